"""The Hugging Face ``Trainer`` under ampguard: ``GuardedTrainer`` and ``AmpGuardCallback``.

Needs the ``transformers`` extra (``pip install 'ampguard[transformers]'``: transformers 5.19 or
newer, :data:`TRANSFORMERS_FLOOR`), imported when this module is; ``GuardedTrainer`` refuses an
older one when it is built (:func:`missing_seams`).

A callback cannot guard a Trainer step: it runs after the backward (it cannot keep a NaN loss
from seeding it), after HF's clipping (the pre-clip norm is gone) and it cannot veto the optimizer
step. So the guard is a ``Trainer`` subclass, and the callback is what writes and watches:

- :class:`GuardedTrainer` does the AMP itself (Accelerate is told ``mixed_precision="no"``):
  ``training_step`` runs the model's forward under :meth:`Guard.autocast` with its outputs handed
  back in float32 (what Accelerate does to the stock Trainer's forward: a loss computed outside
  the forward is computed as there), then ``Guard.backward``; the group's last micro-batch closes
  with ``Guard.step()`` (unscale, global norm, one host read, skip or clip + step,
  ``scaler.update()``). The Trainer's own clip returns the guard's pre-clip norm, its
  ``optimizer.step()`` after the guard's does nothing (an optimizer with state of its own per
  step, schedule-free's, or a step hook, would count a second step) and its scheduler is held on
  a skip through Accelerate's own signal, ``optimizer_step_was_skipped``.
- :class:`AmpGuardCallback` writes one CSV row per optimizer step (the 8 contract columns), feeds
  a :class:`RunMonitor` (the skip-rate ALERT, fail-fast), writes ``events.jsonl`` and, at the
  end, ``summary.json``; on a failure it sets ``control.should_training_stop`` with the reason
  written out. On a stock ``Trainer`` (no guard) it only reads what the Trainer exposes (see
  :meth:`AmpGuardCallback.on_pre_optimizer_step`) and warns so when training begins
  (:class:`WatchOnlyWarning`).

HF checkpoints carry the guard: ``GuardedTrainer`` writes ``ampguard_state.json`` (the guard's
scaler and counters, the callback's monitor) into each ``checkpoint-N`` folder, where HF saves
its own AMP scaler, and ``train(resume_from_checkpoint=...)`` restores it: the steps go on at
N + 1 and the CSV continues after row N.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import convert_to_fp32
from transformers import Trainer, TrainerCallback

from .. import distributed
from ..clipping import global_l2_norm
from ..errors import (AmpguardWarning, ExitCode, InputError, called_by_user, counted, first_line, folder_problem,
                      shortened, table_cell, unwritable)
from ..events import EventLog, event_word
from ..files import replace_atomically
from ..monitor import AT_THE_END, DEFAULT_MIN_STEPS, FAIL_NON_FINITE_UPDATE, Event, RunMonitor
from ..precision import Precision, check_scaler_settings, loss_scaler_runs, take_over_stock_scale
from ..records import SkipLog, StepLog, StepRecord, non_finite_at, non_finite_back, numbers_back, strict_json
from ..signals import Interrupted, StopFlag, console_line, stop_on_signals
from ..sinks import CsvSink, Sink, aside_taken_back, newly_lost, set_aside
from ..step import Frozen, Guard, SchedulerOnSkip, check_settings, holds_gradients
from ..watch import first_forward_dtypes, float32_layers_text, note_autocast_inside
from .accelerate import _inner, found_inf

__all__ = ["AmpGuardCallback", "GuardedTrainer", "WatchOnlyWarning"]

CSV_NAME, EVENTS_NAME, SUMMARY_NAME, CARD_NAME = "steps.csv", "events.jsonl", "summary.json", "RUN.md"
STOCK_FLOOR = 1.0
"""The floor the callback's monitor gives a stock Trainer's GradScaler, which has none: ``ampguard
train``'s default ``scaler.min_scale``."""
STATE_NAME = "ampguard_state.json"  # in each HF checkpoint-N folder: the guard's and the monitor's state
WATCH_ONLY = ("AmpGuardCallback on a stock Trainer only watches (no loss check before backward, no pre-clip norm: "
              "the CSV's loss and grad_l2_pre_clip stay empty): use ampguard.integrations.transformers."
              "GuardedTrainer(..., ampguard=...) to guard the step")
TRANSFORMERS_FLOOR = "5.19"
"""The oldest transformers whose ``Trainer`` has every seam in :data:`TRAINER_SEAMS` (pyproject's
``transformers`` extra says the same): 5.18 has no ``loss_is_scaled_for_ga``, 4.57 neither
``_build_accelerator_args``, ``_clip_grad_norm`` nor ``_get_grad_norm``."""
TRAINER_SEAMS = ("loss_is_scaled_for_ga", "_build_accelerator_args", "_clip_grad_norm", "_get_grad_norm",
                 "_save_scaler", "_load_scaler", "_report_to_hp_search", "_inner_training_loop", "get_batch_samples",
                 "training_step", "prediction_step", "compute_loss_context_manager", "_prepare_inputs", "log")
"""What :class:`GuardedTrainer` overrides or reads on HF's ``Trainer`` class. A name an older
``Trainer`` lacks is not an error there: ``loss_is_scaled_for_ga`` was an ``AttributeError`` at
the first step, but an override HF never calls is silent (4.57: no ``_build_accelerator_args``,
so Accelerate autocast a second time; no ``_clip_grad_norm``, so HF clipped gradients the guard
had dropped and logged ``grad_norm`` 0.0). Checked when the trainer is built (review 53c)."""
TWO_CALLBACKS = ("two AmpGuardCallbacks in one Trainer: each would write its own rows into the same steps.csv; "
                 "give one (GuardedTrainer: as ampguard= or in callbacks=, not both)")


class WatchOnlyWarning(AmpguardWarning):
    """:class:`AmpGuardCallback` was added to a stock ``Trainer``: it watches the steps, it does
    not guard them (warned when training begins, on process 0). Where watching is all you want:
    ``warnings.filterwarnings("ignore", category=WatchOnlyWarning)`` (or ``category=AmpguardWarning``
    for all of ampguard's warnings).

    Example::

        >>> from ampguard.errors import AmpguardWarning
        >>> issubclass(WatchOnlyWarning, AmpguardWarning), issubclass(WatchOnlyWarning, UserWarning)  # shown by default
        (True, True)
    """


def run_card(summary: dict[str, Any]) -> str:
    """``RUN.md``: what a teammate reads first about a Trainer run, from ``summary.json``'s fields
    (``ampguard report DIR/steps.csv`` draws its plot).

    Example::

        >>> card = run_card({"ended": "finished: 20 steps", "exit_code": 0, "steps": 20, "updates": 19,
        ...                  "skips": {"non_finite_grad": 1}, "max_skip_rate": 0.05, "alert_episodes": 0,
        ...                  "clip_rate": 0.9, "scale": "stable", "final_scale": 512.0, "guarded": True})
        >>> print(card.splitlines()[5]); print(card.splitlines()[7])
        | steps / updates applied | 20 / 19 |
        | skipped steps | 1 (non_finite_grad 1) |

    A resume without ampguard's state that raised before its first step (the monitor began
    after step 6: ``unobserved``) observed no step, and says so::

        >>> card = run_card({"ended": "crashed after step 6", "exit_code": 1, "steps": 6, "updates": 0,
        ...                  "unobserved": 6, "clip_rate": 0.0, "guarded": True}).splitlines()
        >>> card[5].split("; ")[-1], card[10]
        ('no step after it was observed) |', '| clip rate | n/a (no step observed) |')
    """
    skips = summary.get("skips") or {}
    unseen = summary.get("unobserved") or 0  # (a resume without the monitor's state: RunMonitor.begin_at)
    steps = summary.get("steps") or 0
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(skips.items())) or "none"
    scale = summary.get("final_scale")
    # steps 1..unseen are not counted, whether or not steps.csv holds their rows (a stock Trainer's resume in
    # its own out_dir: the train() before wrote them): `ampguard report` leaves them out too (summary.json's
    # `unobserved`). It said "not observed" of rows the CSV showed, and "cover steps 7 to 6" when none came
    counted = (f"the counts and rates here cover steps {unseen + 1} to {steps}" if steps > unseen
               else "no step after it was observed")
    clip = summary.get("clip_rate")
    rows = [
        ("ended", f"{summary.get('ended')} (exit {summary.get('exit_code')})"),
        ("steps / updates applied", f"{summary.get('steps')} / {summary.get('updates')}" + (
            f" (steps 1 to {unseen} not counted: resumed from a checkpoint without ampguard's state, the monitor "
            f"observed from step {unseen + 1}, as `ampguard report` counts; {counted})" if unseen else "")),
        ("guarded", "yes: GuardedTrainer (the step skipped, the schedule held)" if summary.get("guarded")
         else "watched only: a stock Trainer with the callback"),
        ("skipped steps", f"{sum(skips.values())} ({reasons})"),
        ("max rolling skip rate", f"{summary.get('max_skip_rate', 0):.4g}"),
        ("skip-rate alert episodes", str(summary.get("alert_episodes"))),
        # (a stock Trainer shows a callback no pre-clip norm: its 0 was no measure; `ampguard report` said n/a)
        ("clip rate", "n/a (no step observed)" if unseen and steps <= unseen
         else "n/a (a stock Trainer shows the callback no pre-clip norm)" if summary.get("guarded") is False
         else "n/a" if clip is None else f"{clip:.3g}"),
        ("loss scale", "n/a" if scale is None else f"{scale:g} at the end ({summary.get('scale') or 'no scaler'})"),
        *((("float32 under autocast", summary["float32_under_autocast"]),) if "float32_under_autocast" in summary
          else ()),
        ("files", f"`{CSV_NAME}` (one row per optimizer step), `{EVENTS_NAME}`, `{SUMMARY_NAME}`"),
    ]
    lines = ["# ampguard run card (Hugging Face Trainer)", "", "| | |", "|---|---|"]
    # (a `|` in a module's name or the error that ended the run escaped: it cut the cell, review 56d)
    return "\n".join(lines + [f"| {table_cell(k)} | {table_cell(v)} |" for k, v in rows]) + "\n"
GUARD_EXIT_CODE = int(ExitCode.GUARD)  # what `ampguard train` exits with when a guard stops a run


def precision_of(args: Any) -> str:
    """The ampguard precision a ``TrainingArguments`` asks for.

    Example::

        >>> from types import SimpleNamespace
        >>> precision_of(SimpleNamespace(fp16=True, bf16=False)), precision_of(SimpleNamespace(fp16=False, bf16=False))
        ('fp16', 'fp32')
    """
    return "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"


def _state_numbers_back(saved: Any) -> Any:
    """An ``ampguard_state.json`` as read, each ``"inf"``/``"-inf"``/``"nan"`` string
    :func:`~ampguard.records.strict_json` wrote for a non-finite float read back as the float: at
    the places its ``non_finite`` lists (:func:`~ampguard.records.non_finite_at`: a skipped step's
    inf gradient norm, a monitor of yours on the guard whose ``best`` is inf; a string of yours
    stays a string), taken out of the state. A state written before those places were kept
    (review 56l) has them read back in the two fields of the monitor's state whose values are
    numbers alone, its last record and held-out metrics; one written with ``Infinity`` reads as it did.

    Example::

        >>> _state_numbers_back({"guard": {"monitors": {"best": {"best": "inf", "name": "inf"}}},
        ...                      "non_finite": [["guard", "monitors", "best", "best"]]})
        {'guard': {'monitors': {'best': {'best': inf, 'name': 'inf'}}}}
        >>> _state_numbers_back({"guard": {}, "monitor": {"last": {"loss": "nan"}, "eval_last": {"acc": 0.5}}})
        {'guard': {}, 'monitor': {'last': {'loss': nan}, 'eval_last': {'acc': 0.5}}}
    """
    if isinstance(saved, dict) and "non_finite" in saved:
        return non_finite_back(saved, saved.pop("non_finite"))
    monitor = saved.get("monitor") if isinstance(saved, dict) else None
    if isinstance(monitor, dict):
        saved["monitor"] = {**monitor, **{k: numbers_back(monitor[k]) for k in ("last", "eval_last") if k in monitor}}
    return saved


