"""fp8 conversion of the Linear layers torchao's swap gets wrong (a subclass with its own forward,
a forward replaced on the instance or compiled in place, a parametrized or lazy layer, one with
hooks or state-dict hooks, a bias kept as a buffer, one reused at two places or held under a
second name after the head), a Float8Linear called with a keyword input or reused under the
diagnosis, the token dimension CUDA's ``_scaled_mm`` wants a multiple of 16 (in layers torchao
converted directly too), and a torchao too old for the recipes. torchao runs for real (PyTorch's
CPU ``torch._scaled_mm`` on a CPU).
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard import Guard
from ampguard.build import prepare_model
from ampguard.config import validate
from ampguard.errors import InputError
from ampguard.fp8 import convert_to_fp8, find_bad_scales, float8_config, fp8_layers, plan, require_torchao
from ampguard.precision import Precision, keep_in_fp32

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py


class Scaled(nn.Linear):
    """A Linear with its own forward (modded-nanogpt's CastedLinear, a LoRA layer...)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 0.5 + 1.0


class InitOnly(nn.Linear):
    """A Linear subclass that only changes its init: it computes what nn.Linear computes."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def middle(layer: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), layer, nn.ReLU(), nn.Linear(32, 16))


def refusal(model: nn.Module) -> str:
    """The one line ``ampguard train`` prints for this model under fp8 (build.prepare_model)."""
    with pytest.raises(InputError) as err:
        prepare_model(validate({"precision": "fp8"}), model)
    message = str(err.value)
    assert "\n" not in message
    return message


def fp8_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with Precision("fp8", "cpu").autocast():
        return model(x).float()


# ---------------------------------------------------------------------------- which layers convert


def test_a_linear_subclass_with_its_own_forward_stays_out_and_keeps_its_forward():
    layer = Scaled(32, 32)
    model = middle(layer)
    why = "a Scaled with its own forward, which Float8Linear's would replace"
    assert plan(model, keep_first_last=False)["2"] == why
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "4"]
    h = torch.randn(16, 32)
    assert model[2] is layer and torch.equal(model[2](h), F.linear(h, layer.weight, layer.bias) * 0.5 + 1.0)
    # the default keeps first and last: nothing is left, one line naming why (exit 2 in the CLI)
    assert "2: a Scaled with its own forward" in refusal(middle(Scaled(32, 32)))


def test_the_swap_offers_torchao_only_the_planned_layers():
    # torchao's own test is isinstance(m, nn.Linear): its filter must be plan()'s, layer by layer; a
    # subclass that keeps nn.Linear's forward (it only changes the init) computes a Linear: it converts
    model = nn.Sequential(nn.Linear(32, 32), Scaled(32, 32), InitOnly(32, 32), Scaled(32, 32), nn.Linear(32, 32))
    assert plan(model, keep_first_last=False)["2"] == "fp8"
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "2", "4"]
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Scaled", "Float8Linear", "Scaled", "Float8Linear"]


@pytest.mark.parametrize("wrap, why", [
    (nn.utils.parametrizations.weight_norm, "its weight is parametrized (weight_norm, spectral_norm...)"),
    (nn.utils.parametrizations.spectral_norm, "its weight is parametrized (weight_norm, spectral_norm...)"),
    (nn.utils.weight_norm, "holds weight_g, weight_v besides weight and bias"),
    (nn.utils.spectral_norm, "holds weight_orig, weight_u, weight_v besides weight and bias"),
])
def test_a_weight_normed_linear_stays_out_with_a_reason_not_a_traceback(wrap, why):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (old-style weight_norm is deprecated)
        layer = wrap(nn.Linear(32, 32))
    model = middle(layer)
    assert plan(model)["2"].startswith(why)
    assert f"2: {why}" in refusal(model)
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "4"] and model[2] is layer


def test_a_linear_with_hooks_of_its_own_stays_out():
    # the swap makes a new module: a hook on the old one would stop running, unsaid
    layer = nn.Linear(32, 32)
    seen = []
    layer.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    model = middle(layer)
    assert plan(model)["2"] == "has hooks of its own, which the swap to a new Float8Linear would drop"
    convert_to_fp8(model, keep_first_last=False)
    fp8_forward(model, torch.randn(16, 32))
    assert model[2] is layer and seen == [torch.Size([16, 32])]


def test_an_uninitialised_lazy_linear_stays_out_and_converts_once_initialised():
    model = middle(nn.LazyLinear(32))
    assert plan(model)["2"].startswith("not initialised (a lazy layer before its first forward)")
    assert "2: not initialised" in refusal(model)
    model(torch.randn(4, 32))  # its first forward: now an nn.Linear(32, 32)
    assert convert_to_fp8(model) == ["2"]
    fp8_forward(model, torch.randn(16, 32)).sum().backward()
    assert model[2].weight.grad.shape == (32, 32)


def test_a_reused_linear_converts_at_every_place_as_one_layer():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(nn.Linear(32, 32), shared, nn.ReLU(), shared, nn.Linear(32, 16))
    assert plan(model) == {"0": "first layer", "1": "fp8", "3": "fp8", "4": "last layer"}
    assert convert_to_fp8(model) == ["1", "3"] and fp8_layers(model) == ["1", "3"]
    assert type(model[1]).__name__ == "Float8Linear" and model[3] is model[1] and model[1].weight is shared.weight
    assert len(list(model.parameters())) == 6  # still one weight and bias for both places


def test_a_reused_linear_kept_out_at_one_place_is_kept_out_at_all():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), nn.Linear(32, 32), shared, nn.Linear(32, 16))
    assert plan(model)["3"] == "the same layer as '0', which stays out there (first layer)"
    assert convert_to_fp8(model) == ["2"] and model[0] is shared and model[3] is shared


class Aliased(nn.Module):
    """A middle layer held under a second name registered after the head (``self.again = self.sh``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.sh, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)  # c: the head
        self.again = self.sh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.again(torch.relu(self.sh(torch.relu(self.a(x)))))))


