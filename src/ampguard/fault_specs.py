"""A fault's spec, ``KIND@WHEN[@rankR]``, read and checked: the half of :mod:`ampguard.faults`
that needs no torch (:mod:`ampguard.config` checks a config's ``inject`` with it, so loading a
config and ``train --print-config`` start without torch). :mod:`ampguard.faults` imports every
name here and injects the faults; the specs are described there.

Example::

    >>> from ampguard import faults
    >>> faults.parse_fault is parse_fault, parse_fault("nan_loss@5").spec()
    (True, 'nan_loss@5')
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import InputError, counted, plain_digits, shortened

KINDS: tuple[str, ...] = ("inf_grad", "nan_grad", "nan_loss", "spike", "nan_input")
SPIKE_FACTOR = 1e8
MAX_SHOWN = 60
"""The most characters of a fault's spec an error line shows (its head and tail: :func:`_shown`)."""


@dataclass(frozen=True)
class Fault:
    """One ``KIND@WHEN`` fault; :meth:`hits` says whether it fires at a step.

    Example::

        >>> fault = Fault("nan_grad", every=3)
        >>> [step for step in range(1, 10) if fault.hits(step)], fault.spec()
        ([3, 6, 9], 'nan_grad@every:3')
    """

    kind: str
    steps: frozenset[int] = frozenset()
    every: int | None = None
    rate: float | None = None
    seed: int = 0
    rank: int | None = None

    def hits(self, step: int) -> bool:
        """Whether the fault fires at ``step`` (1-based); a ``rate`` fault answers the same every time.

        Example::

            >>> fault = parse_fault("spike@rate:0.5", seed=1)
            >>> first = [fault.hits(s) for s in range(1, 21)]
            >>> first == [fault.hits(s) for s in range(1, 21)], 0 < sum(first) < 20
            (True, True)
        """
        if self.every is not None:
            return step % self.every == 0
        if self.rate is not None:
            # A fresh generator per (seed, kind, step): the same answer in any order, after a resume.
            return random.Random(f"{self.seed}:{self.kind}:{step}").random() < self.rate
        return step in self.steps

    def spec(self) -> str:
        """The ``KIND@WHEN[@rankR]`` text :func:`parse_fault` reads back to this fault.

        Example::

            >>> parse_fault("inf_grad@12,5@rank1").spec()
            'inf_grad@5,12@rank1'
        """
        if self.every is not None:
            when = f"every:{self.every}"
        elif self.rate is not None:
            when = f"rate:{self.rate:g}"
        else:
            when = ",".join(str(s) for s in sorted(self.steps))
        return f"{self.kind}@{when}" + (f"@rank{self.rank}" if self.rank is not None else "")


def parse_fault(spec: str, seed: int = 0) -> Fault:
    """Parse ``KIND@WHEN``; raise ``ValueError`` with one line naming what is wrong.

    Example::

        >>> fault = parse_fault("nan_loss@5,9")
        >>> fault.kind, sorted(fault.steps), fault.every, fault.rank
        ('nan_loss', [5, 9], None, None)
        >>> parse_fault("inf_grad@every:10@rank1").rank
        1
        >>> parse_fault("nan_loss")
        Traceback (most recent call last):
        ...
        ValueError: fault 'nan_loss' needs @WHEN, e.g. nan_loss@5, nan_loss@every:10, nan_loss@rate:0.05
    """
    kind, sep, when = spec.partition("@")
    kind, when = kind.strip(), when.strip()
    if kind not in KINDS:  # (before the rank's: its example names the kind)
        raise ValueError(f"unknown fault kind {_shown(kind)} in {_shown(spec)} (kinds: {', '.join(KINDS)})")
    rank = None
    when, at, rank_text = when.partition("@")
    if at:
        rank_text = rank_text.strip()
        # (int() refuses more than 4,300 digits in its own words, which named no fault)
        if not (rank_text.startswith("rank") and rank_text[4:].isdigit() and rank_text.isascii()
                and len(rank_text[4:].lstrip("0")) <= 18):
            raise ValueError(f"bad rank in fault {_shown(spec)}: use @rankR after WHEN, e.g. {kind}@5@rank1")
        rank = int(rank_text[4:].lstrip("0") or "0")  # (int() counts leading zeros against its limit)
    if not sep or not when:
        raise ValueError(f"fault {_shown(spec)} needs @WHEN, e.g. {kind}@5, {kind}@every:10, {kind}@rate:0.05")
    try:
        if not plain_digits(when):  # (int() reads '１', '٣' and 1_000: a config writes none of them)
            raise ValueError
        if when.startswith("every:"):
            every = int(when.removeprefix("every:"))
            if every < 1:
                raise ValueError
            return Fault(kind, every=every, seed=seed, rank=rank)
        if when.startswith("rate:"):
            rate = float(when.removeprefix("rate:"))
            if not 0.0 < rate <= 1.0:  # (rate:0 never fires: the run would look clean for the wrong reason)
                raise ValueError
            return Fault(kind, rate=rate, seed=seed, rank=rank)
        steps = frozenset(int(s) for s in when.split(","))
        if min(steps) < 1:
            raise ValueError
        return Fault(kind, steps=steps, seed=seed, rank=rank)
    except ValueError:
        raise ValueError(
            f"bad WHEN in fault {_shown(spec)}: use step numbers >= 1 (5 or 5,9,12), every:K with K >= 1, or rate:P with "
            "0 < P <= 1"
        ) from None