class AmpGuardCallback(TrainerCallback):
    """Per-step CSV, skip-rate alert and fail-fast for a Hugging Face ``Trainer``.

    Files (process 0 only) go to ``out_dir`` (default ``<args.output_dir>/ampguard``):
    ``steps.csv`` (one row per optimizer step, ``step`` being HF's ``global_step``),
    ``events.jsonl`` (alerts, the failure, a resume, the end) and ``summary.json`` (the
    monitor's counts, ``ended``, ``exit_code``: 0, or 3 when a guard stopped the run; under
    :class:`GuardedTrainer` also 130 for a Ctrl-C and 1 for an error that ended ``train()``,
    what the process then exits with; ``unobserved``: the steps before a resume from a
    checkpoint without ampguard's state, left out of the counts, as ``ampguard report`` leaves
    them out). An existing ``steps.csv`` is
    refused, never overwritten, except by a resume (``train(resume_from_checkpoint=...)``),
    which appends after the checkpoint's step. Process 0's refusals of its files and their
    folder are raised on every process alike, before HF's loop (the others never look at them).

    With :class:`GuardedTrainer` (which adds one of these if none is given) every row is the
    guard's record: loss, pre- and post-clip norm, scale, skips with their reason. On a stock
    ``Trainer`` it reads what a callback can (see :meth:`on_pre_optimizer_step`), and says so
    when training begins: one :class:`WatchOnlyWarning`.

    Args:
        out_dir: where the files go (a leading ``~`` is the home folder, as in HF's ``output_dir``;
            one process 0 cannot make or write in is refused when ``train()`` begins, before
            anything trains); a hyperparameter search's trial (``trainer.hyperparameter_search``,
            ``train(trial=...)``) writes its own in ``<out_dir>/<run name>``, HF's name for the
            trial's run folder (``run-<trial number>``, or your ``hp_name``; a stock ``Trainer``
            does not tell a callback the trial's number: ``hp_name`` there, else the first free
            ``run-<N>``).
        window, alert_rate, clear_rate, fail_rate, fail_after, min_steps: :class:`RunMonitor`'s settings;
            ``fail_rate=None`` (default) turns fail-fast off.
        print_fn: where ``ALERT``/``CLEAR``/``FAIL`` lines go (by default stdout, kept off HF's live
            progress bar as HF's own log lines are: :func:`~ampguard.signals.console_line`).
        sinks: more sinks for each step's record (process 0 writes them): a ``WandbSink`` or
            ``MLflowSink`` also gets the monitor's view of each step, and at the end of ``train()``
            the totals, the files above as artifacts, and its run ended with :attr:`exit_code`.
            They serve one ``train()`` (their runs end with it): a later one is refused them. Or a
            function of HF's ``TrainerState`` that gives each ``train()`` its own, each trial of a
            hyperparameter search among them (``state.trial_name``, ``state.trial_params``,
            ``state.is_world_process_zero``), called once the callback's files are open.

    Example (the callback's monitor without a Trainer)::

        >>> cb = AmpGuardCallback(fail_rate=0.5, fail_after=2)
        >>> cb.fail_rate, cb.failed, cb.exit_code
        (0.5, None, 0)
    """

    def __init__(self, out_dir: str | Path | None = None, *, window: int = 1000, alert_rate: float = 0.05,
                 clear_rate: float | None = None, fail_rate: float | None = None, fail_after: int = 100,
                 min_steps: int = DEFAULT_MIN_STEPS, print_fn: Any = console_line,
                 sinks: Sequence[Sink] | Callable[[Any], Sequence[Sink]] = ()) -> None:
        RunMonitor(window=window, alert_rate=alert_rate, clear_rate=clear_rate, fail_rate=fail_rate,
                   fail_after=fail_after, min_steps=min_steps)  # bad settings fail here, not at the first step
        # ("~/guard" is the home folder's, as Hugging Face's own output_dir: it was ./~/guard)
        self.out_dir = Path(os.path.expanduser(out_dir)) if out_dir is not None else None
        if self.out_dir is not None:  # (a file there failed only in train(), with mkdir's raw FileExistsError)
            _check_out_dir(self.out_dir)
        self._home = self.out_dir  # the folder given: a trial's files go in a folder of their own in it
        self._trial: str | None = None  # GuardedTrainer: HF's run folder name for the trial train() runs (run-N)
        self._began = True  # GuardedTrainer: this train()'s on_train_begin ran (for_trial sets it back)
        self._reporting = False  # GuardedTrainer: HF is reporting to the search (an on_train_end now: pruned)
        self.window, self.alert_rate, self.clear_rate, self.fail_rate = window, alert_rate, clear_rate, fail_rate
        self.fail_after, self.min_steps, self.print_fn = fail_after, min_steps, print_fn
        if not callable(print_fn):  # (print_fn=None trained every step, then crashed at the first line said)
            raise TypeError(f"AmpGuardCallback(print_fn=...) must be a function of one line, like print; got "
                            f"{type(print_fn).__name__}")
        if isinstance(sinks, (str, bytes)) or not (callable(sinks) or isinstance(sinks, Iterable)):
            raise TypeError("AmpGuardCallback(sinks=...) takes a list of ampguard sinks (CsvSink, MLflowSink, "
                            f"WandbSink, ...) or a function of the Trainer's state returning one; got {sinks!r} (HF's "
                            "report_to names trackers: give the sink itself, e.g. sinks=[MLflowSink()])")
        self.sinks = sinks if callable(sinks) else _checked_sinks(list(sinks))
        self._closed: list[Sink] = []  # the sinks a train()'s end closed: a later train() refuses them
        self.monitor: RunMonitor | None = None
        self.failed = None  # the monitor's failure Event, once a guard stopped the run
        self.ended = ""
        self._csv: CsvSink | None = None
        self._events: EventLog | None = None
        self._pending: StepRecord | None = None  # GuardedTrainer's last record (written at take()): a group closed
        self._guarded = False
        self._scaler: dict[str, float] | None = None  # the loss scaler's init_scale, floor and growth interval, if any
        self._watch: dict[str, Any] = {}  # stock Trainer: what on_pre_optimizer_step saw
        self._noting: contextlib.ExitStack | None = None  # stock Trainer: the first forward's dtype hooks, open
        # a resume: (the checkpoint's step, its monitor state or None, the checkpoint's name, its logged counts,
        # the loss scale a stock checkpoint's scaler.pt gave the guard or None, what the resume event says of the scale)
        self._resume: tuple[int, dict[str, Any] | None, str, dict[str, Any] | None, float | None, str] | None = None
        self.crash: BaseException | None = None  # the error that ended train(), if one did (GuardedTrainer)
        self._ended = False  # run_end and summary.json written
        self._attempt_open = False  # a train()'s files opened, not ended yet (on every process alike)
        self._batch: int | None = None  # the train batch size of this train()'s last attempt (auto_find_batch_size)
        self._given: list[Sink] = []  # the sinks this train() was given (every process: refused to a later one)
        self._serving: list[Sink] = []  # those it writes and its end ends (process 0's)
        self._told_lost: list[Sink] = []  # the tracker sinks lost that events.jsonl names (tracker_lost)
        self._logged_skips = 0  # the monitor's skips at HF's last training log (add_to_log)
        self._logged_steps = 0  # and its steps there: the final log adds keys only for steps after it
        self._stop: StopFlag | None = None  # GuardedTrainer: its train()'s stop signals (SIGINT, SIGTERM)
        self._stop_told = False  # control.should_training_stop set for self.failed
        self._stopping = False  # GuardedTrainer: a stop signal taken at a step's end (_stop_at_step_end)
        self._fresh: list[Path] = []  # the files this train()'s on_train_begin created (withdrawn on a refusal)
        self._poisoned: str | None = None  # stock Trainer: the step being written made the weights non-finite

    @property
    def exit_code(self) -> int:
        """0; 3 (``ExitCode.GUARD``) once a guard stopped the run (on a stock ``Trainer`` also
        when an update it applied made the weights non-finite); 130 after a Ctrl-C, 143 after a
        SIGTERM and 1 after an error that ended ``train()`` (seen by :class:`GuardedTrainer`)."""
        if self.failed is not None:
            return GUARD_EXIT_CODE
        if self.crash is not None:  # (an Interrupted carries its signal's code: 143 for SIGTERM)
            return int(getattr(self.crash, "exit_code", ExitCode.INTERRUPTED)) \
                if isinstance(self.crash, KeyboardInterrupt) else 1
        return 0

    # ---------------------------------------------------------------- fed by GuardedTrainer

    def attach(self, scaler: dict[str, float] | None) -> None:
        """Called by :class:`GuardedTrainer`: the guard's loss scaler (``init_scale``, ``min_scale``,
        ``growth_interval``) or ``None`` without one (bf16, fp32)."""
        self._guarded = True
        self._scaler = scaler

    autocast_dtypes: dict[str, str] | None = None
    """Each leaf module's output dtype in the first training forward under autocast (the run
    card's "float32 under autocast"): set by :class:`GuardedTrainer` from its guard; on a stock
    ``Trainer`` noted by the callback itself around the first micro-batch (:meth:`on_step_begin`)."""

    def take(self, record: StepRecord) -> None:
        """The guard's record of the step that just closed (called by :class:`GuardedTrainer`),
        written at once: the step is applied (or skipped) already, so its row is kept whatever
        ends ``train()`` before HF's ``on_step_end`` (another callback's Ctrl-C there, a signal).
        A second stop signal waits until the row and the monitor's events are written."""
        self._guarded = True
        self._pending = record  # (on_pre_optimizer_step: a guarded step closed this group)
        stop = self._stop
        if stop is not None:
            stop.holding = True
        try:
            self._write(record)
        finally:
            if stop is not None:
                stop.release()  # (a second signal that waited interrupts now)

    def resume(self, step: int, monitor_state: dict[str, Any] | None, source: str,
               logged: dict[str, Any] | None = None, *, scale: float | None = None, scale_note: str = "") -> None:
        """Called by :class:`GuardedTrainer` before ``on_train_begin`` of a resumed run: the
        checkpoint's ``step``, the monitor's state saved with it (``None`` in a checkpoint
        without ampguard's state), the checkpoint's name and :meth:`logged_state` as saved. The
        monitor goes on from that state and the files append: rows after ``step`` (an abandoned
        future) are cut first. Without the monitor's state it observes from step ``step + 1``
        (:meth:`RunMonitor.begin_at`: its counts and judgement cover the steps it saw), its
        scale health from ``scale`` (the loss scale the guard goes on from, when not
        ``init_scale``); ``scale_note`` is what the resume event says of the loss scale."""
        self._resume = (step, monitor_state, source, logged, scale, scale_note)

    def logged_state(self) -> dict[str, int]:
        """The monitor's skips and steps at HF's last training log (:meth:`add_to_log`), saved with
        a checkpoint: the first log after a resume counts its skips from there, so the skips
        between that log and the checkpoint reach a log (they were in the CSV only)."""
        return {"skips": self._logged_skips, "steps": self._logged_steps}

    def for_trial(self, name: str | None) -> None:
        """Called by :class:`GuardedTrainer` before ``train()``: HF's name for the run folder of
        the hyperparameter-search trial it runs (``run-3``), the name of the callback's folder
        for it; ``None`` outside a search."""
        self._trial = name
        self._began = False  # (this train()'s on_train_begin has not run yet)

    def crashed(self, error: BaseException) -> None:
        """``train()`` ended with ``error`` (called by :class:`GuardedTrainer`): ``run_end``,
        ``summary.json`` and ``RUN.md`` still say how far the run got and why it ended. Nothing
        once they are written, or before the files were opened; :attr:`exit_code` says it all the
        same (a Ctrl-C or SIGTERM in a fresh run's first step left it 0: a preempted job that
        reported success, and was never requeued)."""
        if self.monitor is None or self._ended or not self._began:
            if self.monitor is None or not self._began:  # (before this train() opened a
                # file: a checkpoint refused, a signal at start-up; a second train()'s kept the first's 0)
                self.crash, self.failed = error, None
            return
        if not self.monitor.steps and self._fresh:  # (a first step's refusal: frozen="ignore" asked for, ...)
            self._withdraw()
            self.crash = error
            error.add_note("ampguard: no step was recorded, so the files this train() made are taken back: a "
                           "corrected train() starts afresh in the same folder")
            return
        self.crash = error
        if isinstance(error, Interrupted):  # a stop signal taken up at a boundary: "interrupted (SIGTERM)"
            self.ended = self.ended or f"{error} after step {self.monitor.steps}"
        elif isinstance(error, KeyboardInterrupt):
            self.ended = self.ended or f"interrupted after step {self.monitor.steps}"
        else:
            self.ended = self.ended or f"crashed after step {self.monitor.steps}: {first_line(error, with_type=True)}"
        try:
            self._finish()
        except Exception as later:  # noqa: BLE001 - train() raises its own error; this is a note on it
            error.add_note(f"ampguard: ending the callback's files or sinks raised too: {later!r}")

    # ---------------------------------------------------------------- Trainer events

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a second ``AmpGuardCallback`` in the Trainer (``Trainer(callbacks=[a, b])``, or
        one instance twice) while the Trainer is built, before anything is written: HF calls each
        callback's ``on_init_end`` with the Trainer's one ``TrainerControl``, which notes them. One
        a :class:`GuardedTrainer` took already is refused too (another Trainer's first step failed
        with GuardedTrainer's "training_step is overridden" error: each Trainer its own callback)."""
        if self._guarded:  # (a GuardedTrainer given it again sets this back before it is built)
            raise ValueError("AmpGuardCallback: this callback belongs to a GuardedTrainer already (its records, "
                             "monitor and files are that trainer's): give a stock Trainer its own AmpGuardCallback()")
        _one_per_trainer(control, self)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # a second AmpGuardCallback added after the Trainer was built (trainer.add_callback): the
        # first one opened this train()'s files already; it takes them back, then this one refuses
        _one_per_trainer(state, self, withdraw=True)
        self._began = True
        self._stop_told, self._stopping = False, False
        resume, self._resume = self._resume, None  # (taken first: a refusal below leaves none to a later train())
        # HF's auto_find_batch_size begins the loop again, with a smaller batch, after an out-of-memory:
        # the files this train() opened are still open (no run_end); they go on from the new attempt's
        # first step (a fresh run refused its own CSV as "already exists"), the attempt before's rows
        # after it kept aside (HF keeps its weights and optimizer state: those updates are in them)
        # (no run_end: the last attempt's files still open on process 0; told alike on every process, from
        # an attempt that got past its refusals and has not ended, reviews 48f and 48g)
        still_open = self._attempt_open
        retry = still_open and bool(getattr(args, "auto_find_batch_size", False)) and (
            (state.train_batch_size or 0) < (self._batch or 0) or resume is not None)
        if resume is None and not retry and not self._guarded and state.global_step > 0:
            # a stock Trainer resuming (train(resume_from_checkpoint=...): HF loaded the checkpoint's state
            # before this; a fresh train() starts at 0): the files append after its step, the monitor
            # counts from here (a stock Trainer's checkpoint holds no ampguard state); it was refused
            # as "steps.csv already exists"
            resume = (state.global_step, None, "", None, None, "")
        if self.monitor is not None and not self._ended and not retry:
            if not self.monitor.steps and self._fresh:  # (the train() before raised before its first
                self._withdraw()                        # row, unseen: its files go, as after a crash seen)
            else:
                self._end_unseen()
        self._fresh = []  # (the files this train() makes; the train() before's read just above)
        if not callable(self.sinks):  # (before anything is trained: the first step would fail on them)
            self._refuse_closed(self.sinks)
        folder = None
        # process 0's verdict on its folder, raised on every process alike (the others never look at it;
        # a collective: the callback is on every process, as the Trainer it is given to is, review 48g)
        with distributed.refused_on_every_rank():
            if state.is_world_process_zero:  # the folder of the files: a retry goes on in its train()'s; a
                # hyperparameter search's trial has one of its own
                home = self._home or Path(args.output_dir) / "ampguard"
                folder = self.out_dir if retry and self.out_dir is not None else home if state.trial_params is None \
                    else _trial_folder(home, self._trial or state.trial_name)
                # refused in one line before anything is made or trained (the default <output_dir>/ampguard,
                # never checked, raised mkdir's raw FileExistsError when it was a file; /proc/ampguard as root,
                # a folder under a read-only one, passed and raised mkdir's raw error): errors.unwritable, as
                # the Lightning plugin's csv= and log.wandb.dir are judged
                problem = unwritable(folder)
                if problem is not None:
                    raise InputError(f"AmpGuardCallback(out_dir=...): {problem}" if self._home is not None else
                                     f"AmpGuardCallback: {problem} (the callback's default out_dir, "
                                     f"<output_dir>/ampguard); give AmpGuardCallback(out_dir=...) a folder")
        if not self._guarded and state.is_world_process_zero:  # said where a HF user looks, not only in RUN.md
            warnings.warn(WATCH_ONLY, WatchOnlyWarning)
        if not self._guarded:  # (each attempt's first forward, each train()'s; one that raised left its hooks open)
            self._stop_noting(abandoned=True)
            self.autocast_dtypes = None
        if self._scaler is None and not self._guarded:  # a stock Trainer: Accelerate's scaler, if any
            scaler = _scaler_of(kwargs.get("optimizer"))
            if scaler is not None and scaler.is_enabled():
                # a plain GradScaler has no floor: the monitor takes ampguard's default one, 1.0 (a scale
                # at or below it is a collapse: scale_alert), which also ends the opening search it sets aside
                self._scaler = {"init_scale": float(scaler.get_scale()), "min_scale": STOCK_FLOOR,
                                "growth_interval": scaler.get_growth_interval()}
        monitor = RunMonitor(
            window=self.window, alert_rate=self.alert_rate, clear_rate=self.clear_rate, fail_rate=self.fail_rate,
            fail_after=self.fail_after,
            max_norm=args.max_grad_norm, scaler_enabled=self._scaler is not None,
            init_scale=resume[4] if resume is not None and resume[4] is not None  # (a stock scaler.pt's)
            else (self._scaler or {}).get("init_scale"),
            min_scale=(self._scaler or {}).get("min_scale", 1.0),
            growth_interval=(self._scaler or {}).get("growth_interval"),
            min_steps=self.min_steps)
        self._batch = state.train_batch_size
        if resume is not None and resume[1] is not None:  # before any file changes: a state that does not fit is refused
            try:
                monitor.load_state_dict(resume[1])
            except (ValueError, KeyError, TypeError) as err:
                raise InputError(f"{resume[2]}/{STATE_NAME}: the monitor's state does not fit this callback: "
                                 f"{first_line(err)}") from None
        taken_over = resume[4] if resume is not None else None  # (a stock scaler.pt's scale, taken over)
        if (resume is None or resume[1] is None) and (state.global_step > 0 or taken_over is not None):
            # no monitor state for steps 1..N (a stock Trainer's checkpoint, GuardedTrainer's save_only_model one):
            # the monitor observes from N + 1, and its counts, rates and the end's judgement cover the steps it
            # sees (it took N as seen: "steps / updates 8 / 3" with no skip, 2 all-skipped steps judged as 2/40);
            # its opening search starts from the scale taken over (review 55f: the end said "from init_scale")
            monitor.begin_at(state.global_step, taken_over=taken_over)
        self.monitor, self.failed, self.crash, self.ended, self._ended = monitor, None, None, "", False
        # a resume's counts at its run's last log before the checkpoint (an older state has none: all logged)
        self._logged_skips, self._logged_steps = sum(monitor.skips.values()), monitor.steps
        logged = resume[3] if resume is not None else None
        if logged is not None:
            try:
                skips, steps = logged["skips"], logged["steps"]
                fits = all(type(n) is int for n in (skips, steps)) and 0 <= skips <= self._logged_skips \
                    and 0 <= steps <= self._logged_steps
            except (KeyError, TypeError):
                fits = False
            if not fits:
                raise InputError(f"{resume[2]}/{STATE_NAME}: its logged counts {logged!r} do not fit its monitor's "
                                 f"({self._logged_skips} skips in {self._logged_steps} steps)")
            self._logged_skips, self._logged_steps = skips, steps
        if still_open:  # (a train() a stock Trainer ended with an error, unseen, left them open too)
            for sink in (self._csv, self._events):
                if sink is not None:
                    sink.close()
            self._csv = self._events = None
        kept, had_csv = None, True
        # process 0's refusal of its files ("steps.csv already exists", a header a resume cannot append
        # to) raised on every process alike, as the folder's above
        with distributed.refused_on_every_rank():
            if folder is not None:  # (process 0's)
                folder.mkdir(parents=True, exist_ok=True)
                had_csv = (folder / CSV_NAME).exists()  # (a resume's rows go on after its rows, or begin here)
                if retry:
                    kept = set_aside(folder / CSV_NAME, state.global_step, header=True)
                # a resume appends (the CSV cut after the checkpoint's step); a fresh run refuses an existing file
                goes_on = resume is not None or retry
                with aside_taken_back(kept, folder / CSV_NAME, state.global_step):  # (a cut that fails: the rows
                    # set aside not left in both files; one made all the same keeps them in the copy, and says so)
                    self._csv = CsvSink(folder / CSV_NAME, append=goes_on, again=retry, keep_through=resume[0]
                                        if resume is not None else state.global_step if retry else None)
                # (each once made: a file refused as "already exists" is the user's, never taken back)
                if not goes_on:
                    self._fresh.append(folder / CSV_NAME)
                try:
                    self._events = EventLog(folder / EVENTS_NAME, self.print_fn, append=goes_on)
                except BaseException:  # ("events.jsonl already exists": the CSV just made is taken back, or
                    # the next run is refused for a file this one wrote, on a stock Trainer that never says it raised)
                    if not goes_on:
                        self._csv.close()
                        (folder / CSV_NAME).unlink(missing_ok=True)
                        self._csv, self._fresh = None, []
                    raise
                if not goes_on:
                    self._fresh.append(folder / EVENTS_NAME)
                self.out_dir = folder
        self._attempt_open = True  # (past the refusals, on every process: an auto_find_batch_size retry goes on)
        if retry:
            aside = f"; its {counted(kept[1], 'row')} moved to {kept[0].name}" if kept is not None else ""
            # the sinks this train() serves hold the abandoned attempt's steps too: each sets them aside as it can
            sinks = [note for sink in self._serving if hasattr(sink, "begin_again")
                     and (note := sink.begin_again(state.global_step)) is not None]
            self._emit({"step": state.global_step, "event": "retry", "message": (
                f"the training loop began again at step {state.global_step} with a train batch size of "
                f"{state.train_batch_size} (auto_find_batch_size, after an out-of-memory); HF keeps the weights "
                f"the attempt before left (and its optimizer state, unless it reloads a checkpoint's){aside}; "
                "the LR schedule and the monitor start afresh" + "".join(f"; {note}" for note in sinks))}, "RETRY")
        # the sinks this train() serves, once its files are open (a train() refused before, "steps.csv
        # already exists", took none: the next one's are not ended for it, nor made)
        if not retry:
            if callable(self.sinks):  # (called on process 0 alone, which logs)
                self._given = list(self.sinks(state)) if state.is_world_process_zero else []
            else:
                self._given = list(self.sinks)
            self._refuse_closed(self._given)
        self._serving = self._given if state.is_world_process_zero else []
        if not state.is_world_process_zero:  # (only process 0 logs: a tracker run made here ends now, said)
            from .trackers import end_unserved

            end_unserved(self._given, args.process_index, "AmpGuardCallback")
        if resume is not None:
            step, saved, source, _, _, scale_note = resume
            unseen = (f"the monitor observes from step {step + 1} (its counts and judgement leave steps 1 to {step} "
                      "out)") if step else "the monitor observes every step (saved before any)"  # (it said "1 to 0")
            if not source:  # (a stock Trainer's)
                source, note = "the checkpoint", (
                    f"; a stock Trainer's checkpoint holds no ampguard state ({STATE_NAME}, GuardedTrainer's): "
                    f"{unseen}")
            else:
                note = "" if saved is not None else (
                    f"; {source} holds no ampguard state ({STATE_NAME}): {scale_note}{unseen}")
            last = self._csv._last if self._csv is not None else step
            if self._csv is not None and (not had_csv or last is None) and step:
                # (no steps.csv to go on, or one with no row: a header a resume that raised before its first row
                # left, or an auto_find_batch_size retry's after a stock checkpoint's resume. Expected of a stock
                # checkpoint; one with ampguard's state wrote its rows somewhere else. It said "rows end at step
                # 0 ... an older or a copied steps.csv?", of none)
                begins = (f"there was no {CSV_NAME} in {self.out_dir} to go on" if not had_csv else
                          f"{CSV_NAME} in {self.out_dir} had no row to go on") + f": its rows begin at step {step + 1}"
                note += f"; {begins}"
                if saved is not None:
                    warnings.warn(f"AmpGuardCallback: {begins} (steps 1 to {step} were written in another "
                                  "out_dir?)", AmpguardWarning, stacklevel=2)
            elif last is not None and last < step:  # (an older or copied steps.csv: its rows would end in a gap, unsaid)
                gap = (f"{CSV_NAME}'s rows end at step {last}, before the checkpoint's {step}: steps {last + 1} to "
                       f"{step} have no row (an older or a copied {CSV_NAME}?)")
                note += f"; {gap}"
                warnings.warn(f"AmpGuardCallback: {gap}", AmpguardWarning, stacklevel=2)
            self._emit({"step": step, "event": "resume", "message": f"resumed from {source} at step {step}{note}"},
                       "RESUME")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """On a stock ``Trainer`` (fp16/bf16): the first group's first micro-batch runs with each
        leaf of the model HF hands callbacks noting its output's dtype
        (``watch.first_forward_dtypes``), closed at that micro-batch's end (:meth:`_stop_noting`):
        the card's "float32 under autocast", as :class:`GuardedTrainer`'s guard notes it."""
        if self._guarded or self.autocast_dtypes is not None or self._noting is not None or not (args.fp16 or args.bf16):
            return
        model = kwargs.get("model")
        if isinstance(model, torch.nn.Module):
            self._noting = contextlib.ExitStack()
            self._noting.enter_context(first_forward_dtypes(model, self))

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_noting()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stopping:  # (HF's epoch-end flags after a stop: the stop's step was saved, no evaluation begins)
            control.should_evaluate = control.should_save = False

    def _stop_at_step_end(self, args: Any, state: Any, control: Any) -> None:
        """:class:`GuardedTrainer`'s stop signal (its ``train()``'s
        :func:`~ampguard.signals.stop_on_signals`), taken at a step's end as ``ampguard train``
        takes one: the Trainer stops after this step, with its checkpoint (``should_save``, unless
        ``save_strategy`` is ``"no"``) and no evaluation begun; :meth:`on_train_end` writes
        ``interrupted (SIGTERM) after step N`` and ``train()`` raises
        :class:`~ampguard.signals.Interrupted` (130 Ctrl-C, 143 SIGTERM). (Raised here, it skipped
        the step's save: HF saves after ``on_step_end``.) Under DDP the ranks agree on it at every
        step's end, so a signal that reached one rank stops them all after the same step. A
        signal during an evaluation waits for its end (and the next step's: raised there, it lost
        the save after it, and under DDP the ranks disagreed); one in the run's last step ends it
        as finished, as ``ampguard train`` does (``train()`` still raises it as it returns). Once
        the stop is taken further signals wait: its checkpoint is written whole."""
        stop = self._stop
        if stop is None or stop.closing or self._stopping or state.global_step >= state.max_steps > 0:
            return
        if distributed.current().active:  # (one tiny all-reduce a step: the ranks stop after the same step, or
            # one would wait in the next step's gradient all-reduce for a peer that left; the highest signal names
            # the exit code, as ampguard train's ranks agree)
            stop.agreed = distributed.highest([int(stop.signal or 0)], args.device)[0] or None
            if stop.agreed is None:
                return
        elif not stop.requested:
            return
        self._stopping = stop.closing = True
        control.should_training_stop, control.should_evaluate = True, False
        if str(getattr(args.save_strategy, "value", args.save_strategy)) != "no":
            control.should_save = True

    def _stop_noting(self, abandoned: bool = False) -> None:
        """Close the first forward's dtype hooks (:meth:`on_step_begin`). ``abandoned``: the
        micro-batch never ended (its ``training_step`` raised: a stock ``Trainer`` tells no
        callback), so its hooks go and the next attempt notes the map afresh."""
        noting, self._noting = self._noting, None
        if noting is None:
            return
        if not abandoned:
            noting.close()
            return
        error = RuntimeError("the training step raised")
        noting.__exit__(type(error), error, None)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Under :class:`GuardedTrainer`: refuse an optimizer step no guarded step closed (a
        ``training_step`` overridden without ``super()``: it trained unguarded and unclipped,
        silently). On a stock ``Trainer`` (no guard): read the skip where it is decided.

        HF has already unscaled and clipped (with ``max_grad_norm > 0``); the optimizer has not
        stepped. The skip is the Accelerate scaler's found-inf (:func:`found_inf`), not
        ``optimizer_step_was_skipped`` (wrong for fused optimizers, accelerate#4242); the norm
        measured here is the post-clip one. The loss and the pre-clip norm are not shown to a
        callback: their cells stay empty. Nothing here can stop a NaN loss's backward or veto
        the step: that takes :class:`GuardedTrainer`.
        """
        if self._guarded:
            if self._pending is None:  # (HF steps the optimizer on gradients no guard saw: refused, not trained)
                raise RuntimeError(
                    "GuardedTrainer: HF is about to step the optimizer, but no guarded step closed this group: "
                    "training_step is overridden without calling super().training_step(model, inputs, "
                    "num_items_in_batch), so nothing checks, clips or skips (and fp16 would not even autocast); "
                    "call it, or train with a stock Trainer")
            if holds_gradients(kwargs["optimizer"]):
                # the guard dropped the group's gradients when it stepped (an applied step's go back
                # on in HF's optimizer.step(), after this: GuardedTrainer._put_back_gradients), so
                # these came after it (an auxiliary loss's backward after super().training_step).
                # Review 53i: since 5eb7128 put them back before the callbacks, a callback that only
                # measured them in place (clip_grad_norm_(params, inf)) was refused here as such a
                # backward; and the line said HF would apply them: its step after the guard's does
                # nothing, and its model.zero_grad() drops them, so that loss would silently not train
                raise RuntimeError(
                    "GuardedTrainer: gradients made after the guarded step (a backward of your own after "
                    "super().training_step(...)) would never be applied: HF's optimizer step after the guard's "
                    "does nothing and HF's model.zero_grad() drops them, so that loss would not train; add it to "
                    "the one compute_loss returns")
            return
        self._stop_noting()
        optimizer = kwargs["optimizer"]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        scaler = _scaler_of(optimizer)
        bad = found_inf(scaler, optimizer) if scaler is not None and scaler.is_enabled() else None
        self._watch = {"lr": optimizer.param_groups[0]["lr"], "post": global_l2_norm(params), "bad": bad}

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """On a stock ``Trainer``: the step just applied (or skipped by Accelerate's scaler) is
        written here, before ``on_step_end``, so that another callback's error or Ctrl-C there
        does not lose its row (HF's ``global_step`` counts it only after this)."""
        if not self._guarded and self._watch:
            self._write(self._watched(kwargs.get("optimizer"), state.global_step + 1))
            self._stop_training(control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The step's end: its row is written already (:meth:`take`, :meth:`on_optimizer_step`;
        here only for a stock step no ``on_optimizer_step`` took); a failure stops the Trainer."""
        if not self._guarded and self._watch:
            self._write(self._watched(kwargs.get("optimizer"), state.global_step))
        self._pending = None
        self._stop_training(control)
        self._stop_at_step_end(args, state, control)

    def _write(self, record: StepRecord | None) -> None:
        """One step's record to the CSV and the sinks (process 0), then to the monitor: its
        events, its failure (and a stock Trainer's non-finite weights, :meth:`_watched`)."""
        if record is None or self.monitor is None:
            return
        sinks = self._serving
        for sink in [self._csv, *sinks] if self._csv is not None else sinks:
            sink.write(record)
        events: list[Any] = self.monitor.observe(record)
        poisoned, self._poisoned = self._poisoned, None
        failed = self.monitor.failed
        if poisoned is not None and failed is None and self.failed is None:
            failed = Event(record.step, "fail", poisoned, cause=FAIL_NON_FINITE_UPDATE)
            events.append(failed)
        self._tell(events, every_step=True)
        if failed is not None and self.failed is None:
            self.failed = failed
            self.ended = f"stopped by a guard at step {record.step}: {failed.message}"

    def _stop_training(self, control: Any) -> None:
        """A failure stops the Trainer at this step (``control.should_training_stop``), once."""
        if self.failed is not None and not self._stop_told and self.monitor is not None:
            self._stop_told = True
            control.should_training_stop = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        """:meth:`add_to_log`: in time for the loggers only where this callback comes before them
        (HF puts ``report_to``'s first; :class:`GuardedTrainer` adds the keys itself first)."""
        if logs is not None:
            self.add_to_log(logs)

    def add_to_log(self, logs: dict[str, Any]) -> None:
        """A training log of HF's (one with ``loss``, and the final one, ``train_runtime``'s) gets
        the guard's view of the steps since the last one, for every ``report_to`` tracker: ``ampguard/skipped`` (how many were skipped),
        ``ampguard/skip_rate`` (the rolling rate over the monitor's window, as the Lightning
        plugin logs it) and ``ampguard/scale`` (the loss scale after the last step; 1.0 without a scaler).
        Once per log: keys already there are left as they are; the final log gets none when no step
        came after the last training log (a tracker would hold a second value at that step)."""
        if self.monitor is None or "ampguard/skipped" in logs or not ("loss" in logs or "train_runtime" in logs):
            return  # (the final log, train_runtime's: the steps after the last training log)
        if "loss" not in logs and self.monitor.steps == self._logged_steps:
            return
        self._logged_steps = self.monitor.steps
        skips = sum(self.monitor.skips.values())
        logs["ampguard/skipped"], self._logged_skips = skips - self._logged_skips, skips
        logs["ampguard/skip_rate"] = self.monitor.skip_rate
        scale = self.monitor.last.get("scaler_scale")
        logs["ampguard/scale"] = 1.0 if scale is None else scale

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_noting()  # (a train() that ended before a micro-batch did)
        if self.monitor is None or self._ended:
            return
        stop = self._stop  # (GuardedTrainer: a stop signal, at a step's end (the ranks' agreed one) or after the last step)
        if stop is not None and self._stopping and self.failed is None:
            self.crash = Interrupted(stop.exit_code)
            self.ended = f"{self.crash} after step {self.monitor.steps}"
            self._finish()
            return
        if self.failed is None:  # a run too short to arm the ALERT or to fail fast is judged whole
            self._tell(self.monitor.at_end(self.monitor.steps))
            if self.monitor.failed is not None:
                self.failed = self.monitor.failed
                self.ended = f"stopped by a guard {AT_THE_END}{self.failed.step}): {self.failed.message}"
        self.ended = self.ended or _ended_by_itself(state, control, self.monitor.steps, pruned=self._reporting)
        self._finish()

    # ---------------------------------------------------------------- helpers

    def _tell(self, events: list[Any], every_step: bool = False) -> None:
        """The monitor's events to the tracker sinks (their view of the monitor with them: each
        step's, ``every_step``, else only with events: ``last_alert``, ``events.<kind>``; a run
        judged at its end had its ALERT or FAIL there alone), then to ``events.jsonl`` and the console."""
        for sink in self._serving if events or every_step else ():
            if hasattr(sink, "observe"):
                sink.observe(self.monitor, events)
        for event in events:
            self._emit(event.as_dict(), event_word(event.kind))
        for why in newly_lost(self._serving, self._told_lost):  # (its warning was the console's line)
            self._emit({"step": self.monitor.steps, "event": "tracker_lost", "message": why}, None)

    def _finish(self) -> None:
        """``run_end``, then close the files and write ``summary.json`` and ``RUN.md`` (process 0);
        the sinks then end with the outcome (:func:`~ampguard.integrations.trackers.end_sinks`)."""
        self._ended, self._attempt_open = True, False
        wrote = self._events is not None  # (process 0: the files, and so the artifacts)
        try:
            self._emit({"step": self.monitor.steps, "event": "run_end", "message": self.ended,
                        "exit_code": self.exit_code}, None)
            if self._csv is not None:
                csv, self._csv = self._csv, None
                csv.close()
            if self._events is not None:
                events, self._events = self._events, None
                events.close()
                m = self.monitor
                summary = {
                    "ended": self.ended, "exit_code": self.exit_code,
                    "cause": self.failed.cause if self.failed else None, "steps": m.steps, "updates": m.updates,
                    "skips": dict(m.skips), "max_skip_rate": m.max_skip_rate, "alert_episodes": m.alert_episodes,
                    # (null where the card says n/a: a stock Trainer shows no pre-clip norm; no step observed)
                    "clip_rate": m.clip_rate if self._guarded is not False and m.observed else None,
                    "scale": m.scale_verdict, "final_scale": m.last.get("scaler_scale"),
                    "summary": m.summary(), "guarded": self._guarded,
                    "unobserved": m.unobserved,  # steps 1..this not in the counts: resumed without ampguard's state
                    # (what the monitor judged by: `ampguard report` of this folder judges by them too)
                    "thresholds": m.thresholds,
                }
                if self.autocast_dtypes:
                    summary["float32_under_autocast"] = float32_layers_text(self.autocast_dtypes)
                # (each replaced whole, never written through a link at its name, as train writes its own: review
                # 55d, a link another user put in a shared out_dir had both written to root's file, or half a card
                # left by a kill)
                # (strict JSON, as every file ampguard writes: a non-finite number as "inf"/"nan", review 56d)
                replace_atomically(self.out_dir / SUMMARY_NAME,
                                   json.dumps(strict_json(summary), indent=2, allow_nan=False) + "\n")
                replace_atomically(self.out_dir / CARD_NAME, run_card(summary))
        finally:  # (a file that fails, a full disk, does not leave the sinks' runs open)
            self._end_sinks(self.exit_code, self.ended, self.out_dir if wrote else None)

    def _refuse_closed(self, sinks: Sequence[Sink]) -> None:
        closed = [s for s in sinks if any(s is c for c in self._closed)]
        if closed:
            raise ValueError(f"AmpGuardCallback: sinks={[type(s).__name__ for s in closed]} were closed when the "
                             f"previous train() with this callback ended (their tracker runs ended with it); give "
                             f"this train() new sinks (callback.sinks = [...]) or a new AmpGuardCallback (for a "
                             f"hyperparameter search, sinks=lambda state: [...] makes each trial its own)")

    def _end_sinks(self, exit_code: int, ended: str, folder: Path | None) -> None:
        """The sinks this ``train()`` was given are closed to a later one (on every process);
        those it served (process 0's) end with the outcome, ``folder``'s files their artifacts."""
        given, self._given = self._given, []
        sinks, self._serving = self._serving, []
        self._closed += given
        if sinks:
            from .trackers import Outcome, end_sinks

            assert self.monitor is not None
            end_sinks(sinks, Outcome(self.monitor, exit_code, ended, folder, self.autocast_dtypes))

    def _end_unseen(self) -> None:
        """The previous ``train()`` ended with neither ``on_train_end`` nor :meth:`crashed` (a
        stock Trainer's ``train()`` raised: a callback is not told): its sinks end now, FAILED with
        exit code 1 (they had stayed open, and this ``train()`` would have logged on into their
        runs); its files are closed below, without ``run_end`` or a summary (what ended it is not
        known here). A failure to end them is a warning: this ``train()`` goes on."""
        self._ended, self._attempt_open = True, False
        assert self.monitor is not None
        try:
            self._end_sinks(1, f"ended after step {self.monitor.steps} by an error the callback was not told of "
                               "(train() raised)", None)
        except Exception as err:  # noqa: BLE001 - the new train() is not stopped by the old one's sinks
            warnings.warn(f"AmpGuardCallback: ending the previous train()'s sinks raised: {err!r}", stacklevel=2)

    def _withdraw(self) -> None:
        """This ``train()``'s ``on_train_begin`` ran, then a second ``AmpGuardCallback`` in the
        same Trainer was refused (:func:`_one_per_trainer`) before any step: the files it
        created are removed (a CSV header, no row: a corrected run would be refused them as
        "already exists"), those it appends to closed as they are, its sinks left unused."""
        for sink in (self._csv, self._events):
            if sink is not None:
                sink.close()
        self._csv = self._events = None
        for path in self._fresh:
            path.unlink(missing_ok=True)
        self._fresh, self._given, self._serving = [], [], []
        self.monitor, self._ended, self._attempt_open = None, True, False

    def _emit(self, event: dict[str, Any], word: str | None) -> None:
        if self._events is not None:
            self._events.emit(event, word)

    def _watched(self, optimizer: Any, step: int) -> StepRecord | None:
        """A stock Trainer's step as a record: skip, lr, post-clip norm, scale; no loss, no pre-clip norm.

        Without a loss scaler (bf16, fp32, or fp16 on a CPU, where Accelerate scales nothing)
        nothing skips: a non-finite gradient is applied, and said so (``non_finite_update``)."""
        seen, self._watch = self._watch, {}
        if not seen:
            return None
        scaler = _scaler_of(optimizer)
        scaled = scaler is not None and scaler.is_enabled()
        # the norm, the found-inf flag and the scale after update() come to the host in one read
        tensors = [seen["post"], *([seen["bad"]] if seen["bad"] is not None else []),
                   *([scaler._scale] if scaled and scaler._scale is not None else [])]
        post, *rest = torch.stack([t.detach().reshape(()).to(tensors[0].device, torch.float64)
                                   for t in tensors]).tolist()
        bad = rest.pop(0) if seen["bad"] is not None else 0.0
        scale = rest[0] if rest else (scaler.get_scale() if scaled else 1.0)  # (no scale tensor yet: no read)
        common = {"step": step, "lr": seen["lr"], "loss": None, "grad_l2_pre_clip": None, "scaler_scale": scale}
        if bad:
            return SkipLog(**common, grad_l2_post_clip=None, reason="non_finite_grad")
        if not math.isfinite(post):
            # (a rare step: one more host read, whether the optimizer really wrote non-finite weights)
            if _non_finite(params := [p for group in optimizer.param_groups for p in group["params"]]):
                # every later step's gradients are non-finite too: nothing more to train; a guard
                # failure (exit 3), as ampguard train never lets a non-finite update reach the weights
                self._poisoned = (f"the Trainer applied a non-finite gradient (norm {post}) and the weights are now "
                                  "non-finite: no loss scaler skips it on a stock Trainer (GuardedTrainer would "
                                  "have skipped the step)")
            else:
                self._emit({"step": step, "event": FAIL_NON_FINITE_UPDATE, "message": (
                    f"the Trainer stepped the optimizer on a non-finite gradient (norm {post}); the weights "
                    f"stayed finite ({len(params)} tensors checked): the optimizer did not apply it")}, "ALERT")
        return StepLog(**common, grad_l2_post_clip=post)


def _non_finite(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``params`` holds inf or nan (one host read).

    Example::

        >>> _non_finite([torch.ones(2), torch.tensor([1.0, float("nan")])]), _non_finite([torch.ones(2)])
        (True, False)
    """
    flags = [torch.isfinite(p.detach()).all() for p in params]
    return bool(flags) and not bool(torch.stack([f.to(flags[0].device) for f in flags]).all())


def _checked_sinks(sinks: list[Any]) -> list[Any]:
    """``sinks``, each an ampguard sink (a ``write``): ``None`` or a tracker's name failed after the
    first step's update, with an ``AttributeError``."""
    for sink in sinks:
        if not callable(getattr(sink, "write", None)):
            raise TypeError(f"AmpGuardCallback(sinks=...): {sink!r} is no ampguard sink (CsvSink, JsonlSink, "
                            "MLflowSink, WandbSink, TensorBoardSink: an object with write(record))")
    return sinks


def _one_per_trainer(holder: Any, callback: AmpGuardCallback, withdraw: bool = False) -> None:
    """``holder`` (a Trainer's ``TrainerControl`` at ``on_init_end``, its ``TrainerState`` at
    ``on_train_begin``, each one object passed to every callback in turn) notes the
    ``AmpGuardCallback`` s it meets; a second one (or the same one twice) is refused with
    :data:`TWO_CALLBACKS`, ``withdraw``: the first's files of this ``train()`` taken back first."""
    seen = holder.__dict__.setdefault("_ampguard_callbacks", [])
    if seen:
        if withdraw:
            for first in seen:
                first._withdraw()
        raise ValueError(f"AmpGuardCallback: {TWO_CALLBACKS}")
    seen.append(callback)


def _ended_by_itself(state: Any, control: Any, steps: int, pruned: bool = False) -> str:
    """How a ``train()`` no guard stopped ended, for ``on_train_end``: all its steps, or fewer.
    HF ends it early when a callback asks (``control.should_training_stop``: an
    ``EarlyStoppingCallback``, the data running out) and when a hyperparameter search prunes
    the trial (it calls ``on_train_end``, then raises ``optuna.TrialPruned``): ``pruned`` when
    :class:`GuardedTrainer` saw it, else judged by the step count (a prune at the last step
    reads "finished").

    Example::

        >>> from types import SimpleNamespace as S
        >>> _ended_by_itself(S(global_step=4, max_steps=4, trial_params=None), S(should_training_stop=False), 4)
        'finished: 4 steps'
        >>> _ended_by_itself(S(global_step=2, max_steps=4, trial_params=None), S(should_training_stop=True), 2)
        'stopped after step 2 of 4: a callback asked (control.should_training_stop)'
        >>> _ended_by_itself(S(global_step=2, max_steps=4, trial_params={"lr": 0.1}), S(should_training_stop=False), 2)
        'pruned by the hyperparameter search after step 2 of 4'
        >>> _ended_by_itself(S(global_step=4, max_steps=4, trial_params={"lr": 0.1}), None, 4, pruned=True)
        'pruned by the hyperparameter search after step 4 of 4'
    """
    of = f"after step {state.global_step} of {state.max_steps}"
    early = bool(state.max_steps) and state.global_step < state.max_steps
    if pruned or (early and not control.should_training_stop and state.trial_params is not None):
        return f"pruned by the hyperparameter search {of}"
    if not early:
        return f"finished: {counted(steps, 'step')}"
    if control.should_training_stop:
        return f"stopped {of}: a callback asked (control.should_training_stop)"
    return f"ended {of}"


def _trial_folder(home: Path, name: str | None) -> Path:
    """The folder of a hyperparameter-search trial's files in ``home``: ``name`` (HF's run folder
    name for the trial, or ``hp_name``'s; one path part), else the first ``run-<N>`` not there yet.

    Example::

        >>> import tempfile
        >>> home = Path(tempfile.mkdtemp())
        >>> _trial_folder(home, "run-3").name, _trial_folder(home, "lr=0.1/b").name
        ('run-3', 'lr=0.1_b')
        >>> (home / "run-0").mkdir(); _trial_folder(home, None).name
        'run-1'
    """
    if name:
        return home / name.replace("/", "_").replace(os.sep, "_")
    n = 0
    while os.path.lexists(home / f"run-{n}"):  # (a dangling link's name is not free)
        n += 1
    return home / f"run-{n}"


def _check_out_dir(folder: Path) -> None:
    """Refuse (one ``ValueError`` line) an ``out_dir`` that ``mkdir -p`` cannot make or reach (a
    file, a link to nothing or a loop, or a path through one, judged as the OS walks it:
    :func:`~ampguard.errors.folder_problem`), when the callback is made: ``train()`` would fail
    at its ``mkdir`` after the Trainer was built (``file.txt/..`` and ``gone/../x`` did).

    Example::

        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "notes.txt").write_text("mine")
        >>> _check_out_dir(root / "new" / "deeper")  # made by train(), with its parents: fine
        >>> for out in (root / "notes.txt", root / "notes.txt" / "guard"):
        ...     try:
        ...         _check_out_dir(out)
        ...     except ValueError as err:
        ...         print(str(err).replace(str(root), "DIR"))
        AmpGuardCallback(out_dir=...): DIR/notes.txt is a file, not a folder
        AmpGuardCallback(out_dir=...): DIR/notes.txt/guard lies under DIR/notes.txt, a file, not a folder
        >>> (root / "gone").symlink_to(root / "nowhere"); (root / "loop").symlink_to(root / "loop")
        >>> for out in (root / "gone", root / "loop" / "guard"):
        ...     try:
        ...         _check_out_dir(out)
        ...     except ValueError as err:
        ...         print(str(err).replace(str(root), "DIR"))
        AmpGuardCallback(out_dir=...): DIR/gone is a symbolic link to DIR/nowhere, which does not exist, not a folder
        AmpGuardCallback(out_dir=...): DIR/loop/guard lies under DIR/loop, a symbolic link that loops, not a folder
    """
    problem = folder_problem(folder)  # (judged as mkdir -p walks it: errors.as_made, as the Lightning csv=)
    if problem is not None:
        raise ValueError(f"AmpGuardCallback(out_dir=...): {problem}")


def _scaler_of(optimizer: Any) -> torch.amp.GradScaler | None:
    """The loss scaler Accelerate gave the Trainer's optimizer (``AcceleratedOptimizer.scaler``), if any."""
    return getattr(optimizer, "scaler", None)


def _is_guard_callback(callback: Any) -> bool:
    """An :class:`AmpGuardCallback`, or its class (HF's ``callbacks=`` makes an instance of a class)."""
    return isinstance(callback, AmpGuardCallback) or (
        isinstance(callback, type) and issubclass(callback, AmpGuardCallback))


def _shown(value: Any) -> str:
    """A value in an error's one line: its type and a short repr.

    Example::

        >>> print(_shown("somedir")); print(_shown(AmpGuardCallback))
        str 'somedir'
        the class AmpGuardCallback (not an instance: AmpGuardCallback(...))
    """
    if isinstance(value, type):
        return f"the class {value.__name__} (not an instance: {value.__name__}(...))"
    return f"{type(value).__name__} {shortened(repr(value), 60)}"


def _refused_backward(*args: Any, **kwargs: Any) -> None:
    # (review 53i: it said these gradients "would be applied unchecked and unclipped"; HF's optimizer
    # step after the guard's does nothing, and HF's model.zero_grad() would have dropped them)
    raise RuntimeError("GuardedTrainer: accelerator.backward() beside the guard: the guard backs the loss "
                       "training_step computes, and these gradients would never be applied (HF's optimizer step "
                       "after the guard's does nothing); add this loss to the one compute_loss returns")


class GuardedTrainer(Trainer):
    """A ``transformers.Trainer`` whose AMP step is ampguard's :class:`Guard`.

    Use it where you use ``Trainer``, with ``fp16=True`` or ``bf16=True`` as usual (``use_cpu=True``
    works too: Accelerate alone would run fp16 on a CPU in fp32 without a scaler, see the README):
    ampguard does the autocast and the loss scaling, Accelerate is asked for
    ``mixed_precision="no"``. The model is held in float32 (``from_pretrained(...,
    dtype=torch.float32)``): one held in bfloat16 or float16 under ``bf16``/``fp16`` is refused at
    the first step (``ValueError``: mixed precision keeps FP32 master weights; review 53c), where
    the stock Trainer trains it. Per optimizer step:

    - a non-finite loss never seeds the backward, and the step is skipped (``non_finite_loss``);
      a non-finite gradient skips it too (``non_finite_grad``): parameters and optimizer state
      untouched, the loss scale backed off (fp16), HF's LR scheduler held;
    - otherwise the gradients are clipped to ``args.max_grad_norm`` and applied;
    - HF's logged ``grad_norm`` is the pre-clip norm; :class:`AmpGuardCallback` writes the rows.

    Args (beyond ``Trainer``'s):
        ampguard: the :class:`AmpGuardCallback` that writes and watches; one with defaults when
            ``None`` (``<output_dir>/ampguard/steps.csv``). An instance already in ``callbacks``
            is used as it is.
        scaler: keyword arguments for the loss scaler (``init_scale``, ``growth_interval``, ...,
            ``min_scale``), fp16 only.
        scheduler_on_skip: ``"hold"`` (default) or ``"step"`` HF's LR scheduler on a skipped step.
        frozen: :class:`Guard`'s: ``"refuse"`` (default) a parameter that requires grad and no
            optimizer holds (a custom ``optimizers=(opt, None)`` over part of the model), or
            ``"ignore"`` it (its gradients are dropped).

    Accumulation follows HF's groups exactly, the epoch's shorter last group included (HF steps
    after its ``steps_in_epoch % gradient_accumulation_steps`` batches): each group's loss is
    divided by the group's own number of micro-batches, or taken as it is when HF normalised it
    over the group's items (``num_items_in_batch``), as the stock ``training_step`` does.

    Checkpoints: each ``checkpoint-N`` folder gets ``ampguard_state.json`` (the guard's scaler
    and counters, the callback's monitor), and ``train(resume_from_checkpoint=...)`` restores it
    before the first step: the steps go on at N + 1 as HF's ``global_step`` does, the loss scale
    and the skip-rate window where they were, and the callback's CSV appends after row N. A
    state saved with another precision or ``gradient_accumulation_steps`` is refused
    (``InputError``) before anything is written. A checkpoint without that file (a stock
    Trainer's, a ``save_only_model`` one) resumes with the steps numbered from N + 1, the loss
    scale from its ``scaler.pt`` where it has one (a stock fp16 Trainer's: see
    :meth:`_stock_scale`), else ``init_scale``, and the monitor observing from step N + 1 (its
    counts and judgement cover the steps it saw), all said in the ``resume`` event. An error
    that ends ``train()`` still writes ``run_end``, ``summary.json`` and ``RUN.md``
    (``ended``: how far the run got, and why).

    ``evaluate()`` and ``predict()`` run under the same autocast as training, their outputs
    handed back in float32, as the stock Trainer's Accelerate does (``mixed_precision="no"``
    turned Accelerate's off).

    Limits: the guard steps inside ``training_step``, so when HF's ``on_pre_optimizer_step``
    and ``on_optimizer_step`` callbacks run, the step is already applied (or skipped): an
    ``on_pre_optimizer_step`` callback sees no gradients; an ``on_optimizer_step`` one sees an
    applied step's (unscaled and clipped: HF's ``optimizer.step()`` puts them back for its
    scheduler, and its ``model.zero_grad()`` drops them after, as in the stock Trainer), none
    after a skipped step (the norms are in each CSV row, in ``self.record`` and in HF's logged
    ``grad_norm``). The guard is built at the first step (``self.guard``), or when a resume
    loads its state.
    """

    @called_by_user  # (a warning of its settings names the user's line)
    def __init__(self, *args: Any, ampguard: AmpGuardCallback | None = None, scaler: dict[str, Any] | None = None,
                 scheduler_on_skip: SchedulerOnSkip = "hold", frozen: Frozen = "refuse", **kwargs: Any) -> None:
        _require_seams()  # (a transformers before TRANSFORMERS_FLOOR: refused before anything is built)
        check_settings(None, scheduler_on_skip, frozen)  # (Guard's own check; max_norm is args.max_grad_norm)
        self.frozen = frozen  # Guard's: a parameter that requires grad and no optimizer holds (optimizers=(opt, None))
        if ampguard is not None and not isinstance(ampguard, AmpGuardCallback):
            example = f"AmpGuardCallback({str(ampguard)!r})" if isinstance(ampguard, (str, os.PathLike)) \
                else "AmpGuardCallback(out_dir, fail_rate=...)"
            raise TypeError(f"GuardedTrainer: ampguard= takes an AmpGuardCallback (e.g. ampguard={example}), "
                            f"got {_shown(ampguard)}")
        callbacks = list(kwargs.pop("callbacks", None) or [])
        given = [cb for cb in callbacks if _is_guard_callback(cb)]  # (HF takes a callback's class too)
        if len(given) + (ampguard is not None and not any(cb is ampguard for cb in given)) > 1:
            raise ValueError(f"GuardedTrainer: {TWO_CALLBACKS}")  # (before anything is built or written)
        if ampguard is None:
            ampguard = given[0] if given else AmpGuardCallback()
            if isinstance(ampguard, type):  # callbacks=[AmpGuardCallback]: the instance HF would have made
                callbacks[callbacks.index(ampguard)] = ampguard = ampguard()
        if not any(cb is ampguard for cb in callbacks):
            callbacks.append(ampguard)
        ampguard._guarded = False  # (a GuardedTrainer takes it again; a stock Trainer is refused one: on_init_end)
        super().__init__(*args, callbacks=callbacks, **kwargs)
        _refuse_unguardable(self)
        # (declared: never None once built, so trainer.ampguard.exit_code type-checks; review 56e)
        self.ampguard: AmpGuardCallback = ampguard
        # ampguard train's defaults: the scale never falls below 1.0 (scaler.min_scale)
        precision = precision_of(self.args)
        check_scaler_settings(precision, scaler or {})  # (an unknown key: here, not at the first step)
        fp16, scaling = precision == "fp16", loss_scaler_runs(precision, (scaler or {}).get("enabled"))
        # (a scaler turned off takes no floor: review 53j, the guard said "min_scale ignored", a setting
        # the user never gave; and the callback was told of a scaler that does not run)
        self.scaler_settings = {"min_scale": 1.0, **(scaler or {})} if scaling else {"enabled": False} if fp16 else {}
        ampguard.attach({"init_scale": self.scaler_settings.get("init_scale", 2.0**16),
                         "min_scale": self.scaler_settings["min_scale"],
                         "growth_interval": self.scaler_settings.get("growth_interval", 2000)}
                        if scaling else None)
        self.scheduler_on_skip = scheduler_on_skip
        self.guard: Guard | None = None
        self.record: StepRecord | None = None  # the last closed step's record
        # evaluation's autocast: the training precision on the Trainer's device (see prediction_step)
        self.precision = Precision(precision_of(self.args), self.args.device.type)

    def add_callback(self, callback: Any) -> None:
        """``Trainer.add_callback``; a second :class:`AmpGuardCallback` is refused (the Trainer
        feeds ``self.ampguard``; a second one would write its own rows into the same files)."""
        if _is_guard_callback(callback) and callback is not getattr(self, "ampguard", None):
            raise ValueError(f"GuardedTrainer: {TWO_CALLBACKS} (this one has trainer.ampguard)")
        super().add_callback(callback)

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        """Each attempt builds its guard (``auto_find_batch_size`` begins the loop again after an
        out-of-memory, from step 0 or the checkpoint again, with the weights and the optimizer,
        state and all, that the attempt before left: HF keeps them)."""
        self.guard, self.record, self._guard_stepped, self._applied = None, None, False, ()
        self.ampguard.autocast_dtypes = None  # (each attempt's first forward, each train()'s: its model, whole)
        return super()._inner_training_loop(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; an error that ends it (a Ctrl-C included) is first written to the
        callback's files (:meth:`AmpGuardCallback.crashed`), then raised as it is.

        Stop signals, as ``ampguard train`` takes them (:func:`~ampguard.signals.stop_on_signals`,
        installed for this call only, in the main thread, the handlers before it put back when it
        returns or raises): the first SIGINT (Ctrl-C) or SIGTERM (a scheduler's: SLURM,
        Kubernetes, torchrun) lets the step in flight finish and write its row; the Trainer stops
        after that step, with its checkpoint (unless ``save_strategy`` is ``"no"``) and no
        evaluation begun (one running when the signal came ends first, then one more step), and
        :class:`~ampguard.signals.Interrupted` is raised when ``train()`` returns: ``run_end``, ``summary.json`` and ``RUN.md`` say
        ``interrupted (SIGTERM) after step N``, the tracker sinks end KILLED, :attr:`exit_code` is
        130 or 143. A second signal interrupts at once (once the row being written is whole). A
        signal the process ignores stays ignored. An ``Interrupted`` left uncaught ends Python as a
        Ctrl-C does (130): exit with ``trainer.ampguard.exit_code`` to report 143.

        (A Trainer owns its loop's signals, as Lightning's does; :class:`AmpGuardCallback` on a
        stock ``Trainer`` installs no handler behind the Trainer's back, as the Lightning plugin
        installs none: there a SIGTERM ends the process as Python's default does.)"""
        if not any(cb is self.ampguard for cb in self.callback_handler.callbacks):
            # (remove_callback / pop_callback: the guard would still skip and clip, but nothing would record
            # a step, count a skip, fail fast or write the run's files, unsaid; review 33c)
            raise ValueError("GuardedTrainer: its AmpGuardCallback (trainer.ampguard) was taken out of the "
                             "callbacks: nothing would record a step or fail fast; put it back with "
                             "trainer.add_callback(trainer.ampguard), or train a stock Trainer")
        self.guard = None  # each train() builds its guard: at its first step, or from the checkpoint it resumes
        trial = kwargs.get("trial", args[1] if len(args) > 1 else None)
        run_dir = getattr(self, "_get_output_dir", None)  # (HF's name for a search trial's run folder: run-N)
        searching = trial is not None and getattr(self, "hp_search_backend", None) is not None and run_dir is not None
        self.ampguard.for_trial(os.path.relpath(run_dir(trial), self.args.output_dir) if searching else None)
        with stop_on_signals() as stop:
            self.ampguard._stop = stop
            try:
                output = super().train(*args, **kwargs)
            except BaseException as error:
                stop.closing = True  # (a signal now waits: the files and the sinks' runs end first)
                if stop.requested and isinstance(error, KeyboardInterrupt) and not isinstance(error, Interrupted):
                    # a second signal interrupted the step in flight: the first one's code (143 for SIGTERM)
                    interrupted = Interrupted(stop.exit_code)
                    self.ampguard.crashed(interrupted)
                    raise interrupted from error
                self.ampguard.crashed(error)
                raise
            finally:
                self.ampguard._stop = None
            if stop.requested or self.ampguard._stopping:  # (after the run's end was written: not swallowed)
                raise Interrupted(stop.exit_code)
            return output

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer.log``, a training log first given the guard's keys
        (:meth:`AmpGuardCallback.add_to_log`): ``trainer.state.log_history`` and every
        ``report_to`` tracker get ``ampguard/skipped``, ``ampguard/skip_rate``, ``ampguard/scale``."""
        self.ampguard.add_to_log(logs)
        super().log(logs, *args, **kwargs)

    def _report_to_hp_search(self, *args: Any, **kwargs: Any) -> Any:
        """HF's report to a hyperparameter search; when it prunes the trial it calls
        ``on_train_end`` and raises ``optuna.TrialPruned``: the callback, told it is inside,
        writes that the search pruned the trial (at the last step too, where nothing else tells)."""
        self.ampguard._reporting = True
        try:
            return super()._report_to_hp_search(*args, **kwargs)
        finally:
            self.ampguard._reporting = False

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        args = super()._build_accelerator_args(**kwargs)
        args["mixed_precision"] = "no"  # ampguard autocasts and scales; Accelerate must not do it twice
        return args

    def _make_guard(self, model: torch.nn.Module) -> Guard:
        _require_skip_flag(self)
        guard = Guard(model, _inner(self.optimizer), precision=precision_of(self.args),  # (inside Accelerate's wrapper)
                      max_norm=self.args.max_grad_norm, accumulation_steps=self.args.gradient_accumulation_steps,
                      scaler=self.scaler_settings or None, frozen=self.frozen)
        # (review 53i: a crash here ended with "the next guard.backward() begins a new step", the note
        # for a loop of one's own that calls the guard; GuardedTrainer's user never does)
        guard._loop_notes = False
        # the guard backs the loss training_step computes; an accelerator.backward of the user's (an
        # auxiliary loss after super().training_step) made gradients HF then applied, unguarded
        self.accelerator.backward = _refused_backward  # (this accelerator's own attribute, not the class's)
        _stepped_by_the_guard(self)
        return guard

    # ---------------------------------------------------------------- checkpoints
    # HF saves and loads its AMP scaler through _save_scaler / _load_scaler (Accelerate's, which
    # is None here): the guard owns the scaler, so its state goes through the same two seams, into
    # the checkpoint folder beside HF's files. _load_scaler runs after the model, optimizer and
    # trainer state are loaded and before on_train_begin.

    def _save_scaler(self, output_dir: str) -> None:
        super()._save_scaler(output_dir)
        if not self.args.should_save or self.guard is None:
            return
        monitor = self.ampguard.monitor
        state = {"guard": self.guard.state_dict(mid_group=True),  # (HF saves between steps: the group is closed)
                 "monitor": monitor.state_dict() if monitor is not None else None,
                 "logged": self.ampguard.logged_state() if monitor is not None else None,
                 # the layers autocast left in float32: a record kept with the checkpoint (not compared on a resume)
                 **({"autocast_dtypes": self.autocast_dtypes} if self.autocast_dtypes else {})}
        path = Path(output_dir) / STATE_NAME
        # strict JSON: a skipped step's record holds an inf gradient norm or a NaN loss, which json.dumps wrote as
        # Infinity/NaN, what JSON.parse, polars or jq cannot read (review 56d): "inf"/"nan", read back by
        # _load_scaler (_state_numbers_back), at the places "non_finite" lists (any in the state: a monitor of the
        # user's on the guard, best=inf, came back "inf", review 56l; a string of theirs stays a string). Replaced
        # whole: a reader never sees half a file
        state["non_finite"] = non_finite_at(state)
        replace_atomically(path, json.dumps(strict_json(state), indent=1, allow_nan=False) + "\n")

    def _load_scaler(self, checkpoint: str | None) -> None:
        if getattr(self.accelerator, "scaler", None) is not None:  # (never: Accelerate is told "no", it has none)
            super()._load_scaler(checkpoint)
        if checkpoint is None:
            return
        step, source = self.state.global_step, Path(checkpoint).name
        path = Path(checkpoint) / STATE_NAME
        saved = None
        if path.is_file():
            try:
                saved = _state_numbers_back(json.loads(path.read_text(encoding="utf-8")))
                saved_step = saved["guard"]["step"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise InputError(f"{path}: not an ampguard state: {first_line(err, with_type=True)}") from None
            if saved_step != step:
                raise InputError(f"{path}: the guard's state is at step {saved_step!r}, HF's trainer_state at "
                                 f"{step}: they come from different runs")
        # the guard now, over the prepared model and optimizer, so a state that does not fit is refused
        # before on_train_begin opens (and cuts) the callback's files
        self.guard = self._make_guard(self.model_wrapped)
        scale, scale_note = None, ""
        if saved is None:  # (a checkpoint saved without ampguard: its steps are HF's, the rest starts afresh)
            self.guard.steps = step
            scale, scale_note = self._stock_scale(Path(checkpoint))
        else:
            try:
                self.guard.load_state_dict(saved["guard"])
            except (ValueError, KeyError, TypeError) as err:
                raise InputError(f"{path}: {first_line(err)}") from None
        self.ampguard.resume(step, saved.get("monitor") if saved is not None else None, source,
                             saved.get("logged") if saved is not None else None, scale=scale, scale_note=scale_note)

    def _stock_scale(self, checkpoint: Path) -> tuple[float | None, str]:
        """A checkpoint without ampguard's state: the loss scale the guard goes on from and what
        the resume event says of it. HF's ``_load_scaler`` would load its ``scaler.pt`` (what a
        stock fp16 Trainer saves on a GPU: Accelerate's ``GradScaler``) into Accelerate's scaler,
        which is ``None`` here (an ``AttributeError``): its scale is read here instead.

        An fp16 guard takes over its scale (raised to its floor, ``min_scale``) and its growth
        tracker, as the Lightning plugin takes Lightning's (one function,
        :func:`~ampguard.precision.take_over_stock_scale`): the scale is what the scaler found for
        these weights' gradients at this step, as a GuardedTrainer checkpoint's scale is, so the
        run goes on without a new search down from ``init_scale`` (a run of skipped steps); the
        growth and backoff factors and the interval stay the guard's own (``scaler=``), named
        where they differ. Review 54s: the clean steps' count restarted at 0 (the scale grew
        ``growth_interval`` steps late), the settings kept went unsaid, and a NaN scale restarted
        at ``init_scale``; a state :meth:`~ampguard.precision.GuardedGradScaler.check_state`
        refuses is now refused (``InputError`` naming the file). Without a loss scaler (bf16,
        fp32) the file is not used, and said so."""
        file = checkpoint / "scaler.pt"  # (HF's SCALER_NAME)
        scaler = self.guard.scaler if self.guard is not None else None
        if not file.is_file():
            return None, (f"the loss scale starts again at init_scale {scaler.get_scale():g}; "
                          if scaler is not None and scaler.is_enabled() else "")
        if scaler is None or not scaler.is_enabled():
            return None, (f"its {file.name} (a stock fp16 Trainer's loss scale) is not used: this "
                          f"{self.guard.precision.name} run has no loss scaler; ")
        try:
            stock = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a file of any kind: one line naming it, not a traceback
            raise InputError(f"{file}: not a loss scaler's state (HF's scaler.pt): "
                             f"{first_line(err, with_type=True)}") from None
        try:
            scaler.check_state(stock)
        except ValueError as err:  # (a scale past float32's largest, 1e39: it escaped as a bare ValueError)
            raise InputError(f"{file}: not a loss scale to go on from: {first_line(err)}; delete it to start the "
                             f"loss scale at init_scale") from None
        taken, kept = take_over_stock_scale(scaler, stock, "GuardedTrainer's")
        return scaler.get_scale(), (f"the loss scale takes over its {file.name} (the stock Trainer's GradScaler's): "
                                    f"{taken}; " + (f"{kept}; " if kept else ""))

    # ---------------------------------------------------------------- the step

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        """HF's fetch of a group's micro-batches, before the group's first: a guard still inside
        the group before is refused here, with the cause. That group broke off before its last
        micro-batch: a callback set ``control.should_epoch_stop`` between its micro-batches
        (``on_substep_end``), and HF goes on to the next epoch. The stock Trainer carries the
        broken group's gradients into the next epoch's first group (a step of k + n
        micro-batches, each loss divided by n: k/n more gradient than a group's); the guard's
        step is one of HF's groups (its record's loss, norms and skip are that group's), so it
        neither carries them nor drops them unsaid. (It said "give the dataset a length": the
        error for a dataset that runs out inside a group, which is another cause.)"""
        guard = self.guard
        if guard is not None and guard.mid_group:  # (nothing of the broken group is applied: its gradients wait)
            raise RuntimeError(
                f"GuardedTrainer: the epoch ended after micro-batch {guard.micro_batches} of the "
                f"{guard.accumulation_steps} in a group (control.should_epoch_stop set between a group's "
                "micro-batches, in on_substep_end): HF would carry their gradients into the next epoch's first group, a step the "
                "guard does not make (one step is one group); set should_epoch_stop in on_step_end, at a step's end")
        return super().get_batch_samples(*args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch through the guard; the group's last one also closes the optimizer step."""
        if self.guard is None:
            self.guard = self._make_guard(model)
        guard = self.guard
        # HF fetches each group's batches before its first micro-batch and says how many there are:
        # gradient_accumulation_steps, fewer in an epoch's short last group. The guard's group is
        # that one: it divides each loss by this count, as HF's own training_step does (unless the
        # loss is normalised over the group's items, below), and closes on the group's last batch.
        n = self.current_gradient_accumulation_steps
        if not guard.mid_group:
            guard.accumulation_steps = n
        closes = guard.micro_batches + 1 == n
        if closes != self.accelerator.sync_gradients:  # (HF's do_sync_step: whether it steps after this batch)
            raise RuntimeError(
                f"HF {'does not step' if closes else 'steps'} after micro-batch {guard.micro_batches + 1} of the {n} "
                f"it fetched for this group, where the guard {'would' if closes else 'would not'}: as when a dataset "
                "without a length runs out inside a group (HF carries the group on into the next pass, past "
                "gradient_accumulation_steps); give the dataset a length, or make it endless and set max_steps")
        # as the stock training_step: context parallelism's sharded inputs and its context (a no-op
        # without it; an HF before it has no such seam), the inputs let go before the backward, the
        # device cache emptied every torch_empty_cache_steps
        prepare = getattr(self, "_prepare_context_parallel_inputs", None)
        cp_context, inputs = prepare(model, inputs) if prepare is not None else (contextlib.nullcontext, inputs)
        with cp_context():
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            inputs = self._prepare_inputs(inputs)
            # (fp32: no autocast, nothing converted, as Accelerate leaves the stock Trainer's forward alone)
            forward = autocast_forward(model, guard.autocast) if guard.precision.autocasts else guard.autocast()
            with self.compute_loss_context_manager(), forward:
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            del inputs
            every = getattr(self.args, "torch_empty_cache_steps", None)
            if every is not None and self.state.global_step % every == 0:
                from accelerate.utils.memory import clear_device_cache

                clear_device_cache()
            if self.ampguard.autocast_dtypes is None:  # (the attempt's first forward: for the callback's card)
                self.ampguard.autocast_dtypes = guard.autocast_dtypes
            if self.args.n_gpu > 1:
                loss = loss.mean()
            scaled_for_ga = self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else (
                (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None)
            # a loss normalised over the whole group's items is divided already: the guard takes it as it is
            guard.backward(loss, divided=scaled_for_ga)
        # the group's gradients, which the guard's step unscales and clips in place and then drops
        held = [(p, p.grad) for group in guard.optimizer.param_groups for p in group["params"]] if closes else ()
        record = guard.step()
        if record is not None:
            self._guard_stepped = True  # (HF's optimizer.step() that follows does nothing)
            # (an applied step's, put back in that call: _put_back_gradients; a skip's stay dropped)
            self._applied = () if record.skipped else held
            guard.accumulation_steps = self.args.gradient_accumulation_steps  # (what its state_dict saves)
            self.record = record
            self.ampguard.take(record)
            _report_skip(self.optimizer, record.skipped and self.scheduler_on_skip == "hold")
        return (loss if scaled_for_ga else loss / n).detach()

    def _put_back_gradients(self) -> None:
        """An applied step's gradients (as applied: unscaled, clipped) put back on the parameters
        by HF's ``optimizer.step()`` after the guard's (the no-op of :func:`_stepped_by_the_guard`),
        for the rest of HF's step, until its ``model.zero_grad()``, as the stock Trainer leaves
        them: HF's ``lr_scheduler.step()`` comes after the guard's step, and a schedule that reads
        them found none (review 53c: ``AdafactorSchedule`` counts the groups whose first parameter
        has a gradient; with none it wrote its base lr, 0.0, so HF logged ``learning_rate`` 0.0
        and the CSV's ``lr`` was 0.0 at every step). HF's order is ``training_step`` (the guard's
        step), ``on_pre_optimizer_step``, ``optimizer.step()`` (here), ``on_optimizer_step``,
        ``lr_scheduler.step()``, ``model.zero_grad()``: so ``on_optimizer_step`` callbacks and the
        scheduler see them, ``on_pre_optimizer_step`` callbacks see none, and any gradient there
        came from a backward after the step (the callback refuses it). Review 53i: 5eb7128 put
        them back right after the guard's step, and the check there, of each gradient's
        ``_version``, refused a callback that only measured them in place. A skipped step's stay
        dropped (DESIGN: a skip discards them)."""
        applied, self._applied = self._applied, ()
        for p, grad in applied:
            p.grad = grad

    @property
    def autocast_dtypes(self) -> dict[str, str] | None:
        """Each leaf module's output dtype in this attempt's first training forward under autocast
        (its guard's :attr:`~ampguard.Guard.autocast_dtypes`: empty for a compiled model,
        ``torch_compile=True``; the run card's "float32 under autocast", kept by the callback,
        which writes the card)."""
        return self.ampguard.autocast_dtypes

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        """The guard clipped already; HF's logged ``grad_norm`` is its pre-clip norm."""
        return self._pre_clip()

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        return grad_norm if grad_norm is not None else self._pre_clip()

    def _pre_clip(self) -> Any:
        return self.record.grad_l2_pre_clip if self.record is not None else None

    # ---------------------------------------------------------------- evaluation

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """``Trainer.prediction_step`` with the model's forward autocast to the training precision
        and its outputs in float32, as Accelerate's wrapped forward (``convert_outputs_to_fp32``)
        hands them to the stock Trainer (here Accelerate is told ``"no"``); the loss computed
        outside the forward (a label smoother's) is then computed as there, in float32."""
        forward = autocast_forward(model, self.precision.autocast) if self.precision.autocasts else contextlib.nullcontext()
        with forward:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


@contextlib.contextmanager
def autocast_forward(model: torch.nn.Module, autocast: Callable[[], contextlib.AbstractContextManager[Any]]
                     ) -> Iterator[None]:
    """For the block, each call of ``model``'s forward runs under a fresh ``autocast()`` and hands
    its outputs back in float32: what Accelerate's ``prepare_model`` does to the stock Trainer's
    model (``autocast`` around ``forward``, then ``convert_outputs_to_fp32``). A loss computed
    outside the forward (``label_smoothing_factor``'s, a ``compute_loss_func``, an overridden
    ``compute_loss``) is then computed in float32 outside autocast, as the stock Trainer computes it.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> with autocast_forward(model, lambda: torch.autocast("cpu", torch.bfloat16)):
        ...     inside = model(torch.ones(1, 2)).dtype, torch.is_autocast_enabled("cpu")
        >>> inside, "forward" in vars(model), model(torch.ones(1, 2)).dtype
        ((torch.float32, False), False, torch.float32)
    """
    own = vars(model).get("forward")  # (an instance's own forward: a compiled module's, Accelerate's)
    forward = model.forward

    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            note_autocast_inside(model)  # (the guard's probe ran before this wrapper, outside its autocast)
            outputs = forward(*args, **kwargs)
        return convert_to_fp32(outputs)

    model.forward = forward_under_autocast
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _stepped_by_the_guard(trainer: GuardedTrainer) -> None:
    """HF's loop calls ``optimizer.step()`` after each group its ``training_step`` closed, and the
    guard has stepped the optimizer (or skipped the step) by then: that call does nothing. It found
    no gradients (the guard dropped them; since review 53c this call puts an applied step's back,
    for HF's scheduler, :meth:`GuardedTrainer._put_back_gradients`: applying them would apply them
    twice), but an optimizer with state of its own per step (schedule-free's ``k``, its averaging
    weights) or a step post-hook (an EMA) counted a second step per update, and one on a skipped
    step. A call not after a guard's step (one's own) goes through to Accelerate's."""
    accelerated = trainer.optimizer
    previous = accelerated.step  # (Accelerate's, or an LR scheduler's wrapper of it)
    if accelerated is _inner(accelerated) or getattr(previous, "after_the_guards", False):  # (not Accelerate's; done)
        return

    def step(closure: Any = None) -> Any:
        if trainer._guard_stepped:
            trainer._guard_stepped = False
            trainer._put_back_gradients()  # (an applied step's, for HF's scheduler: review 53c, 53i)
            accelerated._opt_called = True  # (what an LR scheduler's wrapper notes: the step was called)
            return None
        return previous(closure)

    functools.update_wrapper(step, previous)  # (an LR scheduler's mark on its wrapper, _wrapped_by_lr_sched, kept)
    step.after_the_guards = True  # type: ignore[attr-defined]
    accelerated.step = step


def missing_seams(trainer_class: type) -> list[str]:
    """The names of :data:`TRAINER_SEAMS` that ``trainer_class`` (HF's ``Trainer``) lacks.

    Example::

        >>> missing_seams(Trainer), missing_seams(object)[:2]
        ([], ['loss_is_scaled_for_ga', '_build_accelerator_args'])
    """
    return [name for name in TRAINER_SEAMS if not hasattr(trainer_class, name)]


def _require_seams() -> None:
    """An ``ImportError`` line for a transformers whose ``Trainer`` lacks a seam the guard relies
    on (before anything is built or written): past the first missing one (an ``AttributeError``
    at the first step) the rest fail silently (review 53c)."""
    missing = missing_seams(Trainer)
    if missing:
        import transformers

        raise ImportError(f"GuardedTrainer needs transformers>={TRANSFORMERS_FLOOR} (this is "
                          f"{transformers.__version__}: its Trainer has no {', '.join(missing)}, which GuardedTrainer "
                          f"overrides or reads): pip install 'transformers>={TRANSFORMERS_FLOOR}'")


def _require_skip_flag(trainer: Trainer) -> None:
    """An ``ImportError`` line, at the guard's building, for an Accelerate whose skip flag the
    guard cannot set: HF holds its scheduler on ``accelerator.optimizer_step_was_skipped``, which
    reads each ``AcceleratedOptimizer``'s ``_is_overflow`` (:func:`_report_skip`). An Accelerate
    that renamed it (or an optimizer not Accelerate's) would step the scheduler on every skip,
    unsaid; so the flag is set once here and the Accelerator asked whether it heard it (review
    53c)."""
    optimizer = trainer.optimizer
    if "_is_overflow" in vars(optimizer):
        was = optimizer._is_overflow
        optimizer._is_overflow = True
        try:
            heard = trainer.accelerator.optimizer_step_was_skipped
        finally:
            optimizer._is_overflow = was
        if heard:
            return
    import accelerate

    raise ImportError(f"GuardedTrainer: this Accelerate ({accelerate.__version__}) has no AcceleratedOptimizer."
                      "_is_overflow that optimizer_step_was_skipped reads, so HF's LR scheduler would step on a "
                      "skipped step: install the Accelerate this transformers asks for")


def _refuse_unguardable(trainer: Trainer) -> None:
    """A ``ValueError`` for a set-up whose update no guard can stand before (before a file is
    written): LOMO and AdaLOMO apply the update inside the backward (no optimizer step to skip or
    clip); DeepSpeed owns the backward and its own loss scaling."""
    optim = str(getattr(trainer.args.optim, "value", trainer.args.optim))
    if optim in ("lomo", "adalomo"):
        raise ValueError(f"GuardedTrainer: optim={optim!r} updates the weights inside the backward: there is no "
                         "optimizer step for the guard to skip or clip; use an optimizer that steps")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ValueError("GuardedTrainer: DeepSpeed owns the backward and its loss scaling: the guard cannot check "
                         "the loss before it nor skip the step; use the stock Trainer with DeepSpeed's own checks")


def _report_skip(optimizer: Any, skipped: bool) -> None:
    """Tell the Trainer the step was skipped, the way Accelerate's own scaler path does.

    ``Trainer`` holds its LR scheduler when ``accelerator.optimizer_step_was_skipped``, which reads
    each ``AcceleratedOptimizer.step_was_skipped``, i.e. its ``_is_overflow`` (set by
    ``AcceleratedOptimizer.step`` only when Accelerate owns a scaler). The guard decided the
    skip, so it sets the flag; the Trainer's ``optimizer.step()`` leaves it alone without a scaler.
    """
    if hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = skipped
