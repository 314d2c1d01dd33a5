"""Run health from the stream of step records: rolling skip rate, alerts, fail-fast, scale health.

Everything here reads records after the step made them (it is a sink); nothing runs inside the
step. Each piece keeps O(1) work per step and a ``state_dict`` so a resumed run continues its
windows exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .records import StepRecord

HEALTH_VERDICTS: tuple[str, ...] = ("warming", "climbing", "stable", "oscillating", "collapsing")


# Every double is a whole multiple of 2**-1074, so sums kept as integers in those units are
# exact, and converting back divides once, correctly rounded: a window's total is always what
# math.fsum of the values it holds would give, however long the run.
_UNITS = 2**1074


def _exact(value: float) -> int:
    num, den = float(value).as_integer_ratio()
    return num * (_UNITS // den)


class RollingWindow:
    """The sum of the last ``size`` values pushed, kept exactly in O(1) per push (a ring buffer).

    ``mean`` divides by ``size`` even before the window has filled: steps before the first one
    count as zeros, so a young run's few early skips do not read as a 100% skip rate.

    Example::

        >>> w = RollingWindow(4)
        >>> for v in (1, 0, 1, 1, 0):
        ...     w.push(v)
        >>> w.total, w.mean
        (2.0, 0.5)
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._ring = [0.0] * size
        self._pos = 0
        self.count = 0  # values pushed in all
        self._sum = 0  # exact, in units of 2**-1074

    @property
    def total(self) -> float:
        return self._sum / _UNITS

    def push(self, value: float) -> None:
        value = float(value)
        self._sum += _exact(value) - _exact(self._ring[self._pos])
        self._ring[self._pos] = value
        self._pos = (self._pos + 1) % self.size
        self.count += 1

    @property
    def mean(self) -> float:
        """Sum over the window divided by the window's size (steps before the first are zeros)."""
        return self.total / self.size

    @property
    def seen_mean(self) -> float:
        """Sum over the window divided by the values it holds so far (0 when empty)."""
        held = min(self.count, self.size)
        return self.total / held if held else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "ring": list(self._ring), "pos": self._pos, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != self.size:
            raise ValueError(f"window was saved with size {state['size']}, this one has {self.size}")
        self._ring = [float(v) for v in state["ring"]]
        self._pos = int(state["pos"])
        self.count = int(state["count"])
        self._sum = sum(_exact(v) for v in self._ring)


@dataclass
class Event:
    """Something a person should hear about: an alert starting or clearing, a failure."""

    step: int
    kind: str  # skip_rate_alert | skip_rate_clear | scale_alert | scale_clear | fail
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "event": self.kind, "message": self.message, **self.data}


