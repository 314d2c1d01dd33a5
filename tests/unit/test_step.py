"""The guarded step (docs/design.md §2): AmpTrainState against the canonical PyTorch loop.

CPU only. Models are tiny (Linear(8,16)-GELU-Linear(16,2), batch 4) because fp16 autocast on
CPU is slow.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampguard
from helpers import HostReads

from ampguard import AmpTrainState, GuardedGradScaler, Precision, SkipLog, StepLog

PRECISIONS = ["fp16", "bf16", "fp32"]
INF = float("inf")
NAN = float("nan")

# ----------------------------------------------------------------------------- helpers


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def make_batches(n: int, *, seed: int = 1, spike_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n micro-batches (x: 4x8, y: 4x2); micro-batch ``spike_at`` has its targets x 1e8."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 2, generator=g)
        if i == spike_at:
            y = y * 1e8
        out.append((x, y))
    return out


def adamw(model: nn.Module, **kw) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, **kw)


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_params_equal(a: nn.Module | list, b: nn.Module | list) -> None:
    pa = list(a.parameters()) if isinstance(a, nn.Module) else a
    pb = list(b.parameters()) if isinstance(b, nn.Module) else b
    assert len(pa) == len(pb)
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"parameter {i} differs (max abs diff {(x - y).abs().max().item()})"


def opt_state_snapshot(opt: torch.optim.Optimizer) -> list[dict]:
    return [
        {k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)) for k, v in s.items()}
        for s in (opt.state[p] for g in opt.param_groups for p in g["params"])
    ]


def assert_opt_state_equal(before: list[dict], after: list[dict]) -> None:
    assert len(before) == len(after)
    for s0, s1 in zip(before, after):
        assert s0.keys() == s1.keys()
        for k in s0:
            if isinstance(s0[k], torch.Tensor):
                assert torch.equal(s0[k], s1[k]), f"optimizer state {k!r} changed"
            else:
                assert s0[k] == s1[k], f"optimizer state {k!r} changed"


def run_reference(
    precision: str,
    accum: int,
    batches,
    *,
    max_norm: float | None = 0.5,
    scaler_kw: dict | None = None,
    make_opt=adamw,
    make_sched=step_lr,
    seed: int = 0,
):
    """The hand-written canonical AMP loop (docs/design.md §2), with clip_grad_norm_.

    Returns the model and one dict per step: scale after update, skipped, lr used, mean loss.
    """
    model = make_model(seed)
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    prec = Precision(precision, "cpu")
    scaler = torch.amp.GradScaler("cpu", **(scaler_kw or {}), enabled=(precision == "fp16"))
    history = []
    losses = []
    for i, (x, y) in enumerate(batches):
        with prec.autocast():
            loss = F.mse_loss(model(x), y).float()
        losses.append(loss.detach())
        scaler.scale(loss / accum).backward()
        if (i + 1) % accum:
            continue
        lr = opt.param_groups[0]["lr"]
        scaler.unscale_(opt)
        if max_norm:
            pre = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            pre = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        after = scaler.get_scale()
        skipped = after < before if scaler.is_enabled() else not math.isfinite(float(pre))
        if sched is not None and not skipped:
            sched.step()
        opt.zero_grad(set_to_none=True)
        mean = losses[0]
        for l in losses[1:]:
            mean = mean + l
        history.append({"scale": after, "skipped": skipped, "lr": lr, "loss": mean / accum, "pre": pre})
        losses = []
    return model, history


def run_ampguard(
    precision: str,
    accum: int,
    batches,
    *,
    max_norm: float | None = 0.5,
    scaler_kw: dict | None = None,
    make_opt=adamw,
    make_sched=step_lr,
    seed: int = 0,
):
    model = make_model(seed)
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    state = AmpTrainState(
        model,
        opt,
        F.mse_loss,
        precision=precision,
        max_norm=max_norm,
        accumulation_steps=accum,
        scheduler=sched,
        scaler=scaler_kw,
    )
    logs = []
    for i, (x, y) in enumerate(batches):
        log = state.step(x, y)
        if (i + 1) % accum:
            assert log is None, "a micro-batch inside a group must return None"
        else:
            assert isinstance(log, (StepLog, SkipLog))
            logs.append(log)
    return model, logs, state


class GradInjector:
    """A hook on one parameter that replaces its gradient with inf or nan when armed."""

    def __init__(self, param: torch.Tensor) -> None:
        self.mode: str | None = None
        param.register_hook(self._hook)

    def _hook(self, g: torch.Tensor) -> torch.Tensor:
        if self.mode == "inf_grad":
            return torch.full_like(g, INF)
        if self.mode == "nan_grad":
            return torch.full_like(g, NAN)
        return g


class FlakyLoss:
    """MSE, plus a NaN constant when armed: a non-finite loss whose gradients stay finite."""

    def __init__(self) -> None:
        self.nan = False

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, y)
        return loss + NAN if self.nan else loss


SCALER_KW = {"init_scale": 2.0**10, "growth_interval": 6}

# ----------------------------------------------------------------------------- 1. bit-for-bit


def spike_index(accum: int) -> int:
    """The micro-batch index of the spike: inside step 5 (its 2nd micro-batch when accum > 1)."""
    return 4 * accum + (1 if accum > 1 else 0)


@pytest.mark.parametrize("data", ["clean", "spike"])
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bit_for_bit_equal_to_canonical_loop(precision, accum, data):
    n_steps = 20
    spike = spike_index(accum) if data == "spike" else None
    batches = make_batches(n_steps * accum, spike_at=spike)

    ref_model, hist = run_reference(precision, accum, batches, scaler_kw=SCALER_KW)
    model, logs, state = run_ampguard(precision, accum, batches, scaler_kw=SCALER_KW)

    assert len(logs) == len(hist) == n_steps
    assert_params_equal(model, ref_model)

    # The same per-step scale history, read only now (records must not alias live state).
    assert [float(l.scaler_scale) for l in logs] == [h["scale"] for h in hist]
    assert [l.skipped for l in logs] == [h["skipped"] for h in hist]
    assert [l.lr for l in logs] == [h["lr"] for h in hist]
    for l, h in zip(logs, hist):
        torch.testing.assert_close(l.loss, h["loss"], rtol=1e-6, atol=0)

    expected_skips = [5] if (data == "spike" and precision == "fp16") else []
    assert [l.step for l in logs if l.skipped] == expected_skips
    assert [h_i + 1 for h_i, h in enumerate(hist) if h["skipped"]] == expected_skips
    assert state.steps == n_steps
    assert state.updates == n_steps - len(expected_skips)
    if expected_skips:
        assert logs[4].reason == "non_finite_grad"
    if precision == "fp16":
        # The scale actually moved during the run (growth every 6 clean steps), so the history
        # comparison is not trivially 1.0 == 1.0.
        assert len({float(l.scaler_scale) for l in logs}) > 1
    else:
        assert all(float(l.scaler_scale) == 1.0 for l in logs)
    if data == "spike" and precision != "fp16":
        # The spike was finite in bf16/fp32: applied and clipped, not a no-op.
        spiked = logs[4]
        assert not spiked.skipped
        assert float(spiked.grad_l2_pre_clip) > 1e3
        assert float(spiked.grad_l2_post_clip) <= 0.5


@pytest.mark.parametrize("max_norm", [None, 0.0])
def test_no_clipping_is_bit_for_bit_the_loop_without_clip(max_norm):
    batches = make_batches(20)
    ref_model, hist = run_reference("fp32", 1, batches, max_norm=None)
    model, logs, _ = run_ampguard("fp32", 1, batches, max_norm=max_norm)
    assert_params_equal(model, ref_model)
    for l, h in zip(logs, hist):
        assert torch.equal(l.grad_l2_post_clip, l.grad_l2_pre_clip)
        assert float(l.grad_l2_pre_clip) == float(h["pre"])
    # Some pre-clip norms exceed 0.5: with clipping on, the run would have differed.
    assert max(float(l.grad_l2_pre_clip) for l in logs) > 0.5


def test_fused_adamw_same_skips_and_close_params():
    accum, n_steps = 1, 20
    batches = make_batches(n_steps, spike_at=spike_index(accum))
    fused = lambda m: adamw(m, fused=True)  # noqa: E731
    model_f, logs_f, state_f = run_ampguard("fp16", accum, batches, scaler_kw=SCALER_KW, make_opt=fused)
    ref_model, hist = run_reference("fp16", accum, batches, scaler_kw=SCALER_KW)  # non-fused
    assert state_f.optimizer.defaults["fused"] is True

    assert [l.skipped for l in logs_f] == [h["skipped"] for h in hist]
    assert [l.step for l in logs_f if l.skipped] == [5]
    assert [float(l.scaler_scale) for l in logs_f] == [h["scale"] for h in hist]
    assert [l.lr for l in logs_f] == [h["lr"] for h in hist]
    for p, q in zip(model_f.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)

    # The skip did not advance fused AdamW's step counter (the skipped update never ran).
    for s in state_f.optimizer.state.values():
        assert float(s["step"]) == n_steps - 1

    # And against the canonical loop with the same fused optimizer (scaler.step's fused path).
    # The guarded step calls optimizer.step() itself; the result is still bit-for-bit.
    ref_fused, hist_f = run_reference("fp16", accum, batches, scaler_kw=SCALER_KW, make_opt=fused)
    assert [h["skipped"] for h in hist_f] == [l.skipped for l in logs_f]
    assert [h["scale"] for h in hist_f] == [float(l.scaler_scale) for l in logs_f]
    assert_params_equal(model_f, ref_fused)


# ----------------------------------------------------------------------------- 2. scale arithmetic


@pytest.mark.parametrize("accum", [1, 2])
def test_scale_arithmetic_like_gradscaler_tests(accum):
    model = make_model()
    inject = GradInjector(model[2].weight)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = FlakyLoss()
    state = AmpTrainState(
        model, opt, loss_fn, precision="fp16", accumulation_steps=accum,
        scaler=dict(init_scale=128.0, growth_interval=1),
    )
    plan = [None, None, "nan_target", None, "inf_grad", None, "inf_target", "nan_grad", None, "nan_const",
            None, "inf_grad", None]
    reasons = {"nan_target": "non_finite_loss", "inf_target": "non_finite_loss", "nan_const": "non_finite_loss",
               "inf_grad": "non_finite_grad", "nan_grad": "non_finite_grad"}
    batches = make_batches(len(plan) * accum, seed=7)
    applied = skipped = 0
    logs = []
    for k, fault in enumerate(plan):
        log = None
        for j in range(accum):
            x, y = batches[k * accum + j]
            last = j == accum - 1
            if fault == "nan_target" and last:
                y = torch.full_like(y, NAN)
            if fault == "inf_target" and j == 0:
                y = torch.full_like(y, INF)
            inject.mode = fault if (fault in ("inf_grad", "nan_grad") and last) else None
            loss_fn.nan = fault == "nan_const" and j == 0
            log = state.step(x, y)
        inject.mode = None
        loss_fn.nan = False
        assert log is not None
        logs.append(log)
        if fault is None:
            applied += 1
            assert not log.skipped, f"step {k + 1} should have been applied"
        else:
            skipped += 1
            assert log.skipped and log.reason == reasons[fault], f"step {k + 1}: {log}"
        assert float(log.scaler_scale) == 128.0 * 2.0**applied * 0.5**skipped, f"step {k + 1}"
    # Read again at the end: each record kept its own step's scale.
    a = s = 0
    for fault, log in zip(plan, logs):
        a, s = (a + 1, s) if fault is None else (a, s + 1)
        assert float(log.scaler_scale) == 128.0 * 2.0**a * 0.5**s
    assert state.updates == applied and state.steps == len(plan)


# ----------------------------------------------------------------------------- 3. skip semantics


def _bad_batch(kind, x, y, inject, loss_fn):
    if kind == "nan_loss":
        return x, torch.full_like(y, NAN)
    if kind == "nan_const":
        loss_fn.nan = True
        return x, y
    inject.mode = "inf_grad"
    return x, y


@pytest.mark.parametrize("kind", ["nan_loss", "nan_const", "inf_grad"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_skipped_step_is_a_perfect_no_op(precision, kind):
    (x0, y0), (x1, y1), (x2, y2) = make_batches(3, seed=3)

    def build():
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        st = AmpTrainState(model, opt, loss_fn, precision=precision, scheduler=sched,
                           scaler=dict(init_scale=256.0))
        return model, opt, sched, st

    loss_fn = FlakyLoss()

    model, opt, sched, state = build()
    inject = GradInjector(model[0].weight)
    assert not state.step(x0, y0).skipped  # creates AdamW state (exp_avg, exp_avg_sq, step)

    params0 = params_of(model)
    opt0 = opt_state_snapshot(opt)
    assert opt0[0]["exp_avg"].abs().sum() > 0
    lr0, epoch0 = opt.param_groups[0]["lr"], sched.last_epoch
    scale0 = float(state.scaler.scale_value())

    log = state.step(*_bad_batch(kind, x1, y1, inject, loss_fn))
    inject.mode = None
    loss_fn.nan = False
    assert isinstance(log, SkipLog) and log.skipped
    assert log.reason == ("non_finite_grad" if kind == "inf_grad" else "non_finite_loss")
    assert log.step == 2
    assert_params_equal(list(model.parameters()), params0)
    assert_opt_state_equal(opt0, opt_state_snapshot(opt))
    assert opt.param_groups[0]["lr"] == lr0 and sched.last_epoch == epoch0
    assert log.lr == lr0
    assert state.updates == 1 and state.steps == 2
    assert all(p.grad is None for p in model.parameters())
    expected_scale = scale0 * 0.5 if precision == "fp16" else 1.0
    assert float(log.scaler_scale) == expected_scale
    if kind == "inf_grad":
        assert not math.isfinite(float(log.grad_l2_pre_clip))
        assert log.grad_l2_post_clip is None
    else:
        assert log.grad_l2_pre_clip is None and log.grad_l2_post_clip is None

    # The next clean step proceeds normally: exactly as if the bad batch had never been seen.
    log = state.step(x2, y2)
    assert isinstance(log, StepLog) and not log.skipped
    assert log.step == 3 and state.updates == 2 and state.steps == 3
    assert log.lr == lr0 and sched.last_epoch == epoch0 + 1
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), params0))

    twin, _, _, twin_state = build()
    twin_state.step(x0, y0)
    twin_state.step(x2, y2)
    if precision == "fp16":  # the twin's scale did not back off: same maths up to a power of 2
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    else:
        assert_params_equal(model, twin)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_scheduler_on_skip_step_steps_the_scheduler(precision):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = AmpTrainState(model, opt, F.mse_loss, precision=precision, scheduler=sched,
                          scheduler_on_skip="step", scaler=dict(init_scale=256.0))
    (x0, y0), (x1, y1) = make_batches(2)
    assert not state.step(x0, y0).skipped
    params0 = params_of(model)
    lr0, epoch0 = opt.param_groups[0]["lr"], sched.last_epoch
    log = state.step(x1, torch.full_like(y1, NAN))
    assert log.skipped and log.reason == "non_finite_loss"
    assert log.lr == lr0
    assert sched.last_epoch == epoch0 + 1
    assert opt.param_groups[0]["lr"] == pytest.approx(lr0 * 0.5)
    assert_params_equal(list(model.parameters()), params0)
    assert state.updates == 1 and state.steps == 2


@pytest.mark.parametrize("kind", ["nan_target", "nan_const"])
def test_nan_loss_on_the_very_first_fp16_step(kind):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss_fn = FlakyLoss()
    state = AmpTrainState(model, opt, loss_fn, precision="fp16", scaler=dict(init_scale=256.0))
    params0 = params_of(model)
    (x, y), (x1, y1) = make_batches(2)
    if kind == "nan_target":
        y = torch.full_like(y, NAN)
    loss_fn.nan = kind == "nan_const"  # finite gradients: only the loss says "skip"
    log = state.step(x, y)
    loss_fn.nan = False
    assert isinstance(log, SkipLog)
    assert log.reason == "non_finite_loss"
    assert log.grad_l2_pre_clip is None and log.grad_l2_post_clip is None
    assert float(log.scaler_scale) == 128.0
    assert math.isnan(float(log.loss))
    assert log.step == 1 and state.steps == 1 and state.updates == 0
    assert_params_equal(list(model.parameters()), params0)
    assert all(len(s) == 0 for s in opt.state.values())
    assert all(p.grad is None for p in model.parameters())
    log = state.step(x1, y1)
    assert isinstance(log, StepLog) and log.step == 2 and state.updates == 1
    assert float(log.scaler_scale) == 128.0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_non_finite_loss_inside_an_accumulation_group_skips_the_group(precision):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = AmpTrainState(model, opt, F.mse_loss, precision=precision, accumulation_steps=3)
    params0 = params_of(model)
    b = make_batches(6)
    assert state.step(*b[0]) is None
    assert state.step(b[1][0], torch.full_like(b[1][1], INF)) is None
    log = state.step(*b[2])
    assert isinstance(log, SkipLog) and log.reason == "non_finite_loss" and log.step == 1
    assert not math.isfinite(float(log.loss))
    assert_params_equal(list(model.parameters()), params0)
    assert all(p.grad is None for p in model.parameters())
    assert float(log.scaler_scale) == (2.0**15 if precision == "fp16" else 1.0)
    # The next group is unaffected by the bad one.
    assert state.step(*b[3]) is None and state.step(*b[4]) is None
    log = state.step(*b[5])
    assert isinstance(log, StepLog) and log.step == 2 and state.updates == 1


@pytest.mark.parametrize("fault", ["inf_grad", "nan_grad"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_non_finite_grad_reason_and_norm(precision, fault):
    model = make_model()
    inject = GradInjector(model[2].bias)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision=precision)
    x, y = make_batches(1)[0]
    inject.mode = fault
    log = state.step(x, y)
    assert isinstance(log, SkipLog) and log.reason == "non_finite_grad"
    pre = float(log.grad_l2_pre_clip)
    assert math.isinf(pre) if fault == "inf_grad" else math.isnan(pre)
    assert log.grad_l2_post_clip is None
    assert state.updates == 0


# ----------------------------------------------------------------------------- 4. host reads


@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_at_most_one_host_read_per_step(precision, accum):
    model = make_model()
    inject = GradInjector(model[2].weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = AmpTrainState(model, opt, F.mse_loss, precision=precision, accumulation_steps=accum,
                          scheduler=sched, scaler=dict(init_scale=256.0))
    n_steps = 5
    batches = make_batches(n_steps * accum)
    kinds = []
    for i, (x, y) in enumerate(batches):
        closes = (i + 1) % accum == 0
        if i // accum == 2:  # step 3: a skip (non-finite grad) and ...
            inject.mode = "inf_grad" if closes else None
        if i // accum == 3 and closes:  # ... step 4: a skip (non-finite loss)
            y = torch.full_like(y, NAN)
        with HostReads() as reads:
            log = state.step(x, y)
        inject.mode = None
        if closes:
            assert log is not None
            assert reads.count == 1, f"micro-batch {i}: {reads.names}"
            kinds.append(log.reason)
        else:
            assert log is None
            assert reads.count == 0, f"micro-batch {i}: {reads.names}"
    assert kinds == [None, None, "non_finite_grad", "non_finite_loss", None]


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_the_steps_one_read_brings_the_records_loss_and_norms(precision):
    # the skip decision's read carries the values themselves: a sink reading the record reads
    # nothing again (fp16's scale after its update is told on the host from the scale and
    # growth tracker the read brought; bf16/fp32's is 1.0), and the loss and norms stay
    # tensors on the record all the same
    model = make_model()
    inject = GradInjector(model[2].weight)
    state = AmpTrainState(model, adamw(model), F.mse_loss, precision=precision, max_norm=0.5,
                          scaler=dict(init_scale=256.0) if precision == "fp16" else None)
    logs, reads_of_values = [], []
    for i, (x, y) in enumerate(make_batches(4)):
        inject.mode = "inf_grad" if i == 1 else None
        log = state.step(x, y if i != 2 else torch.full_like(y, NAN))
        with HostReads() as reads:
            values = log.values()
        logs.append(log)
        reads_of_values.append(reads.names)
        for name in ("loss", "grad_l2_pre_clip", "grad_l2_post_clip"):
            field = getattr(log, name)
            assert (field is None) == (values[name] is None)
            if field is not None:
                assert isinstance(field, torch.Tensor)
                assert values[name] == field.item() or (math.isnan(values[name]) and field.isnan())
    assert [log.reason for log in logs] == [None, "non_finite_grad", "non_finite_loss", None]
    assert reads_of_values == [[]] * 4
    assert [log.values()["scaler_scale"] for log in logs] == (
        [256.0, 128.0, 64.0, 64.0] if precision == "fp16" else [1.0] * 4)
    assert logs[1].values()["grad_l2_pre_clip"] == INF and logs[1].grad_l2_post_clip is None


def test_a_group_whose_finite_losses_overflow_when_summed_is_applied_as_the_loop_applies_it():
    # each micro-batch loss is finite, their sum is not: no loss was non-finite, so nothing is
    # skipped (the canonical loop applies it too, bit for bit); the record's loss reads inf
    def loss_fn(out, y):
        return out.sum() * 1e-3 + y

    model, ref = make_model(), make_model()
    state = AmpTrainState(model, adamw(model), loss_fn, precision="fp32", accumulation_steps=2)
    ref_opt = adamw(ref)
    x = torch.randn(4, 8)
    for y in (torch.tensor(3e38), torch.tensor(3e38)):
        log = state.step(x, y)
        (loss_fn(ref(x), y) / 2).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    assert not log.skipped and log.values()["loss"] == INF
    assert_params_equal(model, ref)
    assert state.updates == 1


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_finite_gradients_whose_global_norm_overflows_are_a_non_finite_grad_skip(precision):
    # DESIGN: the global norm is also the non-finite detector. Every gradient element finite
    # (about 1e20, which fp32 and bf16 hold), their squares' sum is not: the norm reads inf and
    # the step is a `non_finite_grad` skip, weights untouched (the canonical loop's clip factor
    # would be 0: it would apply an update from zeroed gradients). README's CSV table says so.
    def loss_fn(out, y):
        return out.sum() * 1e19

    model = make_model()
    before = copy.deepcopy(model.state_dict())
    state = AmpTrainState(model, adamw(model), loss_fn, precision=precision)
    x = torch.full((4, 8), 10.0)
    log = state.step(x, torch.zeros(()))
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads)  # dropped with the skip
    # the same gradients, computed again outside the guard: finite element by element
    loss_fn(model(x), None).backward()
    assert not ampguard.has_non_finite_grad(model.parameters())
    assert max(float(p.grad.abs().max()) for p in model.parameters()) > 1e19
    assert isinstance(log, SkipLog) and log.reason == "non_finite_grad"
    assert math.isinf(float(log.grad_l2_pre_clip)) and log.grad_l2_post_clip is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert state.updates == 0


def test_a_loss_of_shape_one_is_taken_as_a_scalar():
    model = make_model()
    state = AmpTrainState(model, adamw(model), lambda out, y: F.mse_loss(out, y).reshape(1), precision="bf16")
    x, y = make_batches(1)[0]
    log = state.step(x, y)
    assert log.step == 1 and not log.skipped and log.loss.shape == ()


# ----------------------------------------------------------------------------- 5. records


def test_records_fields_and_values():
    accum = 2
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    prec = Precision("fp16", "cpu")
    state = AmpTrainState(model, opt, F.mse_loss, precision="fp16", accumulation_steps=accum,
                          scheduler=sched, max_norm=0.3, scaler=dict(init_scale=512.0))
    batches = make_batches(6 * accum, seed=5)
    bad_step = 3
    logs, my_losses, lr_before = [], [], []
    group = []
    for i, (x, y) in enumerate(batches):
        if i // accum + 1 == bad_step and i % accum == 0:
            y = torch.full_like(y, NAN)
        with torch.no_grad(), prec.autocast():  # my own loss for this micro-batch
            group.append(F.mse_loss(model(x), y).float())
        if (i + 1) % accum == 0:
            lr_before.append(opt.param_groups[0]["lr"])
        log = state.step(x, y)
        if log is not None:
            logs.append(log)
            my_losses.append(sum(group) / accum)
            group = []

    assert [l.step for l in logs] == [1, 2, 3, 4, 5, 6]
    assert [l.skipped for l in logs] == [s == bad_step for s in range(1, 7)]
    assert [type(l) for l in logs] == [SkipLog if s == bad_step else StepLog for s in range(1, 7)]
    assert [l.reason for l in logs] == [("non_finite_loss" if s == bad_step else None) for s in range(1, 7)]
    # lr used by each step: 0.1 halved every 2 *applied* steps (held on the skip).
    applied_before = 0
    for l, seen in zip(logs, lr_before):
        assert l.lr == seen == pytest.approx(0.1 * 0.5 ** (applied_before // 2))
        applied_before += 0 if l.skipped else 1

    # the scale after each update, as the host told it from the step's read: the scaler's own
    # (512 halved by the skip at step 3; growth_interval 2000 is never reached)
    assert [l.scaler_scale for l in logs] == [512.0, 512.0, 256.0, 256.0, 256.0, 256.0] == [
        l.values()["scaler_scale"] for l in logs]
    assert logs[-1].scaler_scale == state.scaler.get_scale()
    for l, mine in zip(logs, my_losses):
        assert isinstance(l.loss, torch.Tensor) and isinstance(l.scaler_scale, float)
        if l.skipped:
            assert math.isnan(float(l.loss))
            assert l.grad_l2_pre_clip is None and l.grad_l2_post_clip is None
        else:
            torch.testing.assert_close(l.loss, mine, rtol=1e-6, atol=0)
            assert isinstance(l.grad_l2_pre_clip, torch.Tensor)
            assert isinstance(l.grad_l2_post_clip, torch.Tensor)
            assert float(l.grad_l2_post_clip) <= 0.3 + 1e-6
            assert float(l.grad_l2_post_clip) == pytest.approx(min(float(l.grad_l2_pre_clip), 0.3), rel=1e-5)
        vals = l.values()
        assert list(vals) == ["lr", "loss", "grad_l2_pre_clip", "grad_l2_post_clip", "scaler_scale"]
        for name, v in vals.items():
            field = getattr(l, name)
            if field is None:
                assert v is None
            else:
                assert isinstance(v, float)
                assert v == float(field) or (math.isnan(v) and math.isnan(float(field)))


def test_record_lr_is_the_lr_used_when_lr_is_a_tensor():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = AmpTrainState(model, opt, F.mse_loss, precision="bf16", scheduler=sched)
    logs = [state.step(x, y) for x, y in make_batches(3)]
    assert [l.values()["lr"] for l in logs] == pytest.approx([0.1, 0.05, 0.025])


# ----------------------------------------------------------------------------- 6. construction


def _state(**kw):
    model = make_model()
    return AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, **kw)


def test_autocast_device_must_match_the_model():
    with pytest.raises(ValueError, match="device"):
        _state(device="cuda")
    with pytest.raises(ValueError, match="device"):
        _state(precision=Precision("fp16", "cuda"))
    _state(device="cpu")  # matching is fine


def test_optimizer_device_must_match_the_model():
    model = make_model()
    stray = nn.Parameter(torch.zeros(2, device="meta"))
    opt = torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1)
    with pytest.raises(ValueError, match="optimizer"):
        AmpTrainState(model, opt, F.mse_loss)


@pytest.mark.parametrize("bad", [0, -1])
def test_accumulation_steps_must_be_positive(bad):
    with pytest.raises(ValueError, match="accumulation_steps"):
        _state(accumulation_steps=bad)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_scaler_enabled_is_refused_without_fp16(precision):
    with pytest.raises(ValueError):
        _state(precision=precision, scaler=dict(enabled=True))
    st = _state(precision=precision, scaler=dict(enabled=False))
    assert not st.scaler.is_enabled()


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        _state(precision="fp8")
    with pytest.raises(ValueError, match="scheduler_on_skip"):
        _state(scheduler_on_skip="later")
    with pytest.raises(ValueError, match="max_norm"):
        _state(max_norm=NAN)


def test_enabled_scaler_instance_is_refused_with_bf16():
    with pytest.raises(ValueError):
        _state(precision="bf16", scaler=GuardedGradScaler("cpu", init_scale=128.0))


# ----------------------------------------------------------------------------- 7. state_dict


def test_state_dict_round_trip_continues_identically():
    accum = 2
    kw = dict(init_scale=256.0, growth_interval=3)
    batches = make_batches(12 * accum, seed=11)

    def build(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return AmpTrainState(model, opt, F.mse_loss, precision="fp16", accumulation_steps=accum, scaler=kw)

    a = build(make_model())
    a_logs = []
    for i, (x, y) in enumerate(batches[: 5 * accum]):
        if i == 2 * accum + 1:  # step 3 skipped: the scale backs off and the growth tracker resets
            y = torch.full_like(y, NAN)
        log = a.step(x, y)
        if log is not None:
            a_logs.append(log)
    assert [l.skipped for l in a_logs] == [False, False, True, False, False]
    sd = a.state_dict()
    assert sd["step"] == 5 and sd["updates"] == 4

    b_model = copy.deepcopy(a.model)
    b = build(b_model)
    b.optimizer.load_state_dict(copy.deepcopy(a.optimizer.state_dict()))
    b.load_state_dict(copy.deepcopy(sd))
    assert b.steps == a.steps and b.updates == a.updates
    assert float(b.scaler.scale_value()) == float(a.scaler.scale_value())

    for x, y in batches[5 * accum:]:
        la, lb = a.step(x, y), b.step(x, y)
        assert (la is None) == (lb is None)
        if la is not None:
            assert la.step == lb.step and la.skipped == lb.skipped
            # equal scales across a growth point show the growth tracker was restored too
            assert float(la.scaler_scale) == float(lb.scaler_scale)
    assert a.steps == b.steps == 12 and a.updates == b.updates == 11
    assert float(a.scaler.scale_value()) == 256.0 * 0.5 * 2.0**3  # grew at steps 6, 9, 12
    assert_params_equal(a.model, b.model)


def test_state_dict_growth_tracker_matters():
    """Control for the round trip: a fresh state without the loaded tracker diverges in scale."""
    model = make_model()
    st = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=1e-3), F.mse_loss,
                       precision="fp16", scaler=dict(init_scale=256.0, growth_interval=3))
    b = make_batches(4)
    for x, y in b[:2]:
        st.step(x, y)
    sd = st.state_dict()
    assert sd["scaler"]["_growth_tracker"] == 2

    def fresh():
        m = copy.deepcopy(model)
        return AmpTrainState(m, torch.optim.SGD(m.parameters(), lr=1e-3), F.mse_loss,
                             precision="fp16", scaler=dict(init_scale=256.0, growth_interval=3))

    loaded = fresh()
    loaded.load_state_dict(sd)
    log = loaded.step(*b[2])
    assert log.step == 3 and float(log.scaler_scale) == 512.0  # third clean step in a row grows
    log = fresh().step(*b[2])  # without the state: step 1, tracker at 1, no growth
    assert log.step == 1 and float(log.scaler_scale) == 256.0


@pytest.mark.parametrize("other", ["bf16", "fp32"])
def test_load_state_dict_refuses_another_precision(other):
    src = _state(precision="fp16")
    src.step(*make_batches(1)[0])
    dst = _state(precision=other)
    with pytest.raises(ValueError, match="precision"):
        dst.load_state_dict(src.state_dict())
    assert dst.steps == 0


def test_load_state_dict_refuses_another_accumulation():
    src = _state(precision="bf16", accumulation_steps=2)
    dst = _state(precision="bf16", accumulation_steps=3)
    with pytest.raises(ValueError, match="accumulation"):
        dst.load_state_dict(src.state_dict())


def test_state_dict_inside_an_open_group_raises():
    st = _state(precision="bf16", accumulation_steps=3)
    b = make_batches(3)
    st.state_dict()  # between steps: fine
    st.step(*b[0])
    with pytest.raises(RuntimeError):
        st.state_dict()
    st.step(*b[1])
    with pytest.raises(RuntimeError):
        st.state_dict()
    st.step(*b[2])
    assert st.state_dict()["step"] == 1


def test_public_names():
    for name in ("AmpTrainState", "StepLog", "SkipLog", "clip_global_l2_norm", "has_non_finite_grad", "CsvSink"):
        assert hasattr(ampguard, name)


def test_optimizer_must_hold_only_the_models_parameters():
    model = make_model()
    stray = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        AmpTrainState(model, opt, F.mse_loss)


# ----------------------------------------------------------------------------- 8. the scale's floor
#
# A run that opens with a long streak of NaN losses: PyTorch's GradScaler halves its scale on
# every one, down to exactly 0 after ~150, and then every clean step is skipped as
# non_finite_grad (gradients unscaled by 1/0: inf x 0 = NaN). GuardedGradScaler clamps the scale
# to its floor ``min_scale`` instead. Tiny nn.Linear models: fp16 autocast on CPU is slow.


class NanFirst:
    """MSE, but NaN for the first ``k`` calls (the NaN flows through the graph)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = F.mse_loss(out, y)
        return loss * NAN if self.calls <= self.k else loss


