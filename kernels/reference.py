"""Torch reference backend: plain per-segment matmuls. Runs anywhere; the CPU path."""

from __future__ import annotations

import torch

from .backend import LoRABackend
from .checks import check_expand_shapes, check_shapes
from .metadata import LoRABatchInfo


class TorchLoRABackend(LoRABackend):
    """Loops over segments on the host; accumulates in float32."""

    name = "torch"

    def shrink(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, num_slices: int = 1) -> torch.Tensor:
        max_rank, _ = check_shapes(x, A, info, num_slices)
        xa = torch.zeros(x.shape[0], num_slices * max_rank, dtype=x.dtype, device=x.device)
        for seg in range(info.num_segments):
            slot = info.weight_indices_cpu[seg]
            rank = info.lora_ranks_cpu[slot] if slot >= 0 else 0
            if rank == 0:
                continue
            rows = torch.tensor(info.rows(seg), device=x.device, dtype=torch.long)
            xs = x.index_select(0, rows).float()
            for s in range(num_slices):
                a = A[slot, s * max_rank : s * max_rank + rank].float()
                xa[rows, s * max_rank : s * max_rank + rank] = (xs @ a.T).to(x.dtype)
        return xa

    def expand(
        self,
        xa: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...],
    ) -> None:
        num_slices = len(slice_offsets) - 1
        max_rank = check_expand_shapes(xa, B, info, out, slice_offsets)
        for seg in range(info.num_segments):
            slot = info.weight_indices_cpu[seg]
            rank = info.lora_ranks_cpu[slot] if slot >= 0 else 0
            if rank == 0:
                continue
            rows = torch.tensor(info.rows(seg), device=out.device, dtype=torch.long)
            scale = info.scalings[slot].float()
            for s in range(num_slices):
                lo, hi = slice_offsets[s], slice_offsets[s + 1]
                xs = xa.index_select(0, rows)[:, s * max_rank : s * max_rank + rank].float()
                delta = (xs @ B[slot, lo:hi, :rank].float().T) * scale
                out[rows, lo:hi] = (out[rows, lo:hi].float() + delta).to(out.dtype)