class LastBlock(nn.Module):
    """``self.last_block = self.blocks[-1]``, a convenience name registered after the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)) for _ in range(2))
        self.head = nn.Linear(32, 16)
        self.last_block = self.blocks[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(self.inp(x) if block is self.blocks[0] else x)
        return self.head(x)


def test_a_second_name_for_a_layer_registered_after_the_head_does_not_make_it_the_last_layer():
    # first and last are judged at each layer's first place: the second name follows its layer
    model = Aliased()
    assert plan(model) == {"a": "first layer", "sh": "fp8", "c": "last layer", "again": "fp8"}
    assert convert_to_fp8(model) == ["sh", "again"] and type(model.c) is nn.Linear and model.again is model.sh
    blocks = LastBlock()
    assert plan(blocks)["head"] == "last layer" and plan(blocks)["blocks.1.2"] == plan(blocks)["last_block.2"] == "fp8"
    convert_to_fp8(blocks)
    assert type(blocks.head) is nn.Linear and type(blocks.blocks[1][2]).__name__ == "Float8Linear"
    assert blocks.last_block[2] is blocks.blocks[1][2]


def test_a_linear_whose_forward_is_replaced_on_the_instance_stays_out_and_keeps_it():
    # Accelerate's add_hook_to_module does this (layer.forward = MethodType(...)): the swap would drop it
    def scaled(self, x):
        return F.linear(x, self.weight, self.bias) * 0.5 + 1.0

    def patched() -> nn.Linear:
        layer = nn.Linear(32, 32)
        layer.forward = types.MethodType(scaled, layer)
        return layer

    layer = patched()
    model = middle(layer)
    assert plan(model, keep_first_last=False)["2"] == ("its forward is replaced on the instance (Accelerate's hooks, "
                                                       "a patch), which the swap to a new Float8Linear would drop")
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "4"]
    h = torch.randn(16, 32)
    assert model[2] is layer and torch.equal(model[2](h), scaled(layer, h))
    assert "2: its forward is replaced on the instance" in refusal(middle(patched()))


def test_a_linear_compiled_in_place_stays_out():
    layer = nn.Linear(32, 32)
    layer.compile()  # (lazy: nothing compiles before a call)
    model = middle(layer)
    assert plan(model, keep_first_last=False)["2"] == ("compiled in place (module.compile()), which the swap to a new "
                                                       "Float8Linear would drop: compile after convert_to_fp8")
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "4"] and model[2] is layer


def test_a_linear_kept_in_fp32_by_an_earlier_bf16_pass_converts_as_train_converts_it():
    # validate's bf16 pass keeps fp32_modules on the model its fp8 copy is made from; train under
    # fp8 does not keep fp32_modules: the copy's layer converts, as train's does
    model = middle(nn.Linear(32, 32))
    keep_in_fp32(model, ["2"])
    assert plan(model)["2"] == "fp8" and convert_to_fp8(model) == ["2"]


def test_a_lazy_linear_loaded_from_a_checkpoint_converts():
    # load_state_dict fills the parameters but leaves torch's lazy-initialisation hook (and in_features 0)
    plain = middle(nn.Linear(32, 32))
    model = middle(nn.LazyLinear(32))
    model.load_state_dict(plain.state_dict())
    assert type(model[2]) is nn.LazyLinear and not model[2].has_uninitialized_params()
    assert plan(model)["2"] == "fp8" and convert_to_fp8(model) == ["2"]
    assert type(model[2]).__name__ == "Float8Linear" and (model[2].in_features, model[2].out_features) == (32, 32)
    x = torch.randn(16, 32)
    assert torch.equal(fp8_forward(model, x), fp8_forward(prepare_model(validate({"precision": "fp8"}), plain), x))


def test_a_linear_with_a_state_dict_hook_stays_out_and_keeps_its_checkpoint_keys():
    layer = nn.Linear(32, 32)
    layer._register_state_dict_hook(lambda m, sd, prefix, local: sd.__setitem__(prefix + "version", torch.tensor(2)))
    model = middle(layer)
    keys = list(model.state_dict())
    assert plan(model)["2"].startswith("has state-dict hooks of its own, which the swap to a new Float8Linear would "
                                       "drop")
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "4"] and list(model.state_dict()) == keys


def test_a_bias_kept_as_a_buffer_stays_out_with_a_reason_not_a_traceback():
    def fixed_bias() -> nn.Linear:
        layer = nn.Linear(32, 32)
        del layer.bias
        layer.register_buffer("bias", torch.full((32,), 0.1))
        return layer

    model = middle(fixed_bias())
    assert plan(model)["2"] == "its bias is not an nn.Parameter (a buffer: a fixed bias), which Float8Linear needs"
    assert "2: its bias is not an nn.Parameter" in refusal(middle(fixed_bias()))
    assert convert_to_fp8(model, keep_first_last=False) == ["0", "4"] and type(model[2]) is nn.Linear


# ---------------------------------------------------------------------------- the diagnosis


class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(input=torch.relu(self.a(x)))))  # b called with a keyword input


def test_find_bad_scales_reads_a_keyword_input():
    model = KeywordNet()
    assert convert_to_fp8(model, keep_first_last=False) == ["a", "b", "c"]
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    assert find_bad_scales(model, F.cross_entropy, x, y, Precision("fp8", "cpu").autocast) == []
    with torch.no_grad():
        model.a.bias[0] = float("nan")  # b's keyword input holds a NaN
    inputs = [(bad.module, bad.role) for bad in find_bad_scales(model, F.cross_entropy, x, y) if bad.role == "input"]
    assert inputs[0] == ("b", "input")


def test_the_first_skip_diagnosis_of_a_keyword_called_float8_layer():
    from ampguard.locate import diagnose

    model = KeywordNet()
    convert_to_fp8(model, keep_first_last=False)
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    x[0] = 3e38  # finite, overflows in the first layer
    result = diagnose(model, F.cross_entropy, x, y, Precision("fp8", "cpu"), 1.0, 1)
    assert result.amp.where != "none" and result.fp32 is not None and result.fp32.where != "none"


class Reused(nn.Module):
    """A layer called at two places under two names (``self.again = self.sh``), a NaN reaching only the second."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.sh, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16)
        self.again = self.sh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(self.sh(torch.relu(self.a(x)))))  # a clean input at 'sh'
        return self.c(self.again(h))  # b's output (a NaN) at 'again'


