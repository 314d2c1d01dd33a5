"""``Guard`` after something raised inside it (review_guard13): the group is dropped, the next
``backward()`` begins a clean step, and the error says what happened to the step. Before, every
later call blamed the loop for what the failed one left ("after guard.unscale_()", "a gradient
from a backward outside this guard", "your scheduler.step()"), for ever.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ampguard import Guard, StepLog
from ampguard.precision import SlowPrecisionWarning


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)
        yield


def _guard(precision: str, **kw) -> tuple[nn.Module, Guard]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision, **kw)


def _one_layer(sync_free: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A ``Linear(4, 2)`` and its optimizer: fused AdamW with a tensor LR (what ``sync_free``
    takes), else SGD."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    if sync_free:
        return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model: nn.Module, guard: Guard, batches: int = 1) -> list[StepLog]:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    records = []
    for _ in range(batches * guard.accumulation_steps):
        with guard.autocast():
            loss = model(x).float().pow(2).mean()
        guard.backward(loss)
        if (record := guard.step()) is not None:
            records.append(record)
    return records


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("how", ["no loss to reach", "zero_grad"])
def test_a_step_with_no_gradient_is_refused_in_one_line_and_the_guard_goes_on(precision, how):
    # fp16 ended in PyTorch's bare "No inf checks were recorded prior to update" and every later
    # backward said "after guard.unscale_()"; bf16 and fp32 recorded an applied update of nothing
    # (the scheduler stepped on it)
    model, guard = _guard(precision)
    x = torch.randn(8, 4)
    with guard.autocast():
        loss = torch.zeros((), requires_grad=True) if how == "no loss to reach" else model(x).float().sum()
    guard.backward(loss)
    if how == "zero_grad":
        guard.optimizer.zero_grad()
    with pytest.raises(RuntimeError, match=r"^Guard.step\(\): no gradient reached the parameters of 'optimizer' "
                                           r"in this step") as refused:
        guard.step()
    assert refused.value.__notes__ == ["ampguard: Guard.step() raised: the open group was dropped (nothing was "
                                       "applied); the next guard.backward() begins a new step"]
    assert (guard.steps, guard.updates) == (0, 0)
    records = _train(model, guard, batches=2)
    assert [(r.step, type(r).__name__) for r in records] == [(1, "StepLog"), (2, "StepLog")]  # no gap, no blame


class _BackwardFails(torch.autograd.Function):
    """An identity whose backward raises while ``on``: an out-of-memory in a backward."""

    on = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _BackwardFails.on:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return grad


def _out_of_memory_in_backward(model: nn.Module, guard: Guard, x: torch.Tensor) -> str:
    """One micro-batch whose backward raises: the note the guard put on the error."""
    _BackwardFails.on = True
    try:
        with guard.autocast():
            loss = _BackwardFails.apply(model(x)).float().pow(2).mean()
        with pytest.raises(RuntimeError, match="out of memory") as raised:
            guard.backward(loss)
    finally:
        _BackwardFails.on = False
    return raised.value.__notes__[0]


def test_an_error_in_the_backward_drops_the_whole_group_and_the_next_one_starts_clean():
    # an out-of-memory in the second micro-batch's backward, caught by a loop that skips the batch:
    # its half-made gradients and the first micro-batch's were left, and every later backward was
    # refused as "a gradient from a backward outside this guard"; the group's count stayed at 1
    model, guard = _guard("bf16", accumulation_steps=2)
    x = torch.randn(8, 4)
    with guard.autocast():
        guard_loss = model(x).float().pow(2).mean()
    guard.backward(guard_loss)
    assert guard.step() is None and guard.micro_batches == 1
    assert "the open group was dropped (nothing was applied)" in _out_of_memory_in_backward(model, guard, x)
    assert guard.micro_batches == 0 and all(p.grad is None for p in model.parameters())
    records = _train(model, guard)
    assert [(r.step, type(r).__name__) for r in records] == [(1, "StepLog")]


def test_a_scheduler_that_raises_after_the_update_counts_the_update_and_the_next_step_goes_on():
    # OneCycleLR stepped past its total_steps raises in scheduler.step(), after the update: the
    # update stands; it was not counted, no record, and the next step blamed "your scheduler.step()"
    model, guard = _guard("fp32")
    guard = Guard(model, guard.optimizer, precision="fp32",
                  scheduler=torch.optim.lr_scheduler.OneCycleLR(guard.optimizer, max_lr=0.1, total_steps=2))
    assert len(_train(model, guard, batches=2)) == 2
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="Tried to step 3 times") as raised:
        _train(model, guard)
    assert raised.value.__notes__ == ["ampguard: Guard.step() raised: the open group was dropped (step 3's update "
                                      "was applied, its record was not made); the next guard.backward() begins a "
                                      "new step"]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it was applied
    assert (guard.steps, guard.updates, guard.applied) == (3, 3, {"optimizer": 3})
    with pytest.raises(ValueError, match="Tried to step 4 times") as again:  # PyTorch's own, not a blame of ours
        _train(model, guard)
    assert "step 4's update was applied" in again.value.__notes__[0]


def test_a_layer_cast_to_half_mid_run_is_pytorchs_refusal_then_the_step_is_not_counted():
    model, guard = _guard("fp16")
    assert [r.step for r in _train(model, guard)] == [1]
    model[2].half()  # (between the looks at every parameter's dtype: PyTorch's refusal at the unscale)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as raised:
        _train(model, guard)
    assert "nothing was applied" in raised.value.__notes__[0] and guard.steps == 1
    model[2].float()
    assert [r.step for r in _train(model, guard)] == [2]  # (it said "a backward outside this guard", for ever)


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_one_layer_cast_after_guard_is_refused_at_the_first_step_as_guard_refuses_it(precision, dtype):
    # only the first parameter's dtype was read again: under bf16 one layer cast after Guard()
    # trained with bf16 weights, its small updates lost to rounding, unsaid
    model, guard = _guard(precision)
    model[2].to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"^parameter '2.weight' is {str(dtype)[6:]}, but {precision} mixed "
                                         "precision keeps FP32 master weights"):
        _train(model, guard)
    assert guard.steps == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    model[2].float()
    assert [r.step for r in _train(model, guard)] == [1]


@pytest.mark.parametrize("max_norm", ["1.0", True, [1.0], torch.tensor([1.0, 2.0]), torch.tensor(1)])
def test_a_max_norm_that_is_no_number_is_refused_by_guard_itself(max_norm):
    # "1.0" from argv went through Guard() and failed at the first step, inside it
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match=r"^max_norm must be a number or None, got "):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", max_norm=max_norm)


@pytest.mark.parametrize("name", ["model", "precision", "scaler", "device", "optimizer", "scheduler"])
def test_what_the_step_read_in_guard_cannot_be_assigned_later(name):
    # a model assigned later was ignored (every step "applied" with norm 0, the new model's
    # gradients piling up); a precision or scaler failed inside the step with an AttributeError
    model, guard = _guard("bf16")
    with pytest.raises(AttributeError, match=rf"^Guard.{name} is set once, in Guard\(\)"):
        setattr(guard, name, None)
    assert [r.step for r in _train(model, guard)] == [1]  # and the guard is as it was


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_unscale_between_steps_is_refused_and_leaves_the_guard_as_it_was(precision):
    # one line too late, after guard.step(): every later backward was refused as "after
    # guard.unscale_()", for ever; before any backward, PyTorch's bare AssertionError
    model, guard = _guard(precision)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"^Guard.unscale_\(\): nothing to unscale; call it after the group's"):
            guard.unscale_()
        _train(model, guard)
    assert guard.steps == 2


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_guard_still_refuses_a_stray_optimizer_step_and_watches_its_scheduler(how):
    # the copy trained bit for bit but let `backward(); optimizer.step()` through (the registry of
    # guarded optimizers knew the original's only), and had lost its schedulers' positions
    import copy
    import pickle

    model, guard = _guard("bf16")
    guard = Guard(model, guard.optimizer, precision="bf16",
                  scheduler=torch.optim.lr_scheduler.StepLR(guard.optimizer, step_size=100))
    _train(model, guard)
    twin = copy.deepcopy(guard) if how == "deepcopy" else pickle.loads(pickle.dumps(guard))
    twin_model = twin.model
    twin.scheduler.step()  # (the loop's own, beside the guard's: the copy must know where it left it)
    with twin.autocast():
        loss = twin_model(torch.randn(8, 4)).float().pow(2).mean()
    with pytest.raises(RuntimeError, match="was stepped outside the guard"):
        twin.backward(loss)
    twin.scheduler.last_epoch -= 1  # (put back where the guard left it)
    twin.backward(loss)
    with pytest.raises(RuntimeError, match=r"^SGD.step\(\) called outside the guard after guard.backward\(\)"):
        twin.optimizer.step()


def test_a_shallow_copy_leaves_the_stray_step_refusal_with_the_original():
    import copy

    model, guard = _guard("bf16")
    twin = copy.copy(guard)  # (it shares the optimizer)
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    guard.backward(loss)
    with pytest.raises(RuntimeError, match="called outside the guard after guard.backward"):
        guard.optimizer.step()
    del twin


def test_a_shallow_copy_whose_original_was_collected_still_refuses_a_stray_step():
    # the registry kept one guard per optimizer (the original's): once it was collected, the copy
    # that lived on let `backward(); optimizer.step()` apply the unchecked gradients
    import copy
    import gc

    model, guard = _guard("bf16")
    twin = copy.copy(guard)
    del guard
    gc.collect()
    with twin.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    twin.backward(loss)
    with pytest.raises(RuntimeError, match="called outside the guard after guard.backward"):
        twin.optimizer.step()


def test_the_small_misuses_of_the_api_are_one_clear_line(tmp_path):
    # review_guard13 F9: an assert (gone under python -O), "found []", a module named '', a folder
    # taken for an existing file, a dict handed to write(), a skip reason outside the CSV's set
    from ampguard import CsvSink, SkipLog

    with pytest.raises(ValueError, match=r"^the model has no parameters to train \(ReLU\)$"):
        Guard(nn.ReLU(), torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), precision="bf16")
    embedding = nn.Embedding(10, 4, sparse=True)
    with pytest.raises(ValueError, match="^the model makes sparse gradients"):
        Guard(embedding, torch.optim.SGD(embedding.parameters(), lr=0.1), precision="bf16")
    with pytest.raises(Exception, match=r"is a folder: give the file to write"):
        CsvSink(tmp_path)
    with CsvSink(tmp_path / "steps.csv") as log:  # a context manager: closed on the way out
        with pytest.raises(TypeError, match=r"takes a step's record .* got a dict"):
            log.write({"step": 1})
    with pytest.raises(ValueError, match=r"steps.csv is closed: nothing more can be written to it"):
        log.write(SkipLog(1, lr=0.1, loss=1.0, grad_l2_pre_clip=None, grad_l2_post_clip=None, scaler_scale=1.0))
    with pytest.raises(ValueError, match=r"^SkipLog reason must be one of non_finite_loss, non_finite_grad"):
        SkipLog(1, lr=0.1, loss=1.0, grad_l2_pre_clip=None, grad_l2_post_clip=None, scaler_scale=1.0, reason="oops")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_an_optimizer_stepped_inside_the_backward_is_refused_at_the_step(precision):
    # ("optimizer in backward"): under bf16 it trained unchecked while the records showed a norm of
    # 0; under fp16 it ended in GradScaler's bare "No inf checks were recorded"
    model = nn.Linear(4, 2)
    inner = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(p):
        inner[p].step()
        inner[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    guard.backward(loss)
    with pytest.raises(RuntimeError, match=r"or an optimizer stepped inside the backward \(register_post_accumulate"):
        guard.step()


def _out_of_memory_in(optimizer: torch.optim.Optimizer, model: nn.Module, guard: Guard) -> str:
    """One step whose ``optimizer.step()`` raises (an out-of-memory as Adam makes its state): the
    note the guard put on the error."""
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (a stand-in)")

    handle = optimizer.register_step_pre_hook(out_of_memory)
    try:
        with guard.autocast():
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        guard.backward(loss)
        with pytest.raises(RuntimeError, match="out of memory") as raised:
            guard.step()
    finally:
        handle.remove()
    return raised.value.__notes__[0]


def test_with_several_optimizers_the_ones_that_stepped_before_an_error_are_counted_and_named():
    # the second optimizer's step raised (an out-of-memory as Adam makes its state): the first had
    # applied its update, and the guard said "nothing was applied", counted none, reused the step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    guard = Guard(model, {"a": a, "b": b}, precision="bf16")
    assert "step 1's update of 'a' was applied, its record was not made" in _out_of_memory_in(b, model, guard)
    assert (guard.steps, guard.updates, guard.applied) == (1, 0, {"a": 1, "b": 0})
    assert [r.step for r in _train(model, guard)] == [2]
    assert (guard.updates, guard.applied) == (1, {"a": 2, "b": 1})


def test_a_sync_free_step_whose_optimizer_raises_puts_its_device_count_back():
    # the tail had advanced the device count of applied updates: updates 1 after no update, and
    # the LR schedule one step ahead
    model, opt = _one_layer(sync_free=True)
    guard = Guard(model, opt, precision="bf16", sync_free=True, lr_schedule=lambda n: 1.0 / (1.0 + n))
    assert "nothing was applied" in _out_of_memory_in(opt, model, guard)
    assert (guard.steps, guard.updates) == (0, 0)
    record = _train(model, guard)[0]
    assert record.step == 1 and record.values()["lr"] == pytest.approx(1e-3) and guard.updates == 1


def test_a_skip_hook_that_raises_on_a_skipped_step_still_counts_the_skip_and_backs_the_scale_off():
    # first the note said "was applied" (review_session13); then the skip went uncounted and the
    # scale never backed off, so a loop that caught the error and went on overflowed at the same
    # scale every time (review_session14 B4)
    model, guard = _guard("fp16", scaler={"init_scale": 128.0})

    def broken(grads):
        raise ValueError("a diagnostic's bug")

    guard.skip_hooks.append(broken)
    for attempt, scale in ((1, 64.0), (2, 32.0)):
        with guard.autocast():
            loss = model(torch.randn(8, 4)).float().pow(2).mean() * float("nan")
        guard.backward(loss)
        with pytest.raises(ValueError, match="diagnostic's bug") as raised:
            guard.step()
        assert (f"step {attempt} was skipped, nothing was applied, its record was not made"
                in raised.value.__notes__[0])
        assert (guard.steps, guard.updates, guard.scaler.get_scale()) == (attempt, 0, scale)
    guard.skip_hooks.clear()
    assert [r.step for r in _train(model, guard)] == [3]


def test_a_scheduler_that_raises_leaves_the_others_stepped():
    # a's OneCycleLR stepped past its end raised, and b's scheduler, next in line, was never
    # stepped: b's LR lagged its updates by one for the rest of the run (review_session14 B5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(a, max_lr=0.1, total_steps=1)
    halving = torch.optim.lr_scheduler.LambdaLR(b, lambda k: 0.5 ** k)
    guard = Guard(model, {"a": a, "b": b}, precision="bf16", scheduler=[one_cycle, halving])
    assert len(_train(model, guard)) == 1
    with pytest.raises(ValueError, match="Tried to step 2 times"):  # (its constructor took one)
        _train(model, guard)
    assert guard.applied == {"a": 2, "b": 2} and halving.last_epoch == 2


def test_a_numpy_max_norm_is_a_number():
    np = pytest.importorskip("numpy")
    for value in (np.float32(1.0), np.int64(1)):
        model, _ = _guard("bf16")
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", max_norm=value)
        assert [r.step for r in _train(model, guard)] == [1]


@pytest.mark.parametrize("sync_free", [False, True])
def test_a_backward_that_raises_after_a_finished_step_says_nothing_was_applied(sync_free):
    # what the last step had left (the optimizers it stepped) was read as this step's: "step 1's
    # update was applied, its record was not made" for an out-of-memory in step 2's backward
    model, opt = _one_layer(sync_free)
    guard = Guard(model, opt, precision="bf16", sync_free=sync_free)
    x = torch.randn(8, 4)
    with guard.autocast():
        loss = model(x).float().pow(2).mean()
    guard.backward(loss)
    guard.step()
    assert "(nothing was applied)" in _out_of_memory_in_backward(model, guard, x)
    assert (guard.steps, guard.updates) == (1, 1)


def _two_optimizers(precision: str, **kw) -> tuple[nn.Module, Guard, dict]:
    """``a`` on the first layer, ``b`` on the second, each with a scheduler that halves its LR a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    a, b = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    schedulers = {n: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.5 ** k) for n, o in (("a", a), ("b", b))}
    guard = Guard(model, {"a": a, "b": b}, precision=precision, scheduler=list(schedulers.values()),
                  scaler=dict(init_scale=128.0, growth_factor=2.0, growth_interval=1), **kw)
    return model, guard, schedulers


