"""The checkpoint manager: a registry of stateful parts, saved and restored as one payload.

Shaped like torchtitan's ``CheckpointManager``: the run hands it its parts (model, optimizer,
scheduler, the guarded step with its scaler, counters and monitors, the RNGs, the data
position, the rollback log), each an object with ``state_dict()`` / ``load_state_dict()``. The
manager owns everything else: the payload's keys (the constants below), FSDP2 full state dicts
(:class:`ModelState`, :class:`OptimizerState`), every rank taking part in a save while rank 0
alone writes (then a barrier), keep/prune, setting aside checkpoints a resume made obsolete, the
resume-compatibility checks, and ``load(before_step=N)`` + ``restore(parts=...)`` for resume and
rollback. File-level safety (atomic write, weights-only load) is :mod:`ampguard.checkpoint`'s.

What a resume trusts (``docs/resume.md``): nothing in a checkpoint is executed, and no field of
it is used before its type is checked (:func:`check_payload`; the states inside, such as the
loss scaler's, by :meth:`CheckpointManager.check_fits`); the run's config (hence its task)
comes from the run folder's ``config.yaml``, never from the checkpoint; a checkpoint of another
run (:data:`RUN_ID`), another step than its name says, another fixed config
(:data:`RESUME_FIXED`) or another model shape is refused with one line before anything is written.

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

import inspect
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from . import checkpoint as ckpt
from . import distributed
from .config import (MAX_DEPTH, PRESETS, Config, ConfigError, TaskConfig, as_it_ran, flat_keys, is_plain, plain_data,
                     read_file, yaml_spelled)
from .config import validate as config_of
from .errors import (AmpguardWarning, InputError, brief, counted, first_line, real_number, shortened, shown, warn,
                     whole_number)
from .files import DiskFull, writing
from .precision import finite_number, uses_loss_scaler
from .run_folder import RUN_ID_PATTERN, RunPaths
from .untouched import rng_kept

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
"""The rollback log: one line per rollback so far."""
RUN_ID = "run_id"
"""The id of the run folder that wrote the checkpoint (its ``run-id`` file): a resume refuses a
checkpoint of another run. Checkpoints written before run ids have none."""

STATE_KEYS = ("scaler", "step", "updates", "precision", "accumulation_steps", "monitors")
"""The keys :meth:`ampguard.step.AmpTrainState.state_dict` writes under :data:`STATE`."""

ROLLBACK_PARTS = (MODEL, OPTIMIZER, SCHEDULER, STATE, RNG)
"""A rollback returns the training state; the data position and the rollback log go on."""

RESUME_FIXED = ("precision", "accumulation_steps", "seed", "task", "optimizer.name",
                "scaler.enabled", "optimizer.fused", "monitor.window", "rollback.window", "fp8")
"""Config keys a resumed run must keep: changing any would make it differ from the uninterrupted run.
``scaler.enabled`` is compared as it takes effect (null is on for fp16), ``task`` as the settings the
task reads (:func:`changed_task`: review 53i); the two rolling windows'
contents are in the checkpoint, so their sizes cannot change (``rollback.window`` only where the
checkpoint holds a loss-spike window: :func:`holds_spike_window`; docs/resume.md has the table)."""
SPIKE_MONITOR = "loss_spike"
"""The loss-spike trigger's name, which its detector's window is saved under in the guarded step's
``monitors`` (``guards.LOSS_SPIKE`` is this one)."""
POLICY = "policy_changes"
"""Payload key (meta, never restored as a part): the policy changes made on resume so far, each
``{"key", "old", "new", "step"}``; a resumed run carries them on to its run card."""
AUTOCAST_DTYPES = "autocast_dtypes"
"""Payload key (meta, never restored as a part): under autocast, the dtype each leaf module's
output had in the start-up's forward (``watch.recording_dtypes``): the layers kept in float32. A
resume whose model computes one in another dtype says so (:func:`dtype_changes`)."""
DATA_ID = ckpt.DATA_ID
"""Payload key (meta): what identifies the task's data when the machine provides it
(:attr:`ampguard.tasks.Task.data_id`: charlm's corpus is the running Python's standard library); a
resume on other data is refused (:func:`ampguard.checkpoint.other_data`)."""
THROUGHPUT = "throughput"
"""Payload key (meta): the run card's throughput as measured so far; a resume whose own process
measures none (fewer than two steps: a ``--resume`` of a finished run rewrites its card) says
it as an earlier part's (review 52a: the first process's figure became "not measured")."""
EARLIER_PART = " (an earlier part's: this process trained fewer than two steps)"
"""What the card's throughput adds to a figure an earlier part of a resumed run measured."""
DATA_NEXT = "data_next"
"""Payload key (meta): a hash of the task's next global batch at the checkpoint's data position
(:meth:`ampguard.data.DataStream.digest`), for a task whose stream seeks cheaply (``batches_from``:
the built-in tasks'). A resume whose stream gives another batch there is refused
(:func:`check_data_next`; review 52a: a folder of an older ampguard resumed on other batches, its
built-in task's sampling changed since, unsaid)."""
AUTOCAST_DTYPE_CHANGES = "autocast_dtype_changes"
"""Payload key (meta): the autocast dtype changes said on resume so far (run card lines); a later
resume carries them on to its card, as :data:`POLICY` does the settings'."""
POLICY_UNRECORDED = ("log", "validation")
"""Config sections whose change on resume is no policy change: where the run writes and what
``ampguard validate`` checks change nothing the run trains or decides."""


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
    let_go: bool = False
    """True once a :class:`~ampguard.trainer.Trainer` restored it and let go of its model and
    optimizer parts (review 56c: a resumed run held them to its end); a second restore is refused."""

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
        """Load a full optimizer state dict (FSDP2: each rank takes its shards of it). The
        groups keep this run's implementation flags (:data:`HOW_IT_STEPS`: ``fused``,
        ``foreach``, ...): they say how this run steps, not what it learned, and a resume may
        change the path (``fast``). The fast path's sync-free step hands its skip flag to a fused
        kernel, which an exact run's saved ``fused=None`` would have taken away.

        Example::

            >>> model = nn.Linear(2, 1)
            >>> opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
            >>> saved = torch.optim.AdamW(model.parameters(), lr=0.1).state_dict()  # fused=None
            >>> OptimizerState(model, opt).load_state_dict(saved)
            >>> opt.param_groups[0]["lr"], opt.param_groups[0]["fused"]
            (0.1, True)
        """
        how = [{key: group[key] for key in HOW_IT_STEPS if key in group} for group in self.optimizer.param_groups]
        if self.fsdp:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            state = self._by_name(state)  # (a DDP or one-process run's state: by position)
            set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state)
        for group, flags in zip(self.optimizer.param_groups, how):
            group.update(flags)


    def _by_name(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state keyed by parameter position (``Optimizer.state_dict()``: what a DDP
        or one-process run saves) keyed by parameter name instead, as FSDP2's full state dict is:
        the optimizer's parameters in the same order, named by the model (``module.``, which a
        DDP wrapper adds, left out). A state keyed by name already is returned as it is.

        Example::

            >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> by_name = OptimizerState(model, opt, fsdp=True)._by_name(opt.state_dict())
            >>> by_name["param_groups"][0]["params"]
            ['0.weight', '0.bias', '1.weight', '1.bias']
        """
        groups = state.get("param_groups") or []
        if not all(isinstance(pid, int) for group in groups for pid in group.get("params", [])):
            return state
        names = {id(p): name.removeprefix("module.") for name, p in self.model.named_parameters()}
        rename: dict[int, str] = {}
        for group, live in zip(groups, self.optimizer.param_groups):
            for pid, param in zip(group["params"], live["params"]):
                rename[pid] = names[id(param)]
        return {"state": {rename[pid]: value for pid, value in state.get("state", {}).items() if pid in rename},
                "param_groups": [{**group, "params": [rename[pid] for pid in group["params"]]} for group in groups]}


HOW_IT_STEPS = ("fused", "foreach", "capturable", "differentiable")
"""A parameter group's implementation flags: kept from this run when an optimizer state loads."""


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
        if isinstance(state, list) and len(state) != self.dist.world_size:  # (world_size was checked: a hand edit)
            raise ValueError(f"a list of {counted(len(state), 'state')} for {counted(self.dist.world_size, 'process', 'processes')}")
        ckpt.set_rng_state(state[self.dist.rank] if isinstance(state, list) else state)


# ---------------------------------------------------------------------------- the manager


class CheckpointManager:
    """Saves and restores a run's registered parts in ``folder`` (every rank calls; rank 0 writes).

    Args:
        folder: rank 0's checkpoint folder (None: checkpoints off, as in the demo).
        parts: payload key -> stateful part, restored in this order (model before optimizer;
            the step's monitors must be registered before it loads).
        keep: how many of the newest checkpoints to keep.
        hold: the step a save is made at -> the newest step whose checkpoint must stay too (a
            rollback that looks back returns before it: :func:`~ampguard.guards.rollback_reach`),
            or None.
        meta: extra payload entries that identify a checkpoint (config, precision, world size,
            run id, ...), read at each save; they are checked on resume, never restored. The step
            is ``save``'s argument, the same number as in the file's name.
        dist: this process's place in the process group.
        check: called on every checkpoint :meth:`load` reads, before it is used (a run passes
            :func:`check_payload` and :func:`check_belongs`); one that fails counts as not
            loadable, so a rollback goes to an older one.
    """

    def __init__(self, folder: Path | None, parts: Mapping[str, Stateful], *, keep: int,
                 meta: Callable[[], dict[str, Any]] = dict, dist: distributed.DistInfo | None = None,
                 check: Callable[[Loaded], None] | None = None,
                 hold: Callable[[int], int | None] | None = None) -> None:
        self.dist = dist or distributed.DistInfo()
        self.folder = folder
        self.parts = dict(parts)
        self.keep = keep
        self.hold = hold
        self.meta = meta
        self.check = check
        self.failed: DiskFull | None = None
        """The first save that found the disk full (rank 0); the run then writes nothing more."""
        self.saved: list[Path] = ckpt.list_checkpoints(folder) if folder is not None and self.dist.is_main else []

    @property
    def enabled(self) -> bool:
        return self.folder is not None

    def save(self, step: int) -> Path | None:
        """Write ``step-<step>.pt`` (atomic), prune to ``keep`` (and ``hold``), delete partial saves other
        processes left (:func:`ckpt.remove_partial`); the path on rank 0, else None. Every rank
        must call it: FSDP2 state dicts and the RNGs are gathered. (``Trainer.save``, its caller,
        holds a DataLoader worker's death back for the save and the logs' sync before it:
        :func:`ckpt.child_exits_held`.)"""
        if self.folder is None:
            return None
        payload = {**self.meta(), STEP: step, **{key: part.state_dict() for key, part in self.parts.items()}}
        path = None
        if self.dist.is_main:
            target = self.folder / ckpt.checkpoint_name(step)
            try:
                with writing(target):
                    path = ckpt.save_checkpoint(target, payload)
            except DiskFull as full:  # the file never took its name: earlier checkpoints are whole
                self.failed = self.failed or full
            else:
                ckpt.prune(self.folder, self.keep, self.hold(step) if self.hold is not None else None)
                ckpt.remove_partial(self.folder, keep_pid=os.getpid())
                self.saved = ckpt.list_checkpoints(self.folder)
        distributed.barrier()  # no rank reads checkpoints (a rollback) before rank 0 has written them
        return path

    def load(self, *, before_step: int | None = None) -> Loaded:
        """The newest checkpoint that loads (taken before ``before_step`` if given); older ones
        are tried when newer ones do not load. :class:`InputError` when there is none."""
        if self.folder is None:
            raise InputError("checkpoints are off in this run")
        check = None if self.check is None else (lambda p, payload: self.check(Loaded(p, payload)))
        path, payload = ckpt.latest_loadable(self.folder, before_step=before_step, check=check)
        return Loaded(path, payload)

    def remove_partial(self) -> list[Path]:
        """Rank 0 deletes every partial save in the folder (a run starting: none is its own)."""
        if self.folder is None or not self.dist.is_main:
            return []
        return ckpt.remove_partial(self.folder)

    def check_fits(self, loaded: Loaded) -> None:
        """Before :meth:`restore`: the checkpoint's model has this model's parameter names and
        shapes, its optimizer state the shapes of the parameters it belongs to and each parameter
        group's settings of this optimizer's kinds, its scheduler state this scheduler's entries,
        and the guarded step's loss scaler and monitors can take their states (each checks its
        own: ``check_state``). One :class:`InputError` line naming the file and the first
        difference; nothing is loaded. Parts that are not a :class:`ModelState`,
        :class:`OptimizerState`, LR scheduler or guarded step are not looked at.

        Example::

            >>> manager = CheckpointManager(None, {MODEL: ModelState(nn.Linear(4, 1))}, keep=1)
            >>> manager.check_fits(Loaded(Path("step-00000002.pt"), {MODEL: nn.Linear(4, 1).state_dict()}))
            >>> try:
            ...     manager.check_fits(Loaded(Path("step-00000002.pt"), {MODEL: nn.Linear(8, 1).state_dict()}))
            ... except InputError as err:
            ...     print(err)
            step-00000002.pt: its model does not match the one this run builds: weight is [1, 8] in the checkpoint, [1, 4] here
        """
        payload = loaded.payload
        model = self.parts.get(MODEL)
        if isinstance(model, ModelState):
            module = distributed.unwrap(model.model)
            _check_model(loaded.path, payload.get(MODEL), module.state_dict(), {n for n, _ in module.named_parameters()})
        optimizer = self.parts.get(OPTIMIZER)
        if isinstance(optimizer, OptimizerState) and not optimizer.fsdp:
            _check_optimizer(loaded.path, payload.get(OPTIMIZER), optimizer.optimizer)
        scheduler = self.parts.get(SCHEDULER)
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            _check_scheduler(loaded.path, payload.get(SCHEDULER), scheduler, loaded.step)
        if isinstance(payload.get(STATE), Mapping):
            _check_step_state(loaded.path, payload[STATE], self.parts.get(STATE), payload.get(CONFIG))

    def restore(self, loaded: Loaded, parts: Iterable[str] | None = None) -> None:
        """Load ``parts`` (default: all registered) from ``loaded``; one :class:`InputError` line
        naming the part when the checkpoint does not fit this run. Each part checks what it
        takes (the loss scaler's and the monitors' states raise ``ValueError`` naming a bad
        field; an RNG state with an int past C's ``long``, ``OverflowError``); a run restores
        before it writes anything, so such a checkpoint leaves the run folder as it was.

        Example (an RNG state NumPy cannot take)::

            >>> manager = CheckpointManager(None, {RNG: RngState(distributed.DistInfo())}, keep=1)
            >>> state = ckpt.rng_state()
            >>> try:
            ...     manager.restore(Loaded(Path("step-00000002.pt"), {RNG: {**state, "numpy": {
            ...         **state["numpy"], "pos": 10**30}}}))
            ... except InputError as err:
            ...     print(err)
            step-00000002.pt: does not fit this run (rng: Python int too large to convert to C long)
        """
        wanted = set(self.parts if parts is None else parts)
        unknown = wanted - set(self.parts)
        if unknown:
            raise ValueError(f"no registered part named {', '.join(sorted(unknown))}")
        names = [name for name in self.parts if name in wanted]  # registry order, whatever was asked
        for name in names:
            if name not in loaded.payload:
                raise InputError(f"{loaded.path}: does not fit this run (it has no {name})")
            try:
                self.parts[name].load_state_dict(loaded.payload[name])
            # (ArithmeticError: an RNG state's int past C's long, which NumPy and random refuse with OverflowError)
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError, ArithmeticError) as err:
                raise InputError(f"{loaded.path}: does not fit this run ({name}: {first_line(err)})") from None

    def set_aside_after(self, step: int) -> list[Path]:
        """Rank 0 moves checkpoints newer than ``step`` aside (see :func:`ckpt.set_aside_after`)."""
        if self.folder is None or not self.dist.is_main:
            return []
        moved = ckpt.set_aside_after(self.folder, step)
        self.saved = ckpt.list_checkpoints(self.folder)
        return moved


