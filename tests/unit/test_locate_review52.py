"""Review 52f: ``locate`` and fault injection.

- F1: an fp16 overflow FP32 holds, before a NaN FP32 has too (somewhere else): the data/model
  verdict names FP32's own first place, and says the fp16 one is a range problem.
- F2: ``inf_grad`` / ``nan_grad`` fire on a parameter that gets a gradient (the model's first
  trainable parameter may get none: an unused head); one that did not fire is not said injected.
- F4: a module that passes its input on as it is (``nn.Identity``) hands its caller the caller's
  own tensor in the replay too (``g is h`` as in the step).

Planted values: fp16's largest finite value is 65504, float32's ~3.4e38; log of a negative is NaN
in every precision.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ampguard.faults import FaultInjector, parse_fault
from ampguard.locate import diagnose
from ampguard.precision import Precision

FP16 = Precision("fp16", "cpu")


class LogNeg(nn.Module):
    """log(x - 1e6): NaN for any input below 1e6, in every precision (a model bug)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x - 1e6)


class TwoBugs(nn.Module):
    """``a`` (weights 3e4) overflows fp16, FP32 holds it and ``norm`` brings it back; ``bug`` is a NaN everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.bug, self.head = nn.Linear(4, 4), nn.LayerNorm(4), LogNeg(), nn.Linear(4, 1)
        with torch.no_grad():
            self.a.weight.fill_(3e4)
            self.a.weight[:, 0] = -3e4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bug(self.norm(self.a(x))))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.rand(8, 4, generator=g) + 0.5, torch.rand(8, 1, generator=g)


# ---------------------------------------------------------------------------- F1


def test_a_data_model_verdict_names_where_fp32_went_non_finite_not_the_fp16_overflow():
    torch.manual_seed(0)
    x, y = _batch()
    d = diagnose(TwoBugs(), F.mse_loss, x, y, FP16, 1.0)
    assert d.verdict == "data/model"
    assert (d.amp.where, d.amp.name) == ("forward", "a")
    assert (d.fp32.where, d.fp32.name) == ("forward", "bug")
    message = d.message()
    assert message.startswith("first inf under fp16: in the forward output of a (Linear;"), message
    assert "FP32 replay is not finite either, first in the forward output of bug (LogNeg;" in message, message
    assert "a data or model problem there" in message, message
    assert "the fp16 inf named first is finite in FP32: a precision-range problem" in message, message
    assert d.as_dict()["message"] == message


def test_a_data_model_verdict_at_the_same_place_in_both_says_it_once():
    torch.manual_seed(0)
    x, y = _batch()
    model = nn.Sequential(nn.Linear(4, 4), LogNeg(), nn.Linear(4, 1))
    d = diagnose(model, F.mse_loss, x, y, FP16, 1.0)
    assert d.verdict == "data/model" and (d.amp.name, d.fp32.name) == ("1", "1")
    assert d.message().endswith(". FP32 replay is not finite either: a data or model problem, not a precision one")


def test_the_first_skip_diagnosis_of_a_run_names_fp32s_place(tmp_path):
    from ampguard.guards import FirstSkipDiagnosis
    from ampguard.step import AmpTrainState

    torch.manual_seed(0)
    model = TwoBugs()
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.0), F.mse_loss, precision="fp16",
                          device="cpu", scaler={"init_scale": 1.0})
    diagnosis = FirstSkipDiagnosis(state, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fp16 on a CPU is slow: said once by the state)
        batch = _batch()
        diagnosis.capture(batch)
        record = state.step(*batch)
        found = diagnosis.after(record)
    assert record.skipped and found is not None
    assert "first in the forward output of bug (LogNeg;" in found, found
    assert "the fp16 inf named first is finite in FP32: a precision-range problem" in found, found


# ---------------------------------------------------------------------------- F2


class Unused(nn.Module):
    """An auxiliary head defined first and never called: the first trainable parameter gets no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.aux_head = nn.Linear(4, 4)
        self.a = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def _bad(model: nn.Module) -> list[tuple[str, int]]:
    """Each parameter's name and its count of non-finite gradient elements, where it has any."""
    return [(name, int((~torch.isfinite(p.grad)).sum())) for name, p in model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())]


@pytest.mark.parametrize(("kind", "check"), [("inf_grad", math.isinf), ("nan_grad", math.isnan)])
def test_a_grad_fault_fires_when_the_first_parameter_gets_no_gradient(kind, check):
    torch.manual_seed(0)
    model = Unused()
    inj = FaultInjector([parse_fault(f"{kind}@2")])
    inj.attach(model)
    x, y = _batch()
    seen, values = [], []
    for _ in inj.wrap_data([(x, y)] * 3):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        seen.append(_bad(model))
        values += [float(model.get_parameter(name).grad.view(-1)[0]) for name, _ in seen[-1]]
    inj.detach()
    assert seen[0] == [] and seen[2] == []
    assert len(seen[1]) == 1 and seen[1][0][0].startswith("a.") and seen[1][0][1] == 1, seen  # one element, one gradient
    assert check(values[0])
    assert inj.missed(2) == [] and inj.firing(2) == [f"{kind}@2"]


