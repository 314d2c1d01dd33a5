"""``ampguard.locate.diagnose`` (issue 5, part 2): where a non-finite value is born (the input, a
module's forward output, the loss, or a parameter's gradient in backward), and whether an FP32
replay of the same batch is clean (``precision-range``) or not (``data/model``). The CLI verb, the
first-skip diagnosis of ``train`` and ``--strict`` are in ``tests/e2e/test_locate_cli.py``.

Every overflow is planted from first principles: fp16's largest finite value is 65504 and
fp32's is about 3.4e38, so exp(12) = 162755 or a Linear output of 120000 overflows fp16
while staying finite in fp32.
"""

from __future__ import annotations

import math
import queue
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard.locate import diagnose, diagnose_group, trace_first_non_finite
from ampguard.precision import Precision

FP16 = Precision("fp16", "cpu")
FP16_MAX = torch.finfo(torch.float16).max  # 65504
FP32_MAX = torch.finfo(torch.float32).max  # ~3.4e38


# ---------------------------------------------------------------------------- models


class ExpBlock(nn.Module):
    """exp of its input: overflows fp16 (max 65504) for inputs above ln(65504) ~ 11.09."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


class ExpNet(nn.Module):
    """proj (identity Linear, fp16 under autocast) -> act (exp) -> mean over features."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = ExpBlock()
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4))
            self.proj.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x)).float().mean(dim=1, keepdim=True)


class Gate(nn.Module):
    """x + sqrt(g) with g = 0: forward finite (sqrt(0) = 0), d sqrt/dg = 1/(2 sqrt(0)) = inf."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(self.g)


def gate_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(lin=nn.Linear(4, 4), gate=Gate()))


def huge_linear_net() -> nn.Module:
    """body.big: a Linear whose output is 4 * 1000 * 30 = 120000 for inputs of 30."""
    big = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        big.weight.fill_(1000.0)
    return nn.Sequential(OrderedDict(body=nn.Sequential(OrderedDict(big=big)), head=nn.Identity()))


def mse_to_zero(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(outputs.float(), targets)


def test_the_planted_values_overflow_fp16_but_not_fp32():
    # the premises the tests below rest on
    assert math.exp(12.0) > FP16_MAX and math.exp(11.0) < FP16_MAX
    assert math.exp(20.0) < FP32_MAX
    assert 4 * 1000.0 * 30.0 > FP16_MAX
    assert torch.tensor(120000.0).half().isinf()


# ---------------------------------------------------------------------------- the API


def test_forward_overflow_in_a_custom_module_is_named_and_fp32_replay_is_clean():
    model = ExpNet()
    x = torch.linspace(12.0, 20.0, 8).reshape(2, 4)  # exp(12..20): inf in fp16, finite in fp32
    result = diagnose(model, mse_to_zero, x, torch.zeros(2, 1), FP16, loss_scale=2.0**16)

    amp = result.amp
    assert amp.where == "forward"
    assert amp.name == "act"  # the innermost module whose output went bad, not the root ('')
    assert amp.op == "ExpBlock"
    assert amp.kind == "inf"
    assert amp.input_dtypes == ["float16"]  # the fp16 output of proj under autocast
    assert amp.output_dtypes == ["float16"]
    assert amp.precision == "fp16"
    assert result.fp32 is not None and result.fp32.where == "none"
    assert result.verdict == "precision-range"
    message = result.message()
    assert "act" in message and "ExpBlock" in message and "precision-range" in message


def test_forward_overflow_of_a_nested_linear_gives_its_qualified_name_and_dtypes():
    model = huge_linear_net()
    x = torch.full((3, 4), 30.0)
    result = diagnose(model, mse_to_zero, x, torch.zeros(3, 2), FP16)

    assert result.amp.where == "forward"
    assert result.amp.name == "body.big"
    assert result.amp.op == "Linear"
    assert result.amp.kind == "inf"
    assert result.amp.input_dtypes == ["float32"]  # what the module was called with
    assert result.amp.output_dtypes == ["float16"]  # what autocast made of it
    assert result.fp32.where == "none"
    assert result.verdict == "precision-range"


def test_below_the_fp16_limit_nothing_is_found():
    model = huge_linear_net()
    x = torch.full((3, 4), 10.0)  # 4 * 1000 * 10 = 40000 < 65504 (and a multiple of fp16's spacing 32 there)
    # targets equal to the outputs: zero loss, zero gradients, nothing can overflow in backward either
    result = diagnose(model, mse_to_zero, x, torch.full((3, 2), 40000.0), FP16)
    assert result.amp.where == "none"
    assert result.verdict == "none"
    assert result.fp32 is None


@pytest.mark.parametrize(("value", "kind"), [(float("nan"), "nan"), (float("inf"), "inf")])
def test_a_non_finite_input_is_the_input_and_a_data_problem(value, kind):
    model = ExpNet()
    x = torch.ones(2, 4)
    x[1, 2] = value
    result = diagnose(model, mse_to_zero, x, torch.zeros(2, 1), FP16)

    assert result.amp.where == "input"
    assert result.amp.kind == kind
    assert result.amp.name == ""
    assert result.fp32 is not None and result.fp32.where == "input"
    assert result.verdict == "data/model"
    assert "input" in result.message()


class _KeywordCall(nn.Module):
    """Its own code makes the inf (an exp), then hands it to ``b`` as a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(input=torch.exp(self.a(x) * 1000))