# ---------------------------------------------------------------------------- resume


def lrs_from_schedule(optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Each parameter group's LR set to the next step's, as a restored schedule left it
    (``get_last_lr``): after a resume's or a rollback's restore. A fast-path checkpoint's groups
    hold its last step's LR (the sync-free step writes each step's LR before its update), and
    the exact path's step takes ``group["lr"]`` as it is: the first step after it ran at the
    checkpoint's step's LR (25% low in a warm-up). No scheduler: nothing to do.

    Example::

        >>> model = nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.5 ** n)
        >>> opt.step(); schedule.step()
        >>> opt.param_groups[0]["lr"] = 1.0  # (the last step's, as a fast-path checkpoint holds it)
        >>> lrs_from_schedule(opt, schedule); opt.param_groups[0]["lr"]
        0.5
        >>> opt.param_groups[0]["lr"] = torch.tensor(1.0)  # (a fast-path checkpoint's, on the exact path)
        >>> lrs_from_schedule(opt, schedule); opt.param_groups[0]["lr"], schedule.get_last_lr()
        (0.5, [0.5])
    """
    if not hasattr(scheduler, "get_last_lr"):
        return
    # the exact path's LRs are Python floats: a fast-path checkpoint's float32 tensors, loaded into
    # it, made every later step's LR (and steps.csv's) float32-rounded (review 51i); the fast
    # path's DeviceLambdaLR drives tensors
    exact = not hasattr(scheduler, "device_factor")
    lrs = [float(lr) for lr in scheduler.get_last_lr()]
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor) and not exact:
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    if exact:
        scheduler._last_lr = lrs


def set_base_lr(scheduler: Any, lr: float) -> None:
    """Make ``lr`` the base learning rate of a ``LambdaLR`` schedule from now on: its
    ``base_lrs``, each group's ``initial_lr``, and each group's current ``lr`` (``lr x`` the
    schedule's factor at its current count), so the next step already uses it. What a rollback
    with ``rollback.lr_factor`` and a resume that changes ``optimizer.lr`` do after loading a
    checkpoint (which brings back the LR it was saved with).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 0.5 ** n)
        >>> optimizer.step(); scheduler.step()
        >>> set_base_lr(scheduler, 0.02)
        >>> scheduler.base_lrs, optimizer.param_groups[0]["lr"], scheduler.get_last_lr()
        ([0.02], 0.01, [0.01])
        >>> optimizer.step(); scheduler.step(); optimizer.param_groups[0]["lr"]
        0.005
    """
    scheduler.base_lrs = [lr for _ in scheduler.optimizer.param_groups]
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]



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
    run_id: str | None = None
    """The run folder's id (its ``run-id`` file); None for a folder made before run ids."""
    picked: bool = False
    """True when ``--resume RUN_DIR`` picked the checkpoint (the newest one that reads)."""
    unreadable: dict[str, str] = field(default_factory=dict)
    """The newer checkpoints ``--resume RUN_DIR`` passed over, by file name: why each did not read."""

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

    def run_config(self) -> dict[str, Any]:
        """The run folder's ``config.yaml`` as plain data: the base of the resumed run's config
        (then ``--set``). The task, and so any code a ``task.factory`` names, comes from here,
        never from the checkpoint. One :class:`InputError` line when it is missing or unreadable.

        Example::

            >>> import shutil, tempfile
            >>> run_dir = Path(tempfile.mkdtemp())
            >>> resume = Resume(Loaded(run_dir / "checkpoints" / "step-00000002.pt", {}), run_dir)
            >>> try:
            ...     resume.run_config()
            ... except InputError as err:
            ...     print(str(err).replace(str(run_dir), "RUN"))
            --resume: RUN has no config.yaml; a resumed run takes its config (and task) from it
            >>> _ = (run_dir / "config.yaml").write_text("steps: 5\\n")
            >>> resume.run_config()
            {'steps': 5}
            >>> shutil.rmtree(run_dir)
        """
        path = RunPaths.existing(self.run_dir).config
        if not path.is_file():
            raise InputError(f"--resume: {self.run_dir} has no config.yaml; a resumed run takes its config (and task) "
                             "from it")
        data = read_file(path)
        if not data:  # (read as the defaults, an fp16 run resumed as bf16: refused as report refuses it)
            raise InputError(f"--resume: config file {path}: empty; a run's config.yaml holds every setting")
        return as_it_ran(data)  # (a run of an older ampguard goes on as it ran)


def _example_payload(step: int, config: dict[str, Any]) -> dict[str, Any]:
    """A payload :func:`check_payload` accepts, for the examples (no model, no optimizer)."""
    state = {"scaler": {}, "step": step, "updates": step, "precision": config.get("precision", "fp32"),
             "accumulation_steps": 1, "monitors": {}}
    return {STEP: step, UPDATES: step, CONFIG: config, MODEL: {}, OPTIMIZER: {"state": {}, "param_groups": []},
            SCHEDULER: {}, STATE: state, RNG: {}, DATA: step, ROLLBACKS: []}


