"""A ``clip_grad_norm_`` of the loop's own kept between ``guard.backward()`` and ``guard.step()``
(review 55e). Under fp16 it clipped the gradients still multiplied by the loss scale: a clip to
1.0 at scale 1024 left an SGD update up to 1024 times too small, the record's norms were the
clipped ones and ``max_norm`` never clipped, unsaid (README listed it under "Not caught"). At
the first step a gradient changed between the backward and the guard's unscale is refused now,
before anything is applied; where the gradients are not scaled (bf16, fp32), or were unscaled
first (``guard.unscale_()``, the documented way), the loop's edit is its own.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampguard import Guard, SkipLog, StepLog
from ampguard.faults import FaultInjector, parse_fault

SCALED = "was changed after guard.backward\\(\\), while the loss scale \\(1024\\) still multiplied it"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def _guard(model: nn.Module, precision: str = "fp16", **kwargs) -> Guard:
    return Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision,
                 scaler=dict(init_scale=1024.0) if precision == "fp16" else None, max_norm=None, **kwargs)


def _backward(model: nn.Module, guard: Guard, seed: int = 1) -> None:
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
    with guard.autocast():
        loss = model(x).float().pow(2).mean()
    guard.backward(loss)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("edit", ["clip_grad_norm_", "clip_grad_value_", "replaced"])
def test_an_own_clip_of_the_still_scaled_fp16_gradients_is_refused_before_anything_is_applied(edit):
    model = _model()
    guard = _guard(model)
    _backward(model, guard)
    if edit == "clip_grad_norm_":
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    elif edit == "clip_grad_value_":
        nn.utils.clip_grad_value_(model.parameters(), 0.5)
    else:  # (a new tensor in its place: p.grad = p.grad.clamp(...))
        model[2].bias.grad = model[2].bias.grad.clamp(-0.5, 0.5)
    before = _weights(model)
    with pytest.raises(RuntimeError, match=f"^Guard.step\\(\\): the gradient of parameter '[02].(weight|bias)' {SCALED}"):
        guard.step()
    assert (guard.steps, guard.updates) == (0, 0) and not guard.pending
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert all(p.grad is None for p in model.parameters())  # (the group dropped: its gradients were not the backward's)
    _backward(model, guard)  # the loop without its clip goes on
    assert isinstance(guard.step(), StepLog)


def test_a_clip_after_guard_unscale_is_the_recipe_bit_for_bit_and_a_clip_before_it_is_refused():
    # the documented way: guard.unscale_(), then the loop's own clip; the update is the stock
    # recipe's (scaler.unscale_, clip_grad_norm_, scaler.step) bit for bit
    stock, model = _model(), _model()
    opt = torch.optim.SGD(stock.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = _guard(model)
    for seed in (1, 2, 3):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = stock(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(stock.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        _backward(model, guard, seed)
        guard.unscale_()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        assert isinstance(guard.step(), StepLog)
    assert all(torch.equal(a, b) for a, b in zip(_weights(stock), _weights(model)))

    model = _model()
    guard = _guard(model)
    _backward(model, guard)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (the clip before the unscale: still scaled)
    with pytest.raises(RuntimeError, match=f"^Guard.unscale_\\(\\): the gradient of parameter '0.weight' {SCALED}"):
        guard.unscale_()
    assert guard.steps == 0 and not guard.pending


def test_the_same_edit_is_refused_under_fp16_only_and_is_the_loops_own_where_no_loss_scale_multiplies():
    for precision in ("fp16", "bf16", "fp32"):
        model, stock = _model(), _model()
        guard = _guard(model, precision)
        _backward(model, guard)
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        clipped = [p.grad.clone() for p in model.parameters()]
        if precision == "fp16":
            with pytest.raises(RuntimeError, match=SCALED):
                guard.step()
            continue
        assert isinstance(guard.step(), StepLog)
        with torch.no_grad():
            for p, g in zip(stock.parameters(), clipped):
                p.sub_(0.1 * g)  # (SGD's update of the clipped gradients: the loop's clip applied as it is)
        assert all(torch.equal(a, b) for a, b in zip(_weights(stock), _weights(model))), precision


def test_accumulation_and_a_parameter_without_gradient_are_not_an_edit_but_a_clip_at_the_close_is():
    # each backward of a group adds to the gradients in place (their version counters move): the
    # comparison is with the last backward's; an unused head's parameter never gets one
    model = nn.ModuleDict({"used": _model(), "head": nn.Linear(3, 1)})
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                  scaler=dict(init_scale=1024.0), max_norm=1.0, accumulation_steps=2)

    def backward(seed):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
        with guard.autocast():
            loss = model["used"](x).float().pow(2).mean()
        guard.backward(loss)

    backward(1)
    assert guard.step() is None
    backward(2)
    assert isinstance(guard.step(), StepLog) and model["head"].weight.grad is None

    model = nn.ModuleDict({"used": _model(), "head": nn.Linear(3, 1)})
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                  scaler=dict(init_scale=1024.0), max_norm=1.0, accumulation_steps=2)
    backward(1)
    assert guard.step() is None
    backward(2)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=f"parameter 'used.0.weight' {SCALED}"):
        guard.step()
    backward(3)  # (a clip after each micro-batch: refused at the first one's step())
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=SCALED):
        guard.step()
    assert guard.micro_batches == 0 and guard.steps == 0


def test_the_guards_own_gradient_faults_are_no_edit_and_an_edit_that_leaves_an_inf_waits_for_the_next_step():
    # an inf_grad fault writes its inf inside the backward (a gradient hook): nothing changed after it
    model = _model()
    injector = FaultInjector([parse_fault("inf_grad@1")])
    injector.attach(model)
    guard = _guard(model)
    injector.current_step = 1
    _backward(model, guard)
    assert isinstance(guard.step(), SkipLog)
    injector.current_step = 2
    _backward(model, guard)
    assert isinstance(guard.step(), StepLog)

    # a first step that overflows skips whatever a clip did to it (its inf stays): the clip is
    # refused at the next step, the first that would apply it
    for unscale, where in ((False, "step"), (True, "unscale_")):  # (the clip before a guard.unscale_() too)
        model = _model()
        guard = _guard(model)
        _backward(model, guard)
        model[0].weight.grad[0, 0] = float("inf")
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if unscale:
            guard.unscale_()
        assert isinstance(guard.step(), SkipLog)
        _backward(model, guard)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(RuntimeError, match=f"^Guard.{where}\\(\\): .*" + SCALED.replace("1024", "512")):
            guard.unscale_() if unscale else guard.step()
