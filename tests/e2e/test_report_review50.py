"""Review 50k: report and compare replay a run's judgement at its end as the run made it. A run the
guard stopped at its end (too short for the rolling rules), and the earlier part of a resumed run
that was judged at its end, kept their ALERT on the card and lost it in report's count; an fp16
run that skipped every step said "0.0000 as the guard judged it" beside the FAIL at a rate of 1.
Tiny linear runs on the CPU, in-process."""

from __future__ import annotations

from pathlib import Path

from helpers import ag, ok, train

from ampguard import compare


def _card_row(run: Path, label: str) -> str:
    return next(line for line in (run / "RUN.md").read_text(encoding="utf-8").splitlines()
                if line.startswith(f"| {label} |"))


def _report_line(run: Path) -> str:
    out = ok(ag("report", run, "--no-plot"))
    return next(line for line in out.splitlines() if line.startswith("max rolling skip rate"))


def test_a_run_the_guard_stopped_at_its_end_keeps_its_alert_in_report_and_compare(tmp_path):
    code, out, _ = train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=30", "--set", "log.plot=false",
                         "--inject", "inf_grad@1,2,3,4,5,6,7,9,12,15,18,21,24,27,30", "--fail-skip-rate", "0.3")
    run = tmp_path / "run"
    assert code == 3 and "stopped by the guard at the end of the run" in out
    assert _card_row(run, "skip-rate alert episodes") == "| skip-rate alert episodes | 1 |"
    assert "alert episodes 1," in _report_line(run)
    assert compare.load_run(run).monitor.alert_episodes == 1  # (compare replays the run as report does)


def test_the_earlier_part_of_a_resumed_run_judged_at_its_end_keeps_its_alert(tmp_path):
    ok(train(tmp_path, "run", "--set", "task.name=linear", "--set", "steps=40", "--set", "checkpoint.every=10",
             "--set", "log.plot=false", "--inject", "inf_grad@5,6,7,30"))
    run = tmp_path / "run"
    ok(ag("train", "--resume", run, "--set", "steps=150", "--inject", "none"))
    assert _card_row(run, "skip-rate alert episodes") == "| skip-rate alert episodes | 1 |"
    assert "alert episodes 1," in _report_line(run)
    assert compare.load_run(run).monitor.alert_episodes == 1


def test_an_fp16_run_that_never_applied_a_step_is_judged_at_a_rate_of_1_on_its_card(tmp_path):
    code, _, _ = train(tmp_path, "run", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=6",
                       "--set", "log.plot=false", "--inject", "inf_grad@every:1", "--fail-skip-rate", "0.5")
    run = tmp_path / "run"
    assert code == 3
    assert _card_row(run, "max rolling skip rate") == "| max rolling skip rate | 1.0000 |"
    assert "as the guard judged it" not in _report_line(run)
