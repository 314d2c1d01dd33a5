"""The run's stream of micro-batches: from a position, this rank's slice, faults applied, on the device.

The position (micro-batches taken so far) is the data's whole state: a checkpoint saves it, a
resume or a rollback seeks to it, and a task's ``batches()`` gives the same sequence on every
call, so the stream after a seek is the stream the uninterrupted run saw. A seek costs nothing
for the built-in tasks (batch ``i`` is drawn from its index: ``Task.batches_from``); a
factory's stream is read from its start up to the position.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from . import distributed
from .build import to_device
from .faults import FaultInjector
from .tasks import Batch, Task


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

    def peek(self) -> Batch:
        """The batch :meth:`next` would give next, without its faults and without moving: this
        rank's slice, on the device. Reads the task's stream afresh (``StopIteration`` when the
        stream is empty; whatever a broken stream raises).

        Example::

            >>> from ampguard.config import validate
            >>> from ampguard.tasks import build_task
            >>> data = DataStream(build_task(validate({"task": {"name": "linear"}})), FaultInjector([]), torch.device("cpu"))
            >>> x, _ = data.peek()
            >>> data.position, torch.equal(x, data.next(first_step=1)[0])
            (0, True)
        """
        inputs, targets = next(self._source())
        return to_device(inputs, self.device), to_device(targets, self.device)

    def next(self, first_step: int) -> Batch:
        """The next micro-batch. ``first_step`` is the step the stream's next batch belongs to when
        the stream is (re)opened, so that step-targeted faults hit the right batches."""
        if self._iter is None:
            self._iter = self._open(first_step)
        return next(self._iter)

    def _source(self) -> Iterator[Batch]:
        source: Any = self.task.stream(self.position)
        if self.dist.active:  # this rank's slice of each global batch; faults then apply per rank
            source = ((distributed.rank_slice(x, self.dist), distributed.rank_slice(y, self.dist)) for x, y in source)
        return source

    def _open(self, first_step: int) -> Iterator[Batch]:
        for inputs, targets in self.injector.wrap_data(self._source(), first_step=first_step):
            self.position += 1
            yield to_device(inputs, self.device), to_device(targets, self.device)

    def state_dict(self) -> int:
        return self.position

    def load_state_dict(self, position: int) -> None:
        self.seek(int(position))
