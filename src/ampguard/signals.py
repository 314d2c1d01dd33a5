"""Stop signals: Ctrl-C's SIGINT and the SIGTERM that schedulers (SLURM, Kubernetes) send, and
stdout's reader leaving (``ampguard train | head``), what SIGPIPE is to a Unix tool.

A run honours the first one at the next step boundary (checkpoint, run card, exit 130, 143 or
141); a second one interrupts the step in flight; while the run writes its last checkpoint and
run card, signals wait. The console streams never end the process themselves
(:func:`tolerant_console`). This module imports nothing heavy, so the command line can hold
signals while torch is imported (a Ctrl-C inside that import can be swallowed, or leave a
half-made module behind).
"""

from __future__ import annotations

import atexit
import codecs
import contextlib
import errno
import io
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TextIO

from .errors import ExitCode, InputError, failed_because


class RanClock:
    """A clock of the seconds this process ran: :func:`time.monotonic`'s, less the time the process
    stood still (SIGSTOP ... SIGCONT: Ctrl-Z, a scheduler's suspend, a debugger's stop; and where
    the monotonic clock counts a machine's sleep, that sleep), through which the monotonic clock
    goes on. No clock of the OS leaves those out and counts a wait in C (a collective, a GPU's
    sync) in: the process's CPU time leaves both out. So a thread ticks it (:meth:`tick`) every
    :data:`STUCK_POLL_S` (:func:`watch_stuck`'s watcher) and a reading counts at most two polls
    since the last tick: later than that, the ticker did not run either, nor did the process (or
    one C call held the GIL that long: torch's ops, its collectives and a GPU's sync release it).
    Untouched by a ticker (none started, or it ended) it counts as :func:`time.monotonic` does.
    One thread ticks it; any reads it (the tick's state is one tuple, swapped whole).

    Example (times given; the process stopped for an hour between two ticks)::

        >>> now = [100.0]
        >>> clock = RanClock(lambda: now[0])
        >>> for t in (100.25, 100.5, 3700.75):
        ...     now[0] = t
        ...     _ = clock.tick()
        >>> clock()  # (0.25 + 0.25 + the two polls the late tick counts)
        1.0
        >>> clock.stop()
        >>> now[0] += 10.0  # (no ticker: every second counts)
        >>> clock()
        11.0
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self._at = (0.0, now(), math.inf)  # (seconds ran, at the monotonic time, the most a reading adds)

    def __call__(self) -> float:
        """The seconds the process ran so far (since the clock was made)."""
        ran, last, most = self._at
        return ran + min(self.now() - last, most)

    def tick(self) -> float:
        """The ticker's look, every :data:`STUCK_POLL_S`: the seconds ran so far (:meth:`__call__`)."""
        ran, last, most = self._at
        now = self.now()
        ran += min(now - last, most)
        self._at = (ran, now, 2 * STUCK_POLL_S)
        return ran

    def stop(self) -> None:
        """The ticker ends: readings count every second from its last tick on."""
        ran, last, _ = self._at
        self._at = (ran, last, math.inf)


class StopFlag:
    """Set by the first stop signal (Ctrl-C's SIGINT, or the SIGTERM that schedulers such as SLURM
    and Kubernetes send); the loop honours it at the next step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        """The first stop signal received (``signal.SIGINT`` or ``signal.SIGTERM``), or None."""
        self.agreed: int | None = None
        """Under torchrun, the signal the ranks stop for (the highest any rank received, agreed
        at a step boundary), which names the exit code; :attr:`signal` stays this process's own,
        so that its first signal after the agreement is not taken for a second one."""
        self.closing = False
        """Set while the run writes its last checkpoint and run card: further signals wait."""
        self.holding = False
        """Set while the run writes a step's record: a second signal waits for :meth:`release`."""
        self.held = False
        """A second signal arrived while :attr:`holding`."""
        self.cutting = ""
        """What a second signal cuts short while :func:`held_signals` holds them (it ends the process
        at once), named on the line it leaves with: ``"the output"`` says "ampguard: interrupted (the
        output was cut)"; empty: "ampguard: interrupted"."""
        self.watched = 0
        """Set (a count) while the main thread is where :func:`watch_stuck` watches for a stuck
        collective (a run's step and its agreement); elsewhere (a checkpoint's save, an
        evaluation, where a rank waits for the slowest) it is never taken as stuck."""
        self.ran = RanClock()
        """The seconds the process ran (:class:`RanClock`), ticked by :func:`watch_stuck`'s watcher
        while it watches: what a run times its steps by, for the stuck grace."""

    def release(self) -> None:
        """End :attr:`holding`; a second signal that waited interrupts now (``KeyboardInterrupt``).

        Example::

            >>> flag = StopFlag()
            >>> flag.holding, flag.held = True, True  # what the handler does with a second signal
            >>> try:
            ...     flag.release()
            ... except KeyboardInterrupt:
            ...     print("interrupted", flag.holding)
            interrupted False
        """
        self.holding = False
        if self.held:
            self.held = False
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def exit_code(self) -> ExitCode:
        """130 for Ctrl-C, 143 for SIGTERM, 141 for stdout's reader leaving (128 + the signal's
        number, as shells report it)."""
        return _EXIT_CODES.get(self.agreed or self.signal, ExitCode.INTERRUPTED)

    @property
    def name(self) -> str:
        return _NAMES.get(self.exit_code, "Ctrl-C")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
