"""Review 46a: the scale-health label ``oscillating`` (the lesson's sign of a broken fp16 run: the
scale swinging between high and low) needed a fall and a rise of 2 octaves inside the monitor's
window, 1000 steps, while ``train``'s scaler grows once in 2000 clean steps: the label could never
be reached. With the scaler's growth interval the label also looks back over the window and two
2-octave climbs (ScaleHealth.reach) for a swing repeated (review 46c: one dip and its climb back
is no oscillation)."""
import collections
import functools

import pytest
import torch

from ampguard.build import build_monitor
from ampguard.config import load_config
from ampguard.monitor import RunMonitor, ScaleHealth
from ampguard.records import SkipLog, StepLog


def _records(overflow, steps, config, jumps=None):
    """A real scaler's scale after each step (torch's own update kernel) at ``config``'s settings;
    ``jumps``: {step: factor} the scale is multiplied by before that step's update (a checkpoint's restored)."""
    s = config.scaler
    scale, tracker = torch.full((), s.init_scale), torch.zeros((), dtype=torch.int32)
    found = (torch.tensor(0.0), torch.tensor(1.0))  # (the kernel reads found_inf; made once, not each step)
    for step in range(1, steps + 1):
        if jumps and step in jumps:
            scale.mul_(jumps[step])
            tracker.zero_()
        skipped = overflow(step)
        torch._amp_update_scale_(scale, tracker, found[bool(skipped)], s.growth_factor, s.backoff_factor,
                                 s.growth_interval)
        value = float(scale)
        yield (SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                       scaler_scale=value, reason="non_finite_grad") if skipped else
               StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5, scaler_scale=value))


def _labels(monitor, records, every=100):
    seen = collections.Counter()
    for record in records:
        monitor.observe(record)
        if record.step % every == 0:
            seen[monitor.scale_verdict] += 1
    return seen


def burst(step):  # 3 overflows in a row every 7000 steps (from step 7001): 3 octaves down, 6000 steps back
    return step > 7000 and step % 7000 in (1, 2, 3)


@functools.cache
def _burst_records() -> tuple:
    """The records of :func:`burst` at train's fp16 defaults, 24,000 steps: made once for the module, the
    tests that read them take the steps they need from the start (the monitors only read a record)."""
    return tuple(_records(burst, 24_000, load_config(None, ["precision=fp16"])))


def test_trains_defaults_see_a_scale_swinging_three_octaves_as_oscillating():
    config = load_config(None, ["precision=fp16"])
    assert (config.monitor.window, config.scaler.growth_interval) == (1000, 2000)  # (what the review found)
    monitor = build_monitor(config, scaler_enabled=True)
    assert monitor.health.reach == 1000 + 8 * 2000
    labels = _labels(monitor, _burst_records())
    assert labels["oscillating"] >= 20, labels
    # the same records through a monitor that is not told the growth interval: the window alone, never
    plain = RunMonitor(window=1000, init_scale=config.scaler.init_scale, min_scale=config.scaler.min_scale)
    assert "oscillating" not in _labels(plain, _burst_records()[:22_000])


def test_the_healthy_equilibrium_and_one_dip_that_leaves_the_span_are_not_oscillating():
    config = load_config(None, ["precision=fp16", "scaler.init_scale=131072"])
    # 2**17 <-> 2**18: one octave each way, at the default growth interval: stable over the long span too
    at_limit = iter(range(10**9))
    monitor = build_monitor(config, scaler_enabled=True)
    scales = []

    def overflow(step):  # 2**18 overflows 10 steps after the scale gets there
        return bool(scales) and scales[-1] >= 2.0**18 and next(at_limit) % 10 == 9

    seen = collections.Counter()
    for record in _records(overflow, 9000, config):
        monitor.observe(record)
        scales.append(record.scaler_scale)
        if record.step % 100 == 0:
            seen[monitor.scale_verdict] += 1
    assert {2.0**17, 2.0**18} == set(scales[2100:]) and "oscillating" not in seen, seen
    # review 47a: the levels are those the scaler settled at (1000 applied steps in a row, half its growth
    # interval). One dip of 2 octaves (steps 1500, 1501; settled at 2**15 by 2501), climbed back over 4000
    # steps (settled at 2**17 by 6501): 2 legs, never oscillating; a second dip once it is back up (7000,
    # 7001; settled at 8001): the swing repeated, oscillating (down, up, down; then up again by 12001); once
    # the last leg is a reach (17000 steps) behind, the swing is over: not
    dips = build_monitor(config, scaler_enabled=True)
    verdicts = {}
    checked = (2400, 2600, 6600, 7500, 8000, 8001, 12_000, 12_100, 29_000, 29_100)
    for record in _records(lambda step: step in (1500, 1501, 7000, 7001), 29_100, config):
        dips.observe(record)
        if record.step in checked:
            verdicts[record.step] = (dips.scale_verdict, dips.health.swings())
    assert [verdicts[s] for s in (2400, 2600, 6600, 7500, 8000)] == [
        ("stable", 0), ("stable", 1), ("stable", 2), ("stable", 2), ("stable", 2)], verdicts
    assert verdicts[8001] == verdicts[12_000] == ("oscillating", 3), verdicts
    assert verdicts[12_100] == verdicts[29_000] == ("oscillating", 4), verdicts  # (its last leg by 12001: in reach)
    assert verdicts[29_100] == ("climbing", 0), verdicts  # (nothing overflows it any more: new highs)


