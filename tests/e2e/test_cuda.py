"""CUDA checks: the same call sites on a GPU, bit-for-bit there too, and one host sync per step.

Skipped without a CUDA device (CI has none); run on a GPU machine with
``pytest tests/e2e/test_cuda.py`` (or ``bash benchmarks/gpu.sh``, which runs it with the GPU benchmarks).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ampguard import AmpTrainState, Precision

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()


def _data(n: int, spike_at: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g).cuda(), torch.randn(16, 8, generator=g).cuda()) for _ in range(n)]
    if spike_at is not None:
        x, y = data[spike_at]
        data[spike_at] = (x, y * 1e8)
    return data


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("fused", [False, True])
def test_bit_for_bit_with_the_canonical_loop_on_cuda(precision: str, accumulation: int, fused: bool) -> None:
    steps = 20
    data = _data(steps * accumulation, spike_at=5 * accumulation)

    mine = _model()
    opt = torch.optim.AdamW(mine.parameters(), lr=1e-2, fused=fused)
    state = AmpTrainState(mine, opt, nn.functional.mse_loss, precision=precision, accumulation_steps=accumulation)
    my_scales, my_skips = [], []
    for x, y in data:
        record = state.step(x, y)
        if record is not None:
            my_scales.append(record.values()["scaler_scale"])
            my_skips.append(record.skipped)

    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    ctx = Precision(precision, "cuda")
    ref_scales = []
    for i, (x, y) in enumerate(data):
        with ctx.autocast():
            loss = nn.functional.mse_loss(ref(x), y).float()
        scaler.scale(loss / accumulation).backward()
        if (i + 1) % accumulation == 0:
            scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad(set_to_none=True)
            ref_scales.append(scaler.get_scale() if precision == "fp16" else 1.0)

    assert my_scales == ref_scales
    assert my_skips[5] == (precision == "fp16")
    for a, b in zip(mine.parameters(), ref.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_one_host_sync_per_step(precision: str, accumulation: int) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = AmpTrainState(model, opt, nn.functional.mse_loss, precision=precision, accumulation_steps=accumulation)
    data = _data(4 * accumulation, spike_at=accumulation)  # a skipped step among them
    for x, y in data[:accumulation]:  # warm-up: lazy initialisation happens outside the count
        state.step(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = [state.step(x, y) for x, y in data[accumulation:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    closed = [r for r in records if r is not None]
    assert len(closed) == 3
    assert len(syncs) == len(closed), [str(w.message) for w in syncs]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_exact_path_csv_rows_cost_no_sync_beyond_the_steps_read(tmp_path, precision: str) -> None:
    # the step's one read brings the loss and norms over with the skip decision, and fp16's
    # scale and growth tracker, from which the host tells the scale after the update: writing
    # the row reads nothing more from the GPU
    from ampguard import CsvSink

    model = _model()
    state = AmpTrainState(model, torch.optim.AdamW(model.parameters(), lr=1e-3), nn.functional.mse_loss,
                          precision=precision)
    sink = CsvSink(tmp_path / "steps.csv")
    data = _data(6, spike_at=3)  # a skip among them in fp16
    sink.write(state.step(*data[0]))  # warm-up: lazy initialisation outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in data[1:]:
                sink.write(state.step(x, y))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sink.close()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 5, [str(w.message) for w in syncs]
    assert len((tmp_path / "steps.csv").read_text().splitlines()) == 7


def test_stepping_an_optimizer_that_got_no_gradients_on_cuda() -> None:
    # a GAN's discriminator loss on fake.detach(): the generator's optimizer has no gradients;
    # its norm is a zero on the GPU (it was a CPU zero, which the step's stack refused)
    from ampguard import Guard

    gen, disc = _model(), nn.Linear(8, 1).cuda()
    guard = Guard([gen, disc], {"discriminator": torch.optim.SGD(disc.parameters(), lr=0.1),
                                "generator": torch.optim.SGD(gen.parameters(), lr=0.1)}, precision="bf16")
    x, _ = _data(1)[0]
    with guard.autocast():
        loss = disc(gen(x).detach()).float().mean()
    guard.backward(loss)
    record = guard.step()
    assert not record.skipped and record.values()["grad_l2_pre_clip"] > 0


def test_autocast_device_must_match_the_model() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not match"):
        AmpTrainState(model, opt, nn.functional.mse_loss, device="cpu")
    with pytest.raises(ValueError, match="does not match"):
        AmpTrainState(model, opt, nn.functional.mse_loss, precision=Precision("fp16", "cpu"))


def test_demo_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from ampguard.cli import main

    assert main(["demo", "--device", "cuda"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("STEP", "SKIP"))]
    assert len(lines) == 20
    assert [line.split()[0] for line in lines].count("SKIP") == 1 and lines[4].startswith("SKIP 5 ")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_sync_free_path_makes_no_host_sync_at_all(tmp_path, precision: str) -> None:
    import csv
    import math

    from ampguard import BackgroundSink, CsvSink

    def schedule(updates: torch.Tensor) -> torch.Tensor:
        return 0.5 * (1 + torch.cos(math.pi * torch.clamp(updates, max=50.0) / 50.0))

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device="cuda"), fused=True)
    state = AmpTrainState(model, opt, nn.functional.mse_loss, precision=precision, accumulation_steps=2,
                          sync_free=True, lr_schedule=schedule)
    data = _data(2 * 8, spike_at=2 * 3)  # step 4 overflows in fp16
    nan_x, nan_y = data[2 * 5]
    data[2 * 5] = (nan_x, nan_y * float("nan"))  # step 6: a non-finite loss
    sink = BackgroundSink(CsvSink(tmp_path / "steps.csv"))
    for x, y in data[:2]:  # warm-up: lazy initialisation (optimizer state, scaler) outside the check
        record = state.step(x, y)
    sink.write(record)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data[2:]:
            record = state.step(x, y)
            if record is not None:
                sink.write(record)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sink.close()
    rows = list(csv.DictReader((tmp_path / "steps.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    skips = {int(r["step"]): r["skip_reason"] for r in rows if r["skipped"] == "1"}
    assert skips == ({4: "non_finite_grad", 6: "non_finite_loss"} if precision == "fp16" else {6: "non_finite_loss"})
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[4] == lrs[3] if precision == "fp16" else lrs[4] < lrs[3]  # held after the skip at step 4
    assert lrs[6] == lrs[5]  # held after the skip at step 6
    assert state.updates == 8 - len(skips)


def test_sync_free_with_a_constant_host_tensor_lr(tmp_path) -> None:
    # AdamW(params, lr=torch.tensor(1e-3), fused=True), the refusal message's own example: a host
    # tensor; with no schedule nothing moved it, and the record's stack refused host with CUDA
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3), fused=True)
    state = AmpTrainState(model, opt, nn.functional.mse_loss, precision="bf16", sync_free=True)
    for x, y in _data(3):
        record = state.step(x, y)
    assert record.values()["lr"] == pytest.approx(1e-3) and opt.param_groups[0]["lr"].device.type == "cuda"
    assert state.updates == 3


# ---------------------------------------------------------------------------- ampguard train's fast path


def _trainer(tmp_path, **settings):
    from ampguard.config import validate
    from ampguard.run_folder import RunPaths
    from ampguard.trainer import Trainer

    config = validate({"task": {"name": "linear"}, "steps": 12, "device": "cuda",
                       "log": {"dir": str(tmp_path), "name": "a"}, **settings})
    return Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=1, stats_every=None,
                   print_fn=lambda line: None, progress=False, resume=None)


def test_train_takes_the_fast_path_on_cuda_and_its_step_never_syncs(tmp_path) -> None:
    trainer = _trainer(tmp_path)
    assert trainer.fast and trainer.state.sync_free and trainer.state.optimizer.defaults["fused"]
    trainer._open()
    with trainer.watching():  # the first step: lazy state, backward's order
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            with trainer.watching():
                record = trainer.train_step()
            trainer.inflight.add(record, None)  # the host copy starts: no sync either
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [r.step for r, _ in trainer.inflight.drain()] == [2, 3, 4, 5]
    trainer.sinks.close()
    trainer.events.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_train_fast_and_exact_paths_decide_alike_on_cuda(tmp_path, precision) -> None:
    from helpers import read_events, read_rows, train

    common = ("--set", "task.name=linear", "--set", "device=cuda", "--set", f"precision={precision}",
              "--set", "steps=30", "--set", "schedule.warmup=5", "--set", "checkpoint.enabled=false",
              "--inject", "nan_loss@7", "--inject", "inf_grad@12", "--inject", "inf_grad@13")
    rows = {}
    for fast in ("null", "false"):
        code, out, err = train(tmp_path, f"f-{fast}", *common, "--set", f"fast={fast}")
        assert code == 0, err
        rows[fast] = read_rows(tmp_path / f"f-{fast}" / "steps.csv")
        start = [e for e in read_events(tmp_path / f"f-{fast}" / "events.jsonl") if e["event"] == "run_start"][0]
        assert ("fast path" in start["message"]) == (fast == "null")
    for a, b in zip(rows["null"], rows["false"], strict=True):
        assert (a["step"], a["skipped"], a["skip_reason"], a["scaler_scale"]) == \
            (b["step"], b["skipped"], b["skip_reason"], b["scaler_scale"])
        assert float(a["lr"]) == pytest.approx(float(b["lr"]), rel=1e-6)
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-3, nan_ok=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_fused_tail_decides_like_the_eager_one_on_cuda(precision) -> None:
    runs = {}
    for fuse in (False, True):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), fused=True)
        state = AmpTrainState(model, opt, nn.functional.mse_loss, precision=precision, sync_free=True,
                              fuse_tail=fuse, scaler=dict(init_scale=1024.0) if precision == "fp16" else None)
        data = _data(12, spike_at=4)
        data[8] = (data[8][0], data[8][1] * float("nan"))
        records = [state.step(x, y) for x, y in data]
        runs[fuse] = (model, [r.values() for r in records], [r.reason for r in records])
    (m0, v0, r0), (m1, v1, r1) = runs[False], runs[True]
    assert r0 == r1 and r1[8] == "non_finite_loss"
    assert [v["scaler_scale"] for v in v0] == [v["scaler_scale"] for v in v1]
    for a, b in zip(m0.parameters(), m1.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_post_clip_norm_is_the_gpus_bit_for_bit(dtype: torch.dtype) -> None:
    # the exact step computes the post-clip norm on the host from the norm and clip factor its
    # read brought: it must be the GPU's multiply and clamp, over the whole range of norms
    import math

    from ampguard.clipping import clip_coefficient, post_clip_norm, post_clip_value

    g = torch.Generator().manual_seed(0)
    exponents = torch.empty(20000, dtype=torch.float64).uniform_(-45, 38, generator=g)
    pre = ((10 ** exponents) * torch.empty(20000, dtype=torch.float64).uniform_(1, 10, generator=g)).to(dtype).cuda()
    for max_norm in (1.0, 0.5, 3.3, 1e30, 1e300):
        factor = clip_coefficient(pre, max_norm)
        device = post_clip_norm(pre, factor, max_norm).tolist()
        host = [post_clip_value(p, f, max_norm, dtype) for p, f in zip(pre.tolist(), factor.tolist())]
        bad = [(p, d, h) for p, d, h in zip(pre.tolist(), device, host) if not (d == h or math.isnan(d) and math.isnan(h))]
        assert not bad, (max_norm, bad[:3])


def test_the_host_scale_after_update_is_the_gpus_bit_for_bit() -> None:
    # the exact step tells fp16's scale after update() on the host: it must be the CUDA
    # kernel's (products in double, rounded to float32 once; growth only if finite; the floor)
    import random

    from ampguard.precision import GuardedGradScaler

    rng = random.Random(7)
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    huge = torch.finfo(torch.float32).max
    for growth, backoff, interval, floor in [(2.0, 0.5, 2, 2.0**-126), (1.7, 0.37, 2, 0.1), (1e30, 1e-30, 1, 1.0)]:
        scaler = GuardedGradScaler("cuda", init_scale=max(floor, 1.0), growth_factor=growth, backoff_factor=backoff,
                                   growth_interval=interval, min_scale=floor)
        scaler._lazy_init_scale_growth_tracker(torch.device("cuda"))
        for scale in [huge, floor, 2.0**-126] + [2.0 ** rng.uniform(-130, 127) for _ in range(150)]:
            for tracker in range(interval):
                for found in (False, True):
                    scaler._scale.fill_(scale)
                    scaler._growth_tracker.fill_(tracker)
                    predicted = scaler.scale_after([t.item() for t in scaler.update_inputs(torch.device("cuda"))], found)
                    scaler.add_found_inf_(opt, torch.tensor(float(found), device="cuda"))
                    scaler.update()
                    assert predicted == scaler.get_scale(), (scale, tracker, found, growth, backoff, floor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_clip_factor_is_the_gpus_bit_for_bit(dtype: torch.dtype) -> None:
    # review 54f: the exact step takes the clip factor on the host from the norm it read
    # (clip_coefficient_value) and multiplies the gradients by it as a Python float (the
    # foreach kernel's scalar argument): the value must be the GPU's four operations' (its
    # reciprocal the IEEE quotient), and the float's multiply the factor tensor's
    from ampguard.clipping import GradSet, clip_coefficient, clip_coefficient_value

    g = torch.Generator().manual_seed(0)
    exponents = torch.empty(200000, dtype=torch.float64).uniform_(-46, 38.5, generator=g)
    pre = ((10 ** exponents) * torch.rand(200000, dtype=torch.float64, generator=g)).to(dtype)
    pre = torch.cat([pre, torch.tensor([0.0, 1e-45, 1e-7, 0.999999, 1.0, 16.0, 32.0, 1e30, 3e38,
                                        torch.finfo(torch.float32).max], dtype=dtype)])
    norms = pre.tolist()
    for max_norm in (1.0, 0.5, 1e-3, 3.3, 1e30, 3.4e38):
        device = clip_coefficient(pre.cuda(), max_norm).tolist()
        bad = [(v, d) for v, d in zip(norms, device) if clip_coefficient_value(v, max_norm, dtype) != d]
        assert not bad, (max_norm, len(bad), bad[:3])

    model = _model().to(dtype)
    x, y = _data(1)[0]
    for scale in (10.0, 1e3, 1e6):
        model.zero_grad()
        (nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)) * scale).backward()
        by_float = [p.grad.clone() for p in model.parameters()]
        grads = GradSet(list(model.parameters()))
        pre = grads.norm()
        factor = clip_coefficient(pre, 0.3)
        grads.scale_(factor)  # (the device's factor tensor)
        by_tensor = [p.grad for p in model.parameters()]
        for p, grad in zip(model.parameters(), by_float):
            p.grad = grad
        GradSet(list(model.parameters())).scale_(clip_coefficient_value(pre.item(), 0.3, dtype))  # (a Python float)
        assert factor.item() < 1.0
        assert all(torch.equal(a, b) for a, b in zip(by_tensor, by_float))


def test_a_clipped_run_is_bit_for_bit_the_canonical_loop_on_cuda() -> None:
    # review 54f: every step clipped, its factor taken on the host: the weights are still the
    # canonical loop's with clip_grad_norm_
    data = _data(20)
    mine = _model()
    state = AmpTrainState(mine, torch.optim.AdamW(mine.parameters(), lr=1e-2), nn.functional.mse_loss,
                          precision="fp32", max_norm=0.05)
    records = [state.step(x, y) for x, y in data]
    assert all(r.values()["grad_l2_pre_clip"] > 0.05 for r in records)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ctx = Precision("fp32", "cuda")
    for x, y in data:
        with ctx.autocast():
            loss = nn.functional.mse_loss(ref(x), y).float()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), ref.parameters()))
