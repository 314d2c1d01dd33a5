"""Helpers shared by several test files (imported as ``helpers``: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import textwrap
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from ampguard.checkpoint import REQUIRED
from ampguard.cli import main

ROOT = Path(__file__).resolve().parents[1]
"""The repository."""


class HostReads(TorchFunctionMode):
    """Counts the Tensor methods that copy a value to the host."""

    READS = frozenset(
        {
            torch.Tensor.item,
            torch.Tensor.tolist,
            torch.Tensor.__bool__,
            torch.Tensor.__float__,
            torch.Tensor.__int__,
            torch.Tensor.__index__,
            torch.Tensor.cpu,
            torch.Tensor.numpy,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.count += 1
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def reference_rates(skipped: list[bool], window: int) -> list[float]:
    """Rolling skip rate after each step, by brute force: skips among the steps the window holds
    (the last ``window`` steps, or every step so far while there are fewer)."""
    return [sum(held) / len(held) for held in (skipped[max(0, i + 1 - window): i + 1] for i in range(len(skipped)))]


def reference_episodes(
    rates: list[float], threshold: float, labels: tuple[str, str] = ("ALERT", "CLEAR"), min_steps: int = 0
) -> list[tuple[int, str]]:
    """(step, label) each time the rate crosses ``threshold`` (above = alerting); an alert starts
    only from step ``min_steps`` on."""
    out, alerting = [], False
    for step, rate in enumerate(rates, start=1):
        if rate > threshold and not alerting and step >= min_steps:
            out.append((step, labels[0]))
            alerting = True
        elif rate <= threshold and alerting:
            out.append((step, labels[1]))
            alerting = False
    return out


def reference_episodes_events(rates: list[float], threshold: float, min_steps: int = 0) -> list[tuple[int, str]]:
    """The same, labelled as the event log names them."""
    return reference_episodes(rates, threshold, ("skip_rate_alert", "skip_rate_clear"), min_steps)


def reference_fail_step(rates: list[float], fail_rate: float, fail_after: int) -> int | None:
    run = 0
    for step, rate in enumerate(rates, start=1):
        run = run + 1 if rate > fail_rate else 0
        if run >= fail_after:
            return step
    return None


def _no_plot(*args: object, **kwargs: object) -> None:
    return None


def ag(*argv: object) -> tuple[int, str, str]:
    """``ampguard ARGV`` in-process: (exit code, stdout, stderr); the plot is skipped."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch("ampguard.report.plot_run", _no_plot), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------- monitor (unit and whole runs)

seen_rates = reference_rates
"""test_monitor's name for ``reference_rates``."""


def seen_episodes(rates: list[float], threshold: float, min_steps: int) -> list[tuple[int, str]]:
    """(step, ALERT|CLEAR) each time the rate crosses ``threshold``; an ALERT only from step ``min_steps``."""
    return reference_episodes(rates, threshold, min_steps=min_steps)


def strict_json(line: str) -> dict:
    def refuse(token: str):
        raise AssertionError(f"non-strict JSON constant {token} in {line!r}")

    return json.loads(line, parse_constant=refuse)


HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


# ---------------------------------------------------------------------------- config (unit and --print-config)

# One non-default config, written below as YAML, JSON and TOML.
SAMPLE = {
    "precision": "fp16",
    "max_norm": 0.5,
    "accumulation_steps": 2,
    "steps": 7,
    "seed": 3,
    "device": "cpu",
    "optimizer": {"name": "sgd", "lr": 0.01, "betas": [0.8, 0.99], "fused": False, "momentum": 0.5},
    "schedule": {"warmup": 2, "decay": "linear"},
    "scaler": {"init_scale": 1024.0, "growth_interval": 10, "backoff_factor": 0.25},
    "monitor": {"window": 50, "fail_rate": 0.5, "fail_after": 5},
    "log": {"dir": "elsewhere", "every": 2},
    "checkpoint": {"every": 3, "keep": 1},
    "task": {"name": "linear", "batch_size": 8},
    "inject": ["inf_grad@5", "nan_loss@every:3"],
}

SAMPLE_TOML = """\
precision = "fp16"
max_norm = 0.5
accumulation_steps = 2
steps = 7
seed = 3
device = "cpu"
inject = ["inf_grad@5", "nan_loss@every:3"]

[optimizer]
name = "sgd"
lr = 0.01
betas = [0.8, 0.99]
fused = false
momentum = 0.5

[schedule]
warmup = 2
decay = "linear"

[scaler]
init_scale = 1024.0
growth_interval = 10
backoff_factor = 0.25

[monitor]
window = 50
fail_rate = 0.5
fail_after = 5

[log]
dir = "elsewhere"
every = 2

[checkpoint]
every = 3
keep = 1

[task]
name = "linear"
batch_size = 8
"""


# ---------------------------------------------------------------------------- checkpoints (unit and --resume)


def minimal_payload(step: int, **extra: object) -> dict:
    """The smallest payload ``load_checkpoint`` accepts (every REQUIRED key but the marker)."""
    payload = {key: {} for key in REQUIRED if key not in ("magic", "format")}
    payload.update(step=step, data_position=step, model={"w": torch.full((3,), float(step))})
    payload.update(extra)
    return payload


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# ---------------------------------------------------------------------------- tasks (unit and whole runs)

EXAMPLE = ROOT / "examples" / "my_model.py"

TINY_LM = ["task.name=charlm", "task.n_layer=1", "task.n_embd=32", "task.n_head=2", "task.block_size=32",
           "task.batch_size=16", "eval.batches=4"]


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path



# A noiseless linear regression y = x @ w, learnable to ~0 from any start: a user factory's data.
REGRESSION = """\
import torch
from torch import nn

def make():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(8, 1, generator=g)
    x = torch.randn(512, 8, generator=g)
    y = x @ w
    train = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 448, 32)]
    return train, x[448:], y[448:]
"""

FILE_FACTORY = REGRESSION + """
def build(config):
    train, x_test, y_test = make()
    torch.manual_seed(config.seed)
    model = nn.Linear(8, 1)

    def evaluate(model, device):
        out = model(x_test.to(device)).float()
        return {"val_mse": float(nn.functional.mse_loss(out, y_test.to(device)))}

    return {"model": model, "data": train, "loss_fn": nn.functional.mse_loss,
            "evaluate": evaluate, "metrics": ("val_mse",)}
"""
