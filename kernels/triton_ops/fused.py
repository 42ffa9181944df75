"""Single-launch LoRA for tiny batches: shrink and expand in one kernel.

At a handful of tiles the two-launch path is bound by launch latency, not bytes. Here
each program recomputes its tile's ``xa`` for its slice (reading that slice of ``A``,
from L2 after the first program) and then streams its column group of ``B`` and ``out``
as the expand does. The recomputation costs ``column groups × |A|`` of L2 reads, so this
path only pays off while the batch has very few tiles.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..metadata import LoRABatchInfo
from .configs import FusedConfig
from .expand import column_groups
from .pdl import gdc_launch_dependents, gdc_wait
from .shrink import dot_precision, upcast_dot


@triton.jit
def _lora_fused_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    tiles_ptr,
    rows_ptr,
    in_dim,
    max_rank,
    off1,
    off2,
    off3,
    group1,
    group2,
    col_blocks,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    NUM_SLICES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_g = tl.program_id(0)
    pid_t = tl.program_id(1)
    slot = tl.load(tiles_ptr + pid_t * 4)
    rank = tl.load(tiles_ptr + pid_t * 4 + 1)
    scale = tl.load(tiles_ptr + pid_t * 4 + 2).to(tl.float32, bitcast=True)
    rows = tl.load(rows_ptr + pid_t * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    if rank == 0:
        return

    slice_id = pid_g * 0
    lo = pid_g * 0
    hi = pid_g * 0 + off1
    group = pid_g
    if NUM_SLICES > 1:
        in1 = pid_g >= group1
        slice_id = tl.where(in1, 1, slice_id)
        lo = tl.where(in1, off1, lo)
        hi = tl.where(in1, off2, hi)
        group = tl.where(in1, pid_g - group1, group)
        if NUM_SLICES > 2:
            in2 = pid_g >= group2
            slice_id = tl.where(in2, 2, slice_id)
            lo = tl.where(in2, off2, lo)
            hi = tl.where(in2, off3, hi)
            group = tl.where(in2, pid_g - group2, group)

    m_mask = rows >= 0
    rows = tl.where(m_mask, rows, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank

    # Shrink: this tile's xa for this slice, over the whole input.
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + (slice_id * max_rank + offs_r)[None, :].to(tl.int64) * stride_ar
    xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, in_dim, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_dim
        xt = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[:, None] * stride_ak, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST_DOT:
            xa = tl.dot(xt.to(tl.float32), at.to(tl.float32), xa, input_precision="ieee")
        else:
            xa = tl.dot(xt, at, xa, input_precision=DOT_PRECISION)
    xa = xa.to(b_ptr.dtype.element_ty)
    if UPCAST_DOT:
        xa = xa.to(tl.float32)

    # Expand: this program's column group.
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    out_rows = out_ptr + rows[:, None] * stride_om
    n_first = lo + group * col_blocks * BLOCK_N
    for c in range(0, col_blocks):
        offs_n = n_first + c * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        bt = tl.load(
            b_slot + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None] * stride_br,
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if UPCAST_DOT:
            acc = tl.dot(xa, bt.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(xa, bt, input_precision=DOT_PRECISION)
        out_ptrs = out_rows + offs_n[None, :] * stride_on
        out_mask = m_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=out_mask, other=0.0)
        tl.store(out_ptrs, (base.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)


def launch_fused(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor,
    info: LoRABatchInfo,
    slice_offsets: tuple[int, ...],
    config: FusedConfig,
    *,
    pdl: bool = False,
) -> None:
    """Shrink + expand of up to three slices in one launch (tiny batches, ranks <= 64)."""
    num_slices = len(slice_offsets) - 1
    if num_slices > 3:
        raise ValueError(f"the fused LoRA kernel takes at most 3 slices, got {num_slices}")
    max_rank = B.shape[2]
    widths = [b - a for a, b in itertools.pairwise(slice_offsets)]
    groups = column_groups(widths, config.block_n, config.col_blocks)
    starts = list(itertools.accumulate(groups))
    if starts[-1] == 0:
        return
    rel = [*slice_offsets[1:], 0, 0][:3]
    extra = {"launch_pdl": True} if pdl else {}
    assert info.tiles is not None and info.tile_rows is not None
    _lora_fused_kernel[(starts[-1], info.num_tiles)](
        x,
        A,
        B,
        out,
        info.tiles,
        info.tile_rows,
        x.shape[1],
        max_rank,
        rel[0],
        rel[1],
        rel[2],
        starts[0],
        starts[1] if len(starts) > 1 else 0,
        config.col_blocks,
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        B.stride(0),
        B.stride(1),
        B.stride(2),
        out.stride(0),
        out.stride(1),
        NUM_SLICES=num_slices,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot(x.dtype),
        USE_PDL=pdl,
        BLOCK_M=info.tile_m,
        BLOCK_N=config.block_n,
        BLOCK_R=config.block_r,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **extra,
    )
