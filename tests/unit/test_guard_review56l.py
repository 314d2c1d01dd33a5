"""Review 56l F4: a scheduler whose ``step(*args, **kwargs)`` hands on to a timm-shaped one (a
wrapper of the user's, Accelerate's ``AcceleratedScheduler`` built by hand) passed the check for a
``step()`` that needs an argument, and the first ``guard.step()`` raised ``TypeError`` after the
update was applied."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
from torch import nn

from ampguard import Guard
from ampguard.precision import SlowPrecisionWarning


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)
        yield


class _TimmLike:
    """timm's ``Scheduler`` shape: ``step(epoch, metric=None)``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, epoch, metric=None) -> None:
        pass


class _Forwarding:
    """A user's thin wrapper: ``step(*args, **kwargs)`` hands on to ``.scheduler``."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.calls = scheduler, 0

    def step(self, *args, **kwargs):
        self.calls += 1
        return self.scheduler.step(*args, **kwargs)


class _Proxy:
    """A proxy in wrapt's manner: the object it wraps is its ``__wrapped__``."""

    def __init__(self, wrapped) -> None:
        self.__wrapped__ = wrapped

    def step(self, *args, **kwargs):
        return self.__wrapped__.step(*args, **kwargs)


def _wrapped_ways(optimizer):
    yield "_Forwarding", _Forwarding(_TimmLike(optimizer))
    yield "_Proxy", _Proxy(_TimmLike(optimizer))
    yield "_Forwarding", _Forwarding(_Proxy(_TimmLike(optimizer)))  # (wrappers of wrappers)
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate.scheduler import AcceleratedScheduler

        yield "AcceleratedScheduler", AcceleratedScheduler(_TimmLike(optimizer), optimizer, step_with_optimizer=False)


def test_a_wrapper_handing_step_on_to_a_scheduler_that_needs_an_argument_is_refused_at_guard():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for outer, scheduler in _wrapped_ways(opt):
        with pytest.raises(ValueError) as refused:
            Guard(model, opt, precision="bf16", scheduler=scheduler)
        assert str(refused.value) == (
            f"scheduler {outer}: its step() hands its arguments to the _TimmLike it wraps, whose step() needs an "
            "argument ('epoch') and the guard calls step() with none after each applied update; pass a scheduler "
            "stepped per update with no argument (a torch LambdaLR, say), or no scheduler= and step yours after "
            "guard.step() (timm: scheduler.step_update(guard.updates))")

    taken = _Forwarding(torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5 ** n))  # (one stepped bare: taken)
    guard = Guard(model, opt, precision="bf16", scheduler=taken)
    with guard.autocast():
        loss = model(torch.ones(2, 4)).float().pow(2).mean()
    guard.backward(loss)
    guard.step()
    assert taken.calls == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
