"""Review 56l: the exit's wait for ``BackgroundSink`` writer threads. F1: a Ctrl-C in that wait
printed a raw ``KeyboardInterrupt`` traceback, and the sinks still writing were never said. F2: a
sink still referred to at exit (an uncaught crash's traceback keeps it, a module's global) was
closed with ``close()``, whose join has no bound: a stalled inner sink hung the exit for good. F5:
a thread stuck in the inner sink's ``close()`` after writing every row was said to lose its last
0 records, "still writing"."""

from __future__ import annotations

import sys
import threading
import time

import warm
from helpers import dropped_unclosed, read_rows

from ampguard import CsvSink, sinks


INTERRUPTED_EXIT = r'''
import os, signal, sys, threading, time, atexit
from ampguard import CsvSink, StepLog
from ampguard.sinks import BackgroundSink

closing = threading.Event()


class Hung(CsvSink):  # (a hung network disk: the write never returns)
    def write(self, record, extra=None):
        threading.Event().wait()


class HungClosing(CsvSink):  # (every row written, then an fsync that never returns)
    def close(self):
        closing.set()
        threading.Event().wait()


def crashed(sink, steps):
    for step in range(1, steps + 1):
        sink.write(StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0))
    raise RuntimeError("CUDA out of memory")


for sink, steps in ((Hung(sys.argv[1]), 3), (HungClosing(sys.argv[2]), 2)):
    try:
        crashed(BackgroundSink(sink), steps)
    except RuntimeError:
        pass  # (the sink was dropped unclosed: the exit waits for its thread)
assert closing.wait(timeout=60)


def ctrl_c_in_the_wait():
    time.sleep(1.0)  # (the exit is in its wait for the two threads by then)
    os.kill(os.getpid(), signal.SIGINT)


atexit.register(lambda: threading.Thread(target=ctrl_c_in_the_wait, daemon=True).start())  # (before the wait)
'''


def test_a_ctrl_c_in_the_exits_wait_says_each_sink_still_at_work_in_one_line(tmp_path):
    hung, closing = tmp_path / "hung.csv", tmp_path / "closing.csv"
    started = time.monotonic()
    done = warm.run([sys.executable, "-c", INTERRUPTED_EXIT, str(hung), str(closing)], cwd=tmp_path,
                    capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 25  # (not the 30 s bound: the Ctrl-C ended the wait)
    assert (done.returncode, done.stdout) == (0, "")
    assert done.stderr.splitlines() == [  # (no traceback)
        f"ampguard: a BackgroundSink nobody closed was still writing to its Hung {hung} when a Ctrl-C cut the "
        "exit's wait: it loses its last 3 records",
        f"ampguard: a BackgroundSink nobody closed was still closing its HungClosing {closing} when a Ctrl-C cut "
        "the exit's wait (every record written)"]
    assert [row["step"] for row in read_rows(closing)] == ["1", "2"]


HELD_AT_EXIT = r'''
import sys, threading
from ampguard import CsvSink, StepLog, sinks
from ampguard.sinks import BackgroundSink

sinks.DRAIN_AT_EXIT_S = 1.0


class Hung(CsvSink):  # (a hung network disk: the write never returns)
    def write(self, record, extra=None):
        threading.Event().wait()


HUNG = BackgroundSink(Hung(sys.argv[1]))  # (module globals: alive at exit, as a crashed loop's sink an
WELL = BackgroundSink(CsvSink(sys.argv[2]))  # uncaught exception's traceback keeps)
for step in (1, 2, 3):
    record = StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)
    HUNG.write(record)
    WELL.write(record)
'''


def test_a_sink_still_referred_to_at_exit_with_a_stalled_inner_sink_does_not_hang_the_exit(tmp_path):
    hung, well = tmp_path / "hung.csv", tmp_path / "well.csv"
    started = time.monotonic()
    done = warm.run([sys.executable, "-c", HELD_AT_EXIT, str(hung), str(well)], cwd=tmp_path,
                    capture_output=True, text=True, timeout=60)  # (it hung for good: killed here)
    assert time.monotonic() - started < 30
    assert (done.returncode, done.stdout, done.stderr) == (0, "", (
        "ampguard: a BackgroundSink nobody closed was still writing at exit after 1 s (its Hung "
        f"{hung} stalled: a hung disk?): it loses its last 3 records\n"))
    assert [row["step"] for row in read_rows(well)] == ["1", "2", "3"]  # (the other one: written and closed)


class _ClosingSlowly(CsvSink):
    """A CSV whose ``close()`` waits for ``gate`` (an fsync on a hung disk, until it is set)."""

    def __init__(self, path, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate, self.closing = gate, threading.Event()

    def close(self) -> None:
        self.closing.set()
        assert self.gate.wait(timeout=60)
        super().close()


def test_a_sink_stuck_closing_its_file_at_exit_is_said_so_not_losing_zero_records(tmp_path, capfd, monkeypatch):
    gate = threading.Event()
    inner = _ClosingSlowly(tmp_path / "steps.csv", gate)
    thread = dropped_unclosed(inner, (1, 2))
    monkeypatch.setattr(sinks, "DRAIN_AT_EXIT_S", 0.1)
    try:
        assert inner.closing.wait(timeout=30)
        sinks._join_draining()  # (what the exit runs)
        assert capfd.readouterr().err == (
            f"ampguard: a BackgroundSink nobody closed was still closing its _ClosingSlowly {tmp_path / 'steps.csv'} "
            "at exit after 0.1 s (every record written; its close() stalled: a hung disk?)\n")
    finally:
        gate.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [row["step"] for row in read_rows(tmp_path / "steps.csv")] == ["1", "2"]
