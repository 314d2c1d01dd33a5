"""The run's guards and what they decide: go on, roll back, or stop, as typed values.

After each step the loop asks :meth:`Guards.check` for a :data:`Decision`:

- :class:`Continue`;
- :class:`Rollback` (``first_bad_step``, why, ``kind``: :data:`LOSS_SPIKE`, :data:`SKIP_GUARD` or
  :data:`VAL_REGRESSION`), carried out by :class:`Rollbacks`, which may turn it into a stop (no
  checkpoint to return to, ``rollback.max`` used up), and which keeps the evidence: the batches
  that triggered it (:class:`TriggerBatches`), saved as ``rollback/step-N.pt`` for ``ampguard
  locate --batch``;
- :class:`Stop` (an :class:`~ampguard.errors.ExitCode`, why, ``kind``: the monitor's failure
  cause, :data:`STRICT`, :data:`ROLLBACKS_USED_UP`, :data:`NO_CHECKPOINT`, :data:`INTERRUPTED`,
  :data:`DISK_FULL`, :data:`BAD_DATA`, :data:`CRASHED`).

Under torchrun every decision is the same on every rank at the same step: the guards read
values the step's all-reduce already agreed on, a rollback goes ahead only when every rank
loaded the same checkpoint, and the first-skip diagnosis gathers each rank's finding.

Nothing is decided by matching message text: a guard's ``kind`` says which guard it was.
The first-skip diagnosis (:class:`FirstSkipDiagnosis`) lives here too: strict mode stops with
its finding.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from . import distributed
from .checkpoint import torch_rng_state
from .checkpointer import (DATA, ROLLBACK_PARTS, SPIKE_MONITOR, STATE, CheckpointManager, Loaded, apply_policy_changes,
                           lrs_from_schedule)
from .config import Config
from .errors import ConfigError, ExitCode, InputError, counted, first_line
from .files import temporary_beside
from .monitor import FAIL_SKIP_RATE, Event, LossSpikeDetector, RunMonitor, metric_direction
from .precision import scale_in_use
from .records import StepRecord

if TYPE_CHECKING:
    import torch

    from .data import DataStream
    from .events import EventLog
    from .step import AmpTrainState

LOSS_SPIKE = SPIKE_MONITOR  # (the trigger's name, its window's in a checkpoint: checkpointer.holds_spike_window)
SKIP_GUARD = "skip_guard"
VAL_REGRESSION = "val_regression"
STRICT = "strict"
UNSAVED = "; the model after it is not saved (a --resume goes on from the last checkpoint before it)"
"""What a stop the rollback could not turn back adds where the model holds the update the guard
rejected (:attr:`Stop.unsaved`)."""
ROLLBACKS_USED_UP = "rollbacks_used_up"
NO_CHECKPOINT = "no_checkpoint"
INTERRUPTED = "interrupted"
DISK_FULL = "disk_full"
BAD_DATA = "bad_data"
CRASHED = "crashed"


@dataclass(frozen=True)
class Continue:
    """Nothing to do: train on."""


@dataclass(frozen=True)
class Rollback:
    """Return to the newest checkpoint from before ``first_bad_step``."""

    first_bad_step: int
    why: str
    kind: str


@dataclass(frozen=True)
class Stop:
    """End the run with ``exit_code``; ``why`` is what the run card and the console say.
    ``unsaved``: the model it stops with holds the update a guard rejected (a loss spike, a
    held-out regression it could not roll back): no final checkpoint is saved of it, so the
    newest one, which ``--resume`` takes, is from before it."""

    exit_code: ExitCode
    why: str
    kind: str
    unsaved: bool = False


Decision = Union[Continue, Rollback, Stop]
CONTINUE = Continue()


class Guards:
    """Turns a step's record and the monitors' state into a :data:`Decision`.

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.records import SkipLog
        >>> import torch
        >>> config = validate({"monitor": {"fail_rate": 0.5, "fail_after": 1}})
        >>> monitor = RunMonitor(fail_rate=0.5, fail_after=1, scaler_enabled=False)
        >>> record = SkipLog(step=1, lr=0.1, loss=torch.tensor(float("nan")), grad_l2_pre_clip=None,
        ...                  grad_l2_post_clip=None, scaler_scale=torch.tensor(1.0), reason="non_finite_loss")
        >>> _ = monitor.observe(record)
        >>> decision = Guards(config, monitor).check(record)
        >>> type(decision).__name__, int(decision.exit_code), decision.kind
        ('Stop', 3, 'skip_rate')
    """

    def __init__(self, config: Config, monitor: RunMonitor, spikes: LossSpikeDetector | None = None,
                 metrics: tuple[str, ...] = ()) -> None:
        self.monitor = monitor
        self.spikes = spikes
        self.strict = config.diagnose.strict
        self.triggers = set(config.rollback.triggers)
        self.z = config.rollback.z
        self.fail_after = config.monitor.fail_after
        self.eval_every = config.eval.every
        self.val_threshold = config.rollback.val_regression
        self.val_metric = check_val_metric(config, metrics)
        self.val_higher = False
        if self.val_metric is not None:  # declared, or said by its name (check_val_metric refused a guess)
            mode = config.rollback.val_mode
            self.val_higher = mode == "max" if mode != "auto" else metric_direction(self.val_metric) is True
            monitor.higher_better[self.val_metric] = self.val_higher

    def rolls_back(self, event: Event) -> bool:
        """Whether the monitor's ``event`` is a failure this run's guards turn into a rollback
        (the skip-rate fail-fast under the ``skip_guard`` trigger): said as the rollback, or as
        the failure only when the run stops for it (``rollback.max`` used up, no checkpoint),
        never as a ``FAIL`` of a run that then goes on."""
        return event.kind == "fail" and event.cause == FAIL_SKIP_RATE and SKIP_GUARD in self.triggers

    def check(self, record: StepRecord, diagnosis: str | None = None,
              metrics: dict[str, float] | None = None) -> Decision:
        """The decision after ``record`` (already observed by the monitor) and, at an evaluation,
        its held-out ``metrics`` (already observed by the monitor too)."""
        if record.skipped and self.strict:
            which = "loss" if record.reason == "non_finite_loss" else "gradient"
            return Stop(ExitCode.GUARD, f"strict mode: non-finite {which} at step {record.step}: {diagnosis}", STRICT)
        failed = self.monitor.failed  # first: a rollback for a spike would forget it (restart_windows)
        if failed is not None:
            if failed.cause == FAIL_SKIP_RATE and SKIP_GUARD in self.triggers:
                return Rollback(record.step - self.fail_after + 1, f"skip-rate guard: {failed.message}", SKIP_GUARD)
            return Stop(ExitCode.GUARD, f"stopped by the guard at step {record.step}: {failed.message}", failed.cause)
        if self.spikes is not None and not record.skipped:
            loss = self.monitor.last.get("loss")
            if self.spikes.check(loss):
                return Rollback(record.step, f"loss spike ({loss:.4g} > mean + {self.z:g} std)", LOSS_SPIKE)
        if self.val_metric is not None and metrics and self.val_metric in metrics:
            regression = self.val_regression(metrics[self.val_metric])
            if regression is not None:
                # the previous evaluation was judged fine: return to a checkpoint at or before it
                previous = (record.step - 1) // self.eval_every * self.eval_every
                return Rollback(previous + 1, f"held-out regression at step {record.step} ({regression})",
                                VAL_REGRESSION)
        return CONTINUE


    def val_regression(self, value: float) -> str | None:
        """Whether a held-out ``value`` of the watched metric regressed past the threshold, in
        words, or None. The best so far is the monitor's (it has seen ``value`` already).

        Example::

            >>> from ampguard.config import validate
            >>> config = validate({"rollback": {"triggers": ["val_regression"], "val_regression": 0.5},
            ...                    "checkpoint": {"every": 5}, "eval": {"every": 5}})
            >>> monitor = RunMonitor()
            >>> guards = Guards(config, monitor, metrics=("val_loss", "val_accuracy"))
            >>> for value in (2.0, 1.0, 1.4, 1.6, float("nan")):
            ...     monitor.observe_eval({"val_loss": value})
            ...     print(guards.val_regression(value))
            None
            None
            None
            val_loss 1.6 > best 1 + 0.5 x 1
            val_loss nan is not finite
        """
        name, best = self.val_metric, self.monitor.eval_best.get(self.val_metric or "")
        if not math.isfinite(value):
            return f"{name} {value:.4g} is not finite"
        if best is None:
            return None
        margin = self.val_threshold * abs(best)
        if self.val_higher:
            return f"{name} {value:.4g} < best {best:.4g} - {self.val_threshold:g} x {abs(best):.4g}" \
                if value < best - margin else None
        return f"{name} {value:.4g} > best {best:.4g} + {self.val_threshold:g} x {abs(best):.4g}" \
            if value > best + margin else None


def rollback_reach(config: Config, step: int) -> int | None:
    """The newest step whose checkpoint a rollback decided after ``step`` may return to, when a
    trigger looks back (``None`` for none: a loss spike returns to the newest checkpoint before
    it): ``skip_guard`` returns before the first of the ``monitor.fail_after`` steps its guard
    failed on, ``val_regression`` to the evaluation before the one that regressed. The pruning
    keeps that checkpoint and the ones after it beside the newest ``checkpoint.keep`` (with
    ``checkpoint.every`` 5, keep 3 and ``fail_after`` 20 the skip guard found none left to roll
    back to): up to ``fail_after / checkpoint.every + 1`` of them.

    Example::

        >>> from ampguard.config import validate
        >>> both = validate({"rollback": {"triggers": ["skip_guard", "val_regression"]}, "checkpoint": {"every": 5},
        ...                  "eval": {"every": 20}, "monitor": {"fail_after": 30, "fail_rate": 0.5}})
        >>> rollback_reach(both, 45), rollback_reach(both, 60), rollback_reach(validate({}), 60)
        (15, 30, None)
    """
    reach = []
    if SKIP_GUARD in config.rollback.triggers:  # a failure at this step: bad from step - fail_after + 1 on, back to before it
        reach.append(step - config.monitor.fail_after)
    if VAL_REGRESSION in config.rollback.triggers and config.eval.every > 0:  # (an evaluation at this step too)
        reach.append((step - 1) // config.eval.every * config.eval.every)
    return min(reach) if reach else None


def check_val_metric(config: Config, metrics: tuple[str, ...]) -> str | None:
    """The metric the ``val_regression`` trigger watches (None when the trigger is off); a task
    without held-out metrics, or a ``rollback.val_metric`` it does not report, is one
    :class:`~ampguard.errors.ConfigError` line.

    Example::

        >>> from ampguard.config import validate
        >>> on = {"rollback": {"triggers": ["val_regression"]}, "checkpoint": {"every": 5}, "eval": {"every": 5}}
        >>> check_val_metric(validate(on), ("val_loss", "val_accuracy")), check_val_metric(validate({}), ())
        ('val_loss', None)
        >>> check_val_metric(validate({**on, "rollback": {**on["rollback"], "val_metric": "val_f1"}}), ("val_loss",))
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: rollback.val_metric: the task reports val_loss, not 'val_f1'
        >>> check_val_metric(validate({**on, "rollback": {**on["rollback"], "val_metric": "val_thing"}}), ("val_thing",))
        Traceback (most recent call last):
        ...
        ampguard.errors.ConfigError: config: rollback.val_mode: is val_thing better higher or lower? its name does not say: set rollback.val_mode to max or min
    """
    if VAL_REGRESSION not in config.rollback.triggers:
        return None
    if not metrics:
        raise ConfigError("config: rollback.triggers: val_regression needs held-out metrics, and this task reports none")
    name = config.rollback.val_metric or metrics[0]
    if name not in metrics:
        raise ConfigError(f"config: rollback.val_metric: the task reports {', '.join(metrics)}, not {name!r}")
    if config.rollback.val_mode == "auto" and metric_direction(name) is None:  # a wrong guess rolls back on gains
        raise ConfigError(f"config: rollback.val_mode: is {name} better higher or lower? its name does not say: set "
                          "rollback.val_mode to max or min")
    return name


def _keep_base(evidence: Path, checkpoint: Path) -> Path | None:
    """The checkpoint a rollback returned to, kept beside its evidence as
    ``rollback/step-N.checkpoint.pt`` (a hard link: no space; a copy where the file system has
    none): ``ampguard locate --batch rollback/step-N.pt --checkpoint rollback/step-N.checkpoint.pt``
    replays the batches on those weights after the pruning has deleted the checkpoint itself.
    None (said nowhere else) when neither can be made: the evidence stands without it.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "step-00000010.pt").write_bytes(b"weights")
        >>> (folder / "rollback").mkdir()
        >>> kept = _keep_base(folder / "rollback" / "step-15.pt", folder / "step-00000010.pt")
        >>> kept.name, kept.read_bytes()
        ('step-15.checkpoint.pt', b'weights')
    """
    base = evidence.with_name(f"{evidence.stem}.checkpoint.pt")
    with temporary_beside(base) as tmp:  # (linked or copied whole, then renamed: never half a file by its name)
        tmp.unlink(missing_ok=True)  # (a kill's leftover of this process id)
        try:
            try:
                os.link(checkpoint, tmp)
            except OSError:
                shutil.copyfile(checkpoint, tmp)
            os.replace(tmp, base)
        except OSError:
            return None
    return base


class TriggerBatches:
    """The evidence a rollback keeps: references to the open group's micro-batches and the loss
    scale they run with, and the last skipped group's (what tripped a skip-rate guard). Nothing
    is copied or read on the host while training; only a rollback copies them to the CPU
    (:meth:`payload`). Built only when ``rollback.triggers`` is set.

    Example (fp16, a NaN batch: the skipped group is kept; the next clean group replaces the open one)::

        >>> import torch
        >>> from ampguard.step import AmpTrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
        ...                       precision="fp16")
        >>> kept = TriggerBatches(state)
        >>> for x in (torch.full((4, 2), float("nan")), torch.ones(4, 2)):
        ...     kept.capture((x, torch.zeros(4, 1)))
        ...     kept.closed(state.step(x, torch.zeros(4, 1)))
        >>> data = kept.payload(2, LOSS_SPIKE, "loss spike")
        >>> data["step"], data["loss_scale"], len(data["micro_batches"]), bool(data["micro_batches"][0]["inputs"].isnan().any())
        (2, 32768.0, 1, False)
        >>> data = kept.payload(2, SKIP_GUARD, "skip-rate guard")  # the skipped step's batch
        >>> data["step"], data["loss_scale"], bool(data["micro_batches"][0]["inputs"].isnan().any())
        (1, 65536.0, True)
    """

    def __init__(self, state: AmpTrainState) -> None:
        self.state = state
        self.group: list[tuple[Any, Any]] = []
        self.scale: Any = 1.0
        self.last: tuple[int, list[tuple[Any, Any]], Any] | None = None  # the closed group
        self.last_skipped: tuple[int, list[tuple[Any, Any]], Any] | None = None

    def capture(self, batch: tuple[Any, Any]) -> None:
        """Call before the step takes ``batch`` (a reference is kept; the scale is a device copy)."""
        if not self.state.mid_group:
            self.group, self.scale = [], self.state.scaler.scale_value()
        self.group.append(batch)

    def closed(self, record: StepRecord) -> None:
        """Call with the record of the step that closed the group."""
        self.last = (record.step, self.group, self.scale)
        if record.skipped:
            self.last_skipped = self.last

    def payload(self, step: int, kind: str, why: str) -> dict[str, Any] | None:
        """What ``rollback/step-N.pt`` holds, on the CPU: the triggering step's micro-batches (a
        skip-rate guard's: the last skipped step's), its loss scale, step, kind and why; None
        when nothing was kept (a skip-rate guard's skipped steps all ran before a resume: the
        triggering step's own batch was saved, an applied one with nothing wrong in it), and for a
        held-out regression (no training batch triggered it; the event names the data positions
        passed over)."""
        from torch.utils._pytree import tree_map

        if kind == VAL_REGRESSION:  # judged on held-out data: no training batch is the trigger
            return None
        kept = self.last_skipped if kind == SKIP_GUARD else self.last
        if kept is None:
            return None
        batch_step, group, scale = kept
        cpu = lambda value: tree_map(lambda t: t.detach().cpu() if hasattr(t, "detach") else t, value)  # noqa: E731
        return {"micro_batches": [{"inputs": cpu(x), "targets": cpu(y)} for x, y in group],
                "loss_scale": float(scale), "step": batch_step, "rollback_step": step, "kind": kind, "why": why,
                "precision": self.state.precision.name}


def _used_up(allowed: int) -> str:
    """Why a rollback trigger stops the run instead: ``rollback.max`` said, as words.

    Example::

        >>> [_used_up(n) for n in (0, 1, 3)]
        ['no rollback allowed (rollback.max 0)', 'the one rollback (rollback.max) is used up', 'all 3 rollbacks (rollback.max) are used up']
    """
    if allowed == 0:
        return "no rollback allowed (rollback.max 0)"
    return "the one rollback (rollback.max) is used up" if allowed == 1 else \
        f"all {allowed} rollbacks (rollback.max) are used up"


def restart_scale(monitor: RunMonitor, scaler: torch.amp.GradScaler) -> None:
    """Tell ``monitor`` the loss scale the next step runs with where the trainer set it, not the
    step before (:meth:`~ampguard.monitor.RunMonitor.scale_restarted`): a rollback's checkpoint's,
    a resume's (a new ``scaler.init_scale``). Nothing for a run without a loss scaler."""
    if scaler.is_enabled():
        monitor.scale_restarted(float(scale_in_use(scaler)))


class Rollbacks:
    """Carries out :class:`Rollback` decisions and keeps their log (a checkpointed part).

    A rollback first saves the batches that triggered it (``rollback/step-N.pt`` in the run
    folder, from :class:`TriggerBatches`), then reloads the model, optimizer, scheduler, scaler
    and RNGs from the newest checkpoint before the trouble, keeps the step counter and the
    monitors' history (but the monitor's count of applied updates becomes the checkpoint's: the
    updates after it were undone), seeks the data ``rollback.skip_batches`` micro-batches past
    the checkpoint's position but never before the end of the triggering step's micro-batches
    (so the batch that triggered it is skipped even when the checkpoint is further back than
    ``skip_batches``), sets the learning rate to ``optimizer.lr x rollback.lr_factor ** n`` (n
    rollbacks so far; only when ``lr_factor`` is not 1), and restarts the rolling windows.
    After ``rollback.max`` of them the next one is a :class:`Stop`.

    Example (a run whose targets are multiplied by 1e8 at step 5: the loss spike rolls it back
    to its checkpoint of step 4, and the run goes on to finish)::

        >>> import shutil, tempfile
        >>> from pathlib import Path
        >>> from ampguard.config import validate
        >>> from ampguard.run_folder import RunPaths
        >>> from ampguard.train import run
        >>> folder = Path(tempfile.mkdtemp())
        >>> config = validate({"task": {"name": "linear"}, "steps": 6, "precision": "bf16", "device": "cpu",
        ...                    "inject": ["spike@5"], "checkpoint": {"every": 2},
        ...                    "rollback": {"triggers": ["loss_spike"], "window": 3, "skip_batches": 1},
        ...                    "log": {"dir": str(folder), "name": "a"}})
        >>> lines = []
        >>> result = run(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=1, print_fn=lines.append)
        >>> [" ".join(line.split()[:2]) for line in lines]
        ['STEP 1', 'STEP 2', 'STEP 3', 'STEP 4', 'STEP 5', 'ROLLBACK 5', 'STEP 6', 'EVAL 6']
        >>> result.ended, result.rollbacks  # doctest: +ELLIPSIS
        ('finished: 6 steps', ['step 5: loss spike (... > mean + 6 std): rolled back to step-00000004.pt (step 4); ...'])
        >>> shutil.rmtree(folder)
    """

    def __init__(self, config: Config, checkpointer: CheckpointManager, state: AmpTrainState, data: DataStream,
                 monitor: RunMonitor, spikes: LossSpikeDetector | None, events: EventLog | None = None) -> None:
        self.cfg = config.rollback
        self.checkpointer, self.state, self.data = checkpointer, state, data
        self.monitor, self.spikes, self.events = monitor, spikes, events
        self.log: list[str] = []
        self.config = config
        self.policy: list[dict[str, Any]] = []
        """Policy changes made on resume ({key, old, new, step}); re-applied over a checkpoint older than them."""
        self.evidence: TriggerBatches | None = None
        """The batches to keep as evidence (set by the Trainer when rollbacks are on)."""
        self.folder: Path | None = None
        """The run folder; evidence goes to its ``rollback/`` (None: not saved, e.g. other ranks)."""

    def apply(self, decision: Rollback) -> Decision:
        """Carry out ``decision``: :data:`CONTINUE` once rolled back, or a :class:`Stop` when
        ``rollback.max`` is used up or no checkpoint from before ``first_bad_step`` loads. The
        checkpoint is loaded to the CPU and copied onto the model's device.

        Example::

            >>> import shutil, tempfile, torch
            >>> from pathlib import Path
            >>> from ampguard.config import validate
            >>> from ampguard.run_folder import RunPaths
            >>> from ampguard.trainer import Trainer
            >>> folder = Path(tempfile.mkdtemp())
            >>> config = validate({"task": {"name": "linear"}, "steps": 6, "precision": "bf16", "device": "cpu",
            ...                    "checkpoint": {"every": 2}, "log": {"dir": str(folder), "name": "a"},
            ...                    "rollback": {"triggers": ["loss_spike"], "skip_batches": 1}})
            >>> lines = []
            >>> trainer = Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=1,
            ...                   stats_every=None, print_fn=lines.append, progress=False, resume=None)
            >>> trainer._open()  # run() does this: the run folder, its checkpoints/ and the event log
            >>> for step in (1, 2, 3):  # a checkpoint at step 2
            ...     if trainer.save_due(trainer.train_step().step):
            ...         trainer.save()
            ...     if step == 2:
            ...         weights = trainer.task.model.weight.detach().clone()
            >>> trainer.rollbacks.apply(Rollback(3, "loss spike", LOSS_SPIKE))
            Continue()
            >>> trainer.state.steps, trainer.data.position, torch.equal(trainer.task.model.weight, weights)
            (3, 3, True)
            >>> lines  # doctest: +NORMALIZE_WHITESPACE
            ['ROLLBACK 3 loss spike: rolled back to step-00000002.pt (step 2); the data goes on at position 3,
              1 batch past the checkpoint (at 2); batches saved to rollback/step-3.pt (their weights:
              rollback/step-3.checkpoint.pt)']
            >>> trainer.monitor.updates, trainer.state.updates  # step 3's update was undone
            (2, 2)
            >>> sorted(p.name for p in (folder / "a" / "rollback").iterdir())
            ['step-3.checkpoint.pt', 'step-3.pt']
            >>> stop = trainer.rollbacks.apply(Rollback(2, "loss spike", LOSS_SPIKE))  # nothing saved before step 2
            >>> type(stop).__name__, stop.kind, int(stop.exit_code)
            ('Stop', 'no_checkpoint', 3)
            >>> trainer.sinks.close(); trainer.events.close(); shutil.rmtree(folder)
        """
        step = self.state.steps
        # a spike's or a regression's update is in the model now: the run that stops keeps no checkpoint
        # of it (the newest, which a --resume took and trained on from, held the spiked weights)
        unsaved = decision.kind in (LOSS_SPIKE, VAL_REGRESSION)

        def kept() -> str:  # (and those saved since the trouble began: a val_regression's, from the
            # evaluation before; the newest of them was what --resume went on from: review 51j)
            if not unsaved:
                return ""
            aside = self.checkpointer.set_aside_after(decision.first_bad_step - 1) if self.checkpointer else []
            return UNSAVED + (f"; {', '.join(p.name for p in aside)}, saved since, set aside (checkpoints/abandoned-*)"
                              if aside else "")

        if len(self.log) >= self.cfg.max:
            return Stop(ExitCode.GUARD, f"stopped at step {step}: {decision.why}; "
                        + _used_up(self.cfg.max) + kept(), ROLLBACKS_USED_UP, unsaved)
        loaded, problem = None, None
        try:
            loaded = self.checkpointer.load(before_step=decision.first_bad_step)
        except InputError as err:
            problem = str(err)
        # every rank rolls back to the same checkpoint, or none does (a rank that could not read
        # it must not leave the others restored and waiting in the next step's collective)
        answers = distributed.all_gather((None if loaded is None else loaded.path.name, problem))
        problem = next((p for _, p in answers if p is not None), None)
        if problem is None and len({name for name, _ in answers}) > 1:
            problem = f"the ranks found different checkpoints ({', '.join(str(name) for name, _ in answers)})"
        if problem is not None or loaded is None:
            return Stop(ExitCode.GUARD, f"stopped at step {step}: {decision.why}; cannot roll back: {problem}{kept()}",
                        NO_CHECKPOINT, unsaved)
        evidence = self._save_evidence(step, decision)  # before anything goes back
        # the step counter and the monitors' history go on; everything that trains goes back
        state = {**loaded.payload[STATE], "step": step, "monitors": {}}
        self.checkpointer.restore(Loaded(loaded.path, {**loaded.payload, STATE: state}), parts=ROLLBACK_PARTS)
        lrs_from_schedule(self.state.optimizer, self.state.scheduler)  # (a fast-path checkpoint's: the last step's)
        # the checkpoints after it hold the steps undone (a spike's model): a later rollback, or a
        # --resume RUN_DIR, took the newest before its step and went back into them. Rank 0 moves
        # them to checkpoints/abandoned-*/ once every rank has loaded (the gather above)
        undone_saves = self.checkpointer.set_aside_after(loaded.step)
        # the checkpoint brings its own settings back: the resume's policy changes newer than it are
        # applied again and the LR comes down by rollback.lr_factor, in one pass (one set_base_lr)
        stale = [c for c in self.policy if c["step"] >= loaded.step and c["key"] != "scaler.init_scale"]
        lr = apply_policy_changes(stale, self.config, self.state, len(self.log) + 1, rolled_back=True)
        # the run card's "updates applied", final loss and held-out metrics are the model's it holds
        undone = self.monitor.rolled_back(self.state.updates, (loaded.payload[STATE].get("monitors") or {}).get("run"),
                                          skip_guard=decision.kind == SKIP_GUARD)
        restart_scale(self.monitor, self.state.scaler)  # (the checkpoint's scale: the next step runs with it)
        old, saved = self.data.position, int(loaded.payload[DATA])
        # never back onto the triggering step's own micro-batches (they end at the current position)
        self.data.seek(max(saved + self.cfg.skip_batches, old))
        message = (f"{decision.why}: rolled back to {loaded.path.name} (step {loaded.step}); the data goes on at "
                   f"position {self.data.position}, {counted(self.data.position - saved, 'batch', 'batches')} past "
                   f"the checkpoint (at {saved})")
        if self.cfg.lr_factor != 1.0 and lr is not None:
            message += f"; lr {lr:.4g} (rollback.lr_factor {self.cfg.lr_factor:g})"
        if undone_saves:
            message += (f"; the undone steps' {', '.join(p.name for p in undone_saves)} set aside "
                        "(checkpoints/abandoned-*)")
        base = _keep_base(evidence, loaded.path) if evidence is not None else None
        if evidence is not None:
            message += f"; batches saved to rollback/{evidence.name}"
            if base is not None:
                message += f" (their weights: rollback/{base.name})"
        elif decision.kind == SKIP_GUARD and self.evidence is not None and self.evidence.last_skipped is None:
            message += "; no batch saved (the skipped steps ran before this process resumed the run)"
        self.log.append(f"step {step}: {message}")
        if self.spikes is not None:  # the window the checkpoint kept: the losses of the model the run keeps
            self.spikes.restore_or_reset((loaded.payload[STATE].get("monitors") or {}).get("loss_spike"))
        if self.events is not None:
            # (data_position: where step + 1 reads; locate --step N after it seeks there, review 58d)
            self.events.emit({"step": step, "event": "rollback", "message": message, "checkpoint": loaded.path.name,
                              "kind": decision.kind, "updates_undone": undone, "data_position": self.data.position,
                              "evidence": f"rollback/{evidence.name}" if evidence is not None else None,
                              "evidence_checkpoint": f"rollback/{base.name}" if base is not None else None},
                             "ROLLBACK")
        return CONTINUE

    def _save_evidence(self, step: int, decision: Rollback) -> Path | None:
        """Rank 0 writes the triggering batches to ``rollback/step-N.pt`` (atomically; a file of
        that name already there, from an earlier pass over this step, is kept: ``step-N-2.pt``).
        Under torchrun they are the global batches: every rank's slice, gathered to rank 0 and
        joined in rank order (the spike may have been in any rank's share); a collective."""
        if self.evidence is None:
            return None
        data = self.evidence.payload(step, decision.kind, decision.why)
        if distributed.current().active:
            parts = distributed.gather_to_main(data)
            data = None if parts is None or data is None else {
                **data, "micro_batches": [distributed.join_slices(group) for group in
                                          zip(*(part["micro_batches"] for part in parts))]}
        if data is None or self.folder is None:  # (only rank 0 has a run folder)
            return None
        from .checkpoint import save_checkpoint

        folder = self.folder / "rollback"
        path, n = folder / f"step-{step}.pt", 1
        while os.path.lexists(path):  # (a dangling link's name is not free)
            n += 1
            path = folder / f"step-{step}-{n}.pt"
        folder.mkdir(exist_ok=True)
        return save_checkpoint(path, data)

    def state_dict(self) -> list[str]:
        """The rollback log, one line per rollback (a copy): a checkpoint carries it, so a resumed
        run still counts the rollbacks spent against ``rollback.max``.

        Example::

            >>> from ampguard.config import Config
            >>> rollbacks = Rollbacks(Config(), None, None, None, None, None)
            >>> rollbacks.log.append("step 9: loss spike: rolled back to step-00000008.pt (step 8)")
            >>> saved = rollbacks.state_dict()
            >>> saved == rollbacks.log and saved is not rollbacks.log
            True
        """
        return list(self.log)

    def load_state_dict(self, log: list[str]) -> None:
        """Take the log back from a checkpoint (a copy of it).

        Example (``rollback.max`` is 1 and the resumed run has used it: the next one stops)::

            >>> import torch
            >>> from ampguard.config import validate
            >>> from ampguard.monitor import RunMonitor
            >>> from ampguard.step import AmpTrainState
            >>> config = validate({"rollback": {"max": 1}})
            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
            ...                       precision="fp32")
            >>> rollbacks = Rollbacks(config, None, state, None, RunMonitor(), None)
            >>> rollbacks.load_state_dict(["step 9: loss spike: rolled back to step-00000008.pt (step 8)"])
            >>> rollbacks.apply(Rollback(12, "loss spike", LOSS_SPIKE)).kind
            'rollbacks_used_up'
        """
        self.log = list(log)


class FirstSkipDiagnosis:
    """Keeps the open group's micro-batches and, at the first skipped step, replays them to find
    the first non-finite value (:func:`ampguard.locate.diagnose_group`). Fed (:meth:`capture`,
    :meth:`after`) only when ``diagnose.first_skip`` or ``diagnose.strict`` is on: otherwise it
    costs nothing and only keeps what an earlier part of the run found (``state_dict``).

    Example (two micro-batches a step; the second carries a NaN)::

        >>> import torch
        >>> from ampguard.step import AmpTrainState
        >>> model = torch.nn.Linear(2, 1)
        >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
        ...                       precision="bf16", accumulation_steps=2)
        >>> diagnosis = FirstSkipDiagnosis(state, model)
        >>> for batch in [(torch.ones(4, 2), torch.zeros(4, 1)), (torch.full((4, 2), float("nan")), torch.zeros(4, 1))]:
        ...     diagnosis.capture(batch)
        ...     record = state.step(*batch)
        >>> print(diagnosis.after(record))
        step 1 (non_finite_loss): first nan under bf16 in micro-batch 2 of 2: in the input batch. FP32 replay is not
        finite either: a data or model problem, not a precision one
    """

    def __init__(self, state: AmpTrainState, model: Any, events: EventLog | None = None,
                 injected: Callable[[int], list[str]] | None = None) -> None:
        self.state, self.model, self.events = state, model, events
        self.injected = injected  # the faults this rank injects at a step: the replay injects them again
        self.group: list[tuple[Any, Any]] = []
        self.scale: Any = 1.0  # the loss scale the open group runs with
        self.rng: list[Any] = []  # torch's RNG state as each micro-batch of the open group began
        self.keeping = True  # whether the open group is kept (capture): a replay may read it
        self.found: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """The finding, saved with the monitors (``state.monitors``): a resumed run's card still
        names the run's first skip, and a later skip is not taken for the first.

        Example::

            >>> import torch
            >>> from ampguard.step import AmpTrainState
            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
            >>> a, b = FirstSkipDiagnosis(state, model), FirstSkipDiagnosis(state, model)
            >>> a.found = "step 3 (non_finite_grad): first inf under fp16: in fc1"
            >>> b.load_state_dict(a.state_dict()); b.found
            'step 3 (non_finite_grad): first inf under fp16: in fc1'
            >>> b.load_state_dict({"found": 3})
            Traceback (most recent call last):
            ...
            ValueError: first_skip.found must be a string or None, got int
        """
        return {"found": self.found}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        found = state.get("found")
        if found is not None and not isinstance(found, str):
            raise ValueError(f"first_skip.found must be a string or None, got {type(found).__name__}")
        self.found = found

    def capture(self, batch: tuple[Any, Any], fresh: bool = False) -> None:
        """Call before the step takes ``batch``: keeps the group's batches, the loss scale they
        run with (a device copy, no host read) and torch's RNG state as each begins (a host copy
        of the generators' states, a few us: the replay draws the step's dropout masks).

        Only while a replay may read them: before the first finding, or with ``fresh`` (strict
        mode: :meth:`after` diagnoses every skip). Review 53h: after the first finding every
        micro-batch of the run was still kept, the scale copied, the RNG read, for no reader.
        Decided as a group begins, so a group is kept whole or not at all.

        Example (fp16 on two weights: a skipped step halves the scale, the next group keeps the new one)::

            >>> import torch
            >>> from ampguard.step import AmpTrainState
            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
            ...                       precision="fp16")
            >>> diagnosis = FirstSkipDiagnosis(state, model)
            >>> bad = (torch.full((4, 2), float("nan")), torch.zeros(4, 1))
            >>> diagnosis.capture(bad)
            >>> state.step(*bad).skipped, diagnosis.group == [bad], float(diagnosis.scale)
            (True, True, 65536.0)
            >>> diagnosis.capture((torch.ones(4, 2), torch.zeros(4, 1)))
            >>> len(diagnosis.group), float(diagnosis.scale)  # a new group
            (1, 32768.0)
        """
        if not self.state.mid_group:
            self.keeping = fresh or self.found is None
            self.group, self.scale, self.rng = [], self.state.scaler.scale_value() if self.keeping else 1.0, []
        if self.keeping:
            self.group.append(batch)
            self.rng.append(torch_rng_state())  # (the replay draws the dropout masks the step draws for it)

    def after(self, record: StepRecord, fresh: bool = False) -> str | None:
        """The finding for the run's first skipped step (None before it, and for clean steps).

        At the first skipped step it replays the group (:func:`ampguard.locate.diagnose_group`:
        host syncs, once a run); later skips repeat that finding without a replay. ``fresh``
        (strict mode, whose stop is about this step): a later skip is diagnosed too, its own
        finding returned and said, the first one's kept (a resumed run's first skip may be an
        earlier part's).

        Example::

            >>> import torch
            >>> from ampguard.step import AmpTrainState
            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
            ...                       precision="bf16")
            >>> diagnosis = FirstSkipDiagnosis(state, model)
            >>> def step(x):
            ...     diagnosis.capture((x, torch.zeros(4, 1)))
            ...     return diagnosis.after(state.step(x, torch.zeros(4, 1)))
            >>> nan, inf = torch.full((4, 2), float("nan")), torch.full((4, 2), float("inf"))
            >>> step(torch.ones(4, 2)) is None, step(nan)[:42], step(inf)[:42], step(torch.ones(4, 2))
            (True, 'step 2 (non_finite_loss): first nan under ', 'step 2 (non_finite_loss): first nan under ', None)
        """
        if not record.skipped:
            return None
        if self.found is not None and (not fresh or self.found.startswith(f"step {record.step} (")):
            return self.found
        if any(distributed.is_sharded(m) for m in self.model.modules()):
            return self._not_replayed(record)
        from .locate import diagnose_group

        # (a model compiled in place, compile: true, is replayed eagerly: diagnose's own doing)
        # (the scaler's floor: an overflow that stays there is no routine back-off; the replay runs at it)
        floor = float(self.state.scaler.get_min_scale()) if self.state.scaler.is_enabled() else None
        failed = None
        try:  # (a collective of the user's code in a replay is refused: ranks replay different numbers of passes)
            with distributed.no_collectives():
                result = diagnose_group(self.model, self.state.loss_fn, self.group, self.state.precision,
                                        float(self.scale), accumulation_steps=self.state.accumulation_steps,
                                        rng=self.rng, scale_floor=floor)
        except Exception as err:  # noqa: BLE001 - a diagnostic: a model its replay cannot run ends no run (review 49i)
            result, failed = None, first_line(err, with_type=True)
        if result is not None and self.injected is not None:  # (an injected fault fires in the FP32 replay too)
            result.injected = self.injected(record.step)
        if result is not None and self.state.scaler.is_enabled():  # (at its floor the scaler cannot halve)
            result.scale_floor = float(self.state.scaler.get_min_scale())
        # under torchrun the value was born on one rank's share: each rank replays its own, and
        # the first rank that found a non-finite value is the finding of every rank; a replay that
        # failed on a rank is said by every rank when no rank found one (review 49j: rank 0 said
        # "none on any rank" while the faulted rank's replay had failed)
        findings, failures = zip(*distributed.all_gather((result, failed)))
        rank = next((r for r, found in enumerate(findings) if found is not None and found.verdict != "none"), None)
        if rank is None and any(failures):
            ranks: dict[str, list[str]] = {}
            for r, why in enumerate(failures):
                if why:
                    ranks.setdefault(why, []).append(str(r))
            where = [why if len(failures) == 1 else f"rank{'s' * (len(rs) > 1)} {', '.join(rs)}: {why}"
                     for why, rs in ranks.items()]
            failed_on = [r for r, why in enumerate(failures) if why] if len(failures) > 1 else None
            return self._not_replayed(record, f"its replay failed ({'; '.join(where)})", failed_on)
        result = findings[rank] if result is None else result
        head = tail = ""
        if rank is not None and len(findings) > 1:
            head, result = f" on rank {rank}", findings[rank]
        elif len(findings) > 1:
            tail = f" on any of the {len(findings)} ranks"
            result.amp.loss = None  # (this rank's share of the step's loss would read as the step's)
        found = f"step {record.step} ({record.reason}){head}: {result.message()}{tail}"
        self.found = self.found or found
        if self.events is not None:
            extra = {"rank": rank} if len(findings) > 1 else {}
            self.events.emit({"step": record.step, "event": "diagnosis", **result.as_dict(), **extra,
                              "message": found}, "DIAGNOSIS")
        return found

    def _not_replayed(self, record: StepRecord, why: str | None = None, ranks: list[int] | None = None) -> str:
        """What :meth:`after` says for a model FSDP2 shards: every forward of it gathers the ranks'
        shards, a collective, and each rank's replays (one pass on a clean rank, three or more on
        the rank that found a value) would not pair up: a crash or a hang. Every rank says the same,
        with no replay. ``why``: another reason it was not (a replay that raised); ``ranks``: under
        several, the ranks whose replay raised (the event's ``ranks``, as a finding's ``rank``).

        Example::

            >>> import torch
            >>> from ampguard.step import AmpTrainState
            >>> from ampguard.records import SkipLog
            >>> model = torch.nn.Linear(2, 1)
            >>> state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
            >>> skip = SkipLog(step=4, lr=0.1, loss=2.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
            ...                scaler_scale=1.0, reason="non_finite_grad")
            >>> print(FirstSkipDiagnosis(state, model)._not_replayed(skip))
            step 4 (non_finite_grad): not replayed: under FSDP2 every forward gathers the ranks' shards (a collective),
            and each rank's replays would not pair up; `ampguard locate --step 4 --checkpoint <one saved before it>`
            replays the step's batch in one process
        """
        why = why or ("under FSDP2 every forward gathers the ranks' shards (a collective), and each rank's replays "
                      "would not pair up")
        found = (f"step {record.step} ({record.reason}): not replayed: {why}; `ampguard locate --step "
                 f"{record.step} --checkpoint <one saved before it>` replays the step's batch in one process")
        self.found = self.found or found
        if self.events is not None:
            extra = {"ranks": ranks} if ranks is not None else {}
            self.events.emit({"step": record.step, "event": "diagnosis", "verdict": "not replayed", **extra,
                              "message": found}, "DIAGNOSIS")
        return found
