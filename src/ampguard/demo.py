"""``ampguard demo``: the teaching demo. ``nn.Linear`` for 20 steps in fp16 with a loss scaler;
an Inf is injected into the gradients at step 5, which is skipped, and the scale halves there.
The learning rate warms up linearly over the first :data:`WARMUP` applied updates, so the
schedule held on the skipped step shows: step 6 runs at step 5's lr, every other step higher.
A step is one optimizer update (with accumulation, a group of micro-batches), counted from 1.

It is an ordinary guarded run (:func:`ampguard.train.run`) of the ``linear`` task, with every
step printed and no run folder: at most a CSV.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from .config import Config, validate
from .errors import ExitCode, InputError, check_folder_of, counted

INIT_SCALE = 2.0**10
"""Small enough that clean fp16 gradients never overflow in the demo."""
LR = 0.2
"""The SGD learning rate after the warm-up."""
WARMUP = 10
"""Linear warm-up over this many applied updates (``schedule.warmup``): update u runs at
``LR * (u + 1) / WARMUP``. A skipped step applies no update, so the lr holds there."""


def demo_config(*, precision: str = "fp16", steps: int = 20, inject: list[str] | None = None, max_norm: float = 1.0,
                seed: int = 0, device: str = "auto", strict: bool = False,
                monitor: dict[str, Any] | None = None) -> Config:
    """The demo's config: the ``linear`` task, SGD at 0.2 after a linear warm-up over
    :data:`WARMUP` updates (held on skipped steps), ``inject`` (default ``inf_grad@5``, in a run
    that reaches step 5: a fault given that never fires is refused, the default is left out). In
    bf16 the default is the real loss spike, ``spike@5`` (the seed's exercise: "on the same demo
    the skip rate drops to zero"): an injected Inf is an Inf in every precision, so only a real
    spike shows bf16's range; ``inject=["inf_grad@5"]`` still shows the guard skip one there.

    Example::

        >>> c = demo_config(precision="bf16", inject=["spike@5"])
        >>> c.task.name, c.precision, c.inject, c.steps, c.schedule.warmup, c.scheduler_on_skip
        ('linear', 'bf16', ['spike@5'], 20, 10, 'hold')
        >>> demo_config().inject, demo_config(steps=4).inject, demo_config(precision="bf16").inject
        (['inf_grad@5'], [], ['spike@5'])
    """
    fault = "spike@5" if precision == "bf16" else "inf_grad@5"
    return validate({
        "precision": precision,
        "steps": steps,
        "max_norm": max_norm,
        "seed": seed,
        "device": device,
        "inject": ([fault] if steps >= 5 else []) if inject is None else inject,  # the default: when reached
        "task": {"name": "linear", "batch_size": 32},
        "optimizer": {"name": "sgd", "lr": LR, "momentum": 0.0},
        "schedule": {"warmup": WARMUP, "decay": "constant"},
        "eval": {"enabled": False},
        "diagnose": {"strict": strict},
        "scaler": {"init_scale": INIT_SCALE, "growth_interval": 1_000_000},
        "monitor": monitor or {},
    })


def run(config: Config, *, csv: str | None = None) -> ExitCode:
    """Print the set-up, train with a line per step, print the closing lines; ``csv`` must not exist."""
    from . import launch
    from .build import precision_of, resolve_device
    from .clipping import clip_threshold
    from .faults import parse_faults
    from .run_folder import RunPaths
    from .schedule import WarmupPastTheRun
    from .train import finish
    from .train import run as train_run

    if csv == "-":  # (it wrote a file named "-"; stdout already carries the demo's own lines)
        raise InputError("--csv -: the demo prints its lines to stdout; give a file path for the CSV")
    csv_path = Path(csv) if csv else None
    if csv_path is not None and (csv_path.exists() or csv_path.is_symlink()):  # (a link to nothing too)
        raise InputError(f"--csv {csv_path} already exists; refusing to overwrite it"
                         if csv_path.exists() else f"--csv {csv_path} is a symbolic link to nothing; refusing to "
                         "write through it")
    if csv_path is not None:
        check_folder_of(csv_path, f"--csv {csv_path}")  # as report --out
    launched = launch.launched_by_torchrun()  # (a stray WORLD_SIZE: refused before the set-up line)
    # refused before the set-up line too, against the processes torchrun started (a fault @rank1 of two
    # processes was refused as one aimed past a world of one: the group is joined later, in the run)
    parse_faults(config.inject, seed=config.seed, steps=config.steps, world_size=launch.launched_world_size())
    uses_scaler = precision_of(config, resolve_device(config.device)).uses_scaler
    scaler = f"GradScaler(init_scale={config.scaler.init_scale:g})" if uses_scaler else "no loss scaler"
    if not launched or os.environ.get("RANK") == "0":  # (under torchrun rank 0 prints, as the run's lines)
        print(f"ampguard demo: nn.Linear, {counted(config.steps, 'step')}, {config.precision} with {scaler}, "
              f"{f'max_norm={config.max_norm}' if clip_threshold(config.max_norm) else 'clipping off'}, "
              f"inject: {', '.join(config.inject) or 'none'}")
    with warnings.catch_warnings():  # (its fixed warm-up of 10 updates is the demo's own, whatever --steps)
        warnings.simplefilter("ignore", WarmupPastTheRun)
        result = train_run(config, outputs=lambda: RunPaths(csv=csv_path), console_every=1)
    return finish(result)
