"""The learning-rate schedule of a run, on the host (``LambdaLR``) or on the device (the fast path).

One shape (``schedule``: linear warmup, then constant, cosine or linear decay down to
``min_lr_ratio`` at update ``steps - 1``), counted in *applied* updates so it holds on a skipped
step: the last step of a run with no skip is at the floor, one with k skips ends k updates short
of it (review 54c: the README said every run ends at the floor).
:func:`lr_multiplier` is it as a Python function for ``torch.optim.lr_scheduler.LambdaLR`` (the
exact path steps that scheduler after each applied update). :class:`DeviceLambdaLR` is the same
scheduler object for the sync-free step: the step evaluates :meth:`DeviceLambdaLR.device_factor`
on its device count of applied updates, so no host read decides the LR; checkpoints, resume
policy changes and rollbacks see an ordinary ``LambdaLR`` (``base_lrs``, ``last_epoch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .config import Config
from .errors import AmpguardWarning


class WarmupPastTheRun(AmpguardWarning):
    """``schedule.warmup`` is longer than the run: the LR never reaches ``optimizer.lr`` (said at
    a run's start; the demo's fixed warm-up of a short demo is its own choice, not said)."""


def lr_multiplier(config: Config) -> Callable[[int], float]:
    """The schedule as a factor of ``optimizer.lr``, a function of applied updates: linear warmup
    over ``schedule.warmup`` updates, then ``schedule.decay`` down to ``min_lr_ratio`` at update
    ``steps - 1`` (the last step when none was skipped; held on a skip, a run with k skips ends k
    updates short of it).

    Example::

        >>> from ampguard.config import validate
        >>> f = lr_multiplier(validate({"steps": 11, "schedule": {"warmup": 2, "decay": "linear"}}))
        >>> [round(f(u), 3) for u in (0, 1, 2, 10)]
        [0.5, 1.0, 1.0, 0.1]
        >>> f = lr_multiplier(validate({"steps": 5, "schedule": {"warmup": 4, "decay": "cosine"}}))
        >>> [round(f(u), 3) for u in range(5)]  # (one step after the warm-up: it is the last, at the floor)
        [0.25, 0.5, 0.75, 1.0, 0.1]
    """
    warmup, total, floor = config.schedule.warmup, config.steps, config.schedule.min_lr_ratio
    decay = config.schedule.decay

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if decay == "constant":
            return 1.0
        # the last step (update total - 1, when none was skipped) runs at the floor, also when it
        # is the only one after the warm-up
        span = total - warmup - 1
        progress = 1.0 if span <= 0 else min(1.0, (update - warmup) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def device_multiplier(config: Config) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`lr_multiplier` on the device: a float32 table of the factor for every count of
    applied updates up to ``steps`` (computed once, in float64, on the host), looked up by the
    count: two small kernels a step and no host read. The count's index is a ``searchsorted``
    among the table's positions 1..steps, which is the count clamped to the table in one kernel
    (a cast and a clamp otherwise): a count past the table (``steps`` lowered on a resume) reads
    its last entry, as the host function's clamp does.

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"steps": 11, "schedule": {"warmup": 2, "decay": "cosine"}})
        >>> host, device = lr_multiplier(config), device_multiplier(config)
        >>> all(abs(device(torch.tensor(float(u))).item() - host(u)) < 1e-7 for u in range(14))
        True
    """
    host = lr_multiplier(config)
    table = torch.tensor([host(u) for u in range(config.steps + 1)], dtype=torch.float64).to(torch.float32)
    on_device: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def factor(applied: torch.Tensor) -> torch.Tensor:
        found = on_device.get((applied.device, applied.dtype))
        if found is None:
            positions = torch.arange(1, len(table), dtype=applied.dtype)
            found = on_device[applied.device, applied.dtype] = table.to(applied.device), positions.to(applied.device)
        values, positions = found
        index = torch.searchsorted(positions, applied.reshape(1), right=True)  # min(max(count, 0), steps)
        return values.gather(0, index).reshape(())  # (not values[index]: indexing may read the index)

    return factor


class DeviceLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """A ``LambdaLR`` whose factor the sync-free step takes on the device.

    The guarded step (``Guard(sync_free=True, scheduler=...)``) never calls :meth:`step`: at each
    group's end it sets every group's tensor LR to ``base_lrs[i] * device_factor(applied)``,
    ``applied`` being its device count of applied updates (shared here as :attr:`applied`). The
    host bookkeeping (``last_epoch``, the LR of ``get_last_lr``) is brought up to date when the
    state is saved (:meth:`state_dict`, a host read), so a checkpoint holds what the exact path's
    ``LambdaLR`` would and either path resumes from it.

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"steps": 10, "schedule": {"warmup": 4}})
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        >>> schedule = DeviceLambdaLR(optimizer, lr_multiplier(config), device_multiplier(config))
        >>> schedule.applied = torch.tensor(2.0)  # what the step shares with it
        >>> round(schedule.device_factor(schedule.applied).item(), 3), schedule.state_dict()["last_epoch"]
        (0.75, 2)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: Callable[[int], float],
                 device_factor: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(optimizer, factor)
        self.device_factor = device_factor
        self.applied: torch.Tensor | None = None
        """The step's device count of applied updates (set by the step that drives it)."""

    def state_dict(self) -> dict[str, Any]:
        if self.applied is not None:  # the host count catches up (a host read; saves only)
            self.last_epoch = int(self.applied.item())
            self._last_lr = [float(base) * self.lr_lambdas[0](self.last_epoch) for base in self.base_lrs]
        state = super().state_dict()
        for name in ("device_factor", "applied"):
            state.pop(name, None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        keep = self.device_factor, self.applied
        super().load_state_dict(state_dict)
        self.device_factor, self.applied = keep
