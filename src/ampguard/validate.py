"""``ampguard validate``: did mixed precision change what the model decides?

The acceptance test of a precision choice, with every rule declared in the config before the
run (``validation``): a fixed probe set (typical held-out examples, edge cases, and the
examples nearest a decision boundary in FP32; each example probed once, with all its tags), a
score tolerance per output, a tie rule, a quality rule relative to the reference (and optional
absolute floors) on a fixed evaluation set, and no non-finite output. The model is fixed
(weights, eval mode). The FP32 reference runs first and is checked itself: a non-finite or
low-quality reference is reported as such, never trusted; with no floor declared
(``validation.min_accuracy`` / ``max_mse``) its quality is ``NOT CHECKED`` and the verdict
rejects, saying what to declare (an untrained model is finite too: no baseline to accept a
precision against). Then each AMP precision is compared with it, rule by
rule, and every probe keeps its record (scores, decisions, margins, tags). The environment
names the backend: ``rocm`` (with its HIP version) where PyTorch still calls the device ``cuda``.
The evaluation set is the task's held-out set; a factory that returns none is judged on its first
training batches, and the report says so (``evaluation_set``; those probes are ``train:<i>``).

A model's outputs are named: a tensor is ``output``; a dict's are its keys; a tuple's or list's
are their indices as strings (``"0"``, ``"1"``...). ``validation.outputs.<name>`` gives one its
own tolerance. Decisions and quality are read from the first output.

Diagnostics only: the training step never imports this.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .build import prepare_model, resolve_device, to_device
from .config import Config, flat_keys
from .errors import (AmpguardWarning, ExitCode, InputError, counted, failed_because, listed, table_cell, user_code,
                     visible, warn)
from .files import CAN_PROBE_PROCESSES, DiskFull, make_parents, open_to_append, replace_atomically
from .precision import Precision, backend_of, fp32_settings
from .records import strict_json
from .tasks import Task, seed_everything, untrained_model
from .tasks.factory import TrainingBatches, factory_file
from .untouched import BufferSnapshot, modes_kept, rng_kept, untouched

CHUNK = 256
"""Examples per forward pass in :func:`_scores`."""
SINGLE_OUTPUT = "output"
"""The name of a model's output when it returns one tensor."""
TIE_POLICIES = {"count_as_flip": "count as flips", "accept": "accepted", "reject": "reject the run"}
"""``validation.ties``, as the report words it."""
VERDICT_DOUBTS = {"not trusted": "FP32 reference not trusted",
                  "quality not checked": "reference quality not checked: declare {key}"}
"""Why the reference is not relied on (:attr:`Validation.reference_doubt`), as the verdict line
on stdout words it (``{key}``: the floor to declare)."""
REPORT_DOUBTS = {"not trusted": "the FP32 reference itself is not trusted",
                 "quality not checked": "the FP32 reference's quality was not checked: declare {key}"}
"""The same, as ``validation.md`` words it under its title."""


class ModelRaised(InputError):
    """The model (or the task's ``predict``) raised under a precision: bad input under the FP32
    reference, a failed precision under AMP once the reference ran. ``why`` is the cause in one
    line, with its type: what the report's rule "runs under <precision>" quotes.

    Example::

        >>> ModelRaised("validate: task toy: ... raised under bf16: KeyError: 'x'", "KeyError: 'x'").why
        "KeyError: 'x'"
    """

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass
class Rule:
    """One rule and how it came out: the reference's value, the AMP value, pass or not. A rule
    with nothing declared to check against (the reference's quality when neither
    ``validation.min_accuracy`` nor ``validation.max_mse`` is set) is ``checked=False``: it
    fails nothing (``ok``), and it passes nothing either: it reads ``NOT CHECKED``.

    Example::

        >>> Rule("complete and finite", "7/7", "6/7", ok=False).decision
        'FAIL'
    """

    criterion: str
    reference: str
    amp: str
    ok: bool
    """Not violated: a rule that was not checked is ``ok`` (it rejects nothing)."""
    checked: bool = True
    """There was a declared rule to check against."""

    @property
    def decision(self) -> str:
        """``pass``, ``FAIL`` or ``NOT CHECKED``, as the report's tables write it.

        Example::

            >>> [Rule("c", "", "", ok).decision for ok in (True, False)]
            ['pass', 'FAIL']
            >>> Rule("reference quality", "mse 1.444 (no maximum declared)", "", True, checked=False).decision
            'NOT CHECKED'
        """
        if not self.ok:
            return "FAIL"
        return "pass" if self.checked else "NOT CHECKED"


@dataclass
class PrecisionResult:
    """One AMP precision against the FP32 reference: its rules, decision flips and ties, one
    record per probe, stats.

    Example::

        >>> result = PrecisionResult("fp16", rules=[Rule("complete and finite", "7/7", "7/7", True)])
        >>> result.ok, result.flips, result.records
        (True, [], [])
    """

    precision: str
    rules: list[Rule] = field(default_factory=list)
    flips: list[dict[str, Any]] = field(default_factory=list)
    ties: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    """Per probe: its tags, FP32 and AMP top-k scores and decisions, margins, and whether it
    flipped, tied or deviated beyond the tolerance."""

    @property
    def ok(self) -> bool:
        """Every rule of this precision holds.

        Example::

            >>> result = PrecisionResult("bf16", rules=[Rule("a", "", "", True), Rule("b", "", "", False)])
            >>> result.ok, PrecisionResult("bf16", rules=result.rules[:1]).ok
            (False, True)
        """
        return all(rule.ok for rule in self.rules)


@dataclass
class Validation:
    """The whole comparison: the probes, the reference's own checks, one result per precision.

    Example::

        >>> v = Validation("linear", "regression", ["held_out:0"], [Rule("reference quality", "mse 0.1", "", True)],
        ...                [PrecisionResult("bf16", [Rule("complete and finite", "1/1", "1/1", True)])])
        >>> v.ok, v.weights
        (True, 'freshly initialised')
    """

    task: str
    mode: str
    probes: list[str]
    reference: list[Rule]
    results: list[PrecisionResult]
    training: list[dict[str, Any]] = field(default_factory=list)
    weights: str = "freshly initialised"
    tags: dict[str, list[str]] = field(default_factory=dict)
    """Each probe's tags: ``typical``, ``boundary`` (both for one example when it is both), ``edge``."""
    environment: dict[str, Any] = field(default_factory=dict)
    """What it takes to reproduce the report: versions, device, dtype support, hashes."""
    evaluation_set: dict[str, Any] = field(default_factory=dict)
    """Where the evaluation set came from (:func:`evaluation_set`); empty for one made by hand."""
    earlier: list[dict[str, Any]] = field(default_factory=list)
    """Earlier verdicts that rejected these weights under other rules or on another probe set
    (:func:`earlier_rejections`): a rule loosened, or a failing probe dropped, after a rejection is
    said, never hidden."""

    @property
    def reference_ok(self) -> bool:
        """No check of the FP32 reference failed (finite; quality, where a floor is declared).

        Example::

            >>> Validation("t", "regression", [], [Rule("reference outputs finite", "1/1", "", False)], []).reference_ok
            False
        """
        return all(rule.ok for rule in self.reference)

    @property
    def reference_quality_checked(self) -> bool:
        """The reference's quality was checked against a declared floor (``validation.min_accuracy``
        or ``validation.max_mse``). Without one, a finite but wrong FP32 run (an untrained model,
        say) passes every other check: it is not shown to be a baseline worth matching.

        Example::

            >>> unchecked = [Rule("reference quality", "mse 1.444 (no maximum declared)", "", True, checked=False)]
            >>> v = Validation("t", "regression", [], unchecked, [PrecisionResult("bf16")])
            >>> v.reference_quality_checked, v.reference_ok, v.reference_trusted, v.ok
            (False, True, False, False)
        """
        return all(rule.checked for rule in self.reference)

    @property
    def reference_trusted(self) -> bool:
        """Every check of the FP32 reference was made and held: finite, and of the declared quality.

        Example::

            >>> Validation("t", "regression", [], [Rule("reference quality", "mse 0.1 (<= 0.5)", "", True)], []).reference_trusted
            True
        """
        return self.reference_ok and self.reference_quality_checked

    @property
    def ok(self) -> bool:
        """Accepted: the FP32 reference is trusted (finite, and of the quality declared before the
        trial) and every precision passes every rule. A reference whose quality was not checked
        (no ``validation.min_accuracy`` / ``max_mse`` declared) rejects: a wrong FP32 run (an
        untrained model, say) is no baseline to accept a precision against, and a gate reading
        the exit code alone would take "not checked" for a pass; the verdict says what to declare.

        Example (a reference failing its checks, or never checked, rejects with no precision failing)::

            >>> bad_reference = [Rule("reference quality", "mse 9", "", False)]
            >>> Validation("t", "regression", [], bad_reference, [PrecisionResult("bf16")]).ok
            False
            >>> unchecked = [Rule("reference quality", "mse 1.444 (no maximum declared)", "", True, checked=False)]
            >>> Validation("t", "regression", [], unchecked, [PrecisionResult("bf16")]).ok
            False
        """
        return self.reference_trusted and all(result.ok for result in self.results)

    @property
    def floor_key(self) -> str:
        """The key that declares the reference's minimum quality for this task's mode.

        Example::

            >>> Validation("t", "classifier", [], [], []).floor_key, Validation("t", "regression", [], [], []).floor_key
            ('validation.min_accuracy', 'validation.max_mse')
        """
        return "validation.min_accuracy" if self.mode == "classifier" else "validation.max_mse"

    @property
    def reference_doubt(self) -> str | None:
        """Why the FP32 reference is not to be relied on, when it is not: ``"not trusted"`` (a
        check of it failed) or ``"quality not checked"`` (no floor declared); ``None`` when it
        is :attr:`reference_trusted`. The verdict line and ``validation.md`` word it each their
        own way (:data:`VERDICT_DOUBTS`, :data:`REPORT_DOUBTS`).

        Example::

            >>> unchecked = [Rule("reference quality", "mse 1.444 (no maximum declared)", "", True, checked=False)]
            >>> Validation("t", "regression", [], unchecked, []).reference_doubt
            'quality not checked'
        """
        if not self.reference_ok:
            return "not trusted"
        if not self.reference_quality_checked:
            return "quality not checked"
        return None

    def verdict_in(self, doubts: Mapping[str, str], mark: str = "") -> str:
        """``ACCEPTED`` or ``REJECTED`` (between two ``mark``: ``**`` bolds it in Markdown), and
        why the reference is not to be relied on when it is not (:attr:`reference_doubt`), in
        the words of ``doubts``.

        Example::

            >>> v = Validation("t", "classifier", [], [Rule("reference outputs finite", "0/1", "", False)], [])
            >>> v.verdict_in(REPORT_DOUBTS, "**")
            '**REJECTED** (the FP32 reference itself is not trusted)'
        """
        words = f"{mark}{'ACCEPTED' if self.ok else 'REJECTED'}{mark}"
        doubt = self.reference_doubt
        return words if doubt is None else f"{words} ({doubts[doubt].format(key=self.floor_key)})"

    @property
    def verdict(self) -> str:
        """The verdict line's words: ``ACCEPTED`` or ``REJECTED``, and why the reference is not
        to be relied on when it is not (a check failed; or its quality was not checked).

        Example::

            >>> unchecked = [Rule("reference quality", "mse 1.444 (no maximum declared)", "", True, checked=False)]
            >>> Validation("t", "regression", [], unchecked, [PrecisionResult("bf16")]).verdict
            'REJECTED (reference quality not checked: declare validation.max_mse)'
            >>> Validation("t", "classifier", [], [Rule("reference outputs finite", "0/1", "", False)], []).verdict
            'REJECTED (FP32 reference not trusted)'
        """
        return self.verdict_in(VERDICT_DOUBTS)


# ---------------------------------------------------------------------------- scores


