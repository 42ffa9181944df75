"""Attention of uniform batches (decode, target-verify) straight from the paged KV cache.

The default attention (:mod:`.attention`) gathers every request's whole context into a
padded block for each layer, a copy that grows with the context, before SDPA reads it
again. Here a Triton kernel reads each key and value once, in place, through the token
table: the work follows the requests' real lengths (read on the device), not a padded
bucket, and nothing is copied.

Flash-decoding: the context of a (request, KV head) pair is cut into ``splits`` ranges,
one program each, so a batch of one still fills the GPU. A program holds every query row
that shares its KV head (``groups`` heads × ``width`` verify positions), runs an online
softmax over its range and writes a normalised partial output and its log-sum-exp; a
second kernel weighs the partials by their sums. Scores may be soft-capped first
(``softcap * tanh(s / softcap)``, Gemma 2). Masking is causal by position (query
``j`` of a request sits at ``prefix + j``), with an optional sliding window; for a draft
tree's verify (``tree_ancestors``), query ``j`` sees the whole prefix and, of the block's
own keys, its ancestors and itself.

Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (tests compare it with the SDPA
path).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # keys per step of a program's loop
MAX_SPLITS = 64
# Query rows one program holds (KV-head group × new tokens per request). The kernel keeps
# them all in registers; a single-request prefill captured as a "uniform" batch of 512
# tokens would need 2048 (Llama-3-8B's group of 4), which ptxas takes minutes to compile
# and which spills. Wider batches take the SDPA path (:func:`fits`).
MAX_QUERY_ROWS = 128
_INTERPRETER_SMS = 2


@dataclass
class PagedAttentionInputs:
    """Where a uniform batch's keys live: shared by every layer of one forward.

    ``req_to_token`` is the cache's token table (``[rows, max_context]`` slot ids),
    ``rows`` each request's row in it, ``prefix_lens`` the tokens cached before this
    batch (device tensors: a CUDA graph replays with new values). ``width`` new tokens
    per request follow the prefix. ``max_context``: a host bound on every request's
    context (the graphs' context bucket), which sets how many ranges a context is cut
    into; the kernel reads the real lengths on the device.
    """

    req_to_token: torch.Tensor
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    width: int
    max_context: int
    sliding_window: int | None = None
    # bool [bs, width, width]: a draft tree's verify; [b, j, i]: node j sees node i
    tree_ancestors: torch.Tensor | None = None


def fits(groups: int, width: int) -> bool:
    """Whether a uniform batch of ``width`` new tokens per request, ``groups`` query heads
    per KV head, fits one program's query rows (decode, verify and draft trees do)."""
    return groups * width <= MAX_QUERY_ROWS


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_splits(batch_size: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Context ranges per (request, KV head): enough programs for about two waves over the
    SMs, never a range shorter than one key block."""
    if device.type == "cuda":
        sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = _INTERPRETER_SMS
    wanted = -(-2 * sms // max(1, batch_size * num_kv_heads))
    return max(1, min(wanted, -(-max_context // BLOCK_N), MAX_SPLITS))


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    prefix_ptr,
    part_o_ptr,
    part_lse_ptr,
    anc_ptr,
    scale,
    softcap,
    window,
    table_width,
    head_dim,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    WIDTH: tl.constexpr,
    GROUPS: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TREE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    prefix = tl.load(prefix_ptr + b).to(tl.int32)
    seq_len = tl.minimum(prefix + WIDTH, table_width)

    # Query rows of this KV head: m = group * WIDTH + position in the verify block.
    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < GROUPS * WIDTH
    head = kvh * GROUPS + offs_m // WIDTH
    pos = offs_m % WIDTH
    tok = (b * WIDTH + pos).to(tl.int64)
    q_pos = prefix + pos
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
        mask=m_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # This split's keys: whole blocks, the last split short.
    per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), SPLITS) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    if HAS_WINDOW:
        # No query of this request sees a key at or before prefix - window.
        first = tl.maximum(prefix - window + 1, 0)
        lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    kv_head = kvh.to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(table_ptr + row * stride_table + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_SOFTCAP:
            # c * tanh(s / c), before the mask, from exp(-2|s| / c) <= 1: no overflow.
            e = tl.exp(-2.0 * tl.abs(s) / softcap)
            th = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(s < 0, -th, th)
        if TREE:
            # The block's keys sit at prefix + node; a node sees its ancestors among them.
            node = offs_n - prefix
            in_block = n_mask & (node >= 0)
            seen = tl.load(
                anc_ptr + (b * WIDTH + pos[:, None]) * WIDTH + node[None, :],
                mask=m_valid[:, None] & in_block[None, :],
                other=0,
            )
            allowed = n_mask[None, :] & ((offs_n[None, :] < prefix) | (seen != 0))
        else:
            allowed = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new

    # Partials [tokens, heads, SPLITS, D] and [tokens, heads, SPLITS]; rows that saw no
    # key here get zeros and -inf, which the combine weighs as nothing.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    flat = tok * (num_kv_heads * GROUPS) + head
    tl.store(
        part_o_ptr + (flat[:, None] * SPLITS + split) * head_dim + offs_d[None, :],
        out,
        mask=m_valid[:, None] & d_mask[None, :],
    )
    tl.store(part_lse_ptr + flat * SPLITS + split, lse, mask=m_valid)


@triton.jit
def _combine_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    head_dim,
    stride_ot,
    stride_oh,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    flat = tok * tl.num_programs(1) + head
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    lse = tl.load(part_lse_ptr + flat * SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top)
    parts = tl.load(
        part_o_ptr + (flat * SPLITS + offs_s[:, None]) * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: PagedAttentionInputs,
    *,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (``[bs * width, heads, head_dim]``) over each request's cached
    keys, its new ones included (already written to the cache). Returns ``[bs * width,
    heads * head_dim]`` in ``q``'s dtype. ``softcap`` (None or 0: off): the scaled scores
    become ``softcap * tanh(s / softcap)`` before the mask (Gemma 2)."""
    tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, cache_dim = k_cache.shape
    width = inputs.width
    bs = inputs.rows.shape[0]
    if tokens != bs * width:
        raise ValueError(f"q has {tokens} rows but {bs} requests × width {width} = {bs * width}")
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"q [{tokens}, {num_heads}, {head_dim}] does not fit a cache of {num_kv_heads} KV heads × {cache_dim}"
        )
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head dimension")
    groups = num_heads // num_kv_heads
    if not fits(groups, width):
        raise ValueError(
            f"{groups} query heads per KV head × width {width} = {groups * width} query rows exceed the paged "
            f"kernel's {MAX_QUERY_ROWS}: such batches (prefill) take the SDPA path"
        )
    splits = choose_splits(bs, num_kv_heads, inputs.max_context, q.device)
    out = torch.empty(tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    part_o = torch.empty(tokens * num_heads * splits * head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(tokens * num_heads * splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    table = inputs.req_to_token
    window = inputs.sliding_window
    ancestors = inputs.tree_ancestors
    if ancestors is not None:
        if window is not None:
            raise ValueError("a tree verify with a sliding window takes the SDPA path")
        if ancestors.shape != (bs, width, width):
            raise ValueError(f"tree_ancestors {tuple(ancestors.shape)} is not [{bs}, {width}, {width}]")
        ancestors = ancestors.contiguous()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _split_kernel[(bs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        table,
        inputs.rows,
        inputs.prefix_lens,
        part_o,
        part_lse,
        part_lse if ancestors is None else ancestors,  # any pointer when TREE is off
        float(scale),
        float(softcap or 0.0),
        int(window or 0),
        table.shape[1],
        head_dim,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        WIDTH=width,
        GROUPS=groups,
        SPLITS=splits,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=bool(softcap),
        TREE=ancestors is not None,
        # The interpreter's dot reads bf16 as raw integers, and fp32 caches want exact dots.
        UPCAST=interpreted or q.dtype == torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_M=max(16, triton.next_power_of_2(groups * width)),
        BLOCK_N=BLOCK_N,
        BLOCK_D=block_d,
        num_warps=4,
        num_stages=2,
    )
    _combine_kernel[(tokens, num_heads)](
        part_o,
        part_lse,
        out,
        head_dim,
        out.stride(0),
        head_dim,
        SPLITS=splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2,
    )
    return out
