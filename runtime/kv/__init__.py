"""The KV cache: token pool, per-request token tables, budget, prefix cache per adapter."""

from .budget import available_memory_bytes, derive_max_total_tokens, kv_bytes_per_token
from .cache import Allocation, KVCache, KVCacheError, KVCacheFullError
from .prefix_cache import PrefixCache, PrefixMatch

__all__ = [
    "Allocation",
    "KVCache",
    "KVCacheError",
    "KVCacheFullError",
    "PrefixCache",
    "PrefixMatch",
    "available_memory_bytes",
    "derive_max_total_tokens",
    "kv_bytes_per_token",
]
