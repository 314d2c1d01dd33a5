"""``ampguard ARGS`` held at one phase of a run's start-up, for a test to send Ctrl-C there.

Usage: ``python pause_in_startup.py MARKER PHASE ARGS...`` with PHASE one of

- ``torch_import``: inside the command line's import of torch (``importlib.import_module("torch")``
  in ``ampguard.cli.main``, where signals are held); torch is not imported before it;
- ``loading_resume``: while ``train --resume`` finds and loads its checkpoint
  (``checkpointer.find_resume``), before the config is read and before any run handler is set;
- ``building``: while the trainer builds the run (its ``build_state``: model, optimizer, scaler),
  before anything is written;
- ``run_folder``: right after the new run folder was made (``RunPaths.new_run_dir`` returned),
  before the run's signal handlers are installed and its logs opened;
- ``run_folder_in_c``: there too, but waiting in one C call that a signal does not end (a read
  restarted after a signal, what a start-up collective whose peer died is to a SIGTERM: no Python
  handler runs), never let go: the run's start-up watcher must end it (its grace set to 1 s here);
- ``config_write``: inside the making of the new run folder (``RunPaths.new_run_dir``), as it is
  about to write ``config.yaml`` (``RunPaths.write_config``), nothing of the run in place yet: where
  a SIGKILL left a folder that took the name (review 54c);
- ``before_step_1``: the run is open, its signal handlers installed, its first step not begun
  (the first call of ``Trainer.train_step``).

There the wrapper writes MARKER and waits until the file ``MARKER.go`` appears (the test's word
that its signal was sent), then goes on; a signal that raises ``KeyboardInterrupt`` ends the wait
as it would end the code it stands in for. Nothing in ampguard is changed for the test: only this
process's module attributes are patched. Importing this file runs nothing.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

PAUSE_S = 120.0
"""How long the pause waits for MARKER.go (the test writes it long before)."""


def _pause_marker(marker: Path, phase: str) -> None:
    part = marker.with_name(marker.name + ".part")
    part.write_text(f"{phase} {os.getpid()}", encoding="utf-8")
    os.replace(part, marker)


def _pause(marker: Path, phase: str) -> None:
    _pause_marker(marker, phase)
    go, deadline = marker.with_name(marker.name + ".go"), time.monotonic() + PAUSE_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"pause_in_startup: no {go.name} within {PAUSE_S:g} s")
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    marker, phase, args = Path(argv[0]), argv[1], argv[2:]
    from ampguard.cli import main as ampguard_main

    if phase == "torch_import":
        assert "torch" not in sys.modules, "torch was imported before the command line"
        import_module = importlib.import_module

        def importing(name: str, package: str | None = None) -> Any:
            if name == "torch" and "torch" not in sys.modules:
                _pause(marker, phase)
            return import_module(name, package)

        importlib.import_module = importing  # ampguard.cli calls it through the module
    elif phase == "loading_resume":
        from ampguard import checkpointer

        find_resume = checkpointer.find_resume

        def loading(*a: Any, **k: Any) -> Any:
            _pause(marker, phase)
            return find_resume(*a, **k)

        checkpointer.find_resume = loading  # ampguard.cli imports it from its module when it runs
    elif phase == "building":
        from ampguard import trainer

        build_state = trainer.build_state

        def building(*a: Any, **k: Any) -> Any:
            _pause(marker, phase)
            return build_state(*a, **k)

        trainer.build_state = building  # Trainer.__init__ calls it through its module
    elif phase == "run_folder":
        from ampguard.run_folder import RunPaths

        new_run_dir = RunPaths.new_run_dir.__func__

        def made(cls: type, config: Any, **kwargs: Any) -> Any:
            paths = new_run_dir(cls, config, **kwargs)
            _pause(marker, phase)
            return paths

        RunPaths.new_run_dir = classmethod(made)
    elif phase == "run_folder_in_c":
        import ctypes
        import signal

        from ampguard import signals
        from ampguard.run_folder import RunPaths

        signals.START_STUCK_AFTER_S = 1.0
        new_run_dir = RunPaths.new_run_dir.__func__
        read, _ = os.pipe()  # (never written)

        def made_then_stuck(cls: type, config: Any, **kwargs: Any) -> Any:
            paths = new_run_dir(cls, config, **kwargs)
            signal.siginterrupt(signal.SIGTERM, False)  # (SA_RESTART: the read goes on after the signal)
            _pause_marker(marker, phase)
            ctypes.CDLL(None).read(read, ctypes.create_string_buffer(1), 1)
            return paths

        RunPaths.new_run_dir = classmethod(made_then_stuck)
    elif phase == "config_write":
        from ampguard.run_folder import RunPaths

        write_config = RunPaths.write_config

        def writing_config(self: Any, config: Any) -> None:
            _pause(marker, phase)
            write_config(self, config)

        RunPaths.write_config = writing_config  # new_run_dir calls it through the class
    elif phase == "before_step_1":
        from ampguard.trainer import Trainer

        train_step = Trainer.train_step
        calls = []

        def first_step(self: Any) -> Any:
            if not calls:
                calls.append(1)
                _pause(marker, phase)
            return train_step(self)

        Trainer.train_step = first_step
    else:
        raise SystemExit(f"pause_in_startup: unknown phase {phase!r}")
    return ampguard_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
