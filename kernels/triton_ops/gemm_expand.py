"""The base linear layer's GEMM with the LoRA expand in its epilogue.

``out = x @ Wᵀ (+ bias) + scaling[slot[row]] · xa[row, slice] @ B[slot[row], cols, :rank]ᵀ``
in one launch, so the expand no longer runs exposed after the base GEMM. Built for
decode/verify sizes (a few to a few hundred token rows), where the GEMM is memory-bound:
it streams W once, and the epilogue's extra reads (a few columns of B per row, and
``xa``) are small beside it.

Grid: one program per ``block_n`` output columns x ``block_m`` token rows, the row tiles
of one column tile numbered next to each other so they share W through L2. The tile is
computed transposed, ``acc[n, m] = W[n, :] · x[m, :]``: W's column tile is the dot's wide
first operand (Hopper's warp-group MMA needs 64 there; the token rows, often fewer than
16 live, are the second operand's 16+ columns). The K loop is a plain ``tl.load`` +
``tl.dot`` loop that Triton software-pipelines over ``num_stages`` buffers.

Epilogue: rows may belong to any mix of adapters (``info.token_slots``, original row
order; -1 = base model), so the delta is a rank loop of rank-1 updates with a gather of
B per row rather than a tensor-core dot: ``acc[n, m] += xa[m, s(n)·R + r] · B[slot[m], n, r]``,
up to the largest rank among the tile's rows (a base-only tile does no epilogue work).
Ranks are unrolled ``RANK_UNROLL`` at a time so a group's loads are in flight together.
``xa`` is read straight from the shrink's float32 split-K partial sums, adding them as it
loads; rows of slot -1 and columns past a slot's rank are never read (they are unwritten).

Status: an alternative kept for ``bench/kernels --layer epilogue``, not used by the
runtime: the per-row gather of B in the epilogue costs more than the expand it replaces,
and the shrink it needs first is no longer hidden beside the GEMM (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_expand_shapes, check_triton_device
from ..metadata import LoRABatchInfo
from .configs import GemmConfig, next_pow2
from .shrink import dot_precision, upcast_dot

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SLICES = 3
MAX_RANK_UNROLL = 8


@triton.jit
def _slice_delta(
    acc,
    stage_ptr,
    b_ptr,
    rows64,
    slots64,
    live,
    rank,
    r_max,
    offs_n,
    n_lo,
    n_hi,
    slice_id,
    max_rank,
    stride_ss,
    stride_sm,
    stride_sr,
    stride_bs,
    stride_bn,
    stride_br,
    SPLIT: tl.constexpr,
    RANK_UNROLL: tl.constexpr,
):
    """``acc[n, m] += Σ_r xa[m, slice·R + r] · B[slot[m], n, r]`` for the columns of one slice.

    ``acc`` is ``[BLOCK_N, BLOCK_M]``; rows/slots/live/rank are ``[BLOCK_M]`` vectors.
    """
    n_mask = (offs_n >= n_lo) & (offs_n < n_hi)
    xa_rows = stage_ptr + rows64 * stride_sm + slice_id * max_rank * stride_sr
    b_rows = b_ptr + slots64[None, :] * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn
    for r0 in range(0, r_max, RANK_UNROLL):
        for j in tl.static_range(RANK_UNROLL):
            r = r0 + j
            m_mask = live & (r < rank)
            xa = tl.load(xa_rows + r * stride_sr, mask=m_mask, other=0.0).to(tl.float32)
            for s in tl.static_range(1, SPLIT):
                xa += tl.load(xa_rows + s * stride_ss + r * stride_sr, mask=m_mask, other=0.0).to(tl.float32)
            b = tl.load(b_rows + r * stride_br, mask=n_mask[:, None] & m_mask[None, :], other=0.0)
            acc += b.to(tl.float32) * xa[None, :]
    return acc


@triton.jit
def _gemm_expand_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    stage_ptr,
    b_ptr,
    token_slots_ptr,
    ranks_ptr,
    scalings_ptr,
    T,
    N,
    K,
    max_rank,
    off1,
    off2,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    stride_ss,
    stride_sm,
    stride_sr,
    stride_bs,
    stride_bn,
    stride_br,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    SPLIT: tl.constexpr,
    RANK_UNROLL: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(T, BLOCK_M)
    pid_m = pid % m_tiles  # row tiles of one column tile run together: W comes from L2 after the first
    pid_n = pid // m_tiles
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrapped (not masked) edge rows/columns: the loop's loads need no mask, the store drops them.
    rows_ld = (offs_m % T).to(tl.int64)
    cols_ld = (offs_n % N).to(tl.int64)
    w_ptrs = w_ptr + cols_ld[:, None] * stride_wn + offs_k[None, :] * stride_wk
    x_ptrs = x_ptr + rows_ld[None, :] * stride_xm + offs_k[:, None] * stride_xk

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs)
        else:
            k_left = K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            xt = tl.load(x_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST_DOT:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K * stride_wk
        x_ptrs += BLOCK_K * stride_xk

    m_in = offs_m < T
    n_in = offs_n < N
    if HAS_LORA:
        slots = tl.load(token_slots_ptr + offs_m, mask=m_in, other=-1)
        live = slots >= 0
        slots = tl.where(live, slots, 0)
        rank = tl.load(ranks_ptr + slots, mask=live, other=0)
        scale = tl.load(scalings_ptr + slots, mask=live, other=0.0)
        r_max = tl.max(rank, axis=0)  # the tile's largest rank: 0 for a base-only tile
        if r_max > 0:
            slots64 = slots.to(tl.int64)
            rows64 = tl.where(live, offs_m, 0).to(tl.int64)
            delta = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            n_first = pid_n * BLOCK_N
            n_last = n_first + BLOCK_N
            # A column tile may straddle slice boundaries: each slice it touches adds its own columns.
            if n_first < off1:
                delta = _slice_delta(
                    delta, stage_ptr, b_ptr, rows64, slots64, live, rank, r_max, offs_n, 0, off1, 0, max_rank,
                    stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br, SPLIT, RANK_UNROLL,
                )  # fmt: skip
            if NUM_SLICES > 1:  # noqa: SIM102 (compile-time: no code for absent slices)
                if (n_last > off1) & (n_first < off2):
                    delta = _slice_delta(
                        delta, stage_ptr, b_ptr, rows64, slots64, live, rank, r_max, offs_n, off1, off2, 1,
                        max_rank, stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br, SPLIT,
                        RANK_UNROLL,
                    )  # fmt: skip
            if NUM_SLICES > 2:  # noqa: SIM102
                if n_last > off2:
                    delta = _slice_delta(
                        delta, stage_ptr, b_ptr, rows64, slots64, live, rank, r_max, offs_n, off2, N, 2,
                        max_rank, stride_ss, stride_sm, stride_sr, stride_bs, stride_bn, stride_br, SPLIT,
                        RANK_UNROLL,
                    )  # fmt: skip
            acc += delta * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_in, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_in[None, :] & n_in[:, None])


def _check_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None
) -> torch.Tensor:
    """Validate the base GEMM's operands; returns ``out`` (allocated when None)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, in_features], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x has unsupported dtype {x.dtype}: use one of float16, bfloat16, float32")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"weight must be [out_features, {x.shape[1]}] (nn.Linear layout), got {tuple(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} != x dtype {x.dtype}")
    n = weight.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"bias must be [{n}], got shape {tuple(bias.shape)}")
    if out is None:
        return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if out.shape != (x.shape[0], n):
        raise ValueError(f"out must be [{x.shape[0]}, {n}], got shape {tuple(out.shape)}")
    if out.dtype != x.dtype:
        raise ValueError(f"out dtype {out.dtype} != x dtype {x.dtype}")
    return out


