"""The sync-free path: no host read per step, the same decisions as the default path."""

from __future__ import annotations

import csv
import functools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import HostReads
from torch import nn

from ampguard import AmpTrainState, BackgroundSink, CsvSink
from ampguard.records import PendingStep, SkipLog, StepLog
from ampguard.schedule import DeviceLambdaLR

STEPS = 20
HORIZON = 20.0


def factor_py(updates: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(updates, HORIZON) / HORIZON))


def factor_t(updates: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.cos(math.pi * torch.clamp(updates, max=HORIZON) / HORIZON))


def _data(accumulation: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(STEPS * accumulation)]
    spike, nan = 4 * accumulation, 10 * accumulation  # steps 5 and 11
    data[spike] = (data[spike][0], data[spike][1] * 1e8)  # an fp16 overflow (finite in bf16/fp32)
    data[nan] = (data[nan][0], data[nan][1] * float("nan"))  # a non-finite loss everywhere
    return data


def _run(sync_free: bool, precision: str, accumulation: int, fuse_tail: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    scaler = dict(init_scale=1024.0) if precision == "fp16" else None
    if sync_free:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        state = AmpTrainState(model, opt, F.mse_loss, precision=precision, accumulation_steps=accumulation,
                              scaler=scaler, sync_free=True, lr_schedule=factor_t, fuse_tail=fuse_tail)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor_py)
        state = AmpTrainState(model, opt, F.mse_loss, precision=precision, accumulation_steps=accumulation,
                              scaler=scaler, scheduler=sched)
    records, reads = [], []
    for x, y in _data(accumulation):
        with HostReads() as counter:
            record = state.step(x, y)
        if record is not None:
            records.append(record)
            reads.append(counter.count)
    return model, records, reads, state


@pytest.fixture(scope="module")
def run():
    """``run(sync_free, precision, accumulation)``: :func:`_run`'s result, made once for the module's
    tests, which only read it (the sync-free fp16 run of 20 steps was made four times, the default
    path's twice, the sync-free bf16 run twice)."""
    return functools.cache(_run)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_same_decisions_as_the_default_path_and_no_host_read(run, precision, accumulation):
    ref_model, ref, ref_reads, ref_state = run(False, precision, accumulation)
    model, fast, reads, state = run(True, precision, accumulation)
    assert reads == [0] * STEPS  # not one value read back during the steps
    assert set(ref_reads) == {1}  # the default path reads the skip decision, once
    assert all(isinstance(r, PendingStep) for r in fast)
    assert [r.skipped for r in fast] == [r.skipped for r in ref]
    assert [r.reason for r in fast] == [r.reason for r in ref]
    expected = {5: "non_finite_grad", 11: "non_finite_loss"} if precision == "fp16" else {11: "non_finite_loss"}
    assert {r.step: r.reason for r in fast if r.skipped} == expected
    assert [r.values()["scaler_scale"] for r in fast] == [r.values()["scaler_scale"] for r in ref]
    for a, b in zip(model.parameters(), ref_model.parameters()):  # fp32 lr tensor vs float lr
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert state.updates == ref_state.updates == STEPS - len(expected)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_compiled_tail_makes_the_same_decisions(run, precision):
    """fuse_tail: the tail through torch.compile (Inductor's C++ on a CPU) skips the same steps,
    reports the same scales, clips to the same norms and lands on the same weights (to rounding)."""
    eager_model, eager, _, _ = run(True, precision, 1)
    model, fused, reads, state = _run(True, precision, 1, fuse_tail=True)
    assert reads == [0] * STEPS
    assert [r.reason for r in fused] == [r.reason for r in eager] and any(r.skipped for r in fused)
    for a, b in zip(fused, eager):
        va, vb = a.values(), b.values()
        assert va["scaler_scale"] == vb["scaler_scale"] and va["lr"] == vb["lr"]
        for key in ("loss", "grad_l2_pre_clip", "grad_l2_post_clip"):
            assert (va[key] is None and vb[key] is None) or va[key] == pytest.approx(vb[key], rel=1e-4, nan_ok=True)
    for a, b in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    plain = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="fuse_tail compiles the sync-free"):
        AmpTrainState(plain, torch.optim.SGD(plain.parameters(), lr=0.1), F.mse_loss, precision="bf16", fuse_tail=True)


