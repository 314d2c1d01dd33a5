"""The one place that knows fp16, bf16, fp32 and fp8.

Everything that differs between the precisions lives here: the autocast context, the
compute dtype, and whether gradients go through a loss scaler. fp8 is bf16 autocast plus
torchao's ``Float8Linear`` layers (the model is converted once, :mod:`ampguard.fp8`), no loss
scaler. The training step asks this
object and never branches on the precision itself (the pattern of Lightning's MixedPrecision
plugin). Impossible combinations, such as bf16 with a loss scaler, are rejected up front.
"""

from __future__ import annotations

import contextlib
import math
import struct
import sys
import weakref
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from .errors import AmpguardWarning, brief, listed, user_stacklevel, warn
# (the names and rules a config is validated with, torch-free there; here as ever: precision.MAX_SCALE)
from .precision_rules import (DEFAULT_MIN_SCALE, MAX_SCALE, PRECISIONS, PrecisionName,
                              check_scaler_ranges, finite_number, loss_scaler_runs, scaler_range_problem,
                              uses_loss_scaler)


# fp8: torchao's Float8Linear layers matmul in float8; everything else runs under bf16 autocast
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16}


class HalfWeightsWarning(AmpguardWarning):
    """Trainable half-precision weights under ``precision="fp32"``: pure bf16 (or fp16) training,
    the user's choice, said once (the records say fp32)."""


class SlowPrecisionWarning(AmpguardWarning):
    """A precision this device only emulates (fp16 or fp8 on a CPU; bf16 on a CPU without
    AVX-512 or AMX, or a GPU before Ampere): correct, but slow."""


def cpu_runs_natively(name: str) -> bool:
    """Whether this CPU has oneDNN kernels for ``name``'s 16-bit matmuls ("bf16": AVX-512 or
    AMX; "fp16": AVX-512-FP16 or AMX-FP16). Without them autocast's matmuls are emulated: on an
    AVX2-only CPU a bf16 or fp16 512 x 512 matmul took 100x fp32's (2026-12-04).

    Example::

        >>> cpu_runs_natively("bf16") in (True, False)
        True
    """
    check = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[name]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # (a torch built without oneDNN: no kernels either)
        return False


def _cpu_note(name: str) -> str | None:
    """The :meth:`Precision.support` note for ``name`` ("bf16" or "fp16") autocast on this CPU:
    none where it runs natively.

    Example::

        >>> note = _cpu_note("bf16")
        >>> note is None or note.startswith("bf16 autocast on this CPU is emulated")
        True
    """
    if name == "bf16":
        return None if cpu_runs_natively("bf16") else (
            "bf16 autocast on this CPU is emulated (oneDNN has no bf16 kernels without AVX-512 or AMX): "
            "its matmuls run about 100x slower than fp32's; fp32 trains faster here")
    if cpu_runs_natively("fp16"):
        return None
    if cpu_runs_natively("bf16"):
        return "fp16 autocast on a CPU is emulated, about 10x slower than bf16 there; prefer bf16 on CPUs"
    return ("fp16 autocast on this CPU is emulated, as bf16 is (no AVX-512 or AMX): its matmuls run about "
            "100x slower than fp32's; fp32 trains faster here")




def _check_min_scale(min_scale: float) -> float:
    min_scale = float(min_scale)
    if not (math.isfinite(min_scale) and min_scale >= DEFAULT_MIN_SCALE):
        raise ValueError(
            f"min_scale must be a finite number >= {DEFAULT_MIN_SCALE:g} (the smallest normal float32), "
            f"got {min_scale!r}"
        )
    return min_scale


def round_float32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python float (to inf past float32's largest,
    as a conversion to float32 does): what a float32 tensor holds once ``x`` is written to it.

    Example::

        >>> round_float32(0.1) == torch.tensor(0.1).item(), round_float32(1e39)
        (True, inf)
    """
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.inf if x > 0 else -math.inf


_F32 = struct.Struct("f")


def scale_in_use(scaler: torch.amp.GradScaler) -> torch.Tensor | float:
    """The scale the scaler's next ``scale(loss)`` multiplies by, without a host read: a device
    copy of its scale tensor (``update()`` changes that one in place), or ``init_scale`` before
    its first step.

    Example::

        >>> scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
        >>> scale_in_use(scaler)
        512.0
        >>> _ = scaler.scale(torch.ones(()))
        >>> scale_in_use(scaler)
        tensor(512.)
    """
    return float(scaler._init_scale) if scaler._scale is None else scaler._scale.detach().clone()



_INT32_MAX = 2**31 - 1
"""The growth tracker is an int32 tensor: it counts no further."""
_INT64_MAX = 2**63 - 1
"""``growth_interval`` goes to PyTorch's update kernel as an int64."""



