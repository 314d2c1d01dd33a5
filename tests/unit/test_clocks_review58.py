"""Review 58c (time and clocks over long runs): one step the process stood still in (SIGSTOP ...
SIGCONT, a scheduler's suspend) set the torchrun stuck grace for the rest of the run (F2; two such
steps still did, and a step slow once did not, until session 60d timed steps by the run's clock); the
progress bar timed with the wall clock, which can be stepped (F4). The stuck-watcher's own count
(F1) is ``tests/unit/test_stuck_watch.py``'s; a step number past int64 in ``report`` and
``compare`` (F3), ``tests/e2e/test_report_hostile.py``'s."""

from __future__ import annotations

import io
import sys
import time

from ampguard import trainer as trainer_module
from ampguard.config import validate
from ampguard.events import progress_bar
from ampguard.run_folder import RunPaths
from ampguard.signals import STUCK_POLL_S
from ampguard.trainer import Trainer


def trainer_of(tmp_path, name: str, slow_steps: set[int], slow_s: float, stopped: set[int] = frozenset()) -> Trainer:
    """A linear run of 8 steps whose ``slow_steps`` each take ``slow_s`` s more, and in whose
    ``stopped`` steps the process stands still an hour (SIGSTOP ... SIGCONT) as the run's clock
    sees it: fed times, the monotonic clock moved on an hour with no tick of the stuck-watcher's
    (which ticks the clock every STUCK_POLL_S under torchrun; here each step's start ticks it)."""
    config = validate({"task": {"name": "linear"}, "steps": 8, "precision": "fp32", "device": "cpu",
                       "eval": {"enabled": False}, "checkpoint": {"enabled": False},
                       "log": {"dir": str(tmp_path / "runs"), "name": name, "plot": False}})
    trainer = Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=10**6, stats_every=None,
                      print_fn=lambda line: None, progress=False, resume=None)
    step, stood_still = trainer.train_step, [0.0]

    def train_step():
        if stopped:
            clock = trainer.stop_flag.ran  # (the run's: its loop times the step by it)
            clock.now = lambda: time.monotonic() + stood_still[0]
            clock.tick()  # (the watcher's look)
        if trainer.state.steps + 1 in stopped:
            stood_still[0] += 3600.0  # an hour the process did not run: nothing ticked through it
        if trainer.state.steps + 1 in slow_steps:
            time.sleep(slow_s)  # (a step that is slow: a recompile)
        return step()

    trainer.train_step = train_step  # type: ignore[method-assign]
    return trainer


# ---------------------------------------------------------------------------- F2: the stuck grace


def test_steps_the_process_stood_still_in_do_not_set_the_stuck_grace_however_many(tmp_path, monkeypatch):
    # the grace was 3 x the slowest step: after one suspension of an hour, the watcher waited ~3 h,
    # past any scheduler's kill, and so did every_rank_raised for a rank's data failure; then 3 x the
    # second slowest, which a second suspension set (session 60d)
    monkeypatch.setattr(trainer_module, "STUCK_AFTER_S", 0.0)  # (the floor, 10 s, would hide the steps' times)
    stopped = trainer_of(tmp_path, "stopped", set(), 0.0, stopped={3, 6})
    assert int(stopped.run().exit_code) == 0
    assert stopped._stuck_grace() < 3 * (2 * STUCK_POLL_S + 0.3)  # (what a late tick counts, and the step's own time)


def test_a_step_that_is_slow_once_sets_the_stuck_grace(tmp_path, monkeypatch):
    # a recompile: the next one was given 10 s (the second slowest step was a fast one), then the
    # rank waiting for the recompiling peer in a collective was taken as stuck (session 60d)
    monkeypatch.setattr(trainer_module, "STUCK_AFTER_S", 0.0)
    once = trainer_of(tmp_path, "once", {5}, 0.4)
    assert int(once.run().exit_code) == 0
    assert once._stuck_grace() >= 3 * 0.4


# ---------------------------------------------------------------------------- F4: the progress bar's clock


class _Terminal(io.StringIO):
    def isatty(self) -> bool:  # (tqdm draws its bar only on a terminal: disable=None)
        return True


def test_the_progress_bar_times_with_the_monotonic_clock_not_the_wall_clock(monkeypatch):
    # the wall clock stepped back a day showed a negative elapsed time ("-23:59:59") and stopped
    # the bar's refreshes; stepped forward a year, an elapsed time of 8760 h and an ETA of 61,341 h
    import tqdm.std

    wall = [time.time()]
    monkeypatch.setattr(tqdm.std, "time", lambda: wall[0])  # (tqdm's clock: `from time import time`)
    monkeypatch.setattr(sys, "stderr", _Terminal())
    bar = progress_bar(1000)
    try:
        for jump in (-86400.0, 365 * 86400.0):
            wall[0] += jump
            bar.update(100)
            bar.refresh()
            elapsed = bar.format_dict["elapsed"]
            assert 0 <= elapsed < 60, (jump, elapsed)
            assert "-" not in str(bar) and "8760:" not in str(bar), str(bar)
    finally:
        bar.close()
    assert "step" in sys.stderr.getvalue()  # (it drew)

