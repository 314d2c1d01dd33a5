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

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import InputError, counted, plain_digits, shortened

KINDS: tuple[str, ...] = ("inf_grad", "nan_grad", "nan_loss", "spike", "nan_input")
SPIKE_FACTOR = 1e8
MAX_SHOWN = 60
"""The most characters of a fault's spec an error line shows (its head and tail: :func:`_shown`)."""


@dataclass(frozen=True)
class Fault:
    """One ``KIND@WHEN`` fault; :meth:`hits` says whether it fires at a step.

    Example::

        >>> fault = Fault("nan_grad", every=3)
        >>> [step for step in range(1, 10) if fault.hits(step)], fault.spec()
        ([3, 6, 9], 'nan_grad@every:3')
    """

    kind: str
    steps: frozenset[int] = frozenset()
    every: int | None = None
    rate: float | None = None
    seed: int = 0
    rank: int | None = None

    def hits(self, step: int) -> bool:
        """Whether the fault fires at ``step`` (1-based); a ``rate`` fault answers the same every time.

        Example::

            >>> fault = parse_fault("spike@rate:0.5", seed=1)
            >>> first = [fault.hits(s) for s in range(1, 21)]
            >>> first == [fault.hits(s) for s in range(1, 21)], 0 < sum(first) < 20
            (True, True)
        """
        if self.every is not None:
            return step % self.every == 0
        if self.rate is not None:
            # A fresh generator per (seed, kind, step): the same answer in any order, after a resume.
            return random.Random(f"{self.seed}:{self.kind}:{step}").random() < self.rate
        return step in self.steps

    def spec(self) -> str:
        """The ``KIND@WHEN[@rankR]`` text :func:`parse_fault` reads back to this fault.

        Example::

            >>> parse_fault("inf_grad@12,5@rank1").spec()
            'inf_grad@5,12@rank1'
        """
        if self.every is not None:
            when = f"every:{self.every}"
        elif self.rate is not None:
            when = f"rate:{self.rate:g}"
        else:
            when = ",".join(str(s) for s in sorted(self.steps))
        return f"{self.kind}@{when}" + (f"@rank{self.rank}" if self.rank is not None else "")


def parse_fault(spec: str, seed: int = 0) -> Fault:
    """Parse ``KIND@WHEN``; raise ``ValueError`` with one line naming what is wrong.

    Example::

        >>> fault = parse_fault("nan_loss@5,9")
        >>> fault.kind, sorted(fault.steps), fault.every, fault.rank
        ('nan_loss', [5, 9], None, None)
        >>> parse_fault("inf_grad@every:10@rank1").rank
        1
        >>> parse_fault("nan_loss")
        Traceback (most recent call last):
        ...
        ValueError: fault 'nan_loss' needs @WHEN, e.g. nan_loss@5, nan_loss@every:10, nan_loss@rate:0.05
    """
    kind, sep, when = spec.partition("@")
    kind, when = kind.strip(), when.strip()
    if kind not in KINDS:  # (before the rank's: its example names the kind)
        raise ValueError(f"unknown fault kind {_shown(kind)} in {_shown(spec)} (kinds: {', '.join(KINDS)})")
    rank = None
    when, at, rank_text = when.partition("@")
    if at:
        rank_text = rank_text.strip()
        # (int() refuses more than 4,300 digits in its own words, which named no fault)
        if not (rank_text.startswith("rank") and rank_text[4:].isdigit() and rank_text.isascii()
                and len(rank_text[4:].lstrip("0")) <= 18):
            raise ValueError(f"bad rank in fault {_shown(spec)}: use @rankR after WHEN, e.g. {kind}@5@rank1")
        rank = int(rank_text[4:].lstrip("0") or "0")  # (int() counts leading zeros against its limit)
    if not sep or not when:
        raise ValueError(f"fault {_shown(spec)} needs @WHEN, e.g. {kind}@5, {kind}@every:10, {kind}@rate:0.05")
    try:
        if not plain_digits(when):  # (int() reads '１', '٣' and 1_000: a config writes none of them)
            raise ValueError
        if when.startswith("every:"):
            every = int(when.removeprefix("every:"))
            if every < 1:
                raise ValueError
            return Fault(kind, every=every, seed=seed, rank=rank)
        if when.startswith("rate:"):
            rate = float(when.removeprefix("rate:"))
            if not 0.0 < rate <= 1.0:  # (rate:0 never fires: the run would look clean for the wrong reason)
                raise ValueError
            return Fault(kind, rate=rate, seed=seed, rank=rank)
        steps = frozenset(int(s) for s in when.split(","))
        if min(steps) < 1:
            raise ValueError
        return Fault(kind, steps=steps, seed=seed, rank=rank)
    except ValueError:
        raise ValueError(
            f"bad WHEN in fault {_shown(spec)}: use step numbers >= 1 (5 or 5,9,12), every:K with K >= 1, or rate:P with "
            "0 < P <= 1"
        ) from None