class _InPlaceScale(nn.Module):
    """A leaf that overflows its input in place (as Dropout(inplace=True) or a mul_ does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(1e38).mul_(10.0)  # (3e39: past float32)


def test_the_module_whose_in_place_op_overflows_is_named_not_its_caller():
    # the first input was judged after the module ran: written over in place, it read as non-finite
    # on the way in, and the finding blamed the caller ("the forward code of <model> itself, before
    # it calls 1"), so the FP32 search could only offer the whole model
    model = nn.Sequential(nn.Linear(2, 2), _InPlaceScale(), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.fill_(1.0), model[0].bias.fill_(1.0)
    f = trace_first_non_finite(model, nn.functional.mse_loss, torch.ones(3, 2), torch.zeros(3, 1),
                               Precision("fp32", "cpu"))
    assert (f.where, f.name, f.op, f.before) == ("forward", "1", "_InPlaceScale", "")


def test_a_value_the_caller_made_and_passed_as_a_keyword_names_the_caller():
    # the hooks saw no positional input: the Linear given the caller's inf as input= was blamed
    model = _KeywordCall()
    with torch.no_grad():
        model.a.weight.fill_(1.0), model.a.bias.fill_(1.0)  # (3 x 1000: exp overflows, whatever the seed)
    f = trace_first_non_finite(model, nn.functional.mse_loss, torch.full((3, 2), 1.0), torch.zeros(3, 1),
                               Precision("fp32", "cpu"))
    with torch.no_grad():
        assert not torch.isfinite(torch.exp(model.a(torch.ones(3, 2)) * 1000)).all()  # (the planted overflow)
    assert (f.where, f.name, f.op, f.before) == ("forward", "", "_KeywordCall", "b")


def test_a_parameter_that_is_not_finite_before_the_step_is_named_as_the_weights_problem():
    # a checkpoint of a diverged run: the first non-finite value is a module's output, in FP32 too;
    # "a data or model problem" did not say that the weights were NaN before the step, nor which
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].bias.fill_(float("nan"))
    result = diagnose(model, mse_to_zero, torch.ones(2, 4), torch.zeros(2, 1), Precision("bf16", "cpu"))
    assert result.verdict == "data/model" and result.amp.where == "forward" and result.amp.name == "1"
    assert result.bad_weight == "1.bias holds nan" and result.as_dict()["bad_weight"] == result.bad_weight
    assert result.message().endswith("FP32 replay is not finite either: the model's parameter 1.bias holds nan before "
                                     "the step (its weights, not the batch, not a precision problem)")
    # a non-finite batch comes first: it is the input's problem, whatever the weights
    x = torch.ones(2, 4)
    x[0, 0] = float("nan")
    assert diagnose(model, mse_to_zero, x, torch.zeros(2, 1), Precision("bf16", "cpu")).bad_weight == ""


def test_a_nan_born_in_backward_names_the_parameter():
    model = gate_net()
    x, y = torch.randn(5, 4), torch.randn(5, 4)
    # the premise: forward and loss are finite in both precisions
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
        with FP16.autocast():
            assert torch.isfinite(F.mse_loss(model(x).float(), y))

    result = diagnose(model, F.mse_loss, x, y, FP16)
    assert result.amp.where == "backward"
    assert result.amp.name == "gate.g"
    assert result.amp.op == "Gate"
    assert result.amp.kind in ("inf", "nan")
    # sqrt'(0) is inf in any precision: the replay is not clean either
    assert result.fp32.where == "backward" and result.fp32.name == "gate.g"
    assert result.verdict == "data/model"
    assert "gate.g" in result.message() and "backward" in result.message()


def test_a_non_finite_loss_is_the_loss():
    def exploding_loss(outputs, targets):
        return F.mse_loss(outputs.float(), targets) * math.inf

    model = gate_net()
    model.gate.g.data.fill_(1.0)  # nothing wrong in the model itself
    result = diagnose(model, exploding_loss, torch.randn(3, 4), torch.randn(3, 4), FP16)
    assert result.amp.where == "loss"
    assert result.amp.op == "exploding_loss"
    assert result.amp.kind == "inf"
    assert result.fp32.where == "loss"
    assert result.verdict == "data/model"


def test_a_loss_that_overflows_only_in_fp16_is_precision_range():
    def square_sum(outputs, targets):
        return (outputs * outputs).sum()  # fp16 * fp16 stays fp16 under autocast: 300**2 > 65504

    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4) * 100.0)
        lin.bias.zero_()
    result = diagnose(lin, square_sum, torch.full((2, 4), 3.0), None, FP16)
    assert result.amp.where == "loss"
    assert result.amp.op == "square_sum"
    assert result.fp32.where == "none"
    assert result.verdict == "precision-range"


def test_diagnose_changes_neither_parameters_nor_their_grads_nor_the_mode():
    model = gate_net()
    model.train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sentinels = {}
    for name, p in model.named_parameters():
        if name != "lin.bias":  # one parameter keeps grad None
            p.grad = torch.full_like(p, 7.0)
            sentinels[name] = p.grad
    # a backward finding: backward ran through every parameter, twice (fp16, fp32 replay)
    result = diagnose(model, F.mse_loss, torch.randn(5, 4), torch.randn(5, 4), FP16, loss_scale=1024.0)
    assert result.amp.where == "backward"

    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
        if name in sentinels:
            assert p.grad is sentinels[name], name
            assert torch.equal(p.grad, torch.full_like(p, 7.0)), name
        else:
            assert p.grad is None, name
    assert model.training
    # no hook is left behind: a clean batch through the model leaves .grad alone
    model.gate.g.data.fill_(1.0)
    clean = diagnose(model, F.mse_loss, torch.randn(5, 4), torch.randn(5, 4), FP16)
    assert clean.verdict == "none"
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    assert all(not p._backward_hooks for p in model.parameters())

    model.eval()
    diagnose(model, F.mse_loss, torch.randn(5, 4), torch.randn(5, 4), FP16)
    assert not model.training


# ---------------------------------------------------------------------------- refusals of the verb (issue 16)


def _config(**keys):
    from ampguard.config import validate

    return validate({"task": {"name": "linear"}, "device": "cpu", **keys})


@pytest.mark.parametrize("keys, arguments, message", [
    ({"steps": 3}, {"step": 4}, "locate: --step 4 is beyond the run's 3 steps (config steps)"),
    ({"precision": "fp16"}, {"scale": -2.0}, "locate: --scale must be a finite number > 0, got -2"),
    ({"precision": "fp16"}, {"scale": math.nan}, "locate: --scale must be a finite number > 0, got nan"),
    ({"precision": "bf16"}, {"scale": 4.0}, "locate: --scale: bf16 uses no loss scaler"),
    ({"precision": "fp32"}, {"scale": 1.0}, "locate: --scale: fp32 uses no loss scaler"),
])
def test_the_verb_refuses_before_anything_is_built(monkeypatch, keys, arguments, message):
    from ampguard import locate, tasks
    from ampguard.errors import InputError

    def no_task(config):
        raise AssertionError("the task was built before the refusal")

    monkeypatch.setattr(tasks, "build_task", no_task)
    with pytest.raises(InputError) as caught:
        locate.run(_config(**keys), **arguments)
    assert str(caught.value) == message


def test_a_step_beyond_the_run_is_fine_with_a_saved_batch(tmp_path, capsys):
    from ampguard import locate

    torch.save({"inputs": torch.ones(2, 16), "targets": torch.zeros(2, 4)}, tmp_path / "b.pt")
    assert locate.run(_config(steps=1, precision="bf16"), step=5, batch=str(tmp_path / "b.pt")) == 0
    assert "no non-finite value" in capsys.readouterr().out


def test_a_saved_batch_that_does_not_fit_is_one_input_error(tmp_path):
    from ampguard import locate
    from ampguard.errors import InputError

    path = tmp_path / "wide.pt"
    torch.save({"inputs": torch.ones(2, 17), "targets": torch.zeros(2, 4)}, path)
    with pytest.raises(InputError) as caught:
        locate.run(_config(precision="bf16"), batch=str(path))
    message = str(caught.value)
    assert message.startswith(f"locate: batch {path} does not fit the model of task linear: RuntimeError: ")
    assert "\n" not in message


@pytest.mark.parametrize("keys, batch_scale, checkpoint_scale, scale, expected", [
    ({"precision": "fp16"}, 1024.0, 512.0, 8.0, "8"),  # --scale over everything
    ({"precision": "fp16"}, 1024.0, 512.0, None, "1024"),  # the batch file's over the checkpoint's
    ({"precision": "fp16"}, None, 512.0, None, "512"),  # the checkpoint's over scaler.init_scale
    ({"precision": "fp16"}, None, None, None, "65536"),  # scaler.init_scale
    ({"precision": "fp16", "scaler": {"enabled": False}}, 1024.0, 512.0, None, "1"),  # no scaler: no saved scale
    ({"precision": "bf16"}, 1024.0, 512.0, None, "1"),  # no scaler at all: 1
])
def test_the_loss_scale_of_a_replay_comes_from_the_first_source_that_names_one(
        tmp_path, capsys, keys, batch_scale, checkpoint_scale, scale, expected):
    from ampguard import locate
    from ampguard.checkpoint import REQUIRED, save_checkpoint
    from ampguard.tasks import build_task

    config = _config(**keys)
    one = {"inputs": torch.zeros(2, 16), "targets": torch.zeros(2, 4)}
    torch.save({"micro_batches": [one], **({"loss_scale": batch_scale} if batch_scale else {})}, tmp_path / "b.pt")
    checkpoint = None
    if checkpoint_scale is not None:
        payload = {key: {} for key in REQUIRED if key not in ("magic", "format")}
        checkpoint = str(save_checkpoint(tmp_path / "step-00000001.pt", {
            **payload, "step": 1, "model": build_task(config).model.state_dict(),
            "state": {"scaler": FP16.make_scaler(init_scale=checkpoint_scale).state_dict()}}))
    assert locate.run(config, batch=str(tmp_path / "b.pt"), checkpoint=checkpoint, scale=scale) == 0
    assert f", loss scale {expected}\n" in capsys.readouterr().out


# ---------------------------------------------------------------------------- one module in FP32 (issue item 7)


class Mlp(nn.Module):
    """fc (x 1000: 4 * 1000 * 30 = 120000, past fp16's 65504) -> relu -> proj (x 1e-3: back to 480).

    fc alone in FP32 is not enough: its FP32 output goes into proj, which autocast runs in fp16
    (the input cast to fp16 is inf). fc and proj together, the mlp, in FP32 are finite.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        self.proj = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.fill_(1000.0)
            self.proj.weight.fill_(1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def blocks_net() -> nn.Module:
    """blocks.0 harmless, blocks.1.mlp the culprit; a head after them."""
    harmless = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        harmless.weight.copy_(torch.eye(4))
    head = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        head.weight.fill_(1e-4)  # small enough that its own gradient stays in fp16's range
    return nn.Sequential(OrderedDict(blocks=nn.Sequential(Block(harmless), Block(Mlp())), head=head))


def test_the_smallest_module_that_fixes_the_batch_in_fp32_is_named():
    model = blocks_net()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.full((2, 4), 30.0)  # blocks.0: 30 + 120 = 150; blocks.1.mlp.fc: 4 * 1000 * 150 overflows
    result = diagnose(model, mse_to_zero, x, torch.zeros(2, 1), FP16)

    assert result.verdict == "precision-range"
    assert result.amp.where == "forward" and result.amp.name == "blocks.1.mlp.fc"
    # fc alone is tried first and is not enough; with proj beside it, it is: they are every Linear of the mlp,
    # which is named (review 49a: a set of modules is tried before the parents)
    assert result.scopes_tried == ["blocks.1.mlp.fc", "blocks.1.mlp"]
    assert result.fp32_scope == "blocks.1.mlp"
    assert "keeping blocks.1.mlp in FP32 (autocast off around it alone) fixes this batch" in result.message()
    data = result.as_dict()
    assert data["fp32_scope"] == "blocks.1.mlp" and data["scopes_tried"] == result.scopes_tried
    # the replays left no wrapper behind and changed nothing
    assert all("forward" not in vars(m) for m in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    with torch.autocast("cpu", dtype=torch.float16):
        assert model.blocks[1].mlp.fc(torch.ones(1, 4)).dtype == torch.float16  # autocast is back on for it


def test_a_module_kept_in_fp32_alone_really_fixes_the_batch():
    # the finding is an experiment, not a guess: run the batch by hand with the named module in FP32
    model, x = blocks_net(), torch.full((2, 4), 30.0)
    mlp = model.blocks[1].mlp
    plain = mlp.forward

    def fp32_forward(inputs):
        with torch.autocast("cpu", enabled=False):
            return plain(inputs.float())

    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
        mlp.forward = fp32_forward
        assert torch.isfinite(model(x)).all()
    del mlp.forward


def test_when_no_module_alone_fixes_it_the_message_says_so():
    # body.big's FP32 output of 120000 goes into head, a Linear autocast runs in fp16 (inf again);
    # body holds only big: only the model as a whole in FP32 is finite
    model = huge_linear_net()
    model.head = nn.Linear(2, 2)
    x, zeros = torch.full((3, 4), 30.0), torch.zeros(3, 2)
    result = diagnose(model, mse_to_zero, x, zeros, FP16)
    assert result.verdict == "precision-range" and result.amp.name == "body.big"
    assert result.scopes_tried == ["body.big", ""]  # (body.big + head fixed it: every Linear, the model)
    assert result.fp32_scope == ""
    assert result.message().endswith("; keeping body.big in FP32 does not fix it; the whole model in FP32 "
                                     "(autocast off, the same loss scale) fixes this batch")

    # a loss whose matmul autocast runs in fp16: 120000 overflows there whatever runs in FP32 before
    def gram_loss(outputs, targets):
        return (outputs @ outputs.T).float().mean()

    result = diagnose(huge_linear_net(), gram_loss, x, zeros, FP16)
    assert result.verdict == "precision-range" and result.amp.name == "body.big"
    assert result.scopes_tried == ["body.big", "body", ""]
    assert result.fp32_scope is None
    assert result.message().endswith("; no module in FP32 fixes this batch (tried body.big, body, <model>); "
                                     "run the whole step in FP32")

    # a data problem is never sent looking for a module to keep in FP32
    bad = torch.full((3, 4), 30.0)
    bad[0, 0] = float("nan")
    result = diagnose(huge_linear_net(), mse_to_zero, bad, zeros, FP16)
    assert result.verdict == "data/model" and result.scopes_tried == [] and result.fp32_scope is None


def test_a_backward_overflow_without_a_loss_scale_does_not_blame_the_scale():
    # targets of 1e8: the gradient itself overflows fp16 with no loss scale at all (locate --scale 1)
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    x, y = torch.ones(2, 4), torch.full((2, 1), 1e8)  # dL/dout = 2 * (4 - 1e8) / 2 ~ -1e8: inf in fp16
    unscaled = diagnose(lin, F.mse_loss, x, y, FP16, loss_scale=1.0)
    assert unscaled.amp.where == "backward" and unscaled.verdict == "precision-range"
    assert "scaled by" not in unscaled.message()
    assert "overflows fp16 with no loss scale" in unscaled.message()

    small = torch.full((2, 1), 100.0)  # dL/dout ~ -96: finite unscaled, inf times 2**20
    scaled = diagnose(lin, F.mse_loss, x, small, FP16, loss_scale=2.0**20)
    assert scaled.amp.where == "backward"
    assert "the gradient scaled by 1.04858e+06 overflows fp16" in scaled.message()
    # (review_27e: the scaler's own back-off read as "only the whole model in FP32 fixes this batch")
    assert "which the loss scaler answers by halving the scale" in scaled.message()
    assert "fixes this batch" not in scaled.message() and "fixes this batch" in unscaled.message()
    # (review_27f: at the scaler's floor it cannot halve: a range problem, with where to look)
    scaled.scale_floor = 2.0**20
    assert "at the loss scaler's floor 1.04858e+06, scaler.min_scale: it cannot halve further" in scaled.message()
    assert "halving the scale" not in scaled.message() and "FP32" in scaled.message().split("further)")[1]
    # (review_27g: a floor of 0.1 is 0.10000000149 as the float32 scale: at it, not above it)
    scaled.loss_scale, scaled.scale_floor = float(torch.tensor(0.1)), 0.1
    assert "at the loss scaler's floor 0.1" in scaled.message()
    # the finite loss whose backward overflowed is the evidence: its size in the finding (it was null)
    assert scaled.amp.loss == pytest.approx(96.0**2, rel=1e-2) and scaled.as_dict()["amp"]["loss"] == scaled.amp.loss
    assert f"from a finite loss {scaled.amp.loss:.4g}." in scaled.message()


# ---------------------------------------------------------------------------- as the step runs it (review of locate)


def test_with_accumulation_locate_replays_the_loss_scale_the_step_backpropagates():
    # the step backpropagates scaler.scale(loss / N). Here dL/dout = 2 (4 - 3) / 2 = 1, so the fp16
    # output gradient is scale / N: with N = 4, 2**16 / 4 is finite and 2**18 / 4 = 65536 is inf
    from ampguard.locate import diagnose_group
    from ampguard.step import AmpTrainState

    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    batches = [(torch.ones(2, 4), torch.full((2, 1), 3.0))] * 4
    for scale, overflows in ((2.0**16, False), (2.0**18, True)):
        state = AmpTrainState(lin, torch.optim.SGD(lin.parameters(), lr=0.0), F.mse_loss, precision="fp16",
                              accumulation_steps=4, max_norm=None, scaler=torch.amp.GradScaler("cpu", init_scale=scale))
        record = [state.step(x, y) for x, y in batches][-1]
        assert record.skipped is overflows
        result = diagnose_group(lin, F.mse_loss, batches, FP16, scale, accumulation_steps=4)
        assert (result.verdict == "precision-range") is overflows, scale
        assert diagnose_group(lin, F.mse_loss, batches, FP16, scale).verdict == result.verdict  # N: the batches'
    assert diagnose_group(lin, F.mse_loss, batches[:1], FP16, 2.0**16, accumulation_steps=1).amp.where == "backward"


def test_the_verb_divides_by_the_configs_accumulation_steps(capsys):
    from ampguard import locate

    # the linear task's clean step 1 overflows at 2**17 with one micro-batch, and not at 2**17 / 4
    config = _config(precision="fp16", accumulation_steps=4, scaler={"init_scale": 2.0**17})
    assert locate.run(config) == 0
    assert "loss scale 131072\nno non-finite value" in capsys.readouterr().out
    assert locate.run(_config(precision="fp16", scaler={"init_scale": 2.0**19})) == 1


def test_the_verb_replays_fp8_on_the_model_train_runs(tmp_path, capsys):
    pytest.importorskip("torchao")
    from ampguard import locate
    from ampguard.checkpoint import REQUIRED, save_checkpoint
    from ampguard.errors import InputError
    from ampguard.tasks import build_task

    # train refuses the linear task's bare Linear in fp8: so does locate (it replayed bf16 instead)
    with pytest.raises(InputError, match="^precision: fp8: no Linear layer can train in fp8"):
        locate.run(_config(precision="fp8"))

    # digits (64-16-16-10): the middle Linear converts; a weight of inf there is found in a Float8Linear
    config = _config(precision="fp8", task={"name": "digits", "n_embd": 8})
    weights = build_task(config).model.state_dict()
    weights["2.weight"][0, 0] = math.inf
    payload = {key: {} for key in REQUIRED if key not in ("magic", "format")}
    checkpoint = save_checkpoint(tmp_path / "step-00000001.pt", {**payload, "step": 1, "model": weights, "state": {}})
    assert locate.run(config, checkpoint=str(checkpoint), as_json=True) == 1
    import json

    found = json.loads(capsys.readouterr().out)
    assert (found["amp"]["where"], found["amp"]["name"], found["amp"]["op"]) == ("forward", "2", "Float8Linear")


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # log(0) = -inf in any precision: a model problem


def test_every_pass_draws_the_same_dropout_masks():
    # a dropped input gives log(0) = -inf in float32 in both passes: never a precision problem.
    # When the FP32 replay drew its own mask, some seeds read "precision-range" (seed 2 did)
    model = nn.Sequential(nn.Dropout(0.5), Log()).train()
    x, y = torch.ones(1, 1), torch.zeros(1, 1)
    verdicts = set()
    for seed in range(8):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        result = diagnose(model, F.mse_loss, x, y, Precision("bf16", "cpu"))
        verdicts.add(result.verdict)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is put back
    assert verdicts == {"none", "data/model"}


class TwoPaths(nn.Module):
    """Dropout, then fc.lin on the first input and other on the second, each x 1000: a kept input
    of 50 (100 after dropout's scaling) gives 100000, past fp16's 65504; a dropped one gives 0."""

    def __init__(self) -> None:
        super().__init__()
        lin, self.other = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)
        self.drop, self.fc = nn.Dropout(0.5), nn.Sequential(OrderedDict(lin=lin))
        with torch.no_grad():
            lin.weight.fill_(1000.0)
            self.other.weight.fill_(1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.drop(x)
        return torch.cat([self.fc(d[:, :1]), self.other(d[:, 1:])], dim=1)


def test_every_module_alone_replay_draws_the_same_dropout_masks():
    # fc.lin overflows first; fc.lin (or fc) alone in FP32 fixes the batch exactly when other's input
    # was dropped, else only the model does
    model, x = TwoPaths().train(), torch.full((1, 2), 50.0)
    scopes = []
    for seed in range(12):
        torch.manual_seed(seed)
        kept = F.dropout(torch.ones(1, 2), 0.5) != 0  # the mask the AMP pass draws
        torch.manual_seed(seed)
        result = diagnose(model, mse_to_zero, x, torch.zeros(1, 2), FP16)
        if kept[0, 0]:
            assert result.amp.name == "fc.lin" and result.verdict == "precision-range", seed
            assert result.fp32_scope == ("" if kept[0, 1] else "fc.lin"), seed
            scopes.append(result.fp32_scope)
    assert set(scopes) == {"", "fc.lin"}  # both cases were seen


class ExpBetween(nn.Module):
    """fc1 -> torch.exp in its own forward -> fc2: exp(12) = 162755 is inf in fp16, born between modules."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(2, 2), nn.Linear(2, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(1.0)
            self.fc1.bias.zero_()
            self.fc2.weight.copy_(torch.tensor([[1.0, -1.0]]))  # inf - inf: fc2's output is nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.exp(self.fc1(x)))


def test_a_value_born_in_a_modules_own_code_names_that_module_not_the_next():
    model = nn.Sequential(OrderedDict(block=ExpBetween()))
    result = diagnose(model, mse_to_zero, torch.full((1, 2), 6.0), torch.zeros(1, 1), FP16)

    amp = result.amp
    assert (amp.where, amp.name, amp.op, amp.before) == ("forward", "block", "ExpBetween", "block.fc2")
    assert amp.kind == "inf"  # what exp made, not fc2's nan
    assert amp.input_dtypes == ["float32"] and amp.output_dtypes == ["float16"]
    assert result.verdict == "precision-range"
    assert result.scopes_tried == ["block"] and result.fp32_scope == "block"  # the search starts at block
    assert result.message().startswith("first inf under fp16: in the forward code of block itself (ExpBetween; "
                                       "inputs float32 -> outputs float16), before it calls block.fc2. ")
    assert result.as_dict()["amp"]["before"] == "block.fc2"


class MaskedScores(nn.Module):
    """softmax(x x^T + mask): the mask of -inf is a later input, normal; the scores overflow fp16 here."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(-1, -2) + mask, dim=-1)


class Attends(nn.Module):
    def __init__(self, weight: float) -> None:
        super().__init__()
        self.proj, self.scores = nn.Linear(4, 4, bias=False), MaskedScores()
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(4) * weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((x.shape[0], x.shape[0]), -math.inf).triu(1)
        return self.scores(self.proj(x), mask)


def test_a_mask_of_minus_inf_passed_to_a_module_is_no_finding():
    x, y = torch.ones(3, 4), torch.zeros(3, 3)
    assert diagnose(Attends(1.0), mse_to_zero, x, y, FP16).verdict == "none"
    # 300 * 300 * 4 = 360000 overflows fp16 in the matmul: born in scores, not in its caller's mask
    result = diagnose(Attends(300.0), mse_to_zero, x, y, FP16)
    assert (result.amp.where, result.amp.name, result.amp.before) == ("forward", "scores", "")
    assert result.verdict == "precision-range" and result.fp32_scope == "scores"


def test_non_finite_targets_are_the_batch_unless_the_loss_masks_them():
    model = gate_net()
    model.gate.g.data.fill_(1.0)
    y = torch.randn(3, 4)
    y[1, 2] = math.nan
    result = diagnose(model, F.mse_loss, torch.randn(3, 4), y, FP16)
    assert (result.amp.where, result.amp.name, result.amp.kind) == ("input", "targets", "nan")
    assert result.verdict == "data/model" and "in the batch's targets" in result.message()

    def masked_mse(outputs, targets):  # NaN targets mark missing values: left out of the mean
        keep = ~targets.isnan()
        return ((outputs.float() - targets.nan_to_num()) ** 2)[keep].mean()

    assert diagnose(model, masked_mse, torch.randn(3, 4), y, FP16).verdict == "none"


def test_the_verb_names_the_tasks_loss_not_the_fault_injectors_wrapper(tmp_path, capsys):
    from ampguard import locate

    # inputs of 1e20: the Linear's outputs are finite, their squares (1e40) overflow the float32 loss
    torch.save({"inputs": torch.full((2, 16), 1e20), "targets": torch.zeros(2, 4)}, tmp_path / "huge.pt")
    assert locate.run(_config(precision="bf16"), batch=str(tmp_path / "huge.pt")) == 1
    assert "first inf under bf16: in the loss (mse_loss)." in capsys.readouterr().out


def test_a_saved_batch_without_examples_or_with_a_bad_loss_scale_is_one_input_error(tmp_path, capsys):
    from ampguard import locate
    from ampguard.errors import InputError

    one = {"inputs": torch.zeros(2, 16), "targets": torch.zeros(2, 4)}
    cases = {
        "empty.pt": ({"inputs": torch.zeros(0, 16), "targets": torch.zeros(0, 4)},
                     "the batch holds no examples (inputs of shape (0, 16))"),
        "empty_micro.pt": ({"micro_batches": [one, {"inputs": torch.zeros(0, 16), "targets": torch.zeros(0, 4)}]},
                           "micro-batch 1 holds no examples (inputs of shape (0, 16))"),
        "bool.pt": ({**one, "loss_scale": True}, "loss_scale must be a finite number > 0, got True"),
        "zero.pt": ({**one, "loss_scale": 0}, "loss_scale must be a finite number > 0, got 0"),
    }
    for name, (data, message) in cases.items():
        torch.save(data, tmp_path / name)
        with pytest.raises(InputError) as caught:
            locate.run(_config(precision="fp16"), batch=str(tmp_path / name))
        assert str(caught.value) == f"{tmp_path / name}: {message}"

    torch.save({"micro_batches": [one], "loss_scale": 8}, tmp_path / "int.pt")  # an int scale is a scale
    assert locate.run(_config(precision="fp16"), batch=str(tmp_path / "int.pt")) == 0
    assert ", loss scale 8\n" in capsys.readouterr().out


class InfBelowFP32(nn.Module):
    """Finite in FP32, inf in any lower precision: a precision-range problem after the layer before it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 if x.dtype == torch.float32 else math.inf)


def test_under_fp8_the_fp32_replays_compute_the_float8_layers_in_fp32():
    """The FP32 replay, and a scope kept in FP32, run a ``Float8Linear`` as a plain FP32 linear on
    its master weights: autocast off does not reach torchao's float8 casts."""
    pytest.importorskip("torchao")
    from ampguard.fp8 import convert_to_fp8
    from ampguard.locate import fp32_around

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16), InfBelowFP32())
    assert convert_to_fp8(model) == ["1"]
    # (autocast on, input, output) of each call of the float8 layer; in a queue, which the replays' put-back
    # does not look into (what they capture into a hook's list is put back)
    calls = queue.SimpleQueue()
    model[1].register_forward_hook(lambda m, args, out: calls.put((torch.is_autocast_enabled("cpu"), args[0], out)))
    x, y = torch.randn(8, 16), torch.zeros(8, 16)
    d = diagnose(model, F.mse_loss, x, y, Precision("fp8", "cpu"))
    assert (d.verdict, d.amp.name, d.fp32.where, d.fp32_scope) == ("precision-range", "3", "none", "3")
    plain = lambda inputs: F.linear(inputs, model[1].weight, model[1].bias)  # noqa: E731
    # the AMP pass, the FP32 replay, the float8 scales' replay (under AMP too)
    seen = [calls.get() for _ in range(calls.qsize())]
    (amp_on, amp_in, amp_out), (fp32_on, fp32_in, fp32_out), (scales_on, *_) = seen[:3]
    assert amp_on and scales_on and not torch.allclose(amp_out.float(), plain(amp_in.float()))  # float8 ran under AMP
    assert not fp32_on and fp32_out.dtype == torch.float32 and torch.equal(fp32_out, plain(fp32_in))

    h = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp32_around(model, ""):  # a scope holding it
        out = model[1](h)
    assert out.dtype == torch.float32 and torch.equal(out, plain(h))
    assert "forward" not in vars(model[1]) and "forward" not in vars(model)  # put back


def test_a_finite_replay_names_the_steps_loss_so_a_spikes_evidence_says_how_large():
    from ampguard.locate import diagnose_group

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)), (torch.randn(4, 3), 1e4 * torch.randn(4, 1))]  # a spike
    with torch.no_grad():
        expected = sum(float(F.mse_loss(model(x), y)) for x, y in batches) / 2  # the step's loss: the mean
    d = diagnose_group(model, F.mse_loss, batches, Precision("fp32", "cpu"))
    assert d.verdict == "none" and d.amp.loss == pytest.approx(expected, rel=1e-6) and expected > 1e6
    assert d.message() == f"no non-finite value in forward, loss or backward under fp32 (loss {expected:.4g})"
    assert d.as_dict()["amp"]["loss"] == d.amp.loss


