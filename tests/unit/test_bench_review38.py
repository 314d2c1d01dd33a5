"""Review 38b of ``ampguard bench``: an interrupt between cases is an interrupt (not a finished
bench), ``--processes --json`` held whole through a signal, ``--peak-tflops`` with models that
count no FLOPs, a fixed-rounds case cut by a failed step flagged under the table, a table that
stdout could not take, ``step_parts.py`` in whole cycles, and a biased A/A noise floor said so.

The signals are sent by the process to itself at a chosen point (a patched ``census`` or
``_time_steps``, as ``tests/e2e/pause_in_bench.py`` picks its points), never after a sleep;
nothing here asserts on a timing."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import FullStdout

from ampguard import bench
from ampguard import bench_processes as bp
from ampguard.bench import ERROR, INTERRUPTED, BareAgain, Result
from ampguard.cli import main

CUT_SHORT = "interrupted before a whole round of it was measured"  # (bench.CUT_SHORT, bench.NOT_STARTED)
NOT_STARTED = "not started: the bench was interrupted"

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--no-peers", "--no-aa", "--steps", "1", "--rounds", "2", "--warmup", "1", "--resolve", "0"]


def _signal_self(sig: int) -> None:
    """``sig`` to this process, as ``kill`` or Ctrl-C sends it; its handler raises at once (the
    sleep only stands in for the step it interrupts, and is never slept through)."""
    signal.raise_signal(sig)
    time.sleep(30)
    raise AssertionError(f"{signal.Signals(sig).name} did not interrupt")


# ---------------------------------------------------------------- #1: an interrupt between cases


@pytest.mark.parametrize("where", ["warmup", "first round"])
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_in_a_later_cases_warm_up_or_first_round_is_no_finished_bench(monkeypatch, capsys, where, sig,
                                                                                   code):
    # review 38b #1: Ctrl-C while the second case warmed up (or before its first whole round) exited 0,
    # with no "bench: interrupted" line, every stop "fixed" and not_run []: a complete-looking JSON
    # (SIGTERM at the same point gave 143: both signals now go the same way)
    if where == "warmup":
        census = bench.census

        def patched(c):
            if c.w.name == "tiny-mlp":  # the second case, after its first contender's warm-up
                _signal_self(sig)
            return census(c)

        monkeypatch.setattr(bench, "census", patched)
    else:
        time_steps = bench._time_steps

        def patched(c, steps, device):
            if c.w.name == "tiny-mlp":  # the second case's first timing: no whole round yet
                _signal_self(sig)
            return time_steps(c, steps, device)

        monkeypatch.setattr(bench, "_time_steps", patched)
    assert main(["bench", "--models", "nano,mlp,transformer", "--precisions", "fp32", *FAST, "--json"]) == code
    out, err = capsys.readouterr()
    data = json.loads(out)  # the cases measured before it, whole
    assert {(r["workload"], r["stop"]) for r in data["results"]} == {("nano-mlp", "fixed")}
    assert data["not_run"] == [
        {"workload": "tiny-mlp", "precision": "fp32", "contender": None, "why": CUT_SHORT},
        {"workload": "small-transformer", "precision": "fp32", "contender": None, "why": NOT_STARTED}]
    assert ("bench: interrupted; the rounds measured so far follow (tiny-mlp fp32: cut before a whole round, nothing "
            "measured; not started: small-transformer fp32)") in err.splitlines(), err
    assert "Traceback" not in err


def test_a_table_cut_between_cases_says_so_and_exits_130(monkeypatch, capsys):
    census = bench.census

    def patched(c):
        if c.w.name == "tiny-mlp":
            _signal_self(signal.SIGINT)
        return census(c)

    monkeypatch.setattr(bench, "census", patched)
    assert main(["bench", "--models", "nano,mlp", "--precisions", "fp32", *FAST]) == 130
    out, err = capsys.readouterr()
    assert "| nano-mlp | fp32 | bare loop |" in out and "| tiny-mlp" not in out
    # (review 39b #6: under the table, on stdout, where the table is read; it was on stderr only)
    assert ("bench: interrupted; the rounds above are those measured so far (tiny-mlp fp32: cut before a whole "
            "round, nothing measured)") in out.splitlines()
    assert "bench: interrupted" not in err


def test_the_cases_an_interrupt_in_the_rounds_left_unstarted_are_named(monkeypatch):
    # an interrupt in the first case's third round: its two whole rounds are kept (stop: interrupted),
    # and the case never reached is in not_run (the JSON read as if two cases were all asked)
    timed: list[str] = []

    def time_steps(c, steps, device):
        timed.append(c.name)
        if len(timed) == 5:
            raise KeyboardInterrupt
        return 1.0

    monkeypatch.setattr(bench, "_time_steps", time_steps)
    left_out: list[bench.NotRun] = []
    results = bench.run_bench(device=torch.device("cpu"), workloads=["nano", "mlp"], precisions=["fp32", "fp16"],
                              steps=1, rounds=4, warmup=1, peers=False, left_out=left_out)
    assert {(r.workload, r.precision, r.stop, len(r.rounds)) for r in results} == {("nano-mlp", "fp32", INTERRUPTED, 2)}
    assert [(n.workload, n.precision, n.why) for n in left_out] == [
        ("nano-mlp", "fp16", NOT_STARTED), ("tiny-mlp", "fp32", NOT_STARTED), ("tiny-mlp", "fp16", NOT_STARTED)]


# ---------------------------------------------------------------- #2: --processes --json held whole


def _child_json(ratio: float) -> dict:
    return {"results": [
        {"workload": "nano-mlp", "precision": "fp32", "contender": "bare loop", "ratio_to_bare": 1.0, "half_width": None},
        {"workload": "nano-mlp", "precision": "fp32", "contender": "ampguard + csv", "ratio_to_bare": ratio,
         "half_width": 0.01}]}


def launcher(tmp_path: Path, outputs: list[dict]):
    """``run_across``'s ``launch``: each process it starts prints the next of ``outputs`` as JSON."""
    scripts = []
    for i, output in enumerate(outputs):
        path = tmp_path / f"child{i}.py"
        path.write_text(f"import json; print(json.dumps({output!r}))", encoding="utf-8")
        scripts.append(str(path))

    def launch(argv):
        return subprocess.Popen([sys.executable, scripts.pop(0)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    return launch


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_processes_json_is_written_waits_until_it_is_whole(tmp_path, monkeypatch, capsys, sig, code):
    # review 38b #2: a SIGTERM while the parent wrote its JSON (into a pipe read slowly) cut it at 64 KiB
    # and exited 130: the final print was outside the held signals
    launch = launcher(tmp_path, [_child_json(ratio) for ratio in (1.1, 1.2)])
    real_run_across, real_to_json = bp.run_across, bp.to_json

    def to_json(*args, **kwargs):  # the signal arrives as the JSON is being written
        os.kill(os.getpid(), sig)
        return real_to_json(*args, **kwargs)

    monkeypatch.setattr(bp, "run_across", lambda n, child, **kw: real_run_across(n, child, **kw, launch=launch))
    monkeypatch.setattr(bp, "to_json", to_json)
    assert main(["bench", "--processes", "2", "--models", "nano", "--precisions", "fp32", *FAST, "--json"]) == code
    out, err = capsys.readouterr()
    data = json.loads(out)  # whole
    assert (data["ran"], data["stopped"], data["across"][0]["ratios"]) == (2, None, [1.1, 1.2])
    assert err.splitlines()[-1] == "ampguard: interrupted" and "Traceback" not in err


# ---------------------------------------------------------------- #3: --peak-tflops and models with no FLOPs


def test_peak_tflops_with_no_model_that_counts_flops_is_refused(capsys):
    # review 38b #3: it was silently ignored (the MLPs count no tokens: MFU never computed)
    for extra in ([], ["--processes", "2"]):
        assert main(["bench", "--quick", "--models", "mlp,nano", "--precisions", "fp32", "--no-peers",
                     "--peak-tflops", "989", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            "ampguard: error: bench: --peak-tflops gives MFU, which only the transformer and gpt2 models count (their "
            "FLOPs); mlp,nano count none: leave it out, or add a transformer"]


def test_peak_tflops_beside_a_transformer_gives_its_mfu_and_says_the_mlps_have_none(monkeypatch, capsys):
    # (the transformer stood in for by the nano MLP counting 4 tokens and 1000 FLOPs a step: fast; what
    # is tested is which rows get an MFU and the line under the table, not the transformer)
    def counted_nano(device, batch):
        return dataclasses.replace(bench._nano(device, batch), name="small-transformer", tokens_per_step=4,
                                   flops_per_step=1e3)

    monkeypatch.setitem(bench._WORKLOADS, "transformer", counted_nano)
    assert main(["bench", "--quick", "--models", "nano,transformer", "--precisions", "fp32", "--no-peers",
                 "--peak-tflops", "100"]) == 0
    out = capsys.readouterr().out
    rows = {(line.split("|")[1].strip(), line.split("|")[3].strip()): line.split("|")[11].strip()
            for line in out.splitlines() if line.startswith("| nano-mlp") or line.startswith("| small-transformer")}
    assert all(mfu.endswith("%") for (w, _), mfu in rows.items() if w == "small-transformer")
    assert all(mfu == "" for (w, _), mfu in rows.items() if w == "nano-mlp") and len(rows) == 4
    assert ("MFU: --peak-tflops 100 is used for the transformers only; nano-mlp counts no FLOPs (no tokens), so its "
            "MFU is empty") in out.splitlines()
    assert main(["bench", "--quick", "--models", "nano,transformer", "--precisions", "fp32", "--no-peers",
                 "--peak-tflops", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["peak_tflops"] == 100.0


# ---------------------------------------------------------------- #4: fixed rounds ended by a failed step


def _case(stop: str, detail: str | None, rounds: int = 4) -> list[Result]:
    return [Result("nano-mlp", "fp32", "bare loop", 1.0, 1.0, 1.0, rounds=[1.0] * rounds, stop=stop,
                   stop_detail=detail),
            Result("nano-mlp", "fp32", "ampguard + csv", 1.1, 1.1, 1.1, rounds=[1.1] * rounds, stop=stop,
                   stop_detail=detail)]


def test_fixed_rounds_cut_by_a_failed_step_or_an_interrupt_are_flagged_under_the_table():
    # review 38b #4: with --resolve 0, resolution() returned [] at once: a case with 4 of 20 rounds
    # (a CUDA OOM in round 5) read like a whole one
    detail = "RuntimeError: CUDA out of memory. (ampguard + csv, round 5)"
    assert bench.resolution(_case(ERROR, detail), None) == [
        f"nano-mlp fp32: fixed rounds cut short by a failed step: {detail}; its figures are from its 4 whole rounds"]
    assert bench.resolution(_case(INTERRUPTED, None, 2), None) == [
        "nano-mlp fp32: fixed rounds cut short by an interrupt; its figures are from its 2 whole rounds"]
    assert bench.resolution(_case("fixed", None), None) == []


def test_a_real_failed_step_in_fixed_rounds_is_flagged_in_the_table_output(monkeypatch, capsys):
    class FailsInRound3(bench.Guarded):
        calls = 0

        def step(self):
            FailsInRound3.calls += 1
            if FailsInRound3.calls > 1 + 1 + 3:  # warm-up, census, then round 3 (2 rounds: 3 steps, one untimed)
                raise RuntimeError("out of memory")
            super().step()

    monkeypatch.setattr(bench, "Guarded", FailsInRound3)
    assert main(["bench", "--models", "nano", "--precisions", "fp32", "--no-peers", "--no-aa", "--steps", "1",
                 "--rounds", "6", "--warmup", "1", "--resolve", "0"]) == 0
    out = capsys.readouterr().out
    flagged = [line for line in out.splitlines() if line.startswith("nano-mlp fp32: fixed rounds cut short")]
    assert flagged == ["nano-mlp fp32: fixed rounds cut short by a failed step: RuntimeError: out of memory "
                       "(ampguard + csv, round 3); its figures are from its 2 whole rounds"], out


# ---------------------------------------------------------------- #5: a table stdout could not take


_Full = FullStdout  # (a stdout on a full disk)


def test_a_table_that_stdout_could_not_take_exits_74(capsys, monkeypatch):
    # review 38b #5: `bench > /dev/full` warned and exited 0 (its --json exited 74)
    monkeypatch.setattr(sys, "stdout", _Full())
    assert main(["bench", "--quick", "--models", "nano", "--precisions", "fp32", "--no-peers", "--no-aa"]) == 74
    assert capsys.readouterr().err.splitlines()[-1] == (
        "ampguard: error: bench: the table could not be written to stdout (No space left on device)")


# ---------------------------------------------------------------- #6: step_parts.py in whole cycles


def test_step_parts_rounds_up_to_whole_cycles_of_the_orders_and_says_so(monkeypatch, capsys):
    # review 38b #6: the default --rounds 30 of 4 parts was 7.5 cycles: some parts first more often
    spec = importlib.util.spec_from_file_location("step_parts", ROOT / "benchmarks" / "step_parts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    timed: list[str] = []
    real = script.Bare.step

    def step(self):  # (the bare part's steps, counted: one a round with --steps 1, after 20 of warm-up)
        timed.append("bare")
        real(self)

    monkeypatch.setattr(script.Bare, "step", step)
    monkeypatch.setattr(sys, "argv", ["step_parts.py", "--model", "nano", "--precision", "fp32", "--rounds", "5",
                                      "--steps", "1"])
    script.main()
    out = capsys.readouterr().out
    assert "  8 rounds, not 5: whole cycles of the 4 orders (each part in each place alike)" in out.splitlines()
    assert len(timed) == 20 + 8


# ---------------------------------------------------------------- #7: a biased noise floor


def test_a_noise_floor_whose_interval_excludes_1_says_it_is_biased_and_by_how_much():
    # review 38b #7: the A/A copy read 0.2-0.8% faster than the bare loop in 5 of 7 runs, its interval
    # excluding 1, under a line saying "a ratio within it is not told apart from the bare loop"
    # (review 39b: the line says which way and by how much, not a cause: tests/unit/test_bench_review39.py)
    aa = Result("nano-mlp", "fp32", BareAgain.name, 1, 1, 0.992, ratio_low=0.987, ratio_high=0.996,
                rounds=[1.0] * 12)
    (line,) = bench.resolution([aa], None)
    assert line.startswith("nano-mlp fp32: noise floor (bare loop against itself) 0.992 [0.987, 0.996], its "
                           "interval excluding 1: the A/A copy, the same loop, read 0.8% faster than the bare loop "
                           "(0.4-1.3%),")
    assert line.endswith("a ratio within 1.3% of 1, either way, is not told apart from the bare loop")
    slower = Result("nano-mlp", "fp32", BareAgain.name, 1, 1, 1.01, ratio_low=1.004, ratio_high=1.02,
                    rounds=[1.0] * 12)
    assert "read 1.0% slower than the bare loop (0.4-2.0%)," in bench.resolution([slower], None)[0]
    fine = Result("nano-mlp", "fp32", BareAgain.name, 1, 1, 0.998, ratio_low=0.99, ratio_high=1.004, rounds=[1.0] * 12)
    assert bench.resolution([fine], None) == ["nano-mlp fp32: noise floor (bare loop against itself) 0.998 [0.990, "
                                              "1.004]: a ratio within it is not told apart from the bare loop"]
