"""``Guard``: the guarded step as verbs around the user's own forward and loss.

Bit for bit the hand-written canonical AMP loop for a model that computes its own loss (an
output object with ``.loss``) and for a summed multi-loss; calls out of order raise; the
parameter set is the optimizer's; sparse gradients; what is refused up front, one line each.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampguard import AmpTrainState, Guard, GuardedGradScaler, Precision, SkipLog, StepLog
from ampguard.precision import SlowPrecisionWarning
from ampguard.step import UNFROZEN_EVERY, ShortGroupWarning

INF = float("inf")


class WithLoss(nn.Module):
    """A model that returns an output object carrying its own loss, as Hugging Face models do."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> SimpleNamespace:
        logits = self.net(x)
        return SimpleNamespace(logits=logits, loss=F.mse_loss(logits, y))


def output_loss(model: WithLoss, x, y):
    return model(x, y).loss


def multi_loss(model: WithLoss, x, y):
    logits = model.net(x)
    return F.mse_loss(logits[:, :1], y[:, :1]) + 0.5 * F.l1_loss(logits[:, 1:], y[:, 1:])


def batches(n: int, *, spike_at: int | None = None, inf_at: int | None = None):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
        if i == spike_at:
            y = y * 1e8
        if i == inf_at:
            x = x.clone()
            x[0, 0] = INF
        out.append((x, y))
    return out


def reference(precision: str, accum: int, data, loss_of, max_norm: float = 0.5):
    """The hand-written canonical AMP loop with clip_grad_norm_; returns params and (scale, skipped) per step."""
    model = WithLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    prec = Precision(precision, "cpu")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=precision == "fp16")
    steps = []
    for i, (x, y) in enumerate(data):
        with prec.autocast():
            loss = loss_of(model, x, y).float()
        scaler.scale(loss / accum).backward()
        if (i + 1) % accum:
            continue
        scaler.unscale_(opt)
        pre = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < before if scaler.is_enabled() else not math.isfinite(float(pre))
        if not skipped:
            sched.step()
        opt.zero_grad(set_to_none=True)
        steps.append((scaler.get_scale(), skipped))
    return [p.detach().clone() for p in model.parameters()], steps


def guarded(precision: str, accum: int, data, loss_of, max_norm: float = 0.5, divided: bool = False,
            backward=None):
    model = WithLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    guard = Guard(model, opt, precision=precision, max_norm=max_norm, accumulation_steps=accum, scheduler=sched,
                  scaler={"init_scale": 2.0**16})
    records = []
    for x, y in data:
        with guard.autocast():
            loss = loss_of(model, x, y)
        if divided:  # as Lightning's and HF's loops hand it over
            guard.backward(loss.float() / accum, divided=True)
        else:
            guard.backward(loss, backward=backward)
        if (record := guard.step()) is not None:
            records.append(record)
    return [p.detach().clone() for p in model.parameters()], records


