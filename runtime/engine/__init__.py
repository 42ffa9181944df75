"""The serving engine: request state, continuous-batching scheduler, decode strategies.

``Engine`` runs the loop on a background thread; ``Request`` / ``RequestOutput`` are what
callers hand in and get back; ``Decoder`` is the seam speculative decoding plugs into.
"""

from .decoder import (
    Decoder,
    DecoderFactory,
    DecoderUnavailableError,
    StandardDecoder,
    StepOutput,
    build_decoder,
)
from .engine import Engine
from .errors import EngineClosedError, EngineError
from .request import FinishReason, Request, RequestError, RequestOutput, RequestState, SpecStats
from .scheduler import Scheduler, SchedulerLimits, StepKind, StepPlan
from .stats import EngineObserver, EngineSnapshot

__all__ = [
    "Decoder",
    "DecoderFactory",
    "DecoderUnavailableError",
    "Engine",
    "EngineClosedError",
    "EngineError",
    "EngineObserver",
    "EngineSnapshot",
    "FinishReason",
    "Request",
    "RequestError",
    "RequestOutput",
    "RequestState",
    "Scheduler",
    "SchedulerLimits",
    "SpecStats",
    "StandardDecoder",
    "StepKind",
    "StepOutput",
    "StepPlan",
    "build_decoder",
]
