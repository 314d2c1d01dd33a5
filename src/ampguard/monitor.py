"""Run health from the stream of step records: rolling skip rate, alerts, fail-fast, scale health.

Everything here reads records after the step made them (it is a sink); nothing runs inside the
step. Each piece keeps O(1) work per step and a ``state_dict`` so a resumed run continues its
windows exactly (the scale-health label reads its window, O(window), only when asked: the
``STATS`` line and the run card). The labels are the table in docs/design.md, "Scale health".

The rolling skip rate is the share of skipped steps among the steps the window holds: while
the window has not filled yet, that is the steps seen so far (25 skips in the first 25 steps is
a rate of 1.0, not 25/window). A run failing from its first step is therefore caught after
``fail_after`` steps, not after the window has filled with evidence. The ALERT and the fail-fast
judge that rate with the fp16 scaler's opening search set aside (its gradient overflows from
step 1 down from ``init_scale`` until a step applies, the warm-up scale health labels
``warming``; with other skips beside it, at least the window's skips over its full size: the
rate the full window will read, the seed's), and the ALERT waits for ``min_steps`` steps, so a healthy fp16 start raises neither.

A failure is typed: ``Event.kind == "fail"`` and ``Event.cause`` is one of :data:`FAIL_CAUSES`
(:data:`FAIL_SKIP_RATE`, :data:`FAIL_SCALE_COLLAPSE`); nothing downstream has to read the
message to know which guard tripped.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .clipping import clip_threshold
from .errors import DEFAULT_MIN_STEPS, brief, counted, real_number, whole_number
from .precision import MAX_SCALE, finite_number, round_float32
from .records import StepRecord

HEALTH_VERDICTS: tuple[str, ...] = ("warming", "climbing", "stable", "oscillating", "collapsing")

AT_THE_END = "at the end of the run (step "
"""How a run's end says the guard stopped it for what its judgement at the end found
(:meth:`RunMonitor.at_end`): ``stopped by the guard at the end of the run (step N): ...`` (a
trainer's, a callback's ``by a guard``); ``report`` reads it back (``report.judged_at_end``)."""
FAIL_SKIP_RATE = "skip_rate"
"""``Event.cause`` of a fail-fast on the rolling skip rate (above ``fail_rate`` for ``fail_after`` steps)."""
FAIL_SCALE_COLLAPSE = "scale_collapse"
"""``Event.cause`` of a fail-fast on the loss scale (at its floor and skipping for ``fail_after`` steps)."""
FAIL_NON_FINITE_UPDATE = "non_finite_update"
"""``Event.cause`` of a stock HF ``Trainer``'s failure (the integration's callback, not a monitor
rule: the step was not skipped): an update it applied made the weights non-finite."""
FAIL_CAUSES: tuple[str, ...] = (FAIL_SKIP_RATE, FAIL_SCALE_COLLAPSE, FAIL_NON_FINITE_UPDATE)
"""Every cause a failure event can carry."""

CLEAR_FRACTION = 0.8
"""A skip-rate ALERT clears when the judged rate falls to ``clear_rate`` or below, by default
this fraction of ``alert_rate`` (``monitor.clear_rate``): a rate that hovers at the threshold
(k/n of a young window rises with each skip and falls between them) pages once, not once per
skip. ``clear_rate == alert_rate`` clears as soon as the rate is back at the threshold."""


# Every double is a whole multiple of 2**-1074, so sums kept as integers in those units are
# exact, and converting back divides once, correctly rounded: a window's total is always what
# math.fsum of the values it holds would give, however long the run. (The 1.0s, the skip and
# clip windows' flags pushed every step, are counted apart, as a plain int: review 54o.)
_UNITS = 2**1074


def _exact(value: float) -> int:
    num, den = float(value).as_integer_ratio()
    return num * (_UNITS // den)


# ---------------------------------------------------------------------------- checking a saved state
# A state comes from a checkpoint file: each load_state_dict checks every field it takes
# (check_state, which a resume also calls up front, naming the whole field) before it changes
# anything, and raises ValueError naming the field, so a corrupt or hostile file is one line at
# resume (the checkpoint manager's InputError) rather than a traceback mid-run.


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _number_or_none(value: Any) -> bool:
    return value is None or finite_number(value)


def _names_to(value: Any, test: Callable[[Any], bool]) -> bool:
    """A mapping of str names to values that pass ``test``."""
    return isinstance(value, dict) and all(isinstance(k, str) and test(v) for k, v in value.items())


def _need(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} is {brief(value)}, expected {expected}")


def _mapping(state: Any, where: str) -> None:
    """``state`` is a mapping (``where``: its name, ``""`` for a state of its own)."""
    _need(isinstance(state, dict), where.rstrip(".") or "the state", state, "a mapping")


def _get(state: dict[str, Any], key: str, where: str) -> Any:
    if key not in state:
        raise ValueError(f"{where}{key} is missing")
    return state[key]


class RollingWindow:
    """The sum of the last ``size`` values pushed, kept exactly in O(1) per push (a ring buffer).

    Two averages: ``seen_mean`` divides by the values the window holds (what the monitor
    judges), ``mean`` by ``size`` whether or not the window has filled (steps before the first
    count as zeros).

    Example::

        >>> w = RollingWindow(4)
        >>> w.push(1)
        >>> w.seen_mean, w.mean  # one value held: a rate of 1 over what was seen
        (1.0, 0.25)
        >>> for v in (0, 1, 1, 0):
        ...     w.push(v)
        >>> w.total, w.seen_mean, w.mean, w.count  # full: the first 1 has left
        (2.0, 0.5, 0.5, 5)
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._ring = [0.0] * size
        self._pos = 0
        self.count = 0  # values pushed in all
        self._ones = 0  # the 1.0s the window holds (a skip's, a clip's flag): counted, no big integers
        self._sum = 0  # the other values' sum, exact, in units of 2**-1074

    @property
    def total(self) -> float:
        """The exact sum of the values the window holds.

        Example::

            >>> w = RollingWindow(2)
            >>> for v in (0.1, 0.2, 0.3):
            ...     w.push(v)
            >>> w.total == math.fsum([0.2, 0.3])
            True
            >>> w.push(1); w.total == math.fsum([0.3, 1.0])
            True
        """
        if not self._sum:  # (0/1 flags alone: the count of 1s, exact)
            return float(self._ones)
        return (self._ones * _UNITS + self._sum) / _UNITS  # (one division, correctly rounded)

    @property
    def held(self) -> int:
        """How many values the window holds: ``min(count, size)``.

        Example::

            >>> w = RollingWindow(3)
            >>> [w.push(1) or w.held for _ in range(4)]
            [1, 2, 3, 3]
        """
        return min(self.count, self.size)

    def push(self, value: float) -> None:
        """Add ``value``; once full, the oldest value leaves.

        Example::

            >>> w = RollingWindow(2)
            >>> w.push(1); w.push(1); w.push(0)
            >>> w.total, w.count
            (1.0, 3)
        """
        value, old = float(value), self._ring[self._pos]
        if value == 1.0:
            self._ones += 1
        elif value:  # (0.0 adds nothing)
            self._sum += _exact(value)
        if old == 1.0:
            self._ones -= 1
        elif old:
            self._sum -= _exact(old)
        self._ring[self._pos] = value
        self._pos = (self._pos + 1) % self.size
        self.count += 1

    @property
    def mean(self) -> float:
        """Sum over the window divided by the window's size (steps before the first are zeros).

        Example::

            >>> w = RollingWindow(1000)
            >>> for _ in range(25):
            ...     w.push(1)
            >>> w.mean
            0.025
        """
        return self.total / self.size

    @property
    def seen_mean(self) -> float:
        """Sum over the window divided by the values it holds so far (0 when empty).

        Example::

            >>> w = RollingWindow(1000)
            >>> w.seen_mean
            0.0
            >>> for _ in range(25):
            ...     w.push(1)
            >>> w.seen_mean  # 25 skips in the first 25 steps
            1.0
        """
        held = self.held
        return self.total / held if held else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe) from which :meth:`load_state_dict` continues identically.

        Example::

            >>> w = RollingWindow(3)
            >>> w.push(1)
            >>> w.state_dict()
            {'size': 3, 'ring': [1.0, 0.0, 0.0], 'pos': 1, 'count': 1}
        """
        return {"size": self.size, "ring": list(self._ring), "pos": self._pos, "count": self.count}

    def check_state(self, state: Any, where: str = "") -> None:
        """Raise ``ValueError`` naming the field (after the prefix ``where``) unless ``state`` is
        a state this window can load: its size, a ring of that many finite numbers, a position in
        it, a count >= 0 that ends at the position (each push moves both on by one).

        Example::

            >>> w = RollingWindow(3)
            >>> w.check_state({**w.state_dict(), "pos": 3}, "skip_window.")
            Traceback (most recent call last):
            ...
            ValueError: skip_window.pos is 3, expected an int in [0, 3)
            >>> w.check_state({**w.state_dict(), "count": 10**6}, "skip_window.")
            Traceback (most recent call last):
            ...
            ValueError: skip_window.count is 1000000, expected an int >= 0 that ends at pos 0 (pos = count mod 3)
        """
        _mapping(state, where)
        size = _get(state, "size", where)
        if size != self.size:
            raise ValueError(f"{where.rstrip('.') or 'window'} was saved with size {brief(size)}, this one has "
                             f"{self.size}")
        ring = _get(state, "ring", where)
        _need(isinstance(ring, list) and len(ring) == self.size and all(finite_number(v) for v in ring),
              f"{where}ring", ring, f"a list of {self.size} finite numbers")
        pos = _get(state, "pos", where)
        _need(whole_number(pos) and pos < self.size, f"{where}pos", pos, f"an int in [0, {self.size})")
        count = _get(state, "count", where)
        # (each push moves pos on by one: a count that does not end where pos is was not written by one)
        _need(whole_number(count) and count % self.size == pos, f"{where}count", count,
              f"an int >= 0 that ends at pos {pos} (pos = count mod {self.size})")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; a window of another size, or a field that is not what
        :meth:`state_dict` writes, is refused (``ValueError``, this window untouched).

        Example::

            >>> a = RollingWindow(3)
            >>> a.push(1); a.push(0)
            >>> b = RollingWindow(3)
            >>> b.load_state_dict(a.state_dict())
            >>> b.push(1); a.push(1)
            >>> (b.total, b.seen_mean, b.count) == (a.total, a.seen_mean, a.count)
            True
        """
        self.check_state(state)
        self._ring = [float(v) for v in state["ring"]]
        self._pos = int(state["pos"])
        self.count = int(state["count"])
        self._ones = sum(v == 1.0 for v in self._ring)
        self._sum = sum(_exact(v) for v in self._ring if v != 1.0)


@dataclass
class Event:
    """Something a person should hear about: an alert starting or clearing, a failure.

    ``kind`` is one of ``skip_rate_alert``, ``skip_rate_clear``, ``scale_alert``,
    ``scale_clear``, ``fail``. A ``fail`` event carries its ``cause``, one of
    :data:`FAIL_CAUSES` (which guard tripped); other events have none. :meth:`as_dict` is the
    line written to ``events.jsonl``.

    Example::

        >>> e = Event(3, "fail", "rolling skip rate above fail_rate 0.5 for 3 consecutive steps",
        ...           {"skip_rate": 1.0, "window": 1000}, cause=FAIL_SKIP_RATE)
        >>> e.as_dict()["cause"], e.as_dict()["event"], e.as_dict()["skip_rate"]
        ('skip_rate', 'fail', 1.0)
        >>> "cause" in Event(5, "skip_rate_alert", "...").as_dict()
        False
        >>> Event(3, "fail", "no cause")
        Traceback (most recent call last):
        ...
        ValueError: a fail event needs a cause (one of skip_rate, scale_collapse, non_finite_update), got None
    """

    step: int
    kind: str  # skip_rate_alert | skip_rate_clear | scale_alert | scale_clear | fail
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    cause: str | None = None  # fail events: one of FAIL_CAUSES

    def __post_init__(self) -> None:
        if self.kind == "fail" and self.cause not in FAIL_CAUSES:
            raise ValueError(f"a fail event needs a cause (one of {', '.join(FAIL_CAUSES)}), got {self.cause!r}")

    def as_dict(self) -> dict[str, Any]:
        """``{"step", "event", "message"[, "cause"], **data}``: one ``events.jsonl`` line.

        Example::

            >>> Event(7, "scale_clear", "loss scale back to 2", {"scale": 2.0}).as_dict()
            {'step': 7, 'event': 'scale_clear', 'message': 'loss scale back to 2', 'scale': 2.0}
        """
        head: dict[str, Any] = {"step": self.step, "event": self.kind, "message": self.message}
        if self.cause is not None:
            head["cause"] = self.cause
        return {**head, **self.data}


COLLAPSE_STREAK = 8
"""The longest streak of skipped steps that is not yet ``collapsing`` while it goes on.

More than 8 skipped steps in a row (a scale 256x lower) is a run that skips every step:
``collapsing`` while the streak lasts, at the start of a run too. The run's opening streak of
skips, the scaler's search down from ``init_scale`` (one halving per skipped step), is a warm-up
once a step applies, however long it was, unless it reached the floor ``min_scale`` (then it
found no scale fp16 can hold; from the default 2**16 to the floor 1.0 that is 16 halvings).
"""
OSCILLATION_OCTAVES = 2.0
"""``oscillating`` needs the level the steps apply at to fall this many octaves (powers of two)
from an earlier high, climb as many back, and fall again: three legs, each within
:attr:`ScaleHealth.reach` steps of the one before (:meth:`ScaleHealth.swings`). One octave is
the healthy equilibrium (the scaler's growth probe, 2**18, overflows at once and the steps apply
at 2**17), and one stray skip at the working level is one more: neither is a leg."""
COLLAPSE_OCTAVES = 3.0
"""``collapsing``: the scale ended the window this many octaves (8x) or more below where it began."""
SETTLE_STEPS = 8
"""The fewest applied steps in a row at one scale that make it a level the scaler settled at
(:attr:`ScaleHealth.settle`). The scaler grows after ``growth_interval`` clean steps, so with a
growth interval below 8 no scale holds that long and ``oscillating`` is not judged: its probe
and a level it sat at look alike (review 47d: at 1 to 5, healthy runs read ``oscillating``)."""
SPAN_REACHES = 4
"""How far back :class:`ScaleHealth` keeps the applied levels, in :attr:`~ScaleHealth.reach` es:
three legs, each within a reach of the one before and the last within a reach of now, and the
high the first fell from."""


