"""The guarded training step: the canonical PyTorch AMP recipe, with its failures made visible.

:class:`Guard` is the step as verbs around the user's own code (``with guard.autocast():`` the
forward and loss, ``guard.backward(loss)``, ``guard.step()``); :class:`AmpTrainState` is the
shortcut that runs ``loss_fn(model(inputs), targets)`` through those verbs.

Per micro-batch:        autocast forward -> loss (fp32) -> finite? -> scaler.scale(loss / N).backward()
At the group boundary:  scaler.unscale_ -> global L2 norm -> ONE host read: skip or not
                        applied: clip to max_norm -> optimizer.step() -> scaler.update() -> scheduler.step()
                        skipped: scale backs off in scaler.update(); scheduler holds; grads dropped

On clean data this is bit-for-bit the hand-written loop with ``clip_grad_norm_``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, TypedDict, TypeVar, Unpack, overload

import torch
from torch import nn

from . import distributed
from .clipping import (HOST_ROUNDED, GradSet, check_max_norm, clip_coefficient, clip_coefficient_value, clip_threshold,
                       clip_to_norm_, coefficient, factor_on_host, post_clip_norm, post_clip_value)
from .errors import AmpguardWarning, user_stacklevel, whole_number, warn
from .precision import GuardedGradScaler, Precision, PrecisionName, SlowPrecisionWarning, check_scaler_settings
from .records import LABEL_COLUMNS, PendingStep, SkipLog, StepLog, loss_origin
from .watch import (_PROBING, STEPPING, UNFROZEN_EVERY, WATCHED, RunningStats, _GuardStepping, _hook_stray_steps,
                    _parameter_count, _parameter_slots, _probe_autocast, _watch_registrations, began_update,
                    first_forward_dtypes, holds_gradients)


def __getattr__(name: str) -> Any:
    """``ampguard.step._note_autocast``: a model pickled whole with the autocast probe's hook on it
    by an ampguard before ``watch.py`` names the hook here."""
    if name == "_note_autocast":
        from .watch import _note_autocast

        return _note_autocast
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


SchedulerOnSkip = Literal["hold", "step"]
Frozen = Literal["refuse", "ignore"]
Models = nn.Module | Sequence[nn.Module] | Mapping[str, nn.Module]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | Mapping[str, torch.optim.Optimizer]


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()}
    if not devices:
        raise ValueError(f"the model has no parameters to train ({type(model).__name__})")
    if len(devices) != 1:
        raise ValueError(f"the model's parameters must live on one device, found {sorted(map(str, devices))}")
    return devices.pop()


def _modules(model: Models) -> list[nn.Module]:
    if isinstance(model, nn.Module):
        return [model]
    try:
        modules = list(model.values()) if isinstance(model, Mapping) else list(model)
    except TypeError:  # (None, a bound forward: list() raised a bare "'NoneType' object is not iterable")
        raise ValueError(f"model must be an nn.Module or a list/dict of them, got {type(model).__name__}") from None
    bad = [m for m in modules if not isinstance(m, nn.Module)]
    if not modules or bad:
        raise ValueError(f"model must be an nn.Module or a list/dict of them, got {type(bad[0] if bad else model).__name__}")
    return modules


def _root(model: Models) -> nn.Module:
    """One module over the model(s), so parameter names say which model: ``1.fc.weight`` for a list,
    ``generator.fc.weight`` for a dict."""
    if isinstance(model, nn.Module):
        return model
    return nn.ModuleDict(model) if isinstance(model, Mapping) else nn.ModuleList(model)


def _named_optimizers(optimizer: Optimizers) -> dict[str, torch.optim.Optimizer]:
    """``{name: optimizer}``: a dict's keys, a list's positions (``"0"``, ``"1"``), ``"optimizer"`` for one."""
    if isinstance(optimizer, Mapping):
        named = {str(k): v for k, v in optimizer.items()}
    elif isinstance(optimizer, (list, tuple)):
        named = {str(i): v for i, v in enumerate(optimizer)}
    else:
        named = {"optimizer": optimizer}
    if not named:
        raise ValueError("no optimizer given")
    for name, opt in named.items():
        if not name or not name.isprintable() or ";" in name:  # (review 50b: a line break split a CSV row in two)
            raise ValueError(f"optimizer name {name!r} cannot name a record's cells: a name is printable, not empty, "
                             "and has no ';' (the CSV's skipped_optimizers cell joins the names with it)")
        if not hasattr(opt, "param_groups"):
            raise ValueError(f"optimizer {name!r} is a {type(opt).__name__}, not an optimizer (no param_groups)")
        if hasattr(opt, "optimizer") and hasattr(opt, "step_was_skipped"):  # (review 55l: torch's AttributeError)
            raise ValueError(f"optimizer {name!r} is Accelerate's prepared {type(opt).__name__}: build the guard with "
                             "ampguard.integrations.accelerate.make_guard(accelerator, model, optimizer, ...), which "
                             "takes the torch optimizer inside it and the accelerator's device, accumulation and "
                             "checkpoints")
        if _needs_closure(opt):  # (LBFGS: a TypeError from inside the first applied step, after it was counted)
            raise ValueError(f"optimizer {name!r} ({type(opt).__name__}) needs a closure in step(), which evaluates "
                             "the loss again itself: the guard steps it once on the gradients it checked, so "
                             "closure optimizers do not fit; use one that steps without a closure")
    return named


def _needs_closure(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` must be given a closure (``LBFGS``: no default for it)."""
    import inspect

    try:
        parameter = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # (a step whose signature cannot be read: taken as it is)
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


class _ReadOnly(dict):  # type: ignore[type-arg]
    """``guard.optimizers``: a dict that refuses changes (``TypeError``), and pickles and copies as
    itself (a ``MappingProxyType`` did not: a Guard could no longer be ``torch.save``'d or deep-copied).

    Example::

        >>> fixed = _ReadOnly({"a": 1})
        >>> fixed["b"] = 2
        Traceback (most recent call last):
        ...
        TypeError: guard.optimizers is read-only: the step read these optimizers when the Guard was built
        >>> import copy, pickle
        >>> copy.deepcopy(fixed), type(pickle.loads(pickle.dumps(fixed))).__name__
        ({'a': 1}, '_ReadOnly')
    """

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("guard.optimizers is read-only: the step read these optimizers when the Guard was built")

    __setitem__ = __delitem__ = __ior__ = pop = popitem = clear = update = setdefault = _refuse

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (dict(self),)


