"""Review 47a: the scale-health label ``oscillating`` against real fp16 runs.

Measured on every scale, a fall counted from the scaler's growth probe (the one step at 2**18
that overflows at once), so one stray skip at the working level read as a 2-octave fall and its
climb back as a rise: a fault-free charlm run read ``oscillating`` on 9 of its 15 STATS lines,
two stray skips 7,000 steps apart with ``train``'s defaults for the run's last 7,000 steps, and
``growth_factor`` 3 or ``backoff_factor`` 0.3 for a whole run on a constant gradient; while a
textbook swing (2**17 <-> 2**13, repeated) read ``collapsing`` after each fall and ``stable``
between. The legs are now those of the levels the scaler settled at (``growth_interval // 2``
applied steps in a row), ``oscillating`` comes before a collapse by trend, and ``report``
replays a ``growth_interval`` a resume changed.
"""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch

from ampguard.monitor import RunMonitor
from ampguard.records import SkipLog, StepLog
from ampguard.report import REPLAYED_POLICY, policy_changes_of, replay
from ampguard.sinks import Row

FP16_MAX = 65504.0

# A real run's scale, step by step: `ampguard train` of the tiny charlm task in fp16, no fault,
# scaler.growth_interval 20, monitor.window 100, 1500 steps (review 47a's R1c): "a17x19" is 19
# steps applied with the scale 2**17 after each, "S17" a step skipped that left it at 2**17.
HEALTHY_CHARLM = (
    "a16x19 a17x3 S16 a16x19 a17x3 S16 a16x19 a17 S16 a16x19 a17 S16 a16x19 a17x20 a18x8 S17 a17x19 a18 "
    "S17 a17x19 a18 S17 a17x19 a18 S17 a17x19 a18x4 S17 a17x19 a18 S17 a17x19 a18x2 S17 a17x16 S16 a16x19 "
    "a17x20 a18x10 S17 a17x19 a18 S17 a17x5 S16 a16x19 a17x20 a18x2 S17 a17x19 a18 S17 a17x19 a18x3 S17 "
    "a17x19 a18x2 S17 a17x19 a18x2 S17 a17x19 a18x4 S17 a17x19 a18x2 S17 a17x19 a18x2 S17 a17x19 a18 S17 "
    "a17x19 a18x3 S17 a17x19 a18x5 S17 S16 a16x19 a17x20 a18x4 S17 a17x8 S16 a16x19 a17x18 S16 a16x19 "
    "a17x20 a18x5 S17 a17x19 a18x2 S17 a17x17 S16 a16x19 a17x20 a18 S17 a17x19 a18x5 S17 a17x19 a18x2 S17 "
    "a17x7 S16 a16x19 a17x20 a18x2 S17 a17x19 a18x3 S17 a17x19 a18 S17 a17x18 S16 a16x19 a17x15 S16 "
    "a16x19 a17x20 a18x3 S17 a17x4 S16 a16x19 a17x20 a18 S17 a17x19 a18 S17 a17x19 a18x2 S17 a17x19 a18x2 "
    "S17 a17x14 S16 a16x19 a17x20 a18 S17 a17x19 a18x5 S17 a17x19 a18x3 S17 a17x19 a18 S17 a17x19 a18 S17 "
    "a17x19 a18x3 S17 a17x19 a18x6 S17 a17x19 a18x2 S17 a17x19 a18x2 S17 a17x19 a18x4 S17 a17x19 a18 S17 "
    "a17x19 a18 S17 a17 "
)


def _record(step: int, scale: float, skipped: bool) -> StepLog | SkipLog:
    if skipped:
        return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=math.inf, grad_l2_post_clip=None,
                       scaler_scale=scale, reason="non_finite_grad")
    return StepLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5, scaler_scale=scale)


def _expand(trace: str) -> list[tuple[float, bool]]:
    out = []
    for token in trace.split():
        kind, _, times = token.partition("x")
        out += [(2.0 ** int(kind[1:]), kind[0] == "S")] * int(times or 1)
    return out


def _scaler(grads, *, init=2.0**17, growth=2.0, backoff=0.5, interval=20):
    """(scale after, skipped) of torch's own scaler update for each gradient magnitude: a step
    overflows fp16 when scale x gradient passes its largest value (or the gradient is not finite)."""
    scale, tracker = torch.full((), init), torch.zeros((), dtype=torch.int32)
    found = (torch.tensor(0.0), torch.tensor(1.0))  # (the kernel reads found_inf; made once, not each step)
    for g in grads:
        overflow = not math.isfinite(g) or float(scale) * g > FP16_MAX
        torch._amp_update_scale_(scale, tracker, found[overflow], growth, backoff, interval)
        yield float(scale), overflow


