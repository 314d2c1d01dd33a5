"""Review 54k in a whole run (the linear task, fp32, in-process; the plot skipped): one skip right after
a spike's rollback read 1/1, 1/2, 1/3 to the fail-fast (fail_rate 0.3, fail_after 3), which stopped a
healthy run (exit 3), and the card, ``report`` and ``compare`` said "max rolling skip rate 1.0000";
the ALERT counted it over min_steps, 1/10. The same skip without the rollback: exit 0, 0.0500."""

from __future__ import annotations

from helpers import ag, read_events, train

SETTINGS = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "steps=40", "--set", "log.every=1",
            "--set", "eval.enabled=false", "--set", "checkpoint.every=10", "--set", "monitor.window=20",
            "--set", "monitor.min_steps=10", "--fail-skip-rate", "0.3", "--fail-after", "3", "--inject", "inf_grad@26"]


def card_row(run_dir, name: str) -> str:
    for line in (run_dir / "RUN.md").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| {name} |"):
            return line.split(" | ", 1)[1].rsplit(" |", 1)[0]
    raise AssertionError(f"no {name} row")


def test_one_skip_after_a_rollback_stops_nothing_and_the_card_says_one_over_min_steps(tmp_path):
    code, out, err = train(tmp_path, "rb", *SETTINGS, "--set", "rollback.triggers=[loss_spike]",
                           "--set", "rollback.window=5", "--inject", "spike@25")
    assert code == 0, out + err
    assert "FAIL" not in out and "ended: finished: 40 steps" in out, out
    run = tmp_path / "rb"
    events = read_events(run / "events.jsonl", strict=False)
    assert [e["step"] for e in events if e["event"] == "rollback"] == [25]
    assert "STATS 26 skip_rate=0.100 " in out and "STATS 27 skip_rate=0.100 " in out, out
    assert card_row(run, "max rolling skip rate") == "0.1000"
    code, rep, err = ag("report", run, "--no-plot")  # (the replay judges as the run did)
    assert code == 0 and "max rolling skip rate 0.1000 (window 20)" in rep, rep + err
    code, out, err = train(tmp_path, "ctl", *SETTINGS)  # (the control: no rollback, the window of 20)
    assert code == 0 and card_row(tmp_path / "ctl", "max rolling skip rate") == "0.0500", out + err
    code, cmp, err = ag("compare", run, tmp_path / "ctl", "--out", tmp_path / "cmp.png")
    assert code == 0, cmp + err
    row = next(line for line in cmp.splitlines() if "max rolling skip rate" in line)
    assert "0.1000" in row and "0.0500" in row and "1.0000" not in row, row
