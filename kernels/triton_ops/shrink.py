"""Segmented LoRA shrink: ``xa[rows] = x[rows] @ A[slot]ᵀ`` for every tile of one batch.

Grid: (slice × rank block, tile, K split). A program reads its tile's row of the tile
table and its row indices (two independent loads), stops at once for slot -1 or a rank
block past the slot's rank, and otherwise streams its share of ``in_dim`` through one dot
product. With ``split_k > 1`` each split writes its own partial sum (``out[split]``); the
expand adds them while loading, so no atomics, no zero-fill and no extra launch.

Tiles of at most ``few_rows`` live rows (decode with many adapters, short verify blocks)
take :func:`shrink_rows` instead: a tensor-core dot of a 16-row tile stages both operands
through shared memory, which at one live row costs more shared-memory traffic than the
adapter's bytes are worth (Nsight Compute, bench/KERNELS-NOTES.md run 8); the FMA path
reads A straight into registers.
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
def _tile_row(rows_ptr, i):
    """Entry ``i`` of a tile's row list: ``(row index clamped to 0, live)``."""
    row = tl.load(rows_ptr + i)
    live = row >= 0
    return tl.where(live, row, 0).to(tl.int64), live


@triton.jit
def shrink_rows(
    x_ptr,
    a_ptr,
    out_ptr,
    slot,
    rank,
    rows_ptr,
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """:func:`shrink_block` for a tile of at most four live rows (the first four entries of
    ``rows_ptr``; -1: none), on CUDA-core FMAs: each row's products accumulate element-wise
    over the K loop and are reduced once at the end; the next step's loads are issued
    before this step's arithmetic."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rank
    cols = slice_id * max_rank + offs_n
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + cols[:, None].to(tl.int64) * stride_ar
    r0, v0 = _tile_row(rows_ptr, 0)
    r1, v1 = _tile_row(rows_ptr, 1)
    r2, v2 = _tile_row(rows_ptr, 2)
    r3, v3 = _tile_row(rows_ptr, 3)
    x0 = x_ptr + r0 * stride_xm
    x1 = x_ptr + r1 * stride_xm
    x2 = x_ptr + r2 * stride_xm
    x3 = x_ptr + r3 * stride_xm
    k_lo = split_id * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_dim)
    # A dead row gets an empty range rather than a combined mask (scalar & tensor masks).
    h0 = tl.where(v0, k_hi, 0)
    h1 = tl.where(v1, k_hi, 0)
    h2 = tl.where(v2, k_hi, 0)
    h3 = tl.where(v3, k_hi, 0)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a = tl.load(
        a_rows + offs_k[None, :] * stride_ak, mask=n_mask[:, None] & (offs_k < k_hi)[None, :], other=0.0
    )
    y0 = tl.load(x0 + offs_k * stride_xk, mask=offs_k < h0, other=0.0)
    y1 = tl.load(x1 + offs_k * stride_xk, mask=offs_k < h1, other=0.0)
    y2 = tl.load(x2 + offs_k * stride_xk, mask=offs_k < h2, other=0.0)
    y3 = tl.load(x3 + offs_k * stride_xk, mask=offs_k < h3, other=0.0)
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # An empty range (a trailing split past in_dim) loads nothing: the partial stays zero.
    for k in range(k_lo, k_hi, BLOCK_K):
        nk = k + BLOCK_K + tl.arange(0, BLOCK_K)
        a_next = tl.load(
            a_rows + nk[None, :] * stride_ak, mask=n_mask[:, None] & (nk < k_hi)[None, :], other=0.0
        )
        y0_next = tl.load(x0 + nk * stride_xk, mask=nk < h0, other=0.0)
        y1_next = tl.load(x1 + nk * stride_xk, mask=nk < h1, other=0.0)
        y2_next = tl.load(x2 + nk * stride_xk, mask=nk < h2, other=0.0)
        y3_next = tl.load(x3 + nk * stride_xk, mask=nk < h3, other=0.0)
        af = a.to(tl.float32)
        acc0 += af * y0.to(tl.float32)[None, :]
        acc1 += af * y1.to(tl.float32)[None, :]
        acc2 += af * y2.to(tl.float32)[None, :]
        acc3 += af * y3.to(tl.float32)[None, :]
        a, y0, y1, y2, y3 = a_next, y0_next, y1_next, y2_next, y3_next
    out_cols = out_ptr + split_id * stride_os + cols * stride_on
    dt = out_ptr.dtype.element_ty
    tl.store(out_cols + r0 * stride_om, tl.sum(acc0, axis=1).to(dt), mask=offs_n < tl.where(v0, rank, 0))
    tl.store(out_cols + r1 * stride_om, tl.sum(acc1, axis=1).to(dt), mask=offs_n < tl.where(v1, rank, 0))
    tl.store(out_cols + r2 * stride_om, tl.sum(acc2, axis=1).to(dt), mask=offs_n < tl.where(v2, rank, 0))
    tl.store(out_cols + r3 * stride_om, tl.sum(acc3, axis=1).to(dt), mask=offs_n < tl.where(v3, rank, 0))


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
    RANK_BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
    FEW_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(tiles_ptr + pid_t * 4)
    rank = tl.load(tiles_ptr + pid_t * 4 + 1)
    rows = tl.load(rows_ptr + pid_t * BLOCK_M + tl.arange(0, BLOCK_M))
    if slot < 0:
        return
    slice_id = pid_n // RANK_BLOCKS
    n_start = (pid_n % RANK_BLOCKS) * BLOCK_N
    if n_start >= rank:
        return  # nothing past the adapter's own rank
    if FEW_ROWS > 0:
        if tl.sum((rows >= 0).to(tl.int32), axis=0) <= FEW_ROWS:
            shrink_rows(
                x_ptr, a_ptr, out_ptr, slot, rank, rows_ptr + pid_t * BLOCK_M, slice_id, n_start, pid_k, in_dim,
                max_rank, k_per_split, stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_om,
                stride_on, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        else:
            shrink_block(
                x_ptr, a_ptr, out_ptr, slot, rank, rows, slice_id, n_start, pid_k, in_dim, max_rank, k_per_split,
                stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_os, stride_om, stride_on,
                DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
    else:
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
    grid = (num_slices * rank_blocks, info.num_tiles, config.split_k)
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
        RANK_BLOCKS=rank_blocks,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot(x.dtype),
        USE_PDL=pdl,
        FEW_ROWS=config.few_rows,
        BLOCK_M=info.tile_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **extra,
    )
