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


class _TornSGD(torch.optim.SGD):
    """SGD whose step, while ``tear`` is set, moves its first parameter, then raises (an
    out-of-memory, or a Ctrl-C, between two parameters of a per-tensor loop)."""

    tear: type[BaseException] | None = None

    def step(self, closure=None):
        if self.tear is None:
            return super().step(closure)
        first = self.param_groups[0]["params"][0]
        with torch.no_grad():
            first.sub_(first.grad, alpha=self.param_groups[0]["lr"])
        raise self.tear("CUDA out of memory (a stand-in)")


def _step_once(model: nn.Module, guard: Guard) -> BaseException:
    with guard.autocast():
        loss = ((model(X) - Y) ** 2).mean()
    guard.backward(loss)
    with pytest.raises(BaseException) as raised:
        guard.step()
    return raised.value


@pytest.mark.parametrize("tear", [RuntimeError, KeyboardInterrupt])
def test_an_optimizer_step_that_raised_part_way_is_said_maybe_partly_applied_not_nothing_applied(tear):
    # a Ctrl-C inside Adam's per-tensor loop left 3 of 10 parameters and their state moved, and
    # the note said "nothing was applied"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = _TornSGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="bf16")
    before = [p.detach().clone() for p in model.parameters()]

    def refuse(*_):  # a step pre-hook runs before the update: "nothing was applied" stays certain there
        raise tear("CUDA out of memory (a stand-in)")

    handle = opt.register_step_pre_hook(refuse)
    try:
        note = _step_once(model, guard).__notes__[0]
    finally:
        handle.remove()
    assert "(nothing was applied)" in note and "part-way" not in note
    opt.tear = tear
    err = _step_once(model, guard)
    assert isinstance(err, tear)
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert moved == [True, False]  # (what the note must not deny)
    assert err.__notes__ == [
        "ampguard: Guard.step() raised: the open group was dropped (the optimizer's step() raised part-way: its "
        "update may be partly applied, to some parameters and their optimizer state, and is not counted; the "
        "weights may be inconsistent: restore them from a checkpoint); the next guard.backward() begins a new step"]
    assert (guard.steps, guard.updates) == (0, 0)
    opt.tear = None
    assert [r.step for r in _loop(model, guard, 1)] == [1]  # (the guard goes on)


def test_with_several_optimizers_the_one_torn_is_named_beside_the_update_that_stood():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), _TornSGD(model[1].parameters(), lr=0.1)
    guard = Guard(model, {"a": a, "b": b}, precision="bf16")
    b.tear = RuntimeError
    note = _step_once(model, guard).__notes__[0]
    assert ("(step 1's update of 'a' was applied, its record was not made; optimizer 'b''s step() raised "
            "part-way: its update may be partly applied") in note


class _TornAdamW(torch.optim.AdamW):
    """Fused AdamW (what ``sync_free`` takes) whose step, while ``tear`` is set, moves its first
    parameter, then raises."""

    tear = False

    def step(self, closure=None):
        if not self.tear:
            return super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1.0)
        raise RuntimeError("CUDA out of memory (a stand-in)")


def test_a_sync_free_step_torn_inside_its_optimizer_says_so_and_puts_its_count_back():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = _TornAdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)
    guard = Guard(model, opt, precision="bf16", sync_free=True)
    opt.tear = True
    note = _step_once(model, guard).__notes__[0]
    assert "(the optimizer's step() raised part-way: its update may be partly applied" in note
    assert (guard.steps, guard.updates) == (0, 0)
    opt.tear = False
    assert [r.step for r in _loop(model, guard, 1)] == [1] and guard.updates == 1
