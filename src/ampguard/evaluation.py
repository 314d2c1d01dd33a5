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

import torch

from .config import Config
from .errors import InputError
from .precision import Precision
from .tasks import Task


class Evaluator:
    """The task's ``evaluate`` every ``eval.every`` steps and at the last step (none when the
    task has no evaluation or ``eval.enabled`` is false)."""

    def __init__(self, task: Task, precision: Precision, device: torch.device, config: Config) -> None:
        self.task, self.precision, self.device = task, precision, device
        self.every, self.last_step = config.eval.every, config.steps
        self.enabled = config.eval.enabled and task.evaluate is not None
        self.metrics: tuple[str, ...] = task.metrics if self.enabled else ()
        """The metric names: extra CSV columns after the fixed eight."""

    def due(self, step: int) -> bool:
        return self.enabled and (step >= self.last_step or (self.every > 0 and step % self.every == 0))

    def __call__(self) -> dict[str, float]:
        model, evaluate = self.task.model, self.task.evaluate
        if not self.enabled or evaluate is None:
            return {}
        model.eval()
        try:
            with torch.no_grad(), self.precision.autocast():
                return {name: float(value) for name, value in evaluate(model, self.device).items()}
        finally:
            model.train()

    def check(self) -> None:
        """A user's evaluate() must return the metrics it declared: try it once, before any file exists."""
        if not self.enabled:
            return
        try:
            names = set(self())
        except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's code: any failure is bad input
            raise InputError(f"task.factory: evaluate() raised {type(err).__name__}: {err}") from None
        if not names <= set(self.task.metrics):
            raise InputError(f"task.factory: evaluate() returned {sorted(names)}, but metrics declares "
                             f"{list(self.task.metrics)}")
