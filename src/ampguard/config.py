"""The one typed configuration tree: defaults, loading (YAML, JSON, TOML), ``--set`` overrides.

Every field is documented where it is defined (the docstring under it). The tree is validated
once, at load; unknown keys, wrong types and impossible values raise :class:`ConfigError` with
one line that names the key, e.g. ``optimizer.lr: must be a finite number >= 0 (got nan)``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationError, field_validator, model_validator,
)

from .errors import ConfigError
from .faults import parse_fault

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def _not_bool(value: Any) -> Any:
    # pydantic would read true/false as 1/0; a boolean where a number belongs is a mistake
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def _at_least(low: float, *, strict: bool = False, finite: bool = False) -> Any:
    """A bound as a reusable validator: ``>= low`` (``> low`` when strict), finite if asked."""
    relation = ">" if strict else ">="

    def check(value: float) -> float:
        below = not (value > low if strict else value >= low)  # also true for nan
        if below or (finite and not math.isfinite(value)):
            what = "a finite number " if finite else ""
            raise ValueError(f"must be {what}{relation} {low:g} (got {value!r})")
        return value

    return AfterValidator(check)


def _rate(value: float) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"must be in [0, 1] (got {value!r})")
    return value


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Count = Annotated[Int, _at_least(1)]  # a positive whole number
Count0 = Annotated[Int, _at_least(0)]  # zero allowed
Amount = Annotated[Float, _at_least(0.0, finite=True)]  # a finite number >= 0
Positive = Annotated[Float, _at_least(0.0, strict=True, finite=True)]  # a finite number > 0
Rate = Annotated[Float, AfterValidator(_rate)]  # in [0, 1]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


class OptimizerConfig(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer: AdamW, or SGD with momentum."""
    lr: Amount = 3e-3
    """Peak learning rate (after warmup)."""
    weight_decay: Amount = 0.0
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: tuple[Float, Float] = (0.9, 0.95)
    """AdamW's moment decay rates, each in [0, 1)."""
    eps: Positive = 1e-8
    """AdamW's denominator epsilon."""
    momentum: Float = 0.9
    """SGD momentum in [0, 1)."""
    fused: bool | None = None
    """Use the fused AdamW kernel (None: PyTorch's default)."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each beta must be in [0, 1) (got {list(v)})")
        return v

    @field_validator("momentum")
    @classmethod
    def _momentum(cls, v: float) -> float:
        if not (math.isfinite(v) and 0.0 <= v < 1.0):
            raise ValueError(f"must be in [0, 1) (got {v!r})")
        return v


class ScheduleConfig(_Section):
    warmup: Count0 = 0
    """Linear warmup length in applied updates (0: none)."""
    decay: Literal["constant", "cosine", "linear"] = "cosine"
    """Shape of the decay after warmup, down to ``min_lr_ratio * lr`` at the last step."""
    min_lr_ratio: Rate = 0.1
    """Final learning rate as a fraction of ``optimizer.lr``, in [0, 1]."""



class ScalerConfig(_Section):
    enabled: bool | None = None
    """Loss scaling: None means on for fp16, off otherwise. True with bf16/fp32 is an error."""
    init_scale: Positive = 2.0**16
    """Starting loss scale."""
    growth_factor: Float = 2.0
    """Scale multiplier after ``growth_interval`` clean steps in a row (> 1)."""
    backoff_factor: Float = 0.5
    """Scale multiplier on a skipped step, in (0, 1)."""
    growth_interval: Count = 2000
    """Clean steps in a row before the scale grows (>= 1)."""
    min_scale: Positive = 1.0
    """Below this the scale is unhealthy (used by the monitors)."""

    @field_validator("growth_factor")
    @classmethod
    def _growth(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 1.0):
            raise ValueError(f"must be > 1 (got {v!r})")
        return v

    @field_validator("backoff_factor")
    @classmethod
    def _backoff(cls, v: float) -> float:
        if not (math.isfinite(v) and 0.0 < v < 1.0):
            raise ValueError(f"must be in (0, 1) (got {v!r})")
        return v


class MonitorConfig(_Section):
    window: Count = 1000
    """Steps in the rolling skip-rate window."""
    alert_rate: Rate = 0.05
    """Rolling skip rate above which an ALERT is raised, in [0, 1]."""
    fail_rate: Rate | None = None
    """Rolling skip rate that fails the run after ``fail_after`` steps above it (None: never)."""
    fail_after: Count = 100
    """Consecutive steps above ``fail_rate`` (or below ``scaler.min_scale``) before the run stops with exit code 3."""
    fail_on_scale_collapse: bool = False
    """Also stop (exit 3) when the loss scale stays below ``scaler.min_scale`` for ``fail_after`` steps."""


class LogConfig(_Section):
    dir: str = "runs"
    """Folder that holds run folders."""
    name: str | None = None
    """Run folder name under ``dir`` (None: a timestamp). An existing run folder is never reused."""
    every: Count = 50
    """Console line every this many steps (skips are always printed; the CSV has every step)."""
    jsonl: bool = False
    """Also write every step record as JSON lines (``steps.jsonl``)."""
    tensorboard: bool = False
    """Also write TensorBoard scalars (``tensorboard/``); needs the ``tensorboard`` package."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v or v in (".", "..")):
            raise ValueError(f"must be a plain folder name (got {v!r})")
        return v


