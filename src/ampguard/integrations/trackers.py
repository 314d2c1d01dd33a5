"""Tracker sinks: every step's record to Weights & Biases (:class:`WandbSink`) or MLflow
(:class:`MLflowSink`), next to the CSV, JSON lines and TensorBoard sinks.

Each logs, per step, the numbers of the CSV row (:func:`step_metrics`): ``train/lr``,
``train/loss``, ``train/grad_l2_pre_clip``, ``train/grad_l2_post_clip``, ``train/scaler_scale``,
``train/skipped`` (0/1) and the reason as one 0/1 metric per reason
(``train/skip.non_finite_loss``, ``train/skip.non_finite_grad``: a chart, a filter), the held-out
metrics as ``eval/<name>``; and what the run's monitor makes of them (:func:`monitor_metrics`):
``monitor/skip_rate``, ``monitor/clip_rate``, ``monitor/skip_rate_alert`` and
``monitor/scale_alert`` (1 while the ALERT is up), ``monitor/scale_health`` (fp16: the index of
the verdict in :data:`~ampguard.monitor.HEALTH_VERDICTS`). At the end (:meth:`TrackerSink.finish`) the run's
totals (skips by reason, alert episodes, the scale verdict, the exit code) go to the tracker
run's summary (W&B) or tags and metrics (MLflow), and the run card ``RUN.md``, ``report.png``,
``events.jsonl``, ``steps.csv`` and ``config.yaml`` are uploaded as artifacts.

A value that does not exist (the norm of a step skipped before backward) is not logged;
non-finite values are logged as they are: both trackers take ``nan`` and ``inf``
(``tests/integrations/test_trackers.py`` reads them back; MLflow's SQL stores keep ``nan`` and
store ``inf`` as +-1.8e308).

The frameworks are imported when a sink is made, never by ``import ampguard``; a missing one is
one :class:`~ampguard.errors.InputError` line naming the extra to install. In a run
(``log.wandb``, ``log.mlflow``: :func:`build_trackers`) only rank 0 logs, and a resumed run
continues the same tracker run: the W&B run's id is the run folder's ``run-id``; the MLflow run
is found by its ``ampguard.run_id`` tag.

A resume from a checkpoint older than the tracker run's last step (a crash after the last
checkpoint, or ``--resume`` of an older one) replays steps the tracker already holds. The CSV
drops its set-aside rows; trackers cannot: MLflow appends metric values and has no way to delete
them (mlflow#2973), W&B ignores a step below the run's current one (wandb#3890). So an MLflow
sink that finds the steps it is about to log already there forks (:meth:`MLflowSink._fork`): a
new MLflow run with the old one's history up to the checkpoint's step, the old run tagged as
superseded and left as it was. W&B's rewind (``wandb.init(resume_from=...)``) is a private
preview, online only: not used; the W&B run keeps the set-aside values for those steps (README,
"W&B and MLflow"). A loop that begins again in the same process (a Hugging Face
``auto_find_batch_size`` retry) says so with :meth:`TrackerSink.begin_again`: MLflow forks the
same way, W&B keeps the abandoned attempt's steps.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..errors import (AmpguardWarning, ExitCode, InputError, RankWarning, counted, failed_because, first_line, shown,
                      unwritable, warn, whole_number)
from ..monitor import HEALTH_VERDICTS
from ..precision import finite_number
from ..records import SKIP_REASONS, StepRecord
from ..sinks import NONE_WRITTEN, DiskFull, ExtraValue, check_step_after, metric_number, require, steps_from
from ..watch import float32_layers_text

__all__ = ["ForkedRunWarning", "MLflowSink", "TrackerLostWarning", "WandbSink"]

if TYPE_CHECKING:
    from ..config import Config
    from ..monitor import Event, RunMonitor
    from ..run_folder import RunPaths, RunResult

RUN_ID_TAG = "ampguard.run_id"
"""The MLflow tag that names the ampguard run folder's ``run-id`` (how a resume finds its run)."""
RESUMED_FROM_TAG, RESUMED_AT_TAG = "ampguard.resumed_from", "ampguard.resumed_at"
SUPERSEDED_BY_TAG = "ampguard.superseded_by"
"""The MLflow tags of a fork (:meth:`MLflowSink._fork`): on the new run, the old run's id and the
step its history was copied through; on the old run, the new run's id."""
ARTIFACTS: tuple[str, ...] = ("RUN.md", "report.png", "events.jsonl", "steps.csv", "config.yaml", "summary.json",
                              "steps.attempt-*.csv")
"""What :meth:`TrackerSink.finish` uploads from the run folder, those that exist (glob patterns:
a Hugging Face retry's ``steps.attempt-N.csv``)."""


WANDB_FLOOR = "0.21"
"""The oldest wandb :class:`WandbSink` runs on, the ``[wandb]`` extra's floor (review 54e: it said
0.16): the sink makes its own run with ``reinit="create_new"`` (wandb 0.19.10; before it, W&B's
Settings refuse the value, in words that name no version) and takes W&B down with the public
``wandb.teardown`` (0.21; before it, only ``wandb._teardown``)."""


def wandb_too_old(version: str) -> bool:
    """Whether wandb ``version`` is older than :data:`WANDB_FLOOR` (a pre-release of the floor
    counts as it; compared by ``packaging``, which wandb itself requires).

    Example::

        >>> [wandb_too_old(v) for v in ("0.16.0", "0.19.10", "0.20.1", "0.21.0", "0.21.0rc1", "0.31.0", "1.0")]
        [True, True, True, False, False, False, False]
    """
    from packaging.version import Version

    return Version(version).release < Version(WANDB_FLOOR).release


def _require_wandb_floor() -> None:
    """One :class:`InputError` line for an installed wandb older than :data:`WANDB_FLOOR` (read
    from its package metadata: wandb is not imported for it)."""
    from importlib import metadata

    try:
        version = metadata.version("wandb")
    except metadata.PackageNotFoundError:  # (not installed: require says so; metadata-less: let the import tell)
        return
    if wandb_too_old(version):
        raise InputError(f"log.wandb: needs wandb>={WANDB_FLOOR} (this is {version}): pip install 'wandb>={WANDB_FLOOR}'")


def _import(package: str, flag: str) -> Any:
    require(package, flag)
    try:
        return importlib.import_module(package)
    except ImportError as err:
        raise InputError(f"{flag}: cannot import {package} ({err}): pip install 'ampguard[{package}]'") from None