def test_an_update_that_stands_after_another_optimizer_raised_steps_its_scheduler_and_the_scale():
    # a stepped, then b's step raised: a's update stands (counted), but its scheduler was not
    # stepped (its LR lagged its updates by one for the rest of the run) nor the scale updated
    model, guard, schedulers = _two_optimizers("fp16")
    assert "step 1's update of 'a' was applied" in _out_of_memory_in(guard.optimizers["b"], model, guard)
    assert guard.applied == {"a": 1, "b": 0}
    assert (schedulers["a"].last_epoch, schedulers["b"].last_epoch) == (1, 0)
    assert guard.scaler.get_scale() == 256.0  # (a step that ran: the scale grows, growth_interval=1)
    assert [r.step for r in _train(model, guard)] == [2]  # (no "your scheduler.step()" blamed)
    assert guard.applied == {"a": 2, "b": 1}
    assert (schedulers["a"].last_epoch, schedulers["b"].last_epoch) == (2, 1)
    assert guard.optimizers["a"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 2)


@pytest.mark.parametrize("on_skip", ["hold", "step"])
def test_a_skip_hook_that_raises_after_a_partial_skip_keeps_the_backoff_and_the_schedules(on_skip):
    # b's gradients were inf, a's finite: a applied, b skipped; then a skip hook raised, and the
    # scale was never backed off (the next step overflowed again) nor a's scheduler stepped
    model, guard, schedulers = _two_optimizers("fp16", scheduler_on_skip=on_skip)

    def broken(grads):
        raise ValueError("a diagnostic's bug")

    guard.skip_hooks.append(broken)
    handle = model[1].weight.register_hook(lambda g: g * float("inf"))
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    guard.backward(loss)
    with pytest.raises(ValueError, match="diagnostic's bug") as raised:
        guard.step()
    handle.remove()
    assert "step 1's update of 'a' was applied, its record was not made" in raised.value.__notes__[0]
    assert guard.applied == {"a": 1, "b": 0}
    assert guard.scaler.get_scale() == 64.0  # backed off for b's overflow
    assert (schedulers["a"].last_epoch, schedulers["b"].last_epoch) == (1, 1 if on_skip == "step" else 0)
    guard.skip_hooks.clear()
    assert [r.step for r in _train(model, guard)] == [2]


