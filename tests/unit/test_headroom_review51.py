"""The headroom probe, review_51a: NaN gradients read as healthy, a non-finite loss's zero-seeded
backward taken for a measurement (a false clear), the alert's words at a loss-scale floor above
1, and a compiled wrapper's measured steps run eagerly. Tiny models, fp32 arithmetic measured
against fp16 unless the loss scale is the point."""

from __future__ import annotations

import json
import math

import torch
from torch import nn

from ampguard.build import build_headroom
from ampguard.cli import main
from ampguard.config import validate
from ampguard.headroom import Headroom, read_headroom_csv
from ampguard.precision import GuardedGradScaler


def test_a_gradient_of_nans_and_zeros_says_nothing_and_clears_no_alert():
    # an overflowed gradient flowing back through a wide layer of mixed signs (inf - inf = NaN) and
    # a ReLU (zeros): its largest finite value, 0, read as infinite headroom and cleared the alert
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    h = Headroom(model, "fp16", every=1, alert_bits=4.0)
    h.alerting = ["0"]
    with h.measuring(1):
        out = model(torch.randn(16, 4))
        out.backward(torch.full_like(out, math.inf))
    rows = {(r.module, r.tensor): r for r in h.read(1)}
    assert math.isnan(rows[("0", "grad")].amax) and math.isnan(rows[("0", "param_grad")].amax)
    assert rows[("0", "output")].headroom_bits > 10  # (the forward's own rows: well clear)
    assert not any(e.kind == "headroom_clear" for e in h.observe_step(1)) and h.alerting[0] == "0"


FACTORY = '''
import torch
from torch import nn


def build(config):
    # the head's weight gradient ~3.5 bits below fp16's max; the 4th batch has one inf target
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 16, generator=g)
    y = torch.full((32, 1), 3000.0)
    bad = y.clone()
    bad[0, 0] = float("inf")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return {"model": model, "data": [(x, y), (x, y), (x, y), (x, bad)], "loss_fn": nn.functional.mse_loss}
'''


def test_a_non_finite_loss_step_measures_no_gradient_and_clears_no_alert(tmp_path, capsys):
    # the guard's backward of a non-finite loss is seeded with 0: its gradient rows read 0.0 and inf
    # headroom, the alerting head was cleared on them at step 4 and alerted again at step 6
    (tmp_path / "f.py").write_text(FACTORY, encoding="utf-8")
    code = main(["train", "--set", f"task.factory={tmp_path / 'f.py'}:build", "--set", "precision=bf16",
                 "--set", "steps=6", "--set", "optimizer.lr=1e-6", "--set", "max_norm=1e9",
                 "--set", "monitor.headroom.every=2", "--set", "monitor.headroom.format=fp16",
                 "--set", f"log.dir={tmp_path}", "--set", "log.name=run", "--set", "eval.enabled=false",
                 "--set", "checkpoint.enabled=false"])
    assert code == 0, capsys.readouterr()
    run = tmp_path / "run"
    rows = [r for r in read_headroom_csv(run / "headroom.csv") if r.module == "2"]
    at4 = {r.tensor: r for r in rows if r.step == 4}
    assert math.isnan(at4["grad"].amax) and math.isnan(at4["param_grad"].headroom_bits)
    assert at4["output"].amax == next(r.amax for r in rows if r.step == 2 and r.tensor == "output")  # its forward's
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    kinds = [(e["step"], e["event"]) for e in events if e["event"].startswith("headroom_")]
    assert kinds == [(2, "headroom_alert")], kinds  # one episode, no clear at 4


def test_the_alert_at_a_scale_floor_above_one_says_the_headroom_there():
    # scale 16384, floor 4096, an unscaled gradient of 2: "3.0 bits without the loss scale (amax 2
    # unscaled)" where 2 has 15 bits; 3.0 is its headroom at the floor, 8192 there
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        model.fc.weight.fill_(1.0)
    h = Headroom(model, "fp16", every=1, alert_bits=4.0, loss_scale=lambda: 16384.0, scale_floor=4096.0)
    with h.measuring(1):
        (model(torch.ones(1, 1)).sum() * 2.0 * 16384.0).backward()
    [alert] = h.observe_step(1)
    assert alert.message == ("headroom_alert: fc grad headroom 3.0 bits at the loss scale's floor 4096 < alert_bits 4 "
                             "(amax 8192 at the floor, 2 unscaled, 3.277e+04 at loss scale 16384, fp16 max 65504)")
    # overflowed at 32768 with a floor of 4096: < 3 bits at the floor, its amax there > 8188
    h = Headroom(model, "fp16", every=1, alert_bits=4.0, loss_scale=lambda: 32768.0, scale_floor=4096.0)
    model.zero_grad()
    with h.measuring(1):
        (model(torch.ones(1, 1)).sum() * math.inf).backward()
    [alert] = h.observe_step(1)
    assert "overflowed at loss scale 32768: headroom < 3 bits at the loss scale's floor 4096, alert_bits 4 (amax > " \
           "1.999 unscaled (8188 at the floor), fp16 max 65504)" in alert.message, alert.message


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def test_a_compiled_wrapper_around_the_measured_model_is_measured_eagerly():
    # train compiles the DDP wrapper and gives the probe the model inside it, not compiled: the
    # measured steps were not forced eager, and dynamo compiled the probe's hooks at each one
    from torch._dynamo.utils import counters

    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    outer = Wrapper(inner)
    outer.compile(backend="eager")
    scaler = GuardedGradScaler("cpu", enabled=False)
    h = build_headroom(validate({"compile": True, "monitor": {"headroom": {"every": 1}}}), inner, scaler)
    torch._dynamo.reset()
    counters.clear()
    for step in (1, 2):
        with h.measuring(step):
            outer(torch.ones(2, 4)).sum().backward()
        assert h.read(step)
    assert sum(counters["stats"].values()) == 0, dict(counters["stats"])  # nothing compiled: eager
    outer(torch.ones(2, 4)).sum().backward()  # (an unmeasured step compiles as ever)
    assert counters["stats"]["unique_graphs"] >= 1
