"""``ampguard bench ARGS`` held at a chosen point of its first case, for a test to signal it there.

Usage: ``python pause_in_bench.py MARKER WHERE ARGS...`` with WHERE one of

- ``warmup``: after the first contender's warm-up steps, before the next contender's (the first
  call of ``ampguard.bench.census``, which runs once per contender after its warm-up); no
  round has been timed.
- ``round:N``: when round N + 1 starts timing, so exactly N whole rounds were measured (the
  first call of ``ampguard.bench._time_steps`` for a contender already timed N times: each round
  times every contender once). ``round:0`` is inside the first round.

There the wrapper writes MARKER and sleeps until a signal ends it (the bench's SIGTERM handler
raises ``KeyboardInterrupt`` out of the sleep, as it would out of the step it stands in for).
Nothing in ampguard is changed for the test: only this process's module attributes are patched.
Importing this file (pytest's doctest collection does) runs nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

PAUSE_S = 300.0
"""How long the pause waits for its signal before giving up (the test signals it long before)."""


def _pause(marker: Path, note: str) -> None:
    part = marker.with_name(marker.name + ".part")
    part.write_text(note, encoding="utf-8")
    os.replace(part, marker)
    time.sleep(PAUSE_S)
    raise SystemExit(f"pause_in_bench: no signal within {PAUSE_S:g} s")


def main(argv: list[str]) -> int:
    marker, where, args = Path(argv[0]), argv[1], argv[2:]
    from ampguard import bench
    from ampguard.cli import main as ampguard_main

    if where == "warmup":
        census = bench.census

        def after_warmup(c: Any) -> Any:
            _pause(marker, f"warm-up of {c.name} done")
            return census(c)

        bench.census = after_warmup  # measure() calls it through the module
    elif where.startswith("round:"):
        whole = int(where.removeprefix("round:"))
        timed: Counter[str] = Counter()
        time_steps = bench._time_steps

        def timing(c: Any, steps: int, device: Any) -> float:
            if timed[c.name] == whole:
                _pause(marker, f"{whole} whole rounds; round {whole + 1} starts with {c.name}")
            timed[c.name] += 1
            return time_steps(c, steps, device)

        bench._time_steps = timing  # measure() calls it through the module
    else:
        raise SystemExit(f"pause_in_bench: WHERE is warmup or round:N, got {where!r}")
    return ampguard_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