@pytest.mark.parametrize("sync_free", [False, True])
def test_a_step_post_hook_that_raises_after_the_update_counts_it_as_applied(sync_free):
    # the optimizer's update ran, then a post-hook of the user's raised (an EMA copy out of memory):
    # the guard said "nothing was applied", reused the step number and held the schedule (sync-free:
    # put the device count back, while fused Adam's own step count had moved)
    model, opt = _one_layer(sync_free)
    if sync_free:
        guard = Guard(model, opt, precision="bf16", sync_free=True, lr_schedule=lambda n: 1.0 / (1.0 + n))
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
        guard = Guard(model, opt, precision="bf16", scheduler=scheduler)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (a stand-in)")

    handle = opt.register_step_post_hook(out_of_memory)
    before = [p.detach().clone() for p in model.parameters()]
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    guard.backward(loss)
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        guard.step()
    handle.remove()
    assert "nothing was applied" not in raised.value.__notes__[0]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # (applied)
    assert (guard.steps, guard.updates) == (1, 1)
    if not sync_free:
        assert scheduler.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    record = _train(model, guard)[0]
    assert record.step == 2 and guard.updates == 2
    if sync_free:
        assert record.values()["lr"] == pytest.approx(1e-3 / 2)  # (the schedule at one update)


def test_the_guard_does_not_keep_an_optimizer_alive_after_its_step():
    import gc
    import weakref

    model, guard = _guard("bf16")
    _train(model, guard)
    gone = weakref.ref(guard.optimizer)
    del guard
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_forward_outside_guard_autocast_is_said_once_at_the_first_backward(precision):
    # a loop that forgot `with guard.autocast():` trained in float32 under an fp16/bf16 guard, unsaid
    from ampguard.errors import AmpguardWarning

    model, guard = _guard(precision)
    x = torch.randn(8, 4)
    with torch.no_grad():
        model(x)  # (an evaluation before training, outside autocast: not the training forward)
    with pytest.warns(AmpguardWarning, match=rf"^Guard\(precision='{precision}'\): the model's forward ran without "
                                             r"autocast \(outside `with guard.autocast\(\):`\)"):
        guard.backward(model(x).float().pow(2).mean())
    guard.step()
    assert not model._forward_pre_hooks  # (probed at the first step only: nothing left on the hot path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.backward(model(x).float().pow(2).mean())  # said once
        guard.step()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_a_forward_inside_autocast_or_under_fp32_says_nothing(precision):
    model, guard = _guard(precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(torch.randn(8, 4))  # (an evaluation before training: said nothing of either)
        if precision == "fp32":
            guard.backward(model(torch.randn(8, 4)).pow(2).mean())
        else:
            _train(model, guard)
    assert not model._forward_pre_hooks


def test_a_guard_never_used_leaves_no_probe_and_its_model_still_pickles():
    import gc
    import pickle

    model, guard = _guard("bf16")
    assert model._forward_pre_hooks  # (the first forward's probe)
    pickle.loads(pickle.dumps(model))  # (a module-level hook: a model is saved whole before training, too)
    del guard
    gc.collect()
    assert not model._forward_pre_hooks


def test_a_guard_pickled_before_its_attributes_were_renamed_still_steps():
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)  # no optimizer holds layer 2: its weight trains unheld, its bias is frozen
    guard = Guard(model, torch.optim.SGD(model[0].parameters(), lr=0.1), precision="bf16", frozen="ignore")
    _train(model, guard)
    state = guard.__getstate__()
    for new, old in (("_unheld_trainable", "_frozen"), ("_unheld_frozen", "_unowned"), ("_held_count", "_held")):
        state[old] = state.pop(new)  # (as an earlier ampguard pickled it)
    old = Guard.__new__(Guard)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    assert [tuple(p.shape) for p in old._unheld_trainable] == [(2, 8)]  # (each list under its own new name)
    assert [tuple(p.shape) for p in old._unheld_frozen] == [(2,)] and old._held_count == 2
    records = _train(old.model, old, batches=2)
    assert [r.step for r in records] == [2, 3] and old.steps == 3 and not hasattr(old, "_held")
    assert old.model[2].weight.grad is None  # (the unheld weight's gradient dropped each step)


