"""The run's guards and what they decide: go on, roll back, or stop, as typed values.

After each step the loop asks :meth:`Guards.check` for a :data:`Decision`:

- :class:`Continue`;
- :class:`Rollback` (``first_bad_step``, why, ``kind``: :data:`LOSS_SPIKE` or :data:`SKIP_GUARD`),
  carried out by :class:`Rollbacks`, which may turn it into a stop (no checkpoint to return to,
  ``rollback.max`` used up);
- :class:`Stop` (an :class:`~ampguard.errors.ExitCode`, why, ``kind``: the monitor's failure
  cause, :data:`STRICT`, :data:`ROLLBACKS_USED_UP`, :data:`NO_CHECKPOINT`, :data:`INTERRUPTED`,
  :data:`DISK_FULL`).

Under torchrun every decision is the same on every rank at the same step: the guards read
values the step's all-reduce already agreed on, a rollback goes ahead only when every rank
loaded the same checkpoint, and the first-skip diagnosis gathers each rank's finding.

Nothing is decided by matching message text: a guard's ``kind`` says which guard it was.
The first-skip diagnosis (:class:`FirstSkipDiagnosis`) lives here too: strict mode stops with
its finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from . import distributed
from .checkpointer import DATA, ROLLBACK_PARTS, STATE, CheckpointManager, Loaded
from .config import Config
from .errors import ExitCode, InputError
from .monitor import FAIL_SKIP_RATE, LossSpikeDetector, RunMonitor
from .records import StepRecord

if TYPE_CHECKING:
    from .data import DataStream
    from .events import EventLog
    from .step import AmpTrainState

LOSS_SPIKE = "loss_spike"
SKIP_GUARD = "skip_guard"
STRICT = "strict"
ROLLBACKS_USED_UP = "rollbacks_used_up"
NO_CHECKPOINT = "no_checkpoint"
INTERRUPTED = "interrupted"
DISK_FULL = "disk_full"


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
    """End the run with ``exit_code``; ``why`` is what the run card and the console say."""

    exit_code: ExitCode
    why: str
    kind: str


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

    def __init__(self, config: Config, monitor: RunMonitor, spikes: LossSpikeDetector | None = None) -> None:
        self.monitor = monitor
        self.spikes = spikes
        self.strict = config.diagnose.strict
        self.triggers = set(config.rollback.triggers)
        self.z = config.rollback.z
        self.fail_after = config.monitor.fail_after

    def check(self, record: StepRecord, diagnosis: str | None = None) -> Decision:
        """The decision after ``record`` (already observed by the monitor)."""
        if record.skipped and self.strict:
            which = "loss" if record.reason == "non_finite_loss" else "gradient"
            return Stop(ExitCode.GUARD, f"strict mode: non-finite {which} at step {record.step}: {diagnosis}", STRICT)
        if self.spikes is not None and not record.skipped:
            loss = self.monitor.last.get("loss")
            if self.spikes.check(loss):
                return Rollback(record.step, f"loss spike ({loss:.4g} > mean + {self.z:g} std)", LOSS_SPIKE)
        failed = self.monitor.failed
        if failed is None:
            return CONTINUE
        if failed.cause == FAIL_SKIP_RATE and SKIP_GUARD in self.triggers:
            return Rollback(record.step - self.fail_after + 1, f"skip-rate guard: {failed.message}", SKIP_GUARD)
        return Stop(ExitCode.GUARD, f"stopped by the guard at step {record.step}: {failed.message}", failed.cause)


class Rollbacks:
    """Carries out :class:`Rollback` decisions and keeps their log (a checkpointed part).

    A rollback reloads the model, optimizer, scheduler, scaler and RNGs from the newest
    checkpoint before the trouble, keeps the step counter and the monitors' history, seeks the
    data ``rollback.skip_batches`` micro-batches past the checkpoint's position, and restarts the
    rolling windows. After ``rollback.max`` of them the next one is a :class:`Stop`.

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
        ('finished: 6 steps', ['step 5: loss spike (... > mean + 6 std): rolled back to step-00000004.pt (step 4) ...'])
        >>> shutil.rmtree(folder)
    """

    def __init__(self, config: Config, checkpointer: CheckpointManager, state: AmpTrainState, data: DataStream,
                 monitor: RunMonitor, spikes: LossSpikeDetector | None, events: EventLog | None = None) -> None:
        self.cfg = config.rollback
        self.checkpointer, self.state, self.data = checkpointer, state, data
        self.monitor, self.spikes, self.events = monitor, spikes, events
        self.log: list[str] = []

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
            ...     trainer.maybe_save(trainer.train_step().step)
            ...     if step == 2:
            ...         weights = trainer.task.model.weight.detach().clone()
            >>> trainer.rollbacks.apply(Rollback(3, "loss spike", LOSS_SPIKE))
            Continue()
            >>> trainer.state.steps, trainer.data.position, torch.equal(trainer.task.model.weight, weights)
            (3, 3, True)
            >>> lines  # doctest: +NORMALIZE_WHITESPACE
            ['ROLLBACK 3 loss spike: rolled back to step-00000002.pt (step 2) and skipped 1 batches
              (data position 3 -> 3)']
            >>> stop = trainer.rollbacks.apply(Rollback(2, "loss spike", LOSS_SPIKE))  # nothing saved before step 2
            >>> type(stop).__name__, stop.kind, int(stop.exit_code)
            ('Stop', 'no_checkpoint', 3)
            >>> trainer.sinks.close(); trainer.events.close(); shutil.rmtree(folder)
        """
        step = self.state.steps
        if len(self.log) >= self.cfg.max:
            return Stop(ExitCode.GUARD, f"stopped at step {step}: {decision.why}; all {self.cfg.max} rollbacks "
                        "(rollback.max) are used up", ROLLBACKS_USED_UP)
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
            return Stop(ExitCode.GUARD, f"stopped at step {step}: {decision.why}; cannot roll back: {problem}",
                        NO_CHECKPOINT)
        # the step counter and the monitors' history go on; everything that trains goes back
        state = {**loaded.payload[STATE], "step": step, "monitors": {}}
        self.checkpointer.restore(Loaded(loaded.path, {**loaded.payload, STATE: state}), parts=ROLLBACK_PARTS)
        old = self.data.position
        self.data.seek(int(loaded.payload[DATA]) + self.cfg.skip_batches)
        message = (f"{decision.why}: rolled back to {loaded.path.name} (step {loaded.step}) and skipped "
                   f"{self.cfg.skip_batches} batches (data position {old} -> {self.data.position})")
        self.log.append(f"step {step}: {message}")
        self.monitor.restart_windows()
        if self.spikes is not None:
            self.spikes.reset()
        if self.events is not None:
            self.events.emit({"step": step, "event": "rollback", "message": message, "checkpoint": loaded.path.name},
                             "ROLLBACK")
        return CONTINUE

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
    the first non-finite value (:func:`ampguard.locate.diagnose_group`). Built only when
    ``diagnose.first_skip`` or ``diagnose.strict`` is on: otherwise it costs nothing.

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
        step 1 (non_finite_loss): first nan under bf16: in the input batch. FP32 replay is not finite either: a data
        or model problem, not a precision one
    """

    def __init__(self, state: AmpTrainState, model: Any, events: EventLog | None = None) -> None:
        self.state, self.model, self.events = state, model, events
        self.group: list[tuple[Any, Any]] = []
        self.scale: Any = 1.0  # the loss scale the open group runs with
        self.found: str | None = None

    def capture(self, batch: tuple[Any, Any]) -> None:
        """Call before the step takes ``batch``: keeps the group's batches and the loss scale they
        run with (a device copy, no host read).

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
            self.group, self.scale = [], self.state.scaler.scale_value()
        self.group.append(batch)

    def after(self, record: StepRecord) -> str | None:
        """The finding for the run's first skipped step (None before it, and for clean steps).

        At the first skipped step it replays the group (:func:`ampguard.locate.diagnose_group`:
        host syncs, once a run); later skips repeat that finding without a replay.

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
        if not record.skipped or self.found is not None:
            return self.found if record.skipped else None
        from .locate import diagnose_group

        result = diagnose_group(self.model, self.state.loss_fn, self.group, self.state.precision, float(self.scale))
        # under torchrun the value was born on one rank's share: each rank replays its own, and
        # the first rank that found a non-finite value is the finding of every rank
        findings = distributed.all_gather(result)
        rank = next((r for r, found in enumerate(findings) if found.verdict != "none"), None)
        head = tail = ""
        if rank is not None and len(findings) > 1:
            head, result = f" on rank {rank}", findings[rank]
        elif len(findings) > 1:
            tail = f" on any of the {len(findings)} ranks"
        self.found = f"step {record.step} ({record.reason}){head}: {result.message()}{tail}"
        if self.events is not None:
            extra = {"rank": rank} if len(findings) > 1 else {}
            self.events.emit({"step": record.step, "event": "diagnosis", **result.as_dict(), **extra,
                              "message": self.found}, "DIAGNOSIS")
        return self.found
