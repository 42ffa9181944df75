"""Triton fused MoE: grouped expert GEMMs over routed pairs, with per-row LoRA deltas.

One forward (``P = T * top_k`` pairs, see :mod:`.routing`), after the routing layouts (by
expert, and by (expert, slot) for the LoRA deltas: two launches each, :mod:`.align`):

1. ``gate_up [P, 2I] = x[p // top_k] @ W13[e]ᵀ``: one program per (block of one expert's
   pairs, column block); plus, for the pairs whose row uses an adapter with LoRA on the
   experts, the LoRA shrink ``s = x A[slot, e]ᵀ`` and expand ``gate_up += scale * s B[slot, e]ᵀ``
   over blocks of one (expert, slot) group, so each block multiplies one adapter's matrices;
2. ``h = silu(gate) * up`` (the decoder's fused kernel);
3. ``y [P, H] = w_p * (h @ W2[e]ᵀ + scale * (h A) Bᵀ)`` in float32, the routing weight
   applied in the kernels;
4. ``out[t] = sum_j y[t * top_k + j]``, rounded once to the model dtype.

Every pair belongs to exactly one block of each layout, so the expands add into their rows
without atomics. All shapes depend only on ``T``, ``top_k`` and the weights: with the
routing buffers sized for a graph's token rows the whole forward is CUDA-graph capturable.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..model_ops import triton_ops as model_triton
from ..triton_ops.shrink import dot_precision, upcast_dot
from .align import align
from .routing import LORA_BLOCK, BlockLayout, MoEBuffers, block_for
from .types import ExpertLoRA, MoELoRA

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pairs_ptr, groups_ptr, rw_ptr, num_pairs, N, K,
    s_am, s_ak, s_we, s_wn, s_wk, s_cm, s_cn,
    ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``c[p, n] = (w_p *) a[p // ROW_DIV] · W[e, n]`` for one block of expert ``e``'s pairs."""
    pid_m = tl.program_id(0)
    expert = tl.load(groups_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    pairs = tl.where(m_mask, pairs, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    a_rows = a_ptr + (pairs // ROW_DIV)[:, None] * s_am
    w_cols = w_ptr + expert.to(tl.int64) * s_we + offs_n[None, :].to(tl.int64) * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_rows + offs_k[None, :] * s_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + offs_k[:, None] * s_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(rw_ptr + pairs, mask=m_mask, other=0.0)[:, None]
    c = c_ptr + pairs[:, None] * s_cm + offs_n[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, s_ptr, pairs_ptr, groups_ptr, ranks_ptr, num_pairs, num_slots, K, max_rank,
    s_xm, s_xk, s_as, s_ae, s_ar, s_ak, s_sm, s_sr,
    ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``s[p, slice rows] = x[p // ROW_DIV] · A[slot, e, slice rows]`` for one (expert, slot) block."""
    pid_m = tl.program_id(0)
    slice_id = tl.program_id(1)
    group = tl.load(groups_ptr + pid_m)
    if group < 0:
        return
    slot = group % num_slots
    expert = group // num_slots
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return  # this adapter has LoRA on the other part only
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    pairs = tl.where(m_mask, pairs, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    cols = slice_id * max_rank + offs_r
    x_rows = x_ptr + (pairs // ROW_DIV)[:, None] * s_xm
    a_rows = a_ptr + slot.to(tl.int64) * s_as + expert.to(tl.int64) * s_ae + cols[None, :].to(tl.int64) * s_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        xt = tl.load(x_rows + offs_k[None, :] * s_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + offs_k[:, None] * s_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
    s = s_ptr + pairs[:, None] * s_sm + cols[None, :] * s_sr
    tl.store(s, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    s_ptr, b_ptr, c_ptr, pairs_ptr, groups_ptr, ranks_ptr, scale_ptr, rw_ptr,
    num_pairs, num_slots, max_rank, split, width,
    s_sm, s_sr, s_bs, s_be, s_bn, s_br, s_cm, s_cn,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """``c[p, slice cols] += (w_p *) scale * s[p, slice rows] · B[slot, e, slice cols]``."""
    pid_m = tl.program_id(0)
    slice_id = tl.program_id(2)
    group = tl.load(groups_ptr + pid_m)
    if group < 0:
        return
    # at most two slices: columns [0, split) and [split, width)
    lo = tl.where(slice_id == 0, 0, split)
    hi = tl.where(slice_id == 0, split, width)
    n_start = lo + tl.program_id(1) * BLOCK_N
    if n_start >= hi:
        return
    slot = group % num_slots
    expert = group // num_slots
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:
        return
    scale = tl.load(scale_ptr + slot)
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    pairs = tl.where(m_mask, pairs, 0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    sa = tl.load(
        s_ptr + pairs[:, None] * s_sm + (slice_id * max_rank + offs_r)[None, :] * s_sr,
        mask=m_mask[:, None] & r_mask[None, :], other=0.0,
    )  # fmt: skip
    b = b_ptr + slot.to(tl.int64) * s_bs + expert.to(tl.int64) * s_be
    bt = tl.load(b + offs_r[:, None] * s_br + offs_n[None, :].to(tl.int64) * s_bn, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    acc = tl.dot(sa, bt.to(tl.float32), input_precision="ieee") * scale
    if MUL_WEIGHT:
        acc = acc * tl.load(rw_ptr + pairs, mask=m_mask, other=0.0)[:, None]
    c = c_ptr + pairs[:, None] * s_cm + offs_n[None, :] * s_cn
    mask = m_mask[:, None] & n_mask[None, :]
    out = tl.load(c, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(c, out.to(c_ptr.dtype.element_ty), mask=mask)


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, layout: BlockLayout, row_div: int, rw: torch.Tensor | None) -> None:
    n, k = w.shape[1], w.shape[2]
    grid = (layout.num_blocks, triton.cdiv(n, BLOCK_N))
    _expert_gemm_kernel[grid](
        a, w, c, layout.sorted_pairs, layout.block_groups, c if rw is None else rw, layout.num_pairs, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        ROW_DIV=row_div, MUL_WEIGHT=rw is not None, DOT_PRECISION=dot_precision(a.dtype),
        UPCAST_DOT=upcast_dot(a.dtype), BLOCK_M=layout.block, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip


def _lora(
    x: torch.Tensor, out: torch.Tensor, part: ExpertLoRA, lora: MoELoRA, layout: BlockLayout,
    row_div: int, rw: torch.Tensor | None,
) -> None:  # fmt: skip
    """Add ``part``'s per-row delta on ``x`` into ``out`` over the (expert, slot) blocks."""
    slices, max_rank, num_slots = part.num_slices, part.max_rank, part.A.shape[0]
    block_r = max(16, triton.next_power_of_2(max_rank))
    shrunk = torch.empty(layout.num_pairs, slices * max_rank, dtype=torch.float32, device=x.device)
    a, b = part.A, part.B
    _lora_shrink_kernel[(layout.num_blocks, slices)](
        x, a, shrunk, layout.sorted_pairs, layout.block_groups, part.ranks, layout.num_pairs, num_slots,
        a.shape[-1], max_rank, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), a.stride(3),
        shrunk.stride(0), shrunk.stride(1), ROW_DIV=row_div, BLOCK_M=layout.block, BLOCK_R=block_r,
        BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    offsets = part.slice_offsets
    if slices > 2 or offsets[0] != 0:
        raise ValueError(f"expert LoRA slices {offsets}: the kernels take one or two slices from column 0")
    widest = max(hi - lo for lo, hi in itertools.pairwise(offsets))
    _lora_expand_kernel[(layout.num_blocks, triton.cdiv(widest, BLOCK_N), slices)](
        shrunk, b, out, layout.sorted_pairs, layout.block_groups, part.ranks, lora.scalings,
        out if rw is None else rw, layout.num_pairs, num_slots, max_rank, offsets[1], offsets[-1],
        shrunk.stride(0), shrunk.stride(1), b.stride(0), b.stride(1), b.stride(2), b.stride(3),
        out.stride(0), out.stride(1), MUL_WEIGHT=rw is not None, BLOCK_M=layout.block, BLOCK_N=BLOCK_N,
        BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: MoELoRA | None = None,
    buffers: MoEBuffers | None = None,
) -> torch.Tensor:
    """See :func:`loraserve.kernels.moe.fused_moe`."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, inter = gate_up.shape[0], down.shape[2]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if buffers is not None and tokens > buffers.max_tokens:
        raise ValueError(
            f"{tokens} token rows do not fit the MoE routing buffers sized for {buffers.max_tokens} rows "
            "(size them in tokens: max_bs x rows per request)"
        )
    layout = align(ids, num_experts, block_for(num_pairs, num_experts), None if buffers is None else buffers.base)
    lora_layout = None
    if lora is not None and lora.num_slots:
        lora_layout = align(
            ids, num_experts * lora.num_slots, LORA_BLOCK, None if buffers is None else buffers.lora,
            token_slots=lora.token_slots, ranks=lora.live_ranks(), num_slots=lora.num_slots,
        )  # fmt: skip

    gu = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, gu, layout, top_k, None)
    if lora_layout is not None and lora.gate_up is not None:
        _lora(x, gu, lora.gate_up, lora, lora_layout, top_k, None)
    h = model_triton.silu_mul(gu)
    rw = weights.reshape(-1).float().contiguous()
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    _gemm(h, down, y, layout, 1, rw)
    if lora_layout is not None and lora.down is not None:
        _lora(h, y, lora.down, lora, lora_layout, 1, rw)
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)
