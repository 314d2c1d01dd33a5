"""Review 55r: a ``BackgroundSink`` nobody closed kept its thread and its open file until the
process ended (its thread held the sink): one of each per run of a notebook cell that made one.
Dropped now, it is collected: the thread writes what was queued, closes the inner sink and ends."""

from __future__ import annotations

import gc
import threading

from helpers import GatedCsv, dropped_unclosed, read_rows, step_log

from ampguard import CsvSink
from ampguard.sinks import BackgroundSink


def test_a_background_sink_dropped_unclosed_writes_its_queue_closes_its_file_and_ends(tmp_path):
    gate, threads, inners = threading.Event(), [], []
    for run in range(3):  # (the notebook cell `bg = BackgroundSink(CsvSink(...))`, run three times)
        bg = BackgroundSink(GatedCsv(tmp_path / f"steps{run}.csv", gate))
        for step in (1, 2, 3):
            bg.write(step_log(step))
        threads.append(bg._thread)
        inners.append(bg.inner)
    del bg
    gc.collect()
    gate.set()  # (the rows handed before the sink was dropped are written all the same)
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert all(inner._file is None for inner in inners)  # (closed: the descriptor let go)
    for run in range(3):
        assert [row["step"] for row in read_rows(tmp_path / f"steps{run}.csv")] == ["1", "2", "3"]


def test_a_dropped_background_sinks_error_nobody_raised_is_one_line_on_stderr(tmp_path, capfd):
    class Full(CsvSink):
        def write(self, record, extra=None) -> None:
            if record.step == 2:
                raise OSError(28, "No space left on device")
            super().write(record, extra)

    thread = dropped_unclosed(Full(tmp_path / "steps.csv"), (1, 2, 3))
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert capfd.readouterr().err == ("ampguard: a BackgroundSink nobody closed could not write all its "
                                      "records: [Errno 28] No space left on device\n")
    assert [row["step"] for row in read_rows(tmp_path / "steps.csv")] == ["1"]
