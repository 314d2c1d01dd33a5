"""Review 40d on the command line: ``ampguard locate`` replays each pass from the buffers the AMP
pass saw (item 1) and names the call of a module called twice (item 3); a backward overflow that
overflows with no loss scale too is no routine back-off, and the injected fault is named (item
4); ``ampguard validate`` does not blame the precision for a counter the model's forward updates
(item 2). The library's side is ``tests/unit/test_diagnosis_review40.py``."""

from __future__ import annotations

import json

FACTORY = '''
import torch
from torch import nn


class Counting(nn.Module):
    """At the step's state (calls 0) its Linear overflows in FP32 too; from the second call on, not."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)
        self.register_buffer("calls", torch.zeros(()))
        with torch.no_grad():
            self.l.weight.fill_(1e37)

    def forward(self, x):
        self.calls += 1
        return self.l(x * (1.0 if self.calls < 2 else 1e-3))


class Twice(nn.Module):
    """l called twice; only its second call overflows fp16 (300 x 300 = 9e4)."""

    def __init__(self):
        super().__init__()
        self.l, self.n, self.out = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1)
        with torch.no_grad():
            self.l.weight.copy_(torch.eye(4) * 300)
            self.l.bias.zero_()

    def forward(self, x):
        return self.out(self.n(self.l(self.l(x))))


class Stateful(nn.Module):
    """Its output adds 1.0 once the buffer calls, counted up by the forward, is past 2."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.l(x) + (self.calls > 2).float()


def build(config):
    kind = config.task.options["kind"]
    torch.manual_seed(0)
    if kind == "stateful":
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)
        return {"model": Stateful(), "data": [(x, y)], "loss_fn": nn.functional.cross_entropy,
                "held_out": (x, y), "mode": "classifier"}
    if kind == "lazy":  # (review 40g: its weights not made yet, validate's hash of them was a traceback)
        x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        return {"model": nn.Sequential(nn.LazyLinear(3)), "data": [(x, y)], "loss_fn": nn.functional.cross_entropy,
                "held_out": (x, y), "mode": "classifier"}
    if kind == "counting":
        return {"model": Counting(), "data": [(torch.full((2, 4), 50.0), torch.zeros(2, 1))],
                "loss_fn": nn.functional.l1_loss}
    return {"model": Twice(), "data": [(torch.ones(3, 4), torch.zeros(3, 1))], "loss_fn": nn.functional.mse_loss}
'''


def _factory(tmp_path, kind: str) -> list[str]:
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    return ["--set", "task.factory=fac.py:build", "--set", f"task.options.kind={kind}", "--set", "device=cpu",
            "--set", "steps=1"]


def test_cli_locate_replays_in_fp32_from_the_buffers_the_amp_pass_saw(cli, tmp_path):
    # FP32 overflows too at the step's state: data/model; the FP32 replay read the counter bf16's pass left
    code, out, err = cli("locate", *_factory(tmp_path, "counting"), "--set", "precision=bf16", "--step", "1",
                         "--json")
    assert code == 1, err
    found = json.loads(out)
    assert found["verdict"] == "data/model", found["message"]
    assert found["fp32"]["where"] == "forward" and found["fp32"]["name"] == "l"


def test_cli_locate_names_the_call_of_a_module_called_twice(cli, tmp_path):
    code, out, err = cli("locate", *_factory(tmp_path, "twice"), "--set", "precision=fp16", "--step", "1", "--json")
    assert code == 1, err
    found = json.loads(out)
    assert (found["amp"]["name"], found["amp"]["call"]) == ("l", 2)
    assert "in the forward output of l (its call 2) (Linear;" in found["message"]


def test_cli_locate_does_not_call_an_overflow_with_no_loss_scale_too_routine(cli):
    # spike@3: targets x 1e8, a gradient of ~1e8 overflows fp16 at scale 65536 and at scale 1 alike
    code, out, err = cli("locate", "--set", "task.name=linear", "--set", "device=cpu", "--set", "steps=6", "--set",
                         "precision=fp16", "--inject", "spike@3", "--step", "3", "--json")
    assert code == 1, err
    found = json.loads(out)
    assert found["verdict"] == "precision-range" and found["amp"]["where"] == "backward"
    assert found["overflows_unscaled"] is True and found["injected"] == ["spike@3"]
    message = found["message"]
    assert "routine" not in message and "overflows fp16 with no loss scale too" in message
    assert "this step carries the injected spike@3" in message and "fixes this batch" in message


def test_cli_validate_does_not_blame_the_precision_for_a_counter_in_a_buffer(cli, tmp_path):
    # bf16 was REJECTED for a difference of 1.0 that the model's own counter made (FP32 ran at calls 1, 2)
    code, out, err = cli("validate", *_factory(tmp_path, "stateful"), "--set", "validation.precisions=[bf16]",
                         "--set", "validation.min_accuracy=0", "--out", tmp_path / "v")
    assert code == 0, out + err
    assert "validate: ACCEPTED" in out
    report = json.loads((tmp_path / "v" / "validation.json").read_text(encoding="utf-8"))
    [bf16] = report["precisions"]
    assert bf16["stats"]["max_abs_error"] < 0.05


def test_cli_validate_refuses_a_model_whose_lazy_modules_made_no_weights_in_one_line(cli, tmp_path):
    code, out, err = cli("validate", *_factory(tmp_path, "lazy"), "--set", "validation.precisions=[bf16]",
                         "--out", tmp_path / "v")
    assert code == 2 and out == "", out + err
    assert err == ("ampguard: error: validate: task fac.py:build: the model's lazy modules have made no weights yet "
                   "(0: LazyLinear); validate judges weights it can read: run one batch through the model in the "
                   "factory, or give validation.checkpoint\n"), err
    assert not (tmp_path / "v").exists()