@pytest.mark.parametrize("loss_of", [output_loss, multi_loss], ids=["output-object", "multi-loss"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_guard_is_bit_for_bit_the_canonical_loop_clean_and_with_a_spike(precision, accum, loss_of):
    data = batches(6 * accum, spike_at=2 * accum)
    ref_params, ref_steps = reference(precision, accum, data, loss_of)
    params, records = guarded(precision, accum, data, loss_of)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    assert [r.skipped for r in records] == [skipped for _, skipped in ref_steps]
    assert [float(r.values()["scaler_scale"]) for r in records] == [scale if precision == "fp16" else 1.0
                                                                     for scale, _ in ref_steps]
    if precision == "fp16":  # a spike of 1e8 overflows fp16: the step with it is skipped, in both loops
        assert any(skipped for _, skipped in ref_steps)


@pytest.mark.parametrize("max_norm", [torch.tensor([0.05]), torch.tensor(0.05, dtype=torch.float64)],
                         ids=["shape-1", "float64"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_tensor_threshold_clips_every_step_as_the_canonical_loop_does(precision, max_norm):
    # review 50d: Guard(max_norm=tensor([x])) was accepted, then its first step failed; a float64
    # threshold made a factor clip_grad_norm_ (which reads float(max_norm)) does not
    data = batches(6)
    ref_params, ref_steps = reference(precision, 1, data, output_loss, max_norm=max_norm)
    params, records = guarded(precision, 1, data, output_loss, max_norm=max_norm)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert all(r.values()["grad_l2_post_clip"] <= 0.05 + 1e-6 < r.values()["grad_l2_pre_clip"] for r in records)


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_loss_already_divided_by_the_accumulation_steps_is_not_divided_again(precision, accum):
    # backward(loss / N, divided=True) seeds what the canonical loop's scaler.scale(loss / N) does,
    # bit for bit; the record's loss is still the mean of the undivided micro-batch losses
    data = batches(4 * accum, spike_at=accum)
    ref_params, ref_steps = reference(precision, accum, data, output_loss)
    params, records = guarded(precision, accum, data, output_loss, divided=True)
    _, undivided = guarded(precision, accum, data, output_loss)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    assert [r.skipped for r in records] == [skipped for _, skipped in ref_steps]
    for mine, plain in zip(records, undivided):
        assert mine.values()["loss"] == pytest.approx(plain.values()["loss"], rel=1e-6)


@pytest.mark.parametrize("accum", [1, 3])
def test_guard_skips_an_injected_inf_exactly_as_the_fp16_canonical_loop_does(accum):
    data = batches(5 * accum, inf_at=accum + 1)
    ref_params, ref_steps = reference("fp16", accum, data, output_loss)
    params, records = guarded("fp16", accum, data, output_loss)
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
    assert [r.skipped for r in records] == [s for _, s in ref_steps]
    bad = (accum + 1) // accum  # the step whose micro-batch holds the Inf
    assert isinstance(records[bad], SkipLog) and records[bad].reason == "non_finite_loss"


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_backward_the_loop_runs_itself_is_bit_for_bit_the_guards_own(precision, accum):
    # backward=fn (Lightning's LightningModule.backward override): fn is handed the scaled loss with
    # the check in its graph; its plain .backward() makes the gradients the guard's own backward makes,
    # through a spike fp16 overflows (skipped) and an inf input (a non-finite loss: seeded 0)
    handed = []

    def backward(scaled):
        handed.append(scaled.detach().clone())
        scaled.backward()

    for data in (batches(5 * accum, spike_at=2 * accum), batches(5 * accum, inf_at=accum + 1)):
        own_params, own_records = guarded(precision, accum, data, output_loss)
        params, records = guarded(precision, accum, data, output_loss, backward=backward)
        assert all(torch.equal(a, b) for a, b in zip(params, own_params, strict=True))
        assert [str(r.values()) for r in records] == [str(r.values()) for r in own_records]  # (NaN != NaN)
        assert any(r.reason == "non_finite_loss" for r in records) or data[accum + 1][0].isfinite().all()
    assert len(handed) == 10 * accum and handed[0].dtype == torch.float32


def test_a_backward_the_loop_runs_itself_must_reach_the_loss_and_takes_one():
    model, guard = _guard()
    before = [p.detach().clone() for p in model.parameters()]

    def logs_only(scaled):
        scaled.detach().requires_grad_().backward()  # (a copy: no gradient reaches the model)

    with pytest.raises(RuntimeError, match=r"^Guard\.backward\(\): the loop's backward \(.*logs_only\) returned "
                                           r"without a backward through the loss it was handed \(call "
                                           r"loss\.backward\(\) on it, not on a detached copy or another loss\)"):
        guard.backward(_loss(model), backward=logs_only)
    assert guard.steps == 0 and not guard.pending  # the group dropped: the loop may go on
    with pytest.raises(ValueError, match=r"^Guard\.backward\(backward=fn\) takes one loss"):
        guard.backward(_loss(model), _loss(model), backward=lambda scaled: scaled.backward())
    guard.backward(_loss(model), backward=lambda scaled: scaled.backward())
    assert isinstance(guard.step(), StepLog) and guard.steps == 1
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_backward_the_loop_leaves_out_for_a_non_finite_loss_is_run_seeded_zero(precision):
    # review 38d: `if loss.isfinite(): loss.backward()` (a common override of Lightning's backward) was
    # refused as "ran no backward" at the very loss the guard exists to skip; the guard now runs that
    # backward itself, seeded 0, so the step is its own skip, bit for bit
    def skips_non_finite(scaled):
        if torch.isfinite(scaled):
            scaled.backward()

    for data in (batches(6, inf_at=2), batches(6, spike_at=2)):
        own_params, own_records = guarded(precision, 2, data, output_loss)
        params, records = guarded(precision, 2, data, output_loss, backward=skips_non_finite)
        assert all(torch.equal(a, b) for a, b in zip(params, own_params, strict=True))
        assert [str(r.values()) for r in records] == [str(r.values()) for r in own_records]
    assert [(r.skipped, r.reason) for r in records][1] == ((True, "non_finite_grad") if precision == "fp16"
                                                           else (False, None))  # (the spike: a finite loss)


def test_a_backward_the_loop_runs_twice_is_refused():
    # review 38d: twice through the handed loss (retain_graph) added its gradients twice, unsaid
    model, guard = _guard()

    def twice(scaled):
        scaled.backward(retain_graph=True)
        scaled.backward()

    with pytest.raises(RuntimeError, match=r"^Guard\.backward\(\): the loop's backward \(.*twice\) ran the backward "
                                           r"through the loss it was handed 2 times \(its gradients added 2 times\)"):
        guard.backward(_loss(model), backward=twice)
    assert guard.steps == 0 and not guard.pending and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_complex_weights_train_through_unscale_with_no_loss_scaler(precision):
    # review 38d: bdb701f's check of unscale_() with no loss scaler had no complex kernel: a complex
    # weight (bf16 and fp32 train them; fp16 refuses them up front) failed at the first unscale_()
    def run(unscale: bool, inf_at: int | None = None):
        torch.manual_seed(0)
        model = nn.Module()
        model.linear, model.phase = nn.Linear(4, 4), nn.Parameter(torch.ones(4, dtype=torch.complex64))
        phase = model.phase
        guard = Guard(model, torch.optim.Adam(model.parameters(), lr=0.1), precision=precision)
        records = []
        for i in range(3):
            with guard.autocast():
                loss = (model.linear(torch.ones(2, 4)).float() * phase.abs()).pow(2).mean()
            guard.backward(loss)
            if i == inf_at:
                phase.grad[0] = complex(0.0, float("inf"))
            if unscale:
                guard.unscale_()
                phase.grad.real.nan_to_num_(posinf=1.0), phase.grad.imag.nan_to_num_(posinf=1.0)
            records.append(guard.step())
        return [p.detach().clone() for p in model.parameters()], records

    unscaled, _ = run(unscale=True)
    plain, _ = run(unscale=False)
    assert all(torch.equal(a, b) for a, b in zip(unscaled, plain, strict=True))
    _, records = run(unscale=True, inf_at=1)  # (an inf in its imaginary part, then made finite: a skip)
    assert [(r.skipped, r.reason) for r in records] == [(False, None), (True, "non_finite_grad"), (False, None)]


def test_amp_train_state_is_the_guard_verbs_in_one_call():
    data = batches(6)
    torch.manual_seed(0)
    a_model, b_model = WithLoss(), WithLoss()
    a = AmpTrainState(a_model.net, torch.optim.SGD(a_model.parameters(), lr=0.1), F.mse_loss, precision="bf16")
    b = Guard(b_model.net, torch.optim.SGD(b_model.parameters(), lr=0.1), precision="bf16")
    for x, y in data:
        ra = a.step(x, y)
        with b.autocast():
            loss = F.mse_loss(b_model.net(x), y)
        b.backward(loss)
        rb = b.step()
        assert ra.values() == rb.values()
    for p, q in zip(a_model.parameters(), b_model.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------- call order


def _guard(**kw) -> tuple[nn.Module, Guard]:
    model = nn.Linear(3, 1)
    return model, Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", **kw)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.ones(2, 3)).pow(2).mean()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_loss_non_finite_by_overflow_never_seeds_the_backward(precision):
    """DESIGN §1: a non-finite loss is replaced by zero before the backward. A loss whose terms are
    finite but whose sum overflows is inf; seeded with 1, its backward leaves -inf/NaN gradients,
    which the skipped step's diagnostics (``skip_hooks``) would read. Seeded with 0: zeros."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision, max_norm=None,
                  scaler={"init_scale": 4.0})
    seen = []
    guard.skip_hooks.append(lambda grads: seen.append([g.clone() for g in grads.grads]))
    with guard.autocast():
        out = model(torch.ones(4, 3)).float()
    terms = out.abs() * 1e38 + 1e38  # each finite (|out| < 1 here), their sum past float32's largest
    loss = terms.sum()
    assert torch.isinf(loss) and torch.isfinite(terms).all()
    guard.backward(loss)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    record = guard.step()
    assert (record.skipped, record.reason) == (True, "non_finite_loss")
    assert len(seen) == 1 and all(torch.equal(g, torch.zeros_like(g)) for g in seen[0])


def test_step_before_backward_raises():
    _, guard = _guard()
    with pytest.raises(RuntimeError, match=r"step\(\) before guard.backward"):
        guard.step()


def test_step_twice_raises_and_names_the_order():
    model, guard = _guard()
    guard.backward(_loss(model))
    assert isinstance(guard.step(), StepLog)
    with pytest.raises(RuntimeError, match=r"called twice: the order is"):
        guard.step()


def test_backward_twice_without_step_raises_even_inside_a_group():
    model, guard = _guard(accumulation_steps=3)
    guard.backward(_loss(model))
    with pytest.raises(RuntimeError, match=r"backward\(\) called twice"):
        guard.backward(_loss(model))


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_backward_inside_autocast_is_refused_and_nothing_is_counted(precision):
    # the recipe: autocast wraps the forward and the loss, the backward runs after it closes
    # (fp32: the guard's autocast is none, but a user's own still is refused)
    model = nn.Linear(3, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    with guard.autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model)
        with pytest.raises(RuntimeError, match=r"backward\(\) inside autocast: close the `with guard.autocast\(\):`"):
            guard.backward(loss)
    assert model.weight.grad is None  # no backward ran
    guard.backward(loss)  # after the block: the step goes on as usual
    assert isinstance(guard.step(), StepLog) and guard.steps == 1


def test_a_forward_before_the_pending_step_raises():
    model, guard = _guard(accumulation_steps=2)
    guard.backward(_loss(model))
    with pytest.raises(RuntimeError, match=r"^Guard.autocast\(\) while the guard.backward\(\) of micro-batch 1 of 2 "
                                           r"of step 1 awaits its guard.step\(\)") as err:
        with guard.autocast():
            pass
    # a loop keeping its own accumulation counter (step() every Nth batch) is told why
    assert str(err.value).endswith("(inside a group of accumulation_steps=2 it returns None: no counter of your own)")


def test_state_dict_mid_group_or_before_step_raises():
    model, guard = _guard(accumulation_steps=2)
    guard.backward(_loss(model))
    with pytest.raises(RuntimeError, match="inside an accumulation group"):
        guard.state_dict()
    assert guard.step() is None
    with pytest.raises(RuntimeError, match=r"inside an accumulation group; call it after a step closes, or "
                                           r"state_dict\(mid_group=True\) for the last closed step's state"):
        guard.state_dict()  # (accelerator.save_state mid-group: the message names the way out)
    guard.backward(_loss(model))
    guard.step()
    assert guard.state_dict()["step"] == 1


def test_state_dict_mid_group_gives_the_last_boundarys_state():
    model, guard = _guard(accumulation_steps=2)
    for _ in range(2):
        guard.backward(_loss(model))
        guard.step()
    at_boundary = guard.state_dict()
    guard.backward(_loss(model))  # the next group's first micro-batch, its step still pending
    assert guard.state_dict(mid_group=True) == at_boundary
    assert guard.step() is None and guard.state_dict(mid_group=True) == at_boundary
    assert guard.mid_group  # and the group goes on
    guard.backward(_loss(model))
    assert guard.step().step == 2


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_close_ends_a_short_group_as_a_loop_steps_an_epochs_last_batches(precision):
    # accumulation 3, five micro-batches: a full group, then a short one of two closed by hand;
    # every loss divided by 3 (as the canonical loop and Lightning divide), the record's loss the
    # mean over the two the short group took
    data = batches(5)
    model = WithLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, precision=precision, max_norm=0.5, accumulation_steps=3,
                  scaler={"init_scale": 2.0**16})
    records, losses = [], []
    for i, (x, y) in enumerate(data):
        with guard.autocast():
            loss = output_loss(model, x, y)
        losses.append(loss.float().item())
        guard.backward(loss)
        record = guard.step(close=i == len(data) - 1)
        if record is not None:
            records.append(record)
    ref = WithLoss()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, enabled=precision == "fp16")
    for i, (x, y) in enumerate(data):
        with Precision(precision, "cpu").autocast():
            loss = output_loss(ref, x, y).float()
        scaler.scale(loss / 3).backward()
        if i in (2, 4):
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad(set_to_none=True)
    assert [r.step for r in records] == [1, 2] and not guard.mid_group
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert records[1].values()["loss"] == pytest.approx((losses[3] + losses[4]) / 2, rel=1e-6)


def test_unscale_before_step_shows_true_gradients_and_is_not_done_twice():
    # what a framework's on_before_optimizer_step hook sees; the step then does not unscale again
    data = batches(3)
    model, ref = WithLoss(), WithLoss()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    guard = Guard(model, opt, precision="fp16", max_norm=None, scaler={"init_scale": 1024.0})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x, y in data:
        with guard.autocast():
            loss = output_loss(model, x, y)
        guard.backward(loss)
        guard.unscale_()
        guard.unscale_("optimizer")  # a second call: nothing more (GradScaler.unscale_ would raise)
        seen = [p.grad.clone() for p in model.parameters()]
        guard.step()
        with Precision("fp16", "cpu").autocast():
            ref_loss = output_loss(ref, x, y).float()
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ref_opt)
        assert all(torch.equal(a, p.grad) for a, p in zip(seen, ref.parameters()))
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("sync_free", [False, True])
def test_code_that_cleans_gradients_after_unscale_does_not_unskip_the_step(sync_free):
    """``clip_grad_value_`` between ``guard.unscale_()`` and ``step()`` (the documented place for
    such code) turned an fp16 overflow into finite gradients: the guard applied them, where the
    PyTorch recipe skips on what ``unscale_`` found. Bit for bit the recipe now, overflow included."""
    data = batches(4)

    model, ref = WithLoss(), WithLoss()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1) if sync_free else 0.1,
                          fused=True if sync_free else None)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="fp16", max_norm=None, scaler={"init_scale": 1024.0}, sync_free=sync_free,
                  lr_schedule=(lambda n: torch.ones(())) if sync_free else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    skipped, ref_skipped = [], []
    for i, (x, y) in enumerate(data):
        with guard.autocast():
            loss = output_loss(model, x, y)
        guard.backward(loss)
        if i == 1:  # an overflow to inf (a NaN would stay one through the clamp)
            model.net[0].weight.grad[0, 0] = INF
        guard.unscale_()
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0)  # the inf becomes 1.0
        record = guard.step()
        skipped.append(bool(record.skipped))

        with Precision("fp16", "cpu").autocast():
            ref_loss = output_loss(ref, x, y).float()
        scaler.scale(ref_loss).backward()
        if i == 1:
            ref.net[0].weight.grad[0, 0] = INF
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_value_(ref.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_skipped.append(scaler.get_scale() < before)
        ref_opt.zero_grad(set_to_none=True)
    assert skipped == ref_skipped == [False, True, False, False]
    assert guard.scaler.get_scale() == scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_non_finite_gradient_unscale_found_skips_the_step_with_no_loss_scaler_too(precision, sync_free):
    # review 38a: with the scaler disabled (bf16, fp32) unscale_() recorded nothing, so an inf a hook
    # then clamped (clip_grad_value_: what Lightning's on_before_optimizer_step may do) was applied,
    # reason None, where fp16 skips (nan_to_num_ here); and a clean step is bit for bit the one without it
    def run(unscale: bool, inf_at: int | None):
        model = WithLoss()
        opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1) if sync_free else 0.1,
                              fused=True if sync_free else None)
        guard = Guard(model, opt, precision=precision, max_norm=None, sync_free=sync_free,
                      lr_schedule=(lambda n: torch.ones(())) if sync_free else None)
        records = []
        for i, (x, y) in enumerate(batches(4)):
            with guard.autocast():
                loss = output_loss(model, x, y)
            guard.backward(loss)
            if i == inf_at:
                model.net[0].weight.grad[0, 0] = INF
            if unscale:
                guard.unscale_()
                for p in model.parameters():  # the inf becomes 1.0 (a finite gradient stays as it is)
                    p.grad.nan_to_num_(posinf=1.0)
            records.append(guard.step())
        if sync_free:
            records = [r.resolve() for r in records]
        return [p.detach().clone() for p in model.parameters()], records

    params, records = run(unscale=True, inf_at=1)
    assert [(bool(r.skipped), r.reason) for r in records] == [(False, None), (True, "non_finite_grad"),
                                                               (False, None), (False, None)]
    assert math.isinf(float(records[1].values()["grad_l2_pre_clip"]))
    skipped_by_hand, _ = run(unscale=False, inf_at=1)  # (the inf unclamped: the guard's own skip)
    assert all(torch.equal(a, b) for a, b in zip(params, skipped_by_hand, strict=True))
    clean, clean_records = run(unscale=True, inf_at=None)
    plain, plain_records = run(unscale=False, inf_at=None)
    assert all(torch.equal(a, b) for a, b in zip(clean, plain, strict=True))
    assert [str(r.values()) for r in clean_records] == [str(r.values()) for r in plain_records]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_unscale_before_the_groups_last_backward_ends_the_group_at_its_step(precision):
    # a backward after unscale_() would add scaled gradients to unscaled ones, so the step after it
    # closes the group with the micro-batches it has, as close=True (review 33d: it returned None,
    # every later backward was refused "after unscale_()" and close=True "called twice": no way on;
    # review 38a: with no loss scaler, bf16 and fp32, the group ran on to its full length, unsaid)
    # (review 53g: the close is kept, and said once: a ShortGroupWarning naming micro-batch 1 of 2)
    def guarded():
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        return model, Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision,
                            accumulation_steps=2, scaler={"init_scale": 1024.0} if precision == "fp16" else None)

    model, guard = guarded()
    guard.backward(_loss(model))
    guard.unscale_()
    with pytest.warns(ShortGroupWarning, match=r"^Guard\.unscale_\(\) after micro-batch 1 of 2: "):
        closed = guard.step()
    assert closed is not None and closed.step == 1 and not closed.skipped
    other, reference = guarded()
    reference.backward(_loss(other))
    assert torch.equal(reference.step(close=True).loss, closed.loss)
    assert torch.equal(other.weight, model.weight)  # the same update as close=True's
    for _ in range(2):  # the next group is a whole one
        guard.backward(_loss(model))
        record = guard.step()
    assert record.step == 2 and not record.skipped


def test_close_is_refused_for_a_short_group_of_a_model_that_defers_its_all_reduce():
    class Deferring(nn.Linear):  # a stand-in for DDP: its micro-batches ran under no_sync
        def no_sync(self):
            return contextlib.nullcontext()

    model = Deferring(3, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", accumulation_steps=3)
    with guard.autocast():
        loss = _loss(model)
    guard.backward(loss)
    with pytest.raises(RuntimeError, match="cannot end a short group under DDP"):
        guard.step(close=True)
    assert guard.step() is None  # the guard is as it was: the group goes on


def test_a_non_scalar_loss_is_refused_with_its_shape():
    model, guard = _guard()
    with pytest.raises(ValueError, match=r"scalar loss tensor, got \(2, 1\)$"):
        guard.backward(model(torch.ones(2, 3)))
    with pytest.raises(ValueError, match=r"got tuple \(several losses: guard.backward\(\*losses\)\)$"):
        guard.backward((_loss(model), _loss(model)))


# ---------------------------------------------------------------------------- the optimizer's parameters


class TwoPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_parameter_no_optimizer_updates_is_refused_naming_it():
    model = TwoPart()
    with pytest.raises(ValueError) as err:
        Guard(model, torch.optim.SGD(model.head.parameters(), lr=0.1), precision="bf16")
    assert str(err.value).startswith("parameter 'body.weight' requires grad but no optimizer updates it (2 such)")
    model.body.requires_grad_(False)  # a frozen part is fine
    Guard(model, torch.optim.SGD(model.head.parameters(), lr=0.1), precision="bf16")


def test_frozen_ignore_measures_only_the_optimizers_parameters_and_drops_the_rest():
    model = TwoPart()
    guard = Guard(model, torch.optim.SGD(model.head.parameters(), lr=0.1), precision="fp32", max_norm=None,
                  frozen="ignore")
    body_before = model.body.weight.detach().clone()
    x = torch.randn(8, 4)
    with guard.autocast():
        loss = model(x).pow(2).mean()
    guard.backward(loss)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.head.parameters()])
    record = guard.step()
    assert float(record.values()["grad_l2_pre_clip"]) == float(expected)
    assert model.body.weight.grad is None and model.body.bias.grad is None  # dropped, never accumulated
    assert torch.equal(model.body.weight, body_before)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_param_group_added_mid_run_is_clipped_and_checked_as_the_canonical_loop_does(precision):
    """Progressive unfreezing: the body joins the optimizer by ``add_param_group`` after step 2.
    The guard read its parameters once, at ``Guard()``: the body's gradients were left out of
    the clip and the check, and an inf in them was applied (the weights NaN from there on)."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, generator=g) * 30, torch.randn(8, 1, generator=g)) for _ in range(5)]  # (clipped)
    data[4][0][0, 0] = INF  # step 5: an inf input reaches only the body's weight gradient (and the loss)

    def loop(use_guard: bool):
        model = TwoPart()
        model.body.requires_grad_(False)
        opt = torch.optim.SGD(model.head.parameters(), lr=0.05)
        guard = Guard(model, opt, precision=precision, max_norm=1.0, scaler={"init_scale": 256.0}) if use_guard else None
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=precision == "fp16")
        out = []
        for i, (x, y) in enumerate(data):
            if i == 2:
                model.body.requires_grad_(True)
                opt.add_param_group({"params": list(model.body.parameters()), "lr": 0.05})
            if use_guard:
                with guard.autocast():
                    loss = F.mse_loss(model(x).float(), y)
                guard.backward(loss)
                record = guard.step()
                out.append((record.skipped, float(record.values()["grad_l2_pre_clip"] or INF)))
            else:  # the PyTorch recipe: clip_grad_norm_ over the optimizer's parameters as they are now
                with torch.autocast("cpu", dtype=torch.float16 if precision == "fp16" else torch.bfloat16):
                    loss = F.mse_loss(model(x).float(), y)
                if not torch.isfinite(loss):
                    out.append((True, INF))
                    continue
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                params = [p for group in opt.param_groups for p in group["params"]]
                pre = torch.nn.utils.clip_grad_norm_(params, 1.0)
                skipped = not torch.isfinite(pre)
                if not skipped:
                    scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                out.append((skipped, float(pre)))
        return model, out

    (model, got), (reference, want) = loop(True), loop(False)
    assert got[:4] == want[:4]  # the body's gradients in the norm (and clipped with the head's)
    assert got[4][0] is True  # the inf in the added group: a skip
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_param_group_added_mid_run_is_checked_as_guard_checks_its_parameters():
    model = TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="bf16")
    stranger = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [stranger]})
    with guard.autocast():
        loss = model(torch.randn(2, 4)).sum()
    with pytest.raises(ValueError, match="the optimizer holds a parameter that is not the model's"):
        guard.backward(loss)  # read at the group's start: refused before any gradient is made
    assert guard.micro_batches == 0 and all(p.grad is None for p in model.parameters())


def test_a_refusal_at_a_groups_close_abandons_the_group():
    # a param group added inside an accumulation group is read at its close: refused there, the
    # group is dropped (it was left open: caught and fixed, the next update applied its gradient twice)
    model = TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="fp32", accumulation_steps=2, max_norm=None)
    for micro in range(2):
        with guard.autocast():
            loss = model(torch.ones(2, 4)).sum()
        guard.backward(loss)
        if micro == 0:
            assert guard.step() is None
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="not the model's"):
        guard.step()
    assert (guard.micro_batches, guard.steps, guard.pending) == (0, 0, False)
    assert all(p.grad is None for p in model.parameters())
    opt.param_groups.pop()  # fixed: the next group starts clean and is one micro-batch pair's update
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        with guard.autocast():
            loss = model(torch.ones(2, 4)).sum()
        guard.backward(loss)
        record = guard.step()
    assert not record.skipped and guard.steps == 1
    grads = torch.autograd.grad(model(torch.ones(2, 4)).sum(), [model.head.bias])  # (d/d bias: 2, per group of 2 / 2)
    assert torch.allclose(before[-1] - model.head.bias, 0.1 * grads[0])


