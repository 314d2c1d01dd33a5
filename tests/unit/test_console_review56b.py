"""Review 56b: the console read as a log. stdout into a file or a pipe was block-buffered (8 KiB)
while a run printed its lines (a log empty mid-run, out of order with stderr, lost to a kill;
``train | true`` trained on), and on a terminal a warning written mid-run stuck to the live
progress bar. (The reader-gone e2e test, tests/e2e/test_signals.py, runs a buffered child.)"""

from __future__ import annotations

import contextlib
import io
import re
import sys
import warnings

from tqdm import tqdm

from ampguard.cli import _slow_precision_in_one_line, main
from ampguard.errors import AmpguardWarning


class _Recorded(io.RawIOBase):
    """A file's raw layer that keeps each write it is given: what reached the file, and when."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.writes.append(bytes(data))
        return len(data)


def test_a_run_into_a_file_writes_its_console_a_line_at_a_time(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    raw = _Recorded()
    out = io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8")  # (as Python makes stdout into a file)
    assert not out.line_buffering
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["demo", "--steps", "3", "--device", "cpu", "--inject", "nan_loss@2"])
    assert code == 0
    # each line reached the file as it was printed (it was one write of all of them, at the end)
    assert len(raw.writes) >= 5 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in raw.writes), raw.writes
    assert b"".join(raw.writes).startswith(b"ampguard demo: ")
    assert not out.line_buffering  # (the caller's stream as it was)


def test_a_warning_while_a_bar_is_live_is_written_off_the_bar():
    """The command line's warnings (ampguard's one line, and others as Python shows them) wipe a
    live bar from its line before they are written, then draw it again below them: on a terminal
    they stuck to it (``... 195/600 [00:01<00:03, 121.71step/s]/tmp/f.py:14: UserWarning: ...``)."""
    term = io.StringIO()  # (stdout and stderr: one terminal)

    def pythons(message, category, filename, lineno, file=None, line=None):  # (pytest records Python's own)
        (file or sys.stderr).write(f"{filename}:{lineno}: {category.__name__}: {message}\n")

    with warnings.catch_warnings(), contextlib.redirect_stdout(term), contextlib.redirect_stderr(term):
        warnings.simplefilter("always")
        warnings.showwarning = pythons
        held = _slow_precision_in_one_line(quiet=False)
        held.release()  # (the run's first line written: a warning is said as it comes)
        bar = tqdm(total=600, file=sys.stderr, disable=False, bar_format="{n}/{total} bar")
        bar.update(195)
        bar.refresh()
        warnings.warn("a sink failed as it closed", AmpguardWarning)
        warnings.warn("the loss said so", UserWarning)
        bar.close()
    text = term.getvalue()
    for said in ("ampguard: warning: a sink failed as it closed\n", f"{__file__}:"):
        at = text.index(said)
        assert re.search(r"195/600 bar\r *\r$", text[:at]), repr(text)  # the bar wiped first (it was glued to it)
        line = text[at:text.index("\n", at) + 1]
        assert text[at + len(line):].startswith("\r195/600 bar"), repr(text)  # and drawn again below the line