# ---------------------------------------------------------------------------- review 37b


BF16 = Precision("bf16", "cpu")
FP32 = Precision("fp32", "cpu")


class PassThrough(nn.Module):
    """exp in its own code, then a Sequential that only passes the value on to its Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.exp(self.a(x) * 1000))


def test_a_value_made_by_the_model_and_passed_through_a_wrapper_names_the_model_not_the_wrapper():
    # (the Sequential, with no code of its own, was named the maker "before it calls mlp.0")
    torch.manual_seed(0)
    model = PassThrough()
    with torch.no_grad():
        model.a.weight.fill_(1.0), model.a.bias.fill_(1.0)
    found = trace_first_non_finite(model, F.mse_loss, torch.ones(3, 2), torch.zeros(3, 2), FP32)
    assert (found.where, found.name, found.op, found.before) == ("forward", "", "PassThrough", "mlp")


class MaskOut(nn.Module):
    """Writes a causal mask of -inf (the model means it) into attention scores."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], x.shape[0]), -math.inf).triu(1)


class MaskedAttention(nn.Module):
    """A causal mask (all -inf where not finite, in FP32 too), then an MLP whose first Linear
    outputs 1e5: finite in FP32, past fp16's 65504."""

    def __init__(self, big: float = 1.0) -> None:
        super().__init__()
        self.q, self.mask, self.up = nn.Linear(4, 4), MaskOut(), nn.Linear(4, 4)
        with torch.no_grad():
            self.up.weight.fill_(big), self.up.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        h = torch.softmax(h @ h.T + self.mask(x), dim=-1) @ h
        return self.up(h.abs() + 1).float().mean(dim=1, keepdim=True)


