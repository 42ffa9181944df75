"""The torch definitions of the fused ops: the CPU path and the kernels' oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm: float32 statistics, cast back, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum (in the model dtype) and its norm."""
    s = x + delta
    return s, rms_norm(s, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated SiLU of a fused gate/up projection's output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (the half-split layout) on ``[T, heads, D]`` queries and keys from a ``[P, R]`` table:
    the leading ``R <= D`` dims of each head rotate, the rest pass through unchanged."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return rotate(q, c, s), rotate(k, c, s)


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
    """RoPE on ``q`` and ``k``, the rotated keys and the values written to rows ``slots`` of
    the caches (in the caches' dtype); returns the rotated queries."""
    q_rot, k_rot = rotary(positions, q, k, cos, sin)
    tokens = k.shape[0]
    k_cache.index_copy_(0, slots, k_rot.reshape(tokens, *k_cache.shape[1:]).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.reshape(tokens, *v_cache.shape[1:]).to(v_cache.dtype))
    return q_rot


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's half-split rotation of ``x`` ``[..., D]`` by ``cos`` / ``sin`` ``[..., R]``
    (broadcast against ``x``; ``R <= D``): the leading ``R`` dims rotate, the rest pass through."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat((rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
