"""Linear regression, the demo's workload: ``nn.Linear`` fit to a noisy linear target."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import Task

IN_FEATURES = 16
OUT_FEATURES = 4


def linear_batches(
    seed: int, batch_size: int, device: torch.device | str = "cpu"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of ``x ~ N(0, 1)``, ``y = x @ W + b + 0.01 * noise`` with a fixed true (W, b)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen) / IN_FEATURES**0.5
    bias = torch.randn(OUT_FEATURES, generator=gen) * 0.1
    while True:
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        y = x @ weight + bias + 0.01 * torch.randn(batch_size, OUT_FEATURES, generator=gen)
        yield x.to(device), y.to(device)


def build(config: Any, seed: int) -> Task:
    torch.manual_seed(seed)
    model = nn.Linear(IN_FEATURES, OUT_FEATURES)
    return Task(
        name="linear",
        model=model,
        loss_fn=nn.functional.mse_loss,
        batches=lambda device: linear_batches(seed + 1, config.batch_size, device),
        description=f"nn.Linear({IN_FEATURES}, {OUT_FEATURES}) on a noisy linear target",
    )