def test_a_minus_inf_mask_the_model_writes_is_no_finding_and_does_not_hide_a_later_overflow():
    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.zeros(3, 1)
    clean = diagnose(MaskedAttention(), F.mse_loss, x, y, BF16)  # (was data/model, exit 1, on a finite step)
    assert clean.verdict == "none"
    assert "the inf in the forward output of mask (MaskOut" in clean.message()
    # the mask comes first; the step's overflow comes after it, and is the finding
    torch.manual_seed(0)
    model = MaskedAttention(big=3e4)
    result = diagnose(model, F.mse_loss, x, y, FP16)
    assert (result.amp.where, result.amp.name, result.verdict) == ("forward", "up", "precision-range")
    assert "mask" not in result.message()

    class Policy(nn.Module):  # logits of a forbidden action masked to -inf, then cross-entropy
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x).masked_fill(torch.tensor([False, False, True]), -math.inf)

    assert diagnose(Policy(), F.cross_entropy, x, torch.tensor([0, 1, 0]), BF16).verdict == "none"


def test_a_negative_overflow_is_still_a_finding():
    # (an all -inf value that FP32 does not write is the precision's: not taken for a mask)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.fill_(-1e3), model[0].bias.zero_()
    result = diagnose(model, F.mse_loss, torch.full((1, 2), 50.0), torch.zeros(1, 1), FP16)
    assert (result.amp.where, result.amp.name, result.amp.kind, result.verdict) == \
        ("forward", "0", "inf", "precision-range")


