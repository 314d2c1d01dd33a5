"""Guarded training runs: build everything from a :class:`Config`, loop, record, stop cleanly.

``ampguard train`` and ``ampguard demo`` both come here; they differ only in their config and
in where the records go.
"""

from __future__ import annotations

import math
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .config import Config, dump_config
from .errors import InputError
from .faults import FaultInjector, parse_fault
from .records import StepRecord
from .sinks import ConsoleSink, CsvSink, Sink, Sinks
from .step import AmpTrainState
from .tasks import Task, build_task

EXIT_OK = 0
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
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor


@dataclass
class Tally:
    """A sink that keeps what the end-of-run summary needs."""

    steps: int = 0
    updates: int = 0
    skips: Counter = field(default_factory=Counter)
    last: dict[str, float | None] = field(default_factory=dict)

    def write(self, record: StepRecord, extra: Any = None) -> None:
        self.steps = record.step
        if record.skipped:
            self.skips[record.reason] += 1
        else:
            self.updates += 1
        self.last = record.values()

    def close(self) -> None:
        pass

    def summary(self) -> str:
        """``steps=20 updates=19 skips=1 (non_finite_grad=1) final_scale=512 final_loss=0.01``"""
        by_reason = ", ".join(f"{reason}={n}" for reason, n in sorted(self.skips.items())) or "none"
        text = f"steps={self.steps} updates={self.updates} skips={sum(self.skips.values())} ({by_reason})"
        for key, label in (("scaler_scale", "final_scale"), ("loss", "final_loss")):
            if self.last.get(key) is not None:
                text += f" {label}={self.last[key]:.6g}"
        return text


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
class RunResult:
    exit_code: int
    tally: Tally
    csv_path: Path | None
    ended: str


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


def run(
    config: Config,
    *,
    outputs: Callable[[], Path | None] = lambda: None,
    console_every: int,
    print_fn: Callable[[str], None] = print,
    progress: bool = False,
) -> RunResult:
    """Train ``config.steps`` guarded steps, writing records to the CSV and the console.

    ``outputs()`` is called once everything that can reject the input has been built; it
    creates whatever the run writes and returns the CSV path (or ``None``). So bad input leaves
    nothing behind.
    """
    device = resolve_device(config.device)
    faults = [parse_fault(spec, seed=config.seed) for spec in config.inject]
    task = build_task(config.task, config.seed)
    if not task.float_inputs and any(f.kind == "nan_input" for f in faults):
        raise InputError(f"inject: nan_input needs floating-point inputs; task {task.name} feeds integer tokens")
    state = build_state(config, task, device)
    injector = FaultInjector(faults, config.accumulation_steps)
    state.loss_fn = injector.wrap_loss(state.loss_fn)
    injector.attach(task.model)

    csv_path = outputs()
    tally = Tally()
    sinks: list[Sink] = [tally]
    if csv_path is not None:
        sinks.append(CsvSink(csv_path))
    bar = _progress_bar(config.steps) if progress else None
    write = bar.write if bar is not None else print_fn
    sinks.append(ConsoleSink(console_every, write))
    out = Sinks(*sinks)

    ended = "finished"
    exit_code = EXIT_OK
    try:
        with stop_on_sigint() as stop:
            for inputs, targets in injector.wrap_data(task.batches(device)):
                record = state.step(inputs, targets)
                if record is None:
                    continue
                out.write(record)
                if bar is not None:
                    bar.update(1)
                if record.step >= config.steps:
                    break
                if stop.requested:
                    ended, exit_code = "interrupted", EXIT_INTERRUPTED
                    break
    except KeyboardInterrupt:
        ended, exit_code = "interrupted", EXIT_INTERRUPTED
    finally:
        out.close()
        injector.detach()
        if bar is not None:
            bar.close()
    return RunResult(exit_code, tally, csv_path, ended)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr, disable=None)  # off when not a TTY


def new_run_dir(config: Config) -> Path:
    """Create the run folder ``log.dir/log.name`` (a timestamp by default); never reuse one."""
    import time

    name = config.log.name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(config.log.dir) / name
    if run_dir.exists():
        raise InputError(f"run folder {run_dir} already exists; choose another log.name")
    try:
        run_dir.mkdir(parents=True)
    except OSError as err:
        raise InputError(f"cannot create run folder {run_dir}: {err.strerror}") from None
    (run_dir / "config.yaml").write_text(dump_config(config), encoding="utf-8")
    return run_dir
