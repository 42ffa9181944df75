"""Input checks every LoRA kernel shares (the torch reference, the Triton ops, the fused
GEMM): below the backends, so a kernel module never imports the interface above it."""

from __future__ import annotations

import itertools
import os

import torch

from .metadata import LoRABatchInfo


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


def check_expand_shapes(
    xa: torch.Tensor | tuple[int, ...],
    B: torch.Tensor,
    info: LoRABatchInfo,
    out: torch.Tensor,
    slice_offsets: tuple[int, ...],
) -> int:
    """Validate expand inputs (``xa`` or its shape); returns ``max_rank``. Shared by the backends."""
    xa_shape = tuple(xa.shape) if isinstance(xa, torch.Tensor) else tuple(xa)
    if len(slice_offsets) < 2 or slice_offsets[0] != 0:
        raise ValueError(f"slice_offsets must start at 0 and name at least one slice, got {slice_offsets}")
    if any(b < a for a, b in itertools.pairwise(slice_offsets)):
        raise ValueError(f"slice_offsets must be non-decreasing, got {slice_offsets}")
    num_slices = len(slice_offsets) - 1
    if B.dim() != 3:
        raise ValueError(f"B must be [slots, out_total, max_rank], got shape {tuple(B.shape)}")
    max_rank = B.shape[2]
    if out.dim() != 2 or out.shape[0] != info.total_tokens:
        raise ValueError(
            f"out must be [{info.total_tokens}, out_total] for this batch, got shape {tuple(out.shape)}"
        )
    if B.shape[1] != slice_offsets[-1] or out.shape[1] != slice_offsets[-1]:
        raise ValueError(
            f"B {tuple(B.shape)} / out {tuple(out.shape)} do not match slices {slice_offsets}: "
            f"both need {slice_offsets[-1]} output columns"
        )
    if xa_shape != (info.total_tokens, num_slices * max_rank):
        raise ValueError(
            f"xa must be [{info.total_tokens}, {num_slices}*{max_rank}] (tokens, slices*max_rank), "
            f"got shape {xa_shape}"
        )
    return max_rank


def check_triton_device(tensors: tuple[torch.Tensor, ...], what: str, cpu_hint: str = "set TRITON_INTERPRET=1") -> None:
    """All of ``tensors`` on one device, and that device one Triton can run on: CUDA, or the
    CPU under the interpreter. ``what`` names the caller in the errors, ``cpu_hint`` the fix."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{what} tensors must share one device, got {t.device} and {device}")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton {what} runs on CUDA tensors (got {device}); on the CPU {cpu_hint}")
