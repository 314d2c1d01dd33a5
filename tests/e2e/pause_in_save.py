"""``ampguard ARGS`` with one checkpoint save held open, for a test to SIGKILL it mid-save.

Usage: ``python pause_in_save.py MARKER STEP ARGS...``

Runs ``ampguard.cli.main(ARGS)`` in this process, with ``ampguard.checkpoint``'s view of ``os``
replaced by a proxy whose ``fsync`` pauses the save of ``step-<STEP>.pt``: once its temporary file
is written and flushed and is being fsync'ed (so before ``os.replace`` gives it its final name),
the proxy writes MARKER (holding the temporary file's name) and sleeps until the test kills the
process. Nothing in ampguard is changed for the test: only this process's module attributes are
patched, and every other fsync (the folder's, after the replace) passes straight through.
Importing this file (pytest's doctest collection does) runs nothing.
"""

from __future__ import annotations

import os
import stat
import sys
import time
import types
from pathlib import Path
from typing import Any

PAUSE_S = 300.0
"""How long the paused save waits for its SIGKILL before giving up (the test kills it long before)."""


class _PausingOs(types.ModuleType):
    """``os`` as ``ampguard.checkpoint`` sees it: everything is the real ``os`` but ``fsync``."""

    def __init__(self, marker: Path, pause_name: str, saving: dict[str, Any]) -> None:
        super().__init__("os")
        self._marker, self._pause_name, self._saving = marker, pause_name, saving

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def fsync(self, fd: int) -> None:
        target = self._saving.get("path")
        if target is not None and target.name == self._pause_name and stat.S_ISREG(os.fstat(fd).st_mode):
            # the temporary file of the save to pause: written and flushed, not yet replaced
            tmp = [p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}.tmp-")]
            part = self._marker.with_name(self._marker.name + ".part")
            part.write_text("\n".join(tmp), encoding="utf-8")
            os.replace(part, self._marker)
            time.sleep(PAUSE_S)
            raise SystemExit(f"pause_in_save: not killed within {PAUSE_S:g} s")
        os.fsync(fd)


def main(argv: list[str]) -> int:
    marker, step, args = Path(argv[0]), int(argv[1]), argv[2:]
    from ampguard import checkpoint
    from ampguard.cli import main as ampguard_main

    saving: dict[str, Any] = {}
    save_checkpoint = checkpoint.save_checkpoint

    def recording_save(path: Any, payload: dict[str, Any]) -> Path:
        saving["path"] = Path(path)
        try:
            return save_checkpoint(path, payload)
        finally:
            saving.pop("path", None)

    checkpoint.save_checkpoint = recording_save  # the manager calls it through the module
    checkpoint.os = _PausingOs(marker, checkpoint.checkpoint_name(step), saving)
    return ampguard_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