def _shown(spec: str) -> str:
    """A fault's spec (or its kind) for an error line: its repr, cut short (``--inject
    nan_loss@<5,000 digits>`` was echoed whole, an unknown kind of 5,000 characters twice).

    Example::

        >>> _shown("nan_loss@5"), len(_shown("nan_loss@" + "9" * 5000))
        ("'nan_loss@5'", 60)
    """
    return shortened(repr(spec), MAX_SHOWN)


def check_ranks(faults: Iterable[Fault], world_size: int) -> None:
    """Refuse (``ValueError``, one line) a fault aimed at a rank the run does not have: it
    would never fire, and the run would look clean for the wrong reason.

    Example::

        >>> check_ranks([parse_fault("nan_loss@40@rank1")], world_size=2)
        >>> check_ranks([parse_fault("nan_loss@40@rank3")], world_size=1)
        Traceback (most recent call last):
        ...
        ValueError: fault 'nan_loss@40@rank3' targets rank 3, but this run has 1 process (rank 0 only; torchrun --nproc_per_node sets more)
    """
    for fault in faults:
        if fault.rank is not None and fault.rank >= world_size:
            ranks = "rank 0 only" if world_size == 1 else f"ranks 0 to {world_size - 1}"
            processes = counted(world_size, "process", "processes")
            more = "; torchrun --nproc_per_node sets more" if world_size == 1 else ""
            raise ValueError(f"fault {_shown(fault.spec())} targets rank {fault.rank}, but this run has {processes} "
                             f"({ranks}{more})")


def check_steps(faults: Iterable[Fault], steps: int, start: int = 1) -> None:
    """Refuse (``ValueError``, one line) a fault that fires at none of the steps the run trains,
    ``start`` to ``steps`` (all its steps, or its ``every``, beyond ``steps``; or, on a resume
    from step ``start - 1``, all before ``start``): as one aimed at a missing rank, it would never
    fire, and the run would look clean for the wrong reason.

    Example::

        >>> check_steps([parse_fault("nan_loss@5,500"), parse_fault("spike@every:20")], steps=20)
        >>> check_steps([parse_fault("inf_grad@500")], steps=20)
        Traceback (most recent call last):
        ...
        ValueError: fault 'inf_grad@500' never fires: the run has 20 steps (config steps; a step counts optimizer steps, not micro-batches); drop it (given with --inject: leave it out; from a config: --inject none, or --set inject=[...])
        >>> check_steps([parse_fault("nan_loss@2,3")], steps=8, start=5)
        Traceback (most recent call last):
        ...
        ValueError: fault 'nan_loss@2,3' never fires: the run resumes after step 4 (its steps 5 to 8 are left to train)
    """
    def fires(fault: Fault, first: int) -> bool:  # at some step from `first` to `steps`
        if fault.rate is not None:
            return first <= steps
        if fault.every is not None:
            return steps // fault.every * fault.every >= first
        return any(first <= step <= steps for step in fault.steps)

    for fault in faults:
        if fires(fault, start):
            continue
        if fires(fault, 1):  # (it would have, had the run not resumed past it)
            raise ValueError(f"fault {_shown(fault.spec())} never fires: the run resumes after step {start - 1} (its steps "
                             f"{start} to {steps} are left to train)")
        raise ValueError(f"fault {_shown(fault.spec())} never fires: the run has {counted(steps, 'step')} (config steps; a step "
                         "counts optimizer steps, not micro-batches); drop it (given with --inject: leave it out; from a "
                         "config: --inject none, or --set inject=[...])")


def parse_faults(specs: Iterable[str], *, seed: int, steps: int, world_size: int = 1, start: int = 1) -> list[Fault]:
    """A run's ``inject`` list, parsed and checked against the steps it trains (``start`` to
    ``steps``) and its ranks (:func:`check_steps`, :func:`check_ranks`); a fault that cannot fire
    is one :class:`~ampguard.errors.InputError` line.

    Example::

        >>> [f.spec() for f in parse_faults(["nan_loss@3"], seed=0, steps=5)]
        ['nan_loss@3']
        >>> parse_faults(["nan_loss@3@rank1"], seed=0, steps=5)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: inject: fault 'nan_loss@3@rank1' targets rank 1, but this run has 1 process (rank 0 only; torchrun --nproc_per_node sets more)
    """
    faults = [parse_fault(spec, seed=seed) for spec in specs]
    try:
        check_ranks(faults, world_size)
        check_steps(faults, steps, start)
    except ValueError as err:
        raise InputError(f"inject: {err}") from None
    return faults