def tiny_linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


def linear_batches(n: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)) for _ in range(n)]


TINY = torch.finfo(torch.float32).tiny


def test_floor_200_nan_losses_then_clean_steps_are_applied_and_the_scale_grows():
    k, growth_interval, clean = 200, 3, 9
    model = tiny_linear()
    before = params_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GuardedGradScaler("cpu", init_scale=2.0**16, growth_interval=growth_interval)  # default floor
    state = AmpTrainState(model, opt, NanFirst(k), precision="fp16", scaler=scaler)
    logs = [state.step(x, y) for x, y in linear_batches(k + clean)]
    bad, good = logs[:k], logs[k:]

    assert all(isinstance(log, SkipLog) and log.reason == "non_finite_loss" for log in bad)
    scales = [float(log.scaler_scale) for log in bad]
    assert scales == [max(2.0 ** (15 - i), TINY) for i in range(k)]  # halving, then held at the floor
    assert min(scales) == TINY > 0.0  # never 0, never a subnormal
    assert [log.step for log in logs] == list(range(1, k + clean + 1))

    # Clean data again: every step is applied (not non_finite_grad), the scale grows every 3.
    assert all(isinstance(log, StepLog) for log in good), [getattr(log, "reason", None) for log in good]
    assert [float(log.scaler_scale) for log in good] == [TINY * 2.0 ** ((i + 1) // growth_interval)
                                                         for i in range(clean)]
    assert state.updates == clean and state.steps == k + clean
    assert all(math.isfinite(float(log.grad_l2_pre_clip)) for log in good)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # At a scale of 2**-126 fp16 gradients underflow to 0: the applied SGD steps leave the weights
    # where they were (the floor in the config, scaler.min_scale = 1.0, keeps real gradients).
    assert_params_equal(model, before)


def test_floor_one_then_clean_steps_are_bit_for_bit_the_canonical_loop_from_scale_one():
    # With scaler.min_scale = 1.0 the scale stops at 1.0 (tracker reset by the last back-off):
    # from there the run is exactly PyTorch's canonical loop started at init_scale = 1.0.
    k, clean, growth_interval, max_norm = 40, 12, 4, 0.5
    model = tiny_linear()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = AmpTrainState(model, opt, NanFirst(k), precision="fp16", max_norm=max_norm,
                          scaler=dict(init_scale=2.0**16, growth_interval=growth_interval, min_scale=1.0))
    assert state.scaler.get_min_scale() == 1.0  # the dict reaches Precision.make_scaler
    batches = linear_batches(clean, seed=9)
    junk = linear_batches(k, seed=10)
    for x, y in junk:
        log = state.step(x, y)
        assert log.skipped and log.reason == "non_finite_loss"
    assert float(log.scaler_scale) == 1.0
    assert opt.state == {} and state.updates == 0  # skips touched nothing
    ours = [state.step(x, y) for x, y in batches]

    ref = tiny_linear()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=growth_interval)
    prec = Precision("fp16", "cpu")
    ref_scales = []
    for x, y in batches:
        with prec.autocast():
            loss = F.mse_loss(ref(x), y).float()
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        ref_scales.append(ref_scaler.get_scale())
    assert all(isinstance(log, StepLog) for log in ours)
    assert [float(log.scaler_scale) for log in ours] == ref_scales == [2.0 ** ((i + 1) // growth_interval)
                                                                       for i in range(clean)]
    assert_params_equal(model, ref)


def test_floor_collapse_and_skip_rate_guards_on_the_steps_records():
    from ampguard.monitor import FAIL_SCALE_COLLAPSE, FAIL_SKIP_RATE, RunMonitor

    model = tiny_linear()
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), NanFirst(10**6), precision="fp16",
                          scaler=dict(init_scale=2.0**16, min_scale=1.0))
    collapse = RunMonitor(window=1000, init_scale=2.0**16, min_scale=1.0, fail_on_scale_collapse=True,
                          fail_after=5, min_steps=10**6)
    rate = RunMonitor(window=1000, init_scale=2.0**16, min_scale=1.0, fail_rate=0.5, fail_after=3,
                      min_steps=10**6)
    events = {"collapse": [], "rate": []}
    for x, y in linear_batches(25):
        log = state.step(x, y)
        events["collapse"] += [(e.step, e.kind, e.cause) for e in collapse.observe(log)]
        events["rate"] += [(e.step, e.kind, e.cause) for e in rate.observe(log)]
    # 2**16 halves to the floor 1.0 at step 16 (skipped there: 1), the 5th such step is 20.
    assert events["collapse"] == [(16, "scale_alert", None), (20, "fail", FAIL_SCALE_COLLAPSE)]
    # Every loss is NaN (no scaler search: the loss is checked before it is scaled): the young
    # window's rate is 1.0 from step 1, the guard trips at step 3.
    assert events["rate"] == [(3, "fail", FAIL_SKIP_RATE), (16, "scale_alert", None)]
    assert float(state.scaler.scale_value()) == 1.0


