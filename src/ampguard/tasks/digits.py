"""Handwritten digits: scikit-learn's bundled 1,797 real 8x8 images, an MLP classifier.

The split is fixed (it does not move with the run's seed): 1,497 images for training, 300 held
out for the test accuracy.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import InputError
from .base import Task, batch_generator

TEST_SIZE = 300
SPLIT_SEED = 20_240_601


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): pixels scaled to [0, 1], labels 0-9, a fixed split.

    Example::

        >>> x_train, y_train, x_test, y_test = load_split()
        >>> tuple(x_train.shape), tuple(x_test.shape), float(x_train.max()), int(y_test.max())
        ((1497, 64), (300, 64), 1.0, 9)
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - scikit-learn is a dependency
        raise InputError("task digits needs scikit-learn (pip install scikit-learn)") from None
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return x[train], y[train], x[test], y[test]


def digit_batches(x: torch.Tensor, y: torch.Tensor, seed: int, batch_size: int,
                  start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled epochs of the training split (a last partial batch is dropped), from
    batch ``start`` on: epoch ``e``'s order comes from its own generator
    (:func:`~ampguard.tasks.batch_generator` of ``seed`` and ``e``), so no epoch before it is drawn.

    Example::

        >>> x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
        >>> stream = digit_batches(x, y, seed=0, batch_size=2)
        >>> epoch = [next(stream)[1].tolist() for _ in range(2)]  # 2 full batches per epoch of 5
        >>> len(set(sum(epoch, []))), all(len(b) == 2 for b in epoch)
        (4, True)
        >>> later = [b.tolist() for _, b in itertools.islice(stream, 3)]  # batches 2, 3, 4
        >>> [b.tolist() for _, b in itertools.islice(digit_batches(x, y, seed=0, batch_size=2, start=2), 3)] == later
        True
        >>> next(digit_batches(x, y, seed=0, batch_size=6))
        Traceback (most recent call last):
        ...
        ValueError: a batch of 6 examples is larger than the 5 there are
    """
    per_epoch = len(x) // batch_size
    if per_epoch == 0:  # no batch would ever come: an endless loop that yields nothing
        raise ValueError(f"a batch of {batch_size} examples is larger than the {len(x)} there are")
    first_epoch, skip = divmod(start, per_epoch)
    for epoch in itertools.count(first_epoch):
        order = torch.randperm(len(x), generator=batch_generator(seed, epoch))
        for k in range(skip, per_epoch):
            idx = order[k * batch_size : (k + 1) * batch_size]
            yield x[idx], y[idx]
        skip = 0


def build(config: Any) -> Task:
    """The ``digits`` task: an MLP (hidden width ``2 * task.n_embd``), cross-entropy, test accuracy.

    Example::

        >>> from ampguard.config import load_config
        >>> task = build(load_config(None, ["task.name=digits", "task.n_embd=8", "task.batch_size=16"]))
        >>> x, y = next(task.batches())
        >>> tuple(x.shape), y.dtype, task.metrics, task.mode
        ((16, 64), torch.int64, ('val_loss', 'val_accuracy'), 'classifier')
        >>> with torch.no_grad():  # evaluate runs under no_grad, as the trainer calls it
        ...     metrics = task.evaluate(task.model.eval(), torch.device("cpu"))
        >>> sorted(metrics), 0.0 <= metrics["val_accuracy"] <= 1.0
        (['val_accuracy', 'val_loss'], True)
    """
    x_train, y_train, x_test, y_test = load_split()
    batch_size = config.task.batch_size
    if batch_size > len(x_train):
        raise InputError(f"task.batch_size: a batch of {batch_size} images is larger than the digits training set "
                         f"({len(x_train):,} images); use at most {len(x_train)}", key="task.batch_size")
    hidden = config.task.n_embd * 2
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def evaluate(m: nn.Module, device: torch.device) -> dict[str, float]:
        logits = m(x_test.to(device)).float()
        targets = y_test.to(device)
        return {
            "val_loss": float(F.cross_entropy(logits, targets)),
            "val_accuracy": float((logits.argmax(dim=1) == targets).float().mean()),
        }

    return Task(
        name="digits",
        model=model,
        loss_fn=F.cross_entropy,
        batches=lambda: digit_batches(x_train, y_train, config.seed + 1, batch_size),
        batches_from=lambda start: digit_batches(x_train, y_train, config.seed + 1, batch_size, start),
        evaluate=evaluate,
        metrics=("val_loss", "val_accuracy"),
        held_out=lambda: (x_test, y_test),
        edge_cases=lambda: (["blank", "saturated", "inverted_mean", "overexposed_x4"],
                            torch.stack([torch.zeros(64), torch.ones(64), 1 - x_train.mean(0), x_test[0] * 4])),
        description=f"MLP (64-{hidden}-{hidden}-10) on scikit-learn's handwritten digits "
        f"({len(x_train)} train / {len(x_test)} test images)",
    )
