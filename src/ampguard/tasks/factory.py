"""Bring your own model: ``task.factory: "package.module:build"`` or ``"path/to/file.py:build"``.

``build(config)`` receives the run's :class:`~ampguard.config.Config` (``config.task.options``
holds free-form settings for it) and returns a mapping::

    {"model": nn.Module,                         # required
     "data": iterable of (inputs, targets),      # required: a list, a DataLoader, or a function
                                                 #   returning a fresh iterable; re-read every epoch
     "loss_fn": callable(outputs, targets),      # required
     "evaluate": callable(model, device) -> {name: float},   # optional held-out metrics
     "metrics": ("val_loss", ...),               # the names evaluate returns
     "batches_from": callable(start) -> iterable,  # optional: data's stream from micro-batch
                                                 #   `start` on (0-based, across epochs), made
                                                 #   without reading the batches before it
     # for `ampguard validate` (all optional):
     "held_out": (inputs, targets),              # fixed evaluation set (default: the first batches,
                                                 #   which validate reports as training data)
     "edge_cases": (["name", ...], inputs),      # unusual inputs for the probe set
     "mode": "classifier" | "regression",        # default: from the targets' dtype
     "predict": callable(model, inputs) -> scores}  # default: model(inputs)

or the tuple ``(model, data, loss_fn)``. For a resumed run to be bit-for-bit the uninterrupted
one, ``data`` must yield the same sequence each time it is iterated (give a shuffling
DataLoader its own seeded ``generator``). A resume, a rollback and ``locate --step`` read that
stream up to their position; ``batches_from`` lets them start there (large data: no hour of
batches decoded to be dropped), checked against ``data`` on its first batches. Under torchrun
``data`` is the global stream, the same on every rank (no ``DistributedSampler``): each rank
takes its slice of each batch, and ranks whose first batches differ are refused. ``evaluate``
may score the whole held-out set or this rank's share: the run logs and judges the mean over ranks.
"""

from __future__ import annotations

import copy
import difflib
import functools
import gc
import importlib
import importlib.util
import itertools
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, IterableDataset

from ..checkpoint import rng_state, set_rng_state
from ..errors import InputError, RankWarning, user_code, warn
from ..faults import has_floating_input
from ..records import LABEL_COLUMNS
from ..sinks import CSV_COLUMNS, check_column_names
from ..untouched import rng_kept
from .base import FIRST_BATCHES, NO_EXAMPLES, Task, cycle, generators_kept, holds_no_examples


def factory_file(target: str) -> bool:
    """Whether a factory's ``target`` (before ``:function``) names a file, not a module.

    Example::

        >>> factory_file("my_model.py"), factory_file("models/net"), factory_file("ampguard.tasks.linear")
        (True, True, False)
    """
    return target.endswith(".py") or "/" in target


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``module:function`` or ``file.py:function``.

    Example::

        >>> from ampguard.tasks.linear import linear_batches
        >>> load_factory("ampguard.tasks.linear:linear_batches") is linear_batches
        True
        >>> load_factory("ampguard.tasks.linear:no_such_function")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory: ampguard.tasks.linear has no function 'no_such_function'
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise InputError(f"task.factory: expected 'package.module:function' or 'path/file.py:function', got {spec!r}")
    with user_code(f"task.factory: importing {target} failed: "):
        if factory_file(target):
            path = Path(target)
            if not path.is_file() and path.exists():  # (a folder, a FIFO, /dev/null: not a missing file)
                raise InputError(f"task.factory: {path} is {'a folder' if path.is_dir() else 'not a regular file'}; "
                                 f"give a Python file's path: --set task.factory=PATH:{attr}")
            if not path.is_file():
                where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
                raise InputError(f"task.factory: no such file {path}{where}; run from the folder the path "
                                 f"is relative to, or give the file's path here: --set task.factory=PATH:{attr}")
            name = f"_ampguard_factory_{abs(hash(str(path.resolve())))}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            _importable(str(path.resolve().parent))  # its own folder, as `python file.py` has: `from common import ...`
            module_spec.loader.exec_module(module)
        else:
            try:
                module = importlib.import_module(target)
            except ModuleNotFoundError as err:  # from the folder the command runs in, as `python -m` finds it
                if err.name != target.partition(".")[0] or os.getcwd() in sys.path:  # (the `ampguard` script
                    raise                                                           # has no such entry)
                _importable(os.getcwd())
                module = importlib.import_module(target)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InputError(f"task.factory: {target} has no function {attr!r}")
    return fn


def _importable(folder: str) -> None:
    """Put ``folder`` on the import path (once, at its front) for a factory's imports."""
    if folder not in sys.path:
        sys.path.insert(0, folder)


