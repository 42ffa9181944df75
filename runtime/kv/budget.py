"""How many tokens the KV cache may hold: from the configured budget or free memory.

On a GPU the pool takes ``scheduler.kv_memory_fraction`` of the memory free after the
weights and the adapter pool, as vLLM's ``gpu_memory_utilization`` and SGLang's
``mem_fraction_static`` do: the device belongs to this process.

On a CPU that rule is wrong. System memory is shared with the OS, the page cache, other
processes (other runtime pods on the node, the tests that start several runtimes) and this
process's own activations, tokenizer and adapter loads; and the pool is allocated eagerly
and zero-filled, so every byte of it is resident from start-up: 0.85 of the available
memory would take most of the machine for a model that needs a fraction of it. What others
do:

- vLLM's CPU backend ignores ``gpu_memory_utilization`` and sizes the pool from
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB); unset, it used a fixed 4 GiB for a long time (with a
  warning), and recent versions take half of the total memory of the NUMA node.
- SGLang on CPU treats ``psutil.virtual_memory().available`` as the device's free memory
  and applies ``mem_fraction_static`` as on a GPU, which has the problem above.

So, when ``scheduler.max_total_tokens`` is unset, a CPU pool is the smallest of:

1. what the configured limits can ever occupy: ``max_requests * max_context_len`` tokens
   (as on a GPU);
2. ``min(kv_memory_fraction, CPU_KV_MAX_SHARE)`` of the available memory: a quarter at most,
   so a runtime never takes most of a machine by default and a few can share one;
3. ``CPU_KV_MAX_BYTES`` (4 GiB, vLLM's long-standing CPU default): CPU decode is slow enough
   that a CPU runtime rarely holds more live context than that, and zero-filling a larger
   pool costs seconds of start-up and resident memory for nothing.

An explicit ``scheduler.max_total_tokens`` still wins on either device; it is how a CPU
deployment asks for a larger pool. The chosen size and the limit that set it are logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import KVCacheError

log = logging.getLogger(__name__)

CPU_KV_MAX_SHARE = 0.25  # of the available system memory, at most
CPU_KV_MAX_BYTES = 4 << 30  # GiB-sized ceiling of a CPU pool sized by default

_GIB = 2**30


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


@dataclass(frozen=True)
class KVBudget:
    """A KV pool size and why it is that size."""

    tokens: int
    bytes: int
    # max_total_tokens | demand | memory_fraction | cpu_share | cpu_cap
    limited_by: str
    reason: str


def plan_kv_budget(
    *,
    requested: int | None,
    bytes_per_token: int,
    device_type: str,
    available_bytes: int,
    memory_fraction: float,
    max_requests: int,
    max_context_len: int,
) -> KVBudget:
    """The KV token budget from the settings, the model's shape and the memory available.

    Pure: ``available_bytes`` is what :func:`available_memory_bytes` measured (free device
    memory on CUDA, ``MemAvailable`` on CPU). ``device_type`` is ``torch.device.type``;
    every type but ``cuda`` follows the CPU rule of the module docstring.
    """
    if not 0.0 < memory_fraction <= 1.0:
        raise KVCacheError(f"scheduler.kv_memory_fraction must be in (0, 1], got {memory_fraction}")
    bytes_per_token = max(int(bytes_per_token), 1)
    if requested is not None:
        if requested < 1:
            raise KVCacheError(f"scheduler.max_total_tokens must be >= 1, got {requested}")
        need = requested * bytes_per_token
        if device_type == "cuda" and need > available_bytes:
            raise KVCacheError(
                f"scheduler.max_total_tokens={requested} needs {need / _GIB:.2f} GiB of KV cache but only "
                f"{available_bytes / _GIB:.2f} GiB is free on {device_type}: lower it or leave it unset"
            )
        reason = "scheduler.max_total_tokens is set"
        if need > available_bytes:
            reason += f" (more than the {available_bytes / _GIB:.2f} GiB of memory available now)"
        return KVBudget(int(requested), need, "max_total_tokens", reason)

    demand = max(int(max_requests), 1) * max(int(max_context_len), 1)
    # Byte limits from memory; the smallest sets the pool (the first listed on a tie).
    limits: list[tuple[str, int, str]] = [
        (
            "memory_fraction",
            int(available_bytes * memory_fraction),
            f"kv_memory_fraction {memory_fraction:g} of {available_bytes / _GIB:.2f} GiB available",
        )
    ]
    if device_type != "cuda":
        limits.append(
            (
                "cpu_share",
                int(available_bytes * CPU_KV_MAX_SHARE),
                f"{CPU_KV_MAX_SHARE:.0%} of {available_bytes / _GIB:.2f} GiB available "
                "(the CPU default's share of memory)",
            )
        )
        limits.append(
            ("cpu_cap", CPU_KV_MAX_BYTES, f"the CPU default's {CPU_KV_MAX_BYTES / _GIB:g} GiB ceiling")
        )
    name, limit_bytes, why = min(limits, key=lambda item: item[1])
    by_memory = limit_bytes // bytes_per_token
    if demand <= by_memory:
        tokens = demand
        name = "demand"
        why = f"all {max_requests} request rows x {max_context_len} tokens of context fit"
    else:
        tokens = by_memory
    if tokens < 1:
        raise KVCacheError(
            f"no memory left for the KV cache on {device_type} ({available_bytes / _GIB:.2f} GiB free): "
            "use a smaller model, fewer LoRA slots, or set scheduler.max_total_tokens"
        )
    if name != "demand" and device_type != "cuda":
        why += "; set scheduler.max_total_tokens for a larger pool"
    return KVBudget(tokens, tokens * bytes_per_token, name, why)


def derive_max_total_tokens(
    *,
    requested: int | None,
    bytes_per_token: int,
    device: torch.device,
    memory_fraction: float,
    max_requests: int,
    max_context_len: int,
) -> int:
    """The KV token budget for ``device`` (see :func:`plan_kv_budget` and the module docstring).

    ``requested`` (``scheduler.max_total_tokens``) wins when set, but on CUDA must fit in
    free memory. Otherwise a share of the memory available now (after weights and the
    adapter pool) is used, capped at ``max_requests * max_context_len`` since more could
    never be occupied; on CPU the share is smaller and capped (the module docstring says
    why).
    """
    if not 0.0 < memory_fraction <= 1.0:
        raise KVCacheError(f"scheduler.kv_memory_fraction must be in (0, 1], got {memory_fraction}")
    budget = plan_kv_budget(
        requested=requested,
        bytes_per_token=bytes_per_token,
        device_type=device.type,
        available_bytes=available_memory_bytes(device),
        memory_fraction=memory_fraction,
        max_requests=max_requests,
        max_context_len=max_context_len,
    )
    log.info(
        "KV cache budget on %s: %d tokens (%.2f GiB, %d bytes a token): %s",
        device,
        budget.tokens,
        budget.bytes / _GIB,
        bytes_per_token,
        budget.reason,
    )
    if budget.tokens < max_context_len and budget.limited_by != "max_total_tokens":
        log.warning(
            "the KV cache holds %d tokens, fewer than the context length %d: a request's context is "
            "limited to %d tokens",
            budget.tokens,
            max_context_len,
            budget.tokens,
        )
    return budget.tokens
