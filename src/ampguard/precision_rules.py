"""The precisions' names and the loss scaler's rules that need no torch: what a config is
validated with (:mod:`ampguard.config` imports this, never :mod:`ampguard.precision`, so loading a
config and ``train --print-config`` start without torch). Part of :mod:`ampguard.precision`,
which imports every name here (``ampguard.precision.MAX_SCALE`` as ever): the one place that
knows fp16, bf16, fp32 and fp8 is those two modules, this one its torch-free half.

Example (float32's limits, written without torch)::

    >>> import torch
    >>> MAX_SCALE == torch.finfo(torch.float32).max, DEFAULT_MIN_SCALE == torch.finfo(torch.float32).tiny
    (True, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

from .errors import real_number, whole_number

PrecisionName = Literal["fp16", "bf16", "fp32", "fp8"]
PRECISIONS: tuple[str, ...] = ("fp16", "bf16", "fp32", "fp8")
"""The precision names :class:`~ampguard.precision.Precision` accepts (fp8 with the optional ``torchao`` extra)."""


def uses_loss_scaler(name: object) -> bool:
    """Whether precision ``name`` goes through a loss scaler (when ``scaler.enabled`` is null):
    fp16 only. The rule :attr:`~ampguard.precision.Precision.uses_scaler` and a resume's compare of
    configs share; anything that is not a precision name (a hostile checkpoint's config) is False, never an
    error: whoever reads such a config refuses it where it compares the precision itself.

    Example::

        >>> [uses_loss_scaler(n) for n in PRECISIONS], uses_loss_scaler("fp17"), uses_loss_scaler(["fp16"])
        ([True, False, False, False], False, False)
    """
    return name == "fp16"


def loss_scaler_runs(name: object, enabled: bool | None) -> bool:
    """Whether a loss scaler runs under precision ``name`` with the setting ``enabled``: the
    setting where given (``True`` only where one is used: refused elsewhere), else
    :func:`uses_loss_scaler`. The one rule :attr:`Config.scaler_on <ampguard.config.Config.scaler_on>`,
    :meth:`~ampguard.precision.Precision.make_scaler` and the integrations' scaler defaults read.

    Example::

        >>> loss_scaler_runs("fp16", None), loss_scaler_runs("fp16", False), loss_scaler_runs("bf16", None)
        (True, False, False)
    """
    return uses_loss_scaler(name) if enabled is None else bool(enabled)


DEFAULT_MIN_SCALE: float = 2.0**-126
"""The default floor of :class:`~ampguard.precision.GuardedGradScaler`'s scale: 2**-126, the
smallest normal float32.

Any floor keeps the scale off 0 (0 would make every later step inf x 0 = NaN, skipped for
ever); a normal one also keeps ``1 / scale`` (the unscale factor, float32) finite. A run's
config sets a much higher floor, ``scaler.min_scale`` (default 1.0).
"""


MAX_SCALE: float = (2 - 2.0**-23) * 2.0**127
"""The largest loss scale a :class:`~ampguard.precision.GuardedGradScaler` starts from: its scale
is a float32 tensor (float32's largest, (2 - 2**-23) * 2**127)."""


def finite_number(value: object) -> bool:
    """Whether ``value`` is a real number (an int or a float, not a bool) that is finite as a
    float: what a checkpoint's settings and counters are checked with before they are used. An
    int too large for a float is not one: it would raise ``OverflowError`` where it is used.

    Example::

        >>> [finite_number(v) for v in (1, 2.5, -3, float("inf"), float("nan"), True, "1", None, 10**400)]
        [True, True, True, False, False, False, False, False, False]
    """
    if not real_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past the largest float
        return False


SCALER_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "init_scale": (lambda v: finite_number(v) and v > 0, "a finite number > 0"),
    "growth_factor": (lambda v: finite_number(v) and v > 1, "a finite number > 1"),
    "backoff_factor": (lambda v: finite_number(v) and 0 < v < 1, "in (0, 1)"),
    "min_scale": (lambda v: finite_number(v) and v > 0, "a finite number > 0"),
    "growth_interval": (lambda v: whole_number(v, 1), "a whole number >= 1"),
}
"""The loss scaler's settings' ranges, each ``(holds, what it must be)``: the one place they are
written. :func:`check_scaler_ranges` applies them to a :class:`~ampguard.precision.GuardedGradScaler` made directly,
:meth:`~ampguard.precision.Precision.make_scaler` (``Guard(scaler={...})``, the trainer) and a plain ``GradScaler``
handed over; the config's validators and :meth:`~ampguard.precision.GuardedGradScaler.check_state` (a checkpoint's,
a ``Guard.load_state_dict``'s) ask :func:`scaler_range_problem`. A backoff of 0 pins the scale at
the float32 floor after one skip (every later step "applied" with zero gradients), one >= 1 grows
it on overflows, to inf (every later step skipped); a growth factor <= 1 never grows it or shrinks
it; an interval of 0 never grows it."""


def scaler_range_problem(name: str, value: Any) -> str | None:
    """What the scaler setting ``name`` must be (``"must be ..."``), or None when ``value`` is in
    its range (:data:`SCALER_RANGES`).

    Example::

        >>> scaler_range_problem("backoff_factor", 2.0), scaler_range_problem("growth_interval", 10)
        ('must be in (0, 1)', None)
    """
    holds, want = SCALER_RANGES[name]
    return None if holds(value) else f"must be {want}"


def check_scaler_ranges(**settings: Any) -> None:
    """Raise ``ValueError`` (``scaler NAME must be ..., got VALUE``) for the first of ``settings``
    out of its range (:data:`SCALER_RANGES`), in their order there.

    Example::

        >>> check_scaler_ranges(growth_factor=2.0, backoff_factor=0.0)
        Traceback (most recent call last):
        ...
        ValueError: scaler backoff_factor must be in (0, 1), got 0.0
    """
    for name in SCALER_RANGES:
        if name in settings and (problem := scaler_range_problem(name, settings[name])):
            raise ValueError(f"scaler {name} {problem}, got {settings[name]!r}")

