"""Linear regression, the demo's workload: ``nn.Linear`` fit to a noisy linear target."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .base import Task, batch_generator, mean_loss

IN_FEATURES = 16
OUT_FEATURES = 4


def linear_batches(
    seed: int, batch_size: int, sample_seed: int | None = None, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of ``x ~ N(0, 1)``, ``y = x @ W + b + 0.01 * noise``; (W, b) fixed by
    ``seed``, batch ``i`` drawn from its own generator (:func:`~ampguard.tasks.batch_generator`
    of ``sample_seed``, default ``seed``, and ``i``), from batch ``start`` on.

    Example::

        >>> x, y = next(linear_batches(seed=0, batch_size=3))
        >>> tuple(x.shape), tuple(y.shape)
        ((3, 16), (3, 4))
        >>> torch.equal(y, next(linear_batches(seed=0, batch_size=3))[1])  # the same stream every time
        True
        >>> stream = linear_batches(seed=0, batch_size=3)
        >>> _ = next(stream); torch.equal(next(stream)[0], next(linear_batches(seed=0, batch_size=3, start=1))[0])
        True
    """
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen) / IN_FEATURES**0.5
    bias = torch.randn(OUT_FEATURES, generator=gen) * 0.1
    sample_seed = seed if sample_seed is None else sample_seed
    for index in itertools.count(start):
        gen = batch_generator(sample_seed, index)
        x = torch.randn(batch_size, IN_FEATURES, generator=gen)
        y = x @ weight + bias + 0.01 * torch.randn(batch_size, OUT_FEATURES, generator=gen)
        yield x, y


def build(config: Any) -> Task:
    """The ``linear`` task: ``nn.Linear(16, 4)``, MSE loss, a held-out ``val_loss``.

    Example::

        >>> from ampguard.config import load_config
        >>> task = build(load_config(None, ["task.name=linear", "task.batch_size=8"]))
        >>> names, inputs = task.edge_cases()
        >>> task.model, names, tuple(task.held_out()[0].shape)
        (Linear(in_features=16, out_features=4, bias=True), ['zeros', 'large', 'large_negative'], (512, 16))
        >>> list(task.evaluate(task.model, torch.device("cpu")))
        ['val_loss']
    """
    seed, batch_size = config.seed, config.task.batch_size
    torch.manual_seed(seed)
    model = nn.Linear(IN_FEATURES, OUT_FEATURES)
    # held out: the same target (same W, b), samples from a generator of their own
    held_out_stream = linear_batches(seed + 1, 256, sample_seed=seed + 1_000_003)
    held_out = [next(held_out_stream) for _ in range(2)]
    return Task(
        name="linear",
        model=model,
        loss_fn=nn.functional.mse_loss,
        batches=lambda: linear_batches(seed + 1, batch_size),
        batches_from=lambda start: linear_batches(seed + 1, batch_size, start=start),
        evaluate=lambda m, device: {"val_loss": mean_loss(m, nn.functional.mse_loss, held_out, device)},
        metrics=("val_loss",),
        description=f"nn.Linear({IN_FEATURES}, {OUT_FEATURES}) on a noisy linear target",
        mode="regression",
        held_out=lambda: (torch.cat([x for x, _ in held_out]), torch.cat([y for _, y in held_out])),
        edge_cases=lambda: (["zeros", "large", "large_negative"],
                            torch.stack([torch.zeros(IN_FEATURES), torch.full((IN_FEATURES,), 100.0),
                                         torch.full((IN_FEATURES,), -100.0)])),
    )