def test_a_module_added_to_the_model_without_its_optimizer_is_refused():
    # an adapter or a head added after Guard() (no add_param_group): its gradient grew every step,
    # never unscaled nor cleared; torch's registration hooks tell the guard to read the model again
    model = TwoPart()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    with guard.autocast():
        loss = model(torch.randn(2, 4)).sum()
    guard.backward(loss)
    guard.step()
    model.adapter = nn.Linear(1, 1)
    with guard.autocast():
        loss = model.adapter(model(torch.randn(2, 4))).sum()
    with pytest.raises(ValueError, match=r"^parameter 'adapter.weight' requires grad but no optimizer updates it"):
        guard.backward(loss)


@pytest.mark.parametrize("frozen", ["refuse", "ignore"])
def test_a_parameter_unfrozen_mid_run_that_no_optimizer_holds_is_refused_or_dropped(frozen):
    # unfrozen but never given to the optimizer: its gradient (scaled, never unscaled) grew every step
    model = TwoPart()
    model.body.requires_grad_(False)
    guard = Guard(model, torch.optim.SGD(model.head.parameters(), lr=0.1), precision="bf16", frozen=frozen)
    body = model.body.weight.detach().clone()

    def step():
        with guard.autocast():
            loss = model(torch.randn(8, 4)).pow(2).mean()
        guard.backward(loss)
        return guard.step()

    step()
    model.body.requires_grad_(True)  # looked for every UNFROZEN_EVERY groups: a frozen backbone costs little
    for _ in range(1, UNFROZEN_EVERY):
        assert not step().skipped
    assert guard.steps == UNFROZEN_EVERY
    if frozen == "refuse":
        with pytest.raises(ValueError, match=r"^parameter 'body.weight' requires grad but no optimizer updates it "
                                             r"\(2 such\)"):
            step()
        assert model.body.weight.grad is None  # no gradient outlives the refusal
    else:
        for _ in range(2):
            assert not step().skipped
            assert model.body.weight.grad is None  # dropped every step, as for one unfrozen at Guard()
    assert torch.equal(model.body.weight, body)