class _HandedOver:
    """What a plain ``GradScaler`` handed to the guard (:meth:`GuardedGradScaler.from_scaler`) does
    for the methods a ported loop may keep: ``load_state_dict`` loads the guard's scaler too (a
    loop's resume made after ``Guard()`` was dropped at the first step, whose shared tensors were
    the guard's), ``scale`` and ``update`` raise, naming the fix (``scaler.scale(loss)`` given to
    ``guard.backward`` scaled the loss twice: gradients ``scale`` times too large, steps skipped;
    a kept ``scaler.update()`` ended in PyTorch's bare "No inf checks were recorded"). The scale
    refusal also names the way for the one ``scale()`` of the stock recipes that is not the
    backward's: a gradient penalty's ``torch.autograd.grad(scaler.scale(loss), ...)``, ported
    with the scaler handed over, was told only "give guard.backward the loss as it is" (review 61a).
    A module-level class on the instance: a guard holding the scaler still pickles and copies.

    Only while the guard's scaler lives: it holds it weakly, and once the guard (and with it its
    ``GuardedGradScaler``) is collected, :func:`_hand_back` takes these off the instance, which is
    a plain ``GradScaler`` again, at the guard's scale (review 56d: a loop that went back to the
    plain recipe in the same process was refused for good, by a message naming a guard that no
    longer existed). While the guard lives, a plain loop goes on from a new ``GradScaler`` that
    loads this one's ``state_dict()``, as the message says.

    Example::

        >>> plain = torch.amp.GradScaler("cpu", init_scale=4.0)
        >>> guarded = GuardedGradScaler.from_scaler(plain)
        >>> plain.scale(torch.ones(()))
        Traceback (most recent call last):
        ...
        RuntimeError: scaler.scale(loss) on the GradScaler handed to the Guard: guard.backward(loss) scales the loss itself (kept, the loss is scaled twice and the gradients come out scale times too large); give guard.backward the loss as it is; a gradient penalty's torch.autograd.grad(scaler.scale(loss), params, create_graph=True) scales with guard.scaler.scale(loss) and unscales by 1 / guard.scaler.get_scale() (to go back to the plain loop while the guard lives, make a new GradScaler and load_state_dict(this one's state_dict()); once the guard is collected this one is plain again)
        >>> del guarded; plain.scale(torch.ones(()))  # (the guard gone: plain again)
        tensor(4.)
    """

    METHODS = ("load_state_dict", "scale", "update")
    _BACK = ("to go back to the plain loop while the guard lives, make a new GradScaler and "
             "load_state_dict(this one's state_dict()); once the guard is collected this one is plain again")
    _FIXES = {
        "scale": ("scaler.scale(loss) on the GradScaler handed to the Guard: guard.backward(loss) scales the loss "
                  "itself (kept, the loss is scaled twice and the gradients come out scale times too large); give "
                  "guard.backward the loss as it is; a gradient penalty's torch.autograd.grad(scaler.scale(loss), "
                  "params, create_graph=True) scales with guard.scaler.scale(loss) and unscales by "
                  f"1 / guard.scaler.get_scale() ({_BACK})"),
        "update": ("scaler.update() on the GradScaler handed to the Guard: guard.step() updates the scale itself, "
                   f"every step; remove it from the loop ({_BACK})"),
    }

    def __init__(self, guarded: GuardedGradScaler, twin: torch.amp.GradScaler, name: str) -> None:
        # (weakly: the plain scaler, which the user keeps, must not keep the guard's scaler alive)
        self._guarded, self.twin, self.name = weakref.ref(guarded), twin, name

    @property
    def guarded(self) -> GuardedGradScaler | None:
        """The guard's scaler this one was handed to; None once it is collected."""
        return self._guarded()

    def __reduce__(self) -> tuple[Any, ...]:  # (a weak reference does not pickle: the copy's own scaler)
        return type(self), (self.guarded, self.twin, self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.name != "load_state_dict" and self.guarded is not None:  # (the guard's scaler held in no local:
            raise RuntimeError(self._FIXES[self.name])  # the traceback a notebook keeps does not keep it alive)
        guarded = self.guarded
        if guarded is None:  # (collected, its _hand_back not run yet: the plain method)
            return getattr(type(self.twin), self.name)(self.twin, *args, **kwargs)
        guarded.load_state_dict(*args, **kwargs)  # first: a state it refuses changes neither (they share tensors)
        type(self.twin).load_state_dict(self.twin, *args, **kwargs)
        return None


def _hand_back(scaler: torch.amp.GradScaler) -> None:
    """The plain ``scaler`` handed to a guard (:meth:`GuardedGradScaler.from_scaler`) made plain
    again once the guard's scaler is collected: the methods set on the instance
    (:class:`_HandedOver`) taken off, each only while it is still that guard's (one whose guard's
    scaler is gone), so the class's own run again. Its scale and growth tracker are the tensors it
    shared with the guard: the plain loop goes on from the guard's scale.

    Example::

        >>> plain = torch.amp.GradScaler("cpu")
        >>> guarded = GuardedGradScaler.from_scaler(plain)
        >>> sorted(vars(plain).keys() & set(_HandedOver.METHODS))
        ['load_state_dict', 'scale', 'update']
        >>> del guarded
        >>> sorted(vars(plain).keys() & set(_HandedOver.METHODS))
        []
    """
    for name in _HandedOver.METHODS:
        handed = vars(scaler).get(name)
        if isinstance(handed, _HandedOver) and handed.guarded is None:
            delattr(scaler, name)


def _non_finite_flags(optimizer: torch.optim.Optimizer) -> dict[torch.device, torch.Tensor]:
    """Whether a gradient of ``optimizer`` holds an inf or a NaN, a float32 flag per device (no
    host read): PyTorch's fused check of ``GradScaler.unscale_``, by 1.0 (the values unchanged),
    over every gradient, as ``unscale_`` groups them (by device and dtype); a sparse one by its
    values, a complex one by its real view (the check has no complex kernel: a complex weight,
    which bf16 and fp32 train, failed at the first ``unscale_()``).

    Example::

        >>> p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1, dtype=torch.complex64))
        >>> p.grad, q.grad = torch.ones(2), torch.tensor([complex(1.0, float("inf"))])
        >>> _non_finite_flags(torch.optim.SGD([p, q], lr=0.1))
        {device(type='cpu'): tensor(1.)}
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            grad = grad._values() if grad.is_sparse else grad  # (uncoalesced: a non-finite value is one still)
            grad = torch.view_as_real(grad) if grad.is_complex() else grad
            groups[grad.device, grad.dtype].append(grad)
    flags: dict[torch.device, torch.Tensor] = {}
    for (device, _), grads in groups.items():
        if device not in flags:
            flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], one)
    return flags


class GuardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a floor under the scale, that can also be told "this step
    is bad" from outside.

    ``GradScaler`` backs the scale off only when ``unscale_`` found an inf/NaN in a gradient.
    ampguard also skips a step whose *loss* was non-finite, and the step's contract
    (docs/design.md §2) wants that skip to be visible in the scale too (x ``backoff_factor``, growth tracker reset). ``mark_found_inf_``
    records the skip the way ``unscale_`` would, so the following ``update()`` does exactly
    what it does for an overflowing gradient.

    The floor, ``min_scale`` (like DeepSpeed's ``min_loss_scale``): PyTorch's scale halves on
    every skip with no lower bound, so a long run of bad steps drives it to a subnormal and
    then to exactly 0, after which every clean step is skipped too (its gradients are
    unscaled by 1/0) and the run never recovers. Here :meth:`update` clamps the scale to
    ``min_scale`` on the device (no host read). At or above the floor everything is PyTorch's
    GradScaler, bit for bit. The floor must be a normal float32 (``>= 2**-126``); the default
    is that smallest one, :data:`DEFAULT_MIN_SCALE`.

    Example::

        >>> scaler = GuardedGradScaler("cpu", init_scale=4.0, min_scale=1.0)
        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> scales = []
        >>> for _ in range(4):  # four bad steps in a row
        ...     scaler.mark_found_inf_(opt)
        ...     scaler.update()
        ...     scales.append(scaler.get_scale())
        >>> scales  # halves down to the floor, then stays there
        [2.0, 1.0, 1.0, 1.0]
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        min_scale: float = DEFAULT_MIN_SCALE,
    ) -> None:
        if enabled:  # (review 54b: made directly, a backoff of 0 or an interval of 0 was taken; off, none is used)
            check_scaler_ranges(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                                min_scale=min_scale, growth_interval=growth_interval)
        min_scale = _check_min_scale(min_scale)
        if enabled and not init_scale >= min_scale:
            raise ValueError(f"init_scale ({init_scale:g}) must be >= min_scale ({min_scale:g})")
        if enabled and not init_scale <= MAX_SCALE:  # (the scale is a float32 tensor)
            raise ValueError(f"init_scale ({init_scale:g}) must be <= {MAX_SCALE:g}, the largest float32")
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._min_scale = min_scale
        self._twin: torch.amp.GradScaler | None = None  # the plain scaler handed over (:meth:`from_scaler`)
        # a disabled scaler's unscale_ flags, by optimizer (:meth:`unscale_`)
        self._found_off: dict[int, dict[torch.device, torch.Tensor]] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_found_off", {})  # (a scaler pickled before the flags were kept)
        if self.__dict__.get("_twin") is not None:  # (a copy's plain scaler is handed back when the copy goes)
            weakref.finalize(self, _hand_back, self._twin).atexit = False

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        """``GradScaler``'s, and the plain scaler this one took over then holds the same scale and
        growth tracker tensors: its ``get_scale()`` and ``state_dict()`` follow the guard's."""
        super()._lazy_init_scale_growth_tracker(dev)
        if self._twin is not None:
            self._twin._scale, self._twin._growth_tracker = self._scale, self._growth_tracker

    @classmethod
    def from_scaler(cls, scaler: torch.amp.GradScaler, min_scale: float = DEFAULT_MIN_SCALE) -> GuardedGradScaler:
        """A ``GuardedGradScaler`` with a plain ``GradScaler``'s settings and state (its scale and
        growth tracker, when it has run), so a user's scaler can be handed to the guard. From the
        first ``scale()`` on, the two hold the same scale and growth tracker tensors: the plain
        scaler's ``get_scale()`` and ``state_dict()`` (a loop's logging, its checkpoints) follow
        the guard's backoffs and growth instead of staying where they were (its settings are
        its own). Its ``load_state_dict()`` (a loop's resume, before or after the first step)
        loads the guard's too; its ``scale()`` and ``update()``, the recipe's lines the guard
        does itself, raise (:class:`_HandedOver`). A scaler handed over before gives the same
        ``GuardedGradScaler`` again: two guards given one plain scaler share one scale, as they
        do given one ``GuardedGradScaler`` (a second one made its own scale, and the plain
        scaler followed only the last guard's). Once every guard holding it is collected, the
        plain scaler is plain again (:func:`_hand_back`), at the scale they left it.

        Example::

            >>> plain = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=10)
            >>> g = GuardedGradScaler.from_scaler(plain)
            >>> type(g).__name__, g.get_scale(), g.get_growth_interval(), g.is_enabled()
            ('GuardedGradScaler', 512.0, 10, True)
            >>> _ = g.scale(torch.ones(())); g.update(64.0)
            >>> plain.get_scale(), plain.state_dict()["scale"]
            (64.0, 64.0)
            >>> plain.load_state_dict({**plain.state_dict(), "scale": 8.0}); g.get_scale()  # a loop's resume
            8.0
            >>> GuardedGradScaler.from_scaler(plain) is g  # (handed to a second guard)
            True
        """
        handed = vars(scaler).get("scale")
        before = handed.guarded if isinstance(handed, _HandedOver) else None  # (None: its guard collected)
        if before is not None:  # (handed to a guard before: one scale, as the recipe's one scaler)
            return before
        if not scaler.is_enabled():  # (a disabled GradScaler keeps no settings: an AttributeError otherwise)
            return cls(scaler._device, enabled=False, min_scale=min_scale)
        guarded = cls(scaler._device, init_scale=scaler._init_scale, growth_factor=scaler.get_growth_factor(),
                      backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
                      min_scale=min_scale)
        # its state whether it ran or was only loaded (a loaded, unused one keeps its growth tracker
        # in _init_growth_tracker: taking only its scale restarted the growth count at 0)
        guarded.load_state_dict(scaler.state_dict())
        guarded._twin = scaler
        for name in _HandedOver.METHODS:  # (its own methods, on this instance only: the class is torch's)
            setattr(scaler, name, _HandedOver(guarded, scaler, name))
        # plain again once the guard is gone (review 56d); the guard's scaler holds it, so it never outlives that
        weakref.finalize(guarded, _hand_back, scaler).atexit = False
        return guarded

    def get_min_scale(self) -> float:
        """The floor the scale is clamped to after every :meth:`update`.

        Example::

            >>> GuardedGradScaler("cpu").get_min_scale() == 2.0**-126
            True
        """
        return self._min_scale

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """``GradScaler.update``, then the scale is clamped to ``min_scale`` on the device (no
        host read; a no-op above the floor). A ``new_scale`` below the floor is clamped too.

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=8.0, min_scale=2.0)
            >>> _ = scaler.scale(torch.ones(()))  # creates the scale tensor
            >>> scaler.update(0.5)
            >>> scaler.get_scale()
            2.0
        """
        super().update(new_scale)
        if self._enabled and self._scale is not None:
            self._scale.clamp_(min=self._min_scale)
        elif not self._enabled and self._found_off:  # (what a disabled unscale_ kept: GradScaler's reset)
            self._found_off.clear()

    def state_dict(self) -> dict[str, Any]:
        """``GradScaler.state_dict`` plus ``min_scale`` (empty when disabled, as PyTorch's).

        Example::

            >>> GuardedGradScaler("cpu", init_scale=8.0, min_scale=2.0).state_dict()["min_scale"]
            2.0
            >>> GuardedGradScaler("cpu", enabled=False).state_dict()
            {}
        """
        state = super().state_dict()
        if state:
            state["min_scale"] = self._min_scale
        return state

    def check_state(self, state: Any, where: str = "") -> None:
        """Raise ``ValueError`` naming the field (after the prefix ``where``) unless ``state`` is
        one :meth:`load_state_dict` can take: a scale in ``[0, MAX_SCALE]`` (a collapsed 0 is
        raised to the floor), factors and interval in the config's ranges (:data:`SCALER_RANGES`:
        a growth factor > 1, a backoff in (0, 1)), the interval an int >= 1 (an int64 for
        PyTorch's update kernel), a count of clean steps in ``[0, growth_interval)`` (PyTorch
        grows the scale when it reaches the interval and restarts it at 0; an int32 tensor), a
        floor (if saved) a normal float32. A checkpoint's state would otherwise be taken as it is
        and fail at the first ``update()``, mid-run.

        Example::

            >>> scaler = GuardedGradScaler("cpu", growth_interval=3)
            >>> scaler.check_state({**scaler.state_dict(), "growth_factor": "x"}, "state.scaler.")
            Traceback (most recent call last):
            ...
            ValueError: state.scaler.growth_factor is 'x', expected a finite number > 1
            >>> scaler.check_state({**scaler.state_dict(), "backoff_factor": 2.0}, "state.scaler.")
            Traceback (most recent call last):
            ...
            ValueError: state.scaler.backoff_factor is 2.0, expected in (0, 1)
        """

        def bad(key: str, expected: str) -> ValueError:
            return ValueError(f"{where}{key} is {brief(state[key])}, expected {expected}")

        if state is None or state == {}:  # (a scaler that is on saves its scale: none would start it afresh)
            raise ValueError(f"{where.rstrip('.') or 'the scaler state'} is {'missing' if state is None else 'empty'}: "
                             "a loss scaler that is on needs its saved scale")
        if not isinstance(state, dict):
            raise ValueError(f"{where.rstrip('.') or 'the scaler state'} is {brief(state)}, expected a mapping")
        for key in ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"):
            if key not in state:
                raise ValueError(f"{where}{key} is missing")
        if not (finite_number(state["scale"]) and 0 <= state["scale"] <= MAX_SCALE):
            raise bad("scale", f"a number in [0, {MAX_SCALE:g}] (a float32)")
        # review 54b: only "> 0" was asked of the factors: a saved backoff of 2.0 grew the scale on every
        # overflow, to inf (every later step skipped); the config's ranges now, from their one place
        for key in ("growth_factor", "backoff_factor"):
            if problem := scaler_range_problem(key, state[key]):
                raise bad(key, problem.removeprefix("must be "))
        interval, tracker = state["growth_interval"], state["_growth_tracker"]
        if scaler_range_problem("growth_interval", interval) or interval > _INT64_MAX:
            raise bad("growth_interval", "an int >= 1")
        if not (isinstance(tracker, int) and not isinstance(tracker, bool) and 0 <= tracker < interval
                and tracker <= _INT32_MAX):
            raise bad("_growth_tracker", f"an int in [0, growth_interval {interval})")
        floor = state.get("min_scale", DEFAULT_MIN_SCALE)
        if not (finite_number(floor) and DEFAULT_MIN_SCALE <= floor <= MAX_SCALE):
            raise bad("min_scale", f"a number in [{DEFAULT_MIN_SCALE:g}, {MAX_SCALE:g}]")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``GradScaler.load_state_dict``; the saved floor wins (as the saved growth factor does),
        and a state without one (a plain GradScaler's, or saved before floors existed) keeps
        this scaler's. A saved scale below the floor (a scale that had decayed to 0) is raised
        to it, so a resumed run recovers at once. Every field is checked first (a finite
        number, a factor in its range, a growth tracker in ``[0, growth_interval)``: :meth:`check_state`):
        ``ValueError`` naming the field, this scaler untouched.

        Example::

            >>> plain = torch.amp.GradScaler("cpu", init_scale=0.0)  # a collapsed scale, no floor
            >>> scaler = GuardedGradScaler("cpu", min_scale=1.0)
            >>> scaler.load_state_dict(plain.state_dict())
            >>> scaler.get_scale(), scaler.get_min_scale()
            (1.0, 1.0)
            >>> scaler.load_state_dict({**plain.state_dict(), "_growth_tracker": "x"})
            Traceback (most recent call last):
            ...
            ValueError: _growth_tracker is 'x', expected an int in [0, growth_interval 2000)
        """
        if not self._enabled:
            return
        self.check_state(state_dict)
        min_scale = _check_min_scale(state_dict.get("min_scale", self._min_scale))
        # as Python numbers (a saved int scale or factor is fine; the update kernel takes floats)
        super().load_state_dict({**state_dict, "scale": float(state_dict["scale"]),
                                 "growth_factor": float(state_dict["growth_factor"]),
                                 "backoff_factor": float(state_dict["backoff_factor"])})
        self._min_scale = min_scale
        self._init_scale = max(float(self._init_scale), min_scale)
        if self._scale is not None:
            self._scale.clamp_(min=min_scale)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """``GradScaler.unscale_``; disabled (bf16, fp32: nothing to divide), what it finds is
        kept all the same: a flag per device of whether a gradient was non-finite (PyTorch's own
        check, by 1.0: the values unchanged), read by :meth:`found_at_unscale` and
        :meth:`unscaled` as when enabled, and forgotten at :meth:`update`. A step then skips on
        what ``unscale_`` found in every precision, though code in between (a framework's hook's
        ``clip_grad_value_``) made the gradients finite: disabled, PyTorch's does nothing, and
        a bf16 step applied the clamped values where fp16 skipped.

        Example::

            >>> scaler, p = GuardedGradScaler("cpu", enabled=False), torch.nn.Parameter(torch.ones(2))
            >>> opt = torch.optim.SGD([p], lr=0.1)
            >>> p.grad = torch.tensor([1.0, float("inf")])
            >>> scaler.unscale_(opt); _ = p.grad.clamp_(max=1.0)  # the unscale found it; a hook clamps it
            >>> scaler.unscaled(opt), scaler.found_at_unscale(opt, torch.device("cpu")), p.grad
            (True, tensor(True), tensor([1., 1.]))
            >>> scaler.update(); scaler.unscaled(opt)
            False
        """
        if self._enabled:
            super().unscale_(optimizer)
            return
        found = self._found_off
        if id(optimizer) in found:  # (GradScaler's own words)
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        found[id(optimizer)] = _non_finite_flags(optimizer)

    def unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``unscale_(optimizer)`` ran since the last ``update()`` (a second call would raise).

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=4.0)
            >>> p = torch.nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([p], lr=0.1)
            >>> scaler.scale(p.sum()).backward()
            >>> before = scaler.unscaled(opt); scaler.unscale_(opt)
            >>> before, scaler.unscaled(opt)
            (False, True)
        """
        if not self._enabled:
            return id(optimizer) in self._found_off
        return self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED

    def any_unscaled(self, optimizers: Iterable[torch.optim.Optimizer]) -> bool:
        """Whether any of ``optimizers`` is :meth:`unscaled`: on the guard's hot path (each
        backward, a group's close), so a disabled scaler with nothing unscaled answers at once.

        Example::

            >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            >>> GuardedGradScaler("cpu", enabled=False).any_unscaled([opt])
            False
        """
        if not self._enabled:
            return bool(self._found_off) and any(id(o) in self._found_off for o in optimizers)
        return any(self._per_optimizer_states[id(o)]["stage"] is OptState.UNSCALED for o in optimizers)

    def twin_used(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the plain ``GradScaler`` this one took over (:meth:`from_scaler`) was itself
        used on ``optimizer`` since its last ``update()``: a loop's own ``scaler.unscale_(opt)``
        kept beside the guard, which unscaled the gradients a first time (the guard's unscale
        then divided them again). False when none was taken over.

        Example::

            >>> plain = torch.amp.GradScaler("cpu", init_scale=4.0)
            >>> guarded = GuardedGradScaler.from_scaler(plain)
            >>> p = torch.nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([p], lr=0.1)
            >>> guarded.scale(p.sum()).backward()
            >>> before = guarded.twin_used(opt); plain.unscale_(opt)
            >>> before, guarded.twin_used(opt)
            (False, True)
        """
        twin = self._twin
        return twin is not None and id(optimizer) in twin._per_optimizer_states and (
            twin._per_optimizer_states[id(optimizer)]["stage"] is not OptState.READY)

    def found_at_unscale(self, optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor | None:
        """Whether ``unscale_(optimizer)`` found a non-finite gradient in this step, as a bool
        tensor on ``device`` (its per-device flags together; no host read); None when it
        recorded none (the optimizer not unscaled).

        Example::

            >>> scaler, p = GuardedGradScaler("cpu"), torch.nn.Parameter(torch.ones(1))
            >>> opt = torch.optim.SGD([p], lr=0.1)
            >>> scaler.found_at_unscale(opt, torch.device("cpu")) is None
            True
            >>> scaler.scale(p.sum()).backward()
            >>> p.grad[0] = float("inf")
            >>> scaler.unscale_(opt)
            >>> scaler.found_at_unscale(opt, torch.device("cpu"))
            tensor(True)
        """
        flags = list((self._found_inf_per_device(optimizer) if self._enabled
                      else self._found_off.get(id(optimizer), {})).values())
        return torch.stack([f.to(device) for f in flags]).sum() > 0 if flags else None

    def forget_unscaled(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Forget what ``unscale_`` did to ``optimizers`` since the last ``update()`` (as
        ``update()`` does): for a restore that abandons an open group, whose unscaled mark would
        otherwise outlive it. The plain scaler taken over (:meth:`from_scaler`) forgets too: a
        ``scaler.unscale_(opt)`` the loop kept once is refused at that step (:meth:`twin_used`),
        not at every one after it (its ``update()``, the one reset a user could reach, the guard
        refuses). Only those optimizers: another guard sharing the scaler keeps its marks (review
        47e: its own ``unscale_()``, or a stray one the next close must refuse).

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=4.0)
            >>> p, q = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
            >>> a, b = torch.optim.SGD([p], lr=0.1), torch.optim.SGD([q], lr=0.1)
            >>> scaler.scale(p.sum() + q.sum()).backward()
            >>> scaler.unscale_(a); scaler.unscale_(b); scaler.forget_unscaled([a])
            >>> scaler.unscaled(a), scaler.unscaled(b)
            (False, True)
        """
        marks = [vars(scaler).get("_per_optimizer_states", {}) for scaler in (self, self._twin) if scaler is not None]
        for optimizer in optimizers:  # (a disabled scaler keeps no per-optimizer states: its flags, _found_off)
            self._found_off.pop(id(optimizer), None)
            for states in marks:
                states.pop(id(optimizer), None)

    def mark_found_inf_(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the next ``update()`` treat this iteration as an overflow (backoff, tracker reset).

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=64.0)
            >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
            >>> scaler.mark_found_inf_(opt)
            >>> scaler.update()
            >>> scaler.get_scale()
            32.0
        """
        self.add_found_inf_(optimizer, 1.0)

    def add_found_inf_(self, optimizer: torch.optim.Optimizer, found: torch.Tensor | float, *,
                       covers: bool = False) -> None:
        """Merge ``found`` (0 or 1, a tensor: no host read) into what ``unscale_`` recorded, so the
        next ``update()`` backs off when it is 1. ``covers``: ``found`` is 1 whenever what
        ``unscale_`` recorded is (the sync-free step's flag: a non-finite gradient makes the
        norm it tests non-finite), so for a lone optimizer on one device it replaces the record
        rather than being merged into it (no kernel; with several, ``update()`` adds the others'
        flags into the first in place).

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=64.0, growth_interval=1)
            >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
            >>> scaler.add_found_inf_(opt, torch.zeros(()))  # a clean step
            >>> scaler.update()
            >>> scaler.get_scale()
            128.0
        """
        if not self._enabled:
            return
        if self._scale is None:  # the very first step was bad before anything was scaled
            device = next(p.device for g in optimizer.param_groups for p in g["params"])
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None
        record = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not record:
            record[self._scale.device] = torch.zeros((), device=self._scale.device)
        if covers and isinstance(found, torch.Tensor) and len(record) == 1 and len(self._per_optimizer_states) == 1:
            (device, flag), = record.items()
            if found.device == device and found.dtype == flag.dtype:
                record[device] = found
                return
        for flag in record.values():
            if isinstance(found, torch.Tensor):
                torch.maximum(flag, found.to(flag.device, flag.dtype), out=flag)
            elif found:  # a number: filled in on the device (a host tensor would be a copy, and a sync)
                flag.fill_(1.0)

    def update_inputs(self, device: torch.device) -> list[torch.Tensor]:
        """What the next ``update()`` will find, on ``device`` (``[]`` when disabled): the scale,
        the growth tracker, and every found-inf flag recorded so far (``unscale_``'s, of any
        optimizer). Read back with a step's skip decision, they let :meth:`scale_after` tell the
        updated scale on the host, without reading the scale again after the update. All
        float32 (the tracker cast, exact below 2**24): stacked with the step's other float32
        values they make one kernel on a GPU, where a ``cat`` of mixed dtypes copies each input
        with a kernel of its own.

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=512.0)
            >>> _ = scaler.scale(torch.ones(()))
            >>> [(t.item(), t.dtype) for t in scaler.update_inputs(torch.device("cpu"))]
            [(512.0, torch.float32), (0.0, torch.float32)]
            >>> GuardedGradScaler("cpu", enabled=False).update_inputs(torch.device("cpu"))
            []
        """
        if not self._enabled or self._scale is None or self._growth_tracker is None:
            return []
        flags = [f for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        return [t.to(device, torch.float32) for t in (self._scale, self._growth_tracker, *flags)]  # (no-op but the cast)

    def scale_after(self, inputs: list[float], found: bool) -> float | None:
        """What ``update()`` makes of the values ``inputs`` (from :meth:`update_inputs`: scale,
        tracker, found-inf flags) when the step adds its own found-inf ``found`` (a skip it
        marks): PyTorch's ``_amp_update_scale_`` (x ``backoff_factor`` when any flag is set; x
        ``growth_factor``, if that stays finite, on the ``growth_interval``-th clean step in a
        row) and the floor, on the host and bit for bit (the products in double, rounded to
        float32 once, as the kernels compute them); 1.0 for a disabled scaler (bf16, fp32: no
        scale). ``None`` where the host cannot tell: no inputs, a non-finite scale, a tracker
        past float32's exact integers, or a subclass with an ``update`` of its own; the caller
        then reads the scale from the device.

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=4.0, growth_interval=2, min_scale=2.0)
            >>> scaler.scale_after([4.0, 0], False), scaler.scale_after([4.0, 1], False), scaler.scale_after([4.0, 0], True)
            (4.0, 8.0, 2.0)
            >>> scaler.scale_after([4.0, 1, 1.0], False)  # a flag unscale_ recorded backs off too
            2.0
            >>> GuardedGradScaler("cpu", enabled=False).scale_after([], True)
            1.0
        """
        if not self.is_enabled():
            return 1.0
        if len(inputs) < 2 or type(self).update is not GuardedGradScaler.update:
            return None
        scale, tracker, *flags = inputs
        if not math.isfinite(scale) or tracker >= 2**24:
            return None
        if found or any(flags):
            scale = round_float32(scale * self._backoff_factor)
        elif tracker + 1 == self._growth_interval:
            grown = round_float32(scale * self._growth_factor)
            scale = grown if math.isfinite(grown) else scale
        return max(scale, round_float32(self._min_scale))

    def scale_value(self) -> torch.Tensor:
        """The current scale as a detached 0-dim tensor on the scaler's device (no host sync).

        1.0 when the scaler is disabled (bf16, fp32), as the per-step CSV reports it (on the host).

        Example::

            >>> GuardedGradScaler("cpu", init_scale=512.0).scale_value()
            tensor(512.)
            >>> GuardedGradScaler("cpu", enabled=False).scale_value()
            tensor(1.)
        """
        if not self._enabled:
            return self._one(None)
        if self._scale is None:
            return torch.full((), float(self._init_scale))
        return self._scale.detach().clone()

    def scale_tensor(self, device: torch.device) -> torch.Tensor:
        """The scale tensor itself, which the next ``update()`` changes in place (a 1.0 that
        never changes when the scaler is disabled): for an operation that copies it at once, as
        the sync-free step's ``stack`` of its record does, without the copy :meth:`scale_value` makes.

        Example::

            >>> scaler = GuardedGradScaler("cpu", init_scale=512.0)
            >>> scaler.scale(torch.ones(())).item(), scaler.scale_tensor(torch.device("cpu")) is scaler._scale
            (512.0, True)
        """
        if not self._enabled:
            return self._one(device)
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        assert self._scale is not None
        return self._scale

    def _one(self, device: torch.device | None) -> torch.Tensor:
        """A 1.0 on ``device`` (the host by default), the disabled scaler's scale: one tensor a
        device, never written to, serves every record."""
        ones = self.__dict__.setdefault("_ones", {})  # by device (None: the host)
        if device not in ones:
            ones[device] = torch.ones((), device=device or "cpu")
        return ones[device]


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
        """The dtype autocast computes eligible ops in (float32 for fp32: no autocast; bfloat16
        for fp8, whose Float8Linear layers cast their own operands to float8).

        Example::

            >>> [Precision(n, "cpu").dtype for n in PRECISIONS]
            [torch.float16, torch.bfloat16, torch.float32, torch.bfloat16]
        """
        return _DTYPES[self.name]

    @property
    def uses_scaler(self) -> bool:
        """Only fp16 needs loss scaling: its 5-bit exponent underflows small gradients. fp8's
        casts scale each tensor dynamically themselves (torchao), so it runs without one.

        Example::

            >>> [Precision(n, "cpu").uses_scaler for n in PRECISIONS]
            [True, False, False, False]
        """
        return uses_loss_scaler(self.name)

    @property
    def autocasts(self) -> bool:
        """Whether the forward runs under autocast (all but fp32).

        Example::

            >>> [Precision(n, "cpu").autocasts for n in PRECISIONS]
            [True, True, False, True]
        """
        return self.name != "fp32"

    def describe(self) -> str:
        """What this precision computes in, for a run card: the autocast it runs under, or none.

        Example::

            >>> [Precision(n, "cpu").describe() for n in PRECISIONS]
            ['fp16 (autocast on cpu)', 'bf16 (autocast on cpu)', 'fp32 (no autocast)', 'fp8 (float8 Linear layers, the rest autocast to bf16 on cpu)']
        """
        if not self.autocasts:
            return "fp32 (no autocast)"
        if self.name == "fp8":
            return f"fp8 (float8 Linear layers, the rest autocast to bf16 on {self.device_type})"
        return f"{self.name} (autocast on {self.device_type})"

    def support(self, device: torch.device) -> tuple[bool, str | None]:
        """Whether ``device`` can run this precision at all, and a note when it is refused or
        only emulated (slow): the device's half of :meth:`check`, which ``validate``'s
        environment record reports too.

        On a CPU, bf16 and fp16 run at speed only where oneDNN has kernels for them (AVX-512 or
        AMX, :func:`cpu_runs_natively`); elsewhere (an AVX2-only CPU) autocast's matmuls are
        emulated, two orders of magnitude slower than fp32's, and the note says so.

        Example::

            >>> Precision("fp32", "cpu").support(torch.device("cpu"))
            (True, None)
            >>> note = Precision("fp16", "cpu").support(torch.device("cpu"))[1]
            >>> note.startswith("fp16 autocast on ") and "emulated" in note
            True
        """
        if self.autocasts and not torch.amp.is_autocast_available(device.type):
            return False, f"{self.name}: autocast is not available on {device.type}"
        if self.name == "bf16" and device.type == "cuda":
            # torch's answer counts an emulation as support (a bf16 tensor that can be made): a GPU
            # before compute capability 8.0 (V100, T4) runs bf16 matmuls without bf16 kernels, slowly
            if not torch.cuda.is_bf16_supported():
                return False, f"bf16 is not supported on {torch.cuda.get_device_name(device)}: use fp16"
            capability = torch.cuda.get_device_capability(device)
            if not torch.version.hip and capability < (8, 0):
                return True, (f"bf16 on {torch.cuda.get_device_name(device)} (compute capability "
                              f"{capability[0]}.{capability[1]}) is emulated, without bf16 kernels: much slower "
                              "than fp16 there; prefer fp16 on this GPU")
        if self.name in ("fp16", "bf16") and device.type == "cpu":
            return True, _cpu_note(self.name)
        if self.name == "fp8":
            from .fp8 import require_torchao

            try:
                require_torchao()
            except ImportError as err:
                return False, f"precision {err}"
            if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
                return False, (f"fp8 needs a GPU of compute capability 8.9 or newer (H100, L4, RTX 4090...); "
                               f"{torch.cuda.get_device_name(device)} has none: use bf16")
            if device.type == "cpu":
                # review 53a: "emulated by torchao" named the wrong party (torchao's emulate mode is off: real
                # float8 operands go to PyTorch's own CPU kernel)
                return True, ("fp8 on a CPU runs PyTorch's CPU float8 matmul (torch._scaled_mm): right for "
                              "correctness checks, no speed-up")
        return True, None

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast to ``dtype``; for fp32 nothing at all, or autocast
        turned off where one is on already (a caller's: fp32 is FP32 inside it too).

        ``cache=False``: no weight cache (autocast keeps each weight's low-precision copy until
        the block ends: an optimizer step inside the block, Lightning's manual optimization,
        would leave later forwards on the weights before it; Lightning's own plugin turns it off).

        Example::

            >>> with Precision("fp32", "cpu").autocast():
            ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
            torch.float32
            >>> with torch.autocast("cpu", dtype=torch.bfloat16), Precision("fp32", "cpu").autocast():
            ...     torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype
            torch.float32
        """
        if not self.autocasts:
            if torch.is_autocast_enabled(self.device_type):
                return torch.autocast(device_type=self.device_type, enabled=False)
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, cache_enabled=cache)

    @contextlib.contextmanager
    def reference(self) -> Any:
        """The forward context of a reference pass (``validate``'s FP32 reference, ``locate``'s
        FP32 replay): :meth:`autocast`, and for fp32 no TF32 either: cuDNN's convolutions may use
        it by default (``torch.backends.cudnn.allow_tf32``) and matmuls under
        ``torch.set_float32_matmul_precision("high")``; a reference in TF32 would measure AMP's
        error against another reduced precision. The settings are put back after.

        PyTorch 2.9 and later set these per backend (``torch.backends.cuda.matmul.fp32_precision``,
        cuDNN's convolutions and RNNs, oneDNN's on a CPU, which may compute FP32 in bf16): each is
        set to ``"ieee"`` there, and the older settings are not touched (reading them after the
        newer ones were set raises).

        Example::

            >>> conv = _fp32_backends()["cudnn.conv"] if _fp32_backends() else None
            >>> with Precision("fp32", "cpu").reference():
            ...     sorted(set(fp32_settings().values()))
            ['ieee']
            >>> (_fp32_backends()["cudnn.conv"] if _fp32_backends() else None) == conv  # (put back)
            True
        """
        if self.name != "fp32":
            with self.autocast():
                yield
            return
        saved = fp32_settings()
        try:
            set_fp32_settings(dict.fromkeys(saved, "ieee"))
            with self.autocast():
                yield
        finally:
            set_fp32_settings(saved)

    def check(self, model: torch.nn.Module, device: torch.device, held: Collection[int] | None = None,
              say_half: bool = True) -> bool:
        """Refuse what this precision cannot train, up front (``ValueError``, one line each): weights
        already cast to fp16/bf16 (or fp8) under autocast that train or may (mixed precision keeps
        FP32 master weights; float64 ones are kept): trainable ones, and frozen ones an optimizer
        holds (``held``: their ids; unfrozen mid-run they would train in half precision, unsaid:
        review 47g; None: every parameter counts as held). A frozen half backbone no optimizer
        holds, under trained adapters (LoRA's shape), is taken: nothing updates it. Complex weights under fp16 (the loss scaler cannot unscale them), bf16
        on a CUDA device without bf16, fp8 without torchao, on a model with no ``Float8Linear``
        layer (:func:`ampguard.fp8.convert_to_fp8` first) or on a GPU older than compute
        capability 8.9; warn that fp16 on a CPU is emulated (about 10x slower than bf16 there),
        and fp8 too (PyTorch's CPU ``torch._scaled_mm`` runs its float8 matmuls: for correctness,
        not speed). Trainable half weights under fp32 (pure bf16 training) are the user's: said (``say_half``,
        :class:`HalfWeightsWarning`), and the return value is whether there are any, so a caller
        that checks again says it once.

        Example::

            >>> Precision("bf16", "cpu").check(torch.nn.Linear(2, 2).half(), torch.device("cpu"))
            Traceback (most recent call last):
            ...
            ValueError: parameter 'weight' is float16, but bf16 mixed precision keeps FP32 master weights: autocast computes in bf16 while the optimizer updates float32 weights, so small updates are not lost to rounding; keep the model in float32 (no .half() / .to(torch.float16))
        """
        # (float64 weights hold more than the master weights need: theirs to choose)
        # (frozen ones: no master weights to keep, nothing updates them: a bf16 backbone under trained adapters)
        half = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.dtype.itemsize < 4]
        name, param = next(((n, p) for n, p in half if p.requires_grad or held is None or id(p) in held),
                           (None, None)) if self.autocasts else (None, None)
        if param is not None and not param.requires_grad:
            kind = str(param.dtype).removeprefix("torch.")
            raise ValueError(
                f"parameter {name!r} is {kind} and frozen, but an optimizer holds it: unfrozen, it would train in "
                f"{kind}, while {self.name} mixed precision keeps FP32 master weights; give the optimizer the "
                "trainable parameters only (a frozen half backbone no optimizer holds is taken), or keep the model "
                "in float32")
        if param is not None:
            kind = str(param.dtype).removeprefix("torch.")
            # review 53g: the cast named was the precision's, not the weight's: a float16 weight under
            # bf16 was told "(no .half() / .to(torch.bfloat16))" (validate's refusal names it so already)
            undo = ".half() / .to(torch.float16)" if param.dtype == torch.float16 else f".to(torch.{kind})"
            raise ValueError(
                f"parameter {name!r} is {kind}, but {self.name} mixed precision keeps FP32 master weights: "
                f"autocast computes in {self.name} while the optimizer updates float32 weights, so small "
                f"updates are not lost to rounding; keep the model in float32 (no {undo})")
        name, param = next(((n, p) for n, p in half if p.requires_grad), (None, None))
        half_trained = param is not None and not self.autocasts
        if half_trained and say_half:  # (fp32: pure half precision is the user's choice: said)
            kind = str(param.dtype).removeprefix("torch.")
            mixed = "bf16" if param.dtype == torch.bfloat16 else "fp16"
            warn(f"parameter {name!r} is {kind} under precision {self.name}: the guard trains the weights "
                 f"as they are, pure {kind} (no autocast, no loss scaler: small gradients flush to zero in "
                 f"float16; updates rounded to {kind}), and its records say {self.name}; mixed precision is "
                 f"float32 weights with precision {mixed}", HalfWeightsWarning, stacklevel=user_stacklevel())
        if self.uses_scaler:  # (PyTorch's unscale kernel has no complex version: a NotImplementedError mid-step)
            name = next((n for n, p in model.named_parameters() if p.is_complex() and p.requires_grad), None)
            if name is not None:
                raise ValueError(f"parameter {name!r} is complex, which fp16's loss scaler cannot unscale "
                                 "(GradScaler has no complex kernel): train it in bf16 or fp32")
        if self.name == "fp8":  # (the model's half: converted, first; then the device's, below)
            from .fp8 import check_model

            try:
                check_model(model)
            except ImportError as err:
                raise ValueError(f"precision {err}") from None
        elif "torchao" in sys.modules:  # (a model converted to float8 needs torchao imported)
            from .fp8 import fp8_layers

            if layers := fp8_layers(model):
                raise ValueError(f"the model has torchao Float8Linear layers ({listed(layers)}), which train float8 "
                                 f"matmuls under the name {self.name}: use precision fp8, or a model not converted by "
                                 "convert_to_fp8")
        supported, note = self.support(device)
        if not supported:
            raise ValueError(note)
        if note is not None:  # emulated: it runs, slowly
            warn(note, SlowPrecisionWarning, stacklevel=user_stacklevel())
        return half_trained

    def make_scaler(
        self,
        *,
        enabled: bool | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = DEFAULT_MIN_SCALE,
    ) -> GuardedGradScaler:
        """The loss scaler for this precision: enabled for fp16, disabled (scale 1.0) otherwise.

        ``enabled=None`` picks the default; ``enabled=True`` for bf16/fp32 is an error, since
        scaling a format with fp32's exponent range buys nothing and hides bugs.
        ``min_scale`` is the scale's floor (a run passes ``scaler.min_scale``).

        Example::

            >>> s = Precision("fp16", "cpu").make_scaler(init_scale=1024.0, min_scale=1.0)
            >>> s.is_enabled(), s.get_scale(), s.get_min_scale()
            (True, 1024.0, 1.0)
            >>> Precision("bf16", "cpu").make_scaler().is_enabled()
            False
            >>> Precision("bf16", "cpu").make_scaler(enabled=True)
            Traceback (most recent call last):
            ...
            ValueError: bf16 does not use a loss scaler (scaler.enabled must be false)
        """
        if enabled is not None and not isinstance(enabled, bool):  # (review 53n: "false", a text, ran a scaler)
            raise ValueError(f"scaler enabled must be True, False or None, got {enabled!r}")
        if enabled and not self.uses_scaler:
            raise ValueError(f"{self.name} does not use a loss scaler (scaler.enabled must be false)")
        on = loss_scaler_runs(self.name, enabled)
        # what the config refuses, refused for the library too, on or off (a loop that switches precision
        # keeps one set of settings): a backoff of 0 pinned the scale at the float32 floor after one skip
        check_scaler_ranges(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                            min_scale=min_scale, growth_interval=growth_interval)
        return GuardedGradScaler(
            self.device_type,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=on,
            min_scale=min_scale,
        )