READER_LEFT: int = getattr(signal, "SIGPIPE", 13)
"""What :attr:`StopFlag.signal` holds when stdout's reader left: ``signal.SIGPIPE``, or its number
(13, compared by value) where the OS has no such signal (Windows: a write to a closed pipe is only
an ``EPIPE``, the ``BrokenPipeError`` that :func:`reader_left` is told of); its exit code is 141 alike."""
_EXIT_CODES = {signal.SIGTERM: ExitCode.TERMINATED, READER_LEFT: ExitCode.BROKEN_PIPE}
_NAMES = {ExitCode.TERMINATED: "SIGTERM", ExitCode.BROKEN_PIPE: "stdout's reader left"}


def signal_numbered(number: int) -> int:
    """The signal ``number`` (a code less 128, a number agreed across ranks) as ``signal.Signals``,
    or the plain number where this OS has no signal of it (:data:`READER_LEFT` on Windows); the
    flag's exit code reads either alike.

    Example::

        >>> signal_numbered(15) is signal.SIGTERM, int(signal_numbered(READER_LEFT))
        (True, 13)
    """
    try:
        return signal.Signals(number)
    except ValueError:
        return number
_FLAGS: list[StopFlag] = []
"""The stop flags of the ``stop_on_signals`` blocks open now, innermost last: where
:func:`reader_left` asks for a stop."""
_READER_GONE = [False]
"""stdout's reader left before any ``stop_on_signals`` block was open (a run's first line, its
folder, is printed before its loop arms its flag): the next flag starts stopped. Reset by
:func:`tolerant_console`."""


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """The first SIGINT or SIGTERM: finish the current step, then stop. A second one interrupts
    at once (``KeyboardInterrupt``), except while the run is closing (``flag.closing``): then
    the checkpoint and the run card are written first; and while a step's record is written
    (``flag.holding``): then it interrupts when the record is whole (:meth:`StopFlag.release`).

    A signal the process was started with ignored stays ignored, as Python leaves it (a script's
    background job, ``cmd &``, ignores SIGINT so that Ctrl-C in its terminal stops only the
    foreground command): the run is not stopped by it, at start-up or in its loop.

    Example::

        >>> with stop_on_signals() as stop:
        ...     stop.requested, int(stop.exit_code)
        (False, 130)
    """
    flag = StopFlag()
    if _READER_GONE[0]:  # (the reader left before there was a run to stop: stop it at its first boundary)
        flag.signal = READER_LEFT

    def handler(signum: int, frame: Any) -> None:
        if flag.requested and not flag.closing:
            if flag.holding:
                flag.held = True
                return
            raise KeyboardInterrupt
        if flag.signal is None:
            flag.signal = signum

    swapped: list[tuple[int, Any]] = []
    try:  # (one handler at a time, each noted before its swap: a pending handler that raises between
        # two swaps, or as one returns, leaves none of them swapped for good)
        _FLAGS.append(flag)
        for sig in STOP_SIGNALS:
            old = signal.getsignal(sig)
            if old is not signal.SIG_IGN:
                swapped.append((sig, old))
                try:
                    signal.signal(sig, handler)
                except ValueError:  # not the main thread: leave signals alone
                    swapped.pop()
                    break
        yield flag
    finally:
        try:
            _put_back(swapped)
        finally:
            with contextlib.suppress(ValueError):
                _FLAGS.remove(flag)


def _put_back(swapped: list[tuple[int, Any]]) -> None:
    """Each ``(signal, handler)`` of ``swapped`` back, the last swapped first (one set outside
    Python reads as None: the default is what can be put back). ``signal.signal`` runs the pending
    Python handlers before it swaps: one that raises there does not leave this handler, or the
    ones after it, unswapped (the swap is made again, until it holds or the signal is taken back
    as asked: a few tries; then the first error goes on)."""
    raised: BaseException | None = None
    for sig, old in reversed(swapped):
        old = signal.SIG_DFL if old is None else old
        for _ in range(8):  # (each try runs what is pending: one raises at most once a signal)
            try:
                signal.signal(sig, old)
                break
            except BaseException as err:  # (raised before the swap, or as it returned: tried again)
                if raised is None:
                    raised = err
    if raised is not None:
        raise raised


class Watched:
    """``with Watched(flag):`` around where :func:`watch_stuck` watches for a stuck collective
    (:attr:`StopFlag.watched`). A class, not a generator: it is entered twice a step.

    Example::

        >>> flag = StopFlag()
        >>> with Watched(flag):
        ...     flag.watched
        1
        >>> flag.watched
        0
    """

    __slots__ = ("flag",)

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag

    def __enter__(self) -> None:
        self.flag.watched += 1

    def __exit__(self, *exc: object) -> None:
        self.flag.watched -= 1


STUCK_AFTER_S = 10.0
"""The least time a main thread that has not moved since a stop signal is given before
:func:`watch_stuck` takes it as stuck in C (a run gives it more: three times its slow step,
``Trainer._slow_step``)."""

STUCK_POLL_S = 0.25
"""How often :func:`watch_stuck` looks at the main thread once a stop signal came."""