def test_a_model_pickled_with_the_probe_where_it_lived_before_still_loads():
    import pickle

    from ampguard import watch

    # a whole-model pickle made while the probe was on names its hook; before watch.py it was
    # ampguard.step's (protocol 0: "c" module, name)
    assert pickle.loads(b"campguard.step\n_note_autocast\n.") is watch._note_autocast
    with pytest.raises(AttributeError, match="nothing_here"):
        pickle.loads(b"campguard.step\nnothing_here\n.")


def test_a_guard_stepped_inside_another_optimizers_post_hook_leaves_the_outer_count_right():
    # the inner guard's step cleared the one slot that said the outer optimizer's update had run,
    # so a later post-hook raising made the outer update "nothing was applied" (review_session14 B8)
    outer_model, outer = _guard("bf16")
    inner_model, inner = _guard("bf16")

    def train_the_inner(*args):  # (an EMA or a teacher's step hung on the outer optimizer)
        _train(inner_model, inner)

    def out_of_memory(*args):
        raise RuntimeError("out of memory (a stand-in)")

    outer.optimizer.register_step_post_hook(train_the_inner)
    outer.optimizer.register_step_post_hook(out_of_memory)
    with outer.autocast():
        loss = outer_model(torch.randn(8, 4)).float().pow(2).mean()
    outer.backward(loss)
    with pytest.raises(RuntimeError, match="out of memory") as raised:
        outer.step()
    assert "step 1's update was applied" in raised.value.__notes__[0]
    assert (outer.steps, outer.updates, inner.steps) == (1, 1, 1)


