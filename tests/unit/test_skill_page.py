"""docs/skill-clip-amp.md, the seed's "Ship it" page (clip threshold and autocast device per
stage, where the CSVs live, the production skip-rate alarm): its numbers are the code's, read
from the configs the stages run with, so the page cannot drift from them unseen."""

from __future__ import annotations

import re

from helpers import ROOT

from ampguard.config import load_config
from ampguard.demo import demo_config

PAGE = (ROOT / "docs" / "skill-clip-amp.md").read_text(encoding="utf-8")


def row(stage: str) -> str:
    (line,) = [line for line in PAGE.splitlines() if line.startswith(f"| {stage} |")]
    return line


def test_the_pages_stage_rows_say_what_each_stage_runs_with():
    main, demo, demo_bf16 = load_config(None, []), demo_config(), demo_config(precision="bf16")
    assert main.precision in row("main job") and f"`max_norm` {main.max_norm}" in row("main job")
    assert f"`device: {main.device}`" in row("main job")
    fp16 = load_config(None, ["precision=fp16"]).scaler
    assert (f"`init_scale` {fp16.init_scale:g}" in row("main job in fp16")
            and f"`growth_interval` {fp16.growth_interval}" in row("main job in fp16")
            and f"`min_scale` {fp16.min_scale}" in row("main job in fp16"))
    assert demo.precision in row("demo") and f"init_scale={demo.scaler.init_scale:g}" in row("demo")
    assert f"`max_norm` {demo.max_norm}" in row("demo") and demo.scaler.growth_interval >= 10**6  # "growth off"
    assert demo_bf16.precision in row("demo, bf16") and demo_bf16.inject == ["spike@5"]
    assert f"`{main.log.dir}/<name>/steps.csv`" in row("main job")


def test_the_pages_alarm_is_the_monitors_defaults():
    monitor = load_config(None, []).monitor
    said = {key: value for key, value in re.findall(r"`monitor\.(\w+)` = ([\d.]+)", PAGE)}
    assert said == {"window": str(monitor.window), "alert_rate": str(monitor.alert_rate),
                    "min_steps": str(monitor.min_steps)}
    assert monitor.fail_rate is None  # "Failing the run is off by default"
    assert f"--fail-after {monitor.fail_after}" in PAGE
    assert "runs/" in (ROOT / ".gitignore").read_text().splitlines()  # "`runs/` is git-ignored here"
