"""Schedulers handed to a guard in a loop of one's own (review 55l). An optimizer given as
``scheduler=`` was taken: after each applied update the guard "stepped the scheduler", which was
``optimizer.step()`` again on the same gradients, every update applied twice, unsaid. A
``ChainedScheduler`` the loop also stepped went unchecked (torch's has no ``last_epoch``, which the
check reads): the schedule ran twice as fast and stepped on the skips the guard holds it on.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from ampguard import Guard

L = torch.optim.lr_scheduler
OPTIMIZER = r"^scheduler= was given an optimizer \({}\), not an LR scheduler: the guard steps a scheduler after each"


def _linear() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, guard: Guard, scale: float = 1.0):
    with guard.autocast():
        loss = model(torch.ones(4, 3)).float().pow(2).mean() * scale
    guard.backward(loss)
    return guard.step()


class _Wrapper:
    """A plain optimizer wrapper (Lookahead's shape): its own param_groups and step()."""

    def __init__(self, optimizer):
        self.optimizer, self.param_groups = optimizer, optimizer.param_groups

    def step(self):
        self.optimizer.step()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_an_optimizer_given_as_the_scheduler_is_refused_in_every_form(cls):
    model = nn.Linear(3, 1)
    opt = cls(model.parameters(), lr=0.1)
    for given in (opt, [L.StepLR(opt, 2), opt], {"optimizer": opt}):
        with pytest.raises(ValueError, match=OPTIMIZER.format(cls.__name__)):
            Guard(model, opt, precision="bf16", scheduler=given)
    wrapper = _Wrapper(opt)  # (no torch Optimizer, but param_groups: taken as "a scheduler of its own making")
    with pytest.raises(ValueError, match=OPTIMIZER.format("_Wrapper")):
        Guard(model, opt, precision="bf16", scheduler=wrapper)
    assert not opt.state and model.weight.grad is None  # refused before anything ran
    # the refusal is of what is given as scheduler=, not of a wrapper as the optimizer (review 54a)
    sched = L.StepLR(opt, 1, gamma=0.5)
    guard = Guard(model, _Wrapper(opt), precision="fp32", scheduler=sched)
    _step(model, guard)
    assert sched.last_epoch == 1 and guard.updates == 1


def _refusal(make) -> str:
    """The refusal of a loop that steps the scheduler ``make(opt)`` it handed to the guard."""
    model, opt = _linear()
    sched = make(opt)
    guard = Guard(model, opt, precision="bf16", scheduler=sched)
    _step(model, guard)
    sched.step()  # the loop's own, kept beside the guard's
    with pytest.raises(RuntimeError) as caught:
        _step(model, guard)
    assert guard.updates == 1
    return str(caught.value)


CHAINS = {
    "ChainedScheduler": lambda opt: L.ChainedScheduler([L.LinearLR(opt, 0.1, total_iters=4), L.ExponentialLR(opt, 0.9)]),
    "SequentialLR": lambda opt: L.SequentialLR(opt, [L.LinearLR(opt, 0.1, total_iters=2), L.ExponentialLR(opt, 0.9)],
                                               milestones=[2]),
    "ChainedScheduler of a ChainedScheduler": lambda opt: L.ChainedScheduler(
        [L.ChainedScheduler([L.ConstantLR(opt), L.ExponentialLR(opt, 0.9)]), L.StepLR(opt, 2)]),
}


def test_a_chain_stepped_by_the_loop_too_is_refused_with_a_steplr_s_words():
    steplr = _refusal(lambda opt: L.StepLR(opt, 2))
    assert "was stepped outside the guard (last_epoch 2, the guard left it at 1)" in steplr
    for name, make in CHAINS.items():  # (SequentialLR has a last_epoch of its own: it was caught already)
        assert _refusal(make) == steplr.replace("StepLR", name.split(" ")[0]), name


def test_a_chain_held_on_skips_and_restored_by_the_loop_is_watched_from_there():
    # the chain's position is its first scheduler's: held on a skip (not taken for a step of the
    # loop's), and a restore of the loop's own (load_state_dict, back) is the new start, as for any
    # scheduler; the loop's step after that is refused
    model, opt = _linear()
    sched = CHAINS["ChainedScheduler"](opt)
    guard = Guard(model, opt, precision="bf16", scheduler=sched)
    saved = sched.state_dict()
    lrs = []
    for scale in (1.0, math.inf, 1.0):
        lrs.append(_step(model, guard, scale).lr)
    assert [s.last_epoch for s in sched._schedulers] == [2, 2] and guard.updates == 2
    assert lrs[1] == lrs[2]  # held on the skip
    sched.load_state_dict(saved)
    _step(model, guard)
    assert [s.last_epoch for s in sched._schedulers] == [1, 1]
    sched.step()
    with pytest.raises(RuntimeError, match=r"ChainedScheduler .* \(last_epoch 2, the guard left it at 1\)"):
        _step(model, guard)


def test_the_refusal_names_the_chain_s_position_through_its_first_scheduler():
    assert re.search(r"the ChainedScheduler of optimizer 'optimizer' was stepped outside the guard",
                     _refusal(CHAINS["ChainedScheduler"]))
