"""Run health (issue 3): rolling skip rate, alerts, fail-fast, scale health, and the sinks that
carry them (events.jsonl, steps.jsonl, TensorBoard).

These unit tests feed the monitors synthetic records; ``tests/e2e/test_monitor_runs.py`` trains
the linear task for a few steps and reads the guard rails back from the run. Every expected number
is computed here from the fault schedule (``parse_fault(...).hits``) and the window arithmetic.
"""

from __future__ import annotations

import copy
import json
import math
import re
import sys

import pytest
import torch

from helpers import HAS_TENSORBOARD, reference_episodes, reference_fail_step, reference_rates, strict_json

from ampguard.config import MonitorConfig
from ampguard.errors import InputError
from ampguard.faults import parse_fault
from ampguard.monitor import (
    DEFAULT_MIN_STEPS, FAIL_CAUSES, FAIL_SCALE_COLLAPSE, FAIL_SKIP_RATE, HEALTH_VERDICTS, COLLAPSE_STREAK, Event,
    LossSpikeDetector, RollingWindow, RunMonitor, ScaleHealth,
)
from ampguard.records import SkipLog, StepLog
from ampguard.sinks import JsonlSink, TensorBoardSink

# ---------------------------------------------------------------------------- helpers


def step_record(step: int, *, loss: float = 1.0, pre: float = 0.5, post: float | None = None,
                scale: float = 1.0, lr: float = 0.1) -> StepLog:
    return StepLog(step=step, lr=lr, loss=loss, grad_l2_pre_clip=pre,
                   grad_l2_post_clip=pre if post is None else post, scaler_scale=scale)


def skip_record(step: int, reason: str = "non_finite_grad", *, loss: float = 1.0, scale: float = 1.0,
                loss_on: str | None = None) -> SkipLog:
    pre = float("inf") if reason == "non_finite_grad" else None
    loss = float("nan") if reason == "non_finite_loss" else loss
    return SkipLog(step=step, lr=0.1, loss=loss, grad_l2_pre_clip=pre, grad_l2_post_clip=None,
                   scaler_scale=scale, reason=reason, loss_on=loss_on)


def records_for(skipped: list[bool]) -> list:
    return [skip_record(i) if s else step_record(i) for i, s in enumerate(skipped, start=1)]


# ---------------------------------------------------------------------------- RollingWindow


def test_rolling_window_edges_against_brute_force():
    seq = [1, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1]
    size = 4
    w = RollingWindow(size)
    assert (w.total, w.mean, w.seen_mean, w.count) == (0.0, 0.0, 0.0, 0)
    for n, v in enumerate(seq, start=1):
        w.push(v)
        held = seq[max(0, n - size): n]
        assert w.count == n
        assert w.total == sum(held)
        assert w.mean == sum(held) / size  # steps before the first count as zeros
        assert w.seen_mean == sum(held) / len(held)


def test_rolling_window_before_filled_exactly_filled_and_after_wrap():
    w = RollingWindow(4)
    w.push(1)
    assert (w.mean, w.seen_mean) == (0.25, 1.0)  # one early skip is not a 100% rate
    w.push(0)
    assert (w.mean, w.seen_mean) == (0.25, 0.5)
    w.push(1)
    w.push(1)  # exactly filled: [1, 0, 1, 1]
    assert (w.total, w.mean, w.seen_mean) == (3.0, 0.75, 0.75)
    w.push(0)  # wraps: the first 1 leaves -> [0, 1, 1, 0]
    assert (w.total, w.mean, w.seen_mean) == (2.0, 0.5, 0.5)
    w.push(0)  # the 0 leaves -> [1, 1, 0, 0]
    assert w.total == 2.0
    w.push(0)
    w.push(0)  # everything that was 1 has left
    assert (w.total, w.mean, w.seen_mean) == (0.0, 0.0, 0.0)


def test_rolling_window_size_one():
    w = RollingWindow(1)
    for v, expected in ((1, 1.0), (0, 0.0), (1, 1.0), (1, 1.0)):
        w.push(v)
        assert w.mean == w.seen_mean == expected


@pytest.mark.parametrize("size", [0, -3])
def test_rolling_window_refuses_non_positive_size(size):
    with pytest.raises(ValueError, match="window size"):
        RollingWindow(size)


@pytest.mark.parametrize("split", [0, 2, 5, 6, 9])
def test_rolling_window_state_dict_round_trip_continues_identically(split):
    seq = [1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 1]
    live = RollingWindow(6)
    for v in seq[:split]:
        live.push(v)
    state = json.loads(json.dumps(live.state_dict()))  # it must survive a plain serialisation
    restored = RollingWindow(6)
    restored.load_state_dict(state)
    for v in seq[split:]:
        live.push(v)
        restored.push(v)
        assert (restored.total, restored.mean, restored.seen_mean, restored.count) == (
            live.total, live.mean, live.seen_mean, live.count)
    assert live.state_dict() == restored.state_dict()


def test_rolling_window_refuses_a_state_of_another_size():
    saved = RollingWindow(4)
    saved.push(1)
    other = RollingWindow(5)
    before = other.state_dict()
    with pytest.raises(ValueError, match="size 4"):
        other.load_state_dict(saved.state_dict())
    assert other.state_dict() == before  # untouched


def test_rolling_window_total_is_the_sum_of_the_held_values_for_fractions():
    values = [0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 0.7, 0.1]
    live = RollingWindow(3)
    for n, v in enumerate(values, start=1):
        live.push(v)
        assert live.total == math.fsum(values[max(0, n - 3): n])
        restored = RollingWindow(3)
        restored.load_state_dict(live.state_dict())
        assert restored.total == live.total


# ---------------------------------------------------------------------------- ScaleHealth (synthetic)


def feed(health: ScaleHealth, moves: list[tuple[float, bool]]) -> list[str]:
    verdicts = []
    for scale, skipped in moves:
        health.push(scale, skipped)
        verdicts.append(health.verdict)
    return verdicts


def test_health_verdicts_are_the_documented_five():
    assert set(HEALTH_VERDICTS) == {"warming", "climbing", "stable", "oscillating", "collapsing"}


def test_health_no_moves_is_stable():
    h = ScaleHealth(10, init_scale=2.0**16)
    assert feed(h, [(2.0**16, False)] * 15) == ["stable"] * 15


def test_health_opening_backoffs_are_warming_until_they_leave_the_window():
    h = ScaleHealth(5, init_scale=2.0**16)
    # 3 opening skips (the search down from init_scale), then clean steps at 2**13.
    moves = [(2.0**15, True), (2.0**14, True), (2.0**13, True)] + [(2.0**13, False)] * 6
    verdicts = feed(h, moves)
    # The opening's 3 halvings alone would read as a collapse (factor 8): they are warm-up.
    assert verdicts[:7] == ["warming"] * 7  # a back-off is still in the last 5 steps through step 7
    assert verdicts[7:] == ["stable", "stable"]  # step 8: window 4..8 holds no move


def test_health_a_later_skip_ends_the_opening():
    h = ScaleHealth(10, init_scale=2.0**16)
    verdicts = feed(h, [(2.0**15, True), (2.0**15, False), (2.0**14, True)])
    # The second back-off is after a clean step: not warm-up, one fall -> stable, not warming.
    assert verdicts == ["warming", "warming", "stable"]


def test_health_climbing():
    h = ScaleHealth(10, init_scale=1024.0)
    verdicts = feed(h, [(1024.0, False), (2048.0, False), (2048.0, False), (4096.0, False)])
    assert verdicts == ["stable", "climbing", "climbing", "climbing"]


def test_health_back_at_a_level_it_fell_from_is_stable_not_climbing():
    h = ScaleHealth(10, init_scale=1024.0)
    verdicts = feed(h, [(1024.0, False), (2048.0, False), (1024.0, True), (2048.0, False), (4096.0, False)])
    # a new high -> climbing; the fall -> stable; back to 2048, the level it fell from -> stable
    # (the equilibrium); 4096, higher than it has ever been -> climbing again
    assert verdicts == ["stable", "climbing", "stable", "stable", "climbing"]
    assert h.peak == 4096.0


def test_health_moves_within_one_octave_are_stable_however_many():
    h = ScaleHealth(8, init_scale=1024.0)
    moves = [(1024.0, False), (2048.0, False), (1024.0, True), (2048.0, False), (1024.0, True)] * 3
    assert feed(h, moves)[2:] == ["stable"] * 13  # 6 rises and 6 falls, a swing of one octave


def test_health_oscillating_is_a_swing_of_two_octaves_repeated():
    # a clean opening, so that the falls are not the warm-up; the steps settle (8 in a row: SETTLE_STEPS)
    # at 2**18, then (two overflows) at 2**16, back at 2**18, and (two overflows) at 2**16 again
    h = ScaleHealth(20, init_scale=2.0**18)
    dip = [(2.0**17, True), (2.0**16, True)] + [(2.0**16, False)] * 8
    moves = [(2.0**18, False)] * 8 + dip + [(2.0**17, False)] * 9 + [(2.0**18, False)] * 9 + dip
    verdicts = feed(h, moves)
    assert "oscillating" not in verdicts[:-1] and verdicts[-1] == "oscillating"  # one dip and its climb: no
    assert h.swings() == 3
    s = h.stats()
    assert (s.swing, s.fall, s.rise) == (2.0, 2.0, 1.0)
    # once the last leg is a reach (here the window: no growth interval) behind, the verdict calms down
    assert feed(h, [(2.0**16, False)] * 20)[-1] == "stable" and h.swings() == 0


def test_health_collapsing_by_a_factor_of_eight_without_a_rise():
    h = ScaleHealth(6, init_scale=1024.0)
    verdicts = feed(h, [(1024.0, False), (512.0, True), (512.0, False), (256.0, True), (128.0, True)])
    # one clean step ends the opening; then falls of 2, 4, 8 in total
    assert verdicts == ["stable", "stable", "stable", "stable", "collapsing"]
    # The three falls are at steps 2, 4, 5: the window of 6 holds them until step 8 lets step 2 go.
    assert feed(h, [(128.0, False)] * 3) == ["collapsing", "collapsing", "stable"]


def test_health_a_fall_of_three_octaves_is_collapsing_even_after_a_rise():
    h = ScaleHealth(10, init_scale=1024.0)
    verdicts = feed(h, [(1024.0, False), (2048.0, False), (1024.0, True), (512.0, True), (256.0, True),
                        (128.0, True)])
    assert verdicts == ["stable", "climbing", "stable", "stable", "stable", "collapsing"]
    assert h.stats().trend == -3.0 and h.stats().fall == 4.0  # 1024 -> 128 net; 2048 -> 128 from the high


def test_health_at_the_floor_is_collapsing_while_it_skips_there():
    h = ScaleHealth(4, min_scale=1.0, init_scale=4.0)
    verdicts = feed(h, [(2.0, True), (1.0, True)] + [(1.0, True)] * 3 + [(1.0, False)] * 6)
    assert verdicts[0] == "warming"  # 2.0 is above the floor
    # At the floor (the scaler clamps there: 1.0 is as low as it goes) with skips in the window,
    # opening or not, moves or none; once the window holds only applied steps there, the gradients
    # fit at the floor (review_27f: a clean run started at init_scale = min_scale read "collapsing")
    assert verdicts[1:] == ["collapsing"] * 7 + ["stable"] * 3
    assert h.at_floor
    h.push(2.0, False)  # growth off the floor
    assert not h.at_floor and h.verdict == "climbing"


