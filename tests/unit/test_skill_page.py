"""outputs/skill-clip-amp.md, the seed's "Ship it" page (clip threshold and autocast device per
stage, where the CSVs live in version control, the production skip-rate alarm): its numbers are
the code's, read from the configs the stages run with, and each stage's committed reference CSV
(outputs/reference/) is what that stage writes, so neither can drift from the code unseen."""

from __future__ import annotations

import re

import csv

import yaml
from helpers import ROOT

from ampguard.config import dump_config, load_config
from ampguard.demo import demo_config
from ampguard.sinks import CSV_COLUMNS

PAGE = (ROOT / "outputs" / "skill-clip-amp.md").read_text(encoding="utf-8")
REFERENCE = ROOT / "outputs" / "reference"


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


def _rows(stage: str) -> tuple[list[str], list[dict[str, str]]]:
    with (REFERENCE / stage / "steps.csv").open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_each_stage_with_a_reference_names_it_and_it_is_the_stages_csv():
    # the seed: "where each stage's CSV lives in version control"
    for stage, folder in (("demo", "demo"), ("demo, bf16", "demo-bf16"), ("main job", "main-job")):
        assert f"[`outputs/reference/{folder}/steps.csv`](reference/{folder}/steps.csv)" in row(stage)
    assert "none yet" in row("main job in fp16")
    for folder, config, extra in (("demo", demo_config(), []), ("demo-bf16", demo_config(precision="bf16"), []),
                                  ("main-job", load_config(None, []), ["val_loss"])):
        columns, rows = _rows(folder)
        assert columns == [*CSV_COLUMNS, *extra], folder
        assert [int(r["step"]) for r in rows] == list(range(1, config.steps + 1)), folder
    # the demos' faults: the Inf at step 5 skipped in fp16, the scale halved there; bf16 skips nothing
    _, fp16 = _rows("demo")
    assert [(r["step"], r["skip_reason"]) for r in fp16 if r["skipped"] == "1"] == [("5", "non_finite_grad")]
    assert {r["scaler_scale"] for r in fp16[:4]} == {f"{demo_config().scaler.init_scale:g}.0"}
    assert {r["scaler_scale"] for r in fp16[4:]} == {f"{demo_config().scaler.init_scale / 2:g}.0"}
    _, bf16 = _rows("demo-bf16")
    assert not [r for r in bf16 if r["skipped"] != "0"] and demo_config(precision="bf16").inject == ["spike@5"]


def test_the_main_jobs_reference_was_made_with_todays_defaults():
    # a default that changes makes the reference stale: make it again (the page's command)
    kept = (REFERENCE / "main-job" / "config.yaml").read_text(encoding="utf-8")
    assert kept == dump_config(load_config(None, ["log.name=main-job"])), \
        "outputs/reference/main-job is stale: ampguard train --set log.name=main-job, then copy its files there"
    assert yaml.safe_load(kept)["log"]["name"] == "main-job"
    card = (REFERENCE / "main-job" / "RUN.md").read_text(encoding="utf-8")
    _, rows = _rows("main-job")
    assert "**finished: 1000 steps**" in card and len(rows) == 1000 and all(r["skipped"] == "0" for r in rows)
    assert f"final {float(rows[-1]['loss']):.3f}" in card  # (the card is the CSV's run)
