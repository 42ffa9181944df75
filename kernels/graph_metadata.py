"""LoRA batch metadata for CUDA-graph capture and replay.

A captured graph replays fixed kernel launches with fixed pointers, so the metadata they
read must live in buffers that never move, and the launch grids must be sized for the
largest batch the graph can see. :class:`GraphLoRAMetadata` preallocates one int32 buffer
on the device (plus a pinned host twin) for ``max_bs`` requests of ``width`` tokens each
(width 1 for decode, ``k`` for target-verify, ``extend_len`` for an extend padded to a
fixed length: buffers are sized in tokens, not requests). Every captured batch size gets
a :class:`LoRABatchInfo` whose tensors are views into that buffer and whose host counts
are the capture's maxima; :meth:`update` rewrites the buffer in place before each replay
with one non-blocking copy.

An extend graph sees a uniform layout: every request carries exactly ``extend_len``
rows (the runtime pads one request's prompt chunk to a width bucket), one segment per
request in request order, as :func:`~.metadata.host_layout` lays out an extend whose
lengths are all equal. The counts come from :func:`~.metadata.token_counts` like every
other batch's.

A replay must use the width the graph was captured with: the token layout (and so every
row index baked into the tile table) depends on it, so a different width raises.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .forward_mode import ForwardMode, token_counts
from .metadata import (
    TILE_M_CHOICES,
    LoRABatchInfo,
    check_slots,
    default_tile_m,
    host_layout,
    max_tiles,
    pack_int32,
    tile_tables,
)

_SECTIONS = (
    "seg_indptr",
    "seg_lens",
    "weight_indices",
    "permutation",
    "token_slots",
    "ranks",
    "scalings",
    "tiles",
    "tile_rows",
    "live_tiles",
)


class GraphLoRAMetadata:
    """Persistent, in-place-updated LoRA metadata shared by every captured batch size."""

    def __init__(
        self,
        mode: ForwardMode,
        max_bs: int,
        num_slots: int,
        *,
        num_draft_tokens: int | None = None,
        extend_len: int | None = None,
        device: torch.device | str = "cuda",
        tile_m: int | None = None,
    ) -> None:
        """``num_draft_tokens``: target-verify's rows per request; ``extend_len``: an extend
        graph's (every request padded to it). ``tile_m`` defaults to
        :func:`~.metadata.default_tile_m` for the mode and width (16 for decode/verify)."""
        if mode is ForwardMode.TARGET_VERIFY and (num_draft_tokens is None or num_draft_tokens < 1):
            raise ValueError(f"target-verify graphs need num_draft_tokens >= 1, got {num_draft_tokens}")
        if mode is ForwardMode.EXTEND and (extend_len is None or extend_len < 1):
            raise ValueError(
                f"extend graphs need extend_len >= 1 (every request padded to that many rows), got {extend_len}; "
                "run ragged extend batches eagerly with build_batch_info"
            )
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.mode = mode
        self.max_bs = int(max_bs)
        # The per-request row counts token_counts needs for this mode (None where it has none).
        self._extend_len = extend_len if mode is ForwardMode.EXTEND else None
        self._draft_tokens = num_draft_tokens if mode is ForwardMode.TARGET_VERIFY else None
        self.max_tokens, self.width = self._counts(self.max_bs)
        tile_m = default_tile_m(mode, self.width) if tile_m is None else tile_m
        if tile_m not in TILE_M_CHOICES:
            raise ValueError(f"tile_m must be one of {TILE_M_CHOICES}, got {tile_m}")
        self.num_slots = int(num_slots)
        self.tile_m = tile_m
        self.device = torch.device(device)
        self.tile_capacity = self.capacity(self.max_bs)

        sizes = {
            "seg_indptr": self.max_bs + 1,
            "seg_lens": self.max_bs,
            "weight_indices": self.max_bs,
            "permutation": self.max_tokens,
            "token_slots": self.max_tokens,
            "ranks": self.num_slots,
            "scalings": self.num_slots,
            "tiles": 4 * self.tile_capacity,
            "tile_rows": tile_m * self.tile_capacity,
            "live_tiles": 1,
        }
        template, spans = pack_int32([[0] * sizes[name] for name in _SECTIONS])
        self._spans = dict(zip(_SECTIONS, spans, strict=True))
        on_cuda = self.device.type == "cuda"
        self._device_buf = torch.zeros_like(template, device=self.device)
        # The host twin is pinned so the per-replay copy is asynchronous; on the CPU the
        # device buffer is written directly.
        self._host_buf = torch.zeros(template.shape, dtype=torch.int32, pin_memory=True) if on_cuda else self._device_buf
        self._copy_done = torch.cuda.Event() if on_cuda else None
        self._infos: dict[int, LoRABatchInfo] = {}
        self._captured: set[int] = set()
        self._ranks_cpu = [0] * self.num_slots
        self._written: tuple | None = None  # what the buffers hold: (slots, ranks, scalings, batch size)
        # A valid all-base-model layout, so a warm-up run before capture does no work.
        self._write([], [0] * self.num_slots, [0.0] * self.num_slots, self.max_bs)

    def _counts(self, batch_size: int) -> tuple[int, int]:
        """``(rows, rows per request)`` of ``batch_size`` requests in this layout."""
        lens = None if self._extend_len is None else [self._extend_len] * batch_size
        return token_counts(self.mode, batch_size, extend_lens=lens, num_draft_tokens=self._draft_tokens)

    # -- views -------------------------------------------------------------------------

    def _view(self, buf: torch.Tensor, name: str, length: int | None = None) -> torch.Tensor:
        offset, size = self._spans[name]
        return buf[offset : offset + (size if length is None else length)]

    def _tiles_view(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        return self._view(buf, "tiles", 4 * capacity).view(capacity, 4)

    def _rows_view(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        return self._view(buf, "tile_rows", self.tile_m * capacity).view(capacity, self.tile_m)

    def capacity(self, batch_size: int) -> int:
        """Tile-table entries (and so shrink/expand programs per column block) for a batch size."""
        tokens, width = self._counts(batch_size)
        if self.mode is ForwardMode.EXTEND:
            # Exact: every request is its own segment of exactly ``width`` rows. The bound
            # below would add a tile per segment, and a larger count can tip the choices
            # made from it (the LoRA overlap mode) away from those of the eager extend.
            return batch_size * -(-width // self.tile_m)
        return max_tiles(tokens, batch_size, self.tile_m)

    def capture_info(self, batch_size: int) -> LoRABatchInfo:
        """The batch info to capture a graph with for ``batch_size`` requests (padded batches).

        Its tensors view the persistent buffer and its host counts are maxima, so the
        launches recorded with it stay valid for any :meth:`update` at this batch size.
        """
        info = self.info_for(batch_size)
        self._captured.add(batch_size)
        return info

    def info_for(self, batch_size: int) -> LoRABatchInfo:
        """The (cached) info over the persistent buffers for ``batch_size`` padded requests."""
        if not 1 <= batch_size <= self.max_bs:
            raise ValueError(f"batch_size must be in 1..{self.max_bs} (max_bs), got {batch_size}")
        info = self._infos.get(batch_size)
        if info is not None:
            return info
        tokens, width = self._counts(batch_size)
        dev = self._device_buf
        info = LoRABatchInfo(
            mode=self.mode,
            batch_size=batch_size,
            total_tokens=tokens,
            max_tokens_per_request=width,
            num_segments=batch_size,
            # decode/verify group requests of one adapter into a segment; extend does not
            max_segment_len=width if self.mode is ForwardMode.EXTEND else tokens,
            seg_indptr=self._view(dev, "seg_indptr", batch_size + 1),
            seg_lens=self._view(dev, "seg_lens", batch_size),
            weight_indices=self._view(dev, "weight_indices", batch_size),
            permutation=self._view(dev, "permutation", tokens),
            token_slots=self._view(dev, "token_slots", tokens),
            lora_ranks=self._view(dev, "ranks"),
            scalings=self._view(dev, "scalings").view(torch.float32),
            seg_indptr_cpu=[0] * (batch_size + 1),
            weight_indices_cpu=[-1] * batch_size,
            permutation_cpu=list(range(tokens)),
            lora_ranks_cpu=list(self._ranks_cpu),
            tile_m=self.tile_m,
            num_tiles=self.capacity(batch_size),
            tiles=self._tiles_view(dev, self.capacity(batch_size)),
            tile_rows=self._rows_view(dev, self.capacity(batch_size)),
            graph_capture=True,
            live_tiles=self._view(dev, "live_tiles"),
        )
        self._infos[batch_size] = info
        return info

    # -- per-replay update ---------------------------------------------------------------

    def padded_batch_size(self, real_bs: int) -> int:
        """The smallest captured batch size that holds ``real_bs`` requests."""
        fits = [bs for bs in self._captured if bs >= real_bs]
        if not fits:
            raise ValueError(
                f"no captured batch size holds {real_bs} requests (captured: {sorted(self._captured)}); "
                "capture one with capture_info() or run this batch eagerly"
            )
        return min(fits)

    def update(
        self,
        slots: Sequence[int],
        lora_ranks: Sequence[int],
        scalings: Sequence[float],
        *,
        num_draft_tokens: int | None = None,
        batch_size: int | None = None,
    ) -> LoRABatchInfo:
        """Write this step's layout into the persistent buffers; returns the info to replay.

        ``slots`` holds the real requests; they are padded with base-model requests (slot
        -1) up to ``batch_size`` (default: the smallest captured size that fits).
        ``num_draft_tokens``, when given, must equal the width the graph was captured with.
        """
        if num_draft_tokens is not None and int(num_draft_tokens) != self.width:
            raise ValueError(
                f"this batch verifies {num_draft_tokens} tokens per request but the CUDA graph was "
                f"captured for {self.width}: replay needs the captured width (capture one graph "
                "per num_draft_tokens, or run the batch eagerly)"
            )
        if len(lora_ranks) != self.num_slots:
            raise ValueError(f"{len(lora_ranks)} ranks for a pool of {self.num_slots} slots")
        real_bs = len(slots)
        if batch_size is None:
            batch_size = self.padded_batch_size(real_bs)
        if not real_bs <= batch_size <= self.max_bs:
            raise ValueError(f"{real_bs} requests do not fit batch_size {batch_size} (max_bs {self.max_bs})")
        # Decode and verify steps of one running batch repeat the same layout step after
        # step: the buffers already hold it, so skip the host work and the copy (the
        # layout is on the critical path between two steps).
        key = (tuple(int(s) for s in slots), tuple(int(r) for r in lora_ranks), tuple(float(v) for v in scalings))
        if self._written == (*key, batch_size):
            return self.info_for(batch_size)
        self._written = None  # a failed write leaves nothing to trust
        indptr, weights, permutation = self._write(slots, lora_ranks, scalings, batch_size)
        self._written = (*key, batch_size)
        info = self.info_for(batch_size)
        info.seg_indptr_cpu = indptr
        info.weight_indices_cpu = weights
        info.permutation_cpu = permutation
        info.lora_ranks_cpu = list(self._ranks_cpu)
        return info

    def _write(
        self, slots: Sequence[int], lora_ranks: Sequence[int], scalings: Sequence[float], batch_size: int
    ) -> tuple[list[int], list[int], list[int]]:
        """Fill the host twin for ``slots`` padded to ``batch_size`` and send it in one copy."""
        padded = [int(s) for s in slots] + [-1] * (batch_size - len(slots))
        check_slots(padded, lora_ranks, scalings)
        lens = None if self._extend_len is None else [self._extend_len] * batch_size
        layout = host_layout(
            self.mode, padded, lora_ranks, extend_lens=lens, num_draft_tokens=self._draft_tokens, tile_m=self.tile_m
        )
        # Extend keeps request order (no permutation); the buffer's is then the identity.
        permutation = layout.permutation if layout.permutation is not None else list(range(layout.total_tokens))
        capacity = self.capacity(batch_size)
        assert len(layout.tiles) <= capacity, (len(layout.tiles), capacity)

        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous copy has finished reading the host twin
        host = self._host_buf
        nseg = len(layout.weight_indices)
        indptr = layout.seg_indptr + [layout.seg_indptr[-1]] * (batch_size - nseg)
        weights = layout.weight_indices + [-1] * (batch_size - nseg)
        sections = {
            "seg_indptr": torch.tensor(indptr, dtype=torch.int32),
            "seg_lens": torch.tensor([b - a for a, b in itertools.pairwise(indptr)], dtype=torch.int32),
            "weight_indices": torch.tensor(weights, dtype=torch.int32),
            "permutation": torch.tensor(permutation, dtype=torch.int32),
            "token_slots": torch.tensor(layout.token_slots, dtype=torch.int32),
            "ranks": torch.tensor([int(r) for r in lora_ranks], dtype=torch.int32),
            "scalings": torch.tensor([float(v) for v in scalings], dtype=torch.float32).view(torch.int32),
            "live_tiles": torch.tensor([len(layout.tiles)], dtype=torch.int32),
        }
        for name, values in sections.items():
            self._view(host, name, values.numel()).copy_(values)
        table, rows = tile_tables(layout.tiles, layout.weight_indices, permutation, lora_ranks, scalings, self.tile_m)
        tiles = self._tiles_view(host, capacity)
        tiles.fill_(0)
        tiles[:, 0] = -1  # unused entries: programs that stop at once
        tiles[: table.shape[0]] = table
        tile_rows = self._rows_view(host, capacity)
        tile_rows.fill_(-1)
        tile_rows[: rows.shape[0]] = rows

        if self._copy_done is not None:
            self._device_buf.copy_(self._host_buf, non_blocking=True)
            self._copy_done.record()
        self._ranks_cpu = [int(r) for r in lora_ranks]
        return indptr, weights, permutation
