"""``ampguard bench``: what the guard rails cost, measured side by side in one process.

The same model, data, optimizer and seed run under each contender: the bare canonical PyTorch
AMP loop, a second bare loop (the A/A contender: what the noise alone makes of two identical
loops), ampguard's guarded step with per-step CSV logging on, and, when installed, Hugging Face
Accelerate and Lightning Fabric doing the same work.

Paired rounds: each round runs every contender back to back, so drift of the machine (clocks,
other load) falls on all of them alike, and each contender's ratio to the bare loop is taken
*within* the round. The rounds' orders are a balanced (Williams) design: every contender runs
right after every other one equally often, since what ran before a contender warms or
evicts the caches it runs from; each round's first contender runs one untimed step right before
its timed ones, so across rounds too every contender runs right after itself equally often;
fixed rounds (no ``resolve``) run whole cycles of those orders, every contender in every place
alike. The figure is the median of those per-round ratios with its 95% interval from the order statistics
(distribution-free); with ``resolve`` rounds are added until every 99% interval, which holds the
reported one, reaches no farther than ``± resolve`` (or the time budget runs out, and the lines
under the table say so). On CUDA each contender's steps are timed with CUDA events.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn import functional as F

from .errors import counted, failed_because, first_line, shortened
from .precision import Precision, backend_text
from .records import LAG, InFlight
from .signals import lost_stdout
from .sinks import CsvSink, Sink
from .step import AmpTrainState
from .watch import compiled_inside

# ---------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """What every contender trains: a model factory (the same seed each call), one fixed batch,
    the loss, and the work per step (for tokens/s and MFU).

    Example::

        >>> def make():
        ...     torch.manual_seed(0)
        ...     return nn.Linear(4, 2)
        >>> w = Workload("toy", make, (torch.ones(8, 4), torch.zeros(8, 2)), F.mse_loss)
        >>> torch.equal(w.make_model().weight, w.make_model().weight), w.tokens_per_step
        (True, 0)
    """

    name: str
    make_model: Callable[[], nn.Module]
    batch: tuple[torch.Tensor, torch.Tensor]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    tokens_per_step: int = 0
    flops_per_step: float = 0.0  # model FLOPs (6 N per token for a transformer), for MFU


BATCHES = {"mlp": 64, "nano": 4, "transformer": 16, "gpt2": 8}  # each workload's own batch size (--batch: another)
WORKLOAD_NAMES = {"mlp": "tiny-mlp", "nano": "nano-mlp", "transformer": "small-transformer",
                  "gpt2": "transformer-gpt2-small"}
"""Each ``--models`` name's workload name (:attr:`Workload.name`: the table's and the JSON's)."""


def _mlp(device: torch.device, *, name: str = WORKLOAD_NAMES["mlp"], width: int = 64, inputs: int = 32,
         classes: int = 10, batch: int = BATCHES["mlp"]) -> Workload:
    """An MLP of three linear layers with GELUs between (``width`` wide), one fixed batch.

    Example::

        >>> w = _mlp(torch.device("cpu"))
        >>> w.name, [tuple(t.shape) for t in w.batch], w.make_model()[2]
        ('tiny-mlp', [(64, 32), (64,)], Linear(in_features=64, out_features=64, bias=True))
    """
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, inputs, generator=g), torch.randint(0, classes, (batch,), generator=g)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(inputs, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                             nn.Linear(width, classes))

    return Workload(name, make, (x.to(device), y.to(device)), F.cross_entropy)


def _nano(device: torch.device, batch: int = BATCHES["nano"]) -> Workload:
    """An MLP too small to compute anything (8 wide, batch 4): its step is all host time (Python,
    the dispatcher, kernel launches), as a tiny model's is on a GPU, so on a CPU it shows what
    the guard costs a launch-bound step.

    Example::

        >>> [tuple(t.shape) for t in _nano(torch.device("cpu")).batch]
        [(4, 8), (4,)]
    """
    return _mlp(device, name=WORKLOAD_NAMES["nano"], width=8, inputs=8, classes=4, batch=batch)


def _transformer(device: torch.device, size: str, batch: int | None = None) -> Workload:
    """``ampguard train``'s charlm transformer (byte vocabulary) on one fixed batch of random
    bytes: ``"gpt2-small"`` in the shape of ``task.preset: gpt2-small`` (12 layers x 768 wide, 12
    heads, a context of 1024), batch 8; ``"small"`` in the ``task`` section's default shape (2
    layers x 64 wide, 4 heads, a context of 64), batch 16 (``batch``: another). The shapes are read from
    :class:`~ampguard.config.TaskConfig`, so the bench measures the model ``train`` builds.

    Example::

        >>> w = _transformer(torch.device("cpu"), "small")
        >>> w.name, [tuple(t.shape) for t in w.batch], w.tokens_per_step
        ('small-transformer', [(16, 64), (16, 64)], 1024)
    """
    from .config import TaskConfig
    from .tasks.charlm import CharLM, flops_per_token, lm_loss

    shape = TaskConfig(preset="gpt2-small") if size == "gpt2-small" else TaskConfig()
    layers, width, heads, block = shape.n_layer, shape.n_embd, shape.n_head, shape.block_size
    if batch is None:  # the bench's own, not task.batch_size
        batch = BATCHES["gpt2" if size == "gpt2-small" else "transformer"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 256, (batch, block + 1), generator=g)

    def make() -> nn.Module:
        torch.manual_seed(0)
        return CharLM(block, layers, heads, width)

    tokens = batch * block
    # the task's own count (6 N, position embeddings left out, plus attention's 12 L C T), so the
    # bench's MFU is `ampguard train`'s for the same model
    flops = flops_per_token(make(), layers, width, block) * tokens
    name = WORKLOAD_NAMES["gpt2" if size == "gpt2-small" else "transformer"]
    return Workload(name, make, (idx[:, :-1].to(device), idx[:, 1:].to(device)), lm_loss, tokens, flops)


# ---------------------------------------------------------------------------- contenders


class Contender:
    """One way of running a training step; ``step()`` runs one, ``close()`` cleans up.

    Example (a subclass sets ``name``, ``model`` and ``opt`` and implements ``step``)::

        >>> class PlainSGD(Contender):
        ...     name = "plain sgd"
        ...     def __init__(self, w):
        ...         self.model, self.w = w.make_model(), w
        ...         self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        ...     def step(self):
        ...         self.w.loss_fn(self.model(self.w.batch[0]), self.w.batch[1]).backward()
        ...         self.opt.step()
        ...         self.opt.zero_grad()
        >>> results = measure(_mlp(torch.device("cpu")), Precision("fp32", "cpu"), torch.device("cpu"),
        ...                   [lambda w, p, d, f: PlainSGD(w)], steps=1, rounds=1, warmup=1, fused=False)
        >>> [r.contender for r in results], math.isnan(results[0].ratio_to_bare)  # no bare loop to compare with
        (['plain sgd'], True)
    """

    name = ""
    model: nn.Module
    opt: torch.optim.Optimizer
    compiled = False  # its step runs code torch.compile compiled (ops_per_step leaves it uncounted)

    def persistent_bytes(self) -> int:
        """What this contender keeps between steps: parameters and optimizer state.

        Only CUDA tensors count (it goes with the CUDA peak-memory figure); a CPU run keeps 0.

        Example::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> Bare(_mlp(cpu), fp32, cpu, fused=False).persistent_bytes()
            0
        """
        tensors = list(self.model.parameters())
        for state in self.opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors if t.is_cuda)

    def step(self) -> None:
        """One training step on the workload's batch; each subclass says how.

        Example::

            >>> Contender().step()
            Traceback (most recent call last):
            ...
            NotImplementedError
        """
        raise NotImplementedError

    def close(self) -> None:
        """Release what the contender holds (files, threads); nothing by default.

        Example::

            >>> Contender().close() is None
            True
        """
        pass


def _optimizer(model: nn.Module, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)


class Bare(Contender):
    """The canonical loop, as the PyTorch AMP recipe writes it.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> bare = Bare(_mlp(cpu), fp32, cpu, fused=False)
        >>> bare.scaler.is_enabled(), Bare(_mlp(cpu), Precision("fp16", "cpu"), cpu, fused=False).scaler.is_enabled()
        (False, True)
    """

    name = "bare loop"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        self.model = w.make_model().to(device)
        self.opt = _optimizer(self.model, fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision.uses_scaler)
        self.precision, self.w = precision, w

    def step(self) -> None:
        """Autocast forward, scaled backward, unscale, ``clip_grad_norm_`` to 1.0, scaler step and
        update (``scaler.step`` reads the found-inf flag: a host sync), ``zero_grad``.

        Example (in FP32 ampguard's guarded step lands on the same weights, bit for bit)::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> bare, guarded = Bare(_mlp(cpu), fp32, cpu, False), Guarded(_mlp(cpu), fp32, cpu, False)
            >>> for _ in range(3):
            ...     bare.step(); guarded.step()
            >>> all(torch.equal(a, b) for a, b in zip(bare.model.parameters(), guarded.model.parameters()))
            True
            >>> guarded.close()
        """
        x, y = self.w.batch
        with self.precision.autocast():
            loss = self.w.loss_fn(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)


class BareAgain(Bare):
    """The bare loop once more: its ratio to the bare loop is the noise floor of the measurement
    (an A/A test: two identical loops should read 1.00; the interval says how well we can tell).
    An interval that excludes 1 says the two read apart in this process, and the line under the
    table says which way and by how much (:func:`noise_floor`): in one process two identical loops
    can read apart by where they were built, not by their code, or by chance.

    Example::

        >>> BareAgain.name, issubclass(BareAgain, Bare)
        ('bare loop (A/A)', True)
    """

    name = "bare loop (A/A)"


class Guarded(Contender):
    """ampguard's step, with every record written to a per-step CSV.

    The CSV goes to a temporary folder that :meth:`close` deletes.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> guarded = Guarded(_mlp(cpu), fp32, cpu, fused=False)
        >>> csv = Path(guarded._dir.name) / "steps.csv"
        >>> type(guarded.sink).__name__, csv.is_file(), guarded.inflight.lag
        ('CsvSink', True, 0)
        >>> guarded.close()
        >>> csv.exists()
        False
    """

    name = "ampguard + csv"
    sync_free = False
    fuse_tail = False

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        self.model = w.make_model().to(device)
        if self.sync_free:  # fused AdamW takes the skip flag; the LR is a device tensor
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=torch.tensor(1e-4, device=device), fused=True)
        else:
            self.opt = _optimizer(self.model, fused)
        self.state = AmpTrainState(self.model, self.opt, w.loss_fn, precision=precision, sync_free=self.sync_free,
                                   fuse_tail=self.fuse_tail)
        self._dir = tempfile.TemporaryDirectory(prefix="ampguard-bench-")
        self.sink: Sink = CsvSink(Path(self._dir.name) / "steps.csv")
        # as `ampguard train` reads them: the sync-free path's records come back as their copies
        # land, up to LAG steps behind, and are written on this thread (no writer thread to take
        # the interpreter from the loop); the default path has read its values already
        self.inflight = InFlight(lag=LAG if self.sync_free else 0)
        self.w = w

    def step(self) -> None:
        """One guarded step and its CSV row. The step reads its skip flags on the host (its one
        host sync) unless ``sync_free``; then its row is written once its values have landed on
        the host, at most ``LAG`` steps later (:class:`~ampguard.records.InFlight`, as in
        ``ampguard train``).

        Example::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> guarded = Guarded(_mlp(cpu), fp32, cpu, fused=False)
            >>> guarded.step(); guarded.step()
            >>> rows = (Path(guarded._dir.name) / "steps.csv").read_text().splitlines()
            >>> guarded.state.steps, len(rows), rows[2].split(",")[0]
            (2, 3, '2')
            >>> guarded.close()
        """
        record = self.state.step(*self.w.batch)
        if record is not None:
            self.inflight.add(record, None)
            for done, _ in self.inflight.ready():
                self.sink.write(done)

    def close(self) -> None:
        """Flush and close the sink, then delete the temporary folder with the CSV.

        Example::

            >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
            >>> guarded = Guarded(_mlp(cpu), fp32, cpu, fused=False)
            >>> folder = Path(guarded._dir.name)
            >>> guarded.step(); guarded.close()
            >>> folder.exists()
            False
        """
        for done, _ in self.inflight.drain():
            self.sink.write(done)
        self.sink.close()
        self._dir.cleanup()


class GuardedSyncFree(Guarded):
    """ampguard's sync-free path: fused AdamW takes the skip flag, no host read per step.

    Example (the rows are read back as their copies land, never by the step)::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> sync_free = GuardedSyncFree(_mlp(cpu), fp32, cpu, fused=True)
        >>> sync_free.step(); sync_free.step()
        >>> sync_free.inflight.lag, sync_free.state.sync_free, sync_free.opt.defaults["fused"]
        (2, True, True)
        >>> csv = Path(sync_free._dir.name) / "steps.csv"
        >>> sync_free.close(); csv.exists()  # every row was written, then the folder went
        False
    """

    name = "ampguard sync-free + csv"
    sync_free = True


class GuardedFusedTail(GuardedSyncFree):
    """The sync-free path with its scalar tail compiled (``fuse_tail``): for launch-bound models.

    Example::

        >>> GuardedFusedTail.name, GuardedFusedTail.fuse_tail
        ('ampguard sync-free, fused tail + csv', True)
    """

    name = "ampguard sync-free, fused tail + csv"
    fuse_tail = True
    compiled = True


