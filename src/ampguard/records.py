"""One record per optimizer step: what the step did, as device values until someone reads them.

The step builds a record without reading anything back to the host; a sink that wants numbers
calls :meth:`StepRecord.values`, which copies every tensor field to the host in one transfer.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from .clipping import post_clip_value
from .distributed import NAMED_RANKS

SkipReason = Literal["non_finite_loss", "non_finite_grad"]
SKIP_REASONS: tuple[str, ...] = ("non_finite_loss", "non_finite_grad")
# the extra CSV columns of a guard over several optimizers (``Guard.record_columns``)
LABEL_COLUMNS: tuple[str, ...] = ("optimizers", "skipped_optimizers")

Value = torch.Tensor | float | None


@dataclass(frozen=True, slots=True, repr=False)
class StepRecord:
    """Fields shared by :class:`StepLog` and :class:`SkipLog` (docs/design.md §3).

    ``step`` counts from 1; ``lr`` is param group 0's learning rate the step used; ``loss`` is
    the mean of the group's micro-batch losses; the norms are the global L2 norm of the
    unscaled gradients before and after clipping (``None`` where it does not exist);
    ``scaler_scale`` is the loss scale after this step's ``update()`` (1.0 without a scaler).
    Each field is a device tensor, a float or ``None``; :meth:`values` reads them all.

    Example::

        >>> log = StepLog(1, lr=0.1, loss=torch.tensor(0.5), grad_l2_pre_clip=torch.tensor(4.0),
        ...               grad_l2_post_clip=torch.tensor(1.0), scaler_scale=1.0)
        >>> log.skipped, log.reason, log.values()["grad_l2_pre_clip"]
        (False, None, 4.0)
    """

    step: int
    lr: Value
    loss: Value
    grad_l2_pre_clip: Value
    grad_l2_post_clip: Value
    scaler_scale: Value
    _host: dict[str, float | None] | None = field(default=None, init=False, repr=False, compare=False)
    # A guard over several optimizers names those this step stepped and those of them it skipped
    # (both empty for a guard over one optimizer): the CSV columns of :data:`LABEL_COLUMNS`.
    optimizers: tuple[str, ...] = field(default=(), repr=False)
    skipped_optimizers: tuple[str, ...] = field(default=(), repr=False)
    # Every numeric field in one device tensor (in ``_NUMERIC`` order; the fields are views of
    # it), as the sync-free step makes it: read back with one copy and no conversions.
    packed: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # Values already on the host, by field name: what the exact step's one host read brought
    # over with its skip decision. :meth:`values` reads only the other tensor fields.
    read: dict[str, float | None] | None = field(default=None, repr=False, compare=False)

    skipped: ClassVar[bool] = False
    _NUMERIC: ClassVar[tuple[str, ...]] = (
        "lr", "loss", "grad_l2_pre_clip", "grad_l2_post_clip", "scaler_scale",
    )

    @property
    def reason(self) -> str | None:
        """Why the step was skipped (one of :data:`SKIP_REASONS`), ``None`` for an applied one."""
        return None

    def labels(self) -> dict[str, str]:
        """The text cells of :data:`LABEL_COLUMNS`: optimizer names joined by ``;``.

        Example::

            >>> log = SkipLog(4, lr=0.1, loss=0.5, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=0.9,
            ...               scaler_scale=512.0, optimizers=("discriminator", "generator"),
            ...               skipped_optimizers=("generator",))
            >>> log.labels()
            {'optimizers': 'discriminator;generator', 'skipped_optimizers': 'generator'}
        """
        return {"optimizers": ";".join(self.optimizers), "skipped_optimizers": ";".join(self.skipped_optimizers)}

    def values(self) -> dict[str, float | None]:
        """The numeric fields as Python floats (``None`` stays ``None``).

        Tensors are gathered and copied to the host together: one transfer, so it costs a host
        sync on an accelerator. This is the call that costs; the step itself never makes it. The
        result is kept, so several sinks reading one record pay once.

        Example::

            >>> log = StepLog(1, lr=0.1, loss=torch.tensor(0.25), grad_l2_pre_clip=torch.tensor(3.0),
            ...               grad_l2_post_clip=torch.tensor(1.0), scaler_scale=1.0)
            >>> log.values()
            {'lr': 0.1, 'loss': 0.25, 'grad_l2_pre_clip': 3.0, 'grad_l2_post_clip': 1.0, 'scaler_scale': 1.0}
            >>> log.values() is log.values()  # read once, kept
            True
        """
        if self._host is not None:
            return self._host
        if self.packed is not None:
            return self._keep(dict(zip(self._NUMERIC, self.packed.tolist())))
        tensors = self._unread()
        read = dict(self.read or {})
        if tensors and next(iter(tensors.values())).device.type == "cpu":  # no transfer to share: a read each
            read.update((n, t.item()) for n, t in tensors.items())
        elif tensors:
            device = next(iter(tensors.values())).device
            # float32 and narrower convert to Python floats exactly; float64 is kept as it is
            dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors.values()) else torch.float32
            stacked = torch.stack([t.detach().reshape(()).to(device, dtype) for t in tensors.values()])
            read.update(zip(tensors, stacked.tolist()))
        return self._keep(read)

    def __repr__(self) -> str:
        """``StepLog(step=1, lr=0.1, loss=1.105, ...)``, the numbers :meth:`values` reads: the
        tensors in one transfer (none where the step's own read brought them), kept for the sinks;
        a field-by-field repr read each tensor on its own, a host sync each on a GPU (review 55r)."""
        return f"{type(self).__name__}(step={self.step!r}, {self._shown()})"

    def _shown(self) -> str:
        """The repr's values, ``lr=0.1, loss=0.5, ...``; one line, should they not read."""
        try:
            values = self.values()
        except Exception as err:  # noqa: BLE001 - a repr says it, a debugger's view of the record goes on
            return f"values not readable: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return ", ".join(f"{name}={values[name]!r}" for name in StepRecord._NUMERIC)

    def _unread(self) -> dict[str, torch.Tensor]:
        """The tensor fields whose values are not on the host yet."""
        known = self.read or {}
        return {n: v for n in self._NUMERIC if n not in known and isinstance(v := getattr(self, n), torch.Tensor)}

    def _keep(self, read: dict[str, float]) -> dict[str, float | None]:
        """The host values: ``read`` (tensors already brought over), the rest converted here.
        Kept on the record, so several sinks reading it pay once."""
        out = {n: read[n] if n in read else (None if (v := getattr(self, n)) is None else float(v))
               for n in self._NUMERIC}
        object.__setattr__(self, "_host", out)
        return out

    def prefetch(self) -> Prefetch:
        """Start copying the values to the host without waiting; return a :class:`Prefetch`,
        a function that waits for the copy (not for the whole device) and gives :meth:`values`,
        with ``landed()`` to ask without waiting.

        On CUDA the tensors go, stacked, into pinned memory with a non-blocking copy and a CUDA
        event; the returned function waits on that event, so a background thread can do the
        waiting while the training loop goes on. Elsewhere it simply defers :meth:`values`.
        Calling the returned function costs a host sync (on that copy) if :meth:`values` was
        not read yet.

        Example::

            >>> log = StepLog(1, lr=0.1, loss=torch.tensor(0.25), grad_l2_pre_clip=torch.tensor(3.0),
            ...               grad_l2_post_clip=torch.tensor(1.0), scaler_scale=1.0)
            >>> wait = log.prefetch()  # returns at once
            >>> wait()["loss"], wait() == log.values()
            (0.25, True)
        """
        # only device tensors travel through pinned memory; host values (a CPU scale of 1.0, a
        # float lr) are read where they are: copying them to the device would be a sync of its own
        if self.packed is not None and self.packed.is_cuda:  # one copy of what the step packed
            cuda = dict.fromkeys(self._NUMERIC)
            stacked, device = self.packed, self.packed.device
        else:
            cuda = {n: v for n, v in self._unread().items() if v.is_cuda}
            if not cuda or self._host is not None:
                return Prefetch(self.values)
            device = next(iter(cuda.values())).device
            stacked = torch.stack([t.detach().reshape(()).to(device, torch.float64) for t in cuda.values()])
        pinned = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        pinned.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))

        def wait() -> dict[str, float | None]:
            done.synchronize()
            return self._keep({**(self.read or {}), **dict(zip(cuda, pinned.tolist()))})

        return Prefetch(wait, done.query)


