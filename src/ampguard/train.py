"""Guarded training runs: build everything from a :class:`Config`, loop, record, stop cleanly.

``ampguard train`` and ``ampguard demo`` both come here; they differ only in their config and
in where the records go (a run folder, or the console and an optional CSV).
"""

from __future__ import annotations

import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import Config, dump_config
from .errors import InputError
from .faults import FaultInjector, parse_fault
from .monitor import RunMonitor
from .sinks import ConsoleSink, CsvSink, JsonlSink, Sink, Sinks, TensorBoardSink
from .step import AmpTrainState
from .tasks import Task, build_task

EXIT_OK = 0
EXIT_GUARD = 3
EXIT_INTERRUPTED = 130


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; ``cuda`` without a GPU is bad input."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device: cuda was asked for but no CUDA device is available")
    return torch.device(name)


def make_optimizer(config: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    opt = config.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, fused=opt.fused
    )


def lr_multiplier(config: Config) -> Callable[[int], float]:
    """The schedule as a factor of ``optimizer.lr``, a function of applied updates."""
    warmup, total, floor = config.schedule.warmup, config.steps, config.schedule.min_lr_ratio
    decay = config.schedule.decay

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if decay == "constant":
            return 1.0
        # the last step (update total - 1, when none was skipped) runs at the floor
        progress = min(1.0, (update - warmup) / max(1, total - warmup - 1))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def build_state(config: Config, task: Task, device: torch.device) -> AmpTrainState:
    """The guarded step for a config: optimizer, LR schedule, scaler, clipping, accumulation."""
    task.model.to(device)
    optimizer = make_optimizer(config, task.model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config))
    s = config.scaler
    return AmpTrainState(
        task.model,
        optimizer,
        task.loss_fn,
        precision=config.precision,
        max_norm=config.max_norm,
        accumulation_steps=config.accumulation_steps,
        scheduler=scheduler,
        device=device,
        scaler=dict(
            enabled=s.enabled,
            init_scale=s.init_scale,
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff_factor,
            growth_interval=s.growth_interval,
        ),
        scheduler_on_skip=config.scheduler_on_skip,
    )


def build_monitor(config: Config, state: AmpTrainState) -> RunMonitor:
    m = config.monitor
    return RunMonitor(
        window=m.window,
        alert_rate=m.alert_rate,
        fail_rate=m.fail_rate,
        fail_after=m.fail_after,
        max_norm=config.max_norm,
        scaler_enabled=state.scaler.is_enabled(),
        init_scale=config.scaler.init_scale,
        min_scale=config.scaler.min_scale,
        fail_on_scale_collapse=m.fail_on_scale_collapse,
    )


class StopFlag:
    requested = False


@contextmanager
def stop_on_sigint() -> Iterator[StopFlag]:
    """First Ctrl-C: finish the current step, then stop. A second one interrupts at once."""
    flag = StopFlag()

    def handler(signum: int, frame: Any) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class RunPaths:
    """What a run writes. A demo has only (maybe) a CSV; a train run has a folder with all of it."""

    csv: Path | None = None
    dir: Path | None = None

    def _in_dir(self, name: str) -> Path | None:
        return self.dir / name if self.dir is not None else None

    @property
    def events(self) -> Path | None:
        return self._in_dir("events.jsonl")

    @property
    def steps_jsonl(self) -> Path | None:
        return self._in_dir("steps.jsonl")

    @property
    def plot(self) -> Path | None:
        return self._in_dir("report.png")

    @property
    def card(self) -> Path | None:
        return self._in_dir("RUN.md")

    @property
    def config(self) -> Path | None:
        return self._in_dir("config.yaml")

    @property
    def tensorboard(self) -> Path | None:
        return self._in_dir("tensorboard")

    @classmethod
    def new_run_dir(cls, config: Config) -> RunPaths:
        """Create the run folder ``log.dir/log.name`` (a timestamp by default); never reuse one."""
        if config.log.name:
            run_dir = Path(config.log.dir) / config.log.name
            if run_dir.exists():
                raise InputError(f"run folder {run_dir} already exists; choose another log.name")
        else:  # a timestamp, made unique if another run started in the same second
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = Path(config.log.dir) / stamp
            n = 1
            while run_dir.exists():
                n += 1
                run_dir = Path(config.log.dir) / f"{stamp}-{n}"
        try:
            run_dir.mkdir(parents=True)
        except OSError as err:
            raise InputError(f"cannot create run folder {run_dir}: {err.strerror}") from None
        paths = cls(csv=run_dir / "steps.csv", dir=run_dir)
        assert paths.config is not None
        paths.config.write_text(dump_config(config), encoding="utf-8")
        return paths