def test_the_compiled_tail_is_not_compiled_again_for_each_max_norm():
    # review 61d: max_norm went into the compiled tail as a number, a constant dynamo specialises the
    # graph on, so each value set between steps (or another guard's) compiled it again, and the
    # ninth raised FailOnRecompileLimitHit out of step() (fullgraph=True). Now a tensor, an input.
    # (After test_the_compiled_tail_makes_the_same_decisions the first step hits its compile: ~0.1 s)
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), fused=True)
    guard = AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True, fuse_tail=True)
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    assert not guard.step(x, y).skipped  # (max_norm 1.0: the tail compiled, or found compiled)
    graphs = counters["stats"]["unique_graphs"]
    factors = []
    for max_norm in (0.5, 0.25, 1e-3):
        guard.max_norm = max_norm
        record = guard.step(x, y).values()
        factors.append(record["grad_l2_post_clip"] / record["grad_l2_pre_clip"])
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    assert factors[2] < factors[1] < factors[0] <= 1  # (each threshold clips as set)


def test_lr_schedule_is_refused_without_sync_free_or_beside_a_device_scheduler():
    # review 33d: without sync_free it was ignored (a warm-up trained at the full LR from step 1)
    from ampguard.schedule import DeviceLambdaLR

    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="lr_schedule sets the sync-free step's LR on the device: pass sync_free=True"):
        AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="bf16",
                      lr_schedule=factor_t)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    with pytest.raises(ValueError, match="takes lr_schedule= or a DeviceLambdaLR as scheduler=, not both"):
        AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True, lr_schedule=factor_t,
                      scheduler=DeviceLambdaLR(opt, factor_py, factor_t))


def test_a_resume_that_loads_the_optimizer_before_the_guard_keeps_the_schedules_base_lr():
    # review 33d: the base was the group's LR when the guard was built, the schedule's decayed one
    # after a load, so the factor applied twice for the rest of the run; now initial_lr, saved with
    # the optimizer's state as torch's schedulers keep it
    def built(model, opt):
        return AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True, lr_schedule=factor_t)

    def make():
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        return model, torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)

    x, y = torch.randn(4, 2), torch.randn(4, 1)
    model, opt = make()
    state = built(model, opt)
    lrs = [state.step(x, y).values()["lr"] for _ in range(6)]
    model, opt = make()
    state = built(model, opt)
    for _ in range(3):
        state.step(x, y)
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "guard": state.state_dict()}
    model, opt = make()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])  # the optimizer first, then the guard: the usual resume order
    state = built(model, opt)
    state.load_state_dict(saved["guard"])
    assert [state.step(x, y).values()["lr"] for _ in range(3)] == lrs[3:]
    assert lrs[3] < lrs[2]  # (the schedule moves: a base taken from the decayed LR would show)


def test_the_lr_schedule_holds_on_skipped_steps(run):
    _, fast, _, _ = run(True, "fp16", 1)
    lrs = [r.values()["lr"] for r in fast]
    applied_before = 0
    for record, lr in zip(fast, lrs):
        assert lr == pytest.approx(1e-2 * factor_py(applied_before), rel=1e-6)
        applied_before += not record.skipped
    assert lrs[5] == lrs[4] and lrs[11] == lrs[10]  # the step after a skip runs at the same lr


def test_a_skipped_step_leaves_parameters_and_optimizer_state_alone():
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    state = AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    state.step(x, y)
    params = [p.detach().clone() for p in model.parameters()]
    moments = {k: v.clone() for k, v in opt.state[model.weight].items()}
    record = state.step(x, y * float("nan"))
    assert record.skipped and record.reason == "non_finite_loss"
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    assert all(torch.equal(moments[k], v) for k, v in opt.state[model.weight].items())
    assert all(p.grad is None for p in model.parameters())
    assert state.steps == 2 and state.updates == 1


