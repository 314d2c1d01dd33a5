"""The run loop: a :class:`Trainer` that only sequences its components.

The components, each in its own module, own their state: the guarded step (:mod:`step`), the
data stream (:mod:`data`), the monitors (:mod:`monitor`), the guards and rollbacks
(:mod:`guards`), the checkpoint manager (:mod:`checkpointer`), the records and events
(:mod:`sinks`, :mod:`events`), the run folder (:mod:`run_folder`). ``docs/design.md`` §5
describes how the loop sequences them. The verbs that use it are in :mod:`train` and :mod:`demo`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import checkpointer as ck
from . import distributed
from .build import build_monitor, build_sinks, build_spike_detector, build_state, resolve_device
from .config import Config
from .data import DataStream
from .errors import ExitCode, InputError
from .evaluation import Evaluator
from .events import EventLog, event_word, progress_bar
from .faults import FaultInjector, parse_fault
from .guards import INTERRUPTED, FirstSkipDiagnosis, Guards, Rollback, Rollbacks, Stop
from .monitor import LossSpikeDetector, RunMonitor
from .records import StepRecord
from .run_folder import RunPaths, RunResult
from .signals import StopFlag, stop_on_signals
from .sinks import ConsoleSink, Sinks, TensorBoardSink
from .step import AmpTrainState
from .tasks import Task, build_task


class Trainer:
    """One guarded training run. Everything that can reject the input happens in ``__init__``,
    before :meth:`run` creates any file.

    Example (a run folder under a temporary ``log.dir``)::

        >>> import shutil, tempfile
        >>> from ampguard.config import validate
        >>> folder = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "steps": 2, "precision": "bf16", "device": "cpu",
        ...                    "log": {"dir": str(folder / "runs"), "name": "a"}})
        >>> trainer = Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=1,
        ...                   stats_every=None, print_fn=lambda line: None, progress=False, resume=None)
        >>> (folder / "runs").exists()  # everything is built and checked; nothing is written yet
        False
        >>> result = trainer.run()
        >>> int(result.exit_code), sorted(p.name for p in (folder / "runs" / "a").iterdir())
        (0, ['RUN.md', 'checkpoints', 'config.yaml', 'events.jsonl', 'report.png', 'steps.csv'])
        >>> shutil.rmtree(folder)
    """

    # what it trains
    config: Config
    dist: distributed.DistInfo
    device: torch.device
    task: Task
    state: AmpTrainState
    data: DataStream
    injector: FaultInjector
    # what watches it
    monitor: RunMonitor
    spikes: LossSpikeDetector | None
    guards: Guards
    diagnosis: FirstSkipDiagnosis | None
    evaluator: Evaluator
    # what it keeps
    checkpointer: ck.CheckpointManager
    rollbacks: Rollbacks
    resume: ck.Resume | None
    # what it writes: opened by run(), so bad input leaves nothing behind
    paths: RunPaths
    sinks: Sinks
    events: EventLog
    say: Callable[[str], None]
    bar: Any

    def __init__(self, config: Config, *, outputs: Callable[[], RunPaths], console_every: int,
                 stats_every: int | None, print_fn: Callable[[str], None], progress: bool,
                 resume: ck.Resume | None) -> None:
        self.config, self.outputs, self.resume = config, outputs, resume
        self.console_every, self.stats_every, self.print_fn, self.progress = console_every, stats_every, print_fn, progress
        if distributed.launched_by_torchrun():
            self.dist, self.device = distributed.init_from_env(config.device)
        else:
            self.dist, self.device = distributed.DistInfo(), resolve_device(config.device)
        if resume is not None:
            ck.check_resume(resume, config, self.dist.world_size)
        faults = [parse_fault(spec, seed=config.seed) for spec in config.inject]
        self.task = _build_task(config, self.dist.world_size)
        if not self.task.float_inputs and any(f.kind == "nan_input" for f in faults):
            raise InputError(f"inject: nan_input needs floating-point inputs; task {self.task.name} feeds integer tokens")
        if config.log.tensorboard:
            TensorBoardSink.require()
        model = self.task.model.to(self.device)
        if self.dist.active:
            model = distributed.wrap(model, config.distributed.strategy, self.device)
        self.state = build_state(config, model, self.task.loss_fn, self.device)
        self.evaluator = Evaluator(self.task, self.state.precision, self.device, config)
        if self.task.name == "factory":
            self.evaluator.check()
        self.monitor = self.state.monitors["run"] = build_monitor(config, self.state.scaler.is_enabled())
        self.spikes = build_spike_detector(config)
        if self.spikes is not None:
            self.state.monitors["loss_spike"] = self.spikes
        self.guards = Guards(config, self.monitor, self.spikes)
        self.injector = FaultInjector(faults, config.accumulation_steps, rank=self.dist.rank)
        self.state.loss_fn = self.injector.wrap_loss(self.state.loss_fn)
        self.injector.attach(self.task.model)
        self.data = DataStream(self.task, self.injector, self.device, self.dist)
        self.diagnosis = None
        if config.diagnose.first_skip or config.diagnose.strict:
            self.diagnosis = FirstSkipDiagnosis(self.state, self.task.model)
        self.checkpointer = self._checkpointer(None)  # the folder is known once run() opens the outputs
        self.rollbacks = Rollbacks(config, self.checkpointer, self.state, self.data, self.monitor, self.spikes)
        self.checkpointer.parts[ck.ROLLBACKS] = self.rollbacks
        if resume is not None:
            self.checkpointer.restore(resume.loaded)

    def _checkpointer(self, folder: Path | None) -> ck.CheckpointManager:
        fsdp = self.dist.active and self.config.distributed.strategy == "fsdp2"
        state = self.state
        parts: dict[str, ck.Stateful] = {
            ck.MODEL: ck.ModelState(state.model, fsdp), ck.OPTIMIZER: ck.OptimizerState(state.model, state.optimizer, fsdp),
            ck.SCHEDULER: state.scheduler, ck.STATE: state, ck.RNG: ck.RngState(self.dist), ck.DATA: self.data}
        meta = lambda: {ck.UPDATES: state.updates, ck.CONFIG: self.config.model_dump(mode="json"),  # noqa: E731
                        ck.PRECISION: self.config.precision, ck.WORLD_SIZE: self.dist.world_size,
                        ck.TORCH_VERSION: str(torch.__version__)}
        return ck.CheckpointManager(folder, parts, keep=self.config.checkpoint.keep, meta=meta, dist=self.dist)

    # ------------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        """Open the outputs, train until ``config.steps`` (or a guard's stop, or Ctrl-C), save the
        last checkpoint, close: the :class:`RunResult` (and, with a run folder, its card and plot).
        """
        self._open()
        first_step = self.state.steps
        with stop_on_signals() as stop:
            clean, stopped = True, None
            try:
                stopped = self._loop(stop)
            except KeyboardInterrupt:  # a second signal mid-step: no checkpoint of a half-done step
                clean, stopped = False, self._interrupted(stop)
            finally:
                stop.closing = True  # from here a signal waits: the checkpoint and the run card come first
                self.sinks.close()
                self.injector.detach()
                if self.bar is not None:
                    self.bar.close()
            if clean and self.state.steps > first_step:  # (a resumed complete run only rewrites its card)
                self.save()
            return self._close(stopped)

    def _loop(self, stop: StopFlag) -> Stop | None:
        while self.state.steps < self.config.steps:
            record = self.train_step()
            self.record(record, self.evaluator() if self.evaluator.due(record.step) else None)
            decision = self.guards.check(record, self.diagnosis.after(record) if self.diagnosis else None)
            if isinstance(decision, Rollback):
                decision = self.rollbacks.apply(decision)
            if isinstance(decision, Stop):
                return decision
            self.maybe_save(record.step)
            if self._agree(stop.requested):  # the first Ctrl-C or SIGTERM, honoured at a step boundary
                return self._interrupted(stop)
        return None

    def _interrupted(self, stop: StopFlag) -> Stop:
        return Stop(stop.exit_code, f"interrupted ({stop.name}) after step {self.monitor.steps}", INTERRUPTED)

    def train_step(self) -> StepRecord:
        """Micro-batches through the guarded step until one closes its group.

        The step reads its skip flags on the host once per step (a host sync; docs/design.md §2).
        """
        while True:
            batch = self.data.next(first_step=self.state.steps + 1)
            if self.diagnosis is not None:
                self.diagnosis.capture(batch)
            record = self.state.step(*batch)
            if record is not None:
                return record

    def record(self, record: StepRecord, metrics: dict[str, float] | None) -> None:
        """The record to every sink; the monitors' events to the log; the console lines.

        The first sink to read the record copies its values to the host (the step's one
        transfer; later readers pay nothing).
        """
        self.sinks.write(record, metrics)
        for event in self.monitor.observe(record):
            self.events.emit(event.as_dict(), event_word(event.kind))
        if metrics:
            self.monitor.observe_eval(metrics)
            self.say(f"EVAL {record.step} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        if self.stats_every and record.step % self.stats_every == 0:
            self.say(self.monitor.stats_line())
        if self.bar is not None:
            self.bar.update(1)

    def maybe_save(self, step: int) -> None:
        """A checkpoint every ``checkpoint.every`` steps, but not at the last step (``run()``
        saves that one).
        """
        every = self.config.checkpoint.every
        if every and step % every == 0 and step < self.config.steps:
            self.save()

    def save(self) -> None:
        """A checkpoint of the current step, unless checkpoints are off, the step is mid-group, or
        the run has no checkpoint folder (a demo). Device tensors are copied to the host to be
        written (a host sync).
        """
        if not self.config.checkpoint.enabled or self.state.mid_group or not self.checkpointer.enabled:
            return
        path = self.checkpointer.save(self.state.steps)  # every rank takes part; rank 0 writes
        if path is not None:
            self.events.emit({"step": self.state.steps, "event": "checkpoint", "message": f"saved {path.name}"})

    # ------------------------------------------------------------------ opening and closing

    def _open(self) -> None:
        """Create what the run writes (rank 0 only), and tell every rank the checkpoint folder."""
        main, resuming = self.dist.is_main, self.resume is not None
        self.paths = self.outputs() if main else RunPaths()
        self.checkpointer.folder = distributed.broadcast_from_main(self.paths.checkpoints)
        self.bar = progress_bar(self.config.steps, initial=self.state.steps) if self.progress and main else None
        self.say = say = (self.bar.write if self.bar is not None else self.print_fn) if main else (lambda line: None)
        console = ConsoleSink(self.console_every, say)
        self.sinks = build_sinks(self.config, self.paths, self.evaluator.metrics, console,
                                 keep_through=self.state.steps if resuming else None)
        self.events = EventLog(self.paths.events, say, append=resuming)
        self.rollbacks.events = self.events
        if self.diagnosis is not None:
            self.diagnosis.events = self.events
        if self.resume is not None:
            set_aside = self.checkpointer.set_aside_after(self.state.steps)
            note = f"; newer checkpoints set aside: {', '.join(p.name for p in set_aside)}" if set_aside else ""
            self.events.emit({"step": self.state.steps, "event": "resume",
                              "message": f"resumed from {self.resume.path.name} at step {self.state.steps}{note}"}, "RESUME")
        else:
            self.events.emit({"step": 0, "event": "run_start",
                              "message": f"{self.task.description}; {self.config.precision} on {self.device}"})

    def _close(self, stopped: Stop | None) -> RunResult:
        ended = stopped.why if stopped else f"finished: {self.config.steps} steps"
        self.events.emit({"step": self.monitor.steps, "event": "run_end", "message": ended})
        self.events.close()
        result = RunResult(stopped.exit_code if stopped else ExitCode.OK, self.monitor, self.paths, ended, self.device,
                           self.checkpointer.saved, self.rollbacks.log, self.resume.path if self.resume else None,
                           self.task.description, self.diagnosis.found if self.diagnosis else None)
        if self.paths.dir is not None:
            from .report import write_report

            write_report(self.config, result, self.say)
        return result

    def _agree(self, requested: bool) -> bool:
        """Ranks stop together: a Ctrl-C seen by any rank stops all at the same step boundary."""
        return distributed.any_rank(requested, self.device)


def _build_task(config: Config, world: int) -> Task:
    """Every rank reads the same stream of global batches (batch_size per rank x ranks) and takes
    its own slice, so N ranks see exactly the data one process with N x the batch sees."""
    if world == 1:
        return build_task(config)
    task = config.task.model_copy(update={"batch_size": config.task.batch_size * world})
    return build_task(config.model_copy(update={"task": task}))