def test_a_gradient_from_outside_the_guard_at_a_steps_start_is_refused_naming_the_parameter():
    # a GAN with one Guard per network: the generator's loss reaches the discriminator's parameters,
    # and those gradients were added into the discriminator's next update (no zero_grad: the guard
    # "drops gradients after every step", but only its own optimizers')
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 2), nn.Linear(2, 1)
    g_guard = Guard(gen, torch.optim.SGD(gen.parameters(), lr=0.1), precision="bf16")
    d_guard = Guard(disc, torch.optim.SGD(disc.parameters(), lr=0.1), precision="bf16")
    real, z = torch.randn(4, 2), torch.randn(4, 2)
    with d_guard.autocast():
        d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
    d_guard.backward(d_loss)
    assert not d_guard.step().skipped  # the first step: nothing from outside yet
    with g_guard.autocast():
        g_loss = disc(gen(z)).mean()
    g_guard.backward(g_loss)
    g_guard.step()
    assert disc.weight.grad is not None  # left there by the generator's backward
    with d_guard.autocast():
        d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
    with pytest.raises(RuntimeError, match=r"^Guard.backward\(\): parameter 'weight' already holds a gradient at the "
                                           r"start of a step, from a backward outside this guard"):
        d_guard.backward(d_loss)
    assert d_guard.steps == 1 and not d_guard.pending  # nothing counted: zero the gradients and go on
    disc.zero_grad()
    d_guard.backward(d_loss)
    assert not d_guard.step().skipped


