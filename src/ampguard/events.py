"""What a run tells people besides its per-step records: the event log and the console.

Events (alerts, failures, checkpoints, rollbacks, resumes, diagnoses) go to ``events.jsonl``
as one JSON object a line, and the ones a person should see now also to the console as one
line that starts with a word (``ALERT``, ``CLEAR``, ``FAIL``, ``ROLLBACK``, ...). Under torchrun
only rank 0 has an :class:`EventLog` that writes or prints.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .files import DiskFull
from .sinks import JsonlSink


def event_word(kind: str) -> str:
    """The console word for a monitor event's kind.

    Example::

        >>> event_word("fail"), event_word("skip_rate_alert"), event_word("scale_clear")
        ('FAIL', 'ALERT', 'CLEAR')
    """
    return "FAIL" if kind == "fail" else "ALERT" if kind.endswith("_alert") else "CLEAR"


class EventLog:
    """``events.jsonl`` (when the run has a folder) and the console.

    Example::

        >>> lines = []
        >>> log = EventLog(None, lines.append)
        >>> log.emit({"step": 7, "event": "rollback", "message": "loss spike"}, "ROLLBACK")
        >>> lines
        ['ROLLBACK 7 loss spike']
    """

    def __init__(self, path: Path | None, say: Callable[[str], None], *, append: bool = False) -> None:
        self.say = say
        self._sink = JsonlSink(path, append=append) if path is not None else None
        self.failed: DiskFull | None = None
        """The write that found the disk full; the log writes nothing after it (the console
        words go on). The run stops at the step's end (``Trainer``)."""

    def emit(self, event: dict[str, Any], word: str | None = None) -> None:
        """Append ``event`` (with the time) to the log; with ``word``, also print ``WORD step message``."""
        if self._sink is not None:
            try:
                self._sink.write_event({"time": round(time.time(), 3), **event})
            except DiskFull as full:
                self._fail(full, through=event.get("step"))
        if word is not None:
            self.say(f"{word} {event['step']} {event['message']}")

    def sync(self) -> None:
        """The events written so far made durable (before a checkpoint: ``JsonlSink.sync``)."""
        if self._sink is not None:
            try:
                self._sink.sync()
            except DiskFull as full:
                self._fail(full, through=None)

    def close(self) -> None:
        if self._sink is not None:
            try:
                self._sink.close()
            except DiskFull as full:
                self._fail(full, through=None)
            self._sink = None

    def _fail(self, full: DiskFull, through: int | None) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            try:
                sink.close()
            except DiskFull:  # what was left in its buffer found no room either
                pass
        if self.failed is None:
            full.through = through
            self.failed = full


def progress_bar(total: int, initial: int = 0) -> Any:
    """A tqdm bar on stderr, off when stderr is not a terminal, timed by the monotonic clock
    (:func:`_monotonic_tqdm`)."""
    return _monotonic_tqdm()(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                             disable=None)


@functools.cache
def _monotonic_tqdm() -> type:
    """tqdm timing its bar (elapsed, rate, ETA) by ``time.monotonic``, as :class:`Throughput` does.
    Its own clock is the wall clock, which can be stepped (NTP, an admin, a VM's resume): stepped
    back, the bar showed a negative elapsed time and stopped refreshing; forward, an ETA of years
    (review 58c). tqdm has no public setting for it: its clock is the private ``_time`` (4.x),
    set in ``__init__``, so it is replaced only where a bar has one (a tqdm without it, or a
    disabled bar, keeps its own). tqdm's monitor thread still reads the wall clock, so it takes
    this bar's last print for long ago: every 10 s, if the bar lets updates pass between prints
    (``miniters`` > 1), it refreshes it and sets ``miniters`` back to 1 (what it does to a bar
    that has not printed for 10 s), nothing else."""
    from tqdm import tqdm

    class MonotonicTqdm(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if callable(getattr(self, "_time", None)):
                self._time = time.monotonic
                self.start_t = self.last_print_t = self._time()

    return MonotonicTqdm


PEAK_TFLOPS: dict[str, float] = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H200 NVL": 835.0, "H100": 989.0,
                                  "H200": 989.0, "GH200": 989.0, "A100": 312.0}
"""Dense bf16/fp16 tensor-core peaks (TFLOP/s, the vendors' datasheets) of the GPUs whose MFU a
run reports without ``log.peak_tflops``, matched against the device's name: the PCIe and NVL
parts first, then a bare name, which is the SXM part."""