def test_the_diagnosis_names_a_reused_float8_layer_at_every_place():
    # a call does not say through which name it came: the cast is named at both, not at 'sh' alone
    model = Reused()
    assert convert_to_fp8(model, keep_first_last=False) == ["a", "sh", "b", "c", "again"]
    with torch.no_grad():
        model.b.bias[0] = float("nan")
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    inputs = [str(bad) for bad in find_bad_scales(model, F.cross_entropy, x, y) if bad.role == "input"]
    assert inputs[0] == ("sh (the same layer as again) input: amax nan -> fp8 scale nan "
                         "(the tensor itself is not finite)")


# ---------------------------------------------------------------------------- CUDA's token dimension


def test_a_micro_batch_off_16_rows_trains_under_cudas_scaled_mm_checks(monkeypatch):
    # CUDA's torch._scaled_mm wants mat1's columns and both of mat2's dims multiples of 16; in the
    # weight gradient (grad_output.t() @ input) that is the micro-batch's row count. The CPU
    # kernel does not check: the check CUDA makes is put in front of it.
    real = torch._scaled_mm

    def as_on_cuda(mat1, mat2, *args, **kwargs):
        if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
            raise RuntimeError(f"_scaled_mm: {tuple(mat1.shape)} @ {tuple(mat2.shape)} not divisible by 16")
        return real(mat1, mat2, *args, **kwargs)

    for recipe in ("tensorwise", "rowwise"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        convert_to_fp8(model, recipe=recipe)
        x, y = torch.rand(8, 64), torch.randint(0, 10, (8,))
        reference = None
        for check in (False, True):
            if check:
                monkeypatch.setattr(torch, "_scaled_mm", as_on_cuda)
            model.zero_grad()
            with Precision("fp8", "cpu").autocast():
                loss = F.cross_entropy(model(x), y)
            loss.float().backward()
            if reference is None:
                reference = model[2].weight.grad.clone()
            monkeypatch.undo()
        assert torch.equal(model[2].weight.grad, reference)  # zero padding: the same gradient
        model.zero_grad()
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp8")
        monkeypatch.setattr(torch, "_scaled_mm", as_on_cuda)
        with guard.autocast():
            loss = F.cross_entropy(model(x), y)
        guard.backward(loss)
        assert not guard.step().skipped
        monkeypatch.undo()
    assert float8_config().pad_inner_dim and float8_config("rowwise").pad_inner_dim  # (torchao's default: off)


def as_on_cuda(mat1: torch.Tensor, mat2: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """torch._scaled_mm with the check CUDA's makes (the CPU kernel makes none)."""
    if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
        raise RuntimeError(f"_scaled_mm: {tuple(mat1.shape)} @ {tuple(mat2.shape)} not divisible by 16")
    return SCALED_MM(mat1, mat2, *args, **kwargs)


SCALED_MM = torch._scaled_mm


def test_layers_torchao_converted_directly_pad_too(monkeypatch):
    # convert_to_fp8 accepts them as the same recipe: they get pad_inner_dim (torchao's default is
    # off), in their config and their matmuls', or a micro-batch of 8 rows fails on CUDA
    float8 = require_torchao()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 10))
    float8.convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn == "2")
    assert not model[2].config.pad_inner_dim
    assert convert_to_fp8(model) == ["4"] and fp8_layers(model) == ["2", "4"]
    assert model[2].config == model[4].config == float8_config()
    assert model[2].linear_mm_config == model[4].linear_mm_config
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp8")
    monkeypatch.setattr(torch, "_scaled_mm", as_on_cuda)
    x, y = torch.rand(8, 64), torch.randint(0, 10, (8,))
    with guard.autocast():
        loss = F.cross_entropy(model(x), y)
    guard.backward(loss)
    assert not guard.step().skipped


