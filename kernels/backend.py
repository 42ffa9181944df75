"""The one interface every LoRA backend implements (torch reference, Triton).

Weight layout, shared by all backends (the runtime's adapter pool writes it):

- ``A``: ``[num_slots, num_slices * max_rank, in_dim]``: for a fused module (QKV: 3
  slices, gate/up: 2) the slices' A matrices are stacked along the rank dimension, slice
  ``s`` at rows ``s*max_rank : s*max_rank + rank``. One shrink serves every slice.
- ``B``: ``[num_slots, out_total, max_rank]``: slice ``s`` owns output columns
  ``slice_offsets[s] : slice_offsets[s+1]`` and reads ``xa`` columns
  ``s*max_rank : s*max_rank + rank``.
- An adapter of rank ``r < max_rank`` is packed at its own rank; backends read the rank
  per slot and do no work past it. Slot ``-1`` (base model) does no work at all.

``expand`` adds ``scalings[slot] * xa @ Bᵀ`` into ``out`` in place (the base layer's
output), so the LoRA delta is fused into the base result rather than materialised.
"""

from __future__ import annotations

import abc

import torch

from .metadata import LoRABatchInfo


class LoRABackend(abc.ABC):
    """Segmented multi-adapter LoRA ops over one batch."""

    name: str = "abstract"

    @abc.abstractmethod
    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, num_slices: int = 1) -> torch.Tensor:
        """``xa[rows] = x[rows] @ A[slot]ᵀ`` per segment; returns ``[T, num_slices*max_rank]``.

        Columns past a slot's rank and rows of base-model requests are left unspecified:
        ``expand`` never reads them.
        """

    @abc.abstractmethod
    def expand(
        self,
        xa: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...],
    ) -> None:
        """``out[rows, slice s] += scalings[slot] * xa[rows, s] @ B[slot, slice s]ᵀ`` in place."""

    def apply(
        self,
        x: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...] | None = None,
    ) -> None:
        """Shrink then expand into ``out``: the whole LoRA delta of one module."""
        if slice_offsets is None:
            slice_offsets = (0, out.shape[-1])
        if info.num_segments == 0 or x.shape[0] == 0:
            return
        xa = self.shrink(x, A, info, num_slices=len(slice_offsets) - 1)
        self.expand(xa, B, info, out, slice_offsets)

    def embedding(
        self,
        ids: torch.Tensor,
        A_emb: torch.Tensor,
        B_emb: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
    ) -> None:
        """Embedding LoRA: ``out[row] += scaling * A_emb[slot, id] @ B_emb[slot]ᵀ``.

        ``A_emb``: ``[num_slots, vocab, max_rank]`` (PEFT's ``lora_embedding_A`` transposed,
        so a token's row is one contiguous gather); ``B_emb``: ``[num_slots, dim, max_rank]``.
        A gather, not a GEMM: every backend shares this torch implementation.
        """
        if ids.numel() == 0:
            return
        slots = info.token_slots.long()
        active = slots >= 0
        if not bool(active.any()):
            return
        rows = active.nonzero(as_tuple=True)[0]
        s = slots[rows]
        ranks = info.lora_ranks.long()[s]
        xa = A_emb[s, ids[rows].long()].float()  # [n, R]
        col = torch.arange(xa.shape[1], device=xa.device)
        xa = xa * (col[None, :] < ranks[:, None])
        delta = torch.einsum("nr,ndr->nd", xa, B_emb[s].float()) * info.scalings[s][:, None]
        out.index_add_(0, rows, delta.to(out.dtype))


def check_shapes(
    x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, num_slices: int
) -> tuple[int, int]:
    """Validate shrink inputs; returns ``(max_rank, in_dim)``. Shared by the backends."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, in_dim], got shape {tuple(x.shape)}")
    if x.shape[0] != info.total_tokens:
        raise ValueError(f"x has {x.shape[0]} rows but the batch info describes {info.total_tokens}")
    if A.dim() != 3 or A.shape[2] != x.shape[1]:
        raise ValueError(f"A must be [slots, slices*rank, {x.shape[1]}], got {tuple(A.shape)}")
    if A.shape[1] % num_slices:
        raise ValueError(f"A's rank dim {A.shape[1]} is not divisible by {num_slices} slices")
    return A.shape[1] // num_slices, x.shape[1]
