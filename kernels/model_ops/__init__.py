"""Fused elementwise ops of the decoder: RMSNorm, residual-add + RMSNorm, SiLU-and-multiply,
rotary embedding, and rotary embedding fused with the paged KV-cache write.

One interface, two implementations: ``reference`` (torch, any device: the CPU path and the
oracle) and ``triton_ops`` (one kernel each, used for CUDA tensors). Both compute exactly what
Hugging Face Llama computes: float32 statistics, the normalised row cast to the model dtype
before the weight multiplies it, every sum rounded to the model dtype where torch rounds it.

Autograd never reaches the Triton kernels (they have no backward): a tensor that needs a
gradient takes the reference.
"""

from __future__ import annotations

import torch

from . import reference

__all__ = ["add_rms_norm", "fused_enabled", "rms_norm", "rotary", "rotary_kv_write", "set_fused", "silu_mul"]

_ENABLED = True


def set_fused(enabled: bool) -> None:
    """Turn the Triton path on or off for the whole process (benchmarks compare both)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def fused_enabled() -> bool:
    """Whether CUDA tensors take the Triton kernels."""
    return _ENABLED


def _use_triton(*tensors: torch.Tensor) -> bool:
    if not _ENABLED or not all(t.is_cuda for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` over the last dimension."""
    if _use_triton(x, weight):
        from . import triton_ops

        return triton_ops.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, rms_norm(s))`` with ``s = x + delta`` in the model dtype: one read of each input,
    one write of each output."""
    if _use_triton(x, delta, weight):
        from . import triton_ops

        return triton_ops.add_rms_norm(x, delta, weight, eps)
    return reference.add_rms_norm(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[..., 2 * I]`` holding gate then up."""
    if _use_triton(gate_up):
        from . import triton_ops

        return triton_ops.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on ``q [T, H, D]`` and ``k [T, KH, D]`` (views of a fused projection are fine)
    with the rows ``positions`` of the ``cos`` / ``sin`` tables ``[P, R]``: the leading ``R <= D``
    dims of each head rotate (partial rotary), the rest pass through."""
    if _use_triton(q, k, cos, sin):
        from . import triton_ops

        return triton_ops.rotary(positions, q, k, cos, sin)
    return reference.rotary(positions, q, k, cos, sin)


def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """RoPE on ``q [T, H, D]`` and ``k [T, KH, D]``, then the rotated keys and ``v`` (``[T, KH,
    D]`` or ``[T, KH * D]``) written to rows ``slots [T]`` of the paged caches ``[S, KH, D]``
    in the caches' dtype; returns the rotated queries. Tables ``[P, R]`` with ``R < D`` rotate
    the leading ``R`` dims of each head only, as :func:`rotary`. One kernel on CUDA (static shapes:
    CUDA-graph safe); the cached keys are exactly :func:`rotary`'s."""
    if _use_triton(q, k, v, cos, sin, k_cache, v_cache):
        from . import triton_ops

        return triton_ops.rotary_kv_write(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    return reference.rotary_kv_write(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
