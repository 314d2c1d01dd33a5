"""The background writer, part of the benchmark's plumbing (``ampguard.sinks.BackgroundSink``: the
"ampguard + csv" contender writes through it on CUDA or sync-free). ``ampguard bench`` itself runs
in ``tests/e2e/test_bench_cli.py``."""

from __future__ import annotations

import csv
import threading
import time

import pytest
import torch

from ampguard.records import SkipLog, StepLog
from ampguard.sinks import BackgroundSink, CsvSink


def _record(step: int) -> StepLog | SkipLog:
    if step % 5 == 0:
        return SkipLog(step, 0.1, torch.tensor(float("nan")), None, None, torch.tensor(0.5), reason="non_finite_loss")
    return StepLog(step, 0.1, torch.tensor(float(step)), torch.tensor(2.0), torch.tensor(1.0), torch.tensor(1.0))


class SlowSink:
    """A sink that takes its time, so the queue really holds rows when the writer is closed."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False
        self.threads: set[str] = set()

    def write(self, record, extra=None) -> None:
        time.sleep(0.001)
        self.threads.add(threading.current_thread().name)
        self.steps.append(record.step)

    def close(self) -> None:
        self.closed = True


def test_background_writer_keeps_every_row_in_order(tmp_path):
    path = tmp_path / "steps.csv"
    sink = BackgroundSink(CsvSink(path))
    for step in range(1, 1501):
        sink.write(_record(step))
    sink.close()
    rows = list(csv.DictReader(path.open()))
    assert [int(r["step"]) for r in rows] == list(range(1, 1501))
    assert [r["skip_reason"] for r in rows[:5]] == ["", "", "", "", "non_finite_loss"]
    assert rows[1]["loss"] == "2.0" and rows[4]["loss"] == "nan"


def test_background_writer_drains_the_queue_when_closed_early():
    inner = SlowSink()
    sink = BackgroundSink(inner)
    for step in range(1, 201):
        sink.write(_record(step))
    assert len(inner.steps) < 200  # rows still queued when the loop stops
    sink.close()  # what the training loop's `finally` does after Ctrl-C
    assert inner.steps == list(range(1, 201)) and inner.closed
    assert inner.threads == {"ampguard-writer"}  # written off the training thread


def test_background_writer_drains_after_a_keyboard_interrupt():
    inner = SlowSink()
    sink = BackgroundSink(inner)
    with pytest.raises(KeyboardInterrupt):
        try:
            for step in range(1, 10_000):
                sink.write(_record(step))
                if step == 300:
                    raise KeyboardInterrupt
        finally:
            sink.close()
    assert inner.steps == list(range(1, 301))


def test_background_writer_reports_the_inner_sinks_error():
    class Broken(SlowSink):
        def write(self, record, extra=None) -> None:
            raise OSError("disk full")

    sink = BackgroundSink(Broken())
    sink.write(_record(1))
    with pytest.raises(OSError, match="disk full"):
        for step in range(2, 200):
            time.sleep(0.001)
            sink.write(_record(step))
        sink.close()


# ---------------------------------------------------------------------------- measure with no contender left (issue 16)


def test_measure_with_no_contender_left_is_an_empty_result(capsys):
    from ampguard.bench import Guarded, _mlp, measure
    from ampguard.precision import Precision

    closed = []

    class CannotBuild(Guarded):
        name = "cannot build"

        def __init__(self, *args):
            raise ModuleNotFoundError("no module named 'peer'")

    class FailsWarmUp(Guarded):
        name = "fails warm-up"

        def step(self):
            raise RuntimeError("no kernel")

        def close(self):
            closed.append(self.name)
            super().close()

    cpu = torch.device("cpu")
    results = measure(_mlp(cpu), Precision("fp32", "cpu"), cpu, [CannotBuild, FailsWarmUp], steps=1, rounds=3,
                      warmup=1, fused=False)
    assert results == []
    out = capsys.readouterr().out
    assert "cannot build: not run (ModuleNotFoundError" in out
    assert "fails warm-up: not run (RuntimeError: no kernel)" in out
    assert "tiny-mlp fp32: no contender could run, nothing measured" in out
    assert closed == ["fails warm-up"]  # its CSV folder was deleted


def test_speedups_say_slower_when_amp_is_slower_never_a_fraction_faster():
    from ampguard.bench import Bare, Guarded, Result, speedups

    results = [Result("mlp", "fp32", Bare.name, 0.458, 0.45), Result("mlp", "bf16", Bare.name, 0.642, 0.62),
               Result("mlp", "fp32", Guarded.name, 1.0, 1.0), Result("mlp", "fp16", Guarded.name, 0.5, 0.5)]
    assert speedups(results) == ["mlp, bare loop: bf16 is 1.40x slower than fp32",
                                 "mlp, ampguard + csv: fp16 is 2.00x faster than fp32"]
