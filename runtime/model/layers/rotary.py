"""Rotary position embeddings (default, linear, llama3, yarn and longrope scaling), as a cos/sin table.

The table holds every position up to the context length, so a batch's rotation is one
gather by position; values match Hugging Face's (float32 angles, one product each). With a
``partial_rotary_factor`` the table is ``rotary_dim`` wide: the leading ``rotary_dim`` dims of
each head rotate (half-split within them, as transformers' Phi-3), the rest pass through.

LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) has two sets of per-frequency divisors: transformers
picks ``short_factor`` while the sequence fits ``original_max_position_embeddings`` and
``long_factor`` for every position once it is longer, recomputing the whole cache when a
sequence crosses the boundary. Keys in a paged cache shared across steps and requests cannot be
recomputed, so the table here is one set for the whole serve, chosen as vLLM chooses it: long
factors when the served context (``max_positions``) exceeds the original maximum, short factors
otherwise. Within the original maximum this is exactly transformers'; a longer served context
rotates short sequences with the long factors too (as vLLM does), which transformers would rotate
with the short ones. The attention factor scales cos and sin in both cases.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from loraserve.kernels import model_ops

from ..arch import RopeSpec


def inverse_frequencies(
    rope: RopeSpec, head_dim: int, max_position_embeddings: int, *, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Return ``(inv_freq [rotary_dim/2] float32, attention scaling)`` for a rope spec.

    ``max_positions``: the served context, which picks LongRoPE's factor set (see the module
    docstring); None serves the short set."""
    dim = rope.rotary_dim(head_dim)
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
    if rope.rope_type == "longrope":
        return _longrope(rope, dim, base, max_positions)
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


def _longrope(rope: RopeSpec, dim: int, base: float, max_positions: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE: the base frequencies each divided by its factor, cos/sin scaled by the attention
    factor (``sqrt(1 + ln(factor) / ln(original))`` unless config.json gives one)."""
    original = rope.original_max_position_embeddings
    assert original is not None, "arch.py requires original_max_position_embeddings for longrope"
    long = max_positions is not None and max_positions > original
    factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (factors * base**shape), float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat ``[tokens, heads, head_dim]`` queries and keys by position; the
    ``cos`` / ``sin`` tables are ``[max_positions, rotary_dim]``."""

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
        inv_freq, scaling = inverse_frequencies(
            rope, head_dim, max_position_embeddings, max_positions=max_positions
        )
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