SCALER_KEYS = ("enabled", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "min_scale")
"""The settings :meth:`Precision.make_scaler` takes (the config's ``scaler`` section)."""


def check_scaler_settings(precision: str, settings: Mapping[str, Any]) -> None:
    """Loss-scaler settings as a :class:`~ampguard.step.Guard` or an integration is given them (a
    dict), checked where they are given, before any step: each key one of :data:`SCALER_KEYS`,
    each value in its range (:meth:`Precision.make_scaler`'s checks), ``enabled: true`` only for a
    precision that runs a loss scaler. For one that runs none the other settings are taken and do
    nothing (a loop that switches precision keeps one set of them), and said, once, as the CLI
    says the config's ``scaler`` section under bf16 (review 53g: the API dropped them unsaid);
    ``enabled`` alone says nothing. A caller that fills in defaults passes only what applies
    (the trainer, :func:`ampguard.build.scaler_settings`), so it is the user's keys that are named.

    Example::

        >>> check_scaler_settings("fp16", {"init_scale": 1024.0, "min_scale": 1.0})
        >>> check_scaler_settings("bf16", {"enabled": False})
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     check_scaler_settings("bf16", {"init_scale": 4.0, "enabled": False})
        >>> [str(w.message) for w in said]
        ['precision bf16 uses no loss scaler: scaler settings init_scale ignored']
        >>> check_scaler_settings("fp16", {"init_scal": 4.0})
        Traceback (most recent call last):
        ...
        ValueError: scaler settings: unknown key 'init_scal' (the keys: enabled, init_scale, growth_factor, backoff_factor, growth_interval, min_scale)
        >>> check_scaler_settings("bf16", {"enabled": True})
        Traceback (most recent call last):
        ...
        ValueError: bf16 does not use a loss scaler (scaler.enabled must be false)
        >>> check_scaler_settings("fp16", {"backoff_factor": 0})
        Traceback (most recent call last):
        ...
        ValueError: scaler backoff_factor must be in (0, 1), got 0
    """
    if not isinstance(settings, Mapping):
        raise TypeError(f"scaler settings must be a dict, got {type(settings).__name__}")
    unknown = [key for key in settings if key not in SCALER_KEYS]
    if unknown:
        raise ValueError(f"scaler settings: unknown key {brief(unknown[0])} (the keys: {', '.join(SCALER_KEYS)})")
    Precision(precision, "cpu").make_scaler(**settings)  # (the values' ranges; enabled=True without a scaler)
    ignored = [key for key in settings if key != "enabled"]
    if ignored and not uses_loss_scaler(precision):
        warn(f"precision {precision} uses no loss scaler: scaler settings {', '.join(ignored)} ignored",
             AmpguardWarning, stacklevel=user_stacklevel())
    elif ignored and settings.get("enabled") is False:  # (review 53j: said by the CLI, not by the library)
        warn(f"the loss scaler is off (enabled: False): scaler settings {', '.join(ignored)} ignored",
             AmpguardWarning, stacklevel=user_stacklevel())


GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
"""``torch.amp.GradScaler.state_dict()``'s keys: what a stock fp16 run saves (Lightning's
``MixedPrecision``, HF's ``scaler.pt``)."""
_STOCK_SETTINGS = ("growth_factor", "backoff_factor", "growth_interval")
"""The GradScaler settings a stock state carries besides its scale and growth tracker."""


def take_over_stock_scale(scaler: GuardedGradScaler, state: Mapping[str, Any], whose: str) -> tuple[str, str | None]:
    """Load the scale and the growth tracker of a stock ``torch.amp.GradScaler``'s ``state_dict()``
    (a stock fp16 run's checkpoint: Lightning's ``MixedPrecision``, HF's ``scaler.pt``) into the
    guard's new ``scaler``, whose own settings (growth and backoff factors, growth interval,
    floor) are kept: the scale is what the stock scaler found for these weights' gradients, and
    without it the run searched down from ``init_scale`` again (a run of skipped steps). The one
    take-over of the integrations (review 54s: the HF Trainer took the scale alone, restarted the
    count of clean steps at 0, and named no setting it kept), so they say it alike.

    ``state`` must have passed :meth:`GuardedGradScaler.check_state` (the caller's refusal names
    its file). A count of clean steps at or past this ``growth_interval`` restarts at 0 (PyTorch
    grows the scale only when the count reaches the interval: it would never grow); a scale
    below the floor is raised to it. Returns what was taken (``"scale 512 and growth tracker
    2"``, with why where it differs from the state's) and the settings kept that differ from the
    state's (``None`` when none), ``whose`` naming the guard's side (``"this plugin's"``).

    Example::

        >>> scaler = GuardedGradScaler("cpu", growth_interval=3)
        >>> stock = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=5).state_dict()
        >>> take_over_stock_scale(scaler, {**stock, "_growth_tracker": 2}, "this plugin's")
        ('scale 512 and growth tracker 2', "this plugin's scaler settings kept (growth_interval 3, the checkpoint's 5)")
    """
    mine = scaler.state_dict()
    interval, tracker = mine["growth_interval"], int(state["_growth_tracker"])
    kept = tracker if tracker < interval else 0
    scaler.load_state_dict({**mine, "scale": float(state["scale"]), "_growth_tracker": kept})
    said = f"scale {scaler.get_scale():g}"
    if scaler.get_scale() != float(state["scale"]):
        said += f" (the checkpoint's {float(state['scale']):g} raised to min_scale {scaler.get_min_scale():g})"
    said += f" and growth tracker {kept}"
    if kept != tracker:
        said += (f" (the checkpoint's {tracker} clean steps reach {whose} growth_interval {interval}: "
                 f"the count restarts at 0)")
    differ = [f"{name} {mine[name]:g}, the checkpoint's {float(state[name]):g}" for name in _STOCK_SETTINGS
              if float(state[name]) != float(mine[name])]
    return said, (f"{whose} scaler settings kept ({'; '.join(differ)})" if differ else None)


