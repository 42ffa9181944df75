"""The KV cache: token pool, per-request token tables, budget."""

from .budget import available_memory_bytes, derive_max_total_tokens, kv_bytes_per_token
from .cache import Allocation, KVCache, KVCacheError, KVCacheFullError

__all__ = [
    "Allocation",
    "KVCache",
    "KVCacheError",
    "KVCacheFullError",
    "available_memory_bytes",
    "derive_max_total_tokens",
    "kv_bytes_per_token",
]