def find_resume(target: str | Path) -> Resume:
    """The checkpoint for ``--resume RUN_DIR|CHECKPOINT``: a run folder's newest one that reads,
    or the file named (inside its run folder's ``checkpoints/``). Before anything is read the run
    folder must be writable; then the checkpoint is checked (:func:`check_payload`,
    :func:`check_belongs`) and its run folder must hold a ``steps.csv`` to continue.

    ``RUN_DIR``: files that do not read as an ampguard checkpoint (torn by a kill, empty, foreign,
    pickled code) are passed over for the next older one, as after a crash; the newest one that
    reads is the one, and if it does not belong to this run (bad fields, another run's id, a name
    that is not its step) the resume is refused naming it: it never silently gives way to an
    older one.

    Example::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "precision": "bf16", "steps": 10})
        >>> payload = _example_payload(4, config.model_dump(mode="json"))
        >>> path = ckpt.save_checkpoint(run_dir / "checkpoints" / "step-00000004.pt", payload)
        >>> _ = (run_dir / "steps.csv").write_text("")
        >>> resume = find_resume(run_dir)
        >>> resume.path.name, resume.loaded.step, resume.run_dir == run_dir, resume.picked
        ('step-00000004.pt', 4, True, True)
        >>> find_resume(path).run_dir == run_dir  # a file inside checkpoints/: its run folder is two up
        True
        >>> _ = ckpt.save_checkpoint(run_dir / "checkpoints" / "step-00000009.pt", payload)  # step 4 inside
        >>> try:
        ...     find_resume(run_dir)
        ... except InputError as err:
        ...     print(str(err).replace(str(run_dir), "RUN"))
        RUN/checkpoints/step-00000009.pt: named for step 9 but holds step 4; it is not the checkpoint a run saved under that name
        >>> (run_dir / "checkpoints" / "step-00000009.pt").unlink()
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
        run_dir = target
        if not (target / "config.yaml").exists() and not (target / "checkpoints").exists():
            raise InputError(f"--resume: {target} is not a run folder (no config.yaml, no checkpoints/); "
                             f"{_what_to_pass(target)}")
    elif target.is_file():
        if target.parent.name.startswith("abandoned-") and target.parent.parent.name == "checkpoints":
            raise InputError(f"--resume: {target} was set aside (checkpoints/{target.parent.name}/): a resume or a "
                             "rollback went on from an older checkpoint, and the run's steps.csv and checkpoints hold "
                             "that timeline from there; it cannot be resumed in this run folder")
        run_dir = target.parent.parent if target.parent.name == "checkpoints" else target.parent
    elif not target.exists():
        raise InputError(f"--resume: no such run folder or checkpoint file: {target}")
    else:  # (not a FIFO or a device either: torch.load would wait on it)
        raise InputError(f"--resume: {target} is neither a run folder nor a checkpoint file")
    paths = RunPaths.existing(run_dir)
    paths.check_writable()
    paths.check_not_written()
    run_id = paths.run_id()
    unreadable: dict[str, str] = {}
    if target.is_dir():
        loaded = _newest_readable(paths, unreadable)
    else:
        loaded = Loaded(target, ckpt.load_checkpoint(target))
    check_payload(loaded)
    if not paths.csv.is_file():
        raise InputError(f"{loaded.path}: its run folder {run_dir} has no steps.csv to continue")
    check_belongs(loaded, run_id, run_dir)
    return Resume(loaded, run_dir, run_id=run_id, picked=target.is_dir(), unreadable=unreadable)


def _what_to_pass(folder: Path) -> str:
    """What ``--resume`` takes instead of ``folder``, which is no run folder: the run folder above
    a ``checkpoints/`` folder, one of the run folders inside a ``log.dir`` such as ``runs/``.

    Example::

        >>> import shutil, tempfile
        >>> runs = Path(tempfile.mkdtemp())
        >>> _what_to_pass(runs)
        'pass runs/<name> or a checkpoint file'
        >>> (runs / "a" / "checkpoints").mkdir(parents=True)
        >>> _ = (runs / "a" / "config.yaml").write_text("steps: 5\\n")
        >>> for folder in (runs, runs / "a" / "checkpoints"):
        ...     print(_what_to_pass(folder).replace(str(runs), "RUNS"))
        pass one of its run folders (RUNS/<name>, e.g. RUNS/a) or a checkpoint file
        pass its run folder RUNS/a or a checkpoint file
        >>> shutil.rmtree(runs)
    """
    if folder.name == "checkpoints" and (folder.parent / "config.yaml").is_file():
        return f"pass its run folder {folder.parent} or a checkpoint file"
    try:
        runs = sorted(p for p in folder.iterdir() if (p / "config.yaml").is_file())
    except OSError:  # (unreadable: no example to give)
        runs = []
    if runs:  # (the newest last: run folders are named by a timestamp unless log.name says otherwise)
        return f"pass one of its run folders ({folder / '<name>'}, e.g. {runs[-1]}) or a checkpoint file"
    return "pass runs/<name> or a checkpoint file"


def _why_no_checkpoint(config_file: Path | None) -> str:
    """Why a run folder may hold no checkpoint, from its ``config.yaml`` (``""`` when it says nothing).

    Example::

        >>> import shutil, tempfile
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> _ = (run_dir / "config.yaml").write_text("checkpoint:\\n  every: 0\\n")
        >>> print(_why_no_checkpoint(run_dir / "config.yaml").strip())
        (checkpoint.every is 0: the run saves only at its end, at a guard's stop and on Ctrl-C/SIGTERM)
        >>> _ = (run_dir / "config.yaml").write_text("checkpoint:\\n  every: 5\\n")
        >>> _why_no_checkpoint(run_dir / "config.yaml"), _why_no_checkpoint(run_dir / "missing.yaml")
        ('', '')
        >>> shutil.rmtree(run_dir)
    """
    try:
        section = read_file(config_file).get("checkpoint") if config_file is not None else None
    except InputError:  # (unreadable: resuming it says so later; here it only explains)
        return ""
    if not isinstance(section, dict):
        return ""
    if section.get("enabled") is False:
        return " (checkpoint.enabled is false: the run saves none)"
    if section.get("every") == 0:
        return " (checkpoint.every is 0: the run saves only at its end, at a guard's stop and on Ctrl-C/SIGTERM)"
    return ""


def _newest_readable(paths: RunPaths, passed_over: dict[str, str]) -> Loaded:
    """The run folder's newest checkpoint that reads; the newer ones that do not go into
    ``passed_over`` (file name: why, the error line without its path)."""
    folder = paths.checkpoints
    errors = []
    for path in reversed(ckpt.list_checkpoints(folder)):
        try:
            return Loaded(path, ckpt.load_checkpoint(path))
        except InputError as err:
            errors.append(str(err))
            passed_over[path.name] = str(err).removeprefix(f"{path}: ")
    if errors:
        raise InputError(f"no loadable checkpoint in {folder} ({errors[0]})")
    raise InputError(f"no checkpoint in {folder}{_why_no_checkpoint(paths.config)}")


def check_belongs(loaded: Loaded, run_id: str | None, run_dir: Path | None = None) -> None:
    """Refuse a checkpoint that is not this run's: a file name that is not ``step-<N>.pt`` with
    N its step, or a :data:`RUN_ID` other than the run folder's ``run_id``. A checkpoint without
    an id (written before run ids) passes here; its config and model are checked as every
    checkpoint's are (:func:`check_resume`, :meth:`CheckpointManager.check_fits`).

    Example::

        >>> mine, other = "a" * 32, "b" * 32
        >>> check_belongs(Loaded(Path("step-00000005.pt"), {STEP: 5, RUN_ID: mine}), mine)
        >>> check_belongs(Loaded(Path("step-00000005.pt"), {STEP: 5}), mine)  # no id: judged by its config
        >>> for loaded in (Loaded(Path("step-00000099.pt"), {STEP: 5, RUN_ID: mine}),
        ...                Loaded(Path("best.pt"), {STEP: 5, RUN_ID: mine}),
        ...                Loaded(Path("step-00000005.pt"), {STEP: 5, RUN_ID: other})):
        ...     try:
        ...         check_belongs(loaded, mine, Path("runs/a"))
        ...     except InputError as err:
        ...         print(err)
        step-00000099.pt: named for step 99 but holds step 5; it is not the checkpoint a run saved under that name
        best.pt: not named step-<8 digits>.pt; a run resumes only from checkpoints under the names it saved them
        step-00000005.pt: saved by another run (run id bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb; runs/a is aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa); a run resumes only its own checkpoints
    """
    path, step = loaded.path, loaded.step
    named = ckpt.checkpoint_step(path)
    if named < 0:
        raise InputError(f"{path}: not named step-<8 digits>.pt; a run resumes only from checkpoints under the "
                         "names it saved them")
    if named != step:
        raise InputError(f"{path}: named for step {named} but holds step {step}; it is not the checkpoint a run "
                         "saved under that name")
    saved = loaded.payload.get(RUN_ID)
    if saved is not None and saved != run_id:
        where = run_dir if run_dir is not None else "this run folder"
        if run_id is None:
            raise InputError(f"{path}: saved by run {saved}, but {where} has no run-id file; resume the run folder "
                             "it came from")
        raise InputError(f"{path}: saved by another run (run id {saved}; {where} is {run_id}); a run resumes only "
                         "its own checkpoints")


# ---------------------------------------------------------------------------- the payload's schema

def _show(value: Any) -> str:
    """A value for an error line: short, one line."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, (Mapping, list, tuple, set)):
        return f"a {type(value).__name__}"
    text = shortened(repr(value), 40)
    return text if isinstance(value, (str, int, float, bool, type(None))) else f"{text} ({type(value).__name__})"


def _optimizer_state(value: Any) -> bool:
    return (isinstance(value, Mapping) and isinstance(value.get("state"), Mapping)
            and isinstance(value.get("param_groups"), list)
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in value["param_groups"]))


def _rng(value: Any) -> bool:
    return isinstance(value, Mapping) or (isinstance(value, list) and all(isinstance(v, Mapping) for v in value))


def _policy_entry(value: Any) -> bool:
    return (isinstance(value, dict) and set(value) == {"key", "old", "new", "step"} and isinstance(value["key"], str)
            and whole_number(value["step"]) and is_plain(value))


_SCHEMA: tuple[tuple[str, bool, Callable[[Any], bool], str], ...] = (
    # key, required, test, what it must be
    (STEP, True, whole_number, "an int >= 0"),
    (UPDATES, False, whole_number, "an int >= 0"),
    (DATA, True, whole_number, "an int >= 0"),
    (WORLD_SIZE, False, lambda v: whole_number(v, 1), "an int >= 1"),
    (CONFIG, True, lambda v: isinstance(v, dict) and is_plain(v), "a mapping of plain data"),
    (PRECISION, False, lambda v: isinstance(v, str), "a str"),
    (TORCH_VERSION, False, lambda v: isinstance(v, str), "a str"),
    (THROUGHPUT, False, lambda v: isinstance(v, str), "a str"),
    (DATA_NEXT, False, lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None, "64 hex digits"),
    (RUN_ID, False, lambda v: isinstance(v, str) and RUN_ID_PATTERN.fullmatch(v) is not None, "32 hex digits"),
    (MODEL, True, lambda v: isinstance(v, Mapping), "a mapping of parameter names to tensors"),  # (its entries:
    # ckpt.not_weights, in check_field, which names the first bad one: review 54n)
    (OPTIMIZER, True, _optimizer_state, "an optimizer state (a mapping with state and param_groups)"),
    (SCHEDULER, True, lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v), "a mapping"),
    (STATE, True, lambda v: isinstance(v, Mapping) and all(k in v for k in STATE_KEYS),
     f"a mapping with {', '.join(STATE_KEYS)}"),
    (RNG, True, _rng, "a mapping (a list of them under torchrun)"),
    (ROLLBACKS, False, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of str"),
    (POLICY, False, lambda v: isinstance(v, list) and all(_policy_entry(x) for x in v),
     "a list of {key, old, new, step}"),
    (AUTOCAST_DTYPES, False, lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in (*v, *v.values())),
     "a mapping of module names to dtype names"),
    (AUTOCAST_DTYPE_CHANGES, False, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
     "a list of str"),
    (DATA_ID, False, lambda v: isinstance(v, str), "a str"),
)
"""What each payload entry must be before anything uses it (:func:`check_field`)."""

_SCHEMA_OF = {row[0]: row for row in _SCHEMA}

_STATE_SCHEMA: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("step", whole_number, "an int >= 0"),
    ("updates", whole_number, "an int >= 0"),
    ("accumulation_steps", lambda v: whole_number(v, 1), "an int >= 1"),
    ("precision", lambda v: isinstance(v, str), "a str"),
    ("scaler", lambda v: isinstance(v, Mapping), "a mapping"),
    ("monitors", lambda v: isinstance(v, Mapping), "a mapping"),
)


def check_payload(loaded: Loaded) -> None:
    """The payload's schema, checked after the weights-only load and before any field is used:
    each entry's type (:func:`check_field`), the config the config schema takes
    (:func:`check_config`), the guarded step's state (:data:`STATE_KEYS`), and the counters
    agreeing with each other. One :class:`InputError` line naming the file and the field.

    Example::

        >>> payload = _example_payload(4, {})
        >>> check_payload(Loaded(Path("step-00000004.pt"), payload))
        >>> for bad in ({STEP: "abc"}, {SCHEDULER: "x"}, {WORLD_SIZE: "two"}, {DATA: -1}, {ROLLBACKS: [1]},
        ...             {STATE: {**payload[STATE], "step": 3}}, {UPDATES: 5}):
        ...     try:
        ...         check_payload(Loaded(Path("step-00000004.pt"), {**payload, **bad}))
        ...     except InputError as err:
        ...         print(err)
        step-00000004.pt: bad checkpoint: step is 'abc', expected an int >= 0
        step-00000004.pt: bad checkpoint: scheduler is 'x', expected a mapping
        step-00000004.pt: bad checkpoint: world_size is 'two', expected an int >= 1
        step-00000004.pt: bad checkpoint: data_position is -1, expected an int >= 0
        step-00000004.pt: bad checkpoint: rollbacks is a list, expected a list of str
        step-00000004.pt: bad checkpoint: state.step is 3, expected 4 (the checkpoint's step)
        step-00000004.pt: bad checkpoint: updates is 5, expected at most 4 (the checkpoint's step)
    """
    payload, path = loaded.payload, loaded.path

    def bad(key: str, value: Any, expected: str) -> InputError:
        return _bad(path, key, value, expected)

    if not isinstance(payload, Mapping):
        raise InputError(f"{path}: bad checkpoint: the payload is {_show(payload)}, expected a mapping")
    for key in _SCHEMA_OF:
        check_field(path, payload, key)
    check_config(path, payload[CONFIG])
    state, step = payload[STATE], payload[STEP]
    for key, test, expected in _STATE_SCHEMA:
        if not test(state[key]):
            raise bad(f"{STATE}.{key}", state[key], expected)
    if state["step"] != step:
        raise bad(f"{STATE}.step", state["step"], f"{step} (the checkpoint's step)")
    if state["updates"] > step:
        raise bad(f"{STATE}.updates", state["updates"], f"at most {step} (the checkpoint's step)")
    if UPDATES in payload and payload[UPDATES] > step:
        raise bad(UPDATES, payload[UPDATES], f"at most {step} (the checkpoint's step)")
    run = state["monitors"].get("run")  # (the run monitor's count: review 46b)
    if isinstance(run, Mapping) and whole_number(run.get("steps")) and run["steps"] > step:
        raise bad(f"{STATE}.monitors.run.steps", run["steps"], f"at most {step} (the checkpoint's step)")
    if len(payload.get(ROLLBACKS) or []) > step:  # one rollback a step at most
        raise bad(ROLLBACKS, payload[ROLLBACKS], f"at most {step} entries (one a step)")


def _bad(path: Path | str, key: str, value: Any, expected: str) -> InputError:
    return InputError(f"{path}: bad checkpoint: {key} is {_show(value)}, expected {expected}")


def check_field(path: Path | str, payload: Mapping[str, Any], key: str) -> None:
    """One payload entry (``key``, a row of :data:`_SCHEMA`) before it is used: there if required,
    of its type, and the ``model``'s entries tensors (:func:`ampguard.checkpoint.not_weights`,
    naming the first that is not). One :class:`InputError` line naming the file and the field.
    The one check of each: :func:`check_payload` runs every row, validate and locate the ``step``
    they report and the ``config`` whose ``task`` they compare (:func:`load_trained_weights`,
    review 54n: a step of 'abc' went into validate's report).

    Example::

        >>> for payload in ({STEP: "abc"}, {}, {MODEL: {"weight": [0.5]}}):
        ...     try:
        ...         check_field("step-00000004.pt", payload, next(iter(payload), STEP))
        ...     except InputError as err:
        ...         print(err)
        step-00000004.pt: bad checkpoint: step is 'abc', expected an int >= 0
        step-00000004.pt: bad checkpoint: step is missing
        step-00000004.pt: bad checkpoint: model.weight is a list of 1, expected a tensor
    """
    _, required, test, expected = _SCHEMA_OF[key]
    if key not in payload:
        if required:
            raise InputError(f"{path}: bad checkpoint: {key} is missing")
        return
    value = payload[key]
    if not test(value):
        raise _bad(path, key, value, expected)
    if key == MODEL and (entry := ckpt.not_weights(value)):
        raise InputError(f"{path}: bad checkpoint: {entry}")