def test_a_restored_guard_looks_at_every_parameters_dtype_at_its_first_step():
    # the every-64th look went by the step count: a guard restored at step 1000 trained a layer
    # cast to bf16 until step 1024 (review_session14 B9)
    model, guard = _guard("bf16")
    state = guard.state_dict()
    state["step"], state["updates"] = 1000, 1000
    restored = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    restored.load_state_dict(state)
    model[2].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^parameter '2.weight' is bfloat16"):
        _train(model, restored)
    model[2].float()
    assert [r.step for r in _train(model, restored)] == [1001]


def test_a_forward_under_the_loops_own_autocast_of_another_dtype_is_said():
    # review_anyloop14: a port kept `with torch.autocast("cpu", dtype=torch.float16):` under a bf16
    # guard: fp16 with no loss scaler (small gradients flush to zero), unsaid
    from ampguard.errors import AmpguardWarning

    model, guard = _guard("bf16")
    with pytest.warns(AmpguardWarning, match=r"^Guard\(precision='bf16'\): the model's forward ran under "
                                             r"autocast\(float16\), not the guard's bfloat16, with no loss scaler"):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(8, 4)).float().pow(2).mean()
        guard.backward(loss)
    guard.step()


def test_the_port_slips_name_their_cause():
    # review_anyloop14: loss.backward() then guard.step() said "nothing to step"; the second of two
    # losses was called "loss 1 of 2"
    model, guard = _guard("bf16")
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    loss.backward()
    with pytest.raises(RuntimeError, match=r"the gradients there come from a backward outside the guard "
                                           r"\(a loss.backward\(\) of yours\?\): call guard.backward\(loss\)"):
        guard.step()
    guard.optimizer.zero_grad()
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    with pytest.raises(ValueError, match=r"^Guard.backward\(\): loss 2 of 2 does not require grad"):
        guard.backward(loss, torch.tensor(0.0))


