"""The runtime's HTTP server: OpenAI-compatible API, admin API, probes and metrics."""

from .app import EngineFactory, build_app, drain, wait_until_ready
from .errors import ApiError
from .metrics import Metrics
from .state import STATE, ServerState, served_model_name

__all__ = [
    "STATE",
    "ApiError",
    "EngineFactory",
    "Metrics",
    "ServerState",
    "build_app",
    "drain",
    "served_model_name",
    "wait_until_ready",
]