class EvalConfig(_Section):
    enabled: bool = True
    """Evaluate the task's held-out metrics (extra CSV columns)."""
    every: Count0 = 100
    """Evaluate on held-out data every this many steps and at the end (0: only at the end)."""
    batches: Count = 8
    """charlm: held-out batches per evaluation."""


class CheckpointConfig(_Section):
    enabled: bool = True
    """Write checkpoints to ``<run>/checkpoints/`` (and at the end, on fail-fast and on Ctrl-C)."""
    every: Count0 = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep: Count = 3
    """How many recent checkpoints to keep (>= 1)."""


class ValidateConfig(_Section):
    """``ampguard validate``: every rule is declared here, before the run."""

    precisions: list[Literal["fp16", "bf16"]] = ["fp16", "bf16"]
    """AMP precisions to compare with the FP32 reference."""
    checkpoint: str | None = None
    """Model weights from an ampguard checkpoint (default: the task's freshly initialised model)."""
    typical: Count0 = 32
    """Probe set: the first this many held-out examples."""
    boundary: Count0 = 16
    """Probe set: the held-out examples with the smallest FP32 top-2 margin (classifiers)."""
    edge_cases: bool = True
    """Probe set: the task's edge-case inputs (blank, saturated, extreme values...)."""
    abs_tol: Amount = 0.05
    """Score tolerance: |amp - fp32| <= abs_tol + rel_tol * |fp32| for every score of every probe."""
    rel_tol: Amount = 0.05
    """Score tolerance, relative part."""
    tie_margin: Amount = 0.0
    """Tie rule: an AMP top-2 gap <= this is a tie (the decision is not well defined)."""
    ties: Literal["count_as_flip", "accept"] = "count_as_flip"
    """Tie rule: a tie under AMP counts as a decision change, or is accepted."""
    max_flips: Count0 = 0
    """Decision changes (argmax flips, and ties when they count) allowed on the probe set."""
    min_accuracy: Rate | None = None
    """Classifiers: minimum accuracy on the held-out set, for the reference and for AMP."""
    max_mse: Amount | None = None
    """Regression: maximum mean squared error on the held-out set, for the reference and for AMP."""
    train_steps: Count0 = 0
    """Also train this many steps from the same state in FP32 and in each AMP precision and
    compare loss curves, gradient norms and applied updates (informational)."""


class DistributedConfig(_Section):
    strategy: Literal["ddp", "fsdp2"] = "ddp"
    """Under torchrun: DistributedDataParallel, or FSDP2 (``fully_shard``). ``task.batch_size``
    is per rank; every rank reads the same stream and takes its slice of each global batch."""


class DiagnoseConfig(_Section):
    first_skip: bool = False
    """After the first skipped step, find where its non-finite value was born (``ampguard locate``
    on that step's micro-batches) and write the finding to the event log and the run card."""
    strict: bool = False
    """Debugging: the first non-finite loss or gradient stops the run (exit 3) with a message
    naming which and where, instead of skipping it and going on."""


class RollbackConfig(_Section):
    triggers: list[Literal["skip_guard", "loss_spike"]] = []
    """What triggers a rollback: ``skip_guard`` (the fail-fast skip-rate guard trips) and/or
    ``loss_spike`` (loss above mean + z * std of the last ``window`` applied steps). Empty: off."""
    z: Positive = 6.0
    """Loss-spike threshold in standard deviations."""
    window: Annotated[Int, _at_least(2)] = 50
    """Applied steps in the loss-spike window (it must be full before spikes are judged)."""
    skip_batches: Count0 = 20
    """Micro-batches of data skipped past the checkpoint's data position after a rollback."""
    max: Count0 = 3
    """Rollbacks allowed; the next trigger fails the run (exit 3)."""