def check_config(path: Path | str, config: dict[str, Any]) -> None:
    """A checkpoint's config (plain data: :func:`check_field`) is one the config schema takes,
    read as the run folder's ``config.yaml`` is (``as_it_ran``: a setting added since keeps the
    value an older run had); else one :class:`InputError` line naming the setting.

    Review 54n: a resume compares the run's settings with it, and records each difference as a
    policy change (POLICY line, ``events.jsonl``, the run card). It was only checked to be plain
    data, so ``scheduler_on_skip: -5`` resumed and the run recorded a change "from -5", a setting
    it could never have had. A value the schema refuses is a damaged field like any other: the
    resume is refused naming it (a run folder's newest checkpoint too: it reads, so it is not
    passed over for an older one, :func:`find_resume`).

    Example::

        >>> check_config("step-00000004.pt", {"monitor": {"alert_rate": 0.1}})  # (an older run's: no clear_rate)
        >>> check_config("step-00000004.pt", {"scheduler_on_skip": -5})
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: step-00000004.pt: bad checkpoint: config: scheduler_on_skip: Input should be 'hold' or 'step' (got -5)
    """
    try:
        config_of(as_it_ran(config))
    except ConfigError as err:  # ("config: scheduler_on_skip: ...")
        raise InputError(f"{path}: bad checkpoint: {err}") from None


def check_checkpoint(loaded: Loaded, run_id: str | None) -> None:
    """:func:`check_payload` then :func:`check_belongs`: what a run checks of a checkpoint it
    rolls back to (:class:`CheckpointManager`'s ``check``)."""
    check_payload(loaded)
    check_belongs(loaded, run_id)


# ---------------------------------------------------------------------------- does it fit this run


def _names(keys: list[Any]) -> str:
    shown = [shortened(repr(k), 60) for k in keys[:3]]
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return ", ".join(shown) + more


def _check_model(path: Path, saved: Any, live: Mapping[str, Any], parameters: set[str] | frozenset[str] = frozenset()
                 ) -> None:
    """The checkpoint's weights ``saved`` fit the model's state dict ``live``: the same names,
    shapes and dtypes, and its ``parameters`` (by name) finite; a buffer may hold an infinity
    (an attention mask of -inf)."""
    def refuse(why: str) -> InputError:
        return InputError(f"{path}: its model does not match the one this run builds: {why}")

    if not isinstance(saved, Mapping):
        raise refuse(f"it is {_show(saved)}")
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    if missing or unexpected:
        raise refuse("; ".join(([f"missing {_names(missing)}"] if missing else [])
                               + ([f"unexpected {_names(unexpected)}"] if unexpected else [])))
    for key, value in live.items():
        other = saved[key]
        if isinstance(value, torch.Tensor) and (not isinstance(other, torch.Tensor) or other.shape != value.shape):
            shape = list(other.shape) if isinstance(other, torch.Tensor) else _show(other)
            raise refuse(f"{key} is {shape} in the checkpoint, {list(value.shape)} here")
        if isinstance(value, torch.Tensor) and other.dtype != value.dtype:  # (load_state_dict would cast it, unsaid)
            raise refuse(f"{key} is {ckpt.dtype_name(other)} in the checkpoint, {ckpt.dtype_name(value)} here")
    if bad := ckpt.non_finite_weight({name: saved[name] for name in parameters if name in saved}):
        raise InputError(f"{path}: bad checkpoint: its model's {bad}: a run resumed from it would skip every step "
                         "(saved after its weights diverged? resume from an earlier checkpoint)")


def _check_optimizer(path: Path, saved: Any, optimizer: torch.optim.Optimizer) -> None:
    def refuse(why: str) -> InputError:
        return InputError(f"{path}: its optimizer state does not match this run's parameters: {why}")

    if not _optimizer_state(saved):
        raise refuse(f"it is {_show(saved)}")
    groups, live = saved["param_groups"], optimizer.param_groups
    sizes, live_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in live]
    if sizes != live_sizes:
        raise refuse(f"parameter groups of {sizes} in the checkpoint, {live_sizes} here")
    # review 52a: Optimizer.load_state_dict maps the saved ids by position and drops a state entry no id
    # names: a group naming an id twice, or a state entry of no group's parameter, left a parameter's
    # AdamW moments behind, its update restarted from nothing, unsaid
    ids = [pid for group in groups for pid in group["params"]]
    odd = [pid for pid in ids if not isinstance(pid, (int, str)) or isinstance(pid, bool)]
    if odd:
        raise refuse(f"a parameter id is {_show(odd[0])}")
    seen: set[Any] = set()
    twice = next((pid for pid in ids if pid in seen or seen.add(pid)), None)
    if twice is not None:
        raise refuse(f"parameter {twice!r} is named twice in its parameter groups")
    orphan = next((key for key in saved["state"] if key not in seen), None)
    if orphan is not None:
        raise refuse(f"the state of parameter {orphan!r} belongs to no parameter group (its groups name "
                     f"{_listed_ids(ids)})")
    moments: list[tuple[str, Any, torch.Tensor]] = []  # (name, parameter id, tensor): their finiteness read at once
    for i, (group, live_group) in enumerate(zip(groups, live)):
        # the group's settings replace the live group's (Optimizer.load_state_dict), and the step
        # reads them as they are: each must be of the live one's kind (betas two numbers, ...)
        for key, value in live_group.items():
            if key in ("params", "param_names"):  # (the load keeps this run's)
                continue
            if key not in group:
                if not _optional_flag(value):  # a flag an older PyTorch did not save is set by the optimizer
                    raise refuse(f"param_groups[{i}] has no {_names([key])}")
            elif not _same_setting(group[key], value):
                raise refuse(_difference(f"param_groups[{i}].{key}", group[key], value, "this optimizer's"))
        try:
            kinds = _state_kinds(optimizer, group, live_group)
        except ValueError as err:  # the optimizer's own check of its settings (a negative eps, ...)
            raise refuse(f"param_groups[{i}]: {first_line(err)}") from None
        for pid, param in zip(group["params"], live_group["params"]):
            if not isinstance(pid, (int, str)) or isinstance(pid, bool):
                raise refuse(f"a parameter id is {_show(pid)}")
            entry = saved["state"].get(pid)
            if entry is None:
                continue
            if not isinstance(entry, Mapping):
                raise refuse(f"the state of parameter {pid!r} is {_show(entry)}")
            if kinds is not None:  # what a step of this optimizer keeps: each of it there, a tensor where it is one
                missing = [name for name, tensor in kinds.items()
                           if name not in entry or (tensor and not isinstance(entry[name], torch.Tensor))]
                if missing:
                    name = missing[0]
                    raise refuse(f"the state of parameter {pid!r} has no {name!r}" if name not in entry else
                                 f"{name} of parameter {pid!r} is {_show(entry[name])}, not a tensor")
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.is_floating_point():
                    moments.append((name, pid, value))
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    raise refuse(f"{name} of parameter {pid!r} is {list(value.shape)}, the parameter "
                                 f"{list(param.shape)}")
                # (SGD's and AdamW's moments are in the parameter's dtype: load_state_dict casts another)
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.dtype != param.dtype:
                    raise refuse(f"{name} of parameter {pid!r} is {ckpt.dtype_name(value)}, the parameter "
                                 f"{ckpt.dtype_name(param)}")
                if not _finite_scalar(value):  # (a step count of NaN: NaN bias corrections, every weight NaN)
                    number = value.item() if isinstance(value, torch.Tensor) else value
                    raise refuse(f"{name} of parameter {pid!r} is {number:g}")
                if name in NON_NEGATIVE and _below_zero(value):  # (review 50e: a step of -4 crashed the first step
                    # after the resume had cut the logs; an exp_avg_sq below 0 made NaN updates, the weights NaN)
                    raise refuse(f"{name} of parameter {pid!r} is below 0 (a count or a mean of squares)")
    # a moment holding a NaN or an infinity (no update the guard applies leaves one): the first
    # update after the resume would make every weight NaN, each step after it skipped
    if moments and not bool(torch.stack([torch.isfinite(t).all().cpu() for _, _, t in moments]).all()):
        name, pid, _ = next(m for m in moments if not bool(torch.isfinite(m[2]).all()))
        raise refuse(f"{name} of parameter {pid!r} holds a non-finite value (saved after the optimizer's state "
                     "diverged, or damaged: resume from an earlier checkpoint)")


def check_data_next(loaded: Loaded, data: Any) -> None:
    """Refuse (one :class:`InputError` line) a resume whose data stream, seeked to the checkpoint's
    position, gives another next batch than the one the run saved (:data:`DATA_NEXT`): the task
    draws its batches otherwise now (another ampguard's built-in task, a factory's data or
    ``batches_from`` changed), and the resume would train on other batches than the run, unsaid.
    Nothing to compare in a checkpoint without one (an older ampguard's, a factory's stream with
    no ``batches_from``: reading it to its position at each save would cost a pass) nor where the
    stream gives none now (:meth:`~ampguard.data.DataStream.fingerprint`)."""
    saved = loaded.payload.get(DATA_NEXT)
    if saved is not None and data.fingerprint() not in (saved, None):
        raise InputError(f"{loaded.path}: the data's batch at its position (micro-batch {data.position}, counted from "
                         "0) is not the one the run saved it before: the task draws its batches otherwise now "
                         "(another ampguard's built-in task, or a factory's data or batches_from changed), and a "
                         "resume would train on other batches than the run; resume with what wrote it, or start a "
                         "new run")


def _listed_ids(ids: list[Any]) -> str:
    """A checkpoint's parameter ids in a few words: the first ones, and how many.

    Example::

        >>> _listed_ids([0, 1]), _listed_ids(list(range(40)))
        ('0, 1', '0, 1, 2, 3, 4, ... (40 in all)')
    """
    return ", ".join(map(repr, ids[:5])) + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")


def _state_kinds(optimizer: torch.optim.Optimizer, group: Mapping[str, Any], live_group: Mapping[str, Any]
                 ) -> dict[str, bool] | None:
    """What a step of ``optimizer`` under the checkpoint's ``group`` settings keeps for each
    parameter: each state entry's name, True where it is a tensor the parameter's shape (AdamW's
    ``exp_avg``), False where not (its ``step``; SGD's ``momentum_buffer`` without momentum:
    None). Read off one step of a fresh optimizer of the same class over a two-element tensor
    like the group's first parameter, so any optimizer answers for itself; None when that cannot
    run (an optimizer that needs a closure, a setting its constructor cannot take back). The
    constructor's own checks of the settings raise ``ValueError`` (a negative ``eps``).

    Example::

        >>> w = nn.Parameter(torch.zeros(3))
        >>> adamw = torch.optim.AdamW([w], amsgrad=True)
        >>> _state_kinds(adamw, adamw.param_groups[0], adamw.param_groups[0])
        {'step': False, 'exp_avg': True, 'exp_avg_sq': True, 'max_exp_avg_sq': True}
        >>> _state_kinds(adamw, {**adamw.param_groups[0], "eps": -1.0}, adamw.param_groups[0])
        Traceback (most recent call last):
        ...
        ValueError: Invalid epsilon value: -1.0
    """
    if not live_group["params"]:
        return None
    like = live_group["params"][0]
    try:
        takes = inspect.signature(type(optimizer)).parameters
    except (TypeError, ValueError):
        return None
    settings = {key: group.get(key, live_group[key]) for key in optimizer.defaults if key in live_group and key in takes}
    probe = torch.zeros(2, dtype=like.dtype, device=like.device, requires_grad=True)
    try:
        fresh = type(optimizer)([probe], **settings)
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - a constructor that takes other arguments: nothing to compare with
        return None
    probe.grad = torch.zeros_like(probe)
    try:
        with rng_kept():
            fresh.step()
    except Exception:  # noqa: BLE001 - a step that needs a closure, or a device it cannot run on here
        return None
    return {name: isinstance(value, torch.Tensor) and value.dim() > 0 for name, value in fresh.state[probe].items()}


NON_NEGATIVE = ("step", "exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf")
"""Optimizer state no step leaves below 0: the step count, and the running means or sums of
squares (Adam's and AdamW's, RMSprop's, Adagrad's, Adadelta's) and Adamax's largest magnitude."""


def _below_zero(value: Any) -> bool:
    """Whether a number, or any value of a tensor, is below 0.

    Example::

        >>> _below_zero(torch.tensor([0.0, 2.0])), _below_zero(torch.tensor(-4.0)), _below_zero(3)
        (False, True, False)
    """
    if isinstance(value, torch.Tensor):
        return not value.is_complex() and value.numel() > 0 and bool((value < 0).any())
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0


