"""What the run's summary says of the skip rate, the final loss and the scale's opening: the
numbers the run card, ``report`` and ``compare`` print (ampguard.monitor.RunMonitor)."""

from __future__ import annotations

import math

from ampguard.monitor import RunMonitor
from ampguard.records import SkipLog, StepLog


def applied(step: int, loss: float, scale: float = 1.0) -> StepLog:
    return StepLog(step, lr=0.1, loss=loss, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5, scaler_scale=scale)


def skipped(step: int, reason: str, scale: float = 1.0, loss: float = math.nan) -> SkipLog:
    return SkipLog(step, lr=0.1, loss=loss, grad_l2_pre_clip=None if reason == "non_finite_loss" else math.inf,
                   grad_l2_post_clip=None, scaler_scale=scale, reason=reason)


def test_the_max_rolling_skip_rate_is_the_rolling_one_and_says_when_the_guard_judged_less():
    # 8 of 8 steps skipped in the fp16 scaler's opening search: the card said 0.0000 next to
    # STATS skip_rate=1.000; it says both now, and which the guard acted on
    m = RunMonitor(window=100, init_scale=2.0**16)
    for step in range(1, 9):
        m.observe(skipped(step, "non_finite_grad", scale=2.0 ** (16 - step)))
    assert m.skip_rate == 1.0 and m.max_rolling_skip_rate == 1.0 and m.max_skip_rate == 0.0
    assert m.max_skip_rate_text.startswith("1.0000 (0.0000 as the guard judged it")
    again = RunMonitor(window=100, init_scale=2.0**16)
    again.load_state_dict(m.state_dict())
    assert again.max_rolling_skip_rate == 1.0
    older = {k: v for k, v in m.state_dict().items() if k != "max_rolling_skip_rate"}
    again.load_state_dict(older)  # saved before it was kept: the judged maximum stands in
    assert again.max_rolling_skip_rate == 0.0


def test_the_final_loss_is_the_last_applied_steps_and_names_its_step_after_a_skip():
    m = RunMonitor(window=10, scaler_enabled=False)
    m.observe(applied(1, 2.0))
    m.observe(applied(2, 1.5))
    assert m.summary().endswith("final_loss=1.5")
    m.observe(skipped(3, "non_finite_loss"))  # the model is as step 2 left it
    assert m.summary().endswith("final_loss=1.5 (step 2)") and m.final_loss_and_step == (1.5, 2)
    m.observe(skipped(4, "non_finite_grad", loss=8e15))  # a spike, skipped: not the model's loss either
    assert m.final_loss_and_step == (1.5, 2)
    nothing = RunMonitor(window=10, scaler_enabled=False)
    nothing.observe(skipped(1, "non_finite_loss"))
    assert nothing.final_loss_and_step == (None, None) and "final_loss" not in nothing.summary()


def test_an_opening_of_nan_losses_is_no_warm_up_of_the_scale():
    # the card read "warming (final scale 8192)", normal for an fp16 start, for a run whose
    # every loss was NaN; the monitor itself says a non-finite loss is no search
    m = RunMonitor(window=100, init_scale=2.0**16)
    for step in range(1, 4):
        m.observe(skipped(step, "non_finite_loss", scale=2.0 ** (16 - step)))
    # 2**16 -> 2**13, three octaves down and not one step applied: collapsing, not warming
    assert m.scale_verdict == "collapsing"
    assert m.health.opening == 0  # a NaN loss is no search of the scaler: no opening streak
    assert "scale=collapsing" in m.stats_line()
    search = RunMonitor(window=100, init_scale=2.0**16)
    for step in range(1, 4):
        search.observe(skipped(step, "non_finite_grad", scale=2.0 ** (16 - step)))
    assert search.scale_verdict == "warming"
    assert search.health.opening == 3  # the same skips as overflows are the scaler's opening search
    assert "scale=warming" in search.stats_line()
