"""Review 53a: fp8 and headroom telemetry as a user meets them. ``monitor.headroom`` settings given
with the telemetry off were ignored unsaid (every other unread setting is a warning); the run card
and ``run_start`` counted a float8 Linear held at two places twice ("3 Linear layers in float8"
of a model with 2); the CPU note said torchao emulates fp8 (its emulate mode is off: PyTorch's CPU
``torch._scaled_mm`` runs the float8 matmuls); and resume lines spelled settings as Python does
(``None``, ``True``) where the config writes ``null``, ``true``."""

from __future__ import annotations

import pytest

from helpers import ag

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
