"""``signals.watch_stuck``: a stop signal the main thread cannot take up, because it waits in C
in a step (here a lock, as a collective whose peer hung waits), is handed to ``on_stuck`` once
its stack has not moved for the grace; a run that takes the signal up and closes, a wait outside
a step (a checkpoint's save: the others wait for rank 0), or no signal at all, hands nothing.
The run's own use (rank 0 closing alone under torchrun) is ``tests/e2e/test_torchrun_guards.py``'s H."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import ampguard
from ampguard import signals
from ampguard.signals import Interrupted, opening, stop_on_signals, watch_stuck


def _sigterm_in(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_main_thread_waiting_in_c_after_a_sigterm_is_handed_to_on_stuck_after_the_grace():
    waiting, fired = threading.Lock(), []
    waiting.acquire()

    def on_stuck(signum):
        fired.append((signum, time.monotonic()))
        waiting.release()  # (the run would close and leave; here the main thread is let go)

    with stop_on_signals() as stop, watch_stuck(stop, lambda: 0.4, on_stuck):
        stop.watched += 1  # (in a step)
        _sigterm_in(0.1)
        sent = time.monotonic() + 0.1
        assert waiting.acquire(timeout=10)  # the main thread waits where it is, as in a collective
    assert [signum for signum, _ in fired] == [signal.SIGTERM]
    assert stop.signal == signal.SIGTERM  # (the lock's wait let the Python handler run: the frame still did not move)
    assert 0.4 <= fired[0][1] - sent < 3


def test_a_run_that_takes_the_signal_up_and_closes_is_not_stuck():
    # what a run does with the signal: the step goes on (Python calls, the stack moving), the run
    # reaches its boundary and closes, which may take longer than the grace (a final checkpoint)
    fired = []

    def deep(n):
        return deep(n - 1) if n else time.sleep(0.002)

    with stop_on_signals() as stop, watch_stuck(stop, lambda: 0.4, fired.append):
        stop.watched += 1
        _sigterm_in(0.05).join()
        end = time.monotonic() + 0.3
        for i in range(10**6):  # the rest of the step: calls, the stack changing
            deep(i % 23)
            if time.monotonic() > end:
                break
        stop.closing = True  # the boundary: the run closes, signals held
        time.sleep(0.6)  # (its last checkpoint and card take their time)
    assert fired == [] and stop.requested


def test_a_wait_outside_a_step_is_not_stuck():
    # a checkpoint rank 0 writes while the others wait for it, longer than the grace; a loop whose
    # stack repeats (torch.save writing storage after storage, an evaluation's .item() per batch)
    fired = []
    with stop_on_signals() as stop, watch_stuck(stop, lambda: 0.3, fired.append):
        _sigterm_in(0.05).join()
        for _ in range(6):
            time.sleep(0.1)  # (the stack is the same at every sample)
        stop.closing = True
    assert fired == [] and stop.requested


def test_a_run_that_is_closing_is_not_stuck():
    fired = []
    with stop_on_signals() as stop, watch_stuck(stop, lambda: 0.3, fired.append):
        stop.closing = True  # (writing its last checkpoint and card: it may wait, signals held)
        _sigterm_in(0.05).join()
        time.sleep(0.5)
    assert fired == []


def test_without_a_signal_nothing_is_watched_and_the_wakeup_fd_is_put_back():
    fired = []
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    with stop_on_signals() as stop, watch_stuck(stop, lambda: 0.2, fired.append):
        time.sleep(0.4)  # (a sleep: the stack does not move, but no signal came)
    assert fired == [] and not stop.requested
    assert signal.set_wakeup_fd(before) == before
    assert not [t for t in threading.enumerate() if t.name == "ampguard-stuck-watch"]


# ---------------------------------------------------------------------------- the start-up: opening()
# review_session25: SIGTERM in a run's start-up (its folder made, its sinks opening, its ranks
# agreeing on both) ended the process at once: the new run folder was left, holding only config.yaml
# and run-id, which no resume could use and no rerun could take the name of. A Python handler alone
# cannot run while the main thread waits in C (a start-up collective whose peer died).


def _blocked_in_c(read_fd: int) -> None:
    """Wait in one C call that a signal does not end: read() with SA_RESTART (what a collective's
    wait is to a signal: the C-level handler runs, no Python one until the call returns)."""
    import ctypes

    signal.siginterrupt(signal.SIGTERM, False)
    ctypes.CDLL(None).read(read_fd, ctypes.create_string_buffer(1), 1)


def test_opening_unwinds_a_sigterm_where_python_runs_and_puts_the_handler_back(monkeypatch):
    monkeypatch.setattr(signals, "START_STUCK_AFTER_S", 0.3)
    before, fired = signal.getsignal(signal.SIGTERM), []
    with pytest.raises(Interrupted) as info:
        with opening(fired.append):
            _sigterm_in(0.05)
            time.sleep(5)  # (the handler raises here)
    assert int(info.value.exit_code) == 143 and signal.getsignal(signal.SIGTERM) is before
    time.sleep(0.5)
    assert fired == []  # unwound: the watcher handed nothing on
    assert not [t for t in threading.enumerate() if t.name == "ampguard-stuck-watch"]


def test_opening_hands_a_main_thread_waiting_in_c_to_on_stuck_after_the_grace(monkeypatch):
    monkeypatch.setattr(signals, "START_STUCK_AFTER_S", 0.4)
    read, write = os.pipe()
    fired, told = [], []

    def on_stuck(signum):  # (a run takes back its folder and ends the process; here the wait is let go)
        fired.append((signum, time.monotonic()))
        told.append("on_stuck")
        os.write(write, b"x")

    peers = SimpleNamespace(gone=lambda err: False, stopped=lambda: None, tell=told.append, refuse=told.append,
                            refused=lambda: None)
    try:
        with pytest.raises(Interrupted):  # (let go, the main thread runs the handler it owed)
            with opening(on_stuck, peers):
                _sigterm_in(0.1)
                sent = time.monotonic() + 0.1
                _blocked_in_c(read)
    finally:
        os.close(read)
        os.close(write)
    assert [signum for signum, _ in fired] == [signal.SIGTERM]
    assert 0.4 <= fired[0][1] - sent < 3
    # the word for the peers goes before on_stuck ends the process (here, let go, the unwinding says it again)
    assert told == [143, "on_stuck", 143]


def test_opening_leaves_an_ignored_sigterm_ignored():
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with opening(lambda signum: None):
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # (ignored: nothing raised)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------- a process stopped (review 58c F1)
# A stop signal mid-step, then the whole process suspended for longer than the grace (SIGSTOP ...
# SIGCONT: Ctrl-Z, a scheduler's suspend, a debugger): the watcher, stopped too, took the time it
# did not run as the main thread's and fired as soon as the process went on. Under torchrun the
# rank then closed alone, without its final checkpoint, "waited over 10 s in a collective".

SUSPENDED = """
import ctypes, os, signal
from ampguard.signals import Watched, stop_on_signals, watch_stuck
def stuck(signum):
    print("stuck", flush=True)
    os._exit(0)