def _labels(monitor: RunMonitor, trace, every: int = 10) -> collections.Counter:
    seen = collections.Counter()
    for step, (scale, skipped) in enumerate(trace, start=monitor.steps + 1):
        monitor.observe(_record(step, scale, skipped))
        if step % every == 0:
            seen[monitor.scale_verdict] += 1
    return seen


# ---------------------------------------------------------------------------- healthy runs


def test_a_real_fault_free_fp16_run_reads_stable_not_oscillating():
    trace = _expand(HEALTHY_CHARLM)
    assert len(trace) == 1500 and sum(s for _, s in trace) == 61  # (the growth probes, the odd stray skip)
    monitor = RunMonitor(window=100, init_scale=2.0**16, growth_interval=20, max_norm=None)
    seen = _labels(monitor, trace, every=100)
    assert set(seen) <= {"stable", "climbing"} and seen["stable"] >= 13, seen


def test_two_stray_skips_far_apart_at_trains_defaults_are_stable():
    # the lesson's healthy equilibrium (the steps apply at 2**17, the probe at 2**18 overflows), and two
    # batches 7,000 steps apart that overflow at the working level
    grads = [0.6 if step in (6000, 13000) else 0.4 for step in range(1, 20_001)]
    monitor = RunMonitor(window=1000, init_scale=2.0**16, growth_interval=2000, max_norm=None)
    seen = _labels(monitor, _scaler(grads, init=2.0**16, interval=2000), every=100)
    assert "oscillating" not in seen and monitor.scale_verdict == "stable", seen
    assert monitor.skips["non_finite_grad"] >= 6  # (the probes and the two strays)


@pytest.mark.parametrize("growth, backoff", [(3.0, 0.5), (2.0, 0.3), (4.0, 0.5), (2.0, 0.25)])
def test_a_scalers_own_equilibrium_is_stable_whatever_its_factors(growth, backoff):
    # with factors not powers of two the scale never repeats a level: the band it moves in is wider
    # than 2 octaves from the highest probe to the lowest backoff (review 47a: oscillating throughout)
    trace = list(_scaler([0.4] * 3000, init=2.0**16, growth=growth, backoff=backoff))
    monitor = RunMonitor(window=50, init_scale=2.0**16, growth_interval=20, max_norm=None)
    seen = _labels(monitor, trace)
    assert set(seen) <= {"stable", "climbing"}, seen
    assert sum(s for _, s in trace) >= 50  # (the scaler kept probing: an equilibrium, not a still scale)


# ----------------------------------------------------------------------- a real oscillation


