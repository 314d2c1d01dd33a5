"""What fuzzing the guarded step against the stock recipe found (review 61b).

A seeded random-program fuzzer (precisions, accumulation with short groups, one or two
optimizers, schedulers, clipping, sync_free, Guard and AmpTrainState, faults at random
micro-batches, a resume mid-run) ran the guard beside the stock torch loop written from the
documented rules; these are the minimized programs of the discrepancies it found.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import HostReads
from torch import nn

from ampguard import Guard

INPUTS = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
TARGETS = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


def _fused_sgd(model: nn.Module, **kwargs) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True, **kwargs)


@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_a_sync_free_skip_of_a_fused_sgds_first_step_leaves_its_momentum_clean(fault):
    """Torch's fused SGD makes its momentum buffers with ``empty_like`` at its first step and
    fills them in the kernel, which returns first when ``found_inf`` is 1: a sync-free step that
    skipped the first update left uninitialised memory as the momentum, and the next applied
    update moved the weights by it (1e11 here). The stock loop steps nothing on a skip, so the
    next update is the optimizer's first, from the same weights."""
    torch.manual_seed(0)
    model, reference = nn.Linear(64, 64), nn.Linear(64, 64)
    reference.load_state_dict(model.state_dict())
    guard = Guard(model, _fused_sgd(model), precision="fp32", max_norm=None, sync_free=True)
    handle = model.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("inf")))
    with guard.autocast():
        loss = F.mse_loss(model(INPUTS), TARGETS)
    if fault == "nan_loss":
        handle.remove()
        loss = loss + float("nan")
    guard.backward(loss)
    for _ in range(4):  # (memory of the gradients' size freed as NaN: what empty_like may hand the buffers)
        torch.full_like(model.weight, float("nan"))
    assert guard.step().reason == ("non_finite_loss" if fault == "nan_loss" else "non_finite_grad")
    handle.remove()
    assert torch.equal(model.weight, reference.weight)  # (a skip: nothing moved)
    expected = _fused_sgd(reference)
    for _ in range(2):  # the first update and one after it, from clean momentum
        with HostReads() as reads:
            with guard.autocast():
                loss = F.mse_loss(model(INPUTS), TARGETS)
            guard.backward(loss)
            record = guard.step()
        assert reads.count == 0  # (the path stays free of host reads)
        assert not record.skipped
        F.mse_loss(reference(INPUTS), TARGETS).backward()
        expected.step()
        expected.zero_grad(set_to_none=True)
        assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


def test_sync_free_refuses_a_fused_sgd_with_dampened_momentum():
    """The momentum buffers start at zero (above), which is torch's first step only without
    dampening (its first step takes the gradient whole): refused, not a different first step."""
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="dampening"):
        Guard(model, _fused_sgd(model, dampening=0.1), precision="fp32", sync_free=True)


def test_sync_free_refuses_scheduler_on_skip_step():
    """The sync-free step's schedule counts applied updates on the device, so it held on every
    skipped step whatever ``scheduler_on_skip`` said: ``"step"`` was silently ignored (the
    config's ``fast: true`` refuses it; the library took it)."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True)
    with pytest.raises(ValueError, match="scheduler_on_skip='step' needs the exact step"):
        Guard(model, opt, precision="fp32", sync_free=True, scheduler_on_skip="step",
              lr_schedule=lambda updates: 1.0 / (1.0 + updates))
