"""Building blocks of Llama-family decoders, written for flat batched token rows."""

from .attention import Attention, AttentionMetadata, build_attention_metadata
from .linear import Linear, LMHead, LoRAHook, VocabEmbedding
from .norm import RMSNorm
from .rotary import RotaryEmbedding, inverse_frequencies

__all__ = [
    "Attention",
    "AttentionMetadata",
    "LMHead",
    "Linear",
    "LoRAHook",
    "RMSNorm",
    "RotaryEmbedding",
    "VocabEmbedding",
    "build_attention_metadata",
    "inverse_frequencies",
]