def test_gradients_in_and_out_of_fp16_range_in_turn_read_oscillating_through_the_falls():
    # two regimes 16x apart, 100 steps each: the scale falls 2**17 -> 2**13 at each switch, and climbs
    # back in the next (review 47a: collapsing after each fall, stable between, never oscillating)
    grads = [0.4 if (step // 100) % 2 == 0 else 6.4 for step in range(4000)]
    monitor = RunMonitor(window=50, init_scale=2.0**17, growth_interval=20, max_norm=None)
    trace = list(_scaler(grads))
    assert min(s for s, _ in trace[200:]) <= 2.0**13 and max(s for s, _ in trace[200:]) >= 2.0**17
    early = _labels(monitor, trace[:600])
    late = _labels(monitor, trace[600:])
    assert late["oscillating"] >= 0.9 * sum(late.values()) and "collapsing" not in late, (early, late)
    assert monitor.health.swings() >= 3 and monitor.scale_verdict == "oscillating"


def test_one_dip_and_its_climb_back_in_a_window_longer_than_two_growths_is_not_oscillating():
    # review 47a: the window's own rule (a fall and a rise of 2 octaves in it) had no order and no repeat
    grads = [6.4 if step in (750, 751, 752) else 0.4 for step in range(1500)]
    monitor = RunMonitor(window=200, init_scale=2.0**17, growth_interval=20, max_norm=None)
    assert "oscillating" not in _labels(monitor, _scaler(grads), every=1)


# ------------------------------------------------------------ a growth interval changed on resume


def test_report_replays_a_growth_interval_a_resume_changed(tmp_path):
    grads = [1.2 if 350 <= step < 420 else 0.6 if step % 97 in (0, 1) else 0.4 for step in range(1, 781)]
    trace = list(_scaler(grads, init=2.0**17, interval=20))[:700] + \
        list(_scaler(grads, init=2.0**17, interval=50))[700:]  # (the shape of a resume; a trace is a trace)
    rows = [Row(step, 0.1, math.inf if skipped else 0.5, None if skipped else 0.5, 1.0, skipped,
                "non_finite_grad" if skipped else "", scale) for step, (scale, skipped) in enumerate(trace, start=1)]
    live = RunMonitor(window=100, init_scale=2.0**17, growth_interval=20, max_norm=None)
    for row in rows[:700]:
        live.observe(row.record())
    resumed = RunMonitor(window=100, init_scale=2.0**17, growth_interval=50, max_norm=None)  # train --resume --set
    resumed.load_state_dict(json.loads(json.dumps(live.state_dict())))
    for row in rows[700:]:
        resumed.observe(row.record())

    events = [{"step": 0, "event": "run_start"},
              {"step": 700, "event": "policy_change", "key": "scaler.growth_interval", "old": 20, "new": 50}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    policy = policy_changes_of(tmp_path)
    assert "scaler.growth_interval" in REPLAYED_POLICY and [c["key"] for c in policy] == ["scaler.growth_interval"]
    replayed = replay(rows, RunMonitor(window=100, init_scale=2.0**17, growth_interval=50, max_norm=None),
                      policy=policy)
    assert replayed.state_dict()["health"] == resumed.state_dict()["health"]
    unreplayed = replay(rows, RunMonitor(window=100, init_scale=2.0**17, growth_interval=50, max_norm=None))
    assert unreplayed.state_dict()["health"] != resumed.state_dict()["health"]  # (what report did before)


# ------------------------------------------------------------------ review 47d, on the fix


@pytest.mark.parametrize("interval", [1, 3, 5, 20])
def test_a_healthy_run_with_a_short_growth_interval_is_not_oscillating(interval):
    # batch-to-batch jitter of the gradient (lognormal, sigma 0.25): at growth intervals of 1 to 5 every
    # scale held 1 or 2 steps "settled", the probe too, and healthy runs read oscillating (review 47d)
    import random
    rng = random.Random(0)
    grads = [0.4 * math.exp(rng.gauss(0.0, 0.25)) for _ in range(3000)]
    monitor = RunMonitor(window=100, init_scale=2.0**16, growth_interval=interval, max_norm=None)
    seen = _labels(monitor, _scaler(grads, init=2.0**16, interval=interval))
    assert "oscillating" not in seen, seen


def test_the_growth_interval_read_off_rows_outvotes_a_resume_and_a_rollback():
    from ampguard.report import growth_interval_of

    def rows(trace):
        return [Row(step, 0.1, 0.5, 0.5, 1.0, False, "", scale) for step, scale in enumerate(trace, start=1)]
    # 2000 clean steps then a growth; later a resume that set the scale higher after 301 steps (review 47d):
    # one run each, the longer
    assert growth_interval_of(rows([2.0**16] * 1999 + [2.0**17] * 301 + [2.0**19]), 2.0**16) == 2000
    # growths after 20 clean steps, and a rollback that loaded the scaler back mid-count: one run of 35
    # (review 47f: the longest run read 35)
    trace = [2.0**10] * 19 + [2.0**11] * 20 + [2.0**12] * 35 + [2.0**13] * 20 + [2.0**14]
    assert growth_interval_of(rows(trace), 2.0**10) == 20


def _verdict_from_stats(h) -> str:
    """The label by the table (docs/design.md, "Scale health"), from :meth:`ScaleHealth.stats`'
    walk of the whole window: what the verdict, which reads only the window's ends, must say."""
    eps = 1e-9
    if h.at_floor and h._skipped.seen_mean > 0:
        return "collapsing"
    if h.streak > 8:
        return "collapsing"
    if h.swings() >= 3:
        return "oscillating"
    s = h.stats()
    if s.trend <= -3 + eps:
        return "collapsing"
    if s.warmup and s.swing == 0:
        return "warming"
    if s.trend > eps and not h._fell and h.scale == h.peak:
        return "climbing"
    return "stable"


@pytest.mark.parametrize("seed", range(6))
def test_the_verdict_from_the_windows_ends_is_the_tables(seed):
    # review 47d: a tracker asks for the label every step and it walked the window (~1 ms at 1000)
    import random
    from ampguard.monitor import ScaleHealth
    rng = random.Random(seed)
    init = 2.0 ** rng.choice([4, 16, 24])
    h = ScaleHealth(rng.choice([5, 30, 200]), min_scale=1.0, init_scale=init,
                    growth_interval=rng.choice([None, 8, 20]))
    grads = [(0.4 if rng.random() < 0.5 else 3.0) * math.exp(rng.gauss(0, 0.5)) for _ in range(1500)]
    grads = [math.inf if rng.random() < 0.02 else g for g in grads]
    for step, (scale, skipped) in enumerate(_scaler(grads, init=init, interval=h.growth_interval or 10), 1):
        h.push(scale, skipped)
        assert h.verdict == _verdict_from_stats(h), (seed, step)
