"""Review 54k: after a rollback the skip window restarts empty. The ALERT judged its young window as
k skips over ``min(min_steps, window)`` steps, but the fail-fast, the judged rate, the max rolling
rate on the card / report / compare and the STATS line read the raw k of n: one skip right after a
spike's rollback read 1/1, 1/2, 1/3 and, with fail_rate 0.3 and fail_after 3, failed a healthy run
(exit 3), the card saying "max rolling skip rate 1.0000". One rate now, the ALERT's, for every guard."""

from __future__ import annotations

from ampguard.monitor import FAIL_SKIP_RATE, RunMonitor
from ampguard.records import SkipLog, StepLog
from ampguard.report import Row, rolling_skip_rate


def _skip(step: int) -> SkipLog:
    return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                   scaler_scale=1.0, reason="non_finite_grad")


def _applied(step: int) -> StepLog:
    return StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


def _monitor() -> RunMonitor:  # (the reviewer's settings: window 20, min_steps 10, fail 0.3 for 3 steps)
    return RunMonitor(window=20, min_steps=10, fail_rate=0.3, fail_after=3, scaler_enabled=False)


def test_one_skip_after_a_spikes_rollback_is_one_over_min_steps_for_every_guard():
    m = _monitor()
    for s in range(1, 26):
        m.observe(_applied(s))
    m.rolled_back(20, None)  # (a spike at 25, back to step 20)
    events = m.observe(_skip(26))
    assert [e.kind for e in events] == ["skip_rate_alert"] and events[0].data["skip_rate"] == 0.1
    assert m.judged_skip_rate == m.skip_rate == 0.1  # (was 1.0: 1 of 1)
    assert m.stats_line().startswith("STATS 26 skip_rate=0.100 ")
    rates = [0.1]
    for s in range(27, 41):
        m.observe(_applied(s))
        rates.append(m.judged_skip_rate)
        assert m.failed is None, m.failed  # (was FAIL 28: 1/1, 1/2, 1/3 above 0.3)
    # 1/10 while the window holds fewer than 10 steps, then 1 of the steps it holds
    assert rates == [0.1] * 10 + [1 / 11, 1 / 12, 1 / 13, 1 / 14, 1 / 15]
    assert m.at_end(40) == [e for e in () if e] and m.failed is None
    assert (m.max_skip_rate, m.max_rolling_skip_rate, m.max_skip_rate_text) == (0.1, 0.1, "0.1000")
    assert m.above_fail == 0


def test_a_fresh_runs_window_is_still_counted_from_step_1():
    # the documented rule: a run failing from its first step is caught after fail_after steps
    m = _monitor()
    m.observe(_skip(1))
    assert m.skip_rate == 1.0
    m.observe(_applied(2)), m.observe(_applied(3))
    assert m.failed is not None and m.failed.step == 3 and m.max_rolling_skip_rate == 1.0


def _after_skip_guard_rollback(steps: int | None = None) -> tuple[RunMonitor, list[int]]:
    """Every step skipped from step 1; the skip guard's first trip rolled back (as guards.Rollbacks.apply
    does); the steps where it failed (a second trip, or the end's judgement at ``steps``)."""
    m, fails = _monitor(), []
    for s in range(1, 41):
        m.observe(_skip(s))
        if m.failed is not None:
            fails.append(s)
            if len(fails) > 1:
                break
            m.rolled_back(0, None, skip_guard=True)
        if s == steps:
            m.at_end(s)
            fails += [s] if m.failed is not None else []
            break
    return m, fails


def test_a_skip_guard_rollback_then_skips_all_along_still_fails_three_steps_later():
    """Every step skipped: the skip guard trips at 3 (1/1, 2/2, 3/3 above 0.3) and rolls back. Every
    step after it skips: each read 1.0 and the fail-fast tripped again at 6, the 3rd step after the
    rollback; now the young window reads 1/10, 2/10, 3/10 (not above 0.3), then 0.4, 0.5, 0.6: it
    trips at 9, 3 steps later (the young steps not above fail_rate: floor(fail_rate x min(min_steps,
    window)) = 3; with the defaults, min_steps 100 and fail_rate 0.5, 50 steps later)."""
    m, fails = _after_skip_guard_rollback()
    assert fails == [3, 9], fails
    assert m.failed.cause == FAIL_SKIP_RATE and "counting the 6 skips in the 6 steps since" in m.failed.message


