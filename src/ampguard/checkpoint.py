"""Checkpoints that survive a kill and never run code on load.

Saving is atomic: the payload goes to a temporary file in the same folder, is flushed and
fsync'ed, then ``os.replace``'d over its final name, so a run killed at any moment (during a
save included) leaves every earlier checkpoint whole. Loading uses
``torch.load(weights_only=True)`` only: tensors and plain data come back, and a file carrying
pickled code is refused before any of it runs.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from .errors import InputError

MAGIC = "ampguard-checkpoint"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{8})\.pt$")
REQUIRED = ("magic", "format", "step", "config", "model", "optimizer", "state", "scheduler", "rng", "data_position")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """Every RNG a run may draw from: torch (CPU and CUDA), numpy's global one, ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with matplotlib
        return state
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["random"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the ampguard marker) to ``path`` atomically; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("wb") as f:
            torch.save({"magic": MAGIC, "format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def safe_load(path: str | os.PathLike, what: str = "checkpoint", map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(weights_only=True)``, with every failure turned into one :class:`InputError`
    line: a file with pickled code in it is refused and that code never runs."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no {what} file at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        if "WeightsUnpickler" in str(err) or "global" in str(err).lower():  # weights-only loader said no
            raise InputError(
                f"{path}: refused by the weights-only loader: it holds pickled objects or bytes beyond tensors "
                "and plain data (nothing in it was run)"
            ) from None
        raise InputError(f"{path}: unreadable {what} (truncated, or not a PyTorch file)") from None
    except Exception:  # noqa: BLE001 - torch's loaders raise many kinds on junk bytes; all mean the same
        raise InputError(f"{path}: unreadable {what} (truncated, or not a PyTorch file)") from None


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load an ampguard checkpoint, or raise :class:`InputError` saying why it cannot be used.

    Only ``torch.load(weights_only=True)``: a file with pickled code in it is refused and that
    code never runs; a truncated or foreign file is refused too.
    """
    path = Path(path)
    payload = safe_load(path, "checkpoint", map_location)
    if not isinstance(payload, dict) or payload.get("magic") != MAGIC:
        raise InputError(f"{path}: not an ampguard checkpoint")
    if payload.get("format") != FORMAT:
        raise InputError(f"{path}: checkpoint format {payload.get('format')!r}, this ampguard reads {FORMAT}")
    missing = [key for key in REQUIRED if key not in payload]
    if missing:
        raise InputError(f"{path}: incomplete ampguard checkpoint (missing {', '.join(missing)})")
    return payload


def load_weights(model: torch.nn.Module, path: str | os.PathLike,
                 map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint's model weights into ``model`` (one line of :class:`InputError` when the
    file is unusable or the weights do not fit); return the whole payload."""
    payload = load_checkpoint(path, map_location)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as err:
        raise InputError(f"{path}: does not fit this model ({str(err).splitlines()[0]})") from None
    return payload


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The finished checkpoints in ``folder``, oldest first (temporary files are not listed)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def checkpoint_step(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def latest_loadable(
    folder: str | os.PathLike, map_location: str | torch.device = "cpu", before_step: int | None = None
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint in ``folder`` that loads (taken before ``before_step`` if given);
    older ones are tried when newer ones do not load."""
    errors = []
    candidates = [p for p in list_checkpoints(folder) if before_step is None or checkpoint_step(p) < before_step]
    for path in reversed(candidates):
        try:
            return path, load_checkpoint(path, map_location)
        except InputError as err:
            errors.append(str(err))
    if errors:
        raise InputError(f"no loadable checkpoint in {folder} ({errors[0]})")
    when = f" from before step {before_step}" if before_step is not None else ""
    raise InputError(f"no checkpoint{when} in {folder}")


def set_aside_after(folder: str | os.PathLike, step: int) -> list[Path]:
    """Move checkpoints newer than ``step`` into ``folder/abandoned-<time>/``: a run resumed from
    an older checkpoint makes them a future that did not happen (its CSV rows go too), and a
    later ``--resume RUN_DIR`` must not pick them. They are kept, not deleted."""
    newer = [p for p in list_checkpoints(folder) if checkpoint_step(p) > step]
    if not newer:
        return []
    target = Path(folder) / time.strftime("abandoned-%Y%m%d-%H%M%S")
    target.mkdir(exist_ok=True)
    for path in newer:
        os.replace(path, target / path.name)
    return newer


def prune(folder: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for path in list_checkpoints(folder)[:-keep]:
        path.unlink(missing_ok=True)