def check_metrics(metrics: Any, spec: str) -> tuple[str, ...]:
    """A factory's ``metrics`` as a tuple of names, or one :class:`~ampguard.errors.InputError`
    line naming the first that cannot be a CSV column of its own: empty, named twice, or one of
    the fixed columns (``sinks.CSV_COLUMNS``, ``records.LABEL_COLUMNS``). A metric called
    ``loss`` would be a second ``loss`` column, read back as the training loss.

    Example::

        >>> check_metrics(("val_loss", "val_accuracy"), "f.py:build")
        ('val_loss', 'val_accuracy')
        >>> check_metrics(("val_loss", "loss"), "f.py:build")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory f.py:build: metric 'loss' is one of the CSV's fixed columns (step, ...); name it otherwise
    """
    if not isinstance(metrics, Iterable):
        raise InputError(f"task.factory {spec}: metrics must be a sequence of names, not a {type(metrics).__name__}")
    # (loss_on: a record's key in the JSON lines, refused there mid-run: review 52i)
    return check_column_names(metrics, f"task.factory {spec}: metric", CSV_COLUMNS + LABEL_COLUMNS + ("loss_on",))


class TrainingBatches:
    """The evaluation set of a factory that returns no ``held_out``: its first ``batches`` training
    batches, concatenated, as the task's ``held_out()``. Marked as such so that ``ampguard
    validate`` says so (its quality and typical probes are then measured on data the model trains
    on) instead of reporting them as held-out examples. ``read`` gives them when asked (a factory
    reads its data's start again): only ``validate`` asks, and a run held four batches, joined,
    for nothing (review 50a: +390 MiB of host memory for batches of 100 MB).

    Example::

        >>> first = TrainingBatches(lambda: (torch.ones(6, 2), torch.zeros(6)), batches=3)
        >>> tuple(first()[0].shape), first.batches
        ((6, 2), 3)
    """

    def __init__(self, read: Callable[[], tuple[torch.Tensor, torch.Tensor]], batches: int) -> None:
        self.read, self.batches = read, batches

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read()


FACTORY_KEYS = ("model", "data", "loss_fn", "metrics", "evaluate", "held_out", "mode", "edge_cases", "predict",
                "batches_from")
"""The keys a factory's mapping may hold (README, "Bring your own model")."""


def _check_model_and_loss(model: Any, loss_fn: Any, spec: str) -> None:
    """One :class:`InputError` line for a factory's model that is no ``nn.Module``, or holds a
    parameter not made yet, and a loss that cannot be called."""
    if not isinstance(model, nn.Module):
        raise InputError(f"task.factory {spec}: model is a {type(model).__name__}, not an nn.Module")
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:  # (a traceback "Cannot copy out of meta tensor" at the first move otherwise)
        raise InputError(f"task.factory {spec}: the model's parameter {meta} is on the meta device (not made yet): "
                         "materialise it (to_empty(), then load or initialise the weights) before returning it")
    if not callable(loss_fn):
        raise InputError(f"task.factory {spec}: loss_fn is not callable")


def build_from_factory(config: Any) -> Task:
    r"""The :class:`Task` that ``config.task.factory`` builds, its result checked (bad ones raise
    :class:`~ampguard.errors.InputError` in one line). The checks read the data's first batches,
    twice; they leave the global RNGs (torch, CUDA, NumPy, ``random``) as ``build()`` left them,
    so that the run's first read of the data draws what a plain loop's does.

    Example::

        >>> import tempfile
        >>> from ampguard.config import load_config
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = Path(tmp.name) / "toy.py"
        >>> _ = path.write_text(
        ...     "import torch\n"
        ...     "def build(config):\n"
        ...     "    data = [(torch.ones(4, 2), torch.zeros(4, 1))]\n"
        ...     "    return torch.nn.Linear(2, 1), data, torch.nn.functional.mse_loss\n")
        >>> task = build_from_factory(load_config(None, [f"task.factory={path}:build"]))
        >>> task.name, task.mode, task.float_inputs, tuple(task.held_out()[0].shape)
        ('factory', 'regression', True, (4, 2))
        >>> tmp.cleanup()
    """
    spec = config.task.factory
    fn = load_factory(spec)
    folder = os.getcwd()
    with user_code(f"task.factory {spec} raised "):
        made = fn(copy.deepcopy(config))  # (a copy: a build() that set log.name or steps ran unchecked)
    if os.getcwd() != folder:  # (the run folder, and every relative path of the command, are read from there)
        moved = os.getcwd()
        os.chdir(folder)
        warn(f"task.factory {spec}: build() changed the working folder to {moved}; set back to {folder}, "
             "where the command runs and its run folder goes (open your files by absolute paths, e.g. "
             "Path(__file__).parent / 'data')", RankWarning, stacklevel=2)
    if isinstance(made, Task):
        _check_model_and_loss(made.model, made.loss_fn, spec)
        check_metrics(made.metrics, spec)
        return made
    if isinstance(made, tuple) and len(made) == 3:
        made = dict(zip(("model", "data", "loss_fn"), made))
    if not isinstance(made, Mapping) or not {"model", "data", "loss_fn"} <= set(made):
        raise InputError(f"task.factory {spec} must return a mapping with model, data and loss_fn (or that tuple)")
    unknown = [key for key in made if key not in FACTORY_KEYS]
    if unknown:  # (a misspelt "evalute" trained with no evaluation, unsaid)
        close = difflib.get_close_matches(str(unknown[0]), FACTORY_KEYS, n=1)
        raise InputError(f"task.factory {spec} returned the unknown key {unknown[0]!r}"
                         + (f" (did you mean {close[0]}?)" if close else "") + f"; it takes {', '.join(FACTORY_KEYS)}")
    model, data, loss_fn = made["model"], made["data"], made["loss_fn"]
    _check_model_and_loss(model, loss_fn, spec)
    # Every read of the data below draws as the run's own would (a DataLoader's iter() its workers'
    # base seed from the global RNG, a shuffle its order, an augmentation its noise): the global
    # RNGs are put back once they are done, so the run's first read draws where a plain loop's does
    # (review 39e: a DataLoader without a generator, and dropout, trained on other masks)
    with rng_kept():
        return _task_from(made, model, data, loss_fn, spec)