@dataclass
class RunResult:
    exit_code: int
    monitor: RunMonitor
    paths: RunPaths
    ended: str
    """Why the run ended, in words: finished, stopped by a guard, interrupted."""
    device: torch.device


def run(
    config: Config,
    *,
    outputs: Callable[[], RunPaths] = RunPaths,
    console_every: int,
    stats_every: int | None = None,
    print_fn: Callable[[str], None] = print,
    progress: bool = False,
) -> RunResult:
    """Train ``config.steps`` guarded steps, writing records, events and (with a run folder) the
    run card and plot. The console gets a step line every ``console_every`` steps (and every
    skip), a ``STATS`` line every ``stats_every`` steps, and every alert.

    ``outputs()`` is called once everything that can reject the input has been built; it
    creates whatever the run writes. So bad input leaves nothing behind.
    """
    device = resolve_device(config.device)
    faults = [parse_fault(spec, seed=config.seed) for spec in config.inject]
    task = build_task(config.task, config.seed)
    if not task.float_inputs and any(f.kind == "nan_input" for f in faults):
        raise InputError(f"inject: nan_input needs floating-point inputs; task {task.name} feeds integer tokens")
    if config.log.tensorboard:
        TensorBoardSink.require()
    state = build_state(config, task, device)
    monitor = state.monitors["run"] = build_monitor(config, state)
    injector = FaultInjector(faults, config.accumulation_steps)
    state.loss_fn = injector.wrap_loss(state.loss_fn)
    injector.attach(task.model)

    paths = outputs()
    bar = _progress_bar(config.steps) if progress else None
    say = bar.write if bar is not None else print_fn
    sinks = _open_sinks(config, paths, say, console_every)
    events = JsonlSink(paths.events) if paths.events is not None else None
    _event(events, say, {"step": 0, "event": "run_start", "message": f"{task.description}; {config.precision} on {device}"})

    ended, exit_code = f"finished: {config.steps} steps", EXIT_OK
    try:
        with stop_on_sigint() as stop:
            for inputs, targets in injector.wrap_data(task.batches(device)):
                record = state.step(inputs, targets)
                if record is None:
                    continue
                sinks.write(record)
                for event in monitor.observe(record):
                    _event(events, say, event.as_dict(), loud=True)
                if stats_every and record.step % stats_every == 0:
                    say(monitor.stats_line())
                if bar is not None:
                    bar.update(1)
                if monitor.failed is not None:
                    ended, exit_code = f"stopped by the guard at step {record.step}: {monitor.failed.message}", EXIT_GUARD
                    break
                if record.step >= config.steps:
                    break
                if stop.requested:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        ended, exit_code = f"interrupted (Ctrl-C) after step {monitor.steps}", EXIT_INTERRUPTED
    finally:
        sinks.close()
        injector.detach()
        if bar is not None:
            bar.close()
        _event(events, None, {"step": monitor.steps, "event": "run_end", "message": ended})
        if events is not None:
            events.close()

    result = RunResult(exit_code, monitor, paths, ended, device)
    if paths.dir is not None:
        _write_report(config, result, say)
    return result


def _open_sinks(config: Config, paths: RunPaths, say: Callable[[str], None], console_every: int) -> Sinks:
    sinks: list[Sink] = []
    if paths.csv is not None:
        sinks.append(CsvSink(paths.csv))
    if config.log.jsonl and paths.steps_jsonl is not None:
        sinks.append(JsonlSink(paths.steps_jsonl))
    if config.log.tensorboard and paths.tensorboard is not None:
        sinks.append(TensorBoardSink(paths.tensorboard))
    sinks.append(ConsoleSink(console_every, say))
    return Sinks(*sinks)


def _event(log: JsonlSink | None, say: Callable[[str], None] | None, event: dict[str, Any], loud: bool = False) -> None:
    if log is not None:
        log.write_event({"time": round(time.time(), 3), **event})
    if loud and say is not None:
        kind = event["event"]
        word = "FAIL" if kind == "fail" else "ALERT" if kind.endswith("_alert") else "CLEAR"
        say(f"{word} {event['step']} {event['message']}")


def _write_report(config: Config, result: RunResult, say: Callable[[str], None]) -> None:
    """Run card and plot; a plotting failure is reported, never allowed to lose the run card."""
    from .report import plot_run, write_run_card

    paths = result.paths
    assert paths.card is not None and paths.plot is not None and paths.csv is not None
    try:
        plot_run(paths.csv, paths.plot, max_norm=config.max_norm, window=config.monitor.window,
                 alert_rate=config.monitor.alert_rate, fail_rate=config.monitor.fail_rate)
    except Exception as err:  # noqa: BLE001 - the run's records matter more than its picture
        say(f"warning: could not draw {paths.plot}: {err}")
    write_run_card(paths.card, config, result)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr, disable=None)  # off when not a TTY
