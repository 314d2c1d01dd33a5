"""The checkpoint manager: a registry of stateful parts, saved and restored as one payload.

Shaped like torchtitan's ``CheckpointManager``: the run hands it its parts (model, optimizer,
scheduler, the guarded step with its scaler, counters and monitors, the RNGs, the data
position, the rollback log), each an object with ``state_dict()`` / ``load_state_dict()``. The
manager owns everything else: the payload's keys (the constants below), FSDP2 full state dicts
(:class:`ModelState`, :class:`OptimizerState`), every rank taking part in a save while rank 0
alone writes (then a barrier), keep/prune, setting aside checkpoints a resume made obsolete, the
resume-compatibility checks, and ``load(before_step=N)`` + ``restore(parts=...)`` for resume and
rollback. File-level safety (atomic write, weights-only load) is :mod:`ampguard.checkpoint`'s.

Example (fakes stand in for a model; any object with ``state_dict`` / ``load_state_dict``)::

    >>> import tempfile
    >>> class Box:
    ...     def __init__(self, v): self.v = v
    ...     def state_dict(self): return {"v": self.v}
    ...     def load_state_dict(self, s): self.v = s["v"]
    >>> box = Box(1)
    >>> meta = {CONFIG: {}, MODEL: {}, OPTIMIZER: {}, SCHEDULER: {}, STATE: {}, RNG: {}, DATA: 0}
    >>> manager = CheckpointManager(Path(tempfile.mkdtemp()), {"box": box}, keep=2, meta=lambda: meta)
    >>> manager.save(step=5).name
    'step-00000005.pt'
    >>> box.v = 99
    >>> manager.restore(manager.load(), parts=["box"]); box.v
    1
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed
from .config import Config
from .errors import InputError

# The payload's keys (checkpoint format ckpt.FORMAT). Parts are restored; the rest identify.
STEP = "step"
UPDATES = "updates"
CONFIG = "config"
PRECISION = "precision"
WORLD_SIZE = "world_size"
TORCH_VERSION = "torch"
MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
STATE = "state"
"""The guarded step's own state: loss scaler, step/update counters, monitors."""
RNG = "rng"
DATA = "data_position"
"""Micro-batches taken from the task's stream so far."""
ROLLBACKS = "rollbacks"

RESUME_PARTS = (MODEL, OPTIMIZER, SCHEDULER, STATE, RNG, DATA, ROLLBACKS)
ROLLBACK_PARTS = (MODEL, OPTIMIZER, SCHEDULER, STATE, RNG)
"""A rollback returns the training state; the data position and the rollback log go on."""

RESUME_FIXED = ("precision", "accumulation_steps", "seed", "task", "optimizer.name")
"""Config keys a resumed run must keep: changing any would make it differ from the uninterrupted run."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class Loaded:
    """A checkpoint read from disk: where it came from and its payload.

    Example::

        >>> loaded = Loaded(Path("runs/a/checkpoints/step-00000005.pt"), {STEP: 5, MODEL: {}})
        >>> loaded.path.name, sorted(loaded.payload)
        ('step-00000005.pt', ['model', 'step'])
    """

    path: Path
    payload: dict[str, Any]

    @property
    def step(self) -> int:
        """The step the checkpoint was taken after (the payload's ``step``, as an int).

        Example::

            >>> Loaded(Path("step-00000007.pt"), {STEP: torch.tensor(7)}).step
            7
        """
        return int(self.payload[STEP])


# ---------------------------------------------------------------------------- parts


class ModelState:
    """The model's weights: the user's module inside DDP, or FSDP2 shards as one full state dict
    (gathered on every rank, a collective; offloaded to the CPU).

    Example::

        >>> model = nn.Linear(2, 1)
        >>> part = ModelState(model)
        >>> saved = {name: value.clone() for name, value in part.state_dict().items()}
        >>> with torch.no_grad():
        ...     _ = model.weight.zero_()
        >>> part.load_state_dict(saved)
        >>> sorted(saved), torch.equal(model.weight, saved["weight"])
        (['bias', 'weight'], True)
    """

    def __init__(self, model: nn.Module, fsdp: bool = False) -> None:
        self.model, self.fsdp = model, fsdp

    def state_dict(self) -> dict[str, Any]:
        """The user's module's state dict (DDP unwrapped). Under FSDP2 a full state dict gathered
        from every rank (a collective) and copied to the CPU (a host sync).

        Example (the keys carry no DDP ``module.`` prefix)::

            >>> list(ModelState(nn.Sequential(nn.Linear(2, 1))).state_dict())
            ['0.weight', '0.bias']
        """
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return distributed.unwrap(self.model).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full state dict into the user's module (FSDP2: into every rank's shards).

        Example (weights that do not fit raise, as ``nn.Module.load_state_dict`` does)::

            >>> ModelState(nn.Linear(3, 1)).load_state_dict(nn.Linear(2, 1).state_dict())
            Traceback (most recent call last):
            ...
            RuntimeError: Error(s) in loading state_dict for Linear:
            ...
        """
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))
        else:
            distributed.unwrap(self.model).load_state_dict(state)


