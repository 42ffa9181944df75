"""Token -> expert routing metadata for the grouped expert GEMMs, built on the device.

A batch of ``T`` token rows routed to ``top_k`` experts each has ``P = T * top_k`` (row,
expert) *pairs*; pair ``p`` is row ``p // top_k``'s ``p % top_k``-th choice. The grouped
GEMM runs one program per block of ``block`` pairs of one *group* (an expert; for the LoRA
deltas an (expert, adapter slot) pair), so the pairs are sorted by group and each group's
run is padded up to a multiple of ``block`` (the layout of vLLM's ``moe_align_block_size``):

- ``sorted_pairs`` (int32 ``[capacity]``): pair ids in group order, ``P`` in padding;
- ``block_groups`` (int32 ``[capacity // block]``): each block's group, -1 past the end.

:func:`align_block_size` is the torch definition: fixed shapes, no host sync (a scatter-add
count, a stable sort, cumulative sums, a binary search); the fused path builds the same
runs in two Triton launches (:mod:`.align`). The shapes depend
only on the pair count, the group count and the block: :func:`capacity` bounds the padded
length by ``P + min(G, P) * (block - 1)`` (at most ``min(G, P)`` groups are non-empty,
each padding fewer than ``block`` slots). Under CUDA graphs the buffers are sized for the
most token rows a captured batch feeds (:class:`RoutingBuffers`), never for requests: a
target-verify replay feeds ``bs * (draft tokens + 1)`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..forward_mode import ForwardMode, token_counts

BLOCK_CHOICES: tuple[int, ...] = (16, 32, 64)
"""Pair-block heights the grouped GEMMs are built for (``tl.dot`` needs at least 16)."""

LORA_BLOCK = 16
"""Block height of the LoRA shrink/expand: (expert, slot) groups are small."""


def capacity(num_pairs: int, num_groups: int, block: int) -> int:
    """Padded length of ``sorted_pairs`` (a multiple of ``block``) for any routing of
    ``num_pairs`` pairs over ``num_groups`` groups."""
    if num_pairs <= 0 or num_groups <= 0:
        return 0
    bound = num_pairs + min(num_groups, num_pairs) * (block - 1)
    return -(-bound // block) * block


def block_for(num_pairs: int, num_experts: int) -> int:
    """The base GEMMs' block height: the smallest choice that holds an expert's mean share."""
    mean = -(-num_pairs // max(num_experts, 1))
    return next((b for b in BLOCK_CHOICES if mean <= b), BLOCK_CHOICES[-1])


@dataclass
class BlockLayout:
    """Pairs sorted by group and padded to ``block``; see the module docstring."""

    sorted_pairs: torch.Tensor  # int32 [capacity]: pair ids, num_pairs = padding
    block_groups: torch.Tensor  # int32 [capacity // block]: group per block, -1 = none
    block: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_groups.numel()


class RoutingBuffers:
    """Persistent int32 buffers for :func:`align_block_size`, sized for ``max_pairs`` pairs.

    Under CUDA graphs every replay writes the same storage, so a captured launch reads a
    fixed address. ``max_pairs`` counts (token row, expert) pairs: the rows are the most
    token rows one forward feeds (``max_bs`` for decode, ``max_bs * width`` for a verify of
    ``width`` rows per request), times ``top_k``.
    """

    def __init__(self, max_pairs: int, num_groups: int, block: int, device: torch.device | str):
        if max_pairs < 1 or num_groups < 1:
            raise ValueError(f"max_pairs and num_groups must be >= 1, got {max_pairs} and {num_groups}")
        if block not in BLOCK_CHOICES:
            raise ValueError(f"block must be one of {BLOCK_CHOICES}, got {block}")
        self.max_pairs, self.num_groups, self.block = int(max_pairs), int(num_groups), int(block)
        # The most entries and the most blocks over every block height up to ``block``
        # (a smaller block pads less but cuts more blocks).
        caps = [(capacity(self.max_pairs, self.num_groups, b), b) for b in BLOCK_CHOICES if b <= self.block]
        # one spare entry past the end: the scatter target of pairs that join no group
        self._pairs = torch.empty(max(c for c, _ in caps) + 1, dtype=torch.int32, device=device)
        self._groups = torch.empty(max(c // b for c, b in caps), dtype=torch.int32, device=device)
        self.cursor = torch.empty(self.num_groups, dtype=torch.int32, device=device)  # the Triton layout's

    def views(self, num_pairs: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pairs [capacity + 1], block groups)`` for ``num_pairs`` pairs at ``block``."""
        if num_pairs > self.max_pairs:
            raise ValueError(
                f"{num_pairs} (token row, expert) pairs do not fit routing buffers sized for {self.max_pairs}: "
                "size them for the most token rows a forward feeds (max_bs x rows per request) times top_k"
            )
        if block > self.block:
            raise ValueError(f"block {block} is larger than the buffers' {self.block}")
        cap = capacity(num_pairs, self.num_groups, block)
        return self._pairs[: cap + 1], self._groups[: cap // block]


def align_block_size(
    groups: torch.Tensor, num_groups: int, block: int, buffers: RoutingBuffers | None = None
) -> BlockLayout:
    """Sort the pairs by ``groups`` (int ``[P]``, -1: the pair joins no group) and pad every
    group's run to a multiple of ``block``; written into ``buffers`` when given."""
    num_pairs = groups.numel()
    device = groups.device
    cap = capacity(num_pairs, num_groups, block)
    if buffers is None:
        pairs_out = torch.empty(cap + 1, dtype=torch.int32, device=device)
        groups_out = torch.empty(cap // block, dtype=torch.int32, device=device)
    else:
        if buffers.num_groups != num_groups:
            raise ValueError(f"routing buffers hold {buffers.num_groups} groups, the batch {num_groups}")
        pairs_out, groups_out = buffers.views(num_pairs, block)
    if cap == 0:
        groups_out.fill_(-1)
        return BlockLayout(pairs_out[:0], groups_out, block, num_pairs)

    key = groups.reshape(-1).long()
    key = torch.where(key >= 0, key, num_groups)  # no group: sorts last, counted apart
    counts = torch.zeros(num_groups + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_groups]
    padded = (counts + block - 1) // block * block
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts

    sorted_key, order = torch.sort(key, stable=True)
    live = sorted_key < num_groups
    g = sorted_key.clamp(max=num_groups - 1)
    rank_in_group = torch.arange(num_pairs, device=device) - start[g]
    dest = torch.where(live, padded_start[g] + rank_in_group, cap)
    pairs_out.fill_(num_pairs)
    pairs_out.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(0, cap, block, device=device)
    owner = torch.searchsorted(padded_end, block_start, right=True)
    groups_out.copy_(torch.where(block_start < padded_end[-1], owner, -1))
    return BlockLayout(pairs_out[:cap], groups_out, block, num_pairs)


def lora_groups(
    expert_ids: torch.Tensor, token_slots: torch.Tensor, live_ranks: torch.Tensor, num_slots: int
) -> torch.Tensor:
    """Each pair's LoRA group ``expert * num_slots + slot``; -1 for rows of the base model
    (slot -1) or of a slot whose adapter has no LoRA on these experts (rank 0)."""
    top_k = expert_ids.shape[1]
    slots = token_slots.long().repeat_interleave(top_k)
    safe = slots.clamp(min=0)
    live = (slots >= 0) & (live_ranks.index_select(0, safe) > 0)
    return torch.where(live, expert_ids.reshape(-1).long() * num_slots + safe, -1)


class MoEBuffers:
    """The routing buffers of one model's MoE layers (shared: the layers run one after
    another), sized for ``max_tokens`` token rows; see :class:`.routing.RoutingBuffers`."""

    def __init__(self, max_tokens: int, top_k: int, num_experts: int, num_slots: int, device: torch.device | str):
        max_pairs = max_tokens * top_k
        self.max_tokens = int(max_tokens)
        self.base = RoutingBuffers(max_pairs, num_experts, BLOCK_CHOICES[-1], device)
        self.lora = RoutingBuffers(max_pairs, num_experts * num_slots, LORA_BLOCK, device) if num_slots else None

    @classmethod
    def for_graph(
        cls, mode: ForwardMode, max_bs: int, width: int, *, top_k: int, num_experts: int, num_slots: int,
        device: torch.device | str,
    ) -> MoEBuffers:  # fmt: skip
        """The buffers of a CUDA graph of ``mode`` for ``max_bs`` requests of ``width`` rows
        each (1 for decode; target-verify's draft tokens; an extend's padded length), sized
        in the token rows :func:`~..forward_mode.token_counts` gives that batch."""
        lens = [width] * max_bs if mode is ForwardMode.EXTEND else None
        draft = width if mode is ForwardMode.TARGET_VERIFY else None
        tokens, _ = token_counts(mode, max_bs, extend_lens=lens, num_draft_tokens=draft)
        return cls(tokens, top_k, num_experts, num_slots, device)