def test_a_nan_in_an_input_container_pytree_does_not_know_is_the_inputs():
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        features: torch.Tensor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, batch: Batch) -> torch.Tensor:
            return self.fc(batch.features)

    x = torch.randn(3, 4)
    x[0, 0] = math.nan
    result = diagnose(Net(), F.mse_loss, Batch(x), torch.zeros(3, 1), BF16)
    assert (result.amp.where, result.amp.name, result.verdict) == ("input", "", "data/model")


def test_a_nan_input_the_model_masks_out_is_no_finding():
    class Clean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.nan_to_num())

    x = torch.randn(3, 4)
    x[1, 1] = math.nan
    result = diagnose(Clean(), F.mse_loss, x, torch.zeros(3, 1), BF16)
    assert result.verdict == "none" and result.amp.absorbed == "the nan in the input batch"
    assert "did not reach them" in result.message()


def test_nan_targets_the_loss_masks_beside_its_own_fp16_overflow_name_the_loss():
    def masked_sq(outputs, targets):  # NaN targets are missing values; the sum overflows in fp16
        keep = ~targets.isnan()
        return ((outputs - targets.nan_to_num().to(outputs.dtype)) ** 2)[keep].sum()

    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(200.0), model.bias.zero_()
    y = torch.zeros(2, 2)
    y[0, 0] = math.nan
    result = diagnose(model, masked_sq, torch.ones(2, 2), y, FP16)
    assert (result.amp.where, result.amp.op, result.amp.kind, result.verdict) == \
        ("loss", "masked_sq", "inf", "precision-range")
    assert result.message().endswith("compute the loss in FP32 (on the outputs cast to float32, outside autocast)")


