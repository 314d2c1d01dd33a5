"""Helpers shared by several test files (imported as ``helpers``: pytest puts tests/ on the path)."""

from __future__ import annotations

import contextlib
import io
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from ampguard.cli import main


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