@pytest.mark.parametrize("before", ["loss.backward()", "zero_grad(set_to_none=False)"])
def test_gradients_left_before_the_first_step_are_refused(before):
    # loss.backward(retain_graph=True) then guard.backward(loss) summed an unscaled and a scaled
    # gradient; zeros left by zero_grad(set_to_none=False) cannot be told from them without a read
    model = nn.Linear(3, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", max_norm=None)
    with guard.autocast():
        loss = _loss(model)
    if before == "loss.backward()":
        loss.backward(retain_graph=True)
    else:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="already holds a gradient at the start of a step"):
        guard.backward(loss)


def test_a_micro_batch_whose_loss_reaches_no_parameter_is_not_taken_for_a_zero_grad():
    # an empty batch's loss (a zero leaf) first in its group made no gradient: the next micro-batch
    # found none and was refused as "an optimizer.zero_grad() in the loop" (Lightning runs this shape)
    model = TwoPart()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", accumulation_steps=3)
    losses = [torch.zeros((), requires_grad=True)]
    for _ in range(2):
        with guard.autocast():
            losses.append(model(torch.randn(4, 4)).pow(2).mean())
    for loss in losses:
        guard.backward(loss)
        record = guard.step()
    assert record is not None and not record.skipped and guard.updates == 1