class TaskConfig(_Section):
    name: Literal["charlm", "digits", "linear"] = "charlm"
    """Built-in workload: ``charlm`` (a character-level transformer on Python's own sources),
    ``digits`` (an MLP on scikit-learn's handwritten digits) or ``linear`` (the demo's regression)."""
    factory: str | None = None
    """Your own workload instead: ``"package.module:build"`` or ``"path/to/file.py:build"``
    (see the README); ``build(config)`` returns the model, the data and the loss function."""
    options: dict[str, Any] = {}
    """Free-form settings for your factory (``config.task.options``)."""
    batch_size: Count = 32
    """Examples per micro-batch."""
    block_size: Count = 64
    """charlm: context length in characters."""
    n_layer: Count = 2
    """charlm: transformer blocks."""
    n_head: Count = 4
    """charlm: attention heads (must divide ``n_embd``)."""
    n_embd: Count = 64
    """charlm: embedding width; digits: half the MLP's hidden width."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TaskConfig:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        return self


class Config(_Section):
    precision: Literal["fp16", "bf16", "fp32"] = "bf16"
    """Compute precision under autocast; fp16 adds a dynamic loss scaler."""
    max_norm: Amount | None = 1.0
    """Global L2 gradient clip threshold; 0 or null disables clipping."""
    accumulation_steps: Count = 1
    """Micro-batches per optimizer update."""
    steps: Count = 1000
    """Optimizer steps (attempts, skipped ones included)."""
    seed: Int = 0
    """Seed for the model, the data order and seeded fault injection."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: ``auto`` takes CUDA when available, the CPU otherwise."""
    scheduler_on_skip: Literal["hold", "step"] = "hold"
    """On a skipped step the LR schedule holds (default) or steps anyway."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer and its hyper-parameters."""
    schedule: ScheduleConfig = ScheduleConfig()
    """The learning-rate schedule (counted in applied updates)."""
    scaler: ScalerConfig = ScalerConfig()
    """The dynamic loss scaler (fp16)."""
    monitor: MonitorConfig = MonitorConfig()
    """The skip-rate alarm and the fail-fast guard."""
    log: LogConfig = LogConfig()
    """Where run folders go and what the console shows."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation (extra CSV columns)."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints for resume and rollback."""
    validation: ValidateConfig = ValidateConfig()
    """The AMP-vs-FP32 acceptance test (``ampguard validate``)."""
    diagnose: DiagnoseConfig = DiagnoseConfig()
    """Automatic diagnosis of non-finite values."""
    distributed: DistributedConfig = DistributedConfig()
    """Multi-process training when launched by torchrun."""
    rollback: RollbackConfig = RollbackConfig()
    """Rolling back to the last good checkpoint on a loss spike or a tripped guard."""
    task: TaskConfig = TaskConfig()
    """The workload: a built-in one or your own factory."""
    inject: list[str] = []
    """Faults to inject, ``KIND@WHEN`` (see ``ampguard demo --help``); for testing the guard rails."""

    @field_validator("inject")
    @classmethod
    def _inject(cls, v: list[str]) -> list[str]:
        for spec in v:
            parse_fault(spec)
        return v

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Config:
        if self.scaler.enabled and self.precision != "fp16":
            raise ValueError(f"scaler.enabled: {self.precision} does not use a loss scaler (set it false or null)")
        if self.rollback.triggers and not (self.checkpoint.enabled and self.checkpoint.every > 0):
            raise ValueError("rollback.triggers: rolling back needs checkpoints to return to (set checkpoint.every > 0)")
        if "skip_guard" in self.rollback.triggers and self.monitor.fail_rate is None:
            raise ValueError("rollback.triggers: skip_guard needs the guard itself (set monitor.fail_rate)")
        return self


# ---------------------------------------------------------------------------- loading


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{loc}: unknown key"
    msg = first["msg"].removeprefix("Value error, ")
    if msg.startswith(("scaler.enabled:", "rollback.triggers:")):  # cross-field rules name their own key
        return msg
    if first["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {first.get('input')!r})"
    return f"{loc}: {msg}" if loc else msg


def validate(data: dict[str, Any]) -> Config:
    """Build a :class:`Config` from a plain mapping, or raise :class:`ConfigError` (one line)."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"config: {_format_error(err)}") from None


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML, JSON or TOML config file into a mapping (by its extension)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {suffix!r} (use .yaml, .yml, .json or .toml)")
    except ConfigError:
        raise
    except (yaml.YAMLError, json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"config file {path}: cannot parse: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides (values parsed as YAML scalars) to a copy of ``data``."""
    data = json.loads(json.dumps(data))  # a deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r}") from None
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """The effective config: defaults, then the file (if any), then ``--set`` overrides."""
    data = read_file(path) if path is not None else {}
    return validate(apply_overrides(data, overrides or []))


def dump_config(config: Config) -> str:
    """The config as YAML, every field shown (what ``--print-config`` prints)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