def test_health_below_the_floor_is_collapsing_too():
    # A scaler with a lower floor than the monitor's (e.g. a hand-built one): below counts as at.
    h = ScaleHealth(4, min_scale=1.0, init_scale=1024.0)
    assert feed(h, [(1024.0, False), (0.5, False)]) == ["stable", "collapsing"]


def test_health_floor_is_compared_as_the_float32_the_scaler_holds():
    torch = pytest.importorskip("torch")
    floor = 0.1  # not a float32: the scaler stores float32(0.1) > 0.1
    held = float(torch.tensor(floor, dtype=torch.float32))
    assert held > floor
    h = ScaleHealth(4, min_scale=floor, init_scale=1.0)
    h.push(held, True)
    assert h.at_floor and h.verdict == "collapsing"
    h.push(float(torch.tensor(0.2)), False)
    assert not h.at_floor


def test_health_state_dict_round_trip_continues_identically():
    moves = ([(2.0**15, True), (2.0**14, True), (2.0**14, False), (2.0**15, False), (2.0**14, True),
              (2.0**15, False), (2.0**14, True), (2.0**13, True), (2.0**12, True)] + [(2.0**12, False)] * 12)
    for split in range(len(moves)):
        live = ScaleHealth(6, init_scale=2.0**16)
        feed(live, moves[:split])
        restored = ScaleHealth(6, init_scale=2.0**16)
        restored.load_state_dict(json.loads(json.dumps(live.state_dict())))
        assert feed(restored, moves[split:]) == feed(live, moves[split:])


def test_health_factor_eight_fall_after_non_power_of_two_growth():
    growth = 1.22  # a valid scaler.growth_factor (> 1)
    h = ScaleHealth(3, init_scale=1024.0)
    scale = 1024.0
    h.push(scale, False)
    for _ in range(3):
        scale *= growth
        h.push(scale, False)
    for _ in range(3):
        scale *= 0.5
        h.push(scale, True)
    # The window (last 3 steps) holds three halvings and no rise: fell by 8 -> collapsing.
    restored = ScaleHealth(3, init_scale=1024.0)
    restored.load_state_dict(h.state_dict())
    assert restored.verdict == "collapsing"
    assert h.verdict == "collapsing"


# ---------------------------------------------------------------------------- ScaleHealth: the lesson's traces
# The traces come from a real torch.amp.GradScaler (on the CPU), told which steps overflow: the
# labels are judged on what the scaler really does, growth interval and all.


def scaler_trace(overflow, steps: int, *, init: float, growth_interval: int = 2000,
                 backoff: float = 0.5) -> list[tuple[float, bool]]:
    """(scale after update, skipped) per step; ``overflow(step, scale)`` says which steps overflow."""
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=growth_interval, backoff_factor=backoff)
    scaler.scale(p.sum())  # the scaler makes its scale tensor lazily, at the first scale()
    scale, out = init, []
    for step in range(1, steps + 1):
        bad = overflow(step, scale)
        p.grad = torch.full((1,), float("inf") if bad else 1.0)  # as if backward had left it
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scale = scaler.get_scale()
        out.append((scale, bad))
    return out


def test_health_lesson_equilibrium_2_17_2_18_is_stable_with_the_default_settings():
    # The lesson's healthy run: the scale settles at 2**17 <-> 2**18. With GradScaler's defaults
    # (growth every 2000 clean steps) and the monitor's window of 1000: it doubles to 2**18, which
    # overflows 10 steps later, back to 2**17, 2000 clean steps, 2**18 again...
    trace = scaler_trace(lambda step, scale: scale >= 2.0**18 and step % 10 == 0, 4200, init=2.0**17)
    scales = [s for s, _ in trace]
    assert set(scales) == {2.0**17, 2.0**18} and sum(sk for _, sk in trace) == 2
    first_rise, first_fall = scales.index(2.0**18) + 1, 2010
    assert (first_rise, scales[first_fall - 1]) == (2000, 2.0**17)
    h = ScaleHealth(1000, init_scale=2.0**17)
    verdicts = []
    for step, (scale, skipped) in enumerate(trace, start=1):
        h.push(scale, skipped)
        if step % 50 == 0 or step in (first_rise, first_fall, 4010, 4019):
            verdicts.append((step, h.verdict))
    assert {v for s, v in verdicts if s < first_rise} == {"stable"}
    # the first time at 2**18 it is a new high: climbing, until the first overflow shows the limit
    assert {v for s, v in verdicts if first_rise <= s < first_fall} == {"climbing"}
    assert {v for s, v in verdicts if s >= first_fall} == {"stable"}  # every later visit to 2**18 too
    assert h.stats().swing <= 1.0


def test_health_lesson_equilibrium_many_alternations_in_the_window_are_stable():
    # The same equilibrium with a short growth interval: many 2**17 <-> 2**18 moves per window
    # (the old rule, 2 rises and 2 falls, called this "oscillating").
    trace = scaler_trace(lambda step, scale: scale >= 2.0**18 and step % 3 == 0, 300, init=2.0**17,
                         growth_interval=5)
    h = ScaleHealth(100, init_scale=2.0**17)
    verdicts = feed(h, trace)
    first_fall = [sk for _, sk in trace].index(True) + 1
    assert sum(sk for _, sk in trace[-100:]) >= 10  # at least 10 falls (and rises) in the last window
    assert set(verdicts[first_fall - 1:]) == {"stable"}
    s = h.stats()
    assert (s.swing, s.fall, s.rise) == (1.0, 1.0, 1.0) and -1.0 <= s.trend <= 1.0


@pytest.mark.parametrize("init", [2.0**16, 2.0**24])
def test_health_lesson_16_straight_skips_are_collapsing_not_warming(init):
    # 16 steps in a row, every one skipped (100% skip share), from the start of the run.
    trace = scaler_trace(lambda step, scale: True, 16, init=init)
    assert [s for s, _ in trace] == [init / 2**k for k in range(1, 17)]
    h = ScaleHealth(1000, min_scale=1.0, init_scale=init)
    verdicts = feed(h, trace)
    # A warm-up is at most COLLAPSE_STREAK halvings; the 9th skip in a row ends it.
    assert verdicts[:COLLAPSE_STREAK] == ["warming"] * COLLAPSE_STREAK
    assert verdicts[COLLAPSE_STREAK:] == ["collapsing"] * (16 - COLLAPSE_STREAK)
    assert h.stats().skip_share == 1.0 and h.streak == 16
    assert h.stats().headroom == math.log2(init) - 16  # 0 from 2**16: at the floor


def test_health_16_straight_skips_mid_run_are_collapsing_even_with_a_gentle_backoff():
    # backoff 0.9: 16 skips take the scale down only 2.4 octaves; the streak alone says collapsing
    trace = scaler_trace(lambda step, scale: step > 20, 36, init=2.0**17, backoff=0.9)
    h = ScaleHealth(1000, init_scale=2.0**17)
    verdicts = feed(h, trace)
    assert verdicts[:20] == ["stable"] * 20
    assert verdicts[20:28] == ["stable"] * 8  # 8 skips in a row: not yet
    assert verdicts[28:] == ["collapsing"] * 8  # the 9th to the 16th
    assert -3.0 < h.stats().trend < -2.0


def test_health_warmup_of_at_most_eight_skips_then_stable():
    trace = scaler_trace(lambda step, scale: scale > 2.0**8, 30, init=2.0**16)
    assert sum(sk for _, sk in trace) == COLLAPSE_STREAK == 8  # 2**16 down to 2**8
    h = ScaleHealth(20, init_scale=2.0**16)
    verdicts = feed(h, trace)
    assert verdicts[:27] == ["warming"] * 27  # the last opening halving (step 8) leaves the window of 20 at step 28
    assert verdicts[27:] == ["stable"] * 3
    assert h.stats().warmup == 0 and h.opening == 8


def test_health_the_demos_single_halving_is_stable():
    # the demo: fp16 from 1024, an Inf at step 5 halves the scale once (1024 -> 512), 20 steps
    trace = scaler_trace(lambda step, scale: step == 5, 20, init=1024.0, growth_interval=1_000_000)
    h = ScaleHealth(1000, init_scale=1024.0)
    assert feed(h, trace) == ["stable"] * 20
    s = h.stats()
    assert (s.trend, s.fall, s.headroom, s.skip_share) == (-1.0, 1.0, 9.0, 0.05)