class Prefetch:
    """A record's values on their way to the host (:meth:`StepRecord.prefetch`): call it to wait
    for them; :meth:`landed` says, without waiting, whether the copy is done.

    Example::

        >>> p = Prefetch(lambda: {"loss": 0.5})
        >>> p.landed(), p()
        (True, {'loss': 0.5})
    """

    __slots__ = ("_wait", "_landed")

    def __init__(self, wait: Callable[[], dict[str, float | None]], landed: Callable[[], bool] | None = None) -> None:
        self._wait, self._landed = wait, landed

    def __call__(self) -> dict[str, float | None]:
        return self._wait()

    def landed(self) -> bool:
        """True once the values can be read without waiting for the device."""
        return self._landed is None or self._landed()


LAG = 2
"""How many steps behind the training step the fast path's run loop may read records back."""


class InFlight:
    """The run loop's records in flight: each one's host copy is started when it is added; they
    come back in step order, each as soon as its copy has landed, and never more than ``lag``
    steps behind the newest (an older one is waited for). With ``lag`` 0 every record comes back
    at once (its values read on the spot): the exact path.

    Example (CPU values land at once; a fake copy that has not landed shows the lag)::

        >>> flight = InFlight(lag=2)
        >>> records = [StepLog(s, lr=0.1, loss=0.5, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)
        ...            for s in (1, 2, 3, 4)]
        >>> flight.add(records[0], None); [r.step for r, _ in flight.ready()]
        [1]
        >>> for r in records[1:]:
        ...     flight._queue.append((r, None, Prefetch(r.values, lambda: False)))  # still on its way
        >>> [r.step for r, _ in flight.ready()], len(flight)  # step 2 is waited for: 2 stay in flight
        ([2], 2)
        >>> [r.step for r, _ in flight.drain()], len(flight)
        ([3, 4], 0)
    """

    def __init__(self, lag: int = LAG) -> None:
        self.lag = lag
        # (record, extra, wait): a Prefetch, or with lag 0 the record's values() (read on the spot)
        self._queue: deque[tuple[StepRecord, Any, Callable[[], Any]]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, record: StepRecord, extra: Any) -> None:
        """A record just made (and what goes with it, e.g. the evaluation of its step)."""
        self._queue.append((record, extra, record.prefetch() if self.lag else record.values))

    def ready(self) -> Iterator[tuple[StepRecord, Any]]:
        """The records whose values have landed, oldest first, and those beyond ``lag`` (waited for)."""
        while self._queue and (len(self._queue) > self.lag or self._queue[0][2].landed()):  # type: ignore[union-attr]
            yield self._take()

    def drain(self) -> Iterator[tuple[StepRecord, Any]]:
        """Every record still in flight, oldest first (waiting for each)."""
        while self._queue:
            yield self._take()

    def _take(self) -> tuple[StepRecord, Any]:
        record, extra, wait = self._queue[0]
        wait()  # then taken: a wait that is interrupted (Ctrl-C) leaves the record for the next drain
        self._queue.popleft()
        return record, extra


