"""Review 56a: a ``BackgroundSink`` dropped unclosed (F1) had its at-exit close cancelled by its
finalizer, and its daemon thread was stopped by the exit mid-queue: a loop that crashed and whose
caller then ended lost up to ``max_pending`` rows. The exit waits for such a thread now (a bounded
time: a stalled inner sink is said, with what it loses). F2: a ``write`` whose record's
``prefetch()`` raised kept its room in the queue for good (``max_pending=1``: the next one hung)."""

from __future__ import annotations

import sys
import threading

import warm
from helpers import GatedCsv, dropped_unclosed, read_rows, step_log

from ampguard import CsvSink, StepLog, sinks
from ampguard.sinks import BackgroundSink


CRASHED_LOOP = r'''
import sys, time
from ampguard import CsvSink, StepLog
from ampguard.sinks import BackgroundSink


class Slow(CsvSink):  # (a network disk: rows are still queued when the script ends)
    def write(self, record, extra=None):
        time.sleep(0.002)
        super().write(record, extra)


def train(path):
    sink = BackgroundSink(Slow(path))
    for step in range(1, 301):
        sink.write(StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0))
    raise RuntimeError("CUDA out of memory")  # (the loop crashed: its close() never reached)


try:
    train(sys.argv[1])
except RuntimeError as err:  # (the caller says it and the script ends: the sink was collected)
    print("training failed:", err)
'''


def test_a_sink_dropped_unclosed_just_before_the_exit_writes_every_row_it_was_given(tmp_path):
    done = warm.run([sys.executable, "-c", CRASHED_LOOP, str(tmp_path / "steps.csv")], cwd=tmp_path,
                    capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "training failed: CUDA out of memory\n", "")
    assert [int(row["step"]) for row in read_rows(tmp_path / "steps.csv")] == list(range(1, 301))


def test_the_exit_waits_for_a_stalled_dropped_sink_a_bounded_time_then_says_what_it_loses(tmp_path, capfd,
                                                                                          monkeypatch):
    gate = threading.Event()
    thread = dropped_unclosed(GatedCsv(tmp_path / "steps.csv", gate), (1, 2, 3))
    monkeypatch.setattr(sinks, "DRAIN_AT_EXIT_S", 0.1)
    try:
        sinks._join_draining()  # (what the exit runs)
        assert thread.is_alive()  # (not waited for beyond the bound)
        assert capfd.readouterr().err == (
            "ampguard: a BackgroundSink nobody closed was still writing at exit after 0.1 s (its "
            f"GatedCsv {tmp_path / 'steps.csv'} stalled: a hung disk?): it loses its last 3 records\n")
        sinks._join_draining()  # (said once)
        assert capfd.readouterr().err == ""
    finally:
        gate.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert [row["step"] for row in read_rows(tmp_path / "steps.csv")] == ["1", "2", "3"]


def test_a_dropped_sinks_thread_is_let_go_once_it_wrote_its_queue(tmp_path):
    thread = dropped_unclosed(CsvSink(tmp_path / "steps.csv"), (1,))
    thread.join(timeout=30)
    assert not thread.is_alive() and thread not in sinks._DRAINING  # (a notebook keeps nothing of it)
    assert [row["step"] for row in read_rows(tmp_path / "steps.csv")] == ["1"]


class _Interrupted(StepLog):
    __slots__ = ()

    def prefetch(self):
        raise KeyboardInterrupt  # (a Ctrl-C landing in the copy's set-up)


def test_a_write_whose_prefetch_raised_leaves_its_room_in_the_queue(tmp_path):
    bg = BackgroundSink(CsvSink(tmp_path / "steps.csv"), max_pending=1)
    try:
        bg.write(_Interrupted(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0))
    except KeyboardInterrupt:
        pass
    returned = threading.Event()

    def write_next() -> None:
        bg.write(step_log(1))
        returned.set()

    threading.Thread(target=write_next, daemon=True).start()
    assert returned.wait(timeout=10), "the next write waits for room a raised prefetch kept"
    bg.close()
    assert [row["step"] for row in read_rows(tmp_path / "steps.csv")] == ["1"]
