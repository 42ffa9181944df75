"""Rotary position embeddings (default, linear, llama3 and yarn scaling), as a cos/sin table.

The table holds every position up to the context length, so a batch's rotation is one
gather by position; values match Hugging Face's (float32 angles, one product each).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraserve.kernels import model_ops

from ..arch import RopeSpec


def inverse_frequencies(
    rope: RopeSpec, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [head_dim/2] float32, attention scaling)`` for a rope spec."""
    dim = head_dim
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type in ("default", "linear"):
        # Linear scaling divides positions by the factor: the same as dividing frequencies.
        return (inv_freq / rope.factor if rope.rope_type == "linear" else inv_freq), 1.0
    if rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, base, max_position_embeddings)
    raise ValueError(f"unsupported rope type {rope.rope_type!r}")


def _yarn(rope: RopeSpec, dim: int, base: float, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = rope.factor
    original = rope.original_max_position_embeddings or max_position_embeddings

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat ``[tokens, heads, head_dim]`` queries and keys by position."""

    def __init__(
        self,
        rope: RopeSpec,
        head_dim: int,
        max_positions: int,
        max_position_embeddings: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(rope, head_dim, max_position_embeddings)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype=dtype, device=device), persistent=False)
        self.max_positions = max_positions

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return model_ops.rotary(positions, q, k, self.cos, self.sin)