@dataclass(frozen=True, slots=True, repr=False)
class StepLog(StepRecord):
    """An applied optimizer update.

    Example::

        >>> log = StepLog(7, lr=0.01, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0,
        ...               scaler_scale=65536.0)
        >>> log.step, log.skipped, log.reason, log.loss_on
        (7, False, None, None)
    """

    loss_on: ClassVar[None] = None
    """(:attr:`SkipLog.loss_on`: an applied step's loss was finite on every rank.)"""


@dataclass(frozen=True, slots=True, repr=False)
class SkipLog(StepRecord):
    """A skipped step: parameters and optimizer state untouched, the scale backed off.

    With several optimizers a step is skipped when any optimizer it stepped was: those in
    ``skipped_optimizers`` are untouched, the others applied their update (``grad_l2_post_clip``
    is then their norm after clipping).

    Example::

        >>> log = SkipLog(3, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
        ...               scaler_scale=32768.0, reason="non_finite_loss")
        >>> log.skipped, log.reason, log.values()["grad_l2_pre_clip"]
        (True, 'non_finite_loss', None)
    """

    reason: SkipReason = "non_finite_grad"  # type: ignore[assignment]
    loss_on: str | None = field(default=None, repr=False)
    """Under torchrun, for a ``non_finite_loss`` skip: whose own loss was not finite, ``"rank 1"``,
    ``"ranks 1 and 3"`` or ``"every rank"`` (:func:`loss_origin`); None otherwise."""
    skipped: ClassVar[bool] = True

    def __repr__(self) -> str:
        return f"SkipLog(step={self.step!r}, {self._shown()}, reason={self.reason!r})"

    def __post_init__(self) -> None:  # (a skipped step only: the CSV's skip_reason is a closed set)
        if self.reason not in SKIP_REASONS:
            raise ValueError(f"SkipLog reason must be one of {', '.join(SKIP_REASONS)} (docs/design.md §3), "
                             f"got {self.reason!r}")