class AccelerateLoop(Contender):
    """Hugging Face Accelerate doing the same work (``Accelerator(mixed_precision=...)``); listed
    by :func:`available_peers` only when ``accelerate`` is installed.

    Example (``measure`` leaves out a peer it cannot build, and says so)::

        >>> import contextlib, importlib.util, io
        >>> installed = importlib.util.find_spec("accelerate") is not None
        >>> said = io.StringIO()
        >>> with contextlib.redirect_stdout(said):
        ...     results = measure(_mlp(torch.device("cpu")), Precision("fp32", "cpu"), torch.device("cpu"),
        ...                       [Bare, AccelerateLoop], steps=1, rounds=1, warmup=1, fused=False)
        >>> [r.contender for r in results] == ["bare loop"] + (["accelerate"] if installed else [])
        True
        >>> ("accelerate: not run (ModuleNotFoundError" in said.getvalue()) == (not installed)
        True
    """

    name = "accelerate"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)  # a process-wide singleton: one precision per process otherwise
        mp = {"fp16": "fp16", "bf16": "bf16", "fp32": "no"}[precision.name]
        self.acc = Accelerator(mixed_precision=mp, cpu=device.type == "cpu")
        model = w.make_model()
        self.model, self.opt = self.acc.prepare(model, _optimizer(model, fused))
        self.w = w

    def step(self) -> None:
        """Accelerate's autocast, ``backward`` (it scales the loss for fp16), ``clip_grad_norm_``
        to 1.0, the optimizer step and ``zero_grad``.

        Example (runs only where ``accelerate`` is installed)::

            >>> import importlib.util
            >>> if importlib.util.find_spec("accelerate") is not None:
            ...     cpu = torch.device("cpu")
            ...     loop = AccelerateLoop(_mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False)
            ...     before = [p.detach().clone() for p in loop.model.parameters()]
            ...     loop.step()
            ...     assert any(not torch.equal(a, b) for a, b in zip(before, loop.model.parameters()))
        """
        x, y = self.w.batch
        with self.acc.autocast():
            loss = self.w.loss_fn(self.model(x), y)
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _lightning_info_held_back() -> Iterator[None]:
    """Lightning's rank-zero info lines (``Using bfloat16 Automatic Mixed Precision (AMP)``) held
    back while a Fabric contender is built: they would land between the bench's header and its
    table. ``rank_zero_info`` writes to ``lightning_utilities``' module logger, which
    ``lightning.fabric`` (or ``lightning.pytorch``, whichever was imported last) points at a logger
    of its own; that one and ``lightning.fabric``'s are raised to WARNING, and put back after.
    Its warnings still show, but one: fp16 on a CPU, which Fabric runs as bf16 (``AMP with fp16 is
    not supported on CPU``, its site-packages path in the table's header; review 58f): the bench's
    own line says it, as it leaves the contender out of the fp16 row (:func:`other_work`).
    Call it once ``lightning.fabric`` is imported.

    Example::

        >>> import importlib.util, logging
        >>> if importlib.util.find_spec("lightning") is not None:
        ...     import lightning.fabric
        ...     with _lightning_info_held_back():
        ...         assert not logging.getLogger("lightning.fabric").isEnabledFor(logging.INFO)
        ...     assert logging.getLogger("lightning.fabric").isEnabledFor(logging.INFO)
    """
    import logging
    import warnings

    from lightning_utilities.core import rank_zero

    loggers = {logging.getLogger("lightning.fabric"), rank_zero.log}
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*AMP with fp16 is not supported on CPU")
            yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)


