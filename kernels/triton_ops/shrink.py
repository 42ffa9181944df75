"""Segmented LoRA shrink: ``xa[rows] = x[rows] @ A[slot]ᵀ`` for every tile of one batch.

Grid: (slice, tile, K split × rank block). A program reads its tile's row of the tile
table and its row indices (two independent loads), stops at once for slot -1 or a rank
block past the slot's rank, and otherwise streams its share of ``in_dim`` through one dot
product. With ``split_k > 1`` each split writes its own partial sum (``out[split]``); the
expand adds them while loading, so no atomics, no zero-fill and no extra launch.

Rank blocks are the slowest grid axis: the first blocks the GPU dispatches are every
(slice, tile, split)'s first rank block, which serving ranks fill, and the programs of
rank blocks past a slot's rank (which stop at once) come after. With rank blocks as the
fastest axis the block scheduler's round robin can land every live program on the same
few SMs (a rank-64 pool serving rank-16 slots has 3 live programs in 12 per (tile, split),
and 12 divides a 132-SM GPU's count); bench/KERNELS-NOTES.md has the profile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..metadata import LoRABatchInfo
from .configs import ShrinkConfig, cdiv, k_per_split
from .pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def shrink_block(
    x_ptr,
    a_ptr,
    out_ptr,
    slot,
    rank,
    rows,
    slice_id,
    n_start,
    split_id,
    in_dim,
    max_rank,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_os,
    stride_om,
    stride_on,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One tile's rank block ``n_start:+BLOCK_N`` of one slice over split ``split_id`` of
    ``in_dim``, stored as partial sum ``split_id`` (rows -1 and columns past ``rank`` skipped)."""
    m_mask = rows >= 0
    rows = tl.where(m_mask, rows, 0).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rank
    cols = slice_id * max_rank + offs_n

    x_rows = x_ptr + rows[:, None] * stride_xm
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + cols[None, :].to(tl.int64) * stride_ar
    k_lo = split_id * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_dim)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # An empty range (a trailing split past in_dim) leaves zeros: the partial stays valid.
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xt = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[:, None] * stride_ak, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at, acc, input_precision=DOT_PRECISION)

    out_ptrs = out_ptr + split_id * stride_os + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    tiles_ptr,
    rows_ptr,
    in_dim,
    max_rank,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_os,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    slice_id = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2) % SPLIT_K
    n_start = (tl.program_id(2) // SPLIT_K) * BLOCK_N
    slot = tl.load(tiles_ptr + pid_t * 4)
    rank = tl.load(tiles_ptr + pid_t * 4 + 1)
    rows = tl.load(rows_ptr + pid_t * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    if n_start >= rank:
        return  # nothing past the adapter's own rank
    shrink_block(
        x_ptr, a_ptr, out_ptr, slot, rank, rows, slice_id, n_start, pid_k, in_dim, max_rank, k_per_split,
        stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_om, stride_on,
        DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products; half types use the tensor cores natively."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast_dot(dtype: torch.dtype) -> bool:
    """bf16 dots go through fp32 under the interpreter, whose dot reads bf16 as raw integers.

    The products of two bf16 values are exact in fp32, so this matches the GPU's bf16
    tensor-core dot with fp32 accumulation.
    """
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def launch_shrink(
    x: torch.Tensor,
    A: torch.Tensor,
    out: torch.Tensor,
    info: LoRABatchInfo,
    num_slices: int,
    config: ShrinkConfig,
    *,
    pdl: bool = False,
) -> None:
    """Run the shrink over ``info``'s tiles into ``out``.

    ``out`` is ``[split_k, T, num_slices*max_rank]`` (any strides; fp32 for partial sums)
    or ``[T, num_slices*max_rank]`` when ``config.split_k == 1``.
    """
    max_rank = A.shape[1] // num_slices
    in_dim = x.shape[1]
    if out.dim() == 2:
        if config.split_k != 1:
            raise ValueError("a 2-D shrink output holds one partial sum: use split_k=1")
        stride_os, stride_om, stride_on = 0, out.stride(0), out.stride(1)
    else:
        stride_os, stride_om, stride_on = out.stride()
    rank_blocks = cdiv(max_rank, config.block_n)
    assert info.tiles is not None and info.tile_rows is not None
    grid = (num_slices, info.num_tiles, config.split_k * rank_blocks)
    extra = {"launch_pdl": True} if pdl else {}
    _lora_shrink_kernel[grid](
        x,
        A,
        out,
        info.tiles,
        info.tile_rows,
        in_dim,
        max_rank,
        k_per_split(in_dim, config.block_k, config.split_k),
        x.stride(0),
        x.stride(1),
        A.stride(0),
        A.stride(1),
        A.stride(2),
        stride_os,
        stride_om,
        stride_on,
        SPLIT_K=config.split_k,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot(x.dtype),
        USE_PDL=pdl,
        BLOCK_M=info.tile_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **extra,
    )
