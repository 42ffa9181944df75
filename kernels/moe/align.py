"""The routing layout of :mod:`.routing` in two Triton launches instead of ~30 torch ops.

Each pair's group is computed in the kernels from the expert ids (and, for the LoRA
layout, the row's slot and that slot's rank on the experts), so the LoRA grouping costs no
launch of its own either:

1. one program: a histogram of the groups, each group's padded start (a cumulative sum)
   into ``cursor``, ``sorted_pairs`` filled with the padding id and ``block_groups`` with
   each block's group (-1 past the end);
2. one program per chunk of pairs: each live pair takes the next free entry of its group
   with an atomic add on ``cursor`` and writes its id there.

The entries a group's pairs take are the same as :func:`.routing.align_block_size`'s; only
their order inside the group differs (atomics), which no result depends on: the grouped
GEMMs compute every pair's row on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .routing import BlockLayout, RoutingBuffers, capacity

BLOCK_P = 1024


@triton.jit
def _group_of(ids_ptr, slots_ptr, ranks_ptr, offs, mask, top_k, num_slots, LORA: tl.constexpr):
    """Pair ``offs``'s group: its expert, or (expert, slot) for the LoRA layout; -1 for none."""
    expert = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    if LORA:
        slot = tl.load(slots_ptr + offs // top_k, mask=mask, other=-1).to(tl.int32)
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0), mask=mask & (slot >= 0), other=0)
        return tl.where(mask & (slot >= 0) & (rank > 0), expert * num_slots + slot, -1)
    return tl.where(mask, expert, -1)


@triton.jit
def _align_count_kernel(
    ids_ptr, slots_ptr, ranks_ptr, cursor_ptr, pairs_ptr, groups_ptr,
    num_pairs, num_groups, top_k, num_slots, cap, num_blocks,
    LORA: tl.constexpr, BLOCK: tl.constexpr, G_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    counts = tl.zeros((G_BLOCK,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        group = _group_of(ids_ptr, slots_ptr, ranks_ptr, offs, offs < num_pairs, top_k, num_slots, LORA)
        counts += tl.histogram(tl.maximum(group, 0), G_BLOCK, mask=group >= 0)
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    first = tl.cumsum(padded, 0) - padded
    g = tl.arange(0, G_BLOCK)
    tl.store(cursor_ptr + g, first, mask=g < num_groups)
    for start in range(0, cap, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        tl.store(pairs_ptr + offs, tl.zeros((BLOCK_P,), dtype=tl.int32) + num_pairs, mask=offs < cap)
    for start in range(0, num_blocks, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        tl.store(groups_ptr + offs, tl.full((BLOCK_P,), -1, dtype=tl.int32), mask=offs < num_blocks)
    tl.debug_barrier()  # the fill above lands before the groups' blocks overwrite it
    blocks = padded // BLOCK
    first_block = first // BLOCK
    for j in range(0, tl.max(blocks, 0)):
        tl.store(groups_ptr + first_block + j, g, mask=(j < blocks) & (g < num_groups))


@triton.jit
def _align_scatter_kernel(
    ids_ptr, slots_ptr, ranks_ptr, cursor_ptr, pairs_ptr, num_pairs, top_k, num_slots,
    LORA: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    group = _group_of(ids_ptr, slots_ptr, ranks_ptr, offs, offs < num_pairs, top_k, num_slots, LORA)
    live = group >= 0
    entry = tl.atomic_add(cursor_ptr + tl.maximum(group, 0), 1, mask=live)
    tl.store(pairs_ptr + entry, offs, mask=live)


def align(
    ids: torch.Tensor,
    num_groups: int,
    block: int,
    buffers: RoutingBuffers | None = None,
    *,
    token_slots: torch.Tensor | None = None,
    ranks: torch.Tensor | None = None,
    num_slots: int = 0,
) -> BlockLayout:
    """The layout of the pairs of ``ids [T, top_k]`` by expert, or with ``token_slots`` /
    ``ranks`` (the LoRA layout) by (expert, slot) over ``num_groups = experts * num_slots``."""
    ids = ids.contiguous()
    top_k = ids.shape[1]
    num_pairs = ids.numel()
    cap = capacity(num_pairs, num_groups, block)
    if buffers is None:
        pairs = torch.empty(cap, dtype=torch.int32, device=ids.device)
        groups = torch.empty(cap // block, dtype=torch.int32, device=ids.device)
        cursor = torch.empty(num_groups, dtype=torch.int32, device=ids.device)
    else:
        pairs, groups = buffers.views(num_pairs, block)
        pairs, cursor = pairs[:cap], buffers.cursor
    if cap == 0:
        return BlockLayout(pairs, groups, block, num_pairs)
    lora = token_slots is not None
    slots = token_slots if lora else ids
    live_ranks = ranks if lora else ids
    g_block = triton.next_power_of_2(num_groups)
    _align_count_kernel[(1,)](
        ids, slots, live_ranks, cursor, pairs, groups, num_pairs, num_groups, top_k, max(num_slots, 1), cap,
        groups.numel(), LORA=lora, BLOCK=block, G_BLOCK=g_block, BLOCK_P=BLOCK_P,
        num_warps=4 if g_block <= 1024 else 8,
    )  # fmt: skip
    _align_scatter_kernel[(triton.cdiv(num_pairs, BLOCK_P),)](
        ids, slots, live_ranks, cursor, pairs, num_pairs, top_k, max(num_slots, 1), LORA=lora, BLOCK_P=BLOCK_P,
    )  # fmt: skip
    return BlockLayout(pairs, groups, block, num_pairs)
