"""A stock AMP loop ported onto ``Guard`` with one of its own lines kept, or changed under it.

Each case trained differently from the recipe, or recorded other numbers, and said nothing
(review_traps11): a kept ``optimizer.step()`` / ``scaler.step(opt)``, a kept
``scaler.unscale_(opt)``, a ``scheduler.step()`` before ``guard.step()``, a scheduler dict naming
the wrong optimizer, weights cast after ``Guard()``, ``accumulation_steps`` changed inside a
group, a loss that needs no gradient among several. Each is refused now, before it changes the
weights where it can; and what the recipe does (a loaded ``GradScaler``, a float64 model with
``loss / 3``) the guard does bit for bit.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import Guard, SkipLog, StepLog


def _linear(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(dtype)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: nn.Module, guard: Guard, x: torch.Tensor | None = None) -> torch.Tensor:
    with guard.autocast():
        return model(torch.ones(4, 3) if x is None else x).pow(2).mean()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------- the optimizer stepped twice


def test_an_optimizer_step_kept_between_backward_and_step_is_refused_before_it_updates():
    # the NaN batch's gradients were applied by the loop's own step while the guard recorded a skip
    model, opt = _linear()
    guard = Guard(model, opt, precision="bf16")
    guard.backward(_loss(model, guard, torch.full((4, 3), math.nan)))
    before = _weights(model)
    with pytest.raises(RuntimeError, match=r"^SGD.step\(\) called outside the guard after guard.backward\(\): "):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert isinstance(guard.step(), SkipLog)  # the guard's step goes on as it would have
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_a_step_inside_an_accumulation_group_is_refused_and_between_steps_the_optimizer_is_the_callers():
    model, opt = _linear()
    guard = Guard(model, opt, precision="fp32", accumulation_steps=2)
    guard.backward(_loss(model, guard))
    assert guard.step() is None  # the group is open after its first micro-batch, step() taken
    with pytest.raises(RuntimeError, match="called outside the guard"):
        opt.step()
    guard.backward(_loss(model, guard))
    assert isinstance(guard.step(), StepLog)
    opt.step()  # the stock line kept after guard.step(): no gradient left, nothing to refuse
    model(torch.ones(1, 3)).sum().backward()  # a step of the caller's own, between the guard's steps
    opt.step()
    opt.zero_grad()


def test_a_plain_gradscalers_step_kept_beside_the_guard_is_refused():
    # the user's GradScaler handed over as scaler= and its scaler.step(opt); scaler.update() kept:
    # every batch stepped twice, the guard's norms 1/scale of the true ones
    model, opt = _linear()
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = Guard(model, opt, precision="fp16", scaler=plain, max_norm=None)
    guard.backward(_loss(model, guard))
    with pytest.raises(RuntimeError, match="remove your own optimizer.step\\(\\) / scaler.step\\(optimizer\\)"):
        plain.step(opt)


def test_a_plain_gradscalers_unscale_kept_beside_the_guard_is_refused_before_the_step_counts():
    # scaler.unscale_(opt) + clip_grad_norm_ kept: the gradients were divided by the scale twice
    model, opt = _linear()
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = Guard(model, opt, precision="fp16", scaler=plain)
    guard.backward(_loss(model, guard))
    plain.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    before = _weights(model)
    with pytest.raises(RuntimeError, match=r"^the GradScaler given as scaler= was used on the optimizer outside "):
        guard.step()
    assert guard.steps == 0 and guard.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_a_plain_gradscalers_scale_and_update_kept_beside_the_guard_are_refused_at_the_call():
    # guard.backward(scaler.scale(loss)) scaled the loss twice (gradients scale times too large:
    # 4 of 6 fp16 steps skipped, the CSV's loss thousands); a kept scaler.update() after
    # guard.step() ended in PyTorch's bare AssertionError "No inf checks were recorded"
    model, opt = _linear()
    plain = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = Guard(model, opt, precision="fp16", scaler=plain)
    loss = _loss(model, guard)
    with pytest.raises(RuntimeError, match=r"^scaler\.scale\(loss\) on the GradScaler handed to the Guard: "
                                           r"guard\.backward\(loss\) scales the loss itself"):
        plain.scale(loss)
    guard.backward(loss)
    assert isinstance(guard.step(), StepLog)
    with pytest.raises(RuntimeError, match=r"^scaler\.update\(\) on the GradScaler handed to the Guard: "
                                           r"guard\.step\(\) updates the scale itself"):
        plain.update()
    assert plain.get_scale() == guard.scaler.get_scale() == 2.0**10  # nothing changed by either


@pytest.mark.parametrize("first_step", [False, True])
def test_a_plain_gradscaler_loaded_after_guard_is_the_guards_scale(first_step):
    # the usual resume order (build, then load each object's state) loaded the plain scaler after
    # Guard() took it over: before the first step the guard kept its fresh 65536 and, at that
    # step, made the plain scaler share it: the checkpoint's scale and growth count were lost
    saved = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 4, "_growth_tracker": 3}
    model, opt = _linear()
    plain = torch.amp.GradScaler("cpu")
    guard = Guard(model, opt, precision="fp16", scaler=plain)
    if first_step:  # (from then on the two share their tensors: a load filled them already)
        guard.backward(_loss(model, guard))
        guard.step()
    plain.load_state_dict(saved)
    guard.backward(_loss(model, guard))
    record = guard.step()
    # the loaded growth count 3 of interval 4: this clean step grows 8 to 16
    assert record.scaler_scale == 16.0 and plain.get_scale() == 16.0
    assert guard.scaler.state_dict()["_growth_tracker"] == plain.state_dict()["_growth_tracker"] == 0
    with pytest.raises(ValueError):  # a state the guard refuses changes neither (they share the scale tensor)
        plain.load_state_dict({**saved, "scale": math.nan})
    assert plain.get_scale() == guard.scaler.get_scale() == 16.0


# ---------------------------------------------------------------------------- the schedule


def test_a_scheduler_stepped_between_backward_and_step_is_refused_at_that_step():
    # checked at a group's first backward only, a loop step made before guard.step() was folded
    # into what the guard noted: the schedule ran twice as fast, unsaid
    model, opt = _linear()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    guard = Guard(model, opt, precision="fp32", scheduler=sched)
    guard.backward(_loss(model, guard))
    guard.step()
    guard.backward(_loss(model, guard))
    sched.step()
    with pytest.raises(RuntimeError, match=r"stepped outside the guard \(last_epoch 2, the guard left it at 1\)"):
        guard.step()
    assert guard.updates == 1


def test_a_scheduler_dict_is_checked_as_a_list_is():
    # the dict form skipped every check: a GAN's two schedulers swapped held each schedule on the
    # other optimizer's skips; ReduceLROnPlateau or an object with no step() failed after the update
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    opts = {"g": torch.optim.SGD(gen.parameters(), lr=1.0), "d": torch.optim.SGD(disc.parameters(), lr=1.0)}
    sched_g = torch.optim.lr_scheduler.StepLR(opts["g"], 1)
    sched_d = torch.optim.lr_scheduler.StepLR(opts["d"], 1)
    models = [gen, disc]
    with pytest.raises(ValueError, match=r"^scheduler 'g': the StepLR given drives another optimizer than 'g'"):
        Guard(models, opts, precision="fp32", scheduler={"g": sched_d, "d": sched_g})
    with pytest.raises(ValueError, match=r"^ReduceLROnPlateau steps on a metric"):
        Guard(models, opts, precision="fp32", scheduler={"d": torch.optim.lr_scheduler.ReduceLROnPlateau(opts["d"])})
    with pytest.raises(TypeError, match=r"^scheduler must have a step\(\) method, got a object"):
        Guard(models, opts, precision="fp32", scheduler={"d": object()})
    tick = type("Tick", (), {"step": lambda self: None})()  # a schedule of one's own making, no .optimizer
    with pytest.raises(ValueError, match=r"^the same scheduler is given twice"):
        Guard(models, opts, precision="fp32", scheduler={"g": tick, "d": tick})
    guard = Guard(models, opts, precision="fp32", scheduler={"g": sched_g, "d": sched_d})
    assert guard.scheduler == {"g": sched_g, "d": sched_d}


# ---------------------------------------------------------------------------- the model and the settings


def test_weights_cast_after_guard_are_refused_at_the_next_step():
    # model.to(torch.bfloat16) keeps the Parameter objects: 200 steps "applied", every update lost
    # to bf16 rounding, unless some unrelated module happened to be made meanwhile
    model, opt = _linear()
    guard = Guard(model, opt, precision="bf16")
    guard.backward(_loss(model, guard))
    guard.step()
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"parameter 'weight' is bfloat16, but bf16 mixed precision keeps FP32 master"):
        guard.backward(_loss(model, guard))
    assert model.weight.grad is None  # refused before the backward


def test_accumulation_steps_changes_between_groups_not_inside_one():
    model, opt = _linear()
    guard = Guard(model, opt, precision="fp32", accumulation_steps=2)
    for bad in (0, 1.5, "2"):
        with pytest.raises(ValueError, match=r"^accumulation_steps must be a whole number >= 1"):
            guard.accumulation_steps = bad
    guard.backward(_loss(model, guard))
    guard.step()
    with pytest.raises(RuntimeError, match=r"^Guard.accumulation_steps changed inside a group \(1 of 2 micro"):
        guard.accumulation_steps = 4
    guard.accumulation_steps = 2  # the same count: nothing changes
    guard.backward(_loss(model, guard))
    assert isinstance(guard.step(), StepLog)
    guard.accumulation_steps = 1  # between groups (a batch-size ramp)
    guard.backward(_loss(model, guard))
    assert isinstance(guard.step(), StepLog) and guard.updates == 2


def test_a_loss_that_needs_no_gradient_among_several_is_refused_before_any_backward():
    # the losses before it had run backward: their gradients were left, and the next step blamed
    # "a backward outside this guard"
    model, opt = _linear()
    guard = Guard(model, opt, precision="fp32")
    with guard.autocast():
        a = model(torch.ones(4, 3)).mean()
        b = a.detach() * 2
    with pytest.raises(ValueError, match=r"^Guard.backward\(\): loss 2 of 2 does not require grad"):
        guard.backward(a, b)
    assert model.weight.grad is None
    guard.backward(_loss(model, guard))
    assert isinstance(guard.step(), StepLog)


# ---------------------------------------------------------------------------- what the recipe does


def test_a_loaded_plain_gradscaler_keeps_its_growth_tracker():
    # loaded and not yet used, a GradScaler holds its state in _init_*: only the scale was taken,
    # and the resumed run grew its scale one interval late
    saved = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 4, "_growth_tracker": 3}
    plain, canonical = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    plain.load_state_dict(saved)
    canonical.load_state_dict(saved)
    model, opt = _linear()
    guard = Guard(model, opt, precision="fp16", scaler=plain)
    guard.backward(_loss(model, guard))
    record = guard.step()
    twin, twin_opt = _linear()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = twin(torch.ones(4, 3)).pow(2).mean()
    canonical.scale(loss).backward()
    canonical.step(twin_opt)
    canonical.update()
    assert float(record.scaler_scale) == canonical.get_scale() == 2048.0  # the 4th clean step in a row grows it


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_float64_model_with_three_micro_batches_is_the_recipe_bit_for_bit(precision):
    # the loss was cast to float32 before the / 3: float32(1/3) seeded the backward, not 1/3
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    data = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)) for _ in range(6)]
    model, reference = copy.deepcopy(base), copy.deepcopy(base)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    guard = Guard(model, opt, precision=precision, max_norm=None, accumulation_steps=3)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    for i, (x, y) in enumerate(data):
        with guard.autocast():
            loss = F.mse_loss(model(x), y)
        guard.backward(loss)
        guard.step()
        with autocast:
            ref_loss = F.mse_loss(reference(x), y)
        (ref_loss / 3).backward()
        if i % 3 == 2:
            ref_opt.step()
            ref_opt.zero_grad()
    assert guard.updates == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_a_finite_float64_loss_beyond_the_float32_range_is_applied_not_skipped():
    model, opt = _linear(torch.float64)
    guard = Guard(model, opt, precision="fp32", max_norm=None)
    with guard.autocast():
        loss = model(torch.ones(4, 3, dtype=torch.float64)).pow(2).mean() * 1e39
    guard.backward(loss)
    assert isinstance(guard.step(), StepLog) and guard.updates == 1


# ---------------------------------------------------------------------------- what stays allowed (review_session11)


def test_a_new_guard_takes_the_optimizer_over_from_one_abandoned_with_a_step_open():
    # a fit that failed mid-group and was retried while the old trainer lived on (a notebook holds
    # the exception): the framework's own optimizer.step() was refused "after guard.backward()"
    model, opt = _linear()
    old = Guard(model, opt, precision="fp32", accumulation_steps=2)
    old.backward(_loss(model, old))
    assert old.step() is None and old.mid_group  # abandoned here, still alive
    for p in model.parameters():
        p.grad = None  # (what the retry's zero_grad leaves)
    opt.step()  # no gradient to apply: the optimizer is the caller's
    new = Guard(model, opt, precision="fp32")
    new.backward(_loss(model, new))
    assert isinstance(new.step(), StepLog)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # between the new guard's steps, with gradients of the caller's own: not refused


def test_an_optimizer_with_param_groups_alone_is_still_taken():
    # register_step_pre_hook is torch's: a duck-typed optimizer got an AttributeError traceback
    class PlainSGD:
        def __init__(self, params, lr):
            self.param_groups, self.state = [{"params": list(params), "lr": lr}], {}

        @torch.no_grad()
        def step(self):
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.param_groups[0]["lr"])

        def zero_grad(self, set_to_none=True):
            for p in self.param_groups[0]["params"]:
                p.grad = None

    model, _ = _linear()
    guard = Guard(model, PlainSGD(model.parameters(), 0.1), precision="bf16")
    before = _weights(model)
    guard.backward(_loss(model, guard))
    assert isinstance(guard.step(), StepLog) and not torch.equal(before[0], model.weight)


def test_a_restore_of_the_callers_own_rewinds_the_scheduler_without_a_refusal():
    # model, optimizer and scheduler reloaded from the loop's own save, the guard's state kept (as
    # accelerator.load_state() does with the guard not registered): refused as "stepped outside"
    model, opt = _linear()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.9 ** n)
    guard = Guard(model, opt, precision="bf16", scheduler=sched)
    for _ in range(2):
        guard.backward(_loss(model, guard))
        guard.step()
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    for _ in range(2):
        guard.backward(_loss(model, guard))
        guard.step()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    guard.backward(_loss(model, guard))
    assert isinstance(guard.step(), StepLog) and sched.last_epoch == 3
    sched.step()  # and a step of the loop's own after it is still refused
    with pytest.raises(RuntimeError, match=r"stepped outside the guard \(last_epoch 4, the guard left it at 3\)"):
        guard.backward(_loss(model, guard))


def test_a_guard_still_pickles_and_copies():
    # guard.optimizers as a MappingProxyType could not be pickled: torch.save(guard) and
    # copy.deepcopy(guard) failed
    import io
    import pickle

    model, opt = _linear()
    guard = Guard(model, opt, precision="fp32")
    twin = copy.deepcopy(guard)
    assert list(twin.optimizers) == ["optimizer"] and twin.optimizer is not opt
    torch.save(guard, io.BytesIO())
    assert type(pickle.loads(pickle.dumps(guard)).optimizers) is type(guard.optimizers)
