"""From a :class:`~ampguard.config.Config` to objects: device, optimizer, LR schedule, the guarded
step, the monitors, batches on the device.

Every verb that trains or replays (``train``, ``demo``, ``validate``, ``locate``, ``bench``)
builds here, so a setting means the same thing everywhere. Two small truths are decided once:
whether a precision uses a loss scaler (asked of :class:`~ampguard.precision.Precision`) and
whether clipping is on (:func:`~ampguard.clipping.clip_threshold`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from .clipping import clip_threshold
from .config import Config
from .errors import InputError
from .monitor import LossSpikeDetector, RunMonitor
from .precision import Precision
from .run_folder import RunPaths
from .sinks import ConsoleSink, CsvSink, JsonlSink, Sink, Sinks, TensorBoardSink
from .step import AmpTrainState


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else the CPU; ``cuda`` without a GPU is bad input.

    Example::

        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("auto").type in ("cpu", "cuda")
        True
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("device: cuda was asked for but no CUDA device is available")
    return torch.device(name)


def precision_of(config: Config, device: torch.device) -> Precision:
    """The config's precision on ``device``.

    Example::

        >>> from ampguard.config import validate
        >>> precision_of(validate({"precision": "fp16"}), torch.device("cpu")).uses_scaler
        True
    """
    return Precision(config.precision, device.type)


def initial_scale(config: Config, device: torch.device) -> float:
    """The loss scale a run starts with: ``scaler.init_scale`` when the precision scales, else 1.

    Example::

        >>> from ampguard.config import validate
        >>> initial_scale(validate({"precision": "bf16"}), torch.device("cpu"))
        1.0
    """
    return float(config.scaler.init_scale) if _scaler_on(config, device) else 1.0


def _scaler_on(config: Config, device: torch.device) -> bool:
    enabled = config.scaler.enabled
    return precision_of(config, device).uses_scaler if enabled is None else enabled


def make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer.name``: SGD (with momentum) or AdamW (``fused`` when asked).

    Example::

        >>> from ampguard.config import validate
        >>> type(make_optimizer(validate({}), nn.Linear(2, 1))).__name__
        'AdamW'
    """
    opt = config.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, fused=opt.fused
    )


def lr_multiplier(config: Config) -> Callable[[int], float]:
    """The schedule as a factor of ``optimizer.lr``, a function of applied updates: linear warmup
    over ``schedule.warmup`` updates, then ``schedule.decay`` down to ``min_lr_ratio`` at the
    last step.

    Example::

        >>> from ampguard.config import validate
        >>> f = lr_multiplier(validate({"steps": 11, "schedule": {"warmup": 2, "decay": "linear"}}))
        >>> [round(f(u), 3) for u in (0, 1, 2, 10)]
        [0.5, 1.0, 1.0, 0.1]
    """
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


def build_state(config: Config, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                device: torch.device) -> AmpTrainState:
    """The guarded step for a config: optimizer, LR schedule, scaler, clipping, accumulation.
    ``model`` is the model to train, already on ``device`` (DDP/FSDP2-wrapped under torchrun).

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"precision": "bf16", "accumulation_steps": 2})
        >>> state = build_state(config, nn.Linear(3, 1), torch.nn.functional.mse_loss, torch.device("cpu"))
        >>> state.step(torch.randn(4, 3), torch.randn(4, 1)) is None, state.accumulation_steps
        (True, 2)
    """
    optimizer = make_optimizer(config, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config))
    s = config.scaler
    return AmpTrainState(
        model,
        optimizer,
        loss_fn,
        precision=precision_of(config, device),
        max_norm=clip_threshold(config.max_norm),
        accumulation_steps=config.accumulation_steps,
        scheduler=scheduler,
        device=device,
        scaler=dict(
            enabled=s.enabled,
            init_scale=s.init_scale,
            growth_factor=s.growth_factor,
            backoff_factor=s.backoff_factor,
            growth_interval=s.growth_interval,
            min_scale=s.min_scale,
        ),
        scheduler_on_skip=config.scheduler_on_skip,
    )


def build_monitor(config: Config, scaler_enabled: bool) -> RunMonitor:
    """The run's monitor (skip rate, alerts, fail-fast, clip rate, scale health) for a config.

    Example::

        >>> from ampguard.config import validate
        >>> build_monitor(validate({"monitor": {"window": 50}}), scaler_enabled=False).window
        50
    """
    m = config.monitor
    return RunMonitor(
        window=m.window,
        alert_rate=m.alert_rate,
        fail_rate=m.fail_rate,
        fail_after=m.fail_after,
        max_norm=clip_threshold(config.max_norm),
        scaler_enabled=scaler_enabled,
        init_scale=config.scaler.init_scale,
        min_scale=config.scaler.min_scale,
        fail_on_scale_collapse=m.fail_on_scale_collapse,
        min_steps=m.min_steps,
    )


def build_spike_detector(config: Config) -> LossSpikeDetector | None:
    """The loss-spike detector when ``rollback.triggers`` names ``loss_spike``, else None."""
    if "loss_spike" not in config.rollback.triggers:
        return None
    return LossSpikeDetector(config.rollback.window, config.rollback.z)


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors (inside lists, tuples and dicts too) moved to ``device``; anything else as it is.

    Example::

        >>> to_device({"x": torch.ones(1), "n": 3}, torch.device("cpu"))
        {'x': tensor([1.]), 'n': 3}
    """
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


def build_sinks(config: Config, paths: RunPaths, metrics: tuple[str, ...], console: ConsoleSink,
                keep_through: int | None = None) -> Sinks:
    """Where a run's records go: the CSV (appended after ``keep_through`` on a resume), the
    optional JSON lines and TensorBoard sinks, and the console."""
    append = keep_through is not None
    sinks: list[Sink] = []
    if paths.csv is not None:
        sinks.append(CsvSink(paths.csv, metrics, append=append, keep_through=keep_through))
    if config.log.jsonl and paths.steps_jsonl is not None:
        sinks.append(JsonlSink(paths.steps_jsonl, append=append))
    if config.log.tensorboard and paths.tensorboard is not None:
        sinks.append(TensorBoardSink(paths.tensorboard))
    sinks.append(console)
    return Sinks(*sinks)