def test_floor_survives_the_state_dict_round_trip_mid_streak():
    k = 12

    def build(loss_fn, scaler):
        model = tiny_linear()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        return AmpTrainState(model, opt, loss_fn, precision="fp16", scaler=scaler)

    batches = linear_batches(k + 8, seed=4)
    a = build(NanFirst(k), dict(init_scale=64.0, growth_interval=2, min_scale=2.0))
    for x, y in batches[:8]:  # 64 -> 2 after 5 back-offs; steps 6-8 held at the floor
        a.step(x, y)
    sd = copy.deepcopy(a.state_dict())
    assert sd["scaler"]["min_scale"] == 2.0 and sd["scaler"]["scale"] == 2.0
    b = build(NanFirst(k - 8), dict(init_scale=64.0, growth_interval=2))  # default floor, replaced on load
    b.model.load_state_dict(a.model.state_dict())
    b.load_state_dict(sd)
    assert b.scaler.get_min_scale() == 2.0
    la = [a.step(x, y) for x, y in batches[8:]]
    lb = [b.step(x, y) for x, y in batches[8:]]
    assert [(l.step, l.skipped, float(l.scaler_scale)) for l in la] == [
        (l.step, l.skipped, float(l.scaler_scale)) for l in lb]
    assert [float(l.scaler_scale) for l in la] == [2.0] * 4 + [2.0 * 2 ** ((i + 1) // 2) for i in range(8)]
    assert_params_equal(a.model, b.model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_records_post_clip_norm_is_the_device_clip_of_its_norm(dtype):
    # float32/float64 norms: the post-clip norm is computed on the host from the values the
    # step's read brought; a bfloat16 norm (an fp32 run of a bf16 model) keeps the device's.
    # Either way it is the value clip_factor gives on the device, and a tensor on the record.
    from ampguard.clipping import clip_factor

    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(dtype)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="fp32",
                          max_norm=0.05)
    log = state.step(torch.randn(16, 8, dtype=dtype), torch.randn(16, 4, dtype=dtype))
    expected = clip_factor(log.grad_l2_pre_clip, 0.05)[1].item()
    assert isinstance(log.grad_l2_post_clip, torch.Tensor) and log.grad_l2_post_clip.dtype == dtype
    assert log.values()["grad_l2_post_clip"] == log.grad_l2_post_clip.item() == expected
    assert log.values()["grad_l2_post_clip"] < log.values()["grad_l2_pre_clip"]  # it clipped


def test_a_threshold_past_float32s_largest_clips_nothing_and_runs():
    # the post-clip clamp used to convert max_norm to float32 and raise past its largest
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="bf16",
                          max_norm=1e300)
    values = state.step(torch.randn(16, 8), torch.randn(16, 4)).values()
    assert values["grad_l2_post_clip"] == values["grad_l2_pre_clip"] > 0


@pytest.mark.parametrize(("precision", "sync_free"), [("fp16", False), ("bf16", False), ("fp16", True), ("bf16", True)])
def test_every_stack_the_step_makes_is_of_one_dtype(precision, sync_free):
    """The one read (exact path) and the packed record (sync-free) are each one ``stack``: on a
    GPU a stack of one dtype is one kernel, a mixed one a copy kernel per input (PyTorch's
    cat_out_cuda). fp16's growth tracker (int32) rides cast to float32 for that reason."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Stacks(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("stack", "cat")):
                self.dtypes.append({t.dtype for t in args[0]})
            return func(*args, **(kwargs or {}))

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2) if sync_free else 1e-2, fused=True)
    state = AmpTrainState(model, opt, F.mse_loss, precision=precision, sync_free=sync_free,
                          scaler=dict(init_scale=256.0) if precision == "fp16" else None)
    batches = make_batches(3)
    state.step(*batches[0])  # (lazy initialisation first)
    with Stacks() as stacks:
        for x, y in batches[1:]:
            state.step(x, y).values()
    assert stacks.dtypes and all(len(d) == 1 for d in stacks.dtypes), stacks.dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_clip_at_every_step_is_bit_for_bit_the_canonical_loop(dtype):
    """Review 54f: the exact step takes the clip factor on the host from the norm it reads. With a
    threshold every step's norm exceeds (the factor applied each time, not 1), the weights must
    still be the canonical loop's, and the reported post-clip norm the device's own product."""
    from ampguard.clipping import clip_coefficient, post_clip_norm

    batches = [(x.to(dtype), y.to(dtype)) for x, y in make_batches(12)]
    ref = make_model(0).to(dtype)
    ref_opt = adamw(ref)
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    model = make_model(0).to(dtype)
    state = AmpTrainState(model, adamw(model), F.mse_loss, precision="fp32", max_norm=0.05)
    logs = [state.step(x, y) for x, y in batches]
    assert_params_equal(model, ref)
    for log in logs:
        pre = log.grad_l2_pre_clip
        assert pre.dtype == dtype and float(pre) > 0.05  # (clipped, by a factor below 1)
        expected = post_clip_norm(pre, clip_coefficient(pre, 0.05), 0.05)
        assert log.grad_l2_post_clip.dtype == dtype and torch.equal(log.grad_l2_post_clip, expected)
        assert log.values()["grad_l2_post_clip"] == expected.item()
