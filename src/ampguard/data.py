"""The run's stream of micro-batches: from a position, this rank's slice, faults applied, on the device.

The position (micro-batches taken so far) is the data's whole state: a checkpoint saves it, a
resume or a rollback seeks to it, and a task's ``batches()`` gives the same sequence on every
call, so the stream after a seek is the stream the uninterrupted run saw. A seek costs nothing
for the built-in tasks (batch ``i`` is drawn from its index: ``Task.batches_from``); a
factory's stream is read from its start up to the position.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterator
from typing import Any, overload

import torch
from torch.utils._pytree import tree_leaves

from . import distributed
from .build import to_device
from .errors import InputError, counted
from .faults import FaultInjector
from .tasks import Batch, Task
from .tasks.base import NO_EXAMPLES, generators_kept, holds_no_examples


class DataStream:
    """Micro-batches of ``task`` for this rank, from :attr:`position` on.

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> task = build_task(validate({"task": {"name": "linear"}}))
        >>> data = DataStream(task, FaultInjector([]), torch.device("cpu"))
        >>> _ = data.next(first_step=1); _ = data.next(first_step=1)
        >>> data.state_dict()
        2
    """

    def __init__(self, task: Task, injector: FaultInjector, device: torch.device,
                 dist: distributed.DistInfo | None = None) -> None:
        self.task = task
        self.injector = injector
        self.device = device
        self.dist = dist or distributed.DistInfo()
        self.position = 0
        """Micro-batches taken from the task's stream so far (global batches under torchrun)."""
        self._iter: Iterator[Batch] | None = None

    def seek(self, position: int) -> None:
        """Continue from ``position`` (a resume or a rollback); the next batch is re-read. Nothing
        is read here: the next :meth:`next` opens the task's stream at ``position``
        (:meth:`Task.stream <ampguard.tasks.Task.stream>`)."""
        self.position = position
        self._iter = None

    @overload
    def peek(self) -> Batch: ...

    @overload
    def peek(self, count: int) -> Iterator[Batch]: ...

    def peek(self, count: int | None = None) -> Batch | Iterator[Batch]:
        """The batch :meth:`next` would give next, without its faults and without moving: this
        rank's slice, on the device. Reads the task's stream afresh (``StopIteration`` when the
        stream is empty; whatever a broken stream raises). With ``count``, an iterator of the next
        ``count`` batches instead (fewer where the stream ends), from one fresh read, each put on
        the device as it is read: the start-up's check puts the first
        :data:`~ampguard.tasks.base.FIRST_BATCHES` through the model (``build.check_forward``).

        Example::

            >>> from ampguard.config import validate
            >>> from ampguard.tasks import build_task
            >>> data = DataStream(build_task(validate({"task": {"name": "linear"}})), FaultInjector([]), torch.device("cpu"))
            >>> x, _ = data.peek()
            >>> data.position, torch.equal(x, data.next(first_step=1)[0])
            (0, True)
            >>> [len(x) for x, _ in data.peek(4)] == [len(x)] * 4, data.position
            (True, 1)
        """
        if count is not None:
            return ((to_device(x, self.device), to_device(y, self.device))
                    for x, y in itertools.islice(self._source(), count))
        inputs, targets = next(self._source())
        return to_device(inputs, self.device), to_device(targets, self.device)

    def digest(self) -> str:
        """A hash of the next *global* batch (before this rank's slice): under torchrun every
        rank must read the same stream, and each takes its slice of it (:func:`check_same_data`).

        Example::

            >>> from ampguard.config import validate
            >>> from ampguard.tasks import build_task
            >>> data = DataStream(build_task(validate({"task": {"name": "linear"}})), FaultInjector([]), torch.device("cpu"))
            >>> data.digest() == data.digest(), len(data.digest())
            (True, 64)
        """
        return _hashed(self._peek_global())

    def fingerprint(self) -> str | None:
        """:meth:`digest` for a checkpoint to keep (``data_next``), where it says the batch alone:
        None for a stream that seeks by reading (no ``batches_from``: a look at the next batch would
        read the whole stream to it) or that a read beside the run's would move
        (:attr:`Task.side_reads <ampguard.tasks.Task.side_reads>`), for a batch with a leaf whose
        text may hold more than its value (an object's ``repr``, its address: review 52j, the same
        data's resume was refused) and for a stream that ends or fails there (the batch after a
        run's last, which the run never reads: review 52j, a ``batches_from`` of exactly the run's
        batches crashed the final save).

        Example::

            >>> from ampguard.config import validate
            >>> from ampguard.tasks import build_task
            >>> data = DataStream(build_task(validate({"task": {"name": "linear"}})), FaultInjector([]), torch.device("cpu"))
            >>> data.fingerprint() == data.digest()
            True
        """
        if self.task.batches_from is None or not self.task.side_reads:
            return None
        try:
            batch = self._peek_global()
        except Exception:  # noqa: BLE001 - the user's stream, past what the run reads: no fingerprint
            return None
        if not all(isinstance(leaf, (torch.Tensor, *PLAIN_LEAVES)) for leaf in tree_leaves(batch)):
            return None
        return _hashed(batch)

    def _peek_global(self) -> Batch:
        """The next global batch read afresh, the run's draws (the global RNGs, the data's own
        generators) left where they were."""
        from .untouched import rng_kept

        # a factory's stream may draw (a shuffle): the run's draws stay where they were, the global RNGs'
        # and the data's own generators' (its batches_from may read the loader the run reads)
        with generators_kept(self.task.generators), rng_kept():
            return next(iter(self.task.stream(self.position)))

    def next(self, first_step: int) -> Batch:
        """The next micro-batch. ``first_step`` is the step the stream's next batch belongs to when
        the stream is (re)opened, so that step-targeted faults hit the right batches."""
        if self._iter is None:
            self._iter = self._open(first_step)
        try:
            return next(self._iter)
        except StopIteration:  # (a bare StopIteration mid-run: a Task's batches() that ends)
            self._iter = None
            raise ValueError(f"the data ended after {counted(self.position, 'micro-batch', 'micro-batches')}: a "
                             "Task's batches() must be endless (tasks.cycle(lambda: data) repeats a finite one)") from None

    def _source(self) -> Iterator[Batch]:
        source: Any = self._stream()
        if self.dist.active:  # this rank's slice of each global batch; faults then apply per rank
            source = ((distributed.rank_slice(x, self.dist), distributed.rank_slice(y, self.dist)) for x, y in source)
        return source

    def _stream(self) -> Iterator[Batch]:
        """The task's stream from :attr:`position`. One read from its start (a factory without
        ``batches_from``) reads the batches before the position with the RNGs kept: a resume or a
        rollback has put back the RNG state of the run at that position, and data that draws from
        the global RNG (a random augmentation in a generator function) drew again for the
        batches it drops, so the run went on from other draws than the uninterrupted one's.

        Example (each batch drawn from the global RNG; a checkpoint at position 2 saved its state)::

            >>> from ampguard.tasks import Task, cycle
            >>> def noisy():
            ...     for _ in range(3):
            ...         yield torch.rand(1), torch.zeros(1)
            >>> task = Task("toy", torch.nn.Linear(1, 1), torch.nn.functional.mse_loss, batches=lambda: cycle(noisy))
            >>> _ = torch.manual_seed(0); run = iter(task.batches()); _ = next(run), next(run)
            >>> saved = torch.get_rng_state(); third = next(run)[0]
            >>> torch.set_rng_state(saved)  # a resume from that checkpoint
            >>> data = DataStream(task, FaultInjector([]), torch.device("cpu")); data.seek(2)
            >>> torch.equal(next(data._stream())[0], third)
            True
        """
        if not self.position or self.task.batches_from is not None:
            return self.task.stream(self.position)
        from .untouched import rng_kept

        stream = iter(self.task.batches())
        with rng_kept():
            for _ in range(self.position):
                next(stream)
        return stream

    def _open(self, first_step: int) -> Iterator[Batch]:
        # (review 54o: no fault configured, the batches are not passed through the injector's generator)
        source = self.injector.wrap_data(self._source(), first_step=first_step) if self.injector.faults else self._source()
        for inputs, targets in source:
            if holds_no_examples(inputs):  # (review 52h: mid-run, a skip as a non-finite loss that counted toward
                # the skip-rate guards, read as an overflow; refused at start-up among the first batches)
                raise InputError(f"the data's micro-batch {self.position} (counted from 0) {NO_EXAMPLES}")
            self.position += 1
            yield to_device(inputs, self.device), to_device(targets, self.device)

    def release(self) -> None:
        """The stream read no more (the run's loop is over): its reader closed, so the iterators it
        holds (a ``DataLoader``'s, whose worker processes it ends) go now, not at a garbage
        collection, where ending them waited 5 s a worker (its queues' feeder threads were
        finalised first, so no worker heard it should stop); then the task's own ``release``
        (a factory's persistent workers). The next :meth:`next` opens the stream again.

        Example::

            >>> from ampguard.config import validate
            >>> from ampguard.tasks import build_task
            >>> data = DataStream(build_task(validate({"task": {"name": "linear"}})), FaultInjector([]), torch.device("cpu"))
            >>> _ = data.next(first_step=1); data.release(); _ = data.next(first_step=2); data.position
            2
        """
        reader, self._iter = self._iter, None
        if reader is not None:
            reader.close()  # type: ignore[attr-defined]  (a generator: its frame's iterators let go)
        if self.task.release is not None:
            self.task.release()

    def state_dict(self) -> int:
        return self.position

    def load_state_dict(self, position: int) -> None:
        self.seek(int(position))