def test_a_skip_for_a_global_norm_past_float32_with_every_gradient_finite_is_explained():
    model = nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([1.0, -1.0] * 32))  # x.w = 0: a loss of 0

    def loss_fn(out, y):  # each gradient 1e38: finite; the sum of their squares is not
        return (out * 5e37).mean()

    from ampguard.clipping import global_l2_norm

    out = model(torch.full((4, 64), 2.0))
    loss_fn(out, None).backward()
    assert bool(torch.isfinite(model.weight.grad).all()) and not math.isfinite(float(global_l2_norm(model.parameters())))
    model.weight.grad = None
    result = diagnose(model, loss_fn, torch.full((4, 64), 2.0), torch.zeros(4, 1), FP32)
    assert (result.amp.where, result.amp.name, result.amp.op, result.verdict) == \
        ("backward", "", "global L2 norm of the gradients (float32; every gradient finite)", "data/model")
    assert "the global L2 norm of the gradients (float32; every gradient finite)" in result.message()


def test_a_submodule_that_raises_and_is_caught_does_not_shift_the_callers_entries():
    class Fast(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no fast kernel here")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fast, self.fc = Fast(), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                x = self.fast(x)
            except RuntimeError:
                pass
            return self.fc(torch.exp(x * 1000))

    found = trace_first_non_finite(nn.Sequential(Block()), F.mse_loss, torch.ones(3, 2), torch.zeros(3, 2), FP32)
    assert (found.where, found.name, found.op, found.before) == ("forward", "0", "Block", "0.fc")


def test_a_buffer_the_forward_registers_again_with_another_shape_is_put_back():
    class Cached(nn.Module):  # a rotary cos/sin cache grown for a longer input
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("cache", torch.zeros(2, 4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > self.cache.shape[0]:
                self.register_buffer("cache", torch.zeros(x.shape[0], 4), persistent=False)
            return self.fc(x) + self.cache[: x.shape[0]]

    model = Cached()
    cache = model.cache
    assert diagnose(model, F.mse_loss, torch.randn(8, 4), torch.zeros(8, 4), BF16).verdict == "none"
    assert model.cache is cache and model.cache.shape == (2, 4)


def test_parameters_the_forward_changes_in_place_are_named_in_a_warning():
    class Momentum(nn.Module):  # a momentum encoder: its target follows the online weights in forward
        def __init__(self) -> None:
            super().__init__()
            self.online, self.target = nn.Linear(2, 2), nn.Linear(2, 2)
            self.target.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                for t, o in zip(self.target.parameters(), self.online.parameters()):
                    t.mul_(0.9).add_(o, alpha=0.1)
            return self.online(x) + self.target(x)

    x = torch.ones(1, 2)
    x[0, 0] = math.nan
    with pytest.warns(UserWarning, match=r"the replay changed 2 parameters in place \(target.weight, target.bias\)"):
        diagnose(Momentum(), F.mse_loss, x, torch.zeros(1, 2), BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a model that changes none: no warning)
        diagnose(nn.Linear(2, 2), F.mse_loss, x, torch.zeros(1, 2), BF16)


def test_a_model_compiled_by_its_factory_is_replayed_under_its_own_module_names():
    # (named '_orig_mod.0.0', a name fp32_modules does not take; each hook a recompile)
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2)), nn.Linear(2, 1))
    with torch.no_grad():
        inner[0][0].weight.fill_(1e3), inner[0][0].bias.zero_()
    result = diagnose(torch.compile(inner, backend="eager"), F.mse_loss, torch.full((1, 2), 50.0), torch.zeros(1, 1),
                      FP16)
    assert (result.amp.name, result.fp32_scope, result.scopes_tried) == ("0.0", "0.0", ["0.0"])


