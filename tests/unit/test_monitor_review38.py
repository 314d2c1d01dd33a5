"""review_38e: the run monitor fed step records directly (no training).

F1: an fp16 opening search is provisional until a step applies: a streak of skips from step 1 that
reaches the floor, or a run that ends with no step applied, counts whole (its non-finite losses after
the overflows too), and the end's fail-fast compares with the steps judged (the opening set aside).
F2: a rollback (``restart_windows``) neither disarms the ALERT nor clears it at its first clean step.
F3: a ``fail_rate`` changed on resume (or by a replayed policy change) counts the steps above it again.
F4: a rate of -0 is 0.
F5: the scale alert and the collapse failure say when the step ran above the floor (its back-off
brought the scale there: the floor itself not tried).
"""

from __future__ import annotations

import math

import pytest

from ampguard.config import validate
from ampguard.monitor import FAIL_SKIP_RATE, RunMonitor
from ampguard.records import SkipLog, StepLog


def applied(step: int, scale: float = 1.0) -> StepLog:
    return StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5, scaler_scale=scale)


def overflow(step: int, scale: float = 1.0) -> SkipLog:
    return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                   scaler_scale=scale, reason="non_finite_grad")


def nan_loss(step: int, scale: float = 1.0) -> SkipLog:
    return SkipLog(step=step, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
                   scaler_scale=scale, reason="non_finite_loss")


def fp16_records(plan: str, init_scale: float = 2.0**16, floor: float = 1.0) -> list:
    """One record per character: ``o`` an overflow, ``n`` a non-finite loss (each halves the scale,
    down to the floor), ``a`` an applied step (the scale holds)."""
    scale, records = init_scale, []
    for step, kind in enumerate(plan, start=1):
        if kind == "a":
            records.append(applied(step, scale))
            continue
        scale = max(scale / 2, floor)
        records.append((overflow if kind == "o" else nan_loss)(step, scale))
    return records


def feed(m: RunMonitor, records: list) -> list[tuple[int, str]]:
    return [(e.step, e.kind) for r in records for e in m.observe(r)]


# ---------------------------------------------------------------------------- F1


def test_overflows_then_nan_losses_with_no_step_applied_fail_at_the_end_of_a_short_run():
    # review_38e F1 (e4): 3 overflows, then 17 NaN losses; updates=0 skips=20 ended "finished", exit 0.
    # The scale reaches the floor at step 16 (NaN losses back it off too): no scale found, it counts whole
    m = RunMonitor(fail_rate=0.5, fail_after=100)
    assert feed(m, fp16_records("ooo" + "n" * 17)) == [(16, "scale_alert")]
    events = m.at_end(20)
    assert [e.kind for e in events] == ["skip_rate_alert", "fail"]
    assert m.opening == 0 and m.above_fail == 20  # (dropped at the floor, step 16: caught up from step 1)
    assert m.failed.cause == FAIL_SKIP_RATE and m.failed.step == 20
    assert m.failed.message == ("skip rate above fail_rate 0.5 at every one of the run's 20 steps (it ended before "
                                "fail_after 100 consecutive steps)")


def test_overflows_then_nan_losses_ending_before_the_floor_are_judged_whole_at_the_end():
    # the same, 10 steps: the floor not reached, no step applied: the opening never found a scale
    m = RunMonitor(fail_rate=0.5, fail_after=100)
    assert feed(m, fp16_records("ooo" + "n" * 7)) == []
    assert m.opening == 3  # (still provisional)
    events = m.at_end(10)
    assert [e.kind for e in events] == ["skip_rate_alert", "fail"]
    assert events[0].data["skip_rate"] == 1.0
    assert events[0].message == ("no step applied in the run's 10 steps (non_finite_grad=3, non_finite_loss=7): its "
                                 "opening 3 gradient overflows found no scale that applied a step, and are counted "
                                 "with the rest")
    assert m.failed.message.endswith("a skip rate of 1 above fail_rate 0.5")