def test_zero_grad_inside_an_accumulation_group_is_refused():
    # a loop ported to accumulation with its optimizer.zero_grad() left at the top: each micro-batch
    # erased the ones before, the update was the last one's gradient / N, the records looked normal
    model = TwoPart()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="bf16", accumulation_steps=3)
    for micro in range(2):
        opt.zero_grad()
        with guard.autocast():
            loss = model(torch.randn(4, 4)).pow(2).mean()
        if micro == 0:
            guard.backward(loss)
            assert guard.step() is None
    with pytest.raises(RuntimeError, match=r"^Guard.backward\(\): the gradients of micro-batch 1 of 3 were cleared "
                                           r"inside the accumulation group \(an optimizer.zero_grad\(\) in the loop, or "
                                           r"accelerator.accumulate\(\), whose group ends at each epoch's end\?\)"):
        guard.backward(loss)


# ---------------------------------------------------------------------------- sparse gradients


class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.out = nn.Linear(4, 1)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sparse_embedding_trains_without_clipping(precision):
    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guard = Guard(model, opt, precision=precision, max_norm=None)
    before = model.emb.weight.detach().clone()
    ids = torch.tensor([[1, 2, 2], [3, 4, 1]])
    for _ in range(3):
        with guard.autocast():
            loss = (model(ids) - 1.0).pow(2).mean()
        guard.backward(loss)
        record = guard.step()
        assert not record.skipped and math.isfinite(record.values()["grad_l2_pre_clip"])
    changed = (model.emb.weight != before).any(dim=1)
    assert changed[[1, 2, 3, 4]].all() and not changed[[0, 5, 19]].any()  # only the rows looked up


def test_a_sparse_gradient_with_an_inf_is_a_skip():
    model = Bag()
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.5), precision="fp32", max_norm=None)
    ids = torch.tensor([[1, 2]])
    with guard.autocast():
        loss = model(ids).sum() * INF
    guard.backward(loss)
    assert guard.step().reason == "non_finite_loss"
    model.emb.weight.register_hook(lambda g: torch.sparse_coo_tensor(g._indices(), g._values() * INF, g.shape))
    with guard.autocast():
        loss = model(ids).sum()
    guard.backward(loss)
    assert guard.step().reason == "non_finite_grad"


def test_clipping_sparse_gradients_is_refused_up_front():
    model = Bag()
    with pytest.raises(ValueError, match=r"module 'emb' makes sparse gradients, which PyTorch's clip_grad_norm_ "
                                         r"cannot clip: pass max_norm=None"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.5), precision="fp32", max_norm=1.0)


# ---------------------------------------------------------------------------- refused or warned up front


@pytest.mark.parametrize("precision, cast, dtype", [("fp16", torch.float16, "float16"),
                                                    ("bf16", torch.bfloat16, "bfloat16"),
                                                    ("bf16", torch.float16, "float16")])
