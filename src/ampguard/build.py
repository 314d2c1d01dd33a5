"""From a :class:`~ampguard.config.Config` to objects: device, optimizer, LR schedule, the guarded
step, the monitors, batches on the device.

Every verb that trains or replays (``train``, ``demo``, ``validate``, ``locate``, ``bench``)
builds here, so a setting means the same thing everywhere. Two small truths are decided once:
whether a precision uses a loss scaler (asked of :class:`~ampguard.precision.Precision`) and
whether clipping is on (:func:`~ampguard.clipping.clip_threshold`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import UninitializedBuffer, is_lazy
from torch.utils._pytree import tree_map_only

from .clipping import clip_threshold
from .config import EXACT_ONLY, Config, check_fast  # (the config's alone: no torch for --print-config)
from .errors import AmpguardWarning, InputError, counted, first_line, listed, user_code, warn
from .headroom import HEADROOM_COLUMNS, HEADROOM_CSV, Headroom, HeadroomCsv, check_headroom_rows
from .integrations.trackers import build_trackers, end_trackers
from .monitor import LossSpikeDetector, RunMonitor
from .precision import Precision, keep_in_fp32, release_fp32, scale_in_use, submodule
from .run_folder import RunPaths
from .schedule import DeviceLambdaLR, device_multiplier, lr_multiplier
from .sinks import OFF_LOG, ConsoleSink, CsvSink, JsonlSink, Sink, Sinks, TensorBoardSink
from .step import AmpTrainState
from .tasks.base import FIRST_BATCHES
from .untouched import not_made, untouched
from .watch import recording_dtypes


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
    return float(config.scaler.init_scale) if config.scaler_on else 1.0


def scaler_settings(config: Config) -> dict[str, Any]:
    """The config's ``scaler`` section as :meth:`Precision.make_scaler` takes it; where no loss
    scaler runs (:attr:`Config.scaler_on`) only ``enabled`` (review 53g: the guard says settings it
    ignores, and the whole section, defaults and all, made it say so on every bf16 run, after
    the config's own check had said what the user set, once).

    Example::

        >>> from ampguard.config import validate
        >>> scaler_settings(validate({"precision": "fp16", "scaler": {"min_scale": 4}}))["min_scale"]
        4.0
        >>> scaler_settings(validate({"precision": "bf16", "scaler": {"min_scale": 4}}))
        {'enabled': None}
        >>> scaler_settings(validate({"precision": "fp16", "scaler": {"enabled": False}}))
        {'enabled': False}
    """
    s = config.scaler
    if not config.scaler_on:  # (fp16 with enabled: false too: the config's check said what it ignores)
        return dict(enabled=s.enabled)
    return dict(enabled=s.enabled, init_scale=s.init_scale, growth_factor=s.growth_factor,
                backoff_factor=s.backoff_factor, growth_interval=s.growth_interval, min_scale=s.min_scale)


def make_optimizer(config: Config, model: nn.Module, fast: bool = False) -> torch.optim.Optimizer:
    """``optimizer.name``: SGD (with momentum) or AdamW (``fused`` when asked, and always on the
    fast path, whose sync-free step hands the skip flag to the fused kernel).

    Example::

        >>> from ampguard.config import validate
        >>> type(make_optimizer(validate({}), nn.Linear(2, 1))).__name__
        'AdamW'
        >>> make_optimizer(validate({}), nn.Linear(2, 1), fast=True).defaults["fused"]
        True
    """
    opt = config.optimizer
    fused = True if fast else opt.fused
    if opt.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay,
                               fused=fused)
    return torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay, fused=fused
    )


def fast_path(config: Config, device: torch.device, world_size: int = 1) -> tuple[bool, str]:
    """Whether the run takes the fast path (config ``fast``), and in a few words why (or why not).

    ``fast: null`` takes it on CUDA in one process unless an :data:`EXACT_ONLY` setting is on;
    ``fast: true`` with such a setting, or under torchrun, is one :class:`InputError` line.

    Example::

        >>> from ampguard.config import validate
        >>> fast_path(validate({}), torch.device("cuda"))
        (True, 'fast path: fused optimizer, sync-free step, records read back as they land')
        >>> fast_path(validate({"diagnose": {"strict": True}}), torch.device("cuda"))
        (False, 'exact path: diagnose.strict needs each step decided at the host')
        >>> fast_path(validate({}), torch.device("cpu"))[0]
        False
        >>> fast_path(validate({"fast": True, "monitor": {"headroom": {"every": 10}}}), torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: fast: true cannot serve monitor.headroom, which needs each step decided at the host (set fast: false)
        >>> fast_path(validate({"optimizer": {"fused": False}}), torch.device("cuda"))  # (asked for: not overruled)
        (False, 'exact path: optimizer.fused: false (the fast path hands the skip flag to the fused optimizer)')
    """
    blocking = next((name for name, on in EXACT_ONLY if on(config)), None)
    unfused = config.optimizer.fused is False  # (the fast path's sync-free step needs the fused kernel)
    if config.fast:
        check_fast(config, world_size)
    elif config.fast is False:
        return False, "exact path (fast: false)"
    elif device.type != "cuda" or world_size > 1:
        return False, "exact path"
    elif blocking is not None:
        return False, f"exact path: {blocking} needs each step decided at the host"
    elif unfused:
        return False, "exact path: optimizer.fused: false (the fast path hands the skip flag to the fused optimizer)"
    return True, "fast path: fused optimizer, sync-free step, records read back as they land"


def build_state(config: Config, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                device: torch.device, fast: bool = False) -> AmpTrainState:
    """The guarded step for a config: optimizer, LR schedule, scaler, clipping, accumulation.
    ``model`` is the model to train, already on ``device`` (DDP/FSDP2-wrapped under torchrun).
    A model without trainable parameters, or a setup the step refuses (its ``ValueError``), is
    one :class:`InputError` line. ``fast``: the fast path's step (:func:`fast_path`): a fused
    optimizer, tensor learning rates that a :class:`~ampguard.schedule.DeviceLambdaLR` drives
    on the device, ``sync_free``.

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"precision": "bf16", "accumulation_steps": 2})
        >>> state = build_state(config, nn.Linear(3, 1), torch.nn.functional.mse_loss, torch.device("cpu"))
        >>> state.step(torch.randn(4, 3), torch.randn(4, 1)) is None, state.accumulation_steps
        (True, 2)
        >>> build_state(config, nn.ReLU(), torch.nn.functional.mse_loss, torch.device("cpu"))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: the model (ReLU) has no parameters: there is nothing to train
    """
    check_trainable(model)
    model = prepare_model(config, model)
    try:
        optimizer = make_optimizer(config, model, fast)
        if fast:  # the LR lives on the device as a tensor the step sets from its count of applied updates
            scheduler = DeviceLambdaLR(optimizer, lr_multiplier(config), device_multiplier(config, device))
            for group in optimizer.param_groups:
                group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(config))
        return AmpTrainState(
            model,
            optimizer,
            loss_fn,
            precision=precision_of(config, device),
            max_norm=clip_threshold(config.max_norm),
            accumulation_steps=config.accumulation_steps,
            scheduler=scheduler,
            device=device,
            scaler=scaler_settings(config),
            scheduler_on_skip=config.scheduler_on_skip,
            sync_free=fast,
        )
    except ValueError as err:  # the step's (and the optimizer's) refusal of an impossible setup
        raise InputError(f"cannot build the training step: {first_line(err)}") from None


def keep_fp32_modules(config: Config, model: nn.Module, precision: str | None = None) -> None:
    """Keep the submodules ``fp32_modules`` names in FP32 under autocast
    (:func:`~ampguard.precision.keep_in_fp32`) when ``precision`` (default: the config's) is fp16
    or bf16 (under another precision the names are only checked); a name the model does not have
    is one :class:`InputError` line naming it and the children where it went wrong.

    Example::

        >>> from ampguard.config import validate
        >>> keep_fp32_modules(validate({"fp32_modules": ["head"], "precision": "bf16"}), nn.Sequential(nn.Linear(2, 1)))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: fp32_modules: the model has no submodule 'head' (its children: 0)
    """
    if not config.fp32_modules:
        return
    try:
        if (precision or config.precision) in ("fp16", "bf16"):
            keep_in_fp32(model, config.fp32_modules)
        else:  # (nothing to keep in FP32 without autocast: the names still checked, a typo one line)
            for name in config.fp32_modules:
                submodule(model, name)
    except KeyError as err:
        raise InputError(f"fp32_modules: {err.args[0]}", key="fp32_modules") from None


def prepare_model(config: Config, model: nn.Module, precision: str | None = None, *, copy_model: bool = False
                  ) -> nn.Module:
    """The model as ``precision`` (default: the config's) trains it. For every precision but fp8
    that is ``model`` itself; for fp8 its eligible Linear layers are swapped for torchao's
    ``Float8Linear`` as the ``fp8`` section says (:func:`ampguard.fp8.convert_to_fp8`), in place, or
    in a deep copy with ``copy_model`` (``validate`` compares a copy with the FP32 model). Calling it
    on a converted model changes nothing. fp8 without torchao, with no layer that can convert, or
    under torchrun is one :class:`InputError` line.

    Example::

        >>> from ampguard.config import validate
        >>> mlp = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        >>> prepare_model(validate({}), mlp) is mlp
        True
        >>> fp8 = prepare_model(validate({"precision": "fp8"}), mlp, copy_model=True)
        >>> type(fp8[2]).__name__, type(mlp[2]).__name__
        ('Float8Linear', 'Linear')
        >>> prepare_model(validate({"precision": "fp8"}), nn.Sequential(nn.Linear(3, 1)))
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: precision: fp8: no Linear layer can train in fp8 (0: first layer); use bf16
    """
    keep_fp32_modules(config, model, precision)
    if (precision or config.precision) != "fp8":
        return model
    from . import distributed, fp8

    try:
        fp8.require_torchao()
    except ImportError as err:
        raise InputError(f"precision: {err}") from None
    if distributed.current().active:  # (a process group joined: train's; validate runs on rank 0 alone, review 51k)
        raise InputError("precision: fp8 under torchrun is not supported yet (the model is converted after DDP/FSDP2 "
                         "wraps it); train fp8 in one process, or use bf16")
    if copy_model:  # (fp32_modules apply to fp16/bf16 only: a bf16 pass before kept them in the model itself)
        model = copy.deepcopy(model)
        release_fp32(model)
    s = config.fp8
    try:
        fp8.convert_to_fp8(model, recipe=s.recipe, keep_first_last=s.keep_first_last, exclude=s.exclude)
    except ValueError as err:
        raise InputError(f"precision: fp8: {err}") from None
    return model


def check_trainable(model: nn.Module, who: str = "") -> None:
    """Refuse (one :class:`InputError` line, prefixed with ``who``) a model with no parameters,
    or none that requires a gradient: the step would have nothing to update.

    Example::

        >>> frozen = nn.Linear(2, 1).requires_grad_(False)
        >>> check_trainable(frozen, "task.factory toy.py:build")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory toy.py:build: none of the model's 3 parameters requires a gradient (all frozen): there is nothing to train
    """
    prefix = f"{who}: " if who else ""
    params = list(model.parameters())
    if not params:
        raise InputError(f"{prefix}the model ({type(model).__name__}) has no parameters: there is nothing to train")
    if not any(p.requires_grad for p in params):
        count = sum(p.numel() for p in params)
        raise InputError(f"{prefix}none of the model's {count:,} parameters requires a gradient (all frozen): "
                         "there is nothing to train")


def check_forward(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], read_batch: Callable[..., Any],
                  precision: Precision, who: str, *, find_unused: bool = False,
                  dtypes: dict[str, str] | None = None, resuming: bool = False) -> list[str]:
    """Read the first batch and run it forward through ``model`` and ``loss_fn`` once, under the
    run's autocast, as the step will (no backward): a batch that cannot be read, data that does
    not fit the model, a loss that fails, is not a scalar or does not depend on the parameters is
    one :class:`InputError` line that starts with ``who`` (the first line of the error's text).
    With ``find_unused``, also a backward (``torch.autograd.grad``: nothing accumulated) that
    returns the trainable parameters this batch gives no gradient (DDP must be told of them);
    else ``[]``. With ``dtypes``, also fills it with the dtype each leaf module's output had in
    that forward (:func:`recording_dtypes`): which layers autocast left in float32.

    ``read_batch()`` gives the first batch. One that takes a ``count`` (the run's
    :meth:`DataStream.peek <ampguard.data.DataStream.peek>`: ``read_batch(count=n)``, an iterator
    of the first ``n`` batches from one read) gives the first :data:`~ampguard.tasks.base.FIRST_BATCHES`,
    the batches a run's start-up reads: those after the first go through the model too, forward
    only, as the step runs them (:func:`_check_following`), so that one the model cannot take
    (another width, another dtype, a BatchNorm batch of one example) is refused here in one line
    naming it, instead of crashing the run at its step; a stream that ends before them (a Task's
    ``batches()`` is endless) is refused too.

    It leaves no trace (:func:`~ampguard.untouched.untouched`): the RNG states (torch, CUDA,
    NumPy, ``random``), the module buffers (BatchNorm statistics), the modes and the gradients
    are as they were, so the run goes on bit for bit as without it; a parameter its forward
    passes changed in place (a momentum encoder's moving average) is named in a warning. A model
    with lazy modules not made yet is checked on a copy (:func:`_checked_copy`), then its lazy
    modules are made here, drawing from torch's RNG, and a warning says so (:func:`_made_as_checked`;
    not when ``resuming``: a checkpoint's weights replace them, its RNG states the draws).
    Costs
    one forward pass a batch (each one's graph freed before the next: the memory of one step's
    forward) and host reads.

    Example::

        >>> cpu = Precision("fp32", "cpu")
        >>> batch = lambda: (torch.ones(4, 3), torch.zeros(4, 1))
        >>> check_forward(nn.Linear(3, 1), nn.functional.mse_loss, batch, cpu, "task.factory toy.py:build")
        []
        >>> model = nn.Linear(3, 1)
        >>> model.register_parameter("unused", nn.Parameter(torch.ones(1)))  # its forward never reads it
        >>> check_forward(model, nn.functional.mse_loss, batch, cpu, "toy", find_unused=True)
        ['unused']
        >>> check_forward(nn.Linear(2, 1), nn.functional.mse_loss, batch, cpu, "task.factory toy.py:build")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory toy.py:build: the model's forward pass on the first batch failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x3 and 2x1)
        >>> per_example = lambda out, y: ((out - y) ** 2).mean(dim=1)
        >>> check_forward(nn.Linear(3, 1), per_example, batch, cpu, "task.factory toy.py:build")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory toy.py:build: loss_fn must return a scalar (a 0-dim tensor, e.g. .mean()); it returned shape (4,)

    A reader of several batches, the third of five features::

        >>> batches = [(torch.ones(4, 3), torch.zeros(4, 1))] * 2 + [(torch.ones(4, 5), torch.zeros(4, 1))] * 2
        >>> def read(count=None):
        ...     return iter(batches[:count]) if count else batches[0]
        >>> check_forward(nn.Linear(3, 1), nn.functional.mse_loss, read, cpu, "task.factory toy.py:build")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory toy.py:build: the model's forward pass on the third batch failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x5 and 3x1)
    """
    checked, firsts = _checked_copy(model)  # (lazy modules: a copy checked; then the model's made here)
    # (the model kept around a copy's check too: the copy's hooks share their closures and globals with
    # the model's, which the copy's passes fill: review 44a, under rng_kept alone they kept its outputs)
    kept = untouched(model, by=f"{who}: the start-up's check of the first batches",
                     so="and they are not put back: the run starts from weights the check's passes moved, not bit for "
                        "bit a plain loop's", passes=FIRST_BATCHES if _reads_several(read_batch) else 1, also=(loss_fn,))
    unused = _check_forward(checked, loss_fn, read_batch, precision, who, find_unused, dtypes, kept)
    _all_made(checked, who)  # (before the model is touched)
    if checked is not model:
        _made_as_checked(model, firsts, who, said=not resuming)
    return unused


def _all_made(model: nn.Module, who: str) -> None:
    """Refuse (one line) a model whose lazy modules the first batches' forward passes did not
    reach (review 40m: a branch taken later; a hook or the optimizer met an uninitialised weight, a
    traceback)."""
    left = [f"{name or 'the model'} ({type(m).__name__})" for name, m in model.named_modules() if not_made(m)]
    if left:
        raise InputError(f"{who}: the model's lazy modules {listed(left)} "
                         "were not reached by the first batches' forward passes, so their weights cannot be made at "
                         "start-up; make them in the factory (run a batch through them)")


def _check_forward(model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], read_batch: Callable[..., Any],
                   precision: Precision, who: str, find_unused: bool, dtypes: dict[str, str] | None,
                   kept: contextlib.AbstractContextManager[Any]) -> list[str]:
    """:func:`check_forward`'s passes through ``model``, under ``kept`` (what leaves no trace)."""
    with kept:
        following: Iterator[Any] | None = None
        with user_code(f"{who}: reading the first batch failed: "):
            try:
                if _reads_several(read_batch):
                    following = iter(read_batch(count=FIRST_BATCHES))
                    inputs, targets = next(following)
                else:
                    inputs, targets = read_batch()
            except StopIteration:
                raise InputError(f"{who}: the data yielded no batches") from None
        recording = recording_dtypes(model, dtypes) if dtypes is not None else contextlib.nullcontext()
        with precision.autocast(), recording:
            with user_code(f"{who}: the model's forward pass on the first batch failed: "):
                outputs = model(inputs)
            with user_code(f"{who}: loss_fn failed on the model's output for the first batch: "):
                loss = loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor):
            raise InputError(f"{who}: loss_fn must return a scalar tensor; it returned a {type(loss).__name__}")
        if loss.numel() != 1:
            raise InputError(f"{who}: loss_fn must return a scalar (a 0-dim tensor, e.g. .mean()); it returned shape "
                             f"{tuple(loss.shape)}")
        if not loss.is_floating_point():  # (a complex one: its backward drops the imaginary part, with a warning)
            raise InputError(f"{who}: loss_fn must return a real floating-point tensor; it returned {loss.dtype}")
        if not loss.requires_grad:
            raise InputError(f"{who}: the loss does not depend on the model's trainable parameters (no gradient "
                             "flows back from it: was it detached, or computed outside torch?)")
        unused: list[str] = []
        if find_unused:
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
            unused = [name for (name, _), g in zip(named, grads) if g is None]
        del inputs, targets, outputs, loss  # (the first batch's graph: not held through the others)
        if following is not None:
            _check_following(model, following, precision, who)
        return unused


def _checked_copy(model: nn.Module) -> tuple[nn.Module, dict[str, Any]]:
    """The model :func:`check_forward` runs its passes through, and where it is a copy, the first
    inputs of its lazy modules by name (filled by its first forward, for :func:`_made_as_checked`).

    ``model`` itself, or, where it holds lazy modules not made yet (``nn.LazyLinear``,
    ``nn.LazyBatchNorm1d``: a plain loop's first forward makes their weights), a deep copy of it
    (nothing of it kept). Costs a copy of the weights made so far. The copy's check runs under
    :func:`~ampguard.untouched.untouched` of the model all the same: the copy's hooks share their
    closures and globals with the model's. A model that cannot be copied is checked itself, which
    :func:`~ampguard.untouched.untouched` warns of: their weights are drawn in the check.

    Example::

        >>> model = nn.Sequential(nn.LazyLinear(2))
        >>> copied, firsts = _checked_copy(model)
        >>> copied is not model, type(copied[0]).__name__, firsts
        (True, 'LazyLinear', {})
        >>> plain = nn.Linear(2, 1)
        >>> _checked_copy(plain)[0] is plain
        True
    """
    lazy = [name for name, m in model.named_modules() if isinstance(m, LazyModuleMixin) and not_made(m)]
    if not lazy:
        return model, {}
    memo: dict[int, Any] = {id(b): UninitializedBuffer(requires_grad=b.requires_grad, device=b.device, dtype=b.dtype)
                            for b in model.buffers() if is_lazy(b)}  # (one cannot be deep-copied: made anew)
    try:
        copied = copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a model that holds what cannot be copied: checked itself (untouched warns)
        return model, {}
    firsts: dict[str, Any] = {}
    copies = dict(copied.named_modules())
    for name in lazy:
        def note(module: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            if name not in firsts:  # (detached: the check's graph is not kept alive by them)
                firsts[name] = tree_map_only(torch.Tensor, torch.Tensor.detach, (args, kwargs))
        copies[name].register_forward_pre_hook(note, with_kwargs=True, prepend=True)
    return copied, firsts


def _made_as_checked(model: nn.Module, firsts: dict[str, Any], who: str, said: bool = True) -> None:
    """Make the lazy modules of ``model`` that its checked copy made (:func:`_checked_copy`), from
    the inputs they were given there, as their first forward would (``nn.LazyLinear`` becomes an
    ``nn.Linear``: its own ``initialize_parameters``), in the order the forward met them, drawing
    from torch's RNG here, at start-up; and warn that they were. A plain loop draws them at its
    first forward, among that forward's other draws (a dropout between two lazy layers) and after
    the data's first read (a ``DataLoader``'s seed): the run starts from other weights than such a
    loop, so it is not bit for bit one. Drawn again at the first training forward instead (what
    a5f5696 did), the weights a checkpoint, a rollback to step 0, a torchrun broadcast or an
    activation checkpoint's recomputation met differed from those trained (reviews 40g, 40k):
    made here, every part of the run, and every resume, sees the same weights. Not ``said`` on a
    resume, whose checkpoint's weights and RNG states replace what was drawn here."""
    modules = dict(model.named_modules())
    made = []
    with torch.no_grad():
        for name, (args, kwargs) in firsts.items():
            module = modules[name]
            made.append(f"{name} ({type(module).__name__})")
            module._infer_parameters(module, args, kwargs)  # type: ignore[operator]
    if made and said:
        warn(f"{who}: the model's lazy modules {listed(made)} made "
             "their weights at start-up, drawn from torch's RNG there, not at the first step's forward as a "
             "plain loop draws them: the run is not bit for bit such a loop; run one batch through the model "
             "in the factory to make them there", AmpguardWarning, stacklevel=3)


_NTH = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth")
assert FIRST_BATCHES <= len(_NTH)


def _reads_several(read_batch: Callable[..., Any]) -> bool:
    """Whether ``read_batch`` takes a ``count`` (:meth:`DataStream.peek`): it reads the first batches."""
    try:
        return "count" in inspect.signature(read_batch).parameters
    except (TypeError, ValueError):  # (a builtin without a signature)
        return False


def _check_following(model: nn.Module, following: Iterator[Any], precision: Precision, who: str) -> None:
    """The start-up's batches after the first through ``model`` as the step runs them: forward
    only, in the model's own modes (each module's, as the run trains it), with gradients on,
    under the run's autocast; each output is dropped at once (its graph freed). One that cannot
    be read or that the model fails on is one :class:`InputError` line naming it (a BatchNorm
    batch of one example, whose step fails: review 39e); a stream that ends before
    :data:`FIRST_BATCHES` is one too. No mode is changed (review 39e: eval mode first, then a
    retry that set ``module.training`` back by hand, left an EMA model whose ``eval()`` swaps its
    weights with the EMA ones in place of its trained weights). The loss is not called (the
    first batch's is checked). The caller leaves no trace (:func:`check_forward`:
    :func:`~ampguard.untouched.untouched` puts back the buffers a training-mode forward updates,
    BatchNorm's statistics, and the RNGs dropout draws from)."""
    for index in range(1, FIRST_BATCHES):
        nth = _NTH[index]
        with user_code(f"{who}: reading the {nth} batch failed: "):
            try:
                inputs, _ = next(following)
            except StopIteration:
                raise InputError(f"{who}: the data ended after {counted(index, 'batch', 'batches')}: a run reads it "
                                 "epoch after epoch (a Task's batches() must be endless: tasks.cycle(lambda: data) "
                                 "repeats a finite one)") from None
        with torch.enable_grad(), precision.autocast(), user_code(f"{who}: the model's forward pass on the {nth} "
                                                                  "batch failed: "):
            model(inputs)
        del inputs


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
        clear_rate=m.clear_rate,
        fail_rate=m.fail_rate,
        fail_after=m.fail_after,
        max_norm=clip_threshold(config.max_norm),
        scaler_enabled=scaler_enabled,
        init_scale=config.scaler.init_scale,
        min_scale=config.scaler.min_scale,
        fail_on_scale_collapse=m.fail_on_scale_collapse,
        min_steps=m.min_steps,
        growth_interval=config.scaler.growth_interval,
    )


def build_spike_detector(config: Config) -> LossSpikeDetector | None:
    """The loss-spike detector when ``rollback.triggers`` names ``loss_spike``, else None."""
    if "loss_spike" not in config.rollback.triggers:
        return None
    return LossSpikeDetector(config.rollback.window, config.rollback.z)


def build_headroom(config: Config, model: nn.Module, scaler: torch.amp.GradScaler) -> Headroom | None:
    """The headroom telemetry when ``monitor.headroom.every`` is set, else None. Measured against
    ``monitor.headroom.format`` (``HeadroomConfig.format_for``: ``auto`` is the run's precision,
    bf16 for fp8). With the loss scaler on,
    the alert judges the gradients without the scale (:meth:`Headroom.judged_bits`). With
    ``compile: true`` a measured step runs eagerly, however the model is wrapped (``model`` is
    the one inside a DDP wrapper that train compiled).

    Example::

        >>> from ampguard.config import validate
        >>> from ampguard.precision import GuardedGradScaler
        >>> build_headroom(validate({}), nn.Linear(2, 1), GuardedGradScaler("cpu", enabled=False)) is None
        True
        >>> h = build_headroom(validate({"precision": "fp16", "monitor": {"headroom": {"every": 10}}}), nn.Linear(2, 1),
        ...                    GuardedGradScaler("cpu", init_scale=1024.0))
        >>> h.every, h.format.name, h.alert_bits, h.scaled_grads, h.loss_scale()
        (10, 'fp16', 4.0, True, 1024.0)
    """
    h = config.monitor.headroom
    if h.every is None:
        return None
    loss_scale = (lambda: scale_in_use(scaler)) if scaler.is_enabled() else None
    return Headroom(model, h.format_for(config.precision), every=h.every, alert_bits=h.alert_bits, loss_scale=loss_scale,
                    scale_floor=config.scaler.min_scale, compiled=config.compile)


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors (inside lists, tuples and dicts too) moved to ``device``; anything else as it is.

    Example::

        >>> to_device({"x": torch.ones(1), "n": 3}, torch.device("cpu"))
        {'x': tensor([1.]), 'n': 3}
    """
    if isinstance(value, torch.Tensor):  # the usual batch: no tree to walk (a few us a step)
        return value.to(device, non_blocking=True)
    return tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), value)


def _cut_back_logs_off(config: Config, paths: RunPaths, keep_through: int | None, headroom: Headroom | None) -> None:
    """A resume that turned an optional log off (``log.jsonl``, ``log.tensorboard``, the headroom
    monitor): what an earlier attempt left of it after ``keep_through`` is the abandoned run's,
    so it is cut back (TensorBoard's purged) where it reads as this run's log. One that does not
    (another file in its place, a damaged row, a symbolic link: not this run's to cut;
    TensorBoard's without the ``tensorboard`` package) is left as it is, said in a warning: the
    run neither writes nor reads it, so it refuses nothing for it (review 48e)."""
    if keep_through is None or paths.dir is None:
        return

    def cut(path: Path, how: Callable[[Path], None]) -> None:
        if not (path.exists() or path.is_symlink()):
            return
        try:
            if path.is_symlink():
                raise InputError("it is a symbolic link: not this run's to cut")
            how(path)
        except InputError as err:
            why = first_line(str(err)).removeprefix(f"{path}: ")
            warn(f"{path} is left as it is ({why}): any steps after {keep_through} in it are the abandoned "
                 "run's", AmpguardWarning, stacklevel=2)

    def purge(log_dir: Path) -> None:
        if log_dir.is_dir() and any(log_dir.glob("events.out.tfevents.*")):
            if importlib.util.find_spec("tensorboard") is None:
                raise InputError("the tensorboard package, which would purge them, is not installed")
            TensorBoardSink.purge_after(log_dir, keep_through)

    def headroom_rows(path: Path) -> None:
        CsvSink.check_header(path, HEADROOM_COLUMNS, ", ".join(HEADROOM_COLUMNS), OFF_LOG)
        CsvSink.cut_after(path, len(HEADROOM_COLUMNS), keep_through, OFF_LOG, read_back=check_headroom_rows)

    if not config.log.jsonl:
        cut(paths.steps_jsonl, lambda path: JsonlSink.cut_after(path, keep_through, OFF_LOG))
    if not config.log.tensorboard:
        cut(paths.tensorboard, purge)
    if headroom is None:
        cut(paths.dir / HEADROOM_CSV, headroom_rows)


def build_sinks(config: Config, paths: RunPaths, metrics: tuple[str, ...], console: ConsoleSink,
                keep_through: int | None = None, headroom: Headroom | None = None) -> Sinks:
    """Where a run's records go: the CSV (appended after ``keep_through`` on a resume), the
    optional JSON lines and TensorBoard sinks (cut or purged after ``keep_through`` the same way),
    ``headroom.csv`` with ``headroom``, the W&B and MLflow sinks, and the console. A resume that
    turned one of the optional logs off still cuts back (purges) what an earlier attempt left of
    it after ``keep_through`` (:func:`_cut_back_logs_off`)."""
    append = keep_through is not None
    # log.wandb, log.mlflow (rank 0's folder only) first: a tracker that refuses at its open (a
    # store gone since the up-front check) does so before a resume has cut back any log
    trackers = build_trackers(config, paths, resuming=append)
    sinks: list[Sink] = []
    try:
        if paths.csv is not None:
            sinks.append(CsvSink(paths.csv, metrics, append=append, keep_through=keep_through))
        if config.log.jsonl and paths.steps_jsonl is not None:
            sinks.append(JsonlSink(paths.steps_jsonl, append=append, keep_through=keep_through))
        if config.log.tensorboard and paths.tensorboard is not None:
            sinks.append(TensorBoardSink(paths.tensorboard, keep_through=keep_through))
        if headroom is not None and paths.dir is not None:
            sinks.append(HeadroomCsv(paths.dir / HEADROOM_CSV, headroom, append=append, keep_through=keep_through))
        _cut_back_logs_off(config, paths, keep_through, headroom)
    except BaseException as err:  # the tracker runs end with the run, which ends here
        for sink in sinks:  # and the logs opened so far are closed (review 58f: left to the collector, in-process)
            with contextlib.suppress(Exception):
                sink.close()
        end_trackers(trackers, err)
        raise
    sinks += trackers
    sinks.append(console)
    return Sinks(*sinks)