def test_health_oscillating_from_a_real_scaler_trace():
    # gradients sometimes in range, sometimes not: 60 steps in which only 2**14 fits, 60 in which all do
    trace = scaler_trace(lambda step, scale: (step // 60) % 2 == 1 and scale > 2.0**14, 600, init=2.0**17,
                         growth_interval=10)
    h = ScaleHealth(30, init_scale=2.0**17, growth_interval=10)
    verdicts = feed(h, trace)
    assert verdicts[-1] == "oscillating" and verdicts[300:].count("oscillating") >= 250
    assert h.swings() >= 3 and max(s for s, _ in trace[300:]) / min(s for s, _ in trace[300:]) >= 8


def test_health_headroom_is_octaves_above_the_floor():
    h = ScaleHealth(10, min_scale=2.0**10, init_scale=2.0**16)
    h.push(2.0**16, False)
    assert h.stats().headroom == 6.0
    for k in range(15, 9, -1):
        h.push(2.0**k, True)
    assert h.stats().headroom == 0.0 and h.at_floor and h.verdict == "collapsing"


def test_health_old_state_without_scales_loads_and_continues():
    old = {"windows": {name: {"size": 4, "ring": [0.0] * 4, "pos": 2, "count": 6}
                       for name in ("ups", "downs", "log2", "opening_downs", "opening_log2")},
           "scale": 512.0, "opening": False}
    h = ScaleHealth(4, init_scale=1024.0)
    h.load_state_dict(old)
    assert (h.scale, h.verdict) == (512.0, "stable")
    assert feed(h, [(1024.0, False)]) == ["climbing"]


# ---------------------------------------------------------------------------- RunMonitor (synthetic)


def test_monitor_counts_skips_by_reason_losses_and_clip_rate():
    m = RunMonitor(window=10, max_norm=1.0, scaler_enabled=False)
    records = [
        step_record(1, loss=3.0, pre=2.0, post=1.0),  # clipped
        skip_record(2, "non_finite_loss"),
        step_record(3, loss=2.0, pre=0.5),
        skip_record(4, "non_finite_grad", loss=0.1),  # its loss must not count as the best
        step_record(5, loss=2.5, pre=1.5, post=1.0),  # clipped
        skip_record(6, "non_finite_grad"),
    ]
    for r in records:
        m.observe(r)
    assert (m.steps, m.updates) == (6, 3)
    assert dict(m.skips) == {"non_finite_loss": 1, "non_finite_grad": 2}
    assert m.skips_text() == "non_finite_grad=2, non_finite_loss=1"
    assert (m.first_loss, m.best_loss) == (3.0, 2.0)
    assert m.clipped == 2 and m.clip_rate == 2 / 6
    assert m.skip_rate == 3 / 6  # 3 skips among the 6 steps the (not yet full) window holds
    assert m.scale_verdict.startswith("none")
    assert m.summary().startswith("steps=6 updates=3 skips=3 (non_finite_grad=2, non_finite_loss=1)")
    line = m.stats_line()
    assert re.fullmatch(r"STATS 6 skip_rate=0\.500 clip_rate=0\.333 scale=none \(no loss scaler\) "
                        r"skips=non_finite_grad=2, non_finite_loss=1", line), line


def test_monitor_clipping_off_never_counts_clips():
    m = RunMonitor(window=5, max_norm=0.0, scaler_enabled=False)
    for i in range(1, 4):
        m.observe(step_record(i, pre=100.0))
    assert m.clipped == 0 and m.clip_rate == 0.0


@pytest.mark.parametrize("min_steps,first_alert", [(0, 3), (6, 6), (10, 8)])
def test_monitor_alerts_once_per_episode(min_steps, first_alert):
    skipped = [False] * 40
    for s in (3, 5, 6, 7, 25, 26, 28):
        skipped[s - 1] = True
    window, alert = 8, 0.2
    rates = reference_rates(skipped, window)
    expected = reference_episodes(rates, alert, min_steps=min(min_steps, window))
    assert [k for _, k in expected] == ["ALERT", "CLEAR", "ALERT", "CLEAR"]  # the pattern has two episodes
    # Armed from step 0: step 3 is 1 skip in 3 steps (0.333). Armed at 6: the rate was above since
    # step 3, the ALERT comes when it is armed (4 skips in 6). min_steps 10 beyond the window of 8:
    # armed once the window is full, at step 8 (4 skips in 8; review 51i: a burst that filled a
    # small window and left it before min_steps was never judged)
    assert expected[0] == (first_alert, "ALERT")
    m = RunMonitor(window=window, alert_rate=alert, scaler_enabled=False, min_steps=min_steps)
    got = []
    for r in records_for(skipped):
        for e in m.observe(r):
            got.append((e.step, {"skip_rate_alert": "ALERT", "skip_rate_clear": "CLEAR"}[e.kind]))
    assert got == expected
    assert m.alert_episodes == 2
    assert m.max_skip_rate == max(rates) == 4 / 7  # steps 3, 5, 6, 7 skipped: 4 of the first 7 steps


def test_monitor_rate_at_exactly_the_threshold_is_not_an_alert():
    m = RunMonitor(window=4, alert_rate=0.25, scaler_enabled=False, min_steps=0)
    for i in (1, 2, 3):
        assert m.observe(step_record(i)) == []
    events = m.observe(skip_record(4))  # 1/4 == 0.25: not above
    assert events == [] and not m.alerting and m.skip_rate == 0.25
    events = m.observe(skip_record(5))  # 2/4 > 0.25
    assert [e.kind for e in events] == ["skip_rate_alert"]
    assert events[0].data == {"skip_rate": 0.5, "window": 4}
    assert events[0].cause is None and "cause" not in events[0].as_dict()


@pytest.mark.parametrize("fail_rate,fail_after", [(0.1, 10), (0.3, 4), (0.0, 1), (0.45, 3)])
def test_monitor_fails_at_exactly_the_predicted_step(fail_rate, fail_after):
    fault = parse_fault("inf_grad@rate:0.5", seed=0)
    skipped = [fault.hits(s) for s in range(1, 201)]
    rates = reference_rates(skipped, 20)
    expected = reference_fail_step(rates, fail_rate, fail_after)
    assert expected is not None
    m = RunMonitor(window=20, fail_rate=fail_rate, fail_after=fail_after, scaler_enabled=False)
    fails = []
    for r in records_for(skipped):
        fails += [e for e in m.observe(r) if e.kind == "fail"]
        if m.failed is None:
            assert r.step < expected
    assert [e.step for e in fails] == [expected]  # once, at that step
    assert m.failed is fails[0] and m.failed.step == expected
    assert m.failed.cause == FAIL_SKIP_RATE and m.failed.as_dict()["cause"] == "skip_rate"


def test_monitor_without_fail_rate_never_fails():
    m = RunMonitor(window=2, fail_rate=None, fail_after=1, scaler_enabled=False)
    for i in range(1, 30):
        m.observe(skip_record(i))
    assert m.failed is None and m.skip_rate == 1.0


def test_monitor_fail_counter_resets_when_the_rate_drops():
    # window 4, fail_rate 0.5 (above: 3 of the last 4, or all of 1, or 2 of 3 while filling); fail_after 3
    skipped = [True, False, False, False, False, True, True, False, True, True, True, False]
    rates = reference_rates(skipped, 4)
    assert rates[:3] == [1.0, 0.5, 1 / 3]  # step 1 is above (1 of 1); step 2 resets the counter
    expected = reference_fail_step(rates, 0.5, 3)
    assert expected == 11  # rates 0.75 at steps 9, 10, 11
    m = RunMonitor(window=4, fail_rate=0.5, fail_after=3, scaler_enabled=False)
    counters = []
    steps = []
    for r in records_for(skipped):
        steps += [e.step for e in m.observe(r) if e.kind == "fail"]
        counters.append(m.above_fail)
    assert steps == [expected]
    assert counters == [1, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]


def feed_scales(m: RunMonitor, plan: list[tuple[float, bool]]) -> list[tuple[int, str]]:
    """Feed (scale after update, skipped) per step; return (step, event kind) for every event."""
    events = []
    for i, (scale, skip) in enumerate(plan, start=1):
        rec = skip_record(i, scale=scale) if skip else step_record(i, scale=scale)
        events += [(e.step, e.kind) for e in m.observe(rec)]
    return events


def test_monitor_scale_alert_once_and_fail_on_scale_collapse():
    m = RunMonitor(window=100, scaler_enabled=True, init_scale=4.0, min_scale=1.0,
                   fail_on_scale_collapse=True, fail_after=3)
    # The scaler's floor is 1.0: it halves 4 -> 2 -> 1 and stays at 1 however many skips follow.
    # Step 3 is applied at the floor (the counter restarts); steps 4, 5, 6 are skipped at it.
    plan = [(2.0, True), (1.0, True), (1.0, False), (1.0, True), (1.0, True), (1.0, True), (1.0, True)]
    events = feed_scales(m, plan)
    assert events == [(2, "scale_alert"), (6, "fail")]  # one alert while it stays at the floor
    assert m.failed.cause == FAIL_SCALE_COLLAPSE
    assert m.failed.data == {"scale": 1.0, "min_scale": 1.0}
    assert m.failed.as_dict()["cause"] == "scale_collapse"
    assert m.scale_verdict == "collapsing"


def test_monitor_applied_steps_at_the_floor_never_fail():
    # At the floor but training (steps applied): the scale alert is up, the run goes on.
    m = RunMonitor(window=10, scaler_enabled=True, init_scale=2.0, min_scale=1.0,
                   fail_on_scale_collapse=True, fail_after=2)
    plan = [(1.0, True)] + [(1.0, False), (1.0, True)] * 20  # never two skips in a row at the floor
    # (half the steps skipped: the skip-rate ALERT too, once the window of 10 is full)
    assert feed_scales(m, plan) == [(1, "scale_alert"), (10, "skip_rate_alert")]
    assert m.failed is None and m.at_floor_skipped == 1


def test_a_run_started_at_the_floor_is_not_alerted_until_a_step_overflows_there():
    # review_27e #5: scaler.init_scale = min_scale, every step applied: "ALERT 1 ... fp16 cannot hold
    # these gradients" at step 1, where nothing had overflowed
    m = RunMonitor(window=10, scaler_enabled=True, init_scale=1.0, min_scale=1.0)
    assert feed_scales(m, [(1.0, False)] * 3 + [(2.0, False), (1.0, True), (1.0, False), (2.0, False)]) == [
        (5, "scale_alert"), (7, "scale_clear")]


def test_a_nan_loss_at_the_floor_is_alerted_as_what_it_is_not_as_an_overflow():
    # review_27g #8: "the step still overflowed: fp16 cannot hold these gradients" for a loss that was
    # NaN in the forward; the scale at its floor and still skipping is alerted, in its own words
    m = RunMonitor(window=10, scaler_enabled=True, init_scale=1.0, min_scale=1.0)
    events = []
    for i, reason in enumerate([None, "non_finite_loss", None, "non_finite_grad"], start=1):
        rec = skip_record(i, reason, scale=1.0) if reason else step_record(i, scale=1.0)
        events += [(e.step, e.kind, e.message) for e in m.observe(rec)]
    assert [(step, kind) for step, kind, _ in events] == [(2, "scale_alert")]  # (once per episode)
    # (review 49a: not "not fp16's range": a forward activation past fp16's max makes such a loss, which the loss
    # scale does not act on and the first-skip diagnosis calls a precision-range problem on the next line)
    assert events[0][2].endswith("steps still skip (a non-finite loss here, which no loss scale acts on: the "
                                 "forward's, from the data, the model or an activation past fp16's range; ampguard "
                                 "locate tells which)")
    assert "not fp16's range" not in events[0][2]


def test_monitor_scale_collapse_without_fail_on_scale_collapse_only_alerts():
    m = RunMonitor(window=10, scaler_enabled=True, init_scale=2.0, min_scale=1.0, fail_after=2)
    # (every step skipped: the skip-rate ALERT too, once the window of 10 is full)
    assert feed_scales(m, [(1.0, True)] * 30) == [(1, "scale_alert"), (10, "skip_rate_alert")]
    assert m.failed is None


def test_monitor_scale_clear_when_the_scale_recovers():
    m = RunMonitor(window=100, scaler_enabled=True, init_scale=2.0, min_scale=1.0)
    plan = [(1.0, True), (1.0, True), (2.0, False), (1.0, True), (0.5, True), (2.0, False)]
    # at the floor (<=: it cannot go lower) at steps 1, 2 and 4; below it (a lower scaler floor) at 5
    assert feed_scales(m, plan) == [(1, "scale_alert"), (3, "scale_clear"), (4, "scale_alert"), (6, "scale_clear")]
    assert m.failed is None  # fail_on_scale_collapse is off


def test_monitor_scale_guards_are_off_without_a_scaler():
    m = RunMonitor(window=10, scaler_enabled=False, min_scale=1.0, fail_on_scale_collapse=True, fail_after=1,
                   min_steps=100)
    assert feed_scales(m, [(1.0, True)] * 5) == []  # bf16/fp32 report scale 1.0: not a floor
    assert m.failed is None


def test_monitor_skip_rate_fail_wins_when_both_guards_trip_at_once():
    m = RunMonitor(window=10, scaler_enabled=True, init_scale=1.0, min_scale=1.0, fail_rate=0.5, fail_after=2,
                   fail_on_scale_collapse=True, min_steps=100)
    assert feed_scales(m, [(1.0, True)] * 3) == [(1, "scale_alert"), (2, "fail")]
    assert m.failed.cause == FAIL_SKIP_RATE  # one failure, typed; the first guard checked


# ---------------------------------------------------------------------------- RunMonitor: the young window


def every_step_skips(n: int) -> list:
    return [skip_record(i, "non_finite_loss") for i in range(1, n + 1)]


def test_monitor_first_step():
    m = RunMonitor(window=1000, scaler_enabled=False)
    assert (m.skip_rate, m.steps) == (0.0, 0)  # before any step
    m.observe(step_record(1))
    assert m.skip_rate == 0.0
    m = RunMonitor(window=1000, scaler_enabled=False, fail_rate=0.5, fail_after=1)
    events = m.observe(skip_record(1))
    assert m.skip_rate == 1.0  # 1 skip in the 1 step seen, not 1/1000
    assert [(e.step, e.kind, e.cause) for e in events] == [(1, "fail", FAIL_SKIP_RATE)]


def test_monitor_window_not_full_25_skips_in_25_steps_is_rate_one():
    m = RunMonitor(window=1000, scaler_enabled=False)
    for r in every_step_skips(25):
        m.observe(r)
        assert m.skip_rate == 1.0
    assert m.skip_window.held == 25
    assert " skip_rate=1.000 " in m.stats_line()


def test_monitor_lesson_numbers_25_in_25_reads_one_and_5_percent_over_1000_is_the_threshold():
    # The lesson: a rolling window of 1000 steps, paging above 5%.
    m = RunMonitor(scaler_enabled=False)  # window 1000, alert_rate 0.05, min_steps 100: the config's defaults
    assert (m.window, m.alert_rate, m.min_steps) == (1000, 0.05, 100)
    events = [e for r in every_step_skips(25) for e in m.observe(r)]
    assert m.skip_rate == 1.0 and m.skip_window.held == 25  # 25 skips in 25 steps, not 25/1000 = 0.025
    assert events == [] and not m.alert_armed  # the start-up skips: the ALERT is not armed before step 100

    # 50 skips in 1000 steps (every 20th) is 5.0%: at the threshold, not above it; the 51st pages.
    m = RunMonitor(scaler_enabled=False)
    kinds = []
    for i in range(1, 1001):
        kinds += [e.kind for e in m.observe(skip_record(i) if i % 20 == 0 else step_record(i))]
    assert (m.skip_rate, m.skip_window.held, sum(m.skips.values())) == (0.05, 1000, 50)
    assert kinds == [] and m.max_skip_rate == 0.05
    events = m.observe(skip_record(1001))  # the window now holds steps 2..1001: 51 skips
    assert m.skip_rate == 0.051
    assert [(e.kind, e.data) for e in events] == [("skip_rate_alert", {"skip_rate": 0.051, "window": 1000})]
    assert " skip_rate=0.051 " in m.stats_line()

def test_monitor_window_filling_then_full_matches_brute_force():
    fault = parse_fault("nan_loss@rate:0.3", seed=4)
    skipped = [fault.hits(s) for s in range(1, 61)]
    m = RunMonitor(window=16, scaler_enabled=False)
    got = []
    for r in records_for(skipped):
        m.observe(r)
        got.append(m.skip_rate)
    assert got == reference_rates(skipped, 16)


@pytest.mark.parametrize("fail_after", [1, 3, 100])
def test_monitor_fail_fast_trips_at_exactly_fail_after_when_every_step_skips(fail_after):
    # The window (1000) is nowhere near full: the guard must not wait for it.
    m = RunMonitor(window=1000, fail_rate=0.5, fail_after=fail_after, scaler_enabled=False, min_steps=10_000)
    for r in every_step_skips(fail_after + 5):
        events = m.observe(r)
        if r.step < fail_after:
            assert m.failed is None and events == [], r.step
        elif r.step == fail_after:
            assert [e.kind for e in events] == ["fail"]
    assert m.failed.step == fail_after and m.failed.cause == FAIL_SKIP_RATE
    assert m.failed.data == {"skip_rate": 1.0, "window": 1000}


def test_monitor_fail_fast_is_not_delayed_by_min_steps():
    m = RunMonitor(window=1000, fail_rate=0.5, fail_after=3, scaler_enabled=False, min_steps=500)
    kinds = [(r.step, e.kind) for r in every_step_skips(3) for e in m.observe(r)]
    assert kinds == [(3, "fail")]  # no ALERT: not armed; the fail: not gated
    assert not m.alert_armed


@pytest.mark.parametrize("min_steps", [0, 1, 20, 100])
def test_monitor_alert_not_armed_before_min_steps(min_steps):
    m = RunMonitor(window=1000, alert_rate=0.05, scaler_enabled=False, min_steps=min_steps)
    alerts = []
    for r in every_step_skips(min_steps + 3):
        alerts += [r.step for e in m.observe(r) if e.kind == "skip_rate_alert"]
        assert m.alert_armed == (r.step >= min_steps)
    assert alerts == [max(1, min_steps)]  # the rate was 1.0 all along: it alerts as soon as armed
    assert m.max_skip_rate == 1.0


def test_monitor_default_min_steps_is_the_configs():
    m = RunMonitor(window=1000, scaler_enabled=False)
    assert m.min_steps == DEFAULT_MIN_STEPS == MonitorConfig().min_steps
    alerts = [r.step for r in every_step_skips(DEFAULT_MIN_STEPS) for e in m.observe(r)
              if e.kind == "skip_rate_alert"]
    assert alerts == [DEFAULT_MIN_STEPS]


@pytest.mark.parametrize("opening", [1, 3, 5, 6, 8, 9, 12, 15])
def test_monitor_default_settings_do_not_alert_on_the_fp16_opening(opening):
    # fp16 from 2**16: the scaler's search skips the first few steps, halving each time, then trains.
    m = RunMonitor()  # window 1000, alert_rate 0.05, min_steps = DEFAULT_MIN_STEPS
    scale, events = 2.0**16, []
    for i in range(1, 301):
        if i <= opening:
            scale /= 2
            rec = skip_record(i, scale=scale)
        else:
            rec = step_record(i, scale=scale)
        events += [(e.step, e.kind) for e in m.observe(rec)]
    assert events == []
    assert m.scale_verdict == "warming"  # the opening is still in the window
    assert m.max_skip_rate == 0.0  # the judged rate: the opening set aside
    assert m.skip_rate == opening / 300  # the rate shown counts it


def test_monitor_min_steps_rejects_negative():
    with pytest.raises(ValueError, match="min_steps"):
        RunMonitor(min_steps=-1)


@pytest.mark.parametrize("floor", [0.0, -1.0, float("nan")])
def test_monitor_refuses_a_floor_that_is_not_a_positive_number(floor):
    # the scale's headroom is log2(scale / min_scale): a 0 floor crashed the run card's label
    with pytest.raises(ValueError, match="min_scale"):
        RunMonitor(min_scale=floor)


def test_monitor_restart_windows_restarts_the_fail_counters_and_keeps_the_alert_armed_and_up():
    # (review_38e F2: a rollback used to disarm the ALERT for min_steps steps and clear an ALERT at the
    # first clean step after it; it stays armed, and the ALERT up stays up, judged by _young_after_restart)
    m = RunMonitor(window=100, alert_rate=0.1, fail_rate=0.5, fail_after=4, scaler_enabled=False, min_steps=3)
    for r in every_step_skips(3):
        m.observe(r)
    assert m.alerting and m.above_fail == 3 and m.failed is None
    m.restart_windows()
    assert (m.skip_rate, m.above_fail, m.alert_armed, m.alerting) == (0.0, 0, True, True)
    kinds = [(r.step, e.kind) for r in every_step_skips(8)[3:] for e in m.observe(r)]
    # 4 more consecutive steps above, counted afresh; review 54k: the young window's first skip reads 1/3
    # (its skips over min_steps 3), not above 0.5: from step 5 (2/3), one step later than 1 of 1 did
    assert kinds == [(8, "fail")]


# ---------------------------------------------------------------------------- Event


def test_fail_event_must_carry_a_known_cause():
    for cause in FAIL_CAUSES:
        assert Event(1, "fail", "m", cause=cause).as_dict()["cause"] == cause
    for bad in (None, "", "skip rate"):
        with pytest.raises(ValueError, match="cause"):
            Event(1, "fail", "m", cause=bad)
    assert FAIL_CAUSES == ("skip_rate", "scale_collapse", "non_finite_update")  # the strings events.jsonl carries


MIXED = "cSccccccccSScccccccSccccSSSSccccccccccSSSSScc"  # S: skipped step, c: clean step
MIXED_ARGS = dict(window=6, alert_rate=0.2, fail_rate=0.4, fail_after=4, max_norm=1.0, init_scale=2.0**16,
                  min_steps=3)


def _mixed_records() -> list:
    scale = 2.0**16
    out = []
    for i, ch in enumerate(MIXED, start=1):
        if ch == "S":
            scale /= 2
            reason = "non_finite_loss" if i % 3 == 0 else "non_finite_grad"
            # (as under torchrun: whose loss it was; the round trips keep the count)
            on = ("rank 1" if i % 2 else "every rank") if reason == "non_finite_loss" else None
            out.append(skip_record(i, reason, scale=scale, loss_on=on))
        else:
            if i % 7 == 0:
                scale *= 2
            out.append(step_record(i, loss=10.0 / i, pre=0.5 + (i % 4) * 0.4, scale=scale))
    return out


def test_mixed_stream_has_two_episodes_then_a_fail():
    # What the round trips below must preserve really happens in this stream.
    skipped = [ch == "S" for ch in MIXED]
    rates = reference_rates(skipped, 6)
    fail_step = reference_fail_step(rates, 0.4, 4)
    assert fail_step == 30
    assert rates[1] == 0.5  # step 2 is above fail_rate and alert_rate, before min_steps (3)
    m = RunMonitor(**MIXED_ARGS)
    events = [(e.step, e.kind) for r in _mixed_records() for e in m.observe(r)]
    expected_alerts = [(s, {"ALERT": "skip_rate_alert", "CLEAR": "skip_rate_clear"}[k])
                       for s, k in reference_episodes(rates, 0.2, min_steps=3)]
    assert expected_alerts[0] == (3, "skip_rate_alert")  # armed at step 3, not 2
    assert [e for e in events if e[1].startswith("skip_rate")] == expected_alerts
    assert [e for e in events if e[1] == "fail"] == [(fail_step, "fail")]
    assert len(expected_alerts) >= 5  # alert, clear, alert, clear, alert


def canon(state: dict) -> str:
    """Comparable text of a state (NaN == NaN here, unlike in a dict comparison)."""
    return json.dumps(state, sort_keys=True)


def _round_trip(split: int) -> tuple[RunMonitor, RunMonitor, list]:
    records = _mixed_records()
    live = RunMonitor(**MIXED_ARGS)
    for r in records[:split]:
        live.observe(r)
    state = json.loads(json.dumps(live.state_dict()))  # a checkpoint holds plain data
    restored = RunMonitor(**MIXED_ARGS)
    restored.load_state_dict(copy.deepcopy(state))
    return live, restored, records[split:]


@pytest.mark.parametrize("split", [1, 2, 3, 5, 8, 11, 12, 20, 26, 27, 29])
def test_run_monitor_state_dict_round_trip_mid_run(split):
    live, restored, rest = _round_trip(split)
    assert canon(restored.state_dict()) == canon(live.state_dict())
    for r in rest:
        a = [e.as_dict() for e in live.observe(r)]
        b = [e.as_dict() for e in restored.observe(r)]
        assert a == b, r.step
        assert (restored.skip_rate, restored.clip_rate, restored.scale_verdict, restored.stats_line(),
                restored.summary()) == (live.skip_rate, live.clip_rate, live.scale_verdict, live.stats_line(),
                                        live.summary())
        assert (restored.failed is None) == (live.failed is None)
    assert canon(restored.state_dict()) == canon(live.state_dict())


@pytest.mark.parametrize("split", [30, 33])
def test_run_monitor_round_trip_after_the_fail(split):
    # A failure is not restored (a resume may change the thresholds): the counters are, so with the
    # same thresholds the restored monitor fails again at its first step whose rate is still above.
    live, restored, rest = _round_trip(split)
    assert live.failed is not None and live.failed.step == 30
    assert restored.failed is None and restored.above_fail == live.above_fail
    for r in rest:
        got, want = restored.observe(r), live.observe(r)
        assert [e.as_dict() for e in got if e.kind != "fail"] == [e.as_dict() for e in want], r.step
    again = reference_fail_step(reference_rates([ch == "S" for ch in MIXED], 6), 0.4, 4, after=split)
    assert again == {30: 31, 33: 44}[split]  # at 30 still above: at once; at 33 the rate had fallen
    assert restored.failed.step == again and restored.failed.cause == FAIL_SKIP_RATE


def test_run_monitor_restored_after_the_fail_judges_with_new_thresholds():
    live, _, rest = _round_trip(30)
    state = json.loads(json.dumps(live.state_dict()))
    for changed in ({"fail_rate": None}, {"fail_rate": 0.99}, {"fail_after": 1000}):
        restored = RunMonitor(**{**MIXED_ARGS, **changed})
        restored.load_state_dict(copy.deepcopy(state))
        for r in rest:
            assert all(e.kind != "fail" for e in restored.observe(r)), (changed, r.step)
        assert restored.failed is None


def test_run_monitor_round_trip_needs_the_same_window():
    m = RunMonitor(window=6)
    m.observe(step_record(1))
    other = RunMonitor(window=7)
    before = canon(other.state_dict())
    with pytest.raises(ValueError):
        other.load_state_dict(m.state_dict())
    assert canon(other.state_dict()) == before  # untouched


@pytest.mark.parametrize("split", [0, 1, 10, 19, 20, 21, 24])
def test_run_monitor_round_trip_in_a_young_window(split):
    # window 1000, never full: the rate is over the steps seen, the ALERT arms at 20, fail at 25.
    args = dict(window=1000, alert_rate=0.3, fail_rate=0.5, fail_after=25, scaler_enabled=False, min_steps=20)
    skipped = [True] * 30
    live = RunMonitor(**args)
    for r in records_for(skipped)[:split]:
        live.observe(r)
    restored = RunMonitor(**args)
    restored.load_state_dict(json.loads(json.dumps(live.state_dict())))
    got = {"live": [], "restored": []}
    for r in records_for(skipped)[split:]:
        got["live"] += [(e.step, e.kind, e.cause) for e in live.observe(r)]
        got["restored"] += [(e.step, e.kind, e.cause) for e in restored.observe(r)]
        assert restored.skip_rate == live.skip_rate == 1.0
    assert got["restored"] == got["live"]
    expected = [(20, "skip_rate_alert", None), (25, "fail", FAIL_SKIP_RATE)]
    assert got["live"] == [e for e in expected if e[0] > split]
    assert canon(restored.state_dict()) == canon(live.state_dict())


@pytest.mark.parametrize("split", [0, 2, 3, 4, 5, 6])
def test_run_monitor_round_trip_at_the_scale_floor(split):
    args = dict(window=8, scaler_enabled=True, init_scale=4.0, min_scale=1.0, fail_on_scale_collapse=True,
                fail_after=3, min_steps=100)
    plan = [(2.0, True), (1.0, True), (1.0, False), (1.0, True), (1.0, True), (1.0, True), (1.0, True)]
    live = RunMonitor(**args)
    feed_scales(live, plan[:split])
    restored = RunMonitor(**args)
    restored.load_state_dict(json.loads(json.dumps(live.state_dict())))
    assert restored.at_floor_skipped == live.at_floor_skipped
    for i, (scale, skip) in enumerate(plan[split:], start=split + 1):
        rec = skip_record(i, scale=scale) if skip else step_record(i, scale=scale)
        got = [e.as_dict() for e in restored.observe(rec)]
        want = [e.as_dict() for e in live.observe(rec)]
        assert got == want or (split == 6 and i == 7 and [e["event"] for e in got] == ["fail"] and want == [])
    # restored after the failure (split 6): not restored, but tripped again at the next step at the floor
    assert live.failed.step == 6 and restored.failed.step == (7 if split == 6 else 6)
    assert restored.failed.cause == FAIL_SCALE_COLLAPSE


def test_the_skips_for_a_non_finite_loss_are_counted_by_whose_loss_it_was_and_kept_across_a_resume():
    live, restored, rest = _round_trip(20)
    assert live.loss_origins and restored.loss_origins == live.loss_origins  # the checkpoint kept them
    for r in rest:
        live.observe(r)
        restored.observe(r)
    expected = {}
    for r in _mixed_records():
        if r.skipped and r.loss_on:
            expected[r.loss_on] = expected.get(r.loss_on, 0) + 1
    assert dict(restored.loss_origins) == expected and set(expected) == {"rank 1", "every rank"}
    top = max(expected, key=expected.get)
    assert restored.loss_origins_text().startswith(f"{top} ({expected[top]})")  # most first
    state = json.loads(json.dumps(live.state_dict()))
    with pytest.raises(ValueError, match="loss_origins is .*expected a mapping of names to ints >= 0"):
        RunMonitor(**MIXED_ARGS).load_state_dict({**state, "loss_origins": {"rank 1": -2}})
    assert RunMonitor(**MIXED_ARGS).loss_origins_text() is None  # one process: no line on the card


def test_run_monitor_loads_an_older_state_without_the_new_keys():
    m = RunMonitor(**MIXED_ARGS)
    records = _mixed_records()
    for r in records[:31]:
        m.observe(r)
    old = json.loads(json.dumps(m.state_dict()))
    old["below_min_scale"] = old.pop("at_floor_skipped")  # the name before the floor
    del old["failed"]["cause"]  # saved before failures were typed
    for key in ("eval_last", "eval_best", "max_skip_rate", "loss_origins"):
        del old[key]
    restored = RunMonitor(**MIXED_ARGS)
    restored.load_state_dict(old)
    assert restored.failed is None  # judged again (the counters go on): fails at its next step
    assert (restored.eval_last, restored.eval_best, restored.max_skip_rate) == ({}, {}, 0.0)
    for r in records[31:]:
        got, want = restored.observe(r), m.observe(r)
        assert [e.as_dict() for e in got if e.kind != "fail"] == [e.as_dict() for e in want]
    again = reference_fail_step(reference_rates([ch == "S" for ch in MIXED], 6), 0.4, 4, after=31)
    assert restored.failed.cause == FAIL_SKIP_RATE and restored.failed.step == again == 44


# ---------------------------------------------------------------------------- sinks


def test_jsonl_sink_is_strict_json_with_non_finite_strings(tmp_path):
    path = tmp_path / "e.jsonl"
    sink = JsonlSink(path)
    sink.write(skip_record(3, "non_finite_grad", loss=2.5, scale=512.0))
    sink.write(skip_record(4, "non_finite_loss"))
    sink.write_event({"step": 5, "event": "x", "a": float("-inf"), "b": float("nan"), "c": 1.5, "d": None})
    # flushed per line: readable before close
    first, second, third = [strict_json(line) for line in path.read_text(encoding="utf-8").splitlines()]
    sink.close()
    assert first == {"step": 3, "lr": 0.1, "loss": 2.5, "grad_l2_pre_clip": "inf", "grad_l2_post_clip": None,
                     "scaler_scale": 512.0, "skipped": True, "skip_reason": "non_finite_grad"}
    assert second["loss"] == "nan" and second["grad_l2_pre_clip"] is None
    assert second["skip_reason"] == "non_finite_loss"
    assert third == {"step": 5, "event": "x", "a": "-inf", "b": "nan", "c": 1.5, "d": None}


def test_jsonl_sink_refuses_to_overwrite(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text('{"a": 1}\n', encoding="utf-8")
    with pytest.raises(InputError):
        JsonlSink(path)
    assert path.read_text(encoding="utf-8") == '{"a": 1}\n'


def test_tensorboard_sink_without_the_package_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # hidden: find_spec raises, import fails
    with pytest.raises(InputError) as info:
        TensorBoardSink(tmp_path / "tb")
    assert str(info.value) == ("log.tensorboard is on but the tensorboard package is not installed: "
                               "pip install 'ampguard[tensorboard]'")
    assert not (tmp_path / "tb").exists()  # refused before the writer made its folder


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_sink_writes_event_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tb")
    sink.write(step_record(1, pre=2.0, post=1.0, scale=8.0))
    sink.write(skip_record(2, scale=4.0))  # an overflow: pre-clip norm inf, no post-clip norm
    sink.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").rglob("*"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()

    def scalars(name: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(f"train/{name}")]

    assert sorted(events.Tags()["scalars"]) == sorted(
        f"train/{name}" for name in ("lr", "loss", "grad_l2_pre_clip", "grad_l2_post_clip", "scaler_scale", "skipped"))
    assert scalars("loss") == [(1, 1.0), (2, 1.0)]
    assert scalars("skipped") == [(1, 0.0), (2, 1.0)]
    assert scalars("scaler_scale") == [(1, 8.0), (2, 4.0)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("train/lr")] == [(1, 0.1), (2, 0.1)]
    assert scalars("grad_l2_pre_clip") == [(1, 2.0), (2, math.inf)]  # the skip's non-finite norm, as inf
    assert scalars("grad_l2_post_clip") == [(1, 1.0)]  # None (the skip's) is left out, not written as 0


def fp16_opening(opening: int, steps: int, later_skips: tuple[int, ...] = ()) -> list:
    """fp16 from 2**16: ``opening`` halvings (skipped steps), then clean steps but ``later_skips``."""
    scale, records = 2.0**16, []
    for i in range(1, steps + 1):
        if i <= opening or i in later_skips:
            scale /= 2
            records.append(skip_record(i, scale=scale))
        else:
            records.append(step_record(i, scale=scale))
    return records


@pytest.mark.parametrize("opening", [6, 8])
def test_monitor_fail_fast_sets_the_fp16_opening_aside(opening):
    # --fail-skip-rate 0.05: 6-8 opening skips are 6-8% of the first 100 steps, the scaler's search
    m = RunMonitor(fail_rate=0.05, fail_after=100)
    events = [(e.step, e.kind) for r in fp16_opening(opening, 300) for e in m.observe(r)]
    assert events == [] and m.failed is None
    assert m.skip_rate == opening / 300 and m.judged_skip_rate == 0.0
    assert m.scale_verdict == "warming"


@pytest.mark.parametrize("opening", [9, 12, 15])
def test_monitor_a_long_opening_that_finds_a_scale_is_a_search(opening):
    # a sum-reduced loss can need 9-15 halvings from 2**16: 9% of the first 100 steps is no failure
    m = RunMonitor(fail_rate=0.05, fail_after=100)
    events = [(e.step, e.kind) for r in fp16_opening(opening, 300) for e in m.observe(r)]
    assert events == [] and m.failed is None
    assert m.scale_verdict == "warming"  # scale health agrees: a warm-up, not a collapse


def test_monitor_an_opening_that_reaches_the_floor_counts_whole_from_its_first_step():
    # from 2**16 to the floor 1.0 in 16 halvings: no scale found. Its skips count from step 1, so
    # the fail-fast trips at step 100, as for a bf16 run that skips every step
    fp16 = RunMonitor(fail_rate=0.05, fail_after=100)
    bf16 = RunMonitor(fail_rate=0.05, fail_after=100, scaler_enabled=False)
    records = [skip_record(s, scale=max(2.0 ** (16 - s), 1.0)) for s in range(1, 151)]
    fails = [[e.step for r in records for e in m.observe(r) if e.kind == "fail"] for m in (fp16, bf16)]
    assert fails == [[100], [100]]
    assert fp16.opening == 0 and not fp16.in_opening and fp16.judged_skip_rate == 1.0


@pytest.mark.parametrize("scaler", [True, False])
def test_monitor_fail_fast_on_a_run_that_skips_every_step(scaler):
    # with the scaler its skips could be the opening search until a step at the floor skips too
    # (2**16 -> 1.0 after step 16: step 17 runs at the floor; review 51i: the back-off to the floor
    # is not the floor tried); fail_after=3 was met long before, so it fails there
    m = RunMonitor(fail_rate=0.05, fail_after=3, scaler_enabled=scaler)
    records = [skip_record(s, scale=max(2.0 ** (16 - s), 1.0)) for s in range(1, 31)]
    fails = [r.step for r in records for e in m.observe(r) if e.kind == "fail"]
    assert fails == [17 if scaler else 3]


@pytest.mark.parametrize("scaler", [True, False])
def test_the_fail_says_how_many_consecutive_steps_were_above_the_rate_not_fail_after(scaler):
    # review 50c: an fp16 opening whose step at the floor (17) skipped counts its steps at once; the
    # FAIL said "for 3 consecutive steps" while all of them were above the rate
    m = RunMonitor(fail_rate=0.05, fail_after=3, scaler_enabled=scaler)
    fails = [e.message for s in range(1, 31) for e in m.observe(skip_record(s, scale=max(2.0 ** (16 - s), 1.0)))
             if e.kind == "fail"]
    assert [f.split(" (now")[0] for f in fails] == [
        "rolling skip rate above fail_rate 0.05 for 17 consecutive steps, past fail_after 3" if scaler else
        "rolling skip rate above fail_rate 0.05 for 3 consecutive steps"]


@pytest.mark.parametrize("max_norm", [torch.tensor(1.0), torch.tensor([1.0])])
def test_a_tensor_max_norm_counts_clips_as_the_number_it_holds(max_norm):
    # review 50h: the Lightning plugin hands its max_norm to the monitor as given; a tensor made the clip
    # count a tensor, saved in the checkpoint, which the plugin's own resume then refused
    m = RunMonitor(max_norm=max_norm, scaler_enabled=False)
    for s in range(1, 4):
        m.observe(StepLog(s, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0 if s != 2 else 0.5, grad_l2_post_clip=0.5,
                          scaler_scale=None))
    assert m.max_norm == 1.0 and type(m.clipped) is int and m.clipped == 2
    assert not [k for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)]
    RunMonitor(max_norm=1.0, scaler_enabled=False).load_state_dict(m.state_dict())


def test_monitor_non_finite_losses_are_no_scaler_search():
    # the loss is checked before it is scaled: NaN losses from step 1 are counted whole, fp16 or not
    m = RunMonitor(fail_rate=0.05, fail_after=3)
    fails = [s for s in range(1, 20) for e in m.observe(skip_record(s, "non_finite_loss")) if e.kind == "fail"]
    assert fails == [3] and m.opening == 0
    # and a loss skip ends the opening (step 1's overflow stays set aside): the overflows after it
    # count, from step 2 on, so the guard trips at step 4
    m = RunMonitor(fail_rate=0.05, fail_after=3)
    records = [skip_record(1, "non_finite_grad", scale=2.0**15), skip_record(2, "non_finite_loss", scale=2.0**14)]
    records += [skip_record(s, scale=2.0 ** (16 - s)) for s in range(3, 10)]
    assert [e.step for r in records for e in m.observe(r) if e.kind == "fail"] == [4]
    assert m.opening == 1 and not m.in_opening


def test_monitor_alert_after_the_opening_names_what_it_set_aside():
    # 6 opening skips set aside; 5 more at steps 101-105 are 5 of 99 judged steps (> 5%): ALERT at 105
    m = RunMonitor()
    events = [e for r in fp16_opening(6, 105, later_skips=tuple(range(101, 106))) for e in m.observe(r)]
    alerts = [e for e in events if e.kind == "skip_rate_alert"]
    assert [e.step for e in alerts] == [105]
    assert "over the last 99 steps (the scaler's opening 6 skips set aside)" in alerts[0].message
    assert alerts[0].data["skip_rate"] == 5 / 99 == m.judged_skip_rate
    assert m.skip_rate == 11 / 105


def test_monitor_with_a_later_skip_the_opening_counts_as_the_full_window_will_count_it():
    # window 20: the opening alone is set aside; a later skip beside it makes the rate at least the
    # window's 5 skips over its 20 steps (what it reads once full), or the later skip's own rate
    # over the steps after the opening where that is higher; full, it is the rolling rate itself
    m = RunMonitor(window=20, min_steps=0)
    for r in fp16_opening(4, 40, later_skips=(12,)):
        m.observe(r)
        if r.step < 12:
            assert m.judged_skip_rate == 0.0, r.step
        elif r.step < 20:
            assert m.judged_skip_rate == max(1 / (r.step - 4), 5 / 20), r.step
        else:
            assert m.judged_skip_rate == m.skip_rate, r.step
    assert m.skip_rate == 0.0  # steps 21-40: the opening and step 12 have left the window


def test_monitor_51_skips_in_the_last_1000_steps_page_opening_or_not():
    # seed 000: the 1000-step rolling rate pages above 5%. 8 opening halvings + 43 later skips are
    # 51 of the first 1000 steps: the full window will read 5.1%, so the ALERT comes with the 51st
    # skip (step 930), though the later skips are never 5% of the steps after the opening
    m = RunMonitor()
    later = tuple(range(510, 940, 10))  # 43, spread: never 5% of the steps after the opening
    assert len(later) == 43
    records = fp16_opening(8, 1000, later_skips=later)
    events = [(r.step, e) for r in records for e in m.observe(r) if e.kind == "skip_rate_alert"]
    assert [step for step, _ in events] == [930] and m.judged_skip_rate == m.skip_rate == 51 / 1000
    assert events[0][1].message == ("rolling skip rate 0.051 > alert_rate 0.05 counting the window's 51 skips over its "
                                    "1000 steps (the scaler's opening 8 skips among them: the full window will hold them)")


@pytest.mark.parametrize("window", [20, 30])
def test_monitor_an_opening_alone_is_not_counted_the_step_the_window_fills(window):
    # 9 opening halvings, then clean steps: the window's only skips are the scaler's search. Counted
    # the step the window filled (no new skip), they read 9/20 = 0.45: an ALERT, and the fail-fast
    # stopped a healthy run 3 steps later. Judged 0 before, at and after the fill alike
    m = RunMonitor(window=window, alert_rate=0.05, fail_rate=0.3, fail_after=3, min_steps=5)
    for r in fp16_opening(9, window + 15):
        assert m.observe(r) == [], r.step
        assert m.judged_skip_rate == 0.0, r.step
        if r.step == window:
            assert m.skip_rate == 9 / window  # the rate shown counts them
    assert m.failed is None and not m.alerting and m.max_skip_rate == 0.0


def test_monitor_a_later_skip_joins_the_opening_in_a_full_window():
    # window 20: at step 21 the window holds steps 2-21, opening steps 2-9 and the later skip: the
    # full window's rate counts every skip, the seed's rule (9 of the last 20 steps); the opening
    # then leaves it a step at a time: 8/20, 7/20 (above 0.3 for 3 steps: the fail-fast)
    m = RunMonitor(window=20, alert_rate=0.05, fail_rate=0.3, fail_after=3, min_steps=5)
    events = [(e.step, e.kind) for r in fp16_opening(9, 23, later_skips=(21,)) for e in m.observe(r)]
    assert events == [(21, "skip_rate_alert"), (23, "fail")]
    assert m.judged_skip_rate == m.skip_rate == 7 / 20


def test_monitor_the_judged_rate_never_jumps_with_no_new_skip():
    # window 20: 9 opening halvings, a later skip at step 15, then clean steps. The opening was set
    # aside while the window was young (1/6, ..., 1/10 at step 19) and counted whole the step it
    # filled (0.5 at step 20: a fail-fast, no new skip). Now the later skip counts the window's
    # 10 skips over its 20 steps at once, and from then on the rate only falls or holds
    m = RunMonitor(window=20, alert_rate=0.05, fail_rate=0.3, fail_after=3, min_steps=5)
    judged = []
    for r in fp16_opening(9, 40, later_skips=(15,)):
        m.observe(r)
        judged.append(m.judged_skip_rate)
    assert judged[:14] == [0.0] * 14 and judged[14] == 10 / 20  # (steps 1-14, then 15)
    assert all(b <= a for a, b in zip(judged[14:], judged[15:]))  # no skip after step 15: never up
    assert m.failed is not None and m.failed.step == 17 and judged[-1] == 0.0


# ---------------------------------------------------------------------------- a saved state that does not fit
# A monitor's state comes from a checkpoint file. Each of these used to load as it was and fail
# mid-run (a str counter in an addition, a short ring indexed by pos) or go quietly wrong; now the
# load refuses it with a ValueError naming the field, before it changes anything.


def _mid_run_monitor() -> RunMonitor:
    """A monitor 21 steps in, the last with a NaN loss, after a held-out loss of 2 then one that diverged."""
    m = RunMonitor(**MIXED_ARGS)
    for r in _mixed_records()[:20]:
        m.observe(r)
    m.observe_eval({"val_loss": 2.0})
    m.observe(skip_record(21, "non_finite_loss"))
    m.observe_eval({"val_loss": float("nan")})
    return m


def _with(state: dict, path: str, value) -> dict:
    """A copy of ``state`` with the dotted ``path`` set to ``value``, or removed (``...``)."""
    state = copy.deepcopy(state)
    *parents, last = path.split(".")
    node = state
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return state


def refused_untouched(obj, state, said: str, canonical=lambda st: st) -> None:
    """``obj.load_state_dict(state)`` raises ``ValueError(said)`` and leaves ``obj`` as it was."""
    before = canonical(obj.state_dict())
    with pytest.raises(ValueError) as err:
        obj.load_state_dict(state)
    assert str(err.value) == said
    assert canonical(obj.state_dict()) == before


BAD_WINDOW = [
    ("ring", [0.0], "ring is a list of 1, expected a list of 4 finite numbers"),
    ("ring", [0.0, 1.0, "x", 0.0], "ring is a list of 4, expected a list of 4 finite numbers"),
    ("ring", [0.0, float("inf"), 0.0, 0.0], "ring is a list of 4, expected a list of 4 finite numbers"),  # no exact sum
    ("pos", 4, "pos is 4, expected an int in [0, 4)"),
    ("pos", -1, "pos is -1, expected an int in [0, 4)"),
    ("pos", 1.0, "pos is 1.0, expected an int in [0, 4)"),
    ("count", "x", "count is 'x', expected an int >= 0 that ends at pos 3 (pos = count mod 4)"),
    ("count", 10**6, "count is 1000000, expected an int >= 0 that ends at pos 3 (pos = count mod 4)"),  # (36c)
    ("count", 2, "count is 2, expected an int >= 0 that ends at pos 3 (pos = count mod 4)"),
    ("count", ..., "count is missing"),
    ("size", 5, "window was saved with size 5, this one has 4"),
]


@pytest.mark.parametrize(("key", "value", "said"), BAD_WINDOW,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_WINDOW)])
def test_rolling_window_refuses_a_saved_field_that_does_not_fit_and_stays_untouched(key, value, said):
    saved = RollingWindow(4)
    for v in (1, 0, 1):
        saved.push(v)
    window = RollingWindow(4)
    window.push(1)
    refused_untouched(window, _with(saved.state_dict(), key, value), said)
    with pytest.raises(ValueError, match="^the state is 'x', expected a mapping$"):
        window.load_state_dict("x")