@dataclass(frozen=True, slots=True, repr=False)
class PendingStep(StepRecord):
    """A step of the sync-free path: whether it was skipped is still a device value.

    ``skipped`` and ``reason`` read it (with the other values, in one transfer; through a
    :class:`~ampguard.sinks.BackgroundSink` that transfer happens off the training thread).
    Norms that do not exist for the step (a loss skip's, a skip's post-clip) read as ``None``,
    exactly as in a :class:`SkipLog`. ``loss_mark`` is the group's loss mark (0, or NaN when a
    micro-batch loss was non-finite): with the pre-clip norm it tells on the host whether the
    step was skipped and why, so the device computes no flags for the record. With ``clip``,
    ``(max_norm, the norm's dtype)``, the packed post-clip slot holds the clip factor instead
    and the host computes the post-clip norm from it (:func:`~ampguard.clipping.post_clip_value`,
    bit for bit the device's; the ``grad_l2_post_clip`` field is then ``None``, and
    :meth:`values` has the number), as the exact step does: two kernels fewer per step.

    Example::

        >>> p = PendingStep(2, lr=0.1, loss=torch.tensor(1.0), grad_l2_pre_clip=torch.tensor(float("inf")),
        ...                 grad_l2_post_clip=torch.tensor(float("nan")), scaler_scale=torch.tensor(512.0),
        ...                 loss_mark=torch.tensor(0.0))
        >>> p.skipped, p.reason, p.values()["grad_l2_post_clip"]  # the read costs a host sync
        (True, 'non_finite_grad', None)
        >>> sorted(p.values())  # the mark is not a value of the record
        ['grad_l2_post_clip', 'grad_l2_pre_clip', 'loss', 'lr', 'scaler_scale']
    """

    loss_mark: Value = None
    loss_ranks: Value = None
    loss_rank_code: Value = None
    world: int = field(default=1, repr=False, compare=False)
    clip: tuple[float, torch.dtype] | None = field(default=None, repr=False, compare=False)
    _reason: str | None = field(default=None, init=False, repr=False, compare=False)
    _loss_on: str | None = field(default=None, init=False, repr=False, compare=False)

    # (the packed tensor holds them in this order; a world of one packs no origin: read as None)
    _NUMERIC: ClassVar[tuple[str, ...]] = StepRecord._NUMERIC + ("loss_mark", "loss_ranks", "loss_rank_code")

    def _keep(self, read: dict[str, float]) -> dict[str, float | None]:
        out = StepRecord._keep(self, read)
        mark, pre = out.pop("loss_mark"), out["grad_l2_pre_clip"]
        ranks, code = out.pop("loss_ranks"), out.pop("loss_rank_code")
        reason = ("non_finite_loss" if mark is not None and not math.isfinite(mark) else
                  "non_finite_grad" if pre is not None and not math.isfinite(pre) else None)
        object.__setattr__(self, "_reason", reason)
        if reason == "non_finite_loss" and ranks is not None:
            object.__setattr__(self, "_loss_on", loss_origin(ranks, code, self.world))
        if reason == "non_finite_loss":
            out["grad_l2_pre_clip"] = out["grad_l2_post_clip"] = None
        elif reason:
            out["grad_l2_post_clip"] = None
        elif self.clip is not None:  # the slot held the clip factor
            out["grad_l2_post_clip"] = post_clip_value(pre, out["grad_l2_post_clip"], *self.clip)  # type: ignore[arg-type]
        return out

    def __repr__(self) -> str:
        """Not read yet (the sync-free step's promise: nothing reads the device but the reader
        it is handed to), ``PendingStep(step=3, not read yet: ...)``; once read, its values and
        whether it was skipped. Its fields as they stand would mislead: a clipped step's
        ``grad_l2_post_clip`` is None (the packed slot holds the clip factor), the skip is a
        device value (review 55r)."""
        if self._host is None and (self.packed is not None or self._unread()):
            return (f"PendingStep(step={self.step!r}, not read yet: .values() or .resolve() reads it, one host "
                    "sync)")
        shown, reason = self._shown(), self._reason
        return (f"PendingStep(step={self.step!r}, {shown}, skipped={reason is not None}"
                + (f", reason={reason!r})" if reason is not None else ")"))

    @property
    def skipped(self) -> bool:  # type: ignore[override]
        """Whether the step was skipped: reads :meth:`values` (costs a host sync, once)."""
        return self.reason is not None

    @property
    def reason(self) -> str | None:
        """``non_finite_loss``, ``non_finite_grad`` or ``None``: reads :meth:`values` (a host sync, once)."""
        self.values()
        return self._reason

    @property
    def loss_on(self) -> str | None:
        """:attr:`SkipLog.loss_on`: reads :meth:`values` (a host sync, once)."""
        self.values()
        return self._loss_on

    def resolve(self) -> StepLog | SkipLog:
        """The :class:`StepLog` or :class:`SkipLog` this step turned out to be (reads the values,
        which costs a host sync).

        Example::

            >>> p = PendingStep(4, lr=0.1, loss=torch.tensor(0.5), grad_l2_pre_clip=torch.tensor(2.0),
            ...                 grad_l2_post_clip=torch.tensor(1.0), scaler_scale=torch.tensor(1024.0),
            ...                 loss_mark=torch.tensor(0.0))
            >>> p.resolve()
            StepLog(step=4, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1024.0)
        """
        return record_from(self.step, self.values(), self.reason, self.loss_on)