def backend_of(device: torch.device) -> dict[str, Any]:
    """The compute backend behind ``device``: ``rocm`` on a HIP build of PyTorch (which still
    calls an AMD GPU ``cuda``: the same name, not the same kernels or results), ``cuda`` on a
    CUDA device otherwise, else the device type (``cpu``); on a GPU, with the CUDA and HIP
    versions PyTorch was built with (one of them ``None``). Reads no device: only ``torch.version``.

    Example::

        >>> backend_of(torch.device("cpu"))
        {'backend': 'cpu'}
        >>> backend_of(torch.device("cuda"))["backend"] == ("rocm" if torch.version.hip else "cuda")
        True
    """
    if device.type != "cuda":
        return {"backend": device.type}
    hip = getattr(torch.version, "hip", None)
    return {"backend": "rocm" if hip else "cuda", "cuda": torch.version.cuda, "hip": hip}


def backend_text(device: torch.device) -> str:
    """:func:`backend_of` in words, for a report's set-up table.

    Example::

        >>> backend_text(torch.device("cpu"))
        'cpu'
    """
    info = backend_of(device)
    if info["backend"] == "rocm":
        return f"rocm (HIP {info['hip']}; PyTorch names the device cuda)"
    if info["backend"] == "cuda":
        return f"cuda (CUDA {info['cuda']})"
    return info["backend"]


