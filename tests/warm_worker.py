"""A torchrun worker forked warm: ``torchrun --no-python PYTHON warm_worker.py SCRIPT ARGS`` starts
this stand-in, which asks the suite's forkserver (its address and the variables it started with
in ``AMPGUARD_WARM_SERVER``: ``warm.server_handle``) for ``python -u SCRIPT ARGS`` with the
stand-in's environment (torchrun's ``RANK``, ``WORLD_SIZE``...), working folder, niceness and
standard streams, passes on each signal torchrun (or a test) sends it, and ends as the worker
ended: its exit code, or killed by the same signal. The worker dies with it (``warm.Popen``'s
``tied``: SIGKILL when the stand-in ends, however it ends: torchrun's SIGKILL after its grace). A
fresh worker spends ~4.5 s of CPU importing torch and ``torch._dynamo`` first; the stand-in imports
the standard library and ``warm``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import warm  # noqa: E402 - after the path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    warm.connect(os.environ.pop("AMPGUARD_WARM_SERVER"))
    tie, _held = os.pipe()  # (its writing end open as long as this process lives: the worker is tied to it)
    # (the worker gets this process's nice, as warm.Popen's children do, though the forkserver runs at 0)
    # (a process group of its own, as torchrun gives its workers sessions: a Ctrl-C at the suite's
    # terminal does not reach it; the same session, so the same scheduler autogroup as the suite)
    proc = warm.Popen([sys.executable, "-u", *argv], stdin=0, tied=tie,
                      process_group=0)
    os.close(tie)

    def forward(sig: int, _: object) -> None:  # (not proc.send_signal: its poll would take the code main waits for)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = proc.wait()
    # The worker ended: it can be sent nothing more, and neither can this process be changed by a
    # signal (torchrun's SIGTERM to every rank once one exited, which would land in this
    # interpreter's exit, its Python handlers gone, and make the worker's code -15)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)
    if code < 0:  # (killed by a signal: so is this process, for torchrun to say which)
        with contextlib.suppress(OSError, ValueError):  # (SIGKILL's cannot be set, nor need be)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
