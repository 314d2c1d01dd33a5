"""Workloads: a model, a loss, an endless reproducible stream of micro-batches, and an evaluation.

Built in: ``charlm`` (a character-level transformer on Python's standard library), ``digits``
(scikit-learn's 1,797 handwritten digits) and ``linear`` (the demo's regression). Or bring your
own with ``task.factory`` (see :mod:`ampguard.tasks.factory`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import AmpguardWarning, InputError, first_line, warn
from .base import Batch, Task, batch_generator, cycle, mean_loss

__all__ = ["Batch", "Task", "batch_generator", "build_task", "cycle", "mean_loss", "seed_everything",
           "untrained_model"]


def untrained_model(config: Any) -> str:
    """The model :func:`build_task` builds for ``config``, in words: what a diagnosis given no
    checkpoint ran (``validate``'s reference, ``locate``'s replay), for its warning.

    Example::

        >>> from ampguard.config import load_config
        >>> untrained_model(load_config(None, ["task.name=linear"]))
        'task linear freshly initialised (untrained weights)'
    """
    if config.task.factory:
        return f"the model task factory {config.task.factory} returns (untrained unless the factory loads weights)"
    return f"task {config.task.name} freshly initialised (untrained weights)"


def build_task(config: Any) -> Task:
    """The workload a :class:`~ampguard.config.Config` names (``task.factory`` wins over ``task.name``),
    built after every global RNG (torch, Python's ``random``, NumPy's) is seeded with ``seed``, so
    a factory that draws from any of them builds the same model and data every time.

    Example::

        >>> from ampguard.config import load_config
        >>> task = build_task(load_config(None, ["task.name=linear", "task.batch_size=4"]))
        >>> x, y = next(task.batches())
        >>> task.name, task.mode, tuple(x.shape), tuple(y.shape), task.metrics
        ('linear', 'regression', (4, 16), (4, 4), ('val_loss',))
    """
    seed_everything(config.seed)
    if config.task.factory:
        from .factory import build_from_factory

        return build_from_factory(config)
    unread = config.task.unread()
    if unread:  # (a config shared with another task: said, not refused)
        warn(f"task {config.task.name} does not read task.{', task.'.join(unread)}: ignored"
             + (" (task.options are a task.factory's)" if "options" in unread else ""), AmpguardWarning,
             stacklevel=2)
    if config.task.name == "linear":
        from .linear import build
    elif config.task.name == "charlm":
        from .charlm import build
    elif config.task.name == "digits":
        from .digits import build
    else:  # pragma: no cover - the config only admits the names above
        raise ValueError(f"unknown task {config.task.name!r}")
    name = config.task.name
    try:
        task = build(config)
    except (RuntimeError, MemoryError) as err:  # (sizes the config takes, up to MAX_COUNT, a model may not fit)
        if not (out_of_memory(err) and MODEL_SIZES[name]):  # (linear's model has one size: the machine is full)
            raise
        raise InputError(f"task {name}: its model does not fit in memory at these sizes ({_asked(err)}); "
                         f"give smaller {_either(MODEL_SIZES[name])}", key="task") from None
    task.batches = _sized(task.batches, name)  # (a batch too large for memory: named as the model is)
    if task.batches_from is not None:
        task.batches_from = _sized(task.batches_from, name)
    return task


def eval_unread(config: Any, task: Task) -> str | None:
    """The line a training run says of the ``eval`` settings given that ``task`` does not read, or
    None (review 52h: ignored unsaid, though the README says a setting given and not read is said):
    ``eval.batches`` is charlm's held-out batch count; ``eval.every`` is read only by a task with
    an ``evaluate``. Not with ``eval.enabled`` false (:func:`~ampguard.config.ignored_settings`
    says them then: review 52i, said twice).

    Example::

        >>> from ampguard.config import load_config
        >>> config = load_config(None, ["task.name=linear", "eval.batches=3"])
        >>> eval_unread(config, build_task(config))
        "task linear does not read eval.batches (charlm's number of held-out batches): ignored"
    """
    from ..config import given_keys

    given = given_keys(config)
    unread = [key for key in ("eval.every", "eval.batches") if config.eval.enabled and key in given and (
        key == "eval.batches" and task.name != "charlm" or key == "eval.every" and task.evaluate is None)]
    why = {"eval.batches": "eval.batches (charlm's number of held-out batches)",
           "eval.every": "eval.every (it has no held-out evaluation: no evaluate)"}
    return f"task {task.name} does not read {', '.join(why[key] for key in unread)}: ignored" if unread else None


MODEL_SIZES: dict[str, tuple[str, ...]] = {"charlm": ("task.n_embd", "task.n_layer", "task.block_size"),
                                           "digits": ("task.n_embd",), "linear": ()}
"""The settings that size each built-in task's model (what its ``build`` allocates): what a model
that does not fit in memory is told to make smaller (linear's has one size)."""
BATCH_SIZES: dict[str, tuple[str, ...]] = {"charlm": ("task.batch_size", "task.block_size"),
                                           "digits": ("task.batch_size",), "linear": ("task.batch_size",)}
"""The settings that size each built-in task's micro-batch."""


def _either(keys: tuple[str, ...]) -> str:
    """``a``, ``a or b``, ``a, b or c``: the settings a refusal asks to make smaller.

    Example::

        >>> _either(("task.n_embd",)), _either(MODEL_SIZES["charlm"])
        ('task.n_embd', 'task.n_embd, task.n_layer or task.block_size')
    """
    return keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} or {keys[-1]}"


