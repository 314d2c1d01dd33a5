"""Headroom telemetry and the skipped steps' gradient norms in whole ``ampguard train`` runs: the
ALERT before an overflow, naming the layer; ``headroom.csv`` (long format, appended on a resume
exactly as the uninterrupted run wrote it); the report's heatmap panel; ``grad_norms`` events at
an injected skip; bad settings as one line, exit 2."""

from __future__ import annotations

import shutil

import pytest

from helpers import ag, ok, one_error_line, png_size, read_events, read_rows, train

import ampguard.report
from ampguard.cli import main
from ampguard.headroom import HEADROOM_COLUMNS

# fc1 then a LayerNorm: the inputs double every step, so fc1's output loses one bit of fp16
# headroom a step and overflows (65504) around step 10; the layers after the norm stay put.
RAMP = '''
import torch
from collections import OrderedDict
from torch import nn


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(2, 8), norm=nn.LayerNorm(8), fc2=nn.Linear(8, 1)))
    data = [(torch.full((4, 2), 128.0 * 2.0 ** i), torch.zeros(4, 1)) for i in range(40)]
    return model, data, nn.functional.mse_loss
'''
RAMP_RUN = ["--set", "precision=fp16", "--set", "scaler.init_scale=1", "--set", "optimizer.lr=0",
            "--set", "steps=11", "--set", "monitor.headroom.every=1", "--set", "monitor.headroom.alert_bits=4",
            "--set", "checkpoint.enabled=false", "--set", "log.every=1000"]


def test_an_overflow_is_announced_before_the_first_skip_and_drawn_in_the_report(tmp_path, monkeypatch, capsys):
    factory = tmp_path / "ramp.py"
    factory.write_text(RAMP, encoding="utf-8")
    titles: list[str] = []
    real_panel = ampguard.report.headroom_panel

    def spy(fig, ax, rows, alert_bits=None, scale_at=None, **kwargs):  # the real panel, its title kept
        mesh = real_panel(fig, ax, rows, alert_bits, scale_at, **kwargs)
        titles.append(ax.get_title())
        return mesh

    monkeypatch.setattr(ampguard.report, "headroom_panel", spy)
    code = main(["train", *RAMP_RUN, "--set", f"task.factory={factory}:build", "--set", f"log.dir={tmp_path}",
                 "--set", "log.name=ramp"])
    out = capsys.readouterr().out
    assert code == 0, out
    run = tmp_path / "ramp"

    steps = read_rows(run / "steps.csv")
    first_skip = next(int(r["step"]) for r in steps if r["skipped"] == "1")
    alerts = [e for e in read_events(run / "events.jsonl") if e["event"] == "headroom_alert"]
    assert alerts and alerts[0]["module"] == "fc1" and alerts[0]["tensor"] == "output"
    assert alerts[0]["step"] <= first_skip - 3  # at least k = 3 steps of warning
    assert {e["module"] for e in alerts if e["step"] < first_skip} == {"fc1"}
    assert f"ALERT {alerts[0]['step']} headroom_alert: fc1 output headroom" in out
    closing = out.splitlines()[-1]  # what the folder holds, headroom.csv included (it was left out)
    assert closing.startswith("run folder: ") and closing.endswith(", headroom.csv)"), closing
    # the early warning outlives the scrollback: the run card and report name it (they said nothing)
    said = f"{len(alerts)} (step {alerts[0]['step']}: fc1 output {alerts[0]['judged_bits']:.1f} bits"
    assert f"| headroom alerts | {said}" in (run / "RUN.md").read_text(encoding="utf-8")
    assert main(["report", str(run), "--no-plot"]) == 0
    assert f"headroom alerts {said}" in capsys.readouterr().out

    rows = read_rows(run / "headroom.csv")
    assert tuple(rows[0]) == HEADROOM_COLUMNS
    assert sorted({int(r["step"]) for r in rows}) == list(range(1, 12))  # every step measured (every: 1)
    fc1 = {int(r["step"]): float(r["headroom_bits"]) for r in rows if (r["module"], r["tensor"]) == ("fc1", "output")}
    assert not fc1[first_skip] >= 0 and fc1[first_skip - 1] >= 0  # the skip: beyond the format (or nan) there

    # the report: a heatmap panel below the five, a taller and larger PNG than the same run without it
    assert len(titles) == 1 and titles[0].startswith("Headroom")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(run / "steps.csv", bare / "steps.csv")
    assert main(["report", str(bare)]) == 0
    with_panel, without = run / "report.png", bare / "report.png"
    assert png_size(with_panel)[1] > png_size(without)[1] and png_size(with_panel)[0] == png_size(without)[0]
    assert with_panel.stat().st_size > without.stat().st_size
    assert len(titles) == 1  # nothing to draw without headroom.csv


