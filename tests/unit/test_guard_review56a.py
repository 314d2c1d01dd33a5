"""Review 56a: a step pre-hook that is a callable object or a ``functools.partial`` and refused
was said to leave the update "maybe partly applied" (F3)."""

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
