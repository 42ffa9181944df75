"""Speculative decoding with co-batched LoRA adapters.

The draft proposes tokens without any adapter; the target verifies them in one
target-verify forward with each request's own adapter, and acceptance keeps exactly the
tokens the target would have produced (greedy) or its exact distribution (sampling).
The engine asks :func:`build_decoder` for the decoder when speculation is enabled.
"""

from .factory import build_decoder, build_drafter

__all__ = ["build_decoder", "build_drafter"]