BAD_HEALTH = [
    ("scale", "x", "scale is 'x', expected a finite number or None"),
    ("scales", [4.0, "x"], "scales is a list of 2, expected a list of at most 5 finite numbers"),
    ("scales", [4.0] * 6, "scales is a list of 6, expected a list of at most 5 finite numbers"),
    ("skipped.pos", 9, "skipped.pos is 9, expected an int in [0, 4)"),
    ("opening", "x", "opening is 'x', expected an int >= 0"),
    ("opening_open", 1, "opening_open is 1, expected True or False"),
    ("streak", -1, "streak is -1, expected an int >= 0"),
    ("peak", float("nan"), "peak is nan, expected a finite number or None"),
    ("fell", None, "fell is None, expected True or False"),
    ("streak", ..., "streak is missing"),
]


@pytest.mark.parametrize(("key", "value", "said"), BAD_HEALTH,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_HEALTH)])
def test_health_refuses_a_saved_field_that_does_not_fit_and_stays_untouched(key, value, said):
    saved = ScaleHealth(4, init_scale=8.0)
    feed(saved, [(4.0, True), (4.0, False), (8.0, False)])
    health = ScaleHealth(4, init_scale=8.0)
    feed(health, [(4.0, True)])
    refused_untouched(health, _with(saved.state_dict(), key, value), said)


