"""Review 40a of ``signals.held_signals`` (SIGINT and SIGTERM blocked with ``pthread_sigmask``) and
its callers: a pending handler that raised as the hold was entered left the signals blocked (or a
stop handler swapped) for good, the mask put back with ``SIG_SETMASK`` undid a change made inside
the block, a reader that stopped reading left a process no signal could end, SIGTERM then SIGINT
exited 130, ``bench --json`` ran ``git`` inside its hold, and a signal while the output was held
replaced the code found before it (a lost stdout's 74, a failed process's 1, the bench's own
interrupt's 130).

What could change the signals of the test process runs in a child process; the signals are sent
at chosen points (a patched function, a child blocked in ``write(2)``), never on a timer."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ampguard
from ampguard import bench, signals
from ampguard import bench_processes as bp
from ampguard.signals import SAME_STOP_S, Interrupted, TolerantStream

SRC = str(Path(ampguard.__file__).resolve().parents[1])  # (the children run the code under test)
DEADLINE_S = 20  # (only a broken test runs into it)


def _python(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=DEADLINE_S,
                          env={**os.environ, "PYTHONPATH": SRC}, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- #1: a handler that raises as the hold is entered


ENTER_HELD = """
import os, signal
from ampguard import signals
class Alarm(Exception): pass
def alarm(signum, frame): raise Alarm
signal.signal(signal.SIGUSR1, alarm)
real = signal.pthread_sigmask
def sigmask(how, mask):  # CPython's pthread_sigmask runs the pending handlers once the mask is changed:
    before = real(how, mask)  # one that raises there raises out of it, the mask changed
    if how == signal.SIG_BLOCK and signal.SIGINT in set(mask):
        signal.pthread_sigmask = real
        os.kill(os.getpid(), signal.SIGUSR1)  # (its handler runs as this returns)
    return before
signal.pthread_sigmask = sigmask
try:
    with signals.held_signals():
        print("entered")
except Alarm:
    print("alarm")
print(sorted(s.name for s in real(signal.SIG_BLOCK, []) if s in signals.STOP_SIGNALS))
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
      signals._FLAGS)
"""


def test_a_handler_raising_as_the_hold_blocks_the_signals_leaves_them_unblocked():
    # review 40a #1: the mask was blocked outside the try: SIGINT and SIGTERM stayed blocked for good
    done = _python(ENTER_HELD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["alarm", "[]", "True True []"]


ENTER_STOP = """
import os, signal, sys
from ampguard import signals
class Alarm(Exception): pass
def alarm(signum, frame): raise Alarm
signal.signal(signal.SIGUSR1, alarm)
real, fired = signal.signal, []
def swap(sig, handler):  # signal.signal runs the pending handlers before it swaps; one can run as it returns
    if sig == signal.SIGTERM and getattr(handler, "__qualname__", "").startswith("stop_on_signals") and not fired:
        fired.append(True)
        if sys.argv[1] == "after":
            real(sig, handler)
        os.kill(os.getpid(), signal.SIGUSR1)  # (its handler runs as this returns)
    return real(sig, handler)
signal.signal = swap
try:
    with signals.stop_on_signals():
        print("entered")
except Alarm:
    print("alarm")
signal.signal = real
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
      signals._FLAGS)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_handler_raising_between_the_two_swaps_leaves_no_stop_handler_behind(when):
    # review 40a #1: the handlers swapped were listed outside the try: SIGINT kept a dead flag's handler (Ctrl-C
    # did nothing); "after": the exception comes as SIGTERM's swap returns, before it is listed
    done = _python(ENTER_STOP, when)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["alarm", "True True []"]


# ---------------------------------------------------------------- #5: the mask after the hold


MASK = """
import signal, threading
from ampguard.signals import held_signals
def mask():
    return sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR2})
print(mask())
with held_signals():
    print(mask())
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
print(mask())
print(signal.set_wakeup_fd(-1), [t.name for t in threading.enumerate() if t.name == "ampguard-hold-watch"])
"""