def test_a_streak_of_skips_from_step_1_that_reaches_the_floor_counts_whole_nan_losses_between_or_not():
    # README: "A run that skips every step fails at step N, fp16 overflows too, but not before its
    # scale reaches the floor". 3 overflows, then NaN losses: floor at step 16, fail_after 20 -> step 20
    # (before: the overflows stayed set aside for good, and it failed at step 23)
    m = RunMonitor(fail_rate=0.5, fail_after=20)
    events = feed(m, fp16_records("ooo" + "n" * 37))
    assert [step for step, kind in events if kind == "fail"] == [20]
    # and one that is all overflows fails at the same step
    m = RunMonitor(fail_rate=0.5, fail_after=20)
    assert [step for step, kind in feed(m, fp16_records("o" * 40)) if kind == "fail"] == [20]


def test_the_nan_losses_after_an_opening_count_as_they_come():
    # the overflows stay set aside while a step may still apply; the NaN losses after them count:
    # 5 of them in a row are 5 consecutive steps above fail_rate (e3: step 8, well before the floor)
    m = RunMonitor(fail_rate=0.5, fail_after=5)
    assert [step for step, kind in feed(m, fp16_records("ooo" + "n" * 17)) if kind == "fail"] == [8]


def test_a_settled_opening_is_set_aside_at_the_end_and_the_steps_after_it_are_judged():
    # review_38e F1 cause 1: at_end compared above_fail with every observed step, though the opening's
    # steps read 0 (set aside) and reset it. 3 overflows, 2 NaN losses, one applied step (2 skips of the
    # 3 steps after the opening: 0.67), then NaN losses: above 0.5 at every one of the 27 judged steps
    m = RunMonitor(fail_rate=0.5, fail_after=100, min_scale=2.0**-30)
    assert feed(m, fp16_records("ooonna" + "n" * 24, floor=2.0**-30)) == []
    assert m.above_fail == 27 and m.opening == 3
    assert [e.kind for e in m.at_end(30)] == ["skip_rate_alert", "fail"]
    assert m.opening_settled
    assert m.failed.message == ("skip rate above fail_rate 0.5 at every one of the run's 27 steps after the fp16 "
                                "scaler's opening 3 skips (it ended before fail_after 100 consecutive steps)")


def test_an_opening_a_nan_loss_ends_is_still_set_aside_once_a_step_applies():
    # a healthy fp16 start (9 halvings) and one NaN batch at step 10: the search found its scale at
    # step 11, and its 9 overflows are no failure (fail_after 10); the NaN loss is 1 skip of the 191 other
    # steps
    m = RunMonitor(fail_rate=0.3, fail_after=10)
    assert feed(m, fp16_records("o" * 9 + "n" + "a" * 190)) == []
    assert m.opening == 9 and m.opening_settled and m.failed is None and m.at_end(200) == []
    assert m.judged_skip_rate == max(1 / 191, 10 / 1000)  # (what the full window will read: README)


def old_state(m: RunMonitor) -> dict:
    """``m``'s state as the code before review 38e saved it (no opening_settled, fail_rate,
    judged rates, floor_reached, or the lowest judged rate of review 39d)."""
    state = m.state_dict()
    for key in ("opening_settled", "fail_rate", "judged_runs", "min_judged_rate", "floor_reached"):
        del state[key]
    return state


@pytest.mark.parametrize("plan, settled", [("ooon", False), ("ooan", True), ("oooo", False)])
def test_an_old_state_is_settled_only_when_a_step_applied(plan, settled):
    # review 38h #1: an older state's opening that had ended at a NaN loss with no step applied loaded as
    # settled (opening_settled = not in_opening), so a run that then skipped every step was never failed
    m = RunMonitor(fail_rate=0.5, fail_after=100)
    feed(m, fp16_records(plan))
    restored = RunMonitor(fail_rate=0.5, fail_after=100)
    restored.load_state_dict(old_state(m))
    assert restored.opening_settled is settled