def _task_from(made: Mapping[str, Any], model: nn.Module, data: Any, loss_fn: Any, spec: str) -> Task:
    """:func:`build_from_factory`'s checks of a factory's mapping, its data read, and its Task."""
    # A shuffling DataLoader's generators (its own, and a sampler's of the user's) advance as it is
    # read (an iterator's seed, then the sampler's order): their states as the factory left them,
    # before anything here reads them, are where every stream starts (resume, rollback: the same
    # sequence); within a stream they advance, so each epoch is shuffled anew, as in a plain loop.
    # So do the generators of a DataLoader behind a wrapper or a function (review 40c: a plain loop
    # over the wrapper read the loader's first shuffle; the run, after the start-up's reads, its
    # fourth), and its persistent workers are restarted at each read from the start as a bare one's.
    samplers = (_looked_up(data, "sampler"), _looked_up(_looked_up(data, "batch_sampler"), "sampler"))
    generators, loaders = _reached(data)
    generators = list({id(g): g for g in [*(_looked_up(x, "generator") for x in (data, *samplers)), *generators]
                       if isinstance(g, torch.Generator)}.values())
    start_states = [g.get_state() for g in generators]
    global_sampler = any(s is not None and _looked_up(s, "generator", _UNKNOWN) is None for s in samplers)
    if global_sampler:  # (random ones have one)
        warn(f"task.factory {spec}: the DataLoader's sampler draws from the global RNG: a resume, a rollback "
             "or locate's replay of a step reads another order than the run did; give it its own seeded "
             "generator (DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(config.seed)), "
             "or the sampler's generator=)",
             RankWarning, stacklevel=3)
    if callable(data) and not isinstance(data, Iterable):
        make_iterable = data
    elif isinstance(data, DataLoader) or isinstance(data, Iterable) and iter(data) is not data:
        make_iterable = lambda: data  # noqa: E731 - re-iterable: a list, a DataLoader (whose iter() starts
        # its workers: not called for this)
    else:
        raise InputError(f"task.factory {spec}: data must be re-iterable (a list, a DataLoader) or a function "
                         "returning an iterable, not a one-shot iterator")
    metrics = made.get("metrics")
    metrics = check_metrics(() if metrics is None else (metrics,) if isinstance(metrics, str) else metrics, spec)
    evaluate = made.get("evaluate")
    if evaluate is not None and not metrics:
        raise InputError(f"task.factory {spec}: evaluate is given, so metrics must name what it returns")
    if metrics and evaluate is None:  # (its columns would stay empty, unsaid)
        raise InputError(f"task.factory {spec}: metrics {list(metrics)} is given but no evaluate returns them: "
                         "add evaluate(model, device) -> {name: value}, or drop metrics")
    for key in ("evaluate", "predict"):
        if made.get(key) is not None and not callable(made[key]):
            raise InputError(f"task.factory {spec}: {key} must be a function, got a {type(made[key]).__name__}")
    def rewind() -> None:  # (the data's generators where every stream starts: batches_from's too)
        for generator, state in zip(generators, start_states):
            generator.set_state(state)

    def restart() -> Any:
        rewind()
        iterable = make_iterable()
        for loader in [iterable, *(x for x in loaders if x is not iterable)]:
            _fresh_workers(loader, spec)
        return iterable

    def release() -> None:  # (the run read its last batch: the workers end now, not at a garbage collection)
        for loader in [data, *loaders]:
            _fresh_workers(loader, spec, say=False)

    def stream() -> Iterator[Any]:  # (the generator set once, at the stream's start, not at each epoch's)
        first = restart()
        return itertools.chain(first, cycle(make_iterable))

    seek = made.get("batches_from")
    if seek is not None and not callable(seek):
        raise InputError(f"task.factory {spec}: batches_from must be a function: batches_from(start) -> the batches "
                         f"of data from micro-batch start on, got a {type(seek).__name__}")
    drawn_from = rng_state()  # (data may draw from the global RNGs: the second read below draws the same)
    with user_code(f"task.factory {spec}: reading the data failed: "):
        reader = iter(restart())
        first_batches = list(itertools.islice(reader, 1))
        after_first = rng_state()  # (where a resume at position 1 would put the RNGs: _check_resumes_in_a_pass)
        first_batches += itertools.islice(reader, FIRST_BATCHES - 1)
    held = _held_iterators(reader)  # (what the read drew from: a second read that shares it is a one-shot)
    del reader  # (a DataLoader's workers: not kept through the second read)
    if not first_batches:
        raise InputError(f"task.factory {spec}: data yielded no batches")
    if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in first_batches):
        raise InputError(f"task.factory {spec}: data must yield (inputs, targets) pairs")
    _check_first_batches(first_batches, spec)
    again = _check_read_again(restart, first_batches[0], drawn_from, spec, held)
    if again and not global_sampler and seek is None and len(first_batches) > 1:  # (said already otherwise)
        _check_resumes_in_a_pass(restart, first_batches[1], after_first, spec)
    if seek is not None:
        _check_seek(seek, first_batches, spec, rewind)
        restart()  # (a batches_from that reads data's DataLoader drew from its generators: back to the start)
    inputs, targets = first_batches[0]
    held_out = made.get("held_out")
    if held_out is None and all(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() and y.dim()
                                for x, y in first_batches):  # (a 0-dim one joins nothing: review 50a, a traceback)
        xs, ys = [x for x, _ in first_batches], [y for _, y in first_batches]
        if len({x.shape[1:] for x in xs}) == 1 and len({y.shape[1:] for y in ys}) == 1:  # (batches of one shape;
            # else none: validate asks for held_out, sequences of any length)
            held_out = TrainingBatches(functools.partial(_first_batches_joined, stream, generators, len(xs)), len(xs))
    mode = made.get("mode") or ("classifier" if isinstance(targets, torch.Tensor)
                                and not targets.is_floating_point() else "regression")
    if mode not in ("classifier", "regression"):
        raise InputError(f"task.factory {spec}: mode must be 'classifier' or 'regression', got {mode!r}")
    edge = made.get("edge_cases")
    return Task(
        name="factory",
        model=model,
        loss_fn=loss_fn,
        batches=stream,
        evaluate=evaluate,
        metrics=metrics,
        float_inputs=has_floating_input(inputs),
        description=f"user model from {spec} ({type(model).__name__})",
        mode=mode,
        held_out=held_out if isinstance(held_out, TrainingBatches) else lambda: held_out,
        edge_cases=(lambda: edge) if edge is not None else None,
        predict=made.get("predict"),
        batches_from=None if seek is None else functools.partial(_seeked, seek, spec, rewind),
        release=release,
        generators=tuple(generators),
        side_reads=seek is None or not any(
            loader.persistent_workers and loader.num_workers > 0 for loader in [*loaders, *_reached(seek)[1]]),
    )


