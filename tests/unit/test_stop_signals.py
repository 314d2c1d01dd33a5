"""Stop signals at the edges of a process's life: a verb before a run's own handlers, a start-up
whose peer ended, a rank whose exit code is decided (review_27b)."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from ampguard import distributed, signals
from ampguard.errors import ExitCode, InputError
from ampguard.signals import Interrupted, opening, terminated_as_interrupted


@pytest.fixture
def sigterm_put_back():
    """Whatever a test does to SIGTERM's handler, the suite gets its own back."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _peers(gone: BaseException, *, stopped: int | None = None, told: list | None = None,
           refused: str | None = None) -> SimpleNamespace:
    """The other ranks as a start-up hears of them: ``gone`` is the error of a peer's end, a peer
    left word of its stop with code ``stopped`` (None: none did), this rank's word goes to ``told``;
    a peer's refusal left the line ``refused`` (None: none did), this rank's goes to ``told`` too."""
    told = told if told is not None else []
    return SimpleNamespace(gone=lambda err: err is gone, stopped=lambda: stopped, tell=told.append,
                           refuse=told.append, refused=lambda: refused)


def _term_soon(after_s: float = 0.2) -> threading.Timer:
    timer = threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def test_a_verbs_sigterm_unwinds_as_an_interrupt_and_the_handler_before_is_put_back(sigterm_put_back):
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    with pytest.raises(Interrupted) as raised, terminated_as_interrupted():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert raised.value.exit_code == ExitCode.TERMINATED
    assert signal.getsignal(signal.SIGTERM) is mine


def test_a_settled_process_ignores_sigterm_once_its_verb_is_done(sigterm_put_back):
    # (the process ends next: torchrun's SIGTERM to the ranks left must not turn a decided 143 into -15)
    with terminated_as_interrupted(settle=True):
        pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with pytest.raises(Interrupted), terminated_as_interrupted(settle=True):  # (an interrupt settles it too)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_sigterm_ignored_at_the_start_stays_ignored(sigterm_put_back):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with terminated_as_interrupted():
        os.kill(os.getpid(), signal.SIGTERM)  # (a background job's: not ours to honour)
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_start_up_whose_peer_ended_waits_for_the_launchers_stop_and_ends_as_it_would(sigterm_put_back):
    # a peer stopped alone unwinds and exits; this rank's collective fails at once, before torchrun's
    # SIGTERM: that signal is awaited and ends this rank with 143 instead of the collective's traceback
    gone = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:2178")
    timer = _term_soon()
    started = time.monotonic()
    with pytest.raises(Interrupted) as raised, opening(lambda signum: None, _peers(gone)):
        raise gone
    timer.join()
    assert raised.value.exit_code == ExitCode.TERMINATED and raised.value.__context__ is gone
    assert time.monotonic() - started < signals.PEER_STOP_WAIT_S


def test_a_start_up_error_no_stop_follows_is_raised_as_it_came(sigterm_put_back, monkeypatch):
    monkeypatch.setattr(signals, "PEER_STOP_WAIT_S", 0.2)
    gone, other = RuntimeError("Connection closed by peer"), ValueError("not a peer's")
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised, opening(lambda signum: None, _peers(gone)):
        raise gone
    assert raised.value is gone and time.monotonic() - started >= 0.2
    started = time.monotonic()
    with pytest.raises(ValueError), opening(lambda signum: None, _peers(gone)):  # (not awaited)
        raise other
    assert time.monotonic() - started < 0.2


def test_a_start_up_whose_peer_left_word_of_its_stop_ends_at_once_with_the_peers_code(sigterm_put_back, monkeypatch):
    # the launcher's SIGTERM may come late (the stopped peer's teardown on a loaded machine): the
    # word the peer left in the store ends this rank at once, as the peer ended, with no traceback
    monkeypatch.setattr(signals, "PEER_STOP_WAIT_S", 30.0)
    gone, other = RuntimeError("Connection closed by peer"), ValueError("not a peer's")
    for code in (ExitCode.TERMINATED, ExitCode.INTERRUPTED):
        started = time.monotonic()
        with pytest.raises(Interrupted) as raised, opening(lambda signum: None, _peers(gone, stopped=int(code))):
            raise gone
        assert raised.value.exit_code == code and raised.value.__suppress_context__
        assert time.monotonic() - started < 5
    with pytest.raises(ValueError), opening(lambda signum: None, _peers(gone, stopped=143)):  # (not a peer's end)
        raise other


def test_a_start_up_stopped_by_a_signal_leaves_word_for_its_peers_and_an_error_does_not(sigterm_put_back):
    told = []
    with pytest.raises(Interrupted), opening(lambda signum: None, _peers(ValueError(), told=told)):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises here)
    with pytest.raises(KeyboardInterrupt), opening(lambda signum: None, _peers(ValueError(), told=told)):
        raise KeyboardInterrupt  # (Ctrl-C's)
    with pytest.raises(RuntimeError), opening(lambda signum: None, _peers(ValueError(), told=told)):
        raise RuntimeError("a factory's own error")  # (a crash, not a stop: the peers wait for the launcher)
    assert told == [143, 130]


