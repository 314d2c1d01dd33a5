"""Held-out evaluation during a run: when it is due, and running it under the run's autocast.

Example::

    >>> import torch
    >>> from ampguard.config import validate
    >>> from ampguard.precision import Precision
    >>> from ampguard.tasks import build_task
    >>> config = validate({"task": {"name": "linear"}, "steps": 10, "eval": {"every": 4}})
    >>> ev = Evaluator(build_task(config), Precision("fp32", "cpu"), torch.device("cpu"), config)
    >>> [step for step in range(1, 11) if ev.due(step)]
    [4, 8, 10]
    >>> sorted(ev())
    ['val_loss']
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from . import distributed
from .config import Config
from .errors import InputError, RankWarning, shortened, user_code, visible, warn
from .precision import Precision
from .tasks import Task
from .untouched import modes_kept, rng_kept


class Evaluator:
    """The task's ``evaluate`` every ``eval.every`` steps and at the last step (none when the
    task has no evaluation or ``eval.enabled`` is false)."""

    def __init__(self, task: Task, precision: Precision, device: torch.device, config: Config) -> None:
        self.task, self.precision, self.device = task, precision, device
        self.every, self.last_step = config.eval.every, config.steps
        self.enabled = config.eval.enabled and task.evaluate is not None
        self.metrics: tuple[str, ...] = task.metrics if self.enabled else ()
        """The metric names: extra CSV columns after the fixed eight."""
        self._warned = False  # (an undeclared name left out: said once)

    def due(self, step: int) -> bool:
        return self.enabled and (step >= self.last_step or (self.every > 0 and step % self.every == 0))

    def __call__(self) -> dict[str, float]:
        """The metrics, the same on every rank under torchrun (:func:`agreed`): every rank
        evaluates, and each decides its guards (a ``val_regression`` rollback) on them. A name
        the task did not declare (checked at start-up; a later call may differ) is left out, with
        a warning the first time: the CSV has no column for it, and the run goes on."""
        metrics = self._evaluate()
        extra = [name for name in metrics if name not in self.metrics]
        if extra:
            if not self._warned:
                self._warned = True
                warn(f"task.factory: evaluate() returned {extra}, not among its declared metrics "
                     f"{list(self.metrics)}: left out (the CSV has no column for them)", RankWarning,
                     stacklevel=2)
            metrics = {name: value for name, value in metrics.items() if name in self.metrics}
        return agreed(metrics)

    def _evaluate(self) -> dict[str, float]:
        """One call of the task's ``evaluate``: in eval mode, under no_grad and the run's autocast,
        every global RNG (torch CPU and CUDA, ``random``, NumPy) as it was afterwards. An
        evaluation draws nothing from the run's streams: a plain ``DataLoader`` it iterates draws
        a seed from torch's generator, which moved the dropout masks of every later step, so the
        training depended on ``eval.every`` and ``eval.enabled``.

        Example (an evaluate that draws; the training's next draw is the one it would have been)::

            >>> from ampguard.config import validate
            >>> from ampguard.precision import Precision
            >>> from ampguard.tasks import Task
            >>> task = Task("factory", torch.nn.Linear(2, 1), torch.nn.functional.mse_loss, batches=lambda: iter(()),
            ...             evaluate=lambda m, d: {"val_loss": float(torch.rand(()))}, metrics=("val_loss",))
            >>> ev = Evaluator(task, Precision("fp32", "cpu"), torch.device("cpu"), validate({}))
            >>> _ = torch.manual_seed(0); expected = torch.rand(3)
            >>> _ = torch.manual_seed(0); _ = ev._evaluate()
            >>> torch.equal(torch.rand(3), expected)
            True
        """
        model, evaluate = self.task.model, self.task.evaluate
        if not self.enabled or evaluate is None:
            return {}
        with rng_kept(), modes_kept(model):  # (each module's mode back: a layer frozen in eval mode stays so)
            model.eval()
            with torch.no_grad(), self.precision.autocast():
                metrics = evaluate(model, self.device)
                if not isinstance(metrics, Mapping):  # (it "raised AttributeError: 'NoneType' ... 'items'")
                    raise InputError(f"task.factory: evaluate() returned a {type(metrics).__name__}, not a mapping "
                                     "of metric names to numbers ({'val_loss': 0.42})")
                return {name: metric_number(name, value) for name, value in metrics.items()}

    def check(self) -> None:
        """A user's evaluate() must return the metrics it declared: try it once, before any file
        exists (under torchrun every rank tries, and all refuse with the first rank's line)."""
        if not self.enabled:
            return
        problem = None
        try:
            with user_code("task.factory: evaluate() raised "):  # (its draws kept off the run's: _evaluate)
                names = set(self._evaluate())
            if not names <= set(self.task.metrics):
                problem = (f"task.factory: evaluate() returned {sorted(names)}, but metrics declares "
                           f"{list(self.task.metrics)}")
        except InputError as err:  # (held until the ranks agree on the first rank's line)
            problem = str(err)
        problem = distributed.first_error(problem)
        if problem is not None:
            raise InputError(problem)


def metric_number(name: object, value: object) -> float:
    """A metric ``evaluate()`` returned, as a float, or an ``int`` for an integer (a Python or
    NumPy int, an integer tensor: tokens seen, an epoch; the CSV writes its digits, exact); one
    that is no number is one :class:`~ampguard.errors.InputError` line naming it and its type (at
    start-up and mid-run alike: a traceback from ``float()`` otherwise). A one-element tensor is a
    number; a string, even ``"0.5"``, is not; a bool is 1.0 or 0.0.

    Example::

        >>> metric_number("val_loss", torch.tensor(0.25)), metric_number("val_acc", 1.0), metric_number("tokens", 2**60)
        (0.25, 1.0, 1152921504606846976)
        >>> metric_number("epoch", torch.tensor(3)), metric_number("done", True)
        (3, 1.0)
        >>> metric_number("val_loss", "abc")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory: evaluate() returned a str for metric 'val_loss' ('abc'), not a number
        >>> metric_number("val_loss", torch.ones(3))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory: evaluate() returned a Tensor of shape (3,) for metric 'val_loss', not a number (one value: .item() or .mean())
    """
    said = visible(shortened(repr(name), 60)) if isinstance(name, str) else f"named by a {type(name).__name__}"
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex():
            return value.item() if not value.dtype.is_floating_point and value.dtype != torch.bool else float(value)
        raise InputError(f"task.factory: evaluate() returned a Tensor of shape {tuple(value.shape)} for metric "
                         f"{said}, not a number (one value: .item() or .mean())")
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # (NumPy's integers too)
        return int(value)
    if not isinstance(value, (str, bytes, bytearray, complex)):
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            pass
    shown = f" ({shortened(repr(value), 40)})" if isinstance(value, (str, bytes)) else ""
    raise InputError(f"task.factory: evaluate() returned a {type(value).__name__} for metric {said}{shown}, "
                     "not a number")


def agreed(metrics: dict[str, float]) -> dict[str, float]:
    """Under torchrun, each metric's mean over the ranks (a collective), on every rank: a
    factory's ``evaluate`` that scores this rank's share of the held-out set gives the whole
    set's mean (equal shares); one that scores the whole set on every rank gives its value
    unchanged (the ranks agree: no arithmetic). Without a process group, ``metrics`` itself.

    Example (no process group)::

        >>> agreed({"val_loss": 0.5})
        {'val_loss': 0.5}
    """
    ranks = distributed.all_gather(metrics)
    if len(ranks) == 1:
        return metrics
    out = {}
    for name, value in metrics.items():
        values = [m.get(name, math.nan) for m in ranks]
        same = all(v == value or (math.isnan(v) and math.isnan(value)) for v in values)
        out[name] = value if same else math.fsum(values) / len(values)
    return out