def _asked(err: BaseException) -> str:
    """What an allocation that failed asked for, in words: ``one tensor of 7.5 GiB`` from the CPU
    allocator's words (a GPU's say more: its first line).

    Example::

        >>> _asked(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8053063680 bytes"))
        'one tensor of 7.5 GiB'
    """
    asked = re.search(r"allocate (\d+) bytes", str(err))
    return f"one tensor of {int(asked[1]) / 2**30:.1f} GiB" if asked else first_line(err, with_type=True)


def _sized(make: Callable[..., Iterator[Batch]], name: str) -> Callable[..., Iterator[Batch]]:
    """A built-in task's ``batches`` (or ``batches_from``) whose stream, when a micro-batch does not
    fit in memory (``task.batch_size`` up to 10**9 is a valid count), is refused in one line that
    names the settings sizing it, as a model too large is, not the allocator's own words.

    Example::

        >>> def batches():
        ...     yield 1
        ...     raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 2147483648 bytes")
        >>> stream = _sized(batches, "charlm")()
        >>> next(stream)
        1
        >>> next(stream)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task charlm: its batches do not fit in memory at these sizes (one tensor of 2.0 GiB); give smaller task.batch_size or task.block_size
    """

    def stream(*args: Any) -> Iterator[Batch]:
        try:
            yield from make(*args)
        except (RuntimeError, MemoryError) as err:
            if not out_of_memory(err):
                raise
            raise InputError(f"task {name}: its batches do not fit in memory at these sizes ({_asked(err)}); "
                             f"give smaller {_either(BATCH_SIZES[name])}", key="task.batch_size") from None

    return stream


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed: a ``MemoryError``, torch's ``OutOfMemoryError``
    (a GPU's), or the CPU allocator's ``RuntimeError`` ("can't allocate memory").

    Example::

        >>> out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
        True
        >>> out_of_memory(RuntimeError("size mismatch"))
        False
    """
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(err, (MemoryError, oom)) or "can't allocate memory" in str(err)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), Python's ``random`` and NumPy's global RNG with ``seed``.

    Example::

        >>> import random
        >>> seed_everything(3); a = (random.random(), torch.rand(1).item())
        >>> seed_everything(3); a == (random.random(), torch.rand(1).item())
        True
    """
    import random

    import numpy as np

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