def test_the_long_span_survives_a_resume_and_an_older_state_or_a_bad_one_is_handled():
    config = load_config(None, ["precision=fp16"])
    records = _burst_records()[:17_000]
    a = build_monitor(config, scaler_enabled=True)
    for record in records[:15_500]:
        a.observe(record)
    b = build_monitor(config, scaler_enabled=True)
    b.load_state_dict(a.state_dict())  # (a resume: the moves come back with the rest)
    assert b.scale_verdict == a.scale_verdict == "oscillating"
    for record in records[15_500:]:
        a.observe(record)
        b.observe(record)
        if record.step % 50 == 0:
            assert b.scale_verdict == a.scale_verdict
    old = a.state_dict()
    for key in ("levels", "ups", "downs"):  # a checkpoint saved before the levels were kept: the span starts again
        del old["health"][key]
    old["health"]["moves"] = [[1, 2.0**15]]  # (the forty-sixth session's layout: left alone)
    c = build_monitor(config, scaler_enabled=True)
    c.load_state_dict(old)
    assert c.health.swings() == 0
    for levels in ([[5, 1024.0], [3, 2048.0]], [[25, 1e300], [26, 1e-300]],  # (review 46c's forgeries)
                   [[0, 5.0], [10**9, 2.0**16]], [[1, 4.0], [2, 4.0]]):
        bad = a.state_dict()
        bad["health"]["levels"] = levels
        with pytest.raises(ValueError, match=rf"health\.levels is a list of {len(levels)}, expected a list of "
                                             r"\[step, level\] pairs"):
            build_monitor(config, scaler_enabled=True).load_state_dict(bad)
    for sizes in ([[0.0, 3]], [[1.0, 0]], [[1.0, 2], [1.0, 3]], [["1", 2]]):
        bad = a.state_dict()
        bad["health"]["downs"] = sizes
        with pytest.raises(ValueError, match=r"health\.downs is .* expected a list of \[octaves, count\] pairs"):
            build_monitor(config, scaler_enabled=True).load_state_dict(bad)


def test_without_a_growth_interval_the_reach_is_the_window_and_the_levels_are_kept_four_reaches():
    h = ScaleHealth(8, init_scale=2.0**18)
    assert (h.reach, h.settle) == (8, 8)
    for scale, skipped in [(2.0**18, False), (2.0**17, True), (2.0**16, True), (2.0**17, False)]:
        h.push(scale, skipped)
    assert h.swings() == 0 and h.state_dict()["levels"] == []  # (no scale held 8 steps: a probe's, or a dip's)
    for block in range(20):  # the steps apply at 2**16 and 2**17 in turn, 10 at a time: a level each
        for _ in range(10):
            h.push(2.0 ** (16 + block % 2), False)
    levels = h.state_dict()["levels"]
    assert h.swings() == 0 and levels[0][0] <= 204 - 32 < levels[1][0] and len(levels) <= 5, levels
    with pytest.raises(ValueError, match="growth_interval must be a whole number of steps >= 1, got 0"):
        RunMonitor(growth_interval=0)


