"""Build a serving engine from a configuration: runner, tokenizer, decoder, engine.

The place the layers are put together: the runner comes from the executor (which starts
a tensor-parallel group when the configuration asks for one) and the speculative
decoder's factory is handed to the engine here, so the engine never imports the
speculative package above it.
"""

from __future__ import annotations

from .contract.config import RuntimeConfig
from .engine import DecoderFactory, Engine, EngineObserver
from .tokenizer import Tokenizer


def speculative_decoder_factory(config: RuntimeConfig) -> DecoderFactory | None:
    """The speculative package's decoder factory when ``config`` speculates, else None.

    Imported only then: a runtime without speculation never loads the drafters.
    """
    if not config.speculative.enabled:
        return None
    from .speculative import build_decoder

    return build_decoder


def build_engine(config: RuntimeConfig, observer: EngineObserver | None = None) -> tuple[Engine, Tokenizer]:
    """Load the model (and start-up adapters) and the tokenizer; return an unstarted engine.

    Heavy: reads weights. Call it off the event loop.
    """
    # With tensor_parallel_size > 1 this starts the pod's other ranks (this process is rank 0);
    # with one device it is ModelRunner(config).
    from .executor.launch import build_target_runner

    tokenizer = Tokenizer.load(config.model.path)
    runner = build_target_runner(config)
    factory = speculative_decoder_factory(config)
    return Engine(config, runner, tokenizer=tokenizer, observer=observer, decoder_factory=factory), tokenizer
