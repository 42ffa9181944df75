"""How many tokens the KV cache may hold: from the configured budget or free memory."""

from __future__ import annotations

from pathlib import Path

import torch

from .cache import KVCacheError


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one token costs across all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available system memory (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30  # no /proc: assume a modest 4 GiB


def derive_max_total_tokens(
    *,
    requested: int | None,
    bytes_per_token: int,
    device: torch.device,
    memory_fraction: float,
    max_requests: int,
    max_context_len: int,
) -> int:
    """The KV token budget.

    ``requested`` (``scheduler.max_total_tokens``) wins when set, but must fit in free
    memory. Otherwise ``memory_fraction`` of the memory free now (after weights and the
    adapter pool) is used, capped at ``max_requests * max_context_len`` since more could
    never be occupied.
    """
    if not 0.0 < memory_fraction <= 1.0:
        raise KVCacheError(f"scheduler.kv_memory_fraction must be in (0, 1], got {memory_fraction}")
    available = available_memory_bytes(device)
    if requested is not None:
        if requested < 1:
            raise KVCacheError(f"scheduler.max_total_tokens must be >= 1, got {requested}")
        need = requested * bytes_per_token
        if device.type == "cuda" and need > available:
            raise KVCacheError(
                f"scheduler.max_total_tokens={requested} needs {need / 2**30:.2f} GiB of KV cache but only "
                f"{available / 2**30:.2f} GiB is free on {device}: lower it or leave it unset"
            )
        return int(requested)
    budget = int(available * memory_fraction) // max(bytes_per_token, 1)
    budget = min(budget, max_requests * max_context_len)
    if budget < 1:
        raise KVCacheError(
            f"no memory left for the KV cache on {device} ({available / 2**30:.2f} GiB free): "
            "use a smaller model, fewer LoRA slots, or set scheduler.max_total_tokens"
        )
    return budget
