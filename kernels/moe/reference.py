"""The fused MoE's oracle: every (row, expert) pair computed in float64, no rounding between
steps, from the same inputs the Triton path takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .types import ExpertLoRA, MoELoRA


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: MoELoRA | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` in float64, each expert with the
    LoRA delta of row ``t``'s adapter (``lora.token_slots[t]``) for that expert."""
    top_k = ids.shape[1]
    experts = ids.reshape(-1).long()
    xe = x.double().repeat_interleave(top_k, dim=0)  # [P, H]: pair p is row p // top_k
    g = torch.einsum("ph,pnh->pn", xe, gate_up.double()[experts])
    if lora is not None and lora.gate_up is not None:
        g = g + _delta(xe, experts, lora, lora.gate_up, top_k)
    inter = g.shape[1] // 2
    h = F.silu(g[:, :inter]) * g[:, inter:]
    y = torch.einsum("pi,phi->ph", h, down.double()[experts])
    if lora is not None and lora.down is not None:
        y = y + _delta(h, experts, lora, lora.down, top_k)
    y = y * weights.double().reshape(-1, 1)
    return y.view(x.shape[0], top_k, -1).sum(1)


def _delta(xe: torch.Tensor, experts: torch.Tensor, lora: MoELoRA, part: ExpertLoRA, top_k: int) -> torch.Tensor:
    """Per pair: ``scale * (x A[slot, e, slice]ᵀ) B[slot, e, slice cols]ᵀ`` over the slices,
    only the first ``rank`` rows of each slice; zero for slot -1 and rank-0 slots."""
    slots = lora.token_slots.long().repeat_interleave(top_k)
    safe = slots.clamp(min=0)
    ranks = part.ranks.long()[safe] * (slots >= 0)
    scale = lora.scalings.double()[safe] * (slots >= 0)
    max_rank = part.max_rank
    keep = (torch.arange(max_rank, device=xe.device)[None, :] < ranks[:, None]).double()  # [P, R]
    a = part.A.double()[safe, experts]  # [P, slices * R, in]
    b = part.B.double()[safe, experts]  # [P, out, R]
    out = torch.zeros(xe.shape[0], b.shape[1], dtype=torch.float64, device=xe.device)
    for s in range(part.num_slices):
        lo, hi = part.slice_offsets[s], part.slice_offsets[s + 1]
        shrunk = torch.einsum("pk,prk->pr", xe, a[:, s * max_rank : (s + 1) * max_rank]) * keep
        out[:, lo:hi] = torch.einsum("pr,pnr->pn", shrunk, b[:, lo:hi]) * scale[:, None]
    return out
