"""Guarded training runs: build everything from a :class:`Config`, loop, record, stop cleanly.

``ampguard train`` and ``ampguard demo`` both come here; they differ only in their config and
in where the records go (a run folder, or the console and an optional CSV).
"""

from __future__ import annotations

import itertools
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ckpt
from . import distributed
from .config import Config, dump_config
from .errors import InputError
from .faults import FaultInjector, parse_fault
from .monitor import LossSpikeDetector, RunMonitor
from .records import StepRecord
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


def build_state(config: Config, task: Task, device: torch.device, model: torch.nn.Module | None = None) -> AmpTrainState:
    """The guarded step for a config: optimizer, LR schedule, scaler, clipping, accumulation.
    ``model`` is the (possibly DDP/FSDP2-wrapped) model to train; default ``task.model``."""
    model = model if model is not None else task.model
    optimizer = make_optimizer(config, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config))
    s = config.scaler
    return AmpTrainState(
        model,
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

    @property
    def checkpoints(self) -> Path | None:
        return self._in_dir("checkpoints")

    @classmethod
    def existing(cls, run_dir: Path) -> RunPaths:
        return cls(csv=run_dir / "steps.csv", dir=run_dir)

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
        paths = cls.existing(run_dir)
        paths.write_config(config)
        return paths

    def write_config(self, config: Config) -> None:
        if self.config is not None:
            tmp = self.config.with_name(".config.yaml.tmp")
            tmp.write_text(dump_config(config), encoding="utf-8")
            os.replace(tmp, self.config)


@dataclass
class Resume:
    """Where a resumed run picks up: a loaded checkpoint and the run folder it belongs to."""

    path: Path
    payload: dict[str, Any]
    run_dir: Path


@dataclass
class RunResult:
    exit_code: int
    monitor: RunMonitor
    paths: RunPaths
    ended: str
    """Why the run ended, in words: finished, stopped by a guard, interrupted."""
    device: torch.device
    checkpoints: list[Path] = field(default_factory=list)
    rollbacks: list[str] = field(default_factory=list)
    resumed_from: Path | None = None
    task: str = ""
    diagnosis: str | None = None


class _Stop(Exception):
    """Leaves the loop with an exit code and the reason, in words."""

    def __init__(self, exit_code: int, ended: str) -> None:
        self.exit_code, self.ended = exit_code, ended


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class Trainer:
    """One guarded training run. Everything that can reject the input happens in ``__init__``,
    before :meth:`run` creates any file."""

    def __init__(
        self,
        config: Config,
        *,
        outputs: Callable[[], RunPaths],
        console_every: int,
        stats_every: int | None,
        print_fn: Callable[[str], None],
        progress: bool,
        resume: Resume | None,
    ) -> None:
        self.config = config
        self.outputs = outputs
        self.console_every, self.stats_every = console_every, stats_every
        self.print_fn, self.progress = print_fn, progress
        self.resume = resume

        if distributed.launched_by_torchrun():
            self.dist, self.device = distributed.init_from_env(config.device)
        else:
            self.dist, self.device = distributed.DistInfo(), resolve_device(config.device)
        faults = [parse_fault(spec, seed=config.seed) for spec in config.inject]
        # every rank reads the same stream of global batches (batch_size per rank x ranks) and
        # takes its own slice, so N ranks see exactly the data one process with N x the batch sees
        world = self.dist.world_size
        self.task = build_task(config if world == 1 else config.model_copy(
            update={"task": config.task.model_copy(update={"batch_size": config.task.batch_size * world})}))
        if not config.eval.enabled:
            self.task.evaluate, self.task.metrics = None, ()
        if not self.task.float_inputs and any(f.kind == "nan_input" for f in faults):
            raise InputError(f"inject: nan_input needs floating-point inputs; task {self.task.name} feeds integer tokens")
        if config.log.tensorboard:
            TensorBoardSink.require()
        self.task.model.to(self.device)
        model = self.task.model
        if self.dist.active:
            model = distributed.wrap(model, config.distributed.strategy, self.device)
        self.state = build_state(config, self.task, self.device, model)
        if self.task.name == "factory" and self.task.evaluate is not None:
            self._check_evaluate()
        self.monitor = self.state.monitors["run"] = build_monitor(config, self.state)
        self.spikes: LossSpikeDetector | None = None
        if "loss_spike" in config.rollback.triggers:
            self.spikes = self.state.monitors["loss_spike"] = LossSpikeDetector(config.rollback.window, config.rollback.z)
        self.injector = FaultInjector(faults, config.accumulation_steps, rank=self.dist.rank)
        self.state.loss_fn = self.injector.wrap_loss(self.state.loss_fn)
        self.injector.attach(self.task.model)

        self.position = 0  # micro-batches taken from the task's stream so far
        self.capture = config.diagnose.first_skip or config.diagnose.strict  # keep the open group's batches
        self.group: list[tuple[Any, Any]] = []
        self.diagnosis: str | None = None
        self.rollback_log: list[str] = []
        self.saved: list[Path] = []
        if resume is not None:
            saved_world = int(resume.payload.get("world_size", 1))
            if saved_world != world:
                raise InputError(f"{resume.path}: saved by {saved_world} process(es), this run has {world}; "
                                 "resume with the same world size")
            self._restore(resume.payload, resume.path)
            self.position = int(resume.payload["data_position"])
            self.rollback_log = list(resume.payload.get("rollbacks", []))

    # ------------------------------------------------------------------ restore / save

    def _restore(self, payload: dict[str, Any], path: Path, keep_counters: bool = False) -> None:
        """Load a checkpoint's model, optimizer, scheduler, scaler, counters and RNG states."""
        state = self.state
        try:
            self._load_model_and_optimizer(payload)
            state.scheduler.load_state_dict(payload["scheduler"])
            saved_state = dict(payload["state"])
            if keep_counters:  # a rollback: the step count and the monitors' history go on
                steps, saved_state["monitors"] = state.steps, {}
            state.load_state_dict(saved_state)
            if keep_counters:
                state.steps = steps
            rng = payload["rng"]
            ckpt.set_rng_state(rng[self.dist.rank] if isinstance(rng, list) else rng)
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise InputError(f"{path}: does not fit this run ({first})") from None

    def _fsdp(self) -> bool:
        return self.dist.active and self.config.distributed.strategy == "fsdp2"

    def _load_model_and_optimizer(self, payload: dict[str, Any]) -> None:
        model, optimizer = self.state.model, self.state.optimizer
        if self._fsdp():  # full state dicts into the shards (torch.distributed.checkpoint's API)
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, payload["model"], options=options)
            set_optimizer_state_dict(model, optimizer, payload["optimizer"], options=options)
        else:
            distributed.unwrap(model).load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])

    def _model_and_optimizer_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model, optimizer = self.state.model, self.state.optimizer
        if self._fsdp():  # gathered from the shards on every rank (a collective), saved by rank 0
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return (get_model_state_dict(model, options=options),
                    get_optimizer_state_dict(model, optimizer, options=options))
        return distributed.unwrap(model).state_dict(), optimizer.state_dict()

    def _payload(self) -> dict[str, Any]:
        state = self.state
        model_state, optimizer_state = self._model_and_optimizer_state()
        rngs = distributed.gather_to_main(ckpt.rng_state())  # [own state] in a one-process run
        return {
            "step": state.steps,
            "updates": state.updates,
            "config": self.config.model_dump(mode="json"),
            "precision": self.config.precision,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": state.scheduler.state_dict(),
            "state": state.state_dict(),
            "rng": rngs if self.dist.active else rngs[0],
            "world_size": self.dist.world_size,
            "data_position": self.position,
            "rollbacks": list(self.rollback_log),
            "torch": str(torch.__version__),
        }

    def _save(self) -> None:
        if not self.config.checkpoint.enabled or self.state.mid_group or self.checkpoint_dir is None:
            return
        payload = self._payload()  # every rank takes part (gathers); rank 0 writes
        if self.dist.is_main:
            folder = self.checkpoint_dir
            path = ckpt.save_checkpoint(folder / ckpt.checkpoint_name(self.state.steps), payload)
            ckpt.prune(folder, self.config.checkpoint.keep)
            self.saved = ckpt.list_checkpoints(folder)
            self._event({"step": self.state.steps, "event": "checkpoint", "message": f"saved {path.name}"})
        distributed.barrier()  # no rank reads checkpoints (a rollback) before rank 0 has written them

    # ------------------------------------------------------------------ data

    def _stream(self) -> Iterator[tuple[Any, Any]]:
        """The task's micro-batches from ``self.position`` on, faults applied, on the device."""
        source = itertools.islice(self.task.batches(), self.position, None)
        if self.dist.active:  # this rank's slice of each global batch; faults then apply per rank
            source = ((distributed.rank_slice(x, self.dist), distributed.rank_slice(y, self.dist)) for x, y in source)
        for inputs, targets in self.injector.wrap_data(source, first_step=self.state.steps + 1):
            self.position += 1
            yield _to_device(inputs, self.device), _to_device(targets, self.device)

    # ------------------------------------------------------------------ events

    def _event(self, event: dict[str, Any], word: str | None = None) -> None:
        if self.events is not None:
            self.events.write_event({"time": round(time.time(), 3), **event})
        if word is not None:
            self.say(f"{word} {event['step']} {event['message']}")

    def _evaluate(self, record: bool = True) -> dict[str, float]:
        model, evaluate = self.task.model, self.task.evaluate
        if evaluate is None:
            return {}
        model.eval()
        try:
            with torch.no_grad(), self.state.precision.autocast():
                metrics = {name: float(value) for name, value in evaluate(model, self.device).items()}
        finally:
            model.train()
        if record:
            self.monitor.observe_eval(metrics)
        return metrics

    def _check_evaluate(self) -> None:
        """A user's evaluate() must return the metrics it declared: try it once, before any file exists."""
        try:
            names = set(self._evaluate(record=False))
        except (Exception, SystemExit) as err:  # noqa: BLE001
            raise InputError(f"task.factory: evaluate() raised {type(err).__name__}: {err}") from None
        if not names <= set(self.task.metrics):
            raise InputError(f"task.factory: evaluate() returned {sorted(names)}, but metrics declares "
                             f"{list(self.task.metrics)}")

    def _eval_due(self, step: int) -> bool:
        every = self.config.eval.every
        return self.task.evaluate is not None and (step >= self.config.steps or (every > 0 and step % every == 0))

    # ------------------------------------------------------------------ diagnosis

    def _diagnose(self, record: StepRecord) -> str:
        """Locate the first non-finite value in the skipped step's micro-batches (params are
        untouched by the skip, and the injector still points at this step, so it replays)."""
        from .locate import diagnose_group

        state = self.state
        scale = 1.0
        if state.scaler.is_enabled():  # the scale this step ran with, before its backoff
            scale = float(state.scaler.scale_value()) / state.scaler.get_backoff_factor()
        result = diagnose_group(self.task.model, state.loss_fn, self.group, state.precision, scale)
        message = f"step {record.step} ({record.reason}): {result.message()}"
        self.diagnosis = message
        self._event({"step": record.step, "event": "diagnosis", **result.as_dict(), "message": message}, "DIAGNOSIS")
        return message

    # ------------------------------------------------------------------ rollback

    def _rollback_trigger(self, record: StepRecord) -> tuple[str, int] | None:
        """(why, first bad step) when this record calls for a rollback."""
        if self.spikes is not None and not record.skipped:
            loss = self.monitor.last.get("loss")
            if self.spikes.check(loss):
                return f"loss spike ({loss:.4g} > mean + {self.config.rollback.z:g} std)", record.step
        failed = self.monitor.failed
        if failed is not None and "skip_guard" in self.config.rollback.triggers and "skip rate" in failed.message:
            return f"skip-rate guard: {failed.message}", record.step - self.config.monitor.fail_after + 1
        return None

    def _rollback(self, why: str, first_bad: int) -> None:
        cfg = self.config.rollback
        step = self.state.steps
        if len(self.rollback_log) >= cfg.max:
            raise _Stop(EXIT_GUARD, f"stopped at step {step}: {why}; all {cfg.max} rollbacks (rollback.max) are used up")
        assert self.checkpoint_dir is not None
        try:
            path, payload = ckpt.latest_loadable(self.checkpoint_dir, before_step=first_bad)
        except InputError as err:
            raise _Stop(EXIT_GUARD, f"stopped at step {step}: {why}; cannot roll back: {err}") from None
        self._restore(payload, path, keep_counters=True)
        old = self.position
        self.position = int(payload["data_position"]) + cfg.skip_batches
        message = (f"{why}: rolled back to {path.name} (step {payload['step']}) and skipped {cfg.skip_batches} "
                   f"batches (data position {old} -> {self.position})")
        self.rollback_log.append(f"step {step}: {message}")
        self.monitor.restart_windows()
        if self.spikes is not None:
            self.spikes.reset()
        self._event({"step": step, "event": "rollback", "message": message, "checkpoint": path.name}, "ROLLBACK")

    # ------------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        config, monitor, state = self.config, self.monitor, self.state
        main = self.dist.is_main
        # rank 0 writes the run folder; the other ranks write nothing and print nothing
        self.paths = self.outputs() if main else RunPaths()
        self.checkpoint_dir = self._shared_checkpoint_dir()
        resuming = self.resume is not None
        bar = _progress_bar(config.steps, initial=state.steps) if self.progress and main else None
        self.say = (bar.write if bar is not None else self.print_fn) if main else (lambda line: None)
        sinks = self._open_sinks(keep_through=state.steps if resuming else None)
        self.events = JsonlSink(self.paths.events, append=resuming) if self.paths.events is not None else None
        if self.resume is not None:
            set_aside = ckpt.set_aside_after(self.checkpoint_dir, state.steps) if main and self.checkpoint_dir else []
            note = f"; newer checkpoints set aside: {', '.join(p.name for p in set_aside)}" if set_aside else ""
            self._event({"step": state.steps, "event": "resume",
                         "message": f"resumed from {self.resume.path.name} at step {state.steps}{note}"}, "RESUME")
        else:
            self._event({"step": 0, "event": "run_start",
                         "message": f"{self.task.description}; {config.precision} on {self.device}"})

        ended, exit_code, clean = f"finished: {config.steps} steps", EXIT_OK, True
        try:
            with stop_on_sigint() as stop:
                stream = self._stream()
                while state.steps < config.steps:
                    batch = next(stream)
                    if self.capture:
                        self.group = [*self.group, batch] if state.mid_group else [batch]
                    record = state.step(*batch)
                    if record is None:
                        continue
                    extra = self._evaluate() if self._eval_due(record.step) else None
                    sinks.write(record, extra)
                    for event in monitor.observe(record):
                        word = "FAIL" if event.kind == "fail" else "ALERT" if event.kind.endswith("_alert") else "CLEAR"
                        self._event(event.as_dict(), word)
                    if record.skipped and self.capture and self.diagnosis is None:
                        found = self._diagnose(record)
                        if config.diagnose.strict:
                            which = "loss" if record.reason == "non_finite_loss" else "gradient"
                            raise _Stop(EXIT_GUARD, f"strict mode: non-finite {which} at step {record.step}: {found}")
                    if extra:
                        self.say(f"EVAL {record.step} " + " ".join(f"{k}={v:.4g}" for k, v in extra.items()))
                    if self.stats_every and record.step % self.stats_every == 0:
                        self.say(monitor.stats_line())
                    if bar is not None:
                        bar.update(1)
                    trigger = self._rollback_trigger(record) if config.rollback.triggers else None
                    if trigger is not None:
                        self._rollback(*trigger)
                        stream = self._stream()
                        continue
                    if monitor.failed is not None:
                        raise _Stop(EXIT_GUARD, f"stopped by the guard at step {record.step}: {monitor.failed.message}")
                    every = config.checkpoint.every
                    if every and record.step % every == 0 and record.step < config.steps:
                        self._save()
                    if self._agree_stop(stop.requested):  # the first Ctrl-C, honoured at a step boundary
                        raise _Stop(EXIT_INTERRUPTED, f"interrupted (Ctrl-C) after step {monitor.steps}")
        except _Stop as stopped:
            ended, exit_code = stopped.ended, stopped.exit_code
        except KeyboardInterrupt:  # a second Ctrl-C, anywhere: no checkpoint of a half-done step
            clean = False
            ended, exit_code = f"interrupted (Ctrl-C) after step {monitor.steps}", EXIT_INTERRUPTED
        finally:
            sinks.close()
            self.injector.detach()
            if bar is not None:
                bar.close()

        if clean:
            self._save()
        self._event({"step": monitor.steps, "event": "run_end", "message": ended})
        if self.events is not None:
            self.events.close()
        result = RunResult(exit_code, monitor, self.paths, ended, self.device, self.saved, self.rollback_log,
                           self.resume.path if self.resume else None, self.task.description, self.diagnosis)
        if self.paths.dir is not None:
            _write_report(config, result, self.say)
        return result

    def _shared_checkpoint_dir(self) -> Path | None:
        """Rank 0's checkpoint folder, told to every rank (they all load from it on a rollback)."""
        folder = str(self.paths.checkpoints) if self.paths.checkpoints is not None else None
        if self.dist.active:
            box = [folder]
            torch.distributed.broadcast_object_list(box, src=0)
            folder = box[0]
        return Path(folder) if folder is not None else None

    def _agree_stop(self, requested: bool) -> bool:
        """Ranks stop together: a Ctrl-C seen by any rank stops all at the same step boundary."""
        if not self.dist.active:
            return requested
        flag = torch.tensor([float(requested)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def _open_sinks(self, keep_through: int | None) -> Sinks:
        config, paths, metrics = self.config, self.paths, self.task.metrics
        append = keep_through is not None
        sinks: list[Sink] = []
        if paths.csv is not None:
            sinks.append(CsvSink(paths.csv, metrics, append=append, keep_through=keep_through))
        if config.log.jsonl and paths.steps_jsonl is not None:
            sinks.append(JsonlSink(paths.steps_jsonl, append=append))
        if config.log.tensorboard and paths.tensorboard is not None:
            sinks.append(TensorBoardSink(paths.tensorboard))
        sinks.append(ConsoleSink(self.console_every, self.say))
        return Sinks(*sinks)


def run(
    config: Config,
    *,
    outputs: Callable[[], RunPaths] = RunPaths,
    console_every: int,
    stats_every: int | None = None,
    print_fn: Callable[[str], None] = print,
    progress: bool = False,
    resume: Resume | None = None,
) -> RunResult:
    """Train until ``config.steps`` guarded steps, writing records, events, checkpoints and (with
    a run folder) the run card and plot. The console gets a step line every ``console_every``
    steps (and every skip), a ``STATS`` line every ``stats_every`` steps, and every alert.

    ``outputs()`` is called once everything that can reject the input has been built; it
    creates whatever the run writes. So bad input leaves nothing behind.
    """
    trainer = Trainer(config, outputs=outputs, console_every=console_every, stats_every=stats_every,
                      print_fn=print_fn, progress=progress, resume=resume)
    return trainer.run()


RESUME_FIXED = ("precision", "accumulation_steps", "seed", "task", "optimizer.name")


def prepare_resume(target: str | Path) -> tuple[Resume, dict[str, Any]]:
    """Find the checkpoint for ``--resume RUN_DIR|CHECKPOINT``; return it and its saved config."""
    target = Path(target)
    if target.is_dir():
        folder = target / "checkpoints"
        path, payload = ckpt.latest_loadable(folder)
        run_dir = target
    else:
        payload = ckpt.load_checkpoint(target)
        path = target
        run_dir = target.parent.parent if target.parent.name == "checkpoints" else target.parent
    if not (run_dir / "steps.csv").is_file():
        raise InputError(f"{path}: its run folder {run_dir} has no steps.csv to continue")
    return Resume(path, payload, run_dir), payload["config"]


def check_resume_config(saved: dict[str, Any], config: Config) -> None:
    """Refuse a config that would make the resumed run differ from the uninterrupted one."""
    now = config.model_dump(mode="json")
    for key in RESUME_FIXED:
        a, b = saved, now
        for part in key.split("."):
            a, b = a.get(part), b.get(part)
        if isinstance(a, dict) and isinstance(b, dict):  # name the exact field, e.g. task.n_embd
            diff = next((k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)), None)
            if diff is not None:
                key, a, b = f"{key}.{diff}", a.get(diff), b.get(diff)
        if a != b:
            raise InputError(f"--resume: {key} was {a!r} in the checkpoint, now {b!r}; a resumed run must keep it")
    if saved.get("steps", 0) and config.steps <= 0:  # pragma: no cover - validated elsewhere
        raise InputError("--resume: steps must be positive")


def _write_report(config: Config, result: RunResult, say: Callable[[str], None]) -> None:
    """Run card and plot; a plotting failure is reported, never allowed to lose the run card."""
    from .report import plot_run, write_run_card

    paths = result.paths
    assert paths.card is not None and paths.plot is not None and paths.csv is not None
    try:
        plot_run(paths.csv, paths.plot, max_norm=config.max_norm, window=config.monitor.window,
                 alert_rate=config.monitor.alert_rate, fail_rate=config.monitor.fail_rate,
                 title=f"run {paths.dir.name}" if paths.dir is not None else None)
    except Exception as err:  # noqa: BLE001 - the run's records matter more than its picture
        say(f"warning: could not draw {paths.plot}: {err}")
    write_run_card(paths.card, config, result)


def _progress_bar(total: int, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr,
                disable=None)  # off when not a TTY
