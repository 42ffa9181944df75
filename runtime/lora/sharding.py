"""One tensor-parallel rank's share of an adapter, cut the way its base layers are cut."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .adapter import AdapterWeights

if TYPE_CHECKING:
    from ..distributed.sharding import ShardPlan


def shard_adapter(weights: AdapterWeights, plan: ShardPlan) -> AdapterWeights:
    """A copy of ``weights`` holding only ``plan``'s slices (see ``ShardPlan.shard_lora``;
    an MoE layer's experts, stacked ``A [E, r, in]`` / ``B [E, out, r]``, by
    ``ShardPlan.shard_expert_lora``; its router whole; Qwen2-MoE's shared expert, 2-D, as a
    dense MLP of its own size, its gate whole).

    Slices are cloned, so the full tensors can be freed: a rank keeps about ``1/size`` of
    every adapter's B (column-parallel), A (row-parallel) and vocabulary rows.
    """
    local = {}
    for (module, layer), (a, b) in weights.weights.items():
        expert = a.dim() == 3  # experts are the only stacked (3-D) LoRA weights
        a_local, b_local = plan.shard_expert_lora(module, a, b) if expert else plan.shard_lora(module, a, b)
        local[(module, layer)] = (_owned(a_local, a), _owned(b_local, b))
    return dataclasses.replace(weights, weights=local)


def _owned(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """``part`` with its own storage when it is a slice of ``whole`` (a view would pin it)."""
    return whole if part.shape == whole.shape else part.contiguous().clone()