class _Monitors(dict):  # type: ignore[type-arg]
    """``guard.monitors``: name -> an object with ``state_dict()`` / ``load_state_dict()``, fed by
    the loop and saved with the guard's state. A state :meth:`Guard.load_state_dict` found no
    monitor for is kept (``saved``) and loaded when one is registered under its name: a loop
    that builds its monitors after the resume gets them as they were, not fresh, unsaid
    (review 47c). A monitor registered with no saved state starts fresh (one added on resume).

    Example::

        >>> class Count:
        ...     def __init__(self): self.n = 0
        ...     def state_dict(self): return {"n": self.n}
        ...     def load_state_dict(self, state): self.n = state["n"]
        >>> monitors = _Monitors()
        >>> monitors.saved = {"count": {"n": 7}}
        >>> monitors["count"] = Count()
        >>> monitors["count"].n, monitors.saved
        (7, {})
    """

    def __init__(self, items: Any = (), saved: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.saved: dict[str, Any] = dict(saved or {})
        self.update(items)

    def __setitem__(self, name: str, monitor: Any) -> None:
        if name in self.saved:
            monitor.load_state_dict(self.saved[name])
            del self.saved[name]  # (after the load: a state it refused stays for the next try)
        super().__setitem__(name, monitor)

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for name, monitor in dict(*args, **kwargs).items():
            self[name] = monitor

    def setdefault(self, name: str, monitor: Any = None) -> Any:  # type: ignore[override]
        if name not in self:
            self[name] = monitor
        return self[name]

    def __ior__(self, other: Any) -> _Monitors:  # type: ignore[override]
        self.update(other)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (dict(self), self.saved)


def _inner_scheduler(scheduler: Any) -> Any:
    """The torch scheduler inside Accelerate's ``AcceleratedScheduler`` (its ``.scheduler``), or
    ``scheduler`` itself (another's ``.scheduler`` that is no LR scheduler is left alone)."""
    inner = getattr(scheduler, "scheduler", None)
    lr_schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    return inner if getattr(scheduler, "optimizer", None) is None and isinstance(inner, lr_schedulers) else scheduler


def _driven(scheduler: Any) -> Any:
    """The optimizer ``scheduler`` steps the LR of: its ``.optimizer``, or its inner scheduler's
    (Accelerate's prepared ``AcceleratedScheduler`` has none of its own: two swapped were taken)."""
    return getattr(_inner_scheduler(scheduler), "optimizer", None)


def _drives(scheduler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scheduler`` was made over ``optimizer``: its ``.optimizer``, or a wrapper of it
    (a scheduler made over Accelerate's prepared optimizer, whose torch optimizer the guard holds),
    or an optimizer whose param groups are ``optimizer``'s (the same list, or the same group
    dicts): review 54a, a plain wrapper the guard steps (Lookahead's shape: no
    ``torch.optim.Optimizer``, which torch's schedulers refuse) has its scheduler made over the
    optimizer inside it, and that was refused as driving none of the guard's optimizers."""
    driven = _driven(scheduler)
    if driven is None:
        return False
    if driven is optimizer or getattr(driven, "optimizer", None) is optimizer:
        return True
    mine, its = getattr(optimizer, "param_groups", None), getattr(driven, "param_groups", None)
    if not isinstance(mine, list) or not isinstance(its, list) or not mine:
        return False
    return its is mine or (len(its) == len(mine) and all(a is b for a, b in zip(its, mine)))


def _note_update(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """The update the guard just took of ``optimizer``, noted where ``scheduler`` looks for it when
    it was made over a wrapper of it (Accelerate's prepared optimizer, whose torch optimizer the
    guard steps): torch's scheduler wraps that object's ``step`` to set ``_opt_called``, and its
    first ``step()`` warned "Detected call of `lr_scheduler.step()` before `optimizer.step()`"
    (the schedule's first value skipped, which it was not)."""
    driven = _driven(scheduler)
    if driven is not optimizer and _drives(scheduler, optimizer):  # (made over the wrapper, not the optimizer)
        driven._opt_called = True


def _refuse_optimizer(scheduler: Any) -> None:
    """Refuse an optimizer given as a scheduler (review 55l): the guard "steps the scheduler" after
    each applied update, so it was ``optimizer.step()`` again on the same gradients, every update
    applied twice, unsaid. An optimizer is a ``torch.optim.Optimizer`` (Accelerate's prepared
    ``AcceleratedOptimizer`` is one) or has ``param_groups`` and a ``zero_grad()`` (a
    Lookahead-style wrapper); no LR scheduler has a ``zero_grad`` (Accelerate's
    ``AcceleratedScheduler`` neither), though one of the user's may show its optimizer's
    ``param_groups`` (review 56a: it was refused)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):  # (a scheduler, whatever else it shows)
        return
    if isinstance(scheduler, torch.optim.Optimizer) or (
            hasattr(scheduler, "param_groups") and callable(getattr(scheduler, "zero_grad", None))):
        raise ValueError(f"scheduler= was given an optimizer ({type(scheduler).__name__}), not an LR scheduler: the "
                         "guard steps a scheduler after each applied update, so every update would be applied twice; "
                         "pass the optimizer's LR scheduler (torch.optim.lr_scheduler.OneCycleLR(optimizer, ...)), "
                         "or no scheduler=")


def _needs_arguments(scheduler: Any) -> str:
    """The arguments ``scheduler.step()`` cannot go without, named (``''``: none, or none can be
    told: a step of C with no signature).

    Example::

        >>> class Timm:
        ...     def step(self, epoch, metric=None): ...
        >>> _needs_arguments(Timm()), _needs_arguments(torch.optim.lr_scheduler.LambdaLR(
        ...     torch.optim.SGD([nn.Parameter(torch.zeros(1))]), lambda n: 1.0))
        ("'epoch'", '')
    """
    signature = _step_signature(scheduler)
    if signature is None:
        return ""
    try:
        signature.bind()
    except TypeError:
        return ", ".join(repr(name) for name, param in signature.parameters.items()
                         if param.default is param.empty and param.kind not in (param.VAR_POSITIONAL,
                                                                               param.VAR_KEYWORD))
    return ""


def _forwarded_needs(scheduler: Any) -> tuple[Any, str]:
    """The scheduler whose ``step()`` needs arguments that ``scheduler.step()`` called bare cannot
    give it, and those named (:func:`_needs_arguments`): ``scheduler`` itself, or, where its
    ``step`` only hands on what it is given (``*args``/``**kwargs``: a wrapper of yours, Accelerate's
    ``AcceleratedScheduler``), the one it wraps, its ``.scheduler`` or ``.__wrapped__`` (review 56l:
    a timm scheduler so wrapped was taken, and its first step raised after the update was applied).
    ``(scheduler, '')`` when none can be told: a wrapper is judged by its own signature past that.

    Example::

        >>> class Timm:
        ...     def step(self, epoch, metric=None): ...
        >>> class Wrapper:
        ...     def __init__(self, scheduler): self.scheduler = scheduler
        ...     def step(self, *args, **kwargs): return self.scheduler.step(*args, **kwargs)
        >>> inner, needed = _forwarded_needs(Wrapper(Timm()))
        >>> type(inner).__name__, needed
        ('Timm', "'epoch'")
    """
    found, needed = scheduler, _needs_arguments(scheduler)
    for _ in range(8):  # (wrappers of wrappers; a cycle ends here)
        if needed or not _forwards(found):
            break
        inner = next((inner for inner in (getattr(found, "scheduler", None), getattr(found, "__wrapped__", None))
                      if inner is not None and inner is not found and callable(getattr(inner, "step", None))), None)
        if inner is None:
            break
        found, needed = inner, _needs_arguments(inner)
    return (found, needed) if needed else (scheduler, "")


def _forwards(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` takes any arguments it is given (``*args`` or ``**kwargs``)."""
    signature = _step_signature(scheduler)
    return signature is not None and any(param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
                                         for param in signature.parameters.values())


def _step_signature(scheduler: Any) -> inspect.Signature | None:
    """``scheduler.step``'s signature; None where none can be read (a step of C)."""
    try:
        return inspect.signature(scheduler.step)
    except (TypeError, ValueError):
        return None


def _schedulers_of(scheduler: Any, optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, list[Any]]:
    """Which optimizer each scheduler drives: a dict by name, else by the scheduler's own
    ``.optimizer`` (any scheduler object, when there is one optimizer)."""
    out: dict[str, list[Any]] = {name: [] for name in optimizers}
    if scheduler is None:
        return out
    given = scheduler.values() if isinstance(scheduler, Mapping) else (
        scheduler if isinstance(scheduler, (list, tuple)) else [scheduler])
    for sched in given:  # (first: one was taken as a scheduler of its own making, or as driving itself)
        _refuse_optimizer(sched)
    if isinstance(scheduler, Mapping):  # (checked as the other forms are, below: it skipped every check)
        for name, sched in scheduler.items():
            if str(name) not in out:
                raise ValueError(f"scheduler {name!r} names no optimizer; the optimizers are {sorted(out)}")
            driven = _driven(sched)
            if driven is not None and not _drives(sched, optimizers[str(name)]):  # (a GAN's two swapped)
                raise ValueError(f"scheduler {name!r}: the {type(sched).__name__} given drives another optimizer "
                                 f"than {name!r} (it would follow the updates and skips of {name!r}, not those of "
                                 "its own optimizer)")
            out[str(name)].append(sched)
    else:
        for sched in scheduler if isinstance(scheduler, (list, tuple)) else [scheduler]:
            owner = [n for n, o in optimizers.items() if _drives(sched, o)]
            if not owner and len(optimizers) == 1 and _driven(sched) is None:
                owner = list(optimizers)  # (a scheduler of its own making, with no .optimizer: the one there is)
            if not owner:  # (another optimizer's: it was stepped, the guard's schedule never)
                raise ValueError(f"scheduler {type(sched).__name__} drives none of the guard's optimizers; pass the "
                                 "scheduler of the optimizer it steps (several: scheduler={optimizer name: scheduler})")
            out[owner[0]].append(sched)
    for sched in [sched for scheds in out.values() for sched in scheds]:
        if not callable(getattr(sched, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got a {type(sched).__name__}")
        if isinstance(_inner_scheduler(sched), torch.optim.lr_scheduler.ReduceLROnPlateau):  # (prepared too)
            raise ValueError("ReduceLROnPlateau steps on a metric the guard does not have: step it yourself, after "
                             "your evaluation (the guard steps only schedulers that take no argument)")
        needing, needed = _forwarded_needs(sched)
        if needed:  # (timm's step(epoch), or a wrapper handing on to one: the first step raised, its update applied)
            whose = "its step()" if needing is sched else (
                f"its step() hands its arguments to the {type(needing).__name__} it wraps, whose step()")
            raise ValueError(f"scheduler {type(sched).__name__}: {whose} needs an argument ({needed}) and the "
                             "guard calls step() with none after each applied update; pass a scheduler stepped "
                             "per update with no argument (a torch LambdaLR, say), or no scheduler= and step yours "
                             "after guard.step() (timm: scheduler.step_update(guard.updates))")
    scheds = [id(sched) for scheds in out.values() for sched in scheds]
    if len(scheds) != len(set(scheds)):
        raise ValueError("the same scheduler is given twice: it would step twice per update")
    return out


def _holders(root: nn.Module, optimizers: dict[str, torch.optim.Optimizer], device: torch.device,
             held: set[int] | frozenset[int] = frozenset()) -> dict[int, str]:
    """Which optimizer updates each parameter (by id); refused: a parameter on another device,
    one that is not the model's (one of ``held``, the model's when the guard read it, named as
    taken out since), one in two optimizers."""
    names = {id(p): name for name, p in root.named_parameters()}
    holder: dict[int, str] = {}
    for opt_name, opt in optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.device.type != device.type:
                    raise ValueError(
                        f"the optimizer holds a parameter on {p.device.type!r}, the model is on {device.type!r}"
                    )
                if id(p) not in names and id(p) in held:  # (still trained: a gradient would go unclipped, unchecked)
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {list(p.shape)} the model no longer does (taken "
                        "out since the guard read it: bias = None, a deleted adapter): take it out of the optimizer "
                        "too (its param group), or put it back in the model")
                if id(p) not in names:
                    raise ValueError(
                        "the optimizer holds a parameter that is not the model's; the step clips and checks "
                        "the model's parameters, so every optimized tensor must belong to the model (a loss "
                        "module's own parameters: Guard([model, loss_module], optimizer))"
                    )
                if holder.setdefault(id(p), opt_name) != opt_name:
                    raise ValueError(
                        f"parameter {names[id(p)]!r} is in optimizers {holder[id(p)]!r} and {opt_name!r}; its "
                        "gradient would be unscaled twice: give each parameter to one optimizer")
    return holder


def check_settings(max_norm: Any, scheduler_on_skip: Any, frozen: Any) -> None:
    """``Guard()``'s plain settings, before anything is read of the model (and where an
    integration is given them, long before its first step builds the guard).

    Example::

        >>> check_settings(1.0, "hold", "refuse")
        >>> check_settings("abc", "hold", "refuse")
        Traceback (most recent call last):
        ...
        TypeError: max_norm must be a number or None, got 'abc' (a str)
    """
    check_max_norm(max_norm)
    if scheduler_on_skip not in ("hold", "step"):
        raise ValueError(f"scheduler_on_skip must be 'hold' or 'step', got {scheduler_on_skip!r}")
    if frozen not in ("refuse", "ignore"):
        raise ValueError(f"frozen must be 'refuse' or 'ignore', got {frozen!r}")


def _refuse_sparse_clip(root: nn.Module, max_norm: float | None) -> None:
    """A model that makes sparse gradients cannot be clipped (as ``clip_grad_norm_`` cannot:
    ``NotImplementedError`` on torch 2.13), refused up front where a module says so (an
    ``nn.Embedding(sparse=True)``); any other sparse gradient at the step (:func:`_refuse_sparse_grads`)."""
    sparse = [name for name, m in root.named_modules() if getattr(m, "sparse", False) is True]
    if sparse and max_norm is not None and max_norm > 0:
        which = f"module {sparse[0]!r}" if sparse[0] else "the model"
        raise ValueError(f"{which} makes sparse gradients, which PyTorch's clip_grad_norm_ cannot "
                         "clip: pass max_norm=None (the norm and the non-finite check still cover them)")


def _refuse_sparse_grads(root: nn.Module, grads: GradSet, max_norm: float | None) -> None:
    """A sparse gradient at a step that clips is refused, whatever made it. Review 54a: only a
    module's ``sparse=True`` was refused (:func:`_refuse_sparse_clip`); ``F.embedding(...,
    sparse=True)`` passed and its gradient was clipped, where the recipe's ``clip_grad_norm_``
    raises. Nothing to read when the gradients are one foreach group (dense: the common case)."""
    if max_norm is None or max_norm <= 0 or grads._one_group:
        return
    held = next((p for p, g in zip(grads.params, grads.grads) if g.is_sparse), None)
    if held is None:
        return
    name = next((n for n, p in root.named_parameters() if p is held), None)
    which = f"parameter {name!r}" if name is not None else f"a parameter of shape {list(held.shape)}"
    raise ValueError(f"Guard.step(): {which} has a sparse gradient (F.embedding(..., sparse=True)?), which "
                     "PyTorch's clip_grad_norm_ cannot clip: pass max_norm=None (the norm and the non-finite "
                     "check still cover it)")


def _adopt_scaler(scaler: Any, precision: Precision) -> GuardedGradScaler:
    """The guard's loss scaler: a given ``GradScaler`` (made a :class:`GuardedGradScaler`, its
    state kept), else the precision's own, from ``scaler``'s settings (a dict) or its defaults."""
    if not isinstance(scaler, torch.amp.GradScaler):
        check_scaler_settings(precision.name, scaler or {})
        return precision.make_scaler(**(scaler or {}))
    if scaler.is_enabled() and not precision.uses_scaler:
        raise ValueError(f"{precision.name} does not use a loss scaler; pass a disabled one or none")
    if scaler._device != precision.device_type:  # (on a machine without CUDA, torch turns it off silently)
        raise ValueError(f"the scaler is for {scaler._device}, the model on {precision.device_type}: make it "
                         f"GradScaler({precision.device_type!r}, ...)")
    if isinstance(scaler, GuardedGradScaler):
        return scaler
    # review 52g: a subclass's own update (a scale cap), step or unscale_ never ran once its state went to
    # the guard's GuardedGradScaler, and nothing said so: its scale grew past the cap
    overridden = [name for name in _SCALER_BEHAVIOUR
                  if getattr(type(scaler), name) is not getattr(torch.amp.GradScaler, name)]
    if overridden:
        raise ValueError(f"scaler=: {type(scaler).__name__} overrides GradScaler's "
                         f"{', '.join(name + '()' for name in overridden)}; the guard steps with a GuardedGradScaler "
                         "made from its settings and state, so that code would not run: pass no scaler (the guard "
                         "makes its own) or a subclass of ampguard.GuardedGradScaler")
    return GuardedGradScaler.from_scaler(scaler)


_SCALER_BEHAVIOUR = ("scale", "unscale_", "_unscale_grads_", "step", "_maybe_opt_step", "update")
"""The ``GradScaler`` methods whose override a scaler handed to a guard would lose (:func:`_adopt_scaler`)."""


def _check_left_out(root: nn.Module, holder: dict[int, str], frozen: str) -> None:
    """Refuse (unless ``frozen="ignore"``) a parameter that requires grad but no optimizer updates."""
    left_out = [name for name, p in root.named_parameters() if p.requires_grad and id(p) not in holder]
    if left_out and frozen == "refuse":
        raise ValueError(
            f"parameter {left_out[0]!r} requires grad but no optimizer updates it ({len(left_out)} such); its "
            "gradient would be neither unscaled nor cleared: give it to the optimizer, set requires_grad=False, "
            "or pass frozen='ignore'")


_HALF = (torch.float16, torch.bfloat16)  # a loss in these is rounded (Guard.backward says so once)
_RENAMED = {"_frozen": "_unheld_trainable", "_unowned": "_unheld_frozen", "_held": "_held_count",
            "max_norm": "_max_norm"}
"""A Guard's attributes an earlier ampguard named otherwise (:meth:`Guard.__setstate__`)."""


class _Read(NamedTuple):
    """What the step's one host read brought (:meth:`Guard._read_back`): the group's loss and
    pre-clip norm, what carries the post-clip norm (:meth:`Guard._post_clip`), whether the loss
    was non-finite, whether each optimizer's own norm was (several optimizers), and the scaler's
    inputs to its update (:meth:`~ampguard.precision.GuardedGradScaler.update_inputs`)."""

    loss: float
    pre: float
    carried: float
    bad_loss: bool
    bad_each: list[bool]
    scaling: list[float]
    loss_on: str | None = None
    """Under torchrun, whose own loss was not finite (:func:`~ampguard.records.loss_origin`)."""


class _Owed(NamedTuple):
    """A close past its decision, until the step is settled (:meth:`Guard._finish_group`): what
    :meth:`Guard._dropped` still owes the step if the user's code raises now (an optimizer's
    step or hook, a scheduler). ``settled``: ``scaler.update()`` ran, only the schedulers are left."""

    names: tuple[str, ...]
    skipped: tuple[str, ...]
    settled: bool


def _finite_seed(mark: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """The loss checked before backward: the backward's seed, 1.0 (what ``backward()`` seeds
    with) for a finite loss (``mark`` 0), 0.0 for a non-finite one (``mark`` NaN), so the loss's
    own NaN never flows back (a NaN activation still may: the step drops a skipped step's
    gradients whatever they hold). One kernel, written in the scaled loss's dtype into a fresh
    tensor on its device (a ``masked_fill`` and its backward took four); fresh each time, since
    autograd may keep the seed itself as a gradient (a parameter reached through views only).

    Example::

        >>> _finite_seed(torch.tensor(0.0), torch.tensor(2.0, dtype=torch.float16))
        tensor(1., dtype=torch.float16)
        >>> _finite_seed(torch.tensor(float("nan")), torch.tensor(2.0))
        tensor(0.)
    """
    # (``mark`` is +0 or NaN, so ``mark == mark`` is ``mark == 0`` without a wrapped scalar operand; a
    # plain tensor's ``empty_like`` is ``empty((), dtype, device)`` without the keyword parsing: ~6 us fewer
    # a step on a CPU. A subclass's (a DTensor loss) goes the keyword way, a plain tensor as before.)
    out = (torch.empty_like(scaled) if type(scaled) is torch.Tensor and scaled.dim() == 0
           else torch.empty((), dtype=scaled.dtype, device=scaled.device))
    return torch.eq(mark, mark, out=out)


def _handed_backward(backward: Callable[[torch.Tensor], Any], seeded: torch.Tensor) -> None:
    """Run a loop's own ``backward(seeded)`` (``Guard.backward(backward=fn)``) and make sure it
    ran the backward through ``seeded`` once (a hook on it counts; nothing read on the device).
    One that left out the backward of a non-finite loss (``if loss.isfinite(): ...``, a common
    guard of its own) gets it run here, seeded 0 as the guard's own backward seeds it: the step
    skips it as ``non_finite_loss`` with gradients as the guard's own leaves them (and under DDP
    every rank's backward takes part in the all-reduce). One that left out a finite loss's (it
    logged and returned, or backwarded a detached copy) or ran it twice (the gradients doubled)
    is refused: the step would have gone on without this loss, or with it counted twice."""
    reached: list[bool] = []
    handle = seeded.register_hook(lambda grad: reached.append(True))
    try:
        backward(seeded)
    finally:
        handle.remove()
    if len(reached) == 1:
        return
    func = getattr(backward, "func", backward)  # (a functools.partial: its function's name)
    name = getattr(func, "__qualname__", None) or repr(backward)
    if reached:
        raise RuntimeError(f"Guard.backward(): the loop's backward ({name}) ran the backward through the loss it was "
                           f"handed {len(reached)} times (its gradients added {len(reached)} times): run it once")
    if not bool(torch.isfinite(seeded.detach())):  # (a host read, on this path only)
        seeded.backward()  # the loss is non-finite, so its seed is 0: the guard's own backward of it
        return
    raise RuntimeError(f"Guard.backward(): the loop's backward ({name}) returned without a backward through the loss "
                       f"it was handed (call loss.backward() on it, not on a detached copy or another loss)")


def _partition(names: tuple[str, ...], read: _Read) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(skipped, applied)``: all applied when the loss and every gradient were finite; all
    skipped for a non-finite loss, or a non-finite joint norm with no single optimizer's own
    norm to blame (one optimizer, or only their sum overflowed); else the optimizers whose own
    norm was non-finite skip and the others apply (``GradScaler.step``'s semantics).

    Example::

        >>> read = _Read(1.0, math.inf, math.inf, False, [True, False], [])
        >>> _partition(("d", "g"), read), _partition(("d", "g"), read._replace(bad_loss=True))
        ((('d',), ('g',)), (('d', 'g'), ()))
        >>> _partition(("d", "g"), read._replace(pre=2.0))
        ((), ('d', 'g'))
    """
    if not (read.bad_loss or not math.isfinite(read.pre)):  # (a non-finite gradient anywhere makes the joint norm so)
        return (), names
    if read.bad_loss or not any(read.bad_each):  # a loss skip, or one optimizer, or no single culprit
        return names, ()
    skipped = tuple(n for n, bad in zip(names, read.bad_each) if bad)
    return skipped, tuple(n for n in names if n not in skipped)


def _epoch_of(scheduler: Any, depth: int = 0) -> int | None:
    """A scheduler's ``last_epoch``, through a wrapper that has none (Accelerate's
    ``AcceleratedScheduler`` holds the scheduler as ``.scheduler``), or a chain that has none
    (torch's ``ChainedScheduler`` steps each of its ``_schedulers`` once per ``step()``: its first
    one's, which moves as the chain does; review 55l, a chain the loop stepped too went
    unchecked); None when there is none."""
    epoch = getattr(scheduler, "last_epoch", None)
    if epoch is None and depth < 4:  # (a wrapper of a chain of a chain: bounded, a cycle is no scheduler)
        inner = getattr(scheduler, "scheduler", None)
        chain = getattr(scheduler, "_schedulers", None)
        if inner is None and isinstance(chain, (list, tuple)) and chain:
            inner = chain[0]
        if inner is not None:
            return _epoch_of(inner, depth + 1)
    return epoch if isinstance(epoch, int) else None


def sync_free_tail(mark: torch.Tensor, pre: torch.Tensor, applied: torch.Tensor, max_norm: float | torch.Tensor | None,
                   zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sync-free step's scalar arithmetic once the group's loss mark (0, or NaN when a
    micro-batch loss was non-finite) and norm are known: ``(found, clip factor)``, where
    ``found`` is 1.0 when the step must be skipped (the mark or the norm non-finite) and 0.0
    otherwise, and the factor is ``None`` when clipping is off; and ``applied``, the device
    count of applied updates (int64: exact at any count, where a float32 one stopped at 2**24,
    review 55b), advanced in place by ``found == 0`` (a bool, added as 1 or 0: two kernels). ``zero`` is a 0.0 of the norm's
    device. (The host computes the post-clip norm from the factor for a float32 norm: :meth:`Guard._post_clip`.)
    ``max_norm`` as a 0-dim tensor is a threshold that is on (``fuse_tail``'s: :meth:`Guard._threshold_tensor`).

    ``found`` takes two kernels: ``mark + pre * 0`` is 0 for a finite norm and mark, NaN
    otherwise (``inf * 0`` is NaN, IEEE 754), and ``nan_to_num(1.0)`` makes that 0 or 1. Only
    scalar tensor operations, so ``torch.compile`` fuses them into a kernel or two
    (``fuse_tail``); eagerly the clip factor's are the exact path's.

    Example (a non-finite gradient: found, and the count does not advance)::

        >>> applied = torch.tensor(3)
        >>> found, factor = sync_free_tail(torch.tensor(0.0), torch.tensor(float("inf")), applied, 1.0,
        ...                                torch.tensor(0.0))
        >>> found.item(), applied.item()
        (1.0, 3)
        >>> found, factor = sync_free_tail(torch.tensor(0.0), torch.tensor(4.0), applied, 1.0, torch.tensor(0.0))
        >>> found.item(), round(factor.item(), 6), applied.item()
        (0.0, 0.25, 4)
    """
    found = torch.addcmul(mark, pre, zero).nan_to_num_(1.0)
    if found.dtype != torch.float32:  # (a float64 norm): fused optimizers take a float32 flag
        found = found.float()
    factor = coefficient(pre, max_norm) if isinstance(max_norm, torch.Tensor) else clip_coefficient(pre, max_norm)
    applied.add_(found == 0)
    return found, factor


def _fused_momentum_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups of a torch SGD that are fused and carry momentum (:func:`_start_momentum`);
    none for any other optimizer."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [group for group in optimizer.param_groups if group.get("fused") and group.get("momentum", 0) != 0]


def _start_momentum(optimizer: torch.optim.Optimizer) -> None:
    """Zeros as the momentum buffers of a torch fused SGD before its first sync-free step.

    Torch's fused SGD makes its buffers at its first step with ``empty_like`` and lets the
    kernel fill them (``buf = g``), but the kernel returns before that when ``found_inf`` is 1:
    a sync-free step that skipped the first update left uninitialised memory as the momentum,
    and the next applied update moved the weights by it (1e11 on a CPU; found by fuzzing the
    step against the recipe, review 61b; a plain ``GradScaler.step`` over a fused SGD does the
    same). From zeros the kernel's ``momentum x 0 + (1 - dampening) x g`` is its first step's
    ``g`` bit for bit (dampening 0: ``_check_sync_free`` refuses another), and a skipped step
    leaves them 0, so the next applied one is that first step again. Called when the state is
    empty (the first step, or a state loaded from before one): O(1) on every other step.

    Example::

        >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.full((2,), math.inf)
        >>> sgd = torch.optim.SGD([w], lr=torch.tensor(0.1), momentum=0.9, fused=True)
        >>> _start_momentum(sgd); sgd.found_inf = torch.tensor(1.0); sgd.step()
        >>> sgd.state[w]["momentum_buffer"], w.detach()
        (tensor([0., 0.]), tensor([1., 1.]))
    """
    for group in _fused_momentum_groups(optimizer):
        for p in group["params"]:
            if p.grad is not None and optimizer.state[p].get("momentum_buffer") is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)


@functools.cache
def _compiled_tail() -> Callable[..., Any]:
    """:func:`sync_free_tail` compiled once per process (``torch.compile``, the whole graph), given
    the clip threshold as a tensor: a number is a constant of the graph, so each ``max_norm`` set
    between steps (or another guard's) compiled it again, and the ninth value raised dynamo's
    recompile limit out of ``step()`` (``fullgraph``)."""
    return torch.compile(sync_free_tail, fullgraph=True, dynamic=False)


_Held = TypeVar("_Held")


class _SetOnce(Generic[_Held]):
    """An attribute set once, in ``Guard()``: the step reads what it holds then (the parameters it
    checks, the LR schedule), so a later assignment would be ignored, silently; it is refused.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
        >>> guard.optimizer = torch.optim.Adam(model.parameters())
        Traceback (most recent call last):
        ...
        AttributeError: Guard.optimizer is set once, in Guard(): the step would go on with the one it read; build a new Guard (scaler=old.scaler, then load_state_dict(old.state_dict()))
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.public = name

    # No __get__: the value lives in the instance's __dict__ under its own name, so reading it is a
    # plain attribute read (the step reads the scaler a dozen times); only assignment comes here.
    # A type checker is told what a read gives, ``_SetOnce[T]``'s T (review 56e: guard.optimizer was
    # "_SetOnce", without attributes, to mypy and pyright); the run never defines it.
    if TYPE_CHECKING:
        @overload
        def __get__(self, obj: None, owner: type) -> _SetOnce[_Held]: ...
        @overload
        def __get__(self, obj: object, owner: type) -> _Held: ...
        def __get__(self, obj: object, owner: type) -> _SetOnce[_Held] | _Held: ...

    def __set__(self, obj: Any, value: Any) -> None:
        if self.public in obj.__dict__:
            raise AttributeError(f"Guard.{self.public} is set once, in Guard(): the step would go on with the one it "
                                 "read; build a new Guard (scaler=old.scaler, then load_state_dict(old.state_dict()))")
        obj.__dict__[self.public] = value


REPLICA_TRIES = 16
"""The steps an optimizer's replica check waits for a norm finite and not 0 on every rank before
it gives up on that optimizer (its gradients stay 0, or it skips every step: an all-reduce and a
host read a step, otherwise for ever; review 48g)."""


def _of_optimizer(name: str, optimizers: Mapping[str, Any]) -> str:
    """`` of optimizer 'd'`` where a guard has several, else nothing."""
    return f" of optimizer {name!r}" if len(optimizers) > 1 else ""


class UnsyncedReplicasWarning(AmpguardWarning):
    """Under several processes the ranks' gradients differ at the guard's first step: each rank
    applies its own (a model not wrapped in DDP or FSDP2), and the replicas drift apart."""


class ScaledEditWarning(AmpguardWarning):
    """Under fp16's loss scaler, a gradient changed between ``guard.backward()`` and the guard's
    unscale (an ``on_after_backward`` edit under Lightning): a clip there acts on gradients the loss
    scale times too large, a mask or another multiplication is sound (review 55e, a warning since
    review 55n: the two cannot be told apart)."""


class ShortGroupWarning(AmpguardWarning):
    """``guard.unscale_()`` before an accumulation group's last backward (a ported loop's
    ``unscale_`` outside its ``if boundary:``): the ``step()`` after it ends the group short, its
    update made of fewer micro-batches than the losses were divided by (review 53g)."""


class Guard:
    """The guarded mixed-precision step as verbs around your own forward and loss.

    Per micro-batch: run the forward and the loss inside ``with guard.autocast():``, then
    ``guard.backward(loss)`` (checked on the device, divided by the accumulation steps, scaled,
    backward; no gradient all-reduce mid-group under DDP/FSDP2), then ``guard.step()``: ``None``
    inside an accumulation group, else a :class:`StepLog` (applied) or :class:`SkipLog`
    (non-finite loss or gradient: parameters and optimizer state untouched, the loss scale
    backed off, the scheduler held). Calls out of that order raise ``RuntimeError``.

    Example (a model that computes its own loss, as a Hugging Face model does)::

        >>> model = torch.nn.Linear(4, 1)
        >>> guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> with guard.autocast():
        ...     loss = ((model(x) - y) ** 2).mean() + 0.01 * model.weight.abs().sum()
        >>> guard.backward(loss)
        >>> record = guard.step()
        >>> record.step, record.skipped, guard.updates
        (1, False, 1)
        >>> guard.step()
        Traceback (most recent call last):
        ...
        RuntimeError: Guard.step() called twice: the order is `with guard.autocast(): loss = ...`, guard.backward(loss), guard.step()

    Host syncs: one per step, the skip decision (the same read ``GradScaler.step`` makes for a
    non-fused optimizer; the step calls ``optimizer.step()`` itself once it knows, so the read
    is not made twice). That read brings the loss and norms over with the decision (they stay
    device tensors in the record), and fp16's scale and growth tracker, from which the host
    tells the scale after ``update()`` bit for bit: a sink reads nothing from the device again.

    Under fp16/bf16 the first forward inside ``guard.autocast()`` notes each leaf module's output
    dtype in :attr:`autocast_dtypes` (the layers autocast left in float32; hooks for that forward
    only: :func:`~ampguard.watch.first_forward_dtypes`); ``None`` before it and under fp32.

    The parameters checked, measured and clipped are the optimizer's (in the model's order),
    read again when their number changes (``add_param_group`` mid-run). A
    model parameter that requires grad but no optimizer updates is refused, or, with
    ``frozen="ignore"``, has its gradient dropped every step; never silently accumulated.

    Args:
        model: any ``nn.Module`` (DDP/FSDP2-wrapped under torchrun), in float32: autocast
            computes in the low precision, the optimizer updates FP32 master weights. Several
            models (a GAN's generator and discriminator) as a list or a dict of modules.
        optimizer: any optimizer over the model's parameters (fused AdamW included), or several
            as a dict ``{name: optimizer}`` (or a list, named ``"0"``, ``"1"``, ...): each
            parameter in at most one. ``step()`` steps them all, ``step(name)`` those named; each
            is skipped when its own gradients are non-finite (``GradScaler``'s semantics), all
            of them for a non-finite loss or a joint norm no single one's explains; the clip
            covers what is applied, and the records name them (:attr:`record_columns`).
        precision: ``"fp16"`` (with a loss scaler), ``"bf16"``, ``"fp32"``, or ``"fp8"`` for a model
            converted by :func:`~ampguard.fp8.convert_to_fp8` first (torchao's float8 layers, bf16
            autocast around them); or a :class:`Precision`.
        max_norm: global L2 clip threshold; ``None`` or ``<= 0`` disables clipping.
        accumulation_steps: micro-batches per optimizer update; each loss is divided by it.
        scheduler: an LR scheduler stepped once per applied update of its optimizer; with
            several optimizers a list (each matched by its ``.optimizer``) or ``{name: scheduler}``.
        device: the autocast device; defaults to the model's. A different one is an error.
        scaler: a ``GuardedGradScaler`` to use, a plain ``torch.amp.GradScaler`` (its settings
            and state are taken over), or keyword arguments for one (``init_scale``,
            ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``min_scale``; under a
            precision that runs no loss scaler said ignored, all but ``enabled``).
        scheduler_on_skip: ``"hold"`` (default) or ``"step"`` the scheduler on a skipped step
            (``"step"`` is the exact step's: refused with ``sync_free``, whose schedule counts
            applied updates).
        sync_free: the fast path with **no** host read at all (see ``_finish_group_sync_free``):
            needs an optimizer that takes ``found_inf`` (fused AdamW / Adam / SGD) and tensor
            learning rates; a schedule is ``lr_schedule`` or one on the device as ``scheduler``
            (:class:`~ampguard.schedule.DeviceLambdaLR`, which the step drives, never steps), a
            host scheduler is refused, and with neither the learning rate stays as it is. A fused
            SGD's momentum buffers start at zero (torch's leaves them unset when a skip holds
            its first step; dampened momentum is refused).
            ``step()`` then returns a :class:`PendingStep` whose skip decision is read by
            whoever reads its values.
        lr_schedule: with ``sync_free`` (refused without it, and beside a ``scheduler``),
            ``lr_schedule(applied_updates) -> factor`` on tensors, computed on the device (the count
            handed over as a float32 tensor, as it always was: exact to 2**24 = 16,777,216 updates,
            past that a multiple of 2, then 4; the guard's own count is int64 and exact, and a
            :class:`~ampguard.schedule.DeviceLambdaLR` given as ``scheduler`` gets it as it is); each
            group's lr is its ``initial_lr`` times the factor (set from its lr the first time, as
            torch's schedulers set it, and saved with the optimizer's state: a resume that loads
            the optimizer before building the guard keeps the base). It advances only on applied
            updates, so it holds on skipped steps.
        frozen: ``"refuse"`` (default) a model parameter that requires grad but is in no
            optimizer, or ``"ignore"`` it (its gradient is dropped every step).
        fuse_tail: with ``sync_free``, run the step's scalar tail (:func:`sync_free_tail`: the
            skip flag, the clip factor, the update count) compiled by
            ``torch.compile`` into a kernel or two instead of a dozen launches: for launch-bound
            models on a GPU. Inductor's arithmetic may differ from eager in the last bit.
    """

    # the notes a raise leaves for a loop that catches it and goes on ("the next guard.backward()
    # begins a new step"); ``ampguard train``, which ends the run at any raise and whose user never
    # called the guard, turns them off (review 53e: a peer's death ended rank 0's traceback with it)
    _loop_notes = True
    # the optimizer whose step() raised after it may have begun its update (set on the error path
    # only, read and cleared by _dropped: its note says the update may be partly applied; review 55r)
    _partly: str | None = None
    # sync_free over a torch fused SGD with momentum: its buffers are set to 0 before its first step
    # (_start_momentum: a first step skipped by found_inf left them uninitialised; review 61b)
    _fused_momentum = False
    # fuse_tail's clip threshold as a tensor, and the (max_norm, dtype, device) it was made for (_threshold_tensor)
    _threshold: tuple[tuple[float, torch.dtype, torch.device], torch.Tensor] | None = None

    # the optimizer itself when there is one, else {name: optimizer} (guard.optimizers always the latter)
    optimizer: _SetOnce[torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer]] = _SetOnce()
    optimizers: _SetOnce[Mapping[str, torch.optim.Optimizer]] = _SetOnce()
    scheduler: _SetOnce[Any] = _SetOnce()  # (as given: None, a scheduler, a list or dict of them)
    # (a model assigned later was ignored, every step "applied" with norm 0; a precision or scaler
    # assigned later failed deep inside the step with an AttributeError)
    model: _SetOnce[Models] = _SetOnce()
    precision: _SetOnce[Precision] = _SetOnce()
    scaler: _SetOnce[GuardedGradScaler] = _SetOnce()
    device: _SetOnce[torch.device] = _SetOnce()

    def __init__(
        self,
        model: Models,
        optimizer: Optimizers,
        *,
        precision: PrecisionName | Precision = "fp16",
        max_norm: float | None = 1.0,
        accumulation_steps: int = 1,
        scheduler: Any = None,
        device: str | torch.device | None = None,
        scaler: torch.amp.GradScaler | dict[str, Any] | None = None,
        scheduler_on_skip: SchedulerOnSkip = "hold",
        sync_free: bool = False,
        lr_schedule: Callable[[torch.Tensor], torch.Tensor] | None = None,
        frozen: Frozen = "refuse",
        fuse_tail: bool = False,
    ) -> None:
        check_settings(max_norm, scheduler_on_skip, frozen)
        if isinstance(model, torch.optim.Optimizer) or isinstance(optimizer, nn.Module):
            raise TypeError("Guard(model, optimizer, ...): the model comes first, then its optimizer")
        modules = _modules(model)
        root = _root(model)
        model_device = _model_device(root)
        if model_device.type == "meta":  # (fp32 failed at its first autocast() deep in torch)
            raise ValueError("the model is on the meta device (its parameters are not made yet): materialise it "
                             "(to_empty(), then load or initialise the weights) before Guard()")
        device = torch.device(device) if device is not None else model_device
        if device.type != model_device.type:
            raise ValueError(
                f"autocast device {device.type!r} does not match the model's device {model_device.type!r}"
            )
        optimizers = _named_optimizers(optimizer)
        holder = _holders(root, optimizers, device)
        if fuse_tail and not sync_free:
            raise ValueError("fuse_tail compiles the sync-free step's tail: pass sync_free=True too")
        if lr_schedule is not None and not sync_free:  # (it was ignored: a warm-up trained at the full LR)
            raise ValueError("lr_schedule sets the sync-free step's LR on the device: pass sync_free=True too, or "
                             "give your scheduler as scheduler= (the guard steps it on applied updates)")
        if lr_schedule is not None and scheduler is not None:
            raise ValueError("sync_free takes lr_schedule= or a DeviceLambdaLR as scheduler=, not both")
        if sync_free and len(optimizers) > 1:
            raise ValueError("sync_free takes one optimizer; several step with one host read per step")
        if sync_free and scheduler_on_skip == "step":  # (it was ignored: the LR held on every skipped step)
            raise ValueError("scheduler_on_skip='step' needs the exact step: the sync-free step's schedule counts "
                             "applied updates on the device, so it holds on a skipped step; use "
                             "scheduler_on_skip='hold', or sync_free=False")

        if not isinstance(precision, Precision):
            precision = Precision(precision, device.type)
        if precision.device_type != device.type:
            raise ValueError(
                f"autocast device {precision.device_type!r} does not match the model's device {device.type!r}"
            )
        half_said = precision.check(root, device, held=holder)  # (half weights under fp32: said, once)
        _check_left_out(root, holder, frozen)
        _refuse_sparse_clip(root, max_norm)

        self.model = model
        # read-only: the step read them once (their parameters, schedulers, counters); one added or
        # swapped in the dict later would be half known to it
        optimizers = _ReadOnly(optimizers)
        # the optimizer itself when there is one (a one-entry list or dict too), else {name: optimizer}
        self.optimizer = next(iter(optimizers.values())) if len(optimizers) == 1 else optimizers
        self.optimizers = optimizers
        self.precision = precision
        self.max_norm = max_norm
        self._micro = 0  # micro-batches so far in the open group (before the setter below reads it)
        self.accumulation_steps = accumulation_steps
        self.scheduler = scheduler
        self._schedulers = _schedulers_of(scheduler, optimizers)
        self.scheduler_on_skip = scheduler_on_skip
        # each scheduler's ``last_epoch`` as the guard left it at a group's end (see _check_schedulers)
        self._scheduler_epochs: dict[int, int] = {}
        self.device = device
        self.scaler = _adopt_scaler(scaler, precision)

        self._half_loss_said = False  # (a float16/bfloat16 loss: said once, Guard.backward)
        self._short_group_said = False  # (a group closed short by an early unscale_(): said once, Guard.step)
        # until each optimizer's first group closes, under fp16's loss scaler: a gradient changed between
        # backward() and the unscale (a clip_grad_norm_ of the loop's own) is warned of (_check_scaled_edits),
        # once a guard; the optimizers not checked yet (empty: nothing to do), and the last backward's
        # gradients and their version counters, meanwhile
        self._edits_unchecked: set[str] = set(optimizers) if self.scaler.is_enabled() else set()
        self._grads_seen: list[tuple[torch.Tensor, torch.Tensor | None, int]] | None = None
        self._half_said = half_said
        self.monitors: dict[str, Any] = _Monitors()  # fed by the loop, saved here: name -> obj with state_dict()
        # called at a skipped step, before its gradients are dropped (diagnostics: nothing on applied
        # steps), with the group's GradSet (its per-parameter norms, where the global norm took them)
        self.skip_hooks: list[Callable[[GradSet], None]] = []
        # sync_free: called at every group's end before clipping (whether it skips is not known yet)
        self.group_hooks: list[Callable[[GradSet], None]] = []
        self.steps = 0  # optimizer steps attempted (closed groups); the next record is steps + 1
        self.sync_free = sync_free
        self.fuse_tail = fuse_tail
        self.lr_schedule = lr_schedule
        self._updates = 0  # steps applied in full (a device count in the sync-free path)
        self._applied = dict.fromkeys(optimizers, 0)  # updates each optimizer applied (read with several)
        if sync_free:
            self._check_sync_free(self.optimizer, scheduler)
            # on the parameters' device (``device`` may name only the type: "cuda" for a model on cuda:1)
            # (int64: exact at any count; a float32 count stopped at 2**24, review 55b)
            self._updates_t = torch.zeros((), dtype=torch.int64, device=model_device)
            self._zero = torch.zeros((), device=model_device)  # (never written: the tail's ``pre * 0``)
            self._base_lrs = [_initial_lr(group) for group in self.optimizer.param_groups]
            self._fused_momentum = bool(_fused_momentum_groups(self.optimizer))  # (its buffers start at 0: _start_momentum)
            if scheduler is not None:  # a schedule on the device reads the same count (its state_dict, at saves)
                scheduler.applied = self._updates_t
        self._modules, self._root, self._frozen_mode = modules, root, frozen
        # (under several ranks: do they apply the same gradients? each optimizer's first step tells)
        self._replicas_unjudged = set(optimizers)
        self._replicas_tries: dict[str, int] = {}  # (steps each has had with nothing to tell by)
        # the running statistics (BatchNorm's) each step's forward writes: put back on a skip
        self._running_stats = RunningStats(modules)
        _watch_registrations()
        self._own(holder)
        self._group: tuple[str, ...] | None = None  # the optimizers the open group steps
        self._backward_pending = False  # backward() ran, step() not yet
        self._loss_sum: torch.Tensor | None = None  # the open group's losses, summed
        self._loss_mark: torch.Tensor | None = None  # the sum of each loss's x - x: NaN iff one was non-finite
        self._grads_made = False  # the open group's backwards made a gradient (its later ones must find it)
        self._stepped: tuple[str, ...] | None = None  # inside a close: the optimizers that stepped
        self._tail_found: torch.Tensor | None = None  # inside a sync-free close: the tail's skip flag
        self._owed: _Owed | None = None  # inside a close, past its decision: what a raise leaves owed
        # the first step's forward: did it run under autocast? (_probe_autocast; gone after the first backward)
        self._forward_autocast: torch.dtype | bool | None = None  # (its autocast dtype, False: none)
        # (under fp32 too: a loop's own torch.autocast(float16) left in trained fp16 with no loss
        # scaler, its records saying fp32, unsaid; review 51c)
        self._autocast_probes = _probe_autocast(self, modules)
        # each leaf module's output dtype in the first forward under autocast() (None until then,
        # and in fp32): the layers autocast left in float32 (_noting_dtypes)
        self.autocast_dtypes: dict[str, str] | None = None
        _hook_stray_steps(self, optimizers)  # (last: a Guard() refused is never watched)

    @property
    def max_norm(self) -> float | None:
        """The global L2 norm the gradients are clipped to (``None``, 0 or less: no clipping).
        Set between steps, it is checked as ``Guard()`` checks it (a NaN read as "clipping off", a
        string failed deep inside the step, a model of sparse gradients was clipped)."""
        return self._max_norm

    @max_norm.setter
    def max_norm(self, value: float | None) -> None:
        check_max_norm(value)
        root = self.__dict__.get("_root")  # (Guard() checked the model before it set this)
        if root is not None:
            _refuse_sparse_clip(root, value)
        # a one-element tensor is read here, once, as PyTorch's clip reads it (``float(max_norm)``):
        # every step then clips with a number, the sync-free one with no host read of it
        self._max_norm = float(value) if isinstance(value, torch.Tensor) else value

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickle, ``torch.save``) keeps what the guard knows of its
        schedulers by their order, not by ``id()`` (the copy's schedulers are other objects)."""
        state = self.__dict__.copy()
        state["_scheduler_epochs"] = [self._scheduler_epochs.get(id(s)) for s in self._every_scheduler()]
        state["_autocast_probes"] = []  # (the original's hooks on its modules; a copy does not probe)
        state.pop("_running_stats", None)  # (the original's layers: the copy keeps its own model's)
        state["_grads_seen"] = None  # (the original's gradients: a copy does not hold them)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy watches its own optimizers for a stray ``optimizer.step()`` as the original does."""
        epochs = state.pop("_scheduler_epochs")
        for old, new in _RENAMED.items():  # (a guard pickled by an ampguard before the names changed)
            if old in state:
                state[new] = state.pop(old)
        self.__dict__.update(state)
        self.__dict__.setdefault("_half_loss_said", False)  # (a guard pickled before they were kept)
        self.__dict__.setdefault("_half_said", True)
        self.__dict__.setdefault("_replicas_unjudged", set())
        self.__dict__.setdefault("_replicas_tries", {})
        unchecked = self.__dict__.setdefault("_edits_unchecked", set())
        if isinstance(unchecked, bool):  # (a guard pickled when it was one flag for the first group)
            self._edits_unchecked = set(self.optimizers) if unchecked else set()
        self.__dict__.setdefault("_grads_seen", None)
        if self.__dict__.get("sync_free") and "_fused_momentum" not in state:  # (a guard pickled before review 61b)
            self._fused_momentum = bool(_fused_momentum_groups(self.optimizer))
        self.__dict__.pop("_edit_let_through", None)
        if "_slots" not in state and "_root" in state:  # (a guard pickled before the slots were read)
            self._slots = _parameter_slots(self._root)
        self._running_stats = RunningStats(getattr(self, "_modules", []))
        self._scheduler_epochs = {id(s): e for s, e in zip(self._every_scheduler(), epochs) if e is not None}
        # (a deep copy's optimizers are new; a shallow copy shares the original's, which stay its)
        _hook_stray_steps(self, self.optimizers, taken=False)

    def _end_autocast_probe(self) -> None:
        """After the first forward: the probes go, and a forward that ran without autocast, or
        under another autocast dtype than the guard's, is said once
        (:class:`~ampguard.errors.AmpguardWarning`): a loop that forgot ``with guard.autocast():``
        trains in float32, its loss scaled for nothing; one that kept its own
        ``torch.autocast(dtype=torch.float16)`` under a bf16 or an fp32 guard runs fp16 with no
        loss scaler (small gradients flush to zero), unsaid. A forward the probe did not see (compiled, or not
        through the model's ``__call__``) leaves the hooks in place (removing them would make
        ``torch.compile`` compile the model again) and says nothing."""
        seen = self._forward_autocast
        if seen is None:  # (left to go with the guard: _probe_autocast's finalizer)
            self._autocast_probes = []
            return
        self._drop_autocast_probe()
        where = f"Guard(precision={self.precision.name!r}): the model's forward ran"
        if seen is False and not self.precision.autocasts:  # (fp32: no autocast is the precision asked for)
            return
        if seen is False:
            warn(f"{where} without autocast (outside `with guard.autocast():`): it computes in float32, no "
                 "mixed precision; put the forward and the loss inside that block", AmpguardWarning,
                 stacklevel=user_stacklevel())
        elif seen != self.precision.dtype:
            said = str(seen).removeprefix("torch.")
            scaler = "" if self.scaler.is_enabled() else ", with no loss scaler"
            warn(f"{where} under autocast({said}), not the guard's {str(self.precision.dtype).removeprefix('torch.')}{scaler}: "
                 f"a torch.autocast of the loop's own? use `with guard.autocast():`", AmpguardWarning,
                 stacklevel=user_stacklevel())

    def _drop_autocast_probe(self) -> None:
        """The probe's hooks off the models now, nothing said: ``ampguard train`` before it compiles
        the model in place (it runs every forward inside ``autocast()``; a hook left there was
        compiled by dynamo as a frame of its own, noting nothing, and compiled again at the first
        evaluation, under ``torch.no_grad()``: a recompile the bare compiled loop has not)."""
        handles, self._autocast_probes = self._autocast_probes, []
        for handle in handles:
            handle.remove()
        for module in self._modules:
            if (probing := _PROBING.get(module)) is not None:
                probing.discard(self)

    def _every_scheduler(self) -> list[Any]:
        return [scheduler for schedulers in self._schedulers.values() for scheduler in schedulers]

    def _own(self, holder: dict[int, str]) -> None:
        """What is checked, measured and clipped: each optimizer's parameters, in the model's order
        (``holder``: parameter id -> the optimizer that updates it); and what is dropped unused."""
        root = self._root
        self._owned = [(p, holder[id(p)]) for p in root.parameters() if id(p) in holder]  # (param, optimizer)
        self._params_of = {n: [p for p, owner in self._owned if owner == n] for n in self.optimizers}
        # what no optimizer holds: trained (its gradient dropped each step, frozen="ignore"), or
        # frozen now (unfrozen later, it is refused, or dropped)
        self._unheld_trainable = [p for p in root.parameters() if p.requires_grad and id(p) not in holder]
        self._unheld_frozen = [p for p in root.parameters() if not p.requires_grad and id(p) not in holder]
        self._held_count = _parameter_count(self.optimizers)
        self._registered = WATCHED.registered
        self._slots = _parameter_slots(root)
        # each parameter's dtype: a model cast after Guard() (model.to(torch.bfloat16)) keeps its
        # Parameter objects, so only their dtype tells (the first one's every group, every one's less often)
        self._dtypes = [p.dtype for p, _ in self._owned]
        self._look_all = False  # every parameter looked at by the next group's first backward (after a restore)

    def _abandon_group(self) -> None:
        """Drop the open group: its gradients, and what it unscaled forgotten (a restore; a
        refusal at its close, which leaves nothing to fold into the next step)."""
        self._micro = 0
        self._group = None
        self._backward_pending = False
        self._grads_seen = None  # (the first group's gradients, held for the edit check: let go)
        self.scaler.forget_unscaled(self.optimizers.values())
        self._zero_grad()
        self._running_stats.forget()  # (a restore loaded the model's statistics: the next forward copies them)

    def _discard_group(self) -> None:
        """Drop the open group as if its micro-batches had not been taken: its gradients and what
        it unscaled (:meth:`_abandon_group`), and the running statistics its forwards wrote put
        back, as a skip puts them back. The run's loop, when the data fails inside a group: the
        model is then the last closed step's, whole, to checkpoint (review 50a)."""
        self._running_stats.end_step(skipped=True)
        self._abandon_group()

    def _parameters_changed(self) -> bool:
        """Whether what :meth:`_own` read may be out of date: the optimizers hold another number of
        parameters (``add_param_group``), a module or parameter was registered anywhere since
        (``watch.WATCHED.registered``: an adapter added to the model without its optimizer), the first
        parameter's dtype changed (the model cast after ``Guard()``), or, at the first group (a
        restored guard's too) and every :data:`UNFROZEN_EVERY` groups, a parameter no optimizer
        holds requires grad again, any parameter's dtype changed (one layer cast alone:
        ``model[2].to(torch.bfloat16)``), or the model holds another number of parameters (one
        a compiled forward made: no count while dynamo traces; one taken out). O(1)
        but those looks, O(parameters) and O(modules) spread over the groups (a frozen backbone's
        thousands of tensors, ~45-105 ns each, and ~0.8 us a module). The registration
        count is the process's: a module built anywhere (an evaluator's, a metric's) is a false
        alarm here, which the next group pays with a whole :meth:`_own_again`."""
        if _parameter_count(self.optimizers) != self._held_count or WATCHED.registered != self._registered:
            return True
        if self._owned and self._owned[0][0].dtype != self._dtypes[0]:  # (checked again as at Guard())
            return True
        if self.steps % UNFROZEN_EVERY and not self._look_all:
            return False
        self._look_all = False  # (set by a restore: its first group looks, wherever its count is)
        return (any(p.requires_grad for p in self._unheld_frozen)
                or any(p.dtype != dtype for (p, _), dtype in zip(self._owned, self._dtypes))
                # (a parameter no registration count saw: made inside a compiled forward, or one taken
                # out, bias = None or a deleted adapter, which _own_again refuses while an optimizer holds it)
                or _parameter_slots(self._root) != self._slots)

    def _own_again(self) -> None:
        """The optimizers' parameters changed since they were read (``add_param_group`` mid-run:
        progressive unfreezing, adapters added), or a parameter no optimizer holds was unfrozen:
        read them again, with the checks ``Guard()`` makes, so the new ones are clipped and
        checked too (they were neither: an inf gradient in a group added later was applied),
        and an unfrozen parameter no optimizer updates is refused (or, ``frozen="ignore"``,
        has its gradient dropped) instead of accumulating its gradient, never cleared."""
        try:
            holder = _holders(self._root, self.optimizers, self.device, held={id(p) for p, _ in self._owned})
            with warnings.catch_warnings():  # (its "fp16 on a CPU is slow" was said at Guard())
                warnings.simplefilter("ignore", SlowPrecisionWarning)
                half = self.precision.check(self._root, self.device, held=holder, say_half=not self._half_said)
            self._half_said = self._half_said or half  # (half weights under fp32 once: a cast after Guard() says so)
            _check_left_out(self._root, holder, self._frozen_mode)
            if self.sync_free:
                self._check_sync_free(self.optimizer, self.scheduler)
        except ValueError:  # refused: no gradient outlives it (a refused parameter's would stay forever)
            self._abandon_group()
            for p in self._root.parameters():
                p.grad = None
            raise
        if self.sync_free:  # a group added: with lr_schedule=, its base is its LR now (a DeviceLambdaLR,
            # as torch's LambdaLR, has no base for it: the group keeps its own LR)
            groups = self.optimizer.param_groups
            self._base_lrs += [_initial_lr(group) for group in groups[len(self._base_lrs):]]
        self._own(holder)

    @property
    def record_columns(self) -> tuple[str, ...]:
        """The extra CSV columns this guard's records fill: ``("optimizers", "skipped_optimizers")``
        with several optimizers, none with one. ``CsvSink(path, extra_columns=guard.record_columns)``."""
        return LABEL_COLUMNS if len(self.optimizers) > 1 else ()

    @property
    def applied(self) -> dict[str, int]:
        """Updates each optimizer applied, by name (with one optimizer, ``{"optimizer": updates}``)."""
        return dict(self._applied) if len(self._applied) > 1 else dict.fromkeys(self._applied, self.updates)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward-pass context: autocast to the precision's dtype (nothing for fp32) and, on a
        micro-batch that does not close its group, no gradient all-reduce (DDP's ``no_sync``)."""
        if self._backward_pending:  # (review 55r: a loop cell re-run after a Ctrl-C between the two was told
            # "call guard.step() after each guard.backward(loss)", which its loop does, at every re-run)
            n = self.accumulation_steps
            which = f"micro-batch {self._micro} of {n} of step {self.steps + 1}" if n > 1 else f"step {self.steps + 1}"
            raise RuntimeError(f"Guard.autocast() while the guard.backward() of {which} awaits its guard.step() (a "
                               "loop interrupted between the two?): call guard.step() once to finish it, then go "
                               "on; a loop calls guard.step() after each guard.backward(loss)"
                               + (f" (inside a group of accumulation_steps={n} it returns None: no counter of your "
                                  "own)" if n > 1 else ""))
        stats = self._running_stats
        # (a model with BatchNorm, one added, or every UNFROZEN_EVERY steps a look for one that came with
        # no registration, on a group's first micro-batch: a compiled model's layers' hooks copy nothing)
        if stats.layers or stats.stale or not (self.steps % UNFROZEN_EVERY or self._micro):
            self.keep_running_stats()
        context = self.precision.autocast() if self._last_micro_batch() else self._autocast_no_sync()
        if self.autocast_dtypes is None and self.precision.autocasts:  # (the first forward only)
            return self._noting_dtypes(context)
        return context

    def keep_running_stats(self) -> None:
        """Copy the model's running statistics (BatchNorm's) now, if a training forward may follow
        and this step has no copy yet, for the step to put back if it is skipped
        (:class:`~ampguard.watch.RunningStats`). :meth:`autocast` calls it; a forward of a compiled
        model outside it (a framework's own autocast) calls it first, since the layers' hooks run
        nothing while ``torch.compile`` traces them. Every ``UNFROZEN_EVERY`` steps, on a group's
        first micro-batch, it looks for such layers again (one a compiled forward made)."""
        self._running_stats.keep_before_training(look=not (self.steps % UNFROZEN_EVERY or self._micro))

    def count_step_without_backward(self) -> None:
        """Count a step the loop took with no backward and no update (a Lightning
        ``training_step`` that returned ``None``: the loop counts the step, as the guard's
        numbering must): the running statistics its forward wrote stand, as an applied step's
        do (the copy taken before it is dropped: a later skip puts back only its own forward's)."""
        self.steps += 1
        self._running_stats.end_step(skipped=False)

    @contextlib.contextmanager
    def _autocast_no_sync(self) -> Iterator[None]:
        with self._no_sync(), self.precision.autocast():
            yield

    @contextlib.contextmanager
    def _noting_dtypes(self, context: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
        """``context`` (the first autocast), and each leaf of the model (DDP's module inside)
        notes its output's dtype in :attr:`autocast_dtypes` (:func:`~ampguard.watch.first_forward_dtypes`):
        the layers autocast left in float32, as ``ampguard train``'s run card names them."""
        with first_forward_dtypes(distributed.unwrap(self._root), self), context:
            yield

    def backward(self, *losses: torch.Tensor, divided: bool = False,
                 backward: Callable[[torch.Tensor], Any] | None = None, retain_graph: bool = False) -> None:
        """Check the loss on the device, divide it by the accumulation steps, scale it, backward.

        The loss is checked before backward, on the device: a non-finite loss is replaced by zero
        as far as the backward can tell (its seed is 0, where a finite loss's is 1), so it never
        seeds the backward pass, and the group is marked bad (its mark, the sum of
        each loss's ``x - x``, is NaN; the boundary reads it). Every micro-batch still runs
        backward (no host read here; under DDP no rank leaves a collective waiting). The bad
        group's gradients are discarded at the boundary.

        Several losses (``guard.backward(loss0, loss1)``) run backward one after the other over
        a shared graph, as ``scaler.scale(loss0).backward(retain_graph=True)`` then
        ``scaler.scale(loss1).backward()`` do; the record's loss is their sum.

        ``divided=True``: the losses are already divided by ``accumulation_steps`` (as Lightning's
        and the Hugging Face Trainer's loops hand them over). They seed the backward as they are,
        bit for bit what that loop would do, and the record counts each as ``loss x N``.

        ``backward=fn``: the backward is ``fn(scaled)``, a function of the loop's that runs it
        (Lightning's ``LightningModule.backward`` override: a log, a context around
        ``loss.backward()``). ``scaled`` is the scaled loss with the check carried in its graph
        (``scaled x seed``: a plain ``scaled.backward()`` seeds 1 x seed, bit for bit the
        guard's own backward); ``fn`` must backward through it once: a finite loss's backward it
        did not run, or ran twice, is refused (the group dropped); a non-finite loss's it left out
        the guard runs, seeded 0. One loss: several would need ``retain_graph`` in ``fn``.

        ``retain_graph=True`` keeps the graph after the last loss's backward, as
        ``loss.backward(retain_graph=True)`` does (a loop that backwards through it again later).

        A loss in float16 or bfloat16 (a reduction inside autocast: ``(x * x).sum()``) is said
        once (:class:`~ampguard.errors.AmpguardWarning`): the recipe's loss is float32, and a
        float16 one scaled by 65536 overflows, its steps skipped as non-finite gradients.
        """
        try:
            self._refuse_out_of_order(losses)
            if backward is not None and (len(losses) > 1 or retain_graph):
                raise ValueError("Guard.backward(backward=fn) takes one loss (fn backwards it once; sum the losses)"
                                 if len(losses) > 1 else "Guard.backward(backward=fn, retain_graph=True): fn "
                                 "runs the backward, so it says retain_graph (scaled.backward(retain_graph=True))")
            if self._autocast_probes:  # (the first backward only)
                self._end_autocast_probe()
            self._check_losses(losses)
            if self._micro == 0:  # (before a gradient is made: a refusal undoes nothing)
                if self._parameters_changed():
                    self._own_again()
                if self._scheduler_epochs:
                    self._check_schedulers()
            self._check_gradients_so_far()
        except (RuntimeError, ValueError) as err:  # a refusal: a loop that catches it goes on (README)
            self._refused(err, "backward")
            raise
        n, last = self.accumulation_steps, len(losses) - 1
        total: Any = None  # the losses' sum and their marks' (a NaN mark: a non-finite loss among them)
        bad: Any = None
        try:
            with self._no_sync():  # FSDP2 reduces in backward
                for i, loss in enumerate(losses):
                    loss = loss if loss.dim() == 0 else loss.reshape(())
                    value = loss.detach()
                    mark = value - value  # 0 for a finite loss, NaN otherwise (IEEE 754), in the loss's dtype
                    if value.dtype != torch.float32:  # the record's dtype (a float64 loss past 3.4e38 is finite)
                        value, mark = value.float(), mark.float()
                    total, bad = (value, mark) if total is None else (total + value, bad + mark)
                    if n > 1 and not divided:  # in the loss's dtype, as the recipe's loss / N (x / 1 is x: skipped)
                        loss = loss / n
                    scaled = self.scaler.scale(loss)
                    if backward is None:
                        scaled.backward(_finite_seed(mark, scaled), retain_graph=retain_graph or i < last)  # checked
                    else:
                        _handed_backward(backward, scaled * _finite_seed(mark, scaled))
        except BaseException as err:  # (free until something raises: no context manager on the hot path)
            self._stepped = self._tail_found = None  # (what the last step left: nothing of this one stepped)
            self._dropped(err, "backward", self.steps)
            raise
        if divided and n > 1:  # the record's loss is the mean of the undivided ones
            total = total * n
        first = self._micro == 0
        self._loss_sum = total if first else self._loss_sum + total
        self._loss_mark = bad if first else self._loss_mark + bad
        if self._micro + 1 < self.accumulation_steps:  # more to come: did the group make a gradient yet?
            self._grads_made = (self._grads_made and not first) or any(p.grad is not None for p, _ in self._owned)
        self._micro += 1
        self._backward_pending = True
        if self._edits_unchecked:  # (each optimizer's first group only: what step() or unscale_() compares with)
            self._grads_seen = [(p, g, g._version if g is not None else 0) for p, _ in self._owned for g in (p.grad,)]

    def _refuse_out_of_order(self, losses: tuple[torch.Tensor, ...]) -> None:
        """A backward twice without a step, with no loss, or inside autocast: refused."""
        if self._backward_pending:
            raise RuntimeError("Guard.backward() called twice: call guard.step() after each guard.backward(loss) "
                               "(a step's several losses: guard.backward(loss0, loss1))")
        if not losses:
            raise ValueError("Guard.backward() takes a loss tensor")
        if torch.is_autocast_enabled(self.precision.device_type):
            raise RuntimeError("Guard.backward() inside autocast: close the `with guard.autocast():` block first "
                               "(autocast wraps the forward and the loss; the backward runs after it)")

    def _check_losses(self, losses: tuple[torch.Tensor, ...]) -> None:
        """Each loss a scalar tensor that requires grad, and no ``guard.unscale_()`` before this
        backward in the group (its gradients would stay scaled): refused before any backward."""
        for i, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                several = " (several losses: guard.backward(*losses))" if isinstance(loss, (tuple, list)) else ""
                raise ValueError(f"Guard.backward() takes a scalar loss tensor, got {shape}{several}")
            if not loss.requires_grad:  # (before any backward: the losses before it left no gradient)
                which = f"loss {i + 1} of {len(losses)}" if len(losses) > 1 else "the loss"
                raise ValueError(f"Guard.backward(): {which} does not require grad (made under torch.no_grad(), "
                                 "detached, or a constant placeholder: leave it out): nothing to backward")
            if loss.dtype in _HALF and not self._half_loss_said:
                self._half_loss_said = True
                kind = str(loss.dtype).removeprefix("torch.")
                overflow = ("; scaled by the loss scale (65536 by default) it overflows float16 past 65504, and "
                            "the step skips as a non-finite gradient" if self.scaler.is_enabled()
                            and loss.dtype == torch.float16 else "")
                warn(f"Guard.backward(): the loss is {kind}, not float32 (a reduction inside autocast, "
                     f"(x * x).sum()?): it is rounded to {kind}{overflow}; make it float32 (.float() "
                     "before the reduction, or a loss function autocast runs in float32, F.mse_loss)",
                     AmpguardWarning, stacklevel=user_stacklevel())
        if self.scaler.any_unscaled(self.optimizers.values()):
            raise RuntimeError("Guard.backward() after guard.unscale_(): unscale once the group's last backward "
                               "has run (the gradients this backward adds would stay scaled)")

    def _check_schedulers(self) -> None:
        """Before a group's first backward and at its close: each scheduler the guard steps is
        where the guard left it. A loop that kept its own ``scheduler.step()`` after handing the
        scheduler to the guard ran the schedule twice as fast, and stepped it on the skipped steps
        the guard held it on, unsaid. A ``last_epoch`` that went back is a restore of the user's
        own (the scheduler loaded without the guard's state): the new start. One attribute read
        per scheduler."""
        for name, schedulers in self._schedulers.items():
            for scheduler in schedulers:
                left = self._scheduler_epochs.get(id(scheduler))
                now = _epoch_of(scheduler)
                if left is not None and now is not None and now < left:  # (a restore of the user's own, back)
                    self._scheduler_epochs[id(scheduler)] = now
                elif left is not None and now != left:
                    raise RuntimeError(
                        f"the {type(scheduler).__name__} of optimizer {name!r} was stepped outside the guard "
                        f"(last_epoch {now}, the guard left it at {left}): the guard steps it once "
                        "per applied update and holds it on a skipped step; a per-epoch schedule stays yours: pass "
                        "no scheduler= to the guard and step it at the epoch's end; a per-update one, remove your "
                        "own scheduler.step() call")

    def _check_gradients_so_far(self) -> None:
        """Before a micro-batch's backward: a group begins with no gradient (the guard drops them
        after every step), and inside a group they are there. Else something outside the guard
        wrote or cleared them, and the update would silently differ: a gradient at a group's
        start came from a ``loss.backward()`` of the user's or another Guard's backward
        reaching these parameters (a GAN's generator loss into the discriminator: it was added
        to the discriminator's next update); none inside a group, from an
        ``optimizer.zero_grad()`` left in a loop ported to accumulation (each micro-batch erased
        the ones before; a micro-batch whose loss reached no parameter, an empty batch's, made
        none to lose). Attribute reads on the host, no tensor touched: at a group's start one per
        parameter the optimizers hold (~45 ns each), inside it one or two. Inside a group under
        DDP/FSDP2 no check (FSDP2 holds a group's gradients unsharded, off the parameters)."""
        owned = self._owned
        if self._micro == 0:
            held = next((p for p, _ in owned if p.grad is not None), None)
            if held is not None:
                name = next((n for n, p in self._root.named_parameters() if p is held), None)
                # (one taken out of the model since the guard read it, still in the optimizer: a bare StopIteration)
                which = f"parameter {name!r}" if name is not None else \
                    f"a parameter of shape {list(held.shape)}, no longer in the model,"
                raise RuntimeError(
                    f"Guard.backward(): {which} already holds a gradient at the start of a step, from a "
                    "backward outside this guard (a loss.backward() of yours, or another Guard's backward reaching "
                    "these parameters: one Guard for models whose losses reach each other, or zero them first); the "
                    "guard drops gradients after every step (optimizer.zero_grad(set_to_none=False) leaves zeros: "
                    "call it with the default)")
        elif (self._grads_made and all(p.grad is None for p, _ in owned)  # (made, then gone: not an empty micro-batch's)
              and not any(map(distributed.defers_sync, self._modules))):
            raise RuntimeError(
                f"Guard.backward(): the gradients of micro-batch {self._micro} of {self.accumulation_steps} were cleared "
                "inside the accumulation group (an optimizer.zero_grad() in the loop, or accelerator.accumulate(), "
                "whose group ends at each epoch's end?): the guard drops them after each step itself; remove "
                "zero_grad() from the loop")

    def step(self, *which: str | torch.optim.Optimizer, close: bool = False
             ) -> StepLog | SkipLog | PendingStep | None:
        """After each ``backward``: ``None`` inside an accumulation group; at its end the update
        (or the skip) and the group's record. The skip decision costs one host sync per group
        (none with ``sync_free``).

        ``close=True`` ends the group now, with the micro-batches it has (a loop's short last
        group, as Lightning steps an epoch's last batches): their losses were divided by
        ``accumulation_steps`` all the same, and the record's loss is their mean. Given after
        the group's last ``step()`` (a loader of unknown length ends inside a group: its last
        batch is known only when the loop has ended), it closes the open group the same way, and
        with no group open (the loader ended on a group's boundary) it returns None: a streaming
        loop ends with ``guard.step(close=True)`` whatever its length. Refused for a
        model under DDP/FSDP2: the guard all-reduces gradients on the micro-batch it expects to
        be last, so a short group's never were.

        With several optimizers, ``step()`` steps them all and ``step("generator")`` (names or
        optimizer objects) only those named, as ``scaler.step(opt)`` does: each is skipped when
        its own gradients are non-finite (all of them for a non-finite loss, or a joint norm no
        single one's explains), and the one loss scale backs off when any was.
        After every step all the guard's gradients are dropped, the unstepped optimizers' too
        (as a GAN's ``zero_grad`` before each backward drops what the other loss left there).
        """
        called = self._step_call(which, close)  # the call's order checked; the names, whether the group ends now
        if called is None:  # (a close after the loop, which ended on a group's boundary: nothing open)
            return None
        names, close = called
        ends = close or self._micro >= self.accumulation_steps
        if self._edits_unchecked:  # (each optimizer's first group only)
            self._check_scaled_edits(names, "step", ends)
        self._backward_pending = False
        if not ends:  # inside an accumulation group
            self._group = names
            return None
        self._group = None
        steps = self.steps  # (_dropped puts the count back for a step that did not run)
        self._stepped = self._tail_found = self._owed = None
        try:
            return self._finish_group_sync_free() if self.sync_free else self._finish_group(names)
        except BaseException as err:  # (free until something raises: no context manager on the hot path)
            self._dropped(err, "step", steps)
            raise

    def _step_call(self, which: tuple[str | torch.optim.Optimizer, ...], close: bool
                   ) -> tuple[tuple[str, ...], bool] | None:
        """:meth:`step`'s call checked before anything moves: refused out of order (no backward
        since the last step, a backward from outside the guard, other optimizers than the
        group's; a short group under DDP/FSDP2), else ``(names, close)``: the optimizers to step
        and whether the group ends now (``close``, or an ``unscale_()`` that came before its last
        backward: said once, :class:`ShortGroupWarning`); None for a close after the loop with no
        group open. A refusal keeps the group as it was."""
        after_loop = not self._backward_pending and close  # the group a loader ended inside, closed after the loop
        if after_loop and not self._micro:  # (it ended on a group's boundary: nothing open, nothing to close)
            return None
        if not self._backward_pending and not after_loop:
            if not self._micro and any(map(holds_gradients, self.optimizers.values())):  # (the error's path only)
                raise RuntimeError("Guard.step() without guard.backward(loss): the gradients there come from a "
                                   "backward outside the guard (a loss.backward() of yours?): call "
                                   "guard.backward(loss) instead, which checks, scales and counts it")
            if self._micro:  # (a loader that ended inside a group: its last micro-batches wait for a close)
                raise RuntimeError(f"Guard.step() called twice: the open group holds {self._micro} of "
                                   f"{self.accumulation_steps} micro-batches, and the next guard.backward(loss) adds "
                                   "one; a loop that ended inside a group closes it with guard.step(close=True)")
            raise RuntimeError("Guard.step() called twice: the order is `with guard.autocast(): loss = ...`, "
                               "guard.backward(loss), guard.step()" if self.steps else
                               "Guard.step() before guard.backward(loss): nothing to step")
        # (a refusal here keeps the group as it was: the same call with the right names goes on)
        names = self._group if after_loop and not which and self._group is not None else self._names(which)
        if self._group is not None and names != self._group:
            raise RuntimeError(f"Guard.step() names optimizers {list(names)} inside a group begun with "
                               f"{list(self._group)}: step the same optimizers until the group closes")
        if not close and self._micro < self.accumulation_steps and self.scaler.any_unscaled(
                self.optimizers[name] for name in names):
            close = early = True  # unscale_() came after the group's last backward: it ends with the ones it has
        else:
            early = False
        if close and self._micro < self.accumulation_steps and any(map(distributed.defers_sync, self._modules)):
            raise RuntimeError("Guard.step(close=True) cannot end a short group under DDP/FSDP2: its micro-batches "
                               "ran without the gradient all-reduce (the guard expected more); end groups full there")
        if early and not self._short_group_said:
            # review 53g: an unscale_() after every micro-batch (outside a ported loop's `if boundary:`) made
            # each micro-batch an update of gradients divided by N, unsaid; the close stays (hooks that unscale
            # before a framework's short last group's step), said once a guard unless the step says close=True
            self._short_group_said = True
            k, n = self._micro, self.accumulation_steps
            warn(ShortGroupWarning(
                f"Guard.unscale_() after micro-batch {k} of {n}: the group ends short, its update made of {k} "
                f"micro-batch{'es' if k > 1 else ''} whose losses were divided by {n} (an unscale_() every "
                f"micro-batch makes each one an update of gradients divided by {n}); call unscale_() after the "
                "group's last backward (a loop whose data ended inside a group: guard.step(close=True))"),
                stacklevel=user_stacklevel())
        return names, close

    def _refused(self, err: BaseException, where: str) -> None:
        """A call refused (out of order, a typo'd optimizer, a gradient from outside the guard):
        the open group, if any, is dropped with its gradients, so the next ``backward()`` begins a
        clean step (else every later call was refused: the first's pending backward, the outside
        gradient, stayed), and a note says so."""
        if self._micro or self._backward_pending or any(p.grad is not None for p, _ in self._owned):
            self._abandon_group()
            if self._loop_notes:
                err.add_note(f"ampguard: Guard.{where}() refused the call: the open group was dropped (its "
                             "gradients); the next guard.backward() begins a new step")

    def _dropped(self, err: BaseException, where: str, steps: int) -> None:
        """After the backward or the group's close raised (an out-of-memory, a scheduler stepped
        past its end, a dtype PyTorch will not unscale): the open group is dropped (its
        gradients, half made or half unscaled, and its count) and each scheduler's position
        taken as it is, so the next call starts a clean group. Then, by what the close had got
        to (a note on ``err`` says which; docs/design.md section 2, "After a raise", says why):

        - nothing stepped and nothing decided: the step is not counted (the sync-free step's
          device count of updates put back);
        - an update stands (some optimizer stepped; one whose update ran before its own step
          post-hook raised counts, :func:`_mark_finished`): counted where it stepped;
        - a skip was decided (a skip hook raised, or one optimizer skipped while another
          raised before its update): counted as a skip;
        - and when the user's code raised after the update or the skip stood (``_owed``, not
          yet settled): settled as a step that ran, ``scaler.update()`` (a partial skip's
          backoff kept) and the stepped optimizers' schedulers (as ``scheduler_on_skip`` says).
        """
        stepped, self._stepped = self._stepped, None
        owed, self._owed = self._owed, None
        partly, self._partly = self._partly, None
        names, skipped, settled = owed if owed is not None else _Owed((), (), False)
        if owed is not None and not settled and (stepped or skipped):  # (settled: a scheduler raised after)
            if not skipped and len(stepped) == len(names):  # (every one stepped: a post-hook raised after)
                self._updates += 1
            try:
                self.scaler.update()
                self._step_schedulers([n for n in names if n in (stepped or ()) or n in skipped], stepped or ())
            except Exception as later:  # (the error the loop sees stays the first one)
                err.add_note(f"ampguard: settling the step raised too: {later!r}")
        # an optimizer's step() that raised inside its update (a Ctrl-C between two parameters, an
        # out-of-memory): some parameters and their state may have moved; no "nothing was applied"
        torn = "" if partly is None else (
            f"{f'optimizer {partly!r}' if len(self.optimizers) > 1 else 'the optimizer'}'s step() raised part-way: "
            "its update may be partly applied, to some parameters and their optimizer state, and is not counted; "
            "the weights may be inconsistent: restore them from a checkpoint")
        if stepped is None and skipped:  # (a skip that ran: counted, its scale backed off)
            which = f" of {', '.join(map(repr, skipped))}" if len(self.optimizers) > 1 else ""
            said = (f"step {self.steps} was skipped{which}, its record was not made; {torn}" if torn else
                    f"step {self.steps} was skipped{which}, nothing was applied, its record was not made")
        elif stepped is None:
            self.steps = steps  # (nothing counted: the step number is the next one's)
            if self._tail_found is not None:  # (the sync-free tail had advanced the count: undo it)
                self._updates_t.sub_((self._tail_found == 0).long())
            said = torn or "nothing was applied"
        elif not stepped:  # (the sync-free step: its optimizer ran, what it did was decided on the device)
            said = f"step {self.steps} ran on the device, applied or skipped there; its record was not made"
        else:  # (an update stands, counted already; no record was made)
            which = f" of {', '.join(map(repr, stepped))}" if len(self.optimizers) > 1 else ""
            said = f"step {self.steps}'s update{which} was applied, its record was not made" + (f"; {torn}" if torn else "")
        self._tail_found = None
        self._abandon_group()
        for scheduler in self._every_scheduler():
            if (epoch := _epoch_of(scheduler)) is not None:
                self._scheduler_epochs[id(scheduler)] = epoch
        if self._loop_notes:
            err.add_note(f"ampguard: Guard.{where}() raised: the open group was dropped ({said}); "
                         "the next guard.backward() begins a new step")

    def unscale_(self, *which: str | torch.optim.Optimizer) -> None:
        """Unscale the gradients of these optimizers (all by default) now, before :meth:`step`,
        so code between the group's last backward and the step sees true gradients (a
        framework's ``on_before_optimizer_step`` hooks, a look of your own); ``step()`` then
        does not unscale them again. ``GradScaler.unscale_``'s use, without its error on a
        second call. A non-finite gradient it finds skips the step (reason ``non_finite_grad``,
        the record's pre-clip norm ``inf``) even if code in between made the gradients finite,
        as ``GradScaler.step`` skips on what ``unscale_`` found. Between steps there is nothing to
        unscale: refused (it left every later ``backward()`` refused as "after unscale_()"). Inside
        an accumulation group it ends the group's backwards: the next ``step()`` closes the group
        with the micro-batches it has, as ``close=True`` (it returned ``None``, and every later
        call was refused); unless that step says ``close=True`` (a loop whose data ended inside
        the group), a :class:`ShortGroupWarning` says so, once a guard: an ``unscale_()`` every
        micro-batch made each one an update of gradients divided by N, unsaid (review 53g)."""
        if not self._backward_pending:
            raise RuntimeError("Guard.unscale_(): nothing to unscale; call it after the group's last "
                               "guard.backward(loss), before guard.step()")
        names = self._names(which)
        if self._edits_unchecked:  # (each optimizer's first group only)
            self._check_scaled_edits(names, "unscale_", False)
        self._unscale(names)

    def _unscale(self, names: Sequence[str]) -> None:
        for name in names:
            optimizer = self.optimizers[name]
            if not self.scaler.unscaled(optimizer):
                self.scaler.unscale_(optimizer)

    def _check_scaled_edits(self, names: Sequence[str], where: str, ends: bool) -> None:
        """Until each optimizer's first group closes, under fp16's loss scaler (:attr:`_edits_unchecked`,
        the names not checked yet): did a gradient of ``names``' optimizers not unscaled yet change
        since the last ``backward()`` returned (its version counter moved, or another tensor took
        its place)? Then code of the loop's acted on gradients still multiplied by the loss scale
        (Lightning's ``on_after_backward`` too). A clip there is wrong: the stock recipe's
        ``clip_grad_norm_`` kept without its ``scaler.unscale_`` (a clip to 1.0 at scale 65536 left
        an SGD update up to 65536 times too small, the record's norms the clipped ones, and
        ``max_norm`` never clipped), a ``clip_grad_value_``; a mask or another multiplication is
        sound (it commutes with the scale: bit for bit the stock loop's). The two cannot be told
        apart, so it is a :class:`ScaledEditWarning`, once a guard, and the step goes on as the loop
        wrote it (review 55n: a refusal aborted a Lightning fit that masked rows). A backward bumps
        the versions itself (accumulation), so the comparison is with the last one's; a gradient
        gone (``p.grad = None``) is left to the step's own check, a plain ``GradScaler``'s
        ``unscale_`` to its refusal at the close (:meth:`_unscale_and_measure`); a
        ``guard.unscale_()`` before the edit, the documented way, leaves nothing to compare. Not
        seen: an edit through ``.data`` (its own version counter), torch's ``_foreach_*`` ops on
        FSDP2's DTensor gradients (they move no version counter). Attribute reads on the host, one
        per parameter, until every optimizer's first group has closed (``ends``: the group closes,
        and the check of ``names`` with it)."""
        seen = self._grads_seen or []  # (none: a copy made mid-group, which holds no gradients of the original's)
        for name in names:
            optimizer = self.optimizers[name]
            if name not in self._edits_unchecked or self.scaler.unscaled(optimizer) or self.scaler.twin_used(optimizer):
                continue
            mine = {id(p) for p in self._params_of[name]}
            edited = next((p for p, grad, version in seen if id(p) in mine and (now := p.grad) is not None
                           and (now is not grad or now._version != version)), None)
            if edited is None:
                continue
            found = next((n for n, p in self._root.named_parameters() if p is edited), None)
            which = f"parameter {found!r}" if found is not None else f"a parameter of shape {list(edited.shape)}"
            scale = f"{self.scaler.get_scale():g}"
            self._edits_unchecked.clear()  # (said once a guard: nothing more to check)
            warn(ScaledEditWarning(
                f"Guard.{where}(): the gradient of {which} was changed after guard.backward() (under Lightning: in "
                f"on_after_backward), while the loss scale ({scale}) still multiplied it. A mask or another "
                f"multiplication there is fine; a clip_grad_norm_ or clip_grad_value_ acts on gradients {scale} times "
                "too large (the update up to that many times too small, the record's norms the clipped ones, max_norm "
                "never clipping): drop it and clip with max_norm= (the plugin's, under Lightning), or unscale first "
                "(guard.unscale_() before it in your own loop; under Lightning, move it to on_before_optimizer_step, "
                f"which sees unscaled gradients). A norm measured there (clip_grad_norm_(..., inf)) is {scale} times "
                "too large: torch.nn.utils.get_total_norm after the unscale. Checked at each optimizer's first step; "
                "said once"), stacklevel=user_stacklevel())
            break
        if ends:
            self._edits_unchecked.difference_update(names)
            self._grads_seen = None  # (the next backward notes its own; they would keep a replaced gradient alive)

    def _names(self, which: tuple[str | torch.optim.Optimizer, ...]) -> tuple[str, ...]:
        if not which:
            return tuple(self.optimizers)
        chosen = set()
        for item in which:
            name = item if isinstance(item, str) else next(
                (n for n, o in self.optimizers.items() if o is item), None)
            if name not in self.optimizers:
                raise ValueError(f"Guard.step(): {item if isinstance(item, str) else type(item).__name__!r} is not "
                                 f"one of this guard's optimizers {list(self.optimizers)}")
            chosen.add(name)
        return tuple(n for n in self.optimizers if n in chosen)

    def _last_micro_batch(self) -> bool:
        """Whether the next backward is its group's last."""
        return self._micro + 1 == self.accumulation_steps

    def _no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """No gradient all-reduce (DDP's ``no_sync``) on a micro-batch that does not close its group."""
        if self._last_micro_batch():  # the group's last micro-batch (every one without accumulation): sync
            return contextlib.nullcontext()
        if len(self._modules) == 1:
            return distributed.accumulation_context(self._modules[0], False)
        stack = contextlib.ExitStack()
        for module in self._modules:
            stack.enter_context(distributed.accumulation_context(module, False))
        return stack

    def _clip_applied(self, grads: GradSet, applied: Sequence[str]) -> torch.Tensor | None:
        """In a step some optimizers skip, what the others apply is clipped by its own norm (the
        joint one counted the skipped gradients): its post-clip norm, or None when none applies."""
        if not applied:
            return None
        params = self._union(applied)
        return clip_to_norm_(params, self.max_norm, distributed.full_norm(grads.norm_of(params)))

    def _union(self, names: Sequence[str]) -> list[torch.Tensor]:
        """The parameters of these optimizers in the model's order (whatever order the optimizers
        are named in), so their norm is bit for bit ``clip_grad_norm_`` over the model's parameters."""
        if len(names) == 1:
            return self._params_of[names[0]]
        return [p for p, owner in self._owned if owner in names]

    def _unscale_and_measure(self, names: tuple[str, ...]
                     ) -> tuple[GradSet, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
        """Count the step (``steps + 1``; the group's micro-batch count back to 0), then unscale,
        take the global norm, agree across ranks: ``(grads, loss, mark, pre, each, origin)``. No host read.

        ``loss`` is the group's mean loss (the mean over ranks); ``mark`` is 0, or NaN when a
        micro-batch loss was non-finite (on any rank); ``pre`` the global norm of the named
        optimizers' gradients (all shards), non-finite iff a gradient element was (or the norm
        overflowed); ``each`` with several optimizers each one's own norm; ``grads`` the named
        optimizers' gradients, for the clip. :func:`distributed.agree` makes a value that is
        non-finite on one rank so on every rank: the mark and the norms are the step's detectors;
        ``origin`` (under torchrun) counts the ranks whose own loss was not finite, and which."""
        for name in names:
            if self.scaler.twin_used(self.optimizers[name]):
                raise RuntimeError("the GradScaler given as scaler= was used on the optimizer outside the guard "
                                   "(scaler.unscale_(optimizer), or a scaler.step(optimizer) refused after it "
                                   "unscaled: the guard would divide the gradients a second time): the guard "
                                   "unscales, clips and steps; remove those lines from the loop")
        if _parameter_count(self.optimizers) != self._held_count:  # a group added inside this group (read at its start)
            self._own_again()
        micro, self._micro = self._micro, 0
        self.steps += 1
        loss = self._loss_sum / micro if micro > 1 else self._loss_sum
        early = [n for n in names if self.scaler.unscaled(self.optimizers[n])]  # by guard.unscale_(), before
        if self.scaler.is_enabled():  # (disabled, only guard.unscale_() checks: what it found, the step reads)
            self._unscale(names)
        grads = GradSet(self._union(names))
        if not grads.grads:  # (under fp16 PyTorch's bare "No inf checks were recorded"; else an "update" of nothing)
            which = ", ".join(map(repr, names))
            raise RuntimeError(f"Guard.step(): no gradient reached the parameters of {which} in this step: a loss "
                               "that reaches no parameter (torch.zeros((), requires_grad=True) for an empty batch: "
                               "use one made from the model's output, output.sum() * 0), a zero_grad() between "
                               "guard.backward() and guard.step(), or an optimizer stepped inside the backward "
                               "(register_post_accumulate_grad_hook: not supported)")
        _refuse_sparse_grads(self._root, grads, self.max_norm)
        norms = [distributed.full_norm(grads.norm())]
        if len(names) > 1:  # each optimizer's own norm, from the per-parameter norms just taken
            norms += [distributed.full_norm(grads.norm_of(self._params_of[n])) for n in names]
        if early:
            norms = self._found_at_unscale(names, early, norms)
        (loss, mark, pre, *each), origin = distributed.agree(loss, [self._loss_mark, *norms])
        if self._replicas_unjudged and not self._replicas_unjudged.isdisjoint(names):
            self._judge_replicas(each or [pre], names)
        return grads, loss, mark, pre, each, origin

    def _judge_replicas(self, norms: list[torch.Tensor], names: tuple[str, ...]) -> None:
        """Once an optimizer, at its first step whose gradient norm (``norms``: each of ``names``'
        own) is finite and not 0 on every rank: under several processes, ranks whose norms differ
        apply their gradients each as its own (a model not wrapped in DDP or FSDP2, or the one
        from before ``accelerator.prepare``): the guard would tie their skips and average their
        losses into one record while the replicas drift apart, so it says so
        (:class:`UnsyncedReplicasWarning`). One all-reduce and one host read, at that step (and
        at each before it that skipped, or whose gradients were all 0); a GAN's second optimizer,
        stepped on its own, is judged at its first step, two stepped together each by its own."""
        seen = distributed.norm_range(norms)
        if seen is None:  # (a world of one)
            self._replicas_unjudged.clear()
            return
        for name, (low, high) in zip(names, seen):
            if name not in self._replicas_unjudged:
                continue
            if not (math.isfinite(low) and math.isfinite(high) and high > 0):  # (a skip, or no gradient to tell by)
                self._replicas_tries[name] = tries = self._replicas_tries.get(name, 0) + 1
                if tries >= REPLICA_TRIES:  # (an optimizer whose gradients stay 0: not judged, the cost ends)
                    self._replicas_unjudged.discard(name)
                continue
            self._replicas_unjudged.discard(name)
            if high - low > distributed.REPLICA_SPREAD * high:
                warn(UnsyncedReplicasWarning(
                    f"the ranks' gradient norms{_of_optimizer(name, self.optimizers)} differ at step {self.steps} "
                    f"({low:.6g} to {high:.6g}): each rank applies its own gradients, so the replicas drift apart "
                    f"while the guard ties their skips and averages their losses into one record; wrap the model "
                    f"(DistributedDataParallel, fully_shard) and give the guard the wrapped one (Accelerate: the "
                    f"model accelerator.prepare returned), or all-reduce the gradients between guard.backward() and "
                    f"guard.step()"), stacklevel=user_stacklevel())

    def _found_at_unscale(self, names: tuple[str, ...], early: list[str], norms: list[torch.Tensor]
                          ) -> list[torch.Tensor]:
        """The norms, ``inf`` where ``guard.unscale_()`` found a non-finite gradient: code that ran
        between it and the step (``clip_grad_value_``, ``nan_to_num_``, a framework's hook) may
        have made the gradients finite since, but the step skips, as ``GradScaler.step`` skips
        on what ``unscale_`` found (it was applied, with the clamped values). ``norms`` is the
        group's norm, then each optimizer's with several. A few kernels, only on this path."""
        device = norms[0].device
        found = {name: flag for name in early
                 if (flag := self.scaler.found_at_unscale(self.optimizers[name], device)) is not None}
        if not found:
            return norms
        inf = torch.full((), math.inf, device=device, dtype=norms[0].dtype)
        any_found = torch.stack(list(found.values())).any()
        each = [torch.where(found[n], inf, norm) if n in found else norm for n, norm in zip(names, norms[1:])]
        return [torch.where(any_found, inf, norms[0]), *each]

    def _finish_group(self, names: tuple[str, ...]) -> StepLog | SkipLog:
        """The group's end, in the recipe's order: unscale and measure (no host read), the one
        host read, skip or clip, the optimizers' steps, ``scaler.update()`` every step, the
        schedulers (held on a skip), the gradients dropped, the record."""
        if self._scheduler_epochs:  # (a loop's scheduler.step() since the group's first backward)
            self._check_schedulers()
        lr = self.optimizers[names[0]].param_groups[0]["lr"]
        if isinstance(lr, torch.Tensor):  # a tensor lr is updated in place by the scheduler: keep this step's
            lr = lr.detach().clone()
        # 1. count the step, unscale, the pre-clip global norm (the non-finite detector), agreed over ranks
        grads, loss, mark, pre, each, origin = self._unscale_and_measure(names)
        factor, post, carried = self._clip_before_read(grads, pre)  # the clip of them all (unused if any is skipped)
        # 2. the one host read: was the loss (seeded 0 in its backward) or a gradient non-finite?
        read = self._read_back(loss, pre, carried, mark, each, origin)
        if carried is None:  # (the clip factor the host took from the norm read: carried by the read)
            factor = read.carried
        skipped, applied = _partition(names, read)
        # the running statistics (BatchNorm's) back as the step found them when it skipped whole
        # (decided: a skip hook or an optimizer raising after this leaves them so too)
        self._running_stats.end_step(skipped=bool(skipped) and not applied)
        # 3. skip (the scaler told found_inf) or clip, then the optimizers' steps
        if skipped:  # the record's post-clip norm is then what is applied
            post = self._clip_applied(grads, applied)
            for name in skipped:
                self.scaler.mark_found_inf_(self.optimizers[name])  # a loss skip backs the scale off too
        elif factor is not None:
            grads.scale_(factor)
        self._owed = _Owed(names, skipped, False)  # (the user's code raising from here on: _dropped settles the step)
        self._step_optimizers(applied)
        if not skipped:
            self._updates += 1
        for hook in self.skip_hooks if skipped else ():  # they see the skipped step's gradients
            hook(grads)
        # (update() itself raising, a device error: nothing settles the step again; an update
        # that stood stays counted, its schedulers not stepped, and a decided skip is taken back)
        self._owed = None
        self.scaler.update()  # 4. every step, skipped or not: the scale backs off or grows
        self._owed = _Owed(names, skipped, True)  # (settled: a scheduler raising leaves a step that ran)
        self._step_schedulers(names, applied)  # 5. the schedulers, held where the step skipped
        self._owed = None
        self._zero_grad()  # 6. the gradients dropped, the record
        return self._record(names, skipped, read, lr, loss, pre, post)

    def _read_back(self, loss: torch.Tensor, pre: torch.Tensor, carried: torch.Tensor | None, mark: torch.Tensor,
                   each: list[torch.Tensor], origin: torch.Tensor | None) -> _Read:
        """The one host read of the step: was the loss or a gradient non-finite (on any rank)?
        The values themselves come over, so it also brings the record's loss and norms, the
        scale and growth tracker the update will find (the host tells the new scale), and under
        torchrun whose own loss it was. Where :meth:`_clip_before_read` left the clip factor to the
        host (``carried`` None), the read's ``carried`` is its value from the norm read
        (:func:`clip_coefficient_value`; None for a non-finite norm, which skips), as it is a device
        factor's otherwise."""
        scaling = self.scaler.update_inputs(pre.device)
        values = [loss, pre, *(() if carried is None else (carried,)), mark, *scaling, *each,
                  *(origin.unbind() if origin is not None else ())]
        loss_v, pre_v, *rest = torch.stack(values).tolist()
        if carried is None:  # the factor on the host
            carried_v = clip_coefficient_value(pre_v, self.max_norm, pre.dtype) if math.isfinite(pre_v) else None  # type: ignore[arg-type]
        else:
            carried_v = rest.pop(0)
        mark_v = rest.pop(0)
        bad_loss, loss_on = not math.isfinite(mark_v), None
        if origin is not None:
            *rest, ranks, code = rest
            loss_on = loss_origin(ranks, code, distributed.current().world_size) if bad_loss else None
        return _Read(loss_v, pre_v, carried_v, bad_loss, [not math.isfinite(v) for v in rest[len(scaling):]],  # type: ignore[arg-type]
                     rest[:len(scaling)], loss_on)

    def _step_optimizers(self, applied: tuple[str, ...]) -> None:
        """``optimizer.step()`` of each applied one (what ``scaler.step()`` does once found_inf
        reads 0), each counted as it steps: a failure after it leaves an update that stands."""
        with _GuardStepping([self.optimizers[name] for name in applied]):
            try:
                for name in applied:
                    self.optimizers[name].step()
                    self._count_stepped(name)
            except BaseException as err:
                if STEPPING.finished is self.optimizers[name]:  # (its update ran, a later step post-hook raised)
                    if name not in (self._stepped or ()):  # (not when a Ctrl-C came after it was counted)
                        self._count_stepped(name)
                elif began_update(self.optimizers[name], err):  # (not a pre-hook's refusal: it may be torn)
                    self._partly = name
                raise

    def _record(self, names: tuple[str, ...], skipped: tuple[str, ...], read: _Read, lr: Any,
                loss: torch.Tensor, pre: torch.Tensor, post: torch.Tensor | None) -> StepLog | SkipLog:
        """The step's record: its tensors, with what the read brought (and the scale after
        ``update()``, told on the host) as ``read``, so a sink reads nothing more."""
        labels = {"optimizers": names, "skipped_optimizers": skipped} if len(self.optimizers) > 1 else {}
        values = {"loss": read.loss} if read.bad_loss else {"loss": read.loss, "grad_l2_pre_clip": read.pre}
        scale = self.scaler.scale_after(read.scaling, bool(skipped))
        if scale is None:  # (the host cannot tell: the record reads it from the device)
            scale = self.scaler.scale_value()
        else:
            values["scaler_scale"] = scale
        if not skipped:
            if post is None:  # from the factor read; a host tensor (the record's values stay tensors, no kernel)
                values["grad_l2_post_clip"] = post_clip_value(read.pre, read.carried, self.max_norm, pre.dtype)  # type: ignore[arg-type]
                post = torch.scalar_tensor(values["grad_l2_post_clip"], dtype=pre.dtype)
            else:
                values["grad_l2_post_clip"] = read.carried
            return StepLog(step=self.steps, lr=lr, loss=loss, grad_l2_pre_clip=pre, grad_l2_post_clip=post,
                           scaler_scale=scale, **labels, read=values)
        return SkipLog(
            step=self.steps,
            lr=lr,
            loss=loss,
            grad_l2_pre_clip=None if read.bad_loss else pre,
            grad_l2_post_clip=post,
            scaler_scale=scale,
            reason="non_finite_loss" if read.bad_loss else "non_finite_grad",
            loss_on=read.loss_on,
            **labels,
            read=values,
        )

    def _count_stepped(self, name: str) -> None:
        self._applied[name] += 1
        self._stepped = (*(self._stepped or ()), name)

    def _step_schedulers(self, names: Sequence[str], applied: Sequence[str]) -> None:
        """Each named optimizer's schedulers, held where it skipped (``scheduler_on_skip="hold"``).
        One that raises (a ``OneCycleLR`` stepped past its end) is raised after the others have
        stepped: theirs would lag their updates by one for the rest of the run."""
        error = None
        for name in names:
            for scheduler in self._schedulers[name]:
                if name in applied or self.scheduler_on_skip == "step":
                    if name in applied:
                        _note_update(scheduler, self.optimizers[name])
                    try:
                        scheduler.step()
                    except Exception as err:  # noqa: BLE001 - the first is raised once all have stepped
                        error = error or err
                if (epoch := _epoch_of(scheduler)) is not None:
                    self._scheduler_epochs[id(scheduler)] = epoch
        if error is not None:
            raise error

    def _clip_before_read(self, grads: GradSet, pre: torch.Tensor
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The exact step's clip before its read: ``(factor, post, carried)``, the clip factor on
        the device, the post-clip norm and what the read carries for it (:meth:`_post_clip`; a
        factor None: clipping is off); all None where the host takes the factor from the norm it
        reads (:func:`~ampguard.clipping.factor_on_host`: a float32/float64 norm, the usual
        case), bit for bit the device's, four kernels fewer (review 54f)."""
        if factor_on_host(grads, pre, self.max_norm):
            return None, None, None
        factor = clip_coefficient(pre, self.max_norm)
        return (factor, *self._post_clip(pre, factor))

    def _post_clip(self, pre: torch.Tensor, factor: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(post-clip norm, what the record's read carries for it)``: the norm itself when
        clipping is off; for a norm in :data:`HOST_ROUNDED`, ``None`` and the clip factor, from
        whose value the host computes the post-clip norm bit for bit (two kernels fewer a step);
        else the device's post-clip norm."""
        if factor is None:
            return pre, pre
        if pre.dtype in HOST_ROUNDED:
            return None, factor
        post = post_clip_norm(pre, factor, self.max_norm)  # type: ignore[arg-type]
        return post, post

    def _settle_sync_free(self, found: torch.Tensor) -> None:
        """After the sync-free step's ``optimizer.step()`` (what it applied, or skipped, is on the
        device, counted there): the skip flag to the scaler's found-inf record, ``update()``."""
        self._stepped = ()
        self.scaler.add_found_inf_(self.optimizer, found, covers=True)
        self.scaler.update()

    def _finish_group_sync_free(self) -> PendingStep:
        """The group boundary without any host read: every decision stays on the device.

        The LR comes from ``lr_schedule`` of a device count of applied updates, which a skip
        keeps from advancing. The skip flag goes to the optimizer as ``found_inf`` (a fused
        kernel skips its update and undoes its step count when it is 1, as it does for
        ``GradScaler.step``) and to the scaler's found-inf record (so ``update()`` backs off).
        Clipping runs unconditionally: on a skipped step it scales gradients nobody will use.
        """
        grads, loss, mark, pre, _, origin = self._unscale_and_measure(tuple(self.optimizers))
        self._set_lrs()  # this step's LR, from the count before it
        lr = self.optimizer.param_groups[0]["lr"]
        if self.fuse_tail:
            found, factor = _compiled_tail()(mark, pre, self._updates_t, self._threshold_tensor(pre), self._zero)
        else:
            found, factor = sync_free_tail(mark, pre, self._updates_t, self.max_norm, self._zero)
        self._tail_found = found  # (the count advanced: put back if the step fails before the optimizer's)
        post, carried = self._post_clip(pre, factor)
        for hook in self.group_hooks:
            hook(grads)
        if factor is not None:
            grads.scale_(factor)
        if self._fused_momentum and not self.optimizer.state:  # (a fused SGD's first step: _start_momentum)
            _start_momentum(self.optimizer)
        self.optimizer.found_inf = found  # type: ignore[attr-defined]
        with _GuardStepping([self.optimizer]):
            try:
                self.optimizer.step()
            except BaseException as err:
                if STEPPING.finished is self.optimizer:  # its update ran, a step post-hook raised: the step stands
                    self._settle_sync_free(found)
                elif began_update(self.optimizer, err):  # (not a pre-hook's refusal: it may be torn)
                    self._partly = next(iter(self.optimizers))
                raise
            finally:
                del self.optimizer.found_inf  # type: ignore[attr-defined]
        self._settle_sync_free(found)
        self._zero_grad()
        self._running_stats.end_step(skipped=found)  # (on the device: a select, no read)
        # the record's values in one tensor (read back with one copy), the fields views of it;
        # the LR as this step used it (the next step's _set_lrs writes that tensor in place), the
        # post-clip norm or the factor the host computes it from, the scale after update(), and
        # the loss mark, from which the reader tells a skip and its reason (and under torchrun
        # the origin: whose own loss was not finite), in PendingStep._NUMERIC's order
        clip = None if post is not None else (self.max_norm, pre.dtype)
        packed = torch.stack([lr, loss, pre, carried, self.scaler.scale_tensor(pre.device), mark,
                              *(origin.unbind() if origin is not None else ())])
        lr, loss, pre, carried, scale, mark, *origin_read = packed.unbind()
        ranks, code, world = (*origin_read, distributed.current().world_size) if origin_read else (None, None, 1)
        return PendingStep(step=self.steps, lr=lr, loss=loss, grad_l2_pre_clip=pre,
                           grad_l2_post_clip=None if clip else carried, scaler_scale=scale, loss_mark=mark,
                           loss_ranks=ranks, loss_rank_code=code, world=world, packed=packed, clip=clip)

    def _threshold_tensor(self, pre: torch.Tensor) -> torch.Tensor | None:
        """``fuse_tail``'s clip threshold: ``None`` when clipping is off, else ``max_norm`` as a 0-dim
        tensor on the norm's device (float64 for a float64 norm, else float32, as the eager tail's
        kernels take the number), made again only when ``max_norm`` or the norm's dtype or device
        changed (a fill: no copy from the host)."""
        threshold = clip_threshold(self.max_norm)
        if threshold is None:
            return None
        key = (threshold, pre.dtype, pre.device)
        if self._threshold is None or self._threshold[0] != key:
            dtype = torch.promote_types(pre.dtype, torch.float32)
            self._threshold = (key, torch.full((), threshold, dtype=dtype, device=pre.device))
        return self._threshold[1]

    def _set_lrs(self) -> None:
        """Sync-free: each group's LR for this step, ``base x factor(applied updates)`` on the
        device. A group whose LR a checkpoint's optimizer state brought back as a float or on
        the host gets a device tensor again, as does a constant LR given as a host tensor."""
        if self.scheduler is not None:  # a DeviceLambdaLR: its base LRs (a rollback or resume may change them)
            factor, bases = self.scheduler.device_factor(self._updates_t), self.scheduler.base_lrs
        elif self.lr_schedule is not None:
            # a float32 copy (one cast kernel): what a user's schedule got before the count became int64
            # (review 55n: u.new_tensor(0.1) or full_like(u, 0.1) on an int64 count truncated to 0)
            factor, bases = self.lr_schedule(self._updates_t.float()), self._base_lrs
        else:  # a constant LR: a tensor on the step's device, where the record stacks it (once moved, stays)
            for group in self.optimizer.param_groups:
                lr = group["lr"]
                if not (isinstance(lr, torch.Tensor) and lr.device == self._updates_t.device):
                    group["lr"] = torch.as_tensor(lr, dtype=torch.float32).to(self._updates_t.device)
            return
        for group, base in zip(self.optimizer.param_groups, bases):
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device == self._updates_t.device:
                torch.mul(factor, base, out=lr)  # (base * factor, written in place: one kernel)
            else:
                group["lr"] = (base * factor).to(torch.float32)

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        for p in self._unheld_trainable:  # frozen="ignore": what no optimizer updates is dropped, not accumulated
            p.grad = None

    def _check_sync_free(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError("sync_free needs an optimizer that takes found_inf, e.g. torch.optim.AdamW(..., fused=True)")
        if scheduler is not None and not hasattr(scheduler, "device_factor"):
            raise ValueError("sync_free computes the LR on the device: pass lr_schedule=, or a schedule on the "
                             "device as scheduler= (ampguard.schedule.DeviceLambdaLR)")
        if not all(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups):
            raise ValueError("sync_free needs tensor learning rates, e.g. AdamW(params, lr=torch.tensor(1e-3), fused=True)")
        if _fused_momentum_groups(optimizer) and any(group.get("dampening", 0) != 0 for group in optimizer.param_groups
                                                     if group.get("momentum", 0) != 0):
            raise ValueError("sync_free with a fused SGD whose momentum has dampening: the guard starts its momentum "
                             "buffers at 0 (torch's fused SGD leaves them unset when a skip holds its first step), "
                             "which is torch's first step only with dampening=0; use dampening=0, or sync_free=False")

    @property
    def updates(self) -> int:
        """Optimizer steps applied. In the sync-free path reading it costs a host sync.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                       torch.nn.functional.mse_loss, precision="fp32")
            >>> _ = state.step(torch.ones(1, 2), torch.tensor([[float("inf")]]))  # skipped
            >>> _ = state.step(torch.ones(1, 2), torch.zeros(1, 1))  # applied
            >>> state.steps, state.updates
            (2, 1)
        """
        return int(self._updates_t.item()) if self.sync_free else self._updates

    @updates.setter
    def updates(self, value: int) -> None:
        if self.sync_free:
            self._updates_t.fill_(value)
        else:
            self._updates = value

    # ------------------------------------------------------------------ state

    @property
    def pending(self) -> bool:
        """True after a ``backward`` whose ``step()`` has not been called yet.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32",
            ...               accumulation_steps=2)
            >>> guard.backward(model(torch.ones(1, 2)).sum())
            >>> guard.pending, guard.micro_batches
            (True, 1)
            >>> guard.step() is None, guard.pending, guard.micro_batches
            (True, False, 1)
        """
        return self._backward_pending

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer update. It may change between groups (a batch-size ramp; the
        adapters set each group's own count at its first micro-batch), not inside one: the
        group's losses would be divided by two counts.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32")
            >>> guard.accumulation_steps = 4
            >>> guard.backward(model(torch.ones(1, 2)).sum()); guard.step()
            >>> guard.accumulation_steps = 2
            Traceback (most recent call last):
            ...
            RuntimeError: Guard.accumulation_steps changed inside a group (1 of 4 micro-batches taken): change it between groups (guard.mid_group False)
        """
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, steps: int) -> None:
        if not whole_number(steps, 1):
            raise ValueError(f"accumulation_steps must be a whole number >= 1, got {steps!r}")
        if self._micro and steps != self._accumulation_steps:
            raise RuntimeError(f"Guard.accumulation_steps changed inside a group ({self._micro} of "
                               f"{self._accumulation_steps} micro-batches taken): change it between groups "
                               "(guard.mid_group False)")
        self._accumulation_steps = int(steps)

    @property
    def micro_batches(self) -> int:
        """The micro-batches the open accumulation group has taken so far (0 between groups)."""
        return self._micro

    @property
    def mid_group(self) -> bool:
        """True between the first and last micro-batch of an accumulation group.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                       torch.nn.functional.mse_loss, precision="fp32", accumulation_steps=3)
            >>> flags = []
            >>> for _ in range(3):
            ...     _ = state.step(torch.ones(1, 2), torch.zeros(1, 1))
            ...     flags.append(state.mid_group)
            >>> flags
            [True, True, False]
        """
        return self._micro != 0

    def state_dict(self, *, mid_group: bool = False) -> dict[str, Any]:
        """Scaler, counters, monitors and settings that must match on resume. Call between steps;
        ``mid_group=True`` allows it inside an accumulation group and gives the state as of the
        last closed group (all of it changes only at a group's end; the open group's
        micro-batches are not in it: a loop that saves there, as Lightning may, resumes at that
        boundary).

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                       torch.nn.functional.mse_loss, precision="bf16")
            >>> _ = state.step(torch.ones(4, 2), torch.zeros(4, 1))
            >>> saved = state.state_dict()
            >>> saved["step"], saved["updates"], saved["precision"], saved["accumulation_steps"]
            (1, 1, 'bf16', 1)
        """
        if self._micro and not mid_group:  # (a pending backward has counted its micro-batch)
            raise RuntimeError("state_dict() called inside an accumulation group; call it after a step closes, or "
                               "state_dict(mid_group=True) for the last closed step's state (a framework's "
                               "checkpoint mid-group: accelerator.save_state)")
        return {
            "scaler": self.scaler.state_dict(),
            "step": self.steps,
            "updates": self.updates,
            "precision": self.precision.name,
            "accumulation_steps": self.accumulation_steps,
            # (a state loaded for a monitor not registered again yet travels on: a second resume keeps it)
            "monitors": {**getattr(self.monitors, "saved", {}),
                         **{name: monitor.state_dict() for name, monitor in self.monitors.items()}},
            **({"applied": dict(self._applied)} if len(self.optimizers) > 1 else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; precision and accumulation must match.

        Example::

            >>> def make(precision):
            ...     model = torch.nn.Linear(2, 1)
            ...     return AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                          torch.nn.functional.mse_loss, precision=precision)
            >>> state = make("bf16")
            >>> _ = state.step(torch.ones(4, 2), torch.zeros(4, 1))
            >>> resumed = make("bf16")
            >>> resumed.load_state_dict(state.state_dict())
            >>> resumed.steps, resumed.updates
            (1, 1)
            >>> make("fp32").load_state_dict(state.state_dict())
            Traceback (most recent call last):
            ...
            ValueError: state was saved with precision='bf16', this step uses 'fp32'
        """
        _check_state(state)
        for key in ("precision", "accumulation_steps"):  # (before the scaler: a bf16 state holds none)
            mine = self.precision.name if key == "precision" else self.accumulation_steps
            if state.get(key) != mine:
                raise ValueError(f"state was saved with {key}={state.get(key)!r}, this step uses {mine!r}")
        if self.scaler.is_enabled() and not state["scaler"]:
            raise ValueError("Guard.load_state_dict(): the state holds no loss-scaler state, which an fp16 guard's "
                             "state_dict() saves: its scale would start again unsaid")
        saved = sorted(state.get("applied", {"optimizer": 0}))
        if saved != sorted(self._applied):
            raise ValueError(f"state was saved with optimizers {saved}, this step has {sorted(self._applied)}")
        monitors = state.get("monitors", {})
        for name, monitor in self.monitors.items():  # (a state a monitor refuses: refused before anything is
            if name in monitors and hasattr(monitor, "check_state"):  # restored, review 47e; one with no
                monitor.check_state(monitors[name], f"Guard.load_state_dict(): monitors.{name}.")  # check: its load)
        if state["scaler"] and not self.scaler.is_enabled():  # (review 53n: GradScaler's load drops it, unsaid)
            warn(f"Guard.load_state_dict(): the state's loss scale {state['scaler'].get('scale', '?')} is "
                 "not taken: this guard's loss scaler is off (scaler enabled: False); the run goes on "
                 "unscaled", AmpguardWarning, stacklevel=user_stacklevel())
        elif state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state["step"])
        self.updates = int(state["updates"])
        if "applied" in state:
            self._applied = {name: int(state["applied"][name]) for name in self._applied}
        else:
            self._applied = {name: self.updates for name in self._applied}
        saved = dict(monitors)
        for name, monitor in self.monitors.items():
            if name in saved:
                monitor.load_state_dict(saved.pop(name))
        if isinstance(self.monitors, _Monitors):  # (the rest: for monitors the loop registers after the load)
            self.monitors.saved = saved
        self._scheduler_epochs.clear()  # (a restore loads the schedulers' states with it)
        self._abandon_group()
        self._look_all = True  # (a resumed run's first step looks at every parameter, as a fresh one's does)


def _check_state(state: Any) -> None:
    """What :meth:`Guard.load_state_dict` is given has the shape :meth:`Guard.state_dict` gives,
    checked before anything is restored (a missing key was a bare ``KeyError``, ``monitors=None``
    an ``AttributeError``, ``step=2.7`` truncated, ``updates`` past ``step`` taken). An fp16
    state without its scaler's is refused after the precision is compared (a bf16 state given
    to an fp16 guard is named by its precision).

    Example::

        >>> _check_state({"step": 3, "updates": 4, "scaler": {}, "precision": "fp16", "accumulation_steps": 1})
        Traceback (most recent call last):
        ...
        ValueError: Guard.load_state_dict(): step 3 and updates 4 must be whole numbers, updates <= step
        >>> _check_state({"step": 3, "updates": 3, "scaler": {}})  # (one built by hand)
        Traceback (most recent call last):
        ...
        ValueError: Guard.load_state_dict(): the state has no precision, accumulation_steps (its keys: scaler, step, updates): not what Guard.state_dict() returned; a plain GradScaler's state goes to guard.scaler.load_state_dict(), or hand the GradScaler itself over as Guard(scaler=...)
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"Guard.load_state_dict() takes what state_dict() returned (a dict), got a "
                         f"{type(state).__name__}")
    # (review 56d: a state built by hand without its precision was refused as "saved with precision=None")
    missing = [key for key in ("step", "updates", "scaler", "precision", "accumulation_steps") if key not in state]
    if missing:
        raise ValueError(f"Guard.load_state_dict(): the state has no {', '.join(missing)} (its keys: "
                         f"{', '.join(map(str, sorted(state, key=str)))}): not what Guard.state_dict() returned; a "
                         "plain GradScaler's state goes to guard.scaler.load_state_dict(), or hand the GradScaler "
                         "itself over as Guard(scaler=...)")
    step, updates = state["step"], state["updates"]
    if not (whole_number(step) and whole_number(updates) and updates <= step):
        raise ValueError(f"Guard.load_state_dict(): step {step!r} and updates {updates!r} must be whole numbers, "
                         "updates <= step")
    applied = state.get("applied", {})
    if not (isinstance(applied, Mapping) and all(whole_number(n) and n <= step for n in applied.values())):
        raise ValueError(f"Guard.load_state_dict(): applied {applied!r} must map each optimizer to a whole number "
                         "of updates, at most step")
    if not isinstance(state.get("monitors", {}), Mapping):
        raise ValueError(f"Guard.load_state_dict(): monitors {state['monitors']!r} must be a dict of their states")


def _initial_lr(group: dict[str, Any]) -> torch.Tensor:
    """A param group's base LR for ``lr_schedule``: its ``initial_lr``, set from its LR the first
    time, as torch's schedulers set it, so it is saved with the optimizer's state and a resume that
    loads the optimizer before building the guard keeps the base (its LR then is the schedule's
    last, decayed one: the factor was applied twice). A device tensor on the LR's device."""
    lr = group["lr"]
    if "initial_lr" not in group:
        group["initial_lr"] = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
    base = group["initial_lr"]
    device = lr.device if isinstance(lr, torch.Tensor) else None
    return torch.as_tensor(base, dtype=torch.float32, device=device).detach().clone()


class GuardSettings(TypedDict, total=False):
    """:class:`Guard`'s keywords, each optional, for the functions that pass them on
    (``AmpTrainState(model, optimizer, loss_fn, **settings)``, ``make_guard(accelerator, model,
    optimizer, **settings)``): typed as ``**settings: Unpack[GuardSettings]`` (PEP 692), a
    misspelt keyword or a wrong value is a type checker's error there as it is at ``Guard(...)``
    (review 56e). Type checking only: at run time ``Guard()`` checks what it is given. Each is
    typed as Guard's own parameter (a test keeps the two the same).
    """

    precision: PrecisionName | Precision
    max_norm: float | None
    accumulation_steps: int
    scheduler: Any
    device: str | torch.device | None
    scaler: torch.amp.GradScaler | dict[str, Any] | None
    scheduler_on_skip: SchedulerOnSkip
    sync_free: bool
    lr_schedule: Callable[[torch.Tensor], torch.Tensor] | None
    frozen: Frozen
    fuse_tail: bool


class _NoBatch:
    """``AmpTrainState.step()``'s default: no batch given (only ``step(close=True)`` takes none);
    shown so in ``help()``, not as an ``<object object at 0x...>``."""

    def __repr__(self) -> str:
        return "<no batch>"


_NO_BATCH: Any = _NoBatch()  # (AmpTrainState.step without a batch: only step(close=True))


class AmpTrainState(Guard):
    """The guarded step for the common loop shape: ``loss_fn(model(inputs), targets)``.

    ``step(inputs, targets)`` runs the forward and the loss inside :meth:`Guard.autocast`, then
    :meth:`Guard.backward` and :meth:`Guard.step`, once per micro-batch: ``None`` inside an
    accumulation group, else the group's :class:`StepLog` or :class:`SkipLog`. Every other
    argument, the records, host reads and ``state_dict`` are :class:`Guard`'s.

    Example::

        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = AmpTrainState(model, opt, torch.nn.functional.mse_loss, precision="bf16")
        >>> log = state.step(torch.randn(8, 4), torch.randn(8, 1))
        >>> log.step, log.skipped, state.updates
        (1, False, 1)
    """

    def __init__(self, model: nn.Module, optimizer: Optimizers,
                 loss_fn: Callable[[Any, Any], torch.Tensor], **settings: Unpack[GuardSettings]) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError("AmpTrainState calls model(inputs): pass one module, or use Guard for several")
        if not callable(loss_fn):  # (None failed at the first step: "'NoneType' object is not callable")
            raise ValueError(f"AmpTrainState calls loss_fn(outputs, targets): it must be callable, got "
                             f"{type(loss_fn).__name__}")
        super().__init__(model, optimizer, **settings)
        self.loss_fn = loss_fn

    # (help() and inspect show Guard's keywords, which **settings passes on: review 49b; type checkers and
    # editors read them from GuardSettings)
    __init__.__signature__ = (lambda sig: sig.replace(parameters=[  # type: ignore[attr-defined]
        *list(sig.parameters.values())[:3],
        inspect.Parameter("loss_fn", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="Callable[[Any, Any], Tensor]"),
        *list(sig.parameters.values())[3:]]))(inspect.signature(Guard.__init__))

    def step(self, inputs: Any = _NO_BATCH, targets: Any = _NO_BATCH, *,  # type: ignore[override]
             close: bool = False) -> StepLog | SkipLog | PendingStep | None:
        """Forward and backward one micro-batch; at the end of a group, update (or skip).
        ``close=True`` on a loader's last batch ends a short group, as :meth:`Guard.step`'s;
        ``step(close=True)`` with no batch, after the loop, closes the group the loader ended in.

        Example (three batches, groups of two: the last group closed short, on its batch or after)::

            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
            ...                       torch.nn.functional.mse_loss, precision="fp32", accumulation_steps=2)
            >>> [type(state.step(torch.ones(1, 2), torch.zeros(1, 1), close=last)).__name__
            ...  for last in (False, False, True)]
            ['NoneType', 'StepLog', 'StepLog']
            >>> [type(state.step(torch.ones(1, 2), torch.zeros(1, 1))).__name__ for _ in range(3)]
            ['NoneType', 'StepLog', 'NoneType']
            >>> state.step(close=True).step
            4
            >>> state.step(close=True) is None  # (nothing open: the loader ended on a group's boundary)
            True
        """
        if inputs is _NO_BATCH or targets is _NO_BATCH:
            if inputs is _NO_BATCH and targets is _NO_BATCH and close:  # (the group a loader ended inside)
                return super().step(close=True)
            raise TypeError("AmpTrainState.step(inputs, targets) takes a batch; with none, only step(close=True) "
                            "after the loop, which closes the group the loader ended inside")
        with self.autocast():  # (which copies the running statistics before the forward writes them)
            loss = self.loss_fn(self.model(inputs), targets)
        self.backward(loss)
        return super().step(close=close)
