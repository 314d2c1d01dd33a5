"""review_38e in whole runs (the linear task, a few steps, in-process; the plot skipped): the
end-of-run fail-fast of an fp16 run that skipped every step, the ALERT after a rollback, a raised
``monitor.fail_rate`` on resume, and the run card's fail-fast row. The monitor's rules themselves,
fed records directly, are in ``tests/unit/test_monitor_review38.py``."""

from __future__ import annotations

from helpers import ag, read_events, train

QUIET = ["--set", "task.name=linear", "--set", "log.every=1000", "--set", "eval.enabled=false"]


def card_row(run_dir, name: str) -> str:
    for line in (run_dir / "RUN.md").read_text(encoding="utf-8").splitlines():
        if line.startswith(f"| {name} |"):
            return line.split(" | ", 1)[1].rsplit(" |", 1)[0]
    raise AssertionError(f"no {name} row")


def test_an_fp16_run_that_skips_every_step_fails_at_its_end(tmp_path):
    # review_38e F1 (e4): 3 overflows then NaN losses, 20 steps, fail_after 100: "finished", exit 0
    nan = ",".join(str(s) for s in range(4, 21))
    code, out, err = train(tmp_path, "e4", *QUIET, "--set", "steps=20", "--set", "precision=fp16",
                           "--inject", "inf_grad@1,2,3", "--inject", f"nan_loss@{nan}",
                           "--set", "monitor.fail_rate=0.5", "--set", "monitor.fail_after=100")
    assert code == 3, out + err
    assert ("ended: stopped by the guard at the end of the run (step 20): skip rate above fail_rate 0.5 at every one "
            "of the run's 20 steps") in out


def test_a_rollback_leaves_the_skip_rate_alert_armed(tmp_path):
    # review_38e F2 (q3, shorter): a loss-spike rollback after step 20, then every other step a NaN loss.
    # The rollback's fresh window waited min_steps (30) steps to arm: past the run's end, in silence
    nan = ",".join(str(s) for s in range(22, 41, 2))
    code, out, err = train(tmp_path, "q", *QUIET, "--set", "precision=fp32", "--set", "steps=40",
                           "--set", "checkpoint.every=10", "--set", "rollback.triggers=[loss_spike]",
                           "--set", "rollback.window=5", "--set", "rollback.skip_batches=1",
                           "--set", "monitor.min_steps=30", "--inject", "spike@20", "--inject", f"nan_loss@{nan}")
    assert code == 0, out + err
    run = tmp_path / "q"
    events = read_events(run / "events.jsonl", strict=False)
    assert [e["step"] for e in events if e["event"] == "rollback"] == [20]
    alerts = [e for e in events if e["event"] == "skip_rate_alert"]
    # armed at step 30 (the run's steps); 5 skips in the 10 steps since the rollback, over min_steps 30
    assert [(e["step"], e["skip_rate"]) for e in alerts] == [(30, 5 / 30)]
    assert card_row(run, "skip-rate alert episodes") == "1"
    code, out, err = ag("report", run, "--no-plot")
    assert code == 0 and "alert episodes 1," in out, out + err  # the replay judges as the run did


def test_a_raised_fail_rate_on_resume_trains_on(tmp_path):
    # review_38e F3 (p1): stopped at step 10 under fail_rate 0.5; resumed from step 9 with 0.58 (step 9 read
    # 5/9 = 0.556), it stopped again at step 10: "above fail_rate 0.58 for 10 consecutive steps"
    common = [*QUIET, "--set", "precision=fp32", "--set", "monitor.window=10", "--set", "monitor.fail_after=10"]
    code, out, err = train(tmp_path, "p1", *common, "--set", "steps=30", "--inject", "nan_loss@1,2,3,4,5,10",
                           "--set", "monitor.fail_rate=0.5", "--set", "checkpoint.every=9")
    assert code == 3 and "stopped by the guard at step 10" in out, out + err
    code, out, err = ag("train", "--resume", tmp_path / "p1" / "checkpoints" / "step-00000009.pt",
                        "--set", "monitor.fail_rate=0.58")
    assert code == 0, out + err
    assert "ended: finished: 30 steps" in out and "FAIL" not in out


def test_the_card_says_what_the_fail_fast_settings_do_not_do(tmp_path):
    # review_38e F4: under fp32 the collapse guard (no loss scaler) and a fail_after with no fail_rate
    # stop nothing; the card promised "skipping at the scale floor 1 for 3 steps -> exit 3"
    short = [*QUIET, "--set", "precision=fp32", "--set", "steps=2"]
    code, out, err = train(tmp_path, "c", *short, "--set", "monitor.fail_on_scale_collapse=true",
                           "--set", "monitor.fail_after=3")
    assert code == 0, out + err
    assert card_row(tmp_path / "c", "fail-fast") == (
        "off (monitor.fail_rate not set; monitor.fail_after 3 unused); scale collapse: n/a (fp32 runs no loss "
        "scaler: monitor.fail_on_scale_collapse stops nothing)")
    # and --fail-skip-rate -0 is a rate of 0 ("skip rate > -0")
    code, out, err = train(tmp_path, "z", *short, "--fail-skip-rate", "-0", "--fail-after", "5")
    assert code == 0, out + err
    assert card_row(tmp_path / "z", "fail-fast") == "skip rate > 0 for 5 consecutive steps -> exit 3"
