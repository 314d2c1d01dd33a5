"""``precision: fp8`` (torchao float8 training) in the guarded step: which layers convert, the
precision object, the refusals, and broken scales caught by the step and named by
``ampguard.fp8.find_bad_scales``. torchao runs for real (on the CPU its float8 matmuls are
PyTorch's CPU ``torch._scaled_mm``).

The one thing injected is torchao#3356's bug: a scale function without the floor under the amax
(``float8_max / amax``), so an all-zero tensor gets an infinite scale and 0 x inf = NaN. torchao's
float8 training clamps the amax to 1e-12, so a zero amax is harmless there (tested too).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard import Guard
from ampguard.build import build_state, prepare_model
from ampguard.config import load_config, validate
from ampguard.errors import ConfigError, InputError
from ampguard.fp8 import BadScale, CastStats, cast_stats, convert_to_fp8, find_bad_scales, fp8_layers, plan
from ampguard.precision import Precision, SlowPrecisionWarning

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py


def mlp(hidden: int = 64, out: int = 10) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out))


def batch(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def guarded(model: nn.Module, **kw) -> Guard:
    return Guard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision="fp8", **kw)


def one_step(guard: Guard, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    with guard.autocast():
        loss = F.cross_entropy(model(x), y)
    guard.backward(loss)
    return guard.step()


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(model: nn.Module, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


# ---------------------------------------------------------------------------- the precision


def test_fp8_is_bf16_autocast_without_a_loss_scaler():
    p = Precision("fp8", "cpu")
    assert p.dtype == torch.bfloat16 and not p.uses_scaler
    assert not p.make_scaler().is_enabled() and float(p.make_scaler().scale_value()) == 1.0
    with pytest.raises(ValueError, match="fp8 does not use a loss scaler"):
        p.make_scaler(enabled=True)
    with p.autocast():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")


def test_guard_refuses_a_model_with_no_float8_layer():
    model = mlp()
    with pytest.raises(ValueError, match=r"has none: convert it first with ampguard\.fp8\.convert_to_fp8\(model\)"):
        guarded(model)


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_guard_refuses_a_float8_model_under_another_precision(precision):
    # (the converse of the refusal above: it trained float8 matmuls under the name bf16, unsaid)
    model = mlp()
    convert_to_fp8(model)
    with pytest.raises(ValueError, match=rf"^the model has torchao Float8Linear layers \(2\), which train float8 "
                                         rf"matmuls under the name {precision}: use precision fp8"):
        Guard(model, torch.optim.AdamW(model.parameters()), precision=precision)


def test_a_second_conversion_with_another_recipe_is_refused_not_dropped():
    model = mlp()
    assert convert_to_fp8(model, recipe="rowwise") == ["2"]
    with pytest.raises(ValueError, match="converted with another recipe than 'tensorwise'"):
        convert_to_fp8(model)
    assert convert_to_fp8(model, recipe="rowwise") == []  # the same recipe again: nothing more to convert


def test_guard_warns_that_fp8_on_a_cpu_is_for_correctness_not_speed():
    # review 53a: it said "emulated by torchao": torchao's emulate mode is off, the matmuls are PyTorch's
    model = mlp()
    convert_to_fp8(model)
    with pytest.warns(SlowPrecisionWarning, match=r"^fp8 on a CPU runs PyTorch's CPU float8 matmul "
                                                  r"\(torch._scaled_mm\): right for correctness checks, no speed-up$"):
        guarded(model)


def test_guard_without_torchao_is_one_clear_refusal(monkeypatch):
    model = mlp()
    convert_to_fp8(model)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if the fp8 extra were not installed
    with pytest.raises(ValueError, match=r"^precision fp8 needs torchao, which is not installed: pip install"):
        guarded(model)


# ---------------------------------------------------------------------------- which layers convert


def test_the_default_keeps_first_last_and_dims_off_16_in_bf16():
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 32),
                          nn.Linear(32, 32), nn.Linear(32, 10))
    assert plan(model) == {"0": "first layer", "2": "out_features 40 is not a multiple of 16",
                           "4": "in_features 40 is not a multiple of 16", "5": "fp8", "6": "last layer"}
    assert convert_to_fp8(model) == ["5"] and fp8_layers(model) == ["5"]
    assert type(model[0]) is nn.Linear and type(model[6]) is nn.Linear


def test_exclude_patterns_and_keep_first_last_off():
    blocks = nn.ModuleDict({f"b{i}": nn.ModuleDict({"attn": nn.Linear(32, 32), "mlp": nn.Linear(32, 32)})
                            for i in range(2)})
    chosen = convert_to_fp8(blocks, keep_first_last=False, exclude=["*.attn"])
    assert chosen == ["b0.mlp", "b1.mlp"] and fp8_layers(blocks) == chosen


def test_an_exclude_on_a_bare_linear_says_it_is_one():
    # review_session26: "matches no Linear layer of the model (it has none)" of a model that is one Linear
    with pytest.raises(ValueError, match=r"it has none: it is a bare Linear, not a model that holds one\)$"):
        convert_to_fp8(nn.Linear(64, 16), exclude=["2"])


def test_conversion_keeps_the_parameters_so_an_earlier_optimizer_still_trains_them():
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    convert_to_fp8(model)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    before = model[2].weight.detach().clone()
    guard = Guard(model, opt, precision="fp8")
    record = one_step(guard, model, *batch())
    assert not record.skipped and not torch.equal(model[2].weight, before)


def test_converting_twice_converts_nothing_more():
    model = mlp()
    assert convert_to_fp8(model) == ["2"]
    assert convert_to_fp8(model) == [] and fp8_layers(model) == ["2"]


def test_a_model_with_no_eligible_layer_is_refused_naming_why():
    with pytest.raises(ValueError, match=r"no Linear layer can train in fp8 \(0: first layer; 1: last layer\)"):
        convert_to_fp8(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))


def test_a_converted_model_keeps_the_state_dict_keys_of_the_plain_one():
    plain, converted = mlp(), mlp()
    convert_to_fp8(converted)
    assert list(plain.state_dict()) == list(converted.state_dict())
    converted.load_state_dict(plain.state_dict())  # checkpoints move between bf16 and fp8 models
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), converted.parameters()))


def test_rowwise_recipe_trains():
    model = mlp()
    convert_to_fp8(model, recipe="rowwise")
    assert model[2].config.round_scales_to_power_of_2  # torchao's rowwise recipe
    record = one_step(guarded(model), model, *batch())
    assert not record.skipped and math.isfinite(float(record.loss))


# ---------------------------------------------------------------------------- config and build


def test_fp8_config_section_defaults_and_bad_values():
    c = validate({"precision": "fp8", "fp8": {"recipe": "rowwise", "exclude": ["head"]}})
    assert (c.fp8.recipe, c.fp8.keep_first_last, c.fp8.exclude) == ("rowwise", True, ["head"])
    assert validate({"validation": {"precisions": ["bf16", "fp8"]}}).validation.precisions == ["bf16", "fp8"]
    for data, key in [({"fp8": {"recipe": "delayed"}}, "fp8.recipe"), ({"fp8": {"bogus": 1}}, "fp8.bogus"),
                      ({"fp8": {"exclude": "head"}}, "fp8.exclude"), ({"precision": "fp4"}, "precision"),
                      ({"precision": "fp8", "scaler": {"enabled": True}}, "scaler.enabled")]:
        with pytest.raises(ConfigError) as err:
            validate(data)
        assert str(err.value).startswith(f"config: {key}:") and "\n" not in str(err.value)


def test_build_state_converts_the_model_in_place():
    config = load_config(None, ["precision=fp8", "task.name=digits", "device=cpu"])
    model = mlp()
    state = build_state(config, model, F.cross_entropy, torch.device("cpu"))
    assert state.model is model and fp8_layers(model) == ["2"] and state.precision.name == "fp8"
    assert not state.scaler.is_enabled()


def test_build_without_torchao_is_one_input_error_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    with pytest.raises(InputError) as err:
        prepare_model(load_config(None, ["precision=fp8"]), mlp())
    assert str(err.value) == ("precision: fp8 needs torchao, which is not installed: pip install 'ampguard[fp8]' "
                              "(or pip install torchao)")


def test_fp8_under_torchrun_is_refused_before_anything_is_converted(monkeypatch):
    from ampguard import distributed

    # a process group of two joined (train's under torchrun); validate under torchrun runs on rank 0
    # alone, no group joined, where fp8 converts as anywhere (review 51k)
    monkeypatch.setattr(distributed, "current", lambda: distributed.DistInfo(rank=0, world_size=2, local_rank=0))
    model = mlp()
    with pytest.raises(InputError, match=r"^precision: fp8 under torchrun is not supported yet"):
        prepare_model(load_config(None, ["precision=fp8"]), model)
    assert fp8_layers(model) == []
    monkeypatch.undo()
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # what torchrun sets, no group joined: validate's rank 0
    assert fp8_layers(prepare_model(load_config(None, ["precision=fp8"]), mlp()))


def test_prepare_model_copies_for_validate_and_leaves_other_precisions_alone():
    model = mlp()
    config = load_config(None, ["precision=bf16"])
    assert prepare_model(config, model) is model
    copy = prepare_model(config, model, "fp8", copy_model=True)
    assert fp8_layers(copy) == ["2"] and fp8_layers(model) == []


# ---------------------------------------------------------------------------- broken scales


def test_a_zero_amax_is_harmless_in_torchao_float8_training():
    # torchao clamps the amax to 1e-12 before float8_max / amax: an all-zero weight gets a huge
    # but finite scale, its cast is exact (0), the step is applied
    model = mlp()
    convert_to_fp8(model)
    with torch.no_grad():
        model[2].weight.zero_()
    x, y = batch()
    assert find_bad_scales(model, F.cross_entropy, x, y, Precision("fp8", "cpu").autocast) == []
    assert not one_step(guarded(model), model, x, y).skipped


@pytest.fixture
def scale_without_floor(monkeypatch):
    """torchao#3356's bug injected: a dynamic scale computed as float8_max / amax, no floor."""
    from torchao.float8 import float8_scaling_utils
    from torchao.float8.float8_utils import tensor_to_amax

    def tensor_to_scale(hp, float8_dtype, reduce_amax=False, device_mesh=None, granularity=None, axiswise_dim=None,
                        round_pow2=False):
        amax = tensor_to_amax(hp, reduce_amax, device_mesh, granularity, axiswise_dim).to(torch.float64)
        return (torch.finfo(float8_dtype).max / amax).to(torch.float32)

    monkeypatch.setattr(float8_scaling_utils, "tensor_to_scale", tensor_to_scale)


