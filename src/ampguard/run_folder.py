"""The run folder: where a run writes what (paths), and what a finished run hands back (result).

``runs/<name>/`` holds ``RUN.md``, ``steps.csv``, ``events.jsonl``, ``report.png``,
``config.yaml``, ``checkpoints/`` (and ``steps.jsonl``, ``tensorboard/`` when asked for). A demo
writes at most a CSV: its :class:`RunPaths` has no folder. :mod:`ampguard.report` reads these
names from here; nothing here imports the training loop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import Config, dump_config
from .errors import ExitCode, InputError

if TYPE_CHECKING:
    from .monitor import RunMonitor


@dataclass
class RunPaths:
    """What a run writes. A demo has only (maybe) a CSV; a train run has a folder with all of it.

    Example::

        >>> p = RunPaths.existing(Path("runs/a"))
        >>> p.csv.as_posix(), p.card.as_posix(), RunPaths().card is None
        ('runs/a/steps.csv', 'runs/a/RUN.md', True)
    """

    csv: Path | None = None
    dir: Path | None = None

    def _in_dir(self, name: str) -> Path | None:
        return self.dir / name if self.dir is not None else None

    @property
    def events(self) -> Path | None:
        return self._in_dir("events.jsonl")

    @property
    def steps_jsonl(self) -> Path | None:
        return self._in_dir("steps.jsonl")

    @property
    def plot(self) -> Path | None:
        return self._in_dir("report.png")

    @property
    def card(self) -> Path | None:
        return self._in_dir("RUN.md")

    @property
    def config(self) -> Path | None:
        return self._in_dir("config.yaml")

    @property
    def tensorboard(self) -> Path | None:
        return self._in_dir("tensorboard")

    @property
    def checkpoints(self) -> Path | None:
        return self._in_dir("checkpoints")

    @classmethod
    def existing(cls, run_dir: Path) -> RunPaths:
        """The paths of the run folder ``run_dir`` (nothing is created)."""
        return cls(csv=run_dir / "steps.csv", dir=run_dir)

    @classmethod
    def new_run_dir(cls, config: Config) -> RunPaths:
        """Create the run folder ``log.dir/log.name`` (a timestamp by default), never reusing one,
        and write the effective config into it."""
        if config.log.name:
            run_dir = Path(config.log.dir) / config.log.name
            if run_dir.exists():
                raise InputError(f"run folder {run_dir} already exists; choose another log.name")
        else:  # a timestamp, made unique if another run started in the same second
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(config.log.dir) / stamp
            n = 1
            while run_dir.exists():
                n += 1
                run_dir = Path(config.log.dir) / f"{stamp}-{n}"
        try:
            run_dir.mkdir(parents=True)
        except OSError as err:
            raise InputError(f"cannot create run folder {run_dir}: {err.strerror}") from None
        paths = cls.existing(run_dir)
        paths.write_config(config)
        return paths

    def write_config(self, config: Config) -> None:
        """``config.yaml``, replaced atomically (a resumed run may have changed ``steps``)."""
        if self.config is not None:
            tmp = self.config.with_name(".config.yaml.tmp")
            tmp.write_text(dump_config(config), encoding="utf-8")
            os.replace(tmp, self.config)


@dataclass
class RunResult:
    """What a finished (or stopped) run hands back; the run card is written from it.

    Example (a demo-like run: no folder, only a CSV)::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> from ampguard.train import run
        >>> folder = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "steps": 2, "precision": "bf16", "device": "cpu",
        ...                    "inject": ["nan_loss@2"]})
        >>> result = run(config, outputs=lambda: RunPaths(csv=folder / "steps.csv"), console_every=1,
        ...              print_fn=lambda line: None)
        >>> result.exit_code, result.ended, result.monitor.skips_text(), result.device
        (<ExitCode.OK: 0>, 'finished: 2 steps', 'non_finite_loss=1', device(type='cpu'))
        >>> result.paths.dir, result.paths.csv.name, result.checkpoints, result.rollbacks, result.resumed_from
        (None, 'steps.csv', [], [], None)
        >>> shutil.rmtree(folder)
    """

    exit_code: ExitCode
    monitor: RunMonitor
    paths: RunPaths
    ended: str
    """Why the run ended, in words: finished, stopped by a guard, interrupted."""
    device: torch.device
    checkpoints: list[Path] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)
    resumed_from: Path | None = None
    task: str = ""
    diagnosis: str | None = None