# ---------------------------------------------------------------------------- review 37e


def test_a_nan_the_model_masks_out_does_not_hide_a_later_overflow():
    # (the masked NaN was named, "precision-range" with no module: FP32 ends finite around it)
    class Clean(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.nan_to_num()).float().sum(dim=1, keepdim=True)

    model = Clean()
    with torch.no_grad():
        model.fc.weight.fill_(1e3), model.fc.bias.zero_()
    x = torch.full((1, 2), 100.0)  # (the other column alone: 1e5, past fp16's 65504)
    x[0, 0] = math.nan
    result = diagnose(model, F.mse_loss, x, torch.zeros(1, 1), FP16)
    assert (result.amp.where, result.amp.name, result.verdict) == ("forward", "fc", "precision-range")


def test_a_mask_is_looked_past_element_by_element_not_module_by_module():
    class Scores(nn.Module):  # a -inf mask in column 0 (FP32 too); under fp16 column 1 overflows to -inf
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.full((2, 2), -1e3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x @ self.w).masked_fill(torch.tensor([True, False]), -math.inf)

    class Square(nn.Module):
        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return s[:, 1:] ** 2

    result = diagnose(nn.Sequential(Scores(), Square()), F.mse_loss, torch.full((1, 2), 50.0), torch.zeros(1, 1), FP16)
    assert (result.amp.where, result.amp.name, result.amp.before, result.fp32_scope) == ("forward", "0", "", "0")


def test_an_additive_mask_in_the_batch_is_looked_past():
    class Attends(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(2, 2), nn.Linear(2, 1)

        def forward(self, batch: dict) -> torch.Tensor:
            h = self.fc(batch["x"])  # overflows fp16
            return self.head(torch.softmax(h + batch["mask"], -1) * h)

    model = Attends()
    with torch.no_grad():
        model.fc.weight.fill_(1e3), model.fc.bias.zero_()
    batch = {"x": torch.full((1, 2), 50.0), "mask": torch.tensor([[0.0, -math.inf]])}
    result = diagnose(model, F.mse_loss, batch, torch.zeros(1, 1), FP16)
    assert (result.amp.where, result.amp.name, result.verdict) == ("forward", "fc", "precision-range")


def test_a_groups_summed_gradients_past_float32_are_the_finding():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)

    def loss_fn(out, y):  # each micro-batch's gradient 2e38: finite; their sum is not
        return (out * 2e38).mean()

    batch = (torch.ones(1, 1), torch.zeros(1, 1))
    result = diagnose_group(model, loss_fn, [batch, batch], FP32, accumulation_steps=1)
    assert (result.amp.where, result.amp.name, result.verdict) == ("backward", "weight", "data/model")
    assert "summed over the group's micro-batches" in result.message() and model.weight.grad is None


def test_each_micro_batch_is_replayed_with_the_dropout_masks_the_step_drew_for_it():
    class Recorded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop, self.fc = nn.Dropout(0.5), nn.Linear(8, 1)
            self.note = masks.append  # (a list of its own would be given its contents back after each replay)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.drop(x)
            self.note((h != 0).flatten().tolist())
            return self.fc(h)

    masks: list[list[bool]] = []
    model, x, y = Recorded(), torch.ones(1, 8), torch.zeros(1, 1)
    torch.manual_seed(0)
    from ampguard.checkpoint import rng_state

    start = rng_state()
    model(x), model(x)  # what the step drew for its two micro-batches
    drawn = masks[:]
    masks.clear()
    diagnose_group(model, F.mse_loss, [(x, y), (x, y)], FP32, rng=start)
    assert masks == drawn * 2 and drawn[0] != drawn[1]  # (each micro-batch, then the group's sum)


def test_activation_checkpointing_recomputes_the_module_kept_in_fp32_in_fp32():
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(2, 2), nn.LayerNorm(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.fc(x))

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block, self.head = Block(), nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(checkpoint(self.block, x, use_reentrant=False))

    torch.manual_seed(0)
    model = Checkpointed()
    with torch.no_grad():
        model.block.fc.weight.fill_(1e3), model.block.fc.bias.zero_()
    result = diagnose(model, F.mse_loss, torch.full((4, 2), 50.0), torch.zeros(4, 1), FP16)  # (a CheckpointError)
    assert (result.amp.name, result.fp32_scope) == ("block.fc", "block.fc")


def test_odd_batches_buffers_and_hooks_the_replay_survives():
    import dataclasses

    @dataclasses.dataclass
    class Node:  # a batch that holds itself, and a field never set
        x: torch.Tensor
        parent: object = None
        later: int = dataclasses.field(init=False)

    node = Node(torch.ones(3, 2))
    node.parent = node
    net = nn.Linear(2, 1)

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.register_buffer("cache", None)  # filled by the forward: taken out again after

        def forward(self, n: Node) -> torch.Tensor:
            self.cache = torch.zeros(1)
            return self.net(n.x)

    model = Reads()
    assert diagnose(model, F.mse_loss, node, torch.zeros(3, 1), FP32).verdict == "none"  # (RecursionError)
    assert model.cache is None

    class Fallback(nn.Module):  # a hook of the user's that raises before the trace's pre-hook ran
        def __init__(self) -> None:
            super().__init__()
            self.fast, self.slow = nn.Linear(2, 1), nn.Linear(2, 1)
            self.fast.register_forward_pre_hook(lambda m, args: 1 / 0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                return self.fast(x)
            except ZeroDivisionError:
                return self.slow(x)

    assert diagnose(Fallback(), F.mse_loss, torch.ones(3, 2), torch.zeros(3, 1), FP32).verdict == "none"  # (IndexError)
    sparse = nn.Sequential(nn.Embedding(10, 2, sparse=True), nn.Flatten(), nn.Linear(4, 1))
    result = diagnose(sparse, F.mse_loss, torch.tensor([[1, 2]]), torch.zeros(1, 1), FP32)  # (NotImplementedError)
    assert result.verdict == "none"
    with torch.inference_mode():
        stats = torch.zeros(2)  # a buffer that is an inference tensor (loaded under inference_mode)

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 1)
            self.register_buffer("stats", stats)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x - self.stats)

    assert diagnose(Centred(), F.mse_loss, torch.ones(2, 2), torch.zeros(2, 1), FP32).verdict == "none"  # (restore raised)


def test_a_nan_a_post_accumulate_hook_writes_is_named_on_its_parameter():
    model = nn.Linear(2, 1)

    def spoil(p: torch.Tensor) -> None:
        p.grad.fill_(math.nan)

    model.weight.register_post_accumulate_grad_hook(spoil)
    result = diagnose(model, F.mse_loss, torch.ones(3, 2), torch.zeros(3, 1), FP32)
    assert (result.amp.where, result.amp.name, result.amp.kind) == ("backward", "weight", "nan")
    assert "every gradient finite" not in result.message()