def _hashed(batch: Batch) -> str:
    """A SHA-256 of a batch: each tensor's dtype, shape and bytes, any other leaf's text as every
    process writes it (:func:`_leaf_text`): ranks compare it (:func:`check_same_data`)."""
    h = hashlib.sha256()
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(_leaf_text(leaf).encode())
    return h.hexdigest()


PLAIN_LEAVES = (str, bytes, int, float, bool, type(None))
"""The leaves, besides tensors, whose ``repr`` is their value alone."""
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""Where a ``repr`` names an object's address (``<Tags object at 0x7f...>``, a function's)."""


def _leaf_text(leaf: Any) -> str:
    """A batch leaf that is no tensor, as text that is the same in every process for the same
    value: its ``repr``, with a set's members sorted (a set of strings iterates in the order of
    the process's hash secret, and a set's order follows its history in any process) and an
    address left out (review 58e: identical batches of fresh ranks read as different data).
    A plain value's text is its ``repr``, as before (the digest a checkpoint keeps).

    Example::

        >>> grown = set(); grown.add(9); grown.add(1)
        >>> repr(grown) == repr({1, 9}), _leaf_text(grown) == _leaf_text({1, 9})
        (False, True)
        >>> _leaf_text(object())
        '<object object>'
    """
    if isinstance(leaf, PLAIN_LEAVES):
        return repr(leaf)
    if isinstance(leaf, (set, frozenset)):
        return f"{type(leaf).__name__}({{{', '.join(sorted(map(_leaf_text, leaf)))}}})"
    if isinstance(leaf, tuple):  # (a set's member: a batch's own tuples are branches, not leaves)
        return f"({''.join(_leaf_text(m) + ', ' for m in leaf)})"
    return _ADDRESS.sub("", repr(leaf))


def check_same_data(data: DataStream, who: str) -> str | None:
    """Under torchrun, the line refusing a run whose ranks read different global batches (a
    factory's ``DistributedSampler``: ampguard would slice each rank's own shard again and train
    on a fraction of it), else None. A collective: every rank calls it.

    Example (no process group)::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> check_same_data(DataStream(build_task(validate({})), FaultInjector([]), torch.device("cpu")), "task charlm")
    """
    if not data.dist.active:
        return None
    digests = distributed.all_gather(data.digest())
    if len(set(digests)) == 1:
        return None
    ranks = [r for r, d in enumerate(digests) if d != digests[0]]
    return (f"{who}: the ranks read different data (the first batch of rank {ranks[0]} differs from rank 0's); "
            "under torchrun every rank reads the same global batches and ampguard gives each rank its slice: "
            "no DistributedSampler, and the same shuffling seed on every rank")
