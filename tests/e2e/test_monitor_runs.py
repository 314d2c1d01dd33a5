"""Guard rails seen in whole runs (issue 3): fail-fast, skip-rate alerts and scale health as
``ampguard train`` (the linear task, in-process, a few steps) and ``ampguard demo`` report them:
the console, steps.csv, steps.jsonl, events.jsonl and RUN.md.

Every expected number is computed here from the fault schedule (``parse_fault(...).hits``) and
the window arithmetic, never read back from a run first. The plot is stubbed in these runs (it is
what ``test_report_cli.py`` is about, and it costs seconds on a CPU); everything else a run writes
is real. The monitors themselves, fed synthetic records, are in ``tests/unit/test_monitor.py``.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from helpers import (ag, read_events, read_rows, reference_episodes, reference_fail_step,
                     reference_rates, strict_json)

import ampguard.report
from ampguard.cli import main
from ampguard.config import MonitorConfig
from ampguard.faults import parse_fault

LINEAR = ["--set", "task.name=linear", "--set", "log.every=1000"]


@pytest.fixture
def train(tmp_path, monkeypatch, capsys):
    """``train(name, *argv) -> (code, stdout, stderr, run_dir)``; the plot is stubbed (see module doc)."""
    monkeypatch.chdir(tmp_path)
    drawn: list[Path] = []

    def fake_plot(csv_path, png_path, **kwargs):
        drawn.append(Path(png_path))
        Path(png_path).write_bytes(b"stub")
        return Path(png_path)

    monkeypatch.setattr(ampguard.report, "plot_run", fake_plot)

    def run(name: str, *argv: str) -> tuple[int, str, str, Path]:
        capsys.readouterr()
        code = main(["train", *LINEAR, "--set", f"log.dir={tmp_path / 'runs'}", "--set", f"log.name={name}", *argv])
        out, err = capsys.readouterr()
        return code, out, err, tmp_path / "runs" / name

    run.drawn = drawn  # type: ignore[attr-defined]
    return run


# ---------------------------------------------------------------------------- train: fail-fast


def test_a_run_too_short_to_arm_the_alert_or_fail_fast_is_judged_at_its_end(train):
    # review: 30 of 30 steps skipped ended "finished", exit 0, no ALERT (min_steps and fail_after are 100)
    code, out, err, run = train("short", "--set", "steps=30", "--inject", "nan_loss@every:1")
    assert code == 0, err
    alerts = [line for line in out.splitlines() if line.startswith("ALERT ")]
    assert alerts == ["ALERT 30 skip rate 1.000 > alert_rate 0.05 over the run's 30 steps, which ended before the "
                      "rolling ALERT armed (monitor.min_steps 100)"]
    card = (run / "RUN.md").read_text(encoding="utf-8")
    assert "| skip-rate alert episodes | 1 |" in card
    assert [e["step"] for e in read_events(run / "events.jsonl") if e["event"] == "skip_rate_alert"] == [30]
    code, out, err = ag("report", run, "--out", run / "again.png")  # (this fixture's report.png is a stub)
    assert code == 0 and "alert episodes 1," in out, err  # the replay judges the whole run as the run did

    code, out, err, run = train("short-fail", "--set", "steps=30", "--inject", "nan_loss@every:1",
                                "--set", "monitor.fail_rate=0.5")
    assert code == 3, err
    assert "ended: stopped by the guard at the end of the run (step 30): skip rate above fail_rate 0.5 at every one " \
           "of the run's 30 steps (it ended before fail_after 100 consecutive steps)" in out
    assert len(read_rows(run / "steps.csv")) == 30
    code, out, err, _ = train("short-ok", "--set", "steps=30", "--inject", "nan_loss@2", "--set", "monitor.fail_rate=0.5")
    assert code == 0 and "ALERT" not in out  # 1 of 30 (0.033) is below alert_rate


def test_train_fail_fast_stops_at_the_predicted_step(train):
    fault = parse_fault("inf_grad@rate:0.5", seed=0)
    window, fail_rate, fail_after, steps = 20, 0.1, 10, 200
    skipped = [fault.hits(s) for s in range(1, steps + 1)]
    expected = reference_fail_step(reference_rates(skipped, window), fail_rate, fail_after)
    assert expected is not None and expected < steps

    code, out, err, run_dir = train(
        "ff", "--set", "precision=fp32", "--set", f"steps={steps}", "--inject", "inf_grad@rate:0.5",
        "--set", f"monitor.window={window}", "--fail-skip-rate", str(fail_rate), "--fail-after", str(fail_after))
    assert code == 3, err
    assert "Traceback" not in err

    # CSV: exactly `expected` complete rows, steps 1..expected, skips exactly where the fault hits.
    text = (run_dir / "steps.csv").read_text(encoding="utf-8")
    assert text.endswith("\n")
    rows = read_rows(run_dir / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, expected + 1))
    assert [r["skipped"] == "1" for r in rows] == skipped[:expected]
    assert {r["skip_reason"] for r in rows if r["skipped"] == "1"} == {"non_finite_grad"}

    # One FAIL line on the console, at that step.
    fail_lines = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert len(fail_lines) == 1 and fail_lines[0].startswith(f"FAIL {expected} ")
    assert f"fail_rate {fail_rate:g}" in fail_lines[0] and f"{fail_after} consecutive" in fail_lines[0]

    # events.jsonl: strict JSON, exactly one fail event at that step, then run_end.
    events = read_events(run_dir / "events.jsonl")
    fails = [e for e in events if e["event"] == "fail"]
    assert [e["step"] for e in fails] == [expected]
    assert fails[0]["cause"] == "skip_rate"  # which guard, without reading the message
    held = skipped[max(0, expected - window):expected]
    assert fails[0]["skip_rate"] == sum(held) / len(held)
    assert events[-1]["event"] == "run_end" and events[-1]["step"] == expected
    assert events[0]["event"] == "run_start"

    # RUN.md says why it ended; the plot was still made.
    card = (run_dir / "RUN.md").read_text(encoding="utf-8")
    assert f"stopped by the guard at step {expected}" in card
    assert f"above fail_rate {fail_rate:g} for {fail_after} consecutive steps" in card
    assert train.drawn == [run_dir / "report.png"]
    assert f"ended: stopped by the guard at step {expected}" in out


def test_train_fail_rate_from_config_keys(train):
    # monitor.fail_rate / monitor.fail_after are the config spelling of the two flags.
    fault = parse_fault("nan_loss@every:2", seed=0)
    skipped = [fault.hits(s) for s in range(1, 61)]
    expected = reference_fail_step(reference_rates(skipped, 10), 0.3, 5)
    assert expected is not None
    code, out, err, run_dir = train(
        "cfg", "--set", "precision=bf16", "--set", "steps=60", "--inject", "nan_loss@every:2",
        "--set", "monitor.window=10", "--set", "monitor.fail_rate=0.3", "--set", "monitor.fail_after=5")
    assert code == 3, err
    assert len(read_rows(run_dir / "steps.csv")) == expected
    assert [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "fail"] == [expected]


def test_a_resumed_guard_stop_is_judged_with_the_resumed_thresholds(train):
    # stopped by the guard; resumed as it was: stopped again at its next step (the rate is still
    # above, the counters went on); resumed with the guard off or a higher rate: trains to the end
    args = ["--set", "precision=bf16", "--set", "steps=60", "--inject", "nan_loss@every:2",
            "--set", "monitor.window=10", "--set", "monitor.fail_after=5"]
    fault = parse_fault("nan_loss@every:2", seed=0)
    rates = reference_rates([fault.hits(s) for s in range(1, 61)], 10)
    stop = reference_fail_step(rates, 0.3, 5)
    code, out, err, run_dir = train("r", *args, "--set", "monitor.fail_rate=0.3")
    assert code == 3 and len(read_rows(run_dir / "steps.csv")) == stop, err
    again = reference_fail_step(rates, 0.3, 5, after=stop)
    assert again == stop + 1
    for name, change, code_, rows, fails in (
            ("same", "monitor.fail_rate=0.3", 3, again, [stop, again]),
            ("guard-off", "monitor.fail_rate=null", 0, 60, [stop]),
            ("higher", "monitor.fail_rate=0.9", 0, 60, [stop])):
        copy = run_dir.parent / name
        copy.mkdir()
        for f in run_dir.rglob("*"):
            if f.is_file():
                (copy / f.relative_to(run_dir)).parent.mkdir(parents=True, exist_ok=True)
                (copy / f.relative_to(run_dir)).write_bytes(f.read_bytes())
        code, out, err, _ = train(name, *args, "--resume", str(copy), "--set", change)
        assert code == code_, (name, err)
        assert len(read_rows(copy / "steps.csv")) == rows, name
        assert [e["step"] for e in read_events(copy / "events.jsonl") if e["event"] == "fail"] == fails, name


def test_fail_fast_sets_the_fp16_scalers_opening_search_aside(train):
    # fp16: overflows in a row at the start are the scaler finding its scale (scale health: warming),
    # not 6% or 12% of the first 100 steps skipped; an fp16 run that overflows at every step reaches
    # the floor (2**16 -> 1.0 at step 16), and then its skips count from step 1: it fails at step 100
    # as a bf16 run would
    for name, opening in (("six", 6), ("twelve", 12)):
        faults = "inf_grad@" + ",".join(str(s) for s in range(1, opening + 1))
        code, out, err, run_dir = train(name, "--set", "precision=fp16", "--set", "steps=120",
                                        "--inject", faults, "--fail-skip-rate", "0.05")
        assert code == 0, (name, err)
        assert "ALERT" not in out and "FAIL" not in out
    for precision in ("fp16", "bf16"):
        code, out, err, run_dir = train(f"all-{precision}", "--set", f"precision={precision}", "--set", "steps=120",
                                        "--inject", "inf_grad@every:1", "--fail-skip-rate", "0.05")
        assert code == 3, err
        assert [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "fail"] == [100]


def test_train_without_fail_rate_runs_to_the_end_despite_skips(train):
    code, out, err, run_dir = train(
        "nofail", "--set", "precision=fp32", "--set", "steps=15", "--inject", "inf_grad@rate:0.5",
        "--set", "monitor.window=5")
    assert code == 0, err
    assert len(read_rows(run_dir / "steps.csv")) == 15
    assert not [line for line in out.splitlines() if line.startswith("FAIL")]
    assert "finished: 15 steps" in (run_dir / "RUN.md").read_text(encoding="utf-8")


def test_train_fail_on_scale_collapse(train):
    # fp16 from scale 4: injected overflows at steps 1-3 halve it to 2, then 1 = scaler.min_scale
    # (the floor) at step 2; step 3 is skipped at the floor too: 2 consecutive -> exit 3 at step 3.
    code, out, err, run_dir = train(
        "collapse", "--set", "precision=fp16", "--set", "steps=30", "--set", "scaler.init_scale=4",
        "--inject", "inf_grad@1,2,3", "--set", "monitor.fail_on_scale_collapse=true",
        "--set", "monitor.fail_after=2")
    assert code == 3, err
    rows = read_rows(run_dir / "steps.csv")
    assert len(rows) == 3 and all(r["skipped"] == "1" for r in rows)
    assert [float(r["scaler_scale"]) for r in rows[:2]] == [2.0, 1.0]
    events = read_events(run_dir / "events.jsonl")
    assert [(e["step"], e["event"]) for e in events if e["event"] in ("scale_alert", "fail")] == [
        (2, "scale_alert"), (3, "fail")]
    assert [e["cause"] for e in events if e["event"] == "fail"] == ["scale_collapse"]
    assert [line.split()[:2] for line in out.splitlines() if line.startswith(("ALERT", "FAIL"))] == [
        ["ALERT", "2"], ["FAIL", "3"]]
    card = (run_dir / "RUN.md").read_text(encoding="utf-8")
    assert "scale health | collapsing" in card
    assert "stopped by the guard at step 3" in card


def test_demo_every_step_nan_fails_fast_at_fail_after():
    # The defect: the rate divided by the whole (empty) window, so this ran all 300 steps, exit 0.
    code, out, err = ag("demo", "--steps", 300, "--inject", "nan_loss@every:1", "--fail-skip-rate", 0.5,
                        "--fail-after", 3)
    assert code == 3, (out, err)
    steps = [line.split()[:2] for line in out.splitlines() if line.startswith(("STEP ", "SKIP "))]
    assert steps == [["SKIP", "1"], ["SKIP", "2"], ["SKIP", "3"]]
    assert [line.split()[:2] for line in out.splitlines() if line.startswith("FAIL ")] == [["FAIL", "3"]]


# ---------------------------------------------------------------------------- train: alert episodes


def test_train_alerts_once_per_episode(train):
    # The skip at step 3 is 1 of 3 steps seen (0.333 > 0.1) but the ALERT is not armed before
    # min(monitor.min_steps, window) = 10 steps, when the window reads 1 of 10 (not above 0.1);
    # the two episodes after it are.
    min_steps = MonitorConfig().min_steps
    steps, window, alert = min_steps + 35, 10, 0.1
    late = [min_steps + d for d in (2, 3, 5, 20, 21)]
    spec = "nan_loss@" + ",".join(str(s) for s in [3, *late])
    fault = parse_fault(spec)
    skipped = [fault.hits(s) for s in range(1, steps + 1)]
    rates = reference_rates(skipped, window)
    assert rates[2] > alert
    expected = reference_episodes(rates, alert, min_steps=min(min_steps, window))
    # with clear_rate 0.08 (0.8 x alert_rate) in a window of 10 an ALERT clears when its last skip leaves it
    assert expected == [(late[1], "ALERT"), (late[2] + 10, "CLEAR"), (late[4], "ALERT"), (late[4] + 10, "CLEAR")]

    code, out, err, run_dir = train(
        "alerts", "--set", "precision=fp32", "--set", f"steps={steps}", "--inject", spec,
        "--set", f"monitor.window={window}", "--set", f"monitor.alert_rate={alert}")
    assert code == 0, err
    console = [(int(line.split()[1]), line.split()[0]) for line in out.splitlines()
               if line.startswith(("ALERT ", "CLEAR "))]
    assert console == expected  # once when it starts, once when it clears: not per step

    events = read_events(run_dir / "events.jsonl")
    logged = [(e["step"], {"skip_rate_alert": "ALERT", "skip_rate_clear": "CLEAR"}[e["event"]])
              for e in events if e["event"] in ("skip_rate_alert", "skip_rate_clear")]
    assert logged == expected
    for e in events:
        if e["event"] in ("skip_rate_alert", "skip_rate_clear"):
            assert e["skip_rate"] == rates[e["step"] - 1] and e["window"] == window

    card = (run_dir / "RUN.md").read_text(encoding="utf-8")
    assert "| skip-rate alert episodes | 2 |" in card
    assert f"| max rolling skip rate | {max(rates):.4f} |" in card  # from step 1: step 3 was 1 in 3
    assert max(rates) == 1 / 3
    assert f"| skipped steps | {sum(skipped)} (non_finite_loss={sum(skipped)}) |" in card


# ---------------------------------------------------------------------------- train: real fp16 scale health


def reference_verdicts(scales: list[float], skipped: list[bool], init: float, window: int,
                       growth_interval: int) -> list[str]:
    """The scale-health table (docs/design.md) re-derived by brute force from the per-step scales."""
    full = [init, *scales]  # full[k]: the scale after step k (full[0]: before step 1)
    run_opening = next((k for k, s in enumerate(skipped) if not s), len(skipped))  # the opening streak of skips
    out = []
    for i in range(len(scales)):  # step i + 1
        opening = min(run_opening, i + 1)  # the streak as far as step i + 1 has seen it
        start = max(0, i + 1 - window)  # full[start]: the scale before the window's first step
        streak = next((n for n, s in enumerate(reversed(skipped[: i + 1])) if not s), i + 1)
        floored = any(x <= 1.0 for x in scales[:opening])  # the opening reached the floor: no warm-up
        warm = 1 <= opening and not floored and opening >= start + 1  # a warm-up, and a move of it in the window
        seg = full[max(start, opening) if warm else start: i + 2]
        octs = [math.log2(x / seg[0]) for x in seg]
        after = scales[opening: i + 1]  # since the opening streak
        peak = max(after, default=None)
        new_high = bool(after) and all(x == peak for x in after[after.index(peak):])  # at the peak, no fall since
        # the legs: the levels the scaler settled at (growth_interval // 2 applied steps in a row at one
        # scale, step k + 1 applying at full[k]), from the first fall of 2 octaves
        reach, settle = window + 8 * growth_interval, max(1, growth_interval // 2)
        ends, falling, high, low = [], None, None, None
        for k in range(run_opening, i + 1):
            first = k - settle + 1  # (the run of applied steps this one completes)
            if first < run_opening or any(skipped[first: k + 1]) or len(set(full[first: k + 1])) > 1 or (
                    first > run_opening and not skipped[first - 1] and full[first - 1] == full[k]):
                continue
            x = math.log2(full[k])
            high, low = (x, x) if high is None else (max(high, x), min(low, x))
            if falling is not True and x <= high - 2:
                ends, falling, low = ends + [k + 1], True, x
            elif falling is True and x >= low + 2:
                ends, falling, high = ends + [k + 1], False, x
        legs = 0
        if ends and ends[-1] > i + 1 - reach:
            legs = 1
            while legs < len(ends) and ends[-legs] - ends[-legs - 1] < reach:
                legs += 1
        if scales[i] <= 1.0 or streak > 8:  # the floor scaler.min_scale is 1
            out.append("collapsing")
        elif legs >= 3:
            out.append("oscillating")
        elif octs[-1] <= -3:
            out.append("collapsing")
        elif warm and len(set(seg)) == 1:
            out.append("warming")
        elif octs[-1] > 0 and new_high:
            out.append("climbing")
        else:
            out.append("stable")
    return out


@pytest.mark.parametrize("init,window,every,steps,labels", [
    # a search of 5 halvings down from 2**22 is a warm-up; the skip at step 7 comes after a clean step
    (2.0**22, 10, 5, 20, ["warming", "stable", "stable", "stable"]),
    # 2**40: 23 straight skips before a scale fits: collapsing while more than 8 in a row go on,
    # a warm-up once a step applies (the search found a scale above the floor)
    (2.0**40, 10, 10, 40, ["collapsing", "collapsing", "stable", "stable"]),
])
def test_train_fp16_scale_health_from_the_opening_on(train, init, window, every, steps, labels):
    code, out, err, run_dir = train(
        "fp16", "--set", "precision=fp16", "--set", f"steps={steps}", "--set", f"scaler.init_scale={int(init)}",
        "--set", f"monitor.window={window}", "--set", f"log.every={every}", "--set", "log.jsonl=true")
    assert code == 0, err
    rows = read_rows(run_dir / "steps.csv")
    scales = [float(r["scaler_scale"]) for r in rows]
    skipped = [r["skipped"] == "1" for r in rows]
    # init_scale times any gradient overflows fp16 (max 65504): the run opens with a streak of skips.
    assert all(skipped[:every]), "the opening steps should all overflow"
    assert all(r["skip_reason"] == "non_finite_grad" for r, s in zip(rows, skipped) if s)

    stats = [line for line in out.splitlines() if line.startswith("STATS ")]
    assert [int(line.split()[1]) for line in stats] == list(range(every, steps + 1, every))
    verdicts = [re.search(r" scale=(\S+) ", line).group(1) for line in stats]
    expected = reference_verdicts(scales, skipped, init, window, growth_interval=2000)
    assert verdicts == [expected[s - 1] for s in range(every, steps + 1, every)] == labels
    for line, step in zip(stats, range(every, steps + 1, every)):
        rate = sum(skipped[max(0, step - window): step]) / min(step, window)
        assert f"skip_rate={rate:.3f}" in line
        n = sum(skipped[:step])
        assert re.search(rf" skips=non_finite_grad={n} examples/s=[\d,]+$", line), line  # then the throughput

    card = (run_dir / "RUN.md").read_text(encoding="utf-8")
    assert f"| scale health | stable (final scale {scales[-1]:g}) |" in card
    assert "| precision | fp16 (autocast on cpu) |" in card

    # steps.jsonl (log.jsonl=true): strict JSON, the opening's non-finite norms as strings.
    lines = (run_dir / "steps.jsonl").read_text(encoding="utf-8").splitlines()
    recs = [strict_json(line) for line in lines]
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    for rec, row in zip(recs, rows):
        assert rec["skipped"] == (row["skipped"] == "1")
        assert rec["skip_reason"] == (row["skip_reason"] or None)
        assert rec["scaler_scale"] == float(row["scaler_scale"])
        if row["grad_l2_pre_clip"] in ("inf", "nan"):
            assert rec["grad_l2_pre_clip"] == row["grad_l2_pre_clip"]
    assert any(r["grad_l2_pre_clip"] in ("inf", "nan") for r in recs[:every])


# ---------------------------------------------------------------------------- train: sinks


def test_train_with_tensorboard_missing_exits_2_and_writes_nothing(train, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # the package hidden (it is installed here)
    code, out, err, run_dir = train("tb", "--set", "steps=3", "--set", "log.tensorboard=true")
    assert code == 2
    assert err.splitlines() == ["ampguard: error: log.tensorboard is on but the tensorboard package is not "
                                "installed: pip install 'ampguard[tensorboard]'"], err
    # Bad input leaves nothing behind: the check comes before the run folder is made.
    assert not run_dir.exists()
    assert not (tmp_path / "runs").exists()


def test_the_end_of_a_run_is_judged_once_and_only_for_a_run_that_trained_to_it(train):
    # review: a run stopped at its last step (strict) has no end judgement, and report must not add one
    code, out, err, run = train("st", "--set", "steps=5", "--inject", "nan_loss@5", "--strict")
    assert code == 3 and "ALERT" not in out, out
    # review_session26: the first-skip diagnosis replays the step with its injected fault (FP32 too) and
    # said "a data or model problem" where locate names the fault; the console, the end and the card name it
    said = "FP32 replay is not finite either: the injected nan_loss@5, not a precision problem"
    assert "DIAGNOSIS 5 step 5 (non_finite_loss): first nan under " in out and said in out, out
    assert said in [e for e in read_events(run / "events.jsonl") if e["event"] == "diagnosis"][0]["message"]
    assert said in (run / "RUN.md").read_text(encoding="utf-8")
    assert "| skip-rate alert episodes | 0 |" in (run / "RUN.md").read_text(encoding="utf-8")
    assert "alert episodes 0," in ag("report", run, "--out", run / "again.png")[1]
    # a resume of a run that had finished trains nothing and logs its end judgement no second time
    code, out, err, run = train("twice", "--set", "steps=10", "--inject", "nan_loss@every:1",
                                "--set", "monitor.fail_rate=0.5", "--set", "checkpoint.every=5")
    assert code == 3, err
    kinds = lambda: [e["event"] for e in read_events(run / "events.jsonl") if e["event"] in ("fail", "skip_rate_alert")]  # noqa: E731
    assert kinds() == ["skip_rate_alert", "fail"]
    code, out, err = ag("train", "--resume", run)
    assert code == 3 and "ended: stopped by the guard at the end of the run (step 10)" in out, out + err
    assert kinds() == ["skip_rate_alert", "fail"]  # (the guard's stop saved step 10: nothing trained again)
