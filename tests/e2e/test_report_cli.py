"""After the run (issue 3): ``ampguard report`` (the five-panel PNG and its summary), the plot and
run card ``train`` writes when it finishes, fails fast (exit 3) or is interrupted (exit 130), and
bad report input (exit 2, one line, no PNG).

Expected numbers come from the fault schedule and the window arithmetic; the run's own files are
only read to check they agree with each other (the card against the CSV it summarises).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import warm
import yaml

from helpers import (card_table, png_size, read_events, read_rows, reference_episodes_events, reference_fail_step,
                     reference_rates)

from ampguard.cli import main
from ampguard.faults import parse_fault
from ampguard.sinks import CSV_COLUMNS

HEADER = ",".join(CSV_COLUMNS)
PNG_SIZE = (1200, 1400)


# ---------------------------------------------------------------------------- helpers


def in_process(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``ampguard.cli.main(argv)`` inside ``cwd``, capturing stdout and stderr (for module fixtures)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    finally:
        os.chdir(old)
    return code, out.getvalue(), err.getvalue()


CARD_KEYS = {
    # set-up
    "precision", "backend", "loss scaler", "clipping", "accumulation", "processes", "skip-rate alert", "fail-fast",
    "rollback triggers",
    # outcome
    "ended", "steps attempted", "updates applied", "skipped steps", "max rolling skip rate",
    "skip-rate alert episodes", "clip rate (whole run)", "scale health", "loss of applied steps",
    # files
    "per-step CSV", "event log (JSON lines)", "plot", "checkpoints",
}


def check_card_against_csv(run_dir: Path, *, window: int, alert_rate: float, max_norm: float) -> dict[str, str]:
    """Every field is there, and the outcome numbers are those of the CSV the card sits next to."""
    card = (run_dir / "RUN.md").read_text(encoding="utf-8")
    table = card_table(card)
    assert CARD_KEYS <= set(table), sorted(CARD_KEYS - set(table))
    assert table["processes"] == "1"
    rows = read_rows(run_dir / "steps.csv")
    skipped = [r["skipped"] == "1" for r in rows]
    reasons = {}
    for r in rows:
        if r["skip_reason"]:
            reasons[r["skip_reason"]] = reasons.get(r["skip_reason"], 0) + 1
    n = len(rows)
    assert table["steps attempted"] == str(n)
    assert table["updates applied"] == str(n - sum(skipped))
    by_reason = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"
    assert table["skipped steps"] == f"{sum(skipped)} ({by_reason})"
    rates = reference_rates(skipped, window)
    assert table["max rolling skip rate"] == f"{max(rates):.4f}"
    min_steps = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["monitor"]["min_steps"]
    # (armed once min(min_steps, window) steps were seen: a smaller window is full by then)
    episodes = sum(1 for _, k in reference_episodes_events(rates, alert_rate, min(min_steps, window))
                   if k == "skip_rate_alert")
    assert table["skip-rate alert episodes"] == str(episodes)
    clipped = sum(1 for r in rows if r["skipped"] == "0" and float(r["grad_l2_pre_clip"]) > max_norm)
    assert table["clip rate (whole run)"] == f"{clipped / n:.3f} ({clipped} of {n} steps clipped: applied with pre-clip norm > max_norm)"
    applied = [float(r["loss"]) for r in rows if r["skipped"] == "0"]
    last_applied = next(r for r in reversed(rows) if r["skipped"] == "0")  # a skipped step left the model as it was
    note = "" if last_applied is rows[-1] else f" (step {last_applied['step']}, the last applied)"
    assert table["loss of applied steps"] == (f"first {applied[0]:.4g}, final {float(last_applied['loss']):.4g}{note}, "
                             f"best {min(applied):.4g}")
    assert table["clipping"] == f"global L2, max_norm {max_norm:g}"
    assert table["skip-rate alert"] == f"rolling rate > {alert_rate:g} over {window} steps"
    assert table["per-step CSV"] == "`steps.csv`"
    assert table["event log (JSON lines)"] == "`events.jsonl`"
    assert table["plot"] == "`report.png`"
    assert table["checkpoints"]
    assert card.startswith(f"# Run {run_dir.name}\n")
    assert f"**{table['ended']}**" in card  # why it ended, up front
    return table


# ---------------------------------------------------------------------------- runs shared by several tests

DEMO_SKIPS = {5: "non_finite_grad", 9: "non_finite_loss"}


@pytest.fixture(scope="module")
def demo_csvs(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("demo")
    code, out, err = in_process(["demo", "--inject", "inf_grad@5", "--inject", "nan_loss@9", "--csv",
                                 folder / "skips.csv"], folder)
    assert code == 0, err
    code, out, err = in_process(["demo", "--inject", "none", "--csv", folder / "clean.csv"], folder)
    assert code == 0, err
    return {"skips": folder / "skips.csv", "clean": folder / "clean.csv"}


FINISHED = dict(steps=15, window=5, fail_rate=0.5, fail_after=3, init_scale=1024, min_steps=2)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("finished")
    code, out, err = in_process([
        "train", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "accumulation_steps=2",
        "--set", f"steps={FINISHED['steps']}", "--set", f"scaler.init_scale={FINISHED['init_scale']}",
        "--set", f"monitor.window={FINISHED['window']}", "--set", f"monitor.min_steps={FINISHED['min_steps']}",
        "--fail-skip-rate", str(FINISHED["fail_rate"]),
        "--fail-after", str(FINISHED["fail_after"]), "--inject", "inf_grad@5", "--inject", "nan_loss@9",
        "--set", "log.every=5", "--set", f"log.dir={root}", "--set", "log.name=done"], root)
    assert code == 0, err
    return root / "done", out


FAILED = dict(window=20, fail_rate=0.1, fail_after=10, steps=200, spec="inf_grad@rate:0.5")


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> tuple[Path, int, str]:
    root = tmp_path_factory.mktemp("failed")
    code, out, err = in_process([
        "train", "--set", "task.name=linear", "--set", "precision=bf16", "--set", f"steps={FAILED['steps']}",
        "--inject", FAILED["spec"], "--set", f"monitor.window={FAILED['window']}",
        "--fail-skip-rate", str(FAILED["fail_rate"]), "--fail-after", str(FAILED["fail_after"]),
        "--set", "log.every=1000", "--set", f"log.dir={root}", "--set", "log.name=failed"], root)
    return root / "failed", code, out


# ---------------------------------------------------------------------------- report: good input


def test_report_csv_with_both_skip_reasons(demo_csvs):
    csv_path = demo_csvs["skips"]
    rows = read_rows(csv_path)
    assert {int(r["step"]): r["skip_reason"] for r in rows if r["skipped"] == "1"} == DEMO_SKIPS
    window = 3
    skipped = [int(r["step"]) in DEMO_SKIPS for r in rows]
    rates = reference_rates(skipped, window)
    episodes = sum(1 for _, k in reference_episodes_events(rates, 0.05, min_steps=2) if k == "skip_rate_alert")
    assert episodes == 2  # window 3: steps 5 and 9 are two separate episodes

    png = csv_path.with_suffix(".png")
    assert not png.exists()
    code, out, err = in_process(["report", csv_path, "--window", window, "--min-steps", 2], csv_path.parent)
    assert code == 0, err
    assert err == ""
    assert png_size(png) == PNG_SIZE  # the default output sits next to the CSV
    assert "summary: steps=20 updates=18 skips=2 (non_finite_grad=1, non_finite_loss=1)" in out
    # the alerts judged under thresholds given on the command line, not the run's: said so
    assert (f"max rolling skip rate {max(rates):.4f} (window {window}), alert episodes {episodes} "
            f"(re-judged at --window {window}, --min-steps 2),") in out
    assert f"plot: {png}" in out


def test_report_clean_csv(demo_csvs, tmp_path):
    out_png = tmp_path / "sub.png"
    code, out, err = in_process(["report", demo_csvs["clean"], "--out", out_png], tmp_path)
    assert code == 0, err
    assert png_size(out_png) == PNG_SIZE
    assert not demo_csvs["clean"].with_suffix(".png").exists()  # --out is where it goes
    assert "summary: steps=20 updates=20 skips=0 (none)" in out
    assert "max rolling skip rate 0.0000 (window 1000), alert episodes 0," in out


def test_report_run_dir_uses_the_run_config(finished_run, tmp_path):
    run_dir, _ = finished_run
    out_png = tmp_path / "again.png"
    code, out, err = in_process(["report", run_dir, "--out", out_png], tmp_path)
    assert code == 0, err
    assert png_size(out_png) == PNG_SIZE
    skipped = [s in DEMO_SKIPS for s in range(1, FINISHED["steps"] + 1)]
    rates = reference_rates(skipped, FINISHED["window"])  # the window of the run's config.yaml
    assert f"max rolling skip rate {max(rates):.4f} (window {FINISHED['window']})" in out
    # The same numbers as the run card written during the run.
    table = card_table((run_dir / "RUN.md").read_text(encoding="utf-8"))
    assert f"alert episodes {table['skip-rate alert episodes']}," in out
    assert f"clip rate {table['clip rate (whole run)'].split()[0]}, scale {table['scale health'].split()[0]}" in out


def test_the_clip_rate_report_prints_is_the_runs_whatever_max_norm_is_given(cli, tmp_path):
    # review 9 #7: --max-norm (help: "clip threshold line") also recomputed the summary's clip
    # rate: this run (5 of 6 steps clipped) read 0.833, or 0.000 with --max-norm 0 or 100
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=6", "--set", "precision=fp16",
                         "--inject", "nan_loss@3", "--set", "log.name=r", "--set", "log.plot=false")  # (no plot read)
    assert code == 0, err
    run = tmp_path / "runs" / "r"
    card = card_table((run / "RUN.md").read_text(encoding="utf-8"))["clip rate (whole run)"]
    assert card.startswith("0.833 (5 of 6 steps")
    (tmp_path / "bare.csv").write_bytes((run / "steps.csv").read_bytes())  # no config.yaml: the CSV's own account
    for target in (run, "bare.csv"):
        for max_norm in ([], ["--max-norm", "0"], ["--max-norm", "1"], ["--max-norm", "100"]):
            code, out, err = cli("report", target, "--no-plot", *max_norm)  # (the summary is the point)
            assert code == 0, err
            assert ", clip rate 0.833, " in out, (target, max_norm, out)


# ---------------------------------------------------------------------------- report: bad input

GOOD_ROWS = [
    "1,0.2,3.0,1.0,2.5,0,,1024.0",
    "2,0.2,inf,,2.4,1,non_finite_grad,512.0",
    "3,0.2,,,nan,1,non_finite_loss,256.0",
]


def _csv(*lines: str) -> str:
    return "\n".join(lines) + "\n"


BAD_CSVS = {
    "bad header": (_csv("step,lr,loss,grad_l2_pre_clip,grad_l2_post_clip,skipped,skip_reason,scaler_scale",
                        *GOOD_ROWS), r"header"),
    "short header": (_csv("step,lr,grad_l2_pre_clip", "1,0.1,2.0"), r"header"),
    "non-number cell": (_csv(HEADER, GOOD_ROWS[0], "2,0.2,1.0,1.0,abc,0,,1024.0"), r"line 3.*loss.*'abc'"),
    "step not whole": (_csv(HEADER, "1.5,0.2,1.0,1.0,2.0,0,,1024.0"), r"step '1\.5'"),
    "too few cells": (_csv(HEADER, GOOD_ROWS[0], "2,0.2,1.0,1.0,2.0,0,"), r"line 3.*7 cells"),
    "too many cells": (_csv(HEADER, "1,0.2,1.0,1.0,2.0,0,,1024.0,9"), r"line 2.*9 cells"),
    "skipped=2": (_csv(HEADER, GOOD_ROWS[0], "2,0.2,1.0,1.0,2.0,2,,1024.0"), r"skipped.*'2'"),
    "reason without skip": (_csv(HEADER, "1,0.2,1.0,1.0,2.0,0,non_finite_grad,1024.0"), r"skip_reason"),
    "skip without reason": (_csv(HEADER, "1,0.2,inf,,2.0,1,,1024.0"), r"skip_reason"),
    "unknown reason": (_csv(HEADER, "1,0.2,inf,,2.0,1,cosmic_ray,1024.0"), r"cosmic_ray"),
    "steps out of order": (_csv(HEADER, GOOD_ROWS[0], "3,0.2,1.0,1.0,2.0,0,,1024.0", "2,0.2,1.0,1.0,2.0,0,,1024.0"),
                           r"step 2 does not follow step 3"),
    "duplicate step": (_csv(HEADER, GOOD_ROWS[0], GOOD_ROWS[0]), r"step 1 twice \(a row repeated\)"),
    "empty file": ("", r"bad.csv is empty \(no header, no step\)"),
    "header only": (_csv(HEADER), r"no steps"),
    "not utf-8": (None, r"not a readable CSV"),
}


@pytest.mark.parametrize("case", sorted(BAD_CSVS))
def test_report_bad_csv_exits_2_with_one_line_and_no_png(cli, tmp_path, snapshot, case):
    text, names = BAD_CSVS[case]
    path = tmp_path / "bad.csv"
    if text is None:
        path.write_bytes(HEADER.encode() + b"\n1,0.2,1.0,1.0,\xff\xfe,0,,1024.0\n")
    else:
        path.write_text(text, encoding="utf-8")
    before = snapshot(tmp_path)
    code, out, err = cli("report", "bad.csv")
    assert code == 2
    assert len(err.splitlines()) == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert re.search(names, err), err
    assert "bad.csv" in err
    assert out == ""
    assert snapshot(tmp_path) == before  # no PNG, nothing touched
    assert not list(tmp_path.rglob("*.png"))


def test_report_the_good_rows_above_are_good(cli, tmp_path):
    # The bad cases differ from this file in one place each.
    (tmp_path / "good.csv").write_text(_csv(HEADER, *GOOD_ROWS), encoding="utf-8")
    from ampguard.sinks import read_steps_csv

    rows = read_steps_csv(tmp_path / "good.csv")
    assert [(r.step, r.skipped, r.skip_reason) for r in rows] == [
        (1, False, ""), (2, True, "non_finite_grad"), (3, True, "non_finite_loss")]
    assert rows[1].grad_l2_pre_clip == float("inf") and rows[1].grad_l2_post_clip is None


@pytest.mark.parametrize("target", ["missing.csv", "missing_dir/", "empty_dir"])
def test_report_missing_file_exits_2(cli, tmp_path, snapshot, target):
    (tmp_path / "empty_dir").mkdir()
    before = snapshot(tmp_path)
    code, out, err = cli("report", target)
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert target.rstrip("/") in err
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------- run card and plot of train


def test_finished_run_card_and_plot(finished_run):
    run_dir, out = finished_run
    rows = read_rows(run_dir / "steps.csv")
    n = FINISHED["steps"]
    assert [int(r["step"]) for r in rows] == list(range(1, n + 1))
    # Only the injected steps skip: the scale halves exactly twice from init_scale.
    assert {int(r["step"]): r["skip_reason"] for r in rows if r["skipped"] == "1"} == DEMO_SKIPS
    final_scale = FINISHED["init_scale"] * 0.5 ** len(DEMO_SKIPS)
    assert float(rows[-1]["scaler_scale"]) == final_scale

    table = check_card_against_csv(run_dir, window=FINISHED["window"], alert_rate=0.05, max_norm=1.0)
    assert table["ended"] == f"finished: {n} steps"
    assert table["precision"] == "fp16 (autocast on cpu)"
    assert table["backend"] == "cpu"
    assert table["accumulation"] == "2 micro-batches per step"
    assert table["loss scaler"] == (f"dynamic: init {FINISHED['init_scale']}, x2 after 2000 clean steps, "
                                    f"x0.5 on a skip, floor (min_scale) 1")
    assert table["fail-fast"] == (f"skip rate > {FINISHED['fail_rate']:g} for {FINISHED['fail_after']} "
                                  f"consecutive steps -> exit 3")
    # The last skip (step 9) left the 5-step window at step 14: no moves in it -> stable.
    assert table["scale health"] == f"stable (final scale {final_scale:g})"
    assert table["skipped steps"] == "2 (non_finite_grad=1, non_finite_loss=1)"
    assert png_size(run_dir / "report.png") == PNG_SIZE

    skipped = [s in DEMO_SKIPS for s in range(1, n + 1)]
    expected = reference_episodes_events(reference_rates(skipped, FINISHED["window"]), 0.05, FINISHED["min_steps"])
    events = read_events(run_dir / "events.jsonl")
    assert [(e["step"], e["event"]) for e in events if e["event"].startswith("skip_rate")] == expected
    assert events[0]["event"] == "run_start"
    assert (events[-1]["event"], events[-1]["step"], events[-1]["message"]) == ("run_end", n, table["ended"])
    assert "run folder:" in out and "STATS 15 " in out


def test_the_run_card_names_rocm_where_pytorch_says_cuda(tmp_path, monkeypatch):
    # review_seeds8 #5: PyTorch on ROCm names an AMD GPU "cuda" and leaves torch.version.cuda None; the
    # card said only "autocast on cuda". No GPU here: the card reads torch.version, not the device.
    import torch

    from ampguard.config import validate
    from ampguard.errors import ExitCode
    from ampguard.monitor import RunMonitor
    from ampguard.report import write_run_card
    from ampguard.run_folder import RunPaths, RunResult

    (tmp_path / "steps.csv").write_text(HEADER + "\n", encoding="utf-8")
    config = validate({"precision": "bf16"})

    def card(device: str) -> dict[str, str]:
        result = RunResult(ExitCode.OK, RunMonitor(), RunPaths.existing(tmp_path), "finished", torch.device(device))
        write_run_card(tmp_path / "RUN.md", config, result)
        return card_table((tmp_path / "RUN.md").read_text(encoding="utf-8"))

    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766")
    monkeypatch.setattr(torch.version, "cuda", None)
    table = card("cuda")
    assert table["precision"] == "bf16 (autocast on cuda)"
    assert table["backend"] == "rocm (HIP 6.2.41133-dd7f95766; PyTorch names the device cuda)"
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert card("cuda")["backend"] == "cuda (CUDA 12.4)"
    assert card("cpu")["backend"] == "cpu"


def test_failed_run_card_and_plot(failed_run):
    run_dir, code, out = failed_run
    fault = parse_fault(FAILED["spec"], seed=0)
    skipped = [fault.hits(s) for s in range(1, FAILED["steps"] + 1)]
    expected = reference_fail_step(reference_rates(skipped, FAILED["window"]), FAILED["fail_rate"],
                                   FAILED["fail_after"])
    assert code == 3
    rows = read_rows(run_dir / "steps.csv")
    assert len(rows) == expected  # flushed, and nothing after the guard's step
    table = check_card_against_csv(run_dir, window=FAILED["window"], alert_rate=0.05, max_norm=1.0)
    assert table["ended"].startswith(f"stopped by the guard at step {expected}: rolling skip rate above "
                                     f"fail_rate {FAILED['fail_rate']:g} for {FAILED['fail_after']} consecutive")
    assert table["precision"] == "bf16 (autocast on cpu)"
    assert table["loss scaler"].startswith("off")
    assert table["scale health"].startswith("none")
    assert table["skipped steps"] == f"{sum(skipped[:expected])} (non_finite_grad={sum(skipped[:expected])})"
    assert table["fail-fast"] == "skip rate > 0.1 for 10 consecutive steps -> exit 3"
    assert png_size(run_dir / "report.png") == PNG_SIZE
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("FAIL")] == [["FAIL", str(expected)]]


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_interrupted_run_card_and_plot(tmp_path):
    argv = [sys.executable, "-m", "ampguard", "train", "--set", "task.name=linear", "--set", "steps=1000000",
            "--set", "log.every=1000000", "--set", "log.dir=runs", "--set", "log.name=int",
            "--set", "monitor.window=50", "--inject", "nan_loss@every:4"]
    run_dir = tmp_path / "runs" / "int"
    csv_path = run_dir / "steps.csv"
    with open(tmp_path / "out.txt", "wb") as out_f, open(tmp_path / "err.txt", "wb") as err_f:
        proc = warm.Popen(argv, cwd=tmp_path, stdout=out_f, stderr=err_f)
        try:
            deadline = time.monotonic() + 45
            while time.monotonic() < deadline and proc.poll() is None:
                if csv_path.exists() and csv_path.read_bytes().count(b"\n") > 10:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before it could be interrupted"
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=40)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    err = (tmp_path / "err.txt").read_text(encoding="utf-8")
    assert code == 130, err
    assert "Traceback" not in err
    rows = read_rows(csv_path)
    n = len(rows)
    assert n >= 10 and [int(r["step"]) for r in rows] == list(range(1, n + 1))
    fault = parse_fault("nan_loss@every:4")
    assert [r["skipped"] == "1" for r in rows] == [fault.hits(s) for s in range(1, n + 1)]

    table = check_card_against_csv(run_dir, window=50, alert_rate=0.05, max_norm=1.0)
    assert table["ended"] == f"interrupted (Ctrl-C) after step {n}"
    assert table["precision"] == "bf16 (autocast on cpu)"  # the config default
    assert table["fail-fast"].startswith("off")
    assert table["rollback triggers"] == "none (rollback.triggers)"  # (review_27e: the card never said)
    assert png_size(run_dir / "report.png") == PNG_SIZE
    events = read_events(run_dir / "events.jsonl")
    assert events[-1]["event"] == "run_end" and events[-1]["step"] == n
    assert "interrupted" in events[-1]["message"]


def test_report_of_a_bare_demo_csv_judges_the_scale_from_where_the_demo_started(cli, tmp_path):
    # no config.yaml beside a demo's CSV: the start scale is read off the CSV (1024), not assumed
    # to be 65536, so the demo's single halving (1024 -> 512) is not a "collapse"
    code, out, err = cli("demo", "--csv", "d.csv")
    assert code == 0, err
    code, out, err = cli("report", "d.csv", "--no-plot")  # (the summary is the point)
    assert code == 0, err
    assert "scale stable" in out and "collapsing" not in out


def test_an_fp32_run_card_says_no_autocast(tmp_path):
    # review_clarity10 #2: the card said "fp32 (autocast on cpu)", but fp32 runs under no autocast
    import torch

    from ampguard.config import validate
    from ampguard.errors import ExitCode
    from ampguard.monitor import RunMonitor
    from ampguard.report import write_run_card
    from ampguard.run_folder import RunPaths, RunResult

    (tmp_path / "steps.csv").write_text(HEADER + "\n", encoding="utf-8")
    for precision, said in [("fp32", "fp32 (no autocast)"), ("bf16", "bf16 (autocast on cpu)")]:
        result = RunResult(ExitCode.OK, RunMonitor(), RunPaths.existing(tmp_path), "finished", torch.device("cpu"))
        write_run_card(tmp_path / "RUN.md", validate({"precision": precision}), result)
        assert card_table((tmp_path / "RUN.md").read_text(encoding="utf-8"))["precision"] == said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RUN.md", "steps.csv"]  # no temporary file left


def test_a_run_with_log_plot_false_draws_no_plot_and_its_card_says_how_to_get_one(cli, tmp_path):
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "steps=3", "--set", "log.plot=false",
                         "--set", "log.name=p")
    assert code == 0, err
    run = tmp_path / "runs" / "p"
    assert not (run / "report.png").exists() and "report.png" not in out
    table = card_table((run / "RUN.md").read_text(encoding="utf-8"))
    assert table["plot"] == "not drawn when the run ended (log.plot false: `ampguard report` draws it)"
    code, out, err = cli("report", run)  # drawn when wanted
    assert code == 0 and (run / "report.png").is_file(), err
    # a resume with log.plot false: the earlier part's plot would show a run that is no longer the run
    # (review_session10 #5: the closing line listed it, the trackers uploaded it)
    code, out, err = cli("train", "--resume", run, "--set", "steps=5")
    assert code == 0, err
    assert not (run / "report.png").exists() and "report.png" not in out


def test_report_and_compare_of_a_rolled_back_run_say_what_its_card_says(tmp_path, capsys):
    # a run's rollbacks undo updates and restart the skip window; report and compare replayed the
    # CSV without them: "updates=100" for the card's 80 after a spike, and after skip-guard
    # rollbacks a max rolling rate of 0.62 with an ALERT where the run saw 1.0 and none
    linear = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "log.plot=false",
              "--set", f"log.dir={tmp_path}"]
    runs = {"spike": ["--set", "steps=100", "--set", "checkpoint.every=20", "--set", "rollback.triggers=[loss_spike]",
                      "--inject", "spike@60"],
            "skips": ["--set", "steps=120", "--set", "checkpoint.every=10", "--set", "rollback.triggers=[skip_guard]",
                      "--set", "rollback.skip_batches=2", "--fail-skip-rate", "0.5", "--fail-after", "5",
                      "--inject", "nan_grad@" + ",".join(map(str, range(20, 51)))]}
    for name, args in runs.items():
        assert main(["train", *linear, "--set", f"log.name={name}", *args]) == 0
        kinds = [e["kind"] for e in read_events(tmp_path / name / "events.jsonl", strict=False) if e["event"] == "rollback"]
        assert kinds and set(kinds) == {"loss_spike" if name == "spike" else "skip_guard"}  # (what is tested)
    capsys.readouterr()
    cards = {}
    for name in runs:
        card = cards[name] = card_table((tmp_path / name / "RUN.md").read_text(encoding="utf-8"))
        assert main(["report", str(tmp_path / name), "--no-plot"]) == 0
        out = capsys.readouterr().out
        assert f" updates={card['updates applied']} " in out, out
        assert (f"max rolling skip rate {card['max rolling skip rate']} (window 1000), "
                f"alert episodes {card['skip-rate alert episodes']},") in out, out
        assert f"\nended: {card['ended']}\n" in out  # (why it ended, as the card says: report did not say)
    assert main(["compare", str(tmp_path / "spike"), str(tmp_path / "skips")]) == 0
    table = capsys.readouterr().out
    # compare's cells are each card's (the spike's 80: 20 updates after step 40's checkpoint undone)
    assert cards["spike"]["updates applied"] == "80"
    cells = [f"{cards[n]['steps attempted']} / {cards[n]['updates applied']}" for n in runs]
    assert re.search(rf"steps / updates\s*\|\s*{cells[0]}\s*\|\s*{cells[1]}\s*\|", table), table
    rates = [f"{float(cards[n]['max rolling skip rate']):.4f}" for n in runs]
    # (review 54k: the skip guard tripped at step 43, 24 skips in 43 steps; the windows its rollbacks
    # restarted count their skips over min_steps 100, not 1 of 1: the card said 1.0000)
    assert rates == ["0.0000", f"{24 / 43:.4f}"]
    assert re.search(rf"max rolling skip rate\s*\|\s*{rates[0]}\s*\|\s*{rates[1]}\s*\|", table), table
    # resumed from the checkpoint of the rollback's own step (saved after the rollback, which it
    # holds): the rollback is the run's still, not a future the resume abandoned
    assert main(["train", "--resume", str(tmp_path / "spike" / "checkpoints" / "step-00000060.pt")]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "spike"), "--no-plot"]) == 0
    card = card_table((tmp_path / "spike" / "RUN.md").read_text(encoding="utf-8"))
    assert card["updates applied"] == "80" and " updates=80 " in capsys.readouterr().out
