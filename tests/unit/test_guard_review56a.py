"""Review 56a: a step pre-hook that is a callable object or a ``functools.partial`` and refused
was said to leave the update "maybe partly applied" (F3); a scheduler of the user's showing its
optimizer's ``param_groups`` was refused as an optimizer (F4); a timm-shaped scheduler, whose
``step(epoch)`` needs its epoch, was taken and broke the first step after its update (F5)."""

from __future__ import annotations

import functools
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


X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(8, 2)


def _refuse(*_):
    raise RuntimeError("refused by a hook")


class _Refuser:  # a hook object (a user's NaN check)
    def __call__(self, optimizer, args, kwargs):
        raise RuntimeError("refused by a hook")


@pytest.mark.parametrize("hook", [functools.partial(_refuse), functools.partial(functools.partial(_refuse, 1)),
                                  _Refuser()], ids=["partial", "nested-partial", "callable-object"])
def test_a_pre_hook_of_any_callable_shape_that_refused_is_said_to_have_applied_nothing(hook):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="bf16")
    before = model.weight.detach().clone()
    handle = opt.register_step_pre_hook(hook)
    try:
        with guard.autocast():
            loss = ((model(X) - Y) ** 2).mean()
        guard.backward(loss)
        with pytest.raises(RuntimeError, match="refused by a hook") as raised:
            guard.step()
    finally:
        handle.remove()
    note = raised.value.__notes__[0]
    assert "(nothing was applied)" in note and "partly applied" not in note
    assert torch.equal(before, model.weight) and guard.updates == 0


class _ParamGroupsView:
    """A scheduler of the user's (no ``LRScheduler``) with a convenience ``param_groups``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def step(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5


def _steps(model: nn.Module, guard: Guard, n: int) -> None:
    for _ in range(n):
        with guard.autocast():
            loss = ((model(X) - Y) ** 2).mean()
        guard.backward(loss)
        guard.step()


def test_a_scheduler_showing_param_groups_is_taken_and_an_optimizer_wrapper_still_refused():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="bf16", scheduler=_ParamGroupsView(opt))
    _steps(model, guard, 2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)

    class Lookahead:  # (an optimizer wrapper: param_groups and zero_grad, no torch.optim.Optimizer)
        def __init__(self, inner):
            self.optimizer, self.param_groups = inner, inner.param_groups

        def step(self, closure=None):
            return self.optimizer.step(closure)

        def zero_grad(self, set_to_none=True):
            self.optimizer.zero_grad(set_to_none)

    with pytest.raises(ValueError, match=r"^scheduler= was given an optimizer \(Lookahead\)"):
        Guard(model, opt, precision="bf16", scheduler=Lookahead(opt))


class _TimmLike:
    """timm's ``Scheduler`` shape: ``step(epoch, metric=None)``, ``step_update(num_updates)``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, epoch, metric=None) -> None:
        pass

    def step_update(self, num_updates, metric=None) -> None:
        pass


def test_a_scheduler_whose_step_needs_an_argument_is_refused_at_guard_in_one_line():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for given in (_TimmLike(opt), [_TimmLike(opt)], {"optimizer": _TimmLike(opt)}):
        with pytest.raises(ValueError) as refused:
            Guard(model, opt, precision="bf16", scheduler=given)
        assert str(refused.value) == (
            "scheduler _TimmLike: its step() needs an argument ('epoch') and the guard calls step() with none "
            "after each applied update; pass a scheduler stepped per update with no argument (a torch "
            "LambdaLR, say), or no scheduler= and step yours after guard.step() (timm: "
            "scheduler.step_update(guard.updates))")

    class Optional:  # (an argument it does not need: taken)
        def __init__(self, optimizer):
            self.optimizer, self.calls = optimizer, 0

        def step(self, epoch=None, *args, **kwargs):
            self.calls += 1

    taken = Optional(opt)
    guard = Guard(model, opt, precision="bf16", scheduler=taken)
    _steps(model, guard, 2)
    assert taken.calls == 2