def test_a_model_with_a_method_named_like_fsdp2s_is_not_taken_for_a_sharded_one():
    from ampguard.distributed import is_sharded

    class Own(nn.Linear):
        def set_requires_gradient_sync(self, sync: bool) -> None:
            pass

    assert not is_sharded(Own(2, 1))


# ---------------------------------------------------------------------------- review 37i


def test_the_first_skip_diagnosis_replays_the_dropout_masks_each_micro_batch_drew():
    # (FirstSkipDiagnosis kept no RNG state: the replay drew other masks and found nothing in 6 of 13 skips)
    from ampguard.guards import FirstSkipDiagnosis
    from ampguard.step import AmpTrainState

    x, y = torch.ones(1, 8), torch.zeros(1, 1)
    x[0, 0] = 2e38  # finite; dropout's x2 makes it inf where its mask keeps it
    found = []
    for seed in range(8):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Dropout(0.5), nn.Linear(8, 1))
        state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="fp32",
                              accumulation_steps=2)
        diagnosis = FirstSkipDiagnosis(state, model)
        for batch in [(torch.ones(1, 8), y), (x, y)]:
            torch.rand(3)  # (the loop draws between micro-batches too: an augmentation)
            diagnosis.capture(batch)
            record = state.step(*batch)
        if record.skipped:
            found.append(diagnosis.after(record))
    assert found and all("no non-finite value" not in f for f in found), found


class CausalMask(nn.Module):
    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return s.masked_fill(torch.ones(s.shape[-1], s.shape[-1], dtype=torch.bool).triu(1), -math.inf)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask, self.out = CausalMask(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mask(x @ x.transpose(-1, -2)).softmax(-1) @ x)


def test_a_mask_is_looked_past_when_the_fp32_replay_fails_too():
    # (a data/model finding named the model's own -inf mask, not the weight or the targets)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 4)
    model = Attention()
    with torch.no_grad():
        model.out.weight[0, 0] = math.inf
    result = diagnose(model, F.mse_loss, x, torch.zeros(2, 4, 1), BF16)
    assert (result.amp.where, result.amp.name, result.verdict, result.bad_weight) == \
        ("forward", "out", "data/model", "out.weight holds inf")
    y = torch.zeros(2, 4, 1)
    y[0, 0, 0] = math.nan
    result = diagnose(Attention(), F.mse_loss, x, y, BF16)
    assert (result.amp.where, result.amp.name, result.verdict) == ("input", "targets", "data/model")
    assert result.fp32.where == "input"  # (the FP32 replay's finding looks past the mask too)


def test_a_groups_scaled_sum_past_float32_is_said_as_such():
    class Scale(nn.Module):  # an elementwise op: float32 under autocast, its gradient too
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    def loss_fn(out, y):  # /2 accumulation, x65536 scale: 2e38 a micro-batch, 4e38 summed
        return out.float().mean() * (2e38 * 2 / 65536)

    batch = (torch.ones(1, 1), torch.zeros(1, 1))
    result = diagnose_group(Scale(), loss_fn, [batch, batch], FP16, 65536.0, accumulation_steps=2)
    assert result.verdict == "precision-range"
    assert "the micro-batches' gradients scaled by 65536 sum past float32's range; the loss scaler answers it" \
        in result.message() and "overflows fp16" not in result.message()


def test_a_sparse_csr_or_nested_side_output_is_left_out_not_a_crash():
    class Side(nn.Module):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.fc, self.kind = nn.Linear(2, 1), kind

        def forward(self, x: torch.Tensor):
            side = torch.eye(2).to_sparse_csr() if self.kind == "csr" else torch.nested.nested_tensor([torch.ones(2)])
            return self.fc(x), side

    for kind in ("csr", "nested"):
        result = diagnose(Side(kind), lambda out, y: F.mse_loss(out[0], y), torch.ones(3, 2), torch.zeros(3, 1), BF16)
        assert result.verdict == "none", kind


# ---------------------------------------------------------------------------- review 37k


def test_an_overflow_to_minus_inf_in_fp32_too_is_named_not_taken_for_a_mask():
    # (a whole output of -inf: an overflow, no mask; it was looked past and the loss named)
    model = nn.Sequential(nn.Linear(2, 2), nn.Identity(), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.fill_(-3e38), model[0].bias.zero_()  # (finite weights: -6e38 is -inf in FP32 too)
    result = diagnose(model, F.mse_loss, torch.ones(3, 2), torch.zeros(3, 1), BF16)
    assert (result.amp.where, result.amp.name, result.verdict) == ("forward", "0", "data/model")


def test_a_nan_where_the_fp32_replay_had_a_mask_is_new():
    # (+inf under fp16 plus the -inf mask is NaN where FP32 has -inf: it was taken as known, and the
    # Softmax that only received it was named)
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.sm, self.out = nn.Linear(4, 4, bias=False), nn.Softmax(-1), nn.Linear(4, 1)
            with torch.no_grad():
                self.q.weight.fill_(0.0), self.q.weight[3, :].fill_(1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q = self.q(x)
            return self.out(self.sm(q * q + torch.tensor([0.0, 0.0, 0.0, -math.inf])))  # 1.44e6: inf in fp16

    result = diagnose(Attn(), F.mse_loss, torch.full((2, 4), 300.0), torch.zeros(2, 1), FP16)
    assert (result.amp.where, result.amp.name, result.amp.before, result.amp.kind) == ("forward", "", "sm", "nan")


def test_a_groups_summed_norm_past_float32_says_the_sum():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.weight).sum(dim=1, keepdim=True)

    def loss_fn(out, y):  # each micro-batch's gradients 4.7e18 a weight: their norm finite; summed, not
        return out.float().mean() * 4.7e18

    batch = (torch.ones(1, 4), torch.zeros(1, 1))
    result = diagnose_group(Scale(), loss_fn, (batch, batch), FP32, accumulation_steps=1, rng=(None, None))
    assert result.amp.op.endswith("summed over the group's micro-batches") and result.amp.name == ""
    assert "run that module" not in result.message()


def test_a_float8_side_output_does_not_crash_the_trace():
    class Side(nn.Module):  # (a cached float8 activation beside the output: torch.cat of its values raised)
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor):
            return self.fc(x), torch.tensor([-math.inf, 1.0]).to(torch.float8_e5m2)

    result = diagnose(Side(), lambda out, y: F.mse_loss(out[0], y) * math.inf, torch.ones(3, 2), torch.zeros(3, 1),
                      BF16)
    assert result.verdict == "data/model"


def test_an_inf_among_nan_targets_the_loss_masks_is_the_targets():
    # review 37o: NaN came first in the targets' kind, so an inf beside it (the loss's inf) named the loss
    def nansum_loss(out, y):  # (NaN targets left out; the inf one makes the loss inf)
        return torch.nansum((out - y).abs())

    result = diagnose(nn.Linear(2, 1), nansum_loss, torch.ones(3, 2), torch.tensor([[math.nan], [math.inf], [0.0]]),
                      BF16)
    assert (result.amp.where, result.amp.name, result.amp.kind) == ("input", "targets", "inf")