@contextmanager
def watch_stuck(flag: StopFlag, grace: Callable[[], float], on_stuck: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, a watcher thread waits for a stop signal (SIGINT, SIGTERM): the byte
    Python's C-level handler writes to its wakeup fd, which it looks for every
    :data:`STUCK_POLL_S`. A main thread stuck in C (a
    collective whose peer hung or died: under NCCL it never returns, under gloo not for its 30
    minutes) runs no Python, so the signal's Python handler never runs and the run cannot stop
    at a step boundary. Once a signal came, if the run has not begun closing (``flag.closing``:
    a run that takes the signal up closes within a step) and the main thread has stayed
    :attr:`StopFlag.watched` with its stack unchanged for ``grace()`` seconds, the watcher calls
    ``on_stuck(signum)`` (the run writes what it can, alone, and leaves; it takes the run over
    only if the run is still not closing). Those seconds are the ones the process ran
    (``flag.ran``, a :class:`RanClock` the watcher ticks as it looks, every :data:`STUCK_POLL_S`,
    signal or none: a look that comes later than two of them counts as two, the whole process
    stood still, its watcher too: SIGSTOP ... SIGCONT, a scheduler's suspend, a debugger's stop; a
    step it stopped in is not stuck, and a hang still is once it ran the grace). The run times its
    steps by that clock too, so the grace it gives is not made of such stops either. Nothing but
    the clock's ticks happens without a signal; outside the main thread nothing is watched (nor
    ticked).

    Example (no signal: the watcher only waits)::

        >>> with stop_on_signals() as stop, watch_stuck(stop, lambda: 1.0, print):
        ...     pass
    """
    import threading

    main = threading.main_thread()
    if threading.current_thread() is not main:
        yield
        return
    read, write = os.pipe()
    try:
        os.set_blocking(write, False)
        os.set_blocking(read, False)  # (the watcher looks for the signal's byte at each tick)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    # (a thread of the interpreter's own, or no signals at all; AttributeError, OSError: an OS whose
    # Python cannot make a pipe non-blocking or wake on one, Windows before Python 3.12)
    except (ValueError, AttributeError, OSError):
        os.close(read)
        os.close(write)
        yield
        return
    done = threading.Event()

    def where() -> tuple[tuple[Any, int], ...]:
        """The main thread's stack, as (code, line) pairs: it changes while Python runs calls (a
        compile, a step's modules), not while it waits in one C call."""
        frame, stack = sys._current_frames().get(main.ident or 0), []
        while frame is not None:
            stack.append((frame.f_code, frame.f_lineno))
            frame = frame.f_back
        return tuple(stack)

    def watch() -> None:
        clock, signum = flag.ran, None
        try:
            while signum is None and not done.wait(STUCK_POLL_S):
                clock.tick()
                with contextlib.suppress(BlockingIOError):  # (none came since the last look)
                    signum = next((b for b in os.read(read, 512) if b in STOP_SIGNALS), None)
            if signum is None:
                return
            at, since = where(), clock.tick()
            while not done.wait(STUCK_POLL_S) and not flag.closing:
                ran, here = clock.tick(), where()
                if here != at or not flag.watched:
                    at, since = here, ran
                elif ran - since >= grace():
                    on_stuck(signum)
                    return
        finally:
            clock.stop()

    watcher = threading.Thread(target=watch, name="ampguard-stuck-watch", daemon=True)
    try:
        watcher.start()
        yield
    finally:
        done.set()  # (wakes the watcher from its wait)
        signal.set_wakeup_fd(previous)
        if watcher.is_alive():
            watcher.join()
        os.close(read)
        os.close(write)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived while nothing could be stopped cleanly (start-up): exit with ``exit_code``.
    A ``KeyboardInterrupt``, as Ctrl-C's is, so that no ``except Exception`` takes it (a factory's
    fallback, a tracker's start-up went on training after a SIGTERM) and the user-code wrappers
    pass it on (:func:`~ampguard.errors.an_interrupt`) instead of calling it bad input."""

    def __init__(self, exit_code: ExitCode) -> None:
        super().__init__(f"interrupted ({_NAMES.get(exit_code, 'Ctrl-C')})")
        self.exit_code = exit_code


@contextmanager
def held_signals() -> Iterator[StopFlag]:
    """Hold SIGINT and SIGTERM for the ``with`` block; on leaving it, raise :class:`Interrupted`
    if one arrived (the first one's code; an exception leaving the block goes on instead, the
    signal dropped). A second one ends the process at once (:func:`leave_now`, exit 130 or 143 as
    the first one says, "ampguard: interrupted", with what it cut: :attr:`StopFlag.cutting`), as
    a second signal does in a run: a block that cannot end (a write into a pipe whose reader
    stopped reading: a stalled ``| ssh``, a stopped pager) is not left to SIGKILL alone.

    On the main thread they are blocked at the OS level (``pthread_sigmask``) for the block, and
    unblocked as it ends (those this call blocked: a signal blocked before stays so, and a change
    of the mask made in the block stays), which delivers a signal that came then: a Python
    handler that only takes note (what this did before) still interrupts the system call the
    main thread is in, and a ``write(2)`` blocked on a full pipe (``bench --json | reader``, a
    reader slower than the bench) returned part-way and ``print`` dropped the rest: the JSON was
    cut at 64 KiB. A watcher thread started in the block (so it blocks them too, as every thread
    started there does) counts them as they come: it takes those sent to the process
    (``sigtimedwait``; blocked, they would come back in the order of their numbers, SIGINT
    before SIGTERM, whichever came first), and hears of those another thread took (one started
    before the block, torch's, does not block them: Python's C-level handler runs there) by the
    byte that handler writes to the wakeup fd, set for the block; the noting handler kept here
    notes those without interrupting the main thread's system call. The watcher is stopped
    before the mask is put back, and the signals still waiting then are taken, SIGTERM first
    (they came since its last look, in an order not known). A process started inside the block inherits the mask (the
    signals wait in it too, until it sets its own): start none there (``bench --json`` reads its
    versions, ``git``, before). A signal the process was started with ignored stays ignored.
    Nested, the outer block holds and counts (the inner one blocks nothing). Off the main thread
    nothing is held and a signal never makes the block raise: the main thread's own handler takes it
    (:func:`stop_on_signals` leaves signals alone there). Without ``pthread_sigmask`` (Windows)
    the signal is only noted; without ``sigtimedwait`` (macOS) a second one waits as the first.

    Example::

        >>> import os
        >>> try:
        ...     with held_signals():
        ...         os.kill(os.getpid(), signal.SIGTERM)  # held: the block goes on
        ...         print("still here")
        ... except Interrupted as err:
        ...     print(int(err.exit_code))
        still here
        143
    """
    import threading

    with stop_on_signals() as flag:
        flag.closing = True
        held = {sig for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
        if not held or not hasattr(signal, "pthread_sigmask") or \
                threading.current_thread() is not threading.main_thread():
            yield flag
        else:  # (the mask read first, then blocked inside the try: a pending handler that raises as
            # the mask changes, PyErr_CheckSignals, cannot leave the signals blocked for good)
            blocking = held - signal.pthread_sigmask(signal.SIG_BLOCK, ())
            try:
                if blocking:
                    signal.pthread_sigmask(signal.SIG_BLOCK, blocking)
                with _second_signal_leaves(flag, blocking):
                    yield flag
            finally:  # (one that came after the watcher's last look is delivered here: the handler above notes it)
                if blocking:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, blocking)
    if flag.requested:
        raise Interrupted(flag.exit_code)


HOLD_POLL_S = 0.1
"""How often :func:`held_signals`' watcher looks for a signal sent to the process that no thread
took (every thread blocks it): at most this late is the second one counted."""

SAME_STOP_S = 0.5
"""A stop signal within this long of the first is the same stop, not a second one: GNU
``timeout`` sends its SIGTERM twice, to the process and to its group, microseconds apart (review
40h: with a thread that does not block it the two were counted apart, and one ``timeout`` cut
the bench's JSON at 64 KiB); a person's second Ctrl-C, or a scheduler's, comes later."""


@contextmanager
def _second_signal_leaves(flag: StopFlag, watched: set[int]) -> Iterator[None]:
    """:func:`held_signals`' watcher, for the block: a thread that counts the ``watched`` signals
    (those the block blocked, on the main thread) as they come: the first sets ``flag.signal``
    (unless one was noted already), the second calls :func:`leave_now` with the first's code (one
    within :data:`SAME_STOP_S` of the first is that one again). It
    waits on the wakeup fd (a byte: another thread, not blocking it, took a signal) and every
    :data:`HOLD_POLL_S` takes one no thread took (``sigtimedwait``); once the block is over, those
    still waiting are taken the same way (:func:`_taken`), and the first is noted. Nothing without
    ``sigtimedwait`` or signals to watch."""
    import select
    import threading

    if not watched or not hasattr(signal, "sigtimedwait"):
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    noted = flag.signal in STOP_SIGNALS  # (before the wakeup fd: a signal noted after it has its byte, counted once)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # (no signals in this interpreter)
        os.close(read)
        os.close(write)
        yield
        return
    done: list[bool] = []  # (the block is over; a list, not an Event: its append is one C call, which a
    # pending handler's exception cannot cut in two, as it can Event.set's Python lines)

    def watch() -> None:
        first = time.monotonic() if noted else None  # (when the first stop came)
        with contextlib.suppress(OSError):  # (its pipe closed: a block left before the watcher ran)
            while not done:  # (the block's end writes a byte to wake it)
                ready = select.select([read], [], [], HOLD_POLL_S)[0]
                others = [b for b in os.read(read, 512) if b in watched] if ready else []  # (in their order)
                for signum in others + _taken(watched):
                    if flag.signal is None:
                        flag.signal = signum
                    if first is None:
                        first = time.monotonic()
                    elif time.monotonic() - first >= SAME_STOP_S and not done:  # (a second stop: else the
                        # output is whole, and the block raises Interrupted)
                        leave_now(flag.signal, held=True, cut=flag.cutting)

    watcher = threading.Thread(target=watch, name="ampguard-hold-watch", daemon=True)
    try:
        watcher.start()
        yield
    finally:  # (nested: a pending handler that raises in one part leaves the parts after it to run)
        done.append(True)
        try:
            try:
                with contextlib.suppress(OSError):
                    os.write(write, b"\0")  # (wakes the watcher from its select: it sees done)
                if watcher.is_alive():
                    watcher.join()
            finally:
                taken = _taken(watched)  # (those that came since its last look, as it would have taken them)
                if taken and flag.signal is None:
                    flag.signal = taken[0]
        finally:
            try:
                signal.set_wakeup_fd(previous)
            finally:
                os.close(read)  # (a watcher still reading, cut short above, ends on the closed pipe)
                os.close(write)


def _taken(signals: set[int]) -> list[int]:
    """The ``signals`` waiting for this thread or the process (blocked), taken (``sigtimedwait``),
    SIGTERM first: they came between two looks, in an order not known (blocked, they would come
    back in the order of their numbers, SIGINT first), and a scheduler's SIGTERM is the one whose
    code matters."""
    taken = []
    while (info := signal.sigtimedwait(signals, 0)) is not None:
        taken.append(info.si_signo)
    return sorted(taken, key=lambda signum: signum != signal.SIGTERM)


START_STUCK_AFTER_S = 5.0
"""How long a run's start-up has to take a stop signal up before :func:`opening` takes its main
thread as waiting in C (far below torchrun's 30 s from its SIGTERM to its SIGKILL)."""


PEER_STOP_WAIT_S = 60.0
"""How long a start-up whose collective failed because a peer process ended, a peer that left no
word of a stop of its own (:class:`Peers`: killed, crashed), waits for the stop signal the
launcher sends the ranks left. torchrun sends it within its 0.1 s monitor interval of the peer's
exit, which always follows; but the peer's socket closes when it leaves the process group, and
its exit (the interpreter's teardown) can take many seconds more on a loaded machine (5 s and 20 s
were too short in the test suite, where dozens of processes start at once). An error no signal
follows (no launcher) is raised then."""


class Peers(Protocol):
    """How a run's start-up (:func:`opening`) hears of the other processes of its group
    (:data:`ampguard.distributed.PEERS` under torchrun, which this module does not import)."""

    def gone(self, err: BaseException) -> bool:
        """The error is a collective failing because a peer process ended."""

    def stopped(self) -> int | None:
        """The exit code (130, 143) a peer's start-up stop left word of, or None."""

    def tell(self, code: int) -> None:
        """Leave word of this rank's start-up stop, before its process leaves the group (its
        sockets close after that, so a peer whose collective fails finds the word there)."""

    def refuse(self, line: str) -> None:
        """Leave word of this rank's start-up refusal (its one line), as :meth:`tell` does."""

    def refused(self) -> str | None:
        """The line a peer's refused start-up left word of, or None."""


def _terminated(signum: int, frame: Any) -> None:
    """SIGTERM's handler while it unwinds as Ctrl-C does (:func:`opening`,
    :func:`terminated_as_interrupted`): :class:`Interrupted` (143) where the main thread is."""
    raise Interrupted(ExitCode.TERMINATED)


@contextmanager
def opening(on_stuck: Callable[[int], None], peers: Peers | None = None) -> Iterator[None]:
    """While a run opens (its folder made, its sinks opened, its ranks agreeing on both), SIGTERM
    unwinds it as Ctrl-C does: :class:`Interrupted` (143) is raised where the main thread is, so
    the caller takes back what the start-up made. (SIGTERM's default ended the process at once:
    a new run folder holding only ``config.yaml`` and ``run-id`` was left, which no resume could
    use and no rerun could take the name of.) A main thread that waits in one C call (a start-up
    collective whose peer died runs no Python handler) and has not moved for
    :data:`START_STUCK_AFTER_S` after a SIGTERM or SIGINT is handed to ``on_stuck(signum)`` from a
    watcher thread (:func:`watch_stuck`): the caller takes back what it can and ends the process.
    A SIGTERM the process was started with ignored stays ignored.

    Under torchrun a stop signal may reach one rank alone: it unwinds and ends, and the others'
    next start-up collective fails at once ("Connection closed by peer"), before the SIGTERM
    torchrun then sends them. So a rank whose start-up a signal stops leaves word of it with
    ``peers.tell`` (the stuck-watcher's end too), and an error ``peers.gone(err)`` takes for a
    peer's end raises :class:`Interrupted` with the code the peer left (``peers.stopped()``): the
    same end as the peer's (143, one line, not a traceback), whenever the launcher's signal comes.
    A peer that left no word (killed) is waited for up to :data:`PEER_STOP_WAIT_S` for that
    signal, which then ends this rank as its own would; with none the error is raised as it came.
    A rank whose start-up is refused (an :class:`~ampguard.errors.InputError`) leaves its line
    with ``peers.refuse``; a peer whose start-up error is that rank leaving (its next collective,
    a barrier in its own factory: ``peers.gone`` of the error or of its cause), or whom the
    launcher's SIGTERM reaches after it, raises that line (``peers.refused()``): exit 2 on every
    rank. A rank's own crash or own refusal stays its own.

    Example::

        >>> try:
        ...     with opening(print):
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ...         time.sleep(1)  # (the handler raises here)
        ... except Interrupted as err:
        ...     print(int(err.exit_code))
        143
    """
    import threading

    flag, installed, previous = StopFlag(), False, None
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        previous, installed = signal.signal(signal.SIGTERM, _terminated), True

    def stuck(signum: int) -> None:  # (the word for the peers first: on_stuck ends the process)
        if peers is not None:
            peers.tell(128 + int(signum))
        on_stuck(signum)

    try:
        with watch_stuck(flag, lambda: START_STUCK_AFTER_S, stuck), Watched(flag):
            try:
                yield
            except KeyboardInterrupt as err:  # (Interrupted: a SIGTERM's)
                if peers is not None and (refused := peers.refused()) is not None:
                    raise InputError(refused) from None  # (torchrun's SIGTERM after a peer's refusal: its line)
                if peers is not None:
                    peers.tell(int(getattr(err, "exit_code", ExitCode.INTERRUPTED)))
                raise
            except Exception as err:
                if peers is not None:
                    # a peer refused its start-up (its line, exit 2 on every rank) where this rank's error is
                    # the peer leaving (its collective, or the factory's barrier, wrapped: review 51g, 51k);
                    # an error of this rank's own is its own (review 51m)
                    cause = err.__cause__ or err.__context__
                    left = peers.gone(err) or (cause is not None and peers.gone(cause))
                    refused = peers.refused() if left else None
                    if refused is not None:
                        raise InputError(refused) from None
                    if isinstance(err, InputError) and not left:  # (this rank's: word of it for the peers)
                        peers.refuse(str(err).splitlines()[0] if str(err) else type(err).__name__)
                if installed and peers is not None and peers.gone(err):
                    code = peers.stopped()
                    if code is not None:
                        raise Interrupted(ExitCode(code)) from None
                    deadline = time.monotonic() + PEER_STOP_WAIT_S
                    while time.monotonic() < deadline:  # (the signal's handler raises here)
                        time.sleep(0.02)
                raise
    finally:
        if installed:  # (a handler set outside Python reads as None: the default is what can be put back)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@contextmanager
def terminated_as_interrupted(*, settle: bool = False) -> Iterator[None]:
    """For a verb's time (the command line's :func:`~ampguard.cli.main`), SIGTERM raises
    :class:`Interrupted` (143) where the main thread is, as Ctrl-C raises ``KeyboardInterrupt``:
    what a verb does before a run's own handlers are set (``--resume`` finding and loading its
    checkpoint, a config read) or without a run (``validate``, ``locate``) unwinds as a Ctrl-C does
    (SIGTERM's default ended it at once: exit -15, no line). A run's start-up and loop put handlers
    of their own over this one and back. On the way out the handler before is put back; with
    ``settle`` (the process ends next: its exit code is decided) SIGTERM is ignored instead:
    torchrun sends one to every rank still running as soon as one ends with a non-zero code, and
    this rank's own code, the same stop, must stand rather than become -15. A handler the verb set
    in this one's place and kept (a torchrun rank's end ignores SIGTERM) stays. A SIGTERM the
    process was started with ignored stays ignored; off the main thread nothing is set.

    Example::

        >>> try:
        ...     with terminated_as_interrupted():
        ...         os.kill(os.getpid(), signal.SIGTERM)
        ...         time.sleep(1)  # (the handler raises here)
        ... except Interrupted as err:
        ...     print(int(err.exit_code))
        143
    """
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:  # (a handler set outside Python reads as None: the default is what can be put back)
        if settle:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif signal.getsignal(signal.SIGTERM) is _terminated:  # (not one the verb set and kept: a torchrun rank's
            # end ignores SIGTERM from there on, distributed.ending, and must go on doing so)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def settled(code: int) -> None:
    """The process's exit code is decided (``code``) and it only ends from here (its teardown:
    interpreter exit, threads joined, a library's exit hooks): a Ctrl-C in that time ends it at
    once with ``code``, as a SIGTERM then is ignored (:func:`terminated_as_interrupted`'s
    ``settle``). Python's own would kill it by SIGINT (status -2, whatever the run did: a run
    that finished and wrote everything read as killed; review 48c). In the interpreter's C-level
    teardown, where no Python handler runs, a Ctrl-C is ignored (``atexit``). Off the main thread, and for
    a SIGINT the process was started with ignored, nothing is set.

    Example (not run: it would end this process at a Ctrl-C)::

        code = main(settle=True)
        settled(code)
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    # (review 52m: a Ctrl-C in the start-up's held import decided 130 before terminated_as_interrupted's settle;
    # SIGTERM kept its default through the teardown, and one then killed the process, -15)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return

    def leave(signum: int, frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    def ignored_to_the_end() -> None:
        """At exit (the last Python the process runs, before the interpreter's C-level teardown):
        SIGINT ignored from here. The teardown runs no Python handler: ``leave`` never ran, and
        the interpreter puts SIGINT's default back, but leaves an ignored one ignored; a
        torchrun rank spends a second or more there (garbage-collecting a run's objects), and a
        Ctrl-C then killed it by SIGINT, torchrun reporting -2 for its decided 130 (review 49c M1)."""
        if signal.getsignal(signal.SIGINT) is leave:  # (not a handler set since: it stays)
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGINT, signal.SIG_IGN)

    signal.signal(signal.SIGINT, leave)
    atexit.register(ignored_to_the_end)


def leave_now(signum: int, take_back: Callable[[], None] | None = None, *, held: bool = False,
              cut: str = "") -> None:
    """End the process at once for the stop signal ``signum``, from a watcher thread: ``take_back()``
    first (what the start-up made), "ampguard: interrupted", exit 130 or 143 (128 + the signal).
    From :func:`opening`'s (a main thread stuck in C cannot unwind) the consoles are flushed first.
    From :func:`held_signals`' (``held``: a second signal) they are not, and the line, naming what
    was ``cut`` ("ampguard: interrupted (the output was cut)"), goes straight to stderr's
    descriptor, only if it takes it at once: the main thread may be inside a write to a console
    whose reader stopped reading, holding the stream's lock for good (a flush would wait on it)."""
    if take_back is not None:
        with contextlib.suppress(Exception):
            take_back()
    if held:
        import select

        line = f"ampguard: interrupted ({cut} was cut)\n" if cut else "ampguard: interrupted\n"
        with contextlib.suppress(Exception):  # (a line shorter than PIPE_BUF: a pipe that has room takes it whole)
            if select.select([], [2], [], 0)[1]:
                os.write(2, line.encode())
        os._exit(128 + int(signum))
    with contextlib.suppress(Exception):
        print("ampguard: interrupted", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + int(signum))


def reader_left() -> None:
    """stdout's reader has left (a broken pipe: ``ampguard train | head``). To a Unix tool that is
    SIGPIPE, which ends it; here it is a stop signal like the first SIGTERM: a run stops at the
    next step boundary with its checkpoint and run card (exit 141, ``--resume`` goes on), where a
    bare exit would leave the run folder half-written. Outside a run nothing stops: the verb
    finishes, its output dropped, and exits with its own code (``validate | head -1`` of a
    rejected model is still 1).

    Example::

        >>> with stop_on_signals() as stop:
        ...     reader_left()
        ...     stop.requested, int(stop.exit_code), stop.name
        (True, 141, "stdout's reader left")
        >>> reader_left()  # no run yet: the next one starts stopped
        >>> with stop_on_signals() as stop:
        ...     stop.name
        "stdout's reader left"
        >>> _READER_GONE[0] = False
    """
    if not _FLAGS:
        _READER_GONE[0] = True
    elif _FLAGS[-1].signal is None:
        _FLAGS[-1].signal = READER_LEFT


class TolerantStream:
    """A console stream (stdout, stderr) whose write failures do not end the process: the lines
    are only the console's; a run's record is its folder. On the first failure the stream's file
    descriptor is pointed at ``/dev/null`` (so what is buffered, and Python's flush at exit, go
    nowhere instead of failing again) and later lines are dropped. A reader that left (EPIPE)
    asks the run to stop (:func:`reader_left`); another error (``> /dev/full``, an I/O error) is
    said once on stderr and the run goes on: it was the console, not the run folder, that had no
    room. Everything else is the wrapped stream's.

    Example::

        >>> import io
        >>> class Full(io.StringIO):
        ...     def write(self, text):
        ...         raise OSError(errno.ENOSPC, "No space left on device")
        >>> said = io.StringIO()
        >>> with contextlib.redirect_stderr(said):
        ...     out = TolerantStream(Full(), "stdout")
        ...     out.write("summary: ..."), out.write("ended: ..."), type(out.gone).__name__
        (12, 10, 'OSError')
        >>> said.getvalue()
        'ampguard: warning: stdout: No space left on device; its lines are dropped, the run goes on\\n'
        >>> TolerantStream(None, "stdout").write("a line"), TolerantStream(None, "stdout").gone.strerror
        (6, 'stdout is closed')
    """

    def __init__(self, stream: TextIO | None, name: str) -> None:
        self.gone: OSError | None = None
        if stream is None:  # (started with the descriptor closed, `>&-`: Python made it None; its lines go nowhere)
            stream, self.gone = io.StringIO(), OSError(errno.EBADF, f"{name} is closed")  # (never written: gone)
        self._stream, self._name = stream, name
        self.result = False
        """Its lines are the command's result (a report, a table, ``--print-config``): a loss is
        not "the run goes on" but the command's failure, which the command line says (exit 74)."""
        self.before_write: Callable[[], None] | None = None
        """Called once, before the first line is written (what the command line holds back until
        the verb says anything: a warning that a refusal would make a second line)."""

    def write(self, text: str) -> int:
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None
            hook()
        if self.gone is None:
            try:
                return self._stream.write(text)
            except OSError as err:
                self._lose(err)
        return len(text)

    def flush(self) -> None:
        if self.gone is None:
            try:
                self._stream.flush()
            except OSError as err:
                self._lose(err)

    def _lose(self, err: OSError) -> None:
        self.gone = err
        with contextlib.suppress(Exception):  # (a stream with no descriptor: its lines are dropped all the same)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        if err.errno == errno.EPIPE:
            reader_left()
        elif self._name != "stderr" and not self.result:
            print(f"ampguard: warning: {self._name}: {failed_because(err)}; its lines are dropped, the run goes on",
                  file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def lost_stdout() -> OSError | None:
    """Why stdout could not take what was written to it (the console's guard dropped it:
    :attr:`TolerantStream.gone`), or None; a reader that left (EPIPE) is no loss here: it asked
    for no more (``| head``).

    Example::

        >>> with contextlib.redirect_stdout(TolerantStream(None, "stdout")):
        ...     lost = lost_stdout()
        >>> lost.strerror, lost_stdout()
        ('stdout is closed', None)
    """
    lost = getattr(sys.stdout, "gone", None)
    return None if lost is None or lost.errno == errno.EPIPE else lost


def _console_errors(err: UnicodeError) -> tuple[str | bytes, int]:
    """The encoding errors of the console: a name that is not UTF-8 (a surrogate-escaped byte)
    printed as its bytes, as ``ls`` does; a character the stream's codec lacks (an ASCII
    terminal) as a backslash escape; never a ``UnicodeEncodeError`` that ends the process."""
    try:
        return codecs.lookup_error("surrogateescape")(err)
    except UnicodeError:
        return codecs.backslashreplace_errors(err)


codecs.register_error("ampguard.console", _console_errors)


def console_width(text: str, encoding: str | None = None) -> int:
    """How many characters ``text`` takes on a console of ``encoding`` (the console's own when
    None), as :func:`tolerant_console` writes it: a character an ASCII console lacks is its
    backslash escape (4 to 10 wide), so a table padded by ``len`` would not line up there.

    Example::

        >>> console_width("lauf-\u00e4", "utf-8"), console_width("lauf-\u00e4", "ascii"), console_width("lauf-\u00e4", "gb18030")
        (6, 9, 6)
    """
    encoding = encoding or getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        return len(text)
    if name.startswith("utf"):
        return len(text)
    return len(text.encode(name, "ampguard.console").decode(name, "surrogateescape"))  # (as written, read back)


@contextmanager
def clear_of_bars(file: Any = None) -> Iterator[None]:
    """What the block writes to ``file`` (stdout when None) kept off any live tqdm progress bar
    (``ampguard train``'s, Hugging Face's): the bars are wiped from their line first and drawn
    again below what was written (tqdm's ``external_write_mode``, which ``tqdm.write`` uses). A
    line written past a live bar on a terminal stuck to it (``... 195/600 [00:01<00:03]UserWarning:
    ...``, ``...]ALERT 63 ...``; review 56b). With no tqdm imported there is no bar: the block
    runs as it is (nothing imported). A bar that is off (stderr not a terminal) is no live bar.

    Example::

        >>> import io
        >>> from tqdm import tqdm
        >>> term = io.StringIO()  # (stdout and stderr, one terminal)
        >>> with contextlib.redirect_stdout(term), contextlib.redirect_stderr(term):
        ...     bar = tqdm(total=10, file=sys.stderr, disable=False, bar_format="{n}/{total}")
        ...     with clear_of_bars(sys.stderr):
        ...         print("a line", file=sys.stderr)
        ...     bar.close()
        >>> term.getvalue().replace(" ", "")  # (the bar; wiped; the line; the bar again, below it)
        '\\r0/10\\r\\raline\\n\\r0/10\\r0/10\\n'
    """
    bars = sys.modules.get("tqdm.std")
    if bars is None:
        yield
        return
    with bars.tqdm.external_write_mode(file=file):
        yield


def console_line(line: str) -> None:
    """``print(line)``, kept off a live progress bar (:func:`clear_of_bars`): where the console
    lines of a run ampguard does not drive go by default (the Hugging Face callback's ``ALERT``,
    ``CLEAR`` and ``FAIL`` lines, under HF's bar), as ``print`` where no bar is live.

    Example::

        >>> console_line("ALERT 63 rolling skip rate 0.100 > alert_rate 0.05")
        ALERT 63 rolling skip rate 0.100 > alert_rate 0.05
    """
    with clear_of_bars(sys.stdout):
        print(line)


@contextmanager
def tolerant_console() -> Iterator[TolerantStream]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`TolerantStream` for the block (stdout's
    encoding errors as :func:`_console_errors` says, and stdout written a line at a time:
    :func:`_a_line_at_a_time`), then as they were, stdout flushed through its guard first (a
    block-buffered stdout fails at its flush). Yields stdout's.

    Example::

        >>> import io
        >>> with contextlib.redirect_stdout(io.StringIO()):
        ...     with tolerant_console():
        ...         inside = type(sys.stdout).__name__
        ...     after = type(sys.stdout).__name__
        >>> inside, after
        ('TolerantStream', 'StringIO')
    """
    out, err = sys.stdout, sys.stderr
    _READER_GONE[0] = False
    strict = getattr(out, "errors", None) == "strict" and hasattr(out, "reconfigure")
    if strict:
        out.reconfigure(errors="ampguard.console")
    lined = _a_line_at_a_time(out)
    console = TolerantStream(out, "stdout")
    sys.stdout, sys.stderr = console, TolerantStream(err, "stderr")
    try:
        yield console
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdout, sys.stderr = out, err
        _READER_GONE[0] = False
        if strict:
            with contextlib.suppress(OSError, ValueError):  # (a closed stream)
                out.reconfigure(errors="strict")
        if lined:
            with contextlib.suppress(OSError, ValueError):
                out.reconfigure(line_buffering=False)


def _a_line_at_a_time(out: Any) -> bool:
    """Make ``out`` (stdout) line-buffered, as it is on a terminal, and say whether it was not
    (the caller puts it back). Python block-buffers a stdout that is not a terminal (a log file,
    ``nohup``, a pipe, a CI log) 8 KiB at a time: a run's lines reached ``tail -f`` thousands of
    steps late, after stderr's lines in a ``2>&1`` log, not at all when the run was killed, and
    ``ampguard train | head -3`` trained on until 8 KiB were due (review 56b). A line is written
    every ``log.every`` steps at most (and each skip): its flush is no cost to the run. A stream
    that cannot be made so (a notebook's, a ``StringIO``) is left as it is.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryFile() as file:
        ...     out = io.TextIOWrapper(file, encoding="utf-8")  # (block-buffered, as stdout into a file)
        ...     changed, _ = _a_line_at_a_time(out), out.write("STEP 1\\n")
        ...     written = os.pread(file.fileno(), 100, 0)
        ...     out.reconfigure(line_buffering=False)
        >>> changed, written, _a_line_at_a_time(io.StringIO())
        (True, b'STEP 1\\n', False)
    """
    if getattr(out, "line_buffering", True) or not hasattr(out, "reconfigure"):
        return False
    try:
        out.reconfigure(line_buffering=True)  # (which flushes what the caller left in it)
    except (OSError, ValueError):  # (a stream closed, or one whose flush fails: the guard says so at its write)
        return False
    return True