def test_an_injected_skip_writes_every_parameters_gradient_norm_and_only_then(tmp_path):
    ok(train(tmp_path, "inj", "--set", "task.name=linear", "--set", "precision=fp32", "--set", "steps=5",
             "--inject", "inf_grad@3", "--set", "checkpoint.enabled=false"))
    events = [e for e in read_events(tmp_path / "inj" / "events.jsonl") if e["event"] == "grad_norms"]
    assert [e["step"] for e in events] == [3]
    event = events[0]
    assert event["reason"] == "non_finite_grad" and event["order"] == "backward"
    assert set(event["norms"]) == {"weight", "bias"}
    # (the fault sets the first gradient the backward makes, review 52f: one of the two, whichever torch makes first)
    [bad] = event["non_finite"]
    assert event["norms"][bad] == "inf"  # strict JSON: inf as a string
    assert isinstance(event["norms"][({"weight", "bias"} - {bad}).pop()], float)
    assert "1 of 2 gradients non-finite" in event["message"]


def test_a_resume_appends_headroom_csv_exactly_as_the_uninterrupted_run_wrote_it(tmp_path):
    args = ["--set", "task.name=linear", "--set", "precision=bf16", "--set", "steps=6", "--set", "checkpoint.every=2",
            "--set", "checkpoint.keep=10", "--set", "monitor.headroom.every=1"]
    ok(train(tmp_path, "A", *args))
    a, b = tmp_path / "A", tmp_path / "B"
    shutil.copytree(a, b)
    (b / "checkpoints" / "step-00000006.pt").unlink()
    ok(ag("train", "--resume", b / "checkpoints" / "step-00000004.pt"))
    assert (b / "headroom.csv").read_bytes() == (a / "headroom.csv").read_bytes()
    steps = [int(r["step"]) for r in read_rows(b / "headroom.csv")]
    assert steps == sorted(steps) and len(steps) == 6 * 4  # input, output, grad and param_grad rows a step, none twice


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_the_heatmap_judges_a_gradient_at_the_scale_a_resume_set_anew(tmp_path, monkeypatch, precision):
    # review_session26: the heatmap took every step's scale from the row before; a resume that set
    # scaler.init_scale 1024 ran step 6 at 1024 but was drawn at 65536: a 6-bit jump in no data; and
    # step 1 then read the rewritten config's 1024. A bf16 run's scaler.init_scale scales nothing.
    args = ["--set", "task.name=linear", "--set", f"precision={precision}", "--set", "steps=8",
            "--set", "checkpoint.every=5", "--set", "monitor.headroom.every=1", "--set", "log.plot=false"]
    ok(train(tmp_path, "r", *args))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()
    ok(ag("train", "--resume", run, "--set", "scaler.init_scale=1024"))
    seen = {}
    real_panel = ampguard.report.headroom_panel

    def spy(fig, ax, rows, alert_bits=None, scale_at=None, **kwargs):
        seen.update({step: scale_at(step) for step in range(1, 9)})
        return real_panel(fig, ax, rows, alert_bits, scale_at, **kwargs)

    monkeypatch.setattr(ampguard.report, "headroom_panel", spy)
    assert main(["report", str(run), "--out", str(tmp_path / "again.png")]) == 0  # (in this process: the spy)
    rows = read_rows(run / "steps.csv")  # (no skip, no growth: each step ran at its own row's scale)
    ran = [float(r["scaler_scale"]) for r in rows]
    assert ran == ([65536.0] * 5 + [1024.0] * 3 if precision == "fp16" else [1.0] * 8)
    assert [seen[step] for step in range(1, 9)] == ran


@pytest.mark.parametrize("setting, key", [
    ("monitor.headroom.every=0", "monitor.headroom.every: must be >= 1"),
    ("monitor.headroom.alert_bits=-1", "monitor.headroom.alert_bits: must be a finite number >= 0"),
    ("monitor.headroom.format=fp4", "monitor.headroom.format:"),
    ("monitor.headroom.every_n=5", "monitor.headroom.every_n: unknown key"),
])
def test_bad_headroom_settings_are_one_line_and_exit_2(tmp_path, setting, key):
    line = one_error_line(train(tmp_path, "bad", "--set", setting))
    assert key in line
    assert not (tmp_path / "bad").exists()