def record_from(step: int, values: dict[str, float | None], reason: str | None,
                loss_on: str | None = None) -> StepLog | SkipLog:
    """A :class:`SkipLog` with ``reason`` (or a :class:`StepLog` without) from host values.

    Example::

        >>> values = {"lr": 0.1, "loss": 0.5, "grad_l2_pre_clip": float("inf"), "grad_l2_post_clip": None,
        ...           "scaler_scale": 256.0}
        >>> record_from(9, values, "non_finite_grad")  # doctest: +NORMALIZE_WHITESPACE
        SkipLog(step=9, lr=0.1, loss=0.5, grad_l2_pre_clip=inf, grad_l2_post_clip=None,
                scaler_scale=256.0, reason='non_finite_grad')
        >>> record_from(9, values, None).skipped
        False
    """
    fields = {name: values[name] for name in StepRecord._NUMERIC}
    return SkipLog(step, **fields, reason=reason, loss_on=loss_on) if reason else StepLog(step, **fields)  # type: ignore[arg-type]


def loss_origin(ranks: float, code: float, world: int) -> str | None:
    """Whose own loss was not finite, from :func:`~ampguard.distributed.agree`'s origin (how
    many ranks, the sum of their :func:`~ampguard.distributed.rank_code`): each rank in a world
    of up to ``NAMED_RANKS``, beyond it the rank when one rank's was.

    Example::

        >>> loss_origin(1, 8, 4), loss_origin(2, 10, 4), loss_origin(3, 11, 4), loss_origin(4, 15, 4)
        ('rank 3', 'ranks 1 and 3', 'ranks 0, 1 and 3', 'every rank')
        >>> loss_origin(1, 40, 64), loss_origin(2, 41, 64), loss_origin(0, 0, 4)
        ('rank 40', '2 of 64 ranks', None)
    """
    if not ranks:
        return None
    if ranks >= world:
        return "every rank"
    if world > NAMED_RANKS:
        return f"rank {int(code)}" if ranks == 1 else f"{int(ranks)} of {world} ranks"
    named = [str(r) for r in range(world) if int(code) >> r & 1]
    return f"rank {named[0]}" if len(named) == 1 else f"ranks {', '.join(named[:-1])} and {named[-1]}"


def format_number(x: float | None) -> str:
    """How numbers are written everywhere: ``repr`` round-trips, non-finite as inf/-inf/nan.

    Example::

        >>> format_number(0.1), format_number(3), format_number(float("-inf")), format_number(None)
        ('0.1', '3.0', '-inf', '')
    """
    return "" if x is None else repr(float(x))  # (repr gives nan, inf and -inf as they are)


