"""The one place that knows fp16, bf16 and fp32.

Everything that differs between the three precisions lives here: the autocast context, the
compute dtype, and whether gradients go through a loss scaler. The training step asks this
object and never branches on the precision itself (the pattern of Lightning's MixedPrecision
plugin). Impossible combinations, such as bf16 with a loss scaler, are rejected up front.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

PrecisionName = Literal["fp16", "bf16", "fp32"]
PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp32")

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class GuardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that can also be told "this step is bad" from outside.

    ``GradScaler`` backs the scale off only when ``unscale_`` found an inf/NaN in a gradient.
    ampguard also skips a step whose *loss* was non-finite, and DESIGN.md wants that skip to
    be visible in the scale too (x ``backoff_factor``, growth tracker reset). ``mark_found_inf_``
    records the skip the way ``unscale_`` would, so the following ``update()`` does exactly
    what it does for an overflowing gradient. Everything else is PyTorch's GradScaler.
    """

    def mark_found_inf_(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the next ``update()`` treat this iteration as an overflow (backoff, tracker reset)."""
        self.add_found_inf_(optimizer, torch.ones(()))

    def add_found_inf_(self, optimizer: torch.optim.Optimizer, found: torch.Tensor) -> None:
        """Merge ``found`` (0 or 1, a tensor: no host read) into what ``unscale_`` recorded, so the
        next ``update()`` backs off when it is 1."""
        if not self._enabled:
            return
        if self._scale is None:  # the very first step was bad before anything was scaled
            device = next(p.device for g in optimizer.param_groups for p in g["params"])
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None
        record = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not record:
            record[self._scale.device] = torch.zeros((), device=self._scale.device)
        for flag in record.values():
            torch.maximum(flag, found.to(flag.device, flag.dtype), out=flag)

    def scale_value(self) -> torch.Tensor:
        """The current scale as a detached 0-dim tensor on the scaler's device (no host sync).

        1.0 when the scaler is disabled (bf16, fp32), as the per-step CSV reports it.
        """
        if not self._enabled:
            if not hasattr(self, "_one"):
                self._one = torch.ones(())  # never written to: one tensor serves every record
            return self._one
        if self._scale is None:
            return torch.full((), float(self._init_scale))
        return self._scale.detach().clone()


@dataclass(frozen=True)
class Precision:
    """A precision on a device type: ``Precision("fp16", "cuda")``.

    Example::

        >>> p = Precision("bf16", "cpu")
        >>> with p.autocast():
        ...     y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        >>> y.dtype, p.uses_scaler
        (torch.bfloat16, False)
    """

    name: PrecisionName
    device_type: str

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.name!r}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype autocast computes eligible ops in (float32 for fp32: no autocast)."""
        return _DTYPES[self.name]

    @property
    def uses_scaler(self) -> bool:
        """Only fp16 needs loss scaling: its 5-bit exponent underflows small gradients."""
        return self.name == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to ``dtype``, or nothing at all for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def make_scaler(
        self,
        *,
        enabled: bool | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> GuardedGradScaler:
        """The loss scaler for this precision: enabled for fp16, disabled (scale 1.0) otherwise.

        ``enabled=None`` picks the default; ``enabled=True`` for bf16/fp32 is an error, since
        scaling a format with fp32's exponent range buys nothing and hides bugs.
        """
        if enabled and not self.uses_scaler:
            raise ValueError(f"{self.name} does not use a loss scaler (scaler.enabled must be false)")
        on = self.uses_scaler if enabled is None else enabled
        return GuardedGradScaler(
            self.device_type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=on,
        )