def test_the_hold_unblocks_only_what_it_blocked():
    # review 40a #5: SIG_SETMASK put back the whole mask: SIGUSR2, unblocked in the block, was blocked again
    done = _python(MASK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "['SIGTERM', 'SIGUSR2']",
        "['SIGINT', 'SIGTERM', 'SIGUSR2']",
        "['SIGTERM']",  # (SIGTERM was blocked before: it stays so; SIGINT and SIGUSR2 are not)
        "-1 []"]  # (the watcher gone, the wakeup fd as it was)


# ---------------------------------------------------------------- #2, #4: a reader that stopped reading


WRITER = """
import os, sys, threading, time
from ampguard.signals import Interrupted, held_signals
for _ in range(int(sys.argv[1])):  # (as torch's intra-op threads: started before the hold, they block no signal)
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
try:
    with held_signals() as flag:
        flag.cutting = "the output"
        os.write(2, b"HOLD\\n")
        print("x" * 1_000_000, flush=True)
except Interrupted as err:
    sys.exit(int(err.exit_code))
"""


def _status(pid: int, field: str) -> str:
    return next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(field + ":"))


def _writing(threads: int) -> subprocess.Popen:
    """The child, once it is blocked writing into its stdout, which nothing reads yet."""
    proc = subprocess.Popen([sys.executable, "-u", "-c", WRITER, str(threads)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC}, stdin=subprocess.DEVNULL)
    assert proc.stderr.readline() == b"HOLD\n"
    deadline = time.monotonic() + DEADLINE_S
    while not Path(f"/proc/{proc.pid}/wchan").read_text().endswith("pipe_write") and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def _taken(proc: subprocess.Popen) -> None:
    """Until no stop signal waits for the child as a whole (one of its threads took it), 2 s at most."""
    deadline = time.monotonic() + 2
    while int(_status(proc.pid, "ShdPnd"), 16) & (1 << signal.SIGINT - 1 | 1 << signal.SIGTERM - 1) and \
            time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="reads /proc")
@pytest.mark.parametrize("threads", [0, 2], ids=["no other thread", "threads that take the signal"])
@pytest.mark.parametrize("first, second, code", [(signal.SIGTERM, signal.SIGINT, 143),
                                                 (signal.SIGINT, signal.SIGTERM, 130),
                                                 (signal.SIGINT, signal.SIGINT, 130)],
                         ids=["SIGTERM then SIGINT", "SIGINT then SIGTERM", "SIGINT twice"])
def test_a_second_signal_ends_a_hold_whose_reader_stopped_reading(threads, first, second, code):
    # review 40a #2: only SIGKILL ended it (the signals waited for the write); #4: the first signal names the code
    proc = _writing(threads)
    try:
        proc.send_signal(first)
        _taken(proc)
        assert proc.poll() is None  # (one signal: the output is still written whole)
        time.sleep(SAME_STOP_S + 0.1)  # (sooner, it is the first one again: timeout sends its SIGTERM twice)
        proc.send_signal(second)
        assert proc.wait(timeout=5) == code
        assert proc.stderr.read().decode().splitlines() == ["ampguard: interrupted (the output was cut)"]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="reads /proc")
@pytest.mark.parametrize("threads", [0, 2], ids=["no other thread", "threads that take the signal"])
@pytest.mark.parametrize("sent", [1, 2], ids=["once", "twice at once, as timeout sends it"])
def test_one_stop_still_waits_for_the_whole_output(threads, sent):
    # (the watcher takes it, or another thread: the write is not cut, and the exit is 143 once it is whole);
    # review 40h #1: GNU timeout sends SIGTERM to the process and to its group, microseconds apart: the two
    # were counted as two stops and the output was cut at 64 KiB
    proc = _writing(threads)
    try:
        for _ in range(sent):
            os.kill(proc.pid, signal.SIGTERM)
            _taken(proc)  # (the first taken before the second comes: else the two merge into one, as blocked)
        out = proc.stdout.read()
        assert proc.wait(timeout=5) == 143 and len(out) == 1_000_001
        assert proc.stderr.read() == b""
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


BOTH = """
import os, signal, sys
from ampguard.signals import Interrupted, held_signals
try:
    with held_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
except Interrupted as err:
    sys.exit(int(err.exit_code))
"""