# ---------------------------------------------------------------------------- modules kept in FP32


def to_fp32(value: Any) -> Any:
    """``value`` with its floating tensors (nested in lists, tuples, dicts) cast to float32.

    Example::

        >>> to_fp32((torch.ones(1, dtype=torch.bfloat16), {"n": 3}))
        (tensor([1.]), {'n': 3})
    """
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _fp32_backends() -> dict[str, Any]:
    """The backends PyTorch's per-backend FP32 setting (``fp32_precision``, PyTorch 2.9 and
    later) holds, by name; empty on an older PyTorch."""
    b = torch.backends
    found = {f"{name}.{op}": getattr(getattr(b, name, None), op, None)
             for name, ops in (("cuda", ("matmul",)), ("cudnn", ("conv", "rnn")), ("mkldnn", ("matmul", "conv", "rnn")))
             for op in ops}
    return {name: backend for name, backend in found.items() if hasattr(backend, "fp32_precision")}


def fp32_settings() -> dict[str, Any]:
    """The process's FP32 settings, to put back after a reference pass: each backend's
    ``fp32_precision`` (PyTorch 2.9 and later), else the older two (``float32_matmul_precision``,
    cuDNN's ``allow_tf32``)."""
    backends = _fp32_backends()
    if backends:
        return {name: backend.fp32_precision for name, backend in backends.items()}
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}