def _first_batches_joined(stream: Callable[[], Iterator[Any]], generators: list[torch.Generator], count: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` batches of the data read again from its start, inputs and targets each
    joined (:class:`TrainingBatches`), the global RNGs and the data's generators left as they were.

    Example::

        >>> data = [(torch.ones(2, 3), torch.zeros(2)), (torch.ones(1, 3), torch.ones(1))]
        >>> x, y = _first_batches_joined(lambda: iter(data), [], 2)
        >>> tuple(x.shape), y.tolist()
        ((3, 3), [0.0, 0.0, 1.0])
    """
    with generators_kept(generators), rng_kept():
        pairs = list(itertools.islice(stream(), count))
    return torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])


def _check_first_batches(batches: list[Any], spec: str) -> None:
    """The first batches read at start-up hold values (no tensor on the meta device: shapes only,
    a traceback at the first comparison or move) and examples (inputs whose first dimension is 0
    are a step that skips, ``non_finite_loss``, every time): else one :class:`InputError` line
    naming the batch.

    Example::

        >>> _check_first_batches([(torch.ones(2, 3), torch.zeros(2, 1))], "f.py:build")
        >>> _check_first_batches([(torch.ones(2, 3), torch.zeros(2, 1)), (torch.empty(0, 3), torch.empty(0, 1))],
        ...                      "f.py:build")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory f.py:build: data's batch 1 (counted from 0) holds no examples: its inputs' first dimension is 0 ...
    """
    for index, (inputs, targets) in enumerate(batches):
        leaves = [leaf for leaf in tree_leaves((inputs, targets)) if isinstance(leaf, torch.Tensor)]
        if any(leaf.is_meta for leaf in leaves):
            raise InputError(f"task.factory {spec}: data's batch {index} (counted from 0) holds a tensor on the meta "
                             "device (a shape without values): make the data's tensors on the CPU, with their values")
        if holds_no_examples(inputs):
            raise InputError(f"task.factory {spec}: data's batch {index} (counted from 0) {NO_EXAMPLES}")


def _check_read_again(restart: Callable[[], Any], first: Any, drawn_from: dict[str, Any], spec: str,
                      held: Mapping[int, Any] | None = None) -> bool:
    """``data`` read again from its start (every epoch, a resume and a rollback do) must give its
    first batch again: none is a one-shot iterable (an ``IterableDataset`` whose ``__iter__``
    returns itself: the run stopped at its fourth step, "bad data"), refused; another batch from
    reads that share one iterator (:func:`_one_shot`; or the second read's iterator draws from
    one that ``held``, the first read's :func:`_held_iterators`, holds too: an ``__iter__`` that
    is a generator over one stored iterator, review 39e. A one-shot whose first pass is longer
    goes on where the first read stopped, but an iterable that starts over and returns itself
    does too) is warned as a likely one-shot; another batch
    otherwise is data that changes from pass to pass (a generator of its own that
    :func:`_reached` does not find, not set back), which trains on other batches than a plain
    loop (the start-up's reads drew from it first) and resumes on others again: warned. Read from the RNG state the
    first read began at, and the RNGs left as the first read left them. Whether the first batch came again."""
    one_shot = False
    with rng_kept(), user_code(f"task.factory {spec}: reading the data again failed: "):
        set_rng_state(drawn_from)
        reader = iter(restart())
        again = next(reader, None)
        if again is not None and not _same_batch(again, first):
            one_shot = bool(held and held.keys() & _held_iterators(reader).keys()) or _one_shot(restart)
        del reader
    if again is None:
        raise InputError(f"task.factory {spec}: data yielded no batch when read a second time (a one-shot iterable?): "
                         "every epoch, a resume and a rollback read it again from its start; give a list, a DataLoader "
                         "over a map-style dataset, or a function returning a fresh iterable")
    if one_shot:  # (warned, not refused: an iterable whose __iter__ starts over and returns itself, reshuffled, is
        # one shared iterator too, and trains: review 38i; whether it starts over no read can tell)
        warn(f"task.factory {spec}: data read again from its start gave another first batch, and every read "
             "shares one iterator (a one-shot iterable?): if it does not start over when read again, the run "
             "stops at the end of its first pass, and a resume or a rollback reads other batches; give a "
             "list, a DataLoader over a map-style dataset, a dataset whose __iter__ is a generator (yield) "
             "that reads its source from the start, or a function returning a fresh iterable", RankWarning,
             stacklevel=4)
    elif not _same_batch(again, first):
        warn(f"task.factory {spec}: data read again from its start gave another first batch: a resume, a "
             "rollback or locate's replay reads other batches than the run did, and the run, after the "
             "start-up's reads, other batches than a plain loop: something it draws from goes on from read "
             "to read (a generator of its own, a NumPy one, a dataset's; the torch generators of its "
             "DataLoaders and their samplers are set back); re-seed it at the start of each read (in "
             "__iter__, or in the function data is), or draw from a generator the DataLoader holds "
             "(generator=)", RankWarning, stacklevel=4)
    return _same_batch(again, first)


def _check_resumes_in_a_pass(restart: Callable[[], Any], second: Any, after_first: dict[str, Any], spec: str) -> None:
    """``data`` read as a resume at position 1 reads it (from its start, the batch before the
    position dropped with the RNGs kept, from the RNG state the run had there: ``after_first``)
    must give the run's second batch, ``second``; another one is data that draws from the global
    RNGs as a pass begins (a shuffle with ``torch.randperm`` or ``np.random.permutation``, a
    ``DataLoader(shuffle=True)`` without a generator of its own, its workers' seeds): the
    resume draws that pass's order from its checkpoint's state, not the one the pass began at,
    and trains on other batches than the run did (review 52h: unsaid). Warned, not refused: the
    run trains, and a resume at a pass's start is exact. A random augmentation drawn per batch
    resumes exactly and passes. The RNGs are left as they were."""
    with rng_kept(), user_code(f"task.factory {spec}: reading the data again failed: "):
        set_rng_state(after_first)
        with rng_kept():  # (opened inside, as a resume opens it: a DataLoader's iter() draws its seed;
            reader = iter(restart())  # review 52i: opened before, it moved the draws of a per-batch augmentation)
            next(reader, None)
        again = next(reader, None)
        del reader
    if again is not None and not _same_batch(again, second):
        warn(f"task.factory {spec}: data draws from the global RNG as a pass begins (a shuffle without a "
             "generator of its own: torch.randperm, a DataLoader(shuffle=True) without generator=, "
             "np.random.permutation): a resume, a rollback or locate's replay inside a pass reads that pass "
             "in another order than the run did (a pass's order is drawn again from the RNG state at the "
             "position, not the one the pass began at); give the shuffle a generator of its own, held by the "
             "DataLoader (generator=torch.Generator().manual_seed(0)) or re-seeded at the start of each "
             "pass", RankWarning, stacklevel=4)


def _one_shot(restart: Callable[[], Any]) -> bool:
    """Whether two reads of the data share one iterator, so that a second read goes on where
    the first stopped: a one-shot iterable (an ``IterableDataset`` whose ``__iter__`` returns a
    stored iterator, or itself). Two fresh reads' iterators are compared, nothing read from
    them; a ``DataLoader`` by what it iterates (its iterable-style dataset, else its samplers:
    its own iterator, with persistent workers, is one object reset at every ``iter``), and no
    worker started.

    Example::

        >>> class Stored:
        ...     def __init__(self): self.it = iter(range(8))
        ...     def __iter__(self): return self.it
        >>> stored, fresh = Stored(), [1, 2]
        >>> _one_shot(lambda: stored), _one_shot(lambda: fresh), _one_shot(lambda: (x for x in fresh))
        (True, False, False)
    """
    first, second = restart(), restart()
    if isinstance(first, DataLoader) and isinstance(second, DataLoader):
        pairs = [(first.dataset, second.dataset)] if isinstance(first.dataset, IterableDataset) else \
            [(first.sampler, second.sampler), (first.batch_sampler, second.batch_sampler)]
    else:
        pairs = [(first, second)]
    return any(isinstance(a, Iterable) and isinstance(b, Iterable) and _same_iterator(iter(a), iter(b)) for a, b in pairs)


def _same_iterator(a: Any, b: Any) -> bool:
    """Whether two reads' iterators are one object that is no ``DataLoader``'s (a persistent-workers
    loader's is one object at every ``iter()``, and starts over: a wrapper whose ``__iter__``
    returns ``iter(loader)`` is no one-shot, review 40c)."""
    return a is b and not isinstance(a, _LOADER_ITERATORS)


_LEVELS = 2
"""How deep :func:`_reached` looks behind the data: a wrapper's attributes, and theirs."""


def _reached(data: Any) -> tuple[list[torch.Generator], list[DataLoader]]:
    """The torch generators that reads of ``data`` may draw from and that a read from its start
    sets back, and the DataLoaders it reads through, found up to :data:`_LEVELS` deep:
    ``data`` itself, a wrapper's attributes (``vars()``), a function's closure cells (a bound
    method's object, a ``functools.partial``'s function and arguments), and theirs. Of each
    DataLoader found: its ``generator``, its sampler's and its batch sampler's (and its batch
    sampler's sampler's) generators, any attribute of theirs (a custom sampler's ``self.g``),
    and its dataset's ``generator``. A generator found as an attribute of a wrapper is one too. A
    NumPy ``Generator``, a dataset's generator under another name, one deeper: not found, not set
    back (their draws go on from read to read, which :func:`_check_read_again` warns of). Lists,
    mappings, modules, tensors and classes are not looked into.

    Example::

        >>> from torch.utils.data import TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(4)), shuffle=True, generator=torch.Generator())
        >>> class Wrapper:
        ...     def __init__(self, loader): self.loader = loader
        ...     def __iter__(self): yield from self.loader
        >>> def read(loader):
        ...     return lambda: (b for b in loader)
        >>> for data in (Wrapper(loader), read(loader), loader):
        ...     generators, loaders = _reached(data)
        ...     print(loader.generator in generators, loaders == [loader])
        True True
        True True
        True True
    """
    generators: dict[int, torch.Generator] = {}
    loaders: dict[int, DataLoader] = {}
    seen: set[int] = set()
    level = [data]
    for depth in range(_LEVELS + 1):
        below = []
        for found in level:
            if id(found) in seen:
                continue
            seen.add(id(found))
            if isinstance(found, torch.Generator):
                generators.setdefault(id(found), found)
            elif isinstance(found, DataLoader):
                loaders.setdefault(id(found), found)
                for g in _loader_generators(found):
                    generators.setdefault(id(g), g)
            elif depth < _LEVELS:
                below += _held_by(found)
        level = below
    return list(generators.values()), list(loaders.values())


def _loader_generators(loader: DataLoader) -> list[torch.Generator]:
    """A DataLoader's own generator, its samplers' (as ``generator`` or any attribute), its dataset's ``generator``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    samplers = [getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None)]
    found = [getattr(loader, "generator", None), getattr(getattr(loader, "dataset", None), "generator", None)]
    for sampler in samplers:
        found += _held_by(sampler) if sampler is not None else []
    return [g for g in found if isinstance(g, torch.Generator)]


def _held_by(thing: Any) -> list[Any]:
    """What ``thing`` holds one level down, for :func:`_reached`: a function's closure cells, a bound
    method's object, a partial's function and arguments, an object's ``vars()``; nothing of a
    container, a module, a class, a tensor or an ``nn.Module``."""
    if isinstance(thing, (type, types.ModuleType, torch.Tensor, nn.Module, str, bytes, Mapping, list, tuple, set,
                          frozenset)):
        return []
    if isinstance(thing, types.FunctionType):
        held = []
        for cell in thing.__closure__ or ():
            try:
                held.append(cell.cell_contents)
            except ValueError:  # (a cell not filled yet)
                continue
        return held
    if isinstance(thing, types.MethodType):
        return [thing.__self__, thing.__func__]
    if isinstance(thing, functools.partial):
        return [thing.func, *thing.args, *thing.keywords.values()]
    try:
        return list(vars(thing).values())
    except TypeError:  # (no __dict__: a builtin, an object with __slots__)
        return []


_LOADER_ITERATORS = (torch.utils.data.dataloader._BaseDataLoaderIter,)
"""A ``DataLoader``'s iterators: one with ``persistent_workers`` is the same object at every
``iter()``, and a read through it starts over (a wrapper's ``for batch in self.loader``)."""


def _held_iterators(reader: Any) -> dict[int, Any]:
    """The iterators that ``reader``, one read's iterator, draws from, by id: what its generator's
    frame holds (its locals and its stack: the stored iterator of ``yield from self.it`` or ``for
    batch in self.it``), through the generators it delegates to; for a single-process
    ``DataLoader``'s iterator, its iterable dataset's iterator's. Nothing is read from them. Two
    reads whose iterators share one (:func:`_check_read_again`) go on from one another; an object
    of another kind, a DataLoader's iterator with workers (its dataset's iterators are theirs),
    hold none that is looked at.

    Example::

        >>> class Stored:
        ...     def __init__(self): self.it = iter(range(8))
        ...     def __iter__(self): yield from self.it
        >>> class Fresh:
        ...     def __iter__(self): yield from iter(range(8))
        >>> def shared(data):
        ...     first, second = iter(data), iter(data)
        ...     _ = next(first), next(second)  # (a generator holds what it reads once started)
        ...     return bool(_held_iterators(first).keys() & _held_iterators(second).keys())
        >>> shared(Stored()), shared(Fresh()), shared([1, 2])
        (True, False, False)
    """
    try:  # (a user's iterator whose __getattr__ raises another error: nothing looked at)
        fetcher = getattr(reader, "_dataset_fetcher", None)  # (torch's single-process iterator: the dataset's own)
        todo = [getattr(fetcher, "dataset_iter", reader)]
    except Exception:  # noqa: BLE001
        return {}
    found: dict[int, Any] = {}
    while todo:
        generator = todo.pop()
        if not isinstance(generator, types.GeneratorType):
            continue
        for held in gc.get_referents(generator):  # (its frame's locals and stack)
            if isinstance(held, _LOADER_ITERATORS):  # (a persistent-workers DataLoader gives every read the same one)
                continue
            if isinstance(held, Iterator) and held is not generator and id(held) not in found:
                found[id(held)] = held
                todo.append(held)
    return found


def _fresh_workers(iterable: Any, spec: str, *, say: bool = True) -> None:
    """A ``DataLoader`` with ``persistent_workers`` keeps its worker processes, and the RNG state
    each draws its augmentations from, from one ``iter()`` to the next: a read from the data's
    start (the start-up's reads, the run's, a resume's, a rollback's) would go on from the draws
    of the reads before it, not from a plain loop's first ``iter()`` (review 39e). Its workers
    are shut down here, so that the read starts new ones, seeded as at that first ``iter()``
    (their base seed from the loader's generator, set back, or from the global RNG); within a
    stream, epoch after epoch, they persist as in a plain loop. A torch whose loader keeps them
    otherwise than in ``_iterator`` is warned about instead (``say``: at the run's end, when
    they are only stopped, :attr:`Task.release <ampguard.tasks.Task.release>`, not)."""
    if not (isinstance(iterable, DataLoader) and iterable.persistent_workers and iterable.num_workers > 0):
        return
    running = getattr(iterable, "_iterator", _UNKNOWN)
    if running is None:
        return
    stop = getattr(running, "_shutdown_workers", None)
    if running is _UNKNOWN or stop is None:  # (torch's private attributes, as of 1.7 to 2.x)
        if not say:
            return
        warn(f"task.factory {spec}: the DataLoader's persistent workers cannot be restarted: their RNGs go "
             "on from the start-up's reads of the data, so that a random augmentation in them draws other "
             "numbers than a plain loop's (give persistent_workers=False for a bit-for-bit run)",
             RankWarning, stacklevel=2)
        return
    stop()
    iterable._iterator = None


_UNKNOWN = object()


def _looked_up(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)``, and ``default`` too where looking raises another error (a
    data wrapper whose ``__getattr__`` reads a dict raised ``KeyError``: a traceback at start-up).

    Example::

        >>> class Config:
        ...     def __getattr__(self, key): return {}[key]
        >>> _looked_up(Config(), "sampler"), _looked_up(None, "sampler", 0)
        (None, 0)
    """
    try:
        return getattr(obj, name, default)
    except Exception:  # noqa: BLE001 - a user's object: what it raises is not a sampler
        return default


def _check_seek(seek: Callable[[int], Any], first: list[Any], spec: str, rewind: Callable[[], None] = lambda: None
                ) -> None:
    """A factory's ``batches_from`` must start where ``data``'s stream is: ``batches_from(i)``'s
    first batch is data's batch ``i``, checked for the first and the last of ``first`` (data's
    first batches, read already); else a resume would train on other batches than the run, unsaid.
    Each call from the data's generators set back (``rewind``), as the run's (:func:`_seeked`)."""
    for i in sorted({0, len(first) - 1}):
        rewind()  # (review 52h: one that reads data's own seeded DataLoader read its next shuffle: refused)
        with user_code(f"task.factory {spec}: batches_from({i}) raised "):
            got = next(iter(seek(i)), None)
        if got is None or not _same_batch(got, first[i]):
            said = "gave no batch" if got is None else f"does not start with data's batch {i} (counted from 0)"
            raise InputError(f"task.factory {spec}: batches_from({i}) {said}: a resume would train on other batches "
                             "than the run; make batches_from(start) give data's stream from micro-batch start on")


def _same_batch(a: Any, b: Any) -> bool:
    """Whether two batches hold the same values (tensors compared exactly, NaN to NaN), nested alike.

    Example::

        >>> x = torch.tensor([1.0, float("nan")])
        >>> _same_batch((x, {"y": [1, 2]}), (x.clone(), {"y": [1, 2]})), _same_batch((x,), (x + 1,))
        (True, False)
        >>> import numpy as np
        >>> _same_batch(np.arange(3), np.arange(3)), _same_batch(np.arange(3), np.ones(3))
        (True, False)
        >>> _same_batch(torch.ones(2, device="meta"), torch.ones(2, device="meta"))  # (no values to compare)
        False
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or (a.shape, a.dtype) != (b.shape, b.dtype):
            return False
        try:  # (tensors that do not compare, meta ones say, are not the same: no traceback)
            if torch.equal(a, b):
                return True
            inf = float("inf")
            return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(
                a.nan_to_num(0.0, inf, -inf), b.nan_to_num(0.0, inf, -inf))
        except Exception:  # noqa: BLE001 - a comparison that raises: not the same batch
            return False
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_batch(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_batch(x, y) for x, y in zip(a, b))
    try:  # (an array's == is elementwise)
        same = type(a) is type(b) and a == b
        return bool(same.all() if hasattr(same, "all") else same)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


def _seeked(seek: Callable[[int], Any], spec: str, rewind: Callable[[], None], start: int) -> Iterator[Any]:
    """``batches_from(start)``'s batches, called with the data's generators set back (``rewind``:
    every stream starts from the factory's state, as data's own; one that reads data's DataLoader
    went on from the reads before it); one that ends is refused (the stream runs epoch after epoch)."""
    rewind()
    count = 0
    for batch in seek(start):
        count += 1
        yield batch
    raise ValueError(f"task.factory {spec}: batches_from({start}) ended after {count} batches: it must give data's "
                     "stream on, epoch after epoch, as data is read again every epoch")