def format_value(x: Any) -> str:
    """An extra column's number as the CSV writes it: an integer (a Python ``int``, a NumPy
    integer, a one-element integer tensor: a host read, as ``float()``'s) as its digits, exact at
    any size (``float`` was exact only to 2**53: 2**60 + 1 came back 2**60); anything else, a bool
    among them (``1.0``/``0.0``, as always), as :func:`format_number` writes it, its text unchanged.

    Example::

        >>> import numpy as np
        >>> [format_value(v) for v in (1024, 2**60 + 1, np.int64(-3), torch.tensor(7), torch.tensor([5]))]
        ['1024', '1152921504606846977', '-3', '7', '5']
        >>> [format_value(v) for v in (0.1, 3.0, torch.tensor(0.25), True, np.bool_(False), torch.tensor(True), None)]
        ['0.1', '3.0', '0.25', '1.0', '0.0', '1.0', '']
    """
    if type(x) is float or x is None or isinstance(x, bool):  # (the common case first: a float's text as before)
        return format_number(x)
    if isinstance(x, numbers.Integral):  # (int and NumPy's integers; NumPy's bool is none)
        return str(int(x))
    if callable(getattr(x, "item", None)):  # (a tensor or a NumPy value: read once)
        with contextlib.suppress(ValueError, RuntimeError):  # (several values: format_number refuses, as before)
            x = x.item()
        if type(x) is int:
            return str(x)
    return format_number(x)


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (nested in dicts, lists, tuples) written as the
    string ``format_number`` gives it, so ``json.dumps`` yields strict JSON.

    Example::

        >>> strict_json({"a": [1.5, float("nan")], "b": float("-inf"), "c": "x"})
        {'a': [1.5, 'nan'], 'b': '-inf', 'c': 'x'}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return format_number(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def non_finite_at(value: Any) -> list[list[str | int]]:
    """Where :func:`strict_json` writes a string for a non-finite float in ``value``: each the keys
    (as JSON writes a key: ``1`` is ``"1"``) and list indices that lead to it from the top, for a
    file that keeps them beside the value, so its reader turns back those strings and none of the
    user's (:func:`non_finite_back`; review 56l: a monitor's ``best=inf`` came back ``"inf"``).

    Example::

        >>> non_finite_at({"a": [1.5, float("nan")], "b": {"c": float("-inf"), 2: "inf"}})
        [['a', 1], ['b', 'c']]
    """
    found: list[list[str | int]] = []

    def walk(value: Any, at: list[str | int]) -> None:
        if isinstance(value, float) and not math.isfinite(value):  # (strict_json's own test)
            found.append(at)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, [*at, key if isinstance(key, str) else json.dumps(key)])
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, [*at, index])

    walk(value, [])
    return found


def non_finite_back(value: Any, paths: Any) -> Any:
    """``value`` as read back from :func:`strict_json`'s JSON, the strings it wrote at ``paths``
    (:func:`non_finite_at`) turned back into the floats, in place; any other string stays as it
    is. Raises ``ValueError`` for a path that leads to no such string (a file edited by hand).

    Example::

        >>> non_finite_back({"a": [1.5, "nan"], "b": {"c": "-inf", "2": "inf"}}, [["a", 1], ["b", "c"]])
        {'a': [1.5, nan], 'b': {'c': -inf, '2': 'inf'}}
    """
    if not isinstance(paths, list):
        raise ValueError(f"its non-finite numbers' places are not a list: {paths!r}")
    for path in paths:
        try:
            *to, last = path
            holder = value
            for step in to:
                holder = holder[step]
            written = holder[last]
            if not isinstance(written, str) or written not in NON_FINITE_WRITTEN or isinstance(last, bool):
                raise ValueError
            holder[last] = NON_FINITE_WRITTEN[written]
        except (ValueError, TypeError, KeyError, IndexError):
            raise ValueError(f"its non-finite number at {path!r} is not there") from None
    return value


NON_FINITE_WRITTEN = {format_number(x): x for x in (math.inf, -math.inf, math.nan)}
"""The strings :func:`strict_json` writes for the non-finite floats (``"inf"``, ``"-inf"``, ``"nan"``)."""


def numbers_back(values: Any) -> Any:
    """A mapping of names to numbers that went through :func:`strict_json`, each of its
    ``"inf"``/``"-inf"``/``"nan"`` strings read back as the float (anything else, and a value
    that is no mapping, as it is): for the fields whose values are numbers alone (a monitor's
    last record, its held-out metrics), never a string a user named.

    Example::

        >>> numbers_back({"loss": "nan", "grad_l2_pre_clip": "inf", "lr": 0.1, "grad_l2_post_clip": None})
        {'loss': nan, 'grad_l2_pre_clip': inf, 'lr': 0.1, 'grad_l2_post_clip': None}
    """
    if not isinstance(values, dict):
        return values
    return {k: NON_FINITE_WRITTEN.get(v, v) if isinstance(v, str) else v for k, v in values.items()}
