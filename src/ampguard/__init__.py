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

import typing as _typing
from importlib import import_module as _import_module

# What a type checker and an editor see: each public name with its type (the ``as`` form re-exports
# it, PEP 484). At run time none of these is imported here; __getattr__ imports each on first use
# (review 56e: ``from ampguard import Guard`` was Any to mypy, pyright and Pylance).
# tests/unit/test_public_api_review56e.py keeps this list, _WHERE and __all__ the same names.
if _typing.TYPE_CHECKING:
    from .step import AmpTrainState as AmpTrainState
    from .errors import AmpguardWarning as AmpguardWarning
    from .sinks import BackgroundSink as BackgroundSink
    from .sinks import ConsoleSink as ConsoleSink
    from .sinks import CsvSink as CsvSink
    from .step import Guard as Guard
    from .precision import GuardedGradScaler as GuardedGradScaler
    from .records import InFlight as InFlight
    from .sinks import JsonlSink as JsonlSink
    from .integrations.trackers import MLflowSink as MLflowSink
    from .records import PendingStep as PendingStep
    from .precision import Precision as Precision
    from .monitor import RunMonitor as RunMonitor
    from .step import ScaledEditWarning as ScaledEditWarning
    from .step import ShortGroupWarning as ShortGroupWarning
    from .sinks import Sink as Sink
    from .records import SkipLog as SkipLog
    from .precision import SlowPrecisionWarning as SlowPrecisionWarning
    from .records import StepLog as StepLog
    from .records import StepRecord as StepRecord
    from .sinks import TensorBoardSink as TensorBoardSink
    from .step import UnsyncedReplicasWarning as UnsyncedReplicasWarning
    from .integrations.trackers import WandbSink as WandbSink
    from .clipping import clip_global_l2_norm as clip_global_l2_norm
    from .clipping import has_non_finite_grad as has_non_finite_grad

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

__all__ = [  # (a literal list, as type checkers read it: the names of _WHERE, sorted)
    "AmpTrainState",
    "AmpguardWarning",
    "BackgroundSink",
    "ConsoleSink",
    "CsvSink",
    "Guard",
    "GuardedGradScaler",
    "InFlight",
    "JsonlSink",
    "MLflowSink",
    "PendingStep",
    "Precision",
    "RunMonitor",
    "ScaledEditWarning",
    "ShortGroupWarning",
    "Sink",
    "SkipLog",
    "SlowPrecisionWarning",
    "StepLog",
    "StepRecord",
    "TensorBoardSink",
    "UnsyncedReplicasWarning",
    "WandbSink",
    "clip_global_l2_norm",
    "has_non_finite_grad",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> _typing.Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'ampguard' has no attribute {name!r}")
    value = getattr(_import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # the next look-up is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