def test_weights_already_cast_to_half_are_refused_saying_why(precision, cast, dtype):
    model = nn.Linear(2, 2).to(cast)
    with pytest.raises(ValueError) as err:
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"parameter 'weight' is {dtype}, but {precision} mixed precision keeps FP32 master weights")
    assert "small updates are not lost to rounding" in line


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_float64_parameter_trains_as_the_canonical_loop_trains_it(precision):
    # it was refused as if it were a half weight ("small updates are not lost to rounding": float64
    # holds more than a float32 master weight); the PyTorch recipe trains it
    def make():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        model.gain = nn.Parameter(torch.full((1,), 1.5, dtype=torch.float64))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(model, x):
        return (model(x).float().pow(2).mean() * model.gain).sum()

    data = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    model, opt = make()
    guard = Guard(model, opt, precision=precision, max_norm=0.5, scaler={"init_scale": 256.0})
    ref, ref_opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=precision == "fp16")
    for x in data:
        with guard.autocast():
            loss = loss_of(model, x)
        guard.backward(loss)
        assert not guard.step().skipped
        with Precision(precision, "cpu").autocast():
            ref_loss = loss_of(ref, x)
        scaler.scale(ref_loss.float()).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
    assert model.gain.dtype == torch.float64
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_complex_weights_under_fp16_are_refused_up_front():
    # GradScaler's unscale kernel has no complex version: a NotImplementedError mid-step
    model = nn.Linear(2, 1)
    model.phase = nn.Parameter(torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^parameter 'phase' is complex, which fp16's loss scaler cannot unscale"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")  # no scaler: trains
    model.phase.requires_grad_(False)  # frozen (a fixed filter bank): the scaler never unscales it
    with pytest.warns(SlowPrecisionWarning):
        Guard(model, torch.optim.SGD([model.weight, model.bias], lr=0.1), precision="fp16")


def test_half_weights_with_fp32_precision_are_the_users_choice():
    torch.manual_seed(0)
    model = nn.Linear(2, 2).to(torch.bfloat16)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")
    before = model.weight.detach().clone()
    x = torch.randn(4, 2).to(torch.bfloat16)
    with guard.autocast():
        loss = (model(x) - 1.0).pow(2).mean()
    guard.backward(loss)
    record = guard.step()
    # accepted, and the guard then works on them: the step is applied, the weights stay bf16
    assert isinstance(record, StepLog) and not record.skipped, record
    assert math.isfinite(record.values()["loss"]) and math.isfinite(record.values()["grad_l2_pre_clip"])
    assert guard.updates == 1
    assert not torch.equal(model.weight, before)
    assert model.weight.dtype == torch.bfloat16 and model.bias.dtype == torch.bfloat16


def test_a_plain_grad_scaler_is_taken_over_with_its_settings_and_state():
    model = nn.Linear(2, 1)
    plain = torch.amp.GradScaler("cpu", init_scale=256.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    plain.scale(torch.ones(()))  # lazily creates its scale tensor
    plain._scale.fill_(64.0)
    with pytest.warns(SlowPrecisionWarning):
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=plain)
    assert isinstance(guard.scaler, GuardedGradScaler)
    s = guard.scaler
    assert (s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (64.0, 4.0, 0.25, 7)


@pytest.mark.parametrize("ran_before", [False, True])
def test_the_plain_scaler_handed_over_follows_the_guards_scale(ran_before):
    # a loop ported with its own `scaler = GradScaler(...)` logs scaler.get_scale() and saves
    # scaler.state_dict(): they stayed at the scale handed over while the guard's backed off
    model = nn.Linear(2, 1)
    plain = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=1000)
    if ran_before:  # its own tensors exist (a resumed loop): they are replaced by the guard's
        plain.scale(torch.ones(()))
    with pytest.warns(SlowPrecisionWarning):
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", scaler=plain)
    for inf_grad in (True, False, True):
        with guard.autocast():
            loss = model(torch.ones(1, 2)).sum()
        guard.backward(loss)
        if inf_grad:
            model.weight.grad[0, 0] = INF
        record = guard.step()
        assert plain.get_scale() == guard.scaler.get_scale() == record.values()["scaler_scale"]
    assert plain.get_scale() == 128.0
    mine, guards = plain.state_dict(), guard.scaler.state_dict()
    assert (mine["scale"], mine["_growth_tracker"]) == (guards["scale"], guards["_growth_tracker"]) == (128.0, 0)
    # the user's checkpoint of their scaler resumes where the guard was
    again = GuardedGradScaler.from_scaler(torch.amp.GradScaler("cpu"))
    again.load_state_dict(plain.state_dict())
    assert again.get_scale() == 128.0


def test_one_plain_scaler_handed_to_two_guards_is_one_scale():
    # each Guard made its own GuardedGradScaler of it: the one that skipped backed off alone,
    # and the plain scaler's get_scale() and state_dict() followed only the last guard built
    plain = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    models = [nn.Linear(2, 1), nn.Linear(2, 1)]
    with pytest.warns(SlowPrecisionWarning):
        guards = [Guard(m, torch.optim.SGD(m.parameters(), lr=0.1), precision="fp16", scaler=plain) for m in models]
    assert guards[0].scaler is guards[1].scaler
    scales = []
    for model, guard, inf_grad in zip(models, guards, (True, False)):
        with guard.autocast():
            loss = model(torch.ones(1, 2)).sum()
        guard.backward(loss)
        if inf_grad:
            model.weight.grad[0, 0] = INF
        scales.append(float(guard.step().values()["scaler_scale"]))
    assert scales == [512.0, 512.0]
    assert plain.get_scale() == plain.state_dict()["scale"] == 512.0


def test_fp16_on_a_cpu_warns_that_it_is_emulated(cpu_kind):
    model = nn.Linear(2, 1)
    cpu_kind(bf16=True)
    with pytest.warns(SlowPrecisionWarning, match="emulated, about 10x slower than bf16"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    cpu_kind(bf16=False)  # an AVX2-only CPU: bf16 too
    for precision in ("fp16", "bf16"):
        with pytest.warns(SlowPrecisionWarning, match=f"^{precision} autocast on this CPU is emulated"):
            Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)


@pytest.mark.parametrize("accumulation, losses, divided", [(1, 2, False), (1, 3, False), (2, 1, True), (3, 1, True)])
def test_a_parameter_reached_through_views_only_gets_its_own_gradient(accumulation, losses, divided):
    # autograd may keep the backward's seed itself as such a parameter's gradient (no copy): a
    # seed shared between backwards was then overwritten by the next one, and the gradient
    # accumulated into it seeded the other branches with 2 (found in review). Against plain
    # autograd, micro-batch by micro-batch.
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.p = torch.nn.Parameter(torch.zeros(1))
            self.lin = torch.nn.Linear(2, 1)

        def loss(self, x):
            return self.lin(x).mean() + self.p.squeeze()

    def make():
        torch.manual_seed(0)
        return Model()

    mine, ref = make(), make()
    guard = Guard(mine, torch.optim.SGD(mine.parameters(), lr=0.0), precision="fp32", max_norm=None,
                  accumulation_steps=accumulation)
    x = torch.randn(4, 2)
    for i in range(accumulation):
        # (divided: the caller says the losses are divided already, so the guard seeds them as they are)
        guard.backward(*[mine.loss(x) for _ in range(losses)], divided=divided)
        for _ in range(losses):
            (ref.loss(x) if divided else ref.loss(x) / accumulation).backward()
        if i < accumulation - 1:
            assert guard.step() is None
            assert torch.equal(mine.p.grad, ref.p.grad) and torch.equal(mine.lin.weight.grad, ref.lin.weight.grad)
    grads = [p.grad.clone() for p in mine.parameters()]
    assert all(torch.equal(a, b.grad) for a, b in zip(grads, ref.parameters()))


def test_an_optimizer_that_needs_a_closure_is_refused_up_front():
    # LBFGS raised a TypeError from inside the first applied step, after the step was counted (an
    # fp16 run whose first step was a skip went past it)
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"^optimizer 'optimizer' \(LBFGS\) needs a closure in step\(\)"):
        Guard(model, torch.optim.LBFGS(model.parameters()), precision="bf16")