BAD_MONITOR = [
    ("updates", "x", "updates is 'x', expected an int >= 0"),  # was: str + int in observe(), mid-run
    ("steps", -1, "steps is -1, expected an int >= 0"),
    ("opening", 2.5, "opening is 2.5, expected an int >= 0"),
    ("in_opening", 1, "in_opening is 1, expected True or False"),
    ("alerting", "no", "alerting is 'no', expected True or False"),
    ("max_skip_rate", 2.0, "max_skip_rate is 2.0, expected a number in [0, 1]"),
    ("best_loss", "x", "best_loss is 'x', expected a finite number or None"),
    ("eval_best", {"val_loss": float("nan")},
     "eval_best is a dict of 1, expected a mapping of names to finite numbers"),
    ("eval_last", {"val_loss": "x"}, "eval_last is a dict of 1, expected a mapping of names to numbers"),
    ("skips", {"non_finite_grad": -2}, "skips is a dict of 1, expected a mapping of names to ints >= 0"),
    ("last", {"loss": [1.0]}, "last is a dict of 1, expected a mapping of names to numbers or None"),
    ("skip_window.ring", [0.0], "skip_window.ring is a list of 1, expected a list of 6 finite numbers"),  # IndexError
    ("skip_window.pos", 6, "skip_window.pos is 6, expected an int in [0, 6)"),
    ("clip_window.count", None, "clip_window.count is None, expected an int >= 0 that ends at pos 3 (pos = count mod 6)"),
    ("health.streak", "x", "health.streak is 'x', expected an int >= 0"),
    ("health.skipped.ring", [0.0] * 7, "health.skipped.ring is a list of 7, expected a list of 6 finite numbers"),
]