def test_a_run_ending_in_the_young_window_after_a_skip_guard_rollback_still_fails_at_its_end():
    """Review 53l's rule: every step since the skip guard's rollback skipped, the run ended before the
    fail-fast counted fail_after steps above fail_rate again: its end fails. The end has no later step to
    wait for: it counts what the young window held (2 of 2), not 1/10 and 2/10 as the fail-fast did;
    and now that the fail-fast waits 3 more steps, a run ending 4 steps after the rollback (fail_after
    3) fails at its end too, where the young count left it at one step above 0.3 (4/10)."""
    m, fails = _after_skip_guard_rollback(steps=5)
    assert fails == [3, 5], fails
    assert m.failed.message == (
        "skip rate above fail_rate 0.3 at every one of the 2 steps since the rollback at step 3, counted over the "
        "steps the window held (the fail-fast counts a fresh window's skips over 10 steps until it holds them; "
        "the run ended before fail_after 3 consecutive steps above it)")
    m, fails = _after_skip_guard_rollback(steps=7)
    assert fails == [3, 7], fails  # (it tripped at 6 on 1/1, 2/2, 3/3)
    assert m.failed.message.startswith("skip rate above fail_rate 0.3 at every one of the 4 steps since the rollback")
    # a step since it at or below fail_rate, as the steps held it, clears the trouble: judged as any run's end
    m = _monitor()
    for s, record in enumerate([_skip] * 3 + [_applied] * 3 + [_skip], 1):
        m.observe(record(s))
        if s == 3:
            m.rolled_back(0, None, skip_guard=True)
    m.at_end(7)
    assert m.failed is None


def test_a_short_run_that_skipped_every_step_still_fails_at_its_end_after_a_spikes_rollback():
    # review 39d's rule (a rollback's fresh window does not narrow the end's judgement): 6 of 6 skipped,
    # fail_after 10; the young count read 1/10 ... 4/10 after the rollback at step 2
    m = RunMonitor(window=20, min_steps=10, fail_rate=0.3, fail_after=10, scaler_enabled=False)
    for s in range(1, 7):
        m.observe(_skip(s))
        if s == 2:
            m.rolled_back(0, None)
    assert m.judged_skip_rate == 0.4 and m.failed is None
    assert [e.kind for e in m.at_end(6)] == ["skip_rate_alert", "fail"] and m.min_judged_rate == 1.0


def test_the_plots_rolling_rate_is_the_monitors():
    rows = [Row(s, 0.1, 2.0, 1.0, 0.5, s == 26, "non_finite_grad" if s == 26 else "", 1.0) for s in range(1, 41)]
    rates = rolling_skip_rate(rows, window=20, rollbacks=[{"step": 25, "updates_undone": 5}], min_steps=10)
    m = _monitor()
    seen = []
    for row in rows:
        m.observe(row.record())
        seen.append(m.skip_rate)
        if row.step == 25:
            m.rolled_back(20, None)
    assert rates == seen and max(rates) == 0.1


def test_an_older_states_rebuilt_rates_set_the_opening_aside_in_a_restarted_window():
    """Review 54p: an older state (no ``judged_runs``) of a run that rolled back during the fp16
    opening search rebuilt its young window's rates as j/min_steps counting the opening's
    overflows (0.4, 0.5, 0.6 where the live monitor judged 0.1, 0.2, 0.3): a resume that lowered
    fail_rate counted steps above it that never were."""
    def overflow(step: int, scale: float) -> SkipLog:
        return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                       scaler_scale=scale, reason="non_finite_grad")

    def nan_loss(step: int, scale: float) -> SkipLog:
        return SkipLog(step=step, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
                       scaler_scale=scale, reason="non_finite_loss")

    settings = dict(window=20, min_steps=10, fail_rate=0.3, fail_after=50, init_scale=2.0**16, min_scale=1.0)
    live, scale = RunMonitor(**settings), 2.0**16
    for step in (1, 2):
        scale /= 2
        live.observe(overflow(step, scale))
    live.rolled_back(0, None)
    for step in (3, 4, 5):
        scale /= 2
        live.observe(overflow(step, scale))
    for step in (6, 7, 8):
        live.observe(nan_loss(step, scale))
    state = live.state_dict()
    del state["judged_runs"], state["min_judged_rate"]
    older = RunMonitor(**settings)
    older.load_state_dict(state)
    assert [rate for rate, _ in older._runs] == [rate for rate, _ in live._runs]
    assert max(rate for rate, _ in live._runs) == live.judged_skip_rate == 3 / 10  # (the three NaN losses)
    assert older._steps_above(0.25) == live._steps_above(0.25) == 1