def set_fp32_settings(settings: dict[str, Any]) -> None:
    """Set what :func:`fp32_settings` read (``"ieee"`` for each: strict FP32)."""
    backends = _fp32_backends()
    for name, value in settings.items():
        if name in backends:
            backends[name].fp32_precision = value
        elif name == "float32_matmul_precision":
            torch.set_float32_matmul_precision("highest" if value == "ieee" else value)
        elif name == "cudnn.allow_tf32":
            torch.backends.cudnn.allow_tf32 = False if value == "ieee" else value


def fp32_forward(forward: Any) -> Any:
    """``forward`` run with autocast off (on the device its inputs are on) and its floating inputs
    cast to float32: "keep this module in FP32", the usual fix for a layer whose range a lower
    precision cannot hold (``ampguard locate`` tries it on one batch; ``fp32_modules`` keeps it).

    Example::

        >>> lin = torch.nn.Linear(2, 1)
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     lin(torch.ones(1, 2)).dtype, fp32_forward(lin.forward)(torch.ones(1, 2)).dtype
        (torch.bfloat16, torch.float32)
    """
    def forward_in_fp32(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(_device_type_of(args, kwargs), enabled=False):
            return forward(*to_fp32(args), **to_fp32(kwargs))
    return forward_in_fp32


def _device_type_of(args: Any, kwargs: Any) -> str:
    """The device type of the first tensor among a call's arguments (``cpu`` with none)."""
    from torch.utils._pytree import tree_leaves

    return next((t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), "cpu")


def _fp32_method(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A module's forward kept in FP32 (:func:`keep_in_fp32`): the forward it had (an instance
    forward of the user's, kept in ``_forward_before_fp32``; else its class's), through
    :func:`fp32_forward`. A method of the module (bound with ``types.MethodType``), so a copy of
    the model (``copy.deepcopy``) calls its own forward, not the original's."""
    forward = vars(self).get(_FORWARD_BEFORE) or type(self).forward.__get__(self)
    return fp32_forward(forward)(*args, **kwargs)


_FORWARD_BEFORE = "_forward_before_fp32"  # (keep_in_fp32: a module's own instance forward, put back on release)


def submodule(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """``model``'s submodule ``name`` (dotted); one it lacks is a ``KeyError`` naming it and the
    children of the deepest module on its path that exists (where the name went wrong).

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        >>> type(submodule(model, "0.0")).__name__
        'Linear'
    """
    try:
        return model.get_submodule(name)
    except AttributeError:
        parts, found = name.split("."), ""
        for i in range(len(parts), 0, -1):  # (the deepest prefix that is a module)
            try:
                model.get_submodule(".".join(parts[:i - 1]))
                found = ".".join(parts[:i - 1])
                break
            except AttributeError:
                continue
        parent = model.get_submodule(found)
        children = ", ".join(n for n, _ in parent.named_children()) or "none"
        where = f"{found}'s children" if found else "its children"
        raise KeyError(f"the model has no submodule {name!r} ({where}: {children})") from None


def keep_in_fp32(model: torch.nn.Module, names: list[str]) -> None:
    """Run each submodule of ``model`` named in ``names`` in FP32 under autocast (``fp32_modules``):
    its ``forward`` becomes :func:`_fp32_method` (an instance attribute; the parameters, their
    names and the checkpoints are unchanged). Calling it again changes nothing. A name the model
    does not have is a ``KeyError`` naming it.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> keep_in_fp32(model, ["0"])
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     model[0](torch.ones(1, 2)).dtype, model[1](torch.ones(1, 2)).dtype
        (torch.float32, torch.bfloat16)
        >>> keep_in_fp32(model, ["2"])
        Traceback (most recent call last):
        ...
        KeyError: "the model has no submodule '2' (its children: 0, 1)"
        >>> keep_in_fp32(torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2))), ["0.1"])
        Traceback (most recent call last):
        ...
        KeyError: "the model has no submodule '0.1' (0's children: 0)"
    """
    import types

    for name in names:
        module = submodule(model, name)
        before = vars(module).get("forward")
        if getattr(before, "__func__", None) is _fp32_method:  # (kept already)
            continue
        if before is not None:  # an instance forward of the user's (a patched attention): the one kept in FP32
            vars(module)[_FORWARD_BEFORE] = before
        module.forward = types.MethodType(_fp32_method, module)


def release_fp32(model: torch.nn.Module) -> None:
    """Undo :func:`keep_in_fp32` on every submodule of ``model``: each runs the forward it had
    again (an instance forward of its own, or its class's). For a copy that trains in a precision ``fp32_modules`` does not apply to (fp8's, made
    from a model a bf16 pass kept modules of in FP32: the copy's verdict depended on the order of
    ``validation.precisions``).

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> keep_in_fp32(model, ["0"]); release_fp32(model)
        >>> "forward" in vars(model[0])
        False
    """
    for module in model.modules():
        forward = vars(module).get("forward")
        if getattr(forward, "__func__", None) is _fp32_method:
            del module.forward
            if _FORWARD_BEFORE in vars(module):
                module.forward = vars(module).pop(_FORWARD_BEFORE)
