"""Review 53l: the end of a run judged after a rollback, and the FAIL lines' counts."""

from __future__ import annotations

from ampguard.monitor import FAIL_SCALE_COLLAPSE, FAIL_SKIP_RATE, RunMonitor
from ampguard.records import SkipLog, StepLog


def _skip(step: int) -> SkipLog:
    return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                   scaler_scale=1.0, reason="non_finite_grad")


def _applied(step: int) -> StepLog:
    return StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


def _run(records, rollback_after: int | None, steps: int, skip_guard: bool = True,
         resumed_at: int | None = None) -> RunMonitor:
    m = RunMonitor(window=10, fail_rate=0.5, fail_after=3, scaler_enabled=False)
    for step, record in enumerate(records, 1):
        m.observe(record(step))
        if step == rollback_after:  # (the trainer's rollback: the windows restart)
            m.failed = None
            m.rolled_back(0, None, skip_guard=skip_guard)
        if step == resumed_at:  # (a checkpoint's monitor state, loaded by a resume)
            state, m = m.state_dict(), RunMonitor(window=10, fail_rate=0.5, fail_after=3, scaler_enabled=False)
            m.load_state_dict(state)
    m.at_end(steps)
    return m


def test_a_run_that_ends_skipping_every_step_since_a_rollback_fails_at_its_end():
    # every step skipped: the skip guard rolled back at step 3; steps 4 and 5 skipped too, and the run
    # ended before the count reached fail_after again: "finished", exit 0, nothing applied since
    m = _run([_skip] * 5, rollback_after=3, steps=5)
    assert m.failed is not None and m.failed.cause == FAIL_SKIP_RATE
    # (review 54k: the fail-fast counts the young window's skips over min(min_steps, window) 10 steps, 1/10
    # and 2/10; the end counts what they held, 2 of 2, and says so)
    assert m.failed.message == ("skip rate above fail_rate 0.5 at every one of the 2 steps since the rollback at "
                                "step 3, counted over the steps the window held (the fail-fast counts a fresh "
                                "window's skips over 10 steps until it holds them; the run ended before fail_after 3 "
                                "consecutive steps above it)")


def test_the_skip_guards_rollback_is_remembered_by_a_resume_and_a_spikes_is_not_one():
    m = _run([_skip] * 5, rollback_after=3, steps=5, resumed_at=4)
    assert m.failed is not None and "since the rollback at step 3" in m.failed.message
    # a spike's rollback takes back no failure: two skips at the end of a run are judged as any run's
    assert _run([_skip] * 5, rollback_after=3, steps=5, skip_guard=False).failed is None


def test_a_run_that_applied_a_step_since_its_rollback_ends_as_it_did():
    m = _run([_skip] * 3 + [_applied, _skip], rollback_after=3, steps=5)
    assert m.failed is None  # (step 4 applied: the rate since the rollback fell to 0 there)
    m = _run([_skip, _applied, _skip, _skip], rollback_after=None, steps=4)
    assert m.failed is None  # (no rollback: the rule for a run shorter than fail_after, not met)


def test_fail_lines_count_one_step_as_one():
    m = RunMonitor(window=4, fail_rate=0.5, fail_after=1, scaler_enabled=False)
    m.observe(_skip(1))
    assert m.failed.message.startswith("rolling skip rate above fail_rate 0.5 for 1 consecutive step (")
    m = RunMonitor(window=4, fail_after=1, fail_on_scale_collapse=True, min_scale=1.0)
    m.observe(_skip(1))
    assert m.failed.cause == FAIL_SCALE_COLLAPSE
    assert "with every step skipped for 1 consecutive step" in m.failed.message, m.failed.message


def test_a_skip_guard_rollback_at_the_last_step_fails_the_end():
    # review 53m: the guard tripped at the run's last step and rolled back: exit 0, "finished"
    m = _run([_skip] * 3, rollback_after=3, steps=3)
    assert m.failed is not None and m.failed.cause == FAIL_SKIP_RATE
    assert m.failed.message.startswith("the run ended right after a rollback at its last step, 3, the skip-rate "
                                       "guard's trouble not cleared")
    assert m.failed.data["skip_rate"] == 1.0  # (the run's: the window the rollback emptied said 0.0; review 53o)
    assert _run([_skip] * 3, rollback_after=3, steps=3, skip_guard=False).failed is None  # (a spike's alone)


def _run_rollbacks(records, rollbacks: dict[int, bool], steps: int) -> RunMonitor:
    m = RunMonitor(window=10, fail_rate=0.5, fail_after=3, scaler_enabled=False)
    for step, record in enumerate(records, 1):
        m.observe(record(step))
        if step in rollbacks:
            m.failed = None
            m.rolled_back(0, None, skip_guard=rollbacks[step])
    m.at_end(steps)
    return m


def test_a_spikes_rollback_inside_the_skip_guards_trouble_does_not_clear_it():
    # review 53m: skip guard at 3, two skips, a spike rolled back at 6 (the rate still above fail_rate), a
    # skip: nothing applied since step 3, and the spike's rollback had cleared the flag: exit 0
    m = _run_rollbacks([_skip] * 5 + [_applied, _skip], {3: True, 6: False}, steps=7)
    assert m.failed is not None and "since the rollback at step 6" in m.failed.message, m.failed
    # once a step since the skip guard's rollback judged at or below fail_rate, its trouble is over: a
    # spike's rollback later and a short streak after it end as any run's last steps do
    m = _run_rollbacks([_skip] * 3 + [_applied] * 4 + [_skip] * 2, {3: True, 7: False}, steps=9)
    assert m.failed is None