def test_sigterm_then_sigint_in_a_short_hold_is_sigterms_143():
    # review 40a #4: blocked, they came back in the order of their numbers: SIGINT's 130
    done = _python(BOTH)
    assert done.returncode == 143, done.stderr


# ---------------------------------------------------------------- #3: no process started inside the hold


def test_the_bench_reads_its_versions_before_the_hold(monkeypatch, capsys):
    # review 40a #3: to_json ran versions(), and git, inside the hold: the child inherited SIGINT and SIGTERM blocked
    masks = []

    def versions():  # (a process started here inherits this thread's mask)
        masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, set()) & set(signals.STOP_SIGNALS))
        return {"ampguard": "test"}

    monkeypatch.setattr(bench, "versions", versions)
    assert bench.run(models="nano", precisions="fp32", quick=True, peers=False, as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["versions"] == {"ampguard": "test"}
    assert masks == [set()]


# ---------------------------------------------------------------- #5: the code found before a signal in the hold


class Full(io.StringIO):
    def write(self, text):
        raise OSError(28, "No space left on device")


def _returned(call):
    """What ``call()`` returns, or the Interrupted it raises (a KeyboardInterrupt: pytest would end the session)."""
    try:
        return call()
    except Interrupted as err:
        return f"Interrupted({int(err.exit_code)})"


def _sigterm_in(monkeypatch, module) -> None:
    """``module.to_json`` raises SIGTERM in the main thread (the hold's), as the output is made."""
    real = module.to_json

    def to_json(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "to_json", to_json)


def test_a_signal_while_the_output_is_held_does_not_hide_a_lost_stdout(monkeypatch, capsys):
    # review 40a #5: Interrupted (143) from the hold skipped output_written: the lost JSON went unsaid, exit 143
    _sigterm_in(monkeypatch, bench)
    monkeypatch.setattr(sys, "stdout", TolerantStream(Full(), "stdout"))
    assert _returned(lambda: bench.run(models="nano", precisions="fp32", quick=True, peers=False, as_json=True)) == 74
    assert "ampguard: error: bench: the --json result could not be written to stdout" in capsys.readouterr().err


def test_a_signal_while_the_output_is_held_does_not_replace_the_benchs_own_interrupt(monkeypatch, capsys):
    # the bench interrupted by Ctrl-C as it ended (130, its results printed), then a SIGTERM as they are: 130
    real, sent = signals.held_signals, []

    def held():
        if not sent:  # (the first hold: just after the bench; bench.run imports it from signals)
            sent.append(True)
            signal.raise_signal(signal.SIGINT)
        return real()

    monkeypatch.setattr(signals, "held_signals", held)
    _sigterm_in(monkeypatch, bench)
    assert _returned(lambda: bench.run(models="nano", precisions="fp32", quick=True, peers=False, as_json=True)) == 130
    assert sent and json.loads(capsys.readouterr().out)["results"]


def test_a_signal_while_the_processes_output_is_held_does_not_replace_a_failed_processs_code(tmp_path, monkeypatch,
                                                                                             capsys):
    # review 40a #5: process 2 exited 1, a SIGTERM came as the rows of process 1 were printed: exit 143
    scripts = [tmp_path / "ok.py", tmp_path / "failed.py"]
    scripts[0].write_text("import json; print(json.dumps({'results': []}))", encoding="utf-8")
    scripts[1].write_text("raise SystemExit(1)", encoding="utf-8")

    def launch(argv):
        return subprocess.Popen([sys.executable, str(scripts.pop(0))], stdout=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)

    _sigterm_in(monkeypatch, bp)
    assert _returned(lambda: bp.run_across(2, [], resolve=None, as_json=True, launch=launch)) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["ran"], data["stopped"]) == (1, "process 2 exited 1")


def test_the_hold_raises_the_signal_that_came_when_nothing_came_before_it(monkeypatch, capsys):
    # (the rule above only keeps a code found before the signal: a whole bench, then a SIGTERM, is 143)
    _sigterm_in(monkeypatch, bench)
    with pytest.raises(Interrupted) as stopped:
        bench.run(models="nano", precisions="fp32", quick=True, peers=False, as_json=True)
    assert stopped.value.exit_code == 143 and json.loads(capsys.readouterr().out)["results"]
