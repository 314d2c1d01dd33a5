"""``ampguard ARGS`` with the run card's writing held open, for a test to signal it meanwhile.

Usage: ``python pause_in_report.py MARKER ARGS...``

Runs ``ampguard.cli.main(ARGS)`` in this process with ``ampguard.report.write_report`` wrapped:
when a run starts writing its run card and plot, the wrapper writes MARKER, then waits up to
``PAUSE_S`` for the file ``MARKER.go`` (the test's word that its signals were sent), then writes
the card. Nothing in ampguard is changed for the test. Importing this file runs nothing.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

PAUSE_S = 60.0


def main(argv: list[str]) -> int:
    marker, args = Path(argv[0]), argv[1:]
    from ampguard import report
    from ampguard.cli import main as ampguard_main

    write_report = report.write_report

    def paused(*a: Any, **k: Any) -> None:
        part = marker.with_name(marker.name + ".part")
        part.write_text(str(os.getpid()), encoding="utf-8")
        os.replace(part, marker)
        go, deadline = marker.with_name(marker.name + ".go"), time.monotonic() + PAUSE_S
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        write_report(*a, **k)

    report.write_report = paused  # train imports it from the module when it closes
    return ampguard_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
