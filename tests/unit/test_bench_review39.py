"""Review 39b of ``ampguard bench``: a signal while a JSON over 64 KiB is written into a pipe (it
was cut at 65,537 bytes), Ctrl-C to ``--processes`` while its process is blocked writing into the
pipe (a minute's hang), a signal just after a case's rounds (the case thrown away), one between a
case and its count (named both measured and cut), one between the bench and the hold on its output
(everything lost), the interrupted line of a table, ``--peak-tflops`` with only a left-out
transformer, and the A/A noise-floor line's wording.

Every signal is sent at a chosen point: by a patched function (its Nth call), to the main thread
once the pipe it writes into is full (the write then is inside ``write(2)``, blocked), or by a
trace function at the first line after a statement; nothing here waits on a timing."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch

from ampguard import bench
from ampguard import bench_processes as bp
from ampguard import signals
from ampguard.bench import BareAgain, Result
from ampguard.cli import main
from test_bench_review38 import launcher  # noqa: E402
from ampguard.signals import Interrupted, held_signals

CUT_SHORT = "interrupted before a whole round of it was measured"  # (bench.CUT_SHORT, bench.NOT_STARTED)
NOT_STARTED = "not started: the bench was interrupted"
FAST = ["--no-peers", "--no-aa", "--steps", "1", "--rounds", "2", "--warmup", "1", "--resolve", "0"]
DEADLINE_S = 120  # (only a broken test runs into it)


# ---------------------------------------------------------------- #1: a signal mid-write into a pipe


class SignalledPipe:
    """A pipe whose reader, once the pipe is full (the writer inside a blocked ``write(2)``), sends
    ``sig`` to the main thread (as the kernel gives a process's signal to it), then reads it all.
    Its ``writer`` is a text stream with no buffer, as stdout is under ``PYTHONUNBUFFERED=1`` or
    ``python -u`` (containers often set it): one ``write(2)`` a write, what it did not take dropped
    (a buffered one writes the rest after the signal)."""

    def __init__(self, sig: int) -> None:
        read, write = os.pipe()
        self.size = fcntl.fcntl(write, fcntl.F_GETPIPE_SZ)
        self.writer = io.TextIOWrapper(io.FileIO(write, "w"), encoding="utf-8", write_through=True)
        self.got, self.sent = bytearray(), False
        main = threading.main_thread().ident

        def reader() -> None:
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                if struct.unpack("i", fcntl.ioctl(read, termios.FIONREAD, b"\0" * 4))[0] >= self.size:
                    signal.pthread_kill(main, sig)
                    self.sent = True
                    break
                time.sleep(0.001)
            while chunk := os.read(read, 1 << 16):
                self.got += chunk
            os.close(read)

        self.thread = threading.Thread(target=reader, daemon=True)
        self.thread.start()

    def close(self) -> bytes:
        self.writer.close()
        self.thread.join()
        return bytes(self.got)


def test_a_signal_while_held_does_not_cut_a_write_blocked_on_a_full_pipe():
    # review 39b #1: held_signals' Python handler returned, the signal interrupted the blocked write(2)
    # part-way and print dropped the rest (65,537 of 222,304 bytes)
    text, mask = "x" * 222_303, signal.pthread_sigmask(signal.SIG_BLOCK, set())
    pipe = SignalledPipe(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        with held_signals():
            print(text, file=pipe.writer, flush=True)
    got = pipe.close()
    assert pipe.sent and stopped.value.exit_code == 143  # (the contract: the block runs on, then Interrupted)
    assert len(got) == len(text) + 1 and got == (text + "\n").encode()
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == mask  # (the mask as it was)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_bench_json_over_64_kib_written_into_a_pipe_is_whole_through_a_signal(monkeypatch, sig, code):
    real = bench.to_json

    def padded(*args, **kwargs):  # (a JSON of 240 rounds is as big; this one takes no time to measure)
        data = json.loads(real(*args, **kwargs))
        data["padding"] = "x" * 200_000
        return json.dumps(data, indent=2)

    monkeypatch.setattr(bench, "to_json", padded)
    pipe = SignalledPipe(sig)
    monkeypatch.setattr(sys, "stdout", pipe.writer)
    returned = main(["bench", "--quick", "--models", "nano", "--precisions", "fp32", "--no-peers", "--json"])
    monkeypatch.undo()
    data = json.loads(pipe.close())  # whole
    assert pipe.sent and returned == code
    assert {r["contender"] for r in data["results"]} == {"bare loop", "ampguard + csv"}


def _child_json(ratio: float) -> dict:
    return {"results": [
        {"workload": "nano-mlp", "precision": "fp32", "contender": "bare loop", "ratio_to_bare": 1.0, "half_width": None},
        {"workload": "nano-mlp", "precision": "fp32", "contender": "ampguard + csv", "ratio_to_bare": ratio,
         "half_width": 0.01}], "padding": "x" * 120_000}


def _launcher(tmp_path: Path, ratios: list[float]):
    return launcher(tmp_path, [_child_json(ratio) for ratio in ratios])


def test_the_processes_json_over_64_kib_written_into_a_pipe_is_whole_through_a_sigterm(tmp_path, monkeypatch):
    pipe = SignalledPipe(signal.SIGTERM)
    monkeypatch.setattr(sys, "stdout", pipe.writer)
    with pytest.raises(Interrupted) as stopped:
        bp.run_across(2, [], resolve=None, as_json=True, launch=_launcher(tmp_path, [1.1, 1.2]))
    monkeypatch.undo()
    data = json.loads(pipe.close())  # whole (222 KB)
    assert pipe.sent and stopped.value.exit_code == 143
    assert (data["ran"], data["stopped"], data["across"][0]["ratios"]) == (2, None, [1.1, 1.2])


# ---------------------------------------------------------------- #2: Ctrl-C while a process writes its JSON


def test_an_interrupt_ends_a_process_blocked_writing_its_json_into_the_pipe_without_a_kill(tmp_path, capsys):
    # review 39b #2: the parent's communicate() was interrupted and the pipe never read again; the child,
    # its SIGTERM held until its JSON (over 64 KiB) was whole, stayed blocked: SIGKILLed a minute later
    ready = tmp_path / "ready"
    child = tmp_path / "child.py"
    child.write_text(  # (as a bench does while it writes its JSON: SIGTERM held, then taken: exit 143)
        "import os, pathlib, signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "try:\n"
        "    sys.stdout.write('x' * 300000); sys.stdout.flush()\n"
        "except BrokenPipeError:\n"
        "    pass\n"
        "signal.sigwait({signal.SIGTERM})\n"
        "os._exit(143)\n", encoding="utf-8")
    procs = []

    class Blocked(subprocess.Popen):
        def communicate(self, *args, **kwargs):  # Ctrl-C, once the child holds SIGTERM
            deadline = time.monotonic() + DEADLINE_S
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise KeyboardInterrupt

        def wait(self, timeout=None):  # (a minute, where the child would hang: 5 s here)
            return super().wait(None if timeout is None else min(timeout, 5))

    def launch(argv):
        procs.append(Blocked([sys.executable, str(child)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             start_new_session=True))
        return procs[-1]

    assert bp.run_across(2, [], resolve=None, as_json=True, launch=launch) == 130
    out, err = capsys.readouterr()
    assert procs[0].returncode == 143  # ended by its SIGTERM, not SIGKILLed (-9)
    assert json.loads(out)["stopped"] == "interrupted"
    assert "bench: interrupted in process 1 of 2; the 0 processes before it follow" in err


# ---------------------------------------------------------------- #3: a signal just after a case's rounds


@pytest.mark.parametrize("where", ["results", "close"])
@pytest.mark.parametrize("models, expected, not_run", [
    ("nano", {("nano-mlp", "fixed", 2)}, []),
    ("nano,mlp,transformer", {("nano-mlp", "fixed", 2), ("tiny-mlp", "fixed", 2)},
     [{"workload": "small-transformer", "precision": "fp32", "contender": None, "why": NOT_STARTED}]),
], ids=["first case", "second case"])
def test_a_signal_after_a_cases_rounds_all_ran_keeps_the_case(monkeypatch, capsys, where, models, expected, not_run):
    # review 39b #3: a SIGTERM while the contenders were closed or _results ran threw the case away and
    # named it "cut before a whole round, nothing measured"; as the first case, exit 143 and no JSON
    last = models.split(",")[-1] if "transformer" not in models else "mlp"
    name = bench.w_name(last)
    sent = []
    if where == "results":
        real = bench._results

        def patched(w, *args, **kwargs):
            if w.name == name and not sent:
                sent.append(True)
                signal.raise_signal(signal.SIGTERM)
            return real(w, *args, **kwargs)

        monkeypatch.setattr(bench, "_results", patched)
    else:
        real_close = bench.Guarded.close

        def patched_close(self):
            if self.w.name == name and not sent:
                sent.append(True)
                signal.raise_signal(signal.SIGTERM)
            real_close(self)

        monkeypatch.setattr(bench.Guarded, "close", patched_close)
    assert main(["bench", "--models", models, "--precisions", "fp32", *FAST, "--json"]) == 143
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert sent and {(r["workload"], r["stop"], len(r["rounds"])) for r in data["results"]} == expected
    assert data["not_run"] == not_run
    assert "nothing measured" not in err and "Traceback" not in err


# ---------------------------------------------------------------- #4: a signal between a case and its count


def test_a_signal_just_after_a_case_was_measured_does_not_also_name_it_cut(monkeypatch):
    # review 39b #4: between `results += measure(...)` and `handled += 1` the case was in the results and
    # in not_run as "cut ... nothing measured"
    monkeypatch.setattr(bench, "_time_steps", lambda c, steps, device: 1.0)
    real = bench.measure
    state = {"rows": 0, "armed": False}

    def measure(*args, **kwargs):
        rows = real(*args, **kwargs)
        state["rows"] += len(rows)
        state["armed"] = True  # (the first case: the interrupt comes once its rows are in `results`)
        return rows

    def local(frame, event, arg):
        if event == "line" and state["armed"] and len(frame.f_locals["results"]) == state["rows"]:
            state["armed"] = False
            raise KeyboardInterrupt  # (as a signal's handler raises: at this line, before it runs)
        return local

    def calls(frame, event, arg):
        return local if frame.f_code is bench.run_bench.__code__ else None

    monkeypatch.setattr(bench, "measure", measure)
    left_out: list[bench.NotRun] = []
    sys.settrace(calls)
    try:
        with pytest.raises(bench.BenchInterrupted) as stopped:
            bench.run_bench(device=torch.device("cpu"), workloads=["nano", "mlp"], precisions=["fp32"], steps=1,
                            rounds=2, warmup=1, peers=False, left_out=left_out)
    finally:
        sys.settrace(None)
    assert {(r.workload, r.stop) for r in stopped.value.results} == {("nano-mlp", "fixed")}
    assert [(n.workload, n.precision, n.why) for n in left_out] == [("tiny-mlp", "fp32", NOT_STARTED)]


# ---------------------------------------------------------------- #5: a signal between the bench and the hold


def _signal_before_the_hold(monkeypatch, module, caller: str, sig: int) -> list[bool]:
    """``module.held_signals``, patched: ``sig`` sent just before ``caller``'s first hold is entered
    (``hold_output``: the bench's and the processes' hold on their output, review 52b)."""
    real, sent = signals.held_signals, []

    def held():
        if sys._getframe(1).f_code.co_name == caller and not sent:
            sent.append(True)
            signal.raise_signal(sig)
        return real()

    monkeypatch.setattr(module, "held_signals", held)
    return sent


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_between_the_bench_and_the_hold_on_its_output_keeps_the_results(monkeypatch, capsys, sig, code):
    # review 39b #5: after interrupted_by was left, before held_signals: exit 130, nothing printed
    sent = _signal_before_the_hold(monkeypatch, signals, "hold_output", sig)  # (it imports it from signals)
    assert main(["bench", "--models", "nano", "--precisions", "fp32", *FAST, "--json"]) == code
    out, err = capsys.readouterr()
    assert sent and {(r["workload"], r["stop"]) for r in json.loads(out)["results"]} == {("nano-mlp", "fixed")}
    assert "bench: interrupted; the rounds measured so far follow" in err.splitlines() and "Traceback" not in err


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_after_the_last_process_before_the_hold_keeps_their_rows(tmp_path, monkeypatch, capsys, sig, code):
    sent = _signal_before_the_hold(monkeypatch, signals, "hold_output", sig)
    real_run_across, launch = bp.run_across, _launcher(tmp_path, [1.1, 1.2])
    monkeypatch.setattr(bp, "run_across", lambda n, child, **kw: real_run_across(n, child, **kw, launch=launch))
    assert main(["bench", "--processes", "2", "--models", "nano", "--precisions", "fp32", *FAST, "--json"]) == code
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert sent and (data["ran"], data["stopped"], data["across"][0]["ratios"]) == (2, "interrupted", [1.1, 1.2])
    assert "bench: interrupted after process 2 of 2; the 2 processes before it follow" in err and "Traceback" not in err


# ---------------------------------------------------------------- #6: a table's interrupted line


@pytest.mark.parametrize("where", ["second case", "its rounds"])
def test_a_table_cut_by_an_interrupt_says_so_under_the_table(monkeypatch, capsys, where):
    # review 39b #6: only stderr said the bench was cut (stdout, the table, read as a whole bench)
    real, timed = bench._time_steps, []

    def patched(c, steps, device):
        timed.append(c.w.name)
        if (c.w.name == "tiny-mlp") if where == "second case" else len(timed) == 5:  # (round 3 of nano-mlp)
            signal.raise_signal(signal.SIGINT)
        return real(c, steps, device)

    monkeypatch.setattr(bench, "_time_steps", patched)
    args = [a if a != "2" else "4" for a in FAST] if where == "its rounds" else FAST  # (4 rounds: 2 kept)
    assert main(["bench", "--models", "nano,mlp", "--precisions", "fp32", *args]) == 130
    out = capsys.readouterr().out.splitlines()
    last_row = max(i for i, line in enumerate(out) if line.startswith("| nano-mlp"))
    said = {"second case": " (tiny-mlp fp32: cut before a whole round, nothing measured)",
            "its rounds": " (not started: tiny-mlp fp32)"}[where]
    assert out[last_row + 1] == "bench: interrupted; the rounds above are those measured so far" + said


# ---------------------------------------------------------------- minor: --peak-tflops, the noise floor


def test_peak_tflops_with_only_a_transformer_left_out_on_a_cpu_is_refused(monkeypatch, capsys):
    # review 39b: fp16 on a CPU leaves the transformer out, so no row had MFU: the case the MLPs alone are refused for
    ran = []
    monkeypatch.setattr(bp, "run_across", lambda *args, **kwargs: ran.append(True) or 0)
    for extra in ([], ["--processes", "2"]):
        assert main(["bench", "--quick", "--models", "nano,transformer", "--precisions", "fp16", "--no-peers",
                     "--peak-tflops", "5", *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines() == [
            "ampguard: error: bench: --peak-tflops gives MFU, which only the transformer and gpt2 models count (their "
            "FLOPs), and transformer fp16 is not run here (on a CPU fp16 runs only the mlp and nano models): no row "
            "would have MFU; leave it out, or add a precision it runs in"]
    assert ran == []


def test_the_noise_floor_line_says_which_way_the_aa_copy_read_not_why():
    # review 39b: any A/A interval excluding 1 was called "biased by where they were built", which chance
    # does 1 time in 20, and a slower A/A copy goes against (the one built second read faster)
    faster = Result("nano-mlp", "fp32", BareAgain.name, 1, 1, 0.992, ratio_low=0.987, ratio_high=0.996)
    slower = Result("nano-mlp", "fp32", BareAgain.name, 1, 1, 1.01, ratio_low=1.004, ratio_high=1.02)
    fast_line, slow_line = bench.noise_floor(faster), bench.noise_floor(slower)
    for line in (fast_line, slow_line):
        assert "biased" not in line and "where they were built, not by their code" not in line
        # (review 49e: identical loops' intervals excluded 1 in 6 of 14 runs, not 1 in 20: an offset, not chance)
        assert "by chance" not in line and "an offset of this process, not chance alone" in line
    assert ("read 0.8% faster than the bare loop (0.4-1.3%), the way the build-order effect seen on CPUs goes (of two "
            "identical loops the one built second, the A/A copy, read faster)") in fast_line
    assert ("read 1.0% slower than the bare loop (0.4-2.0%), against the build-order effect seen on CPUs") in slow_line
    assert slow_line.endswith("a ratio within 2.0% of 1, either way, is not told apart from the bare loop")
