"""Segmented LoRA expand, fused into the base output in place.

``out[rows, slice s] += scaling[slot] * xa[rows, s] @ B[slot, slice s]ᵀ`` for every tile.
Grid: (column group over all slices, tile). Slices of different widths (QKV with GQA:
q wider than k and v; gate/up) share one launch: a program finds its slice from its
column group. A program issues its first block's B and output loads, loads its tile's
``xa`` once (adding the shrink's split-K partial sums), then streams ``col_blocks``
blocks of ``B`` and ``out``, always loading the next block before storing the current
one. The per-program cost (metadata, ``xa``) is paid once per group, not per block.
The pieces are shared with the single-launch kernel in :mod:`.fused`.

Tiles of at most ``few_rows`` live rows take :func:`expand_rows`: no tensor-core dot,
whose operand and result layouts go through shared memory for all 16 rows of a tile
(Nsight Compute on the H200: the expand's L1/shared pipe near 80% busy at half the DRAM
bandwidth, bench/KERNELS-NOTES.md run 8). The FMA path reads B in blocks as wide as
the program's threads cover (each thread holds every rank of its 16 bytes of columns), so
the reduction over the rank stays in registers.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..metadata import LoRABatchInfo
from .configs import ExpandConfig, cdiv, next_pow2
from .pdl import gdc_launch_dependents, gdc_wait
from .shrink import _tile_row, dot_precision, upcast_dot

MAX_SLICES_PER_LAUNCH = 3


@triton.jit
def _load_xa(xa_ptrs, mask, cols, stride_xs, split, SPLIT_K: tl.constexpr, XA_CACHE: tl.constexpr):
    """One ``xa`` tile: the shrink's first ``split`` partial sums (of at most ``SPLIT_K``)
    added in float32. The loads are unrolled so they are all in flight at once; those
    past ``split`` are masked off (``cols`` is the tile's column index, ``[1, BLOCK_R]``)."""
    xa = tl.load(xa_ptrs, mask=mask, other=0.0, cache_modifier=XA_CACHE).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        part_mask = mask & (cols < tl.where(s < split, 1 << 30, 0))
        xa += tl.load(xa_ptrs + s * stride_xs, mask=part_mask, other=0.0, cache_modifier=XA_CACHE).to(
            tl.float32
        )
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
        bt_next = tl.load(
            b_cols_next + offs_r[:, None] * stride_br, mask=r_mask[:, None] & next_mask[None, :], other=0.0
        )
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
                br = tl.load(
                    b_cols + offs_rr[:, None] * stride_br, mask=rr_mask[:, None] & n_mask[None, :], other=0.0
                )
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


RANK_CHUNK = tl.constexpr(4)  # ranks of B an FMA step holds: few registers per thread, however wide the block


@triton.jit
def expand_rows(
    xa_ptr,
    b_ptr,
    out_ptr,
    slot,
    rank,
    scale,
    rows_ptr,
    slice_id,
    n_first,
    n_end,
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
    ROWS_N: tl.constexpr,
):
    """``out[rows, n_first:n_end] += scale * xa[rows] @ B[slot]ᵀ`` for a tile of at most
    four live rows (the first four entries of ``rows_ptr``), ``ROWS_N`` columns a block, on
    CUDA-core FMAs. The rank is walked ``RANK_CHUNK`` at a time up to the slot's own rank,
    the next chunk's B loads issued before this chunk's arithmetic; ``xa`` is rounded to
    B's dtype first, as the dot path does."""
    r0, v0 = _tile_row(rows_ptr, 0)
    r1, v1 = _tile_row(rows_ptr, 1)
    r2, v2 = _tile_row(rows_ptr, 2)
    r3, v3 = _tile_row(rows_ptr, 3)
    xa_cols = xa_ptr + (xa_col0 + slice_id * max_rank) * stride_xr
    x0 = xa_cols + r0 * stride_xm
    x1 = xa_cols + r1 * stride_xm
    x2 = xa_cols + r2 * stride_xm
    x3 = xa_cols + r3 * stride_xm
    # A dead row reads nothing (its xa is zero): rank 0 rather than a combined mask.
    k0 = tl.where(v0, rank, 0)
    k1 = tl.where(v1, rank, 0)
    k2 = tl.where(v2, rank, 0)
    k3 = tl.where(v3, rank, 0)
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    offs_c = tl.arange(0, RANK_CHUNK)
    dt = b_ptr.dtype.element_ty
    for n in range(n_first, n_end, ROWS_N):
        offs_n = n + tl.arange(0, ROWS_N)
        n_mask = offs_n < n_end
        b_cols = b_slot + offs_n[None, :].to(tl.int64) * stride_bn
        bt = tl.load(
            b_cols + offs_c[:, None] * stride_br, mask=(offs_c < rank)[:, None] & n_mask[None, :], other=0.0
        )
        d0 = tl.zeros((ROWS_N,), dtype=tl.float32)
        d1 = tl.zeros((ROWS_N,), dtype=tl.float32)
        d2 = tl.zeros((ROWS_N,), dtype=tl.float32)
        d3 = tl.zeros((ROWS_N,), dtype=tl.float32)
        for c in range(0, rank, RANK_CHUNK):
            nc = c + RANK_CHUNK + offs_c
            bt_next = tl.load(
                b_cols + nc[:, None] * stride_br, mask=(nc < rank)[:, None] & n_mask[None, :], other=0.0
            )
            cc = c + offs_c
            bf = bt.to(tl.float32)
            d0 += tl.sum(
                _xa_chunk(x0, cc, k0, stride_xr, stride_xs, split, SPLIT_K, dt)[:, None] * bf, axis=0
            )
            d1 += tl.sum(
                _xa_chunk(x1, cc, k1, stride_xr, stride_xs, split, SPLIT_K, dt)[:, None] * bf, axis=0
            )
            d2 += tl.sum(
                _xa_chunk(x2, cc, k2, stride_xr, stride_xs, split, SPLIT_K, dt)[:, None] * bf, axis=0
            )
            d3 += tl.sum(
                _xa_chunk(x3, cc, k3, stride_xr, stride_xs, split, SPLIT_K, dt)[:, None] * bf, axis=0
            )
            bt = bt_next
        cols = offs_n * stride_on
        if v0:
            _add_row(out_ptr + r0 * stride_om + cols, n_mask, d0, scale)
        if v1:
            _add_row(out_ptr + r1 * stride_om + cols, n_mask, d1, scale)
        if v2:
            _add_row(out_ptr + r2 * stride_om + cols, n_mask, d2, scale)
        if v3:
            _add_row(out_ptr + r3 * stride_om + cols, n_mask, d3, scale)


@triton.jit
def _xa_chunk(row_ptr, cols, rank, stride_xr, stride_xs, split, SPLIT_K: tl.constexpr, DTYPE: tl.constexpr):
    """Ranks ``cols`` of one row's ``xa``: the sum of the first ``split`` partials, zero
    past the slot's rank (the partial sums leave those columns unspecified), rounded to
    ``DTYPE``, in float32."""
    ptrs = row_ptr + cols * stride_xr
    xa = tl.load(ptrs, mask=cols < rank, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT_K):
        xa += tl.load(ptrs + s * stride_xs, mask=cols < tl.where(s < split, rank, 0), other=0.0).to(
            tl.float32
        )
    return xa.to(DTYPE).to(tl.float32)


@triton.jit
def _add_row(ptrs, mask, delta, scale):
    base = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (base.to(tl.float32) + delta * scale).to(base.dtype), mask=mask)


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
    FEW_ROWS: tl.constexpr,
    ROWS_N: tl.constexpr,
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
    if FEW_ROWS > 0 and not MULTI_CHUNK:
        if tl.sum((rows >= 0).to(tl.int32), axis=0) <= FEW_ROWS:
            expand_rows(
                xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows_ptr + pid_t * BLOCK_M, slice_id, n_first,
                tl.minimum(hi, n_first + col_blocks * BLOCK_N), max_rank, xa_col0, SPLIT_K, stride_xs, stride_xm,
                stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on, SPLIT_K, ROWS_N,
            )  # fmt: skip
        else:
            _expand_tile(
                xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, max_rank, xa_col0,
                stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on, SPLIT_K,
                MULTI_CHUNK, DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_R,
            )  # fmt: skip
    else:
        _expand_tile(
            xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, max_rank, xa_col0,
            stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on, SPLIT_K,
            MULTI_CHUNK, DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_R,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The tensor-core path: a program's column group for all ``BLOCK_M`` rows of its tile."""
    bt, base = expand_prefetch(
        b_ptr, out_ptr, slot, rank, rows, slot >= 0, n_first, hi, stride_bs, stride_bn, stride_br, stride_om, stride_on,
        BLOCK_M, BLOCK_N, BLOCK_R,
    )  # fmt: skip
    expand_stream(
        xa_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, col_blocks, bt, base, max_rank,
        xa_col0, SPLIT_K, stride_xs, stride_xm, stride_xr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
        SPLIT_K, MULTI_CHUNK, "", DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_R,
    )  # fmt: skip


def rows_width(dtype: torch.dtype, num_warps: int) -> int:
    """Columns of one :func:`expand_rows` step: 16 bytes for every thread of the program,
    so each thread's loads are whole 16-byte vectors and every rank of a column sits in
    one thread (the reduction over the rank needs no shuffles or shared memory)."""
    return 16 // dtype.itemsize * 32 * num_warps


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
            FEW_ROWS=config.few_rows,
            ROWS_N=rows_width(B.dtype, config.num_warps),
            BLOCK_M=info.tile_m,
            BLOCK_N=config.block_n,
            BLOCK_R=config.block_r,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **extra,
        )
