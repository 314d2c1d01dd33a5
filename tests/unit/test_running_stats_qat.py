"""A skipped step puts back what a quantization-aware training forward wrote, as it puts back
BatchNorm's statistics (``watch.RunningStats``): review 55m found that in a ``prepare_qat`` model
one NaN batch the guard skipped left NaN in the fake-quantizers' observers (``min_val``,
``max_val``, then ``scale``), so every later forward was NaN, every later step skipped and every
evaluation NaN: the run was dead. The observers of a step the guard applies are the plain loop's,
bit for bit; a skipped step's are as the step found them, a per-channel observer's empty
``tensor([])`` too (its first observation resizes it)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.ao.quantization as tq
import torch.nn.functional as F
from torch import nn

from ampguard import Guard

D = 6

_FAKE_QUANT = tq.QConfig(  # (torch's unfused FakeQuantize: the fused kernel refuses a bf16/fp16 input)
    activation=tq.FakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, quant_min=0, quant_max=255),
    weight=tq.FakeQuantize.with_args(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                     quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric))


def _qat(qconfig: str = "x86") -> nn.Module:
    """A tiny QAT model: "x86", torch's default QAT qconfig (fused fake-quantizers), a conv fused
    with its BatchNorm (``ConvBnReLU2d``); "unfused", FakeQuantize modules that call their observers."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if qconfig == "x86":
            model = nn.Sequential(tq.QuantStub(), nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(2 * 2 * 2, D), tq.DeQuantStub()).train()
            model = tq.fuse_modules_qat(model, [["1", "2", "3"]])
            model.qconfig = tq.get_default_qat_qconfig("x86")
        else:
            model = nn.Sequential(nn.Flatten(), tq.QuantStub(), nn.Linear(4 * 4, D), nn.ReLU(), nn.Linear(D, D),
                                  tq.DeQuantStub()).train()
            model.qconfig = _FAKE_QUANT
        return tq.prepare_qat(model)


def _batches(n: int, bad: frozenset[int] = frozenset()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x, y = torch.randn(4, 1, 4, 4, generator=g), torch.randn(4, D, generator=g)
        if i in bad:
            x[0, 0, 0, 0] = float("nan")
        out.append((x, y))
    return out


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, times: float = 1.0) -> torch.Tensor:
    return F.mse_loss(model(x).float(), y) * times


def _guarded(model: nn.Module, batches, precision: str = "fp32", sync_free: bool = False,
             accumulation_steps: int = 1, times: float = 1.0) -> tuple[Guard, list]:
    if sync_free:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, precision=precision, sync_free=sync_free, accumulation_steps=accumulation_steps)
    records = []
    for x, y in batches:
        with guard.autocast():
            loss = _loss(model, x, y, times)
        guard.backward(loss)
        record = guard.step()
        if record is not None:
            records.append(record)
    return guard, records


def _plain(model: nn.Module, batches, precision: str = "fp32", times: float = 1.0) -> list[float]:
    """The hand-written recipe (SGD, clip at 1.0, the guard's defaults); the loss scale after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    scales = []
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16 if precision == "fp16" else torch.bfloat16,
                            enabled=precision != "fp32"):
            loss = _loss(model, x, y, times)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
    return scales


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:  # (a shape, a dtype and the bits: an observer's empty min_val is not a NaN one)
        assert got[name].shape == expected[name].shape and got[name].dtype == expected[name].dtype, name
        assert torch.equal(got[name], expected[name]), name


def _observers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _state(model).items() if "activation_post_process" in k or "fake_quant" in k}


@pytest.mark.parametrize("qconfig,precision", [("x86", "fp32"), ("unfused", "bf16")])
def test_a_qat_run_survives_a_nan_batch_as_the_plain_loop_that_never_read_it(qconfig, precision):
    # batches 0, 1 (one NaN: skipped), 2, 3: the weights, the BatchNorm statistics and every
    # observer and fake-quantizer buffer bit for bit those of the hand-written loop over 0, 2, 3
    model = _qat(qconfig)
    _, records = _guarded(model, _batches(4, frozenset({1})), precision)
    assert [r.skipped for r in records] == [False, True, False, False], records
    plain = _qat(qconfig)
    _plain(plain, [b for i, b in enumerate(_batches(4)) if i != 1], precision)
    _equal(_state(model), _state(plain))
    model.eval()
    x = torch.randn(2, 1, 4, 4)
    assert torch.isfinite(_loss(model, x, torch.zeros(2, D))).item()


@pytest.mark.parametrize("sync_free", [False, True], ids=["exact", "sync-free"])
def test_a_skip_puts_each_observer_back_bit_for_bit_and_a_first_observation_back_to_empty(sync_free):
    # after one applied step, a NaN batch's skip leaves every observer as it was; a skip of the very
    # first step leaves a per-channel observer's min_val the empty tensor([]) it was (its first
    # observation resized it), the fused fake-quantizer's scale tensor([1.]): as prepare_qat made them
    model = _qat()
    made = _state(model)
    assert made["1.weight_fake_quant.activation_post_process.min_val"].shape == (0,)
    guard, records = _guarded(model, _batches(1, frozenset({0})), sync_free=sync_free)
    assert records[0].skipped
    _equal(_state(model), made)
    batches = _batches(3, frozenset({1}))
    guard, records = _guarded(model, batches[:1], sync_free=sync_free)
    before = _observers(model)
    assert before["1.weight_fake_quant.activation_post_process.min_val"].shape == (2,)
    for x, y in batches[1:]:
        with guard.autocast():
            loss = _loss(model, x, y)
        guard.backward(loss)
        records.append(guard.step())
        if records[-1].skipped:
            _equal(_observers(model), before)
    assert [r.skipped for r in records] == [False, True, False]
    assert all(torch.isfinite(v).all() for v in _observers(model).values())


def test_a_group_skipped_for_its_last_micro_batch_puts_back_what_each_of_its_forwards_wrote():
    model = _qat("unfused")
    batches = _batches(6, frozenset({3}))  # groups of 2: the second's second micro-batch NaN
    guard, records = _guarded(model, batches[:2], "bf16", accumulation_steps=2)
    after_first = _state(model)
    for x, y in batches[2:4]:
        with guard.autocast():
            loss = _loss(model, x, y)
        guard.backward(loss)
        record = guard.step()
    assert record.skipped
    _equal(_state(model), after_first)
    for x, y in batches[4:]:
        with guard.autocast():
            loss = _loss(model, x, y)
        guard.backward(loss)
        record = guard.step()
    assert record is not None and not record.skipped


def test_an_fp16_overflow_skip_on_clean_data_puts_the_observers_back_where_the_plain_loop_keeps_them():
    # clean data, a loss whose scaled gradients pass fp16's range at the first scale: the guard and
    # the plain GradScaler loop both skip the first steps, their parameters equal bit for bit; the
    # guard's observers are as prepare_qat made them, the plain loop's hold the skipped forwards'
    # (README: "bit-for-bit the hand-written loop" is the parameters' and the optimizer's)
    model, plain = _qat("unfused"), _qat("unfused")
    made = _state(model)
    batches = _batches(2)
    _, records = _guarded(model, batches, "fp16", times=1e4)
    scales = _plain(plain, batches, "fp16", times=1e4)
    assert [r.skipped for r in records] == [True, True] and scales == [32768.0, 16384.0]
    assert {r.reason for r in records} == {"non_finite_grad"}
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name
    _equal(_state(model), made)
    assert not torch.equal(plain.state_dict()["2.activation_post_process.scale"], made["2.activation_post_process.scale"])
