"""A ``clip_grad_norm_`` of the loop's own kept between ``guard.backward()`` and ``guard.step()``
(review 55e). Under fp16 it clipped the gradients still multiplied by the loss scale: a clip to
1.0 at scale 1024 left an SGD update up to 1024 times too small, the record's norms were the
clipped ones and ``max_norm`` never clipped, unsaid (README listed it under "Not caught"). At
each optimizer's first step a gradient changed between the backward and the guard's unscale is
warned of (``ScaledEditWarning``, once a guard); where the gradients are not scaled (bf16, fp32),
or were unscaled first (``guard.unscale_()``, the documented way), the loop's edit is its own.

Review 55n: it was a refusal, which aborted sound runs (a mask of rows commutes with the scale:
bit for bit the stock loop's; a Lightning ``on_after_backward`` mask stopped the fit at step 1),
and the mistake it targets cannot be told from them: a warning now, the step going on as the loop
wrote it. Only the first optimizer stepped was checked (a GAN generator's clip passed): each
optimizer's first group is.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ampguard import Guard, ScaledEditWarning, SkipLog, StepLog
from ampguard.faults import FaultInjector, parse_fault

SCALED = ("was changed after guard.backward() (under Lightning: in on_after_backward), while the loss scale (1024) "
          "still multiplied it")


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


def _said(run):
    """What ``run()`` returns and the ScaledEditWarnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in seen if issubclass(w.category, ScaledEditWarning)]