def _finite_scalar(value: Any) -> bool:
    """False for a number or a one-value floating tensor that is NaN or infinite; True otherwise.

    Example::

        >>> _finite_scalar(torch.tensor(3.0)), _finite_scalar(torch.tensor(float("nan"))), _finite_scalar(float("inf"))
        (True, False, False)
    """
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 or not value.is_floating_point() or bool(torch.isfinite(value))
    return not isinstance(value, float) or math.isfinite(value)


def _optional_flag(value: Any) -> bool:
    """A parameter group's flag: True, False or None (``fused``, ``foreach``, ``amsgrad``, ...)."""
    return value is None or isinstance(value, bool)


def _scalar(value: Any) -> bool:
    """A number, or a tensor of one floating-point value (the LR on the fast path)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return real_number(value)


def _same_setting(saved: Any, live: Any) -> bool:
    """A parameter group's setting of the live one's kind. ``fast`` may change on resume, and
    either path reads the other's checkpoints: a flag (``fused``, ``foreach``, ...) may be True,
    False or None whatever the live one is, and a number (``lr``: a tensor on the fast path) a
    finite number or a one-value tensor; anything else as :func:`_same_kind` (``betas``: two
    numbers).

    Example::

        >>> _same_setting(None, True), _same_setting(torch.tensor(0.1), 0.1), _same_setting(0.1, torch.tensor(0.1))
        (True, True, True)
        >>> _same_setting([0.9], (0.9, 0.999)), _same_setting("x", 0.1), _same_setting(float("nan"), 0.1)
        (False, False, False)
    """
    if _optional_flag(live):
        return _optional_flag(saved)
    if _scalar(live):
        if isinstance(saved, torch.Tensor):
            return _scalar(saved) and bool(torch.isfinite(saved).all())
        return finite_number(saved)
    return _same_kind(saved, live)


def _same_kind(saved: Any, live: Any, depth: int = 0) -> bool:
    """Whether a saved value is of the live one's kind: the same type (an int for a float too;
    numbers finite, ints within int64), lists of the same length and kinds, mappings whose shared
    keys are, tensors of the same shape.

    Example::

        >>> _same_kind([1, 0.5], [0.1, 0.1]), _same_kind([float("nan")], [0.1]), _same_kind(10**30, 3)
        (True, False, False)
    """
    if depth > MAX_DEPTH:
        return False
    if live is None or isinstance(live, (bool, str)):
        return type(saved) is type(live)
    if isinstance(live, int):
        return whole_number(saved, -(2**63)) and saved < 2**63
    if isinstance(live, float):
        return finite_number(saved)
    if isinstance(live, (list, tuple)):
        return (isinstance(saved, (list, tuple)) and len(saved) == len(live)
                and all(_same_kind(a, b, depth + 1) for a, b in zip(saved, live)))
    if isinstance(live, Mapping):
        return isinstance(saved, Mapping) and all(
            _same_kind(saved[k], v, depth + 1) for k, v in live.items() if k in saved)
    if isinstance(live, torch.Tensor):
        return isinstance(saved, torch.Tensor) and saved.shape == live.shape
    return type(saved) is type(live)


def _check_step_state(path: Path, saved: Mapping[str, Any], state: Any, config: Any = None) -> None:
    """The guarded step's saved loss scaler and monitors, checked by the parts that will load
    them (their ``check_state``: a str factor, a window's position past its size, ...), so that
    the line names the whole field (``state.monitors.run.skip_window.pos``). Loaded as they are,
    such fields fail only at the first step, mid-run. A part without ``check_state``, or a
    monitor this run does not have, is not looked at (the step loads only those it has). The
    scaler's settings are held to the checkpoint's own ``config`` too (:func:`check_scaler_state`).

    Example::

        >>> from ampguard.step import AmpTrainState
        >>> model = nn.Linear(2, 1)
        >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss,
        ...                       precision="fp16")
        >>> saved = state.state_dict()
        >>> try:
        ...     _check_step_state(Path("step-00000002.pt"), {**saved, "scaler": {**saved["scaler"], "scale": -1.0}},
        ...                       state)
        ... except InputError as err:
        ...     print(err)
        step-00000002.pt: bad checkpoint: state.scaler.scale is -1.0, expected a number in [0, 3.40282e+38] (a float32)
    """
    scaler, monitors = getattr(state, "scaler", None), getattr(state, "monitors", None)
    settings = config.get("scaler") if isinstance(config, Mapping) else None
    check_scaler_state(path, saved.get("scaler"), scaler, settings)
    try:
        saved_monitors = saved.get("monitors")
        if isinstance(saved_monitors, Mapping) and isinstance(monitors, Mapping):
            if "run" in monitors and "run" not in saved_monitors:
                # (every checkpoint a run writes holds it; without it the counts would start again at the
                # resume, unsaid, and the card's "updates applied" disagree with the CSV: review 46b)
                raise ValueError(f"{STATE}.monitors has no 'run' (the run monitor's counts), which every "
                                 "checkpoint of a run holds")
            for name, monitor in monitors.items():
                if name in saved_monitors and hasattr(monitor, "check_state"):
                    monitor.check_state(saved_monitors[name], f"{STATE}.monitors.{name}.")
    except ValueError as err:
        raise InputError(f"{path}: bad checkpoint: {first_line(err)}") from None


def check_scaler_state(path: Path | str, saved: Any, scaler: Any, settings: Any = None) -> None:
    """A checkpoint's ``state.scaler``, checked by the loss scaler that will load it (its
    ``check_state``: one :class:`InputError` line naming the field; the factors in the config's
    ranges). A scaler that is on needs one: an fp16 run's checkpoint always holds it, and without
    it the run would go on at ``init_scale``, the scale it had found lost. Nothing to check for a
    scaler that is off.

    ``settings``, the checkpoint's own config's ``scaler`` section (a resume's), if given: the
    saved factors, interval and floor must be its. A run's scaler holds its config's settings, and
    a resume that changes one sets it in the scaler (:func:`apply_policy_changes`), so every
    checkpoint a run writes agrees; one that does not was edited (review 54b: a floor of 3e38,
    above the config's ``init_scale``, skipped every step, exit 0), and resumed it would train on
    with a setting its config, its card and a later resume's comparison do not say. A setting the
    config lacks (an older ampguard's) is not compared.

    Example::

        >>> from ampguard.precision import Precision
        >>> fp16 = Precision("fp16", "cpu").make_scaler()
        >>> check_scaler_state("c.pt", fp16.state_dict(), fp16)
        >>> check_scaler_state("c.pt", {}, Precision("bf16", "cpu").make_scaler())
        >>> for saved, settings in (({}, None), ({**fp16.state_dict(), "backoff_factor": 0.25}, {"backoff_factor": 0.5})):
        ...     try:
        ...         check_scaler_state("c.pt", saved, fp16, settings)
        ...     except InputError as err:
        ...         print(err)
        c.pt: bad checkpoint: state.scaler is empty: a loss scaler that is on needs its saved scale
        c.pt: bad checkpoint: state.scaler.backoff_factor is 0.25, not its config's scaler.backoff_factor 0.5 (a run saves its scaler with its config's settings)
    """
    if not (hasattr(scaler, "check_state") and scaler.is_enabled()):
        return
    try:
        scaler.check_state(saved, f"{STATE}.scaler.")
    except ValueError as err:
        raise InputError(f"{path}: bad checkpoint: {first_line(err)}") from None
    if not isinstance(settings, Mapping):
        return
    for key in ("growth_factor", "backoff_factor", "growth_interval", "min_scale"):
        if key in saved and key in settings and saved[key] != settings[key]:
            raise InputError(f"{path}: bad checkpoint: {STATE}.scaler.{key} is {brief(saved[key])}, not its config's "
                             f"scaler.{key} {brief(settings[key])} (a run saves its scaler with its config's settings)")


SCHEDULER_COUNTS = ("last_epoch", "_step_count")
"""A scheduler's counts of its steps: a fresh scheduler's plus at most one a step of the run
(the guard steps it once an applied update; ``scheduler_on_skip: step``, once a step)."""


def _check_scheduler(path: Path, saved: Any, scheduler: Any, step: int) -> None:
    def refuse(why: str) -> InputError:
        return InputError(f"{path}: its scheduler state does not fit this run's scheduler: {why}")

    if not isinstance(saved, Mapping):
        raise refuse(f"it is {_show(saved)}")
    live = scheduler.state_dict()
    for key, value in saved.items():
        if key not in live:
            if not isinstance(key, str) or key.startswith("__") or key in vars(scheduler):
                raise refuse(f"{_names([key])} is not scheduler state")  # it would replace one of its attributes
            continue
        if not _same_kind(value, live[key]):
            raise refuse(_difference(key, value, live[key], "this scheduler's"))
        # review 50e: a last_epoch of -5 passed, then the first step divided by zero after the
        # resume had cut the run's logs; one of 1e9 put the LR at the schedule's floor, unsaid
        if key in SCHEDULER_COUNTS and type(value) is int and type(live[key]) is int and \
                not live[key] <= value <= live[key] + step:
            raise refuse(f"{key} is {value}, and a scheduler of {step} step(s) counts {live[key]} to {live[key] + step}")


def _difference(name: str, saved: Any, live: Any, whose: str, depth: int = 0) -> str:
    """What makes ``saved`` (named ``name``) not of ``live``'s kind (:func:`_same_kind`), in
    words: the first entry of a list or mapping that differs, or the lengths.

    Example::

        >>> _difference("base_lrs", ["x"], [0.1], "this scheduler's")
        "base_lrs[0] is 'x', this scheduler's is 0.1"
        >>> _difference("base_lrs", [0.1, 0.1], [0.1], "this scheduler's")
        "base_lrs has 2 entries, this scheduler's 1"
    """
    if depth < MAX_DEPTH and isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)):
        if len(saved) != len(live):
            return f"{name} has {len(saved)} entries, {whose} {len(live)}"
        for i, (a, b) in enumerate(zip(saved, live)):
            if not _same_kind(a, b, depth + 1):
                return _difference(f"{name}[{i}]", a, b, whose, depth + 1)
    if depth < MAX_DEPTH and isinstance(saved, Mapping) and isinstance(live, Mapping):
        for key, value in live.items():
            if key in saved and not _same_kind(saved[key], value, depth + 1):
                return _difference(f"{name}.{key}", saved[key], value, whose, depth + 1)
    return f"{name} is {_show(saved)}, {whose} is {_show(live)}"


# ---------------------------------------------------------------------------- resume checks


def _short(value: Any) -> str:
    """A setting's value in a resume's line (a refusal, a POLICY line), as the config spells it
    (review 53a: Python's ``None``/``True`` of settings written ``null``/``true``), cut short."""
    return shortened(yaml_spelled(value), 80)


def check_resume(resume: Resume, config: Config, world_size: int | None = None, rank: int = 0) -> None:
    """Refuse a resume that would make the run differ from the uninterrupted one: a fixed config
    key changed (:data:`RESUME_FIXED`, naming the exact field), a checkpoint beyond ``steps``, a
    data position beyond what its steps could have taken (``step x accumulation_steps +
    rollbacks x rollback.skip_batches``, the largest the run used: each step takes
    ``accumulation_steps`` micro-batches and each rollback seeks at most ``skip_batches`` past a
    position already taken; the stream is skipped to it by reading, so a larger one would
    spin), or (when ``world_size`` is given)
    another number of processes. ``config`` is the run folder's ``config.yaml`` plus ``--set``;
    the checkpoint's own config is only compared with it.

    Example::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> run_dir = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "precision": "bf16", "steps": 10})
        >>> payload = _example_payload(4, config.model_dump(mode="json"))
        >>> path = ckpt.save_checkpoint(run_dir / "checkpoints" / "step-00000004.pt", payload)
        >>> _ = (run_dir / "steps.csv").write_text("")
        >>> resume = find_resume(path)
        >>> check_resume(resume, config, world_size=1)  # the same run, more steps to go: fine
        >>> for changed in ({"precision": "fp16"}, {"task": {"name": "linear", "batch_size": 8}}, {"steps": 3}):
        ...     try:
        ...         check_resume(resume, validate({**config.model_dump(mode="json"), **changed}))
        ...     except InputError as err:
        ...         print(str(err).replace(str(run_dir), "RUN"))
        --resume: precision was 'bf16' in the checkpoint, now 'fp16'; a resumed run must keep it
        --resume: task.batch_size was 32 in the checkpoint, now 8; a resumed run must keep it
        --resume: RUN/checkpoints/step-00000004.pt is at step 4, the run asks for 3 steps; raise steps ...
        >>> for bad in ({WORLD_SIZE: 2}, {DATA: 10**12}):
        ...     try:
        ...         check_resume(Resume(Loaded(path, {**payload, **bad}), run_dir), config, world_size=1)
        ...     except InputError as err:
        ...         print(str(err).replace(str(run_dir), "RUN"))
        RUN/checkpoints/step-00000004.pt: saved by 2 processes, this run has 1; resume with the same world size
        RUN/checkpoints/step-00000004.pt: data position 1000000000000 is beyond what 4 steps could have taken (4 = step x accumulation_steps + rollbacks x the largest rollback.skip_batches the run used)
        >>> shutil.rmtree(run_dir)
    """
    saved, now = as_it_ran(resume.saved_config), plain_data(config)
    where = resume.path if resume.picked else "the checkpoint"
    for key in RESUME_FIXED:
        if key == "rollback.window" and not holds_spike_window(resume.loaded.payload):
            continue  # (no detector's window to keep: loss_spike turned on here gets a window of its own)
        # a node's own task.options (its data path), as the run began with (check_same_configs
        # warns): the checkpoint's config is rank 0's, and a rank that gave its own again was
        # refused alone, the run never resumable (review 51g)
        if key == "task":  # (the settings the task reads: review 53i)
            changed = changed_task(saved, now, apart=("options",) if rank > 0 else ())
        else:
            changed = changed_setting(saved, now, key)
        if changed:
            key, a, b = changed
            raise InputError(f"--resume: {key} was {_short(a)} in {where}, now {_short(b)}; a resumed run must keep it")
    step = resume.loaded.step
    if step > config.steps:  # (at config.steps the run was complete: resuming rewrites its card)
        raise InputError(f"--resume: {resume.path} is at step {step}, the run asks for {counted(config.steps, 'step')}; "
                         "raise steps (--set steps=N) to continue")
    saved_world = int(resume.loaded.payload.get(WORLD_SIZE, 1))
    if world_size is not None and saved_world != world_size:
        raise InputError(f"{resume.path}: saved by {counted(saved_world, 'process', 'processes')}, this run has {world_size}; "
                         "resume with the same world size")
    check_data_position(resume.path, resume.loaded.payload, config)


def holds_spike_window(payload: Mapping[str, Any]) -> bool:
    """Whether a checkpoint holds a loss-spike detector's window (whose size ``rollback.window``
    is, so a resume must keep it): its run had the ``loss_spike`` trigger, or its guarded step's
    state carries the window on (a run resumed with the trigger off keeps the one it loaded, for
    a later resume that turns it back on: :class:`ampguard.step._Monitors`). A checkpoint of a run
    that never had the trigger holds none (review 58a: ``loss_spike`` turned on at resume was
    stuck with the window the first run's config happened to have).

    Example::

        >>> from ampguard.config import validate
        >>> off = validate({}).model_dump(mode="json")
        >>> on = validate({"rollback": {"triggers": ["loss_spike"]}, "checkpoint": {"every": 5}}).model_dump(mode="json")
        >>> window = {"sum": {}, "sq": {}}
        >>> [holds_spike_window({CONFIG: c, STATE: {"monitors": m}})
        ...  for c, m in ((off, {}), (on, {SPIKE_MONITOR: window}), (off, {SPIKE_MONITOR: window}))]
        [False, True, True]
    """
    rollback = (payload.get(CONFIG) or {}).get("rollback")
    triggers = rollback.get("triggers") if isinstance(rollback, Mapping) else None
    monitors = (payload.get(STATE) or {}).get("monitors")
    return (isinstance(triggers, list) and SPIKE_MONITOR in triggers) or \
        (isinstance(monitors, Mapping) and SPIKE_MONITOR in monitors)


def changed_setting(saved: Mapping[str, Any], now: Mapping[str, Any], key: str,
                    apart: Iterable[str] = ()) -> tuple[str, Any, Any] | None:
    """The first setting under ``key`` (dotted) that differs between two configs as plain data
    (``saved``: a checkpoint's; ``now``), as ``(exact dotted key, saved value, value now)``; None
    when none does. Compared as they take effect (:func:`_effective`: a factory file by its name
    and function, wherever its folder now is; named as written), ``key``'s own entries named in
    ``apart`` left out. One comparison for what a resume must keep (:func:`check_resume`) and
    the task a checkpoint is loaded into (:func:`ampguard.checkpoint.load_weights`, review 53b).

    Example::

        >>> changed_setting({"task": {"n_head": 8, "batch_size": 4}}, {"task": {"n_head": 4, "batch_size": 2}}, "task")
        ('task.batch_size', 4, 2)
        >>> changed_setting({"task": {"n_head": 8, "batch_size": 4}}, {"task": {"n_head": 4, "batch_size": 2}},
        ...                 "task", apart=("batch_size",))
        ('task.n_head', 8, 4)
        >>> changed_setting({"task": {"factory": "/a/m.py:build"}}, {"task": {"factory": "m.py:build"}}, "task")
    """
    raw = saved, now
    a, b = _effective(dict(saved)), _effective(dict(now))
    for part in key.split("."):
        a = a.get(part) if isinstance(a, dict) else None  # a checkpoint may lack a whole section
        b = b.get(part) if isinstance(b, dict) else None
    apart = tuple(apart)
    if apart and isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in side.items() if k not in apart} for side in (a, b))
    while isinstance(a, dict) and isinstance(b, dict):  # name the exact field, e.g. task.options.cap
        diff = _first_difference(a, b)
        if diff is None:
            break
        key, a, b = f"{key}.{diff}", a.get(diff), b.get(diff)
    if _same(a, b):
        return None
    if key == "task.factory":  # compared by the file's name; named as written
        a, b = (flat_keys(side).get(key) for side in raw)
    return key, a, b


def changed_task(saved: Mapping[str, Any], now: Mapping[str, Any],
                 apart: Iterable[str] = ()) -> tuple[str, Any, Any] | None:
    """The first ``task`` setting that makes another model or data stream between two configs as
    plain data (``saved``: a checkpoint's; ``now``), as :func:`changed_setting` gives it; None when
    none does. The workload first (``task.name``, ``task.factory``: named before a size that
    differs because of it), then only the settings that workload reads
    (:meth:`~ampguard.config.TaskConfig.reads`): review 53i, a digits run was refused for an
    ``n_head`` it never reads, a linear one for any size. ``preset`` is compared as the sizes it
    sets (they are in the config, and filled in here for a config that lacks them): gpt2-small
    and the same four sizes spelled out are one model. ``apart``: more of ``task``'s entries
    left out. For :func:`check_resume` (whose :data:`RESUME_FIXED` ``task`` is this) and
    :func:`check_task_settings`.

    Example::

        >>> changed_task({"task": {"name": "digits", "n_head": 4}}, {"task": {"name": "digits", "n_head": 8}})
        >>> changed_task({"task": {"name": "charlm", "n_head": 4}}, {"task": {"name": "charlm", "n_head": 8}})
        ('task.n_head', 4, 8)
        >>> changed_task({"task": {"name": "digits", "n_embd": 8}}, {"task": {"name": "charlm", "n_embd": 64}})
        ('task.name', 'digits', 'charlm')
        >>> changed_task({"task": {"preset": "gpt2-small"}}, {"task": {"n_layer": 12, "n_head": 12, "n_embd": 768,
        ...                                                            "block_size": 1024}})
    """
    for key in ("task.name", "task.factory"):
        changed = changed_setting(saved, now, key)
        if changed:
            return changed
    sides = [side.get("task") for side in (saved, now)]
    if not all(isinstance(side, Mapping) for side in sides):  # (a checkpoint without a task section)
        return changed_setting(saved, now, "task", apart)
    sides = [_sized_task(side) for side in sides]
    task = sides[1]
    reads = TaskConfig.reads(task.get("name"), task.get("factory"))
    apart = {*apart, *(key for side in sides for key in side if key not in reads)}
    return changed_setting({**saved, "task": sides[0]}, {**now, "task": sides[1]}, "task", apart)


def _sized_task(task: Mapping[str, Any]) -> dict[str, Any]:
    """A ``task`` section (plain data) with its ``preset`` given as the sizes it sets, not by name:
    the validator puts them in the config, here as well for one written without them.

    Example::

        >>> _sized_task({"preset": "gpt2-small", "name": "charlm"})
        {'name': 'charlm', 'n_layer': 12, 'n_head': 12, 'n_embd': 768, 'block_size': 1024}
    """
    task = dict(task)
    preset = task.pop("preset", None)
    return {**task, **PRESETS[preset]} if isinstance(preset, str) and preset in PRESETS else task


TASK_APART = ("batch_size", "options")
"""The ``task`` settings a checkpoint may be loaded under other values of: the batch size changes
no model, and ``options`` are a factory's own (a data path among them: said, not refused)."""


def check_task_settings(payload: Mapping[str, Any], now: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Refuse (one :class:`InputError` line naming the key and both values) a checkpoint (its
    ``payload``, loaded by :func:`ampguard.checkpoint.load_weights`) whose config's ``task``
    section builds another model than the config's (``now``, :func:`plain_data`'s) though its
    weights fit: review 53b, charlm's ``n_head`` changes no weight shape, and ``validate
    --checkpoint`` judged the trained weights in a model of another head count, ACCEPTED, a
    verdict about a model nobody trained. Compared as :func:`check_resume` compares a task
    (:func:`changed_task`: only what the task reads, a preset as its sizes, review 53i),
    :data:`TASK_APART` apart; a factory's ``task.options`` setting that differs is said (an
    :class:`AmpguardWarning`: a factory's data path may be another on this machine). Nothing to
    compare in a checkpoint without a task section. For validate and locate.

    Example::

        >>> def check(saved, now):
        ...     check_task_settings({CONFIG: {"task": saved}}, now, "a.pt")
        >>> check({"name": "charlm", "n_head": 8, "batch_size": 4}, {"name": "charlm", "n_head": 8, "batch_size": 2})
        >>> check({"factory": "/old/project/m.py:build"}, {"factory": "/new/m.py:build"})  # moved: the same file
        >>> check({"name": "digits", "n_head": 4}, {"name": "digits", "n_head": 8})  # (digits has no heads)
        >>> for saved, now in (({"name": "charlm", "n_head": 8}, {"name": "charlm", "n_head": 4}),
        ...                    ({"name": "digits"}, {"name": "charlm"})):
        ...     try:
        ...         check(saved, now)
        ...     except InputError as err:
        ...         print(err)
        a.pt: it was trained with task.n_head 8, this config's is 4: pass that run's config.yaml, or --set task.n_head=8
        a.pt: it is a checkpoint of task digits, this config's is charlm: pass that run's config.yaml, or --set task.name=digits
    """
    config = payload.get(CONFIG)
    saved = config.get("task") if isinstance(config, Mapping) else None
    if not isinstance(saved, Mapping):
        return
    changed = changed_task({"task": saved}, {"task": now}, apart=TASK_APART)
    if changed:
        key, was, this = changed
        workload = ckpt.other_task(saved, now) if key in ("task.name", "task.factory") else ""
        if workload:  # (another workload: said as a misfit's is)
            raise InputError(f"{path}: {workload.removeprefix('; ')}")
        ask = f"--set {key}={'null' if was is None else _value(was)}"
        preset = PRESETS.get(now.get("preset") or "")
        if preset and key.removeprefix("task.") in preset:
            # review 53i: a size the config takes from its preset: --set of it alone clashes with
            # the preset, and preset=null alone gives the default sizes: the run's sizes, all of them
            sizes = _sized_task(saved)
            ask = " ".join(["--set task.preset=null", *(f"--set task.{size}={_value(sizes.get(size))}"
                                                        for size in preset)])
        raise InputError(f"{path}: it was trained with {key} {_value(was)}, this config's is {_value(this)}: "
                         f"pass that run's config.yaml, or {ask}")
    if "options" in saved and "options" in TaskConfig.reads(now.get("name"), now.get("factory")):
        # (a checkpoint from before the key: nothing to compare; a built-in task reads none)
        changed = changed_setting({"task": saved}, {"task": now}, "task.options")
        if changed:
            key, was, this = changed
            warn(f"{path}: it was trained with {key} {_value(was)}, this config's is {_value(this)}: "
                 "loaded under this config's (a factory's own setting; if it makes the model, pass that "
                 "run's config.yaml)", AmpguardWarning, stacklevel=2)


def load_trained_weights(model: nn.Module, path: str | os.PathLike, config: Config, map_location: Any = "cpu",
                         data_id: Any = None) -> dict[str, Any]:
    """A checkpoint's weights into ``model`` for validate and locate (:func:`ampguard.checkpoint.load_weights`,
    which refuses weights that do not fit, naming the task settings behind a misfit), then its
    ``task`` settings against ``config``'s (:func:`check_task_settings`: weights that fit a model
    of other settings, review 53b). Returns what the callers read of the payload: its ``step``,
    ``config`` and ``state.scaler`` (where it has one); and, as the payload holds them, unchecked
    (a replay of a saved batch and validate read neither), ``data_position`` (where the run's data
    went on after it: locate checks it, :func:`check_field` and :func:`check_data_position` with
    the ``rollbacks`` and ``policy_changes`` it returns too, and reads the step it replays from
    there) and ``run_id`` (None without one).

    The payload is loaded on the host (``map_location``) and ``load_state_dict`` copies the
    weights onto the model's device; nothing else of it is kept (review 56c: validate and locate
    held the whole payload, weights and optimizer moments, on the run's device for the whole
    command, 3x the parameters with AdamW beside the model they evaluate and replay)."""
    settings = plain_data(config)["task"]
    payload = ckpt.load_weights(model, path, map_location=map_location, task=settings, data_id=data_id)
    # review 54n: the step, which validate writes into its report and locate judges its weights'
    # age by, and the config, whose task is compared, are checked as a resume checks them:
    # validate wrote "Weights: from CKPT (step abc)", and a config.task.n_head of a tensor raised
    # a RuntimeError in the comparison (the schema is not asked: the weights are what is used)
    for key in (STEP, CONFIG):
        check_field(path, payload, key)
    check_task_settings(payload, settings, path)
    state = payload[STATE]  # (a mapping: load_weights checks it)
    return {STEP: payload[STEP], CONFIG: payload[CONFIG], DATA: payload.get(DATA), RUN_ID: payload.get(RUN_ID),
            **{key: payload[key] for key in (ROLLBACKS, POLICY) if key in payload},
            STATE: {"scaler": state["scaler"]} if "scaler" in state else {}}


def _value(value: Any) -> str:
    """A config value in a one-line message: text as it is (:func:`ampguard.errors.shown`: its repr
    when a control character would split the line), anything else as its repr, shortened."""
    return shown(value) if isinstance(value, str) else _short(value)


def check_data_position(path: Path | str, payload: Mapping[str, Any], config: Config) -> None:
    """A checkpoint's data position (``payload``'s, its fields checked) against what its steps
    could have taken: :func:`check_reachable_position` of its step, with its rollbacks and the
    largest ``rollback.skip_batches`` the run used (``config``'s, the checkpoint's config's and its
    policy log's: :func:`skip_batches_used`). A resume and ``locate --step N`` read the stream up
    to it where the task cannot seek (a factory without ``batches_from``): a hand-edited
    10**15 read for ever. One :class:`InputError` line, naming the file."""
    check_reachable_position(path, payload[DATA], payload[STEP], len(payload.get(ROLLBACKS) or []), config,
                             skip_batches_used(config, payload[CONFIG], payload.get(POLICY)))


def check_reachable_position(where: Path | str, position: int, step: int, rollbacks: int, config: Config,
                             skip: int) -> None:
    """Refuse a data position beyond what ``step`` steps could have taken: ``step x
    accumulation_steps + rollbacks x skip`` (each step takes ``accumulation_steps`` micro-batches
    and each rollback seeks at most ``skip``, the largest ``rollback.skip_batches`` the run used,
    past a position already taken). The one bound of a checkpoint's position
    (:func:`check_data_position`: a resume, ``locate``) and of a rollback event's (``locate``).

    Example::

        >>> from ampguard.config import validate
        >>> check_reachable_position("c.pt", 24, 4, 1, validate({"accumulation_steps": 4}), 8)  # 4 x 4 + 1 x 8
        >>> try:
        ...     check_reachable_position("c.pt", 10**15, 4, 1, validate({"accumulation_steps": 4}), 8)
        ... except InputError as err:
        ...     print(err)
        c.pt: data position 1000000000000000 is beyond what 4 steps could have taken (24 = step x accumulation_steps + rollbacks x the largest rollback.skip_batches the run used)
    """
    bound = step * config.accumulation_steps + rollbacks * skip
    if position > bound:
        raise InputError(f"{where}: data position {position} is beyond what {counted(step, 'step')} could have taken "
                         f"({bound} = step x accumulation_steps + rollbacks x the largest rollback.skip_batches "
                         "the run used)")


def skip_batches_used(config: Config, saved_config: Any = None, changes: Iterable[Any] | None = None) -> int:
    """The largest ``rollback.skip_batches`` the run has used: ``config``'s (the resumed or
    replayed run's), ``saved_config``'s (the checkpoint's), and each earlier resume's change of it
    in ``changes`` (a checkpoint's policy log, or ``events.jsonl``'s ``policy_change`` events:
    old and new). A rollback seeks with the value in force at the time, and ``skip_batches`` may
    change on resume (docs/resume.md), so the run's own value now does not bound the past ones.
    A value that is not a whole number (a hand edit) is passed over.

    Example (lowered from 20 to 5 at an earlier resume, and to 0 now)::

        >>> from ampguard.config import validate
        >>> saved = validate({"rollback": {"skip_batches": 5}}).model_dump(mode="json")
        >>> log = [{"key": "rollback.skip_batches", "old": 20, "new": 5, "step": 3}]
        >>> skip_batches_used(validate({"rollback": {"skip_batches": 0}}), saved, log)
        20
    """
    used = [config.rollback.skip_batches]
    saved = saved_config.get("rollback") if isinstance(saved_config, Mapping) else None
    if isinstance(saved, Mapping):  # (a checkpoint from before the key, or a bad one, has none)
        used.append(saved.get("skip_batches"))
    for change in changes or ():
        if isinstance(change, Mapping) and change.get("key") == "rollback.skip_batches":
            used += [change.get("old"), change.get("new")]
    return max(value for value in used if whole_number(value))


# ---------------------------------------------------------------------------- policy changes on resume


def _effective(config: dict[str, Any]) -> dict[str, Any]:
    """A config as plain data with ``scaler.enabled`` as it takes effect (null: on for fp16 only)
    and the ``fp8`` section only where it takes effect (precision fp8; a checkpoint from before
    the section existed has none).

    Example::

        >>> _effective({"precision": "fp16", "scaler": {"enabled": None}})["scaler"]["enabled"]
        True
        >>> eff = _effective({"precision": "bf16", "fp8": {"recipe": "rowwise"}})
        >>> eff["scaler"]["enabled"], "fp8" in eff, "fp8" in _effective({"precision": "fp8", "fp8": {}})
        (False, False, True)
        >>> _effective({"task": {"factory": "/old/project/my_model.py:build"}})["task"]  # moved: the same file
        {'factory': 'my_model.py:build'}
    """
    scaler = dict(config.get("scaler") or {})
    if scaler.get("enabled") is None:
        scaler["enabled"] = uses_loss_scaler(config.get("precision"))
    if not scaler["enabled"]:  # (its settings take no effect: a change to one is none, review 50e)
        scaler = {"enabled": False}
    fp8 = {"fp8": config["fp8"]} if config.get("precision") == "fp8" and "fp8" in config else {}
    task = dict(config.get("task") or {})
    factory = task.get("factory")
    if isinstance(factory, str):  # a file is the same file wherever the folder now is: its name and function
        target, sep, attr = factory.rpartition(":")
        if sep and (target.endswith(".py") or "/" in target):
            task["factory"] = f"{Path(target).name}:{attr}"
    return {**{k: v for k, v in config.items() if k not in ("fp8", "task")}, "task": task, "scaler": scaler, **fp8}


def resume_point(resume: Resume | None) -> tuple[int, str | None] | None:
    """What a rank resumes from, for :func:`check_same_resumes`: the checkpoint's step and its run's id."""
    return None if resume is None else (resume.loaded.step, resume.run_id)


def fail_rate_counted_under(resume: Resume) -> None:
    """A run monitor state saved before it kept the ``fail_rate`` its count of steps above it was
    made under (ampguard before the recount on resume) takes the checkpoint's config's
    ``monitor.fail_rate``, the rate the run that saved it judged with: a resume with another
    rate counts the steps above it again (:meth:`RunMonitor.load_state_dict`) rather than keep,
    or guess, a count made under the old one. A state that has it, or a config that does not say
    (a rate that is none), is left as it is.

    Example::

        >>> from pathlib import Path
        >>> payload = {CONFIG: {"monitor": {"fail_rate": 0.4}}, STATE: {"monitors": {"run": {"above_fail": 9}}}}
        >>> fail_rate_counted_under(Resume(Loaded(Path("step-00000009.pt"), payload), Path(".")))
        >>> payload[STATE]["monitors"]["run"]
        {'above_fail': 9, 'fail_rate': 0.4}
    """
    payload = resume.loaded.payload
    state = payload.get(STATE)
    monitors = state.get("monitors") if isinstance(state, dict) else None
    run = monitors.get("run") if isinstance(monitors, dict) else None
    section = payload.get(CONFIG, {}).get("monitor") if isinstance(payload.get(CONFIG), dict) else None
    if not (isinstance(run, dict) and "fail_rate" not in run and isinstance(section, dict) and "fail_rate" in section):
        return
    rate = section["fail_rate"]
    if rate is None or (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1):
        run["fail_rate"] = rate


def check_same_resumes(points: Sequence[tuple[int, str | None] | None]) -> None:
    """Under torchrun, every rank resumes from the same step of the same run (:func:`resume_point`,
    in rank order), else one :class:`InputError` line, the same on every rank, before anything is
    cut. Ranks given different ``--resume`` checkpoints trained different steps from different
    weights, rank 0 cut the CSV back to its own, and the job hung (review_dist22).

    Example::

        >>> check_same_resumes([(5, "a"), (5, "a")])
        >>> check_same_resumes([(5, "a"), (10, "a")])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: the ranks were given different --resume checkpoints: step 5 of run a on rank 0, step 10 of run a on rank 1; give every rank the same --resume
        >>> check_same_resumes([(5, "a"), None])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: the ranks were given different --resume checkpoints: step 5 of run a on rank 0, no --resume on rank 1; give every rank the same --resume
    """
    def said(point: tuple[int, str | None] | None) -> str:
        return "no --resume" if point is None else f"step {point[0]} of run {point[1] or '(no id)'}"

    for rank, theirs in enumerate(points[1:], start=1):
        if theirs != points[0]:
            raise InputError(f"the ranks were given different --resume checkpoints: {said(points[0])} on rank 0, "
                             f"{said(theirs)} on rank {rank}; give every rank the same --resume")


def check_same_configs(configs: Sequence[dict[str, Any]]) -> None:
    """Under torchrun, every rank's config (in rank order) trains as rank 0's does, else one
    :class:`InputError` line naming the first setting that differs, the same on every rank. A
    node's own ``my.yaml`` that differs would hang the job at the first step where the ranks part
    (``steps``, ``checkpoint.every``: one rank waits in a collective the other never joins) or let
    the replicas drift apart unsaid (``optimizer.lr``: DDP averages the gradients, each rank steps
    with its own rate). Where each rank writes, what validate checks and a factory's
    ``task.options`` may differ (:func:`config_difference`).

    Example::

        >>> ranks = [{"steps": 12, "log": {"dir": "runs"}}, {"steps": 12, "log": {"dir": "/node1/runs"}},
        ...          {"steps": 8, "log": {"dir": "runs"}}]
        >>> check_same_configs(ranks[:2])
        >>> check_same_configs(ranks)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: the ranks were given different configs: steps is 12 on rank 0, 8 on rank 2; give every rank the same config and --set values
    """
    for rank, theirs in enumerate(configs[1:], start=1):
        differs = config_difference(configs[0], theirs)
        if differs is not None:
            key, ours, other = differs
            raise InputError(f"the ranks were given different configs: {key} is {_short(ours)} on rank 0, "
                             f"{_short(other)} on rank {rank}; give every rank the same config and --set values")
    options = [flat_keys((c.get("task") or {}).get("options") or {}) for c in configs]
    for rank, theirs in enumerate(options[1:], start=1):  # (a node's own data path: allowed, but said)
        key = _first_difference(options[0], theirs)
        if key is not None:
            warn(f"task.options.{key} is {_short(options[0].get(key))} on rank 0, {_short(theirs.get(key))} "
                 f"on rank {rank}: the run goes on (a node's own data path); a setting there that changes "
                 "the training would let the replicas drift apart", AmpguardWarning, stacklevel=2)
            break


def model_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each entry of ``model``'s state dict, in its order: what
    :func:`check_same_models` compares between ranks.

    Example::

        >>> model_shapes(nn.Linear(4, 2))
        [('weight', (2, 4)), ('bias', (2,))]
    """
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items()
            if isinstance(t, torch.Tensor)]  # (not a module's get_extra_state(): any object)


def check_same_models(models: Sequence[list[tuple[str, tuple[int, ...]]]]) -> None:
    """Under torchrun, every rank's model (its :func:`model_shapes`, in rank order) has rank 0's
    parameters and buffers, of rank 0's shapes, else one :class:`InputError` line naming the
    first that differs, the same on every rank, before the model is wrapped: a ``task.options``
    value that differs between ranks (allowed: a node's own data path) but sizes a layer had
    DDP raise its parameter-size traceback on every rank, and FSDP2 abort rank 0 with a
    half-made run folder.

    Example::

        >>> check_same_models([[("fc.weight", (8, 4))], [("fc.weight", (16, 4))]])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: the ranks built different models: fc.weight is [8, 4] on rank 0, [16, 4] on rank 1 (a task.options value that differs between the ranks?); every rank must build the same model
    """
    def shape(s: tuple[int, ...] | None) -> str:
        return "missing" if s is None else str(list(s))

    ours = dict(models[0])
    for rank, theirs in enumerate(models[1:], start=1):
        other = dict(theirs)
        name = next((n for n in [*ours, *other] if ours.get(n) != other.get(n)), None)
        if name is not None:
            raise InputError(f"the ranks built different models: {name} is {shape(ours.get(name))} on rank 0, "
                             f"{shape(other.get(name))} on rank {rank} (a task.options value that differs between "
                             "the ranks?); every rank must build the same model")


def config_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first setting (a dotted key, in sorted order) two configs train differently with, and
    its two values; None when they train the same. The sections in :data:`POLICY_UNRECORDED`
    (where the run writes, what validate checks) are not compared; nor is a factory file's folder
    (:func:`_effective`), nor ``task.options``, the factory's own settings, where a node-local
    data path lives (ranks that read different data are refused by the data check, a model of
    another shape by :func:`check_same_models`).

    Example::

        >>> one = {"optimizer": {"lr": 0.1}, "log": {"dir": "runs"}, "task": {"factory": "/a/m.py:build"}}
        >>> config_difference(one, {"optimizer": {"lr": 0.1}, "log": {"dir": "/scratch/runs"},
        ...                         "task": {"factory": "/b/m.py:build"}}) is None
        True
        >>> config_difference(one, {**one, "optimizer": {"lr": 0.5}})
        ('optimizer.lr', 0.1, 0.5)
        >>> config_difference({"task": {"options": {"data": "/node0/d"}}}, {"task": {"options": {"data": "/node1/d"}}})
    """
    flat = [{k: v for k, v in flat_keys(_effective(side)).items()
             if k.split(".")[0] not in POLICY_UNRECORDED and not k.startswith("task.options.")} for side in (a, b)]
    key = _first_difference(*flat)
    return None if key is None else (key, flat[0].get(key), flat[1].get(key))


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The first key (in sorted order) whose value differs between ``a`` and ``b`` (one missing
    from a side reads None there); None when none does.

    Example::

        >>> _first_difference({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": None}), _first_difference({"a": 1}, {"a": 1})
        ('b', None)
    """
    return next((k for k in sorted(set(a) | set(b)) if not _same(a.get(k), b.get(k))), None)


def _same(saved: Any, now: Any) -> bool:
    """Whether two config values (plain data) are the same setting: NaN is NaN, and a saved null
    is an infinity or NaN now (an earlier ampguard saved them in a checkpoint as JSON's null).

    Example::

        >>> _same({"x": [math.nan, 1]}, {"x": [math.nan, 1.0]}), _same(None, math.inf), _same(math.inf, -math.inf)
        (True, True, False)
    """
    if isinstance(saved, dict) and isinstance(now, dict):
        return saved.keys() == now.keys() and all(_same(saved[k], now[k]) for k in saved)
    if isinstance(saved, list) and isinstance(now, list):
        return len(saved) == len(now) and all(map(_same, saved, now))
    if isinstance(now, float) and not math.isfinite(now):
        return saved is None or (isinstance(saved, float) and (saved == now or math.isnan(saved) and math.isnan(now)))
    return saved == now


def policy_changes(resume: Resume, config: Config) -> list[dict[str, Any]]:
    """The settings a resumed run changes (``config.yaml`` + ``--set`` against the checkpoint's
    config), each ``{"key", "old", "new", "step"}`` (``step``: the checkpoint's; the new value
    holds from the next step). Keys :func:`check_resume` refuses never get here; the sections in
    :data:`POLICY_UNRECORDED` are not policy, nor is ``task``: :func:`check_resume` refuses a
    change to any setting the task reads (:func:`changed_task`), so one left is a setting it
    does not read (a linear task's ``n_layer``, a preset spelled out as its sizes), which trains
    nothing differently (review 53j: it was a POLICY line, a card row, and refused a finished
    run's card rewrite as "would apply to no step"). A key the checkpoint's config lacks
    (written by an older ampguard) compares with its default.

    Example::

        >>> from ampguard.config import validate
        >>> base = validate({"precision": "fp16", "steps": 10}).model_dump(mode="json")
        >>> resume = Resume(Loaded(Path("step-00000004.pt"), {STEP: 4, CONFIG: base}), Path("."))
        >>> now = validate({**base, "steps": 20, "optimizer": {**base["optimizer"], "lr": 0.001},
        ...                 "log": {**base["log"], "every": 1}})
        >>> for change in policy_changes(resume, now):
        ...     print(change)
        {'key': 'steps', 'old': 10, 'new': 20, 'step': 4}
        {'key': 'optimizer.lr', 'old': 0.003, 'new': 0.001, 'step': 4}
    """
    default = flat_keys(_effective(Config().model_dump(mode="json")))
    saved = flat_keys(_effective(as_it_ran(resume.saved_config)))
    now = flat_keys(_effective(config.model_dump(mode="json")))
    changes = []
    for key, new in now.items():
        if key.split(".")[0] in (*POLICY_UNRECORDED, "task"):
            continue
        old = saved.get(key, default.get(key))
        if old != new:
            changes.append({"key": key, "old": old, "new": new, "step": resume.loaded.step})
    return changes


def check_left_to_train(resume: Resume, config: Config, changes: list[dict[str, Any]] | None = None) -> None:
    """Refuse a resume of a run that has trained all its steps with a new setting besides
    ``steps``: it would apply to no step, yet the card would describe the run as trained under
    it. ``steps`` may end the run here, and ``inject``, when that ends it sooner, drop the faults
    the end leaves unfired, as their refusal asks. ``changes``: :func:`policy_changes`, if made."""
    if resume.loaded.step < config.steps:
        return
    changes = policy_changes(resume, config) if changes is None else changes
    shorter = config.steps < int(resume.saved_config.get("steps") or 0)
    idle = [c["key"] for c in changes if c["key"] != "steps" and not (c["key"] == "inject" and shorter)]
    if idle:
        raise InputError(f"train --resume: the run has trained all its steps ({resume.loaded.step} of "
                         f"steps={config.steps}): {', '.join(idle)} would apply to no step; raise steps to "
                         "train on under the new settings, or leave them out to rewrite the run card")


_OPTIMIZER_KEYS = ("weight_decay", "betas", "eps", "momentum")
_SCALER_KEYS = {"init_scale": "scale", "growth_factor": "growth_factor", "backoff_factor": "backoff_factor",
                "growth_interval": "growth_interval", "min_scale": "min_scale"}


def apply_policy_changes(changes: list[dict[str, Any]], config: Config, state: Any, rollbacks: int = 0, *,
                         rolled_back: bool = False) -> float | None:
    """Make the restored training state follow the new settings, where the checkpoint would
    otherwise bring back the old ones (everything else is built from the new config already).
    The one place settings are restored after a checkpoint is loaded: on resume (``changes``: the
    resume's own) and at a rollback (``rolled_back``; ``changes``: the policy changes newer than
    the checkpoint rolled back to, ``rollbacks`` counting this rollback):

    - ``optimizer.lr``, ``schedule.*``, ``steps``, ``rollback.lr_factor`` (and, at a rollback,
      ``rollback.lr_factor`` not 1, changed or not): the schedule's base LR becomes
      ``optimizer.lr x rollback.lr_factor ** rollbacks`` and the next step's LR follows the new
      schedule (:func:`set_base_lr`, called once);
    - ``optimizer.weight_decay`` / ``betas`` / ``eps`` / ``momentum``: every parameter group
      (where the optimizer has the setting);
    - ``scaler.*``: the loss scaler's factors, interval and floor; ``scaler.init_scale`` restarts
      the scale at the new value (its growth count at 0); the count of clean steps in a row is
      kept, below a shorter ``growth_interval``.

    Returns the base LR it set, or None when it left the checkpoint's.

    Example (the checkpoint's LR was 0.1; the resumed run asks for 0.01)::

        >>> from ampguard.config import validate
        >>> from ampguard.step import AmpTrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> state = AmpTrainState(model, optimizer, torch.nn.functional.mse_loss, precision="fp16",
        ...                       scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0))
        >>> config = validate({"precision": "fp16", "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.5},
        ...                    "scaler": {"growth_interval": 10}})
        >>> apply_policy_changes([{"key": "optimizer.lr"}, {"key": "optimizer.momentum"},
        ...                       {"key": "scaler.growth_interval"}], config, state)
        0.01
        >>> group = optimizer.param_groups[0]
        >>> group["lr"], group["momentum"], state.scaler.get_growth_interval(), state.scaler.get_scale()
        (0.01, 0.5, 10, 65536.0)

    Under ``rollback.lr_factor`` 0.5 a second rollback sets the LR even with no change since the
    checkpoint; a resume with no change leaves it::

        >>> halving = validate({**config.model_dump(mode="json"), "rollback": {"lr_factor": 0.5}})
        >>> apply_policy_changes([], halving, state, 2, rolled_back=True), group["lr"]
        (0.0025, 0.0025)
        >>> apply_policy_changes([], halving, state, 2) is None  # a resume: the checkpoint's LR holds
        True
    """
    keys = {change["key"] for change in changes}
    lr = None
    changed = any(map(moves_lr, keys))
    # a rollback brings back the checkpoint's LR: under lr_factor it must come down with or without a change
    if (changed or (rolled_back and config.rollback.lr_factor != 1.0)) and state.scheduler is not None:
        lr = config.optimizer.lr * config.rollback.lr_factor ** rollbacks
        set_base_lr(state.scheduler, lr)
    for name in _OPTIMIZER_KEYS:
        if f"optimizer.{name}" in keys:
            value = getattr(config.optimizer, name)
            for group in state.optimizer.param_groups:
                if name in group:
                    group[name] = tuple(value) if name == "betas" else value
    scaler_keys = [name for name in _SCALER_KEYS if f"scaler.{name}" in keys]
    if scaler_keys and state.scaler.is_enabled():
        saved = state.scaler.state_dict()
        for name in scaler_keys:
            saved[_SCALER_KEYS[name]] = getattr(config.scaler, name)
        if "init_scale" in scaler_keys:
            saved["_growth_tracker"] = 0
        # PyTorch grows the scale when the count of clean steps *equals* the interval: a count
        # already past a shorter interval would never grow again
        saved["_growth_tracker"] = min(int(saved["_growth_tracker"]), saved["growth_interval"] - 1)
        state.scaler.load_state_dict(saved)
    return lr


def moves_lr(key: str) -> bool:
    """Whether a change of config ``key`` on resume sets the LR schedule anew (its base LR, its
    length or its shape): :func:`apply_policy_changes` re-bases the schedule for it.

    Example::

        >>> moves_lr("steps"), moves_lr("schedule.warmup"), moves_lr("max_norm")
        (True, True, False)
    """
    return key in ("optimizer.lr", "steps", "rollback.lr_factor") or key.startswith("schedule.")


def dtype_changes(saved: dict[str, str] | None, now: dict[str, str]) -> list[str]:
    """The layers that compute in another dtype under autocast than in the checkpoint's run
    (``saved``, its :data:`AUTOCAST_DTYPES`; none from a checkpoint without it): the model's
    code, or torch's autocast lists, changed. Not a setting, but no equivalent continuation
    either: each is said on resume and kept on the run card.

    Example::

        >>> dtype_changes({"fc": "bfloat16", "norm": "float32", "drop": "bfloat16"},
        ...               {"fc": "bfloat16", "norm": "bfloat16", "head": "float32"})
        ['norm float32 -> bfloat16', 'head (new) float32', 'drop bfloat16 -> (not run)']
        >>> dtype_changes(None, {"fc": "bfloat16"})
        []
    """
    if not saved:
        return []
    changed = [f"{name} {saved[name]} -> {dtype}" for name, dtype in now.items() if saved.get(name, dtype) != dtype]
    return (changed + [f"{name} (new) {dtype}" for name, dtype in now.items() if name not in saved]
            + [f"{name} {dtype} -> (not run)" for name, dtype in saved.items() if name not in now])


def policy_line(change: dict[str, Any]) -> str:
    """One change in words (the event's message and the run card's entry).

    Example::

        >>> policy_line({"key": "scaler.growth_interval", "old": 2000, "new": 100, "step": 40})
        'scaler.growth_interval 2000 -> 100 from step 41'
        >>> policy_line({"key": "steps", "old": 30, "new": 10, "step": 10})  # (no step 11: review 52a)
        'steps 30 -> 10: the run ends at step 10'
    """
    if change["key"] == "steps" and whole_number(change["new"]) and change["new"] <= change["step"]:
        return f"steps {_short(change['old'])} -> {_short(change['new'])}: the run ends at step {change['step']}"
    return f"{change['key']} {_short(change['old'])} -> {_short(change['new'])} from step {change['step'] + 1}"
