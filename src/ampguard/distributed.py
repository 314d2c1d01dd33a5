"""torch.distributed for the guarded step: who am I, agree on the skip, accumulate quietly.

Launched by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` in the
environment), ampguard joins the process group (gloo on CPU, nccl on CUDA) and wraps the model
in DDP or FSDP2 (``fully_shard``). The step then

- agrees on its skip decision with one all-reduce per step: a non-finite loss or gradient on any
  rank makes every rank skip the same step, so no rank waits in a collective another skipped,
  and the loss scale stays identical everywhere (the same all-reduce carries the loss, so the
  logged loss is the global mean);
- computes the global norm over all ranks and shards (DDP gradients are already averaged; an
  FSDP2 gradient norm is a DTensor whose ``full_tensor()`` reduces over the shards);
- skips the gradient all-reduce on the micro-batches that do not close an accumulation group
  (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map, tree_map_only
from torch import nn

from .errors import ExitCode, InputError, first_line


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the run: ``rank`` of ``world_size``, ``local_rank`` on its host.

    Example::

        >>> info = DistInfo(rank=1, world_size=4, local_rank=1)
        >>> info.is_main, info.active, DistInfo().is_main, DistInfo().active
        (False, True, True, False)
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes logs, checkpoints and reports."""
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world_size > 1


def current() -> DistInfo:
    """This process's place in the initialised process group (a world of one if there is none).

    Example (no process group)::

        >>> current()
        DistInfo(rank=0, world_size=1, local_rank=0)
    """
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    return DistInfo()