def _launch(x, weight, bias, out, config: GemmConfig, lora) -> None:
    T, K = x.shape
    N = weight.shape[0]
    if T == 0 or N == 0:
        return
    if lora is None:
        # Never read (HAS_LORA=False): any pointers and strides will do.
        stage, B, slots, ranks, scalings = x, x, x, x, x
        max_rank, off1, off2, split, unroll, num_slices = 0, N, N, 1, 1, 1
        stage_strides, b_strides = (0, 0, 0), (0, 0, 0)
    else:
        stage, B, info, slice_offsets = lora
        slots, ranks, scalings = info.token_slots, info.lora_ranks, info.scalings
        max_rank = B.shape[2]
        num_slices = len(slice_offsets) - 1
        offs = [*slice_offsets[1:-1], N, N]
        off1, off2 = offs[0], offs[1]
        if stage.dim() == 2:
            split, stage_strides = 1, (0, stage.stride(0), stage.stride(1))
        else:
            split, stage_strides = stage.shape[0], stage.stride()
        unroll = min(MAX_RANK_UNROLL, next_pow2(max_rank))
        b_strides = B.stride()
    grid = (triton.cdiv(T, config.block_m) * triton.cdiv(N, config.block_n),)
    _gemm_expand_kernel[grid](
        x, weight, bias if bias is not None else x, out, stage, B, slots, ranks, scalings,
        T, N, K, max_rank, off1, off2,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        *stage_strides, *b_strides,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        NUM_SLICES=num_slices,
        SPLIT=split,
        RANK_UNROLL=unroll,
        EVEN_K=K % config.block_k == 0,
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot(x.dtype),
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip


def gemm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weightᵀ (+ bias)`` through the same kernel with no LoRA epilogue (benchmarks vs cuBLAS).

    ``x`` ``[T, K]`` and ``weight`` ``[N, K]`` (any strides, one dtype); returns ``out``
    ``[T, N]`` in x's dtype (written in place when given), accumulated in float32.
    """
    out = _check_linear(x, weight, bias, out)
    check_triton_device(tuple(t for t in (x, weight, bias, out) if t is not None), "GEMM")
    _launch(x, weight, bias, out, config, None)
    return out


def launch_gemm_expand(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stage: torch.Tensor,
    B: torch.Tensor,
    info: LoRABatchInfo,
    slice_offsets: tuple[int, ...],
    config: GemmConfig,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The base layer and its LoRA delta in one launch; returns ``out`` ``[T, N]`` in x's dtype.

    ``out[t, n] = x[t] · weight[n] (+ bias[n]) + scalings[slot] · Σ_r xa[t, s·R + r] · B[slot, n, r]``
    with ``slot = info.token_slots[t]`` (rows of slot -1 get the base output alone),
    ``r < lora_ranks[slot]``, ``s`` the slice of column ``n`` in ``slice_offsets`` (1 to 3
    slices covering ``N``) and ``R = B.shape[2]``.

    ``stage`` is :meth:`TritonLoRABackend.shrink_stage`'s float32 partial sums
    ``[split, T, slices*R]`` (``xa`` is their sum) or ``xa`` itself ``[T, slices*R]``;
    rows of slot -1 and columns past a slot's rank are never read. ``B`` is
    ``[slots, N, R]`` with any strides (rank-major ``B_phys.transpose(1, 2)`` included).
    Reads only device tensors of ``info`` and host shapes: safe inside a CUDA-graph capture.
    """
    slice_offsets = tuple(int(o) for o in slice_offsets)
    out = _check_linear(x, weight, bias, out)
    if stage.dim() not in (2, 3):
        raise ValueError(
            f"stage must be [split, T, slices*rank] partial sums or [T, slices*rank] xa, got {tuple(stage.shape)}"
        )
    if stage.dim() == 3 and stage.shape[0] < 1:
        raise ValueError("stage has no partial sums (split 0)")
    if slice_offsets and slice_offsets[-1] != weight.shape[0]:
        raise ValueError(
            f"slice_offsets {slice_offsets} must end at weight's {weight.shape[0]} output features"
        )
    max_rank = check_expand_shapes(tuple(stage.shape[-2:]), B, info, out, slice_offsets)
    if len(slice_offsets) - 1 > MAX_SLICES:
        raise ValueError(
            f"slice_offsets names {len(slice_offsets) - 1} slices; the GEMM epilogue takes 1 to {MAX_SLICES}"
        )
    if B.dtype not in SUPPORTED_DTYPES or stage.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"B ({B.dtype}) and stage ({stage.dtype}) must be float16, bfloat16 or float32")
    if len(info.lora_ranks_cpu) > B.shape[0]:
        raise ValueError(
            f"the batch info describes {len(info.lora_ranks_cpu)} slots but B holds {B.shape[0]}"
        )
    for slot, rank in enumerate(info.lora_ranks_cpu):
        if rank > max_rank:
            raise ValueError(f"slot {slot} has rank {rank} but B's max_rank is {max_rank}")
    if info.token_slots.numel() < x.shape[0]:
        raise ValueError(f"info.token_slots has {info.token_slots.numel()} rows, x has {x.shape[0]}")
    tensors = [x, weight, out, stage, B, info.token_slots, info.lora_ranks, info.scalings]
    check_triton_device((*tensors, *([bias] if bias is not None else [])), "GEMM")
    _launch(x, weight, bias, out, config, (stage, B, info, slice_offsets))
    return out
