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

Tiles: the kernels launch one program per *tile* of at most ``tile_m`` rows of one
segment. A tile's program reads one row of the tile table (slot, rank, scaling) and its
own ``tile_m`` row indices (``-1`` past the segment's end), both addressed by the program
id alone, so every metadata load is issued at once instead of as a chain. Segments of
the base model or of a rank-0 slot get no tile at all, so they cost no program. Under
CUDA graphs the table has a fixed capacity and unused entries carry slot -1 (see
:mod:`.graph_metadata`).

Every device tensor of one batch is a view into one int32 buffer, filled on the host and
sent with a single pinned, non-blocking copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .forward_mode import ForwardMode, token_counts

TILE_M_CHOICES: tuple[int, ...] = (16, 32, 64)
"""Row-tile heights the kernels are built for (``tl.dot`` needs at least 16)."""

_ALIGN = 4  # int32 entries: every section of the packed buffer starts 16-byte aligned


def default_tile_m(mode: ForwardMode, max_segment_len: int) -> int:
    """Row-tile height for a batch: 16 for decode/verify, the smallest fit for extend.

    Decode and verify keep 16 so a CUDA graph captured once serves every replay; extend
    grows the tile with its segments (fewer re-reads of each adapter's B) up to 64.
    """
    if mode is not ForwardMode.EXTEND:
        return TILE_M_CHOICES[0]
    for tile in TILE_M_CHOICES:
        if max_segment_len <= tile:
            return tile
    return TILE_M_CHOICES[-1]


def max_tiles(total_rows: int, num_segments: int, tile_m: int) -> int:
    """Upper bound on tiles for ``total_rows`` rows cut into at most ``num_segments`` segments.

    Each segment wastes at most one partial tile, and a tile holds at least one row.
    """
    if total_rows <= 0 or num_segments <= 0:
        return 0
    return min(total_rows, total_rows // tile_m + num_segments)


@dataclass
class LoRABatchInfo:
    """Segment layout of one batch, on the device the kernels run on.

    Rows of segment ``s`` are ``rows[seg_indptr[s]:seg_indptr[s+1]]`` where ``rows`` is
    ``permutation`` when set, else the identity. Segment ``s`` uses adapter slot
    ``weight_indices[s]`` (-1: base model, no LoRA work). ``lora_ranks`` and ``scalings``
    are indexed by slot; a slot of rank 0 costs nothing.

    ``tiles`` (int32 ``[num_tiles, 4]``) is what the Triton kernels launch over: per tile
    its slot (-1: nothing to do), that slot's rank, its scaling (float32 bits) and its
    segment; ``tile_rows`` (int32 ``[num_tiles, tile_m]``) the token rows it covers, -1
    past the end. ``num_tiles`` is the launch size: the exact count for an eager batch,
    the capacity for a CUDA-graph capture. ``live_tiles`` holds, on the device, how many
    leading entries of ``tiles`` carry work (all of them in an eager batch), so a kernel
    that loops over work items can stop at this batch's real work.
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
    tile_m: int = TILE_M_CHOICES[0]
    num_tiles: int = 0
    tiles: torch.Tensor | None = None  # int32 [num_tiles, 4]: slot, rank, scaling bits, segment
    tile_rows: torch.Tensor | None = None  # int32 [num_tiles, tile_m]: token rows, -1 = none
    graph_capture: bool = False  # True: host counts are capture maxima, not this batch's
    live_tiles: torch.Tensor | None = None  # int32 [1]: tiles with work; they come first in ``tiles``

    def rows(self, segment: int) -> list[int]:
        """Row indices (into the batch's token rows) of one segment, host side."""
        start, end = self.seg_indptr_cpu[segment], self.seg_indptr_cpu[segment + 1]
        if self.permutation_cpu is None:
            return list(range(start, end))
        return self.permutation_cpu[start:end]


@dataclass
class HostLayout:
    """The host-side description of one batch, before it is sent to the device."""

    total_tokens: int
    max_tokens_per_request: int
    seg_indptr: list[int]
    weight_indices: list[int]
    permutation: list[int] | None
    token_slots: list[int]
    tiles: list[tuple[int, int, int]]  # (segment, row start, row end): positions in the rows order

    @property
    def seg_lens(self) -> list[int]:
        return [b - a for a, b in itertools.pairwise(self.seg_indptr)]


def check_slots(slots: Sequence[int], lora_ranks: Sequence[int], scalings: Sequence[float]) -> None:
    """Reject slot ids outside the pool and rank/scaling lists of different lengths."""
    num_slots = len(lora_ranks)
    if len(scalings) != num_slots:
        raise ValueError(
            f"{len(scalings)} scalings for {num_slots} slots: pass one scaling per pool slot"
        )
    for slot, rank in enumerate(lora_ranks):
        if int(rank) < 0:
            raise ValueError(f"lora_ranks[{slot}] is {rank}: ranks must be >= 0")
    for i, slot in enumerate(slots):
        if slot < -1 or slot >= num_slots:
            raise ValueError(
                f"request {i} names slot {slot}, but the pool has {num_slots} slots (use -1 for the base model)"
            )


def host_layout(
    mode: ForwardMode,
    slots: Sequence[int],
    lora_ranks: Sequence[int],
    *,
    extend_lens: Sequence[int] | None = None,
    num_draft_tokens: int | None = None,
    group_by_slot: bool = True,
    tile_m: int = TILE_M_CHOICES[0],
) -> HostLayout:
    """Segments, permutation and tile table of one batch, as host lists (pure)."""
    bs = len(slots)
    total, max_len = token_counts(mode, bs, extend_lens=extend_lens, num_draft_tokens=num_draft_tokens)
    if mode is ForwardMode.EXTEND:
        per_request = [int(n) for n in extend_lens]  # type: ignore[union-attr]
    else:
        per_request = [max_len] * bs

    token_slots: list[int] = []
    for slot, n in zip(slots, per_request, strict=True):
        token_slots.extend([int(slot)] * n)

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
                weights.append(int(slots[i]))
                indptr.append(indptr[-1] + width)
            permutation.extend(range(i * width, (i + 1) * width))
    else:
        for slot, n in zip(slots, per_request, strict=True):
            if n == 0:
                continue  # empty extend segments carry no rows
            weights.append(int(slot))
            indptr.append(indptr[-1] + n)

    tiles = segment_tiles(indptr, weights, lora_ranks, tile_m)
    return HostLayout(total, max_len, indptr, weights, permutation, token_slots, tiles)


def segment_tiles(
    indptr: Sequence[int], weights: Sequence[int], lora_ranks: Sequence[int], tile_m: int
) -> list[tuple[int, int, int]]:
    """Cut every LoRA segment into tiles of at most ``tile_m`` rows (pure)."""
    tiles: list[tuple[int, int, int]] = []
    for seg, slot in enumerate(weights):
        if slot < 0 or int(lora_ranks[slot]) == 0:
            continue  # base-model and rank-0 segments cost no program
        start, end = indptr[seg], indptr[seg + 1]
        tiles.extend((seg, row, min(row + tile_m, end)) for row in range(start, end, tile_m))
    return tiles


def tile_tables(
    tiles: Sequence[tuple[int, int, int]],
    weights: Sequence[int],
    permutation: Sequence[int] | None,
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    tile_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' view of the tiles: ``[n, 4]`` (slot, rank, scaling bits, segment) and
    ``[n, tile_m]`` token rows (-1 past a segment's end), as int32 host tensors."""
    n = len(tiles)
    table = torch.zeros(n, 4, dtype=torch.int32)
    rows = torch.full((n, tile_m), -1, dtype=torch.int32)
    if n == 0:
        return table, rows
    segs = torch.tensor([t[0] for t in tiles], dtype=torch.long)
    slots = torch.tensor(list(weights), dtype=torch.long)[segs]
    table[:, 0] = slots.to(torch.int32)
    table[:, 1] = torch.tensor([int(r) for r in lora_ranks], dtype=torch.int32)[slots]
    table[:, 2] = torch.tensor([float(v) for v in scalings], dtype=torch.float32)[slots].view(torch.int32)
    table[:, 3] = segs.to(torch.int32)
    order = torch.tensor(list(permutation), dtype=torch.int32) if permutation is not None else None
    starts = torch.tensor([t[1] for t in tiles], dtype=torch.long)
    ends = torch.tensor([t[2] for t in tiles], dtype=torch.long)
    pos = starts[:, None] + torch.arange(tile_m)[None, :]
    valid = pos < ends[:, None]
    src = pos.clamp(max=max(int(ends.max()) - 1, 0))
    token_rows = order[src] if order is not None else src.to(torch.int32)
    rows[valid] = token_rows[valid].to(torch.int32)
    return table, rows


def pack_int32(sections: Sequence[Sequence[int] | torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Concatenate sections into one int32 host tensor, each section 16-byte aligned.

    Returns the tensor and each section's ``(offset, length)``. A float32 section is
    passed as a tensor and stored bit for bit.
    """
    parts: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for section in sections:
        if isinstance(section, torch.Tensor):
            part = section.reshape(-1).contiguous().view(torch.int32)
        else:
            part = torch.tensor(list(section), dtype=torch.int32)
        length = part.numel()
        pad = -length % _ALIGN
        if pad:
            part = torch.cat([part, torch.zeros(pad, dtype=torch.int32)])
        parts.append(part)
        spans.append((offset, length))
        offset += length + pad
    host = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
    return host, spans


def to_device_once(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy: pinned and non-blocking on CUDA, no copy at all on CPU."""
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
    tile_m: int | None = None,
) -> LoRABatchInfo:
    """Build the segment layout for one batch.

    ``slots[i]`` is request i's adapter slot (-1: base model); ``lora_ranks`` and
    ``scalings`` describe every slot of the pool. For decode and target-verify with
    ``group_by_slot`` the requests are sorted by slot (stable) and each run of one slot
    becomes one segment; otherwise each request is its own segment. ``tile_m`` (16, 32
    or 64) overrides the row-tile height :func:`default_tile_m` picks.
    """
    device = torch.device(device)
    check_slots(slots, lora_ranks, scalings)
    # Counts first: they raise the mode-specific errors (missing k, bad extend_lens).
    _, _ = token_counts(mode, len(slots), extend_lens=extend_lens, num_draft_tokens=num_draft_tokens)
    if mode is ForwardMode.EXTEND:
        longest = max((int(n) for n in extend_lens), default=0)  # type: ignore[union-attr]
    else:
        longest = len(slots) * (num_draft_tokens or 1)
    if tile_m is None:
        tile_m = default_tile_m(mode, longest)
    if tile_m not in TILE_M_CHOICES:
        raise ValueError(f"tile_m must be one of {TILE_M_CHOICES}, got {tile_m}")
    layout = host_layout(
        mode,
        slots,
        lora_ranks,
        extend_lens=extend_lens,
        num_draft_tokens=num_draft_tokens,
        group_by_slot=group_by_slot,
        tile_m=tile_m,
    )
    return info_from_layout(mode, len(slots), layout, lora_ranks, scalings, tile_m, device)


def info_from_layout(
    mode: ForwardMode,
    batch_size: int,
    layout: HostLayout,
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    tile_m: int,
    device: torch.device,
) -> LoRABatchInfo:
    """Send a host layout to ``device`` in one copy and wrap it as a :class:`LoRABatchInfo`."""
    num_tiles = len(layout.tiles)
    table, rows = tile_tables(
        layout.tiles, layout.weight_indices, layout.permutation, lora_ranks, scalings, tile_m
    )
    seg_lens = layout.seg_lens
    host, spans = pack_int32(
        [
            layout.seg_indptr,
            seg_lens,
            layout.weight_indices,
            layout.permutation or [],
            layout.token_slots,
            [int(r) for r in lora_ranks],
            torch.tensor(list(scalings), dtype=torch.float32),
            table,
            rows,
            [num_tiles],
        ]
    )
    buf = to_device_once(host, device)
    views = [buf[o : o + n] for o, n in spans]
    return LoRABatchInfo(
        mode=mode,
        batch_size=batch_size,
        total_tokens=layout.total_tokens,
        max_tokens_per_request=layout.max_tokens_per_request,
        num_segments=len(layout.weight_indices),
        max_segment_len=max(seg_lens, default=0),
        seg_indptr=views[0],
        seg_lens=views[1],
        weight_indices=views[2],
        permutation=None if layout.permutation is None else views[3],
        token_slots=views[4],
        lora_ranks=views[5],
        scalings=views[6].view(torch.float32),
        seg_indptr_cpu=layout.seg_indptr,
        weight_indices_cpu=layout.weight_indices,
        permutation_cpu=layout.permutation,
        lora_ranks_cpu=[int(r) for r in lora_ranks],
        tile_m=tile_m,
        num_tiles=num_tiles,
        tiles=views[7].view(num_tiles, 4),
        tile_rows=views[8].view(num_tiles, tile_m),
        live_tiles=views[9],
    )


def ensure_tiles(info: LoRABatchInfo, tile_m: int | None = None) -> LoRABatchInfo:
    """Return ``info`` with a tile table, building one from its host copies if it has none.

    For a :class:`LoRABatchInfo` assembled by hand (without :func:`build_batch_info`).
    """
    if info.tiles is not None and info.tile_rows is not None and (tile_m is None or tile_m == info.tile_m):
        if info.live_tiles is None:
            # A hand-built table: every entry counts; slot -1 entries stop at once.
            info.live_tiles = to_device_once(torch.tensor([info.num_tiles], dtype=torch.int32), info.tiles.device)
        return info
    tile_m = tile_m or default_tile_m(info.mode, info.max_segment_len)
    tiles = segment_tiles(info.seg_indptr_cpu, info.weight_indices_cpu, info.lora_ranks_cpu, tile_m)
    scalings = info.scalings.detach().cpu().tolist()
    table, rows = tile_tables(
        tiles, info.weight_indices_cpu, info.permutation_cpu, info.lora_ranks_cpu, scalings, tile_m
    )
    device = info.seg_indptr.device
    info.tiles = to_device_once(table, device)
    info.tile_rows = to_device_once(rows, device)
    info.tile_m = tile_m
    info.num_tiles = len(tiles)
    info.live_tiles = to_device_once(torch.tensor([len(tiles)], dtype=torch.int32), device)
    return info