def _swing_needed(ups: Mapping[float, int], downs: Mapping[float, int]) -> float:
    """The octaves a leg (a fall or a climb of the applied level) must span:
    :data:`OSCILLATION_OCTAVES`, and more than the scaler's routine move, one step's backoff or
    growth (with ``backoff_factor`` 0.25 or ``growth_factor`` 4 one routine move is 2 octaves:
    review 46e): the commonest size of a single move down (``downs``, octaves -> count) and of a
    single move up (``ups``), the larger of the two (review 46f: the largest move, one scale set
    8x higher, a checkpoint's restored, made every swing need more than 3 octaves and hid a real
    oscillation).

    Example::

        >>> _swing_needed({1.0: 5}, {1.0: 6}) == OSCILLATION_OCTAVES - 1e-9
        True
        >>> _swing_needed({1.0: 5}, {2.0: 6}) > 2.0  # (backoff 0.25: 2 octaves a backoff)
        True
        >>> _swing_needed({1.0: 5, 3.0: 1}, {1.0: 4}) < 2.0  # (one jump of 3 among growths of 1)
        True
    """
    one_move = max((max(sizes.items(), key=lambda item: (item[1], item[0]))[0] for sizes in (ups, downs) if sizes),
                   default=0.0)  # (each direction's commonest move; a tie: the larger)
    eps = 1e-9  # (octaves of non-power-of-two factors are not exact)
    return OSCILLATION_OCTAVES - eps if one_move < OSCILLATION_OCTAVES - eps else one_move + eps


@dataclass(frozen=True)
class ScaleStats:
    """What the loss scale did over the window, in octaves (factors of two), warm-up set aside.

    - ``swing``: octaves between the highest and the lowest scale;
    - ``fall``: the largest drop from an earlier high; ``rise``: the largest climb from an
      earlier low;
    - ``trend``: net octaves from the window's start to now (negative: it fell);
    - ``headroom``: octaves above the floor ``min_scale`` (0 at the floor);
    - ``skip_share``: skipped steps over the steps the window holds (warm-up included);
    - ``streak``: skipped steps in a row up to now;
    - ``warmup``: the opening skips set aside as warm-up (0 when none is in the window).

    Example::

        >>> ScaleStats(swing=1.0, fall=1.0, rise=1.0, trend=0.0, headroom=17.0, skip_share=0.01, streak=0,
        ...            warmup=0).fall
        1.0
    """

    swing: float
    fall: float
    rise: float
    trend: float
    headroom: float
    skip_share: float
    streak: int
    warmup: int


