"""The guarded step inside PyTorch Lightning's own loop: ``AmpGuardPlugin``, a precision plugin.

``pip install 'ampguard[lightning]'``. Two lines in an existing script::

    from ampguard.integrations.lightning import AmpGuardPlugin
    trainer = L.Trainer(..., plugins=[AmpGuardPlugin("16-mixed", max_norm=1.0, csv="steps.csv")])

(no ``precision=`` and no ``gradient_clip_val=`` on the Trainer: the plugin is the precision and
does the clipping). Lightning's automatic optimization then runs ampguard's :class:`~ampguard.Guard`
step (docs/design.md §2) on every micro-batch and optimizer step:

=======================  ===================================================================
Lightning calls          the plugin does
=======================  ===================================================================
``forward_context``      autocast (fp16 / bf16) around ``training_step`` (and val/test/predict)
``backward``             ``guard.backward(loss)``: the loss checked on the device before
                         backward (a non-finite one seeds no gradient), scaled, backward
``optimizer_step``       the closure (forward + backward), ``guard.unscale_()``, the
                         ``on_before_optimizer_step`` hooks (unscaled gradients, as Lightning's
                         ``MixedPrecision``), then ``guard.step(close=True)``: global L2 norm pre- and
                         post-clip, skip on a non-finite loss or gradient, ``scaler.update()``
                         every step; one record to the sinks, the monitor and ``self.log``
``lr_scheduler_step``    held on a skipped step (``interval="step"`` schedulers), so the LR
                         schedule counts applied updates (Lightning#18828); an
                         ``interval="epoch"`` one held after an epoch that applied no update
=======================  ===================================================================

The skip-rate alarm is ampguard's :class:`~ampguard.monitor.RunMonitor`: with ``fail_rate``
set, the trainer is stopped at the failing step (``trainer.should_stop = True``, with the
Trainer's ``min_steps`` / ``min_epochs`` set aside for the rest of the fit: Lightning would
otherwise train on to them) and :attr:`AmpGuardPlugin.stop_reason` says why.
``accumulate_grad_batches=N`` gives one record per optimizer step (the short group Lightning
steps at an epoch's end too); the guard takes N from the Trainer at each group's start, so a
``GradientAccumulationScheduler`` that changes it between epochs is followed.

The sinks (``csv=`` and ``sinks=[...]``) are the fit's: written on rank 0, the tracker sinks
(:class:`~ampguard.integrations.trackers.WandbSink`, :class:`~ampguard.integrations.trackers.MLflowSink`)
also given the monitor's view of each step, and all closed when the fit ends, a tracker run
with the fit's outcome (``TrackerSink.finish``: exit code 0, 3 for a guard's stop, 1 for a
crash, 130 for Ctrl-C, 143 for SIGTERM, as ``ampguard train``).

Not covered: Fabric (``L.Fabric`` is your own loop: put :class:`~ampguard.Guard`'s verbs in it),
strategies that own the backward or the step (DeepSpeed, FSDP's mixed precision), LBFGS, fused
optimizers that unscale themselves, accumulation in manual optimization (the guard steps once
per ``manual_backward``). A ``LightningModule.backward`` override, and ``manual_backward``'s
arguments (``retain_graph=True``), are honoured: the override is handed the scaled loss with the
guard's check in its graph (``Guard.backward(backward=...)``), as Lightning's ``MixedPrecision``
hands it the scaled loss. (A ``training_step`` returning ``None`` is Lightning's no-update step: counted, no
record; so is the step of a backward Lightning skips itself, ``StochasticWeightAveraging``'s last
epoch, whose weights stay SWA's average. A group an epoch ends inside, ``on_train_batch_start``
returning -1, is dropped, warned, as Lightning drops it; README.md.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
    from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
    from lightning.pytorch.plugins.precision import Precision as _LightningPrecision
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
    from lightning.pytorch.trainer.states import TrainerStatus
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.exceptions import SIGTERMException, _TunerExitException
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
except ImportError as err:  # pragma: no cover - the extra is installed in the test environment
    raise ImportError("ampguard.integrations.lightning needs PyTorch Lightning: "
                      "pip install 'ampguard[lightning]'") from err

import torch
from torch import Tensor

from .. import distributed
from ..errors import (MAX_PATH_SHOWN, AmpguardWarning, ExitCode, InputError, called_by_user, counted, failed_because,
                      folder_problem, looked_at, shortened, shown, unwritable, warn_each_time, what_is, whole_number)
from ..monitor import RunMonitor
from ..precision import (GRADSCALER_KEYS, GuardedGradScaler, Precision, check_scaler_settings, loss_scaler_runs,
                         take_over_stock_scale)
from ..records import LABEL_COLUMNS, SkipLog, StepLog
from ..sinks import CSV_COLUMNS, CsvSink, Sink, opened_without_waiting
from ..step import Guard, check_settings
from ..watch import first_forward_dtypes
from .trackers import Outcome, end_sinks, end_unserved

__all__ = ["AmpGuardPlugin"]

LightningPrecision = Literal["16-mixed", "bf16-mixed", "32-true"]
_NAMES = {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
# what goes to LightningModule.log, from the record's values (None is logged as nan)
LOG_KEYS: dict[str, str] = {
    "loss": "ampguard/loss", "lr": "ampguard/lr", "grad_l2_pre_clip": "ampguard/grad_l2_pre_clip",
    "grad_l2_post_clip": "ampguard/grad_l2_post_clip", "scaler_scale": "ampguard/scale",
}


class AmpGuardPlugin(_LightningPrecision):
    """A Lightning precision plugin that runs ampguard's guarded step in the Trainer's loop.

    Example (bf16 on a CPU, three steps, the third loss non-finite)::

        >>> import lightning as L
        >>> class Tiny(L.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layer = torch.nn.Linear(4, 1)
        ...     def training_step(self, batch, i):
        ...         loss = self.layer(batch[0]).pow(2).mean()
        ...         return loss * float("nan") if self.trainer.global_step == 2 else loss
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        ...     def train_dataloader(self):
        ...         return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=8)
        >>> plugin = AmpGuardPlugin("bf16-mixed", max_norm=1.0)
        >>> trainer = L.Trainer(max_steps=3, plugins=[plugin], accelerator="cpu", logger=False,
        ...                     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
        >>> trainer.fit(Tiny())
        >>> [(r.step, r.reason) for r in plugin.records], plugin.guard.updates
        ([(1, None), (2, None), (3, 'non_finite_loss')], 2)

    Args:
        precision: ``"16-mixed"`` (fp16 with a loss scaler), ``"bf16-mixed"``, or ``"32-true"``
            (the same checks and records, no autocast); ampguard's ``"fp16"``/``"bf16"``/``"fp32"`` too.
        max_norm: global L2 clip threshold (``None`` or ``<= 0``: no clipping). Replaces the
            Trainer's ``gradient_clip_val``, which must then be unset.
        csv: path of the per-step CSV (the eight contract columns, a row flushed per step,
            written by global rank 0; with several optimizers also the guard's
            ``record_columns``, ``optimizers`` and ``skipped_optimizers``, named by Lightning's
            index ``"0"``, ``"1"``, ...). A missing folder is created; a path through a file is
            refused up front. An existing file is refused unless the fit resumes from a
            checkpoint (``ckpt_path``), which appends after the checkpoint's step (its header
            checked before the fit trains). It serves one fit, as the sinks do: a later fit with
            the same plugin and ``csv`` is refused (``ValueError``) before it trains, unless it
            resumes (``ckpt_path``).
        sinks: more ampguard sinks (``JsonlSink``, ``TensorBoardSink``, ``WandbSink``,
            ``MLflowSink``, ...), written on rank 0; a tracker sink also gets the monitor's view
            of each step (``monitor/*``, the alert tags). The plugin closes them when the fit
            ends, a tracker run with the fit's exit code (:meth:`teardown`), so they serve one
            fit: a later fit with the same plugin is refused until it is given new ones
            (``plugin.extra_sinks = [...]``).
        log: send the record to ``LightningModule.log`` (so to every Lightning logger) as
            ``ampguard/loss``, ``ampguard/lr``, ``ampguard/grad_l2_pre_clip``,
            ``ampguard/grad_l2_post_clip``, ``ampguard/scale``, ``ampguard/skipped``,
            ``ampguard/skip_rate``, on the steps Lightning writes its loggers
            (``Trainer(log_every_n_steps=...)``: logging costs milliseconds per key; the CSV and
            sinks get every step).
        scaler: a ``torch.amp.GradScaler``'s keyword arguments (``init_scale``, ``growth_interval``,
            ...) for fp16, and ``min_scale``, the scale's floor: 1.0 unless given, as in
            ``ampguard train`` (at the floor the ``scale_alert`` rises, and with
            ``fail_on_scale_collapse`` a run still skipping there stops).
        window, alert_rate, clear_rate, fail_rate, fail_after, fail_on_scale_collapse, min_steps: the
            :class:`~ampguard.monitor.RunMonitor`'s settings; with ``fail_rate`` set, a skip rate
            above it for ``fail_after`` consecutive steps stops the trainer at that step (its
            ``min_steps`` / ``min_epochs`` set aside: a diverged fit trains no further).
        scheduler_on_skip: ``"hold"`` (default) the ``interval="step"`` LR schedulers on a
            skipped step, and the ``interval="epoch"`` ones at the end of an epoch that applied
            no update (every step of it skipped; one applied update steps them as Lightning
            does), or ``"step"`` them as Lightning does.
        frozen: the guard's ``frozen`` (``"refuse"`` a parameter that requires grad but is in no
            optimizer, or ``"ignore"`` it).

    A resume (``fit(ckpt_path=...)``) restores the guard's state from the checkpoint; a checkpoint
    without it (saved by a fit without the plugin) goes on numbering steps from its
    ``global_step``, with a warning that the monitor starts afresh, and the loss scale too unless
    Lightning's own fp16 ``MixedPrecision`` (or a subclass, under its own name) saved its
    GradScaler's there (taken over:
    :meth:`on_load_checkpoint`). A tuner's
    sweep (``lr_find``, ``scale_batch_size``: a ``Tuner``'s, or its callback in the fit) is
    guarded but recorded nowhere, and the guard goes back with the model the tuner restores.

    After a fit: :attr:`guard` (the :class:`~ampguard.Guard`: ``steps``, ``updates``, ``scaler``),
    :attr:`monitor`, :attr:`records` (the last ``keep_records`` records, their numbers host floats:
    the step's tensors are not kept), :attr:`stop_reason`.
    Host reads: the guard's one per step (the skip decision), and the sinks/monitor/logging
    reading each record once (one transfer of its five values).
    """

    @called_by_user  # (a warning of its settings names the user's line)
    def __init__(
        self,
        precision: LightningPrecision | str = "16-mixed",
        *,
        max_norm: float | None = 1.0,
        csv: str | os.PathLike | None = None,
        sinks: Sequence[Sink] = (),
        log: bool = True,
        scaler: dict[str, Any] | None = None,
        window: int = 1000,
        alert_rate: float = 0.05,
        clear_rate: float | None = None,
        fail_rate: float | None = None,
        fail_after: int = 100,
        fail_on_scale_collapse: bool = False,
        min_steps: int = 100,
        scheduler_on_skip: Literal["hold", "step"] = "hold",
        frozen: Literal["refuse", "ignore"] = "refuse",
        keep_records: int | None = 10_000,
    ) -> None:
        if not isinstance(precision, str) or precision not in _NAMES:
            raise ValueError(f"AmpGuardPlugin(precision={precision!r}): use '16-mixed', 'bf16-mixed' or '32-true'")
        check_settings(max_norm, scheduler_on_skip, frozen)  # (the guard is built at the first step: its
        # settings are checked here, as the scaler's and the monitor's below)
        # (each of these failed only at the first record, after an update: a bare AttributeError, or
        # deque's "maxlen must be non-negative" naming no argument)
        if csv is not None and not isinstance(csv, (str, os.PathLike)):
            raise TypeError(f"AmpGuardPlugin(csv={csv!r}): give the CSV's path (a str or a Path), or None")
        raw = os.fspath(csv) if csv is not None else None
        if raw in ("", b""):  # (Path("") is ".": the fit was refused about csv='.', a path never given)
            raise ValueError("AmpGuardPlugin(csv=''): give the path of the CSV file, e.g. 'steps.csv', or None")
        if isinstance(raw, str) and (raw.endswith(os.sep) or (os.altsep and raw.endswith(os.altsep))
                                     or os.path.basename(raw) in (".", "..")):
            # (Path drops a trailing "/" and "/.": csv="logs/" was written as a file named logs)
            raise ValueError(f"AmpGuardPlugin(csv={_said(raw)}): that names a folder; give the path of the CSV "
                             f"file, e.g. {_said(os.path.join(raw, 'steps.csv'))}")
        if not isinstance(log, bool):
            raise TypeError(f"AmpGuardPlugin(log={log!r}): True or False")
        if keep_records is not None and not whole_number(keep_records, 0):
            raise ValueError(f"AmpGuardPlugin(keep_records={keep_records!r}): a whole number >= 0, or None for all "
                             f"(the records plugin.records keeps)")
        sinks = _check_sinks(sinks)
        self.precision = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[_NAMES[precision]]
        self.name = _NAMES[precision]
        self.max_norm = max_norm
        # ("~/steps.csv" is the home folder's, as Hugging Face's output_dir and ampguard's config paths)
        self.csv = Path(os.path.expanduser(csv)) if csv is not None else None
        self._dev_run = False  # (this fit is a fast_dev_run: it writes no CSV and serves no sinks)
        self.extra_sinks = list(sinks)
        self.log = log
        # ampguard train's and GuardedTrainer's floor: the scale never falls below 1.0 (a floor of
        # 2**-126 took ~140 skips in a row to reach, so scale_alert and fail_on_scale_collapse never came)
        # (a scaler turned off takes no floor: review 53j, "min_scale ignored" said of a setting never given)
        scaling = loss_scaler_runs(self.name, (scaler or {}).get("enabled"))
        self.scaler_settings = {"min_scale": 1.0, **(scaler or {})} if scaling else dict(scaler or {})
        check_scaler_settings(self.name, self.scaler_settings)
        self.monitor_settings = dict(window=window, alert_rate=alert_rate, clear_rate=clear_rate, fail_rate=fail_rate,
                                     fail_after=fail_after, fail_on_scale_collapse=fail_on_scale_collapse,
                                     min_steps=min_steps)
        RunMonitor(**self.monitor_settings)  # bad settings fail here, not after the first step
        self.scheduler_on_skip = scheduler_on_skip
        self.frozen = frozen

        self.guard: Guard | None = None
        self.monitor: RunMonitor | None = None
        # each leaf module's output dtype in the fit's first training step under autocast (None
        # until it ran; {} for a compiled model): the layers autocast left in float32
        self.autocast_dtypes: dict[str, str] | None = None
        self.records: deque[StepLog | SkipLog] = deque(maxlen=keep_records)
        self.stop_reason: str | None = None
        self._autocast: Precision | None = None
        self._sinks: list[Sink] | None = None
        self._loaded: dict[str, Any] | None = None
        # the GradScaler state of Lightning's own MixedPrecision in a resumed checkpoint without ampguard's
        # scale (on_load_checkpoint): (its key, the state, checked; None: unused, this fit has no loss scaler)
        self._stock: tuple[str, dict[str, Any] | None] | None = None
        # the Trainer's accumulate_grad_batches as the fit began: what the guard's state saves (a
        # GradientAccumulationScheduler changes the Trainer's per epoch; each group takes that one)
        self._accumulation = 1
        self._resumed_at: int | None = None  # the step a resumed fit goes on from (the CSV keeps rows to it)
        self._hold = False  # the last optimizer step was skipped: hold the step-interval schedulers
        self._unlogged_skips: dict[str, int] = {}  # per log prefix: the skips since the loggers were last written
        # (batches seen, batches of skipped steps) in this epoch: a scheduler stepped every
        # `frequency` batches counts the applied ones (the state saved with the guard's); None
        # until the fit's first step if a resumed checkpoint did not carry it (see _setup)
        self._held_batches: tuple[int, int] | None = (0, 0)
        self._frequencies: list[tuple[Any, int]] = []  # (config, its frequency) set to 1 for the fit
        self._hooked: pl.LightningModule | None = None
        self._fitting: pl.Trainer | None = None  # the fit under way (past connect's checks): teardown ends it
        self._closed: list[Sink] = []  # the user's sinks a fit's teardown closed: a later fit refuses them
        self._csv_fits: set[str] = set()  # the CSVs of the fits begun: a later fit refuses them unless it resumes
        self._tuned = False  # the fit under way has a tuner's callback (lr_find, scale_batch_size): see _sweeping
        self._minimums: tuple[Any, Any] | None = None  # the Trainer's (min_epochs, min_steps), set aside by a stop
        self._group_began = (0, 0)  # (epoch, batch_idx) of the open accumulation group's first micro-batch
        # and the number of batches of that epoch (a reload_dataloaders_every_n_epochs loader gives the
        # next epoch its own: _drop_an_ended_epochs_group judges the group by its own epoch's)
        self._group_epoch_batches: int | float = 0
        self._own_backward: bool | None = None  # the fit's LightningModule overrides backward (read at its first)
        if self.name != "fp32" and not isinstance(self, _LightningMixedPrecision):
            # fp16 and bf16 are Lightning's MixedPrecision too: what Lightning reads a precision plugin's
            # compute dtype by (ThroughputMonitor's FLOPs and MFU took a plain Precision for float32).
            # The same class with MixedPrecision mixed in, under the same name (_mixed_in); "32-true" stays
            self.__class__ = _mixed_in(type(self))

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A copy or a pickle (``ddp_spawn``) of an fp16/bf16 plugin is made from the class it was
        made as, then given MixedPrecision again (:func:`_mixed_in`: that class is made at run time)."""
        plain = getattr(type(self), "_plain", None)
        if plain is None:
            return super().__reduce_ex__(protocol)
        return _remade_mixed, (plain,), dict(self.__dict__)

    # ------------------------------------------------------------------ setup

    @property
    def scaler(self) -> GuardedGradScaler | None:
        """The guard's loss scaler once the fit started (``None`` before, and for bf16/fp32)."""
        return self.guard.scaler if self.guard is not None and self.guard.scaler.is_enabled() else None

    def connect(self, model: torch.nn.Module, optimizers: list, lr_schedulers: list) -> tuple:
        """Called by the strategy once the model is on its device: the autocast device, and early
        refusals (a CSV that exists when not resuming, one whose header does not fit when
        resuming, a CSV path through a file or one rank 0 cannot write, ``extra_sinks`` that are
        not sinks, ``gradient_clip_val``, LBFGS), before anything trains."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._autocast = Precision(self.name, device.type)
        module = _lightning_module(model)
        trainer = module._trainer if module is not None else None
        if module is not None and trainer is not None and trainer.state.fn == "fit":
            # the refusals, raised on every rank alike (distributed.refused_on_every_rank: a rank that
            # refused alone left the others in the fit's first collective, "Connection closed by peer",
            # under NCCL a wait), entered on every rank whatever its csv and sinks (given on rank 0 alone,
            # as a script may: reviews 48f, 48g)
            with distributed.refused_on_every_rank():
                self._refuse_fit(trainer, optimizers)
            # past the refusals (a refused fit leaves the last fit's results as they were): a new fit
            # has new optimizers (configure_optimizers ran again), so a new guard at its first
            # backward; a resumed one gets its state from load_state_dict, which Lightning calls later
            self._tuned = any(isinstance(cb, _TUNERS) for cb in trainer.callbacks)
            self.guard, self.monitor, self.stop_reason, self.autocast_dtypes = None, None, None, None
            self.records.clear()
            self._loaded, self._hold, self._resumed_at, self._held_batches = None, False, None, None
            self._own_backward, self._stock = None, None
            if isinstance(trainer.strategy.launcher, _MultiProcessingLauncher):
                rank_zero_warn(f"AmpGuardPlugin under {type(trainer.strategy).__name__}, whose processes are "
                               f"started by {trainer.strategy.launcher._start_method}: the guard runs in them, "
                               f"so after fit() the plugin in the process that called it has no records, guard, "
                               f"monitor or stop_reason (a stop by the guard looks like a finished fit there); "
                               f"the CSV and the trackers hold the run. strategy='ddp' (torchrun or Lightning's "
                               f"own launch) keeps them on rank 0", category=AmpguardWarning)
            clipping = next((hook for hook in _CLIPPING_HOOKS if is_overridden(hook, module)), None)
            if module.automatic_optimization and clipping is not None:
                # warned, not refused: the override may not clip at all (Lightning's own example
                # forwards gradient_clip_val, unset here; a logging hook), and a clip through
                # Lightning's own clip_gradients is refused when it runs; only a direct clip goes unseen
                rank_zero_warn(f"AmpGuardPlugin: {type(module).__name__}.{clipping} is overridden; "
                               f"Lightning runs it before the guard's step, so a clip there (clip_grad_norm_) "
                               f"clips first and the CSV's grad_l2_pre_clip is the norm after it: clip with the "
                               f"plugin's max_norm and look at gradients in on_before_optimizer_step instead",
                               category=AmpguardWarning)
            # the Trainer's setting, read before its first epoch (a GradientAccumulationScheduler, which
            # Lightning allows only with accumulate_grad_batches=1, sets its own at each epoch's start)
            self._accumulation = _group_size(module, trainer)
            self._fitting = trainer  # past the refusals: the sinks are this fit's, closed at its end
            self._unlogged_skips = {}  # (a fit's own: the last fit's unlogged skips are not this one's)
            self._dev_run = bool(trainer.fast_dev_run)
            if self._dev_run:
                self._say_dev_run()
            elif self.csv is not None:
                self._csv_fits.add(os.path.abspath(self.csv))
        return model, optimizers, lr_schedulers

    def _refuse_fit(self, trainer: pl.Trainer, optimizers: list[Any]) -> None:
        """What a fit is refused for before it trains (:meth:`connect` raises it on every rank)."""
        # (the attribute a later fit's sinks are set by: checked first, a generator taken into a list once)
        self.extra_sinks = _check_sinks(self.extra_sinks, "plugin.extra_sinks")
        closed = [s for s in self.extra_sinks if any(s is c for c in self._closed)]
        if closed:  # before anything is trained: the first step would crash on them
            raise ValueError(f"AmpGuardPlugin: sinks={[type(s).__name__ for s in closed]} were closed when the "
                             f"previous fit with this plugin ended (its tracker runs ended with that fit); give "
                             f"this fit new sinks (plugin.extra_sinks = [...]) or a new AmpGuardPlugin")
        if self.csv is not None and os.path.abspath(self.csv) in self._csv_fits and trainer.ckpt_path is None:
            # on every rank alike, as the sinks' refusal (not the InputError of a file found on rank 0)
            raise ValueError(f"AmpGuardPlugin: csv={_said(self.csv)} was the previous fit's with this plugin "
                             f"(one fit per plugin); give this fit a new AmpGuardPlugin with a new csv path, "
                             f"or resume the previous fit with trainer.fit(..., ckpt_path=...), which appends to it")
        if trainer.gradient_clip_val:
            raise ValueError(_clip_refusal(trainer))
        if any(isinstance(o, torch.optim.LBFGS) for o in optimizers):
            raise ValueError("AmpGuardPlugin cannot guard LBFGS (its step re-runs the closure)")
        # (rank 0's verdict on its CSV: the others never look; a fast_dev_run writes none)
        if trainer.is_global_zero and self.csv is not None and not trainer.fast_dev_run:
            self._check_csv(trainer, len(optimizers))

    def _say_dev_run(self) -> None:
        """A ``fast_dev_run`` fit, Lightning's smoke test, writes no logs nor checkpoints, and the
        plugin neither its ``csv`` nor its sinks (their files, or the sinks closed at its end,
        refused the real fit after it: reviews 51d, 51l); said where there are any."""
        what = " and ".join(w for w in (f"csv={_said(self.csv)}" if self.csv is not None else "",
                                        "the sinks" if self.extra_sinks else "") if w)
        if what:
            rank_zero_warn(f"AmpGuardPlugin: fast_dev_run: {what} not written, as Lightning writes no logs in it",
                           category=AmpguardWarning)

    def _check_csv(self, trainer: pl.Trainer, optimizers: int) -> None:
        """The CSV's refusals, before the fit trains (the file opens at the first record, after
        the first update), judged on rank 0, which writes it (:meth:`connect` raises its refusal
        on every rank): a path that is a folder, a link to nothing, or neither a regular file
        nor a character device (a named pipe, whose open waited for a reader for ever; a socket),
        or whose folder ``mkdir -p`` cannot make (a file,
        a link to nothing or a loop on the way, judged as the OS walks the path:
        :func:`~ampguard.errors.folder_problem`, as the Hugging Face callback's ``out_dir``); an
        existing file unless the fit resumes, when it resumes one whose header is not this fit's
        columns, and a path it cannot write (:func:`_check_writable`)."""
        assert self.csv is not None
        where = f"AmpGuardPlugin csv={_said(self.csv)}"
        try:
            if self.csv.is_dir() or self.csv.name == "..":  # (x/.. is a folder once the CSV's mkdir made x)
                raise InputError(f"{where}: that is a folder; give the path of the CSV file")
            if self.csv.is_symlink() and not self.csv.exists():  # (the sink refuses it, at the first record)
                raise InputError(f"{where}: that is {what_is(self.csv)}; refusing to write through it")
            if self.csv.exists() and not (self.csv.is_file() or self.csv.is_char_device()):
                # (links followed: a link to a pipe is one; a device such as /dev/null reads empty, so a
                # resume appends to it as to an empty CSV, never cuts it: allowed, as a fresh fit's)
                raise InputError(f"{where}: that is {what_is(self.csv)}, not a regular file; give the path of "
                                 f"a CSV file")
        except OSError as err:  # (a parent this user may not search, a name too long)
            raise InputError(f"{where}: {looked_at(self.csv, err)}") from None
        # its folder, made with its parents when the CSV opens (mkdir -p): judged as the OS walks the
        # path (errors.folder_problem, as the Hugging Face callback's out_dir), so a file, a link to
        # nothing or a loop on the way is refused here (gone/steps.csv, file.txt/../x/steps.csv, nodir/../
        # file.txt/x/steps.csv passed, then failed at the first record, after an update)
        problem = folder_problem(self.csv.parent)
        if problem is not None:
            raise InputError(f"{where}: {problem}")
        if not (self.csv.exists() and self.csv.stat().st_size > 0):
            _check_writable(self.csv, where)  # (an empty one is appended to, not rewritten)
            return
        if trainer.ckpt_path is None:
            raise InputError(f"{shown(self.csv)} already exists; refusing to overwrite it")
        # a resume appends: the same columns the sink will write (the guard's record_columns); a
        # CSV of other columns (another fit's, or one written before the plugin wrote them) cannot be
        try:
            CsvSink.check_header(self.csv, CSV_COLUMNS + (LABEL_COLUMNS if optimizers > 1 else ()),
                                 "this fit's columns" + (f" ({', '.join(LABEL_COLUMNS)} with {optimizers} optimizers)"
                                                         if optimizers > 1 else " (one optimizer)"))
        except InputError as err:
            raise InputError(f"{err}: give this fit a new csv path") from None
        _check_writable(self.csv, where, rewritten=True)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if not isinstance(module, pl.LightningModule) or module._trainer is None:
            raise TypeError("AmpGuardPlugin guards the Lightning Trainer's loop; L.Fabric's loop is your own: "
                            "use ampguard.Guard there (with guard.autocast(), guard.backward(loss), guard.step())")
        return module

    def _setup(self, module: pl.LightningModule) -> Guard:
        """Build the guard at the fit's first backward: the optimizers, the accumulation and the
        schedulers are Lightning's by then, and so is a resumed checkpoint's state.

        The guard's ``accumulation_steps`` is the Trainer's setting as the fit began (what its
        state saves and a resume compares); :meth:`backward` sets each group's own. A resume from
        a checkpoint without ampguard's state (a fit without the plugin) goes on from its
        ``global_step``, as :class:`~ampguard.integrations.transformers.GuardedTrainer` does:
        the records' steps are Lightning's, the scale goes on from the stock ``MixedPrecision``'s
        GradScaler state the checkpoint holds (:meth:`_take_over_stock_scale`) or starts afresh,
        and the monitor observes from the next step (:meth:`~ampguard.monitor.RunMonitor.begin_at`;
        warned)."""
        trainer = module.trainer
        optimizers = trainer.optimizers
        if len(optimizers) == 1:
            optimizers = optimizers[0]
        device = next(module.parameters()).device
        precision = self._autocast or Precision(self.name, device.type)
        scaler = precision.make_scaler(**self.scaler_settings)
        # (review 54m: a stock fp16 checkpoint's scale was thrown away; taken before the monitor is made, whose
        # scale health starts from the scale the fit goes on with)
        taken, took = self._take_over_stock_scale(scaler) if not self._loaded else (None, None)
        guard = Guard(module, optimizers, precision=precision, max_norm=self.max_norm,
                      accumulation_steps=self._accumulation, scaler=scaler, frozen=self.frozen)
        # (review 53i: a crash here ended with "the next guard.backward() begins a new step", the note
        # for a loop of one's own that calls the guard; the plugin's user never does)
        guard._loop_notes = False
        monitor = RunMonitor(max_norm=self.max_norm, scaler_enabled=scaler.is_enabled(),
                             init_scale=scaler.get_scale() if scaler.is_enabled() else None,
                             min_scale=scaler.get_min_scale(),
                             growth_interval=scaler.get_growth_interval() if scaler.is_enabled() else None,
                             **self.monitor_settings)
        guard.monitors["run"] = monitor
        if self._loaded:
            try:
                guard.load_state_dict(self._loaded)
            except ValueError as err:  # (a bare Guard line named neither the checkpoint nor the plugin: review 47h)
                where = Path(trainer.ckpt_path).name if trainer.ckpt_path is not None else "the checkpoint"
                raise ValueError(f"AmpGuardPlugin: the ampguard state {where} holds cannot be restored: {err} (the "
                                 "plugin's settings, window= and scaler= among them, must be the run's)") from None
            self._resumed_at = guard.steps
        elif trainer.ckpt_path is not None:
            guard.steps = self._resumed_at = trainer.global_step
            # (the monitor observes from the next step: its counts and the end's judgement cover the steps
            # it saw; it took the earlier ones as seen, and two all-skipped steps after step 38 were 2/40; its
            # opening search starts from a scale taken over, review 55f: the end said "down from init_scale")
            monitor.begin_at(trainer.global_step, taken_over=took)
            # (review 55f: a stock scale taken over, or left unused, at global_step 0 went unsaid: said as at any
            # step; a checkpoint of no step and no stock scale begins as a fresh fit, nothing to say)
            if trainer.global_step or taken:
                scale = taken or ("the loss scale starts again at init_scale and " if scaler.is_enabled() else "")
                _say(f"AmpGuardPlugin: {Path(trainer.ckpt_path).name} holds no ampguard state (saved "
                     f"without the plugin): steps go on from its global_step {trainer.global_step}; "
                     f"{scale}the skip-rate monitor observes from step {trainer.global_step + 1}")
        elif trainer.global_step:  # a second fit of the same Trainer: its records' steps go on as Lightning's do
            guard.steps = trainer.global_step
            monitor.begin_at(trainer.global_step)
        self.guard, self.monitor = guard, monitor
        if self._held_batches is None:  # (a fresh fit, or a checkpoint without it: an older plugin's, or
            # none): the epoch's batches before this first backward's were all applied, as far as is known
            self._held_batches = (trainer.fit_loop.epoch_loop.batch_idx, 0)
        self._hook_schedulers(module)
        return guard

    def _take_over_stock_scale(self, scaler: GuardedGradScaler) -> tuple[str | None, float | None]:
        """Load the scale and the growth tracker of the stock ``MixedPrecision``'s GradScaler state
        a resumed checkpoint held (:meth:`on_load_checkpoint`) into the guard's new ``scaler``, and
        say so: the clause the resume's warning gives (``None``: there was none) and the scale
        taken over (``None``: none was). This plugin's settings are kept, named where the
        checkpoint's differ (:func:`~ampguard.precision.take_over_stock_scale`, the GuardedTrainer's too)."""
        if self._stock is None:
            return None, None
        key, state = self._stock
        self._stock = None  # (the guard's scaler holds it now: a save takes it from there)
        if state is None or not scaler.is_enabled():
            shown = {v: k for k, v in _NAMES.items() if "-" in k}[self.name]
            scales = "loss scales are" if " and " in key else "loss scale is"  # (several: "MyAMP and OtherAMP")
            return f"its {key} {scales} not used (this fit is {shown}, with no loss scaler); ", None
        # (review 54s: the take-over is precision.py's, shared with the HF GuardedTrainer's scaler.pt)
        taken, kept = take_over_stock_scale(scaler, state, "this plugin's")
        return f"the loss scale takes over its GradScaler's {taken} (Lightning's {key!r} state" + (
            f"; {kept}" if kept else "") + ") and ", scaler.get_scale()

    def _open_sinks(self, trainer: pl.Trainer) -> list[Sink]:
        sinks: list[Sink] = []
        if self._dev_run:  # (Lightning's smoke test: its loggers write nothing, nor do these)
            return sinks
        if trainer.is_global_zero:
            if self.csv is not None:
                assert self.guard is not None  # (sinks open at the first record)
                resumed = self._resumed_at is not None and self.csv.exists()
                # with several optimizers each row names them and the ones skipped (a GAN's D and G rows)
                sinks.append(CsvSink(self.csv, self.guard.record_columns, append=resumed,
                                     keep_through=self._resumed_at if resumed else None))
            sinks += self.extra_sinks
        else:  # (only rank 0 logs: a tracker run made here ends now, said)
            end_unserved(self.extra_sinks, trainer.global_rank, "AmpGuardPlugin")
        return sinks

    def _hook_schedulers(self, module: pl.LightningModule) -> None:
        """Hold the step-interval LR schedulers on a skipped step: Lightning steps them after
        every optimizer step through ``LightningModule.lr_scheduler_step``, which is wrapped on
        this module instance (the user's own override included) for the fit.

        A scheduler with ``frequency: f`` steps every ``f`` batches of the epoch (Lightning's
        count: ``batch_idx + 1``); held, it counts only the batches of applied steps, so it
        steps right after the ``f``-th applied one. Lightning asks only on its own multiples of
        ``f``, so for the fit the plugin sets such a config's ``frequency`` to 1 (Lightning asks
        every optimizer step) and keeps the count itself (``teardown`` puts ``f`` back). A
        ``ReduceLROnPlateau`` keeps Lightning's timing (it reads its metric only then) and is
        held on a skipped step that falls on it.

        An ``interval="epoch"`` scheduler (a ``ReduceLROnPlateau`` too) is held at an epoch's
        end when that epoch applied no update, every batch of it in a skipped step: the schedule
        counts what was learned, as a step scheduler is held per skipped step. An epoch with one
        applied update or more steps it as Lightning does (review 53d: an epoch of skips stepped
        it). Its ``frequency`` stays Lightning's (asked at every f-th epoch, held when that epoch
        applied nothing; the epochs between are not counted)."""
        if self.scheduler_on_skip != "hold" or self._hooked is module:
            return
        configs = module.trainer.lr_scheduler_configs
        step_interval = {id(c.scheduler) for c in configs if c.interval == "step"}
        epoch_interval = {id(c.scheduler) for c in configs if c.interval == "epoch"}
        self._frequencies = [(c, c.frequency) for c in configs
                             if c.interval == "step" and not c.reduce_on_plateau and c.frequency != 1]
        every = {id(c.scheduler): f for c, f in self._frequencies}
        for c, _ in self._frequencies:
            c.frequency = 1
        user_hook, loop = module.lr_scheduler_step, module.trainer.fit_loop.epoch_loop

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if id(scheduler) in step_interval:
                if self._hold:
                    return  # the optimizer step was skipped: the schedule holds
                if (loop.batch_idx + 1 - (self._held_batches or (0, 0))[1]) % every.get(id(scheduler), 1):
                    return  # not yet the f-th applied batch
            elif id(scheduler) in epoch_interval:
                # at the epoch's end (its last batch, or after its end hooks for a ReduceLROnPlateau):
                # the count is this epoch's when it reached the loop's batch (_count_held)
                seen, held = self._held_batches or (0, 0)
                if 0 < seen == held == loop.batch_idx + 1:
                    return  # every step of the epoch skipped: no update applied, the schedule holds
            return user_hook(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        self._hooked = module

    def _count_held(self, trainer: pl.Trainer, skipped: bool) -> None:
        """The batches of this epoch's skipped steps (for the schedulers' ``frequency``): the
        batches since the last optimizer step are this step's. Lightning's count starts again
        with each epoch (``batch_idx``; a fit resumed after ``max_steps`` goes on with the
        epoch's count though its ``current_epoch`` moved on): a count that did not grow is a
        new epoch's."""
        seen, held = self._held_batches or (0, 0)  # (set by _setup before any step closes)
        now = trainer.fit_loop.epoch_loop.batch_idx + 1
        if now <= seen:
            seen, held = 0, 0
        self._held_batches = (now, held + (now - seen if skipped else 0))

    def teardown(self) -> None:
        """The fit's end, finished or not (Lightning calls it from inside its ``except`` on a
        crash): unwrap ``lr_scheduler_step``, give the Trainer back the ``min_steps`` /
        ``min_epochs`` a guard's stop set aside, and close the sinks (the run's rows are all
        flushed); a tracker sink's run gets the fit's totals and ends with its exit code
        (:meth:`_exit_code`), as ``ampguard train`` ends it."""
        self._unhook()
        trainer, self._fitting = self._fitting, None
        if trainer is not None and self._sinks is None and isinstance(sys.exc_info()[1], _TunerExitException):
            # the Tuner's own fit (Tuner.lr_find / scale_batch_size: its sweep, then an early exit) recorded
            # nothing: the csv and the sinks are left to the fit that trains
            if self.csv is not None:
                self._csv_fits.discard(os.path.abspath(self.csv))
            _LightningPrecision.teardown(self)
            return
        if trainer is not None and trainer.state.status != TrainerStatus.INTERRUPTED:  # (FINISHED comes after)
            if self.guard is not None and self.guard.mid_group and trainer.lightning_module.automatic_optimization:
                _say(f"AmpGuardPlugin: the fit ended inside an accumulation group: {self._open_group()} "
                     f"had no optimizer step, as under Lightning")
            self._judge_end()
        if trainer is not None and self._minimums is not None:
            trainer.fit_loop.min_epochs, trainer.fit_loop.epoch_loop.min_steps = self._minimums
        self._minimums = None
        sinks = self._sinks
        if sinks is None and trainer is not None and not self._dev_run:  # no record written (a crash before
            sinks = self.extra_sinks if trainer.is_global_zero else []   # the first step)
        self._sinks = None
        if trainer is not None and not self._dev_run:  # (a fast_dev_run served none: the real fit takes them)
            self._closed += self.extra_sinks  # on every rank: a later fit is refused on every rank alike
        # a fit that raised: Lightning calls this inside its except, its error in flight (the one it raises)
        failed = sys.exc_info()[1] if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED \
            else None
        try:
            if sinks:
                self._close_sinks(sinks, trainer)
        except Exception as later:
            if failed is None:
                raise
            failed.add_note(f"ampguard: closing the plugin's sinks raised too: {later!r}")  # (the fit's error stays)
            # (Lightning swallows a KeyboardInterrupt, and its notes with it: said here too)
            _say(f"AmpGuardPlugin: closing the sinks raised: {later!r}")
        finally:
            _LightningPrecision.teardown(self)

    def _unhook(self) -> None:
        """Give the module its own ``lr_scheduler_step`` and the configs their ``frequency`` back
        (:meth:`_hook_schedulers`)."""
        if self._hooked is not None:
            self._hooked.__dict__.pop("lr_scheduler_step", None)
            self._hooked = None
        for config, frequency in self._frequencies:
            config.frequency = frequency
        self._frequencies = []

    def _judge_end(self) -> None:
        """A fit that ended by itself: the monitor judges it whole once (a fit too short to arm
        the ALERT or to fail fast, :meth:`~ampguard.monitor.RunMonitor.at_end`): an ALERT is
        warned, a failure becomes :attr:`stop_reason` (the fit's exit code 3 for the trackers)."""
        if self.monitor is None or self.stop_reason is not None:
            return
        events = self.monitor.at_end(self.monitor.steps)
        for sink in self._sinks or []:  # the tracker sinks: the events, as with each step's
            if hasattr(sink, "observe"):
                sink.observe(self.monitor, events)
        for event in events:
            if event.kind == "fail":
                self.stop_reason = f"ampguard failed the fit at its end (step {event.step}): {event.message}"
                _say(self.stop_reason)
            else:
                _say(f"ampguard ALERT at step {event.step}: {event.message}")

    def _close_sinks(self, sinks: list[Sink], trainer: pl.Trainer | None) -> None:
        """Every sink closed (one that fails does not keep the others open: the first error is
        raised after); a tracker sink first finished with the fit's result."""
        code, ended = self._exit_code(trainer)
        monitor = self.monitor or RunMonitor(**self.monitor_settings)  # (a fit that crashed before its first step)
        end_sinks(sinks, Outcome(monitor, code, ended, autocast_dtypes=self.autocast_dtypes))  # (no run folder: no artifacts)

    def _exit_code(self, trainer: pl.Trainer | None) -> tuple[int, str]:
        """The fit's outcome as ``ampguard train``'s exit code (docs/design.md §4) and a line.

        Lightning marks a fit that raised ``INTERRUPTED`` before its teardown, and calls the
        teardown inside its ``except`` (lightning/pytorch/trainer/call.py), so the exception is
        ``sys.exc_info()``'s there: Ctrl-C (130), SIGTERM (143, Lightning's ``SIGTERMException``),
        anything else a crash (1). A fit that returned: 3 if the guard stopped it, else 0, its line
        saying whether a callback stopped it first (``trainer.should_stop``: ``EarlyStopping``)."""
        if trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED:
            error = sys.exc_info()[1]
            if isinstance(error, KeyboardInterrupt):
                return ExitCode.INTERRUPTED, "interrupted (Ctrl-C)"
            if isinstance(error, SIGTERMException) or trainer.received_sigterm:
                return ExitCode.TERMINATED, "interrupted (SIGTERM)"
            # (ampguard has no code of its own for a crash: 1 is Python's for an uncaught exception)
            return 1, f"crashed: {type(error).__name__}: {error}" if error is not None else "crashed"
        if self.stop_reason is not None:
            return ExitCode.GUARD, self.stop_reason
        steps = self.guard.steps if self.guard is not None else 0
        if trainer is not None and trainer.should_stop and not _at_its_limit(trainer):
            return ExitCode.OK, f"stopped after step {steps}: a callback asked (trainer.should_stop, e.g. EarlyStopping)"
        return ExitCode.OK, f"finished: {counted(steps, 'step')}"

    # ------------------------------------------------------------------ the step

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast to the plugin's precision (nothing for ``32-true``), without the weight cache,
        as Lightning's own plugin: in manual optimization the whole ``training_step`` is one
        block, and a forward after ``opt.step()`` inside it (a GAN's discriminator on the new
        generator's output) ran on the weights from before the step."""
        precision = self._autocast or Precision(self.name, "cuda" if torch.cuda.is_available() else "cpu")
        with precision.autocast(cache=False):
            yield

    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        """``training_step``'s autocast (:meth:`forward_context`); in the fit's first one, each
        leaf module of the LightningModule notes its output's dtype in :attr:`autocast_dtypes`
        (``ampguard.watch.first_forward_dtypes``: hooks for that step only), as ``ampguard train``'s
        run card and ``GuardedTrainer`` do; the tracker sinks' summary gets it at the fit's end."""
        self._drop_an_ended_epochs_group()
        if self.guard is not None:  # (a compiled module's layers' hooks copy nothing: copied here)
            self.guard.keep_running_stats()
        with _LightningPrecision.train_step_context(self), self._noting_dtypes():
            yield

    def _drop_an_ended_epochs_group(self) -> None:
        """Drop the accumulation group an epoch ended inside, at the next group's first
        ``training_step`` (before its forward), as Lightning drops it.

        ``on_train_batch_start`` returning -1 mid-group ends the epoch with no optimizer step for
        the group's micro-batches; Lightning's ``zero_grad`` at the next group's start (batch
        ``i`` with ``i % accumulate_grad_batches == 0``) clears their gradients. The guard's open
        group, which its next backward took for a ``zero_grad()`` of the user's in the group (and
        raised), goes too (warned, naming the micro-batches): no step counted (Lightning's
        ``global_step`` did not move), no record, and the BatchNorm statistics their forwards
        wrote stand, as under Lightning."""
        guard, trainer = self.guard, self._fitting
        if guard is None or trainer is None or not guard.mid_group:
            return
        if not trainer.lightning_module.automatic_optimization:
            return
        if trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches:
            return  # (inside Lightning's group: the guard's goes on)
        if trainer.current_epoch == self._group_began[0]:
            return  # (the same epoch: no early end; an optimizer_step that skipped the step is refused as before)
        # the group's epoch's batches, noted as the group began: the Trainer's num_training_batches is the new
        # epoch's by now (a reload_dataloaders_every_n_epochs loader with fewer batches took the dropped group
        # for one at its epoch's end, and its next backward raised "gradients ... cleared inside the group")
        epoch_batches, last = self._group_epoch_batches, self._group_began[1] + guard.micro_batches - 1
        if isinstance(epoch_batches, int) and last >= epoch_batches - 1:
            return  # (the epoch ran to its end, where Lightning steps a short group: an optimizer_step skipped it)
        _say(f"AmpGuardPlugin: {self._open_group()} had no optimizer step (the epoch ended inside the "
             f"group: on_train_batch_start returned -1?); dropped, as Lightning drops them (its zero_grad "
             f"at the next group's start)")
        guard._abandon_group()
        guard.accumulation_steps = self._accumulation  # (between groups: the Trainer's setting, as after a step)

    def _open_group(self) -> str:
        """The guard's open accumulation group in words: ``"epoch 0's micro-batches 4-5 (2 of 4)"``."""
        assert self.guard is not None
        taken, of = self.guard.micro_batches, self.guard.accumulation_steps
        epoch, first = self._group_began
        batches = f"micro-batch {first}" if taken == 1 else f"micro-batches {first}-{first + taken - 1}"
        return f"epoch {epoch}'s {batches} ({taken} of {of})"

    def _noting_dtypes(self) -> contextlib.AbstractContextManager:
        """The dtype hooks for the fit's first training step under autocast
        (``watch.first_forward_dtypes``: a step that raises, a ``BatchSizeFinder``'s out-of-memory,
        leaves :attr:`autocast_dtypes` ``None`` for the next); a no-op after it, in fp32, and for
        a compiled model (hooks traced into its graph, then removed, would make ``torch.compile``
        compile it again: the map stays empty)."""
        trainer = self._fitting
        if self.autocast_dtypes is not None or trainer is None or not (self._autocast and self._autocast.autocasts):
            return contextlib.nullcontext()
        module = trainer.lightning_module
        if module._compiler_ctx is not None:  # (fit(torch.compile(module)): its forward is dynamo's)
            self.autocast_dtypes = {}
            return contextlib.nullcontext()
        return first_forward_dtypes(module, self)

    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return _LightningPrecision.pre_backward(self, tensor, module)  # the on_before_backward hooks; the guard scales

    def backward(self, tensor: Tensor, model: pl.LightningModule, optimizer: Any,  # type: ignore[override]
                 *args: Any, **kwargs: Any) -> None:
        """``guard.backward``: the loss checked before backward, scaled, backward.

        Lightning has already divided the loss by ``accumulate_grad_batches`` (N): the guard takes
        it as it is (``divided``), so the gradients are bit for bit Lightning's for any N. N is
        the Trainer's at each group's start, where a ``GradientAccumulationScheduler`` changes it
        (at an epoch's start, and Lightning ends every group by the epoch's end): the record's
        loss is then the group's mean loss, not N/N' times it. In manual optimization N is 1
        (Lightning refuses accumulation there), and ``manual_backward`` is called inside
        ``training_step``, so inside the forward's autocast: the backward runs with autocast
        closed, as the AMP recipe runs it (the guard refuses a backward inside autocast)."""
        guard = self.guard or self._setup(model)
        if guard.pending:  # the micro-batch before, inside its accumulation group: no update
            if guard.micro_batches >= guard.accumulation_steps:
                if not model.automatic_optimization:
                    raise RuntimeError(
                        "AmpGuardPlugin: two manual_backward calls without an optimizer step in between; in manual "
                        "optimization the guard steps once per manual_backward (Lightning refuses "
                        "accumulate_grad_batches there): call opt.step() after each manual_backward, sum the "
                        "losses into one manual_backward, or accumulate in automatic optimization with "
                        "Trainer(accumulate_grad_batches=N)")
                raise RuntimeError("AmpGuardPlugin: two backward passes without an optimizer step in between; "
                                   "accumulate with Trainer(accumulate_grad_batches=N)")
            guard.step()
        if not guard.mid_group:  # a group begins: its N (the loss Lightning hands over is divided by it)
            guard.accumulation_steps = _group_size(model, model.trainer)
            self._group_began = (model.trainer.current_epoch, model.trainer.fit_loop.epoch_loop.batch_idx)
            self._group_epoch_batches = model.trainer.num_training_batches
        device_type = guard.precision.device_type  # (manual optimization calls this inside training_step's autocast)
        inside = torch.is_autocast_enabled(device_type)
        # Lightning's Precision.backward calls model.backward(loss, *args, **kwargs), which an override may
        # change (a log, a context); the guard hands it the scaled, checked loss, as Lightning's own
        # MixedPrecision hands it the scaled one. Without either, the guard's own backward (its loss.backward())
        if self._own_backward is None:  # once a fit: is_overridden walks the class (~19 us a backward)
            self._own_backward = is_overridden("backward", model)
        own = functools.partial(model.backward, *args, **kwargs) \
            if args or kwargs or self._own_backward else None  # (a refusal names the override)
        with torch.autocast(device_type, enabled=False) if inside else contextlib.nullcontext():
            guard.backward(tensor, divided=True, backward=own)

    def optimizer_step(self, optimizer: Any, model: pl.LightningModule,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The closure (training_step, backward), the hooks, then the guarded step and its record."""
        closure_result = closure()
        guard = self.guard
        # Lightning skipped the backward itself (fit_loop._skip_backward: StochasticWeightAveraging's
        # last epoch, a pass over the data for the BatchNorm statistics of the averaged weights, "no need
        # to perform either backward or optimizer.step"): its closure returns the loss, no backward ran
        skipped = bool(getattr(model.trainer.fit_loop, "_skip_backward", False))
        if (guard is None or not guard.pending) and model.automatic_optimization and (
                closure_result is None or skipped):
            # training_step returned None (or Lightning skipped the backward) and no backward ran in
            # this optimizer step: Lightning skips the update (MixedPrecision: no scaler.step) but
            # counts the step; so does the plugin: no record, no update, the step-interval
            # schedulers step as Lightning steps them, and the guard's numbering moves on with
            # Lightning's global_step (built now if it is not yet: a resumed fit's guard takes the
            # checkpoint's step first). A group whose
            # last micro-batches return None after others made gradients closes with those (the
            # pending branch below), as Lightning's bf16 does; its 16-mixed skips that step. Under a
            # skipped backward Lightning steps the optimizer on the gradients the last step left (the
            # guard dropped them after it): no update here, so SWA's averaged weights stay as it set them
            self._after_closure(model, optimizer)
            self._hold = False
            (guard or self._setup(model)).count_step_without_backward()
            self._count_held(model.trainer, skipped=False)
            return closure_result
        if guard is None or not guard.pending:
            if not model.automatic_optimization:
                raise RuntimeError("AmpGuardPlugin: opt.step() without a manual_backward(loss) since the last "
                                   "optimizer step; the guard steps once per manual_backward: call "
                                   "self.manual_backward(loss) once before each opt.step() (one loss for two "
                                   "optimizers, manual_backward(loss) then o1.step() and o2.step(), is not covered: "
                                   "the first step drops every gradient; put both parameter sets in one optimizer, "
                                   "as param groups)")
            raise RuntimeError("AmpGuardPlugin: no backward ran before this optimizer step, though training_step "
                               "returned a loss (a backward of Lightning's skipped, or the closure ran elsewhere?)")
        names = () if len(guard.optimizers) == 1 else (optimizer,)
        if guard.scaler.is_enabled() or _hooks_see_gradients(model):
            guard.unscale_(*names)  # so on_before_optimizer_step sees true gradients (unscaled, or checked first)
        self._after_closure(model, optimizer)
        record = guard.step(*names, close=True)  # only at a group's end (or an epoch's short last group)
        assert record is not None
        guard.accumulation_steps = self._accumulation  # the Trainer's setting between groups (what state_dict saves)
        self._record(record, model)
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Refused with a value: the guard clips to ``max_norm`` itself, between unscale and the
        step, after its non-finite check. Lightning calls this from ``LightningModule.clip_gradients``:
        for the Trainer's ``gradient_clip_val`` (refused in :meth:`connect`), from a
        ``configure_gradient_clipping`` override, or from ``self.clip_gradients(...)`` in manual
        optimization, Lightning's clipping idiom between ``manual_backward`` and ``opt.step()``
        (review 53d: the refusal did not say to remove the call for the plugin's ``max_norm=``)."""
        if clip_val and clip_val > 0:
            raise ValueError(_clip_call_refusal(self._fitting, clip_val, gradient_clip_algorithm))

    def _record(self, record: StepLog | SkipLog, module: pl.LightningModule) -> None:
        """One record per optimizer step: sinks (rank 0), monitor, ``self.log``, the scheduler hold.
        A tuner's trial step (:meth:`_sweeping`) is guarded but recorded nowhere."""
        trainer = module.trainer
        if self._sweeping(trainer):
            self._hold = False  # (the sweep's schedule, lr_find's, steps every step)
            return
        self._hold = bool(record.skipped)
        self._count_held(trainer, self._hold)
        if self._sinks is None:
            self._sinks = self._open_sinks(trainer)
        for sink in self._sinks:
            sink.write(record)
        assert self.monitor is not None
        events = self.monitor.observe(record)
        for sink in self._sinks:  # the tracker sinks: the monitor's view and its events, with the step's row
            if hasattr(sink, "observe"):
                sink.observe(self.monitor, events)
        if self.records.maxlen != 0:  # the last keep_records, as host values: the values the sinks and the
            # monitor read, not the step's tensors (review 56c: 3 a record, 30,000 device allocations at 10,000)
            self.records.append(dataclasses.replace(record, **record.values(), packed=None, read=None))
        for event in events:
            if event.kind == "fail":
                set_aside = self._stop(trainer)
                self.stop_reason = (f"ampguard stopped the trainer at step {event.step}: {event.message}"
                                    + (f" (set aside: the Trainer's {set_aside})" if set_aside else ""))
                _say(self.stop_reason)
            elif event.kind in ("skip_rate_alert", "scale_alert"):
                _say(f"ampguard ALERT at step {event.step}: {event.message}")
        # several optimizers (a GAN's D and G steps in one training_step): keys of their own,
        # ampguard/<optimizer>/..., or the second record's values would replace the first's
        prefix = f"ampguard/{'+'.join(record.optimizers)}/" if record.optimizers else "ampguard/"
        self._unlogged_skips[prefix] = self._unlogged_skips.get(prefix, 0) + int(record.skipped)
        if self.log and _loggers_write_now(trainer):
            values = record.values()
            # every key every time (nan where the value does not exist, e.g. the norm of a loss
            # skip): Lightning would otherwise repeat the last value logged under a key
            metrics = {key.replace("ampguard/", prefix, 1): math.nan if values[field] is None else values[field]
                       for field, key in LOG_KEYS.items()}
            # the skips since the last write, as HF's logs count them (the logged step's own 0 or 1
            # hid the skips of the steps between: log_every_n_steps=5 showed none of 4)
            metrics[f"{prefix}skipped"] = float(self._unlogged_skips.pop(prefix))
            metrics["ampguard/skip_rate"] = self.monitor.skip_rate
            module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def _sweeping(self, trainer: pl.Trainer) -> bool:
        """Whether a tuner's sweep is running: ``lr_find`` and ``scale_batch_size`` (a Tuner's, or
        their callbacks in a fit) train trial steps, then restore the checkpoint they saved before
        (:meth:`load_state_dict` rewinds the guard). For the sweep Lightning swaps the Trainer's
        callbacks for its own (none, or lr_find's ``_LRCallback``): the tuner's callback, there
        when the fit began, is gone from them until the sweep ends."""
        return self._tuned and not any(isinstance(cb, _TUNERS) for cb in trainer.callbacks)

    def _stop(self, trainer: pl.Trainer) -> str:
        """Stop the fit after this step, as ``ampguard train`` stops at a guard's failure.

        ``trainer.should_stop`` alone is what Lightning's ``EarlyStopping`` sets, and Lightning
        ignores it until ``min_steps`` and ``min_epochs`` are met (``_FitLoop._can_stop_early``;
        ``min_steps`` alone implies ``min_epochs=1``): a diverged fit would train on, every step
        skipped. So the minimums not met yet are cleared for the rest of this fit (``teardown``
        restores them) and the fit ends as an early stop does: the epoch's end hooks, a
        checkpoint callback's last save, ``fit`` returns. Every rank sees the same records (the
        skip is agreed), so every rank stops at the same step. Returns the minimums set aside
        (``"min_steps=20"``), or ``""``."""
        trainer.should_stop = True
        fit_loop = trainer.fit_loop
        min_epochs, min_steps = fit_loop.min_epochs, fit_loop.epoch_loop.min_steps
        step = trainer.global_step + 1  # this step, which Lightning counts once the optimizer step returns
        steps_short = bool(min_steps) and step < min_steps
        epochs_short = bool(min_epochs) and trainer.current_epoch < min_epochs
        if not (steps_short or epochs_short):
            return ""
        if self._minimums is None:
            self._minimums = (min_epochs, min_steps)
        fit_loop.min_epochs, fit_loop.epoch_loop.min_steps = 0, None
        named = [f"min_steps={min_steps}"] if steps_short else []
        if epochs_short and not (steps_short and min_steps and min_epochs == 1):
            implied = min_steps and min_epochs == 1  # Lightning's min_epochs=1 for a min_steps
            named.append(f"min_epochs=1, which Lightning sets for min_steps={min_steps}" if implied
                         else f"min_epochs={min_epochs}")
        return ", ".join(named)

    # ------------------------------------------------------------------ checkpoints

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Lightning hands the plugin the whole checkpoint before :meth:`load_state_dict`. Review 54m:
        a checkpoint saved by Lightning's own fp16 ``MixedPrecision`` holds its GradScaler's
        ``state_dict()`` under ``"MixedPrecision"`` (``"native_amp_scaling_state"`` in Lightning 1.x,
        which Lightning hands to any ``MixedPrecision``'s ``load_state_dict``, this plugin's too: taken
        out here), and a resume with the plugin threw that scale away, restarting at ``init_scale``
        (a run whose scale had settled low skipped its first steps again). Where neither key is
        there, the one entry whose keys are a GradScaler's (:func:`_gradscaler_states`: a user's
        ``MixedPrecision`` subclass's, under its class's name; review 55f) is taken over, and two
        such entries are refused (``ValueError`` naming both) unless this fit has no loss scaler
        (then neither is used, said). Where the checkpoint's
        ampguard state holds no scale (none, or saved before its fit's first step), that state is
        checked here with the scaler's own :meth:`~ampguard.precision.GuardedGradScaler.check_state`,
        before any step: one that is not a GradScaler's is refused (``ValueError`` naming the field);
        :meth:`_setup` takes its scale and growth tracker over. Outside a fit, left alone."""
        legacy = checkpoint.pop(_LEGACY_SCALER_KEY, None)
        _LightningPrecision.on_load_checkpoint(self, checkpoint)
        if self._fitting is None:
            return
        self._stock = None
        own = checkpoint.get(type(self).__qualname__)
        if isinstance(own, dict) and not own.get(_BEFORE_FIRST_STEP):
            return  # (ampguard's own state holds the scale: the guard loads it)
        if _STOCK_SCALER_KEY in checkpoint or legacy is not None:
            key = _STOCK_SCALER_KEY if _STOCK_SCALER_KEY in checkpoint else _LEGACY_SCALER_KEY
            state = checkpoint.get(_STOCK_SCALER_KEY, legacy)
        else:  # (review 55f: a subclass of MixedPrecision saves its GradScaler's state under its own class name)
            found = _gradscaler_states(checkpoint, type(self).__qualname__)
            if len(found) > 1 and loss_scaler_runs(self.name, self.scaler_settings.get("enabled")):
                trainer = self._end_refused_fit()
                where = Path(trainer.ckpt_path).name if trainer is not None and trainer.ckpt_path else "the checkpoint"
                raise ValueError(f"AmpGuardPlugin: {where} holds GradScaler states under {found[0]!r} and "
                                 f"{found[1]!r}{' (and more)' if len(found) > 2 else ''}, none under "
                                 f"{_STOCK_SCALER_KEY!r}: which one is this fit's loss scale cannot be told; delete "
                                 f"the entries not to go on from, or start a new fit without ckpt_path")
            key = " and ".join(found)
            state = checkpoint[found[0]] if found else None
        if state is None:
            return
        if not loss_scaler_runs(self.name, self.scaler_settings.get("enabled")):
            self._stock = (key, None)  # (said at the first step: this fit has no scale to take it)
            return
        try:
            GuardedGradScaler("cpu").check_state(state)
        except ValueError as err:
            trainer = self._end_refused_fit()
            where = Path(trainer.ckpt_path).name if trainer is not None and trainer.ckpt_path else "the checkpoint"
            raise ValueError(f"AmpGuardPlugin: the GradScaler state under {key!r} in {where} cannot be taken over: "
                             f"{err}; fix or delete that entry (the loss scale then starts at init_scale), or start "
                             f"a new fit without ckpt_path") from None
        self._stock = (key, dict(state))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Review 54m, the other way: Lightning's own ``MixedPrecision`` resuming this plugin's
        checkpoint looks for its scaler under ``"MixedPrecision"`` only, found none, and restarted
        at ``init_scale``. The fp16 scale is also saved there, in GradScaler's own shape (no
        ``min_scale``), from the state :meth:`state_dict` gave (or a stock state not yet taken
        over); a resume with the plugin loads its own state and leaves that entry."""
        own = checkpoint.get(type(self).__qualname__) or {}
        state = own.get("scaler") or (self._stock[1] if self._stock is not None else None)
        if state:
            checkpoint[_STOCK_SCALER_KEY] = {name: state[name] for name in GRADSCALER_KEYS}
        _LightningPrecision.on_save_checkpoint(self, checkpoint)

    def state_dict(self) -> dict[str, Any]:
        """The guard's state (scaler, step and update counters, the monitor), once it exists, and
        :attr:`autocast_dtypes` once noted (a record kept with the checkpoint, not compared on a resume)."""
        held = {"held_batches": list(self._held_batches)} if self._held_batches is not None else {}
        if self.autocast_dtypes:
            held["autocast_dtypes"] = dict(self.autocast_dtypes)
        if self.guard is None:  # before the fit's first backward: what a resume loaded, or that there was
            # nothing yet (never {}: Lightning neither saves nor restores an empty state, and a tuner restoring
            # the checkpoint it saved here must rewind the guard its sweep built: load_state_dict)
            return {**self._loaded, **held} if self._loaded else {_BEFORE_FIRST_STEP: True, **held}
        guard = self.guard
        # Lightning may save inside an accumulation group (validation or a callback between micro-
        # batches): the state at the last boundary is the one to save, with the Trainer's
        # accumulation setting, not the open group's (a GradientAccumulationScheduler's)
        return {**guard.state_dict(mid_group=True), "accumulation_steps": self._accumulation, **held}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restored when Lightning resumes (``ckpt_path``); the CSV then appends after its step.
        Outside a fit (``trainer.validate/test/predict(ckpt_path=...)``, for which Lightning
        restores it too) it is left alone: :attr:`guard`, :attr:`monitor` and :attr:`records`
        stay the last fit's.

        Mid-fit (a guard built: a tuner restoring the checkpoint it saved before its sweep, which
        :meth:`_record` recorded nowhere) the sweep's guard goes, its steps, scale, monitor and
        scheduler hook with it, and the next backward builds the fit's own from this state (or
        afresh when it holds none: saved before the fit's first step), as a resume does."""
        if self._fitting is None:
            return
        if self.guard is not None:
            self._unhook()
            self.guard, self.monitor, self._loaded, self._held_batches, self._hold = None, None, None, None, False
        if not state_dict:
            return
        self._refuse_a_change(state_dict)
        self._loaded = dict(state_dict)
        held = self._loaded.pop("held_batches", None)  # (a checkpoint of an older plugin has none: _setup)
        self._loaded.pop("autocast_dtypes", None)  # (a record: this fit notes its own)
        self._held_batches = (int(held[0]), int(held[1])) if held is not None else None
        if self._loaded.pop(_BEFORE_FIRST_STEP, False):
            self._loaded = None  # (the guard starts afresh)

    def _end_refused_fit(self) -> pl.Trainer | None:
        """The fit a checkpoint's refusal ends (returned): no longer this plugin's, its CSV and
        sinks left to the next fit (as for the plugin's other refusals)."""
        trainer, self._fitting = self._fitting, None
        if self.csv is not None:
            self._csv_fits.discard(os.path.abspath(self.csv))
        return trainer

    def _refuse_a_change(self, state: dict[str, Any]) -> None:
        """A resume whose checkpoint was saved under another precision or ``accumulate_grad_batches``
        is refused as Lightning restores it, before any step (it failed at the first backward, a
        ``training_step`` later, with the guard's bare ``ValueError``): the loss scale and the
        skip-rate window were that run's. A refused fit is not this plugin's fit: its CSV and
        sinks are left to the next (as for the plugin's other refusals)."""
        saved = {"precision": state.get("precision"), "accumulate_grad_batches": state.get("accumulation_steps")}
        mine = {"precision": self.name, "accumulate_grad_batches": self._accumulation}
        changed = [key for key in saved if saved[key] is not None and saved[key] != mine[key]]
        if not changed:
            return
        trainer = self._end_refused_fit()
        key = changed[0]
        shown = {v: k for k, v in _NAMES.items() if "-" in k} if key == "precision" else {}
        where = Path(trainer.ckpt_path).name if trainer is not None and trainer.ckpt_path else "the checkpoint"
        raise ValueError(f"AmpGuardPlugin: {where} was saved with {key}={shown.get(saved[key], saved[key])!r}, this "
                         f"fit has {shown.get(mine[key], mine[key])!r}: a resumed fit must keep it (its loss scale "
                         f"and skip-rate window were that run's); fit with the same setting, or start a new fit "
                         f"without ckpt_path")


class _AlsoMixedPrecision(_LightningMixedPrecision):
    """What an fp16/bf16 :class:`AmpGuardPlugin` (or a subclass of yours) is made with besides
    its own class (:func:`_mixed_in`): a Lightning ``MixedPrecision``, for what reads a plugin's
    precision by its class (``ThroughputMonitor``'s available FLOPs, so its MFU). Every method
    ``MixedPrecision`` defines is ``AmpGuardPlugin``'s (its own ``__init__``, scaler and clipping
    never run), and ``AmpGuardPlugin`` calls Lightning's ``Precision`` by name, not ``super()``,
    so ``MixedPrecision`` never scales a loss here."""

    @property  # (MixedPrecision's attribute: the autocast device)
    def device(self) -> str:
        autocast = self._autocast  # type: ignore[attr-defined]
        return autocast.device_type if autocast is not None else ("cuda" if torch.cuda.is_available() else "cpu")

    def autocast_context_manager(self) -> contextlib.AbstractContextManager:
        return self.forward_context()  # type: ignore[attr-defined]


@functools.cache
def _mixed_in(cls: type) -> type:
    """``cls`` (AmpGuardPlugin or a subclass) with :class:`_AlsoMixedPrecision` mixed in, under
    ``cls``'s own name: Lightning saves the plugin's state under its class's ``__qualname__``, so
    the checkpoint key stays ``"AmpGuardPlugin"`` (README) whatever the precision, and a resume
    across precisions is refused by name. Pickled as ``cls`` (:meth:`AmpGuardPlugin.__reduce_ex__`)."""
    return type(cls.__name__, (cls, _AlsoMixedPrecision),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, "_plain": cls})


def _remade_mixed(cls: type) -> AmpGuardPlugin:
    """An fp16/bf16 plugin of class ``cls`` being unpickled or copied (its state comes next)."""
    made = cls.__new__(cls)
    made.__class__ = _mixed_in(cls)
    return made


def _at_its_limit(trainer: pl.Trainer) -> bool:
    """Whether the fit trained to the Trainer's ``max_steps`` or ``max_epochs`` (a callback's
    ``should_stop`` there, or one Lightning held until ``min_steps``, stopped nothing)."""
    steps, epochs = trainer.max_steps, trainer.max_epochs
    return (steps is not None and steps >= 0 and trainer.global_step >= steps) or (
        epochs is not None and epochs >= 0 and trainer.current_epoch >= epochs)


def _hooks_see_gradients(model: pl.LightningModule) -> bool:
    """Whether code of the user's runs on the gradients between the backward and the guard's
    step: an ``on_before_optimizer_step`` of the module's or a callback's, or the module's
    :data:`_CLIPPING_HOOKS` (Lightning's ``_after_closure`` runs them). With no loss scaler,
    ``guard.unscale_()`` before them only records what PyTorch's non-finite check finds
    (a hook that then clamps an inf, ``nan_to_num_`` or ``clip_grad_value_``, still skips the
    step); with none of them, the step's own check sees the same gradients, and that pass over
    them (~7% of a small MLP's step) is left out."""
    return (any(_overrides(model, pl.LightningModule, hook) for hook in _GRADIENT_HOOKS)
            or any(_overrides(cb, pl.Callback, "on_before_optimizer_step") for cb in model.trainer.callbacks))


_CLIPPING_HOOKS = ("configure_gradient_clipping", "clip_gradients")
"""The LightningModule's hooks that clip (Lightning runs them before the guard's step): an
override is warned of up front (it hides the pre-clip norm), and runs after the early check."""

_GRADIENT_HOOKS = ("on_before_optimizer_step", *_CLIPPING_HOOKS)
"""The LightningModule's hooks that run between the backward and the optimizer step."""


def _overrides(obj: Any, base: type, hook: str) -> bool:
    """Whether ``obj`` has a ``hook`` other than ``base``'s (its class's, or one set on it). A few
    attribute reads: not Lightning's ``is_overridden`` (~19 us)."""
    return getattr(type(obj), hook, None) is not getattr(base, hook) or hook in vars(obj)


def _loggers_write_now(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes its loggers after this step (every ``log_every_n_steps``, and when
    stopping). ``LightningModule.log`` costs milliseconds per key; on the other steps what it
    logs reaches no logger, so the plugin logs only on these."""
    return bool(getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", True))


_BEFORE_FIRST_STEP = "before_first_step"
"""The state a checkpoint saved before the fit's first step holds (:meth:`AmpGuardPlugin.state_dict`)."""

_STOCK_SCALER_KEY = "MixedPrecision"
"""Where Lightning's own ``MixedPrecision`` saves its GradScaler's ``state_dict()`` in a checkpoint
(its class's ``__qualname__``), and looks for it on a resume."""
_LEGACY_SCALER_KEY = "native_amp_scaling_state"
"""The same state in a Lightning 1.x checkpoint."""


def _gradscaler_states(checkpoint: dict[str, Any], own: str) -> list[str]:
    """The keys of ``checkpoint``'s entries that are a GradScaler's ``state_dict()`` (its keys,
    :data:`~ampguard.precision.GRADSCALER_KEYS`, and no other), ``own`` (this plugin's entry)
    aside: where a precision plugin of another name saved one. Lightning saves a precision
    plugin's ``state_dict()`` under its class's ``__qualname__`` (a user's ``MixedPrecision``
    subclass's, ``"MyAMP"``), and a ``MixedPrecision``'s is its GradScaler's.

    Example::

        >>> state = torch.amp.GradScaler("cpu").state_dict()
        >>> _gradscaler_states({"MyAMP": state, "epoch": 0, "state_dict": {}, "AmpGuardPlugin": {"step": 3}},
        ...                    "AmpGuardPlugin")
        ['MyAMP']
    """
    return [key for key, value in checkpoint.items() if isinstance(key, str) and key != own
            and isinstance(value, dict) and set(value) == set(GRADSCALER_KEYS)]


_TUNERS = (LearningRateFinder, BatchSizeFinder)
"""Lightning's tuner callbacks (``Tuner.lr_find``, ``Tuner.scale_batch_size``, or given as
callbacks): each runs its sweep as a fit, or inside one, through the plugin."""


def _clip_refusal(trainer: pl.Trainer) -> str:
    """Why a Trainer's ``gradient_clip_val`` is refused, and what to do instead: by norm, the
    plugin's ``max_norm``; by value, nothing the plugin offers (a value clip before the guard's
    check would turn an inf gradient into a finite one, and the step would be applied)."""
    val = trainer.gradient_clip_val
    if trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
        return (f"AmpGuardPlugin clips by the global L2 norm (max_norm), after its non-finite check, and offers no "
                f"clipping by value: drop the Trainer's gradient_clip_val={val} with gradient_clip_algorithm='value' "
                f"(a value clip in a hook would make an inf gradient finite, and the guard apply its step); "
                f"max_norm on the plugin clips by norm, another rule")
    return (f"AmpGuardPlugin clips to max_norm after its non-finite check: drop the Trainer's "
            f"gradient_clip_val={val} (use max_norm={val} on the plugin)")


def _clip_call_refusal(trainer: pl.Trainer | None, val: float, algorithm: Any) -> str:
    """Why a ``self.clip_gradients(...)`` with a value is refused, and the way out: the call
    removed from where it is (``training_step`` in manual optimization, else the
    ``configure_gradient_clipping`` override), and the plugin's ``max_norm`` (by value: nothing
    the plugin offers, as for the Trainer's setting, :func:`_clip_refusal`)."""
    manual = trainer is not None and not trainer.lightning_module.automatic_optimization
    where = "training_step" if manual else "configure_gradient_clipping"
    call = f"remove the self.clip_gradients(...) call from {where}"
    if algorithm == GradClipAlgorithmType.VALUE:
        return (f"AmpGuardPlugin clips by the global L2 norm (max_norm) between unscale and the step, after its "
                f"non-finite check, and offers no clipping by value: {call} (a value clip before the guard's check "
                f"would make an inf gradient finite); max_norm= on the plugin clips by norm, another rule")
    return (f"AmpGuardPlugin clips to max_norm itself, between unscale and the step, after its non-finite check "
            f"(the records' grad_l2_pre_clip and grad_l2_post_clip): {call} and give the plugin max_norm={val}"
            + (" (it clips at each opt.step())" if manual else ""))


def _check_writable(path: Path, where: str, rewritten: bool = False) -> None:
    """Refuse (one :class:`InputError` line) a CSV path rank 0 cannot write, before the fit trains:
    the file opens at the first record, after the first update (``/proc/steps.csv`` passed the
    folder checks and failed there, the parameters changed). The folder is judged by
    :func:`~ampguard.errors.unwritable`, as the Hugging Face callback's ``out_dir`` and
    ``log.wandb.dir`` are: a file made and removed in each existing folder ``mkdir -p`` makes a
    folder in, or in the CSV's folder when it exists. A CSV a resume ``rewritten`` (its rows after
    the checkpoint's step cut: a new file renamed over it) needs its folder, the folder of the
    file it links to for a link (``replace_atomically(through_link=True)`` rewrites the target),
    and then the file itself opened to append: the new file keeps the old one's mode (a
    read-only CSV stays one, and is refused here). An existing file not rewritten is opened to
    append (nothing written; a named pipe never waited on)."""
    try:
        if rewritten:
            target = Path(os.path.realpath(path))
            folder = target.parent
        elif path.exists():
            _open_to_append(path)
            return
        else:
            folder = path.parent
    except OSError as err:
        raise InputError(f"{where}: cannot write {shown(path)}: {failed_because(err)}; give a csv path you can "
                         f"write") from None
    problem = unwritable(folder)
    if problem is not None:
        raise InputError(f"{where}: {problem}{', where a resume rewrites the CSV' if rewritten else ''}; give a "
                         f"csv path in a folder you can write")
    if rewritten:
        try:
            _open_to_append(target)
        except OSError as err:  # (a read-only CSV: a resume keeps its mode, and appends to it)
            raise InputError(f"{where}: cannot write {shown(path)}: {failed_because(err)} (a resume appends to it); "
                             f"give a csv path you can write") from None


def _open_to_append(path: Path) -> None:
    """Open ``path`` to append and close it, writing nothing; without waiting, as the sinks open it
    (:func:`~ampguard.sinks.opened_without_waiting`: a named pipe no process reads is ``ENXIO``,
    not a fit that never begins)."""
    os.close(opened_without_waiting(os.fspath(path), os.O_WRONLY | os.O_APPEND))


def _said(path: str | os.PathLike) -> str:
    """A CSV path as the plugin's refusals write it: its ``repr`` (a newline stays on the line),
    cut to :data:`~ampguard.errors.MAX_PATH_SHOWN` characters."""
    return shortened(repr(os.fsdecode(path)), MAX_PATH_SHOWN)


def _say(line: str) -> None:
    """A line about what this fit did (an ALERT, the guard's stop, a dropped group), said as an
    :class:`~ampguard.errors.AmpguardWarning` from the plugin's line on rank 0, as
    ``rank_zero_warn`` does, but at every fit: ``rank_zero_warn`` is ``warnings.warn``, which
    shows a (text, category, line) once a process, and a second fit's stop at the same step (a
    notebook cell run again, a sweep's trials) ended the fit without a word (review 58f). A
    filter of the user's still applies (:func:`~ampguard.errors.warn_each_time`). What is said
    of the module's code or the Trainer's settings (an overridden clipping hook) is
    ``rank_zero_warn``'s, once a process, as Lightning's own advice is."""
    if getattr(rank_zero_only, "rank", 0) == 0:
        warn_each_time(line, AmpguardWarning, stacklevel=2)


def _check_sinks(sinks: Any, where: str = "AmpGuardPlugin(sinks=...)") -> list[Sink]:
    """``sinks`` as a list, refused (one line) unless it holds ampguard sinks: a path string (each
    character taken for a sink) or a ``None`` in the list was taken, and failed at the first record,
    after an update, with a bare ``AttributeError``."""
    if isinstance(sinks, (str, bytes, os.PathLike)) or not hasattr(sinks, "__iter__"):
        raise TypeError(f"{where}: {sinks!r} is not a list of sinks; give ampguard sinks, e.g. "
                        f"[JsonlSink('steps.jsonl')] (the CSV is csv='steps.csv')")
    sinks = list(sinks)
    for sink in sinks:
        if not isinstance(sink, Sink):
            raise TypeError(f"{where}: {sink!r} is not an ampguard sink (one with write(record) and close(): "
                            f"JsonlSink, TensorBoardSink, WandbSink, MLflowSink, ...)")
    return sinks


def _group_size(module: pl.LightningModule, trainer: pl.Trainer) -> int:
    """The micro-batches of the group about to begin: the Trainer's ``accumulate_grad_batches``
    now (a ``GradientAccumulationScheduler`` changes it per epoch); 1 in manual optimization,
    where Lightning refuses accumulation."""
    return trainer.accumulate_grad_batches if module.automatic_optimization else 1


def _lightning_module(model: torch.nn.Module) -> pl.LightningModule | None:
    """The LightningModule inside a strategy's wrapper (DDP's ``.module``), or ``None``."""
    for _ in range(4):
        if isinstance(model, pl.LightningModule):
            return model
        model = getattr(model, "module", None)
        if model is None:
            return None
    return None
