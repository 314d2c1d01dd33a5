"""Fault injection: bad data and bad gradients on purpose, to watch the guard rails work.

A fault is ``KIND@WHEN``:

- KIND: ``inf_grad`` / ``nan_grad`` (one gradient element set by a gradient hook),
  ``nan_loss`` (the loss multiplied by NaN), ``spike`` (targets x 1e8: a real loss spike; with integer targets, tokens or
  class labels, the loss x 1e8),
  ``nan_input`` (one input element set to NaN).
- WHEN (1-based step numbers): ``5``, ``5,9,12``, ``every:10`` (10, 20, ...),
  ``rate:0.05`` (each step independently with that probability, seeded, and the same on resume).
- Optionally ``@rankR`` after WHEN (``nan_loss@5@rank1``): only that rank of a distributed run.

Injection wraps the data stream, the loss function and a gradient hook; the training step has
no branch for it. The data wrapper is what tells the other two which step is being fed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import InputError

# (the specs, torch-free there: config reads them without torch; here as ever: faults.parse_fault)
from .fault_specs import KINDS, SPIKE_FACTOR, Fault, check_ranks, check_steps, parse_fault, parse_faults

__all__ = ["KINDS", "SPIKE_FACTOR", "Fault", "FaultInjector", "check_nan_input", "check_ranks", "check_steps",
           "floating_tensor", "has_floating_input", "parse_fault", "parse_faults"]


class FaultInjector:
    """Wraps a micro-batch stream, a loss function and a model with the given faults.

    Faults for another rank than ``rank`` are dropped.

    Example::

        >>> inj = FaultInjector([parse_fault("nan_loss@2"), parse_fault("spike@3@rank1")])
        >>> loss_fn = inj.wrap_loss(torch.nn.functional.mse_loss)
        >>> batches = [(torch.ones(2, 1), torch.zeros(2, 1))] * 3
        >>> [loss_fn(x, y).isnan().item() for x, y in inj.wrap_data(batches)]  # rank 0: no spike
        [False, True, False]
    """

    def __init__(
        self, faults: Iterable[Fault], accumulation_steps: int = 1, first_step: int = 1, rank: int = 0
    ) -> None:
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.accumulation_steps = accumulation_steps
        self.first_step = first_step
        self.current_step = 0  # the step whose micro-batch was handed out last
        self._hooks: list[Any] = []
        self.fired: set[int] = set()
        """The steps at which an ``inf_grad`` / ``nan_grad`` fault fired (set a gradient element)."""
        self._grads_attached = False  # (attach armed the gradient faults: missed() can tell)
        self._armed = False  # (a batch or a forward since the last injection: the next gradient hook takes one)

    def active(self, kind: str) -> bool:
        """Whether a fault of ``kind`` fires at :attr:`current_step` (the step last fed).

        Example::

            >>> inj = FaultInjector([parse_fault("nan_loss@1")])
            >>> inj.current_step = 1
            >>> inj.active("nan_loss"), inj.active("spike")
            (True, False)
        """
        return any(f.kind == kind and f.hits(self.current_step) for f in self.faults)

    def firing(self, step: int) -> list[str]:
        """The specs of this rank's faults that fire at ``step``: what a finding there is, said so;
        less a gradient fault that did not fire there (:meth:`missed`, review 52f).

        Example::

            >>> FaultInjector([parse_fault("nan_loss@2"), parse_fault("inf_grad@every:2"),
            ...                parse_fault("spike@2@rank1")]).firing(2)
            ['nan_loss@2', 'inf_grad@every:2']
        """
        missed = self.missed(step)
        return [f.spec() for f in self.faults if f.hits(step) and f.spec() not in missed]

    def wrap_data(self, batches: Iterable[tuple[Any, Any]], first_step: int | None = None) -> Iterator[tuple[Any, Any]]:
        """Yield the batches, corrupting those of faulted steps (``spike``, ``nan_input``).

        The first batch belongs to step ``first_step`` (default: the injector's), the next
        ``accumulation_steps - 1`` to the same step, and so on.

        Example::

            >>> inj = FaultInjector([parse_fault("nan_input@2")], accumulation_steps=2)
            >>> batches = [(torch.zeros(1, 2), torch.zeros(1))] * 6
            >>> [bool(x.isnan().any()) for x, _ in inj.wrap_data(batches)]  # step 2: batches 3 and 4
            [False, False, True, True, False, False]
        """
        first = self.first_step if first_step is None else first_step
        for i, (inputs, targets) in enumerate(batches):
            self.current_step = first + i // self.accumulation_steps
            self._armed = True  # (its backward takes one gradient fault: attach's)
            if self.active("nan_input"):
                inputs = _with_nan(inputs)
            if self.active("spike") and floating_tensor(targets):
                targets = targets * SPIKE_FACTOR
            yield inputs, targets

    def wrap_loss(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Callable[[Any, Any], torch.Tensor]:
        """The loss function, made NaN (``nan_loss``) or 1e8 times larger (``spike`` with
        integer targets such as class labels or tokens, which cannot be scaled themselves).

        Example::

            >>> inj = FaultInjector([parse_fault("spike@1")])
            >>> loss_fn = inj.wrap_loss(torch.nn.functional.cross_entropy)
            >>> inj.current_step = 1
            >>> logits, labels = torch.zeros(2, 3), torch.tensor([0, 1])
            >>> ratio = loss_fn(logits, labels) / torch.nn.functional.cross_entropy(logits, labels)
            >>> round(ratio.item() / SPIKE_FACTOR, 3)
            1.0
        """

        def injected_loss(outputs: Any, targets: Any) -> torch.Tensor:
            loss = loss_fn(outputs, targets)
            if self.active("nan_loss"):
                loss = loss * float("nan")
            if self.active("spike") and not floating_tensor(targets):
                loss = loss * SPIKE_FACTOR
            return loss

        injected_loss.__wrapped__ = loss_fn  # type: ignore[attr-defined]  # (a diagnosis names the task's loss)
        return injected_loss

    def attach(self, model: nn.Module) -> None:
        """Arm ``inf_grad`` / ``nan_grad``: on the faulted step, element 0 of the first parameter
        gradient each backward produces is set (a gradient hook on every trainable parameter; each
        micro-batch handed out and each forward of the model arm one injection, the first of the
        hooks to run takes it: a diagnosis's replays of the batch each get it too).

        Review 52f: the hook sat on the first trainable parameter alone; one that takes no part in
        the backward (an auxiliary head defined first, an expert not routed) never ran it, and the
        fault never fired while the run card said it was injected. A pass that runs no backward
        (``locate``'s replay of a non-finite loss; the guarded step runs one, seeded 0) fires none:
        :meth:`missed` names it, :meth:`firing` leaves it out.

        An FSDP2-sharded parameter is never run through by the backward pass (FSDP2 computes with
        unsharded copies and writes the reduced shard into ``.grad``), so there the hook sits on
        the gradient flowing back into the model's output instead, through a forward hook.

        Example (the first parameter, an unused head's, gets no gradient; the fault fires all the same)::

            >>> model = torch.nn.ModuleDict({"unused": torch.nn.Linear(2, 2), "used": torch.nn.Linear(2, 1)})
            >>> inj = FaultInjector([parse_fault("inf_grad@2")])
            >>> inj.attach(model)
            >>> for x, y in inj.wrap_data([(torch.ones(1, 2), torch.zeros(1, 1))] * 2):
            ...     model.zero_grad()
            ...     torch.nn.functional.mse_loss(model["used"](x), y).backward()
            ...     print(inj.current_step, sum(int(torch.isinf(p.grad).sum()) for p in model["used"].parameters()))
            1 0
            2 1
            >>> inj.detach()
        """
        if not any(f.kind in ("inf_grad", "nan_grad") for f in self.faults):
            return
        self._grads_attached = True

        def grad_hook(grad: torch.Tensor) -> torch.Tensor:
            if not self._armed:  # (fired already in this backward: one element of one gradient)
                return grad
            for kind, value in (("inf_grad", float("inf")), ("nan_grad", float("nan"))):
                if self.active(kind):
                    self._armed = False
                    self.fired.add(self.current_step)
                    grad = grad.clone()
                    grad[(0,) * grad.dim()] = value  # (not view(-1): a channels_last gradient has no such view)
            return grad

        def arm(*_: Any) -> None:  # a forward of the model: its backward takes one injection
            self._armed = True

        def forward_hook(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                arm()
                out.register_hook(grad_hook)

        params = [p for p in model.parameters() if p.requires_grad]
        if any(hasattr(p, "placements") for p in params):  # a DTensor: FSDP2
            self._hooks.append(model.register_forward_hook(forward_hook))
            return
        self._hooks.append(model.register_forward_pre_hook(arm))
        self._hooks += [p.register_hook(grad_hook) for p in params]

    def missed(self, step: int) -> list[str]:
        """The specs of this rank's ``inf_grad`` / ``nan_grad`` faults that hit ``step`` and did
        not fire there: no backward of the step reached a parameter (its loss was not finite, and
        it ran none). Only once :meth:`attach` armed them, and the step's backward has run.

        Example::

            >>> inj = FaultInjector([parse_fault("inf_grad@1"), parse_fault("nan_loss@1")])
            >>> inj.attach(torch.nn.Linear(2, 1))
            >>> inj.missed(1), inj.firing(1)  # (no backward ran at step 1)
            (['inf_grad@1'], ['nan_loss@1'])
        """
        if not self._grads_attached or step in self.fired:
            return []
        return [f.spec() for f in self.faults if f.kind in ("inf_grad", "nan_grad") and f.hits(step)]

    def detach(self) -> None:
        """Remove the hooks :meth:`attach` added; the model's gradients are left alone from then on."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _with_nan(inputs: Any) -> Any:
    """``inputs`` with element 0 of its first floating-point tensor NaN (a copy; inputs held in a
    tuple, a list or a dict are searched in order, review 50a: a dict of float tensors was refused
    as "integer tokens").

    Example::

        >>> out = _with_nan({"ids": torch.tensor([1, 2]), "features": torch.zeros(2, 2)})
        >>> out["ids"].tolist(), out["features"].isnan().sum().item()
        ([1, 2], 1)
    """
    leaves, spec = tree_flatten(inputs)
    first = next((i for i, leaf in enumerate(leaves) if floating_tensor(leaf) and leaf.numel()), None)
    if first is None:
        raise ValueError("nan_input needs a floating-point input tensor")
    leaves[first] = leaves[first].clone()
    leaves[first][(0,) * leaves[first].dim()] = float("nan")  # (by index: a channels_last copy has no view(-1), review 50h)
    return tree_unflatten(leaves, spec)


def check_nan_input(task: Any, faults: Iterable[Fault]) -> None:
    """One :class:`InputError` line when ``nan_input`` is asked of a task whose inputs hold no
    floating-point tensor (``task.float_inputs``: :func:`has_floating_input` of its first batch).

    Example::

        >>> from types import SimpleNamespace
        >>> check_nan_input(SimpleNamespace(name="charlm", float_inputs=False), [parse_fault("nan_input@2")])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: inject: nan_input needs a floating-point input tensor; the inputs of task charlm hold none
    """
    if not task.float_inputs and any(f.kind == "nan_input" for f in faults):
        raise InputError(f"inject: nan_input needs a floating-point input tensor; the inputs of task {task.name} hold none")


def floating_tensor(value: Any) -> bool:
    """Whether ``value`` is a floating-point tensor (a spike scales such targets; other targets,
    labels, a tuple of heads' targets, get their loss scaled: review 50a, a tuple failed the run as bad data).

    Example::

        >>> floating_tensor(torch.zeros(1)), floating_tensor(torch.tensor([1])), floating_tensor((torch.zeros(1),))
        (True, False, False)
    """
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def has_floating_input(inputs: Any) -> bool:
    """Whether ``nan_input`` can corrupt ``inputs``: a non-empty floating-point tensor in it.

    Example::

        >>> has_floating_input(torch.tensor([1, 2])), has_floating_input({"x": torch.zeros(2)})
        (False, True)
    """
    return any(floating_tensor(leaf) and leaf.numel() for leaf in tree_flatten(inputs)[0])