class ScaleHealth:
    """Labels the loss-scale history of the last ``window`` steps (the table in docs/design.md,
    "Scale health"). First that holds:

    - ``collapsing``: the scale is at (or below) its floor ``min_scale``; or more than
      :data:`COLLAPSE_STREAK` (8) steps in a row were skipped, the opening streak too while it
      lasts; or (after ``oscillating``) it ended the window :data:`COLLAPSE_OCTAVES` (3) or more
      octaves below where the window began;
    - ``warming``: every move in the window belongs to the warm-up: the run's opening streak of
      skips (the search down from ``init_scale``), unless that streak reached the floor (a
      streak of more than 8 is ``collapsing`` while it lasts: warm-up only once a step applies);
    - ``oscillating`` (after the floor and the streak, before the rest: a fall that repeats a
      swing is the swing, not a first collapse): gradients sometimes fit fp16, sometimes not.
      The level the steps apply at (the scale before each applied step: the scaler's growth
      probe, which overflows at once, never is one) fell :data:`OSCILLATION_OCTAVES` (2) or more
      octaves, climbed as many back and fell again (:meth:`swings`: three legs, each more than
      one of the scaler's own moves, each within :attr:`reach` steps of the one before, the
      last within :attr:`reach` of now). Not a stray skip at the working level, nor two far
      apart, nor the equilibrium's probes (review 47a: measured on every scale, a probe's
      overflow and one stray skip read as a 2-octave fall, and healthy runs read
      ``oscillating``), nor one dip and its climb back (review 46c);
    - ``climbing``: the scale rose in the window to the highest it has been since the warm-up,
      and has not fallen since it first got there (the scaler has not yet met the gradients'
      limit); back at a level it fell from before is the equilibrium, not a climb;
    - ``stable``: otherwise: no move, or moves within an octave (2**17 <-> 2**18, the healthy
      equilibrium), or a fall of less than 3 octaves that does not repeat a swing.

    A warm-up in the window is set aside: the other labels judge the steps after it. ``min_scale``
    is the scaler's floor (``scaler.min_scale``): the scale is clamped there and goes no lower.
    :meth:`push` is O(1) per step; :attr:`verdict` reads the window's ends (all of it only while
    a warm-up is in it), so a tracker may ask every step; :meth:`stats` reads the window,
    O(window), for the log interval and the run card.

    Example::

        >>> h = ScaleHealth(8, min_scale=1.0, init_scale=8.0)
        >>> verdicts = []
        >>> for scale, skipped in [(8.0, False), (4.0, True), (2.0, True), (1.0, True), (1.0, True)]:
        ...     h.push(scale, skipped)
        ...     verdicts.append(h.verdict)
        >>> verdicts
        ['stable', 'stable', 'stable', 'collapsing', 'collapsing']
    """

    def __init__(self, window: int, min_scale: float = 1.0, init_scale: float | None = None,
                 growth_interval: int | None = None) -> None:
        self.window = window
        self.reach = self.settle = 0
        self.growth_interval = growth_interval
        self._run: tuple[float | None, int] = (None, 0)  # (the scale the last steps applied at, how many in a row)
        self._ends: tuple[Any, list[int]] = (None, [])  # (what the legs were worked out from, the legs: swings())
        # the levels the scaler settled at, each time it changes after the opening, as (pushes, level);
        # the first is the one in effect at the kept span's start (:data:`SPAN_REACHES` reaches back)
        self._levels: deque[tuple[int, float]] = deque()
        # the sizes of the scaler's single moves, in octaves (rounded) -> how often: a growth, a backoff
        self._ups: Counter[float] = Counter()
        self._downs: Counter[float] = Counter()
        self.min_scale = min_scale
        self._floor = round_float32(min_scale)
        # the scale before the window's first step, then the scale after each of its steps
        self._scales: deque[float] = deque([] if init_scale is None else [float(init_scale)], maxlen=window + 1)
        self._skipped = RollingWindow(window)
        self.scale: float | None = init_scale  # the scale before the next step
        self.opening = 0  # length of the run's opening streak of skips (from step 1)
        self._opening = True  # that streak is still going
        self.opening_floored = False  # that streak reached the floor: no warm-up, a collapse
        self.streak = 0  # skipped steps in a row up to the last one
        self.peak: float | None = None  # the highest scale since the opening streak
        self._fell = False  # the scale fell since it first reached `peak`
        self._verdict: str | None = None  # the verdict as of the last push (None: not worked out yet)

    @property
    def growth_interval(self) -> int | None:
        """The scaler's ``growth_interval`` (None: not told), which sets :attr:`reach` and
        :attr:`settle`; a resume that changes it sets it here (``report`` replays the change)."""
        return self._growth_interval

    @growth_interval.setter
    def growth_interval(self, growth_interval: int | None) -> None:
        self._growth_interval = growth_interval
        self.reach = self.window + 4 * math.ceil(OSCILLATION_OCTAVES) * growth_interval if growth_interval \
            else self.window
        """The most steps between two legs of a swing, and between its last leg and now
        (:meth:`swings`): the window, and four climbs of :data:`OSCILLATION_OCTAVES` at
        ``growth_interval`` clean steps an octave when it is given (17,000 steps with
        ``train``'s defaults: a scaler that grows once in 2000 steps needs 4000 to climb a leg)."""
        self.settle = max(SETTLE_STEPS, growth_interval // 2) if growth_interval else SETTLE_STEPS
        """Applied steps in a row at one scale that make it a level the scaler settled at (half a
        growth interval, and at least :data:`SETTLE_STEPS`: the growth probe, which overflows
        within a few steps, never is one)."""
        self._verdict = None

    @property
    def at_floor(self) -> bool:
        """True when the last scale pushed is at (or below) ``min_scale``.

        Example::

            >>> import torch
            >>> h = ScaleHealth(4, min_scale=0.1, init_scale=1.0)
            >>> h.push(float(torch.tensor(0.1)), True)  # the float32 floor reads back as 0.10000000149...
            >>> h.at_floor
            True
        """
        return self.scale is not None and self.scale <= self._floor

    def push(self, scale: float, skipped: bool, search: bool = True) -> None:
        """Record the scale after a step's ``update()`` and whether the step was skipped;
        ``search``: a skip for a gradient overflow, the scaler's search. A skip for a non-finite
        loss is none: it ends the opening warm-up (a run whose losses are NaN is not warming up).

        Example::

            >>> h = ScaleHealth(4, init_scale=1024.0)
            >>> h.push(512.0, True)
            >>> h.scale, h.verdict
            (512.0, 'warming')
            >>> h = ScaleHealth(4, init_scale=1024.0)
            >>> h.push(512.0, True, search=False)
            >>> h.verdict
            'stable'
        """
        self._verdict = None
        before = self.scale  # (the scale this step ran at)
        self._opening = self._opening and bool(skipped) and search
        self.opening += self._opening
        self.opening_floored = self.opening_floored or (self._opening and scale <= self._floor)
        self.streak = self.streak + 1 if skipped else 0
        if not self._opening:
            if self.peak is None or scale > self.peak:
                self.peak, self._fell = scale, False
            elif self.scale is not None and scale < self.scale:
                self._fell = True
        self._scales.append(float(scale))
        self._skipped.push(float(bool(skipped)))
        self.scale = scale
        known = before is not None and 0 < before < math.inf  # (a CSV's may be anything a float reads)
        if known and 0 < scale < math.inf and scale != before:
            octaves = round(abs(math.log2(scale) - math.log2(before)), 6)
            (self._downs if scale < before else self._ups)[octaves] += 1
        if skipped or self._opening or not known:
            self._run = (None, 0)
        else:  # (an applied step: how many in a row at this scale)
            self._run = (before, self._run[1] + 1 if self._run[0] == before else 1)
        if self._run[1] >= self.settle:  # (the steps have applied there long enough: a level it settled at)
            levels, count = self._levels, self._skipped.count
            if not levels or levels[-1][1] != before:
                levels.append((count, float(before)))
            while len(levels) > 1 and levels[1][0] <= count - SPAN_REACHES * self.reach:  # (the first: the level
                levels.popleft()                                                        # at the span's start)

    def _judged_start(self) -> tuple[int, int]:
        """(warm-up skips set aside, the index in the window's scales the judged ones start at):
        O(1), so the verdict reads no more of the window than its ends."""
        if self.opening < 1 or self.opening_floored:
            return 0, 0
        # scales[j] is the scale after step count - (len - 1 - j); the warm-up ends after step `opening`
        end = self.opening - self._skipped.count + len(self._scales) - 1
        if end < 1:  # no move of the warm-up is in the window any more
            return 0, 0
        return min(self.opening, end), end

    def _judged(self) -> tuple[int, list[float]]:
        """(warm-up skips set aside, the scales judged): the window's scales after the warm-up."""
        warmup, start = self._judged_start()
        return warmup, list(self._scales)[start:]

    def stats(self) -> ScaleStats:
        """The measures the labels are defined by (see :class:`ScaleStats`), over the window.

        Example (the healthy equilibrium: 2**17 and 2**18 in turn)::

            >>> h = ScaleHealth(100, init_scale=2.0**17)
            >>> for i in range(40):
            ...     h.push(2.0**18 if i % 10 < 5 else 2.0**17, i % 10 == 5)
            >>> s = h.stats()
            >>> s.swing, s.fall, s.rise, s.trend, s.headroom, s.skip_share, h.verdict
            (1.0, 1.0, 1.0, 0.0, 17.0, 0.1, 'stable')
        """
        return self._stats_of(*self._window_logs())

    def _window_logs(self) -> tuple[int, list[float]]:
        """(warm-up skips set aside, the judged scales in octaves from the first): one walk of the
        window, for :meth:`stats` and, while a warm-up is in it, the verdict's ``warming``."""
        warmup, scales = self._judged()
        return warmup, [math.log2(s / scales[0]) if scales[0] > 0 and s > 0 else 0.0 for s in scales] or [0.0]

    def _stats_of(self, warmup: int, logs: list[float]) -> ScaleStats:
        fall = rise = 0.0
        high = low = logs[0]
        for x in logs:
            high, low = max(high, x), min(low, x)
            fall, rise = max(fall, high - x), max(rise, x - low)
        headroom = 0.0 if self.at_floor or self.scale is None else math.log2(self.scale / self.min_scale)
        return ScaleStats(swing=max(logs) - min(logs), fall=fall, rise=rise, trend=logs[-1] - logs[0],
                          headroom=headroom, skip_share=self._skipped.seen_mean, streak=self.streak, warmup=warmup)

    def swings(self) -> int:
        """The legs of the swing going on now: falls and climbs of the level the steps apply at,
        alternating from a fall, each spanning 2 octaves or more (:data:`OSCILLATION_OCTAVES`)
        and more than one of the scaler's own moves, measured from the extreme since the leg
        before; counted back from the last while each is within :attr:`reach` steps of the one
        before, the last within :attr:`reach` of now (0 when it is older). ``oscillating`` takes 3
        (down, up, down): the swing repeated; a single dip and its climb back (2 legs) is a
        scaler that met one bad stretch (review 46d); the climb before the first fall is the
        scaler finding its limit, no leg.

        Example (the scaler grows once in 20 steps: 10 applied steps in a row settle a level)::

            >>> h = ScaleHealth(5, init_scale=2.0**18, growth_interval=20)
            >>> h.reach, h.settle
            (165, 10)
            >>> def at(scale, steps):  # steps that apply, the scale after each
            ...     for _ in range(steps):
            ...         h.push(scale, False)
            >>> def dip():  # 2**18 -> 2**16 in two overflows, settled there, then back up
            ...     h.push(2.0**17, True); h.push(2.0**16, True)
            ...     at(2.0**16, 20); at(2.0**17, 20); at(2.0**18, 20)
            >>> at(2.0**18, 20); dip()
            >>> h.swings(), h.verdict  # (one dip and its climb back)
            (2, 'stable')
            >>> h.push(2.0**17, True); h.push(2.0**16, True); at(2.0**16, 10)
            >>> h.swings(), h.verdict  # (down again, settled there: the swing repeats)
            (3, 'oscillating')
        """
        need = _swing_needed(self._ups, self._downs)
        key = (len(self._levels), self._levels[0] if self._levels else None, self._levels[-1] if self._levels else None,
               need)
        if self._ends[0] != key:  # (the legs change only with the levels kept: O(levels) then, O(legs) a verdict)
            self._ends = (key, self._legs(need))
        ends = self._ends[1]
        if not ends or ends[-1] <= self._skipped.count - self.reach:
            return 0
        legs = 1
        while legs < len(ends) and ends[-legs] - ends[-legs - 1] < self.reach:
            legs += 1
        return legs

    def _legs(self, need: float) -> list[int]:
        """The push count at which each leg of the levels kept reached ``need`` octaves."""
        ends: list[int] = []  # the push count at which each leg reached its 2 octaves
        falling = None  # (the direction of the last leg; None: no fall yet)
        high = low = None
        for count, level in self._levels:
            x = math.log2(level)
            high, low = (x, x) if high is None else (max(high, x), min(low, x))
            if falling is not True and x <= high - need:
                ends, falling, low = ends + [count], True, x
            elif falling is True and x >= low + need:  # (a climb counts after a fall only: the climb to
                ends, falling, high = ends + [count], False, x  # the scaler's limit is none)
        return ends

    @property
    def verdict(self) -> str:
        """One of :data:`HEALTH_VERDICTS` for the window as it stands (worked out once per
        :meth:`push`: it walks the window, and a tracker asks for it every step).

        Example::

            >>> h = ScaleHealth(4, init_scale=1024.0)
            >>> h.push(2048.0, False)
            >>> h.verdict
            'climbing'
        """
        if self._verdict is None:
            self._verdict = self._judge()
        return self._verdict

    def _judge(self) -> str:
        if self.at_floor and self._skipped.seen_mean > 0:  # (at the floor and still skipping: a run started
            return "collapsing"                             # at it whose steps apply is not collapsing)
        if self.streak > COLLAPSE_STREAK:
            return "collapsing"
        if self.swings() >= 3:
            return "oscillating"
        # the window's ends (O(1): a tracker asks every step, and a walk of the window took ~1 ms at 1000)
        if not self._scales:  # (no scale yet: no init_scale, no step)
            return "stable"
        warmup, start = self._judged_start()
        first, last = self._scales[start], self._scales[-1]
        trend = math.log2(last / first) if first > 0 and last > 0 else 0.0  # (as ScaleStats.trend)
        eps = 1e-9  # octaves of non-power-of-two growth factors are not exact
        if trend <= -COLLAPSE_OCTAVES + eps:
            return "collapsing"
        if warmup and self._stats_of(*self._window_logs()).swing == 0:  # (O(window): while a warm-up is in it)
            return "warming"
        if trend > eps and not self._fell and self.scale == self.peak:
            return "climbing"
        return "stable"

    def state_dict(self) -> dict[str, Any]:
        """Plain data from which :meth:`load_state_dict` continues identically.

        Example::

            >>> a = ScaleHealth(3, init_scale=4.0)
            >>> a.push(2.0, True)
            >>> b = ScaleHealth(3, init_scale=4.0)
            >>> b.load_state_dict(a.state_dict())
            >>> (b.scale, b.verdict) == (a.scale, a.verdict) == (2.0, "warming")
            True
        """
        return {
            "scales": list(self._scales),
            "skipped": self._skipped.state_dict(),
            "scale": self.scale,
            "opening": self.opening,
            "opening_open": self._opening,
            "opening_floored": self.opening_floored,
            "streak": self.streak,
            "peak": self.peak,
            "fell": self._fell,
            "levels": [[count, level] for count, level in self._levels],
            "run": [self._run[0], self._run[1]],
            "ups": [[octaves, n] for octaves, n in sorted(self._ups.items())],
            "downs": [[octaves, n] for octaves, n in sorted(self._downs.items())],
        }

    _FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
        ("opening", whole_number, "an int >= 0"),
        ("opening_open", _flag, "True or False"),
        ("streak", whole_number, "an int >= 0"),
        ("peak", _number_or_none, "a finite number or None"),
        ("fell", _flag, "True or False"),
    )
    """The fields of a state (besides the scales and the window) and what each must be."""

    def check_state(self, state: Any, where: str = "") -> None:
        """Raise ``ValueError`` naming the field (after the prefix ``where``) unless ``state`` is
        one :meth:`load_state_dict` can take (either layout).

        Example::

            >>> h = ScaleHealth(3, init_scale=4.0)
            >>> h.check_state({**h.state_dict(), "streak": -1}, "health.")
            Traceback (most recent call last):
            ...
            ValueError: health.streak is -1, expected an int >= 0
        """
        _mapping(state, where)
        _need(_number_or_none(_get(state, "scale", where)), f"{where}scale", state["scale"], "a finite number or None")
        if "scales" not in state:  # the older layout
            windows = _get(state, "windows", where)
            ups = windows.get("ups") if isinstance(windows, dict) else None
            count = ups.get("count") if isinstance(ups, dict) else None
            _need(whole_number(count), f"{where}windows.ups.count", count, "an int >= 0")
            _need(_flag(_get(state, "opening", where)), f"{where}opening", state["opening"], "True or False")
            return
        scales = state["scales"]
        _need(isinstance(scales, list) and len(scales) <= self.window + 1 and all(finite_number(v) for v in scales),
              f"{where}scales", scales, f"a list of at most {self.window + 1} finite numbers")
        self._skipped.check_state(_get(state, "skipped", where), f"{where}skipped.")
        for key, test, expected in self._FIELDS:
            _need(test(_get(state, key, where)), f"{where}{key}", state[key], expected)
        if "opening_floored" in state:  # (saved since the warm-up ends at the floor, not after 8 skips)
            _need(_flag(state["opening_floored"]), f"{where}opening_floored", state["opening_floored"], "True or False")
        if "levels" in state:  # (saved since oscillating judges the applied level: review 47a)
            levels = state["levels"]
            count = state["skipped"].get("count")  # (the skipped window's state, checked above)
            _need(isinstance(levels, list) and all(
                isinstance(m, list) and len(m) == 2 and whole_number(m[0]) and finite_number(m[1])
                and 0 < m[1] <= MAX_SCALE for m in levels)
                and [m[0] for m in levels] == sorted({m[0] for m in levels})
                and all(a[1] != b[1] for a, b in zip(levels, levels[1:]))
                and (not levels or not whole_number(count) or levels[-1][0] <= count),
                f"{where}levels", levels, "a list of [step, level] pairs, steps rising to at most the count, each "
                "level in (0, 3.4e38] and not the one before")
            run = _get(state, "run", where)
            _need(isinstance(run, list) and len(run) == 2 and (run[0] is None or (
                finite_number(run[0]) and 0 < run[0] <= MAX_SCALE)) and whole_number(run[1])
                and (run[0] is None) == (run[1] == 0), f"{where}run", run,
                "[the scale the last steps applied at, how many in a row] ([None, 0] after a skip)")
            for key in ("ups", "downs"):
                sizes = _get(state, key, where)
                _need(isinstance(sizes, list) and all(
                    isinstance(m, list) and len(m) == 2 and finite_number(m[0]) and 0 < m[0] <= 300
                    and whole_number(m[1]) and m[1] >= 1 for m in sizes) and len({m[0] for m in sizes}) == len(sizes),
                    f"{where}{key}", sizes, "a list of [octaves, count] pairs, octaves in (0, 300], each once, "
                    "counts >= 1")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. A state saved before the window kept its scales (it kept
        counts of moves) restarts the history at its last scale. A field that is not what
        :meth:`state_dict` writes is refused (``ValueError``, see :meth:`check_state`).

        Example::

            >>> h = ScaleHealth(3, init_scale=4.0)
            >>> h.load_state_dict({"windows": {"ups": {"count": 5}}, "scale": 2.0, "opening": False})
            >>> h.scale, h.verdict
            (2.0, 'stable')
        """
        self.check_state(state)
        self._verdict = None
        self.scale = state["scale"]
        if "scales" not in state:  # the older layout: counts of moves, no scales
            count = int(state["windows"]["ups"]["count"])
            self._scales = deque([] if self.scale is None else [float(self.scale)], maxlen=self.window + 1)
            self._skipped = RollingWindow(self.window)
            self._skipped.count = count
            self._opening = bool(state["opening"])
            self.opening = count if self._opening else 0
            self.opening_floored = False
            self.streak = self.opening
            self.peak, self._fell = (None if self._opening else self.scale), False
            self._levels, self._ups, self._downs, self._run = deque(), Counter(), Counter(), (None, 0)
            self._ends = (None, [])
            return
        self._scales = deque((float(s) for s in state["scales"]), maxlen=self.window + 1)
        self._skipped.load_state_dict(state["skipped"])
        self.opening = int(state["opening"])
        self._opening = bool(state["opening_open"])
        self.opening_floored = bool(state.get("opening_floored", False))
        self.streak = int(state["streak"])
        self.peak = state["peak"]
        self._fell = bool(state["fell"])
        # (a state saved before the levels were kept: the span starts again from here)
        self._levels = deque((int(c), float(v)) for c, v in state.get("levels", []))
        self._ends = (None, [])
        level, run = state.get("run", [None, 0])
        self._run = (None if level is None else float(level), int(run))
        self._ups = Counter({float(o): int(n) for o, n in state.get("ups", [])})
        self._downs = Counter({float(o): int(n) for o, n in state.get("downs", [])})


_HIGHER = ("acc", "f1", "auc", "precision", "recall", "bleu", "rouge", "mrr", "map", "iou", "dice", "r2", "score")
_LOWER = ("loss", "err", "mse", "mae", "ppl", "perplexity", "nll", "wer", "cer")


def metric_direction(metric: str) -> bool | None:
    """Whether a held-out metric improves upwards (True), downwards (False), or the name does not
    say (None): words of accuracy-like metrics (``acc``, ``f1``, ``auc``, ``bleu``, ...) against
    words of losses and errors (``loss``, ``err``, ``mse``, ``ppl``, ...); a name with both, or
    neither, is None.

    Example::

        >>> [metric_direction(m) for m in ("val_accuracy", "val_f1", "val_loss", "val_ppl", "val_thing")]
        [True, True, False, False, None]
    """
    name = metric.lower()
    higher, lower = any(w in name for w in _HIGHER), any(w in name for w in _LOWER)
    return higher if higher != lower else None


def higher_is_better(metric: str) -> bool:
    """Whether a held-out metric improves upwards (:func:`metric_direction`; a name that does not
    say counts as a loss, for the run card's best-so-far; the ``val_regression`` trigger refuses
    to guess: ``rollback.val_mode``).

    Example::

        >>> higher_is_better("val_accuracy"), higher_is_better("val_loss"), higher_is_better("val_thing")
        (True, False, False)
    """
    return metric_direction(metric) is True


THRESHOLDS = {"window": "monitor.window", "alert_rate": "monitor.alert_rate",
              "min_steps": "monitor.min_steps", "growth_interval": "scaler.growth_interval"}
"""The thresholds a :class:`RunMonitor` judges by (:attr:`RunMonitor.thresholds`), by name, and
the config field each is: what a run that has no ``config.yaml`` (a Hugging Face callback's)
records in its ``summary.json``, so ``ampguard report`` judges its CSV as the run did."""


class RunMonitor:
    """Watches a run's records: counts, rolling skip rate, alerts, fail-fast, clip rate, scale health.

    Feed it every record (:meth:`observe`); it returns the :class:`Event` s the record caused.
    ``failed`` is set once the run must stop (exit code 3); its ``cause`` says which guard.

    The rolling skip rate (:attr:`skip_rate`) is the skipped share of the last ``window``
    steps, or of all the steps so far while fewer than ``window`` were seen.

    - The judged rate (:attr:`judged_skip_rate`): the rate with the scaler's opening search set
      aside: the run's opening streak of gradient overflows (with the scaler on; a non-finite
      loss is no search), each a halving down from ``init_scale``, until a step applies. Nine
      opening halvings are the scaler finding its scale, not 9% of the first 100 steps
      failing. It is provisional until a step applies (a non-finite loss after it ends the
      streak, not the search): a streak of skips from step 1 that reaches the floor
      ``min_scale`` with no step applied found no scale: it is counted whole, from its first
      step (and so is one that ends the run, :meth:`at_end`). With other skips beside the opening, the rate is at least
      the window's skips over its full size (what the full window will read: 51 skips in the
      first 1000 steps page at 5%, opening and all); it never jumps with no new skip.
    - ALERT episodes: an ``ALERT`` starts when the judged rate rises above ``alert_rate`` and
      clears when it falls to ``clear_rate`` or below (by default :data:`CLEAR_FRACTION` of
      ``alert_rate``: a rate hovering at the threshold is one episode), one event each, not one
      per step. It is armed
      only once ``min(min_steps, window)`` steps were seen, so a few skips early in the run (k
      of the first n steps read k/n) do not raise it. A rollback's fresh window (:meth:`restart_windows`)
      does not disarm it: while that window holds fewer than ``min(min_steps, window)`` steps
      its k skips count over that many (:meth:`_young_after_restart`), and an ALERT up stays up.
    - A ``fail_rate`` changed mid-run (a resume with another ``monitor.fail_rate``, a replayed
      policy change) counts the consecutive steps above it again, from the judged rates of the
      steps since the window (re)started (:attr:`fail_rate`; kept as runs, not one per step).
    - Fail-fast (cause :data:`FAIL_SKIP_RATE`): the judged rate has been above ``fail_rate`` for
      ``fail_after`` consecutive steps, counted from step 1 (``min_steps`` does not apply:
      ``fail_after`` consecutive steps are the evidence). A run that skips every step with
      ``fail_after=3`` fails at step 3; when its fp16 gradients overflow, at the step its scale
      reaches the floor if that is later (until then it could have been the opening search).
    - Scale (fp16): ``scale_alert`` while the scale is at (or below) ``min_scale``, the floor
      the scaler clamps it to; with ``fail_on_scale_collapse``, fail-fast (cause
      :data:`FAIL_SCALE_COLLAPSE`) after ``fail_after`` consecutive steps at the floor and skipped
      (the step whose back-off brought the scale there among them; its words say so).
    - Scale health (fp16): :class:`ScaleHealth`'s label; ``growth_interval`` (the scaler's) lets
      ``oscillating`` look back over the window and the scaler's 2-octave climb; None: the window.

    ``max_skip_rate`` is the highest judged rate from step 1 (young-window rates included: a
    first step skipped for a non-finite loss makes it 1.0, ALERT or not);
    ``max_rolling_skip_rate`` the highest rolling rate, the fp16 opening search included.

    Example::

        >>> from ampguard.records import SkipLog
        >>> m = RunMonitor(window=1000, fail_rate=0.5, fail_after=3, scaler_enabled=False)
        >>> def skip(step):
        ...     return SkipLog(step=step, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None,
        ...                    grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_loss")
        >>> [[e.kind for e in m.observe(skip(s))] for s in (1, 2, 3)]
        [[], [], ['fail']]
        >>> m.skip_rate, m.failed.step, m.failed.cause
        (1.0, 3, 'skip_rate')
    """

    def __init__(
        self,
        *,
        window: int = 1000,
        alert_rate: float = 0.05,
        fail_rate: float | None = None,
        fail_after: int = 100,
        max_norm: float | None = 1.0,
        scaler_enabled: bool = True,
        init_scale: float | None = 2.0**16,
        min_scale: float = 1.0,
        fail_on_scale_collapse: bool = False,
        min_steps: int = DEFAULT_MIN_STEPS,
        clear_rate: float | None = None,
        growth_interval: int | None = None,
    ) -> None:
        for name, rate in (("alert_rate", alert_rate), ("fail_rate", fail_rate)):  # (a rate past 1 never trips,
            # one below 0 always does: the config refuses both, and so does the library a plugin builds on)
            if not (rate is None and name == "fail_rate") and not (finite_number(rate) and 0 <= rate <= 1):
                raise ValueError(f"{name} must be a number in [0, 1], got {rate!r}")
        if not isinstance(fail_on_scale_collapse, bool):  # ("false", a non-empty string, turned it on: review 51d)
            if type(fail_on_scale_collapse).__module__ != "numpy" or type(fail_on_scale_collapse).__name__ not in (
                    "bool", "bool_"):  # (NumPy's booleans are taken: review 51l)
                raise TypeError(f"fail_on_scale_collapse must be True or False, got {fail_on_scale_collapse!r}")
            fail_on_scale_collapse = bool(fail_on_scale_collapse)
        if clear_rate is not None and not 0 <= clear_rate <= alert_rate:
            raise ValueError(f"clear_rate must be in [0, alert_rate {alert_rate:g}], got {clear_rate}")
        for name, count in (("window", window), ("fail_after", fail_after), ("min_steps", min_steps)):
            if isinstance(count, bool) or not isinstance(count, numbers.Integral):  # (window=2.5 failed deep in
                raise ValueError(f"{name} must be a whole number of steps, got {count!r}")  # a list's multiply)
        window, fail_after, min_steps = int(window), int(fail_after), int(min_steps)  # (a numpy integer too)
        if min_steps < 0:
            raise ValueError(f"min_steps must be >= 0, got {min_steps}")
        if not (math.isfinite(min_scale) and min_scale > 0):  # (the scale's headroom is log2(scale / min_scale))
            raise ValueError(f"min_scale must be a finite number > 0, got {min_scale}")
        if fail_after < 1:
            raise ValueError(f"fail_after must be >= 1, got {fail_after}")
        self.window = window
        self.alert_rate = alert_rate
        self.clear_rate = clear_rate  # type: ignore[assignment] - None: CLEAR_FRACTION of alert_rate
        # the judged rates of the steps since the window (re)started, as runs (rate, steps): a
        # fail_rate changed later (a resume, a replayed policy change) recounts above_fail from them
        # (_push_rate, _steps_above); few entries: one after any step that judged 0
        self._runs: list[tuple[float, int]] = []
        # the lowest judged rate of the run's steps, the opening search's set aside (a rollback does
        # not forget it): at_end's "above fail_rate at every step" (every rate is at most 1: 1.0 is
        # the lowest of none)
        self.min_judged_rate = 1.0
        self._fail_rate: float | None = None if fail_rate is None else (0.0 if fail_rate == 0 else fail_rate)
        self.fail_after = fail_after
        self.max_norm = clip_threshold(max_norm)  # (a one-element tensor read as a number: review 50h, a
        # tensor clip count was saved and the plugin's own resume refused it)
        self.scaler_enabled = scaler_enabled
        self.min_scale = min_scale
        self.fail_on_scale_collapse = fail_on_scale_collapse
        self.min_steps = min_steps
        self._restarted: float | None = None  # the scale the next step runs with, where not the last one left

        self.skip_window = RollingWindow(window)
        self.clip_window = RollingWindow(window)
        if growth_interval is not None and (isinstance(growth_interval, bool) or not isinstance(
                growth_interval, numbers.Integral) or growth_interval < 1):
            raise ValueError(f"growth_interval must be a whole number of steps >= 1, got {growth_interval!r}")
        self.health = ScaleHealth(window, min_scale, init_scale if scaler_enabled else None,
                                  int(growth_interval) if growth_interval is not None else None)
        for name, value in self._scalar_defaults().items():
            setattr(self, name, value)
        self.skips: Counter[str] = Counter()
        self.loss_origins: Counter[str] = Counter()
        """Under torchrun, the ``non_finite_loss`` skips by whose own loss it was (``rank 1``,
        ``every rank``: :attr:`~ampguard.records.SkipLog.loss_on`)."""
        self.last: dict[str, float | None] = {}
        self.failed: Event | None = None
        self._floor_reached: tuple[int, float] | None = None  # (words only: the collapse streak's first step)
        self.higher_better: dict[str, bool] = {}
        """Held-out metrics whose direction was declared (``rollback.val_mode`` for the watched
        one); the others go by their name (:func:`higher_is_better`). Set up, not saved."""

    @property
    def clear_rate(self) -> float:
        """The rate at or below which the skip-rate ALERT clears: the one given, or
        :data:`CLEAR_FRACTION` of ``alert_rate`` (following it when ``alert_rate`` changes, as a
        replayed policy change does; set ``None`` to follow it again).

        Example::

            >>> m = RunMonitor(alert_rate=0.05)
            >>> round(m.clear_rate, 6), setattr(m, "alert_rate", 0.1), round(m.clear_rate, 6)
            (0.04, None, 0.08)
        """
        if self._clear_rate is not None:
            return self._clear_rate
        return round(self.alert_rate * CLEAR_FRACTION, 12)  # (0.35 x 0.8 is 0.27999999999999997: 7/25 must clear)

    @property
    def alert_rate(self) -> float:
        """The rolling skip rate above which an ALERT starts (-0.0 is 0: "> alert_rate -0")."""
        return self._alert_rate

    @alert_rate.setter
    def alert_rate(self, value: float) -> None:
        self._alert_rate = 0.0 if value == 0 else value

    @clear_rate.setter
    def clear_rate(self, value: float | None) -> None:
        self._clear_rate = 0.0 if value == 0 else value  # (-0.0 is 0: "<= clear_rate -0" otherwise)

    @property
    def fail_rate(self) -> float | None:
        """The rate the fail-fast judges against (None: off). Set to another value (a resume with
        a new ``monitor.fail_rate``, a replayed policy change), the count of consecutive steps
        above it (``above_fail``) is the count under the new rate, from the judged rates of the
        steps since the window (re)started: the steps above 0.5 that are not above 0.58 no longer count,
        and steps above a lowered rate count though the old one did not see them.

        Example (0.6 for three steps: above 0.5, not above 0.6)::

            >>> from ampguard.records import SkipLog, StepLog
            >>> m = RunMonitor(window=5, fail_rate=0.5, fail_after=4, scaler_enabled=False)
            >>> for s, skipped in enumerate([True, True, True, False, False], start=1):
            ...     _ = m.observe(SkipLog(step=s, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None,
            ...                           grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_loss")
            ...                   if skipped else StepLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5,
            ...                                           grad_l2_post_clip=0.5, scaler_scale=1.0))
            >>> m.above_fail  # rates 1, 1, 1, 0.75, 0.6: five steps above 0.5
            5
            >>> m.fail_rate = 0.7  # step 5's 0.6 is not above 0.7: no step in a row is
            >>> m.above_fail
            0
            >>> m.fail_rate = 0.5  # (the rates since the window started are kept: 5 steps, enough to fail)
            >>> m.above_fail
            5
        """
        return self._fail_rate

    @fail_rate.setter
    def fail_rate(self, value: float | None) -> None:
        old, self._fail_rate = self._fail_rate, (0.0 if value == 0 else value)
        if value != old:
            self._recount_above_fail(old)

    def _push_rate(self, rate: float) -> None:
        """Keep a step's judged ``rate`` for a recount: the runs, oldest first, hold ``(rate,
        steps)`` with rates rising; a rate joins every run at or above it at the top into one
        whose last step (this one) is its lowest. O(1) amortised (each run is merged away once).

        Example::

            >>> m = RunMonitor()
            >>> for r in (0.2, 0.5, 0.4, 0.6):
            ...     m._push_rate(r)
            >>> m._runs, m._steps_above(0.45), m._steps_above(0.3), m._steps_above(0.1)
            ([(0.2, 1), (0.4, 2), (0.6, 1)], 1, 3, 4)
        """
        runs, steps = self._runs, 1
        while runs and runs[-1][0] >= rate:
            steps += runs.pop()[1]
        runs.append((rate, steps))

    def _steps_above(self, threshold: float) -> int:
        """The steps in a row up to the last one kept whose judged rate is above ``threshold``:
        a run's steps are all above it when its lowest (its last) is, and the first run that is
        not ends the streak at its last step."""
        count = 0
        for rate, steps in reversed(self._runs):
            if not rate > threshold:
                break
            count += steps
        return count

    def _recount_above_fail(self, old: float | None) -> None:
        """``above_fail`` under the current ``fail_rate``, counted under ``old`` (None: off, or
        not known: a state saved before the monitor kept it): the judged rates kept (every step
        since the window started) above it, from the last step back. The rates an older state
        kept may be fewer (the last ``fail_after`` of them): where the rate went down, the steps
        counted under the old rate are above the new one too, so the count is at least the old
        one; where the old rate is not known, the count is what the rates kept show (none kept:
        0): it may fall short, never over, so a resume cannot fail on a count made under another
        rate."""
        new = self._fail_rate
        if new is None:
            self.above_fail = 0
            return
        count = self._steps_above(new)
        if old is not None and new <= old:  # (every step above old is above new)
            count = max(count, self.above_fail)
        self.above_fail = count

    @staticmethod
    def _scalar_defaults() -> dict[str, Any]:
        return {
            "steps": 0, "updates": 0, "clipped": 0,
            "alerting": False, "scale_alerting": False, "alert_episodes": 0, "max_skip_rate": 0.0,
            "above_fail": 0,  # consecutive steps with the rate above fail_rate
            "at_floor_skipped": 0,  # consecutive steps skipped with the scale at its floor
            "opening": 0,  # the scaler's opening search: gradient overflows in a row from step 1
            "in_opening": True,  # that search is still going (every step so far an overflow)
            # a step applied after it: the search found a scale, and its skips are set aside for good
            # (until then it is provisional: a streak of skips from step 1 that reaches the floor, or a
            # run that ends with no step applied, found none, and the opening counts whole)
            "opening_settled": False,
            "first_loss": None, "best_loss": None, "eval_last": {}, "eval_best": {},
            "max_rolling_skip_rate": 0.0,  # the raw rolling rate's highest (max_skip_rate: the judged one's)
            "final_loss": None, "final_loss_step": None,  # the last applied step's (finite) loss
            "unobserved": 0,  # steps 1..this were not observed: a resume without this monitor's state (begin_at)
            # the windows were last restarted by the skip guard's rollback (its fail-fast, turned into a
            # rollback): at_end judges the steps since it (review 53l)
            "restarted_by_skip_guard": False,
            # the loss scale a resume took over from a stock fp16 checkpoint (begin_at): the opening search
            # starts from it, not from init_scale (review 55f: the end's ALERT said "down from init_scale")
            "taken_over_scale": None,
        }

    # -------------------------------------------------------------- per record

    def observe(self, record: StepRecord) -> list[Event]:
        """Take one step's record; return the events it caused (alerts, clears, the failure).

        Example::

            >>> from ampguard.records import StepLog
            >>> m = RunMonitor(window=10, scaler_enabled=False)
            >>> m.observe(StepLog(step=1, lr=0.1, loss=2.0, grad_l2_pre_clip=3.0, grad_l2_post_clip=1.0,
            ...                   scaler_scale=1.0))
            []
            >>> m.updates, m.clipped, m.best_loss
            (1, 1, 2.0)
        """
        if record.step <= self.steps:  # (counted twice, its skip in the rate twice: the steps would not move)
            raise ValueError(f"RunMonitor.observe: step {record.step} after step {self.steps}: each step is observed "
                             "once, in order (a record observed twice? a fresh start needs a fresh RunMonitor)")
        v = record.values()
        self.steps = record.step
        self.last = v
        if record.skipped:
            self.skips[str(record.reason)] += 1
            if on := getattr(record, "loss_on", None):
                self.loss_origins[on] += 1
        else:
            self.updates += 1
            loss = v["loss"]
            if loss is not None and math.isfinite(loss):
                self.first_loss = loss if self.first_loss is None else self.first_loss
                self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
                self.final_loss, self.final_loss_step = loss, record.step
        clipped = (
            self.max_norm is not None
            and not record.skipped
            and v["grad_l2_pre_clip"] is not None
            and v["grad_l2_pre_clip"] > self.max_norm
        )
        self.clipped += clipped
        self.clip_window.push(float(clipped))
        self.skip_window.push(float(record.skipped))
        scale = v["scaler_scale"] if v["scaler_scale"] is not None else 1.0
        # (the scale this step ran with: the one the step before left, or the one a resume or a
        # rollback set the scaler to since: scale_restarted)
        ran_with, self._restarted = (self.health.scale if self._restarted is None else self._restarted), None
        if self.scaler_enabled:
            self.health.push(scale, record.skipped, search=record.reason == "non_finite_grad")
        opening = self.opening
        if not self.opening_settled and (self.in_opening or self.opening):
            self._follow_opening(record, ran_with)
        rate, over = self._judged()
        self._push_rate(rate)
        # review 54k: a young window a rollback restarted counts its k skips over min(min_steps, window)
        # steps, what it reads once it holds them if no other skip comes: the end's judgement (at_end) has
        # no later step to wait for, and counts what its steps held, k of n, as it judges a run shorter
        # than min_steps whole (the young count alone, 4 skips in the 4 steps of a short run with a
        # rollback read 1/8 and 2/8 and the run ended "finished")
        held = self._judged(young=False)[0] if self._young_after_restart() else rate
        if self.restarted_by_skip_guard and not (self.fail_rate is not None and held > self.fail_rate):
            self.restarted_by_skip_guard = False  # (the skip guard's trouble cleared: a step at or below fail_rate)
        if self.opening <= opening:  # (a step of the opening search is set aside: judged 0, not at the end)
            self.min_judged_rate = min(self.min_judged_rate, held)
        self.max_skip_rate = max(self.max_skip_rate, rate)
        self.max_rolling_skip_rate = max(self.max_rolling_skip_rate, self.skip_rate)
        return self._events(record.step, rate, over, scale, bool(record.skipped),
                            overflowed=record.reason == "non_finite_grad", ran_with=ran_with)

    def _follow_opening(self, record: StepRecord, ran_with: float | None = None) -> None:
        """The scaler's opening search: gradient overflows in a row from step 1, set aside until
        a step applies (then for good: the search found a scale). A non-finite loss ends the
        streak (it is no search: it counts) but not the search: the overflows before it stay set
        aside while a step may still apply. A streak of skips from step 1 in which a step that
        ran at the floor (``ran_with``, the scale the step ran with) skipped too found no scale:
        it was no search, and the steps the fail-fast set aside count now (each one skipped: a
        rate of 1.0, above any ``fail_rate`` below 1), so an fp16 run that skips every step fails
        one step after its scale reaches the floor. The back-off that brings the scale to the
        floor is not yet that: the floor is not tried (a search that lands on ``min_scale`` and
        applies there counted its opening skips as failures, and a healthy run was failed,
        review 51i). (A run that ends with its opening still provisional is judged whole at its
        end: :meth:`at_end`.)"""
        floored = ran_with <= self.health._floor if ran_with is not None else self.health.at_floor
        if not record.skipped:
            self.in_opening, self.opening_settled = False, True
        elif self.scaler_enabled and floored:
            self._drop_opening()
        elif self.in_opening and self.scaler_enabled and record.reason == "non_finite_grad":
            self.opening += 1
        else:
            self.in_opening = False

    def _drop_opening(self) -> None:
        """No step applied since step 1 and the opening found no scale: its skips count, from step
        1. Every step so far was skipped, so each one's rolling rate, judged now, is 1.0; the
        fail-fast's count of steps above ``fail_rate`` is caught up (this step's own comes in
        :meth:`_events`). The lowest judged rate (:attr:`min_judged_rate`) counts its steps as 1.0,
        the highest there is: it stays as it was."""
        self.in_opening, self.opening = False, 0
        # the steps judged since the window (re)started, this one aside, each skipped (the rates an
        # older state kept may be fewer: all of them are known now)
        n = min(self.skip_window.count, self.observed) - 1
        self._runs = self._skipped_runs(n) if n > 0 else []
        self.above_fail = 0 if self.fail_rate is None else self._steps_above(self.fail_rate)

    def _events(self, step: int, rate: float, over: str, scale: float, skipped: bool, overflowed: bool,
                ran_with: float | None = None) -> list[Event]:
        events: list[Event] = []
        young = self._young_after_restart()
        data = {"skip_rate": rate, "window": self.window}
        if rate > self.alert_rate and not self.alerting and self.alert_armed:
            self.alerting = True
            self.alert_episodes += 1
            events.append(Event(step, "skip_rate_alert", (
                f"rolling skip rate {rate:.3f} > alert_rate {self.alert_rate:g} {over}"), data))
        # (the clear level worked out only while alerting; a window a rollback restarted clears once it
        # holds min_steps steps: one clean step after the rollback, 0 of 1, is no rate yet)
        elif self.alerting and not young and rate <= self.clear_rate:
            self.alerting = False
            events.append(Event(step, "skip_rate_clear", (
                f"rolling skip rate back to {rate:.3f} <= clear_rate {self.clear_rate:g}"), data))

        at_floor = self.scaler_enabled and self.health.at_floor
        # (a step skipped at the floor is what raises it: a run started at the floor, scaler.init_scale =
        # min_scale, whose steps apply, is not alerted; the words follow why the step skipped, and whether
        # it ran at the floor or the skip's back-off brought the scale there, the floor itself not tried yet)
        if at_floor and skipped and not self.scale_alerting:
            if ran_with is not None and ran_with > self.health._floor:
                why = ("the step overflowed at " if overflowed else "the step (a non-finite loss) ran at ") + (
                    f"{ran_with:g}, and its back-off brought the scale there: the floor itself is not tried yet")
                head = f"loss scale {scale:g} fell to its floor scaler.min_scale {self.min_scale:g}:"
            else:
                why = ("the step still overflowed: fp16 cannot hold these gradients" if overflowed else
                       "steps still skip (a non-finite loss here, which no loss scale acts on: the forward's, "
                       "from the data, the model or an activation past fp16's range; ampguard locate tells which)")
                head = f"loss scale {scale:g} is at its floor scaler.min_scale {self.min_scale:g} and"
            events.append(Event(step, "scale_alert", f"{head} {why}", {"scale": scale}))
        elif not at_floor and self.scale_alerting:
            events.append(Event(step, "scale_clear", f"loss scale back to {scale:g}", {"scale": scale}))
        self.scale_alerting = at_floor and (self.scale_alerting or skipped)

        self.above_fail = self.above_fail + 1 if self.fail_rate is not None and rate > self.fail_rate else 0
        self.at_floor_skipped = self.at_floor_skipped + 1 if at_floor and skipped else 0
        if self.at_floor_skipped == 1:  # (the streak's first step: ran above the floor, its back-off brought it there?)
            self._floor_reached = (step, ran_with) if ran_with is not None and ran_with > self.health._floor else None
        if self.failed is None:
            if self.above_fail >= self.fail_after:
                # (the count, not fail_after: an fp16 opening search that reached the floor counts its steps at
                # once, and "for 5 consecutive steps" undercounted ten above the rate, review 50c)
                past = f", past fail_after {self.fail_after}" if self.above_fail > self.fail_after else ""
                self.failed = Event(step, "fail", (
                    f"rolling skip rate above fail_rate {self.fail_rate:g} for {counted(self.above_fail, 'consecutive step')}"
                    f"{past} (now {rate:.3f} {over})"), {"skip_rate": rate, "window": self.window}, cause=FAIL_SKIP_RATE)
            elif self.fail_on_scale_collapse and self.at_floor_skipped >= self.fail_after:
                self.failed = Event(step, "fail", (
                    f"loss scale at its floor scaler.min_scale {self.min_scale:g} with every step skipped "
                    f"for {counted(self.fail_after, 'consecutive step')}" + ("" if self._floor_reached is None else (
                        f" (the first of them, step {self._floor_reached[0]}, ran at {self._floor_reached[1]:g}: "
                        "its back-off brought the scale to the floor)"))),
                    {"scale": scale, "min_scale": self.min_scale}, cause=FAIL_SCALE_COLLAPSE)
            if self.failed is not None:
                events.append(self.failed)
        return events

    def at_end(self, step: int) -> list[Event]:
        """The run ended at ``step`` (its last, trained to the end): what its steps show that the
        rolling rules had no time to. A run shorter than ``min_steps`` never armed the ALERT, and
        one shorter than ``fail_after`` could not fail fast, however many of its steps skipped.
        Judged over the whole run (:attr:`steps`, :attr:`skips`: a rollback's fresh window, or a
        window shorter than the run, does not narrow it), the fp16 scaler's opening search set
        aside as the rolling rate sets it aside:

        - its skip rate above ``alert_rate`` in a run shorter than ``min_steps`` raises one ALERT
          (an episode);
        - with ``fail_rate``, a run shorter than ``fail_after`` whose rolling rate was above it at
          every step fails (cause :data:`FAIL_SKIP_RATE`): the whole run is the evidence (its
          lowest judged rate, :attr:`min_judged_rate`, is above it; a step after a rollback
          judges its fresh window, by what it held: the k skips of its n steps, not over the
          ``min(min_steps, window)`` steps the rolling rules wait for, as a run shorter than
          ``min_steps`` is judged whole; the steps before it count as they were judged).
        - a run whose opening search never ended (every step an fp16 gradient overflow, the floor
          not reached yet: a short run, or a high ``init_scale``; or overflows, then non-finite
          losses) applied no update: the search found no scale, so nothing is set aside and the
          whole run is judged, whatever its length: one ALERT, and with ``fail_rate`` (below 1) a
          failure.

        Example (a 30-step run that skipped every step, with the defaults' min_steps and fail_after 100)::

            >>> from ampguard.records import SkipLog
            >>> m = RunMonitor(fail_rate=0.5, scaler_enabled=False)
            >>> for s in range(1, 31):
            ...     _ = m.observe(SkipLog(step=s, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None,
            ...                           grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_loss"))
            >>> m.alert_episodes, m.failed
            (0, None)
            >>> [e.kind for e in m.at_end(30)], m.alert_episodes, m.failed.cause
            (['skip_rate_alert', 'fail'], 1, 'skip_rate')
            >>> print(m.failed.message)
            skip rate above fail_rate 0.5 at every one of the run's 30 steps (it ended before fail_after 100 consecutive steps)
        """
        observed = self.observed  # (a monitor that began after step 1, begin_at, judges the steps it saw)
        # no step applied since step 1 and the opening not dropped yet: a search that found no scale
        unsettled = observed > 0 and not self.opening_settled and self.opening > 0
        aside = 0 if unsettled else self.opening  # (0 once it reached the floor too: then it counts)
        judged, skipped = observed - aside, sum(self.skips.values()) - aside

        def run(n: int) -> str:  # (a monitor that began later observed only the steps after it began)
            return f"the run's {counted(n, 'step')}" if not self.unobserved else \
                f"the {counted(n, 'step')} after step {self.unobserved}"

        events: list[Event] = []
        if judged <= 0:
            return events
        rate = skipped / judged
        if unsettled:  # (nothing set aside after all: the rate judged is the whole run's; review 50k, the card
            self.max_skip_rate = max(self.max_skip_rate, rate)  # said "0.0000 as the guard judged it" beside its FAIL)
        data = {"skip_rate": rate, "window": self.window}
        never = ""
        if unsettled and self.in_opening:
            start = "init_scale" if self.taken_over_scale is None else (
                f"{self.taken_over_scale:g}, the scale taken over from the checkpoint's stock GradScaler,")
            never = (f"no step applied in {run(observed)}: the fp16 loss scale's search down from {start} "
                     f"never found a scale (now {self.health.scale:g})")
        elif unsettled:
            never = (f"no step applied in {run(observed)} ({self.skips_text()}): its opening "
                     f"{counted(self.opening, 'gradient overflow')} found no scale that applied a step, and are "
                     "counted with the rest")
        if (observed < self.arms_at or unsettled) and not self.alerting and rate > self.alert_rate:
            self.alerting = True
            self.alert_episodes += 1
            arming = f"monitor.min_steps {self.min_steps}" if self.min_steps <= self.window else \
                f"monitor.window {self.window}"
            events.append(Event(step, "skip_rate_alert", never or (
                f"skip rate {rate:.3f} > alert_rate {self.alert_rate:g} over {run(judged)}, which "
                f"ended before the rolling ALERT armed ({arming})"), data))
        if self.failed is None and self.fail_rate is not None and (
                unsettled and rate > self.fail_rate
                or observed < self.fail_after and self.min_judged_rate > self.fail_rate):
            after = f" after the fp16 scaler's opening {counted(aside, 'skip')}" if aside else ""
            self.failed = Event(step, "fail", f"{never}, a skip rate of 1 above fail_rate {self.fail_rate:g}" if never else (
                f"skip rate above fail_rate {self.fail_rate:g} at every one of {run(judged)}{after} "
                f"(it ended before fail_after {self.fail_after} consecutive steps)"), data, cause=FAIL_SKIP_RATE)
            events.append(self.failed)
        since = sum(steps for _, steps in self._runs)  # (the steps since the window restarted: the rollback's)
        # (review 54k: the trouble not cleared, every step since above fail_rate as the steps held it, and no
        # failure: the fail-fast had too few steps to count fail_after again, or counted the young window's
        # skips over min(min_steps, window) steps and had not reached fail_after yet)
        if self.failed is None and self.fail_rate is not None and self.restarted_by_skip_guard:
            # review 53l: the skip guard's rollback restarts the count it tripped on; a run that ended
            # before the count reached fail_after again, every step since the rollback above fail_rate,
            # ended "finished", exit 0 (the same data without the rollback: exit 3); review 53m: none
            # since, a rollback at the run's last step (its own, or a spike's inside its trouble). A
            # spike's rollback alone is no failure taken back: a streak after it is judged as any run's
            # last steps are
            if since:
                young = self._young_after_restart() if self._steps_above(self.fail_rate) < since else 0
                why = (f"skip rate above fail_rate {self.fail_rate:g} at every one of the {counted(since, 'step')} "
                       f"since the rollback at step {self.steps - since}" + (
                           f", counted over the steps the window held (the fail-fast counts a fresh window's skips "
                           f"over {young} steps until it holds them; the run ended before fail_after "
                           f"{self.fail_after} consecutive steps above it)" if young else
                           f" (the run ended before fail_after {self.fail_after} consecutive steps)"))
                data = {"skip_rate": self.skip_rate, "window": self.window}
            else:  # (data: the run's rate; the window the rollback emptied holds none, review 53o)
                why = (f"the run ended right after a rollback at its last step, {self.steps}, the skip-rate guard's "
                       f"trouble not cleared (no step at or below fail_rate {self.fail_rate:g} since it tripped)")
            self.failed = Event(step, "fail", why, data, cause=FAIL_SKIP_RATE)
            events.append(self.failed)
        return events

    def observe_eval(self, metrics: dict[str, float]) -> None:
        """Keep the latest and the best held-out metrics (higher is better for accuracies); the
        latest of each metric, evaluated when it was (a replayed CSV's ``val_bleu`` every 25 steps
        beside ``val_loss`` every 10 kept its last value: review 47b).

        Example::

            >>> m = RunMonitor()
            >>> m.observe_eval({"val_loss": 2.0, "val_accuracy": 0.5})
            >>> m.observe_eval({"val_loss": 3.0, "val_accuracy": 0.7})
            >>> m.observe_eval({"val_loss": 2.5})
            >>> m.eval_best, m.eval_last
            ({'val_loss': 2.0, 'val_accuracy': 0.7}, {'val_loss': 2.5, 'val_accuracy': 0.7})
        """
        self.eval_last = {**self.eval_last, **metrics}
        for name, value in metrics.items():
            if not math.isfinite(value):
                continue
            best = self.eval_best.get(name)
            higher = self.higher_better.get(name, higher_is_better(name))  # (the watched metric's: declared)
            if best is None or (value > best if higher else value < best):
                self.eval_best[name] = value

    def rolled_back(self, updates: int, saved: Mapping[str, Any] | None, skip_guard: bool = False) -> int:
        """After a rollback to a checkpoint: the updates the model holds (``updates``), its last
        loss and held-out metrics as the checkpoint's monitor state ``saved`` had them (a run
        that ends before its next applied step reports the model it kept, not the step undone:
        a spike at the last step was the run's "final loss"), the rolling windows afresh
        (:meth:`restart_windows`); ``skip_guard``: the skip guard's rollback (its fail-fast turned
        into one), whose trouble the end judges again (:meth:`at_end`). Returns how many updates
        were undone.

        Example::

            >>> from ampguard.records import StepLog
            >>> m = RunMonitor(window=10, scaler_enabled=False)
            >>> for s, loss in ((1, 2.0), (2, 1.5), (3, 9e15)):
            ...     _ = m.observe(StepLog(step=s, lr=0.1, loss=loss, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0,
            ...                           scaler_scale=1.0))
            >>> saved = {"final_loss": 1.5, "final_loss_step": 2, "eval_last": {"val_loss": 0.7}}
            >>> m.rolled_back(2, saved), m.updates, m.final_loss_and_step, m.eval_last
            (1, 2, (1.5, 2), {'val_loss': 0.7})
        """
        undone, self.updates = self.updates - updates, updates
        if isinstance(saved, Mapping):  # (a checkpoint of an older ampguard may lack them: they stay)
            if "final_loss" in saved:
                self.final_loss, self.final_loss_step = saved["final_loss"], saved.get("final_loss_step")
            if "eval_last" in saved:
                self.eval_last = dict(saved["eval_last"])
        self.restart_windows()
        # (review 53m: a spike's rollback inside the skip guard's trouble, no step of it at or below
        # fail_rate yet, does not clear it: the run that applied nothing since ended exit 0)
        self.restarted_by_skip_guard = skip_guard or self.restarted_by_skip_guard
        return undone

    def begin_at(self, step: int, taken_over: float | None = None) -> None:
        """Take a run over after its ``step`` without this monitor's state (a resume from a
        checkpoint saved without it): its steps 1 to ``step`` were not observed. :attr:`steps`
        goes on from there, the last step's number as after a resume with the state, and the
        counts, rates and the end's judgement cover the steps observed (:attr:`observed`, their
        first ``unobserved + 1``): 2 skips in the 2 steps after step 38 are a skip rate of 1, not 2/40.
        ``taken_over``: the loss scale the resume took over from a stock fp16 checkpoint's
        GradScaler (:func:`~ampguard.precision.take_over_stock_scale`), the one this monitor was
        made with: the opening search starts from it, and the end's words say so (saved with the
        state: :attr:`taken_over_scale`).

        Example::

            >>> from ampguard.records import SkipLog
            >>> m = RunMonitor(fail_rate=0.5, scaler_enabled=False)
            >>> m.begin_at(38)
            >>> for s in (39, 40):
            ...     _ = m.observe(SkipLog(step=s, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None,
            ...                           grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_loss"))
            >>> m.steps, m.observed, m.summary()
            (40, 2, 'steps=40 (1 to 38 not observed) updates=0 skips=2 (non_finite_loss=2) final_scale=1')
            >>> [e.kind for e in m.at_end(40)], m.failed.message.split(" (")[0]
            (['skip_rate_alert', 'fail'], 'skip rate above fail_rate 0.5 at every one of the 2 steps after step 38')
        """
        if self.steps:
            raise ValueError(f"RunMonitor.begin_at({step}): this monitor has observed up to step {self.steps} "
                             "already (begin_at is for a fresh one)")
        if not whole_number(step):
            raise ValueError(f"RunMonitor.begin_at: step must be an int >= 0, got {step!r}")
        if taken_over is not None and not (finite_number(taken_over) and 0 < taken_over <= MAX_SCALE):
            raise ValueError(f"RunMonitor.begin_at: taken_over must be a loss scale in (0, {MAX_SCALE:g}], "
                             f"got {taken_over!r}")
        self.steps = self.unobserved = int(step)
        self.taken_over_scale = None if taken_over is None else float(taken_over)

    def restart_windows(self) -> None:
        """Forget the rolling skip window (after a rollback): the run starts its judging afresh
        (the fail-fast counters restart at 0, and the judged rates kept for a new ``fail_rate``
        are forgotten). The ALERT stays armed (:attr:`alert_armed`: the run's steps) and an
        ALERT up stays up: until the new window holds ``min(min_steps, window)`` steps every
        guard judges it as :meth:`_young_after_restart` says (k skips over that many steps, not k of the
        few seen: the fail-fast, :attr:`skip_rate`, the max rates; review 54k), and the ALERT
        clears only then; the end's judgement counts what it held (:meth:`at_end`).

        Example::

            >>> from ampguard.records import SkipLog
            >>> m = RunMonitor(window=4, fail_rate=0.5, fail_after=1, scaler_enabled=False)
            >>> _ = m.observe(SkipLog(step=1, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None,
            ...                       grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_loss"))
            >>> m.failed.cause
            'skip_rate'
            >>> m.restart_windows()
            >>> m.failed is None, m.skip_rate
            (True, 0.0)
        """
        self.skip_window = RollingWindow(self.window)
        self._runs = []
        self.above_fail = 0
        self.at_floor_skipped = 0
        self.failed = None

    # -------------------------------------------------------------- views

    def scale_restarted(self, scale: float) -> None:
        """The loss scale the next step runs with, set by the trainer, not left by the step before:
        a resume that changed ``scaler.init_scale``, a rollback's checkpoint's scale. The opening
        search judges a step by the scale it ran with (:meth:`_follow_opening`): read from the last
        record, a resume with a new ``init_scale`` after a back-off to the floor counted its next
        step as run at the floor, and a healthy run failed (review 51j).

        Example::

            >>> m = RunMonitor(fail_rate=0.5, fail_after=2, init_scale=4.0, min_scale=2.0)
            >>> from ampguard.records import SkipLog
            >>> def overflow(step, scale):
            ...     return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"),
            ...                    grad_l2_post_clip=None, scaler_scale=scale, reason="non_finite_grad")
            >>> _ = m.observe(overflow(1, 2.0))  # the back-off to the floor
            >>> m.scale_restarted(65536.0)  # (a resume's new init_scale)
            >>> _ = m.observe(overflow(2, 32768.0)); m.opening, m.failed is None
            (2, True)
        """
        self._restarted = float(scale)

    @property
    def alert_armed(self) -> bool:
        """True once ``min(min_steps, window)`` steps were observed: the ALERT may fire (a
        window smaller than ``min_steps`` is full, its rate the seed's, after ``window`` steps: a
        burst of skips that filled it and left it before ``min_steps`` was never judged, its max
        rolling rate 1.0 beside no ALERT). A rollback (:meth:`restart_windows`) does not disarm
        it: its young window is judged as :meth:`_young_after_restart` says.

        Example::

            >>> RunMonitor(min_steps=0).alert_armed, RunMonitor(min_steps=1).alert_armed
            (True, False)
        """
        return self.observed >= self.arms_at

    @property
    def arms_at(self) -> int:
        """The steps observed before the ALERT is armed: ``min(min_steps, window)``."""
        return min(self.min_steps, self.window)

    def _young_after_restart(self) -> int:
        """``min(min_steps, window)`` while a window a rollback restarted (:meth:`restart_windows`)
        holds fewer steps than that, else 0: the steps over which every guard counts its k skips
        (:meth:`_judged`, :attr:`skip_rate`), what the window reads once it holds them if no other
        skip comes. k of the first n steps after a rollback read k/n as they do from step 1 (the
        reason for ``min_steps``), so one skip just after a rollback is no ALERT nor fail-fast,
        while a rate the window is sure to be above pages as soon as it is sure, not ``min_steps``
        later; an ALERT up clears only once the window holds them. (Review 54k: that count was the
        ALERT's alone; the fail-fast, the max rate on the card and the STATS line read 1 of 1, and
        one skip after a spike's rollback failed a healthy run.)

        Example (a rollback after step 100; then a skip every other step)::

            >>> from ampguard.records import SkipLog, StepLog
            >>> m = RunMonitor(window=1000, scaler_enabled=False)
            >>> def record(s, skipped):
            ...     return (SkipLog(step=s, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
            ...                     scaler_scale=1.0, reason="non_finite_loss") if skipped else
            ...             StepLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5,
            ...                     scaler_scale=1.0))
            >>> for s in range(1, 101):
            ...     _ = m.observe(record(s, False))
            >>> m.restart_windows()
            >>> [(s, e.kind) for s in range(101, 131) for e in m.observe(record(s, s % 2 == 0))]
            [(112, 'skip_rate_alert')]
            >>> print(m._judged()[1])
            counting the 15 skips in the 30 steps since the window restarted after step 100 (a rollback) over 100 steps: what it reads once it holds them
        """
        settle = min(self.min_steps, self.window)
        count = self.skip_window.count
        return settle if count < settle and count < self.observed else 0

    @property
    def skip_rate(self) -> float:
        """Skips in the last ``window`` steps over the steps the window holds (all steps so far
        while fewer than ``window``); 0.0 before the first step. A window a rollback restarted
        (:meth:`restart_windows`) counts its skips over ``min(min_steps, window)`` steps until it
        holds that many (:meth:`_young_after_restart`; review 54k: one skip right after a rollback
        is 1/100, not 1 of 1, on the STATS line and the card's max as for the guards). (The rolling
        rate; the whole run's skips are :attr:`skips`, and :attr:`clip_rate` is the whole run's.)

        Example::

            >>> from ampguard.records import SkipLog
            >>> m = RunMonitor(window=1000, scaler_enabled=False)
            >>> for s in range(1, 26):
            ...     _ = m.observe(SkipLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"),
            ...                           grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_grad"))
            >>> m.skip_rate  # 25 skips in 25 steps, not 25/1000
            1.0
            >>> m.restart_windows(); _ = m.observe(SkipLog(step=26, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"),
            ...                                         grad_l2_post_clip=None, scaler_scale=1.0, reason="non_finite_grad"))
            >>> m.skip_rate  # after a rollback: 1 skip over min_steps 100
            0.01
        """
        held = self.skip_window.held
        return round(self.skip_window.total) / max(held, self._young_after_restart()) if held else 0.0

    @property
    def judged_skip_rate(self) -> float:
        """What the ALERT and the fail-fast judge: :attr:`skip_rate` with the scaler's opening
        search set aside. The opening search is the run's opening streak of steps skipped for a
        non-finite gradient, with the scaler on, until a step applies (its halvings down from
        ``init_scale``, scale health's ``warming``; a non-finite loss is no search: the loss is
        checked before it is scaled); a streak that reaches the floor is no search.

        - The opening alone in the window: 0 (a healthy search pages nothing, young window or full).
        - Other skips beside it: the larger of their rate over the window's other steps (the
          opening's leave numerator and denominator alike) and all the window's skips over its
          full size ``window`` (what the full window will read, the seed's 1000-step rate: 8
          opening and 43 later skips in the first 1000 steps page at the 51st). Once the window
          is full that is the rolling rate itself, opening and all; the rate never jumps with no
          new skip (a window filling, its opening counted there all at once, stopped a healthy run).
        - No opening in the window: the rolling rate.

        Example (fp16: six opening halvings, then 94 clean steps)::

            >>> from ampguard.records import SkipLog, StepLog
            >>> m = RunMonitor()
            >>> for s in range(1, 101):
            ...     _ = m.observe(SkipLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"),
            ...                           grad_l2_post_clip=None, scaler_scale=2.0 ** (16 - s),
            ...                           reason="non_finite_grad") if s <= 6 else
            ...                   StepLog(step=s, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5,
            ...                           grad_l2_post_clip=0.5, scaler_scale=2.0 ** 10))
            >>> m.skip_rate, m.judged_skip_rate, m.alerting
            (0.06, 0.0, False)
        """
        return self._judged()[0]

    def _judged(self, young: bool = True) -> tuple[float, str]:
        """:attr:`judged_skip_rate` and the words for what it counted (an event's "over the last ...");
        ``young`` False: a young window a rollback restarted counted over the steps it holds, as the
        end's judgement counts it (:meth:`observe`)."""
        held, skips = self.skip_window.held, round(self.skip_window.total)
        opening = self._opening_in_window()
        if young and (settle := self._young_after_restart()):  # (review 54k: every guard's, not the ALERT's alone)
            aside = f" (the scaler's opening {counted(opening, 'skip')} set aside)" if opening else ""
            return (skips - opening) / settle, (
                f"counting the {counted(skips - opening, 'skip')} in the {counted(held, 'step')} since the window "
                f"restarted after step {self.steps - held} (a rollback) over {settle} steps{aside}: what it reads "
                "once it holds them")
        if not opening:
            return (skips / held if held else 0.0), f"over the last {counted(held, 'step')}"
        aside = f"(the scaler's opening {counted(opening, 'skip')} set aside)"
        if skips == opening:
            return 0.0, f"over the last {counted(held - opening, 'step')} {aside}"
        others = (skips - opening) / (held - opening)
        whole = skips / self.window
        if others >= whole:
            return others, f"over the last {counted(held - opening, 'step')} {aside}"
        if held >= self.window:
            return whole, f"over the last {counted(held, 'step')}"
        return whole, (f"counting the window's {counted(skips, 'skip')} over its {self.window} steps (the scaler's "
                       f"opening {counted(opening, 'skip')} among them: the full window will hold them)")

    def _opening_in_window(self) -> int:
        """How many of the skip window's steps are the scaler's opening search (0 when none is)."""
        opening = self.opening
        if opening < 1:
            return 0
        # the window holds the last `held` steps up to `steps`; the opening is the first `opening`
        # steps observed (1..opening, or after the `unobserved` ones)
        first = self.steps - self.skip_window.held + 1
        return max(0, min(self.unobserved + opening - first + 1, self.skip_window.held, round(self.skip_window.total)))

    @property
    def observed(self) -> int:
        """The steps this monitor observed: :attr:`steps` less those before it began
        (:meth:`begin_at`; none for a monitor that observed the run from step 1).

        Example::

            >>> m = RunMonitor()
            >>> m.begin_at(5); m.steps, m.observed
            (5, 0)
        """
        return self.steps - self.unobserved

    @property
    def clip_rate(self) -> float:
        """Share of the whole run's steps clipped: applied with a pre-clip norm above ``max_norm`` (a
        skipped step is not clipped, whatever its norm; "we clip every
        step" is a finding; a norm exactly ``max_norm`` is not: the clip's factor
        ``max_norm / (norm + 1e-6)`` there is PyTorch's epsilon, a scale of 1 - 1e-6, review 54g): the run card's. Unlike :attr:`skip_rate`, not the rolling window's:
        the STATS line and the trackers' ``clip_rate`` are ``clip_window.seen_mean``, the last
        ``window`` steps'.

        Example::

            >>> RunMonitor().clip_rate  # no steps yet
            0.0
        """
        return self.clipped / self.observed if self.observed else 0.0

    @property
    def growth_interval(self) -> int | None:
        """The scaler's ``growth_interval`` the scale health is judged by (:attr:`ScaleHealth.reach`);
        a resume that changes it is replayed by ``report`` through this (``REPLAYED_POLICY``).

        Example::

            >>> m = RunMonitor(window=100, growth_interval=10)
            >>> m.growth_interval = 20
            >>> m.health.reach, m.health.settle
            (260, 10)
        """
        return self.health.growth_interval

    @growth_interval.setter
    def growth_interval(self, growth_interval: int | None) -> None:
        self.health.growth_interval = growth_interval

    @property
    def thresholds(self) -> dict[str, Any]:
        """The :data:`THRESHOLDS` this monitor judges by, by name.

        Example::

            >>> RunMonitor(window=16, growth_interval=5).thresholds
            {'window': 16, 'alert_rate': 0.05, 'min_steps': 100, 'growth_interval': 5}
        """
        return {name: getattr(self, name) for name in THRESHOLDS}

    @property
    def scale_verdict(self) -> str:
        """The :class:`ScaleHealth` verdict, or ``none (no loss scaler)``.

        Example::

            >>> RunMonitor(scaler_enabled=False).scale_verdict, RunMonitor().scale_verdict
            ('none (no loss scaler)', 'stable')
        """
        return self.health.verdict if self.scaler_enabled else "none (no loss scaler)"

    def skips_text(self) -> str:
        """``reason=count`` pairs, sorted, or ``none``.

        Example::

            >>> RunMonitor().skips_text()
            'none'
        """
        return ", ".join(f"{reason}={n}" for reason, n in sorted(self.skips.items())) or "none"

    def loss_origins_text(self) -> str | None:
        """Whose non-finite losses the skips were (torchrun), most first, or None when no skip
        named one.

        Example::

            >>> m = RunMonitor()
            >>> m.loss_origins.update({"rank 1": 5, "every rank": 1, "rank 0": 1})
            >>> m.loss_origins_text()
            'rank 1 (5), every rank (1), rank 0 (1)'
        """
        return ", ".join(f"{on} ({n})" for on, n in self.loss_origins.most_common()) or None

    def stats_line(self) -> str:
        """The log-interval line: ``STATS <step> skip_rate=... clip_rate=... scale=<verdict> skips=...``.

        Example::

            >>> RunMonitor(scaler_enabled=False).stats_line()
            'STATS 0 skip_rate=0.000 clip_rate=0.000 scale=none (no loss scaler) skips=none'
        """
        return (
            f"STATS {self.steps} skip_rate={self.skip_rate:.3f} clip_rate={self.clip_window.seen_mean:.3f} "
            f"scale={self.scale_verdict} skips={self.skips_text()}"
        )

    def summary(self) -> str:
        """``steps=20 updates=19 skips=1 (non_finite_grad=1) final_scale=512 final_loss=0.01``:
        ``final_loss`` is the last applied step's (a skipped step left the model as it was; its
        loss, a NaN or a spike, is not the model's), with its step when that is not the last.

        Example::

            >>> RunMonitor().summary()
            'steps=0 updates=0 skips=0 (none)'
        """
        unseen = f" (1 to {self.unobserved} not observed)" if self.unobserved else ""
        text = f"steps={self.steps}{unseen} updates={self.updates} skips={sum(self.skips.values())} "
        text += f"({self.skips_text()})"
        if self.last.get("scaler_scale") is not None:
            text += f" final_scale={self.last['scaler_scale']:.6g}"
        loss, step = self.final_loss_and_step
        if loss is not None:
            text += f" final_loss={loss:.6g}" + (f" (step {step})" if step is not None and step != self.steps else "")
        return text

    @property
    def max_skip_rate_text(self) -> str:
        """The highest rolling skip rate, and the highest the guard judged when the two differ
        (the fp16 scaler's opening search set aside while the window was young): the run card's
        and ``report``'s "max rolling skip rate".

        Example::

            >>> m = RunMonitor(window=8)
            >>> m.max_rolling_skip_rate, m.max_skip_rate = 1.0, 0.0
            >>> print(m.max_skip_rate_text)
            1.0000 (0.0000 as the guard judged it: the fp16 scaler's opening search set aside)
        """
        text = f"{self.max_rolling_skip_rate:.4f}"
        if f"{self.max_skip_rate:.4f}" != text:
            text += f" ({self.max_skip_rate:.4f} as the guard judged it: the fp16 scaler's opening search set aside)"
        return text

    @property
    def final_loss_and_step(self) -> tuple[float | None, int | None]:
        """The last applied step's finite loss and its step (None, None when no step applied);
        a state saved before they were kept gives the last record's loss."""
        if self.final_loss is not None or not self.updates:
            return self.final_loss, self.final_loss_step
        return self.last.get("loss"), None

    # -------------------------------------------------------------- state

    _SCALARS = (
        "steps", "updates", "clipped", "alerting", "scale_alerting", "alert_episodes", "max_skip_rate",
        "above_fail", "at_floor_skipped", "opening", "in_opening", "opening_settled", "first_loss", "best_loss",
        "eval_last", "eval_best", "max_rolling_skip_rate", "final_loss", "final_loss_step", "unobserved",
        "restarted_by_skip_guard", "taken_over_scale",
    )
    # new name -> its name in older states (an older state's judged maximum is the closest it holds)
    _RENAMED = {"at_floor_skipped": "below_min_scale", "max_rolling_skip_rate": "max_skip_rate"}
    _COUNTS = ("steps", "updates", "clipped", "alert_episodes", "above_fail", "at_floor_skipped", "opening",
               "unobserved")
    _FLAGS = ("alerting", "scale_alerting", "in_opening", "opening_settled", "restarted_by_skip_guard")

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-safe) from which :meth:`load_state_dict` continues identically.

        Example::

            >>> state = RunMonitor(window=8).state_dict()
            >>> state["steps"], state["skip_window"]["size"], state["failed"]
            (0, 8, None)
        """
        return {
            **{name: getattr(self, name) for name in self._SCALARS},
            "failed": None if self.failed is None else self.failed.as_dict(),
            "skips": dict(self.skips),
            "loss_origins": dict(self.loss_origins),
            "last": dict(self.last),
            "skip_window": self.skip_window.state_dict(),
            "clip_window": self.clip_window.state_dict(),
            "health": self.health.state_dict(),
            # the threshold above_fail was counted under, and the rates judged since the window
            # (re)started, as [rate, steps] runs: a resume that changes fail_rate counts above_fail
            # again under its own (load_state_dict)
            "fail_rate": self.fail_rate,
            "judged_runs": [[rate, steps] for rate, steps in self._runs],
            "min_judged_rate": self.min_judged_rate,  # (at_end: above fail_rate at every step)
            # the collapse streak's first step and the scale it ran with (its FAIL's words)
            "floor_reached": None if self._floor_reached is None else list(self._floor_reached),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`. A key missing from an older state takes its default
        (a fresh monitor's value); a window of another size is refused (``ValueError``).

        A saved failure (``failed``) is not restored: the resumed run judges its steps with its
        own thresholds, which a resume may have changed (docs/resume.md). The counters go on, so
        with the same thresholds the guard trips again at the first step whose rate is still
        above; with ``fail_rate`` off, it does not; with another ``fail_rate``, the steps in a row
        above it are counted again from the rates the state judged (``judged_runs``, every step
        since the window started, saved with the ``fail_rate`` they were counted under): a raised
        rate trips only on steps above it, as a run with it from its start would, whatever
        ``fail_after`` the resume sets.

        Older states: ``judged_rates`` (one rate a step, the last ``fail_after`` of them) is read
        as runs; the state of a run that skipped every step it observed has them all (each step
        1.0, the opening search's 0). A state saved without its ``fail_rate`` (ampguard before
        the recount; ``train --resume`` gives it the checkpoint's config's ``monitor.fail_rate``
        before it loads) has a count made under a rate not known: it counts again from the rates
        the state kept (none: 0), short rather than over: such a resume cannot fail on steps that
        were not above its rate, and may fail up to ``fail_after`` steps later than the run would
        have. A state without ``min_judged_rate`` takes the lowest of its ``judged_rates`` when
        they are every step the monitor judged (1.0 when every step skipped); else, when its
        ``above_fail`` covers every step judged, the lowest rate above its ``fail_rate``; else 0
        (the end's judgement does not fail on it).

        Example::

            >>> old = RunMonitor(window=8).state_dict()
            >>> del old["at_floor_skipped"]  # saved before this counter existed
            >>> m = RunMonitor(window=8)
            >>> m.load_state_dict(old)
            >>> m.at_floor_skipped
            0
        """
        self.check_state(state)  # first: a state that does not fit leaves this monitor untouched
        for name, win in (("skip_window", self.skip_window), ("clip_window", self.clip_window)):
            if name in state:
                win.load_state_dict(state[name])
        for name, value in self._saved_scalars(state).items():
            setattr(self, name, value)
        self.failed = None
        if "in_opening" not in state:  # saved before the opening was kept: over unless nothing ran
            self.in_opening = self.steps == 0
        if "opening_settled" not in state:  # (saved before: settled when an observed step applied, and only then)
            observed = self.steps - self.unobserved
            self.opening_settled = sum(state.get("skips", {}).values()) < observed
        self.skips = Counter(state.get("skips", {}))
        self._runs = []
        if "judged_runs" in state:
            self._runs = [(float(rate) + 0.0, int(steps)) for rate, steps in state["judged_runs"]]  # (-0.0 is 0)
        elif self.observed and sum(self.skips.values()) >= self.observed:
            self._runs = self._all_skipped_runs()  # (an older state of a run that skipped every step: exact)
        else:  # (an older state: one rate a step, the last fail_after of them, or none)
            for rate in state.get("judged_rates", ()):
                self._push_rate(float(rate) + 0.0)
        self.min_judged_rate = (float(state["min_judged_rate"]) + 0.0 if "min_judged_rate" in state
                                else self._older_min_judged_rate(state))
        reached = state.get("floor_reached")
        self._floor_reached = None if reached is None else (int(reached[0]), float(reached[1]))
        if state.get("fail_rate", ()) != self.fail_rate:
            # a resume with another fail_rate judges with it: the steps counted above the old one are
            # counted again against the new one (docs/resume.md: "judged with the new thresholds");
            # a state without its rate (an older ampguard's) was counted under one not known: None
            self._recount_above_fail(state.get("fail_rate"))
        self.loss_origins = Counter(state.get("loss_origins", {}))
        self.last = dict(state.get("last", {}))
        if "health" in state:
            self.health.load_state_dict(state["health"])

    def _all_skipped_runs(self) -> list[tuple[float, int]]:
        """The judged rates since the window (re)started of a run that skipped every step it
        observed (for an older state, which kept fewer or none): each step of the opening search
        judged 0 (the window held only its skips), each other 1.0 (no step applied)."""
        held = min(self.skip_window.count, self.observed)  # (the steps since the window started)
        opening = max(0, min(self.opening - (self.observed - held), held))  # (the first ones observed)
        return self._skipped_runs(held, opening)

    def _skipped_runs(self, held: int, opening: int = 0) -> list[tuple[float, int]]:
        """The judged rates, as runs, of the first ``held`` steps since the window started, each
        skipped, the first ``opening`` of them the opening search's (0): 1.0 each, but in a window
        a rollback restarted the j-th reads j/min(min_steps, window) until it holds that many
        (review 54k: the young window's count, :meth:`_young_after_restart`)."""
        settle = min(self.min_steps, self.window) if self.skip_window.count < self.observed else 0
        young = [((j - opening) / settle, 1) for j in range(opening + 1, min(held + 1, settle))]  # (the opening set aside)
        return [(rate, steps) for rate, steps in ((0.0, opening), *young, (1.0, held - opening - len(young))) if steps]

    def _older_min_judged_rate(self, state: dict[str, Any]) -> float:
        """:attr:`min_judged_rate` of a state saved before it was kept (called once its scalars
        and skips are loaded, ``above_fail`` as saved): a value that is above a ``fail_rate`` only
        when every step judged (the opening's set aside) was."""
        judged = self.observed - self.opening  # (the steps after the opening: its own are the first)
        if judged <= 0 or sum(self.skips.values()) >= self.observed:  # (none, or each skipped: 1.0)
            return 1.0
        rates = state.get("judged_rates")
        if isinstance(rates, list) and len(rates) == self.observed:  # (every step's: no rollback, < fail_after)
            return min(float(rate) for rate in rates[self.opening:]) + 0.0
        rate = state.get("fail_rate")
        if rate is not None and self.above_fail >= judged:  # (each one above the rate it was counted under)
            return min(math.nextafter(float(rate), 2.0), 1.0)
        return 0.0

    def _saved_scalars(self, state: dict[str, Any]) -> dict[str, Any]:
        """The scalars of a saved ``state``: a name missing (an older state) takes its older
        name's value, else its default."""
        defaults = self._scalar_defaults()
        return {name: state.get(name, state.get(self._RENAMED.get(name, name), defaults[name]))
                for name in self._SCALARS}

    def check_state(self, state: Any, where: str = "") -> None:
        """Raise ``ValueError`` naming the field (after the prefix ``where``) unless ``state`` is
        one :meth:`load_state_dict` can take: windows of this monitor's size
        (:meth:`RollingWindow.check_state`), counters ints >= 0, flags True or False, rates and
        losses finite numbers, the skip counts and the last and held-out values mappings of names
        to numbers, the scale health's state (:meth:`ScaleHealth.check_state`). A key an older
        state lacks is not looked for.

        Example::

            >>> m = RunMonitor(window=8)
            >>> for bad in ({"updates": "x"}, {"skips": {"non_finite_grad": -1}}, {"skip_window": {"size": 4}}):
            ...     try:
            ...         m.check_state({**m.state_dict(), **bad})
            ...     except ValueError as err:
            ...         print(err)
            updates is 'x', expected an int >= 0
            skips is a dict of 1, expected a mapping of names to ints >= 0
            skip_window was saved with size 4, this one has 8
        """
        _mapping(state, where)
        for name in ("steps", "updates"):  # (every layout saved them: without them it is no monitor's state)
            _get(state, name, where)
        for name, win in (("skip_window", self.skip_window), ("clip_window", self.clip_window)):
            if name in state:
                win.check_state(state[name], f"{where}{name}.")
        scalars = self._saved_scalars(state)
        for name in self._COUNTS:
            _need(whole_number(scalars[name]), f"{where}{name}", scalars[name], "an int >= 0")
        for name in ("unobserved", "updates"):
            _need(scalars[name] <= scalars["steps"], f"{where}{name}", scalars[name],
                  f"an int in [0, steps {scalars['steps']}]")
        for name in self._FLAGS:
            _need(_flag(scalars[name]), f"{where}{name}", scalars[name], "True or False")
        for name in ("max_skip_rate", "max_rolling_skip_rate"):
            rate = scalars[name]
            _need(finite_number(rate) and 0 <= rate <= 1, f"{where}{name}", rate, "a number in [0, 1]")
        taken = scalars["taken_over_scale"]
        _need(taken is None or (finite_number(taken) and 0 < taken <= MAX_SCALE), f"{where}taken_over_scale", taken,
              f"a loss scale in (0, {MAX_SCALE:g}] or None")
        if "fail_rate" in state:
            rate = state["fail_rate"]
            _need(rate is None or (finite_number(rate) and 0 <= rate <= 1), f"{where}fail_rate", rate,
                  "a number in [0, 1] or None")
        if "judged_rates" in state:  # (an older state's)
            rates = state["judged_rates"]
            _need(isinstance(rates, list) and len(rates) <= scalars["steps"]
                  and all(finite_number(r) and 0 <= r <= 1 for r in rates), f"{where}judged_rates", rates,
                  f"a list of at most steps {scalars['steps']} numbers in [0, 1]")
        if "judged_runs" in state:
            runs = state["judged_runs"]
            ok = isinstance(runs, list) and all(
                isinstance(run, list) and len(run) == 2 and finite_number(run[0]) and 0 <= run[0] <= 1
                and whole_number(run[1], 1) for run in runs)
            _need(ok and all(a[0] < b[0] for a, b in zip(runs, runs[1:]))
                  and sum(run[1] for run in runs) <= scalars["steps"], f"{where}judged_runs", runs,
                  f"a list of [a rate in [0, 1], steps >= 1], the rates rising, at most steps {scalars['steps']} in all")
            window = state.get("skip_window")
            count = window.get("count") if isinstance(window, dict) else None
            if whole_number(count):  # (every step since the window started, at most: fewer after an older state)
                _need(sum(run[1] for run in runs) <= count, f"{where}judged_runs", runs,
                      f"at most skip_window.count {count} steps in all (the steps since the window started)")
        if "min_judged_rate" in state:
            rate = state["min_judged_rate"]
            _need(finite_number(rate) and 0 <= rate <= 1, f"{where}min_judged_rate", rate, "a number in [0, 1]")
            window = state.get("skip_window")
            count = window.get("count") if isinstance(window, dict) else None
            judged = scalars["steps"] - scalars["unobserved"]
            # (a step judged, the window never restarted: the lowest is one of them. After a rollback the end's
            # lowest counts a young window's steps by what they held, k of n, above the k/min(min_steps,
            # window) the guards judged them at: review 54k)
            if judged > scalars["opening"] and whole_number(count) and count >= judged:
                _need(rate <= scalars["max_skip_rate"], f"{where}min_judged_rate", rate,
                      f"at most max_skip_rate {scalars['max_skip_rate']} (the lowest of the rates judged)")
        reached = state.get("floor_reached")
        _need(reached is None or (isinstance(reached, list) and len(reached) == 2 and whole_number(reached[0])
                                  and finite_number(reached[1]) and reached[1] > 0), f"{where}floor_reached", reached,
              "None or [a step, a scale > 0]")
        for name in ("first_loss", "best_loss", "final_loss"):
            _need(_number_or_none(scalars[name]), f"{where}{name}", scalars[name], "a finite number or None")
        step = scalars["final_loss_step"]
        _need(step is None or whole_number(step), f"{where}final_loss_step", step, "an int >= 0 or None")
        # held-out metrics may be non-finite (a diverged evaluation), the best ones never; so may
        # the last record's values (a NaN loss)
        _need(_names_to(scalars["eval_last"], real_number), f"{where}eval_last", scalars["eval_last"],
              "a mapping of names to numbers")
        _need(_names_to(scalars["eval_best"], finite_number), f"{where}eval_best", scalars["eval_best"],
              "a mapping of names to finite numbers")
        skips, last = state.get("skips", {}), state.get("last", {})
        _need(_names_to(skips, whole_number), f"{where}skips", skips, "a mapping of names to ints >= 0")
        origins = state.get("loss_origins", {})
        _need(_names_to(origins, whole_number), f"{where}loss_origins", origins, "a mapping of names to ints >= 0")
        _need(_names_to(last, lambda v: v is None or real_number(v)), f"{where}last", last,
              "a mapping of names to numbers or None")
        if "health" in state:
            self.health.check_state(state["health"], f"{where}health.")


SPIKE_STD_FLOOR = 2.0 ** -7  # (bfloat16's machine epsilon)
"""The smallest spread :class:`LossSpikeDetector` judges by, relative to the window's mean (and
2**-23 beside it, for a mean of 0): bfloat16's resolution there, the coarsest a loss is computed
in (float32's called the next bf16 value of a flat bf16 loss, +0.4%, a spike: review 51j; a floor
of at least 2**-7 hid a converged 0.01 going to 0.03: 51m). With ``z`` 6, a flat window's next
loss is a spike from about 5% above it."""


class LossSpikeDetector:
    """Flags a loss above ``mean + z * std`` of the last ``window`` applied steps' losses (the
    spread at least :data:`SPIKE_STD_FLOOR` times the mean: a window of equal losses).

    O(1) per step (rolling sums of x and x^2). Judges nothing until the window is full (at the
    run's start; a rollback takes back the checkpoint's window: :meth:`restore_or_reset`), and a
    spike does not enter a full window (so one spike does not hide the next); while it fills,
    every finite loss enters it. Non-finite losses are the skip machinery's business, not this
    detector's.

    Example::

        >>> d = LossSpikeDetector(window=4, z=3.0)
        >>> [d.check(v) for v in (1.0, 1.1, 0.9, 1.0)]  # filling the window: nothing judged
        [False, False, False, False]
        >>> d.check(1.05), d.check(50.0), d.check(float("nan"))
        (False, True, False)
    """

    def __init__(self, window: int, z: float) -> None:
        self.z = z
        self._sum = RollingWindow(window)
        self._sq = RollingWindow(window)

    def check(self, loss: float | None) -> bool:
        """True if ``loss`` is a spike; otherwise it joins the window (see the class example)."""
        if loss is None or not math.isfinite(loss):
            return False
        w = self._sum
        if w.count >= w.size:
            mean = w.mean
            # (at least bfloat16's resolution at the mean: a window of equal losses, a cross-entropy
            # at 0 or stuck at ln 2, has no spread, and the next loss one rounding up was a "spike")
            floor = SPIKE_STD_FLOOR * abs(mean) + 2.0**-23
            std = max(math.sqrt(max(0.0, self._sq.total / w.size - mean * mean)), floor)
            if loss > mean + self.z * std:
                return True
        self._sum.push(loss)
        self._sq.push(loss * loss)
        return False

    def restore_or_reset(self, state: Any) -> None:
        """After a rollback: the window the checkpoint it returns to kept (its losses are the
        model's the run goes on with); where that one is not full (``step-00000000.pt``'s) or
        kept none that reads, this one's when it is full, else an empty one. Emptied,
        the window judged nothing until it filled again (``rollback.window`` applied steps), and
        a spike in that time joined it and hid the next ones (review 51i: spikes at 5, 7 and 9,
        only 5 rolled back).

        Example::

            >>> d = LossSpikeDetector(window=2, z=1.0)
            >>> d.check(1.0), d.check(1.0)
            (False, False)
            >>> kept = d.state_dict()
            >>> d.check(1.5)  # a spike, rolled back
            True
            >>> d.restore_or_reset(kept); d.check(100.0)  # judged at once, against the checkpoint's window
            True
            >>> d.restore_or_reset(LossSpikeDetector(window=2, z=1.0).state_dict()); d.check(100.0)  # (its own, full)
            True
            >>> d.reset(); d.restore_or_reset(None); d.check(100.0)  # none kept, none full: nothing to judge against
            False
        """
        full = self._sum.count >= self._sum.size
        try:
            self.check_state(state)
        except ValueError:
            if not full:  # (none kept, and this one judges nothing yet either)
                self.reset()
            return
        kept = LossSpikeDetector(self._sum.size, self.z)
        kept.load_state_dict(state)
        if kept._sum.count >= kept._sum.size or not full:  # (a checkpoint's window not yet full, step 0's: this
            # full one judges on, its losses those of a model like the one the run goes on with; review 51j)
            self.load_state_dict(state)

    def reset(self) -> None:
        """Forget the window (after a rollback to a checkpoint that kept none).

        Example::

            >>> d = LossSpikeDetector(window=2, z=1.0)
            >>> d.check(1.0), d.check(1.0)
            (False, False)
            >>> d.reset()
            >>> d.check(100.0)  # the window is empty again: nothing to judge against
            False
        """
        self._sum = RollingWindow(self._sum.size)
        self._sq = RollingWindow(self._sq.size)

    def state_dict(self) -> dict[str, Any]:
        """Plain data for :meth:`load_state_dict`.

        Example::

            >>> sorted(LossSpikeDetector(window=2, z=1.0).state_dict())
            ['sq', 'sum']
        """
        return {"sum": self._sum.state_dict(), "sq": self._sq.state_dict()}

    def check_state(self, state: Any, where: str = "") -> None:
        """Raise ``ValueError`` naming the field (after the prefix ``where``) unless ``state`` is
        one :meth:`load_state_dict` can take: the two windows' (:meth:`RollingWindow.check_state`).

        Example::

            >>> d = LossSpikeDetector(window=2, z=1.0)
            >>> d.check_state({"sum": d.state_dict()["sum"]}, "loss_spike.")
            Traceback (most recent call last):
            ...
            ValueError: loss_spike.sq is missing
        """
        _mapping(state, where)
        for name, win in (("sum", self._sum), ("sq", self._sq)):
            win.check_state(_get(state, name, where), f"{where}{name}.")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Example::

            >>> a = LossSpikeDetector(window=2, z=1.0)
            >>> a.check(1.0), a.check(1.0)
            (False, False)
            >>> b = LossSpikeDetector(window=2, z=1.0)
            >>> b.load_state_dict(a.state_dict())
            >>> b.check(5.0)
            True

        A field that is not what :meth:`state_dict` writes is refused (``ValueError``, this
        detector untouched)::

            >>> b.load_state_dict({"sum": a.state_dict()["sum"], "sq": {**a.state_dict()["sq"], "ring": [1.0]}})
            Traceback (most recent call last):
            ...
            ValueError: sq.ring is a list of 1, expected a list of 2 finite numbers
        """
        self.check_state(state)  # both windows checked before either is loaded
        self._sum.load_state_dict(state["sum"])
        self._sq.load_state_dict(state["sq"])