@dataclass
class Scores:
    """A model's outputs on a batch of examples, by name, each as float32 rows (one per example),
    and the dtype each came out in (autocast may leave some in float32).

    Example::

        >>> s = Scores({"logits": torch.ones(3, 2), "aux": torch.zeros(3, 1)}, {"logits": "torch.bfloat16"})
        >>> tuple(s.primary.shape), s.names
        ((3, 2), ['logits', 'aux'])
    """

    outputs: dict[str, torch.Tensor]
    dtypes: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Each output's shape per example as the model returned it, before its rows were flattened:
    ``(2, 3)`` and ``(3, 2)`` flatten to the same 6 scores, and only this tells them apart."""

    @property
    def names(self) -> list[str]:
        """The outputs' names, in the model's order."""
        return list(self.outputs)

    @property
    def primary(self) -> torch.Tensor:
        """The first output: the one decisions and quality are read from."""
        return next(iter(self.outputs.values()))

    def finite_rows(self) -> torch.Tensor:
        """Per example: every score of every output is finite."""
        return torch.stack([torch.isfinite(t).all(dim=1) for t in self.outputs.values()]).all(dim=0)


def named_outputs(raw: Any) -> list[tuple[str, torch.Tensor]]:
    """A model's outputs by name: a tensor is ``output``, a dict's are its keys, a tuple's or
    list's are their indices as strings; ``None`` entries are left out. Anything else, or an
    entry that is not a tensor, is an :class:`InputError`.

    Example::

        >>> [name for name, _ in named_outputs({"logits": torch.ones(1), "loss": None})]
        ['logits']
        >>> [name for name, _ in named_outputs((torch.ones(1), None, torch.ones(1)))], named_outputs(torch.ones(1))[0][0]
        (['0', '2'], 'output')
        >>> named_outputs("text")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: validate: the model returned a str; validate compares a tensor, or a dict, tuple or list of tensors
    """
    if isinstance(raw, torch.Tensor):
        return [(SINGLE_OUTPUT, raw)]
    if isinstance(raw, Mapping):
        items = [(str(key), value) for key, value in raw.items()]
    elif isinstance(raw, (tuple, list)):
        items = [(str(i), value) for i, value in enumerate(raw)]
    else:
        raise InputError(f"validate: the model returned a {type(raw).__name__}; validate compares a tensor, "
                         "or a dict, tuple or list of tensors")
    items = [(name, value) for name, value in items if value is not None]
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise InputError(f"validate: the model's output {name} is a {type(value).__name__}, not a tensor")
    if not items:
        raise InputError("validate: the model returned no tensor to compare")
    return items


@torch.no_grad()
def _scores(task: Task, model: nn.Module, inputs: torch.Tensor, precision: Precision,
            seed: int | None = None, start: Callable[[], None] | None = None) -> Scores:
    """The model's outputs on ``inputs`` under ``precision``, in chunks of :data:`CHUNK`, the RNG
    seeded with ``seed`` first when one is given (:func:`seed_pass`: every precision then draws the
    same noise, a model that samples in its forward included), and ``start`` called first when
    one is given (a :class:`~ampguard.untouched.BufferSnapshot`'s ``put_back``: every pass then
    starts from the same buffers, a counter or a cache the forward updates included). What the
    user's code does wrong is an :class:`InputError`: the model (or the task's ``predict``)
    raising, outputs that are not one row per example, and a classifier whose first output is not
    one score per class (the decision is the argmax over them).

    Example::

        >>> from ampguard.tasks.base import Task
        >>> task = Task("toy", nn.Linear(2, 1), nn.functional.mse_loss, batches=lambda: iter(()))
        >>> try:
        ...     _scores(task, task.model, torch.ones(3, 2), Precision("fp32", "cpu"))
        ... except InputError as err:
        ...     print(err)
        validate: task toy is a classifier, but its first output (output) has 1 score per example: a classifier's decision is the argmax over one score per class (for a binary logit z, return torch.cat([torch.zeros_like(z), z], 1) from predict), or declare mode 'regression'
        >>> def broken(model, inputs):
        ...     raise ZeroDivisionError("division by zero")
        >>> try:
        ...     _scores(Task("toy", task.model, task.loss_fn, task.batches, predict=broken), task.model,
        ...             torch.ones(3, 2), Precision("bf16", "cpu"))
        ... except InputError as err:
        ...     print(err)
        validate: task toy: the model (or the task's predict) raised under bf16: ZeroDivisionError: division by zero
    """
    device = next(model.parameters()).device
    if start is not None:
        start()
    if seed is not None:
        seed_pass(seed, device)
    parts: dict[str, list[torch.Tensor]] = {}
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for start in range(0, len(inputs), CHUNK):
        chunk = inputs[start : start + CHUNK]
        # the user's code: one line, not a traceback (a sys.exit() in it passed through as validate's
        # own exit: 0, no report, a model never judged)
        with user_code(error=lambda why: ModelRaised(f"validate: task {task.name}: the model (or the task's "
                                                     f"predict) raised under {precision.name}: {why}", why)):
            with precision.reference():  # (fp32: strictly, no TF32)
                raw = task.scores(model, chunk.to(device))
        named = named_outputs(raw)
        if parts and [name for name, _ in named] != list(parts):
            raise InputError(f"validate: the model's outputs changed names between batches "
                             f"({', '.join(parts)} -> {', '.join(name for name, _ in named)})")
        for name, value in named:
            what = "the model's output" if name == SINGLE_OUTPUT else f"the model's output {name}"
            if value.dim() == 0 or value.shape[0] != len(chunk):
                raise InputError(f"validate: {what} has shape {tuple(value.shape)} for "
                                 f"{len(chunk)} examples; validate compares one row per example")
            rows = value.float().reshape(len(chunk), -1)
            each = tuple(value.shape[1:])
            if name in parts and rows.shape[1] != parts[name][0].shape[1]:  # (torch.cat would raise mid-report)
                raise InputError(f"validate: {what} has {rows.shape[1]} scores per example in "
                                 f"one batch and {parts[name][0].shape[1]} in another; validate compares the same "
                                 "scores for every example")
            if name in parts and each != shapes[name]:  # (as many scores, in another layout: compared wrongly)
                raise InputError(f"validate: {what} has shape {each} per example in one batch and {shapes[name]} in "
                                 "another; validate compares the same scores for every example")
            parts.setdefault(name, []).append(rows)
            dtypes[name], shapes[name] = str(value.dtype), each
        if task.mode == "classifier":
            first, rows = next(iter(parts.items()))
            if sum(size != 1 for size in shapes[first]) > 1:  # (flattened, its argmax named no class)
                raise InputError(
                    f"validate: task {task.name} is a classifier, but its first output ({first}) has shape "
                    f"{shapes[first]} per example: a classifier's decision is the argmax over one score per class "
                    "(return (examples, classes) from predict), or declare mode 'regression'")
            if rows[0].shape[1] < 2:
                raise InputError(
                    f"validate: task {task.name} is a classifier, but its first output ({first}) has "
                    f"{rows[0].shape[1]} score{'' if rows[0].shape[1] == 1 else 's'} per example: a classifier's "
                    "decision is the argmax over one score per class (for a binary logit z, return "
                    "torch.cat([torch.zeros_like(z), z], 1) from predict), or declare mode 'regression'")
    return Scores({name: torch.cat(rows) for name, rows in parts.items()}, dtypes, shapes)


def seed_pass(seed: int, device: torch.device) -> None:
    """Seed every generator a pass may draw from, as a run is seeded (:func:`~ampguard.tasks.seed_everything`:
    torch's, CPU and GPUs, Python's ``random`` and NumPy's), so the FP32 reference and each AMP
    precision start from the same state: a factory's augmentation drawing from ``random``, or a
    layer drawing from NumPy, draws the same numbers in every pass (torch's alone left them to
    differ, and the difference was blamed on the precision). Call it inside
    :func:`~ampguard.untouched.rng_kept` (which puts all three back). ``device`` is where the pass
    runs (every GPU's generator is seeded whichever it is).

    Example::

        >>> import random
        >>> import numpy as np
        >>> seed_pass(0, torch.device("cpu")); first = random.random(), float(np.random.rand()), float(torch.rand(1))
        >>> seed_pass(0, torch.device("cpu")); first == (random.random(), float(np.random.rand()), float(torch.rand(1)))
        True
    """
    del device  # (seed_everything seeds every device's generator)
    seed_everything(seed)


def _matmul_precision() -> str | None:
    """``torch.get_float32_matmul_precision()``, or None where it cannot tell: it raises once the
    per-backend settings (PyTorch 2.9's ``fp32_precision``) were set apart from it (the
    environment's ``fp32_precision`` says them)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _cuda_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _top2(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(decision, margin) of a classifier's scores: the argmax (the first of equal best scores,
    as ``torch.argmax``) and the gap between the two best scores. :func:`_scores` has refused a
    classifier with fewer than two scores per example."""
    top = scores.topk(2, dim=1)
    return scores.argmax(1), top.values[:, 0] - top.values[:, 1]


def _top_k(row: torch.Tensor, k: int) -> list[list[float]]:
    """The ``k`` best ``[class, score]`` pairs of one probe's scores, best first."""
    top = row.topk(min(k, len(row)))
    return [[int(i), float(v)] for i, v in zip(top.indices, top.values)]


# ---------------------------------------------------------------------------- quality


def _quality(mode: str, scores: torch.Tensor, targets: torch.Tensor) -> float:
    """Accuracy of a classifier's argmax; mean squared error otherwise."""
    if mode == "classifier":
        return int((scores.argmax(1) == targets.to(scores.device).reshape(len(scores))).sum()) / len(scores)
    return float(((scores - targets.to(scores.device).reshape(len(scores), -1).float()) ** 2).mean())


def _check_targets(task: Task, scores: torch.Tensor, targets: torch.Tensor, each: tuple[int, ...] | None = None
                   ) -> None:
    """Refuse held-out targets the quality rule cannot read: a classifier needs one class index
    per example, a regression task one target per score of its first output, laid out as the
    output is per example (``each``; a flat row of as many targets too, and sizes of 1 aside:
    a (3, 2) target beside a (2, 3) output flattened to the same 6 numbers compared wrongly).

    Example::

        >>> from ampguard.tasks.base import Task
        >>> task = Task("toy", nn.Linear(2, 2), nn.functional.mse_loss, batches=lambda: iter(()), mode="regression")
        >>> _check_targets(task, torch.zeros(4, 2), torch.zeros(4, 2))  # fine: nothing printed
        >>> try:
        ...     _check_targets(task, torch.zeros(4, 2), torch.zeros(4, 1))
        ... except InputError as err:
        ...     print(err)
        validate: task toy: the held-out targets have shape (4, 1), but the first output has 2 scores per example: a regression task needs one target per score
        >>> try:
        ...     _check_targets(task, torch.zeros(4, 6), torch.zeros(4, 3, 2), each=(2, 3))
        ... except InputError as err:
        ...     print(err)
        validate: task toy: the held-out targets have shape (3, 2) per example, but the first output has shape (2, 3): a regression task needs the targets laid out as the output (or flat)
        >>> _check_targets(task, torch.zeros(4, 6), torch.zeros(4, 6), each=(2, 3))  # flat: fine
        >>> task.mode = "classifier"
        >>> try:
        ...     _check_targets(task, torch.zeros(4, 2), torch.tensor([0, 1, 2, 1]))
        ... except InputError as err:
        ...     print(err)
        validate: task toy: the held-out targets hold labels from 0 to 2, but the first output scores 2 classes: a classifier's targets are class indices in [0, 2)
    """
    n = len(scores)
    per_example = targets.numel() // max(len(targets), 1)
    if task.mode == "classifier" and per_example != 1:
        raise InputError(f"validate: task {task.name}: the held-out targets have shape {tuple(targets.shape)}: "
                         "a classifier needs one class index per example")
    if task.mode == "classifier" and targets.numel():  # a label no score can name would count as wrong, silently
        classes, labels = scores.shape[1], targets.reshape(-1)
        whole = not labels.is_floating_point() or bool((labels == labels.round()).all())
        if not whole or int(labels.min()) < 0 or int(labels.max()) >= classes:
            raise InputError(f"validate: task {task.name}: the held-out targets hold "
                             f"{'non-integer labels' if not whole else f'labels from {int(labels.min())} to {int(labels.max())}'}"
                             f", but the first output scores {classes} classes: a classifier's targets are class "
                             f"indices in [0, {classes})")
    if task.mode != "classifier" and targets.numel() != scores.numel():
        raise InputError(f"validate: task {task.name}: the held-out targets have shape {tuple(targets.shape)}, but "
                         f"the first output has {scores.shape[1] if n else 0} scores per example: a regression task "
                         "needs one target per score")
    if task.mode != "classifier" and each is not None and targets.dim() > 2 and sum(n != 1 for n in each) > 1:
        # (an output laid out in several dimensions: a flat one, (N, 6), takes targets of any layout)
        unit = tuple(size for size in targets.shape[1:] if size != 1)
        if unit != tuple(size for size in each if size != 1):
            raise InputError(f"validate: task {task.name}: the held-out targets have shape {tuple(targets.shape[1:])} "
                             f"per example, but the first output has shape {each}: a regression task needs the "
                             "targets laid out as the output (or flat)")


def _quality_rule(mode: str, cfg: Any, value: float) -> tuple[str, bool, bool]:
    """``(text, ok, checked)`` of the absolute quality rule for one quality value. With no floor
    declared (``validation.min_accuracy`` / ``max_mse``) there is nothing to check a finite value
    against: it is not checked (``NOT CHECKED``, never ``pass``); a non-finite one still fails.

    Example::

        >>> from ampguard.config import validate
        >>> _quality_rule("regression", validate({}).validation, 1.444)
        ('mse 1.444 (no maximum declared)', True, False)
        >>> _quality_rule("regression", validate({"validation": {"max_mse": 0.5}}).validation, 1.444)
        ('mse 1.444 (<= 0.5)', False, True)
        >>> _quality_rule("classifier", validate({}).validation, math.nan)
        ('accuracy nan (no minimum declared)', False, True)
    """
    if mode == "classifier":
        if cfg.min_accuracy is None:
            return f"accuracy {value:.4f} (no minimum declared)", math.isfinite(value), not math.isfinite(value)
        return f"accuracy {value:.4f} (>= {cfg.min_accuracy:g})", value >= cfg.min_accuracy, True
    if cfg.max_mse is None:
        return f"mse {value:.4g} (no maximum declared)", math.isfinite(value), not math.isfinite(value)
    return f"mse {value:.4g} (<= {cfg.max_mse:g})", math.isfinite(value) and value <= cfg.max_mse, True


QUALITY_SLACK = 1e-12
"""Rounding slack on the relative quality bound (0.8 - 0.01 is 0.7900000000000001 in floats)."""


def relative_quality_rule(mode: str, drop: float | None, reference: float, amp: float) -> Rule | None:
    """The quality rule relative to the reference (``validation.max_quality_drop``): AMP accuracy
    may fall by at most ``drop`` (classifiers), AMP MSE may rise by at most a fraction ``drop`` of
    the reference's (regression). ``None`` when no drop is declared.

    Example (accuracy falling from 1.0 to 0.5 is refused; 0.995 is within a 0.01 drop)::

        >>> for amp in (0.5, 0.995):
        ...     rule = relative_quality_rule("classifier", 0.01, 1.0, amp)
        ...     print(rule.criterion, "|", rule.amp, "|", rule.decision)
        quality vs FP32: accuracy drop <= 0.01 | accuracy 0.5000 (>= 1.0000 - 0.01 = 0.9900) | FAIL
        quality vs FP32: accuracy drop <= 0.01 | accuracy 0.9950 (>= 1.0000 - 0.01 = 0.9900) | pass
        >>> relative_quality_rule("classifier", 2, 0.9, 0.3).decision  # (0.9 - 2 < 0: it rejects nothing)
        'NOT CHECKED'
        >>> relative_quality_rule("regression", 0.01, 2.0, 2.03).amp
        'mse 2.03 (<= 2 x (1 + 0.01) = 2.02)'
    """
    if drop is None:
        return None
    if mode == "classifier":  # (a bound at or below 0 rejects no accuracy: a drop of 1 or more checks nothing)
        bound = reference - drop
        vacuous = bound <= 0 and math.isfinite(amp)
        return Rule(f"quality vs FP32: accuracy drop <= {drop:g}", f"accuracy {reference:.4f}",
                    f"accuracy {amp:.4f} (>= {reference:.4f} - {drop:g} = {bound:.4f}"
                    f"{': no accuracy is below it' if vacuous else ''})",
                    math.isfinite(bound) and amp >= bound - QUALITY_SLACK, not vacuous)
    bound = reference * (1 + drop)
    return Rule(f"quality vs FP32: mse <= FP32 mse x (1 + {drop:g})", f"mse {reference:.4g}",
                f"mse {amp:.4g} (<= {reference:.4g} x (1 + {drop:g}) = {bound:.4g})",
                math.isfinite(amp) and math.isfinite(bound) and amp <= bound * (1 + QUALITY_SLACK))


# ---------------------------------------------------------------------------- tolerances


def tolerance(cfg: Any, name: str) -> tuple[float, float]:
    """``(abs_tol, rel_tol)`` for the output ``name``: its own ``validation.outputs.<name>`` where
    declared, part by part, else ``validation.abs_tol`` / ``rel_tol``.

    Example::

        >>> from ampguard.config import validate
        >>> cfg = validate({"validation": {"abs_tol": 0.05, "outputs": {"box": {"abs_tol": 0.5}}}}).validation
        >>> tolerance(cfg, "box"), tolerance(cfg, "logits")
        ((0.5, 0.05), (0.05, 0.05))
    """
    own = cfg.outputs.get(name)
    abs_tol = own.abs_tol if own is not None and own.abs_tol is not None else cfg.abs_tol
    rel_tol = own.rel_tol if own is not None and own.rel_tol is not None else cfg.rel_tol
    return abs_tol, rel_tol


def tolerance_text(abs_tol: float, rel_tol: float) -> str:
    """The tolerance rule as it is applied.

    Example::

        >>> tolerance_text(0.05, 0.01)
        '|amp - fp32| <= 0.05 + 0.01 * |fp32| per element'
    """
    return f"|amp - fp32| <= {abs_tol:g} + {rel_tol:g} * |fp32| per element"


def _within(ref: torch.Tensor, amp: torch.Tensor, err: torch.Tensor, abs_tol: float, rel_tol: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inside, used): per element, whether it is within the tolerance (a non-finite one never
    is), and the share of its allowance it uses (inf where none is allowed or it is not finite).
    ``err`` is ``|amp - ref|``."""
    allowed = abs_tol + rel_tol * ref.abs()
    inside = err <= allowed
    used = torch.where(allowed > 0, err / allowed, torch.where(err > 0, math.inf, 0.0))
    used = torch.where(torch.isnan(used) | ~torch.isfinite(amp) | ~torch.isfinite(ref), math.inf, used)
    return inside, used


def _score_rule(name: str, label: str, ref: torch.Tensor, amp: torch.Tensor, cfg: Any, ids: list[str],
                stats: dict[str, Any]) -> tuple[Rule, torch.Tensor, torch.Tensor]:
    """The tolerance rule of one output, its ``|amp - fp32|`` per element (computed once: the
    probe records read it too), and per probe whether any of its elements deviates. The
    output's error stats go into ``stats[name]``."""
    abs_tol, rel_tol = tolerance(cfg, name)
    err = (amp - ref).abs()
    inside, used = _within(ref, amp, err, abs_tol, rel_tol)
    rel = err / ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    total, good = inside.numel(), int(inside.sum())
    worst = int(used.flatten().argmax()) if total else 0
    row, col = divmod(worst, max(ref.shape[1], 1))
    worst_used = float(used.flatten()[worst]) if total else 0.0
    stats[name] = {"abs_tol": abs_tol, "rel_tol": rel_tol, "elements": total, "within": good,
                   "max_abs_error": float(err.max()) if total else 0.0,
                   "max_rel_error": float(rel.max()) if total else 0.0,
                   "worst_allowance_used": worst_used}
    finite_ref = ref[torch.isfinite(ref)]
    ref_text = (f"{total} scores in [{float(finite_ref.min()):.4g}, {float(finite_ref.max()):.4g}]"
                if finite_ref.numel() else f"{total} scores, none finite")
    if not total:
        amp_text = "no scores"
    elif math.isfinite(worst_used):
        amp_text = (f"{good}/{total} within; worst {ids[row]}[{col}]: |{float(amp[row, col]):.6g} - "
                    f"{float(ref[row, col]):.6g}| = {float(err[row, col]):.3g} {'<=' if inside[row, col] else '>'} allowed "
                    f"{abs_tol + rel_tol * abs(float(ref[row, col])):.3g} ({100 * worst_used:.3g}% of it)")
    else:
        amp_text = (f"{good}/{total} within; {ids[row]}[{col}]: amp {float(amp[row, col]):.6g}, "
                    f"fp32 {float(ref[row, col]):.6g}")
    rule = Rule(f"{label}: {tolerance_text(abs_tol, rel_tol)}", ref_text, amp_text, good == total)
    return rule, err, ~inside.all(dim=1)


# ---------------------------------------------------------------------------- probes


class ProbeSet(NamedTuple):
    """The fixed probe set and evaluation set. Each example is probed once: ``ids`` name it
    (``held_out:<index>``, ``train:<index>`` when the evaluation set is training data, or
    ``edge:<name>``), ``tags`` say why it is in the set."""

    ids: list[str]
    tags: dict[str, list[str]]
    inputs: torch.Tensor
    x_eval: torch.Tensor
    y_eval: torch.Tensor
    fp32_eval: Scores | None = None
    """The FP32 scores of ``x_eval`` when choosing the boundary examples took them (the
    reference then reuses them instead of running the evaluation set again)."""
    evaluation: dict[str, Any] | None = None
    """Where ``x_eval`` came from (:func:`evaluation_set`)."""

    def sha256(self) -> str:
        """A hash of the probes: ids, tags, and the inputs' dtype, shape and bytes.

        Example::

            >>> p = ProbeSet(["held_out:0"], {"held_out:0": ["typical"]}, torch.ones(1, 2), torch.ones(1, 2), torch.ones(1))
            >>> p.sha256() == p._replace(inputs=torch.ones(1, 2)).sha256() != p._replace(inputs=torch.zeros(1, 2)).sha256()
            True
        """
        digest = hashlib.sha256(json.dumps([self.ids, self.tags, str(self.inputs.dtype),
                                            list(self.inputs.shape)]).encode())
        data = self.inputs.detach().cpu().contiguous()
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        return digest.hexdigest()


def build_probes(task: Task, model: nn.Module, device: torch.device, cfg: Any, seed: int | None = None,
                 start: Callable[[], None] | None = None) -> ProbeSet:
    """The fixed probe set and evaluation set (its FP32 pass seeded with ``seed`` and begun with
    ``start``, as :func:`_scores`'s). The typical examples (the first ``typical``
    held-out ones) and the boundary ones (the ``boundary`` with the smallest FP32 top-2 margin)
    are both drawn from the held-out set: an example that is both is probed once, with both tags.
    A factory's default evaluation set (its first training batches, :class:`TrainingBatches`) is
    no held-out set: its examples are ``train:<i>``, never ``held_out:<i>``.

    Example (a regression task: typical examples and edge cases, no decision boundary)::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> config = validate({"task": {"name": "linear"}, "validation": {"typical": 2}})
        >>> task = build_task(config)
        >>> probes = build_probes(task, task.model, torch.device("cpu"), config.validation)
        >>> probes.ids
        ['held_out:0', 'held_out:1', 'edge:zeros', 'edge:large', 'edge:large_negative']
        >>> probes.tags["held_out:1"], probes.tags["edge:large"]
        (['typical'], ['edge'])
        >>> tuple(probes.inputs.shape), tuple(probes.x_eval.shape), torch.equal(probes.inputs[:2], probes.x_eval[:2])
        ((5, 16), (512, 16), True)
    """
    held_out = task.held_out() if task.held_out is not None else None
    if held_out is None:
        raise InputError(f"validate: task {task.name} has no held-out set (a factory can return 'held_out')")
    if not (isinstance(held_out, (tuple, list)) and len(held_out) == 2):
        raise InputError(f"validate: task {task.name}: held_out must be an (inputs, targets) pair of tensors, "
                         f"got a {type(held_out).__name__}")
    x_eval, y_eval = held_out
    if not isinstance(x_eval, torch.Tensor):
        raise InputError("validate: the held-out inputs must be a tensor")
    if not isinstance(y_eval, torch.Tensor):
        raise InputError(f"validate: task {task.name}: the held-out targets must be a tensor, "
                         f"got a {type(y_eval).__name__}")
    if x_eval.dim() == 0 or y_eval.dim() == 0 or len(y_eval) != len(x_eval):
        raise InputError(f"validate: task {task.name}: held_out has inputs of shape {tuple(x_eval.shape)} and "
                         f"targets of shape {tuple(y_eval.shape)}; it needs one target per input example")
    if len(x_eval) == 0:
        raise InputError(f"validate: task {task.name} has an empty held-out set: nothing to evaluate")
    tags: dict[int, list[str]] = {i: ["typical"] for i in range(min(cfg.typical, len(x_eval)))}
    fp32_eval = None
    if task.mode == "classifier" and cfg.boundary:
        fp32_eval = _scores(task, model, x_eval, Precision("fp32", device.type), seed, start)
        _, margin = _top2(fp32_eval.primary)
        margin = torch.where(torch.isfinite(margin), margin, torch.full_like(margin, math.inf))
        for i in margin.cpu().argsort(stable=True)[: min(cfg.boundary, len(x_eval))].tolist():
            tags.setdefault(i, []).append("boundary")
    evaluation = evaluation_set(task, len(x_eval))
    prefix = "held_out" if evaluation["source"] == "held_out" else "train"
    ids = [f"{prefix}:{i}" for i in tags]
    by_id = {f"{prefix}:{i}": t for i, t in tags.items()}
    parts = [x_eval[list(tags)]] if tags else []
    if cfg.edge_cases and task.edge_cases is not None:
        names, edge = _edge_cases(task, x_eval)
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise InputError(f"validate: task {task.name} names edge case {twice[0]!r} more than once")
        for name in names:
            ids.append(f"edge:{name}")
            by_id[f"edge:{name}"] = ["edge"]
        parts.append(edge.to(x_eval.dtype))
    if not ids:
        raise InputError(_empty_probe_set(task, cfg))
    return ProbeSet(ids, by_id, torch.cat(parts), x_eval, y_eval, fp32_eval, evaluation)


def evaluation_set(task: Task, examples: int) -> dict[str, Any]:
    """Where the evaluation set (quality, the typical and boundary probes) comes from, as the
    report says it: ``source`` ``held_out`` (the task's own), or ``training_batches`` for a
    factory that returns no ``held_out`` (its first batches, :class:`TrainingBatches`): data the
    model trains on, which a report calling it held-out would pass off as generalisation.

    Example::

        >>> from ampguard.tasks.base import Task
        >>> first = TrainingBatches(lambda: (torch.ones(8, 2), torch.zeros(8, 1)), batches=4)
        >>> task = Task("factory", nn.Linear(2, 1), nn.functional.mse_loss, batches=lambda: iter(()), held_out=first)
        >>> info = evaluation_set(task, 8)
        >>> info["source"], info["batches"], info["examples"]
        ('training_batches', 4, 8)
        >>> print(info["description"])  # doctest: +NORMALIZE_WHITESPACE
        the first 4 training batches (8 examples), not held-out data: the task's factory returns no held_out, so
        quality and the typical and boundary probes are measured on data the model trains on (return 'held_out'
        from the factory to judge unseen data)
    """
    first = task.held_out if isinstance(task.held_out, TrainingBatches) else None
    if first is None:
        return {"source": "held_out", "examples": examples,
                "description": f"task {task.name}'s held-out set ({counted(examples, 'example')})"}
    return {"source": "training_batches", "batches": first.batches, "examples": examples,
            "description": f"the first {counted(first.batches, 'training batch', 'training batches')} "
                           f"({counted(examples, 'example')}), not held-out data: the task's factory returns no "
                           "held_out, so quality and the typical and boundary probes are measured on data the "
                           "model trains on (return 'held_out' from the factory to judge unseen data)"}


def _edge_cases(task: Task, x_eval: torch.Tensor) -> tuple[list[str], torch.Tensor]:
    """The task's edge cases, checked: a ``(names, inputs)`` pair, one name (a string) per row,
    each row shaped as a held-out example. Anything else is an :class:`InputError`.

    Example::

        >>> from ampguard.tasks.base import Task
        >>> def task(edge):
        ...     return Task("toy", nn.Linear(4, 2), nn.functional.cross_entropy, batches=lambda: iter(()),
        ...                 edge_cases=lambda: edge)
        >>> _edge_cases(task((["a"], torch.ones(1, 4))), torch.zeros(8, 4))[0]
        ['a']
        >>> for edge in ((["a"], torch.ones(1, 5)), (["a"], torch.ones(3, 4)), torch.ones(1, 4)):
        ...     try:
        ...         _edge_cases(task(edge), torch.zeros(8, 4))
        ...     except InputError as err:
        ...         print(err)
        validate: task toy: edge_cases: the inputs have shape (1, 5); each row must have a held-out example's shape (4,)
        validate: task toy: edge_cases names 1 edge case but holds 3 rows; give one name per row
        validate: task toy: edge_cases must be a (names, inputs) pair: a list of names and a tensor with one row per name, got a Tensor
    """
    made = task.edge_cases() if task.edge_cases is not None else None
    where = f"validate: task {task.name}: edge_cases"
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise InputError(f"{where} must be a (names, inputs) pair: a list of names and a tensor with one row "
                         f"per name, got a {type(made).__name__}")
    names, edge = made
    if not (isinstance(names, (tuple, list)) and all(isinstance(name, str) for name in names)):
        raise InputError(f"{where}: the names must be a list of strings, got {type(names).__name__}")
    if not isinstance(edge, torch.Tensor):
        raise InputError(f"{where}: the inputs must be a tensor, got a {type(edge).__name__}")
    if edge.dim() == 0 or tuple(edge.shape[1:]) != tuple(x_eval.shape[1:]):
        raise InputError(f"{where}: the inputs have shape {tuple(edge.shape)}; each row must have a held-out "
                         f"example's shape {tuple(x_eval.shape[1:])}")
    if len(names) != len(edge):
        raise InputError(f"{where} names {len(names)} edge case{'' if len(names) == 1 else 's'} but holds "
                         f"{len(edge)} row{'' if len(edge) == 1 else 's'}; give one name per row")
    return list(names), edge


def check_rules(task: Task, cfg: Any) -> None:
    """Refuse rules that cannot apply to ``task`` before anything runs or is written: a quality
    threshold of the other mode (``min_accuracy`` is for classifiers, ``max_mse`` for regression),
    a decision rule (:data:`CLASSIFIER_RULES`) declared other than its default for a regression
    task (``boundary: 0``, no boundary probes, is kept), and a probe set that would be empty
    (nothing compared would read ACCEPTED).

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> task = build_task(validate({"task": {"name": "linear"}}))
        >>> for rules in ({"min_accuracy": 0.9}, {"ties": "accept"}, {"typical": 0, "edge_cases": False}):
        ...     try:
        ...         check_rules(task, validate({"validation": rules}).validation)
        ...     except InputError as err:
        ...         print(err)
        validate: validation.min_accuracy applies to classifiers; task linear is a regression task (declare validation.max_mse)
        validate: validation.ties applies to classifiers; task linear is a regression task (its rules: the score tolerance, extremes and quality)
        validate: the probe set is empty (validation.typical is 0, validation.boundary applies to classifiers only, validation.edge_cases is false): set validation.typical > 0
        >>> check_rules(task, validate({"validation": {"max_mse": 1.0}}).validation)  # fine: nothing printed
    """
    if task.mode == "classifier" and cfg.max_mse is not None:
        raise InputError(f"validate: validation.max_mse applies to regression tasks; task {task.name} is a "
                         "classifier (declare validation.min_accuracy)")
    if task.mode != "classifier" and cfg.min_accuracy is not None:
        raise InputError(f"validate: validation.min_accuracy applies to classifiers; task {task.name} is a "
                         f"{task.mode} task (declare validation.max_mse)")
    if task.mode != "classifier":  # (a decision rule declared for a task with no decision: ignored, it read as held)
        for key in CLASSIFIER_RULES:
            value, default = getattr(cfg, key), type(cfg).model_fields[key].default
            if value != default and not (key == "boundary" and value == 0):
                raise InputError(f"validate: validation.{key} applies to classifiers; task {task.name} is a "
                                 f"{task.mode} task (its rules: the score tolerance, extremes and quality)")
    classifier = task.mode == "classifier"
    if not (cfg.typical or (classifier and cfg.boundary) or (cfg.edge_cases and task.edge_cases is not None)):
        raise InputError(_empty_probe_set(task, cfg))


def check_fp32_weights(model: nn.Module, precisions: Iterable[str]) -> None:
    """Refuse, in one :class:`InputError` line, a model whose floating parameters are not float32,
    naming the first and its dtype. Below float32 (fp16, bf16), the FP32 reference would compute
    in their dtype: bf16 weights give a bf16 "reference", which bf16 autocast matches exactly,
    ACCEPTED at zero tolerance. A floating buffer below float32 is warned of, naming it: a frozen
    projection kept as a buffer sets the reference's dtype as such a parameter does, a 0/1 mask
    or a cache does not (type promotion keeps the work in float32), and which it is cannot be
    told from here (``train`` takes both). A model all in float64 (which train keeps; a float64 parameter
    or buffer beside float32 weights is fine) gives no comparison either:
    autocast lowers float32 work only, so the precision judged computes nothing in its dtype
    there and its pass is the reference's again, bit for bit. Either way nothing about the
    precision would be measured: no verdict, not a REJECTED that blames the precision. Integer
    and bool buffers (a BatchNorm's count, a mask) hold no weights: kept. What the device cannot
    run validate reports in the dtype support instead (:func:`describe_environment`).

    Example::

        >>> check_fp32_weights(nn.BatchNorm1d(2), ["bf16"])  # fine: nothing printed (an int64 count)
        >>> for model in (nn.Linear(2, 2).half(), nn.Linear(2, 2).double()):
        ...     try:
        ...         check_fp32_weights(model, ["bf16"])
        ...     except InputError as err:
        ...         print(err)
        validate: the FP32 reference needs float32 weights: parameter 'weight' is float16, so the reference would compute in float16, not float32; keep the model in float32 (no .half() / .to(torch.float16))
        validate: the FP32 reference needs float32 weights: parameter 'weight' is float64, where autocast computes nothing in bf16 (it lowers float32 work only): bf16 would run as the reference does, in float64; keep the model in float32 (no .double())
    """
    for name, t in model.named_buffers():
        if t.is_floating_point() and t.dtype.itemsize < 4:
            warn(f"validate: buffer {name!r} is {str(t.dtype).removeprefix('torch.')}: where the model "
                 "computes with it (a frozen projection), the FP32 reference computes in that dtype too and "
                 "AMP's difference there goes unmeasured (a 0/1 mask or a cache is fine)", AmpguardWarning,
                 stacklevel=2)
    weights = [("parameter", n, t) for n, t in model.named_parameters()]
    found = next(((kind, name, t) for kind, name, t in weights if t.is_floating_point() and t.dtype.itemsize < 4),
                 None)
    if found is None:  # (float64 refused only when no weight is float32: a float64 scale or table beside them is fine)
        floats = [(kind, name, t) for kind, name, t in weights if t.is_floating_point()]
        found = floats[0] if floats and all(t.dtype.itemsize > 4 for *_, t in floats) else None
    if found is None:
        return
    kind, name, weight = found
    dtype = weight.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    # (a Guard takes a frozen half backbone no optimizer holds; the reference cannot: said frozen, review 47g)
    what = (f"validate: the FP32 reference needs float32 weights: {kind} {name!r} is {dtype_name}"
            + ("" if weight.requires_grad else ", frozen"))
    if dtype.itemsize > 4:
        precisions = list(precisions)  # (said as the autocast precision judged; fp8 alone, as itself)
        judged = next((p for p in precisions if p in ("fp16", "bf16")), precisions[0] if precisions else "bf16")
        raise InputError(f"{what}, where autocast computes nothing in {judged} (it lowers float32 work only): "
                         f"{judged} would run as the reference does, in {dtype_name}; keep the model in float32 "
                         "(no .double())")
    undo = {torch.float16: ".half() / .to(torch.float16)"}.get(dtype, f".to(torch.{dtype_name})")
    raise InputError(f"{what}, so the reference would compute in {dtype_name}, not float32; keep the model in "
                     f"float32 (no {undo})")


CLASSIFIER_RULES = ("ties", "tie_margin", "max_flips", "boundary")
"""``validation`` keys that judge decisions (argmax flips and ties, boundary probes): a
regression task has none, and :func:`check_rules` refuses them declared for one."""


def _empty_probe_set(task: Task, cfg: Any) -> str:
    """The one line for a probe set with nothing in it, naming the keys that made it so."""
    why = ["validation.typical is 0" if not cfg.typical else "the held-out set is empty",
           ("validation.boundary is 0" if task.mode == "classifier"
            else "validation.boundary applies to classifiers only"),
           "validation.edge_cases is false" if not cfg.edge_cases else f"task {task.name} has no edge cases"]
    return f"validate: the probe set is empty ({', '.join(why)}): set validation.typical > 0"


def compare(task: Task, model: nn.Module, config: Config, device: torch.device) -> Validation:
    """Run the reference and every AMP precision on the probes and the evaluation set.

    Reads every score back to the host (several host syncs per precision): a diagnostic, run
    outside the training loop. Every pass runs in eval mode (the reference's and each precision's,
    on the probes and on the evaluation set) and starts from the same RNG state, seeded with
    ``config.seed``, and from the same buffers, the model's as given (a counter, a running
    normaliser or a cache its forward updates reads the same in each; the fp8 copy is made from
    them too), so only the precision differs. The model is left as it was found
    (:func:`~ampguard.untouched.untouched`: each module's train/eval mode, its buffers, its
    plain attributes), and so is the caller's RNG state. A ``validation.outputs`` name the model does not produce is an
    :class:`InputError` (raised before anything is written).

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> config = validate({"task": {"name": "linear"}, "validation": {"precisions": ["bf16"], "typical": 4}})
        >>> task = build_task(config)
        >>> v = compare(task, task.model, config, torch.device("cpu"))
        >>> v.ok, len(v.probes), [r.precision for r in v.results]
        (False, 7, ['bf16'])
        >>> [(rule.criterion, rule.decision) for rule in v.results[0].rules]  # doctest: +NORMALIZE_WHITESPACE
        [('complete and finite', 'pass'), ('scores: |amp - fp32| <= 0.05 + 0.05 * |fp32| per element', 'pass'),
         ('extremes (min, max over probes)', 'pass'), ('quality on the fixed evaluation set', 'NOT CHECKED'),
         ('quality vs FP32: mse <= FP32 mse x (1 + 0.01)', 'pass')]

    No ``max_mse`` is declared: the untrained reference is finite, but its quality is not checked,
    so the verdict rejects (bf16 itself passes every rule)::

        >>> [(rule.criterion, rule.decision) for rule in v.reference], v.reference_trusted
        ([('reference outputs finite', 'pass'), ('reference quality', 'NOT CHECKED')], False)
    """
    with untouched(model, by="validate", so="each pass once more, and they are not put back"):  # (the RNGs too)
        return _compare(task, model, config, device)


def _compare(task: Task, model: nn.Module, config: Config, device: torch.device) -> Validation:
    cfg, seed = config.validation, config.seed
    check_fp32_weights(model, cfg.precisions)  # (run checks it first; compare called alone, here)
    model.eval()
    buffers = BufferSnapshot(model)  # (every pass starts from the buffers as given: put back before each)
    probes = build_probes(task, model, device, cfg, seed, buffers.put_back)
    reference, checks = _reference(task, model, cfg, device, probes, seed, buffers.put_back)
    # fp8 compares a converted copy of the model; every other precision the model itself
    results, float8 = [], {}
    for name in cfg.precisions:
        buffers.put_back()  # (the fp8 copy: made from the buffers as given, not as the passes before left them)
        amp_model = prepare_model(config, model, name, copy_model=True)
        # (taken after prepare_model: the forwards it gave fp32_modules are the precision's, and the
        # snapshot taken before took them out before each pass: review 41, bf16 ran them in bf16)
        start = BufferSnapshot(amp_model).put_back
        if name == "fp8":  # which layers ran in float8, and how (the seeds: record what stays in higher precision)
            from .fp8 import fp8_layers

            float8 = {"recipe": config.fp8.recipe, "float8_layers": fp8_layers(amp_model)}
        results.append(_compare_precision(name, task, amp_model, cfg, device, probes, reference, seed, start))
    environment = describe_environment(config, device, reference.scores.dtypes, results)
    if float8:
        environment["dtype_support"]["fp8"].update(float8)
    environment["probe_set_sha256"] = probes.sha256()
    return Validation(task.name, task.mode, probes.ids, checks, results, tags=probes.tags, environment=environment,
                      evaluation_set=probes.evaluation or {})


class Reference(NamedTuple):
    """The FP32 reference, as every AMP precision is compared with it."""

    scores: Scores
    """Its outputs on the probes."""
    eval_scores: torch.Tensor
    """Its first output on the evaluation set: what quality is read from."""
    quality: float
    quality_text: str
    """Its absolute quality rule as the report writes it: ``mse 1.444 (no maximum declared)``."""
    finite: str
    """How many probes and evaluation examples have every output finite: ``7/7 probes, 512/512 eval``."""


def _reference(task: Task, model: nn.Module, cfg: Any, device: torch.device, probes: ProbeSet,
               seed: int | None, start: Callable[[], None] | None = None) -> tuple[Reference, list[Rule]]:
    """The FP32 reference on the probes and the evaluation set, and its own checks: every output
    finite, and its quality (against a declared floor; ``NOT CHECKED`` with none). A
    ``validation.outputs`` name the model does not produce is an :class:`InputError`."""
    fp32 = Precision("fp32", device.type)
    ref = _scores(task, model, probes.inputs, fp32, seed, start)
    unknown = [name for name in cfg.outputs if name not in ref.outputs]
    if unknown:
        raise InputError(f"validate: validation.outputs.{unknown[0]}: the model has no output named {unknown[0]!r} "
                         f"(its outputs: {', '.join(ref.names)})")
    ref_eval = (probes.fp32_eval if probes.fp32_eval is not None
                else _scores(task, model, probes.x_eval, fp32, seed, start))
    _check_targets(task, ref_eval.primary, probes.y_eval, ref_eval.shapes.get(ref_eval.names[0]))
    quality = _quality(task.mode, ref_eval.primary, probes.y_eval)
    finite, all_finite = _finite(ref, ref_eval)  # every output, where quality reads only the first
    text, ok, checked = _quality_rule(task.mode, cfg, quality)
    checks = [Rule("reference outputs finite", finite, "", all_finite), Rule("reference quality", text, "", ok, checked)]
    return Reference(ref, ref_eval.primary, quality, text, finite), checks


def _finite(on_probes: Scores, on_eval: Scores) -> tuple[str, bool]:
    """``(text, ok)``: how many probes and evaluation examples have every output finite, and
    whether all of them do.

    Example::

        >>> _finite(Scores({"output": torch.tensor([[1.0], [math.inf]])}), Scores({"output": torch.ones(3, 1)}))
        ('1/2 probes, 3/3 eval', False)
    """
    n, n_eval = len(on_probes.primary), len(on_eval.primary)
    finite, eval_finite = int(on_probes.finite_rows().sum()), int(on_eval.finite_rows().sum())
    return f"{finite}/{n} probes, {eval_finite}/{n_eval} eval", finite == n and eval_finite == n_eval


def _compare_precision(name: str, task: Task, model: nn.Module, cfg: Any, device: torch.device, probes: ProbeSet,
                       reference: Reference, seed: int | None,
                       start: Callable[[], None] | None = None) -> PrecisionResult:
    """One AMP precision against the reference, rule by rule, with one record per probe. Its
    passes are seeded with ``seed`` and begun with ``start`` (the buffers put back) as the
    reference's were. A model that raised under this
    precision, where the FP32 reference ran, fails it (the rule "runs under <precision>"); so do
    outputs FP32 gave and this precision does not (other names, another shape, one row per
    example no more: the rule "outputs as FP32's"): the same inputs ran in FP32, so it is the
    precision that fails, reported, not bad input."""
    amp_p = Precision(name, device.type)
    try:
        amp = _scores(task, model, probes.inputs, amp_p, seed, start)
        amp_eval = _scores(task, model, probes.x_eval, amp_p, seed, start)
    except ModelRaised as err:  # FP32 ran: the precision is what fails, not the input
        return PrecisionResult(name, rules=[Rule(f"runs under {name}", "ran", f"raised {err.why}", False)],
                               stats={"output_dtypes": {}})
    except InputError as err:  # (what _scores refuses of outputs it accepted from FP32 on the same inputs)
        return _outputs_differ(name, reference.scores, str(err).removeprefix("validate: "), {})
    differ = _outputs_mismatch(name, reference.scores, amp) or _outputs_mismatch(name, reference.scores, amp_eval,
                                                                                 len(probes.x_eval))
    if differ:
        return _outputs_differ(name, reference.scores, differ, amp.dtypes)
    result = PrecisionResult(name, stats={"output_dtypes": amp.dtypes})
    # the evaluation set too, every output of it: an inf there must not pass as a wrong answer (or
    # pass at all, in an output the quality rule does not read)
    finite, all_finite = _finite(amp, amp_eval)
    result.rules.append(Rule("complete and finite", reference.finite, finite, all_finite))
    errors, deviated = _tolerance_rules(result, cfg, probes.ids, reference.scores, amp)
    result.records = _probe_records(probes, amp, errors, deviated)
    if task.mode == "classifier":
        _decisions(result, cfg, reference.scores.primary, amp.primary)
    else:
        _extremes(result, reference, amp, amp_eval.primary, probes.y_eval)
    _quality_rules(result, task.mode, cfg, reference, amp_eval.primary, probes.y_eval)
    return result


def _outputs_mismatch(name: str, ref: Scores, amp: Scores, rows: int | None = None) -> str | None:
    """Why AMP outputs cannot be compared with FP32's element by element (other names, or
    another shape, as the model returned it: a ``(2, 3)`` output that AMP returns ``(3, 2)``
    flattens to as many scores, compared in the wrong layout), or None. ``rows``: compare with
    FP32's shape per example only, on another set of examples (the evaluation set's, where the
    reference keeps only the first output's scores).

    Example::

        >>> ref = Scores({"logits": torch.zeros(4, 3), "aux": torch.zeros(4, 3)})
        >>> _outputs_mismatch("bf16", ref, Scores({"logits": torch.zeros(4, 3), "aux": torch.zeros(4, 2)}))
        'output aux has shape (4, 2) under bf16, (4, 3) in FP32'
        >>> _outputs_mismatch("bf16", ref, Scores({"logits": torch.zeros(4, 3)}))
        "the model's outputs under bf16 (logits) are not those of FP32 (logits, aux)"
        >>> _outputs_mismatch("bf16", ref, Scores({"logits": torch.zeros(9, 3), "aux": torch.zeros(9, 3)}), 9) is None
        True
        >>> fp32 = Scores({"output": torch.zeros(4, 6)}, shapes={"output": (3, 2)})
        >>> _outputs_mismatch("bf16", fp32, Scores({"output": torch.zeros(4, 6)}, shapes={"output": (2, 3)}))
        "the model's output has shape (4, 2, 3) under bf16, (4, 3, 2) in FP32"
    """
    if amp.names != ref.names:
        return f"the model's outputs under {name} ({', '.join(amp.names)}) are not those of FP32 ({', '.join(ref.names)})"
    for out in ref.names:
        got = (len(amp.outputs[out]), *amp.shapes.get(out, amp.outputs[out].shape[1:]))
        want = (len(ref.outputs[out]) if rows is None else rows, *ref.shapes.get(out, ref.outputs[out].shape[1:]))
        if got != want:
            what = "the model's output" if out == SINGLE_OUTPUT else f"output {out}"
            return f"{what} has shape {got} under {name}, {want} in FP32"
    return None


def _outputs_differ(name: str, ref: Scores, why: str, dtypes: dict[str, str]) -> PrecisionResult:
    """The result of a precision whose outputs are not FP32's (``why``): the rule "outputs as
    FP32's" fails, and nothing else can be compared."""
    shapes = ", ".join(f"{out} {(len(t), *ref.shapes.get(out, t.shape[1:]))}" for out, t in ref.outputs.items())
    return PrecisionResult(name, rules=[Rule("outputs as FP32's (names, shapes)", shapes, why, False)],
                           stats={"output_dtypes": dtypes})


def _tolerance_rules(result: PrecisionResult, cfg: Any, ids: list[str], ref: Scores, amp: Scores
                     ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One tolerance rule per output (a non-finite element is never within: it fails its
    output's rule) and the error stats, added to ``result``. Returns, by output, its
    ``|amp - fp32|`` per element and, per probe, whether any of its elements deviates."""
    per_output: dict[str, Any] = {}
    errors, deviated = {}, {}
    for out in ref.names:
        label = "scores" if ref.names == [SINGLE_OUTPUT] else f"output {out}"
        rule, errors[out], deviated[out] = _score_rule(out, label, ref.outputs[out], amp.outputs[out], cfg, ids,
                                                       per_output)
        result.rules.append(rule)
    result.stats.update(max_abs_error=_worst(s["max_abs_error"] for s in per_output.values()),
                        max_rel_error=_worst(s["max_rel_error"] for s in per_output.values()),
                        outputs=per_output)
    return errors, deviated


def _worst(errors: Iterable[float]) -> float:
    """The largest error, NaN if any is NaN (Python's ``max`` keeps whichever comes first:
    ``max(1.0, nan)`` is 1.0, so an output's NaN error hid behind an earlier output's finite one).

    Example::

        >>> _worst([1.0, math.nan]), _worst([math.nan, 1.0]), _worst([0.5, 2.0])
        (nan, nan, 2.0)
    """
    values = list(errors)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _probe_records(probes: ProbeSet, amp: Scores, errors: dict[str, torch.Tensor],
                   deviated: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """One record per probe: its tags, whether every AMP output is finite, the outputs in which
    it deviates beyond the tolerance, its largest ``|amp - fp32|`` (:func:`_decisions` adds a
    classifier's decisions)."""
    finite = amp.finite_rows()
    records = []
    for i, probe in enumerate(probes.ids):
        outside = [out for out, rows in deviated.items() if bool(rows[i])]
        records.append({
            "probe": probe, "tags": probes.tags[probe], "finite": bool(finite[i]),
            "deviated": bool(outside), "deviated_outputs": outside,
            "max_abs_error": _worst(float(err[i].max()) if err[i].numel() else 0.0 for err in errors.values()),
        })
    return records


def _extremes(result: PrecisionResult, reference: Reference, amp: Scores, amp_eval: torch.Tensor,
              targets: torch.Tensor) -> None:
    """A regression task's extremes: the first output's min and max over the probes in FP32 and
    AMP, as a rule that shows them and holds where its tolerance rule does (no probe deviates in
    it: another output's deviation, beside equal extremes, read as FAIL; that output has its own
    rule), and each one's largest error against the evaluation set's targets (stats)."""
    first, first_amp = reference.scores.primary, amp.primary
    name = reference.scores.names[0]
    targets = targets.to(amp_eval.device).reshape(len(amp_eval), -1).float()
    result.stats.update(
        max_abs_error_vs_target_fp32=float((reference.eval_scores - targets).abs().max()),
        max_abs_error_vs_target_amp=float((amp_eval - targets).abs().max()),
        extremes_fp32=[float(first.min()), float(first.max())],
        extremes_amp=[float(first_amp.min()), float(first_amp.max())],
    )
    within = not any(name in record["deviated_outputs"] for record in result.records)
    label = "" if reference.scores.names == [SINGLE_OUTPUT] else f" of output {name}"
    result.rules.append(Rule(f"extremes{label} (min, max over probes)", f"{float(first.min()):.4g}, {float(first.max()):.4g}",
                             f"{float(first_amp.min()):.4g}, {float(first_amp.max()):.4g}", within))


def _quality_rules(result: PrecisionResult, mode: str, cfg: Any, reference: Reference, amp_eval: torch.Tensor,
                   targets: torch.Tensor) -> None:
    """The quality rules on the evaluation set: the absolute one (:func:`_quality_rule`, the
    reference's beside AMP's) and the one relative to the reference (:func:`relative_quality_rule`,
    where ``validation.max_quality_drop`` is declared)."""
    amp_quality = _quality(mode, amp_eval, targets)
    text, ok, checked = _quality_rule(mode, cfg, amp_quality)
    result.stats.update(quality_fp32=reference.quality, quality_amp=amp_quality)
    result.rules.append(Rule("quality on the fixed evaluation set", reference.quality_text, text, ok, checked))
    relative = relative_quality_rule(mode, cfg.max_quality_drop, reference.quality, amp_quality)
    if relative is not None:
        result.rules.append(relative)


def classify_probe(fp32_decision: int, amp_decision: int, fp32_margin: float, amp_margin: float,
                   tie_margin: float) -> str:
    """``flip``, ``tie`` or ``same``: what AMP did to the decision FP32 made.

    AMP naming another class is a ``tie`` where FP32's own top-2 gap is within ``tie_margin``
    (the reference barely decides: AMP changed the order of near-equal scores) and a ``flip``
    where it is not, however small AMP's gap (the reference's decision was clear, and AMP's is
    another; an AMP gap near zero made a confident change read as a tie, which ``ties: accept``
    then passed). AMP keeping FP32's class is the same decision, except where AMP made a tie:
    its gap within ``tie_margin`` where FP32's is not, or an exact tie (a gap of 0) where FP32's
    gap is not 0 (the lesson's 1.0000 and 1.0003, which bf16 rounds to one value: a tie under
    any ``tie_margin``). A tie the reference has and AMP keeps is not AMP's doing: counting it
    made AMP's outputs bit for bit FP32's, or FP32 compared with itself, fail ``count_as_flip``
    on any probe the reference ties on (a zero input to a head with no bias, a saturated
    softmax; the boundary probes are the reference's narrowest gaps). :func:`_decisions` lists
    those beside the rule (``reference ties kept``), and passes an exact AMP tie that includes
    FP32's class as AMP keeping it: which of equal scores ``argmax`` names is only the lower
    class index, so the verdict is the same in whichever order the classes come. It is not
    hidden: ``ties: count_as_flip`` (the default) counts a tie, ``reject`` refuses it, and the
    report lists it with AMP's ``argmax`` and its gap. An exact AMP tie that FP32's class is not
    in is a changed decision.

    Example (the lesson's scores, 1.0000 and 1.0003: under a tie margin of 0.001 the reference
    barely decides, so AMP naming the other class, or keeping it by an exact tie, is a tie, and
    AMP keeping it by a gap of 0.0002 the same decision; with a margin of 0.0001 FP32 decides,
    so AMP keeping its class by 0.0 is a tie, and AMP deciding the other way is a flip, however
    narrowly; so is a confident FP32 decision, a gap of 3.0, that AMP changes by 0.0005)::

        >>> fp32_margin = 1.0003 - 1.0000
        >>> classify_probe(1, 0, fp32_margin, 0.0, 0.001), classify_probe(1, 1, fp32_margin, 0.0, 0.001)
        ('tie', 'tie')
        >>> classify_probe(1, 1, fp32_margin, 0.0002, 0.001), classify_probe(0, 0, fp32_margin, 0.0, 0.0001)
        ('same', 'tie')
        >>> classify_probe(1, 0, fp32_margin, 0.0002, 0.0001), classify_probe(1, 1, 3.0, 2.9, 0.0001)
        ('flip', 'same')
        >>> classify_probe(0, 1, 3.0, 0.0005, 0.001), classify_probe(0, 1, fp32_margin, 0.00005, 0.0001)
        ('flip', 'flip')
        >>> classify_probe(0, 0, 0.0, 0.0, 0.0)  # an exact FP32 tie AMP keeps: FP32 compared with itself
        'same'
    """
    if amp_decision != fp32_decision:
        return "tie" if fp32_margin <= tie_margin else "flip"
    made_a_tie = amp_margin <= tie_margin < fp32_margin or amp_margin == 0.0 < fp32_margin
    return "tie" if made_a_tie else "same"


def _tie_rule(cfg: Any) -> str:
    """The tie rule as the decision rule's row and the report's rules paragraph word it
    (:func:`classify_probe`'s, under ``validation.tie_margin`` and ``validation.ties``).

    Example::

        >>> from ampguard.config import validate
        >>> _tie_rule(validate({"validation": {"tie_margin": 0.001}}).validation)
        "another class where FP32's top-2 gap is <= 0.001, or FP32's class kept by AMP's gap <= it, or by an exact tie, where FP32's is not; ties count as flips"
    """
    return (f"another class where FP32's top-2 gap is <= {cfg.tie_margin:g}, or FP32's class kept by AMP's gap <= it, "
            f"or by an exact tie, where FP32's is not; ties {TIE_POLICIES[cfg.ties]}")


def _decisions(result: PrecisionResult, cfg: Any, ref: torch.Tensor, amp: torch.Tensor) -> None:
    """Decisions per probe (argmax of the first output): flips, ties, the records, the rule."""
    ref_decision, ref_margin = _top2(ref)
    decision, margin = _top2(amp)
    reference_ties: list[dict[str, Any]] = []  # FP32's own ties AMP kept: not AMP's doing, said
    for i, record in enumerate(result.records):
        fp32_d, amp_d = int(ref_decision[i]), int(decision[i])
        tied = ref[i] == ref[i].max()
        if int(tied.sum()) > 1:  # an exact FP32 tie: kept where AMP ties exactly on the same classes, else a
            # tie, in whichever order the classes come (argmax names the lower index: review 51l)
            kind = "same" if torch.equal(tied, amp[i] == amp[i].max()) else "tie"
        else:
            # (an exact AMP tie that includes FP32's class keeps it: argmax names the lower index of equal scores)
            kept = fp32_d if bool(amp[i, fp32_d] == amp[i, amp_d]) else amp_d
            kind = classify_probe(fp32_d, kept, float(ref_margin[i]), float(margin[i]), cfg.tie_margin)
        record.update(fp32={"decision": fp32_d, "top": _top_k(ref[i], cfg.top_k)},
                      amp={"decision": amp_d, "top": _top_k(amp[i], cfg.top_k)},
                      fp32_margin=float(ref_margin[i]), amp_margin=float(margin[i]),
                      changed=fp32_d != amp_d, flipped=kind == "flip", tied=kind == "tie")
        row = {"probe": record["probe"], "tags": record["tags"], "fp32": fp32_d, "amp": amp_d,
               "fp32_margin": record["fp32_margin"], "amp_margin": record["amp_margin"]}
        if kind == "flip":
            result.flips.append(row)
        elif kind == "tie":
            result.ties.append(row)
        elif float(ref_margin[i]) <= cfg.tie_margin:
            reference_ties.append(row)
    changes = len(result.flips) + (len(result.ties) if cfg.ties == "count_as_flip" else 0)
    ok = changes <= cfg.max_flips and not (cfg.ties == "reject" and result.ties)

    def listed(rows: list[dict[str, Any]]) -> str:
        return "".join(f"{', ' if i else ': '}{r['probe']} ({r['fp32']}->{r['amp']}, margin fp32 "
                       f"{r['fp32_margin']:.3g} amp {r['amp_margin']:.3g})" for i, r in enumerate(rows))

    kept = f"; reference ties AMP kept (not counted): {len(reference_ties)}{listed(reference_ties)}" if reference_ties else ""
    result.rules.append(Rule(f"decision changes <= {cfg.max_flips} (tie: {_tie_rule(cfg)})",
                             "0", f"{counted(len(result.flips), 'flip')}{listed(result.flips)}; "
                             f"{counted(len(result.ties), 'tie')}{listed(result.ties)}{kept}", ok))


# ---------------------------------------------------------------------------- reproducibility


def describe_environment(config: Config, device: torch.device, fp32_dtypes: dict[str, str],
                         results: list[PrecisionResult]) -> dict[str, Any]:
    """What the report was made with: ampguard, torch and Python versions, the device and its
    backend (:func:`backend_of`: ``rocm`` with its HIP version, ``cuda`` with its CUDA version, or
    ``cpu``), the dtype support of each precision compared there (as training decides it,
    :meth:`Precision.support`: a ``note`` where the device refuses the precision or only emulates
    it), and the effective config (its paths made absolute: :func:`reproducible_config`) with its
    SHA-256.

    Example::

        >>> from ampguard.config import validate
        >>> env = describe_environment(validate({"validation": {"precisions": ["bf16"]}}), torch.device("cpu"), {}, [])
        >>> env["device"]["type"], env["device"]["backend"], env["dtype_support"]["bf16"]["supported"], len(env["config_sha256"])
        ('cpu', 'cpu', True, 64)
    """
    from . import __version__

    effective = reproducible_config(config)
    backend = backend_of(device)
    # the process's settings ("high" or "medium" lets FP32 matmuls use TF32 / bf16; PyTorch 2.9's
    # per-backend fp32_precision, "tf32" or "bf16"): the FP32 reference runs without them
    # (Precision.reference: every backend "ieee"), said too
    info: dict[str, Any] = {"type": device.type, "backend": backend["backend"],
                            "name": platform.processor() or platform.machine(),
                            "float32_matmul_precision": _matmul_precision(),
                            "fp32_precision": fp32_settings(), "reference_tf32": False}
    index = _cuda_index(device)
    if index is not None:
        info.update(name=torch.cuda.get_device_name(index),
                    capability=".".join(map(str, torch.cuda.get_device_capability(index))),
                    cuda=backend["cuda"], hip=backend["hip"])
    support = {}
    for name in config.validation.precisions:
        precision = Precision(name, device.type)
        supported, note = precision.support(device)
        support[name] = {"autocast_available": torch.amp.is_autocast_available(device.type),
                         "dtype": str(precision.dtype), "supported": supported}
        if note is not None:
            support[name]["note"] = note
    outputs = {r.precision: r.stats.get("output_dtypes", {}) for r in results}
    return {"ampguard": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "device": info, "dtype_support": support, "output_dtypes": {"fp32": fp32_dtypes, **outputs},
            "config_sha256": hashlib.sha256(json.dumps(effective, sort_keys=True).encode()).hexdigest(),
            "config": effective}


def reproducible_config(config: Config) -> dict[str, Any]:
    """The effective config as JSON, with what the run read from a path relative to the folder it
    ran in made absolute: ``validation.checkpoint`` and a ``task.factory`` file (a module name
    stays as it is). ``environment.config`` then reproduces the report run from any folder.
    ``log.dir`` is where a run writes, not what it reads: it stays as given (and free-form
    ``task.options`` are the factory's own).

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"task": {"factory": "my_model.py:build"}, "validation": {"checkpoint": "runs/a/x.pt"}})
        >>> data = reproducible_config(config)
        >>> data["task"]["factory"] == f"{Path.cwd() / 'my_model.py'}:build"
        True
        >>> data["validation"]["checkpoint"] == str(Path.cwd() / "runs" / "a" / "x.pt")
        True
        >>> reproducible_config(validate({"task": {"factory": "ampguard.tasks.linear:build"}}))["task"]["factory"]
        'ampguard.tasks.linear:build'
    """
    effective = config.model_dump(mode="json")
    validation, task = effective["validation"], effective["task"]
    if validation.get("checkpoint"):
        validation["checkpoint"] = str(Path(validation["checkpoint"]).resolve())
    target, sep, attr = (task.get("factory") or "").rpartition(":")
    if sep and factory_file(target):
        task["factory"] = f"{Path(target).resolve()}:{attr}"
    return effective


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file, read in 1 MiB pieces.

    Example::

        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     file_sha256(f.name)[:12]
        'e3b0c44298fc'
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def compare_training(task: Task, config: Config, device: torch.device, steps: int) -> list[dict[str, Any]]:
    """Train ``steps`` steps from the same state in FP32 and each AMP precision on the task's
    clean data (the config's ``inject`` faults are not applied); compare curves.

    Reads each step's record on the host (one host sync a step, as in a run). The model's
    weights are put back as they were afterwards. Each precision trains from the same RNG state
    too (seeded with ``config.seed`` as :func:`seed_pass` seeds it: the same dropout masks and a
    factory's same ``random`` / NumPy draws), and the caller's RNG state is put back afterwards.
    FP32 trains with no TF32, as the inference reference runs (:meth:`Precision.reference`).
    ``opening_skips`` is a loss scaler's opening search (:func:`training_rule` sets it aside)
    counted on the steps FP32 applied only: a step FP32 skipped too is no update FP32 made.

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.tasks import build_task
        >>> config = validate({"task": {"name": "linear"}, "device": "cpu", "validation": {"precisions": ["bf16"]}})
        >>> task = build_task(config)
        >>> before = task.model.weight.detach().clone()
        >>> curves = compare_training(task, config, torch.device("cpu"), steps=2)
        >>> [(c["precision"], c["updates_applied"], len(c["losses"])) for c in curves]
        [('fp32', 2, 2), ('bf16', 2, 2)]
        >>> curves[0]["max_loss_diff_vs_fp32"], torch.equal(task.model.weight, before)
        (0.0, True)
    """
    start = copy.deepcopy(task.model.state_dict())
    with rng_kept(), modes_kept(task.model):  # (each module trains in the mode the task left it in, as in a run)
        runs = {name: _train_from(task, config, device, steps, name, start)
                for name in ["fp32", *config.validation.precisions]}
    task.model.load_state_dict(start)
    ref = runs["fp32"]
    out = []
    for name, r in runs.items():
        # the search set aside is its skips on steps FP32 applied: a step FP32 skipped too (a
        # gradient non-finite in every precision) is already missing from FP32's count
        set_aside = sum(1 for i in r["opening"] if i < len(ref["applied"]) and ref["applied"][i])
        pairs = [(a, b) for a, b in zip(r["losses"], ref["losses"]) if a is not None and b is not None
                 and math.isfinite(a) and math.isfinite(b)]
        norm_pairs = [(a, b) for a, b in zip(r["norms"], ref["norms"]) if a and b and math.isfinite(a) and math.isfinite(b)]
        out.append({
            "precision": name,
            "updates_applied": r["updates"],
            "opening_skips": set_aside,
            "final_loss": r["losses"][-1] if r["losses"] else None,
            "max_loss_diff_vs_fp32": max((abs(a - b) for a, b in pairs), default=0.0),
            "mean_grad_norm_ratio_vs_fp32": (sum(a / b for a, b in norm_pairs) / len(norm_pairs)) if norm_pairs else None,
            "losses": r["losses"],
        })
    return out


def _train_from(task: Task, config: Config, device: torch.device, steps: int, name: str,
                start: dict[str, Any]) -> dict[str, Any]:
    """``steps`` training steps of ``task.model`` under ``name`` from the weights ``start`` and
    the RNG seeded with ``config.seed``: the losses, pre-clip norms and updates applied."""
    from .build import build_state
    from .step import AmpTrainState

    task.model.load_state_dict(start)
    scales = Precision(name, device.type).uses_scaler  # a scaler setting applies where one is used
    scaler = config.scaler.model_copy(update={"enabled": config.scaler.enabled if scales else None})
    run_config = config.model_copy(update={"precision": name, "steps": steps, "scaler": scaler})
    model = prepare_model(run_config, task.model, copy_model=True)  # fp8: a converted copy; else task.model
    state: AmpTrainState = build_state(run_config, model, task.loss_fn, device)
    losses, norms, applied, opening = [], [], [], []
    searching = state.scaler.is_enabled()  # (a loss scaler's search down from init_scale, until its first update)
    seed_pass(config.seed, device)  # the same dropout masks (and shuffle, for a DataLoader) in every precision
    stream = itertools.islice(task.batches(), steps * config.accumulation_steps)
    # FP32 trains as its inference reference runs (Precision.reference: every backend's FP32 at
    # "ieee", no TF32): under the process's settings its curve was another reduced precision's
    with Precision(name, device.type).reference() if name == "fp32" else contextlib.nullcontext():
        for inputs, targets in stream:
            record = state.step(to_device(inputs, device), to_device(targets, device))
            if record is None:
                continue
            v = record.values()
            losses.append(v["loss"])
            norms.append(v["grad_l2_pre_clip"])
            applied.append(not record.skipped)
            # the search is its opening streak of gradient overflows, by design (as the monitor's scale
            # health has it): it ends at the first update, or at a skip of another reason (a forward
            # that overflowed is no search: it counts against the precision)
            searching = searching and record.skipped and record.reason == "non_finite_grad"
            if searching:
                opening.append(len(applied) - 1)
    return {"losses": losses, "norms": norms, "updates": sum(applied), "applied": applied, "opening": opening}


def training_reference_rule(fp32: dict[str, Any]) -> Rule:
    """The FP32 training reference's own check (``--train-steps``): it applied at least one
    update and its last loss is finite. A run that skipped every step, or ended non-finite, is no
    baseline for the updates an AMP precision must apply (seed 001: a wrong FP32 run is not a
    reference because it has more bits): failing, it makes the reference untrusted, as a
    non-finite inference reference does.

    Example::

        >>> rule = training_reference_rule({"updates_applied": 0, "final_loss": math.nan, "losses": [math.nan] * 5})
        >>> rule.criterion, rule.reference, rule.decision
        ('reference training: updates applied, final loss finite', '0 of 5 steps applied, final loss nan', 'FAIL')
        >>> training_reference_rule({"updates_applied": 5, "final_loss": 0.25, "losses": [1.0] * 5}).decision
        'pass'
    """
    loss = fp32["final_loss"]
    ok = fp32["updates_applied"] > 0 and loss is not None and math.isfinite(loss)
    return Rule("reference training: updates applied, final loss finite",
                f"{fp32['updates_applied']} of {len(fp32['losses'])} steps applied, final loss "
                f"{'none' if loss is None else format(loss, '.4g')}", "", ok)


def training_rule(t: dict[str, Any], fp32: dict[str, Any], min_applied: float) -> Rule:
    """The judged part of ``--train-steps`` for one AMP precision (``t``, of
    :func:`compare_training`): it applied at least ``min_applied`` of the updates FP32 applied,
    its loss scaler's opening search set aside (FP32 has none; ``opening_skips`` counts only the
    search's skips on steps FP32 applied: one FP32 skipped too is not in FP32's count to take
    from); an AMP run that applied none fails whatever the search (a scale that never found the
    gradients' range). FP32's own run is checked by :func:`training_reference_rule`.

    Example (fp16 skipped its first 3 steps finding its scale, then 1 more of the 17 after)::

        >>> fp32 = {"updates_applied": 20, "opening_skips": 0}
        >>> rule = training_rule({"updates_applied": 16, "opening_skips": 3}, fp32, 0.9)
        >>> rule.reference, rule.amp, rule.decision
        ('20 of 20 steps', "16 of 20 steps (3 skipped in the loss scaler's opening search); 16/17 = 0.94 (>= 0.9)", 'pass')
        >>> training_rule({"updates_applied": 0, "opening_skips": 20}, fp32, 0.9).decision
        'FAIL'
    """
    steps = len(fp32["losses"]) if "losses" in fp32 else fp32["updates_applied"]
    expected = max(0, fp32["updates_applied"] - t["opening_skips"])
    search = f" ({t['opening_skips']} skipped in the loss scaler's opening search)" if t["opening_skips"] else ""
    ok = t["updates_applied"] >= min_applied * expected and (t["updates_applied"] > 0 or fp32["updates_applied"] == 0)
    share = f"; {t['updates_applied']}/{expected} = {t['updates_applied'] / expected:.2f} (>= {min_applied:g})" \
        if expected else ""
    return Rule("updates applied in training", f"{fp32['updates_applied']} of {steps} steps",
                f"{t['updates_applied']} of {steps} steps{search}{share}", ok)


# ---------------------------------------------------------------------------- output


def markdown(v: Validation, config: Config) -> str:
    """``validation.md``: the verdict, the rules declared, then one table per precision.

    Example::

        >>> v = Validation("linear", "regression", ["held_out:0"], [Rule("reference quality", "mse 0.1", "", True)],
        ...                [PrecisionResult("fp16", [Rule("complete and finite", "1/1", "0/1", False)])],
        ...                environment={"torch": "2.13.0"})
        >>> lines = markdown(v, Config()).splitlines()
        >>> lines[0], lines[2]
        ('# AMP validation: linear (regression)', '**REJECTED**')
        >>> [line for line in lines if line.startswith("## ") or "complete and finite" in line or "torch" in line]
        ['## FP32 reference', '## fp16 vs FP32: FAIL', '| complete and finite | 1/1 | 0/1 | FAIL |', '## Reproducibility', '| torch | 2.13.0 |']
    """
    cfg = config.validation
    lines = [
        f"# AMP validation: {v.task} ({v.mode})",
        "",
        v.verdict_in(REPORT_DOUBTS, "**"),
        "",
        *([rejections_text(v.earlier), ""] if v.earlier else []),
        _rules_paragraph(v, cfg),
        *(["", f"Evaluation set: {v.evaluation_set['description']}."] if v.evaluation_set else []),
        "",
        "## FP32 reference",
        "",
        "| criterion | reference | decision |",
        "|---|---|---|",
        *(_row(r.criterion, r.reference, r.decision) for r in v.reference),
    ]
    for result in v.results:
        lines += ["", f"## {result.precision} vs FP32: {'pass' if result.ok else 'FAIL'}", "",
                  "| criterion | reference (FP32) | AMP | decision |", "|---|---|---|---|"]
        lines += [_row(r.criterion, r.reference, r.amp, r.decision) for r in result.rules]
        if result.flips or result.ties:
            lines += ["", "| probe | tags | FP32 decision | AMP decision | FP32 margin | AMP margin | change |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {r['probe']} | {', '.join(r.get('tags', []))} | {r['fp32']} | {r['amp']} | "
                      f"{r['fp32_margin']:.4g} | {r['amp_margin']:.4g} | {change} |"
                      for change, rows in (("flip", result.flips), ("tie", result.ties)) for r in rows]
        deviated = [r for r in result.records if r.get("deviated")]
        if deviated:
            lines += ["", f"Probes outside the tolerance ({len(deviated)}): " + ", ".join(
                f"{r['probe']} ({', '.join(r['tags'])}; max |amp - fp32| {r['max_abs_error']:.3g})" for r in deviated)]
    if v.training:
        lines += ["", "## Training from the same state (the updates applied are judged above; the rest informational)",
                  "",
                  "| precision | updates applied | final loss | max loss diff vs FP32 | mean grad-norm ratio vs FP32 |",
                  "|---|---|---|---|---|"]
        for t in v.training:
            ratio = t["mean_grad_norm_ratio_vs_fp32"]
            lines.append(f"| {t['precision']} | {t['updates_applied']} | "
                         f"{'none' if t['final_loss'] is None else format(t['final_loss'], '.4g')} | "
                         f"{t['max_loss_diff_vs_fp32']:.3g} | {'n/a' if ratio is None else format(ratio, '.4f')} |")
    lines += _reproducibility(v)
    return "\n".join(lines) + "\n"


def _rules_paragraph(v: Validation, cfg: Any) -> str:
    """The report's paragraph under the verdict: the weights, the probe set, and every rule as
    it was declared before the run.

    Example::

        >>> from ampguard.config import validate
        >>> cfg = validate({"validation": {"max_mse": 0.5, "outputs": {"box": {"abs_tol": 0.5}}}}).validation
        >>> print(_rules_paragraph(Validation("t", "regression", ["held_out:0"], [], []), cfg))  # doctest: +NORMALIZE_WHITESPACE
        Weights: freshly initialised. Model in eval mode. Probe set (1 examples, each probed once with all its
        tags): 32 typical, 0 nearest a decision boundary in FP32, the task edge cases. Rules declared before the
        run: scores |amp - fp32| <= 0.05 + 0.05 * |fp32| per element (outputs not named below); output box:
        |amp - fp32| <= 0.5 + 0.05 * |fp32| per element; no non-finite output; mse <= 0.5; mse at most (1 +
        0.01) x FP32's.
    """
    rules = [f"scores {tolerance_text(cfg.abs_tol, cfg.rel_tol)}{' (outputs not named below)' if cfg.outputs else ''}",
             *(f"output {name}: {tolerance_text(*tolerance(cfg, name))}" for name in cfg.outputs),
             *([f"at most {cfg.max_flips} decision changes (a tie: {_tie_rule(cfg)})"]
               if v.mode == "classifier" else []),
             "no non-finite output"]
    if v.mode == "classifier" and cfg.min_accuracy is not None:
        rules.append(f"accuracy >= {cfg.min_accuracy:g}")
    elif v.mode == "regression" and cfg.max_mse is not None:
        rules.append(f"mse <= {cfg.max_mse:g}")
    else:
        rules.append("no absolute quality floor declared (the reference's quality is not checked: the verdict "
                     "rejects)")
    if cfg.max_quality_drop is not None:
        rules.append(f"accuracy at most {cfg.max_quality_drop:g} below FP32's" if v.mode == "classifier"
                     else f"mse at most (1 + {cfg.max_quality_drop:g}) x FP32's")
    if cfg.train_steps:
        rules.append(f"training {counted(cfg.train_steps, 'step')} from the same state applies at least "
                     f"{cfg.min_applied:g} of FP32's updates (a loss scaler's opening search set aside)")
    return (f"Weights: {v.weights}. Model in eval mode. Probe set ({len(v.probes)} examples, each probed once with "
            f"all its tags): {_probe_counts(v, cfg)}. Rules declared before the run: {'; '.join(rules)}.")


def _probe_counts(v: Validation, cfg: Any) -> str:
    """How many probes carry each tag, e.g. ``7 typical, 7 nearest a decision boundary in FP32, 1 edge case``."""
    if not v.tags:  # a Validation made by hand: what was asked
        return (f"{cfg.typical} typical, {cfg.boundary if v.mode == 'classifier' else 0} nearest a decision "
                f"boundary in FP32, {'the task edge cases' if cfg.edge_cases else 'no edge cases'}")
    count = {tag: sum(tag in tags for tags in v.tags.values()) for tag in ("typical", "boundary", "edge")}
    return (f"{count['typical']} typical, {count['boundary']} nearest a decision boundary in FP32, "
            f"{count['edge']} edge case{'' if count['edge'] == 1 else 's'}")


def _reproducibility(v: Validation) -> list[str]:
    """The report's last section: what it was made with (the full config is in validation.json)."""
    env = v.environment
    if not env:
        return []
    rows = [(key, env[key]) for key in ("ampguard", "torch", "python") if key in env]
    device = env.get("device")
    if device:
        rows.append(("device", ", ".join(f"{k} {val}" for k, val in device.items())))
    for name, support in env.get("dtype_support", {}).items():
        rows.append((f"{name} support", ", ".join(f"{k} {', '.join(val) if isinstance(val, list) else val}"
                                                  for k, val in support.items())))
    for name, dtypes in env.get("output_dtypes", {}).items():
        rows.append((f"{name} output dtypes", ", ".join(f"{k} {val}" for k, val in dtypes.items()) or "n/a"))
    checkpoint = env.get("checkpoint")
    if checkpoint:
        rows.append(("checkpoint", f"{checkpoint['path']} (sha256 {checkpoint['sha256']})"))
    rows += [(key.replace("_", " "), env[key]) for key in ("config_sha256", "probe_set_sha256") if key in env]
    return ["", "## Reproducibility", "", "| what | value |", "|---|---|", *(_row(k, val) for k, val in rows)]


def _row(*cells: Any) -> str:
    """One Markdown table row; a ``|`` inside a cell (``|amp - fp32|``) is escaped, a control
    character written as its escape (:func:`ampguard.errors.table_cell`, compare's table's too).

    Example::

        >>> print(_row("scores: |a - b| <= 0.1", "pass"))
        | scores: \\|a - b\\| <= 0.1 | pass |
    """
    return "| " + " | ".join(map(table_cell, cells)) + " |"


def as_json(v: Validation) -> dict[str, Any]:
    """``validation.json``'s content: the same verdict and rules as the markdown, as data.

    ``accepted`` is the exit code's verdict; ``reference_trusted`` is true only when every check of
    the FP32 reference was made and held, and ``reference_quality_checked`` says whether its
    quality was checked at all (false when no ``validation.min_accuracy`` / ``max_mse`` is
    declared: ``accepted`` is then false too). Each rule
    carries ``ok`` (not violated) and ``checked`` (there was a declared rule to check).
    ``evaluation_set`` says where the evaluation set came from (:func:`evaluation_set`: the
    task's held-out set, or a factory's first training batches).

    Example::

        >>> v = Validation("linear", "regression", ["held_out:0"], [Rule("reference quality", "mse 0.1", "", True)],
        ...                [PrecisionResult("bf16", [Rule("complete and finite", "1/1", "1/1", True)])])
        >>> data = as_json(v)
        >>> data["accepted"], data["reference_trusted"], data["reference_quality_checked"]
        (True, True, True)
        >>> data["precisions"][0]["rules"]
        [{'criterion': 'complete and finite', 'reference': '1/1', 'amp': '1/1', 'ok': True, 'checked': True}]
    """

    def rules(rs: list[Rule]) -> list[dict[str, Any]]:
        return [{"criterion": r.criterion, "reference": r.reference, "amp": r.amp, "ok": r.ok, "checked": r.checked}
                for r in rs]

    return {
        "accepted": v.ok, "reference_trusted": v.reference_trusted,
        "reference_quality_checked": v.reference_quality_checked, "task": v.task, "mode": v.mode,
        "weights": v.weights, "evaluation_set": v.evaluation_set, "probes": v.probes, "probe_tags": v.tags,
        "reference": rules(v.reference),
        "precisions": [{"precision": r.precision, "ok": r.ok, "rules": rules(r.rules), "flips": r.flips,
                        "ties": r.ties, "stats": r.stats, "probes": r.records} for r in v.results],
        "training": v.training, "environment": v.environment, "earlier_rejections": v.earlier,
    }


def write_outputs(v: Validation, config: Config, folder: Path) -> tuple[Path, Path]:
    """Write ``validation.md`` and ``validation.json`` into ``folder`` (which must exist), each
    whole or not at all (a temporary file renamed over it: a reader never sees half a report).

    Example (non-finite stats are written as strict JSON)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> result = PrecisionResult("fp16", [Rule("complete and finite", "1/1", "0/1", False)],
        ...                          stats={"max_abs_error": math.inf})
        >>> md, js = write_outputs(Validation("linear", "regression", [], [], [result]), Config(), folder)
        >>> data = json.loads(js.read_text())
        >>> md.name, data["accepted"], data["precisions"][0]["stats"]["max_abs_error"]
        ('validation.md', False, 'inf')
        >>> shutil.rmtree(folder)
    """
    md, js = folder / "validation.md", folder / "validation.json"
    replace_atomically(md, markdown(v, config))
    replace_atomically(js, json.dumps(strict_json(as_json(v)), indent=2) + "\n")
    return md, js


# ---------------------------------------------------------------------------- verdicts over time

HISTORY = "validate-history.jsonl"
"""Beside the report folders (``log.dir``, or ``--out``'s parent): one line per report written,
``{time, report, task, weights, probe_set, rules, accepted, verdict}``, so that a later validate of the
same weights under other rules, or on another probe set, says what an earlier one rejected (seed 001:
declare the rules before reading the results; do not widen a tolerance to make a case vanish)."""


def histories(report: Path, log_dir: str | Path) -> list[Path]:
    """The histories a report reads its earlier verdicts from and is noted in: the one beside it
    and, when ``--out`` put it elsewhere, ``log.dir``'s too, so that a report written under
    another folder still sees (and is seen by) the reports in ``log.dir`` (review 49a: a
    rejection in ``runs/`` went unsaid by a widened rerun with ``--out report2``).

    Example::

        >>> [str(p) for p in histories(Path("runs/validate-1"), "runs")]
        ['runs/validate-history.jsonl']
        >>> [str(p) for p in histories(Path("elsewhere/v2"), "runs")]
        ['elsewhere/validate-history.jsonl', 'runs/validate-history.jsonl']
    """
    beside, shared = report.parent / HISTORY, Path(log_dir) / HISTORY
    return [beside] if beside.absolute() == shared.absolute() else [beside, shared]


def verdict_key(config: Config, v: Validation) -> dict[str, Any]:
    """What a verdict is about and under which rules: the task (its factory, or its name: two
    models whose weights happen to hash the same are not one) and its ``task.options`` (a change
    :func:`earlier_rejections` says as it says a rule's: one factory may build another model from
    other options on the same weights), the weights (the checkpoint's SHA-256; with none, the built model's weights', :func:`weights_sha256`), the probe set's
    SHA-256, and every ``validation`` setting but the checkpoint's path (dotted keys; the
    precisions in any order), with the ``fp8`` section's when fp8 is judged.

    Example::

        >>> from ampguard.config import validate
        >>> key = verdict_key(validate({"task": {"name": "linear"}}), Validation("linear", "regression", [], [], []))
        >>> sorted(key), key["task"], key["task_options"], key["rules"]["validation.ties"], key["weights"][:14]
        (['probe_set', 'rules', 'task', 'task_options', 'weights'], 'linear', {}, 'count_as_flip', 'weights sha256')
    """
    checkpoint = v.environment.get("checkpoint") or {}
    weights = f"sha256 {checkpoint['sha256']}" if checkpoint.get("sha256") else \
        f"weights sha256 {v.environment.get('weights_sha256')}"  # (the model as built: a factory may load its own)
    rules = flat_keys(config.validation.model_dump(mode="json"), "validation")
    rules.pop("validation.checkpoint", None)
    rules["validation.precisions"] = sorted(rules["validation.precisions"])  # (the order judges nothing)
    if "fp8" in config.validation.precisions:  # (which layers run in float8 decides the fp8 verdict)
        rules.update(flat_keys(config.fp8.model_dump(mode="json"), "fp8"))
    task = reproducible_config(config)["task"]
    return {"task": task.get("factory") or task.get("name"), "task_options": task.get("options") or {},
            "weights": weights, "probe_set": v.environment.get("probe_set_sha256"), "rules": rules}


def _check_made(model: nn.Module, who: str) -> None:
    """Refuse (one line) a model whose lazy modules have not made their weights yet (review 40g:
    ``nn.LazyLinear`` with no checkpoint was a traceback in :func:`weights_sha256`): the verdict
    is about weights it can read, and each precision's pass would otherwise draw its own at its
    first forward. A checkpoint loaded into it makes them.

    Example::

        >>> _check_made(nn.Linear(2, 1), "toy")
        >>> try:
        ...     _check_made(nn.Sequential(nn.LazyLinear(2)), "toy")
        ... except InputError as err:
        ...     print(err)
        validate: task toy: the model's lazy modules have made no weights yet (0: LazyLinear); validate judges weights it can read: run one batch through the model in the factory, or give validation.checkpoint
    """
    from .untouched import not_made

    lazy = [f"{name or 'the model'}: {type(m).__name__}" for name, m in model.named_modules() if not_made(m)]
    if lazy:
        raise InputError(f"validate: task {who}: the model's lazy modules have made no weights yet "
                         f"({listed(lazy)}); validate judges weights it can "
                         "read: run one batch through the model in the factory, or give validation.checkpoint")


def weights_sha256(model: nn.Module) -> str:
    """The SHA-256 of a model's weights: each ``state_dict`` entry's name, dtype, shape and bytes,
    in order (what the verdict is about when no checkpoint file names them).

    Example::

        >>> a, b = nn.Linear(2, 1), nn.Linear(2, 1)
        >>> _ = b.load_state_dict(a.state_dict())
        >>> weights_sha256(a) == weights_sha256(b), weights_sha256(a) == weights_sha256(nn.Linear(2, 1))
        (True, False)
        >>> len(weights_sha256(nn.BatchNorm1d(2).to(torch.bfloat16)))  # (a 0-dim count; a dtype numpy lacks)
        64
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        # (flat first: a 0-dim buffer, a BatchNorm's count, cannot be viewed as bytes as it is)
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


UNSET = "(not set)"
"""How :func:`earlier_rejections` words a rule one side does not record (a per-output tolerance
declared since, say)."""


def earlier_rejections(history: Path, key: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The entries of ``history`` (:data:`HISTORY`) that rejected the same weights (of the same
    task, where the entry names it) under other rules or on another probe set, each with what changed since (``changed``: ``"key: old ->
    new"``; ``probe set: <sha256> -> <sha256>``). A rule one side does not record counts as
    changed (:data:`UNSET`): ``validation.outputs: {}`` records no key, so a per-output tolerance
    widened after a rejection was no change at all; the ``fp8`` section's settings, recorded
    only when fp8 is judged, are the one exception (``validation.precisions`` says that). The
    probe set is no key to match on but a change: dropping the probes that failed
    (``validation.edge_cases: false``) made the earlier verdict another set's, never shown (its
    SHA-256's first 12 digits are said).
    Lines that do not read are passed over (the history informs, it never refuses a run).

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / HISTORY
        >>> old = {"weights": "w", "probe_set": "p", "rules": {"validation.ties": "count_as_flip"}}
        >>> _ = path.write_text(json.dumps({**old, "accepted": False, "verdict": "REJECTED", "time": "t",
        ...                                 "report": "r"}) + "\\n" + "{torn")
        >>> [e["changed"] for e in earlier_rejections(path, {**old, "rules": {"validation.ties": "accept"}})]
        [['validation.ties: count_as_flip -> accept']]
        >>> earlier_rejections(path, old)  # (the same rules and probes: nothing loosened)
        []
        >>> [e["changed"] for e in earlier_rejections(path, {**old, "rules": {  # (fp8 now judged: its settings new)
        ...     "validation.ties": "accept", "fp8.recipe": "tensorwise"}})]
        [['validation.ties: count_as_flip -> accept']]
        >>> [e["changed"] for e in earlier_rejections(path, {**old, "probe_set": "q", "rules": {
        ...     **old["rules"], "validation.outputs.output.abs_tol": 1000}})]
        [['probe set: p -> q', 'validation.outputs.output.abs_tol: (not set) -> 1000']]
    """
    found = []
    with contextlib.suppress(OSError):
        for raw in history.read_bytes().splitlines():  # (a bad byte or a torn line costs that line alone)
            try:
                entry = json.loads(raw.decode("utf-8", errors="replace"))
            except (ValueError, RecursionError):  # (a line nested past the parser's depth: not ours either)
                continue
            if not (isinstance(entry, dict) and entry.get("accepted") is False and isinstance(entry.get("rules"), dict)
                    and entry.get("weights") == key["weights"] and entry.get("task", key.get("task")) == key.get("task")):
                continue  # (an entry that names no task, written before it was keyed, is matched on its weights)
            # the task's options are a change said, not another subject: an option the factory ignores, or one
            # left to its default, builds the same weights (and a different model on the same weights is said)
            now_options = key.get("task_options") or {}
            then = {**entry["rules"], **flat_keys(entry.get("task_options", now_options) or {}, "task.options")}
            now = {**key["rules"], **flat_keys(now_options, "task.options")}
            changed = [f"probe set: {str(entry.get('probe_set'))[:12]} -> {str(key['probe_set'])[:12]}"] \
                if entry.get("probe_set") != key["probe_set"] else []
            for k in sorted(set(then) | set(now)):
                if (k in then) != (k in now) and k.startswith("fp8."):  # (fp8 judged on one side only)
                    continue
                # (null is unset too: an output's rel_tol left to the default records null)
                old, new = (UNSET if side.get(k) is None else json.dumps(side[k]) for side in (then, now))
                if old != new and _effective(then, k) != _effective(now, k):
                    changed.append(f"{k}: {old} -> {new}".replace('"', ""))
            if changed:
                found.append({k: entry.get(k) for k in ("time", "report", "verdict")} | {"changed": changed})
    return found


def _effective(rules: Mapping[str, Any], k: str) -> Any:
    """The value rule ``k`` had in ``rules`` (a :func:`verdict_key`'s): an output's own tolerance
    left unset (absent, or null) is the global one (:func:`tolerance`), so declaring it equal to
    the global one changes nothing applied.

    Example::

        >>> rules = {"validation.abs_tol": 0.05}
        >>> _effective(rules, "validation.outputs.output.abs_tol"), _effective(rules, "validation.rel_tol")
        (0.05, None)
    """
    value = rules.get(k)
    head, _, part = k.rpartition(".")
    if value is None and head.startswith("validation.outputs.") and part in ("abs_tol", "rel_tol"):
        return rules.get(f"validation.{part}")
    return value


def rejections_text(earlier: list[dict[str, Any]]) -> str:
    """The report's and the console's words for :func:`earlier_rejections`, one line: what the
    history holds (its times, folders, verdicts, rules: a file others may write, in a shared
    ``log.dir``) with each control character written as its escape (:func:`~ampguard.errors.visible`:
    review 55d, an escape sequence in it cleared the screen or wrote a line of its own).

    Example::

        >>> print(rejections_text([{"time": "2026-12-03 19:20", "report": "runs/validate-1", "verdict": "REJECTED",
        ...                         "changed": ["validation.ties: count_as_flip -> accept"]}]))
        Earlier verdicts on these weights under other rules or probes: REJECTED at 2026-12-03 19:20 (runs/validate-1); since then validation.ties: count_as_flip -> accept
    """
    said = "; ".join(f"{e['verdict']} at {e['time']} ({e['report']}); since then {', '.join(e['changed'])}"
                     for e in earlier)
    return visible(f"Earlier verdicts on these weights under other rules or probes: {said}")


def note_verdict(history: Path, key: Mapping[str, Any], v: Validation, report: Path) -> str | None:
    """Append this report's line to ``history``; a line saying why it could not (the report
    stands without it), else None. The history is reached as the run's logs are
    (:func:`~ampguard.files.open_to_append`): one in a folder others share (``log.dir``) that is a
    link of another user's to what is not theirs is not written through (review 55d): the line is
    left out, and the reason returned."""
    entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "report": str(report.resolve()), **key,
             "accepted": v.ok, "verdict": v.verdict}
    try:
        with open(open_to_append(history, readable=True), "r+b", buffering=0) as f:
            size = f.seek(0, os.SEEK_END)  # (a torn last line: this one on a line of its own)
            torn = size > 0 and f.seek(size - 1) == size - 1 and f.read(1) != b"\n"
            f.write((b"\n" if torn else b"") + json.dumps(strict_json(entry)).encode() + b"\n")
    except OSError as err:
        return f"validate: could not note the verdict in {history} ({failed_because(err)})"
    return None


# ---------------------------------------------------------------------------- the verb


def run(config: Config, *, checkpoint: str | None = None, out: str | Path | None = None,
        train_steps: int | None = None) -> ExitCode:
    """``ampguard validate``: compare, write ``validation.md`` and ``validation.json`` into ``out``
    (default ``log.dir/validate-<time>``, ``-2``, ``-3``... when taken; an existing non-empty
    folder, one another validate is writing, a file, or a place that cannot be written is
    refused), print the verdict. ``ExitCode.OK`` when every rule holds, ``ExitCode.REJECTED``
    when any is violated. The folder is reserved first (:func:`reserve_report_folder`), so two
    runs never write one report; every refusal (:class:`InputError`) or interruption after that
    takes back what it made: nothing is written but the whole report. With no floor declared
    (``validation.min_accuracy`` / ``max_mse``) the reference's quality reads ``NOT CHECKED`` and
    the verdict rejects, saying what to declare; with no checkpoint, a warning on stderr says the
    reference is the untrained model (:func:`untrained_reference`).

    Example (an untrained model misses a declared ``max_mse``: the reference is not trusted)::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> folder = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "device": "cpu",
        ...                    "validation": {"precisions": ["bf16"], "typical": 4, "max_mse": 0.5}})
        >>> code = run(config, out=folder / "v")  # doctest: +ELLIPSIS
        evaluation set: task linear's held-out set (512 examples)
        reference: reference outputs finite: 7/7 probes, 512/512 eval -> pass
        reference: reference quality: mse ... (<= 0.5) -> FAIL
        ...
        validate: REJECTED (FP32 reference not trusted); report .../validation.md, .../validation.json
        >>> code, sorted(p.name for p in (folder / "v").iterdir())
        (<ExitCode.REJECTED: 1>, ['validation.json', 'validation.md'])
        >>> for out in (folder / "v", folder / "v" / "validation.md"):
        ...     try:
        ...         run(config, out=out)
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        --out DIR/v exists and is not empty; refusing to overwrite it
        --out DIR/v/validation.md is a file, not a folder
        >>> shutil.rmtree(folder)
    """
    cfg = config.validation
    if train_steps is not None or checkpoint:  # the report's config is the one that reproduces it
        update = {"train_steps": train_steps} if train_steps is not None else {}
        cfg = cfg.model_copy(update={**update, **({"checkpoint": str(checkpoint)} if checkpoint else {})})
        config = config.model_copy(update={"validation": cfg})
    folder = reserve_report_folder(out, config.log.dir)
    try:
        result, key, (md, js) = _judge(config, folder)
    except BaseException:  # a refusal, a failed write, Ctrl-C: the folder goes back as it was
        folder.release(written=False)
        raise
    folder.release(written=True)
    beside, *shared = histories(folder.path, config.log.dir)
    unnoted = note_verdict(beside, key, result, folder.path)
    for history in shared:  # (log.dir's, made if missing; one that cannot be is let be: the report's own holds it)
        with contextlib.suppress(OSError):
            history.parent.mkdir(parents=True, exist_ok=True)
            note_verdict(history, key, result, folder.path)
    print(f"evaluation set: {result.evaluation_set['description']}")
    for r in result.reference:
        print(f"reference: {r.criterion}: {r.reference} -> {r.decision}")
    for precision in result.results:
        for r in precision.rules:
            print(f"{precision.precision}: {r.criterion}: {r.amp} -> {r.decision}")
    for t in result.training:
        print(f"train {t['precision']}: {counted(t['updates_applied'], 'update')} applied, final loss "
              f"{'none' if t['final_loss'] is None else format(t['final_loss'], '.4g')}")
    if not cfg.checkpoint:  # stderr: after the report, so a refusal above stays the one line there
        print(f"ampguard: warning: validate: {untrained_reference(config)}", file=sys.stderr)
    if unnoted:
        print(f"ampguard: warning: {unnoted}", file=sys.stderr)
    if result.earlier:  # (a rule loosened after a rejection: said beside the verdict, not only in the report)
        print(f"validate: note: {rejections_text(result.earlier)}")
    print(visible(f"validate: {result.verdict}; report {md}, {js}"))  # (--out as given: a control character escaped)
    return ExitCode.OK if result.ok else ExitCode.REJECTED


def _judge(config: Config, folder: ReportFolder) -> tuple[Validation, dict[str, Any], tuple[Path, Path]]:
    """What :func:`run` does in its reserved ``folder``: check, load, compare, write the report.
    Returns the verdict, what it is about (:func:`verdict_key`, for the history) and the report's
    two files."""
    from .checkpointer import load_trained_weights
    from .tasks import build_task

    cfg = config.validation
    device = resolve_device(config.device)
    task = build_task(config)
    check_rules(task, cfg)
    model = task.model.to(device)
    weights = "freshly initialised (no checkpoint given)"
    checkpoint = cfg.checkpoint
    if checkpoint:
        payload = load_trained_weights(model, checkpoint, config, data_id=task.data_id)
        weights = f"from {checkpoint} (step {payload['step']})"
        try:
            provenance = {"path": str(Path(checkpoint).resolve()), "sha256": file_sha256(checkpoint)}
        except OSError as err:
            raise InputError(f"{checkpoint}: cannot read it ({failed_because(err)})") from None

    check_fp32_weights(model, cfg.precisions)  # (after the checkpoint: its weights are what the reference runs)
    _check_made(model, config.task.factory or task.name)
    judged = weights_sha256(model)  # (the weights judged, as loaded: before any training moves and restores them)
    if cfg.train_steps:  # what train refuses at its first batch, refused here in its words (not a traceback
        # whose exit 1 read as REJECTED)
        from .build import check_forward, check_trainable

        who = f"validate --train-steps: task {config.task.factory or task.name}"
        check_trainable(model, who)
        check_forward(model, task.loss_fn, lambda: tuple(to_device(t, device) for t in next(iter(task.batches()))),
                      Precision(config.precision, device.type), who)
    training = compare_training(task, config, device, cfg.train_steps) if cfg.train_steps else []
    result = compare(task, model, config, device)
    result.weights, result.training = weights, training
    result.environment["weights_sha256"] = judged
    if training:  # (a broken FP32 training run is no baseline: the reference is not trusted)
        result.reference.append(training_reference_rule(training[0]))
    for precision, t in zip(result.results, training[1:]):  # (training[0] is FP32's)
        assert precision.precision == t["precision"], (precision.precision, t["precision"])
        precision.rules.append(training_rule(t, training[0], cfg.min_applied))
    if checkpoint:
        result.environment["checkpoint"] = provenance
    key = verdict_key(config, result)
    earlier = [e for history in histories(folder.path, config.log.dir) for e in earlier_rejections(history, key)]
    result.earlier = list({e["report"]: e for e in earlier}.values())  # (a report noted in both: once)
    return result, key, write_report_folder(result, config, folder)


def untrained_reference(config: Config) -> str:
    """The warning for a run with no checkpoint: the FP32 reference is the model as the task
    builds it, untrained for a built-in task (a factory may load weights of its own).

    Example::

        >>> from ampguard.config import validate
        >>> print(untrained_reference(validate({"task": {"name": "linear"}})))
        no --checkpoint: the FP32 reference is task linear freshly initialised (untrained weights); pass --checkpoint (or set validation.checkpoint) to validate trained ones
    """
    which = "the weights of a run" if config.task.factory else "trained ones"
    return (f"no --checkpoint: the FP32 reference is {untrained_model(config)}; pass --checkpoint (or set "
            f"validation.checkpoint) to validate {which}")


RESERVED = ".ampguard-validate"
"""The file a validate run holds in its report folder while it runs (made with ``O_EXCL``, its pid
in it): a second run given the same ``--out`` is refused at its start, instead of both passing
the up-front check and one overwriting the other's report. Removed once the report is written."""


@dataclass
class ReportFolder:
    """The folder a validate run reserved for its report (:func:`reserve_report_folder`)."""

    path: Path
    what: str
    """How a refusal names it: ``--out PATH``, or ``report folder PATH`` for the default one."""
    made: list[Path] = field(default_factory=list)
    """The folders this run created (the report folder and its missing parents), deepest first."""
    held: bool = False
    """This run created :data:`RESERVED` in it (and so removes it)."""

    def release(self, *, written: bool) -> None:
        """Let go of the folder: remove this run's :data:`RESERVED`, and, when no report was
        ``written``, the folders this run made, while they are empty (never a folder it found)."""
        if self.held:
            if _marker_pid(self.path / RESERVED) == os.getpid():  # (its own: never another run's)
                with contextlib.suppress(OSError):
                    (self.path / RESERVED).unlink()
            self.held = False
        for p in [] if written else self.made:
            with contextlib.suppress(OSError):
                p.rmdir()


def reserve_report_folder(out: str | Path | None, log_dir: str | Path) -> ReportFolder:
    """Check (:func:`check_output_folder`) and take the report's folder, atomically: ``out``, or
    ``log_dir/validate-<time>`` with ``-2``, ``-3``... added until a name is free (two runs in
    one second never share one, nor name an ``--out`` nobody gave). The folder (made with its
    missing parents) is this run's once it holds :data:`RESERVED`, created exclusively: an
    ``--out`` that another run reserved, or that filled up since the check, is refused in one
    :class:`InputError` line, and what this call made is taken back.

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> first = reserve_report_folder(root / "a" / "out", root)
        >>> sorted(p.name for p in first.path.iterdir()), [p.name for p in first.made]
        (['.ampguard-validate'], ['out', 'a'])
        >>> try:
        ...     reserve_report_folder(root / "a" / "out", root)
        ... except InputError as err:
        ...     print(str(err).replace(str(root), "DIR"))  # doctest: +ELLIPSIS
        --out DIR/a/out is being written by another ampguard validate (pid ...): choose another --out (or remove DIR/a/out/.ampguard-validate if none runs)
        >>> first.release(written=False); sorted(p.name for p in root.iterdir())
        []
        >>> one, two = reserve_report_folder(None, root / "runs"), reserve_report_folder(None, root / "runs")
        >>> one.path != two.path, one.what.startswith("report folder ")
        (True, True)
        >>> shutil.rmtree(root)
    """
    if out:
        folder = Path(out)
        what = f"--out {folder}"
        check_output_folder(folder)
    else:
        folder, what = Path(log_dir) / time.strftime("validate-%Y%m%d-%H%M%S"), f"log.dir {log_dir}"
        _check_parent(folder, what)
    made: list[Path] = []  # (outermost first; ReportFolder takes them back newest first)
    try:
        make_parents(folder, made)
        for n in itertools.count(1):
            name = folder if out or n == 1 else folder.with_name(f"{folder.name}-{n}")
            try:
                name.mkdir()
            except FileExistsError:
                if out:
                    break  # (found empty by the check: the marker below decides whose it is)
                continue
            made.append(name)
            folder = name
            break
        fd = os.open(folder / RESERVED, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:  # (only the marker's open lets one through: another run's, left as it is)
        refusal = _being_written(folder, what)
        ReportFolder(folder, what, made[::-1]).release(written=False)
        raise refusal from None
    except OSError as err:
        ReportFolder(folder, what, made[::-1]).release(written=False)
        raise InputError(f"{what}: cannot create {folder} ({failed_because(err)})") from None
    with contextlib.suppress(OSError), os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    reserved = ReportFolder(folder, what if out else f"report folder {folder}", made[::-1], held=True)
    if any(p.name != RESERVED for p in folder.iterdir()):  # a run that finished between the check and the marker
        reserved.release(written=False)
        raise InputError(f"{reserved.what} exists and is not empty; refusing to overwrite it")
    return reserved


def _marker_pid(marker: Path) -> int | None:
    """The pid a :data:`RESERVED` file names; None when it names none (unreadable, still being
    written, a hand edit)."""
    try:
        text = marker.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and len(text) < 10 else None


def _take_over(folder: Path, what: str) -> None:
    """Take ``folder``'s :data:`RESERVED` away when the process it names no longer runs (a
    validate killed with SIGKILL or SIGTERM never let go of it), atomically: it is renamed to a
    name of this process's first, so of two runs that both found it stale one takes it and the
    other finds it gone (a marker renamed that turns out live is put back). A live one, or one
    that names no pid, is refused (:func:`_being_written`)."""
    marker = folder / RESERVED
    pid = _marker_pid(marker)
    if pid is None or _alive(pid):
        raise _being_written(folder, what)
    taken = marker.with_name(f"{RESERVED}.stale-{os.getpid()}")
    try:
        os.rename(marker, taken)
    except FileNotFoundError:  # (another run took it over first: that one holds the folder now)
        raise _being_written(folder, what) from None
    except OSError as err:
        raise InputError(f"{what}: cannot take over {marker} ({failed_because(err)})") from None
    if _marker_pid(taken) != pid:  # (a run that took it over between the read and the rename: its own)
        with contextlib.suppress(OSError):
            os.link(taken, marker)
        taken.unlink(missing_ok=True)
        raise _being_written(folder, what)
    taken.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (another user's counts: it runs; where it cannot be told,
    :data:`~ampguard.files.CAN_PROBE_PROCESSES`, it is taken to: the folder is refused, named)."""
    if not CAN_PROBE_PROCESSES:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def _being_written(folder: Path, what: str) -> InputError:
    """The refusal of a folder another validate run holds (:data:`RESERVED`), naming its pid."""
    pid = _marker_pid(folder / RESERVED)
    held = f" (pid {pid})" if pid is not None else ""
    return InputError(f"{what} is being written by another ampguard validate{held}: choose another --out "
                      f"(or remove {folder / RESERVED} if none runs)")


def check_output_folder(folder: Path) -> None:
    """Refuse an ``--out`` the report cannot go to, before anything runs: a file, a non-empty
    folder (one another validate run holds: said so), a path under a file, or a place this
    process may not write.

    Example::

        >>> import os, shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "notes.txt").write_text("keep me")
        >>> check_output_folder(root / "new" / "deeper")  # made later, with its parents: fine
        >>> for out in (root, root / "notes.txt", root / "notes.txt" / "sub"):
        ...     try:
        ...         check_output_folder(out)
        ...     except InputError as err:
        ...         print(str(err).replace(str(root), "DIR"))
        --out DIR exists and is not empty; refusing to overwrite it
        --out DIR/notes.txt is a file, not a folder
        --out DIR/notes.txt/sub: DIR/notes.txt is a file, not a folder
        >>> shutil.rmtree(root)
    """
    what = f"--out {folder}"
    if folder.is_dir():
        if (folder / RESERVED).exists():
            _take_over(folder, what)  # (a run killed before it let go: nothing of it holds the folder)
        if any(folder.iterdir()):
            raise InputError(f"{what} exists and is not empty; refusing to overwrite it")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InputError(f"{what}: {folder} is not writable")
    elif folder.exists() or folder.is_symlink():
        raise InputError(f"{what} is a file, not a folder")
    else:
        _check_parent(folder, what)


def _check_parent(folder: Path, what: str) -> None:
    """Refuse a ``folder`` (which does not exist) whose nearest existing folder above is a file or
    cannot be written, in one line (``what`` names the setting: ``--out`` or ``log.dir``)."""
    existing = next(p for p in folder.absolute().parents if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise InputError(f"{what}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{what}: {existing} is not writable")


def write_report_folder(v: Validation, config: Config, folder: ReportFolder) -> tuple[Path, Path]:
    """Write the report into the ``folder`` this run reserved (:func:`reserve_report_folder`,
    which makes and takes back the folders); a write that fails (permissions, a full disk), or
    Ctrl-C between the two files, leaves neither file, and a failed write is one
    :class:`InputError` naming the folder.

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> v = Validation("linear", "regression", [], [], [])
        >>> folder = reserve_report_folder(root / "a" / "b", root)
        >>> [p.name for p in write_report_folder(v, Config(), folder)]
        ['validation.md', 'validation.json']
        >>> folder.release(written=True); shutil.rmtree(root)
    """
    try:
        return write_outputs(v, config, folder.path)
    except BaseException as err:
        for name in ("validation.md", "validation.json"):
            (folder.path / name).unlink(missing_ok=True)
        if not isinstance(err, (OSError, DiskFull)):
            raise
        err = err.error if isinstance(err, DiskFull) else err  # (replace_atomically names a full disk DiskFull)
        raise InputError(f"{folder.what}: cannot write the report ({failed_because(err)})") from None