def test_the_climb_to_the_limit_before_one_dip_is_no_leg():
    # review 46d: 1024 -> 4096 (the scaler finding its limit), one double overflow back to 1024, the climb
    # back to 4096: counted from the first climb that read 3 legs, oscillating; from the first fall, 2.
    # (review 47a: a level counts once 25 steps in a row applied there, half the growth interval)
    config = load_config(None, ["precision=fp16", "scaler.init_scale=1024", "scaler.growth_interval=50",
                                "monitor.window=20"])
    monitor = build_monitor(config, scaler_enabled=True)
    assert (monitor.health.reach, monitor.health.settle) == (20 + 8 * 50, 25)
    seen = []
    for record in _records(lambda step: step in (140, 141, 280, 281), 320, config):
        monitor.observe(record)
        seen.append((record.step, record.scaler_scale, monitor.scale_verdict, monitor.health.swings()))
    assert [scale for step, scale, _, _ in seen if step in (125, 141, 266)] == [4096.0, 1024.0, 4096.0]
    assert not [row for row in seen if row[0] < 306 and row[2] == "oscillating"], seen
    assert seen[304][1:] == (1024.0, "stable", 2)  # (step 305: down again, 23 steps applied there)
    assert seen[305][1:] == (1024.0, "oscillating", 3)  # (step 306: settled at 1024, the swing repeated)


@pytest.mark.parametrize("factors", [["scaler.backoff_factor=0.25"], ["scaler.growth_factor=4.0"]])
def test_one_routine_move_of_two_octaves_is_no_leg(factors):
    # review 46e: with a backoff of 0.25 (or a growth of 4) each routine move is 2 octaves: the healthy
    # equilibrium (one overflow each time the scale reaches its limit) read oscillating; a leg must span
    # more than one move, so two overflows in a row (4 octaves with 0.25) still count
    config = load_config(None, ["precision=fp16", "scaler.growth_interval=50", "monitor.window=20", *factors])
    limit = 2.0**18
    monitor = build_monitor(config, scaler_enabled=True)
    last = [config.scaler.init_scale]

    def overflow(step):  # one overflow once the scale has been past the limit for longer than the window
        return len(last) > 25 and all(scale > limit for scale in last[-25:])

    for record in _records(overflow, 1500, config):
        monitor.observe(record)
        last.append(record.scaler_scale)
        assert monitor.scale_verdict != "oscillating", (record.step, last[-30:])
    assert len(set(last[200:])) >= 2  # (it did move: up to the limit and back, over and over)
    if factors == ["scaler.backoff_factor=0.25"]:
        double = build_monitor(config, scaler_enabled=True)
        last = [config.scaler.init_scale]
        pending = [0]

        def two_in_a_row(step):  # past the limit: two overflows in a row, 4 octaves down
            if last[-1] > limit:
                pending[0] = 2
            pending[0] -= 1
            return pending[0] >= 0

        seen = set()
        for record in _records(two_in_a_row, 1500, config):
            double.observe(record)
            last.append(record.scaler_scale)
            seen.add(double.scale_verdict)
        assert "oscillating" in seen, seen


def test_one_routine_move_of_two_octaves_is_no_swing_in_the_window_either():
    # growth_factor 4: 2**18 -> 2**20 in one growth, then one overflow back: inside one window a rise and
    # a fall of 2 octaves, each a single routine move (the window's rule read it oscillating)
    config = load_config(None, ["precision=fp16", "scaler.growth_interval=50", "monitor.window=20",
                                "scaler.growth_factor=4.0"])
    monitor = build_monitor(config, scaler_enabled=True)
    last = [config.scaler.init_scale]
    for record in _records(lambda step: last[-1] > 2.0**18, 1000, config):
        monitor.observe(record)
        last.append(record.scaler_scale)
        assert monitor.scale_verdict != "oscillating", (record.step, last[-5:])
    assert {2.0**18, 2.0**19, 2.0**20} <= set(last)


def test_one_jump_of_the_scale_does_not_hide_a_real_oscillation():
    # review 46f: bursts of 3 overflows every 400 steps (3 octaves down, climbed back in 150 steps at a
    # growth interval of 50); at step 3000 the scale set 8x higher in one step (a checkpoint's restored):
    # taken for the scaler's routine move, it made every swing need more than 3 octaves
    config = load_config(None, ["precision=fp16", "scaler.growth_interval=50"])
    monitor = build_monitor(config, scaler_enabled=True)
    seen = collections.Counter()
    for record in _records(lambda step: step > 500 and step % 400 in (1, 2, 3), 4000, config, jumps={3000: 8.0}):
        monitor.observe(record)
        if record.step > 3000 and record.step % 25 == 0:
            seen[monitor.scale_verdict] += 1
    assert seen == {"oscillating": 40}, seen
