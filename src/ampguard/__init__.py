"""ampguard: mixed-precision training made safe and observable."""

from .clipping import clip_global_l2_norm, has_non_finite_grad
from .precision import GuardedGradScaler, Precision
from .records import SkipLog, StepLog, StepRecord
from .sinks import BackgroundSink, ConsoleSink, CsvSink, JsonlSink, Sink
from .step import AmpTrainState

__all__ = [
    "AmpTrainState",
    "BackgroundSink",
    "ConsoleSink",
    "CsvSink",
    "GuardedGradScaler",
    "JsonlSink",
    "Precision",
    "Sink",
    "SkipLog",
    "StepLog",
    "StepRecord",
    "clip_global_l2_norm",
    "has_non_finite_grad",
]

__version__ = "0.1.0"