def test_a_grad_fault_fires_once_in_each_backward_of_an_accumulated_step():
    torch.manual_seed(0)
    model = Unused()
    inj = FaultInjector([parse_fault("inf_grad@2")], accumulation_steps=2)
    inj.attach(model)
    x, y = _batch()
    counts = []
    for _ in inj.wrap_data([(x, y)] * 4):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        counts.append(sum(n for _, n in _bad(model)))
    inj.detach()
    assert counts == [0, 0, 1, 1]


def test_a_grad_fault_that_did_not_fire_is_not_said_injected():
    """A step whose loss is NaN runs no backward: its inf_grad never fires, and is not named as injected."""
    model = Unused()
    inj = FaultInjector([parse_fault("inf_grad@1"), parse_fault("nan_loss@1")])
    inj.attach(model)
    loss_fn = inj.wrap_loss(F.mse_loss)
    x, y = _batch()
    for _ in inj.wrap_data([(x, y)]):
        loss = loss_fn(model(x), y)
        assert math.isnan(float(loss))  # (no backward: the step skips it)
    inj.detach()
    assert inj.missed(1) == ["inf_grad@1"]
    assert inj.firing(1) == ["nan_loss@1"]


def test_locate_replays_an_inf_grad_on_a_model_whose_first_parameter_is_unused(tmp_path, capsys):
    from ampguard.config import validate
    from ampguard.locate import run

    (tmp_path / "unused.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Unused(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.aux_head = nn.Linear(4, 4)\n"
        "        self.a = nn.Linear(4, 1)\n"
        "    def forward(self, x):\n"
        "        return self.a(x)\n\n"
        "def build(config):\n"
        "    torch.manual_seed(0)\n"
        "    g = torch.Generator().manual_seed(1)\n"
        "    data = [(torch.rand(8, 4, generator=g), torch.rand(8, 1, generator=g)) for _ in range(4)]\n"
        "    return Unused(), data, nn.functional.mse_loss\n")
    config = validate({"task": {"factory": f"{tmp_path / 'unused.py'}:build"}, "precision": "fp32", "device": "cpu",
                       "steps": 4, "inject": ["inf_grad@2"]})
    assert run(config, step=2) == 1
    out = capsys.readouterr().out
    assert "with inf_grad@2 injected" in out
    assert "FP32 replay is not finite either: the injected inf_grad@2" in out, out


# ---------------------------------------------------------------------------- F4


class IdCheck(nn.Module):
    """Scales by 1e30 only when ``nn.Identity`` hands back another tensor than it was given (never in a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.idm, self.b = nn.Linear(4, 4), nn.Identity(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = self.idm(h)
        if g is not h:
            g = g * 1e30
        return self.b(g)


def test_a_module_that_passes_its_input_on_hands_back_the_callers_tensor_in_the_replay():
    torch.manual_seed(0)
    x, y = _batch()
    model = IdCheck()
    assert bool(torch.isfinite(F.mse_loss(model(x), y)))  # (the step's computation: finite)
    d = diagnose(model, F.mse_loss, x, y, Precision("fp32", "cpu"), 1.0)
    assert d.verdict == "none", d.message()


def test_locate_does_not_say_injected_a_grad_fault_its_replay_did_not_fire(cli):
    """nan_loss and inf_grad at one step: the replay runs no backward of a NaN loss, so its inf_grad never fires."""
    code, out, err = cli("locate", "--set", "task.name=linear", "--set", "precision=bf16", "--set", "steps=3",
                         "--inject", "nan_loss@2", "--inject", "inf_grad@2", "--step", "2")
    assert code == 1, err
    head, message = out.splitlines()[:2]
    assert head.startswith("locate: step 2 of task linear (seed 0) with nan_loss@2 injected (inf_grad@2 not: it did "
                           "not fire, no backward reached a parameter)"), head
    assert message.endswith("FP32 replay is not finite either: the injected nan_loss@2, not a precision problem"), message


def test_a_gradient_fault_lands_on_a_channels_last_gradient():
    # review 52k: grad.view(-1)[0] raised on a channels_last conv gradient (no such view), mid-run
    from ampguard.faults import FaultInjector, parse_fault

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 2, 3, padding=1, bias=False)).to(
        memory_format=torch.channels_last)
    injector = FaultInjector([parse_fault("inf_grad@1")])
    injector.attach(model)
    for x, y in injector.wrap_data([(torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last),
                                     torch.zeros(2, 2, 3, 3))]):
        torch.nn.functional.mse_loss(model(x), y).backward()
    assert sum(int(torch.isinf(p.grad).sum()) for p in model.parameters()) == 1