with stop_on_signals() as stop, watch_stuck(stop, lambda: 2.0, stuck), Watched(stop):
    signal.siginterrupt(signal.SIGTERM, False)  # (the read goes on after the signal, as a collective's wait)
    print("busy", flush=True)
    ctypes.CDLL(None).read(0, ctypes.create_string_buffer(1), 1)  # (until the parent writes: never here)
print("let go", flush=True)
"""


def test_the_time_a_stopped_process_stood_still_is_not_counted_as_stuck_and_a_hang_still_is():
    src = str(Path(ampguard.__file__).resolve().parents[1])  # (the child runs the code under test)
    child = subprocess.Popen([sys.executable, "-c", SUSPENDED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": src})
    try:
        assert child.stdout.readline() == "busy\n"
        child.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # (the watcher has the signal: it counts)
        child.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # stopped for longer than the grace (2 s)
        child.send_signal(signal.SIGCONT)
        went_on = time.monotonic()
        assert child.stdout.readline() == "stuck\n"  # the main thread never moves: still a hang
        # ... once the process ran the grace: 0.3 s before the stop, at most 0.5 s counted for the stop,
        # ~1.2 s after it (it fired at the watcher's first look after SIGCONT, within ~0.3 s)
        assert 0.7 <= time.monotonic() - went_on < 10
        assert child.wait(timeout=10) == 0
    finally:
        child.kill()
        child.wait()


# ---------------------------------------------------------------------------- the run's clock (session 60d)
# The run timed its steps by the monotonic clock, which goes on while the process is stopped: a
# step it was stopped in was a slow step, and two of them set the stuck grace (3 x the second
# slowest) for the rest of the run. The watcher now ticks the flag's clock (RanClock), which
# counts two polls at most for a stop, whatever the number of stops; fed times here.


def test_the_watcher_ticks_the_runs_clock_which_leaves_out_the_time_the_process_stood_still():
    fired, stood_still = [], [0.0]
    with stop_on_signals() as stop, watch_stuck(stop, lambda: 1.0, fired.append):
        stop.ran.now = lambda: time.monotonic() + stood_still[0]
        time.sleep(0.6)  # (the watcher looks, and ticks, every STUCK_POLL_S)
        for _ in range(2):  # two stops of an hour: the monotonic clock went on, nothing ticked through them
            began = stop.ran()
            stood_still[0] += 3600.0
            assert stop.ran() - began <= 2 * signals.STUCK_POLL_S
        assert fired == []
    began = stop.ran()  # without the watcher (the block over) every second counts
    stood_still[0] += 3600.0
    assert stop.ran() - began >= 3600.0
