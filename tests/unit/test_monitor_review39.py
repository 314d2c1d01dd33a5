"""review_39d: the run monitor fed step records directly (no training).

F1: a resume that changes ``fail_rate`` and raises ``fail_after`` counts every step judged since the
window started (the judged rates are kept as runs, not the last ``fail_after`` of them).
F2: the end of a run shorter than ``fail_after`` judges every step, a rollback's fresh window or not.
F3: a state saved before the monitor kept its ``fail_rate`` is not counted under a raised one.
F4: the run card says a ``fail_rate`` of 1 never trips.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ampguard import checkpointer as ck
from ampguard.config import MonitorConfig
from ampguard.monitor import FAIL_SKIP_RATE, RunMonitor
from ampguard.records import SkipLog, StepLog
from ampguard.report import _fail_fast_text


def applied(step: int, scale: float = 1.0) -> StepLog:
    return StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5, scaler_scale=scale)


def nan_loss(step: int, scale: float = 1.0) -> SkipLog:
    return SkipLog(step=step, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
                   scaler_scale=scale, reason="non_finite_loss")


def feed(m: RunMonitor, records: list) -> list[tuple[int, str]]:
    return [(e.step, e.kind) for r in records for e in m.observe(r)]


def bf16(**kwargs) -> RunMonitor:
    return RunMonitor(scaler_enabled=False, **kwargs)


def round_trip(m: RunMonitor) -> dict:
    return json.loads(json.dumps(m.state_dict()))


# ---------------------------------------------------------------------------- F1


def test_a_resume_that_changes_fail_rate_and_raises_fail_after_counts_every_step():
    # review_39d F1 (e2e t5): 4 NaN steps under fail_after 2 with fail-fast off kept 2 judged rates; resumed
    # with --fail-skip-rate 0.5 --fail-after 6 the recount saw 2 of the 4 steps, and step 5 ended exit 0
    first = bf16(window=4, fail_rate=None, fail_after=2)
    feed(first, [nan_loss(s) for s in range(1, 5)])
    resumed = bf16(window=4, fail_rate=0.5, fail_after=6)
    resumed.load_state_dict(round_trip(first))
    assert resumed.above_fail == 4
    feed(resumed, [nan_loss(5)])
    # (the window of 4 armed the ALERT once full: paged by the rolling rule, at_end fails)
    assert resumed.alert_episodes == 1 and [e.kind for e in resumed.at_end(5)] == ["fail"]
    fresh = bf16(window=4, fail_rate=0.5, fail_after=6)
    feed(fresh, [nan_loss(s) for s in range(1, 6)])
    assert fresh.alert_episodes == 1 and [e.kind for e in fresh.at_end(5)] == ["fail"]
    assert resumed.failed.message == fresh.failed.message
    # and with more steps the resumed run fails at the step the uninterrupted one does
    resumed = bf16(window=4, fail_rate=0.5, fail_after=6)
    resumed.load_state_dict(round_trip(first))
    assert feed(resumed, [nan_loss(s) for s in range(5, 9)])[-1] == (6, "fail")


def test_the_judged_rates_kept_are_exact_for_any_threshold_and_few():
    # the runs answer "steps in a row above t" as the rates one a step would, whatever t
    rng = random.Random(39)
    m = RunMonitor()
    rates: list[float] = []
    for _ in range(3000):
        rate = rng.choice([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, 1.0, rng.random()])
        m._push_rate(rate)
        rates.append(rate)
        threshold = rng.choice([0.0, 0.1, 0.3, 0.5, 0.6, 0.99, 1.0, rng.random()])
        streak = 0
        for r in reversed(rates):
            if not r > threshold:
                break
            streak += 1
        assert m._steps_above(threshold) == streak
    # a long run of a rolling window: never more runs than the window's rates (k / window), one after a 0
    m = bf16(window=50, fail_rate=0.5, fail_after=10**6)
    most = 0
    for s in range(1, 2001):
        m.observe(nan_loss(s) if (s % 7) in (1, 3) or s % 97 == 0 else applied(s))
        most = max(most, len(m._runs))
    assert most <= 51 and m._steps_above(-1.0) == 2000
    feed(m, [applied(s) for s in range(2001, 2052)])  # the window empties of its skips: a rate of 0
    assert m._runs == [(0.0, 2051)] and m.state_dict()["judged_runs"] == [[0.0, 2051]]


def test_an_older_state_of_a_run_that_skipped_every_step_is_recounted_whole():
    # a state saved with judged_rates (the last fail_after of them: 2 of 4), resumed with another rate and a
    # raised fail_after: every step skipped, so every step's rate is known (1.0): the run fails as the
    # uninterrupted one does, not fail_after steps later
    first = bf16(window=4, fail_rate=None, fail_after=2)
    feed(first, [nan_loss(s) for s in range(1, 5)])
    older = round_trip(first)
    older.pop("judged_runs", None), older.pop("min_judged_rate", None)
    older["judged_rates"] = [1.0, 1.0]
    resumed = bf16(window=4, fail_rate=0.5, fail_after=6)
    resumed.load_state_dict(older)
    assert resumed.above_fail == 4 and resumed.min_judged_rate == 1.0
    feed(resumed, [nan_loss(5)])
    assert [e.kind for e in resumed.at_end(5)] == ["fail"]  # (paged already: the window of 4 is full)


def test_the_saved_judged_runs_are_checked_like_every_field():
    m = bf16(window=10, fail_rate=0.5)
    feed(m, [nan_loss(1), applied(2), nan_loss(3)])
    state = m.state_dict()
    assert state["judged_runs"] == [[0.5, 2], [2 / 3, 1]] and "judged_rates" not in state
    for bad in ("x", [[0.5]], [[1.5, 1]], [[0.5, 0]], [[0.5, True]], [[0.6, 1], [0.5, 1]], [[0.5, 2], [0.6, 2]]):
        with pytest.raises(ValueError, match="judged_runs is"):
            m.check_state({**state, "judged_runs": bad})
    for bad in (-0.5, 1.5, "x", None):
        with pytest.raises(ValueError, match="min_judged_rate is"):
            m.check_state({**state, "min_judged_rate": bad})


# ---------------------------------------------------------------------------- F2


def test_a_rollback_does_not_keep_a_short_run_from_failing_at_its_end():
    # review_39d F2: a rollback after step 2, then NaN losses: every step read 1.0, yet at_end compared the
    # count since the rollback (2) with the run's 4 steps, and the run ended exit 0
    m = bf16(window=8, fail_rate=0.5, fail_after=10)
    feed(m, [nan_loss(1), nan_loss(2)])
    m.rolled_back(0, None)
    feed(m, [nan_loss(3), nan_loss(4)])
    assert [e.kind for e in m.at_end(4)] == ["skip_rate_alert", "fail"]
    assert m.failed.cause == FAIL_SKIP_RATE and m.failed.message == (
        "skip rate above fail_rate 0.5 at every one of the run's 4 steps (it ended before fail_after 10 consecutive "
        "steps)")
    # the lowest rate is kept by a resume after the rollback, too
    m = bf16(window=8, fail_rate=0.5, fail_after=10)
    feed(m, [nan_loss(1), nan_loss(2)])
    m.restart_windows()
    feed(m, [nan_loss(3)])
    resumed = bf16(window=8, fail_rate=0.5, fail_after=10)
    resumed.load_state_dict(round_trip(m))
    feed(resumed, [nan_loss(4)])
    assert [e.kind for e in resumed.at_end(4)] == ["skip_rate_alert", "fail"]
    # a step at or below fail_rate before the rollback still counts: no failure at the end
    m = bf16(window=8, fail_rate=0.5, fail_after=10)
    feed(m, [nan_loss(1), applied(2)])  # step 2 read 0.5: not above 0.5
    m.restart_windows()
    feed(m, [nan_loss(3), nan_loss(4)])
    assert m.min_judged_rate == 0.5
    assert [e.kind for e in m.at_end(4)] == ["skip_rate_alert"] and m.failed is None


def test_the_opening_search_is_set_aside_from_the_lowest_rate_or_counted_as_one_when_dropped():
    # fp16: 2 overflows (the opening, judged 0), then a NaN loss and a step that applied: the opening is set
    # aside for good and the lowest rate is that of the steps after it
    m = RunMonitor(window=8, fail_rate=0.3, fail_after=10, init_scale=16.0)
    feed(m, [SkipLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                     scaler_scale=16.0 / 2**s, reason="non_finite_grad") for s in (1, 2)])
    assert m.min_judged_rate == 1.0  # (the opening's steps read 0, and are not judged)
    m.restart_windows()  # (a rollback: the opening steps stay set aside)
    feed(m, [nan_loss(3, 2.0), applied(4, 2.0)])
    assert m.min_judged_rate == 0.5 and [e.kind for e in m.at_end(4)] == ["skip_rate_alert", "fail"]
    # an opening that reaches the floor found no scale: its steps count (1.0), the lowest rate does not move
    m = RunMonitor(window=8, fail_rate=0.5, fail_after=10, init_scale=4.0)
    feed(m, [SkipLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                     scaler_scale=max(4.0 / 2**s, 1.0), reason="non_finite_grad") for s in (1, 2, 3)])
    assert m.opening == 0 and m.min_judged_rate == 1.0 and m._runs == [(1.0, 3)]


@pytest.mark.parametrize(("state_of", "lowest"), [
    ("rates of every step", 0.5),  # judged_rates of every step: their lowest
    ("above_fail of every step", 0.4000000000000001),  # above 0.4 at every step: the lowest number above it
    ("a rollback's rates", 0.0),  # judged_rates that are not every step's: not known, so none above a rate
    ("every step skipped", 1.0),  # every rate was 1.0 (no opening)
])
def test_an_older_states_lowest_rate_can_only_be_too_low(state_of, lowest):
    m = bf16(window=8, fail_rate=0.4, fail_after=10)
    skipped = state_of == "every step skipped"
    feed(m, [nan_loss(1), nan_loss(2) if skipped else applied(2)])  # (rates 1.0 and 0.5, or 1.0 and 1.0)
    if state_of == "a rollback's rates":
        m.restart_windows()
    feed(m, [nan_loss(3)])  # (2/3, or 1.0 in a window a rollback restarted)
    older = round_trip(m)
    older.pop("judged_runs", None), older.pop("min_judged_rate", None)
    older["judged_rates"] = {"rates of every step": [1.0, 0.5, 2 / 3], "a rollback's rates": [1.0],
                             "every step skipped": [1.0, 1.0]}.get(state_of)
    if older["judged_rates"] is None:
        del older["judged_rates"]
    resumed = bf16(window=8, fail_rate=0.4, fail_after=10)
    resumed.load_state_dict(older)
    assert resumed.min_judged_rate == lowest


# ---------------------------------------------------------------------------- F3


def test_a_state_saved_without_its_fail_rate_is_not_counted_under_a_raised_one():
    # review_39d F3: a checkpoint from before the recount (no fail_rate, no judged rates) had 9 steps above
    # 0.4, one of them (step 1) above 0.55; resumed with 0.55 the first step above it failed at once:
    # "above fail_rate 0.55 for 10 consecutive steps"
    plan = [nan_loss(s) if s % 2 else applied(s) for s in range(1, 10)] + [nan_loss(10)]
    first = bf16(window=2, fail_rate=0.4, fail_after=10)
    feed(first, plan[:9])
    older = round_trip(first)
    for key in ("fail_rate", "judged_runs", "judged_rates", "min_judged_rate", "opening_settled", "floor_reached"):
        older.pop(key, None)
    assert older["above_fail"] == 9
    resumed = bf16(window=2, fail_rate=0.55, fail_after=10)
    resumed.load_state_dict(older)
    assert feed(resumed, plan[9:]) == [] and resumed.failed is None and resumed.above_fail == 1
    # train --resume gives such a state the checkpoint config's rate: a rate not raised keeps the count
    from ampguard.checkpointer import fail_rate_counted_under
    payload = {ck.CONFIG: {"monitor": {"fail_rate": 0.4}}, ck.STATE: {"monitors": {"run": dict(older)}}}
    fail_rate_counted_under(ck.Resume(ck.Loaded(Path("step-00000009.pt"), payload), Path(".")))
    handed = payload[ck.STATE]["monitors"]["run"]
    assert handed["fail_rate"] == 0.4
    for rate, fails_at in ((0.4, 10), (0.3, 10), (0.55, None)):
        resumed = bf16(window=2, fail_rate=rate, fail_after=10)
        resumed.load_state_dict(handed)
        feed(resumed, plan[9:])
        assert (resumed.failed and resumed.failed.step) == fails_at
    # a state that has its rate, or a config that does not say, is left as it is
    for run, config in (({"fail_rate": 0.5}, {"monitor": {"fail_rate": 0.4}}), ({}, {"monitor": {}}), ({}, {}),
                        ({}, {"monitor": {"fail_rate": "x"}})):
        payload = {ck.CONFIG: config, ck.STATE: {"monitors": {"run": dict(run)}}}
        fail_rate_counted_under(ck.Resume(ck.Loaded(Path("step-00000009.pt"), payload), Path(".")))
        assert payload[ck.STATE]["monitors"]["run"] == run


def test_a_state_saved_without_its_fail_rate_of_a_run_that_skipped_every_step_still_fails():
    # the rate it was counted under is not known, but every step skipped: each step since the window
    # started read 1.0. A rollback after step 2, saved at step 3: the run fails at its end as the
    # uninterrupted one does, and at step 11 when it goes on (review 54k: the window the rollback restarted
    # counts its skips over min(min_steps, window) 4 steps, 1/4, 2/4, 3/4 not above 0.9: 6 steps from step 6,
    # 3 steps later than 1 of 1 did; the end counts what those steps held, 1.0)
    def first_part() -> dict:
        m = bf16(window=4, fail_rate=0.5, fail_after=6)
        feed(m, [nan_loss(1), nan_loss(2)])
        m.restart_windows()
        feed(m, [nan_loss(3)])
        return round_trip(m)

    whole = bf16(window=4, fail_rate=0.9, fail_after=6)
    feed(whole, [nan_loss(1), nan_loss(2)])
    whole.restart_windows()
    assert feed(whole, [nan_loss(s) for s in range(3, 14)])[-1] == (11, "fail")
    older = first_part()
    for key in ("fail_rate", "judged_runs", "judged_rates", "min_judged_rate"):
        older.pop(key, None)
    resumed = bf16(window=4, fail_rate=0.9, fail_after=6)
    resumed.load_state_dict(older)
    feed(resumed, [nan_loss(4), nan_loss(5)])
    assert [e.kind for e in resumed.at_end(5)] == ["fail"]  # (paged already: the window of 4 is full)
    assert (resumed.above_fail, resumed.min_judged_rate) == (0, 1.0)
    resumed = bf16(window=4, fail_rate=0.9, fail_after=6)
    resumed.load_state_dict(older)
    assert feed(resumed, [nan_loss(s) for s in range(4, 14)])[-1] == (11, "fail")


# ---------------------------------------------------------------------------- F4


def test_the_card_says_a_fail_rate_of_1_never_trips():
    # review_39d F4: "skip rate > 1 for 100 consecutive steps -> exit 3": no rate is above 1
    assert _fail_fast_text(MonitorConfig(fail_rate=1.0), 1.0, True, "fp16") == (
        "off (monitor.fail_rate 1: no skip rate is above 1, it never trips)")
    assert _fail_fast_text(MonitorConfig(fail_rate=1.0, fail_after=5, fail_on_scale_collapse=True), 1.0, True,
                           "fp16") == ("off (monitor.fail_rate 1: no skip rate is above 1, it never trips); skipping "
                                       "at the scale floor 1 for 5 steps -> exit 3")
    assert _fail_fast_text(MonitorConfig(fail_rate=0.99, fail_after=5), 1.0, True, "fp16") == (
        "skip rate > 0.99 for 5 consecutive steps -> exit 3")


# ---------------------------------------------------------------------------- review 39f


def _ran(monitor, kinds, start=1):
    from ampguard.records import SkipLog, StepLog
    for step, kind in enumerate(kinds, start=start):
        monitor.observe(StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5,
                                scaler_scale=1.0) if kind == "A" else
                        SkipLog(step=step, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
                                scaler_scale=1.0, reason="non_finite_loss"))
    return monitor


def test_a_state_whose_lowest_judged_rate_is_above_its_highest_is_refused():
    # hand-edited: a clean run given min_judged_rate 1.0 failed at its end, "above fail_rate at every step"
    state = json.loads(json.dumps(_ran(RunMonitor(window=4, fail_rate=0.5, fail_after=50, scaler_enabled=False),
                                       "AAAAAA").state_dict()))
    state["min_judged_rate"] = 1.0
    with pytest.raises(ValueError, match=r"min_judged_rate .*at most max_skip_rate 0"):
        RunMonitor(window=4, fail_rate=0.5, fail_after=50, scaler_enabled=False).load_state_dict(state)


def test_judged_runs_over_more_steps_than_the_window_saw_since_it_started_are_refused():
    # after a rollback the window held 1 step: runs of 8 steps made a streak it never held, and failed
    monitor = _ran(RunMonitor(window=4, fail_rate=0.5, fail_after=3, scaler_enabled=False), "ALALALAL")
    monitor.restart_windows()
    state = json.loads(json.dumps(_ran(monitor, "A", start=9).state_dict()))
    RunMonitor(window=4, fail_rate=0.4, fail_after=3, scaler_enabled=False).load_state_dict(state)  # (as saved: fine)
    state["judged_runs"] = [[0.9, 8]]
    with pytest.raises(ValueError, match=r"judged_runs .*at most skip_window.count 1 steps"):
        RunMonitor(window=4, fail_rate=0.4, fail_after=3, scaler_enabled=False).load_state_dict(state)