def test_pending_steps_resolve_and_write_the_same_csv(run, tmp_path):
    _, ref, _, _ = run(False, "fp16", 1)
    _, fast, _, _ = run(True, "fp16", 1)
    resolved = [r.resolve() for r in fast]
    assert [type(r) for r in resolved] == [type(r) for r in ref]
    assert all(isinstance(r, (StepLog, SkipLog)) for r in resolved)
    paths = []
    for name, records in (("ref", ref), ("fast", fast)):
        sink = BackgroundSink(CsvSink(tmp_path / f"{name}.csv"))
        for record in records:
            sink.write(record)
        sink.close()
        paths.append(tmp_path / f"{name}.csv")
    rows = [list(csv.DictReader(p.open())) for p in paths]
    for a, b in zip(*rows):
        for column in ("step", "skipped", "skip_reason", "scaler_scale", "grad_l2_post_clip"):
            assert a[column] == b[column], column
        if a["grad_l2_pre_clip"] in ("", "inf", "nan"):
            assert a["grad_l2_pre_clip"] == b["grad_l2_pre_clip"]


@pytest.mark.parametrize(
    ("make", "kwargs", "match"),
    [
        (lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.1)), {}, "found_inf"),  # not fused
        (lambda p: torch.optim.AdamW(p, lr=0.1, fused=True), {}, "tensor learning rates"),
        (lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.1), fused=True), {"scheduler": SimpleNamespace(step=lambda: None)}, "lr_schedule"),
    ],
)
def test_what_the_sync_free_path_needs_is_checked_up_front(make, kwargs, match):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        AmpTrainState(model, make(model.parameters()), F.mse_loss, precision="bf16", sync_free=True, **kwargs)


@pytest.mark.parametrize(("max_norm", "dtype"), [(0.05, torch.float32), (1e6, torch.float32), (None, torch.float32),
                                                 (0.05, torch.float64), (0.05, torch.bfloat16)])
def test_the_post_clip_norm_is_the_devices_whether_the_host_or_the_device_computes_it(max_norm, dtype):
    """The record's post-clip norm is ``min(pre x factor, max_norm)`` as the device rounds it:
    for a float32/float64 norm the host computes it from the factor the record carries (the
    field stays None until read; two kernels fewer), for another dtype (a bf16 model's norm) the
    device does; with clipping off it is the pre-clip norm. Against the device's own operations
    on the values read, bit for bit, and against the exact path's record of the same step."""
    from ampguard.clipping import clip_coefficient, post_clip_norm

    def run(sync_free):
        torch.manual_seed(0)
        model = nn.Linear(8, 2).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2) if sync_free else 1e-2, fused=True)
        state = AmpTrainState(model, opt, F.mse_loss, precision="fp32", max_norm=max_norm, sync_free=sync_free)
        g = torch.Generator().manual_seed(3)
        return [state.step(torch.randn(4, 8, generator=g, dtype=dtype), torch.randn(4, 2, generator=g, dtype=dtype))
                for _ in range(4)]

    fast, exact = run(True), run(False)
    for record in fast:
        host = dtype in (torch.float32, torch.float64) and max_norm is not None
        assert (record.grad_l2_post_clip is None) == host
        values = record.values()
        pre = torch.tensor(values["grad_l2_pre_clip"], dtype=dtype)
        factor = clip_coefficient(pre, max_norm)
        expected = pre if factor is None else post_clip_norm(pre, factor, max_norm)
        assert values["grad_l2_post_clip"] == expected.item()
    # (the first step: later the float32 LR tensor and the float LR update a float64 model apart)
    assert fast[0].values()["grad_l2_post_clip"] == exact[0].values()["grad_l2_post_clip"]
    if max_norm == 0.05:
        assert all(r.values()["grad_l2_post_clip"] < r.values()["grad_l2_pre_clip"] for r in fast)  # it clipped