def test_an_injected_zero_amax_nan_scale_is_skipped_and_named(scale_without_floor):
    model = mlp()
    convert_to_fp8(model)
    with torch.no_grad():
        model[2].weight.zero_()  # e.g. a zero-initialised projection: amax 0 -> scale inf -> 0 x inf = NaN
    guard, x, y = guarded(model), *batch()
    before = snapshot(model)
    record = one_step(guard, model, x, y)
    # caught: the NaN reaches the loss, the step is skipped with the contract's reason, nothing moves
    assert record.skipped and record.reason == "non_finite_loss"
    assert same(model, before) and guard.updates == 0
    # named: the layer, the operand, the amax behind it, and that the scale (not the tensor) broke
    found = find_bad_scales(model, F.cross_entropy, x, y, guard.precision.autocast)
    assert found[0] == BadScale("2", "weight", amax=0.0, scale=math.inf)
    assert found[0].broken_scale
    assert str(found[0]) == "2 weight: amax 0 -> fp8 scale inf (the scale itself is broken: the tensor is finite)"
    assert model[2].weight.grad is None  # the replay leaves no trace


def test_the_diagnosis_of_a_skip_names_the_broken_scale_not_one_a_nan_tensor_made(scale_without_floor):
    # the first-skip diagnosis (and locate) replays the micro-batch: under fp8 it names the float8
    # cast whose scale broke with its tensor finite (it named only the Float8Linear's NaN output)
    from ampguard.locate import diagnose

    model = mlp()
    convert_to_fp8(model)
    with torch.no_grad():
        model[2].weight.zero_()
    x, y = batch()
    found = diagnose(model, F.cross_entropy, x, y, Precision("fp8", "cpu"))
    assert found.fp8_scales == ["2 weight: amax 0 -> fp8 scale inf (the scale itself is broken: the tensor is finite)"]
    assert found.message().startswith("first nan under fp8: in the forward output of 2 (Float8Linear; inputs ")
    assert "; a float8 scale broke first: 2 weight: amax 0 -> fp8 scale inf" in found.message()
    assert found.as_dict()["fp8_scales"] == found.fp8_scales and model[2].weight.grad is None
    with torch.no_grad():  # a NaN in the weight: its scale is NaN too, but the tensor broke, not the scale
        model[2].weight.fill_(0.01)[3, 5] = float("nan")
    found = diagnose(model, F.cross_entropy, x, y, Precision("fp8", "cpu"))
    assert found.verdict == "data/model" and found.fp8_scales == [] and "float8 scale" not in found.message()