class OptimizerState:
    """The optimizer's state, as a full state dict under FSDP2 (see :class:`ModelState`).

    Example (Adam's moments go into a fresh optimizer)::

        >>> model = nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> fresh = torch.optim.Adam(model.parameters())
        >>> OptimizerState(model, fresh).load_state_dict(OptimizerState(model, opt).state_dict())
        >>> torch.equal(fresh.state[model.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])
        True
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool = False) -> None:
        self.model, self.optimizer, self.fsdp = model, optimizer, fsdp

    def state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()``; under FSDP2 a full one gathered from every rank (a
        collective) and copied to the CPU (a host sync).

        Example::

            >>> model = nn.Linear(2, 1)
            >>> state = OptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.5)).state_dict()
            >>> sorted(state), state["param_groups"][0]["lr"]
            (['param_groups', 'state'], 0.5)
        """
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a full optimizer state dict (FSDP2: each rank takes its shards of it).

        Example::

            >>> model = nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.5)
            >>> OptimizerState(model, opt).load_state_dict(torch.optim.SGD(model.parameters(), lr=0.1).state_dict())
            >>> opt.param_groups[0]["lr"]
            0.1
        """
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state)


class RngState:
    """Every RNG of every rank: one state in a one-process run, a list by rank under torchrun
    (gathered to rank 0, a collective); each rank restores its own.

    Example (one process: one state, not a list)::

        >>> part = RngState(distributed.DistInfo())
        >>> state = part.state_dict()
        >>> isinstance(state, dict), "torch" in state
        (True, True)
    """

    def __init__(self, dist: distributed.DistInfo) -> None:
        self.dist = dist

    def state_dict(self) -> Any:
        """This rank's RNG states (:func:`ampguard.checkpoint.rng_state`); under torchrun the list
        of every rank's on rank 0 and None elsewhere (a collective).

        Example::

            >>> sorted(RngState(distributed.DistInfo()).state_dict())[-2:]
            ['random', 'torch']
        """
        states = distributed.gather_to_main(ckpt.rng_state())  # None on ranks other than 0
        return states if self.dist.active or states is None else states[0]

    def load_state_dict(self, state: Any) -> None:
        """Restore the RNGs: ``state`` itself, or this rank's entry of a list by rank.

        Example (a list by rank, as torchrun's rank 0 saves it; rank 0 takes entry 0)::

            >>> part = RngState(distributed.DistInfo())
            >>> saved = part.state_dict()
            >>> first = torch.rand(1)
            >>> part.load_state_dict([saved])
            >>> torch.equal(torch.rand(1), first)
            True
        """
        ckpt.set_rng_state(state[self.dist.rank] if isinstance(state, list) else state)


# ---------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and restores a run's registered parts in ``folder`` (every rank calls; rank 0 writes).

    Args:
        folder: rank 0's checkpoint folder (None: checkpoints off, as in the demo).
        parts: payload key -> stateful part, restored in this order (model before optimizer;
            the step's monitors must be registered before it loads).
        keep: how many of the newest checkpoints to keep.
        meta: extra payload entries that identify a checkpoint (config, precision, world size,
            ...), read at each save; they are checked on resume, never restored. The step is
            ``save``'s argument, the same number as in the file's name.
        dist: this process's place in the process group.
    """

    def __init__(self, folder: Path | None, parts: Mapping[str, Stateful], *, keep: int,
                 meta: Callable[[], dict[str, Any]] = dict, dist: distributed.DistInfo | None = None) -> None:
        self.dist = dist or distributed.DistInfo()
        self.folder = folder
        self.parts = dict(parts)
        self.keep = keep
        self.meta = meta
        self.saved: list[Path] = ckpt.list_checkpoints(folder) if folder is not None and self.dist.is_main else []

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def save(self, step: int) -> Path | None:
        """Write ``step-<step>.pt`` (atomic), prune to ``keep``; the path on rank 0, else None.
        Every rank must call it: FSDP2 state dicts and the RNGs are gathered."""
        if self.folder is None:
            return None
        payload = {**self.meta(), STEP: step, **{key: part.state_dict() for key, part in self.parts.items()}}
        path = None
        if self.dist.is_main:
            path = ckpt.save_checkpoint(self.folder / ckpt.checkpoint_name(step), payload)
            ckpt.prune(self.folder, self.keep)
            self.saved = ckpt.list_checkpoints(self.folder)
        distributed.barrier()  # no rank reads checkpoints (a rollback) before rank 0 has written them
        return path

    def load(self, *, before_step: int | None = None) -> Loaded:
        """The newest checkpoint that loads (taken before ``before_step`` if given); older ones
        are tried when newer ones do not load. :class:`InputError` when there is none."""
        if self.folder is None:
            raise InputError("checkpoints are off in this run")
        path, payload = ckpt.latest_loadable(self.folder, before_step=before_step)
        return Loaded(path, payload)

    def restore(self, loaded: Loaded, parts: Iterable[str] | None = None) -> None:
        """Load ``parts`` (default: all registered) from ``loaded``; one :class:`InputError` line
        when the checkpoint does not fit this run."""
        wanted = set(self.parts if parts is None else parts)
        unknown = wanted - set(self.parts)
        if unknown:
            raise ValueError(f"no registered part named {', '.join(sorted(unknown))}")
        names = [name for name in self.parts if name in wanted]  # registry order, whatever was asked
        try:
            for name in names:
                self.parts[name].load_state_dict(loaded.payload[name])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise InputError(f"{loaded.path}: does not fit this run ({first})") from None

    def set_aside_after(self, step: int) -> list[Path]:
        """Rank 0 moves checkpoints newer than ``step`` aside (see :func:`ckpt.set_aside_after`)."""
        if self.folder is None or not self.dist.is_main:
            return []
        moved = ckpt.set_aside_after(self.folder, step)
        self.saved = ckpt.list_checkpoints(self.folder)
        return moved


# ---------------------------------------------------------------------------- resume


@dataclass
class Resume:
    """Where a resumed run picks up: a loaded checkpoint and the run folder it belongs to.

    Example::

        >>> resume = Resume(Loaded(Path("runs/a/checkpoints/step-00000004.pt"), {STEP: 4, CONFIG: {"steps": 10}}),
        ...                 Path("runs/a"))
        >>> resume.path.name, resume.loaded.step, resume.saved_config
        ('step-00000004.pt', 4, {'steps': 10})
    """

    loaded: Loaded
    run_dir: Path

    @property
    def path(self) -> Path:
        """The checkpoint file the run resumes from.

        Example::

            >>> Resume(Loaded(Path("a/checkpoints/step-00000002.pt"), {}), Path("a")).path.as_posix()
            'a/checkpoints/step-00000002.pt'
        """
        return self.loaded.path

    @property
    def saved_config(self) -> dict[str, Any]:
        """The config the checkpoint was saved with, as plain data (the base of a resumed config).

        Example::

            >>> Resume(Loaded(Path("step-00000002.pt"), {CONFIG: {"precision": "bf16"}}), Path(".")).saved_config
            {'precision': 'bf16'}
        """
        return self.loaded.payload[CONFIG]


def find_resume(target: str | Path) -> Resume:
    """The checkpoint for ``--resume RUN_DIR|CHECKPOINT``: a run folder's newest loadable one,
    or the file named (inside its run folder's ``checkpoints/``).

    Example::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "precision": "bf16", "steps": 10})
        >>> payload = {CONFIG: config.model_dump(mode="json"), MODEL: {}, OPTIMIZER: {}, SCHEDULER: {}, STATE: {},
        ...            RNG: {}, DATA: 0}
        >>> path = ckpt.save_checkpoint(run_dir / "checkpoints" / "step-00000004.pt", {**payload, STEP: 4})
        >>> _ = (run_dir / "steps.csv").write_text("")
        >>> resume = find_resume(run_dir)
        >>> resume.path.name, resume.loaded.step, resume.run_dir == run_dir
        ('step-00000004.pt', 4, True)
        >>> find_resume(path).run_dir == run_dir  # a file inside checkpoints/: its run folder is two up
        True
        >>> (run_dir / "steps.csv").unlink()
        >>> try:
        ...     find_resume(run_dir)
        ... except InputError as err:
        ...     print(str(err).replace(str(run_dir), "RUN"))
        RUN/checkpoints/step-00000004.pt: its run folder RUN has no steps.csv to continue
        >>> shutil.rmtree(run_dir)
    """
    target = Path(target)
    if target.is_dir():
        path, payload = ckpt.latest_loadable(target / "checkpoints")
        run_dir = target
    else:
        path, payload = target, ckpt.load_checkpoint(target)
        run_dir = target.parent.parent if target.parent.name == "checkpoints" else target.parent
    if not (run_dir / "steps.csv").is_file():
        raise InputError(f"{path}: its run folder {run_dir} has no steps.csv to continue")
    return Resume(Loaded(path, payload), run_dir)


def check_resume(resume: Resume, config: Config, world_size: int | None = None) -> None:
    """Refuse a resume that would make the run differ from the uninterrupted one: a fixed config
    key changed (:data:`RESUME_FIXED`, naming the exact field), a checkpoint beyond ``steps``, or (when
    ``world_size`` is given) another number of processes.

    Example::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "precision": "bf16", "steps": 10})
        >>> payload = {CONFIG: config.model_dump(mode="json"), MODEL: {}, OPTIMIZER: {}, SCHEDULER: {}, STATE: {},
        ...            RNG: {}, DATA: 0}
        >>> path = ckpt.save_checkpoint(run_dir / "checkpoints" / "step-00000004.pt", {**payload, STEP: 4})
        >>> _ = (run_dir / "steps.csv").write_text("")
        >>> resume = find_resume(run_dir)
        >>> check_resume(resume, config, world_size=1)  # the same run, more steps to go: fine
        >>> for changed in ({"precision": "fp16"}, {"task": {"name": "linear", "batch_size": 8}}, {"steps": 3}):
        ...     try:
        ...         check_resume(resume, validate({**config.model_dump(mode="json"), **changed}))
        ...     except InputError as err:
        ...         print(str(err).replace(str(run_dir), "RUN"))
        --resume: precision was 'bf16' in the checkpoint, now 'fp16'; a resumed run must keep it
        --resume: task.batch_size was 32 in the checkpoint, now 8; a resumed run must keep it
        --resume: RUN/checkpoints/step-00000004.pt is at step 4, the run asks for 3 steps; raise steps ...
        >>> try:
        ...     check_resume(resume, config, world_size=2)
        ... except InputError as err:
        ...     print(str(err).replace(str(run_dir), "RUN"))
        RUN/checkpoints/step-00000004.pt: saved by 1 process(es), this run has 2; resume with the same world size
        >>> shutil.rmtree(run_dir)
    """
    saved, now = resume.saved_config, config.model_dump(mode="json")
    for key in RESUME_FIXED:
        a, b = saved, now
        for part in key.split("."):
            a = a.get(part) if isinstance(a, dict) else None  # a checkpoint may lack a whole section
            b = b.get(part)
        if isinstance(a, dict) and isinstance(b, dict):  # name the exact field, e.g. task.n_embd
            diff = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), None)
            if diff is not None:
                key, a, b = f"{key}.{diff}", a.get(diff), b.get(diff)
        if a != b:
            raise InputError(f"--resume: {key} was {a!r} in the checkpoint, now {b!r}; a resumed run must keep it")
    step = resume.loaded.step
    if step > config.steps:  # (at config.steps the run was complete: resuming rewrites its card)
        raise InputError(f"--resume: {resume.path} is at step {step}, the run asks for {config.steps} steps; "
                         "raise steps (--set steps=N) to continue")
    saved_world = int(resume.loaded.payload.get(WORLD_SIZE, 1))
    if world_size is not None and saved_world != world_size:
        raise InputError(f"{resume.path}: saved by {saved_world} process(es), this run has {world_size}; "
                         "resume with the same world size")