def _shown(spec: str) -> str:
    """A fault's spec (or its kind) for an error line: its repr, cut short (``--inject
    nan_loss@<5,000 digits>`` was echoed whole, an unknown kind of 5,000 characters twice).

    Example::

        >>> _shown("nan_loss@5"), len(_shown("nan_loss@" + "9" * 5000))
        ("'nan_loss@5'", 60)
    """
    return shortened(repr(spec), MAX_SHOWN)


def check_ranks(faults: Iterable[Fault], world_size: int) -> None:
    """Refuse (``ValueError``, one line) a fault aimed at a rank the run does not have: it
    would never fire, and the run would look clean for the wrong reason.

    Example::

        >>> check_ranks([parse_fault("nan_loss@40@rank1")], world_size=2)
        >>> check_ranks([parse_fault("nan_loss@40@rank3")], world_size=1)
        Traceback (most recent call last):
        ...
        ValueError: fault 'nan_loss@40@rank3' targets rank 3, but this run has 1 process (rank 0 only; torchrun --nproc_per_node sets more)
    """
    for fault in faults:
        if fault.rank is not None and fault.rank >= world_size:
            ranks = "rank 0 only" if world_size == 1 else f"ranks 0 to {world_size - 1}"
            processes = counted(world_size, "process", "processes")
            more = "; torchrun --nproc_per_node sets more" if world_size == 1 else ""
            raise ValueError(f"fault {_shown(fault.spec())} targets rank {fault.rank}, but this run has {processes} "
                             f"({ranks}{more})")


def check_steps(faults: Iterable[Fault], steps: int, start: int = 1) -> None:
    """Refuse (``ValueError``, one line) a fault that fires at none of the steps the run trains,
    ``start`` to ``steps`` (all its steps, or its ``every``, beyond ``steps``; or, on a resume
    from step ``start - 1``, all before ``start``): as one aimed at a missing rank, it would never
    fire, and the run would look clean for the wrong reason.

    Example::

        >>> check_steps([parse_fault("nan_loss@5,500"), parse_fault("spike@every:20")], steps=20)
        >>> check_steps([parse_fault("inf_grad@500")], steps=20)
        Traceback (most recent call last):
        ...
        ValueError: fault 'inf_grad@500' never fires: the run has 20 steps (config steps; a step counts optimizer steps, not micro-batches); drop it (given with --inject: leave it out; from a config: --inject none, or --set inject=[...])
        >>> check_steps([parse_fault("nan_loss@2,3")], steps=8, start=5)
        Traceback (most recent call last):
        ...
        ValueError: fault 'nan_loss@2,3' never fires: the run resumes after step 4 (its steps 5 to 8 are left to train)
    """
    def fires(fault: Fault, first: int) -> bool:  # at some step from `first` to `steps`
        if fault.rate is not None:
            return first <= steps
        if fault.every is not None:
            return steps // fault.every * fault.every >= first
        return any(first <= step <= steps for step in fault.steps)

    for fault in faults:
        if fires(fault, start):
            continue
        if fires(fault, 1):  # (it would have, had the run not resumed past it)
            raise ValueError(f"fault {_shown(fault.spec())} never fires: the run resumes after step {start - 1} (its steps "
                             f"{start} to {steps} are left to train)")
        raise ValueError(f"fault {_shown(fault.spec())} never fires: the run has {counted(steps, 'step')} (config steps; a step "
                         "counts optimizer steps, not micro-batches); drop it (given with --inject: leave it out; from a "
                         "config: --inject none, or --set inject=[...])")


def parse_faults(specs: Iterable[str], *, seed: int, steps: int, world_size: int = 1, start: int = 1) -> list[Fault]:
    """A run's ``inject`` list, parsed and checked against the steps it trains (``start`` to
    ``steps``) and its ranks (:func:`check_steps`, :func:`check_ranks`); a fault that cannot fire
    is one :class:`~ampguard.errors.InputError` line.

    Example::

        >>> [f.spec() for f in parse_faults(["nan_loss@3"], seed=0, steps=5)]
        ['nan_loss@3']
        >>> parse_faults(["nan_loss@3@rank1"], seed=0, steps=5)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: inject: fault 'nan_loss@3@rank1' targets rank 1, but this run has 1 process (rank 0 only; torchrun --nproc_per_node sets more)
    """
    faults = [parse_fault(spec, seed=seed) for spec in specs]
    try:
        check_ranks(faults, world_size)
        check_steps(faults, steps, start)
    except ValueError as err:
        raise InputError(f"inject: {err}") from None
    return faults


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
