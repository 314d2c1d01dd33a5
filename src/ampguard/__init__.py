"""ampguard: mixed-precision training made safe and observable.

The public names are imported on first use (PEP 562), so ``import ampguard`` and the
``ampguard`` command start without loading torch: a Ctrl-C during start-up is caught by the
command line like any other (exit 130, no traceback).

Example::

    >>> import ampguard
    >>> ampguard.AmpTrainState.__name__, "AmpTrainState" in ampguard.__all__
    ('AmpTrainState', True)
    >>> ampguard.AmpguardWarning.__module__, ampguard.RunMonitor.__module__  # (names the README tells users to use)
    ('ampguard.errors', 'ampguard.monitor')
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "AmpTrainState": "step",
    "AmpguardWarning": "errors",
    "BackgroundSink": "sinks",
    "ConsoleSink": "sinks",
    "CsvSink": "sinks",
    "Guard": "step",
    "InFlight": "records",
    "GuardedGradScaler": "precision",
    "JsonlSink": "sinks",
    "MLflowSink": "integrations.trackers",
    "PendingStep": "records",
    "Precision": "precision",
    "RunMonitor": "monitor",
    "Sink": "sinks",
    "ScaledEditWarning": "step",
    "SlowPrecisionWarning": "precision",
    "ShortGroupWarning": "step",
    "SkipLog": "records",
    "StepLog": "records",
    "StepRecord": "records",
    "TensorBoardSink": "sinks",
    "UnsyncedReplicasWarning": "step",
    "WandbSink": "integrations.trackers",
    "clip_global_l2_norm": "clipping",
    "has_non_finite_grad": "clipping",
}

__all__ = sorted(_WHERE)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ampguard' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