def test_library_settings_the_config_refuses_are_refused_here_too():
    """The Python API took what the CLI refuses, silently: accumulation_steps=1.5 divided each loss
    by 1.5 while stepping every 2; a backoff_factor of 0 pinned the scale at the float32 floor after
    one skip, every later step "applied" with zero gradients; another optimizer's scheduler was
    stepped while the guard's schedule never was; a scheduler given twice stepped twice."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in (1.5, 2.0, "2", True):
        with pytest.raises(ValueError, match=r"^accumulation_steps must be a whole number >= 1, got"):
            Guard(model, opt, precision="fp32", accumulation_steps=bad)
    for settings, said in (({"backoff_factor": 0.0}, "backoff_factor must be in (0, 1), got 0.0"),
                           ({"backoff_factor": -1.0}, "backoff_factor must be in (0, 1)"),
                           ({"growth_factor": 0.5}, "growth_factor must be a finite number > 1"),
                           ({"growth_factor": float("inf")}, "growth_factor must be a finite number > 1"),
                           ({"growth_interval": 0}, "growth_interval must be a whole number >= 1"),
                           ({"init_scale": float("nan")}, "init_scale must be a finite number > 0")):
        with pytest.raises(ValueError, match=re.escape(f"scaler {said}")):
            Guard(model, opt, precision="fp16", scaler=settings)
    other = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^scheduler StepLR drives none of the guard's optimizers"):
        Guard(model, opt, precision="fp32", scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match=r"^the same scheduler is given twice"):
        Guard(model, opt, precision="fp32", scheduler=[sched, sched])
    with pytest.raises(ValueError, match=r"^ReduceLROnPlateau steps on a metric"):
        Guard(model, opt, precision="fp32", scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(TypeError, match=r"^scheduler must have a step\(\) method, got a str"):
        Guard(model, opt, precision="fp32", scheduler="abc")
    assert model.weight.grad is None and opt.state == {}  # refused before anything ran


def test_a_plain_gradscaler_handed_over_is_taken_whatever_its_state_or_refused_for_another_device():
    # a disabled GradScaler keeps no settings: taking it over was an AttributeError ('_init_scale');
    # one made for cuda, given with a CPU model, was the same AttributeError
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision="fp16", scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert not guard.scaler.is_enabled() and guard.scaler.get_scale() == 1.0
    with pytest.raises(ValueError, match=r"^the scaler is for cuda, the model on cpu: make it GradScaler\('cpu', \.\.\.\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch warns that CUDA is not available: the scaler it makes is off)
            Guard(model, opt, precision="fp16", scaler=torch.amp.GradScaler("cuda", enabled=True))


@pytest.mark.parametrize("precision, scaler, said", [
    ("fp16", {"init_scal": 4.0}, r"^scaler settings: unknown key 'init_scal' \(the keys: enabled, init_scale"),
    ("bf16", {"init_scale": 4.0, "min_scal": 1.0}, r"^scaler settings: unknown key 'min_scal'"),
    ("fp16", {"init_scale": -1.0}, r"^scaler init_scale must be a finite number > 0, got -1\.0"),
    ("fp16", {"growth_interval": 0}, r"^scaler growth_interval must be a whole number >= 1, got 0"),
])
def test_scaler_settings_that_would_be_a_typeerror_are_refused_naming_them(precision, scaler, said):
    # review_27a #5: an unknown key was make_scaler's TypeError (at a plugin's first step, 26 frames
    # into fit), for bf16 not even that
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match=said):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision, scaler=scaler)


def test_scaler_settings_a_guard_takes():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert Guard(model, opt, precision="fp16", scaler={"init_scale": 8.0}).scaler.get_scale() == 8.0
    assert not Guard(model, opt, precision="bf16", scaler={"enabled": False}).scaler.is_enabled()
    # (a loop that switches precision keeps one set of settings: under bf16 they do nothing)
    assert not Guard(model, opt, precision="bf16", scaler={"init_scale": 8.0}).scaler.is_enabled()


def test_a_scheduler_the_loop_also_steps_is_refused_before_the_next_backward():
    """A loop ported to the guard that kept its own ``scheduler.step()`` ran the schedule twice as
    fast, and stepped it on the very skips the guard held it on, unsaid. The next group's first
    backward refuses, before a gradient is made; a restore (its scheduler's state loaded with the
    guard's) is not taken for one."""
    def loop():
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return model, opt, sched, Guard(model, opt, precision="fp32", scheduler=sched)

    def step(model, guard, x=torch.ones(4, 3)):
        with guard.autocast():
            loss = model(x).pow(2).mean()
        guard.backward(loss)
        return guard.step()

    model, opt, sched, guard = loop()
    sched.step()  # before the guard's first step: nothing to compare with yet, taken as the start
    step(model, guard)
    assert sched.last_epoch == 2
    sched.step()  # the stock recipe's own call, after the guard's
    with pytest.raises(RuntimeError, match=r"^the StepLR of optimizer 'optimizer' was stepped outside the guard "
                                           r"\(last_epoch 3, the guard left it at 2\)"):
        step(model, guard)
    assert model.weight.grad is None and guard.steps == 1  # refused before the backward

    # a skipped step the guard held the scheduler on, stepped by the loop: the same refusal
    model, opt, sched, guard = loop()
    assert isinstance(step(model, guard, torch.full((4, 3), math.nan)), SkipLog) and sched.last_epoch == 0
    sched.step()
    with pytest.raises(RuntimeError, match=r"last_epoch 1, the guard left it at 0"):
        step(model, guard)

    # a restore: the scheduler's state loaded with the guard's, elsewhere in the run
    model, opt, sched, guard = loop()
    for _ in range(3):
        step(model, guard)
    saved = sched.state_dict(), guard.state_dict()
    step(model, guard)
    sched.load_state_dict(saved[0])
    guard.load_state_dict(saved[1])
    assert isinstance(step(model, guard), StepLog) and sched.last_epoch == 4
