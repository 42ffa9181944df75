"""Build a serving engine from a configuration: runner, tokenizer, decoder, engine."""

from __future__ import annotations

from ..contract.config import RuntimeConfig
from ..tokenizer import Tokenizer
from .engine import Engine
from .stats import EngineObserver


def build_engine(config: RuntimeConfig, observer: EngineObserver | None = None) -> tuple[Engine, Tokenizer]:
    """Load the model (and start-up adapters) and the tokenizer; return an unstarted engine.

    Heavy: reads weights. Call it off the event loop.
    """
    # With tensor_parallel_size > 1 this starts the pod's other ranks (this process is rank 0);
    # with one device it is ModelRunner(config).
    from ..executor.launch import build_target_runner

    tokenizer = Tokenizer.load(config.model.path)
    runner = build_target_runner(config)
    return Engine(config, runner, tokenizer=tokenizer, observer=observer), tokenizer