@pytest.mark.parametrize(("key", "value", "said"), BAD_MONITOR,
                         ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_MONITOR)])
def test_run_monitor_refuses_a_saved_field_that_does_not_fit_and_stays_untouched(key, value, said):
    saved = json.loads(json.dumps(_mid_run_monitor().state_dict()))  # as a checkpoint holds it: loads
    assert math.isnan(saved["last"]["loss"]) and math.isnan(saved["eval_last"]["val_loss"])  # (non-finite: fine)
    RunMonitor(**MIXED_ARGS).load_state_dict(copy.deepcopy(saved))
    monitor = RunMonitor(**MIXED_ARGS)
    monitor.observe(skip_record(1))
    refused_untouched(monitor, _with(saved, key, value), said, canonical=canon)
    with pytest.raises(ValueError, match=rf"^state\.monitors\.run\.{re.escape(said)}$"):  # named in full
        monitor.check_state(_with(saved, key, value), "state.monitors.run.")


def test_run_monitor_checks_every_scalar_it_saves():
    """A scalar added to the state is checked too: a str in its place is refused, naming it."""
    saved = _mid_run_monitor().state_dict()
    for name in RunMonitor._SCALARS:
        with pytest.raises(ValueError, match=f"^{name} is 'x', expected "):
            RunMonitor(**MIXED_ARGS).load_state_dict(_with(saved, name, "x"))


