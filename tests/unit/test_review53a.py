"""Review 53a: fp8 and headroom telemetry as a user meets them. ``monitor.headroom`` settings given
with the telemetry off were ignored unsaid (every other unread setting is a warning); the run card
and ``run_start`` counted a float8 Linear held at two places twice ("3 Linear layers in float8"
of a model with 2); the CPU note said torchao emulates fp8 (its emulate mode is off: PyTorch's CPU
``torch._scaled_mm`` runs the float8 matmuls); and resume lines spelled settings as Python does
(``None``, ``True``) where the config writes ``null``, ``true``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import ag, train, write

from ampguard import checkpointer as ck
from ampguard.config import ignored_settings, validate

pytestmark = pytest.mark.usefixtures("_one_thread", "_no_bytecode")  # tests/conftest.py

LINEAR = ["--set", "task.name=linear", "--set", "log.plot=false"]


# ---------------------------------------------------------------------------- 1: headroom settings, telemetry off


def test_headroom_settings_with_the_telemetry_off_are_a_warning():
    off = validate({"monitor": {"headroom": {"alert_bits": 8, "format": "fp16"}}})
    assert ignored_settings(off) == ["monitor.headroom.every is not set (headroom telemetry off): "
                                     "monitor.headroom.alert_bits, monitor.headroom.format ignored"]
    # read with the telemetry on; the switch alone (null: off) says nothing either
    assert ignored_settings(validate({"monitor": {"headroom": {"every": 5, "alert_bits": 8, "format": "fp16"}}})) == []
    assert ignored_settings(validate({"monitor": {"headroom": {"every": None}}})) == []
    # a resume's --set: only what it gave
    assert ignored_settings(off, only=["monitor.headroom.format"]) == [
        "monitor.headroom.every is not set (headroom telemetry off): monitor.headroom.format ignored"]


def test_the_cli_says_a_headroom_setting_it_does_not_read():
    code, out, err = ag("train", *LINEAR, "--set", "monitor.headroom.alert_bits=8", "--print-config")
    assert code == 0 and "ampguard: warning: monitor.headroom.every is not set (headroom telemetry off): " \
                         "monitor.headroom.alert_bits ignored" in err.splitlines(), err
    code, out, err = ag("train", *LINEAR, "--set", "monitor.headroom.alert_bits=8", "--set",
                        "monitor.headroom.every=5", "--print-config")
    assert code == 0 and "warning" not in err, err


# ---------------------------------------------------------------------------- 2: a reused float8 Linear, counted once


SHARED = """
import torch
from torch import nn


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.sh, self.mid, self.head = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.again = self.sh  # one Linear at two places

    def forward(self, x):
        return self.head(self.mid(self.again(torch.relu(self.sh(self.inp(x))))))


def build(config):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(4)]
    torch.manual_seed(config.seed)
    return {"model": Shared(), "data": data, "loss_fn": nn.functional.cross_entropy}
"""


def test_a_float8_layer_at_two_places_is_one_layer_named_at_both():
    pytest.importorskip("torchao")
    from ampguard.fp8 import convert_to_fp8, float8_modules, fp8_layers, fp8_layers_named, in_float8

    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    model[3] = model[1]  # (held at 1 and 3; 2 is a layer of its own)
    convert_to_fp8(model)
    assert len(float8_modules(model)) == 2 and fp8_layers(model) == ["1", "2", "3"]
    assert fp8_layers_named(model) == ["1 (also 3)", "2"]
    assert in_float8(fp8_layers_named(model)) == "2 Linear layers in float8: 1 (also 3), 2"


def test_the_card_and_run_start_count_a_reused_float8_layer_once(tmp_path):
    pytest.importorskip("torchao")
    factory = write(tmp_path / "shared.py", SHARED)
    code, out, err = train(tmp_path, "sh", "--set", f"task.factory={factory}:build", "--set", "precision=fp8",
                           "--set", "steps=1", "--set", "eval.enabled=false", "--set", "log.plot=false",
                           "--set", "checkpoint.enabled=false")
    assert code == 0, err
    said = "2 Linear layers in float8: sh (also again), mid"
    card = (tmp_path / "sh" / "RUN.md").read_text(encoding="utf-8")
    assert f"| fp8 | recipe tensorwise; {said} |" in card, card
    events = [json.loads(line) for line in (tmp_path / "sh" / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    [start] = [e for e in events if e["event"] == "run_start"]
    assert f"fp8 on cpu ({said})" in start["message"], start


# ---------------------------------------------------------------------------- 3: what runs fp8 on a CPU


def test_the_cpu_fp8_note_names_pytorchs_scaled_mm_which_is_what_runs():
    pytest.importorskip("torchao")
    from ampguard.fp8 import convert_to_fp8, float8_config
    from ampguard.precision import Precision

    supported, note = Precision("fp8", "cpu").support(torch.device("cpu"))
    assert supported and note == ("fp8 on a CPU runs PyTorch's CPU float8 matmul (torch._scaled_mm): right for "
                                  "correctness checks, no speed-up")
    # what the note says is what happens: torchao's emulation is off, and a forward and backward of
    # a float8 layer call torch._scaled_mm on the CPU with float8 operands (output, grad input, grad weight)
    assert float8_config().emulate is False
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    convert_to_fp8(model)
    called, real = [], torch._scaled_mm

    def seen(a, b, *args, **kwargs):
        called.append((a.device.type, a.dtype.itemsize, b.dtype.itemsize))
        return real(a, b, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "_scaled_mm", seen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randn(16, 32))
        out.float().sum().backward()
    assert called == [("cpu", 1, 1)] * 3, called


# ---------------------------------------------------------------------------- 4: YAML's spellings in resume lines


def test_policy_lines_and_resume_refusals_spell_values_as_the_config_does():
    assert ck.policy_line({"key": "monitor.headroom.every", "old": None, "new": 2, "step": 5}) == (
        "monitor.headroom.every null -> 2 from step 6")
    assert ck.policy_line({"key": "monitor.fail_on_scale_collapse", "old": True, "new": False, "step": 5}) == (
        "monitor.fail_on_scale_collapse true -> false from step 6")
    assert ck.policy_line({"key": "rollback.triggers", "old": [], "new": ["non_finite_loss"], "step": 5}) == (
        "rollback.triggers [] -> ['non_finite_loss'] from step 6")  # (text stays quoted, lists spelled through)
    assert ck.policy_line({"key": "monitor.headroom.format", "old": "auto", "new": "fp16", "step": 5}) == (
        "monitor.headroom.format 'auto' -> 'fp16' from step 6")


def test_a_resume_that_turns_headroom_on_says_null_not_none(tmp_path):
    common = [*LINEAR, "--set", "eval.enabled=false", "--set", "log.every=100"]
    code, out, err = train(tmp_path, "n1", *common, "--set", "steps=4", "--set", "checkpoint.every=2")
    assert code == 0, err
    code, out, err = ag("train", "--resume", tmp_path / "n1" / "checkpoints" / "step-00000002.pt",
                        "--set", "monitor.headroom.every=2")
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("POLICY")] == [
        "POLICY 2 monitor.headroom.every null -> 2 from step 3"], out
