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


TABLE_CHUNK = 1 << 20
"""Entries of the device table computed at a time (:func:`factor_table`): the build's host memory
is a few float64 arrays of this many entries, whatever ``steps`` is."""

_CLOSE = 2.0**-46
"""How far a float64 factor computed by torch may be from the host function's (its ``cos`` may be
another libm's, 1 ulp off; every other operation is the same IEEE one): far more than the error."""


def factor_table(config: Config, device: torch.device | str | None = None, chunk: int = TABLE_CHUNK) -> torch.Tensor:
    """:func:`lr_multiplier` for every count of applied updates 0..``steps``, as a float32 tensor
    on ``device`` (the CPU by default): bit for bit ``torch.tensor([f(u) for u in range(steps +
    1)], dtype=torch.float64).float()``, computed ``chunk`` entries at a time with torch's float64
    operations in the host function's order (review 55b: the Python loop took 40 s and 1.15 GB at
    20M steps, ~55 GB at the ``steps`` cap). Its ``cos`` may not be Python's (``math.cos``, the
    C library's) to the last bit: an entry whose float32 rounding a float64 difference of
    :data:`_CLOSE` could change is taken from the host function itself (a few in a million;
    near the end of a cosine to a zero floor, where the factor is tiny, more).

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"steps": 7, "schedule": {"warmup": 2, "decay": "linear", "min_lr_ratio": 0.5}})
        >>> factor_table(config).tolist()
        [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.5]
    """
    host = lr_multiplier(config)
    table = torch.empty(config.steps + 1, dtype=torch.float32, device=device)
    for start in range(0, len(table), chunk):
        stop = min(start + chunk, len(table))
        table[start:stop].copy_(_factors(config, host, start, stop))
    return table


def _factors(config: Config, host: Callable[[int], float], start: int, stop: int) -> torch.Tensor:
    """The float32 factors of counts ``start..stop - 1`` on the CPU (:func:`factor_table`)."""
    warmup, total, floor = config.schedule.warmup, config.steps, config.schedule.min_lr_ratio
    decay = config.schedule.decay
    update = torch.arange(start, stop, dtype=torch.float64)  # (exact: counts are below 2**53)
    if decay == "constant":
        value = torch.ones_like(update)
    else:  # (each operation the host function's, on the same float64 operands)
        span = total - warmup - 1
        progress = torch.ones_like(update) if span <= 0 else ((update - warmup) / span).clamp_(max=1.0)
        shape = (progress * math.pi).cos_().add_(1).mul_(0.5) if decay == "cosine" else 1 - progress
        value = shape.mul_(1 - floor).add_(floor)
    if start < warmup:
        value = torch.where(update < warmup, (update + 1) / warmup, value)
    rounded = value.float()
    unsure = torch.ne((value - _CLOSE).float(), (value + _CLOSE).float()).nonzero().flatten().tolist()
    for i in unsure:  # (the float32 rounding is the host function's to decide)
        rounded[i] = host(start + i)
    return rounded


def device_multiplier(config: Config, device: torch.device | str | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`lr_multiplier` on the device: its float32 table (:func:`factor_table`, built once
    on ``device``, the CPU by default, and copied to another device the first time a count
    there is looked up), indexed by the count of applied updates, an int64 tensor: a clamp and
    a ``gather``, two small kernels a step and no host read. The clamp keeps the index in the
    table: a count past it (``steps`` lowered on a resume) reads its last entry, as the host
    function's clamp does. The count is exact at any size (a float32 count stopped at 2**24 =
    16,777,216, and positions in float32 put the lookup two entries off there: review 55b); a
    float count (whole) is cast to int64 first.

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"steps": 11, "schedule": {"warmup": 2, "decay": "cosine"}})
        >>> host, device = lr_multiplier(config), device_multiplier(config)
        >>> all(device(torch.tensor(u)).item() == torch.tensor(host(u)).float().item() for u in range(14))
        True
    """
    table = factor_table(config, device)
    on_device: dict[torch.device, torch.Tensor] = {table.device: table}

    def factor(applied: torch.Tensor) -> torch.Tensor:
        values = on_device.get(applied.device)
        if values is None:
            values = on_device[applied.device] = table.to(applied.device)
        index = applied.reshape(1).clamp(0, len(values) - 1)  # (past the table: its last entry)
        if index.dtype != torch.int64:  # (a float count, whole: cast once clamped)
            index = index.long()
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
        >>> schedule.applied = torch.tensor(2)  # what the step shares with it (its int64 count)
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
