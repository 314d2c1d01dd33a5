"""``ampguard ARGS`` with one row of ``steps.csv`` cut in half, for a test to SIGKILL it mid-row.

Usage: ``python pause_in_csv.py MARKER STEP ARGS...``

Runs ``ampguard.cli.main(ARGS)`` in this process with ``ampguard.sinks._append`` (the one
``write`` of a whole line on an unbuffered file, that every CSV and JSONL line goes through)
wrapped: the line of ``steps.csv`` that starts with ``STEP,`` is written only in part, its first
half, with one ``write`` on the same unbuffered file (so those bytes are in the file, in the OS's
page cache, and survive a SIGKILL), as a kill between two partial writes would leave it. Then the
wrapper writes MARKER (a JSON object: the ``line`` that was being written and the ``written``
part) and sleeps until the test kills the process. Every other line passes straight through.

A real row is one ``write`` system call of a few dozen bytes, which a kill in practice finds
either done or not begun; this wrapper stands for the worst a kill can find, a write the kernel
left partial (or a row split over two writes). ``_append`` takes back a partial write only when
the process lives to see it fail (a full disk), so after a kill the half row stays in the file.
Nothing in ampguard is changed for the test: only this process's module attribute is patched.
Importing this file (pytest's doctest collection does) runs nothing.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO

PAUSE_S = 300.0
"""How long the paused row waits for its SIGKILL before giving up (the test kills it long before)."""


def main(argv: list[str]) -> int:
    marker, step, args = Path(argv[0]), int(argv[1]), argv[2:]
    from ampguard import sinks
    from ampguard.cli import main as ampguard_main

    append = sinks._append
    prefix = f"{step},".encode("ascii")

    def cut_in_half(file: IO[bytes], text: str) -> None:
        data = text.encode("utf-8")
        # (the file's name as the kernel has it: the sinks open their logs by descriptor, review 55k)
        name = Path(os.readlink(f"/proc/self/fd/{file.fileno()}")).name
        if name != "steps.csv" or not data.startswith(prefix):
            return append(file, text)
        written = data[: len(data) // 2]
        assert file.write(written) == len(written)  # unbuffered: in the file when this returns
        part = marker.with_name(marker.name + ".part")
        part.write_text(json.dumps({"line": text, "written": written.decode("utf-8"), "pid": os.getpid()}),
                        encoding="utf-8")
        os.replace(part, marker)
        time.sleep(PAUSE_S)
        raise SystemExit(f"pause_in_csv: not killed within {PAUSE_S:g} s")

    sinks._append = cut_in_half  # _LineFile._write_line calls it through the module
    return ampguard_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
