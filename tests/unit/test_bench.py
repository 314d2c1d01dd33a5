"""The background writer, part of the benchmark's plumbing (``ampguard.sinks.BackgroundSink``: the
"ampguard + csv" contender writes through it on CUDA or sync-free). ``ampguard bench`` itself runs
in ``tests/e2e/test_bench_cli.py``."""

from __future__ import annotations

import csv
import math
import threading
import time
import warnings

import pytest
import torch

from ampguard.precision import Precision
from ampguard.records import SkipLog, StepLog
from ampguard.sinks import BackgroundSink, CsvSink


def _record(step: int) -> StepLog | SkipLog:
    if step % 5 == 0:
        return SkipLog(step, 0.1, torch.tensor(float("nan")), None, None, torch.tensor(0.5), reason="non_finite_loss")
    return StepLog(step, 0.1, torch.tensor(float(step)), torch.tensor(2.0), torch.tensor(1.0), torch.tensor(1.0))


class SlowSink:
    """A sink that takes its time, so the queue really holds rows when the writer is closed; with a
    ``gate``, its first write waits until the gate is set (the rows after it certainly queued)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.steps: list[int] = []
        self.closed = False
        self.threads: set[str] = set()
        self.gate = gate

    def write(self, record, extra=None) -> None:
        if self.gate is not None:
            assert self.gate.wait(timeout=60)
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


def test_background_writer_refuses_an_undeclared_column_at_the_write_that_gave_it_and_writes_on(tmp_path):
    # the refusal came from the thread, at the next write, and no row after it was written
    path = tmp_path / "steps.csv"
    sink = BackgroundSink(CsvSink(path, extra_columns=["val_acc"]))
    sink.write(_record(1), {"val_acc": 0.5})
    with pytest.raises(ValueError, match="'val_loss' not among its columns"):
        sink.write(_record(2), {"val_loss": 0.1})
    sink.write(_record(3), {"val_acc": 0.75})
    sink.close()
    assert [(r["step"], r["val_acc"]) for r in csv.DictReader(path.open())] == [("1", "0.5"), ("3", "0.75")]


def test_background_writer_drains_the_queue_when_closed_early():
    gate = threading.Event()
    inner = SlowSink(gate)
    sink = BackgroundSink(inner)
    for step in range(1, 201):
        sink.write(_record(step))
    assert inner.steps == []  # every row still queued when the loop stops
    gate.set()
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


def test_background_writer_writes_nothing_after_the_inner_sinks_error():
    # a row that failed (the disk full at step 5) ends the file there: the rows queued after it are
    # not written, which would leave a CSV with a hole at step 5 that a resume refuses
    gate = threading.Event()

    class FailsAtFive(SlowSink):
        def write(self, record, extra=None) -> None:
            if record.step == 5:
                assert gate.wait(timeout=60)  # (until steps 6..10 are certainly queued behind it)
                raise OSError("disk full at step 5")
            super().write(record, extra)

    inner = FailsAtFive()
    sink = BackgroundSink(inner)
    for step in range(1, 11):
        sink.write(_record(step))
    gate.set()
    with pytest.raises(OSError, match="disk full at step 5"):
        sink.close()
    assert inner.steps == [1, 2, 3, 4]


def test_background_writer_begins_again_after_the_records_queued_before(tmp_path):
    # a Hugging Face auto_find_batch_size retry with a CSV written through the background writer:
    # the abandoned attempt's rows still queued reach the file first, then are set aside with the
    # rest; without begin_again they stayed and the retry's step 2 followed step 5 (refused)
    gate = threading.Event()

    class Slow(CsvSink):
        def write(self, record, extra=None) -> None:
            assert gate.wait(timeout=60)  # (until every row below is certainly queued)
            super().write(record, extra)

    path = tmp_path / "steps.csv"
    sink = BackgroundSink(Slow(path))
    for step in range(1, 6):
        sink.write(_record(step))
    threading.Timer(0.05, gate.set).start()
    assert sink.begin_again(1) == "steps.csv's 4 rows after it moved to steps.attempt-1.csv"
    for step in (2, 3):
        sink.write(_record(step))
    assert sink.begin_again(3) is None  # (nothing after step 3)
    sink.close()
    steps = lambda name: [int(r["step"]) for r in csv.DictReader((tmp_path / name).open())]  # noqa: E731
    assert steps("steps.csv") == [1, 2, 3] and steps("steps.attempt-1.csv") == [2, 3, 4, 5]


def test_background_writer_begins_again_only_where_its_sink_can():
    inner = SlowSink()
    sink = BackgroundSink(inner)
    for step in range(1, 4):
        sink.write(_record(step))
    assert sink.begin_again(1) is None  # (a sink with no begin_again keeps what it has)
    assert inner.steps == [1, 2, 3]  # (written before begin_again returned)
    sink.close()
    assert sink.begin_again(1) is None  # (closed: nothing queued to wait for)


def test_background_writer_begin_again_reports_the_inner_sinks_error(tmp_path):
    class Broken(CsvSink):
        def write(self, record, extra=None) -> None:
            raise OSError("disk full")

    sink = BackgroundSink(Broken(tmp_path / "steps.csv"))
    sink.write(_record(1))
    with pytest.raises(OSError, match="disk full"):
        sink.begin_again(0)
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
    left_out = []
    results = measure(_mlp(cpu), Precision("fp32", "cpu"), cpu, [CannotBuild, FailsWarmUp], steps=1, rounds=3,
                      warmup=1, fused=False, left_out=left_out)
    assert results == []
    assert [(n.workload, n.precision, n.contender, n.why) for n in left_out] == [  # for --json
        ("tiny-mlp", "fp32", "cannot build", "ModuleNotFoundError: no module named 'peer'"),
        ("tiny-mlp", "fp32", "fails warm-up", "RuntimeError: no kernel")]
    out = capsys.readouterr().out
    assert "cannot build: not run (ModuleNotFoundError" in out
    assert "fails warm-up: not run (RuntimeError: no kernel)" in out
    assert "tiny-mlp fp32: no contender could run, nothing measured" in out
    assert closed == ["fails warm-up"]  # its CSV folder was deleted


def test_a_ctrl_c_in_the_warm_up_closes_every_contender_already_built():
    # review (bench): an interrupt before the rounds left the contenders built so far open (Guarded's
    # CSV folder and writer) until the interpreter's exit
    from ampguard.bench import Bare, Guarded, _mlp, measure

    closed = []

    class Closes(Guarded):
        def close(self):
            closed.append(self.name)
            super().close()

    class Interrupted(Bare):
        name = "interrupted"

        def step(self):
            raise KeyboardInterrupt

    cpu = torch.device("cpu")
    with pytest.raises(KeyboardInterrupt):
        measure(_mlp(cpu), Precision("fp32", "cpu"), cpu, [Closes, Interrupted], steps=1, rounds=3, warmup=1,
                fused=False)
    assert closed == ["ampguard + csv"]


def test_a_contender_that_runs_other_work_than_its_row_is_left_out_and_said_so(capsys):
    """Measure only what was seen doing the same work: a loop that drops autocast under an fp16
    row (as Accelerate does on a CPU) or runs fp16 without a loss scaler is not timed beside the
    fp16 loops, and the line says what it ran; the loops that do run fp16 are kept."""
    from ampguard.bench import Bare, _nano, measure

    class NoAutocast(Bare):
        name = "no autocast"

        def step(self):
            x, y = self.w.batch
            self.w.loss_fn(self.model(x), y).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    class NoScaler(Bare):
        name = "no scaler"

        def step(self):
            x, y = self.w.batch
            with torch.autocast("cpu", dtype=torch.float16):
                loss = self.w.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    cpu = torch.device("cpu")
    results = measure(_nano(cpu), Precision("fp16", "cpu"), cpu, [Bare, NoAutocast, NoScaler], steps=1,
                      rounds=1, warmup=1, fused=False)
    out = capsys.readouterr().out
    assert [r.contender for r in results] == ["bare loop"]
    assert "no autocast: not run (its matrix products ran in float32, not fp16's float16" in out
    assert "no scaler: not run (it ran no loss scaler (no scaler.update)" in out
    # the same loops under the precision they do run are measured
    results = measure(_nano(cpu), Precision("fp32", "cpu"), cpu, [Bare, NoAutocast], steps=1, rounds=1,
                      warmup=1, fused=False)
    assert [r.contender for r in results] == ["bare loop", "no autocast"]


def test_a_contender_whose_every_step_skips_is_left_out_and_said_so(capsys):
    """review_seeds14 #4 (seed 001: measure only once the arithmetic is verified): a loop whose
    fp16 steps all overflow runs no optimizer and reads fast; it is not timed beside the loops
    that update, and one that skips some steps but updates is kept."""
    from ampguard.bench import Bare, _nano, measure

    class AlwaysOverflows(Bare):
        name = "always overflows"

        def step(self):
            x, y = self.w.batch
            with self.precision.autocast():
                loss = self.w.loss_fn(self.model(x), y) * float("inf")
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)  # (skipped: found inf)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)

    cpu = torch.device("cpu")
    results = measure(_nano(cpu), Precision("fp16", "cpu"), cpu, [Bare, AlwaysOverflows], steps=1, rounds=1,
                      warmup=2, fused=False)
    out = capsys.readouterr().out
    assert [r.contender for r in results] == ["bare loop"]
    assert "always overflows: not run (no step applied an update (every one skipped?): it would time other work)" in out


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_peers_that_fall_back_on_a_cpu_are_not_timed_as_fp16(precision, capsys):
    """Accelerate runs fp16 on a CPU as FP32 and Lightning Fabric as bf16: left out of the fp16
    row (the real frameworks); under bf16 both run it and are timed."""
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    from ampguard.bench import AccelerateLoop, Bare, FabricLoop, _nano, measure

    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's own warning about the fallback
        results = measure(_nano(cpu), Precision(precision, "cpu"), cpu, [Bare, AccelerateLoop, FabricLoop],
                          steps=1, rounds=1, warmup=1, fused=False)
    out = capsys.readouterr().out
    if precision == "bf16":
        assert [r.contender for r in results] == ["bare loop", "accelerate", "lightning fabric"]
        assert "not run" not in out
    else:
        assert [r.contender for r in results] == ["bare loop"]
        assert "accelerate: not run (its matrix products ran in float32, not fp16's float16" in out
        assert "lightning fabric: not run (its matrix products ran in bfloat16, not fp16's float16" in out


def test_fabric_built_for_fp16_on_a_cpu_says_no_raw_fallback_warning_of_its_own():
    """Review 58f: Fabric(precision="16-mixed") on a CPU warned, with its site-packages path, that it
    runs bf16 instead, inside the table's header; the bench's own "not run" line says so."""
    pytest.importorskip("lightning")
    from ampguard.bench import FabricLoop, _nano

    cpu = torch.device("cpu")
    fp16, workload = Precision("fp16", "cpu"), _nano(cpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FabricLoop(workload, fp16, cpu, fused=False)
    assert [str(w.message) for w in caught if "lightning" in w.filename] == []


def test_speedups_say_slower_when_amp_is_slower_never_a_fraction_faster():
    from ampguard.bench import Bare, Guarded, Result, speedups

    results = [Result("mlp", "fp32", Bare.name, 0.458, 0.45), Result("mlp", "bf16", Bare.name, 0.642, 0.62),
               Result("mlp", "fp32", Guarded.name, 1.0, 1.0), Result("mlp", "fp16", Guarded.name, 0.5, 0.5)]
    assert speedups(results) == ["mlp, bare loop: bf16 is 1.40x slower than fp32 (unpaired)",
                                 "mlp, ampguard + csv: fp16 is 2.00x faster than fp32 (unpaired)"]


# ---------------------------------------------------------------- paired rounds that resolve 1%


def test_the_ratio_is_taken_within_each_round_so_drift_cancels():
    # the machine slows down 32x over six rounds (clocks, other load); ampguard is 1% slower in
    # every round. Paired, the ratio is exactly 1.01 with no spread; the medians of the raw times
    # alone would mix rounds of different speeds.
    from ampguard.bench import Bare, Guarded, _ratios, median_interval

    times = {Bare.name: [1.0, 2.0, 4.0, 8.0, 16.0, 32.0], Guarded.name: [1.01, 2.02, 4.04, 8.08, 16.16, 32.32]}
    ratios = _ratios(times, Guarded.name)
    assert ratios == pytest.approx([1.01] * 6)
    med, low, high = median_interval(ratios)
    assert (med, high - low) == (pytest.approx(1.01), pytest.approx(0.0, abs=1e-12))


def test_the_interval_narrows_with_more_rounds_and_covers_the_median_95_times_in_100():
    import random

    from ampguard.bench import median_interval

    rng = random.Random(3)
    noisy = [1.02 + rng.gauss(0, 0.02) for _ in range(200)]
    few, many = median_interval(noisy[:10]), median_interval(noisy)
    assert few[1] <= few[0] <= few[2] and many[1] <= many[0] <= many[2]
    assert many[2] - many[1] < (few[2] - few[1]) / 2  # ~ 1/sqrt(n): 20x the rounds, < half the width
    # the true median 1.0, skewed rounds (a preempted round is slow, never fast), 2000 trials a size:
    # the bootstrap interval it replaced covered 92-93% at n = 12-20
    for n in (6, 7, 12, 20, 41):
        hits = 0
        for _ in range(2000):
            _, low, high = median_interval([rng.lognormvariate(0, 0.03) for _ in range(n)])
            hits += low <= 1.0 <= high
        assert hits / 2000 >= 0.94, (n, hits / 2000)
    assert all(math.isnan(v) for v in median_interval(noisy[:5])[1:])  # five rounds: no 95% interval


def _measure(**kw):
    from ampguard.bench import Bare, BareAgain, _mlp, measure
    from ampguard.precision import Precision

    cpu = torch.device("cpu")
    return measure(_mlp(cpu), Precision("fp32", "cpu"), cpu, [Bare, BareAgain], steps=1, warmup=1, fused=False, **kw)


def _fake_timings(monkeypatch, timing=lambda c, ran: 1.0, *, run_steps: bool = True):
    """Feed ``timing(contender, names timed so far)`` through ampguard's own timing function (the
    steps still run, unless ``run_steps`` is false: a test of the stop rule alone, whose rounds run
    no step, not even the untimed one that opens each round; the warm-up's still run), so the
    rounds' decisions do not hang on this machine's wall clock."""
    from ampguard import bench

    ran: list[str] = []

    def time_steps(c, steps, device):
        for _ in range(steps if run_steps else 0):
            c.step()
        ran.append(c.name)
        return timing(c, ran)

    monkeypatch.setattr(bench, "_time_steps", time_steps)
    if not run_steps:
        run_rounds = bench._run_rounds

        def without_steps(built, *args, **kwargs):
            for c in built:
                c.step = lambda: None  # (each round's untimed step too; the warm-up ran real ones)
            return run_rounds(built, *args, **kwargs)

        monkeypatch.setattr(bench, "_run_rounds", without_steps)
    return ran


def test_rounds_stop_when_resolved_at_the_least_number_when_the_goal_is_loose(monkeypatch):
    # resolved only at whole cycles of the balanced orders: two contenders' cycle is two
    # rounds, so the least number, 7, becomes 8 (a budget or max_rounds cuts anywhere). The
    # timings are fed, not measured: one preempted real timing made this test run 10 rounds
    import random

    rng = random.Random(0)
    _fake_timings(monkeypatch, lambda c, ran: 1.0 + rng.uniform(0, 0.5))  # within 1.5x of each other
    results = _measure(rounds=7, resolve=10.0)  # ±1000%: any two loops agree that well
    assert [(len(r.rounds), r.stop) for r in results] == [(8, "resolved")] * 2
    aa = results[1]
    assert aa.contender == "bare loop (A/A)" and aa.ratio_low <= aa.ratio_to_bare <= aa.ratio_high
    assert len(aa.ratios) == 8 and (results[0].ratio_to_bare, math.isnan(results[0].ratio_low)) == (1.0, True)
    # not resolving: as asked, rounded up to whole cycles (5 rounds put the bare loop first 3 times, its twin 2)
    assert [(len(r.rounds), r.stop) for r in _measure(rounds=5)] == [(6, "fixed")] * 2


def test_no_case_is_resolved_before_eight_rounds(monkeypatch):
    # `--rounds 1` with two contenders: a cycle is two rounds, and two identical timings give an
    # interval of zero width, but the stop rule decides on the 99% interval, which 7 rounds lack
    _fake_timings(monkeypatch)
    results = _measure(rounds=1, resolve=0.01, budget_s=1e9)
    assert [(len(r.rounds), r.stop) for r in results] == [(8, "resolved")] * 2


def test_a_resolved_case_reports_intervals_within_the_goal(monkeypatch):
    # a case called resolved to ±1% has every row within ±1% on both sides: the stop rule decides
    # on the 99% intervals, which hold the reported 95% ones. (With 400 bootstrap resamples to
    # decide and 2000 to report, seeds 1, 6, 10 and 11 here stopped "resolved" above ±1%.)
    import random

    from ampguard import bench

    resolved = 0
    for seed in range(14):
        rng = random.Random(seed)
        last: dict[str, float] = {}

        def timing(c, ran, rng=rng, last=last):
            if c.name == bench.Bare.name:
                last["bare"] = 1.0 + rng.gauss(0, 0.02)
                return last["bare"]
            return last["bare"] * (1.05 + rng.gauss(0, 0.02))

        _fake_timings(monkeypatch, timing, run_steps=False)  # (the rule's decisions: ~3000 steps not needed)
        cpu = torch.device("cpu")
        results = bench.measure(bench._mlp(cpu), Precision("fp32", "cpu"), cpu, [bench.Bare, bench.Guarded],
                                steps=1, rounds=6, warmup=1, fused=False, resolve=0.01, budget_s=1e9, max_rounds=200)
        if results[0].stop == "resolved":
            resolved += 1
            assert all(r.half_width <= 0.01 for r in results[1:]), (seed, [r.half_width for r in results])
            assert (results[0].ratio_to_bare, math.isnan(results[0].ratio_low)) == (1.0, True)  # the baseline
    assert resolved >= 10


def test_a_bare_loop_left_alone_is_resolved_only_when_its_rounds_agree():
    # every other contender failed to build or warm up: the bare loop's ratio to itself was 1 in
    # every round, an interval of zero width, "resolved" at once whatever its noise
    from ampguard.bench import Bare, _stop_reason

    rule = dict(rounds=1, cycle=1, resolve=0.01, budget_s=None, max_rounds=1000, started=time.perf_counter())
    noisy = {Bare.name: [1.47, 1.7, 1.34, 1.19, 1.51, 1.04, 1.3, 1.6]}
    assert _stop_reason(noisy, 8, **rule) is None
    assert _stop_reason({Bare.name: [1.0, 1.001] * 4}, 8, **rule) == "resolved"


def test_a_case_within_the_goal_but_cut_by_the_budget_says_why_it_is_not_called_resolved(monkeypatch):
    # the budget cuts at any round, the rule calls a case resolved only at the end of a whole
    # cycle: "not resolved to ±1% (...; widest ±0.2%)" read as a contradiction
    from ampguard import bench

    _fake_timings(monkeypatch)  # every timing 1.0: every interval of zero width
    cpu = torch.device("cpu")
    results = bench.measure(bench._mlp(cpu), Precision("fp32", "cpu"), cpu, [bench.Bare, bench.BareAgain, bench.Guarded],
                            steps=1, rounds=6, warmup=1, fused=False, resolve=0.01, budget_s=1e-9)
    # a cycle of three is six rounds, the least (review 52b: whole cycles), and 6 have no 99% interval
    assert [(len(r.rounds), r.stop) for r in results] == [(6, "budget")] * 3
    (line, floor) = bench.resolution(results, 0.01)
    assert line.startswith("tiny-mlp fp32: not resolved to ±1% (the time budget ran out after 6 rounds; widest ±0.0%")
    assert line.endswith(": within, at 95%, but the rule calls a case resolved on its 99% intervals at the end of a "
                         "whole cycle of the round orders)")
    assert floor.startswith("tiny-mlp fp32: noise floor (bare loop against itself) 1.000 [1.000, 1.000]")


def test_every_contender_runs_after_every_other_equally_often(monkeypatch):
    # what each contender ran right after, over a resolving run's rounds: every other
    # contender, equally often (a plain rotation put the A/A copy after the bare loop always)
    from ampguard import bench
    from ampguard.precision import Precision

    ran: list[str] = []
    monkeypatch.setattr(bench, "_time_steps", lambda c, steps, device: ran.append(c.name) or 1.0)
    cpu = torch.device("cpu")
    contenders = [bench.Bare, bench.BareAgain, bench.Guarded]
    measure_rounds = bench.measure(bench._mlp(cpu), Precision("fp32", "cpu"), cpu, contenders, steps=1, rounds=1,
                                   warmup=1, fused=False, resolve=10.0)[0].rounds
    assert len(measure_rounds) == 12 and len(ran) == 36  # three contenders (odd): cycles of six rounds
    rounds = [ran[i:i + 3] for i in range(0, 36, 3)]
    after = [(r[i], r[i + 1]) for r in rounds for i in range(2)]
    assert {pair: after.count(pair) for pair in after} == {pair: 4 for pair in set(after)} and len(set(after)) == 6


def test_across_round_boundaries_too_every_contender_follows_each_one_alike(monkeypatch):
    # the rounds run back to back: the step right before a contender's timed steps may be the
    # previous round's last contender. Over the whole stream of steps (timed or not), each
    # contender's timed steps follow itself, and each other contender, equally often; with
    # three contenders the bare loop and the A/A copy followed themselves at some round
    # boundaries, ampguard never
    from ampguard import bench

    stream: list[tuple[str, bool]] = []  # (contender, timed?) of every step, in order
    timing = {"on": False}

    def recording(cls):
        class Recorded(cls):
            def step(self):
                stream.append((self.name, timing["on"]))
                super().step()
        return Recorded

    def time_steps(c, steps, device):
        timing["on"] = True
        for _ in range(steps):
            c.step()
        timing["on"] = False
        return 1.0

    monkeypatch.setattr(bench, "_time_steps", time_steps)
    cpu = torch.device("cpu")
    contenders = [recording(cls) for cls in (bench.Bare, bench.BareAgain, bench.Guarded)]
    results = bench.measure(bench._nano(cpu), Precision("fp32", "cpu"), cpu, contenders, steps=2, rounds=12,
                            warmup=1, fused=False)
    assert [len(r.rounds) for r in results] == [12] * 3  # two whole cycles of six orders
    first_timed = [i for i, (name, timed) in enumerate(stream) if timed and not (stream[i - 1] == (name, True))]
    assert len(first_timed) == 36
    after = [(stream[i - 1][0], stream[i][0]) for i in first_timed]  # (what ran right before, the contender)
    names = [r.contender for r in results]
    counts = {(a, b): after.count((a, b)) for a in names for b in names}
    assert len({counts[(b, b)] for b in names}) == 1, counts  # each follows itself alike
    assert len({counts[(a, b)] for a in names for b in names if a != b}) == 1, counts  # and each other one


def test_an_interrupt_keeps_the_whole_rounds_measured_before_it(monkeypatch):
    # Ctrl-C (or the SIGTERM of a time limit) in round 4, after one contender ran in it: of the three
    # whole rounds, the two of the whole cycles are kept for every contender (review 34b: the third,
    # of a cycle cut short, ran the contenders in unequal places), and the case says it was interrupted
    from ampguard import bench
    from ampguard.precision import Precision

    ran: list[str] = []

    def time_steps(c, steps, device):
        ran.append(c.name)
        if len(ran) == 7:
            raise KeyboardInterrupt
        return 1.0 + len(ran) / 100

    monkeypatch.setattr(bench, "_time_steps", time_steps)
    cpu = torch.device("cpu")
    results = bench.measure(bench._mlp(cpu), Precision("fp32", "cpu"), cpu, [bench.Bare, bench.BareAgain],
                            steps=1, rounds=2, warmup=1, fused=False, resolve=1e-12, budget_s=1e9)
    assert [(len(r.rounds), r.stop) for r in results] == [(2, bench.INTERRUPTED)] * 2
    assert len(results[1].ratios) == 2


def test_an_interrupt_outside_the_rounds_hands_back_the_cases_measured(monkeypatch):
    from ampguard import bench

    class InterruptedWarmUp(bench.Bare):  # the second case's warm-up is interrupted
        name = "bare loop"

        def step(self):
            if self.w.name == "nano-mlp":
                raise KeyboardInterrupt
            super().step()

    monkeypatch.setattr(bench, "Bare", InterruptedWarmUp)
    with pytest.raises(bench.BenchInterrupted) as stopped:
        bench.run_bench(device=torch.device("cpu"), workloads=["mlp", "nano"], precisions=["fp32"], steps=1,
                        rounds=1, warmup=1, peers=False)
    assert [(r.workload, r.contender, r.stop) for r in stopped.value.results] == [
        ("tiny-mlp", "bare loop", "fixed"), ("tiny-mlp", "ampguard + csv", "fixed")]


def test_an_interrupt_in_a_cases_first_round_hands_back_the_cases_before_it(monkeypatch):
    from ampguard import bench

    calls: list[str] = []

    def time_steps(c, steps, device):  # the second case's first round is interrupted
        calls.append(c.w.name)
        if c.w.name == "nano-mlp":
            raise KeyboardInterrupt
        return 1.0

    monkeypatch.setattr(bench, "_time_steps", time_steps)
    with pytest.raises(bench.BenchInterrupted) as stopped:
        bench.run_bench(device=torch.device("cpu"), workloads=["mlp", "nano"], precisions=["fp32"], steps=1,
                        rounds=1, warmup=1, peers=False)
    assert [(r.workload, r.stop) for r in stopped.value.results] == [("tiny-mlp", "fixed")] * 2


def test_an_interrupt_before_anything_was_measured_exits_as_an_interrupt(monkeypatch):
    from ampguard import bench
    from ampguard.errors import ExitCode
    from ampguard.signals import Interrupted

    def step(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.Bare, "step", step)
    with pytest.raises(Interrupted) as stopped:
        bench.run(models="mlp", precisions="fp32", quick=True, peers=False)
    assert stopped.value.exit_code == ExitCode.INTERRUPTED


def test_rounds_are_added_until_the_most_rounds_when_the_goal_cannot_be_met():
    results = _measure(rounds=3, resolve=1e-12, max_rounds=6)  # no two timings agree to 1e-12
    assert [(len(r.rounds), r.stop) for r in results] == [(6, "max rounds")] * 2


def test_bench_pins_the_cpu_threads_and_says_when_a_case_was_not_resolved(capsys):
    from ampguard.bench import run

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the caller's own count (a notebook's): pinned to 1 for the bench, then back
        assert run(models="mlp", precisions="fp32", steps=1, rounds=3, warmup=1, peers=False, threads=1,
                   resolve_pct=0.001, budget_s=1e-9) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert ", 1 thread): at least 3 rounds x 1 step, paired, until ±0.001% or 1e-09 s a case" in out
    assert "| tiny-mlp | fp32 | bare loop (A/A) |" in out
    # (review 52b: the least rounds are whole cycles of the orders, six for three contenders)
    assert "tiny-mlp fp32: at least 6 rounds, not 3: the rounds run whole cycles of the 6 round orders" in out
    assert "tiny-mlp fp32: not resolved to ±0.001% (the time budget ran out after 6 rounds; widest ±" in out


def _ops(cls, precision="bf16", fused=True):
    from ampguard import bench
    from ampguard.precision import Precision

    cpu = torch.device("cpu")
    c = cls(bench._nano(cpu), Precision(precision, "cpu"), cpu, fused)
    try:
        for _ in range(2):  # past the optimizer's lazy state
            c.step()
        return bench.ops_per_step(c)
    finally:
        c.close()


@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp16"])
def test_the_guard_adds_a_handful_of_device_ops_to_the_bare_step(precision):
    """What a launch-bound model pays per kernel: the exact step adds the loss's mark, its seed,
    the read's stack and the post-clip norm's host tensor (no kernel on a GPU), and leaves out
    the bare loop's seed and clip-factor copy (+3); the
    sync-free one also computes its skip flag and its count on the device (its post-clip norm
    is the host's too), and fused AdamW undoes the step count with found_inf (+7). A change
    that adds a kernel to every step fails here, whatever the timings say."""
    from ampguard import bench

    bare = _ops(bench.Bare, precision)
    assert bare > 20
    assert _ops(bench.Guarded, precision) - bare <= 3
    assert _ops(bench.GuardedSyncFree, precision) - bare <= 7


def test_ops_are_counted_per_step_and_not_for_compiled_code():
    from ampguard import bench

    bare = _ops(bench.Bare)
    assert _ops(bench.Bare) == bare  # the same count every time

    class Twice(bench.Bare):
        def step(self):
            super().step()
            super().step()

    assert _ops(Twice) == 2 * bare

    class Compiled(bench.Bare):
        compiled = True
        steps = 0

        def step(self):
            Compiled.steps += 1

    assert _ops(Compiled) is None and Compiled.steps == 2  # its counted step never ran


def test_the_table_and_json_carry_ops_per_step(capsys):
    import json

    from ampguard import bench

    assert bench.run(models="nano", precisions="bf16", quick=True, peers=False, as_json=True) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["workload"] for r in rows] == ["nano-mlp", "nano-mlp"]
    assert all(r["ops"] > 0 for r in rows)
    # the exact path adds no op over the bare loop on a clipping step since its clip factor is the
    # host's (review 54f; it added 3 before), and never more than the 3 it had
    assert rows[1]["ops"] - rows[0]["ops"] in range(0, 4)


@pytest.mark.parametrize("batch", [None, 3])
def test_batch_sets_every_models_batch_size_and_the_json_says_it(batch, capsys):
    import json

    from ampguard import bench

    assert bench.run(models="nano,transformer", precisions="fp32", quick=True, peers=False, as_json=True,
                     batch=batch) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"]["batch"] == batch
    # tokens/s x seconds a step = the tokens a step: the transformer's batch x its context of 64
    tokens = {r["tokens_per_s"] * r["median_ms"] / 1000 for r in data["results"] if r["tokens_per_s"]}
    assert tokens and all(t == pytest.approx((batch or bench.BATCHES["transformer"]) * 64) for t in tokens)
    assert bench._WORKLOADS["nano"](torch.device("cpu"), batch or bench.BATCHES["nano"]).batch[0].shape[0] == (
        batch or 4)


def test_a_batch_below_one_is_refused_in_one_line(cli):
    code, out, err = cli("bench", "--models", "nano", "--batch", "0")
    assert code == 2 and out == "" and err.count("\n") == 1 and "--batch" in err


def test_the_transformers_flops_are_the_tasks_own_count():
    # position embeddings left out, as `ampguard train`'s MFU counts them: the same MFU for one model
    from ampguard import bench
    from ampguard.tasks.charlm import CharLM, flops_per_token

    w = bench._transformer(torch.device("cpu"), "small")
    assert w.flops_per_step == flops_per_token(CharLM(64, 2, 4, 64), 2, 64, 64) * w.tokens_per_step
    n = sum(p.numel() for p in w.make_model().parameters()) - 64 * 64  # (pos: context x width)
    assert w.flops_per_step == (6 * n + 12 * 2 * 64 * 64) * w.tokens_per_step


def test_the_cpu_threads_are_the_cpus_this_process_may_use(monkeypatch, capsys):
    # a scheduler's allocation (taskset, a cpuset): 1 of the host's 64 CPUs
    import json
    import os

    from ampguard import bench

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert bench.run(models="nano", precisions="fp32", quick=True, peers=False, as_json=True) == 0
        assert torch.get_num_threads() == 2  # (pinned to the one usable CPU while it measured: the JSON says so)
    finally:
        torch.set_num_threads(before)
    data = json.loads(capsys.readouterr().out)
    assert data["threads"] == 1 and ", 1 CPU, " in data["machine"]


def test_a_step_that_fails_in_a_round_ends_the_case_with_its_whole_rounds(monkeypatch, capsys):
    # a CUDA out-of-memory at a later step, say: the case keeps its whole rounds and says why
    from ampguard import bench

    calls: list[str] = []

    def time_steps(c, steps, device):
        calls.append(c.name)
        if len(calls) == 6:  # round 3's second contender
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")
        return 1.0 + len(calls) / 100

    monkeypatch.setattr(bench, "_time_steps", time_steps)
    cpu = torch.device("cpu")
    results = bench.measure(bench._nano(cpu), Precision("fp32", "cpu"), cpu, [bench.Bare, bench.Guarded],
                            steps=1, rounds=5, warmup=1, fused=False, resolve=0.01, budget_s=1e9)
    assert [len(r.rounds) for r in results] == [2, 2] and len(results[1].ratios) == 2
    failed = [c for c in calls[4:6] if c != calls[4]][0]
    assert {(r.stop, r.stop_detail) for r in results} == {
        (bench.ERROR, f"RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB ({failed}, round 3)")}
    assert f"nano-mlp fp32: {failed} failed in round 3 (RuntimeError: CUDA out of memory." in capsys.readouterr().out
    assert bench.resolution(results, 0.01)[0].startswith("nano-mlp fp32: not resolved to ±1% (error: ")


def test_a_failing_step_ends_its_case_and_the_bench_goes_on(monkeypatch, capsys):
    # a real failing step (no timing faked) in the first case's third round; the second case
    # runs as usual; a step that fails in the first round leaves its case out
    from ampguard import bench

    class FailsLater(bench.Guarded):
        # its steps: warm-up 1, the counted one 1, then 1 per round (2 when it runs first)
        def __init__(self, *args):
            super().__init__(*args)
            self.calls = 0

        def step(self):
            self.calls += 1
            if self.w.name == "tiny-mlp" and self.calls >= 6:  # (round 3: rounds 1-2 took 3 steps)
                raise RuntimeError("out of memory")
            if self.w.name == "nano-mlp" and self.calls >= 3:  # its first round
                raise RuntimeError("out of memory")
            super().step()

    monkeypatch.setattr(bench, "Guarded", FailsLater)
    left_out = []
    results = bench.run_bench(device=torch.device("cpu"), workloads=["mlp", "nano", "mlp"], precisions=["fp32"],
                              steps=1, rounds=4, warmup=1, peers=False, left_out=left_out)
    assert [(r.workload, len(r.rounds), r.stop, r.stop_detail) for r in results] == [
        ("tiny-mlp", 2, bench.ERROR, "RuntimeError: out of memory (ampguard + csv, round 3)")] * 4
    out = capsys.readouterr().out
    assert "nano-mlp fp32: ampguard + csv failed in round 1 (RuntimeError: out of memory); the case ends" in out
    # (review_session10 #4: the case left out was in neither --json's results nor its not_run)
    assert left_out == [bench.NotRun("nano-mlp", "fp32", None, "RuntimeError: out of memory (ampguard + csv, round 1)")]


def test_the_header_says_at_least_only_when_rounds_are_added(capsys):
    # "7 rounds x 30 steps ... until ±1%" above a table of 19 rounds: the rounds are the least number
    from ampguard.bench import run

    before = torch.get_num_threads()
    try:
        assert run(models="mlp", precisions="fp32", steps=1, rounds=2, warmup=1, peers=False, aa=False, threads=1,
                   resolve_pct=0.0) == 0
    finally:
        torch.set_num_threads(before)
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith("): 2 rounds x 1 step, paired, fixed rounds; 1 warm-up step a contender, no peers")
    assert "at least" not in header


def test_more_threads_than_usable_cpus_are_pinned_and_the_header_says_oversubscribed(monkeypatch, capsys):
    # allowed (a user may want to see contention), but the timings then measure threads sharing cores
    import os

    from ampguard import bench

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    before = torch.get_num_threads()
    try:
        assert bench.run(models="nano", precisions="fp32", quick=True, peers=False, threads=3) == 0
        assert torch.get_num_threads() == before  # (3 while it measured: the header says so)
        assert bench.run(models="nano", precisions="fp32", quick=True, peers=False, threads=1) == 0
    finally:
        torch.set_num_threads(before)
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("ampguard bench on")]
    assert ", 3 threads on 1 usable CPU (oversubscribed: the threads share cores))" in first
    assert "oversubscribed" not in second and ", 1 thread)" in second


@pytest.mark.parametrize("given", [{"models": "nano,mlp,nano"}, {"precisions": "fp32,fp32"}])
def test_a_model_or_precision_given_twice_is_refused(given):
    from ampguard import bench
    from ampguard.errors import InputError

    with pytest.raises(InputError, match=r"^bench: (model 'nano'|precision 'fp32') given twice$"):
        bench.run(**{"models": "nano", "precisions": "fp32", "quick": True, "peers": False, **given})


@pytest.mark.parametrize("most, kept", [(3, 2), (5, 4), (2, 2), (7, 6)])
def test_rounds_the_most_rounds_cut_inside_a_cycle_are_left_out_of_the_figures(most, kept):
    # review 34b: a budget stop at any round left some contenders first more often than others
    # (the H200 GPT-2 figures: one place 6 times, the others 5), and a contender's time depends on it.
    # (review 52b: the least rounds are whole cycles now, so a budget spent at once stops at them; the most
    # rounds, 2 past the least, cut inside a cycle as a budget running out later does)
    from ampguard.bench import Bare, BareAgain, _mlp, balanced_orders, measure

    cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
    assert len(balanced_orders(2)) == 2
    results = measure(_mlp(cpu), fp32, cpu, [Bare, BareAgain], steps=1, rounds=2, warmup=1, fused=False,
                      resolve=1e-9, budget_s=None, max_rounds=most)
    assert [(len(r.rounds), r.stop) for r in results] == [(kept, "max rounds")] * 2
    assert all(sorted(r.positions) == sorted([0, 1] * (kept // 2)) for r in results)  # every place alike
    cut = most - kept
    assert results[0].stop_detail == (None if not cut else
                                       "the last round, of a cycle of the round orders cut short, left out")
    if kept >= 6:
        assert results[1].ratio_low <= results[1].ratio_to_bare <= results[1].ratio_high
