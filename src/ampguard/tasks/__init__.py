"""Built-in workloads: a model, a loss and an endless, seeded stream of micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Task:
    """What ``ampguard train`` needs from a workload."""

    name: str
    model: nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batches: Callable[[torch.device], Iterator[tuple[torch.Tensor, torch.Tensor]]]
    """``batches(device)`` -> an endless, seeded iterator of (inputs, targets) micro-batches."""
    float_inputs: bool = True
    """Whether inputs are floating point (``nan_input`` can only corrupt those)."""
    description: str = ""


def build_task(config: Any, seed: int) -> Task:
    """The workload named by ``config.name`` (a ``TaskConfig``), built with ``seed``."""
    if config.name == "linear":
        from .linear import build
    elif config.name == "charlm":
        from .charlm import build
    else:  # pragma: no cover - the config only admits the names above
        raise ValueError(f"unknown task {config.name!r}")
    return build(config, seed)
