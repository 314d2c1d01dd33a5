"""Review 55r: a record's repr (a notebook cell that shows ``record`` or a list of them) read every
tensor field on its own, a host sync each on a GPU, though the exact step's one read had brought
the values over; a sync-free ``PendingStep`` showed ``grad_l2_post_clip=None`` for an applied,
clipped step (its slot holds the clip factor) and not whether the step was skipped."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch._tensor_str
from ampguard import Guard, PendingStep, StepLog


@pytest.fixture
def reads(monkeypatch):
    """How many times a tensor's value was read to the host (each a device sync on a GPU): its
    ``item``, ``tolist``, ``float`` or its printed form."""
    count = [0]

    def counting(owner, name):
        real = getattr(owner, name)

        def read(*args, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, read)

    for name in ("item", "tolist", "__float__"):
        counting(torch.Tensor, name)
    counting(torch._tensor_str, "_str")
    return count


def _records(sync_free: bool, batches: int = 3, bad_at: int | None = None) -> list:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    lr = torch.tensor(0.01) if sync_free else 0.01
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=sync_free or None)
    guard = Guard(model, opt, precision="bf16", max_norm=0.5, sync_free=sync_free)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    records = []
    for i in range(batches):
        with guard.autocast():
            loss = ((model(x) - y) ** 2).mean() * (float("nan") if i == bad_at else 1.0)
        guard.backward(loss)
        records.append(guard.step())
    return records


def test_an_exact_steps_records_repr_reads_nothing_the_step_did_not_read_already(reads):
    records = _records(sync_free=False)
    assert all(type(r) is StepLog for r in records)
    reads[0] = 0
    text = repr(records)
    assert reads[0] == 0  # (a field-by-field repr read 3 tensors a record: 9 here)
    values = records[0].values()
    assert repr(records[0]) == ("StepLog(step=1, " + ", ".join(f"{k}={v!r}" for k, v in values.items()) + ")")
    assert text.count("StepLog(step=") == 3 and "tensor(" not in text


def test_a_pending_steps_repr_reads_nothing_then_shows_what_it_was(reads):
    first, skipped = _records(sync_free=True, batches=2, bad_at=1)
    assert type(first) is PendingStep
    reads[0] = 0
    assert repr(first) == "PendingStep(step=1, not read yet: .values() or .resolve() reads it, one host sync)"
    assert reads[0] == 0  # (the sync-free step's promise: 5 tensor reads a record, before)
    values = first.values()
    assert values["grad_l2_post_clip"] == pytest.approx(0.5, rel=1e-5)  # clipped: the slot held the factor
    assert repr(first) == ("PendingStep(step=1, " + ", ".join(f"{k}={v!r}" for k, v in values.items())
                           + ", skipped=False)")  # (it showed grad_l2_post_clip=None, and no word of the skip)
    skipped.values()
    assert repr(skipped).endswith("grad_l2_post_clip=None, scaler_scale=1.0, skipped=True, reason='non_finite_loss')")
