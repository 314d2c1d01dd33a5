"""Review 55r: ``ampguard.cli.main`` called in a notebook's (or a test's) process ignored SIGXFSZ
for the rest of that process's life (it is ignored while a verb runs: ``ulimit -f`` reached is a
write error, not a kill); the caller's handler is back when it returns, however it returns."""

from __future__ import annotations

import contextlib
import io
import signal

import pytest

from ampguard.cli import main


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="no SIGXFSZ on this OS")
@pytest.mark.parametrize("argv", [["demo", "--steps", "1", "--device", "cpu"], ["demo", "--steps", "0"]])
def test_main_gives_the_callers_sigxfsz_handler_back(argv):
    def mine(signum, frame):  # (the caller's own)
        pass

    before = signal.signal(signal.SIGXFSZ, mine)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
        assert signal.getsignal(signal.SIGXFSZ) is mine
    finally:
        signal.signal(signal.SIGXFSZ, before)
