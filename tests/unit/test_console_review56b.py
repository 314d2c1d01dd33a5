"""Review 56b: the console read as a log. stdout into a file or a pipe was block-buffered (8 KiB)
while a run printed its lines (a log empty mid-run, out of order with stderr, lost to a kill;
``train | true`` trained on). (The reader-gone e2e test, tests/e2e/test_signals.py, runs a
buffered child.)"""

from __future__ import annotations

import contextlib
import io

from ampguard.cli import main


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
