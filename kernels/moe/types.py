"""The LoRA inputs of the fused MoE: each expert part's stacked adapter weights and the
batch's per-row adapter slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertLoRA:
    """LoRA of one expert part (``gate_up`` or ``down``) for every slot and expert.

    ``A [slots, experts, slices * max_rank, in]``, ``B [slots, experts, out, max_rank]`` (any
    strides); slice ``s`` owns output columns ``slice_offsets[s]:slice_offsets[s + 1]`` and
    rank rows ``s * max_rank:(s + 1) * max_rank`` of ``A``. ``ranks`` (int32 ``[slots]``, on
    the device): each slot's rank on this part, 0 where its adapter has no LoRA here (such
    rows then cost nothing); rows past a slot's rank are never read.
    """

    A: torch.Tensor
    B: torch.Tensor
    slice_offsets: tuple[int, ...]
    ranks: torch.Tensor

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    @property
    def max_rank(self) -> int:
        return self.B.shape[-1]


@dataclass
class MoELoRA:
    """The batch's adapters on the experts: ``token_slots`` (int32 ``[T]``, -1: base model)
    and ``scalings`` (float32 ``[slots]``) as the LoRA batch info holds them, plus the parts."""

    token_slots: torch.Tensor
    scalings: torch.Tensor
    gate_up: ExpertLoRA | None = None
    down: ExpertLoRA | None = None

    @property
    def num_slots(self) -> int:
        part = self.gate_up if self.gate_up is not None else self.down
        return 0 if part is None else part.A.shape[0]

    def live_ranks(self) -> torch.Tensor:
        """Per slot, a positive value where any part has LoRA (the slots the deltas visit)."""
        parts = [p.ranks for p in (self.gate_up, self.down) if p is not None]
        return parts[0] if len(parts) == 1 else torch.maximum(parts[0], parts[1])
