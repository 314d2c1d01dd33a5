"""CUDA checks: the same call sites on a GPU, bit-for-bit there too, and one host sync per step.

Skipped without a CUDA device (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
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
