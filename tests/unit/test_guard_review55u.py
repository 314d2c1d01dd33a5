"""Review 55r, a notebook's loop cell re-run after a Ctrl-C: the refusal that follows an interrupt
between ``guard.backward()`` and ``guard.step()`` says what the guard is waiting for and how to go
on (F2); an optimizer step that raised part-way through its update is not called "nothing was
applied" (F3)."""

from __future__ import annotations

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


def _loop(model: nn.Module, guard: Guard, batches: int, interrupt_at: int | None = None) -> list:
    """The notebook's loop cell: ``interrupt_at`` raises KeyboardInterrupt after that batch's
    backward, before its step (where a loop's ``print(loss.item())`` waits on a GPU)."""
    records = []
    for i in range(batches):
        with guard.autocast():
            loss = ((model(X) - Y) ** 2).mean()
        guard.backward(loss)
        if i == interrupt_at:
            raise KeyboardInterrupt
        if (record := guard.step()) is not None:
            records.append(record)
    return records


@pytest.mark.parametrize("accumulation, which", [(1, "step 2"), (2, "micro-batch 2 of 2 of step 2")])
def test_a_loop_cell_rerun_after_an_interrupt_between_backward_and_step_is_told_the_way_on(accumulation, which):
    # every re-run of the unchanged cell was refused "call guard.step() after each
    # guard.backward(loss)", which its loop does
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16",
                  accumulation_steps=accumulation)
    with pytest.raises(KeyboardInterrupt):
        _loop(model, guard, 2 * accumulation, interrupt_at=2 * accumulation - 1)
    for _ in range(2):  # (the cell re-run, twice: the same refusal, the guard as it was)
        with pytest.raises(RuntimeError) as refused:
            _loop(model, guard, accumulation)
        message = str(refused.value)
        assert "\n" not in message and not getattr(refused.value, "__notes__", None)
        assert message.startswith(f"Guard.autocast() while the guard.backward() of {which} awaits its "
                                   "guard.step() (a loop interrupted between the two?): call guard.step() once "
                                   "to finish it, then go on")
        assert guard.pending and guard.steps == 1
    record = guard.step()  # the way on the message names: the interrupted step is finished
    assert record is not None and record.step == 2 and not record.skipped
    assert [r.step for r in _loop(model, guard, accumulation)] == [3]