def step_metrics(record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> dict[str, float]:
    """One step's numbers for a tracker: the CSV row's, a missing value left out, non-finite
    ones kept. Reads ``record.values()`` (a host sync if the record holds device tensors).

    Example::

        >>> from ampguard.records import SkipLog
        >>> skip = SkipLog(3, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
        ...                scaler_scale=512.0, reason="non_finite_loss")
        >>> step_metrics(skip, {"val_loss": None})  # doctest: +NORMALIZE_WHITESPACE
        {'train/lr': 0.1, 'train/loss': nan, 'train/scaler_scale': 512.0, 'train/skipped': 1.0,
         'train/skip.non_finite_loss': 1.0, 'train/skip.non_finite_grad': 0.0}
    """
    row = {f"train/{name}": value for name, value in record.values().items() if value is not None}
    row["train/skipped"] = float(record.skipped)
    for reason in SKIP_REASONS:
        row[f"train/skip.{reason}"] = float(record.reason == reason)
    for name in record.optimizers:  # a guard over several optimizers: which of them skipped
        row[f"train/skipped.{name}"] = float(name in record.skipped_optimizers)
    for name, value in (extra or {}).items():
        if (number := metric_number(value)) is not None:
            row[f"eval/{name}"] = number
    return row


def monitor_metrics(monitor: RunMonitor) -> dict[str, float]:
    """What the run's monitor makes of the steps so far, as tracker metrics.

    Example::

        >>> from ampguard.monitor import RunMonitor
        >>> from ampguard.records import SkipLog, StepLog
        >>> m = RunMonitor(window=4, min_steps=0, scaler_enabled=True, init_scale=1024.0)
        >>> _ = m.observe(StepLog(1, lr=0.1, loss=1.0, grad_l2_pre_clip=0.5, grad_l2_post_clip=0.5,
        ...                       scaler_scale=1024.0))
        >>> _ = m.observe(SkipLog(2, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
        ...                       scaler_scale=512.0, reason="non_finite_grad"))
        >>> monitor_metrics(m)  # doctest: +NORMALIZE_WHITESPACE
        {'monitor/skip_rate': 0.5, 'monitor/clip_rate': 0.0, 'monitor/skip_rate_alert': 1.0,
         'monitor/scale_alert': 0.0, 'monitor/scale_health': 2.0}
    """
    row = {
        "monitor/skip_rate": float(monitor.skip_rate),
        "monitor/clip_rate": float(monitor.clip_window.seen_mean),
        "monitor/skip_rate_alert": float(monitor.alerting),
        "monitor/scale_alert": float(monitor.scale_alerting),
    }
    if monitor.scaler_enabled:
        row["monitor/scale_health"] = float(HEALTH_VERDICTS.index(monitor.health.verdict))
    return row


def run_totals(result: RunResult) -> dict[str, Any]:
    """The run's totals for the tracker's summary: numbers, and words (``scale_health``,
    ``ended``, and under autocast ``float32_under_autocast``: the run card's row, which layers
    autocast left in float32 in the first training forward).

    Example::

        >>> from types import SimpleNamespace
        >>> from ampguard.monitor import RunMonitor
        >>> m = RunMonitor(scaler_enabled=False)
        >>> m.skips["non_finite_loss"] += 1
        >>> totals = run_totals(SimpleNamespace(monitor=m, exit_code=0, ended="finished: 5 steps",
        ...                                     autocast_dtypes={"emb": "float32", "fc": "bfloat16"}))
        >>> totals["skips.non_finite_loss"], totals["skips.non_finite_grad"], totals["scale_health"]
        (1, 0, 'none (no loss scaler)')
        >>> totals["float32_under_autocast"]
        'emb (1 of 2 layers; the others bfloat16)'
    """
    m, dtypes = result.monitor, getattr(result, "autocast_dtypes", None)
    return {
        "steps": m.steps, "updates": m.updates, "skips": sum(m.skips.values()),
        **{f"skips.{reason}": m.skips.get(reason, 0) for reason in SKIP_REASONS},
        "max_skip_rate": m.max_skip_rate, "alert_episodes": m.alert_episodes,
        "scale_health": m.scale_verdict, "exit_code": int(result.exit_code), "ended": result.ended,
        **({"float32_under_autocast": float32_layers_text(dtypes)} if dtypes else {}),
    }


NOTHING_SENT = "this sink logged no step: it ended before the first (a start that was refused, or a sink never written)"
"""A tracker run's ``ended`` when its sink ends it with no step and no run's totals sent."""

NOT_PROCESS_0 = ("this sink logged no step: it was given to process {rank}, and only process 0 logs (build the "
                 "tracker sinks on process 0 alone)")
"""A tracker run's ``ended`` when a framework's loop ended it unused on another process
(:func:`end_unserved`)."""


def end_unserved(sinks: Sequence[Any], rank: int, who: str) -> None:
    """The sinks ``who`` (a framework's loop) was given on process ``rank`` (not 0, which alone
    logs): each tracker sink's run ends at once with an ``ended`` that says so
    (:data:`NOT_PROCESS_0`; it read "a start that was refused, or a sink never written"), and a
    warning says so once; the others (files of yours) are left as they are. Review 48b: sinks
    built on every process left one empty FINISHED run a process on the dashboard, unexplained."""
    trackers = [s for s in sinks if isinstance(s, TrackerSink) and not s._ended]
    for sink in trackers:
        sink._end(0, NOT_PROCESS_0.format(rank=rank))
    if trackers:
        warn(f"{who}: {len(trackers)} tracker sink(s) given to process {rank} were ended unused: only "
             "process 0 logs; build them on process 0 alone (their runs say so in 'ended')", RankWarning)


class TrackerLostWarning(AmpguardWarning):
    """A tracker sink's store or server failed (read-only, full, gone): the sink sends nothing
    more and the run goes on without it (:attr:`TrackerSink.lost`)."""


class TrackerSink:
    """What the two tracker sinks share: a :class:`~ampguard.sinks.Sink` whose step row waits
    until the run's monitor has seen the record too (:meth:`observe`), so each step is one
    tracker call. Without a run loop (your own loop), a row goes out at the next ``write`` or at
    ``close``; in a W&B run you gave it (``WandbSink(run=...)``), which your own ``run.log`` calls
    move on, at its ``write``, the monitor's view after it at the same step.

    In a run (``finish_later=True``) ``close()`` flushes the last row and :meth:`finish` (after
    the run card is written) uploads the artifacts and ends the tracker run; otherwise ``close()``
    ends it.

    A tracker is a view of the run, not the run: a call to it that fails (its store read-only or
    full, its server gone) loses the sink (:attr:`lost`, one :class:`TrackerLostWarning`), which
    sends nothing more; the training, its CSV and checkpoints go on, and its exit code is the
    run's. The tracker run is ended as it can be: FAILED when it lacks steps. Review 50f: a
    read-only MLflow store stopped a 40-step run at step 6 with a traceback (exit 1), and one
    tracker failing at the end left the other's run FAILED and a finished run exit 1. A name the
    tracker refuses (MLflow's rule, your metric's) is still raised at the write that brings it.
    """

    found_earlier: bool | None = None
    """Whether the tracker run was found and continued (a resume), not made; None where the
    tracker cannot tell."""

    def __init__(self, *, finish_later: bool = False) -> None:
        self._pending: tuple[int, dict[str, float]] | None = None
        self._holds = True  # a step's row waits for the monitor's view (False: sent at once, the view after it)
        self._unobserved: int | None = None  # (not held) the step written last, its monitor's view not yet sent
        self._finish_later = finish_later
        self._ended = False
        self._sent = 0  # the highest step this sink sent
        self._low: int | None = None  # the lowest it sent since it began (again)
        # it sent a step or a run's totals, or the run is not its own to speak for (one it continued, which
        # holds steps already; a W&B run you gave it): an ended run with none of these says why it is empty
        self._said = False
        self.lost: str | None = None
        """Why the sink sends nothing more (its tracker failed: :class:`TrackerLostWarning`), or None."""
        self._lost_at: int | None = None  # the first step the tracker run lacks (None: lost at the end, every step in)

    @property
    def where(self) -> str:
        """Where the run goes, in words (a console line when the run opens it)."""
        raise NotImplementedError

    # -- the Sink protocol
    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        if record is None:
            raise TypeError(NONE_WRITTEN)
        if self._ended:  # (as CsvSink: a row written after close() went nowhere, unsaid)
            raise ValueError(f"{type(self).__name__} ({self.where}) is closed: nothing more can be written to it")
        if self.lost is not None:  # (said once, when it was lost)
            return
        # (as CsvSink: a second loop's step 1 went in beside the first's)
        check_step_after(f"{type(self).__name__} ({self.where})", record.step,
                         max(self._sent, self._pending[0] if self._pending is not None else 0),
                         "each step must come after the last one written (a second loop? give it a sink of its own)")
        self._flush()
        self._pending = (record.step, step_metrics(record, extra))
        if not self._holds:
            self._flush()
            self._unobserved = record.step

    def observe(self, monitor: RunMonitor, events: Sequence[Event] = ()) -> None:
        """Add the monitor's view of the step just written, and the events it raised; send the row."""
        if self._pending is not None:
            self._pending[1].update(monitor_metrics(monitor))
        elif self._unobserved is not None:  # (its row went out at its write: the view goes to the same step)
            self._pending = (self._unobserved, monitor_metrics(monitor))
        self._unobserved = None
        for event in events:
            said = event.as_dict()
            self._send(said.get("step"), self._event, said)
        self._flush()

    def begin_again(self, step: int) -> str | None:
        """The loop began again from ``step`` (a Hugging Face ``auto_find_batch_size`` retry):
        the steps after it this sink sent are an abandoned attempt's, and the new attempt's come
        next. MLflow forks (:meth:`MLflowSink._fork`), W&B keeps them (it cannot rewrite a step).
        A line that says which, or ``None`` when this sink sent no step after ``step`` since it
        began (or began again)."""
        self._flush()
        if self._sent <= step or self.lost is not None:  # (a lost sink sends nothing more: nothing to fork)
            return None
        # (the tracker failing here loses the sink, as at any call: review 50l, NotSent escaped the retry)
        said = self._send(step + 1, self._begin_again, step, steps_from(max(step + 1, self._low or 0), self._sent))
        self._sent, self._low = step, None
        return None if self.lost is not None else said

    def close(self) -> None:
        try:
            self._flush()
        finally:  # (a row the tracker refused does not keep the run open)
            if not self._finish_later:
                self._end(0)

    def finish(self, result: RunResult) -> None:
        """Totals to the summary, the run folder's :data:`ARTIFACTS` uploaded, the tracker run
        ended with the exit code: ended even when the totals or the upload fail (a tracker's
        store down), the error raised after."""
        try:
            self._flush()
            if not self._ended and self.lost is None:
                self._said = True
                self._send(None, self._summary, run_totals(result))
                folder = result.paths.dir
                files = [] if folder is None else [
                    path for pattern in ARTIFACTS for path in sorted(folder.glob(pattern)) if path.is_file()]
                if files:
                    self._send(None, self._upload, files)
        finally:
            self._end(int(result.exit_code))

    def _flush(self) -> None:
        pending, self._pending = self._pending, None  # (taken first: a row the tracker refuses is said once)
        if pending is not None and not self._ended and self.lost is None:
            step, row = pending
            sent = self._send(step, self._log, step, row)
            if self.lost is None and sent is not False:  # (False: the tracker held that step already, nothing sent)
                self._said = True
                self._sent = max(self._sent, step)
                self._low = step if self._low is None else min(self._low, step)

    def _end(self, exit_code: int, unsent: str = NOTHING_SENT) -> None:
        """Send the row still held, then end the tracker run (once). A run that got no step and
        no totals (a sink given to a ``train()`` or fit refused at its start, then left open: the
        script ended) is told so in its summary, ``ended`` (``unsent``: why): on a dashboard an
        empty run FINISHED said nothing of why. Not in a run it continued nor one you gave it
        (W&B's ``run=``)."""
        if not self._ended:
            try:
                self._flush()
                if not self._said and self.lost is None:
                    self._send(None, self._summary, {"ended": unsent})
            finally:  # (a row that cannot go out does not keep the run open)
                self._ended = True
                atexit.unregister(self._at_exit)
                if self.lost is None:
                    self._send(None, self._stop, exit_code)
                if self.lost is not None:  # ended as it can be, with no second warning: FAILED if it lacks steps
                    with contextlib.suppress(Exception):
                        self._stop_lost(1 if self._lost_at is not None else exit_code)

    def _send(self, step: int | None, call: Any, *args: Any) -> Any:
        """``call(*args)``, a call to the tracker, unless the sink is :attr:`lost`; one that fails
        loses it (``step``: the step being sent, None at the end), said once."""
        if self.lost is not None:
            return None
        try:
            return call(*args)
        except Exception as err:  # noqa: BLE001 - each tracker's store fails its own way
            self._lose(getattr(err, "step", None) or step, err)  # (a NotSent: the first step not sent)
            return None

    def _lose(self, step: int | None, err: BaseException) -> None:
        """The tracker failed: nothing more is sent to it (what it queued is dropped), said once
        as a :class:`TrackerLostWarning`; the run goes on."""
        self._pending, self._lost_at = None, step
        when = f"stopped taking steps at step {step}" if step is not None else "failed at the run's end"
        self.lost = f"{self.where} {when} ({first_line(err)})"
        with contextlib.suppress(Exception):
            self._abandon(err)
        lacks = (f"the tracker run lacks step {step} and later" if step is not None else
                 "the tracker run may lack the run's totals or files")
        warnings.warn(f"{type(self).__name__}: {self.lost}: the training goes on without it; {lacks}",
                      TrackerLostWarning, stacklevel=2)

    def _at_exit(self) -> None:
        """Registered with ``atexit`` once the run is open, for a loop that never called ``close()``:
        the row still held goes out (after a crash usually the step that matters, the NaN before
        it) and the run ends as the process did: FAILED after an uncaught exception (KILLED after
        Ctrl-C), FINISHED after a script that simply ended. A run you finished yourself (``run=``)
        is left as it is: nothing here may raise at exit."""
        crashed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # (set for an uncaught one)
        with contextlib.suppress(Exception):
            self._end(interrupt_code(crashed) or (1 if crashed is not None else 0))

    # -- what each tracker does
    def _log(self, step: int, row: dict[str, float]) -> bool | None:
        raise NotImplementedError

    def _abandon(self, err: BaseException) -> None:
        """The sink was lost (``err``): drop what it queued for the tracker, without waiting for it."""

    def _stop_lost(self, exit_code: int) -> None:
        """End the tracker run of a lost sink, as far as its store still can (errors ignored)."""
        self._stop(exit_code)

    def _end_incomplete_forks(self, old: Any) -> None:
        """Forks of ``old`` whose history copy a kill cut short (``ampguard.resumed_from`` it, but
        no ``ampguard.run_id`` while ``old`` has one): ended FAILED, tagged, never continued."""
        if RUN_ID_TAG not in old.data.tags:
            return
        for run in self.client.search_runs([old.info.experiment_id],
                                           filter_string=f"tags.`{RESUMED_FROM_TAG}` = '{old.info.run_id}'"):
            if RUN_ID_TAG not in run.data.tags and "ampguard.incomplete_fork" not in run.data.tags:
                self.client.set_tag(run.info.run_id, "ampguard.incomplete_fork",
                                    "its history copy was cut short (a kill): a later fork holds this run's history")
                self.client.set_terminated(run.info.run_id, "FAILED")

    def _end_superseded(self, found: Any) -> None:
        """A run continued that forked from another (``ampguard.resumed_from``): that one is ended
        and points here, as the fork would have left it had it not been killed in between."""
        before = found.data.tags.get(RESUMED_FROM_TAG)
        if before is None:
            return
        try:  # (a mend, best effort: the old run may be deleted, purged or read-only; the resume goes on)
            old = self.client.get_run(before)
            if SUPERSEDED_BY_TAG not in old.data.tags:
                self.client.set_tag(before, SUPERSEDED_BY_TAG, found.info.run_id)
            if old.info.status == "RUNNING":
                self.client.set_terminated(before, "KILLED")
        except Exception:  # noqa: BLE001 - MLflow's own errors vary by store
            return

    def _begin_again(self, step: int, sent: str) -> str:
        """``sent``: the abandoned attempt's steps this sink sent, in words."""
        raise NotImplementedError

    def _event(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    def _summary(self, totals: dict[str, Any]) -> None:
        raise NotImplementedError

    def _upload(self, files: list[Path]) -> None:
        raise NotImplementedError

    def _stop(self, exit_code: int) -> None:
        raise NotImplementedError


class ForkedRunWarning(AmpguardWarning):
    """An :class:`MLflowSink` continued in a new run (:meth:`MLflowSink._fork`): a resume replays
    steps the run it was given already holds."""


def _keep_to_itself(run: Any) -> None:
    """Take a sink's own W&B run out of the runs a later ``wandb.init()`` may return: W&B's
    default (``reinit="return_previous"``) hands back the most recent active run, so a
    framework's own W&B logging started after the sink (Hugging Face's ``report_to="wandb"``,
    Lightning's ``WandbLogger``) got the sink's run: HF's ``wandb.config.update`` raised at the
    start of ``train()`` (the sink's run, made with ``reinit="create_new"``, is not
    ``wandb.run``), Lightning logged into it and the plugin finished it under the logger. The
    sink finishes its run itself (``close``, or at exit). W&B's setup object is internal: a
    version without it leaves the run where it was."""
    try:
        from wandb.sdk import wandb_setup

        wandb_setup.singleton().remove_active_run(run)
    except Exception:  # noqa: BLE001 - an internal of W&B's: without it, the old behaviour
        pass


class WandbSink(TrackerSink):
    """Every step to a Weights & Biases run (``pip install 'ampguard[wandb]'``), at the run's
    own step (``run.log(row, step=record.step)``).

    ``id`` and ``resume="allow"`` continue a W&B run (a run's id is its folder's ``run-id``);
    ``run`` logs into a W&B run you made yourself (then ``close`` leaves it open; a step below
    the step your own ``run.log`` calls took it to is not sent, as W&B refuses it, and a warning
    says so once). Offline
    (``mode="offline"`` or ``WANDB_MODE=offline``) W&B writes ``<dir>/wandb/offline-run-*``,
    uploaded later by ``wandb sync``. The monitor's events (ALERT, CLEAR, FAIL) go to the summary
    (``last_alert``, ``events.<kind>`` counts); the run's totals to the summary at the end (all
    the run's events are in the uploaded ``events.jsonl``).

    Example (offline: nothing leaves the machine)::

        >>> import shutil, tempfile
        >>> from ampguard.records import StepLog
        >>> tmp = tempfile.mkdtemp()
        >>> sink = WandbSink(project="demo", mode="offline", dir=tmp)
        >>> sink.write(StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0,
        ...                    scaler_scale=1.0))
        >>> sink.close()
        >>> [p.suffix for p in Path(tmp, "wandb").glob("offline-run-*/*.wandb")]
        ['.wandb']
        >>> shutil.rmtree(tmp, ignore_errors=True)  # (W&B's service may still be writing its logs)
    """

    def __init__(self, *, project: str = "ampguard", entity: str | None = None, mode: str | None = None,
                 name: str | None = None, group: str | None = None, tags: Sequence[str] = (),
                 dir: str | os.PathLike | None = None, id: str | None = None, resume: str | None = None,
                 config: Mapping[str, Any] | None = None, run: Any = None, finish_later: bool = False) -> None:
        super().__init__(finish_later=finish_later)
        self._own = run is None
        if run is None:
            wandb = _import("wandb", "log.wandb")
            _require_wandb_floor()
            if dir is not None:
                try:
                    Path(dir).mkdir(parents=True, exist_ok=True)
                except OSError as err:  # (what the check up front could not foresee: /proc's, a full disk)
                    raise InputError(f"log.wandb.dir: {shown(dir)} cannot be made: {failed_because(err)}") from None
            try:
                run = wandb.init(
                    project=project, entity=entity, mode=mode, name=name, group=group, tags=list(tags) or None,
                    dir=None if dir is None else str(dir), id=id, resume=resume,
                    config=dict(config) if config is not None else None, reinit="create_new",
                    # ampguard prints its own lines: W&B must not wrap stdout/stderr
                    settings=wandb.Settings(console="off", save_code=False))
            except Exception as err:  # noqa: BLE001 - any failure to start is one line
                first = first_line(err)
                if (mode or os.environ.get("WANDB_MODE") or "online") == "online":  # (no key, no network)
                    first += " (or log the run offline: log.wandb.mode=offline, or WANDB_MODE=offline)"
                raise InputError(f"log.wandb: cannot start a W&B run: {first}") from None
            _keep_to_itself(run)
        self.run = run
        # your run takes your own run.log calls too: a row held for the monitor's view went below the
        # step a loop logging at ampguard's step first took it to, and W&B dropped it (review 52e: every
        # step but the last); sent at its write, the view follows at the same step, which W&B merges
        self._holds = self._own
        self._first = int(getattr(run, "starting_step", 0) or 0)  # a resumed run: the steps W&B already has
        self._said = not self._own or self._first > 0 or bool(getattr(run, "resumed", False))
        self._behind = False  # a step already refused as below your run's own step (said once)
        self._events: dict[str, int] = {}
        atexit.register(self._at_exit)  # the process ends before the sink closed: the last row, the end

    @property
    def where(self) -> str:
        files = getattr(self.run, "dir", None)
        mode = getattr(getattr(self.run, "settings", None), "mode", None) or "online"
        if mode == "disabled":  # (W&B names a folder it never makes: review 50f)
            files = None
        return f"W&B run {getattr(self.run, 'id', '?')} ({mode})" + (f", files in {Path(files).parent}" if files else "")

    def _log(self, step: int, row: dict[str, float]) -> bool:
        if step < self._first:  # W&B refuses (with a warning) a step it already holds
            return False
        if not self._own and step < (held := int(getattr(self.run, "step", 0) or 0)):
            # your run is past this step (your own run.log calls count W&B's steps too): W&B drops
            # a row below its step without a word, so ampguard says it, once
            if not self._behind:
                self._behind = True
                warnings.warn(
                    f"WandbSink: W&B run {getattr(self.run, 'id', '?')} is at step {held} (logged outside this "
                    f"sink), so ampguard's step {step} is not sent, nor any later one below the run's step (W&B "
                    "keeps no step below its current one): log your own metrics at ampguard's step "
                    "(run.log(..., step=record.step)) or give the sink a run of its own", stacklevel=4)
            return False
        self.run.log(row, step=step)
        return True

    def _begin_again(self, step: int, sent: str) -> str:
        """W&B cannot rewrite a step it holds: the abandoned attempt's stay, the new attempt's
        are sent from the step after them (not one refusal warning per step before)."""
        self._first = max(self._first, self._sent + 1)
        return (f"W&B run {getattr(self.run, 'id', '?')} keeps the abandoned attempt's {sent} (W&B cannot rewrite a "
                f"logged step): this attempt's go there from step {self._first}")

    def _event(self, event: dict[str, Any]) -> None:
        kind = str(event.get("event"))
        self._events[kind] = self._events.get(kind, 0) + 1
        self.run.summary[f"events.{kind}"] = self._events[kind]
        if kind.endswith("_alert") or kind == "fail":
            self.run.summary["last_alert"] = f"step {event.get('step')}: {event.get('message')}"

    def _summary(self, totals: dict[str, Any]) -> None:
        self.run.summary.update(totals)

    def _upload(self, files: list[Path]) -> None:
        import wandb

        artifact = wandb.Artifact(f"run-{self.run.id}", type="ampguard-run",
                                  description="the ampguard run card, plot, events, CSV and config")
        for path in files:
            artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact)

    def _stop(self, exit_code: int) -> None:
        if self._own:
            self.run.finish(exit_code=exit_code)

    def _abandon(self, err: BaseException) -> None:
        """W&B's service gone (its connection lost: killed, the OOM killer): W&B's own exit would
        print a traceback of its lost connection after the one warning (review 50g); taken down
        now. Another failure leaves W&B as it is (your other W&B runs share its service)."""
        if isinstance(err, ConnectionError) and self._own:
            import wandb

            wandb.teardown()


class MLflowSink(TrackerSink):
    """Every step to an MLflow run (``pip install 'ampguard[mlflow]'``): one ``log_batch`` per
    step, sent to a tracking server from a thread of the sink's own (:class:`_Sender`), so a
    server's round trip stays out of the training loop; ``close``/``finish`` wait for them all,
    a bounded time. A local store is written synchronously instead: it is a local write.

    The run is found by ``run_id`` (the MLflow run's), else by the tag ``ampguard.run_id`` =
    ``ampguard_run_id`` (the newest run with it: how a resumed run continues its MLflow run),
    else made anew with that tag, ``params`` (flattened, logged once, on a new run) and ``tags``
    (nested under the run of MLflow's fluent API open in this process, ``with
    mlflow.start_run():``, when there is one in the same store: the tag ``mlflow.parentRunId``).
    ``run_id`` naming that open run logs into it and leaves it open at the end, as W&B's
    ``run=`` does: your ``mlflow.end_run()`` ends it.
    A run continued that already holds the first step written (a resume from an older
    checkpoint) is forked at that step (:meth:`_fork`; :attr:`run_id` is then the new run's), so
    the run holds one value per step, as the CSV does. The monitor's events
    set the tags ``ampguard.last_alert`` and ``ampguard.events.<kind>`` (its last step); at the end the run's totals are
    tags and ``summary/*`` metrics, and the run ends FINISHED (exit 0), KILLED (interrupted) or
    FAILED. A ``file:`` store needs ``MLFLOW_ALLOW_FILE_STORE=true`` in MLflow 3: set for this
    process unless you set it yourself.

    Example (a local file store)::

        >>> import tempfile
        >>> from ampguard.records import StepLog
        >>> tmp = tempfile.TemporaryDirectory()
        >>> sink = MLflowSink(tracking_uri=Path(tmp.name).as_uri(), experiment="demo")
        >>> sink.write(StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0,
        ...                    scaler_scale=1.0))
        >>> sink.close()
        >>> [(m.step, m.value) for m in sink.client.get_metric_history(sink.run_id, "train/grad_l2_pre_clip")]
        [(1, 2.0)]
        >>> sink.client.get_run(sink.run_id).info.status
        'FINISHED'
        >>> tmp.cleanup()
    """

    def __init__(self, *, tracking_uri: str | None = None, experiment: str = "ampguard", run_name: str | None = None,
                 tags: Mapping[str, str] | None = None, params: Mapping[str, Any] | None = None,
                 ampguard_run_id: str | None = None, run_id: str | None = None, finish_later: bool = False) -> None:
        super().__init__(finish_later=finish_later)
        self.client = mlflow_client(tracking_uri)
        self._sender: _Sender | None = None  # (a tracking server's: made with the run, below)
        self._names: set[str] = set()  # the metric names of extras and optimizers MLflow was found to take
        remote = urlparse(str(self.client.tracking_uri)).scheme not in ("", "file")
        try:
            found = run_id or self._find(experiment, ampguard_run_id)
            active = self._active_run_id()
            # the run of your `with mlflow.start_run():` named as run_id is yours to end, as W&B's run=
            self._yours = found is not None and found == active
            nested = {"mlflow.parentRunId": active} if active is not None and found is None else {}
            self.run_id = found or self._create(
                experiment, run_name,
                {**nested, **(tags or {}), **({RUN_ID_TAG: ampguard_run_id} if ampguard_run_id else {})}, params)
            # a run continued: back to RUNNING; the status it had is kept in case the first write forks it
            continued = self.client.get_run(found) if found else None
            self._continued: str | None = continued.info.status if continued else None
            self._said = bool(found)
            self.found_earlier = found is not None
            if continued is not None:
                self._end_superseded(continued)
                self.client.update_run(found, status="RUNNING")
        except InputError:
            raise
        except Exception as err:  # noqa: BLE001 - the store refused: one line
            raise InputError(f"log.mlflow: {first_line(err)}") from None
        if remote:  # a server's round trips go on a thread of the sink's own (a local store is a local write)
            self._sender = _Sender()
        atexit.register(self._at_exit)  # the process ends before the run did: not left RUNNING

    @property
    def where(self) -> str:
        return f"MLflow run {self.run_id} at {self.client.tracking_uri}"

    def _check_name(self, key: str) -> None:
        """A metric name MLflow takes, or a ``ValueError`` naming it (MLflow's own rule)."""
        try:
            from mlflow.utils.validation import _validate_metric_name
        except ImportError:  # (another MLflow: its error comes when the row is sent)
            return
        try:
            _validate_metric_name(key)
        except Exception as err:  # noqa: BLE001 - MlflowException
            raise ValueError(f"{type(self).__name__} ({self.where}): {first_line(err)}") from None
        if len(key) > MAX_METRIC_NAME:  # (MLflow's stores refuse it only when sent: the sink was lost, review 50g)
            raise ValueError(f"{type(self).__name__} ({self.where}): the metric name {shown(key)} is {len(key)} "
                             f"characters, MLflow takes at most {MAX_METRIC_NAME}")

    def _active_run_id(self) -> str | None:
        """The run of MLflow's fluent API open in this process (``mlflow.start_run()``) when it is
        in this sink's store, else ``None``."""
        fluent = sys.modules.get("mlflow")
        active = fluent.active_run() if fluent is not None and hasattr(fluent, "active_run") else None
        if active is None:
            return None
        try:
            self.client.get_run(active.info.run_id)  # (run ids are unique: found here, it is this store's)
        except Exception:  # noqa: BLE001 - another store's run
            return None
        return active.info.run_id

    def _find(self, experiment: str, ampguard_run_id: str | None) -> str | None:
        if ampguard_run_id is None:
            return None
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            return None
        # the newest: a fork (below) leaves the run it supersedes behind with the same tag
        runs = self.client.search_runs([exp.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{ampguard_run_id}'",
                                       order_by=["attributes.start_time DESC"], max_results=1)
        return runs[0].info.run_id if runs else None

    def _experiment_id(self, experiment: str) -> str:
        """The experiment's id, made if there is none. Another process may make it between the
        look and the making (several processes' sinks opening together: "Experiment 'e' already
        exists"): then it is looked up again."""
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(experiment)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(experiment)
        except MlflowException:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:  # (not the race: the store's own refusal)
                raise
            return exp.experiment_id

    def _create(self, experiment: str, run_name: str | None, tags: dict[str, str],
                params: Mapping[str, Any] | None) -> str:
        from mlflow.entities import Param

        exp_id = self._experiment_id(experiment)
        run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        flat = [Param(k, str(v)[:6000]) for k, v in flatten(params or {}).items()]
        for i in range(0, len(flat), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(run_id, params=flat[i:i + 100])
        return run_id

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        # (refused at the write that brings it, before anything is held: a name MLflow refused at the next
        # write's flush lost that row and this one, at every step, and the run ended FINISHED and empty)
        keys = {f"eval/{name}" for name in (extra or {})} | {f"train/skipped.{name}" for name in record.optimizers}
        for key in keys - self._names:
            self._check_name(key)
            self._names.add(key)
        if self._continued is not None:  # the first step written to a run continued: is it there already?
            status, self._continued = self._continued, None
            # (its store gone: the sink is lost here, as at any other call; review 50g, a traceback, exit 1)
            self._send(record.step, self._continue_at, record.step, status)
        super().write(record, extra)

    def _continue_at(self, step: int, status: str) -> None:
        """The first step written to a run continued: fork it if it holds that step already
        (:meth:`_fork`); say so once if it lacks steps before it (a tracker lost in an earlier
        part of the run: review 50g, the resume ended the run FINISHED over the gap, unsaid)."""
        held = self.client.get_metric_history(self.run_id, "train/skipped")  # (logged at every step)
        last = max((m.step for m in held), default=0)
        if held and last >= step:
            self._fork(step - 1, status)
            return
        if held and last < step - 1:
            warnings.warn(f"MLflow run {self.run_id} holds steps up to {last} only: steps {last + 1} to {step - 1} "
                          "are not in it (its tracker was lost, or the run logged elsewhere then); the CSV holds them",
                          TrackerLostWarning, stacklevel=4)
        if "ampguard.ended" in self.client.get_run(self.run_id).data.tags:  # (an earlier end's, until this one's)
            self.client.set_tag(self.run_id, "ampguard.ended", "running again (resumed): the other ampguard.* "
                                "totals are an earlier end's until this run ends")

    def _fork(self, through: int, status: str) -> None:
        """Continue in a new MLflow run holding the current one's history through step
        ``through``: a resume from a checkpoint older than the run's last step replays steps the
        run already holds, and MLflow can append a metric value but not delete one (mlflow#2973),
        so logging on in the same run would leave two values at each replayed step.

        The new run gets the old one's name, params, tags (not ``ampguard.*`` ones: the totals
        and alerts of the old run's end; the ``ampguard.run_id`` tag is kept, and a later resume
        finds the newest run with it), ``ampguard.resumed_from`` (the old run's id) and
        ``ampguard.resumed_at`` (``through``), and every metric value at steps up to ``through``
        with its timestamp (``summary/*`` not: they are the old end's). The old run keeps its
        history (the set-aside steps, as the checkpoints after the resumed one are set aside),
        gets ``ampguard.superseded_by`` and the status it had (``KILLED`` if it was still
        ``RUNNING``: its process was killed). Cost: one read and a ``log_batch`` per 1000 values
        of the history, once.

        A kill while the history is copied leaves a fork a later resume must not continue (it
        held steps 301-600 of a 600-step run, the old run RUNNING for ever): the new run gets
        ``ampguard.run_id`` only once its history is whole, so until then the old run is the
        one found, and the next fork of it ends such a leftover FAILED
        (``ampguard.incomplete_fork``). A kill after that, before the old run was ended, is
        mended when the new run is continued (:meth:`_end_superseded`)."""
        from mlflow.entities import Metric, Param

        old = self.client.get_run(self.run_id)
        tags = {k: v for k, v in old.data.tags.items() if not k.startswith("ampguard.")}
        tags.update({RESUMED_FROM_TAG: old.info.run_id, RESUMED_AT_TAG: str(through)})
        self._end_incomplete_forks(old)
        new = self.client.create_run(old.info.experiment_id, run_name=old.info.run_name, tags=tags).info.run_id
        params = [Param(k, v) for k, v in old.data.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(new, params=params[i:i + 100])
        for key in sorted(old.data.metrics):
            if key.startswith("summary/"):
                continue
            kept = [Metric(key, m.value, m.timestamp, m.step)
                    for m in self.client.get_metric_history(old.info.run_id, key) if m.step <= through]
            for i in range(0, len(kept), 1000):  # and at most 1000 metric values
                self.client.log_batch(new, metrics=kept[i:i + 1000])
        if RUN_ID_TAG in old.data.tags:  # (whole now: a resume finds it from here on)
            self.client.set_tag(new, RUN_ID_TAG, old.data.tags[RUN_ID_TAG])
        self.client.set_tag(old.info.run_id, SUPERSEDED_BY_TAG, new)
        self.client.set_terminated(old.info.run_id, "KILLED" if status == "RUNNING" else status)
        self.run_id, self._yours = new, False
        # said: a loop that passed run_id= otherwise writes to another run than it named, unaware
        warnings.warn(f"MLflow run {old.info.run_id} already holds step {through + 1}: continuing in a new run {new} "
                      f"(its history through step {through}; MLflow cannot delete logged values); sink.run_id is "
                      "the new one", ForkedRunWarning, stacklevel=3)

    def _begin_again(self, step: int, sent: str) -> str:
        """Fork (:meth:`_fork`): a new run with the history through ``step``; the old one, the
        abandoned attempt's, ends FAILED (it ran out of memory) with ``ampguard.superseded_by``."""
        self._wait()  # (the history read below holds every step sent)
        old = self.run_id
        self._fork(step, "FAILED")
        return (f"MLflow run {old} keeps the abandoned attempt's {sent} and ends FAILED: "
                f"this attempt goes on in a new run {self.run_id} (the history through step {step})")

    def _log(self, step: int, row: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, step) for key, value in row.items()]
        if self._sender is None:
            self.client.log_batch(self.run_id, metrics=metrics)
        else:  # (what failed or stalled there since the last step is raised here: the sink is lost)
            self._sender.send(step, functools.partial(self.client.log_batch, self.run_id, metrics=metrics))

    def _wait(self) -> None:
        """Every step handed to the sender sent (within :data:`END_WAIT_S`), else what stopped it
        raised: the sink is lost at the first step not sent (review 50g: a server that stopped
        taking steps ended the run FINISHED with 19 of 30 steps missing)."""
        if self._sender is not None:
            self._sender.drain(END_WAIT_S)

    def _abandon(self, err: BaseException) -> None:
        if self._sender is not None:
            self._sender.stop()

    def _stop_lost(self, exit_code: int) -> None:
        """A lost run ends FAILED (or with ``exit_code``, lost at the end) if its store takes it:
        a server with :func:`reach_server`'s bounded retries, not MLflow's four minutes."""
        if self._yours:
            return
        if urlparse(str(self.client.tracking_uri)).scheme not in ("http", "https"):
            self.client.set_terminated(self.run_id, _run_status(exit_code))
            return
        _bounded_request(self.client, "/api/2.0/mlflow/runs/update", {
            "run_id": self.run_id, "status": _run_status(exit_code), "end_time": int(time.time() * 1000)})

    def _event(self, event: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        kind, step = str(event.get("event")), event.get("step")
        tags = [RunTag(f"ampguard.events.{kind}", str(step))]
        if kind.endswith("_alert") or kind == "fail":
            tags.insert(0, RunTag("ampguard.last_alert", f"step {step}: {event.get('message')}"[:5000]))
        if self._sender is None:
            self.client.log_batch(self.run_id, tags=tags)
        else:  # (a server's round trip off the training's thread, as the steps': an ALERT to a dead server
            # held the step for MLflow's retries)
            self._sender.send(step if isinstance(step, int) else self._sent,
                              functools.partial(self.client.log_batch, self.run_id, tags=tags))

    def _summary(self, totals: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric, RunTag

        self._wait()
        now = int(time.time() * 1000)
        # at the run's last step: a resume that continues the run adds its totals after the earlier
        # part's, not beside them at step 0 (review 52e: summary/steps held 23 and 40 at one step)
        last = max(self._sent, totals["steps"] if whole_number(totals.get("steps")) else 0)
        numbers = [Metric(f"summary/{k}", float(v), now, last) for k, v in totals.items()
                   if finite_number(v)]
        tags = [RunTag(f"ampguard.{k}", str(v)[:5000]) for k, v in totals.items()]
        self.client.log_batch(self.run_id, metrics=numbers, tags=tags)

    def _upload(self, files: list[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def _stop(self, exit_code: int) -> None:
        self._wait()
        if self._yours:  # (your `with mlflow.start_run()` ends it)
            return
        self.client.set_terminated(self.run_id, _run_status(exit_code))


def _run_status(exit_code: int) -> str:
    """The status an MLflow run ends with for the run's exit code: FINISHED (0), KILLED (an
    interrupt: 130, 141, 143), FAILED (any other).

    Example::

        >>> _run_status(0), _run_status(143), _run_status(3)
        ('FINISHED', 'KILLED', 'FAILED')
    """
    return "FINISHED" if exit_code == 0 else "KILLED" if exit_code in (130, 141, 143) else "FAILED"


END_WAIT_S = 120.0
"""How long :meth:`MLflowSink` waits at the run's end for the steps its sender still holds
before the sink is lost (:class:`TrackerLostWarning`) and the process goes on to exit."""


class NotSent(Exception):
    """What stopped a :class:`_Sender`: the call that failed (``__cause__``) or stalled, and the
    first step the tracker run lacks (``step``, which :meth:`TrackerSink._lose` names)."""

    def __init__(self, message: str, step: int | None) -> None:
        super().__init__(message)
        self.step = step


class _Sender:
    """An MLflow sink's calls to a tracking server, made in order on a daemon thread of its own
    (review 50g): MLflow's own background logger held up to 256 steps, stalled the training when
    full (a server killed mid-run: about four minutes a request with MLflow's retries) and held
    the process's exit while it retried them all. Here a call that fails stops the sending, and
    :meth:`send` raises it at the next step (:class:`NotSent`, naming the first step not sent);
    one under way for more than :data:`STALL_S` is raised alike (the server stopped answering);
    at most :data:`MAX_QUEUED` steps wait. Being a daemon, it never holds the process's exit.

    Example (a call that fails: the next step raises it, naming the first step not sent)::

        >>> sender = _Sender()
        >>> def refused():
        ...     raise ConnectionError("Connection refused")
        >>> sender.send(1, lambda: None); sender.send(2, refused); sender.drain(5)
        Traceback (most recent call last):
        ...
        ampguard.integrations.trackers.NotSent: step 2 was not sent: Connection refused
    """

    def __init__(self) -> None:
        import queue
        import threading

        self._queue: queue.Queue[tuple[int, Callable[[], Any]] | None] = queue.Queue()
        self._lock = threading.Condition()
        self._waiting = 0  # calls handed over and not done
        self._busy: tuple[int, float] | None = None  # (the step of the call under way, since when)
        self.failed: NotSent | None = None
        threading.Thread(target=self._run, name="ampguard-mlflow", daemon=True).start()

    def send(self, step: int, call: Callable[[], Any]) -> None:
        """Hand ``call`` (step ``step``'s) to the thread, once what stopped it, if anything, is raised."""
        self.check()
        if self._waiting >= MAX_QUEUED:
            self.failed = NotSent(f"{MAX_QUEUED} steps wait for the tracking server, which is not keeping up",
                                  self._first_unsent(step))
            raise self.failed
        with self._lock:
            self._waiting += 1
        self._queue.put((step, call))

    def check(self) -> None:
        """Raise what stopped the sending (:class:`NotSent`), or a call under way past :data:`STALL_S`."""
        if self.failed is not None:
            raise self.failed
        busy = self._busy
        if busy is not None and time.monotonic() - busy[1] > STALL_S:
            self.failed = NotSent(f"step {busy[0]} was not sent: the tracking server has not answered for "
                                  f"{STALL_S:g} s", busy[0])
            raise self.failed

    def drain(self, timeout: float) -> None:
        """Until every call handed over is done (then what stopped the sending, if anything, is
        raised), or ``timeout`` seconds: then a :class:`NotSent` naming the first step not sent."""
        with self._lock:
            self._lock.wait_for(lambda: self._waiting == 0 or self.failed is not None, timeout=timeout)
        self.check()
        if self._waiting:
            self.failed = NotSent(f"the tracking server took {counted(self._waiting, 'step')} not in {timeout:g} s",
                                  self._first_unsent(None))
            raise self.failed

    def _first_unsent(self, default: int | None) -> int | None:
        """The first step not sent: the call under way's, else the oldest waiting, else ``default``."""
        busy, waiting = self._busy, [item for item in list(self._queue.queue) if item is not None]
        return busy[0] if busy is not None else waiting[0][0] if waiting else default

    def stop(self) -> None:
        """Send nothing more: what waits is dropped (the thread ends after the call under way)."""
        if self.failed is None:
            self.failed = NotSent("the sink was lost", None)
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, call = item
            if self.failed is None:
                self._busy = (step, time.monotonic())
                try:
                    call()
                except BaseException as err:  # noqa: BLE001 - raised in the training's thread, at its next step
                    failed = NotSent(f"step {step} was not sent: {first_line(err)}", step)
                    failed.__cause__ = err
                    self.failed = failed
                finally:
                    self._busy = None
            with self._lock:
                self._waiting -= 1
                self._lock.notify_all()


MAX_METRIC_NAME = 250
"""The longest metric name MLflow's stores take (its ``MAX_ENTITY_KEY_LENGTH``)."""
STALL_S = 120.0
"""How long one call to a tracking server may take before the MLflow sink is lost (MLflow's own
retries for a server gone take about four minutes a request)."""
MAX_QUEUED = 10_000
"""The most steps an MLflow sink holds for a tracking server that is not keeping up."""


DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
"""MLflow tracking URIs whose store is a database (MLflow's SQLAlchemy store)."""


def mlflow_client(tracking_uri: str | None) -> Any:
    """An ``MlflowClient`` for ``tracking_uri`` whose store has been reached (a bad URI, a store
    MLflow cannot open, a missing SQLAlchemy: one :class:`InputError` line). A ``file:`` URI (or
    a plain path) sets ``MLFLOW_ALLOW_FILE_STORE=true`` unless it is set already: MLflow 3
    refuses its file store without it.

    Example::

        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> type(mlflow_client(Path(tmp.name).as_uri())._tracking_client.store).__name__
        'FileStore'
        >>> mlflow_client("nosuchscheme://x")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: log.mlflow: cannot open the tracking store nosuchscheme://x: ...
        >>> tmp.cleanup()
    """
    mlflow = _import("mlflow", "log.mlflow")
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or mlflow.get_tracking_uri()
    scheme = urlparse(uri).scheme.partition("+")[0]
    if scheme in ("", "file") or Path(uri).is_absolute():  # MLflow's file store
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    elif scheme in DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        default = " (MLflow's default)" if tracking_uri is None else ""
        raise InputError(f"log.mlflow: the tracking store {uri}{default} is a database, which MLflow opens with "
                         "SQLAlchemy: pip install sqlalchemy alembic, or set log.mlflow.tracking_uri=file:./mlruns "
                         "(a folder)")
    file_store = scheme in ("", "file") or Path(uri).is_absolute()
    for attempt in (1, 2):
        try:
            client = MlflowClient(tracking_uri=uri)
            client._tracking_client.store  # noqa: B018 - opens the store now, so a bad one is bad input
            break
        except Exception as err:  # noqa: BLE001 - MLflow's many errors, one line
            if attempt == 1 and file_store and "exists" in str(err):  # (another process making the same new
                time.sleep(0.2)  # store, its default experiment's meta.yaml: "exists as"; whole a moment later)
                continue
            raise InputError(f"log.mlflow: cannot open the tracking store {uri}: {first_line(err)}") from None
    return client


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``a.b.c`` keys (lists kept whole).

    Example::

        >>> flatten({"steps": 3, "log": {"dir": "runs", "wandb": None}, "inject": ["nan_loss@3"]})
        {'steps': 3, 'log.dir': 'runs', 'log.wandb': None, 'inject': ['nan_loss@3']}
    """
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


# ---------------------------------------------------------------------------- in a run


PROBE_RETRIES, PROBE_TIMEOUT_S = 2, 10
"""How hard :func:`reach_server` tries, where the user has not set MLflow's own
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT`` (7 retries and 120 s: about
four minutes before an address nobody answers is refused)."""


def _env_count(name: str, default: int) -> int:
    """The whole number >= 0 the environment variable ``name`` holds (MLflow reads it as one too),
    ``default`` when unset; else one :class:`InputError` line (it was a traceback).

    Example::

        >>> import unittest.mock
        >>> with unittest.mock.patch.dict(os.environ, {"MLFLOW_HTTP_REQUEST_TIMEOUT": "1.5"}):
        ...     _env_count("MLFLOW_HTTP_REQUEST_TIMEOUT", 10)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: MLFLOW_HTTP_REQUEST_TIMEOUT=1.5 is not a whole number >= 0 (MLflow reads it as one)
    """
    given = os.environ.get(name)
    if given is None:
        return default
    try:
        value = int(given)
    except ValueError:
        value = -1
    if value < 0:
        raise InputError(f"{name}={given} is not a whole number >= 0 (MLflow reads it as one)")
    return value


def reach_server(client: Any) -> None:
    """A tracking server (an ``http``/``https`` store) answers one request, before the run writes
    anything; else one :class:`InputError` line. The store objects of a URI are made without a
    request, so an address nobody answers otherwise fails only at the run's first call, after the
    run folder was made. Other stores (files, a database) opened in :func:`mlflow_client`. The
    request's retries and timeout are its own arguments (the user's ``MLFLOW_HTTP_REQUEST_*``
    when set, else :data:`PROBE_RETRIES`, :data:`PROBE_TIMEOUT_S`): the environment is left alone.

    Example::

        >>> import tempfile
        >>> tmp = tempfile.TemporaryDirectory()
        >>> reach_server(mlflow_client(Path(tmp.name).as_uri()))  # a file store: nothing to reach
        >>> tmp.cleanup()
    """
    uri = client.tracking_uri
    if urlparse(uri).scheme not in ("http", "https"):
        return
    try:
        _bounded_request(client, "/api/2.0/mlflow/experiments/search", {"max_results": 1}).raise_for_status()
    except Exception as err:  # noqa: BLE001 - refused, timed out, not an MLflow server: one line
        raise InputError(f"log.mlflow: cannot reach the tracking server {uri}: {first_line(err)}") from None


def _bounded_request(client: Any, endpoint: str, body: dict[str, Any]) -> Any:
    """One POST to ``client``'s tracking server with bounded retries and timeout (the user's
    ``MLFLOW_HTTP_REQUEST_*`` when set, else :data:`PROBE_RETRIES`, :data:`PROBE_TIMEOUT_S`),
    passed as the request's own arguments: the environment is left alone. Its response."""
    from mlflow.utils.rest_utils import http_request

    return http_request(client._tracking_client.store.get_host_creds(), endpoint, "POST",
                        max_retries=_env_count("MLFLOW_HTTP_REQUEST_MAX_RETRIES", PROBE_RETRIES),
                        timeout=_env_count("MLFLOW_HTTP_REQUEST_TIMEOUT", PROBE_TIMEOUT_S), json=body)


def check_trackers(config: Config) -> None:
    """Before a run writes anything: the packages of the trackers ``config.log`` asks for are
    installed and (rank 0, the one that logs) MLflow's tracking store opens; else one
    :class:`InputError` line, on every rank under torchrun (``distributed.first_error``).

    Example::

        >>> from ampguard.config import validate
        >>> check_trackers(validate({}))  # none asked for: nothing to check
    """
    if config.log.wandb is None and config.log.mlflow is None:
        return
    from .. import distributed

    problem = None
    try:
        if config.log.wandb is not None:
            require("wandb", "log.wandb")
            _require_wandb_floor()
            folder = config.log.wandb.dir
            blocked = None if folder is None else _not_a_folder(folder)
            if blocked is not None:  # (a path through a file was a traceback at the mkdir, a folder left behind)
                raise InputError(f"log.wandb.dir: {blocked} (W&B keeps its files in <dir>/wandb/)")
        if config.log.mlflow is not None:
            require("mlflow", "log.mlflow")
            if distributed.current().is_main:
                reach_server(mlflow_client(config.log.mlflow.tracking_uri))
    except InputError as err:
        problem = str(err)
    problem = distributed.first_error(problem)
    if problem is not None:
        raise InputError(problem)


def _not_a_folder(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` cannot be W&B's folder (made with its parents if missing), or None: it
    holds a NUL character; or :func:`~ampguard.errors.unwritable`: ``mkdir -p`` cannot make or
    reach it (a file, a link to nothing or a loop on the way, walked as the OS walks it), or no
    file can be made in a folder it would make something in (the folder itself when it exists),
    tried with a real file, as the Lightning plugin's ``csv=`` and the Hugging Face callback's
    ``out_dir`` are (``os.access`` let root through on ``/proc``: a traceback from the sink's
    ``mkdir``, after the run folder was made).

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp()).resolve(); _ = (root / "afile").write_text("")
        >>> _not_a_folder(root / "new" / "deeper"), _not_a_folder(root)
        (None, None)
        >>> [_not_a_folder(p).replace(str(root), "ROOT") for p in (root / "afile", root / "afile" / "sub")]
        ['ROOT/afile is a file, not a folder', 'ROOT/afile/sub lies under ROOT/afile, a file, not a folder']
        >>> _not_a_folder("a\\0b")
        'the path holds a NUL character'
        >>> shutil.rmtree(root)
    """
    if "\0" in os.fspath(folder):
        return "the path holds a NUL character"
    return unwritable(Path(folder))


def build_trackers(config: Config, paths: RunPaths, *, resuming: bool) -> list[TrackerSink]:
    """The tracker sinks ``config.log`` asks for, for the run folder ``paths`` (rank 0's; a run
    without a folder, a demo or another rank, gets none). Each continues the tracker run of the
    folder's ``run-id`` when there is one (``resuming``: W&B resumes it, or makes it); the run's
    end (:meth:`TrackerSink.finish`) is the Trainer's to call.

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.run_folder import RunPaths
        >>> build_trackers(validate({"log": {"wandb": True, "mlflow": True}}), RunPaths(), resuming=False)
        []
    """
    if paths.dir is None:
        return []
    run_id, settings = paths.run_id(), config.model_dump(mode="json")
    trackers: list[TrackerSink] = []
    if config.log.wandb is not None:
        w = config.log.wandb
        trackers.append(WandbSink(
            project=w.project, entity=w.entity, mode=w.mode, name=w.name or paths.dir.name, group=w.group,
            tags=w.tags, dir=w.dir or paths.dir, id=run_id, resume="allow" if run_id else None, config=settings,
            finish_later=True))
    if config.log.mlflow is not None:
        m = config.log.mlflow
        try:
            trackers.append(MLflowSink(
                tracking_uri=m.tracking_uri, experiment=m.experiment, run_name=m.run_name or paths.dir.name,
                tags=m.tags, params=settings, ampguard_run_id=run_id, finish_later=True))  # params: a new run's
        except BaseException as err:  # the W&B run opened above ends with the run, which ends here
            end_trackers(trackers, err)
            raise
    return trackers


def interrupt_code(err: BaseException | None) -> int | None:
    """The exit code of a stop signal that ended a run (:class:`~ampguard.signals.Interrupted`
    carries its own: 143 for a start-up SIGTERM; any other ``KeyboardInterrupt`` is Ctrl-C's 130),
    also one Python wrapped on its way out or one an error was raised while handling; None for
    anything else.

    Example::

        >>> from ampguard.signals import Interrupted
        >>> interrupt_code(Interrupted(ExitCode.TERMINATED)), interrupt_code(KeyboardInterrupt()), interrupt_code(None)
        (143, 130, None)
        >>> try:  # (a sink that failed while the run closed after a start-up SIGTERM)
        ...     try:
        ...         raise Interrupted(ExitCode.TERMINATED)
        ...     except KeyboardInterrupt:
        ...         raise OSError("the disk went away")
        ... except OSError as err:
        ...     interrupt_code(err)
        143
    """
    for e in (err, getattr(err, "__cause__", None), getattr(err, "__context__", None)):
        if isinstance(e, KeyboardInterrupt):  # (an Interrupted carries its exit_code)
            return int(getattr(e, "exit_code", ExitCode.INTERRUPTED))
    return None


def end_trackers(trackers: Sequence[TrackerSink], err: BaseException) -> None:
    """End the tracker runs of a run that ends with ``err`` before its first step: FAILED (or
    KILLED after a Ctrl-C), each with what it has, rather than left running until the process exits."""
    code = interrupt_code(err) or (ExitCode.DISK_FULL if isinstance(err, DiskFull) else ExitCode.BAD_INPUT)
    for tracker in trackers:
        tracker._end(int(code))


class Outcome:
    """What :meth:`TrackerSink.finish` reads of a run's result (``monitor``, ``exit_code``,
    ``ended``, ``paths``, ``autocast_dtypes``) for a loop that is not ``ampguard train``'s (a
    Lightning fit, a Hugging Face ``train()``): ``folder`` is where its files are (their
    :data:`ARTIFACTS` are uploaded), or None (none); ``autocast_dtypes`` each leaf module's output
    dtype in the first training forward under autocast (``watch.recording_dtypes``), if noted."""

    def __init__(self, monitor: RunMonitor, exit_code: int, ended: str, folder: Path | None = None,
                 autocast_dtypes: dict[str, str] | None = None) -> None:
        from ..run_folder import RunPaths

        self.monitor, self.exit_code, self.ended, self.paths = monitor, exit_code, ended, RunPaths(dir=folder)
        self.autocast_dtypes = dict(autocast_dtypes or {})


def end_sinks(sinks: Sequence[Any], outcome: Outcome) -> None:
    """Close every sink a framework's loop was given, a tracker sink first finished with the
    loop's ``outcome`` (totals, artifacts, its run ended with the exit code). One that fails does
    not keep the others open: the first error is raised after they are all closed.

    Example::

        >>> from ampguard.monitor import RunMonitor
        >>> class Shown:
        ...     def __init__(self, name, fails=False, upload_fails=False):
        ...         self.name, self.fails, self.upload_fails = name, fails, upload_fails
        ...     def finish(self, outcome):
        ...         print(self.name, "finished:", outcome.exit_code, outcome.ended)
        ...         if self.upload_fails:
        ...             raise OSError(f"{self.name}'s upload failed")
        ...     def close(self):
        ...         print(self.name, "closed")
        ...         if self.fails:
        ...             raise OSError(f"{self.name} cannot close")
        >>> end_sinks([Shown("a"), Shown("b")], Outcome(RunMonitor(), 3, "stopped by a guard"))
        a finished: 3 stopped by a guard
        a closed
        b finished: 3 stopped by a guard
        b closed
        >>> try:
        ...     end_sinks([Shown("a", fails=True), Shown("b")], Outcome(RunMonitor(), 1, "crashed"))
        ... except OSError as err:
        ...     print("raised:", err)
        a finished: 1 crashed
        a closed
        b finished: 1 crashed
        b closed
        raised: a cannot close
        >>> try:  # a finish that fails: the sink is closed all the same
        ...     end_sinks([Shown("a", upload_fails=True)], Outcome(RunMonitor(), 0, "finished"))
        ... except OSError as err:
        ...     print("raised:", err)
        a finished: 0 finished
        a closed
        raised: a's upload failed
    """
    errors: list[Exception] = []
    for sink in sinks:
        try:
            try:
                if hasattr(sink, "finish"):  # a tracker sink: totals to its run, which ends with the code
                    sink.finish(outcome)
            finally:
                sink.close()  # (closed even when its finish failed)
        except Exception as err:  # noqa: BLE001 - raised below, once the others are closed
            errors.append(err)
    if errors:
        raise errors[0]