def test_a_skipped_step_whose_scheduler_raises_stays_counted_with_its_backoff():
    # scheduler_on_skip="step" and a OneCycleLR stepped past its end at a skip: the scale had
    # halved and the scheduler moved, yet the step was rewound as "nothing was applied"
    # (review_session14b #5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=1)
    guard = Guard(model, opt, precision="fp16", scheduler=one_cycle, scheduler_on_skip="step",
                  scaler={"init_scale": 128.0})
    assert [r.step for r in _train(model, guard)] == [1]  # (the schedule's one step)
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean() * float("nan")
    guard.backward(loss)
    with pytest.raises(ValueError, match="Tried to step") as raised:
        guard.step()
    assert "step 2 was skipped, nothing was applied, its record was not made" in raised.value.__notes__[0]
    assert (guard.steps, guard.updates, guard.scaler.get_scale()) == (2, 1, 64.0)


def test_a_second_step_call_inside_a_group_says_called_twice():
    # the new "a backward outside the guard" message took the group's own gradients for a stray
    # loss.backward() (review_session14b #1)
    model, guard = _guard("bf16", accumulation_steps=2)
    with guard.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    guard.backward(loss)
    assert guard.step() is None
    with pytest.raises(RuntimeError, match=r"^Guard.step\(\) called twice"):
        guard.step()