@pytest.mark.parametrize("text, gone", [
    ("[pair.cc:553] Connection closed by peer [127.0.0.1]:2178", True),  # a read: the peer closed its socket
    ("[pair.cc:589] Write error [127.0.0.1]:61337: Connection reset by peer", True),
    ("[pair.cc:589] Write error [127.0.0.1]:61337: Broken pipe", True),
    ("Timed out waiting 1800000ms for recv operation to complete", False),  # (a peer that hangs is not gone)
    ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x1)", False),
])
def test_a_collectives_error_is_a_peers_end_only_for_a_socket_the_peer_closed(monkeypatch, text, gone):
    monkeypatch.setattr(distributed, "current", lambda: distributed.DistInfo(rank=0, world_size=2))  # (a group of two)
    assert distributed.peer_gone(RuntimeError(text)) is gone
    assert not distributed.peer_gone(ValueError(text))  # (gloo's are RuntimeErrors)


def test_without_a_process_group_no_word_is_left_or_read():
    distributed.tell_stopped(143)
    assert distributed.peer_stopped() is None and not distributed.PEERS.gone(RuntimeError("Connection closed by peer"))


def test_under_torchrun_a_rank_whose_run_is_ending_ignores_sigterm(sigterm_put_back, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    distributed.ending()  # (a WORLD_SIZE alone is not torchrun's)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    distributed.ending()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_sigterm_ignored_inside_the_verb_stays_ignored_after_it(sigterm_put_back):
    # the CI's batched torchrun runs: a rank's end ignores SIGTERM (distributed.ending); the verb's
    # way out put the default back, and torchrun's SIGTERM then reported the rank's decided 2 or 3 as -15
    with terminated_as_interrupted():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_a_ctrl_c_once_the_exit_code_is_decided_ends_the_process_with_that_code(tmp_path):
    # (review 48c: a run that finished and wrote everything, then a Ctrl-C in the interpreter's
    # teardown, ended killed by SIGINT, status -2, not its own code). The script is forked warm
    # (tests/warm.py: torch imported already, the interpreter's own ending kept, an uncaught
    # KeyboardInterrupt ending it by SIGINT as CPython does): the Ctrl-C lands after entry(), in the
    # script's code, not in the interpreter's start-up, so a fresh one (~4 s of CPU) tests nothing more.
    import sys

    import warm

    script = tmp_path / "late_ctrl_c.py"
    script.write_text(
        "import atexit, os, signal, sys, time\n"
        "from ampguard.cli import entry\n"
        "sys.argv = ['ampguard', 'demo', '--steps', '2', '--bf16', '--device', 'cpu']\n"
        "code = entry()\n"
        "print('teardown', flush=True)\n"  # (the process only ends from here: a Ctrl-C now)
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(5)\n"
        "print('not reached', flush=True)\n"
        "sys.exit(code)\n", encoding="utf-8")
    done = warm.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "ended: finished: 2 steps" in done.stdout and done.stdout.rstrip().endswith("teardown")
    assert "Traceback" not in done.stderr


def test_a_refusal_is_left_for_the_peers_and_a_peers_refusal_is_raised_as_its_line():
    # review_51g, 51k: a start-up refused on one rank alone (its node's file missing) ended the
    # others as "interrupted", 143; a gather of the refusals hung a factory's barrier
    told: list = []
    with pytest.raises(InputError, match="^steps.csv already exists$"), opening(lambda signum: None,
                                                                                _peers(ValueError(), told=told)):
        raise InputError("steps.csv already exists")
    assert told == ["steps.csv already exists"]
    gone = RuntimeError("Connection closed by peer")
    with pytest.raises(InputError, match="^task.factory f.py:build raised FileNotFoundError$"), opening(
            lambda signum: None, _peers(gone, refused="task.factory f.py:build raised FileNotFoundError")):
        raise gone


def _refusing_peers(refused: str) -> SimpleNamespace:
    """Peers one of which refused its start-up with ``refused`` (review 51m)."""
    return SimpleNamespace(gone=lambda err: False, stopped=lambda: None, tell=[].append, refuse=[].append,
                           refused=lambda: refused)


def test_a_ranks_own_crash_is_not_replaced_by_a_peers_refusal_line():
    # rank 1's own bug (not a collective that failed because rank 0 left) while rank 0 refused
    # its start-up: rank 1 must still say (and trace back) its own error
    peers = _refusing_peers("task.factory f.py:build raised FileNotFoundError: node_data/rank0.pt")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        with opening(lambda signum: None, peers):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_ranks_own_refusal_is_its_own_line_not_the_first_peers():
    peers = _refusing_peers("task.factory f.py:build raised FileNotFoundError: node_data/rank0.pt")
    with pytest.raises(InputError, match="rank1"):
        with opening(lambda signum: None, peers):
            raise InputError("task.factory f.py:build raised FileNotFoundError: node_data/rank1.pt")


def test_torchruns_sigterm_after_a_peers_refusal_ends_this_rank_with_the_refusal():
    # rank 0 refused and left; torchrun's SIGTERM reaches rank 1 while its factory still loads:
    # it said "ampguard: interrupted", exit 143 (torchrun launch A of the review)
    peers = _refusing_peers("task.factory f.py:build raised FileNotFoundError: node_data/rank0.pt")
    raised = None
    try:
        with opening(lambda signum: None, peers):
            raise Interrupted(143)
    except BaseException as err:  # (an Interrupted would end pytest's session)
        raised = err
    assert isinstance(raised, InputError) and "rank0.pt" in str(raised), repr(raised)