def test_a_nan_scale_from_a_nan_weight_is_skipped_every_step_and_named():
    model = mlp()
    convert_to_fp8(model)
    with torch.no_grad():
        model[2].weight[3, 5] = float("nan")
    guard, x, y = guarded(model), *batch()
    records = [one_step(guard, model, x, y) for _ in range(3)]
    assert [(r.skipped, r.reason) for r in records] == [(True, "non_finite_loss")] * 3
    first = find_bad_scales(model, F.cross_entropy, x, y, guard.precision.autocast)[0]
    assert (first.module, first.role, math.isnan(first.scale), first.broken_scale) == ("2", "weight", True, False)


def test_a_zero_scale_from_an_inf_gradient_is_a_grad_skip_and_named():
    # an inf reaching the fp8 layer's grad_output: amax inf -> scale 0 -> inf x 0 = NaN gradients
    model = mlp()
    convert_to_fp8(model)

    class _InfGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            return h.clone()

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            g.view(-1)[0] = float("inf")
            return g

    class InfGrad(nn.Module):  # identity forward, an inf in the gradient it passes back
        def forward(self, h):
            return _InfGrad.apply(h)

    model.insert(3, InfGrad())  # after the fp8 layer "2": its grad_output carries the inf
    guard, x, y = guarded(model), *batch()
    before = snapshot(model)
    record = one_step(guard, model, x, y)
    assert record.skipped and record.reason == "non_finite_grad" and same(model, before)
    found = find_bad_scales(model, F.cross_entropy, x, y, guard.precision.autocast)
    assert [(b.module, b.role, b.scale) for b in found][:1] == [("2", "grad_output", 0.0)]
    assert found[0].amax == math.inf and not found[0].broken_scale