def test_an_old_states_opening_dropped_at_the_floor_fails_as_the_uninterrupted_run():
    # review 38h #1 and #2: 2 overflows and a NaN saved by the older code, then every step skipped: the
    # uninterrupted run fails at step 10; resumed from the old state it did not (settled), and its
    # catch-up at the floor counted only the rates kept (none in an old state)
    plan = fp16_records("oon" + "o" * 7, init_scale=2.0**8)
    whole = RunMonitor(fail_rate=0.5, fail_after=10)
    assert ("fail" in [kind for _, kind in feed(whole, plan)]) and whole.failed.step == 10
    first = RunMonitor(fail_rate=0.5, fail_after=10)
    feed(first, plan[:3])
    resumed = RunMonitor(fail_rate=0.5, fail_after=10)
    resumed.load_state_dict(old_state(first))
    feed(resumed, plan[3:])
    assert resumed.failed is not None and resumed.failed.step == 10


def test_a_fail_after_raised_on_resume_catches_up_every_step_at_the_floor():
    # review 38h #2: saved under fail_after 2 (2 rates kept), resumed with 8: the drop at the floor caught up 2
    plan = fp16_records("o" * 10, init_scale=2.0**6)
    whole = RunMonitor(fail_rate=0.5, fail_after=8)
    feed(whole, plan)
    first = RunMonitor(fail_rate=0.5, fail_after=2)
    feed(first, plan[:4])
    resumed = RunMonitor(fail_rate=0.5, fail_after=8)
    resumed.load_state_dict(first.state_dict())
    feed(resumed, plan[4:])
    assert whole.failed is not None and resumed.failed is not None and resumed.failed.step == whole.failed.step


def test_the_collapse_fails_words_survive_a_resume():
    # review 38h #3: the streak's first step (its back-off reached the floor) was not saved: a resumed
    # run's FAIL lost "(the first of them, step 3, ran at 2: ...)"
    def monitor():
        return RunMonitor(fail_after=4, fail_on_scale_collapse=True, scaler_enabled=True, min_scale=1.0)

    plan = fp16_records("aa" + "o" * 8, init_scale=4.0)
    whole = monitor()
    feed(whole, plan)
    first = monitor()
    feed(first, plan[:4])
    resumed = monitor()
    resumed.load_state_dict(first.state_dict())
    feed(resumed, plan[4:])
    assert whole.failed is not None and "(the first of them, step " in whole.failed.message
    assert resumed.failed is not None and resumed.failed.message == whole.failed.message
    with pytest.raises(ValueError, match=r"floor_reached"):
        monitor().check_state({**first.state_dict(), "floor_reached": [3, -1.0]})


def test_negative_zero_rates_given_to_the_monitor_read_as_zero():
    # review 38h #7: the config path normalised -0.0; RunMonitor's own did not ("> alert_rate -0")
    m = RunMonitor(clear_rate=-0.0, alert_rate=-0.0)
    m.alert_rate = -0.0
    assert f"{m.alert_rate:g} {m.clear_rate:g}" == "0 0"


# ---------------------------------------------------------------------------- F2


def alternate(first: int, last: int) -> list:
    """Steps first..last, the even ones NaN losses (a skip rate of 0.5)."""
    return [nan_loss(s) if s % 2 == 0 else applied(s) for s in range(first, last + 1)]


def test_a_rollback_does_not_keep_the_alert_silent_to_the_end():
    # review_38e F2 (q3): a rollback at step 60, then every other step skipped to step 130: the fresh
    # window waited min_steps (100) steps to arm, past the run's end, and the run ended in silence
    m = RunMonitor(scaler_enabled=False)
    feed(m, [applied(s) for s in range(1, 61)])
    m.restart_windows()
    events = feed(m, alternate(61, 130))
    assert events == [(100, "skip_rate_alert")]  # armed at step 100, as a run without the rollback
    assert m.alert_episodes == 1 and m.at_end(130) == []
    # (the rollback's young window: its 20 skips over the 100 steps it reads once it holds them)
    fresh = RunMonitor(scaler_enabled=False)
    assert feed(fresh, [applied(s) for s in range(1, 61)] + alternate(61, 130)) == [(100, "skip_rate_alert")]