# ---------------------------------------------------------------------------- review 33d: refusals a loop goes on from


@pytest.mark.parametrize("wrong", ["backward twice", "a gradient of your own"])
def test_a_refused_backward_drops_the_open_group_so_a_loop_that_catches_it_goes_on(wrong):
    # README "After an error": the next backward() begins a clean step. The refusal left the first
    # backward pending (every later autocast() refused) or the outside gradient there (every later
    # backward() refused): 4 good batches made 1 step
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    for i in range(5):
        with guard.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        if i == 1:
            with pytest.raises(RuntimeError) as refused:
                if wrong == "backward twice":
                    guard.backward(loss)
                else:
                    loss.backward(retain_graph=True)
                guard.backward(loss)
            assert "the open group was dropped" in "\n".join(refused.value.__notes__)
            continue
        guard.backward(loss)
        assert guard.step() is not None
    assert guard.steps == 4 and guard.updates == 4 and all(p.grad is None for p in model.parameters())


def test_what_guard_cannot_take_is_refused_at_the_constructor():
    model = nn.Linear(4, 2, device="meta")  # (fp32 failed at its first autocast(), deep in torch)
    with pytest.raises(ValueError, match=r"^the model is on the meta device \(its parameters are not made yet\)"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"the model comes first, then its optimizer"):  # ("'SGD' is not iterable")
        Guard(optimizer, model)