def test_pad_inner_dim_copies_both_operands_of_all_three_matmuls_and_changes_no_number(monkeypatch):
    # what the docstrings say it does: a copy of each operand of the output, grad input and grad
    # weight matmuls of every float8 layer, every step, even at 16 rows (aligned); the same numbers
    import ampguard.fp8
    import torchao.float8.float8_ops as ops

    real, copies = ops.pad_tensor_for_matmul, []

    def counted(t: torch.Tensor, dims: int) -> torch.Tensor:
        out = real(t, dims)
        copies.append(out.shape == t.shape and out.data_ptr() != t.data_ptr())
        return out

    monkeypatch.setattr(ops, "pad_tensor_for_matmul", counted)
    grads = []
    for pad in (False, True):
        copies.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10))
        config = float8_config() if pad else float8_config().__class__.from_recipe_name("tensorwise")
        require_torchao().convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn == "1", config=config)
        fp8_forward(model, torch.rand(16, 64)).sum().backward()
        grads.append([p.grad for p in model.parameters()])
        assert copies == ([True] * 6 if pad else [])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    for doc in (ampguard.fp8.__doc__, float8_config.__doc__):
        assert "all three" in doc and "only when it is off 16" not in doc and "not measured" in doc


# ---------------------------------------------------------------------------- an old torchao


def test_a_torchao_without_recipe_names_is_one_line(monkeypatch):
    float8 = require_torchao()
    monkeypatch.delattr(float8.Float8LinearConfig, "from_recipe_name")  # as torchao < 0.10 has it
    with pytest.raises(ImportError, match=r"^fp8 needs torchao 0\.10 or newer \(Float8LinearConfig\.from_recipe_name\) "
                                          r"and torchao \S+ lacks it: install the torchao release made for this torch"):
        require_torchao()
    assert refusal(middle(nn.Linear(32, 32))).startswith("precision: fp8 needs torchao 0.10 or newer")


def test_a_linear_whose_patches_were_taken_off_again_converts():
    # review 37l: Accelerate's remove_hook_from_module leaves the class's own forward bound on the
    # instance, and removing weight_norm/spectral_norm leaves torch's legacy-key load hooks: both
    # were refused ("replaced on the instance", "state-dict hooks of its own")
    from torch.nn.utils import parametrize

    from ampguard.fp8 import plan

    def three() -> nn.Sequential:
        return nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10))

    model = three()
    model[1].forward = model[1].forward  # (the class's forward, bound to the layer)
    assert plan(model)["1"] == "fp8"
    model = three()
    nn.utils.parametrizations.weight_norm(model[1])
    parametrize.remove_parametrizations(model[1], "weight")
    assert plan(model)["1"] == "fp8"
    model = three()
    nn.utils.spectral_norm(model[1])
    nn.utils.remove_spectral_norm(model[1])
    assert plan(model)["1"] == "fp8"
    model = three()
    model[1].forward = lambda x: nn.functional.linear(x, model[1].weight) * 2  # (a real patch: still out)
    assert plan(model)["1"].startswith("its forward is replaced on the instance")