def test_a_param_group_added_mid_run_gets_the_schedule():
    # progressive unfreezing on the sync-free path: the added group's LR is its own base times the
    # schedule's factor (the zip with the base LRs read at Guard() left it at its base); the added
    # parameters' checks are the default path's (tests/unit/test_guard.py)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model[2].parameters(), lr=torch.tensor(1e-2), fused=True)
    state = AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True, lr_schedule=factor_t)
    data = _data(1)
    for x, y in data[:2]:
        state.step(x, y)
    model[0].requires_grad_(True)
    opt.add_param_group({"params": list(model[0].parameters()), "lr": torch.tensor(4e-2)})
    for x, y in data[2:4]:  # two updates before the third step, three before the fourth
        record = state.step(x, y)
    assert not record.skipped
    assert float(opt.param_groups[1]["lr"]) == pytest.approx(4e-2 * factor_py(3), rel=1e-6)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(1e-2 * factor_py(3), rel=1e-6)


def test_the_count_of_applied_updates_is_exact_past_2_24_and_so_is_its_checkpoint():
    # review 55b: the count was a float32 tensor: 2**24 + 1 rounds to 2**24, so from 16,777,216
    # updates on the count (and the LR it drives) stood still, was saved as 16,777,216, and a
    # larger count set or loaded was rounded (2**24 + 3 read back 2**24 + 4). A user's
    # lr_schedule gets a float32 copy again (review 55n F3): the int64 count itself drives a
    # DeviceLambdaLR's device function
    start = 2**24 - 2

    def make():
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.5), fused=True)
        # a factor that moves by 1/8 with each update from ``start`` (exact: the LRs compare equal)
        schedule = DeviceLambdaLR(opt, lambda updates: max(updates - start, 0) * 0.125 + 0.5,
                                  lambda updates: (updates - start) * 0.125 + 0.5)
        return AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True, scheduler=schedule)

    state = make()
    state.steps = state.updates = start  # (what a resume from a checkpoint of that count sets)
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    records = [state.step(x, y * (float("nan") if i == 2 else 1.0)) for i in range(5)]
    assert [r.skipped for r in records] == [False, False, True, False, False]
    # the LR of each step is the schedule at the count before it: held on the skip, moving past 2**24
    assert [r.values()["lr"] for r in records] == [0.5 * (0.5 + 0.125 * k) for k in (0, 1, 2, 2, 3)]
    assert state.updates == start + 4 == 2**24 + 2
    saved = state.state_dict()
    assert saved["updates"] == 2**24 + 2
    resumed = make()
    resumed.load_state_dict(saved)
    assert resumed.updates == 2**24 + 2
    assert resumed.step(x, y).values()["lr"] == 0.5 * (0.5 + 0.125 * 4)
    resumed.updates = 2**24 + 3
    assert resumed.updates == 2**24 + 3


FLOOR, T = 0.1, 4


@pytest.mark.parametrize("schedule", [
    lambda u: torch.maximum(u.new_tensor(FLOOR), 1 - u / T),
    lambda u: torch.maximum(torch.full_like(u, FLOOR), 1 - u / T),
    lambda u: torch.minimum(torch.tensor(0.5, dtype=u.dtype, device=u.device), (u + 1) / 2),
    lambda u: u.clone().add_(1).div_(2).clamp_(max=1.0),
], ids=["new_tensor", "full_like", "dtype", "in_place"])
def test_a_schedule_that_takes_its_constants_from_the_counts_dtype_gets_the_lrs_it_got_before(schedule):
    # review 55n F3: with the count int64 (review 55b) u.new_tensor(0.1) and full_like(u, 0.1)
    # were 0, a floor of 0.1 an LR of 0.0 (dtype=u.dtype the same), silently, and an in-place
    # division raised mid-step; the schedule gets a float32 count, as before the int64 one
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1.0), fused=True)
    state = AmpTrainState(model, opt, F.mse_loss, precision="bf16", sync_free=True, lr_schedule=schedule)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    lrs = [state.step(x, y).values()["lr"] for _ in range(7)]
    assert lrs == [float(schedule(torch.tensor(float(k)))) for k in range(7)]
    assert min(lrs) > 0.0