def test_a_healthy_fp16_run_raises_no_headroom_alert_while_its_scaler_works(tmp_path):
    # the scaled gradients sink to 0-3 bits each time the scaler grows the scale: judged with the
    # scale in them they raised an ALERT and a CLEAR every few clean steps (4 pairs in 40 steps)
    ok(train(tmp_path, "h", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=40",
             "--set", "scaler.growth_interval=2", "--set", "checkpoint.enabled=false",
             "--set", "monitor.headroom.every=1"))
    rows = read_rows(tmp_path / "h" / "headroom.csv")
    assert min(float(r["headroom_bits"]) for r in rows if r["tensor"] != "output") < 4  # scaled: close, by design
    kinds = [e["event"] for e in read_events(tmp_path / "h" / "events.jsonl")]
    assert "headroom_alert" not in kinds and "headroom_clear" not in kinds
    assert "| headroom alerts | none |" in (tmp_path / "h" / "RUN.md").read_text(encoding="utf-8")


def test_a_checkpoint_with_a_forged_headroom_state_is_one_line_naming_the_field(tmp_path):
    import torch

    ok(train(tmp_path, "f", "--set", "task.name=linear", "--set", "precision=bf16", "--set", "steps=2",
             "--set", "monitor.headroom.every=1"))
    path = tmp_path / "f" / "checkpoints" / "step-00000002.pt"
    saved = torch.load(path, weights_only=False)
    saved["state"]["monitors"]["headroom"]["alerting"] = "fc"  # loaded, it became ['f', 'c']
    torch.save(saved, path)
    line = one_error_line(ag("train", "--resume", path, "--set", "steps=3"))
    assert line.endswith("bad checkpoint: state.monitors.headroom.alerting is 'fc', expected a list of distinct "
                         "module names")


def test_a_headroom_csv_that_does_not_read_leaves_only_the_heatmap_out_of_the_report(tmp_path, capsys):
    # one bad line of headroom.csv (secondary to the run) made `ampguard report` refuse the whole run
    ok(train(tmp_path, "h", "--set", "task.name=linear", "--set", "precision=bf16", "--set", "steps=4",
             "--set", "checkpoint.enabled=false", "--set", "monitor.headroom.every=2"))
    run = tmp_path / "h"
    lines = (run / "headroom.csv").read_text().splitlines(keepends=True)
    (run / "headroom.csv").write_text("".join(lines[:2] + ["garbage,row\n"] + lines[2:]))  # (a torn last line reads)
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert f"note: {run / 'headroom.csv'}: line " in out and "the plot leaves the headroom heatmap out" in out, out
    assert png_size(tmp_path / "r.png") == (1200, 1400)  # the five panels, no sixth


def test_a_headroom_interval_no_step_reaches_is_said_at_the_start(cli):
    # `--set steps=3` for a smoke test, monitor.headroom.every 100 left: headroom.csv held its header only, unsaid
    import warnings

    from ampguard.errors import AmpguardWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", AmpguardWarning)
        code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=3", "--set", "log.plot=false",
                             "--set", "checkpoint.enabled=false", "--set", "monitor.headroom.every=10")
        assert code == 0, err
        assert ("ampguard: warning: monitor.headroom.every 10: none of the steps this run trains (1 to 3) is "
                "measured (headroom.csv keeps its header only)") in err
        code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=10", "--set", "log.plot=false",
                             "--set", "checkpoint.enabled=false", "--set", "monitor.headroom.every=10")
        assert code == 0 and "headroom.every" not in err, err  # (step 10 is measured)


def test_a_resume_that_turns_the_monitor_off_keeps_its_alerts_on_the_card(tmp_path, capsys):
    # review 36f: the card's row was written only with the monitor on: a resume with
    # monitor.headroom.every null dropped the alerts the run had raised (report still listed them)
    factory = tmp_path / "ramp.py"
    factory.write_text(RAMP, encoding="utf-8")
    run_args = ["checkpoint.every=11" if a == "checkpoint.enabled=false" else a for a in RAMP_RUN]
    run_args += ["--set", "log.plot=false"]  # (the card is what is read: no plot, here or on the resume)
    assert main(["train", *run_args, "--set", f"task.factory={factory}:build", "--set", f"log.dir={tmp_path}",
                 "--set", "log.name=ramp"]) == 0
    run = tmp_path / "ramp"
    alerts = [e for e in read_events(run / "events.jsonl") if e["event"] == "headroom_alert"]
    assert alerts
    assert main(["train", "--resume", str(run), "--set", "steps=12", "--set", "monitor.headroom.every=null"]) == 0
    capsys.readouterr()
    assert f"| headroom alerts | {len(alerts)} (step {alerts[0]['step']}: fc1 output" in \
        (run / "RUN.md").read_text(encoding="utf-8")
