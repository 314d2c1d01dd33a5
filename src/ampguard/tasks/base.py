"""What a workload is (:class:`Task`) and the helpers the built-in workloads share."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Batch = tuple[Any, Any]

FIRST_BATCHES = 4
"""The batches a run's start-up reads before anything is written: a factory's data read, and put
through the model and the loss (``build.check_forward``), so that a batch among them that the
model cannot take is refused in one line rather than found mid-run."""


@dataclass
class Task:
    """What ``ampguard train`` needs from a workload.

    Example::

        >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))]
        >>> task = Task("toy", nn.Linear(2, 1), nn.functional.mse_loss, batches=lambda: cycle(lambda: data),
        ...             mode="regression")
        >>> inputs, targets = next(task.batches())
        >>> task.scores(task.model, inputs).shape == targets.shape
        True
    """

    name: str
    model: nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor]
    batches: Callable[[], Iterator[Batch]]
    """``batches()`` -> an endless iterator of (inputs, targets) micro-batches on the CPU, the
    same sequence on every call (so a resumed run can skip to where it was)."""
    evaluate: Callable[[nn.Module, torch.device], dict[str, float]] | None = None
    """``evaluate(model, device)`` -> held-out metrics (numbers: a float, an int, a one-element
    tensor); called in eval mode, under no_grad and the run's autocast, every global RNG put back
    after each call (``Evaluator``: a draw of its, a plain ``DataLoader``'s seed say, would move
    the training's dropout with ``eval.every``)."""
    metrics: tuple[str, ...] = ()
    """The names ``evaluate`` returns: extra CSV columns after the fixed eight."""
    float_inputs: bool = True
    """Whether inputs are floating point (``nan_input`` can only corrupt those)."""
    description: str = ""
    mode: str = "classifier"
    """``classifier`` (scores per class, the decision is the argmax) or ``regression``."""
    held_out: Callable[[], Batch] | None = None
    """``held_out()`` -> a fixed (inputs, targets) evaluation set as tensors (``ampguard validate``)."""
    edge_cases: Callable[[], tuple[list[str], torch.Tensor]] | None = None
    """``edge_cases()`` -> (names, inputs): unusual inputs for the probe set."""
    predict: Callable[[nn.Module, Any], torch.Tensor] | None = None
    """Scores for a batch of inputs, one row per example (default: ``model(inputs)``)."""
    flops_per_token: float | None = None
    """Model FLOPs to train on one token (forward and backward), for the MFU a run reports; None
    for a model not fed tokens, or when unknown."""
    data_id: str | None = None
    """What identifies the data when it comes from the machine rather than the package (charlm:
    the Python version whose standard library it reads, the corpus's size and hash): saved in each
    checkpoint, so that a resume on other data is refused rather than trained on unsaid."""
    batches_from: Callable[[int], Iterator[Batch]] | None = None
    """``batches_from(i)`` -> the stream of ``batches()`` from micro-batch ``i`` on, made without
    reading the ``i`` batches before it (the built-in tasks draw batch ``i`` from its index, see
    :func:`batch_generator`). Optional: without it :meth:`stream` reads and drops them."""
    release: Callable[[], None] | None = None
    """``release()`` stops what reading ``batches()`` started and a run no longer reads (a
    ``DataLoader``'s persistent workers): called once the run's loop is over. Optional."""
    side_reads: bool = True
    """Whether the stream can be read beside the run's (a checkpoint's look at the next batch,
    ``data_next``) without moving the run's: not a factory's whose ``batches_from`` may read a
    ``DataLoader`` with persistent workers, whose ``iter()`` starts the run's own iterator over
    (review 52l: each checkpoint's look moved the run a batch on)."""
    generators: tuple[torch.Generator, ...] = ()
    """The data's own generators (a factory's ``DataLoader``'s and its samplers'): a read beside
    the run's (a checkpoint's :meth:`~ampguard.data.DataStream.digest`) puts them back after it,
    as it puts back the global RNGs (review 52i: a checkpoint at a pass's end drew the next pass's
    order from the loader the run reads, which then trained on another)."""

    def stream(self, start: int = 0) -> Iterator[Batch]:
        """The micro-batches from number ``start`` on (0-based): what ``batches()`` gives after
        ``start`` batches, by :attr:`batches_from` when the task has it, else by reading and
        dropping the first ``start`` (a resume or rollback then costs ``start`` batch reads).

        Example::

            >>> task = Task("toy", nn.Linear(1, 1), nn.functional.mse_loss, batches=lambda: cycle(lambda: "abc"))
            >>> "".join(itertools.islice(task.stream(4), 4))
            'bcab'
        """
        if self.batches_from is not None:
            return self.batches_from(start)
        return itertools.islice(self.batches(), start, None) if start else self.batches()

    def scores(self, model: nn.Module, inputs: Any) -> torch.Tensor:
        """Scores for ``inputs``, one row per example: ``predict`` if given, else ``model(inputs)``.

        Example::

            >>> task = Task("toy", nn.Linear(2, 3), nn.functional.cross_entropy, batches=lambda: iter(()),
            ...             predict=lambda m, x: m(x).softmax(dim=1))
            >>> task.scores(task.model, torch.ones(5, 2)).sum(dim=1).allclose(torch.ones(5))
            True
        """
        return self.predict(model, inputs) if self.predict is not None else model(inputs)


@contextlib.contextmanager
def generators_kept(generators: Sequence[torch.Generator]) -> Iterator[None]:
    """The ``generators``' states put back as the block ends, however it ends: a read of the data
    beside the run's (the start-up's look at its first batches, a checkpoint's at the next) leaves
    the run's draws from the data's own generators where they were.

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> with generators_kept([g]):
        ...     _ = torch.rand(1, generator=g)
        >>> torch.equal(torch.rand(1, generator=g), torch.rand(1, generator=torch.Generator().manual_seed(0)))
        True
    """
    kept = [generator.get_state() for generator in generators]
    try:
        yield
    finally:
        for generator, state in zip(generators, kept):
            generator.set_state(state)


NO_EXAMPLES = ("holds no examples: its inputs' first dimension is 0 (every step on it would be skipped as a "
               "non-finite loss)")
"""What is said of a batch :func:`holds_no_examples` finds, at start-up and mid-run."""


def holds_no_examples(inputs: Any) -> bool:
    """Whether a batch's inputs hold no examples: every tensor leaf with a dimension has a first
    dimension of 0 (a step on it is a mean over nothing, NaN: skipped as a non-finite loss, every
    time). Shapes only, no host read.

    Example::

        >>> holds_no_examples(torch.empty(0, 3)), holds_no_examples({"ids": torch.ones(2, 3)}), holds_no_examples(7)
        (True, False, False)
    """
    if isinstance(inputs, torch.Tensor):  # (the common batch, each micro-batch: no tree walked)
        return inputs.dim() > 0 and inputs.shape[0] == 0
    from torch.utils._pytree import tree_leaves

    sizes = [leaf.shape[0] for leaf in tree_leaves(inputs)
             if isinstance(getattr(leaf, "shape", None), tuple) and len(leaf.shape) > 0]
    return bool(sizes) and not any(sizes)


def cycle(make_iterable: Callable[[], Any]) -> Iterator[Batch]:
    """Endless batches from a finite, re-iterable source (a list, a DataLoader): epoch after epoch.

    Example::

        >>> stream = cycle(lambda: ["a", "b"])
        >>> [next(stream) for _ in range(5)]
        ['a', 'b', 'a', 'b', 'a']
        >>> next(cycle(lambda: []))
        Traceback (most recent call last):
        ...
        ValueError: the data yielded no batches
    """
    while True:
        empty = True
        for batch in make_iterable():
            empty = False
            yield batch
        if empty:
            raise ValueError("the data yielded no batches")


_MASK64 = (1 << 64) - 1


def batch_generator(seed: int, index: int) -> torch.Generator:
    """The generator that draws micro-batch ``index`` of a stream seeded with ``seed``.

    Batch ``i`` depends on ``(seed, i)`` alone, so a stream can start at any position without
    drawing the batches before it. Torch seeds its CPU generator with 32 bits, so the seed is
    mixed into 32 bits (SplitMix64's finaliser) and ``index`` added to it: within one stream no
    two batches (below 2**32 of them) share a generator.

    Example::

        >>> a = torch.rand(3, generator=batch_generator(7, 5))
        >>> torch.equal(a, torch.rand(3, generator=batch_generator(7, 5)))  # batch 5 of seed 7, every time
        True
        >>> torch.equal(a, torch.rand(3, generator=batch_generator(7, 6)))  # batch 6 is another
        False
    """
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    base = (z ^ (z >> 31)) & 0xFFFFFFFF
    return torch.Generator().manual_seed((base + index) % 2**32)


@torch.no_grad()
def mean_loss(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], batches: list[Batch],
              device: torch.device) -> float:
    """The mean of ``loss_fn`` over fixed held-out batches (a Python float: costs a host sync).

    Example::

        >>> model = nn.Linear(1, 1)
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0), model.bias.zero_()
        >>> batches = [(torch.ones(2, 1), torch.zeros(2, 1)), (torch.ones(2, 1), torch.ones(2, 1))]
        >>> mean_loss(model, nn.functional.mse_loss, batches, torch.device("cpu"))  # (1 + 0) / 2
        0.5
    """
    total = torch.zeros((), device=device)
    for inputs, targets in batches:
        total += loss_fn(model(inputs.to(device)), targets.to(device)).float()
    return float(total / len(batches))
