"""Build a serving engine from a configuration: runner, tokenizer, decoder, engine."""

from __future__ import annotations

from ..config import RuntimeConfig
from ..tokenizer import Tokenizer
from .engine import Engine
from .stats import EngineObserver


def build_engine(config: RuntimeConfig, observer: EngineObserver | None = None) -> tuple[Engine, Tokenizer]:
    """Load the model (and start-up adapters) and the tokenizer; return an unstarted engine.

    Heavy: reads weights. Call it off the event loop.
    """
    from ..model_runner import ModelRunner

    tokenizer = Tokenizer.load(config.model.path)
    runner = ModelRunner(config)
    return Engine(config, runner, tokenizer=tokenizer, observer=observer), tokenizer
