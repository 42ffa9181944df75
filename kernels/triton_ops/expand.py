"""Segmented LoRA expand, fused into the base output in place.

``out[rows, slice s] += scaling[slot] * xa[rows, s] @ B[slot, slice s]ᵀ`` for every tile.
Grid: (column group over all slices, tile). Slices of different widths (QKV with GQA:
q wider than k and v; gate/up) share one launch: a program finds its slice from its
column group. A program issues its first block's B and output loads, loads its tile's
``xa`` once (adding the shrink's split-K partial sums), then streams ``col_blocks``
blocks of ``B`` and ``out``, always loading the next block before storing the current
one. The per-program cost (metadata, ``xa``) is paid once per group, not per block.
The pieces are shared with the single-launch kernel in :mod:`.fused`.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..metadata import LoRABatchInfo
from .configs import ExpandConfig, cdiv, next_pow2
from .pdl import gdc_launch_dependents, gdc_wait
from .shrink import dot_precision, upcast_dot

MAX_SLICES_PER_LAUNCH = 3


@triton.jit
def _load_xa(xa_ptrs, mask, cols, stride_xs, split, SPLIT_K: tl.constexpr, XA_CACHE: tl.constexpr):
    """One ``xa`` tile: the shrink's first ``split`` partial sums (of at most ``SPLIT_K``)
    added in float32. The loads are unrolled so they are all in flight at once; those
    past ``split`` are masked off (``cols`` is the tile's column index, ``[1, BLOCK_R]``)."""
    xa = tl.load(xa_ptrs, mask=mask, other=0.0, cache_modifier=XA_CACHE).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        part_mask = mask & (cols < tl.where(s < split, 1 << 30, 0))
        xa += tl.load(xa_ptrs + s * stride_xs, mask=part_mask, other=0.0, cache_modifier=XA_CACHE).to(tl.float32)
    return xa


@triton.jit
def locate_group(pid_g, off1, off2, off3, group1, group2, NUM_SLICES: tl.constexpr):
    """The slice a column group belongs to: ``(slice, first column, end column, group in slice)``.

    Slice widths need not divide the block, so each slice starts a fresh group.
    """
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
    return slice_id, lo, hi, group


@triton.jit
def expand_prefetch(
    b_ptr,
    out_ptr,
    slot,
    rank,
    rows,
    live,
    n_first,
    hi,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Issue the loads of a group's first block (B and the base output): they depend on
    the tile's slot and rows only, never on ``xa``, so they fly while ``xa`` is made."""
    # A dead item (``live`` false) gets empty ranges rather than a combined mask.
    m_mask = rows >= 0
    rows64 = tl.where(m_mask, rows, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < tl.where(live, rank, 0)
    offs_n = n_first + tl.arange(0, BLOCK_N)
    n_mask = offs_n < tl.where(live, hi, 0)
    b_slot = b_ptr + tl.where(live, slot, 0).to(tl.int64) * stride_bs
    bt = tl.load(
        b_slot + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None] * stride_br,
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    base = tl.load(
        out_ptr + rows64[:, None] * stride_om + offs_n[None, :] * stride_on,
        mask=m_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    return bt, base


@triton.jit
def expand_stream(
    xa_ptr,
    b_ptr,
    out_ptr,
    slot,
    rank,
    scale,
    rows,
    slice_id,
    n_first,
    hi,
    col_blocks,
    bt,
    base,
    max_rank,
    xa_col0,
    split,
    stride_xs,
    stride_xm,
    stride_xr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    MULTI_CHUNK: tl.constexpr,
    XA_CACHE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``out[rows, cols] += scale * xa[rows] @ B[slot, cols]ᵀ`` over ``col_blocks`` blocks
    from ``n_first``; ``bt``/``base`` are the first block's loads (:func:`expand_prefetch`);
    ``xa`` is the sum of the first ``split`` partial sums at ``xa_ptr``.

    Each step issues the next block's B and output loads before it stores its own, so a
    program always has a block's loads in flight instead of waiting on each in turn.
    """
    m_mask = rows >= 0
    rows64 = tl.where(m_mask, rows, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    xa_rows = xa_ptr + rows64[:, None] * stride_xm + (xa_col0 + slice_id * max_rank) * stride_xr
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    out_rows = out_ptr + rows64[:, None] * stride_om

    xa = _load_xa(
        xa_rows + offs_r[None, :] * stride_xr,
        m_mask[:, None] & r_mask[None, :],
        offs_r[None, :],
        stride_xs,
        split,
        SPLIT_K,
        XA_CACHE,
    )
    xa = xa.to(b_ptr.dtype.element_ty)  # the adapter's dtype, as a bf16/fp16 tensor-core dot needs
    if UPCAST_DOT:
        xa = xa.to(tl.float32)

    n_end = tl.minimum(hi, n_first + col_blocks * BLOCK_N)  # this group's last column + 1
    for c in range(0, col_blocks):
        offs_n = n_first + c * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        offs_next = offs_n + BLOCK_N
        next_mask = offs_next < n_end
        b_cols_next = b_slot + offs_next[None, :].to(tl.int64) * stride_bn
        bt_next = tl.load(b_cols_next + offs_r[:, None] * stride_br, mask=r_mask[:, None] & next_mask[None, :], other=0.0)
        base_next = tl.load(
            out_rows + offs_next[None, :] * stride_on, mask=m_mask[:, None] & next_mask[None, :], other=0.0
        )
        if UPCAST_DOT:
            acc = tl.dot(xa, bt.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(xa, bt, input_precision=DOT_PRECISION)
        if MULTI_CHUNK:
            # Ranks above one chunk: further chunks of xa and B (xa's from cache after the first block).
            b_cols = b_slot + offs_n[None, :].to(tl.int64) * stride_bn
            for r in range(BLOCK_R, rank, BLOCK_R):
                offs_rr = r + offs_r
                rr_mask = offs_rr < rank
                xr = _load_xa(
                    xa_rows + offs_rr[None, :] * stride_xr,
                    m_mask[:, None] & rr_mask[None, :],
                    offs_r[None, :],
                    stride_xs,
                    split,
                    SPLIT_K,
                    XA_CACHE,
                ).to(b_ptr.dtype.element_ty)
                br = tl.load(b_cols + offs_rr[:, None] * stride_br, mask=rr_mask[:, None] & n_mask[None, :], other=0.0)
                if UPCAST_DOT:
                    acc = tl.dot(xr.to(tl.float32), br.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xr, br, acc, input_precision=DOT_PRECISION)
        out_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(
            out_rows + offs_n[None, :] * stride_on,
            (base.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
        bt = bt_next
        base = base_next


@triton.jit
def expand_pipelined(
    xa_ptr,
    b_ptr,
    out_ptr,
    slot,
    rank,
    scale,
    rows,
    slice_id,
    n_first,
    hi,
    col_blocks,
    max_rank,
    xa_col0,
    stride_xs,
    stride_xm,
    stride_xr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    MULTI_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """:func:`expand_stream`'s work as a plain loop that Triton's software pipeliner takes:
    ``STAGES - 1`` blocks of B and of the base output are copied ahead, straight from
    global to shared memory (``cp.async``), instead of through registers.
    """
    m_mask = rows >= 0
    rows64 = tl.where(m_mask, rows, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    xa_rows = xa_ptr + rows64[:, None] * stride_xm + (xa_col0 + slice_id * max_rank) * stride_xr
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    out_rows = out_ptr + rows64[:, None] * stride_om
    xa = _load_xa(
        xa_rows + offs_r[None, :] * stride_xr, m_mask[:, None] & r_mask[None, :], offs_r[None, :], stride_xs,
        SPLIT_K, SPLIT_K, "",
    ).to(b_ptr.dtype.element_ty)  # fmt: skip
    if UPCAST_DOT:
        xa = xa.to(tl.float32)
    n_end = tl.minimum(hi, n_first + col_blocks * BLOCK_N)
    for c in tl.range(0, col_blocks, num_stages=STAGES):
        offs_n = n_first + c * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n_end
        b_cols = b_slot + offs_n[None, :].to(tl.int64) * stride_bn
        bt = tl.load(b_cols + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        base = tl.load(out_rows + offs_n[None, :] * stride_on, mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(xa, bt.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(xa, bt, input_precision=DOT_PRECISION)
        if MULTI_CHUNK:
            for r in range(BLOCK_R, rank, BLOCK_R):
                offs_rr = r + offs_r
                rr_mask = offs_rr < rank
                xr = _load_xa(
                    xa_rows + offs_rr[None, :] * stride_xr, m_mask[:, None] & rr_mask[None, :], offs_r[None, :],
                    stride_xs, SPLIT_K, SPLIT_K, "",
                ).to(b_ptr.dtype.element_ty)  # fmt: skip
                br = tl.load(b_cols + offs_rr[:, None] * stride_br, mask=rr_mask[:, None] & n_mask[None, :], other=0.0)
                if UPCAST_DOT:
                    acc = tl.dot(xr.to(tl.float32), br.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xr, br, acc, input_precision=DOT_PRECISION)
        tl.store(
            out_rows + offs_n[None, :] * stride_on,
            (base.to(tl.float32) + acc * scale).to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


@triton.jit
def _lora_expand_kernel(
    xa_ptr,
    b_ptr,
    out_ptr,
    tiles_ptr,
    rows_ptr,
    max_rank,
    xa_col0,
    off1,
    off2,
    off3,
    group1,
    group2,
    col_blocks,
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
    MULTI_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
    SMALL_R: tl.constexpr,
    PIPELINE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
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
    slice_id, lo, hi, group = locate_group(pid_g, off1, off2, off3, group1, group2, NUM_SLICES)
    n_first = lo + group * col_blocks * BLOCK_N
    # Tiles of a small-rank slot take SMALL_R-row B tiles (the launch sets SMALL_R, a
    # constexpr, only where it is narrower than BLOCK_R; 0 compiles the one path).
    if SMALL_R > 0 and rank <= SMALL_R:
        _expand_tile(
            xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, max_rank, xa_col0,
            stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on, SPLIT_K,
            False, DOT_PRECISION, UPCAST_DOT, PIPELINE, BLOCK_M, BLOCK_N, SMALL_R,
        )  # fmt: skip
    else:
        _expand_tile(
            xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, max_rank, xa_col0,
            stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on, SPLIT_K,
            MULTI_CHUNK, DOT_PRECISION, UPCAST_DOT, PIPELINE, BLOCK_M, BLOCK_N, BLOCK_R,
        )  # fmt: skip


@triton.jit
def _expand_tile(
    xa_ptr,
    b_ptr,
    out_ptr,
    slot,
    rank,
    scale,
    rows,
    slice_id,
    n_first,
    hi,
    col_blocks,
    max_rank,
    xa_col0,
    stride_xs,
    stride_xm,
    stride_xr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    SPLIT_K: tl.constexpr,
    MULTI_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    PIPELINE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program's column group of its tile, ``BLOCK_R`` ranks a step."""
    if PIPELINE > 0:
        expand_pipelined(
            xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, max_rank, xa_col0,
            stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on, SPLIT_K,
            MULTI_CHUNK, DOT_PRECISION, UPCAST_DOT, PIPELINE, BLOCK_M, BLOCK_N, BLOCK_R,
        )  # fmt: skip
    else:
        bt, base = expand_prefetch(
            b_ptr, out_ptr, slot, rank, rows, slot >= 0, n_first, hi, stride_bs, stride_bn, stride_br, stride_om,
            stride_on, BLOCK_M, BLOCK_N, BLOCK_R,
        )  # fmt: skip
        expand_stream(
            xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, bt, base, max_rank,
            xa_col0, SPLIT_K, stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
            SPLIT_K, MULTI_CHUNK, "", DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_R,
        )  # fmt: skip


def small_rank_block(config: ExpandConfig, tile_m: int) -> int:
    """The rank step of tiles whose slot's rank fits it (0: none): decode/verify tiles only,
    and only where it is narrower than the pool's ``block_r``."""
    small = config.small_block_r
    return small if 0 < small < config.block_r and tile_m <= 16 else 0


def column_groups(widths: list[int], block_n: int, col_blocks: int) -> list[int]:
    """Program columns per slice: ``col_blocks`` blocks of ``block_n`` output columns each."""
    return [cdiv(cdiv(w, block_n), col_blocks) for w in widths]


def launch_expand(
    xa: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor,
    info: LoRABatchInfo,
    slice_offsets: tuple[int, ...],
    config: ExpandConfig,
    *,
    pdl: bool = False,
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
    multi_chunk = config.block_r < next_pow2(max_rank)
    assert info.tiles is not None and info.tile_rows is not None
    extra = {"launch_pdl": True} if pdl else {}
    for first in range(0, num_slices, MAX_SLICES_PER_LAUNCH):
        group = slice_offsets[first : first + MAX_SLICES_PER_LAUNCH + 1]
        base_col = group[0]
        rel = [o - base_col for o in group[1:]] + [0] * (MAX_SLICES_PER_LAUNCH + 1 - len(group))
        widths = [b - a for a, b in itertools.pairwise(group)]
        groups = column_groups(widths, config.block_n, config.col_blocks)
        starts = list(itertools.accumulate(groups))  # first group of slices 1, 2
        if starts[-1] == 0:
            continue
        out_view = out[:, base_col:]
        b_view = B[:, base_col:, :]
        grid = (starts[-1], info.num_tiles)
        _lora_expand_kernel[grid](
            xa,
            b_view,
            out_view,
            info.tiles,
            info.tile_rows,
            max_rank,
            first * max_rank,
            rel[0],
            rel[1],
            rel[2],
            starts[0],
            starts[1] if len(starts) > 1 else 0,
            config.col_blocks,
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
            MULTI_CHUNK=multi_chunk,
            DOT_PRECISION=dot_precision(B.dtype),
            UPCAST_DOT=upcast_dot(B.dtype),
            USE_PDL=pdl,
            SMALL_R=small_rank_block(config, info.tile_m),
            PIPELINE=config.pipeline_stages,
            BLOCK_M=info.tile_m,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_r,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **extra,
        )