def _stock(edit, seeds=(1,), lr=0.1):
    """The stock fp16 loop with ``edit`` between backward and ``scaler.step`` (no unscale_ before
    it: the edit acts on the scaled gradients): its weights."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for seed in seeds:
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        edit(model)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return _weights(model)


def _clip_norm(model):
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _clip_value(model):
    nn.utils.clip_grad_value_(model.parameters(), 0.5)


def _replaced(model):  # (a new tensor in its place: p.grad = p.grad.clamp(...))
    model[2].bias.grad = model[2].bias.grad.clamp(-0.5, 0.5)


def _mask(model):  # (rows frozen: a mask commutes with the loss scale)
    model[0].weight.grad[:2] = 0
    model[0].bias.grad[:2] = 0


def _measure(model):  # (a norm measured: multiplies by 1.0 in place, the update unchanged)
    nn.utils.clip_grad_norm_(model.parameters(), float("inf"))


@pytest.mark.parametrize("edit", [_clip_norm, _clip_value, _replaced, _mask, _measure],
                         ids=["clip_grad_norm_", "clip_grad_value_", "replaced", "mask", "measure"])
def test_an_edit_of_the_still_scaled_fp16_gradients_is_warned_of_once_and_applied_as_the_loop_wrote_it(edit):
    model = _model()
    guard = _guard(model)
    _backward(model, guard)
    edit(model)
    record, said = _said(guard.step)
    assert isinstance(record, StepLog) and (guard.steps, guard.updates) == (1, 1)
    assert len(said) == 1 and said[0].startswith("Guard.step(): the gradient of parameter ")
    assert "still multiplied it. A mask or another multiplication there is fine; a clip_grad_norm_ or " \
           "clip_grad_value_ acts on gradients 1024 times too large" in said[0]
    assert "torch.nn.utils.get_total_norm after the unscale" in said[0] and "on_before_optimizer_step" in said[0]
    # the update is the stock loop's with the same edit, bit for bit (a mask's is the mask's)
    assert all(torch.equal(a, b) for a, b in zip(_stock(edit), _weights(model)))
    for seed in (2, 3):  # said once a guard; the next steps are not checked
        _backward(model, guard, seed)
        edit(model)
        record, said = _said(guard.step)
        assert isinstance(record, StepLog) and said == []
    assert all(torch.equal(a, b) for a, b in zip(_stock(edit, (1, 2, 3)), _weights(model)))


def test_the_warning_names_the_parameter_and_the_scale_and_a_mask_leaves_the_frozen_rows_as_they_were():
    model = _model()
    guard = _guard(model)
    rows = model[0].weight[:2].detach().clone()
    _backward(model, guard)
    _mask(model)
    _, said = _said(guard.step)
    assert len(said) == 1 and said[0].startswith(f"Guard.step(): the gradient of parameter '0.weight' {SCALED}")
    assert torch.equal(model[0].weight[:2], rows)


def test_a_clip_after_guard_unscale_is_the_recipe_bit_for_bit_and_a_clip_before_it_is_warned_of():
    # the documented way: guard.unscale_(), then the loop's own clip; the update is the stock
    # recipe's (scaler.unscale_, clip_grad_norm_, scaler.step) bit for bit, and nothing is said
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
        record, said = _said(guard.step)
        assert isinstance(record, StepLog) and said == []
    assert all(torch.equal(a, b) for a, b in zip(_weights(stock), _weights(model)))

    model = _model()
    guard = _guard(model)
    _backward(model, guard)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # (the clip before the unscale: still scaled)
    _, said = _said(guard.unscale_)
    assert len(said) == 1 and said[0].startswith("Guard.unscale_(): the gradient of parameter '0.weight' was changed")
    assert isinstance(guard.step(), StepLog)


def test_the_same_edit_is_warned_of_under_fp16_only_and_is_the_loops_own_where_no_loss_scale_multiplies():
    for precision in ("fp16", "bf16", "fp32"):
        model, stock = _model(), _model()
        guard = _guard(model, precision)
        _backward(model, guard)
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        clipped = [p.grad.clone() for p in model.parameters()]
        record, said = _said(guard.step)
        assert isinstance(record, StepLog)
        assert len(said) == (precision == "fp16"), (precision, said)
        if precision == "fp16":
            continue
        with torch.no_grad():
            for p, g in zip(stock.parameters(), clipped):
                p.sub_(0.1 * g)  # (SGD's update of the clipped gradients: the loop's clip applied as it is)
        assert all(torch.equal(a, b) for a, b in zip(_weights(stock), _weights(model))), precision


def test_accumulation_and_a_parameter_without_gradient_are_not_an_edit_but_a_clip_at_the_close_is():
    # each backward of a group adds to the gradients in place (their version counters move): the
    # comparison is with the last backward's; an unused head's parameter never gets one
    def make():
        model = nn.ModuleDict({"used": _model(), "head": nn.Linear(3, 1)})
        return model, Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                            scaler=dict(init_scale=1024.0), max_norm=1.0, accumulation_steps=2)

    def backward(model, guard, seed):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
        with guard.autocast():
            loss = model["used"](x).float().pow(2).mean()
        guard.backward(loss)

    model, guard = make()
    backward(model, guard, 1)
    assert _said(guard.step) == (None, [])
    backward(model, guard, 2)
    record, said = _said(guard.step)
    assert isinstance(record, StepLog) and said == [] and model["head"].weight.grad is None

    model, guard = make()
    backward(model, guard, 1)
    assert guard.step() is None
    backward(model, guard, 2)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    record, said = _said(guard.step)
    assert isinstance(record, StepLog) and len(said) == 1 and "parameter 'used.0.weight' was changed" in said[0]

    model, guard = make()
    backward(model, guard, 3)  # (a clip after each micro-batch: said at the first one's step())
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert _said(guard.step)[1] != []
    assert guard.micro_batches == 1 and guard.steps == 0


def test_the_guards_own_gradient_faults_are_no_edit_and_an_edit_of_an_overflowed_step_is_said_at_once():
    # an inf_grad fault writes its inf inside the backward (a gradient hook): nothing changed after it
    model = _model()
    injector = FaultInjector([parse_fault("inf_grad@1")])
    injector.attach(model)
    guard = _guard(model)
    injector.current_step = 1
    _backward(model, guard)
    record, said = _said(guard.step)
    assert isinstance(record, SkipLog) and said == []
    injector.current_step = 2
    _backward(model, guard)
    record, said = _said(guard.step)
    assert isinstance(record, StepLog) and said == []

    # a clip of an overflowed first step: the step skips, and the clip is said all the same (it
    # will clip every step after it); no host read of the gradients for it (the check reads none)
    for unscale, where in ((False, "step"), (True, "unscale_")):  # (the clip before a guard.unscale_() too)
        model = _model()
        guard = _guard(model)
        _backward(model, guard)
        model[0].weight.grad[0, 0] = float("inf")
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        _, said = _said(lambda: guard.unscale_() if unscale else None)
        record, said_at_step = _said(guard.step)
        assert isinstance(record, SkipLog)
        assert len(said + said_at_step) == 1 and (said + said_at_step)[0].startswith(f"Guard.{where}(): ")


def test_each_optimizers_first_step_is_checked_a_gans_generator_too():
    # review 55n F4: a GAN steps its optimizers by name; only the first one stepped was checked
    # (the first group to close ended the check), so the generator's own clip passed unsaid
    torch.manual_seed(0)
    gen, disc = nn.Linear(3, 3), nn.Linear(3, 1)
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    guard = Guard(model, {"generator": torch.optim.SGD(gen.parameters(), lr=0.1),
                          "discriminator": torch.optim.SGD(disc.parameters(), lr=0.1)},
                  precision="fp16", scaler=dict(init_scale=1024.0), max_norm=None)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        with guard.autocast():
            d_loss = disc(gen(x).detach()).float().pow(2).mean()
        guard.backward(d_loss)
        record, said = _said(lambda: guard.step("discriminator"))
        assert isinstance(record, StepLog) and said == []
        with guard.autocast():
            g_loss = (1 - disc(gen(x))).float().pow(2).mean()
        guard.backward(g_loss)
        nn.utils.clip_grad_norm_(gen.parameters(), 1e-3)
        record, said = _said(lambda: guard.step("generator"))
        assert isinstance(record, StepLog)
        if step == 1:
            assert len(said) == 1 and said[0].startswith("Guard.step(): the gradient of parameter 'gen.weight'"), said
        else:  # (said once a guard)
            assert said == []
