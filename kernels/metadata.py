"""Batch metadata that drives the LoRA ops, built on the host from per-request facts.

The runtime describes a forward batch by, per request, the adapter slot it uses (-1 for
the base model) and how many token rows it contributes; this module turns that into the
segment layout the kernels read. Token counts for every forward mode come from one
function, :func:`token_counts`, so decode, target-verify and extend can never disagree on
how many rows a batch has.

Row grouping: in decode and target-verify every request carries the same number of rows,
so requests that share an adapter are gathered into one segment through a permutation
(sorted by slot). A tile then carries rows of one adapter instead of one request. Extend
segments stay one per request (their lengths differ and rows are contiguous).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ForwardMode(enum.Enum):
    """The batch shapes the target model runs."""

    EXTEND = "extend"  # prefill / chunked prefill: ragged per-request lengths
    DECODE = "decode"  # one token per request
    TARGET_VERIFY = "target_verify"  # exactly k draft tokens per request


def token_counts(
    mode: ForwardMode,
    batch_size: int,
    *,
    extend_lens: Sequence[int] | None = None,
    num_draft_tokens: int | None = None,
) -> tuple[int, int]:
    """Return ``(total token rows, max rows per request)`` for a batch.

    decode: ``(bs, 1)``; target-verify: ``(bs * k, k)``; extend: ``(sum, max)`` of the
    host-side extend lengths. Target-verify has no extend lengths: they are never read
    there, so a stale list from an earlier extend cannot leak into the layout.
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if mode is ForwardMode.DECODE:
        return batch_size, 1 if batch_size else 0
    if mode is ForwardMode.TARGET_VERIFY:
        if num_draft_tokens is None or num_draft_tokens < 1:
            raise ValueError(f"target-verify needs num_draft_tokens >= 1, got {num_draft_tokens}")
        return batch_size * num_draft_tokens, num_draft_tokens if batch_size else 0
    if mode is ForwardMode.EXTEND:
        if extend_lens is None:
            raise ValueError("extend needs the host-side extend_lens")
        if len(extend_lens) != batch_size:
            raise ValueError(f"extend_lens has {len(extend_lens)} entries for batch_size {batch_size}")
        lens = [int(n) for n in extend_lens]
        if any(n < 0 for n in lens):
            raise ValueError(f"extend_lens must be >= 0, got {lens}")
        return sum(lens), max(lens, default=0)
    raise ValueError(f"unknown forward mode {mode!r}")


@dataclass
class LoRABatchInfo:
    """Segment layout of one batch, on the device the kernels run on.

    Rows of segment ``s`` are ``rows[seg_indptr[s]:seg_indptr[s+1]]`` where ``rows`` is
    ``permutation`` when set, else the identity. Segment ``s`` uses adapter slot
    ``weight_indices[s]`` (-1: base model, no LoRA work). ``lora_ranks`` and ``scalings``
    are indexed by slot; a slot of rank 0 costs nothing.
    """

    mode: ForwardMode
    batch_size: int
    total_tokens: int
    max_tokens_per_request: int
    num_segments: int
    max_segment_len: int
    seg_indptr: torch.Tensor  # int32 [num_segments + 1]
    seg_lens: torch.Tensor  # int32 [num_segments]
    weight_indices: torch.Tensor  # int32 [num_segments]
    permutation: torch.Tensor | None  # int32 [total_tokens] or None (identity)
    token_slots: torch.Tensor  # int32 [total_tokens]: slot per row in original order
    lora_ranks: torch.Tensor  # int32 [num_slots]
    scalings: torch.Tensor  # float32 [num_slots]
    # Host copies, for the torch reference path and for tests (no device sync needed).
    seg_indptr_cpu: list[int]
    weight_indices_cpu: list[int]
    permutation_cpu: list[int] | None
    lora_ranks_cpu: list[int]

    def rows(self, segment: int) -> list[int]:
        """Row indices (into the batch's token rows) of one segment, host side."""
        start, end = self.seg_indptr_cpu[segment], self.seg_indptr_cpu[segment + 1]
        if self.permutation_cpu is None:
            return list(range(start, end))
        return self.permutation_cpu[start:end]


def _to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(list(values), dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def build_batch_info(
    mode: ForwardMode,
    slots: Sequence[int],
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    *,
    extend_lens: Sequence[int] | None = None,
    num_draft_tokens: int | None = None,
    group_by_slot: bool = True,
    device: torch.device | str = "cpu",
) -> LoRABatchInfo:
    """Build the segment layout for one batch.

    ``slots[i]`` is request i's adapter slot (-1: base model); ``lora_ranks`` and
    ``scalings`` describe every slot of the pool. For decode and target-verify with
    ``group_by_slot`` the requests are sorted by slot (stable) and each run of one slot
    becomes one segment; otherwise each request is its own segment.
    """
    device = torch.device(device)
    bs = len(slots)
    num_slots = len(lora_ranks)
    for i, slot in enumerate(slots):
        if slot < -1 or slot >= num_slots:
            raise ValueError(f"request {i} names slot {slot}, but the pool has {num_slots} slots")
    if len(scalings) != num_slots:
        raise ValueError(f"{len(scalings)} scalings for {num_slots} slots")
    total, max_len = token_counts(mode, bs, extend_lens=extend_lens, num_draft_tokens=num_draft_tokens)
    if mode is ForwardMode.EXTEND:
        per_request = [int(n) for n in extend_lens]  # type: ignore[union-attr]
    else:
        per_request = [max_len] * bs

    token_slots: list[int] = []
    for slot, n in zip(slots, per_request):
        token_slots.extend([slot] * n)

    indptr = [0]
    weights: list[int] = []
    permutation: list[int] | None = None
    if mode is not ForwardMode.EXTEND and group_by_slot and bs > 0:
        width = max_len
        order = sorted(range(bs), key=lambda i: slots[i])
        permutation = []
        for i in order:
            if weights and weights[-1] == slots[i]:
                indptr[-1] += width
            else:
                weights.append(slots[i])
                indptr.append(indptr[-1] + width)
            permutation.extend(range(i * width, (i + 1) * width))
    else:
        for slot, n in zip(slots, per_request):
            if n == 0:
                continue  # empty extend segments carry no rows
            weights.append(slot)
            indptr.append(indptr[-1] + n)
    seg_lens = [b - a for a, b in zip(indptr, indptr[1:])]
    return LoRABatchInfo(
        mode=mode,
        batch_size=bs,
        total_tokens=total,
        max_tokens_per_request=max_len,
        num_segments=len(weights),
        max_segment_len=max(seg_lens, default=0),
        seg_indptr=_to_device(indptr, torch.int32, device),
        seg_lens=_to_device(seg_lens, torch.int32, device),
        weight_indices=_to_device(weights, torch.int32, device),
        permutation=None if permutation is None else _to_device(permutation, torch.int32, device),
        token_slots=_to_device(token_slots, torch.int32, device),
        lora_ranks=_to_device(lora_ranks, torch.int32, device),
        scalings=_to_device(scalings, torch.float32, device),
        seg_indptr_cpu=indptr,
        weight_indices_cpu=weights,
        permutation_cpu=permutation,
        lora_ranks_cpu=[int(r) for r in lora_ranks],
    )