class ScaleHealth:
    """Classifies the loss-scale history over the last ``window`` steps.

    - ``warming``: the only moves are the back-offs of the run's opening streak of skips, the
      usual search down from ``init_scale`` for a scale that fits;
    - ``oscillating``: at least 2 rises and 2 falls in the window (repeated halve/double:
      gradients sometimes out of fp16's range);
    - ``collapsing``: the scale is below ``min_scale``, or (outside warm-up) it fell by a factor
      of 8 or more over the window with no rise: heading for underflow;
    - ``climbing``: more rises than falls;
    - ``stable``: otherwise (no moves, or a few that cancel).
    """

    def __init__(self, window: int, min_scale: float = 1.0, init_scale: float | None = None) -> None:
        self.window = window
        self.min_scale = min_scale
        self._windows = {name: RollingWindow(window) for name in ("ups", "downs", "log2", "opening_downs", "opening_log2")}
        self.scale: float | None = init_scale  # the scale before the next step
        self._opening = True  # still in the run's opening streak of skips

    def push(self, scale: float, skipped: bool) -> None:
        prev = self.scale
        move = math.log2(scale / prev) if prev and prev > 0 and scale > 0 else 0.0
        self._opening = self._opening and skipped
        opening = move if self._opening else 0.0
        for name, value in (
            ("ups", move > 0),
            ("downs", move < 0),
            ("log2", move),
            ("opening_downs", opening < 0),
            ("opening_log2", opening),
        ):
            self._windows[name].push(float(value))
        self.scale = scale

    @property
    def verdict(self) -> str:
        w = {name: win.total for name, win in self._windows.items()}
        if self.scale is not None and self.scale < self.min_scale:
            return "collapsing"
        ups, downs = w["ups"], w["downs"] - w["opening_downs"]
        if ups == 0 and downs == 0:
            return "warming" if w["opening_downs"] > 0 else "stable"
        if ups >= 2 and downs >= 2:
            return "oscillating"
        if ups == 0 and w["log2"] - w["opening_log2"] <= -3:  # a fall by 8x or more
            return "collapsing"
        if ups > downs:
            return "climbing"
        return "stable"

    def state_dict(self) -> dict[str, Any]:
        return {
            "windows": {name: win.state_dict() for name, win in self._windows.items()},
            "scale": self.scale,
            "opening": self._opening,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, win in self._windows.items():
            win.load_state_dict(state["windows"][name])
        self.scale = state["scale"]
        self._opening = bool(state["opening"])


class RunMonitor:
    """Watches a run's records: counts, rolling skip rate, alerts, fail-fast, clip rate, scale health.

    Feed it every record (:meth:`observe`); it returns the :class:`Event` s the record caused.
    ``failed`` is set once the run must stop (exit code 3).

    Alert episodes: an ``ALERT`` starts when the rolling skip rate rises above ``alert_rate``
    and clears when it falls back to it or below, one event each, not one per step. Fail-fast:
    when the rolling rate has been above ``fail_rate`` for ``fail_after`` consecutive steps
    (and likewise, with ``fail_on_scale_collapse``, the scale below ``min_scale``).
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
    ) -> None:
        self.window = window
        self.alert_rate = alert_rate
        self.fail_rate = fail_rate
        self.fail_after = fail_after
        self.max_norm = max_norm if max_norm and max_norm > 0 else None
        self.scaler_enabled = scaler_enabled
        self.min_scale = min_scale
        self.fail_on_scale_collapse = fail_on_scale_collapse

        self.skip_window = RollingWindow(window)
        self.clip_window = RollingWindow(window)
        self.health = ScaleHealth(window, min_scale, init_scale if scaler_enabled else None)
        self.steps = 0
        self.updates = 0
        self.clipped = 0
        self.skips: Counter[str] = Counter()
        self.alerting = False
        self.scale_alerting = False
        self.alert_episodes = 0
        self.max_skip_rate = 0.0
        self.above_fail = 0
        self.below_min_scale = 0
        self.first_loss: float | None = None
        self.last: dict[str, float | None] = {}
        self.best_loss: float | None = None
        self.failed: Event | None = None
        self.eval_last: dict[str, float] = {}
        self.eval_best: dict[str, float] = {}

    # -------------------------------------------------------------- per record

    def observe(self, record: StepRecord) -> list[Event]:
        v = record.values()
        self.steps = record.step
        self.last = v
        if record.skipped:
            self.skips[str(record.reason)] += 1
        else:
            self.updates += 1
            loss = v["loss"]
            if loss is not None and math.isfinite(loss):
                self.first_loss = loss if self.first_loss is None else self.first_loss
                self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
        clipped = (
            self.max_norm is not None
            and not record.skipped
            and v["grad_l2_pre_clip"] is not None
            and v["grad_l2_pre_clip"] > self.max_norm
        )
        self.clipped += clipped
        self.clip_window.push(float(clipped))
        self.skip_window.push(float(record.skipped))
        rate = self.skip_rate
        self.max_skip_rate = max(self.max_skip_rate, rate)
        scale = v["scaler_scale"] if v["scaler_scale"] is not None else 1.0
        if self.scaler_enabled:
            self.health.push(scale, record.skipped)
        return self._events(record.step, rate, scale)

    def _events(self, step: int, rate: float, scale: float) -> list[Event]:
        events: list[Event] = []
        data = {"skip_rate": rate, "window": self.window}
        if rate > self.alert_rate and not self.alerting:
            self.alerting = True
            self.alert_episodes += 1
            events.append(Event(step, "skip_rate_alert", (
                f"rolling skip rate {rate:.3f} > alert_rate {self.alert_rate:g} over the last {self.window} steps"), data))
        elif rate <= self.alert_rate and self.alerting:
            self.alerting = False
            events.append(Event(step, "skip_rate_clear", (
                f"rolling skip rate back to {rate:.3f} <= alert_rate {self.alert_rate:g}"), data))

        low = self.scaler_enabled and scale < self.min_scale
        if low and not self.scale_alerting:
            events.append(Event(step, "scale_alert", (
                f"loss scale {scale:g} fell below scaler.min_scale {self.min_scale:g}: fp16 cannot hold these gradients"),
                {"scale": scale}))
        elif not low and self.scale_alerting:
            events.append(Event(step, "scale_clear", f"loss scale back to {scale:g}", {"scale": scale}))
        self.scale_alerting = low

        self.above_fail = self.above_fail + 1 if self.fail_rate is not None and rate > self.fail_rate else 0
        self.below_min_scale = self.below_min_scale + 1 if low else 0
        if self.failed is None:
            if self.above_fail >= self.fail_after:
                self.failed = Event(step, "fail", (
                    f"rolling skip rate above fail_rate {self.fail_rate:g} for {self.fail_after} consecutive steps "
                    f"(now {rate:.3f} over the last {self.window})"), data)
            elif self.fail_on_scale_collapse and self.below_min_scale >= self.fail_after:
                self.failed = Event(step, "fail", (
                    f"loss scale below scaler.min_scale {self.min_scale:g} for {self.fail_after} consecutive steps"),
                    {"scale": scale})
            if self.failed is not None:
                events.append(self.failed)
        return events

    def observe_eval(self, metrics: dict[str, float]) -> None:
        """Keep the latest and the best held-out metrics (higher is better for accuracies)."""
        self.eval_last = dict(metrics)
        for name, value in metrics.items():
            if not math.isfinite(value):
                continue
            best = self.eval_best.get(name)
            higher = "acc" in name
            if best is None or (value > best if higher else value < best):
                self.eval_best[name] = value

    def restart_windows(self) -> None:
        """Forget the rolling windows (after a rollback): the run starts its judging afresh."""
        self.skip_window = RollingWindow(self.window)
        self.above_fail = 0
        self.below_min_scale = 0
        self.failed = None

    # -------------------------------------------------------------- views

    @property
    def skip_rate(self) -> float:
        """Skips in the last ``window`` steps divided by ``window``."""
        return self.skip_window.mean

    @property
    def clip_rate(self) -> float:
        """Share of the steps so far whose pre-clip norm exceeded ``max_norm`` ("we clip every step" is a finding)."""
        return self.clipped / self.steps if self.steps else 0.0

    @property
    def scale_verdict(self) -> str:
        return self.health.verdict if self.scaler_enabled else "none (no loss scaler)"

    def skips_text(self) -> str:
        return ", ".join(f"{reason}={n}" for reason, n in sorted(self.skips.items())) or "none"

    def stats_line(self) -> str:
        """The log-interval line: ``STATS <step> skip_rate=... clip_rate=... scale=<verdict> skips=...``."""
        return (
            f"STATS {self.steps} skip_rate={self.skip_rate:.3f} clip_rate={self.clip_window.seen_mean:.3f} "
            f"scale={self.scale_verdict} skips={self.skips_text()}"
        )

    def summary(self) -> str:
        """``steps=20 updates=19 skips=1 (non_finite_grad=1) final_scale=512 final_loss=0.01``"""
        text = f"steps={self.steps} updates={self.updates} skips={sum(self.skips.values())} ({self.skips_text()})"
        for key, label in (("scaler_scale", "final_scale"), ("loss", "final_loss")):
            if self.last.get(key) is not None:
                text += f" {label}={self.last[key]:.6g}"
        return text

    # -------------------------------------------------------------- state

    _SCALARS = (
        "steps", "updates", "clipped", "alerting", "scale_alerting", "alert_episodes", "max_skip_rate",
        "above_fail", "below_min_scale", "first_loss", "best_loss", "eval_last", "eval_best",
    )

    def state_dict(self) -> dict[str, Any]:
        return {
            **{name: getattr(self, name) for name in self._SCALARS},
            "failed": None if self.failed is None else self.failed.as_dict(),
            "skips": dict(self.skips),
            "last": dict(self.last),
            "skip_window": self.skip_window.state_dict(),
            "clip_window": self.clip_window.state_dict(),
            "health": self.health.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self._SCALARS:
            setattr(self, name, state[name])
        failed = state.get("failed")
        self.failed = None if failed is None else Event(
            failed["step"], failed["event"], failed["message"],
            {k: v for k, v in failed.items() if k not in ("step", "event", "message")})
        self.skips = Counter(state["skips"])
        self.last = dict(state["last"])
        self.skip_window.load_state_dict(state["skip_window"])
        self.clip_window.load_state_dict(state["clip_window"])
        self.health.load_state_dict(state["health"])


class LossSpikeDetector:
    """Flags a loss above ``mean + z * std`` of the last ``window`` applied steps' losses.

    O(1) per step (rolling sums of x and x^2). Judges nothing until the window is full, and a
    spike does not enter the window (so one spike does not hide the next). Non-finite losses are
    the skip machinery's business, not this detector's.
    """

    def __init__(self, window: int, z: float) -> None:
        self.z = z
        self._sum = RollingWindow(window)
        self._sq = RollingWindow(window)

    def check(self, loss: float | None) -> bool:
        """True if ``loss`` is a spike; otherwise it joins the window."""
        if loss is None or not math.isfinite(loss):
            return False
        w = self._sum
        if w.count >= w.size:
            mean = w.total / w.size
            std = math.sqrt(max(0.0, self._sq.total / w.size - mean * mean))
            if loss > mean + self.z * std:
                return True
        self._sum.push(loss)
        self._sq.push(loss * loss)
        return False

    def reset(self) -> None:
        self._sum = RollingWindow(self._sum.size)
        self._sq = RollingWindow(self._sq.size)

    def state_dict(self) -> dict[str, Any]:
        return {"sum": self._sum.state_dict(), "sq": self._sq.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sum.load_state_dict(state["sum"])
        self._sq.load_state_dict(state["sq"])