_groups_joined = 0  # process groups init_from_env began in this process (a start-up stop's word is per group)
_starts = [0]  # runs init_from_env started in this process, in one group or several (a refusal's word is per run)
_alone = [False]  # this rank ends alone (end_alone): the group's collectives are not waited in any more
def init_from_env(device_name: str) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes; pick this rank's device and the backend."""
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise InputError("device: cuda was asked for but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    _starts[0] += 1  # (every rank starts the same runs in the same order: the same count)
    if not dist.is_initialized():
        global _groups_joined
        _groups_joined += 1
        _alone[0] = False
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return current(), device


def wrap(model: nn.Module, strategy: str, device: torch.device, *, find_unused_parameters: bool = False) -> nn.Module:
    """``ddp`` -> DistributedDataParallel; ``fsdp2`` -> ``fully_shard`` on each unit of the model
    (:func:`fsdp_units`: each child block, each item of a ModuleList/ModuleDict child), then the root.

    A unit that shares a parameter with another unit or with the root's own (tied weights, such as
    an output head tied to the embedding) is not sharded on its own: its parameters go to the
    root's group. Whatever ``fully_shard`` still refuses (a 0-dim parameter, a root that is itself
    a container) is an :class:`InputError`, the same line on every rank. ``find_unused_parameters``:
    DDP's, for a model with trainable parameters its forward does not use (each step then walks
    the autograd graph to find them: DDP's cost, paid only then)."""
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       find_unused_parameters=find_unused_parameters)
    try:  # torch >= 2.6
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4/2.5 keep FSDP2 here only (review 54e: fsdp2 failed there with a traceback)
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]

    # every rank starts from rank 0's weights and buffers, as DDP's wrap makes them (a factory that
    # seeds its init by rank, or reads per-node weights, trained a model stitched from the ranks' shards)
    broadcast_from_rank_0([*model.parameters(), *model.buffers()])
    try:
        for unit in fsdp_units(model):
            fully_shard(unit)
        fully_shard(model)
    except (ValueError, RuntimeError, TypeError, AssertionError, NotImplementedError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise InputError(f"distributed.strategy=fsdp2: fully_shard cannot shard this model: {reason}") from None
    return model


BROADCAST_BUCKET_BYTES = 64 * 2**20
"""The most :func:`broadcast_from_rank_0` flattens into one broadcast (a whole model flattened at
once doubled the wrap's peak memory; DDP's own start-up broadcast goes in buckets too)."""


def broadcast_from_rank_0(tensors: Sequence[torch.Tensor]) -> None:
    """``tensors`` (unsharded: a model's before ``fully_shard``, its buffers) set to rank 0's values
    on every rank, in place: the tensors of one dtype flattened together into broadcasts of at
    most :data:`BROADCAST_BUCKET_BYTES` (a larger tensor alone, as it is). A tensor shared twice
    (a tied weight) is sent once. Nothing without a process group of more than one."""
    if not current().active:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in dict.fromkeys(tensors):  # (in order, each once)
        by_dtype.setdefault(t.dtype, []).append(t)
    buckets: list[list[torch.Tensor]] = []
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            if bucket and size + t.nbytes > BROADCAST_BUCKET_BYTES:
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(t)
            size += t.nbytes
        buckets.append(bucket)
    with torch.no_grad():
        for bucket in buckets:
            if len(bucket) == 1 and bucket[0].is_contiguous():  # (no copy of a large tensor)
                dist.broadcast(bucket[0].detach(), src=0)
                continue
            flat = torch.cat([b.detach().reshape(-1) for b in bucket])
            dist.broadcast(flat, src=0)
            for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                b.copy_(part.view_as(b))


def buffer_sharing(model: nn.Module) -> Callable[[], None] | None:
    """What sets every rank's buffers (BatchNorm's running statistics) to rank 0's, called on every
    rank: under FSDP2 before each step and each evaluation, under DDP before each evaluation
    (DDP broadcasts them before each training forward itself, and an evaluation calls the
    model it wraps); ``None`` without a group or for a model with no buffers. FSDP2 shards
    parameters, not buffers: each rank's drifted apart with its own batches, only rank 0's
    reached a checkpoint (a resume was not the run it resumed); under both, each rank evaluated
    its own statistics, the metric a mean over models the checkpoint does not hold."""
    buffers = list(model.buffers())
    if not buffers or not current().active:
        return None
    return functools.partial(broadcast_from_rank_0, buffers)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`wrap` gives their own FSDP2 group, before the root's.

    Each child of ``model`` with a trainable parameter, where a ModuleList or ModuleDict child
    (which has no ``forward`` for ``fully_shard`` to hook) stands for its items, recursively. A
    unit that shares a parameter with another unit, or with a module outside every unit (the
    root's own parameters included), is left out: its parameters belong to the root's group.

    Example::

        >>> class Tied(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.tok = nn.Embedding(8, 4)
        ...         self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.ModuleDict({"a": nn.Linear(4, 4)})])
        ...         self.norm = nn.LayerNorm(4).requires_grad_(False)
        ...         self.head = nn.Linear(4, 8, bias=False)
        ...         self.head.weight = self.tok.weight
        >>> model = Tied()
        >>> [name for name, m in model.named_modules() if any(m is u for u in fsdp_units(model))]
        ['blocks.0', 'blocks.1.a']
    """
    candidates: list[nn.Module] = []

    def expand(module: nn.Module) -> None:
        if isinstance(module, _CONTAINERS):
            for item in module.children():
                expand(item)
        elif any(p.requires_grad for p in module.parameters()) and all(module is not c for c in candidates):
            candidates.append(module)

    for child in model.children():
        expand(child)
    owners: dict[int, int] = {}  # parameter id -> how many groups would hold it
    for unit in candidates:
        for p in unit.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    unit_ids = {id(u) for u in candidates}
    seen: set[int] = set()

    def root_params(module: nn.Module) -> None:  # what the root's group gets, as fully_shard walks it
        if id(module) in unit_ids or id(module) in seen:
            return
        seen.add(id(module))
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
        for child in module.children():
            root_params(child)

    root_params(model)
    return [u for u in candidates if all(owners[id(p)] == 1 for p in u.parameters())]


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place, nothing to unwrap).

    Example::

        >>> model = nn.Linear(2, 1)
        >>> unwrap(model) is model
        True
        >>> class DistributedDataParallel(nn.Module):  # a stand-in: the real one needs a process group
        ...     def __init__(self, module):
        ...         super().__init__()
        ...         self.module = module
        >>> unwrap(DistributedDataParallel(model)) is model
        True
    """
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model


def agree(loss: torch.Tensor, norms: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One all-reduce: ``[loss, *norms]`` with the loss the global mean and a norm that is
    non-finite on any rank non-finite on every rank (NaN where the rank's own was finite), so
    every rank reads the same skip decision off them. A norm finite everywhere is unchanged.

    And ``origin``, ``[ranks, rank code]`` (float32): how many ranks found the first of ``norms``
    (the step's loss mark) non-finite on their own, and which (:func:`rank_code` summed: in a
    world of up to ``NAMED_RANKS`` each of them, beyond it the one when one rank's was;
    :func:`~ampguard.records.loss_origin` reads it). Two elements more in the same all-reduce;
    the gradients' norms cannot tell (DDP reduced them in the backward).

    No host sync. Without a process group (a world of one) the values come back as they are,
    and ``origin`` is None.

    Example (no process group)::

        >>> (loss, pre), origin = agree(torch.tensor(0.5), [torch.tensor(float("inf"))])
        >>> loss.item(), pre.item(), origin
        (0.5, inf, None)
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [loss, *norms], None
    # x - x is 0 for a finite x, NaN otherwise (in x's own dtype, then as float32): summed over
    # ranks, NaN if any rank's was not finite
    marks = torch.stack([(n.detach() - n.detach()).reshape(()).to(torch.float32) for n in norms])
    mine = torch.where(marks[0] == 0, 0.0, _this_rank(marks.device, dist.get_rank(), dist.get_world_size()))
    packed = torch.cat([loss.detach().reshape(1).to(torch.float32), marks, mine])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    keep = (packed[1:-2] == 0) | (marks != 0)  # finite everywhere, or not finite here already
    agreed = [packed[0] / dist.get_world_size(), *(torch.where(k, n, torch.nan) for k, n in zip(keep.unbind(), norms))]
    return agreed, packed[-2:]


REPLICA_SPREAD = 1e-3
"""How far apart (relative to the larger) the ranks' gradient norms may read before the guard
calls them different (:func:`norm_range`): DDP's all-reduced gradients, FSDP2's full norm and a
loop's own all-reduce give every rank the same norm (bit for bit on one kind of device)."""


def norm_range(norms: Sequence[torch.Tensor]) -> list[tuple[float, float]] | None:
    """The lowest and the highest of the ranks' gradient norm, for each of ``norms`` (one
    all-reduce, one host read), None in a world of one. Ranks that apply their gradients each as
    its own (a model not wrapped in DDP or FSDP2, or the one from before ``accelerator.prepare``)
    read apart (:data:`REPLICA_SPREAD`): the guard asks at each optimizer's first step whose
    norm is finite and not 0.

    Example (no process group)::

        >>> norm_range([torch.tensor(3.0)]) is None
        True
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    values = torch.stack([n.detach().reshape(()).to(torch.float32) for n in norms])
    packed = torch.cat([values, -values])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    seen = packed.tolist()
    return [(-seen[len(norms) + i], seen[i]) for i in range(len(norms))]


NAMED_RANKS = 24
"""The largest world whose ranks :func:`agree`'s origin names each: a bit a rank, summed in
float32 (24 bits of mantissa: every sum exact)."""


def rank_code(rank: int, world: int) -> float:
    """One rank's share of the origin's code: its bit ``2 ** rank`` in a world of up to
    :data:`NAMED_RANKS` (the sum over ranks names each), else its number (the sum names the rank
    when only one's loss was not finite).

    Example::

        >>> rank_code(3, 8), rank_code(3, 64)
        (8.0, 3.0)
    """
    return float(2 ** rank if world <= NAMED_RANKS else rank)


@functools.cache
def _this_rank(device: torch.device, rank: int, world: int) -> torch.Tensor:
    """``[1, rank_code]`` (float32) on ``device``: one rank's share of :func:`agree`'s origin."""
    return torch.tensor([1.0, rank_code(rank, world)], device=device)


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """An FSDP2 gradient norm is a DTensor: reduce it over the shards (a collective, no host sync).

    Any other tensor is already the full norm and comes back as it is.

    Example::

        >>> norm = torch.tensor(5.0)
        >>> full_norm(norm) is norm
        True
    """
    if type(norm) is torch.Tensor:  # (the usual case, without a failed attribute lookup every step)
        return norm
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is one FSDP2 shards (``fully_shard`` makes its class an
    ``FSDPModule``; read by name, so that torch.distributed.fsdp is not imported for it).

    Example (a model of one's own with a method of that name is not one)::

        >>> class Own(nn.Linear):
        ...     def set_requires_gradient_sync(self, sync):
        ...         pass
        >>> is_sharded(nn.Linear(2, 1)), is_sharded(Own(2, 1))
        (False, False)
    """
    return any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__)


def defers_sync(model: nn.Module) -> bool:
    """Whether ``model`` all-reduces its gradients only when told to (DDP, FSDP2): what
    :func:`accumulation_context` switches off mid-group.

    Example::

        >>> defers_sync(nn.Linear(2, 1))
        False
    """
    return hasattr(model, "no_sync") or is_sharded(model)


def accumulation_context(model: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """No gradient all-reduce on a micro-batch that does not close its group.

    DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``, or nothing for a plain
    module or the group's last micro-batch.

    Example::

        >>> with accumulation_context(nn.Linear(2, 1), last=False) as ctx:  # a plain module
        ...     print(ctx)
        None
        >>> class Wrapped(nn.Linear):  # a stand-in for DDP
        ...     def no_sync(self):
        ...         return contextlib.nullcontext("no_sync")
        >>> with accumulation_context(Wrapped(2, 1), last=False) as ctx:
        ...     print(ctx)
        no_sync
        >>> with accumulation_context(Wrapped(2, 1), last=True) as ctx:
        ...     print(ctx)
        None
    """
    if last:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if is_sharded(model):  # FSDP2
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: Any) -> Any:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def rank_slice(value: Any, info: DistInfo) -> Any:
    """This rank's share of a global batch (dimension 0 split into ``world_size`` equal parts).

    Tensors are sliced; lists, tuples and dicts are sliced item by item; a 0-dim tensor (a
    scalar, such as a temperature) and anything that is not a tensor are kept whole.

    Example::

        >>> batch = {"x": torch.arange(8).reshape(4, 2), "ids": [torch.arange(4)], "name": "b"}
        >>> part = rank_slice(batch, DistInfo(rank=1, world_size=2))
        >>> part["x"].tolist(), part["ids"][0].tolist(), part["name"]
        ([[4, 5], [6, 7]], [2, 3], 'b')
        >>> rank_slice({"x": torch.zeros(4, 2), "temp": torch.tensor(0.5)}, DistInfo(rank=1, world_size=2))["temp"]
        tensor(0.5000)
        >>> rank_slice(torch.arange(3), DistInfo(rank=0, world_size=2))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: a batch of 3 examples does not split evenly over 2 ranks
    """
    def part(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:  # no batch dimension to split
            return tensor
        n = tensor.shape[0]
        if n % info.world_size:
            raise InputError(f"a batch of {n} examples does not split evenly over {info.world_size} ranks")
        size = n // info.world_size
        return tensor[info.rank * size : (info.rank + 1) * size]

    return tree_map_only(torch.Tensor, part, value)


def join_slices(parts: Sequence[Any]) -> Any:
    """The global batch back from every rank's :func:`rank_slice`, in rank order: tensors joined
    along dimension 0; a 0-dim tensor and anything that is not a tensor taken from rank 0.

    Example::

        >>> batch = {"x": torch.arange(8).reshape(4, 2), "temp": torch.tensor(0.5), "name": "b"}
        >>> parts = [rank_slice(batch, DistInfo(rank=r, world_size=2)) for r in (0, 1)]
        >>> joined = join_slices(parts)
        >>> torch.equal(joined["x"], batch["x"]), joined["temp"].item(), joined["name"]
        (True, 0.5, 'b')
    """
    def join(*values: Any) -> Any:
        first = values[0]
        return torch.cat(values) if isinstance(first, torch.Tensor) and first.dim() else first

    return tree_map(join, parts[0], *parts[1:])


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (None elsewhere); ``[obj]`` without a process group.

    Example (no process group)::

        >>> gather_to_main({"skips": 2})
        [{'skips': 2}]
    """
    info = current()
    if not info.active:
        return [obj]
    out: list[Any] | None = [None] * info.world_size if info.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (a collective);
    ``[obj]`` without a process group.

    Example (no process group)::

        >>> all_gather("finding")
        ['finding']
    """
    info = current()
    if not info.active:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object",
               "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv",
               "isend", "irecv", "batch_isend_irecv")
"""The ``torch.distributed`` calls :func:`no_collectives` refuses."""


class CollectiveInReplay(RuntimeError):
    """A collective the user's code issued inside :func:`no_collectives`."""


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Under a process group of several, a ``torch.distributed`` collective (:data:`COLLECTIVES`,
    called as ``dist.all_reduce``, as a loss that all-reduces its sample count or SyncBatchNorm
    does) raises :class:`CollectiveInReplay` before it is issued, for the ``with`` block: the
    first-skip diagnosis replays the step a different number of times on each rank (the rank that
    found a value three passes or more, a clean one one), and a collective there waited in a rank
    the others never joined: the job hung at its first skip (review 49j). Every rank's replay then
    fails at its first such call and says so alike. Nothing without a process group.

    Example (no process group: nothing refused)::

        >>> with no_collectives():
        ...     dist.is_available()
        True
    """
    if not current().active:
        yield
        return

    def refused(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise CollectiveInReplay(f"the model or the loss calls torch.distributed.{name}, a collective, which a "
                                     "replay on each rank alone cannot pair up")
        return call

    modules = (dist, dist.distributed_c10d)  # (called as dist.all_reduce, or through the module that defines it)
    saved = [(module, name, getattr(module, name)) for module in modules for name in COLLECTIVES if hasattr(module, name)]
    try:
        for module, name, _ in saved:
            setattr(module, name, refused(name))
        yield
    finally:
        for module, name, function in saved:
            setattr(module, name, function)


def first_error(message: str | None) -> str | None:
    """The lowest rank's ``message`` that is not None, on every rank (a collective): ranks that
    met a problem on their own share (their slice of a batch, a file they read) refuse or stop
    together instead of one leaving the others waiting in a collective.

    A rank that has a ``message`` returns it when the collective itself fails (a peer that
    crashed or never came: gloo's "Connection closed by peer", a timeout): its refusal is the
    line its user must read, where the transport's traceback was all it showed.

    Example (no process group)::

        >>> first_error(None), first_error("bad batch")
        (None, 'bad batch')
    """
    try:
        gathered = all_gather(message)
    except Exception:
        if message is None:
            raise
        return message
    return next((m for m in gathered if m is not None), None)


@contextlib.contextmanager
def refused_on_every_rank() -> Iterator[None]:
    """Around what one rank alone does (rank 0's files): an error it raises is raised on every
    rank alike (one all-gather of its first line at the block's end), so no rank goes on into a
    collective the failed one never joins (a refusal on rank 0 alone left rank 1 in the
    framework's first collective: "Connection closed by peer", under NCCL a wait). The rank that
    failed raises its own error; the others an :class:`InputError` with its words when it was
    bad input, else a ``RuntimeError`` naming the rank (a full disk, a bug). Every rank must
    enter it, whatever it does inside (a collective at its end). The rank that failed raises its
    own error even when that collective fails (a peer that crashed or never came: gloo's
    "Connection closed by peer", a timeout), the transport's words a note on it: its one line,
    exit 2, was lost to a gloo traceback.

    Example (no process group)::

        >>> try:
        ...     with refused_on_every_rank():
        ...         raise InputError("steps.csv already exists")
        ... except InputError as err:
        ...     print(err)
        steps.csv already exists
    """
    failed: Exception | None = None
    try:
        yield
    except Exception as err:  # (held until every rank has it: below)
        failed = err
    said = None if failed is None else (isinstance(failed, InputError), first_line(str(failed)) or repr(failed))
    try:
        gathered = all_gather(said)
    except Exception as err:
        if failed is None:
            raise
        failed.add_note(f"ampguard: the other ranks could not be told of it: {first_line(err, with_type=True)}")
        gathered = []  # (raised just below, as it was met: its own cause and context kept)
    if failed is not None:
        raise failed
    seen = next(((rank, s) for rank, s in enumerate(gathered) if s is not None), None)
    if seen is not None:
        rank, (bad_input, message) = seen
        raise InputError(message) if bad_input else RuntimeError(f"rank {rank} failed: {message}")


def every_rank_raised(tag: str, message: str, timeout_s: float) -> str | None:
    """This rank's data raised ``message`` mid-run: whether every rank's did, waited for through
    the process group's key-value store (torchrun's rendezvous store), not a collective, which a
    rank whose data did not raise, waiting in the step's own collectives, would never join.
    Every rank reads the same global stream, so the same bad record raises on each, at the same
    step: then rank 0's message on every rank, which stop together. None when some rank's did not
    (this rank's own failure: a file only its node reads): the caller raises.

    Rank 0 decides for all (every rank's key within ``timeout_s``, or not) and says so in a key
    of its own, which the others wait for (twice as long: rank 0 may come later and wait its
    own), so that no rank stops cleanly while another crashes. ``tag`` names this run and this
    micro-batch (the same on every rank): a key left by an earlier run is never read.
    """
    key = f"ampguard/data-raised/{tag}/"
    store = dist.distributed_c10d._get_default_store()
    store.set(key + str(dist.get_rank()), message)
    if dist.get_rank() == 0:
        try:
            store.wait([key + str(r) for r in range(dist.get_world_size())], datetime.timedelta(seconds=timeout_s))
            verdict = "every rank"
        except RuntimeError:  # (DistStoreError: its timeout)
            verdict = "not every rank"
        store.set(key + "verdict", verdict)
    else:
        try:
            store.wait([key + "verdict"], datetime.timedelta(seconds=2 * timeout_s))
        except RuntimeError:  # (rank 0's data did not raise: it waits in the step's collectives)
            return None
        verdict = store.get(key + "verdict").decode()
    return store.get(key + "0").decode("utf-8", errors="replace") if verdict == "every rank" else None


def barrier() -> None:
    """Wait for every rank (nothing to wait for without a process group, nor once this rank ends
    alone: :func:`end_alone`)."""
    if current().active and not _alone[0]:
        dist.barrier()


def broadcast_from_main(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a collective); ``value`` itself without a process group."""
    if not current().active:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def highest(values: list[int], device: torch.device) -> list[int]:
    """Each value the highest any rank holds (small non-negative integers: flags, signal
    numbers): one all-reduce for all of them and one host read (nothing without a process group).

    Example (no process group)::

        >>> highest([0, 15], torch.device("cpu"))
        [0, 15]
    """
    if not current().active:
        return list(values)
    t = torch.tensor([float(v) for v in values], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def any_ranks(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag true on every rank when it is true on any (:func:`highest` of 0s and 1s).

    Example (no process group)::

        >>> any_ranks([False, True], torch.device("cpu"))
        [False, True]
    """
    return [v > 0 for v in highest([int(f) for f in flags], device)]


_PEER_ENDED = ("closed by peer", "reset by peer", "Broken pipe")  # (gloo's transport/tcp/pair.cc)


def peer_gone(err: BaseException) -> bool:
    """Whether ``err`` is a collective failing because another process of the group ended: a
    ``torch.distributed`` error (NCCL's, the store's), or gloo's ``RuntimeError`` for a socket
    the peer closed: "Connection closed by peer" (a read), "reset by peer" or "Broken pipe" (a
    write, as gloo's pair reports ``ECONNRESET`` and ``EPIPE``); never in a group of one
    (:func:`~ampguard.signals.opening` then waits for the launcher's stop signal).

    Example (no process group)::

        >>> peer_gone(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:2178"))
        False
    """
    if not current().active:
        return False
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and any(words in str(err) for words in _PEER_ENDED)


def _stop_key() -> str:
    """The store key of a stop's word: this attempt's (torchrun keeps its rendezvous store across
    ``--max-restarts`` attempts: an earlier attempt's word read a later attempt's crash as its
    stop, review 49h), and this process's group (a process that joins more than one)."""
    attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"ampguard/start-up-stopped/{'/'.join(attempt)}/{_groups_joined}"


def tell_stopped(code: int) -> None:
    """This rank's start-up (or a run's step, cut short by a second signal: :func:`end_alone`) ends
    for a stop signal with exit ``code`` (130, 143): word of it in the
    process group's key-value store (torchrun's rendezvous store), before this process leaves the
    group, for a peer whose collective then fails (:func:`peer_stopped`). Nothing without a
    process group of several; a store that cannot be reached is let be (the peer then waits for
    the launcher's signal, as before).

    Example (no process group)::

        >>> tell_stopped(143), peer_stopped()
        (None, None)
    """
    if current().active:
        with contextlib.suppress(Exception):
            dist.distributed_c10d._get_default_store().set(_stop_key(), str(int(code)))


def peer_stopped() -> int | None:
    """The exit code a peer's stop (its start-up's, or a step a second signal cut short) left word
    of (:func:`tell_stopped`), read without
    waiting; None when none did (it was killed, it crashed) or without a process group."""
    if not current().active:
        return None
    try:
        store, key = dist.distributed_c10d._get_default_store(), _stop_key()
        if not store.check([key]):
            return None
        code = int(store.get(key).decode())
    except Exception:  # (the store went with the launcher: no word to be had)
        return None
    return code if code in (int(ExitCode.INTERRUPTED), int(ExitCode.TERMINATED)) else None


def _line_key(kind: str) -> str:
    """The store key of a line a rank leaves for its peers (``kind``: ``refused``, ``crashed``):
    this run's (a process that runs several in one group, a test's batch or a sweep, read an
    earlier run's refusal as its own)."""
    return f"{_stop_key()}/{kind}/{_starts[0]}"


def _leave_line(kind: str, line: str) -> None:
    """This rank's ``line`` in the store under ``kind``, the first rank's kept (``compare_set``
    writes only where none is). Not a collective; nothing without a process group of several."""
    if current().active:
        with contextlib.suppress(Exception):  # (the store went with the launcher: no word to leave)
            dist.distributed_c10d._get_default_store().compare_set(_line_key(kind), "", line)


def _line_left(kind: str) -> str | None:
    """The line a peer left under ``kind`` (:func:`_leave_line`), read without waiting; None when
    none did, or without a process group."""
    if not current().active:
        return None
    try:
        store, key = dist.distributed_c10d._get_default_store(), _line_key(kind)
        return store.get(key).decode("utf-8", errors="replace") if store.check([key]) else None
    except Exception:  # (the store went with the launcher)
        return None


def tell_refused(line: str) -> None:
    """This rank's start-up is refused (a bad input of its own: its node's file missing for the
    factory, a checkpoint it reads otherwise): its line in the store, the first rank's kept, for
    a peer whose collective (or a barrier in its own factory) then fails (:func:`peer_refused`).
    Not a collective: a peer may wait in one of its own (review 51k: a wrapper that gathered the
    refusals hung a job whose factory's rank 0 failed while rank 1 waited at its barrier).
    Nothing without a process group of several.

    Example (no process group)::

        >>> tell_refused("task.factory f.py:build raised FileNotFoundError"), peer_refused()
        (None, None)
    """
    _leave_line("refused", line)


def peer_refused() -> str | None:
    """The line a peer's refused start-up left (:func:`tell_refused`), read without waiting; None
    when none did, or without a process group."""
    return _line_left("refused")


def tell_crashed(line: str) -> None:
    """This rank's run crashed mid-run (the task's model raised, a bug): its line ("rank 1 raised
    ValueError: ..."), the first rank's kept, in the store, for rank 0, whose collective then
    fails with the transport's words alone ("Connection closed by peer"), and whose run card was
    all the run folder said of it (review 53e: the real error was in rank 1's stderr only, in
    another node's log). Written before this rank leaves the group (its sockets close only as
    the process ends): a peer whose collective failed for it finds it at once
    (:func:`peer_crashed`). Not a collective; nothing without a process group of several.

    Example (no process group)::

        >>> tell_crashed("rank 1 raised ValueError: exploded"), peer_crashed()
        (None, None)
    """
    _leave_line("crashed", line)


def peer_crashed() -> str | None:
    """The line a peer's crash left (:func:`tell_crashed`), read without waiting: the peer wrote it
    before its process ended, which is what failed this rank's collective, so it is there by now
    if it ever will be (a peer killed, or out of memory in the kernel's hands, leaves none, and
    waiting for it would only delay the card). None then, or without a process group."""
    return _line_left("crashed")


class _Peers:
    """The other ranks as a run's start-up hears of them (:class:`~ampguard.signals.Peers`)."""

    gone, stopped, tell = staticmethod(peer_gone), staticmethod(peer_stopped), staticmethod(tell_stopped)
    refuse, refused = staticmethod(tell_refused), staticmethod(peer_refused)


PEERS = _Peers()
"""What :func:`~ampguard.signals.opening` is given under torchrun: :func:`peer_gone`,
:func:`peer_stopped`, :func:`tell_stopped`, :func:`tell_refused`, :func:`peer_refused`."""


def ending() -> None:
    """This rank's run is ending, its exit code decided: under torchrun (its agent's
    ``TORCHELASTIC_RUN_ID``, ``WORLD_SIZE`` > 1) or in a process group a SIGTERM is ignored from
    here. torchrun sends one to every rank still running as soon as one rank exits with a non-zero code (a guard's stop, exit 3; a start-up stopped by a signal, 143),
    and this rank's own code (the same stop) must stand rather than become -15, nor may the
    signal cut short what the ending takes back. One process is left as it is.

    Example (one process: nothing changes)::

        >>> import signal
        >>> before = signal.getsignal(signal.SIGTERM)
        >>> ending()
        >>> signal.getsignal(signal.SIGTERM) is before
        True
    """
    import signal

    try:  # (torchrun's agent names its run: a WORLD_SIZE alone, a test's, is not torchrun's)
        launched = "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
    except ValueError:  # (refused at the start in one line; nothing to settle here)
        launched = False
    if launched or (dist.is_available() and dist.is_initialized()):
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # pragma: no cover - not the main thread: signals are not ours to set
            pass


def end_alone(code: int) -> None:
    """This rank's run ends alone, with exit ``code`` (130, 143): a second stop signal cut a step
    short, on this rank or (its word read: :func:`peer_stopped`) a peer's, while the others may
    wait in a collective it never joins (the step's all-reduce, the boundary's agreement). Closing
    with a collective, or waiting in the leaving :func:`barrier`, hung the job until gloo's 30
    minutes (review 49c H1). So its code is decided (:func:`ending`), word of it is left in the
    store (:func:`tell_stopped`: a peer whose collective then fails ends with the same code, not
    as a crash), and :func:`barrier` waits no more. Nothing without a process group.

    Example (no process group)::

        >>> end_alone(130), _alone[0]
        (None, False)
    """
    if not current().active:
        return
    ending()
    tell_stopped(code)
    _alone[0] = True


def shutdown() -> None:
    """Leave the process group, if this process joined one, after freeing what still uses it.
    From here the process only exits: :func:`ending` first."""
    ending()
    if dist.is_available() and dist.is_initialized():
        import gc

        # a DDP model still held in a reference cycle (the finished run's trainer) is freed now,
        # with its process group: freed in the interpreter's teardown instead, its reducer
        # aborted the process ("terminate called without an active exception", exit -6)
        gc.collect()
        dist.destroy_process_group()