class FabricLoop(Contender):
    """Lightning Fabric doing the same work (``Fabric(precision="16-mixed" | "bf16-mixed" |
    "32-true")``); listed by :func:`available_peers` only when ``lightning`` is installed.

    Example (``measure`` leaves out a peer it cannot build, and says so)::

        >>> import contextlib, importlib.util, io
        >>> installed = importlib.util.find_spec("lightning") is not None
        >>> said = io.StringIO()
        >>> with contextlib.redirect_stdout(said):
        ...     results = measure(_mlp(torch.device("cpu")), Precision("fp32", "cpu"), torch.device("cpu"),
        ...                       [Bare, FabricLoop], steps=1, rounds=1, warmup=1, fused=False)
        >>> [r.contender for r in results] == ["bare loop"] + (["lightning fabric"] if installed else [])
        True
        >>> ("lightning fabric: not run (ModuleNotFoundError" in said.getvalue()) == (not installed)
        True
    """

    name = "lightning fabric"

    def __init__(self, w: Workload, precision: Precision, device: torch.device, fused: bool) -> None:
        from lightning.fabric import Fabric

        mp = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[precision.name]
        with _lightning_info_held_back():
            self.fabric = Fabric(accelerator=device.type, devices=1, precision=mp)
            model = w.make_model()
            self.model, self.opt = self.fabric.setup(model, _optimizer(model, fused))
        self.w = w

    def step(self) -> None:
        """Forward (Fabric's wrapped model autocasts), ``fabric.backward``, ``clip_gradients`` to
        1.0, the optimizer step and ``zero_grad``.

        Example (runs only where ``lightning`` is installed)::

            >>> import importlib.util
            >>> if importlib.util.find_spec("lightning") is not None:
            ...     cpu = torch.device("cpu")
            ...     loop = FabricLoop(_mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False)
            ...     before = [p.detach().clone() for p in loop.model.parameters()]
            ...     loop.step()
            ...     assert any(not torch.equal(a, b) for a, b in zip(before, loop.model.parameters()))
        """
        x, y = self.w.batch
        loss = self.w.loss_fn(self.model(x), y)
        self.fabric.backward(loss)
        self.fabric.clip_gradients(self.model, self.opt, max_norm=1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def available_peers() -> list[type[Contender]]:
    """The peer contenders whose package is installed (Accelerate, Lightning Fabric).

    Example::

        >>> import importlib.util
        >>> expected = [cls for cls, package in ((AccelerateLoop, "accelerate"), (FabricLoop, "lightning"))
        ...             if importlib.util.find_spec(package) is not None]
        >>> available_peers() == expected
        True
    """
    import importlib.util

    peers: list[type[Contender]] = []
    if importlib.util.find_spec("accelerate") is not None:
        peers.append(AccelerateLoop)
    if importlib.util.find_spec("lightning") is not None:
        peers.append(FabricLoop)
    return peers


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class NotRun:
    """A contender (or, with ``contender`` None, a whole case) left out of a bench, and why: the
    "not run" line, kept for ``--json``."""

    workload: str
    precision: str
    contender: str | None
    why: str


INTERRUPTED = "interrupted"
"""``Result.stop`` of a case whose rounds Ctrl-C or a SIGTERM cut short (its whole rounds are kept)."""
ERROR = "error"
"""``Result.stop`` of a case a failed timed step ended (its whole rounds before it are kept;
``Result.stop_detail`` says which contender failed, in which round, and why)."""


@dataclass
class Result:
    """One contender's figures on one workload and precision (times in ms per step).

    ``ratio_to_bare`` is the median over rounds of this contender's ms/step divided by the bare
    loop's in the same round (above 1: slower; the bare loop's own is 1, with no interval, beside
    others; its ``ratios`` are its times over its own median, the spread of its rounds);
    ``ratio_low``/``ratio_high`` its 95% interval (:func:`median_interval`; none below 6
    rounds; inside the 99% one the stop rule decided on); ``stop`` why the rounds ended,
    one of: ``"resolved"`` (every interval within ``± resolve``), ``"budget"`` (time ran out
    first), ``"max rounds"``, ``"fixed"`` (no ``resolve`` asked: whole cycles of the round orders,
    :func:`measure`), :data:`INTERRUPTED` or
    :data:`ERROR`. Code decides on ``stop`` alone; ``stop_detail`` is the words for a person
    (for an error, ``"RuntimeError: CUDA out of memory. ... (bare loop, round 3)"``; ``None``
    for the other stops).

    Example::

        >>> r = Result("tiny-mlp", "fp32", "bare loop", median_ms=0.5, min_ms=0.4)
        >>> math.isnan(r.ratio_to_bare), r.peak_mem_mib, r.rounds, r.stop, r.stop_detail
        (True, None, [], 'fixed', None)
    """

    workload: str
    precision: str
    contender: str
    median_ms: float
    min_ms: float
    ratio_to_bare: float = math.nan
    peak_mem_mib: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    rounds: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    ratio_low: float = math.nan
    ratio_high: float = math.nan
    stop: str = "fixed"
    stop_detail: str | None = None
    ops: int | None = None  # ops_per_step: the device operations one step dispatches
    positions: list[int] = field(default_factory=list)  # its place in each round's order (0: ran first)
    case_s: float | None = None  # the wall seconds the case's rounds took (all contenders)

    @property
    def half_width(self) -> float:
        """How far the interval reaches from the ratio, on its farther side, relative to the
        ratio (0.01 is ``± 1%``: both ends within 1%); nan without one.

        Example::

            >>> round(Result("m", "fp32", "x", 1.0, 1.0, ratio_to_bare=1.0, ratio_low=0.99, ratio_high=1.03).half_width, 6)
            0.03
        """
        return _reach(self.ratio_to_bare, self.ratio_low, self.ratio_high)


CONFIDENCE = 0.95
"""The confidence level of every ratio interval (the stop rule's and the reported one: the same)."""
DECIDE_CONFIDENCE = 0.99
"""The confidence level of the interval the stop rule decides on (:func:`_stop_reason`): wider
than the reported one, which it contains."""
MIN_ROUNDS_TO_RESOLVE = 8
"""The fewest rounds with a 99% interval of their median (:func:`median_interval`: below 8 there
is none; below 6, no 95% one), so the fewest a case can be called resolved at."""
MAX_ROUNDS = 1000
"""The most rounds a case runs, resolved or not (``Result.stop``: ``"max rounds"``)."""
INTERVAL = "order statistics (binomial), distribution-free"
"""What every ratio interval is, for the JSON."""


def least_for_interval(confidence: float = CONFIDENCE) -> int:
    """The fewest values :func:`median_interval` gives an interval at ``confidence`` for.

    Example::

        >>> least_for_interval(), least_for_interval(0.99)
        (6, 8)
    """
    n = 1
    while math.isnan(median_interval([1.0] * n, confidence=confidence)[1]):
        n += 1
    return n


def in_whole_cycles(asked: int, cycle: int, least: int = 1) -> int:
    """``asked`` rounds rounded up to whole cycles of ``cycle`` round orders (a cut cycle puts some
    contenders first more often) and to at least ``least`` (:func:`least_for_interval`, for a
    script that reports an interval).

    Example::

        >>> in_whole_cycles(7, 2), in_whole_cycles(30, 24), in_whole_cycles(1, 6, least_for_interval())
        (8, 48, 6)
    """
    return -(-max(asked, least) // cycle) * cycle


class ScriptParser(argparse.ArgumentParser):
    """argparse for the benchmark scripts: a usage error is one line (exit 2), as ``ampguard``'s
    own, not a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def median_interval(values: list[float], *, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """``(median, low, high)``: the median and the distribution-free interval of it from the order
    statistics: with ``x(1) <= ... <= x(n)``, ``[x(k), x(n+1-k)]`` for the largest ``k`` such that
    a Binomial(n, 1/2) falls below ``k`` with probability at most ``(1 - confidence) / 2``. It covers
    the true median with at least ``confidence`` whatever the rounds' distribution (a bootstrap of
    the median covers less: 92-93% at 95%, and less again after a stop rule picked its moment).
    Fewer than 6 values have no 95% interval: ``low`` and ``high`` are then nan (fewer than 8, no
    99% one). The bench's intervals: the table reports the 95% one, the stop rule decides on the
    99% one of the same rounds, which holds it.

    Example::

        >>> median_interval([1.0] * 6)
        (1.0, 1.0, 1.0)
        >>> median_interval([0.9, 1.0, 1.1, 1.0, 0.95, 1.05, 1.0])  # n = 7: the least and the most
        (1.0, 0.9, 1.1)
        >>> median_interval([float(v) for v in range(1, 21)])  # n = 20: the 6th and the 15th
        (10.5, 6.0, 15.0)
        >>> median_interval([0.9, 1.1, 1.0, 1.2])
        (1.05, nan, nan)
    """
    xs, n, tail = sorted(values), len(values), (1 - confidence) / 2
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) < k)
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    return (statistics.median(xs),) + ((xs[k - 1], xs[n - k]) if k else (math.nan, math.nan))


def _reach(med: float, low: float, high: float) -> float:
    """How far ``[low, high]`` reaches from ``med`` on its farther side, relative to ``med``.

    Example::

        >>> round(_reach(1.0, 0.99, 1.03), 6), round(_reach(2.0, 1.9, 2.05), 6)
        (0.03, 0.05)
    """
    return max(high - med, med - low) / med


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(c: Contender, steps: int, device: torch.device) -> float:
    """ms per step over ``steps`` steps: CUDA events on CUDA (the device's time from the first
    step's launch to the last one's end), the wall clock elsewhere. Starts from an idle device."""
    _sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            c.step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / steps
    start_s = time.perf_counter()
    for _ in range(steps):
        c.step()
    return (time.perf_counter() - start_s) * 1000 / steps


@dataclass(frozen=True)
class Census:
    """What one step of a contender dispatched (:func:`census`): ``ops``, the device operations
    (:func:`ops_per_step`); ``matmuls``, the dtypes its matrix products computed in; ``scales``,
    whether a loss scaler updated its scale (``_amp_update_scale_``, which ``scaler.update()``
    runs every step).

    Example::

        >>> Census(ops=7, matmuls=frozenset({torch.float32}), scales=False).ops
        7
    """

    ops: int
    matmuls: frozenset[torch.dtype]
    scales: bool


def census(c: Contender) -> Census | None:
    """Run one step of ``c`` under a dispatch mode that counts its device operations (the ATen
    operators that reach the dispatcher's kernels, views, bare allocations (``empty``) and the
    profiler's markers left out: they launch no kernel), notes the dtypes of its matrix products
    and whether a loss scaler ran. ``None`` for a step that runs compiled code
    (``Contender.compiled``, or a ``torch.compile``'d model): Inductor's kernels bypass the
    counter, and running them under it would make Dynamo give the compiled frames up.

    Example (a linear layer's SGD step: the input's ``ones``, ``addmm``, ``sum``; backward's
    seed ``ones_like``, ``mm``, ``sum``; the update's one ``_foreach_add_``)::

        >>> class Linear(Contender):
        ...     name = "linear"
        ...     def __init__(self):
        ...         self.model = torch.nn.Linear(2, 1)
        ...         self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, foreach=True)
        ...     def step(self):
        ...         self.model(torch.ones(1, 2)).sum().backward()
        ...         self.opt.step()
        ...         self.opt.zero_grad()
        >>> census(Linear())
        Census(ops=7, matmuls=frozenset({torch.float32}), scales=False)
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops, self.matmuls, self.scales = 0, set(), False

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            if not func.is_view and name not in _NO_KERNEL:
                self.ops += 1
            if name in _MATMULS and isinstance(out, torch.Tensor):
                self.matmuls.add(out.dtype)
            self.scales = self.scales or name == "_amp_update_scale_"
            return out

    model = getattr(c, "model", None)
    if c.compiled or (isinstance(model, nn.Module) and compiled_inside(model)):
        return None  # (a compiled model anywhere inside: Fabric wraps it in a module of its own)
    try:
        with Count() as count:
            c.step()
    except Exception:  # noqa: BLE001 - a step that cannot run under the counter goes uncounted
        return None
    return Census(count.ops, frozenset(count.matmuls), count.scales)


def ops_per_step(c: Contender) -> int | None:
    """The device operations one step of ``c`` dispatches (:func:`census`). An eager step on a
    GPU launches about this many kernels, each costing host time a launch-bound model pays in
    full; unlike a time, the count is the same on every run and every machine. ``None`` for a
    step that runs compiled code.

    Example::

        >>> cpu = torch.device("cpu")
        >>> ops_per_step(Bare(_mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False)) > 20
        True
    """
    seen = census(c)
    return None if seen is None else seen.ops


def other_work(seen: Census | None, precision: Precision) -> str | None:
    """Why a step with this census does not run the work of ``precision``'s row, or ``None``
    when it does (or when it cannot be told: compiled code, fp8's own casts). A peer may run
    something else than it was asked for: Accelerate with fp16 on a CPU runs FP32 (no autocast,
    no scaler), Lightning Fabric falls back to bf16. Timing it beside the fp16 loops would
    compare other work; :func:`measure` leaves it out and says why.

    Example::

        >>> fp16 = Precision("fp16", "cpu")
        >>> other_work(Census(9, frozenset({torch.float16}), scales=True), fp16) is None
        True
        >>> other_work(Census(9, frozenset({torch.float32}), scales=False), fp16)
        "its matrix products ran in float32, not fp16's float16: it would time other work"
        >>> other_work(Census(9, frozenset({torch.float16}), scales=False), fp16)
        'it ran no loss scaler (no scaler.update): fp16 without one is other work'
    """
    if seen is None or precision.name == "fp8":
        return None
    wrong = sorted(str(d).removeprefix("torch.") for d in seen.matmuls - {precision.dtype})
    if wrong:
        want = str(precision.dtype).removeprefix("torch.")
        return f"its matrix products ran in {', '.join(wrong)}, not {precision.name}'s {want}: it would time other work"
    if precision.uses_scaler and not seen.scales:
        return f"it ran no loss scaler (no scaler.update): {precision.name} without one is other work"
    return None


_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"})
"""The ATen matrix products whose output dtype says what precision a step computed in."""


# operators that launch no kernel: profiler markers and bare allocations
_NO_KERNEL = frozenset({"_record_function_enter_new", "_record_function_exit", "empty", "empty_like",
                        "empty_strided"})


def balanced_orders(n: int) -> list[list[int]]:
    """The orders rounds run ``n`` contenders in: a Williams design, ``n`` orders (``2n`` for
    an odd ``n`` above 1) in which every contender runs right after every other one equally often.
    A contender's time depends on what ran before it (the caches it finds warm): in a plain
    rotation each one always follows the same neighbour, and an A/A copy of the bare loop,
    always right after the bare loop, read 1-2% faster than it in every run.

    Example (each ordered pair of neighbours exactly once over the four orders)::

        >>> balanced_orders(4)
        [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
        >>> pairs = [(o[i], o[i + 1]) for o in balanced_orders(5) for i in range(4)]
        >>> len(pairs), len(set(pairs)), max(pairs.count(p) for p in pairs)  # 20 pairs, each twice
        (40, 20, 2)
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    orders = [[(x + shift) % n for x in first] for shift in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 and n > 1 else orders


def _ratios(times: dict[str, list[float]], name: str) -> list[float]:
    """Each round's ms/step of ``name`` over the bare loop's in the same round (over its own
    median for the bare loop itself, or when there is none: the spread of the contender alone).

    Example::

        >>> _ratios({Bare.name: [2.0, 4.0], "x": [3.0, 4.0]}, "x"), _ratios({Bare.name: [2.0, 4.0]}, Bare.name)
        ([1.5, 1.0], [0.6666666666666666, 1.3333333333333333])
    """
    own = [statistics.median(times[name])] * len(times[name])
    base = own if name == Bare.name else times.get(Bare.name) or own
    return [t / b for t, b in zip(times[name], base)]


def _intervals(times: dict[str, list[float]], confidence: float = CONFIDENCE) -> dict[str, tuple[float, float, float]]:
    """Each contender's ``(median, low, high)`` ratio interval (:func:`median_interval`) at
    ``confidence``: 99% for the stop rule, 95% for the table. The bare loop's own (its ratio
    to itself: 1) is left out unless it runs alone, when it is its spread over its own median
    (a lone bare loop is resolved only when its rounds agree)."""
    return {name: median_interval(_ratios(times, name), confidence=confidence) for name in times
            if name != Bare.name or len(times) == 1}


def _floor_within(intervals: dict[str, tuple[float, float, float]], resolve: float) -> bool:
    """No A/A row, or its interval within ``± resolve`` of 1: two identical loops that read further
    apart in this process than the resolution asked (the order they were built in) leave the case
    unresolved however narrow its intervals, as a ratio then owes that much to where it sits
    (review 49e: "resolved to ±1%" beside an A/A interval that excluded 1 in 6 of 14 runs).

    Example::

        >>> _floor_within({"bare loop (A/A)": (0.994, 0.990, 0.998)}, 0.01), _floor_within({}, 0.01)
        (True, True)
        >>> _floor_within({"bare loop (A/A)": (0.993, 0.986, 0.999)}, 0.01)
        False
    """
    floor = intervals.get(BareAgain.name)
    return floor is None or (1 - resolve <= floor[1] and floor[2] <= 1 + resolve)


def _widest(intervals: dict[str, tuple[float, float, float]]) -> float:
    """The farthest reach among the intervals (as :attr:`Result.half_width` reads it); nan when
    one has no interval (too few rounds).

    Example::

        >>> round(_widest({"a": (1.0, 0.99, 1.01), "b": (2.0, 1.9, 2.05)}), 9)
        0.05
    """
    reach = [_reach(*interval) for interval in intervals.values()]
    return math.nan if any(math.isnan(r) for r in reach) else max(reach)


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: ``taskset``, a cpuset, a scheduler's
    allocation), not the host's count; ``os.cpu_count()`` where the mask cannot be read.

    Example::

        >>> 1 <= _usable_cpus() <= (os.cpu_count() or 1)
        True
    """
    if hasattr(os, "sched_getaffinity"):
        with contextlib.suppress(OSError):
            return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _one_line(err: BaseException, limit: int = 200) -> str:
    """How the bench says a contender's failure: :func:`~ampguard.errors.first_line` with the
    type in front, cut to ``limit`` characters (a CUDA OOM's first line alone runs long).

    Example::

        >>> _one_line(RuntimeError("CUDA out of memory." + chr(10) + "Tried to allocate 2 GiB"))
        'RuntimeError: CUDA out of memory.'
        >>> len(_one_line(RuntimeError("x" * 500))), _one_line(KeyError())
        (200, 'KeyError')
    """
    return shortened(first_line(err, with_type=True), limit)


def measure(
    w: Workload, precision: Precision, device: torch.device, contenders: list[type[Contender]],
    *, steps: int, rounds: int, warmup: int, fused: bool, peak_flops: float | None = None,
    resolve: float | None = None, budget_s: float | None = None, max_rounds: int = MAX_ROUNDS,
    orders: Callable[[int], list[list[int]]] = balanced_orders, left_out: list[NotRun] | None = None,
    whole_cycles: bool = True,
) -> list[Result]:
    """Paired rounds: in each round every contender runs ``steps`` steps, back to back, in
    the orders of :func:`balanced_orders` (``orders``); the ratio to the bare loop is taken
    within each round. Each round's first contender first runs one untimed step, so its timed
    steps, too, start right after a step of its own: the rounds run back to back, and the last
    contender of one round would otherwise precede the first of the next (for three
    contenders, sometimes itself).

    ``rounds`` is the least number of rounds. It is rounded up to whole cycles of the orders
    (``whole_cycles``, with a line saying so; ``--quick`` leaves it as given): a run cut inside
    a cycle has some contenders in the first place more often than others, and a contender's
    time depends on its place; with ``resolve`` too, so a budget stop, cut back to whole cycles,
    keeps at least ``rounds``. With ``resolve`` (0.01 is ``± 1%``) rounds are
    added until every contender's ratio interval is within ``± resolve``, ``budget_s`` seconds
    of rounds have passed, or ``max_rounds`` were run; each result's ``stop`` says which. A
    case is called resolved only at the end of a whole cycle of the orders (``n`` rounds for
    ``n`` contenders, ``2n`` for an odd ``n``), when every contender has followed every other
    alike, and after at least :data:`MIN_ROUNDS_TO_RESOLVE` rounds; the budget and
    ``max_rounds`` cut where they run out (:func:`_stop_reason`). The stop rule decides on the
    99% intervals of the rounds, which hold the 95% ones reported (:func:`median_interval`), so
    a resolved case's every row is within ``± resolve``. A timed step that fails (a CUDA out-of-memory,
    say) ends the case: its whole rounds are kept, ``stop`` is :data:`ERROR` and
    ``stop_detail`` says which contender failed, in which round, and why.
    Each timing starts from an idle device (``torch.cuda.synchronize``, then CUDA events).

    In order: :func:`_build` the contenders, :func:`_warm_up` each (leaving out the ones that
    fail or run other work), :func:`_run_rounds`, :func:`_results`, and close them. An interrupt
    (Ctrl-C, or the SIGTERM :func:`run` turns into one) in the rounds ends them, keeping the whole
    ones (:func:`_run_rounds`); one before a whole round raises ``KeyboardInterrupt``; one after
    the rounds (while the results are made or the contenders closed) keeps the case's results,
    whole, in the :class:`CaseInterrupted` it raises.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> results = measure(_mlp(cpu), fp32, cpu, [Bare, Guarded], steps=1, rounds=6, warmup=1, fused=False)
        >>> [(r.contender, len(r.rounds), r.median_ms > 0, r.stop) for r in results]
        [('bare loop', 6, True, 'fixed'), ('ampguard + csv', 6, True, 'fixed')]
        >>> ratios = [g / b for g, b in zip(results[1].rounds, results[0].rounds)]  # within each round
        >>> results[0].ratio_to_bare, results[1].ratio_to_bare == statistics.median(ratios)
        (1.0, True)
        >>> results[1].ratio_low <= results[1].ratio_to_bare <= results[1].ratio_high
        True

    With a budget that is already spent, the rounds stop at the least number and say why::

        >>> results = measure(_mlp(cpu), fp32, cpu, [Bare, BareAgain], steps=1, rounds=4, warmup=1, fused=False,
        ...                   resolve=1e-9, budget_s=0.0)
        >>> [(len(r.rounds), r.stop) for r in results]
        [(4, 'budget'), (4, 'budget')]

    A contender that cannot be built, fails its warm-up, or does not run the precision asked
    for (:func:`other_work`: measured only after it is seen doing the same work) is left out
    with a line saying why (and a :class:`NotRun` in ``left_out``); when none is left the
    result is empty::

        >>> class Broken(Bare):
        ...     name = "broken"
        ...     def step(self):
        ...         raise RuntimeError("no kernel for this")
        >>> measure(_mlp(cpu), fp32, cpu, [Broken], steps=1, rounds=3, warmup=1, fused=False)
          broken: not run (RuntimeError: no kernel for this)
          tiny-mlp fp32: no contender could run, nothing measured
        []
    """
    case = f"{w.name} {precision.name}"
    built: list[Contender] = []
    try:
        said: list[tuple[str, str]] = []  # (contender, why) of each one left out
        ready = _warm_up(_build(contenders, w, precision, device, fused, built, said), precision, device, warmup,
                         said)
        if left_out is not None:
            left_out += [NotRun(w.name, precision.name, name, why) for name, why in said]
    except BaseException:  # Ctrl-C or SIGTERM before the rounds: what was built goes too (Guarded's folder)
        for c in built:
            with contextlib.suppress(Exception):
                c.close()
        raise
    if not ready:  # nothing to time: say so, rather than divide by no contenders
        print(f"  {case}: no contender could run, nothing measured")
        return []
    timed = [r.contender for r in ready]
    cycle = orders(len(timed))
    # review 52b: with --resolve the least rounds were left as asked, and a budget that ran out between them
    # and the end of the cycle was cut back to the last whole cycle (7 asked, 4 kept, no interval): whole too
    if whole_cycles and rounds % len(cycle):
        asked, rounds = rounds, in_whole_cycles(rounds, len(cycle))
        down = resolve is not None and rounds > max_rounds  # (review 52k: 1000 asked ran 1002, past the most)
        rounds -= len(cycle) if down else 0
        fixed = "fixed rounds run" if resolve is None else "the rounds run"
        least = "" if resolve is None or down else "at least "
        within = f", within the {max_rounds} a case may run" if down else ""
        print(f"  {case}: {least}{rounds} rounds, not {asked}: {fixed} whole cycles of the {len(cycle)} round orders"
              f"{within} (every contender in every place alike)", flush=True)
    ran = _run_rounds(timed, device, case, steps=steps, orders=cycle, rounds=rounds, resolve=resolve,
                      budget_s=budget_s, max_rounds=max_rounds)
    # the results first, then the closes: an interrupt from here on (the rounds all ran) keeps them
    # (it threw the case away and called it cut before a whole round); it goes on after, with them
    results: list[Result] | None = None
    closed: list[Contender] = []
    try:
        results = _results(w, precision, ready, ran, peak_flops) if ran.done else []
        for c in timed:
            # after a failed step a contender may be in any state: its files and threads go, whatever
            # its close() says; after rounds that ran, a close that fails is a bug, and raises
            with contextlib.suppress(Exception) if ran.stop == ERROR else contextlib.nullcontext():
                c.close()
            closed.append(c)
    except KeyboardInterrupt:
        for c in timed:
            if c not in closed:  # (one the interrupt cut inside its close too: its files and threads go)
                with contextlib.suppress(Exception):
                    c.close()
        if results is None:
            results = _results(w, precision, ready, ran, peak_flops) if ran.done else []
        if not ran.done and ran.stop == ERROR and left_out is not None:
            left_out.append(NotRun(w.name, precision.name, None, ran.detail or ERROR))
        raise CaseInterrupted(results) from None
    if not ran.done:
        if ran.stop == ERROR:  # nothing of this case; the bench goes on with the next
            if left_out is not None:
                left_out.append(NotRun(w.name, precision.name, None, ran.detail or ERROR))
            return []
        # nothing of this case: the interrupt goes on (run_bench hands back the cases before it)
        print(f"  {case}: interrupted before a whole round, nothing measured")
        raise KeyboardInterrupt
    return results


def _build(contenders: list[type[Contender]], w: Workload, precision: Precision, device: torch.device,
           fused: bool, built: list[Contender] | None = None,
           said: list[tuple[str, str]] | None = None) -> list[Contender]:
    """Each contender set up for this case, appended to ``built`` as it is (so a caller cut short
    by a signal can close those already made); one that cannot be (a peer not installed, or without
    this precision) is left out with a line saying why.

    Example::

        >>> class CannotBuild(Bare):
        ...     name = "cannot build"
        ...     def __init__(self, *args):
        ...         raise ModuleNotFoundError("No module named 'peer'")
        >>> cpu = torch.device("cpu")
        >>> [c.name for c in _build([Bare, CannotBuild], _mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False)]
          cannot build: not run (ModuleNotFoundError: No module named 'peer')
        ['bare loop']
    """
    built = [] if built is None else built
    for cls in contenders:
        try:
            built.append(cls(w, precision, device, fused))
        except Exception as err:  # noqa: BLE001 - a peer that cannot run this case is left out, said so
            _say_not_run(cls.name, _one_line(err), said)
    return built


def _say_not_run(name: str, why: str, said: list[tuple[str, str]] | None) -> None:
    """The "not run" line of a contender left out, kept in ``said`` too (for ``--json``)."""
    print(f"  {name}: not run ({why})")
    if said is not None:
        said.append((name, why))


@dataclass(frozen=True)
class _Ready:
    """A contender warmed up and seen doing its row's work (:func:`_warm_up`), with what its
    untimed steps measured: the peak memory of a steady-state step (CUDA only, else ``None``)
    and its device operations per step (``None`` for compiled code)."""

    contender: Contender
    peak_mem_mib: float | None
    ops: int | None


def _warm_up(built: list[Contender], precision: Precision, device: torch.device, warmup: int,
             said: list[tuple[str, str]] | None = None) -> list[_Ready]:
    """Each contender warmed up (``warmup`` steps), then one untimed step for its peak memory
    (:func:`_peak_mib`, CUDA only) and one for its :func:`census`. One that fails there (an OOM,
    say), runs other work than ``precision``'s (:func:`other_work`) or applied no update in all
    those steps (:func:`_no_update`: measured only once its arithmetic did the work) is closed
    and left out, with a line saying why.

    Example::

        >>> class Broken(Bare):
        ...     name = "broken"
        ...     def step(self):
        ...         raise RuntimeError("no kernel for this")
        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> ready = _warm_up([Bare(_mlp(cpu), fp32, cpu, False), Broken(_mlp(cpu), fp32, cpu, False)], fp32, cpu, 1)
          broken: not run (RuntimeError: no kernel for this)
        >>> [(r.contender.name, r.peak_mem_mib, r.ops > 20) for r in ready]
        [('bare loop', None, True)]
    """
    ready: list[_Ready] = []
    for c in built:
        try:
            before = _weights(c)
            for _ in range(warmup):
                c.step()
            _sync(device)
            peak = _peak_mib(c, device)
            seen = census(c)  # one more untimed step: what it dispatched
            why = other_work(seen, precision) or _no_update(c, before)
        except Exception as err:  # noqa: BLE001 - a peer that fails on this case (an OOM, say) is left out, said so
            why = _one_line(err)
        if why is None:
            ready.append(_Ready(c, peak, None if seen is None else seen.ops))
            continue
        _say_not_run(c.name, why, said)
        with contextlib.suppress(Exception):  # its files and threads go, whatever state it is in
            c.close()
    return ready


def _weights(c: Contender) -> torch.Tensor:
    """A fingerprint of ``c``'s weights: each parameter's norm, on its device (no host read, no copy)."""
    return torch.stack(torch._foreach_norm([p.detach().float() for p in c.model.parameters()]))


def _no_update(c: Contender, before: torch.Tensor) -> str | None:
    """Why ``c`` would time other work when no step of its warm-up and census moved a weight (a
    skip every step: an fp16 overflow the loss scale never gets below; a loop that never steps):
    a skipped step runs no optimizer and reads as fast. ``None`` when its weights moved.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> bare = Bare(_mlp(cpu), fp32, cpu, fused=False)
        >>> before = _weights(bare)
        >>> _no_update(bare, before)
        'no step applied an update (every one skipped?): it would time other work'
        >>> bare.step(); _no_update(bare, before) is None
        True
    """
    if torch.equal(_weights(c), before):
        return "no step applied an update (every one skipped?): it would time other work"
    return None


def _peak_mib(c: Contender, device: torch.device) -> float | None:
    """The memory a steady-state step of ``c`` needs on CUDA, in MiB, over one untimed step;
    ``None`` elsewhere. All contenders live in this process, so the device's total would count
    the others' too: this is ``c``'s own tensors (:meth:`Contender.persistent_bytes`) plus the
    most its step allocates on top of what was there.

    Example::

        >>> cpu = torch.device("cpu")
        >>> _peak_mib(Bare(_mlp(cpu), Precision("fp32", "cpu"), cpu, fused=False), cpu) is None
        True
    """
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    c.step()
    _sync(device)
    transient = torch.cuda.max_memory_allocated(device) - before
    return (c.persistent_bytes() + transient) / 2**20


@dataclass
class _Rounds:
    """What one case's rounds measured (:func:`_run_rounds`): each contender's ms/step in each
    whole round, how many rounds were whole, and why they stopped (:attr:`Result.stop`, with
    :attr:`Result.stop_detail`)."""

    times: dict[str, list[float]]
    done: int
    stop: str
    detail: str | None = None
    positions: dict[str, list[int]] = field(default_factory=dict)  # each one's place in each round (0: first)
    seconds: float | None = None  # the wall time the rounds took


def _run_rounds(built: list[Contender], device: torch.device, case: str, *, steps: int, orders: list[list[int]],
                rounds: int, resolve: float | None, budget_s: float | None, max_rounds: int) -> _Rounds:
    """Paired rounds until :func:`_stop_reason` ends them: round ``k`` runs the contenders in
    the order ``orders[k % len(orders)]``, ``steps`` timed steps each, the first of them after
    one untimed step of its own. Ctrl-C (or the SIGTERM :func:`run` turns into one) or a failed
    step (a CUDA OOM, say; a line naming ``case`` says which contender, in which round) ends
    them early: only the whole rounds before are kept.

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> built = [Bare(_mlp(cpu), fp32, cpu, False), BareAgain(_mlp(cpu), fp32, cpu, False)]
        >>> ran = _run_rounds(built, cpu, "tiny-mlp fp32", steps=1, orders=balanced_orders(2), rounds=3,
        ...                   resolve=None, budget_s=None, max_rounds=1000)
        >>> ran.done, ran.stop, [len(t) for t in ran.times.values()], ran.positions
        (3, 'fixed', [3, 3], {'bare loop': [0, 1, 0], 'bare loop (A/A)': [1, 0, 1]})
    """
    times: dict[str, list[float]] = {c.name: [] for c in built}
    positions: dict[str, list[int]] = {c.name: [] for c in built}
    started, done, running = time.perf_counter(), 0, built[0]
    try:
        while True:
            order = orders[done % len(orders)]
            running = built[order[0]]
            running.step()  # untimed: the first contender's timed steps, too, follow a step of its own
            for place, i in enumerate(order):
                running = built[i]
                times[running.name].append(_time_steps(running, steps, device))
                positions[running.name].append(place)
            done += 1
            why = _stop_reason(times, done, rounds=rounds, cycle=len(orders), resolve=resolve, budget_s=budget_s,
                               max_rounds=max_rounds, started=started)
            if why is not None:
                return _whole_cycles(_Rounds(times, done, why, positions=positions,
                                             seconds=time.perf_counter() - started), len(orders))
    except KeyboardInterrupt:  # Ctrl-C, or the SIGTERM of a time limit (run()): the whole rounds so far
        stop, detail = INTERRUPTED, None
    except Exception as err:  # noqa: BLE001 - a failed step (a CUDA OOM, say) ends this case, not the bench
        stop, detail = ERROR, f"{_one_line(err)} ({running.name}, round {done + 1})"
        print(f"  {case}: {running.name} failed in round {done + 1} ({_one_line(err)}); "
              f"the case ends with its {done} whole rounds", flush=True)
    return _whole_cycles(_Rounds(times, done, stop, detail, positions=positions,
                                 seconds=time.perf_counter() - started), len(orders))


CUT_STOPS = ("budget", "max rounds", INTERRUPTED, ERROR)
"""The stops that may cut the rounds inside a cycle of the orders (:func:`_whole_cycles`)."""


def _whole_cycles(ran: _Rounds, cycle: int) -> _Rounds:
    """``ran`` with only its whole rounds and, when a budget, the most rounds, an interrupt or an
    error cut it inside a cycle of the orders after at least one whole cycle, only the rounds of
    its whole cycles: in a cut cycle some contenders ran in the first places more often than
    others, and a contender's time depends on its place (1-2% measured, RESULTS.md). The rounds
    left out are said in ``detail``. Fixed rounds are the number asked (``--quick`` runs part of
    a cycle on purpose); a case cut inside its first cycle keeps what it has.

    Example (5 rounds of a 2-round cycle, cut by the budget: the fifth goes)::

        >>> ran = _Rounds({"a": [1.0] * 5}, 5, "budget", positions={"a": [0, 1, 0, 1, 0]})
        >>> cut = _whole_cycles(ran, 2)
        >>> cut.done, cut.times, cut.positions, cut.detail
        (4, {'a': [1.0, 1.0, 1.0, 1.0]}, {'a': [0, 1, 0, 1]}, 'the last round, of a cycle of the round orders cut short, left out')
        >>> _whole_cycles(ran, 8).done, _whole_cycles(_Rounds({"a": [1.0] * 5}, 5, "fixed"), 2).done
        (5, 5)
    """
    keep = ran.done - ran.done % cycle if ran.stop in CUT_STOPS and ran.done > cycle else ran.done
    dropped = ran.done - keep
    detail = ran.detail
    if dropped:
        said = f"the last {'round' if dropped == 1 else f'{dropped} rounds'}, of a cycle of the round orders cut short, left out"
        detail = said if detail is None else f"{detail}; {said}"
    return replace(ran, times={name: t[:keep] for name, t in ran.times.items()}, done=keep, detail=detail,
                   positions={name: p[:keep] for name, p in ran.positions.items()})


def _stop_reason(times: dict[str, list[float]], done: int, *, rounds: int, cycle: int, resolve: float | None,
                 budget_s: float | None, max_rounds: int, started: float) -> str | None:
    """Why the rounds end after ``done`` whole rounds (a :attr:`Result.stop`), or ``None`` to run
    another. Never before ``rounds``; then ``"fixed"`` when no ``resolve`` is asked. Else
    ``"resolved"`` once every ratio's :data:`DECIDE_CONFIDENCE` interval (:func:`_intervals`) is
    within ``± resolve``, and the A/A row's within ``± resolve`` of 1 (:func:`_floor_within`), asked
    only at the end of a whole cycle of the orders (``cycle`` rounds); the reported 95% interval of the same rounds lies inside it. (A rule that stops the
    first time a 95% interval happens to be narrow picks rounds that happened to agree: its
    interval missed the true ratio in 6-12% of simulated runs, not 5%; deciding on the 99% one,
    3-4%.) Else ``"budget"`` once ``budget_s`` seconds have passed since ``started``, or ``"max
    rounds"`` at ``max_rounds``: those two cut at any round.

    Example (two identical loops: every ratio 1, every interval of zero width)::

        >>> times = {Bare.name: [1.0] * 8, BareAgain.name: [1.0] * 8}
        >>> rule = dict(rounds=2, cycle=2, budget_s=None, max_rounds=1000, started=time.perf_counter())
        >>> _stop_reason(times, 1, resolve=None, **rule), _stop_reason(times, 2, resolve=None, **rule)
        (None, 'fixed')
        >>> [_stop_reason(times, n, resolve=0.01, **rule) for n in (6, 8)]  # (6 rounds have no 99% interval)
        [None, 'resolved']
        >>> _stop_reason(times, 3, resolve=0.01, **{**rule, "budget_s": 0.0})
        'budget'
    """
    if done < rounds:
        return None
    if resolve is None:
        return "fixed"
    if done % cycle == 0 and done >= max(MIN_ROUNDS_TO_RESOLVE, cycle) and \
            _widest(intervals := _intervals(times, DECIDE_CONFIDENCE)) <= resolve and _floor_within(intervals, resolve):
        return "resolved"
    if budget_s is not None and time.perf_counter() - started >= budget_s:
        return "budget"
    if done >= max_rounds:
        return "max rounds"
    return None


def _results(w: Workload, precision: Precision, ready: list[_Ready], ran: _Rounds,
             peak_flops: float | None) -> list[Result]:
    """One :class:`Result` per contender from its whole rounds: median and least ms/step, tokens/s
    and MFU (for a workload that counts its work), and, with a bare loop among them, the ratios
    to it round by round and their 95% interval (:func:`_intervals`; the stop rule read the 99%
    one of the same rounds, which holds it).

    Example::

        >>> cpu, fp32 = torch.device("cpu"), Precision("fp32", "cpu")
        >>> ready = [_Ready(cls(_mlp(cpu), fp32, cpu, False), None, None) for cls in (Bare, BareAgain)]
        >>> ran = _Rounds({Bare.name: [1.0, 3.0], BareAgain.name: [1.1, 3.3]}, done=2, stop="fixed")
        >>> [(r.contender, round(r.median_ms, 6), round(r.ratio_to_bare, 6)) for r in _results(_mlp(cpu), fp32, ready,
        ...                                                                                         ran, None)]
        [('bare loop', 2.0, 1.0), ('bare loop (A/A)', 2.2, 1.1)]
    """
    times = ran.times
    intervals = _intervals(times) if Bare.name in times else {}
    results = []
    for r in ready:
        name = r.contender.name
        med = statistics.median(times[name])
        res = Result(w.name, precision.name, name, med, min(times[name]), peak_mem_mib=r.peak_mem_mib,
                     rounds=times[name], stop=ran.stop, stop_detail=ran.detail, ops=r.ops,
                     positions=ran.positions.get(name, []), case_s=ran.seconds)
        if w.tokens_per_step:
            res.tokens_per_s = w.tokens_per_step / (med / 1000)
            if peak_flops:
                res.mfu = w.flops_per_step / (med / 1000) / peak_flops
        if Bare.name in times:
            res.ratios = _ratios(times, name)
            if name in intervals:
                res.ratio_to_bare, res.ratio_low, res.ratio_high = intervals[name]
            else:  # the bare loop beside others: the baseline, 1 by definition (no interval)
                res.ratio_to_bare = 1.0
        results.append(res)
    return results


def table(results: list[Result]) -> str:
    """The results as a markdown table, one row per contender (``n/a`` memory off CUDA).

    The ratio column is the contender's time over the bare loop's (above 1: slower), the median
    of the per-round ratios (not the ratio of the two median ms/step columns), with its 95%
    interval; none below 6 rounds, and none for the bare loop beside others: the baseline.

    Example::

        >>> rows = table([Result("tiny-mlp", "fp32", "bare loop", 0.49, 0.4, ratio_to_bare=1.0, rounds=[0.5] * 9),
        ...               Result("tiny-mlp", "fp32", "ampguard + csv", 0.5, 0.4, ratio_to_bare=1.012,
        ...                      ratio_low=1.004, ratio_high=1.019, rounds=[0.5] * 9, ops=82)]).splitlines()
        >>> len(rows), rows[2], rows[3]
        (4, '| tiny-mlp | fp32 | bare loop | 0.490 | 0.400 | 1 (baseline) | 9 |  | n/a |  |  |', '| tiny-mlp | fp32 | ampguard + csv | 0.500 | 0.400 | 1.012 [1.004, 1.019] | 9 | 82 | n/a |  |  |')
    """
    lines = ["| workload | precision | contender | median ms/step | min ms/step | time / bare's [95% CI] | rounds "
             "| ops/step | peak MiB | tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = "n/a" if r.peak_mem_mib is None else f"{r.peak_mem_mib:.1f}"
        tps = "" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        mfu = "" if r.mfu is None else f"{r.mfu:.1%}"
        baseline = r.contender == Bare.name and r.ratio_to_bare == 1.0 and math.isnan(r.ratio_low)
        ratio = "1 (baseline)" if baseline else f"{r.ratio_to_bare:.3f}" + (
            "" if math.isnan(r.ratio_low) else f" [{r.ratio_low:.3f}, {r.ratio_high:.3f}]")
        lines.append(f"| {r.workload} | {r.precision} | {r.contender} | {r.median_ms:.3f} | {r.min_ms:.3f} | "
                     f"{ratio} | {len(r.rounds)} | {'' if r.ops is None else r.ops} | {mem} | {tps} | {mfu} |")
    return "\n".join(lines)


def resolution(results: list[Result], resolve: float | None) -> list[str]:
    """One line per workload and precision: resolved to ``± resolve``, or how close it came; with
    fixed rounds (``resolve`` None), a line only for a case a failed step or an interrupt cut
    short of the rounds asked. Then the A/A noise floor (:func:`noise_floor`).

    Example::

        >>> r = [Result("mlp", "fp32", "bare loop", 1, 1, 1.0, ratio_low=1.0, ratio_high=1.0, stop="budget",
        ...             rounds=[1] * 40),
        ...      Result("mlp", "fp32", "ampguard + csv", 1, 1, 1.1, ratio_low=1.078, ratio_high=1.122,
        ...             stop="budget", rounds=[1] * 40)]
        >>> resolution(r, 0.01)
        ['mlp fp32: not resolved to ±1% (the time budget ran out after 40 rounds; widest ±2.0%, ampguard + csv)']
        >>> resolution(r, 0.00001)[0][:34]  # (what was asked, as given: ±0.0% read as nothing asked)
        'mlp fp32: not resolved to ±0.001% '

        >>> resolution([Result("mlp", "fp32", "bare loop", 1, 1, 1.0, stop="fixed", rounds=[1] * 7)], None)
        []
        >>> resolution([Result("mlp", "fp32", "bare loop (A/A)", 1, 1, 0.997, ratio_low=0.981, ratio_high=1.12,
        ...                    stop="fixed", rounds=[1] * 6)], None)  # (fixed rounds: the noise floor alone)
        ['mlp fp32: noise floor (bare loop against itself) 0.997 [0.981, 1.120]: a ratio within it is not told apart from the bare loop']

    Within ``± resolve`` but not called resolved (the budget cut it), and the A/A noise floor::

        >>> r = [Result("mlp", "fp32", "bare loop (A/A)", 1, 1, 1.001, ratio_low=0.998, ratio_high=1.002,
        ...             stop="budget", rounds=[1] * 7)]
        >>> for line in resolution(r, 0.01):
        ...     print(line)
        mlp fp32: not resolved to ±1% (the time budget ran out after 7 rounds; widest ±0.3%, bare loop (A/A): within, at 95%, but the rule calls a case resolved on its 99% intervals at the end of a whole cycle of the round orders)
        mlp fp32: noise floor (bare loop against itself) 1.001 [0.998, 1.002]: a ratio within it is not told apart from the bare loop
    """
    out = []
    for key in dict.fromkeys((r.workload, r.precision) for r in results):
        rows = [r for r in results if (r.workload, r.precision) == key and r.contender != Bare.name
                and not math.isnan(r.ratio_to_bare)]
        if not rows:
            continue
        where, done = f"{key[0]} {key[1]}: ", len(rows[0].rounds)
        floor = next((r for r in rows if r.contender == BareAgain.name and not math.isnan(r.ratio_low)), None)
        floor_line = [] if floor is None else [where + noise_floor(floor)]
        stop, detail = rows[0].stop, rows[0].stop_detail
        if resolve is None:  # (fixed rounds: nothing asked to resolve; the noise floor still reads the table)
            if stop in (ERROR, INTERRUPTED):  # (the rows' rounds fall short of those asked: say why)
                how = "a failed step" + ("" if detail is None else f": {detail}") if stop == ERROR else "an interrupt"
                out.append(where + f"fixed rounds cut short by {how}; its figures are from its "
                                   f"{counted(done, 'whole round')}")
            out += floor_line
            continue
        why = {"budget": "the time budget ran out", "max rounds": "the most rounds ran"}.get(stop, stop)
        if stop == ERROR:  # (which contender, which round, why)
            why += "" if detail is None else f": {detail}"
        done_text = counted(done, "round") + ("" if stop == ERROR or detail is None else f" ({detail})")  # (a cut cycle's)
        if any(math.isnan(r.ratio_low) for r in rows):
            out.append(where + f"not resolved to ±{resolve * 100:g}% ({why} after {done_text}, too few for a "
                               "95% interval: it needs 6)")
            continue
        widest = max(rows, key=lambda r: r.half_width)
        if stop == "resolved":
            out.append(where + f"resolved to ±{resolve * 100:g}% in {counted(done, 'round')} "
                               f"(widest ±{widest.half_width:.1%}, {widest.contender})")
        else:
            within = (": within, at 95%, but the rule calls a case resolved on its 99% intervals at the end of a "
                      "whole cycle of the round orders") if widest.half_width <= resolve else ""
            if floor is not None and not (1 - resolve <= floor.ratio_low and floor.ratio_high <= 1 + resolve):
                within = (f"; the noise floor reaches {max(1 - floor.ratio_low, floor.ratio_high - 1):.1%} from 1: "
                          f"identical loops read further apart than ±{resolve * 100:g}% in this process, which a "
                          "resolved case may not")
            out.append(where + f"not resolved to ±{resolve * 100:g}% ({why} after {done_text}; widest "
                               f"±{widest.half_width:.1%}, {widest.contender}{within})")
        out += floor_line
    return out


def noise_floor(floor: Result) -> str:
    """The noise-floor line of a case's A/A row (:class:`BareAgain`): its ratio and interval, and
    what a ratio within it means. When the interval itself excludes 1, two identical loops read
    apart in this process: the line says which way and by how much, and takes the floor's far end
    as what a ratio must pass to be told apart from the bare loop. It does not say why, which one
    process cannot know; it is no chance alone (identical loops' 95% intervals excluded 1 in 6 of 14
    runs, review 49e: an offset of the process, which a case's verdict counts, :func:`_stop_reason`),
    and the one effect seen here has a direction. (On a 2-core CPU, of two bare loops of the same class
    built and warmed up one after the other, the second read 0.2-1.4% faster in each of 12
    processes; moving the first one's parameters and optimizer state to fresh memory after the
    second's, or a throwaway loop run before both, did not change it; warming the second up first
    made it even. The A/A copy is built second, so that effect makes it read faster, a ratio below
    1; a floor above 1 goes against it. A contender built third, as ampguard's is, may sit as well
    or as badly, so the floor's far end bounds what a ratio can owe to where it sits.)

    Example::

        >>> print(noise_floor(Result("mlp", "fp32", "bare loop (A/A)", 1, 1, 0.997, ratio_low=0.981, ratio_high=1.12)))
        noise floor (bare loop against itself) 0.997 [0.981, 1.120]: a ratio within it is not told apart from the bare loop
        >>> print(noise_floor(Result("mlp", "fp32", "bare loop (A/A)", 1, 1, 0.992, ratio_low=0.987, ratio_high=0.996)))
        ... # doctest: +NORMALIZE_WHITESPACE
        noise floor (bare loop against itself) 0.992 [0.987, 0.996], its interval excluding 1: the A/A copy, the
        same loop, read 0.8% faster than the bare loop (0.4-1.3%), the way the build-order effect seen on CPUs
        goes (of two identical loops the one built second, the A/A copy, read faster): an offset of this process,
        not chance alone (identical loops' intervals excluded 1 in 6 of 14 runs, review 49e), which --processes
        averages over; a ratio within 1.3% of 1, either way, is not told apart from the bare loop
        >>> print(noise_floor(Result("mlp", "fp32", "bare loop (A/A)", 1, 1, 1.01, ratio_low=1.004, ratio_high=1.02)))
        ... # doctest: +NORMALIZE_WHITESPACE
        noise floor (bare loop against itself) 1.010 [1.004, 1.020], its interval excluding 1: the A/A copy, the
        same loop, read 1.0% slower than the bare loop (0.4-2.0%), against the build-order effect seen on CPUs
        (of two identical loops the one built second, the A/A copy, read faster): an offset of this process, not
        chance alone (identical loops' intervals excluded 1 in 6 of 14 runs, review 49e), which --processes
        averages over all the same; a ratio within 2.0% of 1, either way, is not told apart from the bare loop
    """
    said = f"noise floor (bare loop against itself) {floor.ratio_to_bare:.3f} [{floor.ratio_low:.3f}, " \
           f"{floor.ratio_high:.3f}]"
    if floor.ratio_low <= 1 <= floor.ratio_high:
        return f"{said}: a ratio within it is not told apart from the bare loop"
    bias, near, far = abs(floor.ratio_to_bare - 1), abs(floor.ratio_high - 1), abs(floor.ratio_low - 1)
    if floor.ratio_low > 1:
        near, far = far, near
    effect = "of two identical loops the one built second, the A/A copy, read faster"
    offset = ("an offset of this process, not chance alone (identical loops' intervals excluded 1 in 6 of 14 runs, "
              "review 49e), which --processes averages over")
    if floor.ratio_high < 1:
        how, why = "faster", f"the way the build-order effect seen on CPUs goes ({effect}): {offset}"
    else:
        how, why = "slower", f"against the build-order effect seen on CPUs ({effect}): {offset} all the same"
    return (f"{said}, its interval excluding 1: the A/A copy, the same loop, read {bias:.1%} {how} than the bare loop "
            f"({near * 100:.1f}-{far:.1%}), {why}; a ratio within {far:.1%} of 1, either way, is not told apart from "
            "the bare loop")


GUARDED = (Guarded.name, GuardedSyncFree.name, GuardedFusedTail.name)
PEERS = (AccelerateLoop.name, FabricLoop.name)


def versus(results: list[Result]) -> list[dict[str, Any]]:
    """Each ampguard contender against each peer (Accelerate, Fabric) of its case, paired by
    round: the median of ampguard's ms/step over the peer's in the same round, and its 95%
    interval (what "never slower than Accelerate beyond the interval" is judged by: two
    intervals against the bare loop, read side by side, are not a paired comparison).

    Example::

        >>> rows = [Result("mlp", "bf16", "ampguard + csv", 1.1, 1, rounds=[1.1, 2.2, 1.1, 1.1, 2.2, 1.1]),
        ...         Result("mlp", "bf16", "accelerate", 1.0, 1, rounds=[1.0, 2.0, 1.0, 1.0, 2.0, 1.0])]
        >>> [(v["contender"], v["peer"], round(v["ratio"], 3), round(v["low"], 3), v["rounds"]) for v in versus(rows)]
        [('ampguard + csv', 'accelerate', 1.1, 1.1, 6)]
    """
    out = []
    for key in dict.fromkeys((r.workload, r.precision) for r in results):
        case = {r.contender: r for r in results if (r.workload, r.precision) == key}
        for ours, peer in ((case[g], case[p]) for g in GUARDED for p in PEERS if g in case and p in case):
            med, low, high = median_interval([a / b for a, b in zip(ours.rounds, peer.rounds)])
            out.append({"workload": key[0], "precision": key[1], "contender": ours.contender, "peer": peer.contender,
                        "ratio": med, "low": low, "high": high, "rounds": len(ours.rounds)})
    return out


def memory_note(results: list[Result]) -> list[str]:
    """A line saying why the memory column reads ``n/a``, when a row does.

    Example::

        >>> memory_note([Result("mlp", "fp32", "bare loop", 1.0, 1.0)])
        ['peak MiB: measured on CUDA only (PyTorch keeps no peak of CPU memory, per contender or at all)']
        >>> memory_note([Result("mlp", "bf16", "bare loop", 1.0, 1.0, peak_mem_mib=12.5)])
        []
    """
    if any(r.peak_mem_mib is None for r in results):
        return ["peak MiB: measured on CUDA only (PyTorch keeps no peak of CPU memory, per contender or at all)"]
    return []


def mfu_note(results: list[Result], peak_tflops: float | None) -> list[str]:
    """A line saying why the MFU column is empty for some rows although ``--peak-tflops`` was
    given: the MLPs count no tokens and no FLOPs (only the transformers do, :data:`COUNTED`).
    (With none of those selected, :func:`_check_args` refuses the flag.)

    Example::

        >>> rows = [Result("tiny-mlp", "bf16", "bare loop", 1.0, 1.0),
        ...         Result("small-transformer", "bf16", "bare loop", 1.0, 1.0, tokens_per_s=1e4, mfu=0.4)]
        >>> mfu_note(rows, 989.0)
        ['MFU: --peak-tflops 989 is used for the transformers only; tiny-mlp counts no FLOPs (no tokens), so its MFU is empty']
        >>> mfu_note(rows, None), mfu_note(rows[1:], 989.0)
        ([], [])
    """
    if peak_tflops is None:
        return []
    uncounted = list(dict.fromkeys(r.workload for r in results if r.tokens_per_s is None))
    if not uncounted:
        return []
    counts, its = ("counts", "its") if len(uncounted) == 1 else ("count", "their")
    return [f"MFU: --peak-tflops {peak_tflops:g} is used for the transformers only; {', '.join(uncounted)} {counts} no "
            f"FLOPs (no tokens), so {its} MFU is empty"]


def versus_lines(results: list[Result]) -> list[str]:
    """:func:`versus` in words, one line a pair.

    Example::

        >>> rows = [Result("mlp", "bf16", "ampguard + csv", 1.1, 1, rounds=[1.1] * 6),
        ...         Result("mlp", "bf16", "lightning fabric", 1.0, 1, rounds=[1.0] * 3 + [1.2] * 3)]
        >>> versus_lines(rows)
        ["mlp bf16: ampguard + csv / lightning fabric's time, paired by round: 1.008 [0.917, 1.100] (6 rounds)"]
    """
    return [f"{v['workload']} {v['precision']}: {v['contender']} / {v['peer']}'s time, paired by round: {v['ratio']:.3f}"
            + ("" if math.isnan(v["low"]) else f" [{v['low']:.3f}, {v['high']:.3f}]") + f" ({v['rounds']} rounds)"
            for v in versus(results)]


def speedups(results: list[Result]) -> list[str]:
    """AMP against FP32, per workload, for the bare loop and for ampguard: medians of two cases
    that ran apart (unpaired, no interval; the lines say so).

    Example::

        >>> results = [Result("tiny-mlp", "fp32", Bare.name, 2.0, 2.0), Result("tiny-mlp", "bf16", Bare.name, 1.0, 1.0),
        ...            Result("tiny-mlp", "bf16", Guarded.name, 1.2, 1.2)]  # ampguard has no fp32 row
        >>> speedups(results)
        ['tiny-mlp, bare loop: bf16 is 2.00x faster than fp32 (unpaired)']
        >>> speedups([Result("mlp", "fp32", Bare.name, 1.0, 1.0), Result("mlp", "bf16", Bare.name, 1.4, 1.4)])
        ['mlp, bare loop: bf16 is 1.40x slower than fp32 (unpaired)']
        >>> speedups([Result("gpt2", "bf16", Bare.name, 3.0, 3.0), Result("gpt2", "fp8", Bare.name, 2.0, 2.0)])
        ['gpt2, bare loop: fp8 is 1.50x faster than bf16 (unpaired)']
    """
    out = []
    for workload in dict.fromkeys(r.workload for r in results):
        for contender in (Bare.name, Guarded.name):
            rows = {r.precision: r.median_ms for r in results if r.workload == workload and r.contender == contender}
            if "fp32" in rows:
                for p in ("bf16", "fp16", "fp8"):
                    if p in rows:
                        ratio = rows["fp32"] / rows[p]  # > 1: faster; a slower one says so, never "0.7x faster"
                        how = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
                        out.append(f"{workload}, {contender}: {p} is {how} than fp32 (unpaired)")
            if "bf16" in rows and "fp8" in rows:  # what fp8 is for: its gain over bf16
                ratio = rows["bf16"] / rows["fp8"]
                how = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
                out.append(f"{workload}, {contender}: fp8 is {how} than bf16 (unpaired)")
    return out


def run_bench(
    *, device: torch.device, workloads: list[str], precisions: list[str], steps: int, rounds: int,
    warmup: int, peers: bool = True, fused: bool = False, peak_tflops: float | None = None,
    resolve: float | None = None, budget_s: float | None = None, aa: bool = False, compiled: bool = False,
    left_out: list[NotRun] | None = None, whole_cycles: bool = True, batch: int | None = None,
) -> list[Result]:
    """Every workload x precision, measured with the bare loop (and its A/A twin with ``aa``),
    the guarded step (and its sync-free path with ``fused``) and the installed peers. fp16 on a
    CPU runs only the :data:`SMALL` models (the mlp and nano MLPs). fp8 converts the model
    (:func:`fp8_workload`; the peers are left out); ``compiled`` runs every model through
    ``torch.compile`` (:func:`compiled_workload`), as torchao's float8 needs to be fast.
    ``whole_cycles``: the least rounds rounded up to whole cycles of the orders (:func:`measure`).
    ``batch``: every workload's batch size (None: each its own, :data:`BATCHES`). An interrupt
    (Ctrl-C, or the SIGTERM :func:`run` turns into one) ends the bench: inside a case's rounds
    after a whole one, with the results so far (the last case's ``stop``: :data:`INTERRUPTED`);
    elsewhere with :class:`BenchInterrupted` (a case whose rounds all ran before it came is in its
    ``results``, whole). Either way the cases it left unmeasured go to ``left_out``
    (:func:`_unmeasured`), told from what each case left (:func:`_handled_since`), not from where
    the interrupt found the loop.

    Example::

        >>> results = run_bench(device=torch.device("cpu"), workloads=["mlp"], precisions=["fp32"], steps=1,
        ...                     rounds=2, warmup=1, peers=False)
        tiny-mlp fp32: bare loop, ampguard + csv
        >>> [(r.workload, r.precision, r.contender) for r in results]
        [('tiny-mlp', 'fp32', 'bare loop'), ('tiny-mlp', 'fp32', 'ampguard + csv')]
    """
    # the sync-free path needs fused AdamW: it runs when every contender uses it (--fused)
    ours: list[type[Contender]] = [Bare] + ([BareAgain] if aa else []) + [Guarded]
    ours += [GuardedSyncFree, GuardedFusedTail] if fused else []
    contenders = ours + (available_peers() if peers else [])
    results: list[Result] = []
    said: list[NotRun] = [] if left_out is None else left_out
    cases = [(name, p) for name in workloads for p in precisions]
    # where the bench is: the case it is on (its index in `cases`; those before are measured or
    # said not run), and how long `results` and `said` were as it began, set in one assignment: an
    # interrupt after a case, before this moved on, is told by what the case left (_handled_since)
    at = (0, 0, 0)
    try:
        for name in workloads:
            try:
                w = _WORKLOADS[name](device, batch or BATCHES[name])
            except Exception as err:  # noqa: BLE001 - a batch too large for memory (--batch), say: not run
                why = f"its data could not be made: {_one_line(err)}"
                print(f"{name}: not run ({why})", flush=True)
                said += [NotRun(w_name(name), p, None, why) for p in precisions]
                at = (at[0] + len(precisions), len(results), len(said))
                continue
            for p in precisions:
                why = _case_left_out(name, p, device)
                if why is not None:
                    print(f"{w.name} {p}: not run ({why})", flush=True)
                    said.append(NotRun(w.name, p, None, why))
                    at = (at[0] + 1, len(results), len(said))
                    continue
                run_w, run_c = (fp8_workload(w), ours) if p == "fp8" else (w, contenders)
                run_w = compiled_workload(run_w) if compiled else run_w
                print(f"{w.name} {p}: {', '.join(c.name for c in run_c)}", flush=True)
                results += measure(run_w, Precision(p, device.type), device, run_c, steps=steps, rounds=rounds,
                                   warmup=warmup, fused=fused, peak_flops=peak_tflops * 1e12 if peak_tflops else None,
                                   resolve=resolve, budget_s=budget_s, left_out=said,
                                   whole_cycles=whole_cycles)
                at = (at[0] + 1, len(results), len(said))
                if results and results[-1].stop == INTERRUPTED:  # (measure() kept its whole rounds)
                    _unmeasured(cases[at[0]:], None, device, left_out)
                    return results
        return results
    except KeyboardInterrupt as err:  # outside a case's rounds (building, warming up, its first round): the cases before
        if isinstance(err, CaseInterrupted):  # (it came after the case's rounds all ran: its results are whole)
            results += err.results
        # (an interrupt just after a case, before `at` moved on, named it cut, "nothing measured",
        # beside its rows: what the case left says it was done with)
        done = _handled_since(cases, at, results, said, lambda p: ours if p == "fp8" else contenders)
        if done > at[0]:  # (the case it was on is done with: none was cut)
            _unmeasured(cases[done:], None, device, left_out)
        else:
            _unmeasured(cases[done + 1:], cases[done] if done < len(cases) else None, device, left_out)
        raise BenchInterrupted(results) from None


def _handled_since(cases: Sequence[tuple[str, str]], at: tuple[int, int, int], results: Sequence[Result],
                   said: Sequence[NotRun], contenders: Callable[[str], Sequence[type[Contender]]]) -> int:
    """The index in ``cases`` of the first case not done with, from :func:`run_bench`'s ``at``
    (the case it was on, and how long ``results`` and ``said`` were as it began) and what came
    after: each case said not run as a whole (``contender`` None: its data, its precision here, a
    failed step before a whole round) is done, and so is a case with rows of its own, or whose
    every contender (``contenders(precision)``) was said not run (none could run).

    Example (case 1 measured, before ``at`` moved on to case 2)::

        >>> cases = [("mlp", "fp32"), ("nano", "fp32"), ("nano", "bf16")]
        >>> rows = [Result("tiny-mlp", "fp32", Bare.name, 1.0, 1.0), Result("nano-mlp", "fp32", Bare.name, 1.0, 1.0)]
        >>> _handled_since(cases, (1, 1, 0), rows, [], lambda p: [Bare]), _handled_since(cases, (1, 2, 0), rows, [],
        ...                                                                                  lambda p: [Bare])
        (2, 1)
        >>> _handled_since(cases, (1, 2, 0), rows, [NotRun("nano-mlp", "fp32", Bare.name, "an OOM")], lambda p: [Bare])
        2
    """
    i, rows_from, said_from = at
    for n in said[said_from:]:  # (whole cases said not run, in their order)
        if n.contender is None and i < len(cases) and (n.workload, n.precision) == (w_name(cases[i][0]), cases[i][1]):
            i += 1
    if i == at[0] and i < len(cases):
        names = {n.contender for n in said[said_from:]}
        if results[rows_from:] or {c.name for c in contenders(cases[i][1])} <= names:
            i += 1
    return i


CUT_SHORT = "interrupted before a whole round of it was measured"
"""``NotRun.why`` of the case an interrupt cut while it was built, warmed up or in its first round."""
NOT_STARTED = "not started: the bench was interrupted"
"""``NotRun.why`` of a case the bench never reached, an interrupt having ended it first."""


def w_name(model: str) -> str:
    """The workload name (:data:`WORKLOAD_NAMES`) of a ``--models`` name; the name itself if unknown.

    Example::

        >>> w_name("nano"), w_name("resnet")
        ('nano-mlp', 'resnet')
    """
    return WORKLOAD_NAMES.get(model, model)


def _case_left_out(model: str, precision: str, device: torch.device) -> str | None:
    """Why :func:`run_bench` leaves a case out before measuring it (fp16 on a CPU runs only the
    :data:`SMALL` models: its autocast there is far too slow for anything bigger), or ``None``.

    Example::

        >>> cpu = torch.device("cpu")
        >>> _case_left_out("transformer", "fp16", cpu), _case_left_out("nano", "fp16", cpu)
        ('on a CPU fp16 runs only the mlp and nano models', None)
    """
    if precision == "fp16" and device.type == "cpu" and model not in SMALL:
        return "on a CPU fp16 runs only the mlp and nano models"
    return None


def _unmeasured(never: Sequence[tuple[str, str]], cut: tuple[str, str] | None, device: torch.device,
                left_out: list[NotRun] | None) -> None:
    """The cases an interrupt left unmeasured, as :class:`NotRun` in ``left_out`` (``--json``'s
    ``not_run``, and the interrupted line of :func:`run`): ``cut``, the one it cut before a whole
    round (:data:`CUT_SHORT`), and ``never``, those the bench never reached (:data:`NOT_STARTED`;
    or why they would have been left out anyway).

    Example::

        >>> said = []
        >>> _unmeasured([("mlp", "fp32"), ("transformer", "fp16")], ("nano", "bf16"), torch.device("cpu"), said)
        >>> [(n.workload, n.precision, n.why) for n in said]  # doctest: +NORMALIZE_WHITESPACE
        [('nano-mlp', 'bf16', 'interrupted before a whole round of it was measured'),
         ('tiny-mlp', 'fp32', 'not started: the bench was interrupted'),
         ('small-transformer', 'fp16', 'on a CPU fp16 runs only the mlp and nano models')]
    """
    if left_out is None:
        return
    if cut is not None:
        left_out.append(NotRun(w_name(cut[0]), cut[1], None, CUT_SHORT))
    left_out += [NotRun(w_name(model), p, None, _case_left_out(model, p, device) or NOT_STARTED) for model, p in never]


def interrupted_line(left_out: Sequence[NotRun], under: bool = False) -> str:
    """The line :func:`run` prints when an interrupt cut the bench, naming the cases it left
    unmeasured (:func:`_unmeasured`), so a table of the cases before them does not read as whole:
    on stderr before ``--json``'s output, or ``under`` the table, on stdout with it.

    Example::

        >>> interrupted_line([])
        'bench: interrupted; the rounds measured so far follow'
        >>> interrupted_line([NotRun("nano-mlp", "bf16", None, CUT_SHORT), NotRun("tiny-mlp", "fp32", None, NOT_STARTED),
        ...                   NotRun("tiny-mlp", "bf16", None, NOT_STARTED)])
        'bench: interrupted; the rounds measured so far follow (nano-mlp bf16: cut before a whole round, nothing measured; not started: tiny-mlp fp32, tiny-mlp bf16)'
        >>> interrupted_line([NotRun("tiny-mlp", "fp32", None, NOT_STARTED)], under=True)
        'bench: interrupted; the rounds above are those measured so far (not started: tiny-mlp fp32)'
    """
    cut = [f"{n.workload} {n.precision}" for n in left_out if n.contender is None and n.why == CUT_SHORT]
    never = [f"{n.workload} {n.precision}" for n in left_out if n.contender is None and n.why == NOT_STARTED]
    said = ([f"{', '.join(cut)}: cut before a whole round, nothing measured"] if cut else []) + (
        [f"not started: {', '.join(never)}"] if never else [])
    where = "the rounds above are those measured so far" if under else "the rounds measured so far follow"
    return f"bench: interrupted; {where}" + (f" ({'; '.join(said)})" if said else "")


class CaseInterrupted(KeyboardInterrupt):
    """An interrupt that came after a case's rounds had all run (while its contenders were closed
    or its results made, :func:`measure`): ``results`` holds the case's, whole (their ``stop`` is
    theirs), for :func:`run_bench` to keep before it ends the bench."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__("bench interrupted after a case's rounds")
        self.results = results


class BenchInterrupted(KeyboardInterrupt):
    """A bench interrupted outside a case's whole rounds (a case built, warmed up, or in its first
    round); ``results`` holds the cases measured before (their ``stop`` is theirs: "fixed", say),
    so :func:`run` takes this exception itself as the interrupt, not the last row's ``stop``."""

    def __init__(self, results: list[Result]) -> None:
        super().__init__("bench interrupted")
        self.results = results


def fp8_workload(w: Workload) -> Workload:
    """The same workload with its model converted to torchao float8 training (the default
    layers: :func:`ampguard.fp8.convert_to_fp8`); its FLOPs are counted as before, so MFU stays
    against ``--peak-tflops`` (give the bf16 peak to compare fp8 with bf16 on one scale). The
    peers (Accelerate, Fabric) have no such setting here: fp8 runs the bare loop and ampguard.
    On a CPU the float8 matmuls run in PyTorch's CPU ``torch._scaled_mm``: a correctness smoke
    test, not a speed figure.

    Example::

        >>> w = fp8_workload(_mlp(torch.device("cpu")))
        >>> [type(m).__name__ for m in w.make_model()]
        ['Linear', 'GELU', 'Float8Linear', 'GELU', 'Linear']
    """
    from .fp8 import convert_to_fp8

    def make() -> nn.Module:
        model = w.make_model()
        convert_to_fp8(model)
        return model

    return replace(w, make_model=make)


def compiled_workload(w: Workload) -> Workload:
    """The same workload with its model wrapped in ``torch.compile`` (compiled on its first
    steps, which the warm-up takes). torchao's float8 casts are separate eager kernels without
    it: fp8 against bf16 is a fair race only when both are compiled.

    Example::

        >>> type(compiled_workload(_mlp(torch.device("cpu"))).make_model()).__name__
        'OptimizedModule'
    """

    def make() -> nn.Module:
        return torch.compile(w.make_model())

    return replace(w, make_model=make)


def machine(device: torch.device | None = None) -> str:
    """The machine in one line: processor, the CPUs this process may use, torch version (and,
    for a CUDA ``device``, or with none given where CUDA is available, the GPU's name and its
    backend: ``cuda`` with the CUDA version, or ``rocm`` with the HIP version on an AMD GPU,
    which PyTorch names ``cuda`` too).

    Example::

        >>> f"torch {torch.__version__}" in machine(), f"{_usable_cpus()} CPU" in machine()
        (True, True)
    """
    text = f"{cpu_name()}, {counted(_usable_cpus(), 'CPU')}, torch {torch.__version__}"
    if (device.type == "cuda") if device is not None else torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name(device)}, {backend_text(torch.device('cuda'))}"
    return text


def cpu_name() -> str:
    """The processor's model name (Linux's ``/proc/cpuinfo``: "AMD EPYC 7B13", where
    ``platform.processor()`` says only "x86_64"), else what :mod:`platform` knows.

    Example::

        >>> isinstance(cpu_name(), str) and cpu_name() != ""
        True
    """
    import platform

    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    return platform.processor() or platform.machine() or "unknown processor"


def versions() -> dict[str, str | None]:
    """What the figures were measured with: ampguard (and its git commit, where it runs from a
    checkout, else ``AMPGUARD_COMMIT``: the GPU machine gets a copy of the tree without ``.git``,
    and benchmarks/gpu.sh sets it from the commit gpu_wheels.sh wrote there; review 54h), Python, torch (and its CUDA), and each peer or extra the bench may run (``None``:
    not installed; read from the installed metadata, nothing imported).

    Example::

        >>> v = versions()
        >>> v["torch"] == torch.__version__, sorted(v)[:3]
        (True, ['accelerate', 'ampguard', 'ampguard_commit'])
    """
    import platform
    import subprocess
    from importlib import metadata

    def installed(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # (no git, no checkout: none)
        done = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=False)
        commit = (done.stdout.strip() or None) if done.returncode == 0 else None
    commit = commit or os.environ.get("AMPGUARD_COMMIT") or None
    return {"ampguard": installed("ampguard"), "ampguard_commit": commit, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "accelerate": installed("accelerate"),
            "lightning": installed("lightning"), "torchao": installed("torchao")}


def json_number(v: Any) -> Any:
    """``v`` as JSON takes it: not-a-number (a ratio with no bare loop, an interval below 6
    values) is ``null``.

    Example::

        >>> json_number(math.nan), json_number(1.5), json_number("x")
        (None, 1.5, 'x')
    """
    return None if isinstance(v, float) and math.isnan(v) else v


def to_json(results: list[Result], resolve: float | None = None, settings: dict[str, Any] | None = None,
            device: torch.device | None = None, not_run: list[NotRun] = (),
            load: Sequence[float] | None = None, found: dict[str, str | None] | None = None) -> str:
    """The machine, the run's settings, the resolution asked and every result as JSON
    (``ampguard bench --json``): per contender its per-round times and ratios (``ratios``: its
    time over the bare loop's in each round; on the bare loop's own row, which has no other bare
    loop to divide by, its time over its own median: the spread of its rounds), its place in each
    round's order (``positions``, 0: it ran first; an order effect shows there), the seconds its
    case's rounds took (``case_s``), the median ratio, its interval and half-width, and why the
    rounds stopped (``stop``, with ``stop_detail``: an
    error's contender, round and message; ``null`` for the other stops). Not-a-number (no bare loop to
    compare with) is written ``null``. ``threads`` is the pinned CPU thread count (``null`` on
    CUDA, where nothing is pinned). ``not_run``: each case or contender left out, and why
    (:class:`NotRun`; ``contender`` null for a whole case). ``versions``: ampguard's (and its
    commit), Python's, torch's and the peers' (:func:`versions`; or ``found``, what it returned
    before: it runs ``git``, and :func:`run` writes this where no process may start).
    ``load_avg``: the system's load over 1, 5 and 15 minutes before the bench (``load``; null
    where unknown), and ``load_above_cpus``
    whether the first was above the CPUs this process may use (other work shared the cores: the
    timings are not to be trusted).

    Example::

        >>> data = json.loads(to_json([Result("tiny-mlp", "fp32", "bare loop", 0.5, 0.4, rounds=[0.5])],
        ...                           settings={"steps": 3}))
        >>> sorted(data)  # doctest: +NORMALIZE_WHITESPACE
        ['load_above_cpus', 'load_avg', 'machine', 'not_run', 'resolve', 'results', 'run', 'threads', 'versions',
         'versus']
        >>> data["results"][0]["median_ms"], data["results"][0]["rounds"], data["load_avg"]
        (0.5, [0.5], None)
        >>> [data["results"][0][k] for k in ("ratio_low", "half_width", "stop", "stop_detail")]
        [None, None, 'fixed', None]
        >>> data["run"]["steps"], data["run"]["confidence"], data["run"]["decide_confidence"], data["versus"]
        (3, 0.95, 0.99, [])
    """
    rows = [{**{k: json_number(v) for k, v in asdict(r).items()}, "half_width": json_number(r.half_width)}
            for r in results]
    run = {**(settings or {}), "confidence": CONFIDENCE, "decide_confidence": DECIDE_CONFIDENCE, "interval": INTERVAL,
           "min_rounds_to_resolve": MIN_ROUNDS_TO_RESOLVE, "max_rounds": MAX_ROUNDS}
    threads = None if device is not None and device.type == "cuda" else torch.get_num_threads()
    return json.dumps({"machine": machine(device), "versions": versions() if found is None else found,
                       "load_avg": None if load is None else list(load),
                       "load_above_cpus": _busy(load), "threads": threads, "resolve": resolve, "run": run,
                       "results": rows, "versus": [{k: json_number(v) for k, v in pair.items()} for pair in versus(results)],
                       "not_run": [asdict(n) for n in not_run]}, indent=2)


# each built on a device at a batch size: its own (BATCHES) or --batch
_WORKLOADS: dict[str, Callable[[torch.device, int], Workload]] = {
    "mlp": lambda device, batch: _mlp(device, batch=batch), "nano": _nano,
    "transformer": lambda device, batch: _transformer(device, "small", batch),
    "gpt2": lambda device, batch: _transformer(device, "gpt2-small", batch)}
WORKLOADS = tuple(_WORKLOADS)
SMALL = ("mlp", "nano")  # the MLPs: fp16 runs them on a CPU too
COUNTED = ("transformer", "gpt2")  # the models that count their tokens and FLOPs: tokens/s, and MFU (--peak-tflops)
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


@contextlib.contextmanager
def pinned_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the block (left as they are with None), and the
    count they had before restored after it, however it ends.

    Example::

        >>> before = torch.get_num_threads()
        >>> with pinned_threads(before + 1):
        ...     torch.get_num_threads() == before + 1
        True
        >>> torch.get_num_threads() == before
        True
    """
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if count is not None:
            torch.set_num_threads(before)


def run(*, device: str = "cpu", models: str = "mlp,transformer", precisions: str = "fp32,bf16,fp16", steps: int = 30,
        rounds: int = 7, warmup: int = 5, fused: bool = False, peers: bool = True, peak_tflops: float | None = None,
        quick: bool = False, as_json: bool = False, resolve_pct: float = 1.0, budget_s: float = 120.0,
        threads: int | None = None, aa: bool = True, compiled: bool = False, batch: int | None = None) -> int:
    """``ampguard bench``: measure, then print a table (or JSON), the resolution and the
    speed-ups. Returns the exit status: 0, or, when Ctrl-C or a SIGTERM cut the bench short
    after something was measured, 130 or 143 (what was measured is printed first, and a line
    names the cases it left unmeasured: the one it cut, those never started; under the table, or
    on stderr before ``--json``'s output, whose ``not_run`` has them too), wherever it came (in a
    case's rounds, after them, or while a later case was built or warmed up), or 74 when stdout
    could not take the table or the JSON
    (:func:`output_written`). Bad
    arguments (:func:`_check_args`), or no contender able to run at all, are an InputError
    (exit 2); an interrupt before anything was measured raises
    :class:`~ampguard.signals.Interrupted` (130 or 143).

    At least ``rounds`` paired rounds per case, then more until every ratio is resolved to
    ``± resolve_pct`` percent (0: ``rounds``) or ``budget_s`` seconds of rounds have passed
    (``rounds`` rounded up to whole cycles of the round orders unless ``quick``). The header gives the
    machine's load before the bench (and a warning on stderr when it is above the usable CPUs:
    other work shares the cores); from the end of the bench to the end of the output a SIGINT or
    SIGTERM waits (:func:`~ampguard.signals.held_signals`, blocked at the OS level: a write into
    a pipe is not cut part-way), so the JSON is never cut short, then exits 143 or 130 (a code
    found before it stands: an interrupt of the bench's, a lost stdout's 74); a second one ends
    the process at once, the output cut (a reader that stopped reading); one that comes as the
    bench ends, before that hold, is an interrupt of the bench (its results printed, 130 or 143).
    On a CPU the intra-op threads are pinned (``threads``, default the CPUs this process may run
    on: its affinity mask, not the host's count).
    ``batch`` gives every model that batch size in place of its own (:data:`BATCHES`): a bigger
    one makes a GPU step compute-bound, its time the GPU's rather than the host's (an eager GPT-2
    small at batch 8 is launch-bound on an H200, and its rounds vary by ±5-7%).
    ``compiled`` runs every model through ``torch.compile`` (from Python, e.g.
    ``benchmarks/gpu/fp8_vs_bf16.sh``; fp8 is fast only compiled). (``--processes``: the whole
    bench in fresh processes, :func:`ampguard.bench_processes.run`.)

    Example (``quick``: 2 rounds of 3 steps, a smoke test rather than a measurement)::

        >>> run(models="mlp", precisions="fp32", quick=True, peers=False)  # doctest: +ELLIPSIS
        ampguard bench on cpu (...): 2 rounds x 3 steps, paired, fixed rounds; 1 warm-up step a contender, no peers
        --quick: a smoke test that every contender runs, not a measurement (...)
        tiny-mlp fp32: bare loop, ampguard + csv
        | workload | precision | contender | median ms/step | ...
        |---|---|---|---|---|---|---|---|---|---|---|
        | tiny-mlp | fp32 | bare loop | ... | 1 (baseline) | 2 | ... | n/a |  |  |
        | tiny-mlp | fp32 | ampguard + csv | ...
        0
        >>> run(models="mlp,resnet")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: unknown model 'resnet' (mlp, nano, transformer, gpt2)
        >>> run(models="nano,nano")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: model 'nano' given twice
        >>> run(models="transformer", precisions="fp16")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: on a CPU fp16 runs only the mlp and nano models; nothing to measure for transformer
    """
    from .build import resolve_device
    from .errors import ExitCode, InputError
    from .signals import Interrupted

    where = resolve_device(device)
    workloads, names = models.split(","), precisions.split(",")
    _check_args(where, workloads, names, peak_tflops=peak_tflops, resolve_pct=resolve_pct, budget_s=budget_s,
                threads=threads, quick=quick, rounds=rounds)
    if quick:
        steps, rounds, warmup, resolve_pct, aa = 3, 2, 1, 0.0, False
    resolve = resolve_pct / 100 if resolve_pct > 0 else None
    load = _load()  # before the bench adds its own threads to it
    # pinned, so no round runs with another thread count than the next (the CPUs this process may
    # use, not the host's); the caller's count back after (a notebook's, a test's)
    with pinned_threads((threads or _usable_cpus()) if where.type == "cpu" else None):
        torch.manual_seed(0)
        until = f"until ±{resolve_pct:g}% or {budget_s:g} s a case" if resolve else "fixed rounds"
        threads_said = f", {counted(torch.get_num_threads(), 'thread')}" if where.type == "cpu" else ""
        if where.type == "cpu" and torch.get_num_threads() > _usable_cpus():  # allowed: but the timings say so
            threads_said += f" on {counted(_usable_cpus(), 'usable CPU')} (oversubscribed: the threads share cores)"

        # SIGTERM (what `timeout` and schedulers send) interrupts as Ctrl-C does: a bench cut by a time
        # limit prints its whole rounds; with --json, stdout is the JSON alone: the progress lines go to stderr
        results: list[Result] = []
        left_out: list[NotRun] = []  # the "not run" lines, for --json too
        cut = False  # an interrupt ended the bench outside a case's whole rounds (BenchInterrupted), or after it
        stdout = sys.stdout
        # (versions() runs git: here, not in the hold below, where a process started would inherit
        # SIGINT and SIGTERM blocked and answer neither)
        found = versions() if as_json else None
        written = False  # the output was written whole: a signal that came while it was held does not replace
        # the code found before it (the bench's own interrupt, its first signal's; a lost stdout's 74)
        try:
            with interrupted_by(signal.SIGTERM) as signalled, contextlib.ExitStack() as holding:
                # from the end of the bench a signal waits until the output is whole, then exits 143 or 130
                # (SIGTERM's default cut the JSON short: a time limit left half a file where the last good one
                # had been); the hold is entered before interrupted_by is left, and an interrupt that comes
                # after the bench, before the hold, is the bench's (it lost every result: 130, nothing printed)
                try:
                    try:
                        if as_json:
                            sys.stdout = sys.stderr
                        least = "at least " if resolve else ""  # (rounds are added until the ratios are resolved)
                        # (the settings that change the figures, on the table's own line: review 49e)
                        settings = [f"{counted(warmup, 'warm-up step')} a contender"] + (
                            [f"batch {batch}"] if batch else []) + (["fused AdamW"] if fused else []) + (
                            ["torch.compile"] if compiled else []) + ([] if peers else ["no peers"])
                        print(f"ampguard bench on {where} ({machine(where)}{_load_text(load)}{threads_said}): {least}"
                              f"{counted(rounds, 'round')} x {counted(steps, 'step')}, paired, {until}; "
                              f"{', '.join(settings)}", flush=True)
                        if quick:
                            print("--quick: a smoke test that every contender runs, not a measurement (its ratios are "
                                  "noise; no interval below 6 rounds; no A/A row)", flush=True)
                        for note in _long_on(where, workloads):
                            print(note, flush=True)
                        results = run_bench(device=where, workloads=workloads, precisions=names, steps=steps,
                                            rounds=rounds, warmup=warmup, peers=peers, fused=fused,
                                            peak_tflops=peak_tflops, resolve=resolve, budget_s=budget_s, aa=aa,
                                            compiled=compiled, left_out=left_out, whole_cycles=not quick, batch=batch)
                        hold_output(holding)  # (a second signal: cut, exit)
                    except KeyboardInterrupt as stopped:  # (Ctrl-C, or the SIGTERM interrupted_by turns into one)
                        results, cut = stopped.results if isinstance(stopped, BenchInterrupted) else results, True
                        if not results:  # nothing measured: exit as an interrupted command does (143 for SIGTERM)
                            raise Interrupted(ExitCode.TERMINATED if signalled else ExitCode.INTERRUPTED) from None
                        hold_output(holding)
                finally:
                    sys.stdout = stdout
                # (a case cut before its first whole round, or while built or warmed up, left the one
                # before it last: its stop is "fixed", and Ctrl-C read as a finished bench, exit 0)
                interrupted = cut or bool(signalled) or (bool(results) and results[-1].stop == INTERRUPTED)
                if interrupted and as_json:  # (a table says it under the table: stdout is where it is read)
                    print(interrupted_line(left_out), file=sys.stderr, flush=True)
                if not results:
                    raise InputError(f"bench: no contender could run {models} in {precisions} on {where} "
                                     "(why: the lines above)")
                settings = {"device": str(where), "models": workloads, "precisions": names, "steps": steps,
                            "warmup": warmup, "min_rounds": rounds, "budget_s": budget_s if resolve else None,
                            "peak_tflops": peak_tflops, "fused": fused, "peers": peers, "aa": aa,
                            "compiled": compiled, "quick": quick, "batch": batch}
                print(to_json(results, resolve, settings, where, left_out, load, found) if as_json else
                      "\n".join([table(results), *([interrupted_line(left_out, under=True)] if interrupted else []),
                                 *memory_note(results), *mfu_note(results, peak_tflops), *resolution(results, resolve),
                                 *versus_lines(results), *speedups(results)]),
                      flush=True)
                if _busy(load):  # (after the figures it is about: a refusal above stays one line)
                    cpus = counted(_usable_cpus(), "usable CPU")
                    print(f"ampguard: warning: the 1-minute load before the bench ({load[0]:.2f}) was above the {cpus}: other "
                          "work shared the cores, and the timings are not to be trusted", file=sys.stderr, flush=True)
                written = True
        except Interrupted as held:  # (the hold's, once the output is whole: a signal came while it was written)
            # (or stdout's reader left while it was written: the bench finishes with its own code; review 52b)
            if not (written and (interrupted or lost_stdout() is not None or held.exit_code == ExitCode.BROKEN_PIPE)):
                raise
        return output_written(as_json, int(ExitCode.TERMINATED if signalled else ExitCode.INTERRUPTED)
                              if interrupted else 0)


def hold_output(holding: contextlib.ExitStack) -> None:
    """Hold the signals while the bench's output is written (:func:`~ampguard.signals.held_signals`,
    entered on ``holding``): one waits until the output is whole, a second one cuts it ("the output
    was cut"). stdout's reader leaving (``bench | head -1``: a progress line found the pipe closed)
    is no stop for the bench: outside a run a verb finishes with its own code (docs/design.md, as
    ``validate``, ``report`` and ``compare`` do). Review 52b: the hold's flag started stopped by it
    (SIGPIPE, a run's stop at its first step), and a bench that had measured every case said
    "ampguard: interrupted", exit 141; a reader leaving during the output is the caller's to
    forgive (the hold's :class:`~ampguard.signals.Interrupted` with exit 141).

    Example::

        >>> from ampguard.signals import reader_left
        >>> reader_left()  # (no run: the next stop flag would start stopped)
        >>> with contextlib.ExitStack() as holding:
        ...     hold_output(holding)
        ...     print("written")
        written
        >>> from ampguard import signals
        >>> signals._READER_GONE[0] = False
    """
    from .signals import READER_LEFT, held_signals

    flag = holding.enter_context(held_signals())
    flag.cutting = "the output"
    if flag.signal == READER_LEFT:  # (the reader that left before: only a SIGINT or SIGTERM stops the output)
        flag.signal = None


def output_written(as_json: bool, code: int) -> int:
    """``code``, unless the result on stdout was lost (a full disk behind ``> out.json`` or
    ``> table.md``, a closed stdout: the console's guard, :class:`~ampguard.signals.TolerantStream`,
    dropped it): then one line says so and the exit is :attr:`~ampguard.errors.ExitCode.DISK_FULL`,
    for stdout is the bench's product, the JSON (``as_json``) or the table alike (a table lost to
    ``/dev/full`` exited 0). A reader that left (a pipe into ``head``) is SIGPIPE's own exit,
    not this.

    Example::

        >>> output_written(True, 0), output_written(False, 130)  # (a console that took every line)
        (0, 130)
    """
    from .errors import ExitCode

    lost = lost_stdout()
    if lost is None:
        return code
    what = "the --json result" if as_json else "the table"
    print(f"ampguard: error: bench: {what} could not be written to stdout ({failed_because(lost)})",
          file=sys.stderr, flush=True)
    return int(ExitCode.DISK_FULL)


def _load() -> tuple[float, float, float] | None:
    """The system's load average over 1, 5 and 15 minutes (``os.getloadavg``); ``None`` where
    there is none (Windows).

    Example::

        >>> load = _load()
        >>> load is None or (len(load) == 3 and all(x >= 0 for x in load))
        True
    """
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def _load_text(load: Sequence[float] | None) -> str:
    """The load for the header: ``", load 1.93 1.20 0.85"`` (1, 5, 15 minutes), or nothing.

    Example::

        >>> _load_text((1.934, 1.2, 0.85)), _load_text(None)
        (', load 1.93 1.20 0.85', '')
    """
    return "" if load is None else ", load " + " ".join(f"{x:.2f}" for x in load)


def _busy(load: Sequence[float] | None) -> bool:
    """Whether the 1-minute load is above the CPUs this process may use: other work then takes
    turns on the cores with the bench's threads, and its timings measure that too.

    Example::

        >>> _busy((_usable_cpus() + 0.5, 0.0, 0.0)), _busy((0.0, 0.0, 0.0)), _busy(None)
        (True, False, False)
    """
    return load is not None and load[0] > _usable_cpus()


def _long_on(where: torch.device, workloads: Sequence[str]) -> list[str]:
    """A note for a workload sized for a GPU and asked for on a CPU: GPT-2 small's rounds take
    minutes there, and ``--budget`` stops adding rounds, it does not cut one short (a run given
    ``--budget 1`` ran past a quarter of an hour at 10 GB).

    Example::

        >>> print(*_long_on(torch.device("cpu"), ["mlp", "gpt2"]))  # doctest: +ELLIPSIS
        note: gpt2 is GPT-2 small in shape (12 layers x 768, context 1024), sized for a GPU: on a CPU a step ...
        >>> _long_on(torch.device("cpu"), ["mlp"]), _long_on(torch.device("cuda"), ["gpt2"])
        ([], [])
    """
    if where.type != "cpu" or "gpt2" not in workloads:
        return []
    return ["note: gpt2 is GPT-2 small in shape (12 layers x 768, context 1024), sized for a GPU: on a CPU a "
            "step takes seconds and a round minutes, and --budget stops adding rounds, it does not cut one short"]


MIN_RESOLVE_PCT = 0.001
"""The finest ``--resolve`` taken, in percent: a ratio resolved to ±0.001% is already far below
any timer's noise (and a tinier one divided by 100 reached 0.0, read as "nothing asked")."""


def _check_args(where: torch.device, workloads: list[str], names: list[str], *, peak_tflops: float | None,
                resolve_pct: float, budget_s: float, threads: int | None, quick: bool = False,
                rounds: int | None = None) -> None:
    """Refuse, as one :class:`~ampguard.errors.InputError` line, what :func:`run` cannot measure:
    an unknown or repeated model or precision (a repeat would run the case twice), a
    ``--peak-tflops`` that is not a finite number > 0 or is given with none of the :data:`COUNTED`
    models among the cases that run (the MLPs count no FLOPs, and a transformer in fp16 on a CPU is
    left out, :func:`_case_left_out`: it gave no MFU, and said nothing), ``--resolve`` or ``--budget`` not a
    finite number >= 0, a ``--resolve`` of 100% or more, one below :data:`MIN_RESOLVE_PCT` but
    not 0, or one with ``--budget 0`` (no time to
    resolve in; not with ``quick``, which resolves nothing and ignores the budget), ``--rounds``
    past :data:`MAX_ROUNDS` with ``--resolve`` (not with ``quick``, which sets its own rounds),
    ``--threads`` below 1 or on a GPU (it pins a CPU's threads: it did nothing there, unsaid), or
    no case left to run (fp16 alone on a CPU with none of the :data:`SMALL` models).

    Example::

        >>> cpu = torch.device("cpu")
        >>> _check_args(cpu, ["mlp"], ["fp32", "fp16"], peak_tflops=None, resolve_pct=1.0, budget_s=120.0, threads=None)
        >>> _check_args(cpu, ["mlp"], ["fp32"], peak_tflops=0.0, resolve_pct=1.0, budget_s=120.0, threads=None)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: --peak-tflops must be a finite number > 0, got 0
        >>> _check_args(cpu, ["mlp", "nano"], ["fp32"], peak_tflops=989.0, resolve_pct=1.0, budget_s=120.0, threads=None)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: --peak-tflops gives MFU, which only the transformer and gpt2 models count (their FLOPs); mlp,nano count none: leave it out, or add a transformer
        >>> _check_args(cpu, ["mlp", "gpt2"], ["fp32"], peak_tflops=989.0, resolve_pct=1.0, budget_s=120.0, threads=None)
        >>> _check_args(cpu, ["nano", "transformer"], ["fp16"], peak_tflops=5.0, resolve_pct=1.0, budget_s=120.0,
        ...             threads=None)  # (the transformer is left out: fp16 on a CPU)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: --peak-tflops gives MFU, which only the transformer and gpt2 models count (their FLOPs), and transformer fp16 is not run here (on a CPU fp16 runs only the mlp and nano models): no row would have MFU; leave it out, or add a precision it runs in
        >>> _check_args(cpu, ["mlp"], ["fp32"], peak_tflops=None, resolve_pct=1.0, budget_s=0.0, threads=None,
        ...             quick=True)  # (--quick resolves nothing: no budget needed)
    """
    from .errors import InputError

    for kind, given, known in (("model", workloads, WORKLOADS), ("precision", names, PRECISIONS)):
        for name in given:
            if name not in known:
                raise InputError(f"bench: unknown {kind} {name!r} ({', '.join(known)})")
            if given.count(name) > 1:  # (it ran the case twice, two tables of the same thing)
                raise InputError(f"bench: {kind} {name!r} given twice")
    if peak_tflops is not None and not (math.isfinite(peak_tflops) and peak_tflops > 0):
        raise InputError(f"bench: --peak-tflops must be a finite number > 0, got {peak_tflops:g}")
    kept = [m for m in workloads if any(_case_left_out(m, p, where) is None for p in names)]  # (what run_bench runs)
    if not kept:  # (every case left out: fp16 alone on a CPU with none of the SMALL models)
        why = next(why for m in workloads for p in names if (why := _case_left_out(m, p, where)) is not None)
        raise InputError(f"bench: {why}; nothing to measure for {','.join(workloads)}")
    if peak_tflops is not None and not set(COUNTED) & set(kept):  # (it was ignored: no MFU, no word)
        if not set(COUNTED) & set(workloads):
            raise InputError(f"bench: --peak-tflops gives MFU, which only the {' and '.join(COUNTED)} models count "
                             f"(their FLOPs); {','.join(workloads)} count none: leave it out, or add a transformer")
        left = [f"{m} {p}" for m in workloads if m in COUNTED for p in names]
        why = next(why for m in workloads if m in COUNTED for p in names if (why := _case_left_out(m, p, where)))
        raise InputError(f"bench: --peak-tflops gives MFU, which only the {' and '.join(COUNTED)} models count "
                         f"(their FLOPs), and {', '.join(left)} {'is' if len(left) == 1 else 'are'} not run here "
                         f"({why}): no row would have MFU; leave it out, or add a precision "
                         f"{'it runs' if len(left) == 1 else 'they run'} in")
    for flag, value in (("--resolve", resolve_pct), ("--budget", budget_s)):
        if not (math.isfinite(value) and value >= 0):
            raise InputError(f"bench: {flag} must be a finite number >= 0, got {value:g}")
    if resolve_pct >= 100:  # (a ratio known to ±100% is not known)
        raise InputError(f"bench: --resolve is a percentage below 100 (1 is ±1%), got {resolve_pct:g}")
    if 0 < resolve_pct < MIN_RESOLVE_PCT:  # (1e-323 / 100 is 0.0: "fixed rounds" in the header, a budget stop after)
        raise InputError(f"bench: --resolve {resolve_pct!r} is finer than any timing resolves (at least "
                         f"{MIN_RESOLVE_PCT:g}, or 0 for fixed rounds)")
    if resolve_pct > 0 and budget_s == 0 and not quick:
        raise InputError("bench: --budget 0 leaves no time to add rounds until resolved: give --resolve 0 to run "
                         "exactly --rounds")
    # review 52b: checked by the command line before --quick overrode --rounds and --resolve (`--quick --rounds
    # 2000` refused for a --resolve --quick turns off), in a line without "bench:"
    if rounds is not None and resolve_pct > 0 and not quick and rounds > MAX_ROUNDS:  # (the least past the most)
        raise InputError(f"bench: --rounds {rounds} is more than the {MAX_ROUNDS} rounds a case run to --resolve "
                         "may take; --resolve 0 runs a fixed number of rounds")
    if threads is not None and threads < 1:
        raise InputError(f"bench: --threads must be >= 1, got {threads}")
    if threads is not None and where.type != "cpu":  # review 52b: ignored on cuda ("threads": null), unsaid
        raise InputError(f"bench: --threads {threads} pins a CPU's intra-op threads; on {where.type} the steps run "
                         "on the GPU and it is not used: leave it out")


@contextlib.contextmanager
def interrupted_by(*signals: int, once: bool = False) -> Iterator[list[int]]:
    """Each of ``signals`` interrupts as Ctrl-C does (``KeyboardInterrupt``); the list it yields
    holds the signals that came. ``once``: only the first raises, later ones are ignored while
    what it interrupted is wound up. (Not the main thread: signals are left alone.)"""
    came: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if once and came:
            return
        came.append(signum)
        raise KeyboardInterrupt

    previous: dict[int, Any] = {}
    try:  # (each handler noted before its swap, inside the try: a pending handler that raises as one
        # is swapped leaves none swapped for good)
        for sig in signals:
            previous[sig] = signal.getsignal(sig)
            try:
                signal.signal(sig, handler)
            except ValueError:  # (not the main thread)
                del previous[sig]
                break
        yield came
    finally:
        for sig, old in previous.items():  # (a handler set outside Python reads as None: the default)
            signal.signal(sig, signal.SIG_DFL if old is None else old)