def test_an_alert_up_at_a_rollback_is_not_cleared_by_the_first_clean_step():
    # review_38e F2: 0 skips in the 1 step since the rollback read 0.0: CLEAR, and the next skip (1 of 2)
    # paged again. It stays up until the new window holds min_steps steps, then clears if it reads low
    m = RunMonitor(window=100, alert_rate=0.05, min_steps=20, scaler_enabled=False)
    assert feed(m, alternate(1, 40)) == [(20, "skip_rate_alert")]
    m.restart_windows()
    events = feed(m, [applied(s) for s in range(41, 80)])
    assert events == [(60, "skip_rate_clear")]  # the 20th step of the new window
    assert m.alert_episodes == 1


def test_one_skip_just_after_a_late_rollback_is_no_alert():
    # the young window's k/n (1 of 2 steps) is what min_steps keeps from paging: counted over min_steps
    m = RunMonitor(scaler_enabled=False)
    feed(m, [applied(s) for s in range(1, 501)])
    m.restart_windows()
    assert feed(m, [applied(501), nan_loss(502)] + [applied(s) for s in range(503, 700)]) == []
    # while a window surely above alert_rate pages as soon as it is sure: 6 skips of 100 = 0.06
    m.restart_windows()
    assert feed(m, [nan_loss(s) for s in range(700, 706)]) == [(705, "skip_rate_alert")]


# ---------------------------------------------------------------------------- F3


P1 = {1, 2, 3, 4, 5, 10}  # the review's run: window 10, NaN losses at steps 1-5 and 10


def p1(first: int, last: int) -> list:
    return [nan_loss(s) if s in P1 else applied(s) for s in range(first, last + 1)]


def test_a_raised_fail_rate_on_resume_counts_the_steps_above_it_again():
    # review_38e F3: stopped at step 10 under fail_rate 0.5 (10 steps above 0.5, step 9 at 5/9 = 0.556);
    # resumed from step 9 with 0.58, it still failed at step 10 ("above 0.58 for 10 consecutive steps")
    run = RunMonitor(window=10, fail_rate=0.5, fail_after=10, scaler_enabled=False)
    feed(run, p1(1, 9))
    saved = run.state_dict()
    resumed = RunMonitor(window=10, fail_rate=0.58, fail_after=10, scaler_enabled=False)
    resumed.load_state_dict(saved)
    assert resumed.above_fail == 0  # step 9's 0.556 is not above 0.58
    # (no fail: the window of 10, full at step 10, pages and clears: armed at min(min_steps, window))
    assert "fail" not in [kind for _, kind in feed(resumed, p1(10, 30))] and resumed.failed is None
    # as a run with 0.58 from its start
    fresh = RunMonitor(window=10, fail_rate=0.58, fail_after=10, scaler_enabled=False)
    feed(fresh, p1(1, 30))
    assert fresh.failed is None and fresh.above_fail == resumed.above_fail


@pytest.mark.parametrize(("old", "new"), [(0.9, 0.5), (None, 0.5), (0.5, 0.7)])
def test_a_fail_rate_changed_on_resume_judges_as_a_run_with_it_from_the_start(old, new):
    plan = [nan_loss(s) if s % 3 else applied(s) for s in range(1, 60)]  # rates about 2/3
    run = RunMonitor(window=20, fail_rate=old, fail_after=8, scaler_enabled=False)
    feed(run, plan[:6])
    resumed = RunMonitor(window=20, fail_rate=new, fail_after=8, scaler_enabled=False)
    resumed.load_state_dict(run.state_dict())
    fresh = RunMonitor(window=20, fail_rate=new, fail_after=8, scaler_enabled=False)
    feed(fresh, plan[:6])
    assert resumed.above_fail == fresh.above_fail
    assert feed(resumed, plan[6:]) == [e for e in feed(fresh, plan[6:])]


def test_a_replayed_fail_rate_change_recounts_as_the_resume_did():
    # report's replay sets the attribute at the step a resume changed it (REPLAYED_POLICY)
    m = RunMonitor(window=10, fail_rate=0.5, fail_after=10, scaler_enabled=False)
    feed(m, p1(1, 9))
    m.fail_rate = 0.58
    assert m.above_fail == 0 and "fail" not in [kind for _, kind in feed(m, p1(10, 30))] and m.failed is None


