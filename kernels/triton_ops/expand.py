"""Segmented LoRA expand, fused into the base output in place.

``out[rows, slice s] += scaling[slot] * xa[rows, s] @ B[slot, slice s]ᵀ`` for every tile.
Grid: (output column block over all slices, tile). Slices of different widths (QKV with
GQA: q wider than k and v; gate/up) share one launch: a program finds its slice from its
column block. The shrink's split-K partial sums are added here as ``xa`` is loaded.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..metadata import LoRABatchInfo
from .configs import ExpandConfig, cdiv
from .shrink import dot_precision, upcast_dot

MAX_SLICES_PER_LAUNCH = 3


@triton.jit(do_not_specialize=["tiles_stride"])
def _lora_expand_kernel(
    xa_ptr,
    b_ptr,
    out_ptr,
    tiles_ptr,
    perm_ptr,
    ranks_ptr,
    scalings_ptr,
    tiles_stride,
    max_rank,
    xa_col0,
    off1,
    off2,
    off3,
    stride_xs,
    stride_xm,
    stride_xr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    NUM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_PERM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    slot = tl.load(tiles_ptr + 2 * tiles_stride + pid_t)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return

    # Which slice this column block belongs to; slice widths need not divide BLOCK_N.
    slice_id = pid_n * 0
    lo = pid_n * 0
    hi = pid_n * 0 + off1
    block = pid_n
    if NUM_SLICES > 1:
        c1 = tl.cdiv(off1, BLOCK_N)
        in1 = pid_n >= c1
        slice_id = tl.where(in1, 1, slice_id)
        lo = tl.where(in1, off1, lo)
        hi = tl.where(in1, off2, hi)
        block = tl.where(in1, pid_n - c1, block)
        if NUM_SLICES > 2:
            c2 = c1 + tl.cdiv(off2 - off1, BLOCK_N)
            in2 = pid_n >= c2
            slice_id = tl.where(in2, 2, slice_id)
            lo = tl.where(in2, off2, lo)
            hi = tl.where(in2, off3, hi)
            block = tl.where(in2, pid_n - c2, block)

    row_start = tl.load(tiles_ptr + pid_t)
    seg_end = tl.load(tiles_ptr + tiles_stride + pid_t)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_end
    if HAS_PERM:
        rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    else:
        rows = offs_m.to(tl.int64)
    offs_n = lo + block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi

    xa_rows = xa_ptr + rows[:, None] * stride_xm
    b_cols = b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
    xa_col = xa_col0 + slice_id * max_rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        offs_r = r + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        xa_mask = m_mask[:, None] & r_mask[None, :]
        xa_ptrs = xa_rows + (xa_col + offs_r)[None, :] * stride_xr
        xa = tl.load(xa_ptrs, mask=xa_mask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLIT_K):
            xa += tl.load(xa_ptrs + s * stride_xs, mask=xa_mask, other=0.0).to(tl.float32)
        bt = tl.load(b_cols + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        xa = xa.to(bt.dtype)  # the adapter's dtype, as a bf16/fp16 tensor-core dot needs
        if UPCAST_DOT:
            acc = tl.dot(xa.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xa, bt, acc, input_precision=DOT_PRECISION)

    scale = tl.load(scalings_ptr + slot)
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=out_mask, other=0.0)
    tl.store(out_ptrs, (base.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty), mask=out_mask)


def launch_expand(
    xa: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor,
    info: LoRABatchInfo,
    slice_offsets: tuple[int, ...],
    config: ExpandConfig,
) -> None:
    """Run the expand over ``info``'s tiles, adding into ``out`` in place.

    ``xa`` is ``[T, slices*max_rank]`` or the shrink's partial sums ``[split, T, ...]``.
    Up to three slices go in one launch (QKV, gate/up); more are launched in groups.
    """
    if xa.dim() == 2:
        split_k, (stride_xs, stride_xm, stride_xr) = 1, (0, xa.stride(0), xa.stride(1))
    else:
        split_k, (stride_xs, stride_xm, stride_xr) = xa.shape[0], xa.stride()
    max_rank = B.shape[2]
    num_slices = len(slice_offsets) - 1
    assert info.tiles is not None
    for first in range(0, num_slices, MAX_SLICES_PER_LAUNCH):
        group = slice_offsets[first : first + MAX_SLICES_PER_LAUNCH + 1]
        base_col = group[0]
        rel = [o - base_col for o in group[1:]] + [0] * (MAX_SLICES_PER_LAUNCH + 1 - len(group))
        widths = [b - a for a, b in itertools.pairwise(group)]
        col_blocks = sum(cdiv(w, config.block_n) for w in widths)
        if col_blocks == 0:
            continue
        out_view = out[:, base_col:]
        b_view = B[:, base_col:, :]
        grid = (col_blocks, info.num_tiles)
        _lora_expand_kernel[grid](
            xa,
            b_view,
            out_view,
            info.tiles,
            info.permutation if info.permutation is not None else info.tiles,
            info.lora_ranks,
            info.scalings,
            info.tiles.stride(0),
            max_rank,
            first * max_rank,
            rel[0],
            rel[1],
            rel[2],
            stride_xs,
            stride_xm,
            stride_xr,
            b_view.stride(0),
            b_view.stride(1),
            b_view.stride(2),
            out_view.stride(0),
            out_view.stride(1),
            NUM_SLICES=len(widths),
            SPLIT_K=split_k,
            HAS_PERM=info.permutation is not None,
            DOT_PRECISION=dot_precision(B.dtype),
            UPCAST_DOT=upcast_dot(B.dtype),
            BLOCK_M=info.tile_m,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_r,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
