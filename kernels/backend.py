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
- Any strides are accepted (slices of fused activations, column slices of a fused
  output). In particular ``B`` may be stored rank-major, ``B_phys[slots, max_rank,
  out_total]``, and passed as ``B_phys.transpose(1, 2)``: an adapter of rank r in a
  rank-R pool then reads r contiguous rows instead of r of every R columns (with the
  row-major layout each 128-byte line of B carries R·2 bytes of which r·2 are used).

``expand`` adds ``scalings[slot] * xa @ Bᵀ`` into ``out`` in place (the base layer's
output), so the LoRA delta is fused into the base result rather than materialised.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from .metadata import LoRABatchInfo


def output_slices(out: torch.Tensor, slice_offsets: Sequence[int] | None) -> tuple[int, ...]:
    """The output slices of :meth:`LoRABackend.apply`: ``slice_offsets``, or by default one
    slice over the whole of ``out``'s width (an unfused module)."""
    return (0, out.shape[-1]) if slice_offsets is None else tuple(slice_offsets)


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
        slice_offsets = output_slices(out, slice_offsets)
        if info.num_segments == 0 or x.shape[0] == 0:
            return
        xa = self.shrink(x, A, info, num_slices=len(slice_offsets) - 1)
        self.expand(xa, B, info, out, slice_offsets)

    def shrink_stage(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, num_slices: int) -> torch.Tensor:
        """The first half of :meth:`apply`: an intermediate only :meth:`expand_stage` reads.

        Split so a caller can run the shrink beside other work (the base GEMM on another
        stream) and the expand after it. The base version is :meth:`shrink`'s ``xa``.
        """
        return self.shrink(x, A, info, num_slices=num_slices)

    def expand_stage(
        self,
        stage: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...],
    ) -> None:
        """The second half of :meth:`apply`: add the delta from :meth:`shrink_stage`'s result."""
        self.expand(stage, B, info, out, slice_offsets)

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
        The gathered rows are the shrink's result, so the backend's own ``expand`` finishes
        the job: no host sync, safe under CUDA graphs. Rows of base-model requests gather
        slot 0's row, which ``expand`` never reads.
        """
        if ids.numel() == 0 or A_emb.shape[0] == 0:
            return
        if ids.shape[0] != info.total_tokens:
            raise ValueError(f"ids has {ids.shape[0]} rows but the batch info describes {info.total_tokens}")
        if A_emb.shape[2] != B_emb.shape[2]:
            raise ValueError(f"A_emb rank {A_emb.shape[2]} != B_emb rank {B_emb.shape[2]}")
        slots = info.token_slots.long().clamp(min=0)
        xa = A_emb[slots, ids.reshape(-1).long()]
        self.expand(xa, B_emb, info, out, (0, out.shape[-1]))