@pytest.mark.parametrize(("key", "value", "said"), [
    ("sq", ..., "sq is missing"),
    ("sum.ring", [1.0, float("inf")], "sum.ring is a list of 2, expected a list of 2 finite numbers"),
    ("sq.pos", 2, "sq.pos is 2, expected an int in [0, 2)"),
])
def test_loss_spike_detector_refuses_a_saved_field_that_does_not_fit_and_stays_untouched(key, value, said):
    saved = LossSpikeDetector(window=2, z=1.0)
    saved.check(1.0), saved.check(3.0)
    detector = LossSpikeDetector(window=2, z=1.0)
    detector.check(1.0)
    refused_untouched(detector, _with(saved.state_dict(), key, value), said)


# ---------------------------------------------------------------------------- the run's end


def _fed(skipped: list[bool], **kwargs) -> RunMonitor:
    m = RunMonitor(scaler_enabled=False, **kwargs)
    for record in records_for(skipped):
        m.observe(record)
    return m


@pytest.mark.parametrize("steps", [1, 2, 30, DEFAULT_MIN_STEPS - 1])
def test_a_run_shorter_than_min_steps_that_skipped_above_alert_rate_alerts_at_its_end(steps):
    m = _fed([True] * steps)
    assert m.alert_episodes == 0 and not m.alerting  # never armed
    events = m.at_end(steps)
    assert [e.kind for e in events] == ["skip_rate_alert"] and events[0].step == steps
    assert ("over the run's 1 step," if steps == 1 else f"over the run's {steps} steps,") in events[0].message and m.alert_episodes == 1 and m.failed is None
    assert m.at_end(steps) == []  # once


def test_at_end_leaves_a_run_below_alert_rate_an_armed_run_and_an_empty_run_alone():
    assert _fed([False] * 19 + [True]).at_end(20) == []  # 0.05 is not above 0.05
    assert _fed([False] * 18 + [True] * 2).at_end(20)[0].kind == "skip_rate_alert"  # 0.10 is
    armed = _fed([True] * DEFAULT_MIN_STEPS)  # armed at min_steps: the rolling ALERT spoke already
    assert armed.alert_episodes == 1 and armed.at_end(DEFAULT_MIN_STEPS) == [] and armed.alert_episodes == 1
    assert RunMonitor().at_end(0) == []


@pytest.mark.parametrize(("skipped", "fails"), [
    ([True] * 30, True),  # every step above fail_rate 0.5: the whole run is the evidence
    ([True], True),  # the first step alone: a rate of 1.0
    ([False] + [True] * 29, False),  # step 1 read 0.0: not every step was above
    ([True, False] + [True] * 28, False),  # step 2 read 0.5: not above 0.5
])
def test_a_run_shorter_than_fail_after_fails_at_its_end_only_when_every_step_was_above_fail_rate(skipped, fails):
    m = _fed(skipped, fail_rate=0.5, fail_after=100)
    assert m.failed is None
    events = m.at_end(len(skipped))
    assert (m.failed is not None) == fails
    if fails:
        assert events[-1] is m.failed and m.failed.cause == FAIL_SKIP_RATE and m.failed.step == len(skipped)
    assert _fed(skipped, fail_after=100).at_end(len(skipped)) == [e for e in events if e.kind != "fail"]  # no fail_rate


def test_at_end_does_not_fail_a_run_again_or_one_long_enough_for_fail_after():
    m = _fed([True] * 5, fail_rate=0.5, fail_after=3)
    assert m.failed is not None and m.failed.step == 3
    assert [e.kind for e in m.at_end(5)] == ["skip_rate_alert"]  # the failure stands as it was
    assert m.failed.step == 3


def test_at_end_judges_the_whole_run_not_a_rollbacks_fresh_window_nor_a_short_window():
    # review: after a rollback at step 95 one skip in the 5 steps since read "0.200 over the run's 5 steps"
    m = _fed([False] * 95)
    m.restart_windows()
    for record in records_for([False] * 95 + [True] + [False] * 4)[95:]:
        m.observe(record)
    assert m.steps == 100 and m.at_end(100) == []  # 1 of 100: nothing to say
    # a window of 10 under min_steps 100: 2 skips in 40 steps is 0.05, not above (the window read 0.2)
    m = _fed([False] * 37 + [True, True, False], window=10)
    assert m.skip_rate == 0.2 and m.at_end(40) == []


def test_at_end_sets_the_fp16_opening_search_aside_as_the_rolling_rate_does():
    def search(step, scale):  # an opening overflow: the scaler halving from init_scale
        return skip_record(step, scale=scale)

    m = RunMonitor(init_scale=2.0**16)
    records = [search(s, 2.0**(16 - s)) for s in (1, 2, 3)] + [step_record(s, scale=2.0**13) for s in range(4, 11)]
    for record in records:
        m.observe(record)
    assert sum(m.skips.values()) == 3 and m.at_end(10) == []  # 3 opening halvings: the search, not failures
    m.observe(skip_record(11, scale=2.0**12))  # a later overflow counts: 1 of 8 judged steps
    assert [e.message.split(" > ")[0] for e in m.at_end(11)] == ["skip rate 0.125"]


