"""``ampguard train``'s fast path against its exact path where a stop of another kind comes while
the record that trips a guard is still in flight (review 61e, found by fuzzing whole runs of both
paths). The exact path's guard stops the run at the step boundary it trips at, before that
boundary's stop signal is honoured and before the next batch is read; the fast path, up to
``LAG`` steps behind, judges the records in flight first, so the guard's stop is the run's end
there too (exit 3), not an interrupt (130) or bad data (2) beside a logged ``fail`` event.

The lag is made visible on the CPU as in ``test_fast_path_runs.py``: every record's copy stays
"in flight" until the loop must wait for it.
"""

from __future__ import annotations

import os
import signal

import pytest
from helpers import read_events, read_rows, train

import ampguard.records
from ampguard.data import DataStream
from ampguard.trainer import Trainer

# a skip at every step from 1: the rolling rate is 1.0 > 0.5 at steps 1 and 2, the fail-fast trips at 2
TRIPS_AT_2 = ("--set", "task.name=linear", "--set", "device=cpu", "--set", "log.plot=false", "--set", "steps=10",
              "--set", "precision=bf16", "--set", "checkpoint.every=0", "--set", "monitor.fail_rate=0.5",
              "--set", "monitor.fail_after=2", "--inject", "nan_loss@every:1")
STOPPED = "stopped by the guard at step 2: rolling skip rate above fail_rate 0.5 for 2 consecutive steps"


@pytest.fixture
def lagging(monkeypatch):
    """Every record's copy stays "in flight" until the loop must wait for it (LAG steps on)."""
    monkeypatch.setattr(ampguard.records.Prefetch, "landed", lambda self: False)


def _ended_by_the_guard(run, code, err, last_step):
    assert code == 3, err
    assert [int(r["step"]) for r in read_rows(run / "steps.csv")] == list(range(1, last_step + 1))
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "fail"] == [2]
    assert events[-1]["event"] == "run_end" and events[-1]["message"].startswith(STOPPED), events[-1]
    assert f"| ended | {STOPPED}" in (run / "RUN.md").read_text(encoding="utf-8")


def test_a_stop_signal_while_the_guards_trigger_is_in_flight_ends_the_run_as_the_guard_stops_it(
        tmp_path, lagging, monkeypatch):
    # the first SIGTERM (SLURM's) once step 3 is trained: on the fast path step 2, which trips the
    # fail-fast, is still in flight; on the exact path the guard stopped the run at step 2 already
    original = Trainer.train_step

    def train_step(self):
        record = original(self)
        if self.state.steps == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return record

    monkeypatch.setattr(Trainer, "train_step", train_step)
    for fast, last_step in (("false", 2), ("true", 3)):  # (the fast path trained step 3 before it read step 2's
        # record back: in the CSV, as any stop's steps after its trigger are)
        code, out, err = train(tmp_path, f"sig-{fast}", *TRIPS_AT_2, "--set", f"fast={fast}")
        _ended_by_the_guard(tmp_path / f"sig-{fast}", code, err, last_step)


def test_bad_data_read_while_the_guards_trigger_is_in_flight_ends_the_run_as_the_guard_stops_it(
        tmp_path, lagging, monkeypatch):
    # step 4's batch fails to read: on the fast path steps 2 and 3 are still in flight, and step 2
    # trips the fail-fast; the exact path never reads that batch
    original = DataStream.next

    def next_batch(self, first_step):
        if first_step == 4:
            raise ValueError("a record that does not parse")
        return original(self, first_step)

    monkeypatch.setattr(DataStream, "next", next_batch)
    for fast, last_step in (("false", 2), ("true", 3)):
        code, out, err = train(tmp_path, f"bad-{fast}", *TRIPS_AT_2, "--set", f"fast={fast}")
        _ended_by_the_guard(tmp_path / f"bad-{fast}", code, err, last_step)
        assert "bad data" not in err