def test_clean_fp8_steps_have_no_bad_scale_and_one_host_read():
    from helpers import HostReads

    model = mlp()
    convert_to_fp8(model)
    # SGD: on a CPU AdamW's single-tensor step reads its step counters itself (not the guard's)
    guard, x, y = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp8"), *batch()
    one_step(guard, model, x, y)  # warm-up
    with HostReads() as reads:
        record = one_step(guard, model, x, y)
    assert not record.skipped and reads.count == 1  # the step's skip decision, as for bf16
    assert find_bad_scales(model, F.cross_entropy, x, y, guard.precision.autocast) == []


# ---------------------------------------------------------------------------- an outlier flushes the rest


def outlier_model(recipe: str) -> nn.Sequential:
    model = mlp()
    convert_to_fp8(model, recipe=recipe)
    with torch.no_grad():
        model[2].weight.normal_(0, 0.01)
        model[2].weight[0, 0] = 1e4  # one outlier among weights of about 0.01
    return model


def weight_cast(model: nn.Module) -> CastStats:
    x, y = batch()
    return next(s for s in cast_stats(model, F.cross_entropy, x, y, Precision("fp8", "cpu").autocast)
                if (s.module, s.role) == ("2", "weight"))


def test_one_outlier_flushes_a_tensorwise_weight_to_zero_and_rowwise_confines_it():
    # tensorwise: scale 448 / 1e4, so 0.01 x 0.0448 is below half of e4m3's smallest subnormal
    # (2**-10): every other weight becomes 0 in float8. rowwise scales each output column apart
    tensorwise, rowwise = weight_cast(outlier_model("tensorwise")), weight_cast(outlier_model("rowwise"))
    assert tensorwise.amax == 1e4 and tensorwise.scale == pytest.approx(448 / 1e4)
    assert tensorwise.flushed > 0.9  # all but the normal's tails beyond 2**-10 / 0.0448 ~ 0.022 (2.2 sigma)
    assert rowwise.flushed < 2 / 64  # at most the outlier's own column (1 of 64)
    clean = mlp()
    convert_to_fp8(clean)
    assert weight_cast(clean).flushed < 0.01


def test_an_attentions_out_proj_is_not_converted_since_its_forward_never_runs():
    # nn.MultiheadAttention hands out_proj's weight to F.multi_head_attention_forward: a Float8Linear
    # there would count as an fp8 layer and never run, a bf16 model under the name fp8
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.attn, self.head = nn.Linear(16, 32), nn.MultiheadAttention(32, 4), nn.Linear(32, 16)

        def forward(self, x):
            h = self.inp(x)
            return self.head(self.attn(h, h, h)[0])

    assert plan(Block())["attn.out_proj"] == "inside nn.MultiheadAttention, which does not call its forward"
    with pytest.raises(ValueError, match="no Linear layer can train in fp8 .*attn.out_proj: inside nn.Multi"):
        convert_to_fp8(Block())
    model = Block()
    assert convert_to_fp8(model, keep_first_last=False) == ["inp", "head"]
    assert fp8_layers(model) == ["inp", "head"] and type(model.attn.out_proj) is not type(model.inp)