def test_max_norm_set_between_steps_is_checked_as_guard_checks_it():
    # review 33d: a NaN was read as "clipping off", a string failed 7 frames deep in the step, and a
    # model of sparse gradients (which Guard() refuses to clip) was clipped
    model = nn.Linear(4, 2)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")
    with pytest.raises(ValueError, match="max_norm must be a number or None, got nan"):
        guard.max_norm = float("nan")
    with pytest.raises(TypeError, match="max_norm must be a number or None, got 'x'"):
        guard.max_norm = "x"
    guard.max_norm = 0.5
    assert guard.max_norm == 0.5
    sparse = nn.Embedding(4, 2, sparse=True)
    guard = Guard(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1), precision="fp32", max_norm=None)
    with pytest.raises(ValueError, match="makes sparse gradients, which PyTorch's clip_grad_norm_ cannot clip"):
        guard.max_norm = 1.0
    assert guard.max_norm is None


@pytest.mark.parametrize("change, said", [
    (lambda s: s.pop("scaler"), r"the state has no scaler \(its keys: "),
    (lambda s: s.update(monitors=None), r"monitors None must be a dict of their states"),
    (lambda s: s.update(step=2.7), r"step 2\.7 and updates \d must be whole numbers, updates <= step"),
    (lambda s: s.update(updates=5), r"step 1 and updates 5 must be whole numbers, updates <= step"),
    (lambda s: s.update(scaler={}), r"the state holds no loss-scaler state, which an fp16 guard's state_dict\(\) saves"),
])
def test_a_malformed_state_is_refused_before_anything_is_restored(change, said):
    # review 33d: a bare KeyError, an AttributeError, a step of 2.7 taken as 2, updates past step
    # taken, an fp16 guard given no scaler state kept its fresh scale, unsaid
    model, guard = _guard("fp16")
    with guard.autocast():
        loss = model(torch.randn(3, 4)).pow(2).mean()
    guard.backward(loss)
    guard.step()
    state = guard.state_dict()
    change(state)
    fresh_model, fresh = _guard("fp16")
    with pytest.raises(ValueError, match=said):
        fresh.load_state_dict(state)
    assert fresh.steps == 0 and fresh.updates == 0  # (nothing restored)