def known_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``device_name`` (:data:`PEAK_TFLOPS`), or None.

    Example::

        >>> known_peak_tflops("NVIDIA H200"), known_peak_tflops("NVIDIA A100-SXM4-80GB"), known_peak_tflops("cpu")
        (989.0, 312.0, None)
        >>> known_peak_tflops("NVIDIA H100 PCIe"), known_peak_tflops("NVIDIA H100 NVL")
        (756.0, 835.0)
    """
    words = device_name.replace("-", " ").split()
    return next((peak for name, peak in PEAK_TFLOPS.items()
                 if any(words[i:i + len(name.split())] == name.split() for i in range(len(words)))), None)


class Throughput:
    """Training throughput for the ``STATS`` line and the run card: tokens/s for a model fed
    integer token ids (a batch's ``numel``), examples/s otherwise (its first dimension), over the
    wall time since the previous line (so it includes what the loop did between: evaluation,
    checkpoints). With the model's FLOPs per token and the device's peak FLOP/s it adds the
    model FLOPs utilisation (MFU: achieved model FLOP/s over the peak, nanoGPT's measure).
    Under torchrun (``ranks``: the world size) each rank counts its own slice and the rate is
    the job's (every rank trains an equal slice of the global batch); the MFU is per GPU.

    Example (a fake clock)::

        >>> import torch
        >>> now = iter([0.0, 2.0, 3.0])
        >>> meter = Throughput(clock=lambda: next(now))
        >>> meter.add(torch.zeros(4, 64, dtype=torch.long)); meter.add(torch.zeros(4, 64, dtype=torch.long))
        >>> meter.take()
        ' tokens/s=256'
        >>> meter.add(torch.zeros(8, 3)); meter.take()
        ' examples/s=8'
        >>> Throughput(clock=lambda: 0.0).take()  # nothing measured: nothing said
        ''
        >>> now = iter([0.0, 1.0, 3.0, 3.0])  # 1 GFLOP a token against a 1 TFLOP/s peak
        >>> meter = Throughput(clock=lambda: next(now), flops_per_token=1e9, peak_flops=1e12)
        >>> meter.steady(); meter.add(torch.zeros(2, 100, dtype=torch.long)); meter.take()
        ' tokens/s=67 mfu=6.67%'
        >>> meter.summary()  # since steady(), at 1.0
        '100 tokens/s, MFU 10% (from the end of the first step, wall clock)'
        >>> now = iter([0.0, 1.0, 2.0, 9.0])  # two ranks; the run's clock stops at the last step
        >>> meter = Throughput(clock=lambda: next(now), flops_per_token=1e9, peak_flops=1e12, ranks=2)
        >>> meter.steady(); meter.add(torch.zeros(2, 100, dtype=torch.long)); meter.ended(); meter.summary()
        '400 tokens/s, MFU 20% (from the end of the first step to the end of the last, wall clock)'
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, flops_per_token: float | None = None,
                 peak_flops: float | None = None, ranks: int = 1) -> None:
        self._clock = clock
        self._since = clock()
        self._items, self._unit = 0, ""
        self.flops_per_token, self.peak_flops, self.ranks = flops_per_token, peak_flops, ranks
        self._run_since: float | None = None
        self._run_until: float | None = None
        self._run_items = 0

    def add(self, inputs: Any) -> None:
        """Count one micro-batch's inputs (anything that is not a tensor counts nothing)."""
        shape = getattr(inputs, "shape", None)
        if shape is None or not len(shape):
            return
        tokens = not inputs.is_floating_point()
        n = (inputs.numel() if tokens else shape[0]) * self.ranks
        self._items += n
        if self._run_since is not None:
            self._run_items += n
            self._run_until = None  # training again (a rollback from the last step)
        self._unit = "tokens" if tokens else "examples"

    def steady(self) -> None:
        """Start the run's own count (:meth:`summary`) now: after the first step, which pays for
        compiling, allocating and warming up."""
        if self._run_since is None:
            self._run_since = self._clock()

    def ended(self) -> None:
        """Stop the run's own count now: at the end of its last step, before the final
        evaluation and checkpoint (a step trained after it, once a rollback undid the last
        one, starts it again)."""
        self._run_until = self._clock()

    def _rate(self, items: int, elapsed: float) -> tuple[str, str | None]:
        """Items per second and the MFU (None where unknown), as text: ``"1,234"``, ``"42.3%"``."""
        mfu = None
        if self._unit == "tokens" and self.flops_per_token and self.peak_flops:
            peak = self.peak_flops * self.ranks  # each GPU's share of the job's FLOP/s
            mfu = f"{100 * items * self.flops_per_token / elapsed / peak:.3g}%"  # 42.3%, 0.0412%
        return f"{items / elapsed:,.0f}", mfu

    def take(self) -> str:
        """`` tokens/s=N`` (or examples; `` mfu=P%`` with FLOPs and a peak) since the last call,
        and start counting again."""
        now = self._clock()
        elapsed, self._since = now - self._since, now
        items, self._items = self._items, 0
        if not items or elapsed <= 0:
            return ""
        rate, mfu = self._rate(items, elapsed)
        return f" {self._unit}/s={rate}" + (f" mfu={mfu}" if mfu else "")

    def summary(self) -> str | None:
        """The run's throughput since :meth:`steady` (the run card's line), or None before it."""
        if self._run_since is None or not self._run_items:
            return None
        until = self._run_until if self._run_until is not None else self._clock()
        elapsed = until - self._run_since
        if elapsed <= 0:
            return None
        rate, mfu = self._rate(self._run_items, elapsed)
        span = "from the end of the first step" + (" to the end of the last" if self._run_until is not None else "")
        return f"{rate} {self._unit}/s" + (f", MFU {mfu}" if mfu else "") + f" ({span}, wall clock)"
