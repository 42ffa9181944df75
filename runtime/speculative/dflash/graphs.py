"""CUDA graphs for the DFLASH draft's uniform forwards.

A DFLASH step is uniform in every request: the block is ``width`` rows per request (the
verify width, fixed at start-up), and a verify hands over ``width`` rows of the target's
features per request. Like the target's decode and the EAGLE head's steps, these forwards
are padded to a batch-size bucket and a power-of-two context and replayed from a graph
per shape (eager, each is a few dozen small launches plus attention metadata built on the
host, which then sets a step's cost; docs/benchmarks.md):

- *append*: the target's features of ``rows`` positions per request projected into every
  draft layer's keys and values (no attention runs: context positions are never
  queries). A verify's ``width`` rows all go in and the entries past each request's
  accepted ones are truncated afterwards (the kept rows never read the dropped ones); a
  step that decoded without drafting appends one row per request;
- *block*: ``[first token, mask × (width - 1)]`` after each request's context, every
  block row seeing the whole context and the whole block; returns the draft's greedy
  tokens and its final hidden rows at block positions ``1 .. width - 1`` (the LM head's
  logits of a sampling batch are computed from those outside the graph: a graph's outputs
  stay allocated, and ``bs × width × vocab`` floats per shape would be too many);
- *feed-block*: after a greedy verify, the append of the verified rows and the next
  block in one replay, queued before the host has read the acceptance: the accepted
  counts stay on the device, where they pick each request's first token (the target's
  token after its accepted drafts) and place the block right after the accepted entries.
  The verify, the acceptance and the whole draft then run back to back on the GPU.

Padded requests use KV row 0 and slot 0, which the cache never hands out. Prefill chunks
(ragged) stay eager. The block's width is the runner's: a forward of another width is
refused (a graph's token layout is fixed at capture).

Buckets, static buffers, capture and replay are the engine core's
:class:`~loraserve.runtime.runner.graph_runner.GraphRunner`: this module holds the draft's
keys, buffers and forward bodies only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from ...kv import Allocation
from ...runner.graph_runner import Captured, StaticRequests, fill_padded
from ..draft.graphs import DraftGraphRunner

if TYPE_CHECKING:
    from .runner import DFlashDraftRunner


class _AppendKey(NamedTuple):
    rows: int  # feature rows per request
    batch_size: int  # padded


class _BlockKey(NamedTuple):
    batch_size: int  # padded
    context: int  # key columns, enough for the block's last row


class _FeedKey(NamedTuple):
    batch_size: int  # padded
    context: int  # key columns, enough for every row allocated


@dataclass
class _AppendStatic(StaticRequests):
    features: torch.Tensor  # [max_bs * rows, K * H]: the target's captured layer outputs
    slots: torch.Tensor  # int64 [max_bs * rows], request-major


@dataclass
class _BlockStatic(StaticRequests):
    first: torch.Tensor  # int64 [max_bs]: each block's first token
    slots: torch.Tensor  # int64 [max_bs * width]: the block's cache entries


@dataclass
class _FeedStatic(StaticRequests):
    features: torch.Tensor  # [max_bs * width, K * H]: the target's features at the verified rows
    tokens: (
        torch.Tensor
    )  # int64 [max_bs * width]: the acceptance's tokens (accepted drafts, then the target's)
    accept: torch.Tensor  # int64 [max_bs]: drafts accepted
    slots: torch.Tensor  # int64 [max_bs * 2 * width], request-major: the verified rows, then the block's


Block = tuple[torch.Tensor, torch.Tensor]  # greedy tokens [bs, width - 1], hidden [bs, width - 1, H]


class DFlashGraphRunner(DraftGraphRunner):
    """Pads uniform DFLASH draft forwards into static buffers and replays captured graphs.

    ``width``: the block (the verify width), fixed for the runner's life. ``use_graphs=False``
    runs the same padded static path eagerly (the CPU tests use it). A capture that fails
    turns graphs off for this runner (logged); forwards then run eagerly.
    """

    def __init__(self, runner: DFlashDraftRunner, *, max_bs: int, width: int, use_graphs: bool | None = None):
        super().__init__(runner, max_bs=max_bs, use_graphs=use_graphs, what="the DFLASH draft forward")
        if width < 2:
            raise ValueError(f"a DFLASH block holds the last token and at least one draft, got width {width}")
        self.runner: DFlashDraftRunner = runner
        self.width = int(width)
        self._append_static: dict[int, _AppendStatic] = {}
        self._appends: dict[_AppendKey, Captured[None]] = self.new_table()
        self._block_static: _BlockStatic | None = None
        self._blocks: dict[_BlockKey, Captured[Block]] = self.new_table()
        self._feed_static: _FeedStatic | None = None
        self._feeds: dict[_FeedKey, Captured[torch.Tensor]] = self.new_table()

    def check_width(self, width: int) -> None:
        """Refuse a block or a verify of another width than the graphs' (their layout is fixed)."""
        if width != self.width:
            raise ValueError(
                f"the DFLASH draft's graphs hold blocks of width {self.width}, got {width}: the verify width "
                "(speculative.num_draft_tokens) is fixed at start-up"
            )

    # ------------------------------------------------------------------ forwards
    def run_append(self, alloc: Allocation, features: torch.Tensor, rows: int) -> None:
        """Write ``rows`` context entries per request of ``alloc`` (already allocated) from
        the target's ``features`` ``[bs * rows, K * H]``."""
        if rows not in (1, self.width):
            raise ValueError(
                f"the DFLASH draft's graphs append 1 or {self.width} rows per request, got {rows}"
            )
        bs, padded = len(alloc.seq_lens), self.padded(len(alloc.seq_lens))
        s = self.cached(
            self._append_static,
            rows,
            lambda: self.static_requests(
                _AppendStatic,
                self.max_bs,
                features=self.zeros(self.max_bs * rows, self.runner.feature_size, dtype=self.runner.dtype),
                slots=self.zeros(self.max_bs * rows),
            ),
        )
        fill_padded(s.features, features, bs * rows, padded * rows)
        fill_padded(s.slots, alloc.out_cache_loc, bs * rows, padded * rows)
        s.fill_requests(alloc, padded)
        key = _AppendKey(rows, padded)
        self.replay(self._appends, key, lambda: self._append_body(s, key))

    def run_block(self, alloc: Allocation, first: torch.Tensor) -> Block:
        """The block ``[first[i], mask × (width - 1)]`` over the ``width`` entries per request
        of ``alloc`` (already allocated, right after each request's context). Returns the
        greedy tokens ``[bs, width - 1]`` and the final hidden rows ``[bs, width - 1, H]``."""
        bs, padded, context = self.shape(alloc)
        self.check_width(alloc.new_lens[0])
        s = self._block_static_for()
        fill_padded(s.first, first, bs, padded)
        fill_padded(s.slots, alloc.out_cache_loc, bs * self.width, padded * self.width)
        s.fill_requests(alloc, padded)
        key = _BlockKey(padded, context)
        tokens, hidden = self.replay(self._blocks, key, lambda: self._block_body(key))
        return tokens[:bs].clone(), hidden[:bs].clone()

    def run_feed_block(
        self, alloc: Allocation, features: torch.Tensor, tokens: torch.Tensor, accept: torch.Tensor
    ) -> torch.Tensor:
        """After a greedy verify of ``width`` rows per request: append every verified row's
        features (``2 * width`` entries per request of ``alloc`` are allocated: the verified
        rows, then room for the block), then draft the next block from the target's token
        after each request's ``accept[i]`` accepted drafts (``tokens[i, accept[i]]``, read on
        the device), placed right after the accepted entries. Returns the greedy tokens
        ``[bs, width - 1]``; the caller keeps each request's first ``accept[i] + 1`` entries."""
        bs, padded, context = self.shape(alloc)
        w = self.width
        self.check_width(alloc.new_lens[0] // 2)
        s = self._feed_static_for()
        fill_padded(s.features, features, bs * w, padded * w)
        fill_padded(s.tokens, tokens, bs * w, padded * w)
        fill_padded(s.accept, accept, bs, padded)
        fill_padded(s.slots, alloc.out_cache_loc, bs * 2 * w, padded * 2 * w)
        s.fill_requests(alloc, padded)
        key = _FeedKey(padded, context)
        return self.replay(self._feeds, key, lambda: self._feed_body(key))[:bs].clone()

    # ------------------------------------------------------------------ static buffers
    def _block_static_for(self) -> _BlockStatic:
        if self._block_static is None:
            self._block_static = self.static_requests(
                _BlockStatic,
                self.max_bs,
                first=self.zeros(self.max_bs),
                slots=self.zeros(self.max_bs * self.width),
            )
        return self._block_static

    def _feed_static_for(self) -> _FeedStatic:
        if self._feed_static is None:
            n, w = self.max_bs, self.width
            self._feed_static = self.static_requests(
                _FeedStatic,
                n,
                features=self.zeros(n * w, self.runner.feature_size, dtype=self.runner.dtype),
                tokens=self.zeros(n * w),
                accept=self.zeros(n),
                slots=self.zeros(n * 2 * w),
            )
        return self._feed_static

    # ------------------------------------------------------------------ bodies
    def _append_body(self, s: _AppendStatic, key: _AppendKey) -> None:
        bs, n = key.batch_size, key.batch_size * key.rows
        self.runner.write_rows(s.features[:n], s.prefix_lens[:bs], s.slots[:n], key.rows)

    def _block_body(self, key: _BlockKey) -> Block:
        s = self._block_static
        assert s is not None
        bs = key.batch_size
        hidden = self.runner.block_hidden(
            s.rows[:bs], s.prefix_lens[:bs], s.slots[: bs * self.width], key.context, s.first[:bs], self.width
        )
        return self.runner.greedy_tokens(hidden), hidden

    def _feed_body(self, key: _FeedKey) -> torch.Tensor:
        s = self._feed_static
        assert s is not None
        bs, w = key.batch_size, self.width
        rows, prefix, accept = s.rows[:bs], s.prefix_lens[:bs], s.accept[:bs]
        slots = s.slots[: bs * 2 * w].view(bs, 2 * w)
        self.runner.write_rows(s.features[: bs * w], prefix, slots[:, :w].reshape(-1), w)
        # Entry accept + 1 + j holds block row j: right after the kept rows, over the rejected
        # ones (nothing kept reads them: context entries are never queries).
        offsets = accept[:, None] + 1 + torch.arange(w, device=self.device)[None, :]
        first = s.tokens[: bs * w].view(bs, w).gather(1, accept[:, None]).squeeze(1)
        hidden = self.runner.block_hidden(
            rows, prefix + accept + 1, slots.gather(1, offsets).reshape(-1), key.context, first, w
        )
        return self.runner.greedy_tokens(hidden)