def test_the_saved_judged_rates_are_checked_like_every_field():
    m = RunMonitor(window=10, fail_rate=0.5, scaler_enabled=False)
    feed(m, p1(1, 3))
    for bad, words in ((["x"], "judged_rates is"), ([0.5] * 4, "judged_rates is"), (2.0, "judged_rates is")):
        with pytest.raises(ValueError, match=words):
            m.check_state({**m.state_dict(), "judged_rates": bad})
    with pytest.raises(ValueError, match="fail_rate is"):
        m.check_state({**m.state_dict(), "fail_rate": -1})


# ---------------------------------------------------------------------------- F4


def test_a_rate_of_minus_zero_is_zero():
    # review_38e F4: --fail-skip-rate -0 was kept as -0.0, and the run card said "skip rate > -0"
    config = validate({"monitor": {"fail_rate": -0.0, "alert_rate": -0.0, "clear_rate": -0.0}})
    assert [math.copysign(1.0, v) for v in (config.monitor.fail_rate, config.monitor.alert_rate,
                                            config.monitor.clear_rate)] == [1.0, 1.0, 1.0]
    m = RunMonitor(fail_rate=-0.0, alert_rate=-0.0)
    assert f"{m.fail_rate:g} {m.alert_rate:g}" == "0 0"


# ---------------------------------------------------------------------------- F5


def test_the_step_whose_back_off_reached_the_floor_is_alerted_in_its_own_words():
    # review_38e F5: a step that ran at 2 and backed off to the floor 1 was alerted "is at its floor and
    # the step still overflowed: fp16 cannot hold these gradients": the floor had not been tried
    m = RunMonitor(init_scale=4.0, min_scale=1.0, fail_on_scale_collapse=True, fail_after=2)
    events = [e for r in fp16_records("oooo", init_scale=4.0) for e in m.observe(r)]
    assert [(e.step, e.kind) for e in events] == [(2, "scale_alert"), (3, "fail")]
    assert events[0].message == ("loss scale 1 fell to its floor scaler.min_scale 1: the step overflowed at 2, and "
                                 "its back-off brought the scale there: the floor itself is not tried yet")
    assert events[1].message == ("loss scale at its floor scaler.min_scale 1 with every step skipped for 2 "
                                 "consecutive steps (the first of them, step 2, ran at 2: its back-off brought the "
                                 "scale to the floor)")
    # a step that ran at the floor keeps the words it had
    m = RunMonitor(init_scale=1.0, min_scale=1.0)
    assert [e.message for e in m.observe(overflow(1))] == [
        "loss scale 1 is at its floor scaler.min_scale 1 and the step still overflowed: fp16 cannot hold these gradients"]


# ---------------------------------------------------------------------------- review_51i F3


@pytest.mark.parametrize("floor, fails", [(2.0**5, False), (2.0**4, False), (2.0**6, True)])
def test_an_opening_search_that_lands_on_the_floor_and_applies_there_is_set_aside(floor, fails):
    # eleven overflows from 2**16 bring the scale to 2**5, where every later step applies. With the
    # floor at 2**5 the back-off to it counted the opening as failures (the floor not tried yet):
    # ALERT and FAIL at step 100, exit 3, for the run that was the same step by step at 2**4.
    # A floor of 2**6 is reached one step earlier and its step at the floor skips: that counts
    m = RunMonitor(fail_rate=0.1, fail_after=100, min_scale=floor, init_scale=2.0**16)
    kinds = []
    for s in range(1, 201):
        scale = max(2.0 ** (16 - s), floor)
        record = overflow(s, scale) if s <= 11 else applied(s, scale)
        kinds += [e.kind for e in m.observe(record)]
        if m.failed:
            break
    assert ("fail" in kinds) is fails, kinds
    if not fails:
        assert m.judged_skip_rate == 0.0 and "skip_rate_alert" not in kinds
