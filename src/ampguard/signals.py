"""Stop signals: Ctrl-C's SIGINT and the SIGTERM that schedulers (SLURM, Kubernetes) send.

A run honours the first one at the next step boundary (checkpoint, run card, exit 130 or 143);
a second one interrupts the step in flight; while the run writes its last checkpoint and run
card, signals wait. This module imports nothing heavy, so the command line can hold signals
while torch is imported (a Ctrl-C inside that import can be swallowed, or leave a half-made
module behind).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import ExitCode


class StopFlag:
    """Set by the first stop signal (Ctrl-C's SIGINT, or the SIGTERM that schedulers such as SLURM
    and Kubernetes send); the loop honours it at the next step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        """The first stop signal received (``signal.SIGINT`` or ``signal.SIGTERM``), or None."""
        self.closing = False
        """Set while the run writes its last checkpoint and run card: further signals wait."""
        self.holding = False
        """Set while the run writes a step's record: a second signal waits for :meth:`release`."""
        self.held = False
        """A second signal arrived while :attr:`holding`."""

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
        """130 for Ctrl-C, 143 for SIGTERM (128 + the signal's number, as shells report it)."""
        return ExitCode.TERMINATED if self.signal == signal.SIGTERM else ExitCode.INTERRUPTED

    @property
    def name(self) -> str:
        return "SIGTERM" if self.signal == signal.SIGTERM else "Ctrl-C"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """The first SIGINT or SIGTERM: finish the current step, then stop. A second one interrupts
    at once (``KeyboardInterrupt``), except while the run is closing (``flag.closing``): then
    the checkpoint and the run card are written first; and while a step's record is written
    (``flag.holding``): then it interrupts when the record is whole (:meth:`StopFlag.release`).

    Example::

        >>> with stop_on_signals() as stop:
        ...     stop.requested, int(stop.exit_code)
        (False, 130)
    """
    flag = StopFlag()

    def handler(signum: int, frame: Any) -> None:
        if flag.requested and not flag.closing:
            if flag.holding:
                flag.held = True
                return
            raise KeyboardInterrupt
        if flag.signal is None:
            flag.signal = signum

    try:
        previous = [(sig, signal.signal(sig, handler)) for sig in STOP_SIGNALS]
    except ValueError:  # not the main thread: leave signals alone
        yield flag
        return
    try:
        yield flag
    finally:
        for sig, old in previous:
            signal.signal(sig, old)


class Interrupted(Exception):
    """A stop signal arrived while nothing could be stopped cleanly (start-up): exit with ``exit_code``."""

    def __init__(self, exit_code: ExitCode) -> None:
        super().__init__(f"interrupted ({'SIGTERM' if exit_code == ExitCode.TERMINATED else 'Ctrl-C'})")
        self.exit_code = exit_code


@contextmanager
def held_signals() -> Iterator[StopFlag]:
    """Hold SIGINT and SIGTERM for the ``with`` block; on leaving it, raise :class:`Interrupted`
    if one arrived.

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
    with stop_on_signals() as flag:
        flag.closing = True
        yield flag
    if flag.requested:
        raise Interrupted(flag.exit_code)
