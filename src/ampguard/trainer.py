"""The run loop: a :class:`Trainer` that only sequences its components.

The components, each in its own module, own their state: the guarded step (:mod:`step`), the
data stream (:mod:`data`), the monitors (:mod:`monitor`), the guards and rollbacks
(:mod:`guards`), the checkpoint manager (:mod:`checkpointer`), the records and events
(:mod:`sinks`, :mod:`events`), the run folder (:mod:`run_folder`). ``docs/design.md`` §5
describes how the loop sequences them. The verbs that use it are in :mod:`train` and :mod:`demo`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import checkpointer as ck
from . import distributed
from .build import (build_headroom, build_monitor, build_sinks, build_spike_detector, build_state, check_forward,
                    check_trainable, fast_path, keep_fp32_modules, precision_of, resolve_device)
from .checkpoint import (checkpoint_step, child_exits_held, list_checkpoints, other_data, rng_snapshot, set_rng_state,
                         torch_rng_state)
from .config import Config, check_fast, plain_data
from .data import DataStream, check_same_data
from .errors import (AmpguardWarning, ExitCode, InputError, RankWarning, an_interrupt, counted, first_line, listed,
                     raised, warn, warn_each_time)
from .evaluation import Evaluator
from .events import EventLog, Throughput, event_word, known_peak_tflops, progress_bar
from .faults import FaultInjector, check_nan_input, parse_faults
from .guards import (BAD_DATA, CRASHED, DISK_FULL, INTERRUPTED, FirstSkipDiagnosis, Guards, Rollback, Rollbacks,
                     Stop, TriggerBatches, restart_scale, rollback_reach)
from .headroom import HEADROOM_COLUMNS, HEADROOM_CSV, Headroom, SkipGradNorms, check_headroom_rows
from .integrations.trackers import TrackerSink, check_trackers
from .launch import launched_by_torchrun
from .monitor import AT_THE_END, Event, LossSpikeDetector, RunMonitor
from .records import LAG, InFlight, StepRecord
from .run_folder import RunPaths, RunResult, disk_full_line
from .schedule import WarmupPastTheRun
from .signals import (
    STUCK_AFTER_S, Interrupted, StopFlag, Watched, held_signals, leave_now, opening, signal_numbered, stop_on_signals,
    watch_stuck,
)
from .files import DiskFull, disk_full_error, left_by_an_ended_process, remove_temporaries, writing
from .sinks import CSV_COLUMNS, ConsoleSink, CsvSink, JsonlSink, RowsEndEarly, Sinks, TensorBoardSink
from .step import AmpTrainState
from .tasks import Task, build_task, eval_unread


_NOTHING = contextlib.nullcontext()  # (reusable: a step with nothing to watch, :meth:`Trainer.watching`)


class BadBatch(Exception):
    """A micro-batch the run cannot take, found mid-run: reading it raised (in one process; under
    torchrun one rank's failure is its own, and a traceback ends the job), or under torchrun it
    does not split evenly over the ranks (the same on every rank). The run stops with exit 2, its
    earlier steps kept and its run card written."""


class Trainer:
    """One guarded training run. Everything that can reject the input happens in ``__init__``,
    before :meth:`run` creates any file.

    Example (a run folder under a temporary ``log.dir``)::

        >>> import shutil, tempfile
        >>> from pathlib import Path
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
        (0, ['RUN.md', 'checkpoints', 'config.yaml', 'events.jsonl', 'report.png', 'run-id', 'steps.csv'])
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
    fast: bool
    """The fast path (config ``fast``, :func:`~ampguard.build.fast_path`): the sync-free step, records
    read back up to :data:`~ampguard.records.LAG` steps behind."""
    path: str
    """Which path, and why, in a few words (the run_start event and the run card say it)."""
    share_buffers: Callable[[], None] | None
    """Under torchrun, rank 0's buffers to every rank, before each evaluation and, under FSDP2,
    each step (:func:`~ampguard.distributed.buffer_sharing`); None otherwise."""
    _share_each_step: bool
    inflight: InFlight
    """The records made and not yet handled (written, watched, judged)."""
    # what watches it
    monitor: RunMonitor
    spikes: LossSpikeDetector | None
    guards: Guards
    diagnosis: FirstSkipDiagnosis | None
    evaluator: Evaluator
    headroom: Headroom | None
    """Per-layer headroom every ``monitor.headroom.every`` steps (``headroom.csv``, ALERTs), or None."""
    grad_norms: SkipGradNorms
    """Each parameter's gradient norm at a skipped step, to the event log."""
    # what it keeps
    checkpointer: ck.CheckpointManager
    rollbacks: Rollbacks
    resume: ck.Resume | None
    policy: list[dict[str, Any]]
    """Every policy change made on resume so far ({key, old, new, step}); carried by checkpoints."""
    policy_new: list[dict[str, Any]]
    """This resume's policy changes."""
    run_id: str | None
    """The run folder's id, carried by every checkpoint (known once run() opens the outputs)."""
    _attempt: str
    """A token of this attempt (rank 0's, the same on every rank): its keys in the rendezvous store."""
    # what it writes: opened by run(), so bad input leaves nothing behind
    paths: RunPaths
    sinks: Sinks
    events: EventLog
    say: Callable[[str], None]
    bar: Any
    throughput: Throughput
    _failed: DiskFull | None
    """A write of the trainer's own that found the disk full (the run folder, a checkpoint, the
    run card); the sinks and the event log keep theirs (:meth:`disk_full`)."""

    def __init__(self, config: Config, *, outputs: Callable[[], RunPaths], console_every: int,
                 stats_every: int | None, print_fn: Callable[[str], None], progress: bool,
                 resume: ck.Resume | None, announce: Callable[[RunPaths], str] | None = None,
                 take_back: Callable[[], None] | None = None, check_outputs: Callable[[], None] | None = None) -> None:
        self.config, self.outputs, self.resume, self.announce = config, outputs, resume, announce
        self.take_back = take_back  # undoes what outputs() made: a stop while opening ended the process
        self.stop_flag = StopFlag()  # run()'s, once it installs the signal handlers
        self._group_rng: Any = None  # the RNG states where the open accumulation group began
        # the first step's time and the slowest since (the seconds the process ran, its agreement in): _timed()
        self._first_step_s: float | None = None
        self._slowest = 0.0
        self._handoff = threading.Lock()  # who closes the run: the main thread, or the stuck-watcher (_stuck)
        self._taken_over = False  # the stuck-watcher closes this rank and ends the process
        self.console_every, self.stats_every, self.print_fn, self.progress = console_every, stats_every, print_fn, progress
        if launched_by_torchrun():
            self.dist, self.device = distributed.init_from_env(config.device)
            # every rank trains with rank 0's config and resumes from its checkpoint, checked before
            # anything else (one line on every rank; one all-gather for both)
            configs, points = zip(*distributed.all_gather((plain_data(config), ck.resume_point(resume))))
            ck.check_same_configs(configs)
            ck.check_same_resumes(points)  # (before anything is cut)
        else:
            self.dist, self.device = distributed.DistInfo(), resolve_device(config.device)
        # (a refusal on one rank alone, a node's own file missing for its factory, is every rank's:
        # signals.opening leaves its line in the store for the peers: review 51g)
        # what the config, the checkpoint and the run folder refuse, before anything is built (the task and its
        # data, the model, its forward check, a compile: seconds of work for a refusal)
        self.policy_new: list[dict[str, Any]] = []
        if resume is not None:
            ck.check_resume(resume, config, self.dist.world_size, self.dist.rank)
            self.policy_new = ck.policy_changes(resume, config)
            ck.check_left_to_train(resume, config, self.policy_new)  # (a finished run's)
        check_fast(config, self.dist.world_size)
        faults = parse_faults(config.inject, seed=config.seed, steps=config.steps, world_size=self.dist.world_size)
        self._check_outputs(check_outputs)
        if config.log.tensorboard:
            TensorBoardSink.require()
        check_trackers(config)  # log.wandb / log.mlflow: the package is there, the MLflow store opens
        self.task = _build_task(config, self.dist.world_size)
        if config.task.factory and not self.task.model.training:  # (each module trains in the mode it was left in)
            warn(f"task.factory {config.task.factory}: the model is in eval mode (dropout off, BatchNorm "
                 "statistics frozen) and trains so: call model.train() in the factory to train it in train "
                 "mode", RankWarning, stacklevel=2)
        check_nan_input(self.task, faults)
        model = self.task.model.to(self.device)
        keep_fp32_modules(config, model)  # (before the start-up's check: its forward records them)
        self.injector = FaultInjector(faults, config.accumulation_steps, rank=self.dist.rank)
        self.data = DataStream(self.task, self.injector, self.device, self.dist)
        unused = self._check_model(model)
        self._unused_note = f"; DDP find_unused_parameters ({listed(unused, 4, more='...')} " \
            "unused at the first batch)" if unused else ""
        if self.dist.active:  # (a task.options value that differs between ranks may size a layer)
            ck.check_same_models(distributed.all_gather(ck.model_shapes(model)))
            model = distributed.wrap(model, config.distributed.strategy, self.device, find_unused_parameters=bool(unused))
        # rank 0's buffers on every rank before each evaluation, and under FSDP2 before each step
        # (DDP broadcasts them before each training forward itself)
        self.share_buffers = distributed.buffer_sharing(model)
        self._share_each_step = self.share_buffers is not None and config.distributed.strategy == "fsdp2"
        self.fast, self.path = fast_path(config, self.device, self.dist.world_size)
        self.inflight = InFlight(lag=LAG if self.fast else 0)
        self.state = build_state(config, model, self.task.loss_fn, self.device, fast=self.fast)
        self.state.autocast_dtypes = self.autocast_dtypes  # (noted at start-up: the first step notes none again)
        self.state._loop_notes = False  # (the run ends at any raise: no "next guard.backward()" for the CLI's user)
        if config.compile:  # after fp8's conversion and the DDP/FSDP2 wrap; in place: the same parameters
            self.state._drop_autocast_probe()  # (before dynamo sees its hook: Guard._drop_autocast_probe)
            model.compile()
        self.evaluator = Evaluator(self.task, self.state.precision, self.device, config)
        if self.task.name == "factory":
            self.evaluator.check()
        self.monitor = self.state.monitors["run"] = build_monitor(config, self.state.scaler.is_enabled())
        self.spikes = build_spike_detector(config)
        if self.spikes is not None:
            self.state.monitors["loss_spike"] = self.spikes
        self.guards = Guards(config, self.monitor, self.spikes, self.evaluator.metrics)
        self.headroom = build_headroom(config, self.task.model, self.state.scaler)
        if self.headroom is not None:
            self.state.monitors["headroom"] = self.headroom
        self.grad_norms = SkipGradNorms(self.task.model, enabled=config.diagnose.grad_norms).attach(self.state)
        if self.injector.faults:  # (review 54o: none configured, the loss is the task's own, ~1 us a step less)
            self.state.loss_fn = self.injector.wrap_loss(self.state.loss_fn)
        self.injector.attach(self.task.model)
        # the first skip's diagnosis: made only when asked, kept (and carried by the checkpoints) always, so
        # a resume that turns diagnose.first_skip off leaves the diagnosis an earlier part found on the card
        self.first_skip = self.state.monitors["first_skip"] = FirstSkipDiagnosis(
            self.state, self.task.model, injected=self.injector.firing)
        self.diagnosis = self.first_skip if config.diagnose.first_skip or config.diagnose.strict else None
        self.run_id = resume.run_id if resume is not None else None  # a new run's: made by run()
        self.checkpointer = self._checkpointer()  # its folder is set once run() opens the outputs
        self.rollbacks = Rollbacks(config, self.checkpointer, self.state, self.data, self.monitor, self.spikes)
        if config.rollback.triggers:  # the batches a rollback keeps as evidence
            self.rollbacks.evidence = TriggerBatches(self.state)
        self.checkpointer.parts[ck.ROLLBACKS] = self.rollbacks
        if resume is not None:  # still nothing written: a checkpoint that does not fit is one line
            if resume.loaded.let_go:  # (a caller's retry with the same Resume: review 56n)
                raise ValueError(f"{resume.path}: this Resume was restored by a Trainer already, which let go of "
                                 "its weights and optimizer state: read it again (checkpointer.find_resume)")
            problem = None
            try:
                other_data(resume.loaded.payload, resume.loaded.path.name, self.task.data_id)
                ck.fail_rate_counted_under(resume)
                self.checkpointer.check_fits(resume.loaded)
                self._check_logs(RunPaths.existing(resume.run_dir), resume.loaded.step)
                self.checkpointer.restore(resume.loaded)  # (each rank its own RNG state: one may not load)
                ck.check_data_next(resume.loaded, self.data)  # (the stream now seeked to the checkpoint's position)
            except InputError as err:
                problem = str(err)
            problem = distributed.first_error(problem)  # every rank refuses, with the first rank's line
            if problem is not None:
                raise InputError(problem)
            # the weights and the optimizer state are the model's and the optimizer's now: the payload's
            # copies let go (review 56c: they stayed, held by self.resume and the CLI's, until the run
            # ended, a model's worth of host memory, with AdamW on a GPU 3x the parameters); what is read
            # after (policy, autocast dtypes, throughput, data position, config) stays, a rollback reloads
            for part in (ck.MODEL, ck.OPTIMIZER):
                resume.loaded.payload.pop(part, None)
            resume.loaded.let_go = True
            ck.lrs_from_schedule(self.state.optimizer, self.state.scheduler)
        # settings changed on resume: applied where the checkpoint brought the old ones back, recorded
        self.policy = list(resume.loaded.payload.get(ck.POLICY) or []) if resume is not None else []
        # a training run's settings (not validate's nor locate's), said once: by the run, or by the resume that
        # gave them (review 52l: eval.batches set on a resume was a POLICY line, as if it took effect)
        if (resume is None or any(c["key"] in ("eval.every", "eval.batches") for c in self.policy_new)) and (
                unread := eval_unread(config, self.task)):
            warn(unread, AmpguardWarning, stacklevel=2)
        # the next step's LR, as the checkpoint's schedule left it (its get_last_lr: on the fast path,
        # where the group's LR is the last step's, brought up to date at the save) and as now set
        lr_before = self._next_lr()
        ck.apply_policy_changes(self.policy_new, config, self.state, len(self.rollbacks.log))
        if resume is not None:  # (a new scaler.init_scale: the next step's)
            restart_scale(self.monitor, self.state.scaler)
        lr_after = self._next_lr()
        # a change of the schedule (steps, schedule.*, optimizer.lr) moves the next step's LR: said on its line
        self._lr_moved = (lr_before, lr_after) if lr_before is not None and lr_after != lr_before else None
        self.policy += self.policy_new
        self.rollbacks.policy = self.policy
        # layers autocast computes in another dtype than the checkpoint's run did: said, not refused
        self.dtype_changes = ck.dtype_changes(resume.loaded.payload.get(ck.AUTOCAST_DTYPES), self.autocast_dtypes) \
            if resume is not None else []
        # the card's lines of them, earlier resumes' first (carried by the checkpoints, as the policy is)
        self.dtype_lines = list(resume.loaded.payload.get(ck.AUTOCAST_DTYPE_CHANGES) or []) if resume else []
        self.dtype_lines += [f"autocast dtype of {change} from step {self.state.steps + 1}"
                             for change in self.dtype_changes]
        saved = (resume.saved_config.get("schedule") or {}, resume.saved_config.get("steps")) if resume else None
        said = saved is not None and isinstance(saved[0].get("warmup"), int) and isinstance(saved[1], int) \
            and saved[0]["warmup"] > saved[1]  # (the run's own start said it already)
        if config.schedule.warmup > config.steps and not said:
            warn(f"schedule.warmup {config.schedule.warmup} > steps {config.steps}: the learning rate "
                 f"never reaches optimizer.lr (at most {config.steps / config.schedule.warmup:.3g} of it)",
                 WarmupPastTheRun, stacklevel=2)
        every, first = (self.headroom.every if self.headroom is not None else None), self.state.steps + 1
        if every is not None and first <= config.steps and config.steps // every * every < first:
            left = "" if first > 1 else " (headroom.csv keeps its header only)"
            warn(f"monitor.headroom.every {every}: none of the steps this run trains ({first} to "
                 f"{config.steps}) is measured{left}", AmpguardWarning, stacklevel=2)
        every = config.eval.every
        if "val_regression" in config.rollback.triggers and first == 1 and -(-config.steps // every) < 2:
            # (evaluated at every eval.every-th step and at the last: a run of one evaluation has none to
            # compare it with; a resumed run compares with the evaluations before it)
            warn(f"rollback.triggers: val_regression compares each evaluation with the best before it, and "
                 f"this run evaluates once (eval.every {every}, steps {config.steps}): it rolls back only on "
                 "a non-finite metric", AmpguardWarning, stacklevel=2)

    def _check_outputs(self, check: Callable[[], None] | None) -> None:
        """``check()``: what ``outputs()`` would refuse (a run folder that exists, a ``log.dir`` that
        cannot hold one: :meth:`RunPaths.check_new <ampguard.run_folder.RunPaths.check_new>`), made
        before anything is built, nothing created; rank 0's, as ``outputs()`` is, refused on every
        rank (review 60b: a taken folder was refused after the model's forward check)."""
        problem = None
        if check is not None and self.dist.is_main:
            try:
                check()
            except InputError as err:
                problem = str(err)
        problem = distributed.first_error(problem)
        if problem is not None:
            raise InputError(problem)

    def _next_lr(self) -> float | None:
        """The LR the next step takes from the schedule (``None`` without a scheduler)."""
        scheduler = self.state.scheduler
        return float(scheduler.get_last_lr()[0]) if hasattr(scheduler, "get_last_lr") else None

    def _check_logs(self, paths: RunPaths, step: int) -> None:
        """Every log a resume appends to (and cuts back to its ``step``) is of this run, checked
        before any is cut, each CSV row it keeps included: a refused resume changes none of them."""
        columns = CSV_COLUMNS + self.evaluator.metrics
        csvs = [(paths.csv, columns, f"this run's columns ({', '.join(self.evaluator.metrics) or 'no metrics'})", None)]
        if self.headroom is not None:  # (with the monitor off, build._cut_back_logs_off cuts it back where it can)
            csvs.append((paths.dir / HEADROOM_CSV, HEADROOM_COLUMNS, ", ".join(HEADROOM_COLUMNS), check_headroom_rows))
        for path, names, expected, read_back in csvs:
            CsvSink.check_header(path, names, expected)
            if path is not None and path.is_file():  # (steps.csv: every step from 1 to the checkpoint's)
                try:
                    CsvSink.check_kept_rows(path, len(names), step, first=1 if path == paths.csv else None,
                                      read_back=read_back)
                except RowsEndEarly as short:  # (its tail lost in a crash): the newest checkpoint it reaches
                    reached = [p for p in list_checkpoints(paths.checkpoints) if checkpoint_step(p) <= short.last]
                    way = f"; --resume {reached[-1]} goes on from there" if reached else ""
                    raise InputError(f"{short}{way}") from None
        if self.config.log.jsonl:
            JsonlSink.check_step_log(paths.steps_jsonl)

    def _check_model(self, model: torch.nn.Module) -> list[str]:
        """Before anything is written: the model has something to train, and the first batch goes
        through it and the loss (one forward pass that leaves no trace: ``build.check_forward``).
        Under torchrun each rank checks its own slice, and all refuse with the first rank's line;
        under DDP the check also finds the trainable parameters no rank's first slice gives a
        gradient (returned: DDP must look for them each step, or it fails at the second)."""
        factory = self.config.task.factory
        who = f"task.factory {factory}" if factory else f"task {self.task.name}"
        problem, unused = None, []
        ddp = self.dist.active and self.config.distributed.strategy == "ddp"
        precision = precision_of(self.config, self.device)
        self.autocast_dtypes: dict[str, str] = {}  # (the layers autocast left in float32: card, checkpoint)
        try:
            check_trainable(model, who)
            unused = check_forward(model, self.task.loss_fn, self.data.peek, precision, who, find_unused=ddp,
                                   dtypes=self.autocast_dtypes if precision.autocasts else None,
                                   resuming=self.resume is not None)
        except InputError as err:
            problem = str(err)
        problem = distributed.first_error(problem) or check_same_data(self.data, who)
        if problem is not None:
            raise InputError(problem)
        if not ddp:
            return []
        everyone = set().union(*map(set, distributed.all_gather(unused)))  # unused on any rank's slice
        return [name for name, _ in model.named_parameters() if name in everyone]

    def _checkpointer(self) -> ck.CheckpointManager:
        fsdp = self.dist.active and self.config.distributed.strategy == "fsdp2"
        state = self.state
        parts: dict[str, ck.Stateful] = {
            ck.MODEL: ck.ModelState(state.model, fsdp), ck.OPTIMIZER: ck.OptimizerState(state.model, state.optimizer, fsdp),
            ck.SCHEDULER: state.scheduler, ck.STATE: state, ck.RNG: ck.RngState(self.dist), ck.DATA: self.data}
        meta = lambda: {ck.UPDATES: state.updates, ck.CONFIG: plain_data(self.config),  # noqa: E731
                        ck.PRECISION: self.config.precision, ck.WORLD_SIZE: self.dist.world_size,
                        ck.TORCH_VERSION: str(torch.__version__), **({ck.RUN_ID: self.run_id} if self.run_id else {}),
                        **({ck.POLICY: list(self.policy)} if self.policy else {}),
                        **({ck.DATA_ID: self.task.data_id} if self.task.data_id else {}),
                        **({ck.DATA_NEXT: fingerprint} if (fingerprint := self.data.fingerprint()) else {}),
                        **({ck.THROUGHPUT: said} if (said := self._throughput_said()) else {}),
                        **({ck.AUTOCAST_DTYPES: dict(self.autocast_dtypes)} if self.autocast_dtypes else {}),
                        **({ck.AUTOCAST_DTYPE_CHANGES: list(self.dtype_lines)} if self.dtype_lines else {})}
        check = lambda loaded: ck.check_checkpoint(loaded, self.run_id)  # noqa: E731 - a rollback's too
        reach = lambda step: rollback_reach(self.config, step)  # noqa: E731
        return ck.CheckpointManager(None, parts, keep=self.config.checkpoint.keep, meta=meta, dist=self.dist,
                                    check=check, hold=reach)

    # ------------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        """Open the outputs, train until ``config.steps`` (or a guard's stop, or Ctrl-C), save the
        last checkpoint, close: the :class:`RunResult` (and, with a run folder, its card and plot).
        """
        # (SIGTERM unwinds it as Ctrl-C does; a peer that ended makes a collective fail: its stop, awaited)
        with opening(functools.partial(leave_now, take_back=self.take_back), distributed.PEERS):
            self._open()
        first_step = self._first_step = self.state.steps
        crashed: Exception | None = None
        with stop_on_signals() as stop, (watch_stuck(stop, self._stuck_grace, functools.partial(self._stuck, stop))
                                         if self.dist.active else contextlib.nullcontext()):
            self.stop_flag, clean, stopped = stop, True, None
            if self._stopped_opening is not None:  # (a resume's opening noted a stop signal: the first boundary's)
                stop.signal = signal_numbered(self._stopped_opening - 128)
            try:
                stopped = self._loop(stop)
            except KeyboardInterrupt:  # a second signal mid-step: no checkpoint of a half-done step
                clean = False
            except Exception as err:  # a crash mid-run (the task's model or loss, or a bug): card, then traceback
                # (a Ctrl-C Python wrapped on its way out of the user's code is an interrupt, as above)
                crashed, clean = (None if an_interrupt(err) else err), False
                if crashed is None:  # (an error raised while the Ctrl-C unwound: said, not lost; review 49h)
                    warn_each_time(f"raised while the interrupt unwound: {first_line(err, with_type=True)}",
                                   RankWarning)  # (a run's own line: every run in a process says it)
                if crashed is not None and distributed.peer_gone(crashed) and \
                        (code := distributed.peer_stopped()) is not None:  # a peer's second signal cut its
                    # step short and it left (end_alone, below): its stop, this rank's too, not a crash
                    crashed, stop.agreed = None, signal_numbered(code - 128)
                elif crashed is not None and not distributed.peer_gone(crashed):  # this rank's own crash: its
                    # line in the store before this process ends, for rank 0's card (review 53e: rank 1's
                    # error was in its stderr alone; the card said gloo's "Connection closed by peer")
                    distributed.tell_crashed(f"rank {self.dist.rank} raised {raised(crashed)}")
            finally:
                with self._handoff:  # from here a signal waits: the checkpoint and the run card come first
                    stop.closing, taken = True, self._taken_over
                if taken:  # (it unblocked while the stuck-watcher closes this rank: that ends the process)
                    threading.Event().wait()
                with contextlib.suppress(Exception):  # after an error too: the steps already taken reach the CSV
                    self.settle()
                try:
                    self.sinks.close()
                except Exception as err:  # a sink's last write failing is the run's crash, with its card; it
                    # replaced the crash being handled, and no card nor run_end was written (review 52d); a stop
                    # stays one, an interrupt's or a guard's (reviews 52i, 52l: its 130 became 1)
                    if crashed is None and clean and stopped is None:
                        crashed, clean = err, False
                    else:
                        warn_each_time(f"a sink failed as it closed: {first_line(err, with_type=True)}",
                                       RankWarning)
                self.injector.detach()
                with contextlib.suppress(Exception):  # (no batch is read after the loop: its DataLoader workers end)
                    self.data.release()
                if self.bar is not None:
                    self.bar.close()
            if crashed is not None:  # the steps before it stand: their rows, the last checkpoint, a card that says so
                distributed.ending()  # (a crash is this rank's end: torchrun's SIGTERM must not turn it into a stop)
                # (under torchrun each rank closes alone: a peer may be dead, the crash a collective's
                # "Connection reset by peer", or waiting in a collective this rank never joins)
                said = first_line(crashed, with_type=True)
                if distributed.peer_gone(crashed) and (peer := distributed.peer_crashed()) is not None:
                    # a peer's own crash failed this rank's collective: its error, which the card and the
                    # traceback's last line name (review 53e: "Connection closed by peer" alone; the cause
                    # was in the peer's stderr, another node's log); a peer killed leaves none
                    said = f"{peer} (rank {self.dist.rank} saw: {said.split('. ')[0]})"  # (gloo's advice after)
                    crashed.add_note(f"ampguard: {peer}; its traceback is in its own output")
                with contextlib.suppress(Exception):
                    self._close(Stop(ExitCode.CRASHED, f"crashed after step {self.monitor.steps}: {said}", CRASHED),
                                alone=True)
                raise crashed
            if not clean:  # after settle(): "after step N" names the last step the CSV holds
                stopped = self._interrupted(stop)
                if self.dist.active:  # (under torchrun a step cut short ends this rank alone: a peer may
                    # wait in the step's collective, which no rank will join; word of it for the peers)
                    distributed.end_alone(int(stopped.exit_code))
                    return self._close(stopped, alone=True)
            full = stopped is not None and stopped.kind == DISK_FULL  # agreed: every rank skips the save
            # (nor a model holding an update a guard rejected: Stop.unsaved)
            if clean and not full and not (stopped is not None and stopped.unsaved) and self.state.steps > first_step:
                self.save()  # (a resumed complete run only rewrites its card)
            return self._close(stopped)

    def _loop(self, stop: StopFlag) -> Stop | None:
        # (a resume's stop signal, one its opening noted or one since, is agreed here on every rank, each of
        # whose folders it changed: it ends as a run does, before its first step)
        interrupted, full = self._agree(stop if self.resume is not None else None, self.disk_full() is not None)
        if full:  # opening the outputs found the disk full
            return Stop(ExitCode.DISK_FULL, "disk full", DISK_FULL)
        if interrupted and self.state.steps < self.config.steps:  # (a resume of a run that had finished: it
            return self._interrupted(stop)                        # ends finished, as at the last boundary)
        if self.config.rollback.triggers and self.state.steps == 0 and self.resume is None:
            self.save()  # step-00000000.pt: a trigger before the first checkpoint.every returns to the start
        # where a stuck collective is watched for (torchrun): a step's micro-batches (DDP's all-reduce
        # in the backward, the guard's agreement) and the boundary's agreement; not a checkpoint's
        # save nor an evaluation, where a rank waits for the slowest as long as that takes
        watched = Watched(stop) if self.dist.active else contextlib.nullcontext()
        while self.state.steps < self.config.steps:
            began = stop.ran()  # (the seconds the process ran: a suspension mid-step is no slow step)
            with self.watching(), watched:
                if self._share_each_step:
                    self.share_buffers()  # type: ignore[misc]
                try:
                    record = self.train_step()
                except BadBatch as bad:  # the steps before it stand: their records, the run card
                    self._back_to_the_group_start()
                    # (the records in flight judged first: a guard's stop among them is the run's end, as
                    # on the exact path, whose guard stops the run before it reads the next batch; review 61e)
                    return self.handle(self.inflight.drain()) or \
                        Stop(ExitCode.BAD_INPUT, f"bad data at step {self.state.steps + 1}: {bad}", BAD_DATA)
            self._timed(stop.ran() - began)
            self.throughput.steady()  # the run card's throughput counts from the end of the first step
            if self.state.steps >= self.config.steps:
                self.throughput.ended()  # ... to the end of the last (not its evaluation, the final save)
            # evaluated now, on this step's model; written and judged with its record
            due = self.evaluator.due(record.step)
            if due and self.share_buffers is not None:
                self.share_buffers()
            try:
                metrics = self.evaluator() if due else None
            except BaseException:  # (a second Ctrl-C, a crash: the step the model took keeps its row, written
                self.inflight.add(record, None)  # by settle(), without the metrics it did not finish; review 49f)
                raise
            self.inflight.add(record, metrics)
            decision = self.handle(self.inflight.ready())
            if decision is not None:
                return decision
            with watched:
                interrupted, full = self._agree(stop, self.disk_full() is not None)
            if full:  # a file found no room (on rank 0): every rank stops here, nothing more is written
                return Stop(ExitCode.DISK_FULL, "disk full", DISK_FULL)
            if interrupted and self.state.steps < self.config.steps:  # the first Ctrl-C or SIGTERM, honoured at
                # a step boundary (run() saves); after the last step the run has finished: it ends so. The records
                # in flight are judged first: a guard that tripped on one stops the run (exit 3), as the exact
                # path's guard does at the boundary the signal came to (review 61e: it was written unjudged, its
                # `fail` event logged beside an "interrupted" card and exit 130)
                return self.handle(self.inflight.drain()) or self._interrupted(stop)
            if self.save_due(self.state.steps):  # a checkpoint holds the monitors: every record handled first
                decision = self.handle(self.inflight.drain())
                if decision is not None:
                    return decision
                self.save()
        return self.handle(self.inflight.drain()) or self._judge_end()

    def _judge_end(self) -> Stop | None:
        """The run trained all its steps: the monitor judges the whole run once
        (:meth:`~ampguard.monitor.RunMonitor.at_end`: a run too short to arm the ALERT or to fail
        fast is not waved through)."""
        events = self.monitor.at_end(self.state.steps)
        # (a resumed run that had finished logged them when it did: its last checkpoint is saved after this)
        if events and self.state.steps > self._first_step:
            self._tell(events)  # (the tracker sinks: last_alert, events.<kind>)
        if not events or events[-1].kind != "fail":  # (a failure is the last event at_end gives)
            return None
        failed = events[-1]
        return Stop(ExitCode.GUARD, f"stopped by the guard {AT_THE_END}{failed.step}): {failed.message}",
                    failed.cause)

    def handle(self, records: Iterator[tuple[StepRecord, dict[str, float] | None]]) -> Stop | None:
        """Records read back, oldest first: each written, watched and judged (the guards name its
        own step). A rollback is carried out here (the exact path only: it has no records in
        flight); a stop first writes the records still in flight, then ends the loop."""
        for record, metrics in records:
            held = self.record(record, metrics)
            diagnosis = self.diagnosis.after(record, fresh=self.config.diagnose.strict) if self.diagnosis else None
            decision = self.guards.check(record, diagnosis, metrics)
            if isinstance(decision, Rollback):
                decision = self.rollbacks.apply(decision)
            if held and isinstance(decision, Stop):  # (the failure a rollback would have taken: the run stops for it)
                self._tell(held)
            if isinstance(decision, Stop):
                self.settle()
                return decision
        return None

    def settle(self) -> None:
        """Write (and watch, but no longer judge) every record still in flight: the steps after
        a stop's trigger that the fast path had already trained; the CSV holds every step the
        model took."""
        for record, metrics in self.inflight.drain():
            self.record(record, metrics)

    def _interrupted(self, stop: StopFlag) -> Stop:
        return Stop(stop.exit_code, f"interrupted ({stop.name}) after step {self.monitor.steps}", INTERRUPTED)

    def train_step(self) -> StepRecord:
        """Micro-batches through the guarded step until one closes its group.

        On the exact path the step reads its skip flags on the host once per step (a host sync;
        docs/design.md §2); on the fast path it reads nothing (its record is read back later,
        :class:`~ampguard.records.InFlight`).
        """
        # the RNGs where the group starts, for the final checkpoint after data that fails inside it
        # (:meth:`_back_to_the_group_start`), only where one is saved. Review 53h: every RNG's state, ~50 us a
        # step (NumPy's and random's most of it), cost the linear task's step 17%: a built-in task draws from
        # torch alone (its own generators, dropout), so torch's is exact for it (~2 us); a factory's data may
        # draw from any of them (a raw snapshot, converted for no file)
        if self.config.accumulation_steps > 1 and self.config.checkpoint.enabled and self.checkpointer.enabled:
            self._group_rng = rng_snapshot() if self.config.task.factory else torch_rng_state()
        while True:
            try:
                batch = self.data.next(first_step=self.state.steps + 1)
            except InputError as err:  # a batch that does not split over the ranks: the same on every rank
                raise BadBatch(str(err)) from None
            except (torch.cuda.OutOfMemoryError, StopIteration):
                raise
            except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's data raising (or exiting)
                if an_interrupt(err):
                    raise
                why = raised(err)
                if self.dist.active:  # the same global stream on every rank: the same record raises on each
                    why = distributed.every_rank_raised(f"{self._attempt}/{self.data.position}", why,
                                                        max(STUCK_AFTER_S, 3 * self._slow_step()))
                    if why is None:  # this rank's own failure: a stop on it alone would leave the others
                        raise        # waiting in the step's collectives; the traceback ends the job (torchrun)
                raise BadBatch(why) from None
            self.throughput.add(batch[0])
            if self.diagnosis is not None:  # (kept while a replay may read it: review 53h)
                self.diagnosis.capture(batch, fresh=self.config.diagnose.strict)
            evidence = self.rollbacks.evidence
            if evidence is not None:
                evidence.capture(batch)
            try:
                record = self.state.step(*batch)
            except SystemExit as err:  # its code would pass for ours (0: done; 3: a guard's stop): a crash
                raise RuntimeError(f"the task's model or loss called sys.exit({err.code!r}) at step "
                                   f"{self.state.steps + 1}") from None
            if record is not None:
                if evidence is not None:
                    evidence.closed(record)
                return record

    def _back_to_the_group_start(self) -> None:
        """The data failed inside an accumulation group: the group is dropped (its gradients, the
        running statistics its forwards wrote), the data position and the RNGs put back where it
        started, so the run's final checkpoint is the last closed step's, whole, and a resume
        from it reads that group again. Review 50a: with ``checkpoint.every: 0`` a failure at a
        group's second micro-batch ended "intact up to step 4 (no checkpoint)": a save refuses a
        group half-read, and every trained step was lost."""
        if not self.state.mid_group:
            return
        self.data.seek(self.data.position - self.state.micro_batches)
        self.state._discard_group()
        if self._group_rng is not None:  # (none noted: no checkpoint is saved, no resume reads the group again)
            set_rng_state(self._group_rng)

    def watching(self) -> contextlib.AbstractContextManager[None]:
        """Around :meth:`train_step`: the diagnostics' hooks, which live for that call only and
        watch from outside the step (``headroom.py``): at the first step the hooks that learn
        backward's order (for a skipped step's gradient norms), and on a measured step the
        headroom hooks. Other steps pay nothing: one shared do-nothing context (review 54o: the
        two generator context managers entered and left every step, for nothing on most, cost
        ~4-5 us a step, ~1% of a tiny model's)."""
        grad, headroom = self.grad_norms, self.headroom
        learned = not grad.enabled or grad.order is not None  # (capturing() would install nothing)
        if learned and (headroom is None or not headroom.due(self.state.steps + 1)):  # (nor measuring())
            return _NOTHING
        return self._watching()

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        headroom = self.headroom.measuring(self.state.steps + 1) if self.headroom else contextlib.nullcontext()
        with self.grad_norms.capturing(), headroom:
            yield

    def record(self, record: StepRecord, metrics: dict[str, float] | None) -> list[Event]:
        """The record to every sink; the monitors' events to the log; the console lines. Returns
        the failure held back for a rollback to take (:meth:`Guards.rolls_back`; said only if
        the run stops for it).

        The first sink to read the record copies its values to the host (the step's one
        transfer; later readers pay nothing).
        """
        self.stop_flag.holding = True  # a second Ctrl-C here waits until the record is whole
        try:
            self.sinks.write(record, metrics)
            events = self.monitor.observe(record) + (self.headroom.observe(record) if self.headroom else [])
            held = [event for event in events if self.guards.rolls_back(event)]
            self._tell([event for event in events if event not in held])
            norms = self.grad_norms.after(record)  # a skipped step's per-parameter norms (read on skips only)
            if norms is not None:
                self.events.emit(norms)
            if metrics:
                self.monitor.observe_eval(metrics)
                self.say(f"EVAL {record.step} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if self.stats_every and record.step % self.stats_every == 0:
                self.say(self.monitor.stats_line() + self.throughput.take())
            if self.bar is not None:
                self.bar.update(1)
        finally:
            self.stop_flag.holding = False
        self.stop_flag.release()
        return held

    def _tell(self, events: list[Event]) -> None:
        """The monitors' events to the event log and the console, and to the tracker sinks with
        the monitor's view of the step."""
        for event in events:
            self.events.emit(event.as_dict(), event_word(event.kind))
        self.sinks.observe(self.monitor, events)  # the tracker sinks log the monitor's view with the step
        for why in self.sinks.newly_lost():  # (its warning was the console's line; the log keeps when)
            self.events.emit({"step": self.monitor.steps, "event": "tracker_lost", "message": why})

    def save_due(self, step: int) -> bool:
        """A checkpoint every ``checkpoint.every`` steps, but not at the last step (``run()``
        saves that one)."""
        every = self.config.checkpoint.every
        return bool(every) and step % every == 0 and step < self.config.steps

    def save(self) -> None:
        """A checkpoint of the current step, unless checkpoints are off, the step is mid-group, or
        the run has no checkpoint folder (a demo). Device tensors are copied to the host to be
        written (a host sync).
        """
        if not self.config.checkpoint.enabled or self.state.mid_group or not self.checkpointer.enabled:
            return
        # the logs up to this step made durable first (the checkpoint is fsync'ed): after a machine
        # crash a resume from it finds every row up to its step (it refuses a CSV that stops short);
        # a DataLoader worker dying meanwhile is said at the data's next read (review 58d)
        with child_exits_held():
            self.sinks.sync()
            self.events.sync()
            path = self.checkpointer.save(self.state.steps)  # every rank takes part; rank 0 writes
        if path is not None:
            self.events.emit({"step": self.state.steps, "event": "checkpoint", "message": f"saved {path.name}"})

    # ------------------------------------------------------------------ opening and closing

    def _open(self) -> None:
        """Create what the run writes (rank 0 only), and tell every rank the checkpoint folder."""
        main, resuming = self.dist.is_main, self.resume is not None
        self._failed, refused, self._stopped_opening = None, None, None
        try:
            with writing("the run folder"):
                self.paths = self.outputs() if main else RunPaths()
        except DiskFull as full:  # the disk is full already: train nothing, write nothing more
            self.paths, self._failed = RunPaths(), full
        except InputError as err:  # rank 0's alone (the folder exists): every rank refuses with its line
            refused = str(err)
        refused = distributed.first_error(refused)
        if refused is not None:
            raise InputError(refused)
        self.checkpointer.folder = distributed.broadcast_from_main(self.paths.checkpoints)
        try:  # (made with a new run folder; a folder from before run ids gets one now)
            with writing(self.paths.dir or "the run folder"):
                run_id = self.paths.ensure_run_id()
        except DiskFull as full:
            run_id, self._failed = None, self._failed or full
        # (and a token of this attempt, rank 0's: keys of its own in the rendezvous store)
        self.run_id, self._attempt = distributed.broadcast_from_main((run_id, secrets.token_hex(8)))
        self.bar = progress_bar(self.config.steps, initial=self.state.steps) if self.progress and main else None
        self.throughput = Throughput(flops_per_token=self.task.flops_per_token, peak_flops=self._peak_flops(),
                                     ranks=self.dist.world_size)
        self.say = say = (self.bar.write if self.bar is not None else self.print_fn) if main else (lambda line: None)
        console = ConsoleSink(self.console_every, say)
        if not resuming:
            self._open_outputs(console, main)
            return
        # from its log's cut on, a resume changes its folder for good (the rows after its step, config.yaml,
        # the card of its earlier end, newer checkpoints set aside): a stop signal there is noted, not raised,
        # and stops the run at its first boundary with its events and a card (review 49f: it unwound as a
        # start-up stop and left a cut CSV under the old card, or no card and the cancelled --set kept)
        try:
            with held_signals():
                self._open_outputs(console, main)
        except Interrupted as stop:
            self._stopped_opening = stop.exit_code

    def _open_outputs(self, console: ConsoleSink, main: bool) -> None:
        """:meth:`_open`'s sinks, and for a resume its folder brought to the checkpoint's step."""
        resuming, say = self.resume is not None, self.say
        # a resume's opened before the sinks, whose resume cuts the CSV back, and before the folder changes for
        # good (config.yaml, the card): one it refuses (another user's link, review 55d) leaves the folder as it
        # was (review 55w: opened after them, the refusal came with steps.csv cut); a new run's after them, so a
        # sink's refusal (a tracker's) leaves a folder with nothing of a run, taken back
        if resuming:
            self.events = EventLog(self.paths.events, say, append=True)
        try:
            self.sinks = build_sinks(self.config, self.paths, self.evaluator.metrics, console,
                                     keep_through=self.state.steps if resuming else None, headroom=self.headroom)
        except DiskFull as full:  # the CSV's header (or a resume's truncation) found no room
            self.sinks, self._failed = Sinks(console), self._failed or full
        except BaseException:  # refused: the resume's event log is closed too (review 58f: left to the collector)
            if resuming:
                with contextlib.suppress(Exception):
                    self.events.close()
            raise
        if not resuming:
            self.events = EventLog(self.paths.events, say, append=False)
        if self.announce is not None and self.paths.dir is not None and main:
            # the run folder's line once nothing can refuse the run any more (a sink that did not
            # open): a refusal is then the console's only output besides "removed (nothing was run)",
            # and a warning held until the first line (fp16 on a CPU) stays held
            say(self.announce(self.paths))
        for sink in self.sinks.sinks:
            if isinstance(sink, TrackerSink):  # where the tracker run is: it may not be where one looks first
                say(f"tracking: {sink.where}")
                if resuming and self.state.steps and sink.found_earlier is False:  # (deleted there, or another store)
                    # (a warning as the others are, `ampguard: warning: ...` on stderr; it was a stdout line: review 56b)
                    warn(f"{sink.where} is a new run: this run's earlier one was not found there (deleted? "
                         f"another store?); it holds the steps from {self.state.steps + 1} on", AmpguardWarning)
        if resuming and self._failed is None:  # rank 0's; a resume a sink refused keeps the old config.yaml
            try:
                with writing(self.paths.config or "config.yaml"):
                    self.paths.write_config(self.config)
            except DiskFull as full:
                self._failed = full
            if self.paths.card is not None:  # the run goes on: the card of its earlier end is no longer true
                # (a resume killed before its end left "finished: 30 steps" beside rows to step 59,
                # which report and compare then printed as the run's end); its end writes a new one
                self.paths.card.unlink(missing_ok=True)
        self.rollbacks.events = self.events
        self.rollbacks.folder = self.paths.dir
        if self.diagnosis is not None:
            self.diagnosis.events = self.events
        if self.resume is not None:
            self.checkpointer.remove_partial()  # saves that a kill cut short: none of them is this run's
            if self.paths.dir is not None:  # (rank 0's folder) an evidence checkpoint's copy a kill cut
                remove_temporaries(self.paths.dir / "rollback")  # short: a hard link to a pruned one holds its disk
                # and the card, config or plot a killed run or report left half-written in the folder itself (review
                # 52c: never taken out); a live process's (a report drawing now) stays
                remove_temporaries(self.paths.dir, only=left_by_an_ended_process)
            set_aside = self.checkpointer.set_aside_after(self.state.steps)
            unreadable = self.resume.unreadable  # (passed over by --resume RUN_DIR: say why, not only that)
            note = "; newer checkpoints set aside: " + ", ".join(
                p.name + (f" ({unreadable[p.name]})" if p.name in unreadable else "") for p in set_aside) if set_aside else ""
            self.events.emit({"step": self.state.steps, "event": "resume",
                              "message": f"resumed from {self.resume.path.name} at step {self.state.steps}{note}"}, "RESUME")
            # (no next step where the resume ends the run: review 52a said the LR of a step 11 that never ran)
            moved = self._lr_moved if self.state.steps < self.config.steps else None
            for change in self.policy_new:  # each is a line on the console, in events.jsonl and the run card
                line = ck.policy_line(change)
                said = change["key"] == "optimizer.lr" and moved == (change["old"], change["new"])  # (its own line)
                if moved is not None and ck.moves_lr(change["key"]) and not said:  # (once, on the first such change)
                    line += f" (the next step's LR {moved[0]:.4g} -> {moved[1]:.4g})"
                    moved = None
                self.events.emit({"step": self.state.steps, "event": "policy_change", **change, "message": line},
                                 "POLICY")
            if self.dtype_changes:  # (the model's code or torch's autocast changed: no setting says so)
                self.events.emit({"step": self.state.steps, "event": "autocast_dtype_change",
                                  "changes": self.dtype_changes,
                                  "message": "layers autocast computes in another dtype than the checkpoint's run did: "
                                             + ", ".join(self.dtype_changes)
                                             + " (the model's code or torch changed: not the same run continued)"},
                                 "POLICY")
        else:
            self.events.emit({"step": 0, "event": "run_start",
                              "message": f"{self.task.description}; {self.config.precision} on {self.device}"
                                         + (f" x {counted(self.dist.world_size, 'process', 'processes')} "
                                            f"({self.config.distributed.strategy})" if self.dist.active else "")
                                         + self._fp8_note() + self._unused_note
                                         + ("; compiled (torch.compile)" if self.config.compile else "")
                                         + f"; {self.path}"})

    @functools.cached_property
    def fp8_layers(self) -> list[str]:
        """Under fp8, the Linear layers that train in float8 (``fp8.keep_first_last``,
        ``fp8.exclude``), one entry per layer (a reused one with its other places:
        :func:`~ampguard.fp8.fp8_layers_named`); none under another precision. The run's start and
        its card name them."""
        if self.config.precision != "fp8":
            return []
        from .fp8 import fp8_layers_named

        return fp8_layers_named(self.task.model)

    def _fp8_note(self) -> str:
        """Under fp8, which Linear layers train in float8, for ``run_start``."""
        if self.config.precision != "fp8":
            return ""
        from .fp8 import in_float8

        return f" ({in_float8(self.fp8_layers)})"

    def _timed(self, seconds: float) -> None:
        """A step took ``seconds`` of the process's running time: for :meth:`_slow_step`."""
        if self._first_step_s is None:
            self._first_step_s = seconds
        else:
            self._slowest = max(self._slowest, seconds)

    def _slow_step(self) -> float:
        """How long a slow step of this run takes (s): the slowest after this process's first
        (that one while it alone is timed; 0 before), in the seconds the process ran
        (:attr:`StopFlag.ran <ampguard.signals.StopFlag.ran>`, ticked by the stuck-watcher under
        torchrun). A step the process was stopped in (SIGSTOP ... SIGCONT, a scheduler's suspend,
        a debugger's stop: the monotonic clock goes on) counts the time it ran, however many there
        are (the second slowest step, taken so that one such step did not make the stuck grace
        hours long, was a second one's; session 60d); a step that is slow once (a recompile, a data
        loader starting its workers) counts from then on (it did not until it came twice: the
        next one was given 10 s). The first step (a compile, a warm-up) counts only until a second
        is timed: three compiles' grace would leave a rank a dead peer hung to the SIGKILL that
        follows the launcher's SIGTERM (torchrun's, 30 s later). Without the watcher (one process,
        where nothing reads this; a Python that cannot wake on a pipe) the clock is the monotonic
        one."""
        return self._slowest or self._first_step_s or 0.0

    def _stuck_grace(self) -> float:
        """How long the main thread may stay where it is in a step after a stop signal before it
        is taken as stuck in a collective (:func:`~ampguard.signals.watch_stuck`): three of the
        run's slow steps (:meth:`_slow_step`), at least :data:`~ampguard.signals.STUCK_AFTER_S`;
        never before the first step is timed (a compile, a warm-up)."""
        slow = self._slow_step()
        return max(STUCK_AFTER_S, 3 * slow) if slow else math.inf

    def _stuck(self, stop: StopFlag, signum: int) -> None:
        """On the stuck-watcher's thread, under torchrun: a stop signal came and the main thread
        has not moved since (waiting in C, in a collective a hung or dead peer never joins: under
        NCCL it never returns). This rank closes alone with what it has (the rows up to the last
        step recorded and the checkpoints already written: it writes none, a stuck step's state is
        half-made; rank 0 writes ``run_end``, the card and ends its tracker runs) and leaves at
        once with the signal's code: the job's scheduler would kill it next."""
        with self._handoff:
            if stop.closing:  # the main thread got there first: it closes
                return
            stop.closing, self._taken_over = True, True
        if stop.signal is None:  # (its Python handler never ran: what it would have noted)
            stop.signal = signum
        code, why = stop.exit_code, (f"{self._interrupted(stop).why}: the process then waited over "
                                     f"{self._stuck_grace():.0f} s in a collective (another process hung or died?)")
        try:
            with contextlib.suppress(Exception):  # (the main thread's finally would have closed them)
                self.sinks.close()
            self._close(Stop(code, why, INTERRUPTED), alone=True)
            if self.dist.is_main:  # (no checkpoint is written here: the others' share of the state is out of reach)
                saved = self.checkpointer.saved
                resume = (f"--resume goes on from {saved[-1].parent.name}/{saved[-1].name}" if saved  # (as train's line)
                          else "no checkpoint to --resume from")
                print(f"ampguard: {why}; the rows up to step {self.monitor.steps} stand ({resume})",
                      file=sys.stderr, flush=True)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            os._exit(int(code))

    def _close(self, stopped: Stop | None, alone: bool = False) -> RunResult:
        """The run's end (the main thread's, or the stuck-watcher's: :meth:`_stuck`; which one,
        ``_handoff`` decides): ``run_end``, the run card and plot, the tracker runs ended;
        ``alone`` (a crash, a rank stuck in a collective): no collective, the ranks end with their
        own codes."""
        ended = stopped.why if stopped else f"finished: {counted(self.config.steps, 'step')}"
        if self.disk_full() is None:  # once a write found no room, nothing more is written
            self.events.emit({"step": self.monitor.steps, "event": "run_end", "message": ended})
        self.events.close()
        result = RunResult(stopped.exit_code if stopped else ExitCode.OK, self.monitor, self.paths, ended, self.device,
                           self.checkpointer.saved, self.rollbacks.log, self.resume.path if self.resume else None,
                           self.task.description, self.first_skip.found)
        result.policy_changes = [ck.policy_line(change) for change in self.policy] + self.dtype_lines
        result.policy = list(self.policy)
        result.autocast_dtypes = self.autocast_dtypes
        result.throughput, result.path, result.fp8_layers = self._throughput_said(), self.path, self.fp8_layers
        result.world_size = self.dist.world_size
        if self.paths.dir is not None and self.disk_full() is None:
            from .report import write_report

            try:
                write_report(self.config, result)
            except Exception as err:
                if disk_full_error(err) is None:
                    raise
                self._failed = DiskFull(disk_full_error(err).filename or self.paths.card, disk_full_error(err))
        full = self._disk_full_line()
        if not alone:  # every rank ends with the same code: rank 0's
            full = distributed.broadcast_from_main(full)
        if full is not None:
            if self.dist.is_main:
                print(f"ampguard: error: {full}", file=sys.stderr, flush=True)
            result.exit_code, result.ended = ExitCode.DISK_FULL, full
        self.sinks.finish(result)  # the tracker runs: totals, the run card and plot as artifacts, the end
        return result

    def _throughput_said(self) -> str | None:
        """The run card's throughput: this process's (:meth:`Throughput.summary`), else the one the
        checkpoint it resumed from kept, as an earlier part's (:data:`~ampguard.checkpointer.THROUGHPUT`)."""
        measured = self.throughput.summary()
        if measured is not None or self.resume is None:
            return measured
        earlier = self.resume.loaded.payload.get(ck.THROUGHPUT)
        return earlier.removesuffix(ck.EARLIER_PART) + ck.EARLIER_PART if isinstance(earlier, str) else None

    def _peak_flops(self) -> float | None:
        """FLOP/s for the MFU: ``log.peak_tflops``, else a known GPU's (``events.PEAK_TFLOPS``)."""
        if self.config.log.peak_tflops is not None:
            return self.config.log.peak_tflops * 1e12
        if self.device.type != "cuda" or self.config.precision == "fp32":
            return None
        peak = known_peak_tflops(torch.cuda.get_device_name(self.device))
        return peak * 1e12 if peak else None

    def _agree(self, stop: StopFlag | None, full: bool) -> tuple[bool, bool]:
        """Ranks stop together: a stop signal seen by any rank, or a write that found the disk full
        (rank 0's), stops all at the same step boundary; and for one signal, the highest-numbered
        any rank saw (SIGTERM 15 over stdout's reader leaving 13 over Ctrl-C 2), whose exit code and
        name every rank then ends with (a SIGTERM sent to one rank's process had the others end
        with 130, "Ctrl-C"). One all-reduce and host read (torchrun); in one process, nothing to
        agree with (review 54o: the call, its process-group look-up and lists, ~3 us every step)."""
        signum = int(stop.signal or 0) if stop else 0
        if self.dist.active:
            signum, full = distributed.highest([signum, int(full)], self.device)
        if signum and stop is not None:  # (not its own signal: one arriving now is this rank's first, not a second)
            stop.agreed = signal_numbered(signum)
        return bool(signum), bool(full)

    def disk_full(self) -> DiskFull | None:
        """This rank's first write that found the disk full (the run folder, a sink, the event
        log, a checkpoint, the run card), or None while every write went through."""
        return self._failed or self.checkpointer.failed or self.sinks.failed or self.events.failed

    def _disk_full_line(self) -> str | None:
        full = self.disk_full()
        if full is None:
            return None
        return disk_full_line(full, self.checkpointer.saved, self.state.steps, self.monitor.steps, self.paths.dir)


def _build_task(config: Config, world: int) -> Task:
    """Every rank reads the same stream of global batches (batch_size per rank x ranks) and takes
    its own slice, so N ranks see exactly the data one process with N x the batch sees."""
    if world == 1:
        return build_task(config)
    task = config.task.model_copy(update={"batch_size": config.task.batch_size * world})
    try:
        return build_task(config.model_copy(update={"task": task}))
    except InputError as err:  # its numbers are the global batch's: say how it was made
        if err.key != "task.batch_size":
            raise
        raise InputError(f"{err} (under torchrun task.batch_size is per process: the global batch is "
                         f"{config.task.batch_size} x {world} processes; divide by {world})") from None