@pytest.mark.parametrize(("steps", "fail_rate"), [(6, 0.5), (6, None), (150, 0.5)])
def test_an_opening_search_that_never_ended_is_judged_whole_at_the_end(steps, fail_rate):
    # fp16, every step an overflow, the floor not reached (a short run, or a high init_scale): the
    # whole run was "the scaler's opening search" and nothing was judged: 0 updates ended "finished",
    # exit 0, no alert, with fail-fast set. A search that finds no scale is no warm-up.
    m = RunMonitor(init_scale=2.0**127, min_scale=2.0**-126, fail_rate=fail_rate, fail_after=100)
    for s in range(1, steps + 1):
        m.observe(skip_record(s, scale=2.0**(127 - s)))
    assert m.failed is None and m.alert_episodes == 0  # (the rolling rules set the search aside)
    events = m.at_end(steps)
    assert events[0].kind == "skip_rate_alert" and events[0].message == (
        f"no step applied in the run's {steps} steps: the fp16 loss scale's search down from init_scale never found a "
        f"scale (now {2.0 ** (127 - steps):g})")
    if fail_rate is None:
        assert len(events) == 1 and m.failed is None
    else:
        assert events[1] is m.failed and m.failed.cause == FAIL_SKIP_RATE and m.failed.step == steps
        assert m.failed.message.endswith("a skip rate of 1 above fail_rate 0.5")
    # one step applied ends the search: its halvings before were the warm-up, as before
    m = RunMonitor(init_scale=2.0**127, min_scale=2.0**-126, fail_rate=fail_rate, fail_after=100)
    for s in range(1, steps):
        m.observe(skip_record(s, scale=2.0**(127 - s)))
    m.observe(step_record(steps, scale=2.0**(128 - steps)))
    assert m.at_end(steps) == [] and m.failed is None


@pytest.mark.parametrize("clear_rate,episodes", [(None, 1), (0.05, 14)])
def test_a_rate_hovering_at_the_threshold_pages_once_not_once_per_skip(clear_rate, episodes):
    # review_seeds10 #1: one skip every 19 steps is 5.26%, just above alert_rate 0.05. In a young
    # window k/n rises with each skip and falls between them: clearing at the threshold itself paged
    # 14 times in 361 steps; clearing at 0.8 x alert_rate (0.04) pages once, and stays up.
    skipped = [s % 19 == 0 for s in range(1, 362)]
    rates = reference_rates(skipped, 1000)
    expected = reference_episodes(rates, 0.05, min_steps=100, clear=clear_rate)
    m = RunMonitor(window=1000, alert_rate=0.05, clear_rate=clear_rate, scaler_enabled=False)
    got = [(e.step, {"skip_rate_alert": "ALERT", "skip_rate_clear": "CLEAR"}[e.kind])
           for r in records_for(skipped) for e in m.observe(r) if e.kind.startswith("skip_rate")]
    assert got == expected
    assert m.alert_episodes == episodes and m.alerting
    assert m.clear_rate == pytest.approx(0.04 if clear_rate is None else clear_rate)


def test_the_alert_clears_only_at_or_below_clear_rate():
    m = RunMonitor(window=4, alert_rate=0.5, clear_rate=0.25, scaler_enabled=False, min_steps=0)
    events = [m.observe(r) for r in records_for([True, True, True, False, False, False, False])]
    # rates 1, 1, 1, 0.75, 0.5 (at alert_rate: still up), 0.25 (at clear_rate: clears), 0
    assert [[e.kind for e in got] for got in events] == [["skip_rate_alert"], [], [], [], [], ["skip_rate_clear"], []]
    assert events[5][0].message == "rolling skip rate back to 0.250 <= clear_rate 0.25"


@pytest.mark.parametrize("key, rate", [("alert_rate", 5.0), ("alert_rate", -1.0), ("alert_rate", float("nan")),
                                       ("alert_rate", None), ("fail_rate", 2.0), ("fail_rate", -0.1), ("fail_rate", True)])
def test_a_rate_outside_zero_to_one_is_refused_where_the_config_would_refuse_it(key, rate):
    # review_27a #2: an integration builds its monitor from keyword arguments, not the config: a
    # fail_rate of 2 could never trip and an alert_rate of -1 paged every step, unsaid
    with pytest.raises(ValueError, match=rf"{key} must be a number in \[0, 1\], got {rate!r}"):
        RunMonitor(**{key: rate})


def test_the_rates_edges_are_taken():
    m = RunMonitor(alert_rate=1.0, fail_rate=0.0, clear_rate=0.0)
    assert (m.alert_rate, m.fail_rate) == (1.0, 0.0) and RunMonitor(alert_rate=0, fail_rate=1).fail_rate == 1


@pytest.mark.parametrize("clear_rate", [-0.01, 0.06])
def test_a_clear_rate_outside_zero_to_alert_rate_is_refused(clear_rate):
    with pytest.raises(ValueError, match=r"clear_rate must be in \[0, alert_rate 0.05\]"):
        RunMonitor(alert_rate=0.05, clear_rate=clear_rate)


def test_the_default_clear_level_is_the_decimal_one():
    # review_session10 #6: 0.35 x 0.8 is 0.27999999999999997 in floats: a rate of exactly 7/25 did not
    # clear, while the message said "clear_rate 0.28"
    m = RunMonitor(window=25, alert_rate=0.35, scaler_enabled=False, min_steps=0)
    assert m.clear_rate == 0.28
    events = [(e.step, e.kind) for r in records_for([True] * 9 + [False] * 20) for e in m.observe(r)]
    # step 27: the window holds steps 3..27, skips 3..9: 7/25 = 0.28, the clear level (0.27999... cleared at 28)
    assert events == [(1, "skip_rate_alert"), (27, "skip_rate_clear")]


def test_a_rollback_restarts_the_count_of_skips_at_the_scale_floor():
    # review_tests14 #4: the floor and a rollback together. restart_windows() (a rollback) must drop the
    # steps skipped at the floor before it: kept, the collapse fail-fast fired one step after the
    # rollback, counting steps the rollback had undone
    def skip(step):
        return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                       scaler_scale=1.0, reason="non_finite_grad")

    m = RunMonitor(window=50, init_scale=1.0, min_scale=1.0, fail_on_scale_collapse=True, fail_after=3, min_steps=0)
    for step in (1, 2):
        m.observe(skip(step))
    m.restart_windows()
    m.observe(skip(3))
    assert m.failed is None and m.at_floor_skipped == 1
    for step in (4, 5):
        m.observe(skip(step))
    assert m.failed is not None and m.failed.step == 5


def test_a_run_of_exactly_min_steps_is_judged_by_the_rolling_rule_not_again_at_its_end():
    # review_tests14 #5: the window-not-yet-full edge at its boundary. 20 steps = min_steps = window:
    # five skips early: armed and judged at step 20 (the rolling rule's ALERT), so at_end says
    # nothing; one step fewer is a run too short to arm, judged whole at its end
    full = _fed([True] * 5 + [False] * 15, window=20, min_steps=20)
    assert full.alert_episodes == 1 and full.at_end(20) == []
    assert [e.kind for e in _fed([True] * 5 + [False] * 14, window=20, min_steps=20).at_end(19)] == ["skip_rate_alert"]
    # review_51i: a window of 10 below min_steps 20 is armed once full, at step 10: the early burst
    # alerts then (it had slid out of the window by step 20, unjudged: 0 episodes beside a max rate 0.5)
    small = _fed([True] * 5 + [False] * 14, window=10, min_steps=20)
    assert small.alert_episodes == 1 and small.at_end(19) == []


# ---------------------------------------------------------------------------- LossSpikeDetector


def _fill(detector: LossSpikeDetector, values) -> None:
    for v in values:
        assert detector.check(v) is False


def test_spike_detector_judges_nothing_until_its_window_is_full():
    d = LossSpikeDetector(window=5, z=3.0)
    _fill(d, [1.0, 1.0, 1.0, 1.0])
    assert d.check(1e9) is False  # fifth value: the window was not full, so it joins it
    d2 = LossSpikeDetector(window=5, z=3.0)
    _fill(d2, [1.0, 1.1, 0.9, 1.0, 1.05])
    assert d2.check(1e9) is True  # now it is judged


def test_spike_detector_flags_a_value_above_mean_plus_z_std():
    values = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    threshold = mean + 2.5 * std
    below, above = threshold - 1e-9, threshold + 1e-9
    d = LossSpikeDetector(window=6, z=2.5)
    _fill(d, values)
    assert d.check(above) is True
    assert d.check(above) is True  # the spike did not enter the window
    d = LossSpikeDetector(window=6, z=2.5)
    _fill(d, values)
    assert d.check(below) is False  # not a spike: it joins the window
    d = LossSpikeDetector(window=6, z=2.5)
    _fill(d, values)
    assert threshold == 2.75 and d.check(threshold) is False  # (mean 1.5, std 0.5: exact) at it, not above it


def test_a_flat_loss_is_never_a_spike():
    # a loss that settles exactly (0.0 once a model fits its data): the window's std is 0, its
    # threshold the loss itself; ">=" would call every later step a spike and roll back until the
    # rollbacks ran out (exit 3)
    for level in (0.0, 1.25):
        d = LossSpikeDetector(window=4, z=3.0)
        _fill(d, [level] * 4)
        assert [d.check(level) for _ in range(10)] == [False] * 10


def test_a_spike_does_not_enter_the_window_and_non_finite_losses_are_ignored():
    d = LossSpikeDetector(window=4, z=3.0)
    _fill(d, [1.0, 1.2, 0.8, 1.0])
    before = d.state_dict()
    assert d.check(50.0) is True
    for value in (None, float("nan"), float("inf")):
        assert d.check(value) is False
    assert d.state_dict() == before


def test_spike_detector_state_dict_round_trip():
    values = [0.5, 0.7, 0.6, 0.65, 0.55, 0.6, 0.62]
    a = LossSpikeDetector(window=5, z=4.0)
    _fill(a, values)
    b = LossSpikeDetector(window=5, z=4.0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for probe in (0.6, 0.9, 0.61, 5.0, 0.58):
        assert a.check(probe) == b.check(probe)
    assert a.state_dict() == b.state_dict()
    b.reset()
    assert b.check(100.0) is False  # after a reset it judges nothing until the window is full again
    with pytest.raises(ValueError):
        LossSpikeDetector(window=6, z=4.0).load_state_dict(a.state_dict())


@pytest.mark.parametrize("again", [3, 2, 0])
def test_a_step_observed_again_or_out_of_order_is_refused_and_counts_nothing(again):
    # review 33d: a record handed to observe() twice counted its skip twice (the rate over a window
    # whose steps did not move); one of an earlier step went back in time
    m = RunMonitor(window=10, scaler_enabled=False)
    for step in (1, 2):
        m.observe(step_record(step))
    m.observe(skip_record(3))
    with pytest.raises(ValueError, match=f"RunMonitor.observe: step {again} after step 3: each step is observed once"):
        m.observe(skip_record(again))
    assert (m.steps, dict(m.skips), m.updates) == (3, {"non_finite_grad": 1}, 2)
    m.observe(step_record(5))  # (a gap is no error: records of every other step are steps still)
    assert (m.steps, m.updates) == (5, 3)
