"""Runs a DFLASH draft next to its target, with the draft's own KV cache.

The draft's KV of projected context features is a separate
:class:`~loraserve.runtime.kv.KVCache` with one layer per draft layer
(:class:`~..draft.runner.DraftRunner`'s), sized like the target's (so the draft can never run out before the target does). It is the same paged
pool the target and the EAGLE head use rather than per-request tensors: appends are O(new
rows), dropping a request returns its slots at once, and the block forward attends through
the same attention layer (SDPA or the paged Triton kernel) the target uses.

Entry ``i`` of a request holds every draft layer's K/V of the target's features at the
``i``-th position the draft has seen. Positions are the draft's own (its entry index): a
request whose draft state was lost starts again at 0 and keeps the right relative
distances (rotary attention depends on nothing else). Outside :meth:`draft` and
:meth:`feed_block` the cache holds context entries only; a block's entries are dropped as
soon as it has been queued.

With CUDA graphs on (``cuda_graph_max_bs``), the uniform forwards (a block of the verify
width, an append of one row or of a verify's rows per request, and the two fused after a
greedy verify) replay from :class:`.DFlashGraphRunner`; prefill chunks stay eager.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..draft.runner import DraftRunner
from ..draft.settings import DraftSettings
from .format import (
    DFlashDraftConfig,
    load_dflash_config,
    load_dflash_tensors,
    random_dflash_tensors,
    resolve_mask_token_id,
)
from .graphs import DFlashGraphRunner
from .model import DFlashDraftModel


class DFlashDraftRunner(DraftRunner):
    """Loads a DFLASH draft next to its target; appends context and drafts blocks."""

    kind = "a DFLASH draft"
    lora = None  # drafts never carry adapters

    def __init__(self, settings: DraftSettings):
        """``settings.embed_weight`` / ``lm_head_weight``: the target's BASE weights;
        ``settings.target_dir``: where the mask token is read when the draft does not state
        it. ``settings.cuda_graph_max_bs``: replay blocks of ``settings.verify_width`` rows
        and context appends of up to this many requests from CUDA graphs (:mod:`.graphs`;
        0 or no ``verify_width``: always eager)."""
        super().__init__(settings)
        path = settings.path
        target = settings.target_arch
        self.config: DFlashDraftConfig = load_dflash_config(
            path, target_num_layers=target.num_layers, architecture_override=settings.architecture
        )
        self.config.check_target(target)
        self.mask_token_id, self.mask_source = resolve_mask_token_id(
            self.config, draft_dir=path, target_dir=settings.target_dir, vocab_size=target.vocab_size
        )
        tensors = self.load_tensors(
            lambda: load_dflash_tensors(path, self.config),
            lambda seed: random_dflash_tensors(self.config, seed=seed),
        )
        model = DFlashDraftModel(
            self.config,
            embed_weight=settings.embed_weight,
            lm_head_weight=settings.lm_head_weight,
            max_positions=settings.max_context_len,
            dtype=self.dtype,
            device=self.device,
        )
        self.install(model, tensors)
        layer = self.config.layer
        self.allocate_kv(layer.num_layers, layer.num_kv_heads, layer.head_dim)
        self.graphs: DFlashGraphRunner | None = None
        if self.graphs_wanted() and settings.verify_width is not None:
            self.graphs = DFlashGraphRunner(self, max_bs=settings.cuda_graph_max_bs, width=settings.verify_width)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target's residual streams the draft reads (``ForwardBatch.hidden_layers``)."""
        return self.config.capture_layers

    @property
    def feature_size(self) -> int:
        """Width of a context row from the target: its captured layer outputs side by side."""
        return self.config.fc_in_features

    @property
    def hidden_size(self) -> int:
        """The draft's (and the target's) hidden size."""
        return self.config.hidden_size

    def can_graph(self, batch_size: int) -> bool:
        """Whether uniform forwards of ``batch_size`` requests replay from the graph runner."""
        return self.graphs is not None and self.graphs.can_run(batch_size)

    @torch.inference_mode()
    def append_context(
        self, request_ids: Sequence[Hashable], features: torch.Tensor, lens: Sequence[int]
    ) -> None:
        """Append ``lens[i]`` context rows for request ``i`` from the target's captured
        features (flat ``[sum(lens), K * H]`` in request order). All or nothing.

        A uniform append of one row or of a verify's ``width`` rows per request replays
        from the graph runner where one holds the batch; others run eagerly."""
        counts = [int(n) for n in lens]
        if features.shape[0] != sum(counts):
            raise ValueError(f"{features.shape[0]} feature rows for lens summing to {sum(counts)}")
        keep = [i for i, n in enumerate(counts) if n > 0]
        if not keep:
            return
        if len(keep) < len(counts):
            request_ids = [request_ids[i] for i in keep]
            counts = [counts[i] for i in keep]
        features = features.to(device=self.device, dtype=self.dtype)
        graphs = self.graphs
        uniform = len(set(counts)) == 1 and graphs is not None and counts[0] in (1, graphs.width)
        with self.kv.allocating(request_ids, counts) as alloc:
            if uniform and self.can_graph(len(counts)):
                assert graphs is not None
                graphs.run_append(alloc, features, counts[0])
                return
            starts = np.repeat(np.asarray(alloc.prefix_lens, dtype=np.int64), counts)
            within = np.arange(sum(counts), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
            positions = torch.from_numpy(starts + within).to(self.device, non_blocking=True)
            self.model.write_context(
                features, positions, alloc.out_cache_loc, self.kv.k_buffers, self.kv.v_buffers
            )

    def write_rows(
        self, features: torch.Tensor, prefix_lens: torch.Tensor, slots: torch.Tensor, rows: int
    ) -> None:
        """Write ``rows`` context entries per request (positions ``prefix_lens[i] + j``, cache
        ``slots``, request-major) from ``features``. Device tensors only: the graph runner
        captures it."""
        offsets = torch.arange(rows, device=prefix_lens.device)
        positions = (prefix_lens[:, None] + offsets[None, :]).reshape(-1)
        self.model.write_context(features, positions, slots, self.kv.k_buffers, self.kv.v_buffers)

    def block_hidden(
        self,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        slots: torch.Tensor,
        context: int,
        first_tokens: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """The block ``[first_tokens[i], mask × (width - 1)]`` of each request at positions
        ``prefix_lens[i] ..``, written into ``slots`` (``width`` per request, already in the
        requests' token table) and attending over ``context`` key columns. Returns the final
        hidden rows of block positions ``1 .. width - 1``: ``[bs, width - 1, H]``. Device
        tensors only: the graph runner captures it."""
        bs = rows.shape[0]
        ids = torch.full((bs, width), self.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = first_tokens
        # The block as a "tree" whose nodes are all ancestors of each other: node n sits at
        # prefix + n and sees the whole context and every node (non-causal in the block).
        depths = torch.arange(width, device=self.device).expand(bs, width)
        visible = torch.ones(bs, width, width, dtype=torch.bool, device=self.device)
        meta = self.attention(
            rows, prefix_lens, slots, width, context, tree_depths=depths, tree_ancestors=visible
        )
        hidden = self.model(ids.reshape(-1), meta, self.kv.k_buffers, self.kv.v_buffers)
        return hidden.view(bs, width, -1)[:, 1:]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's argmax of each hidden row (int64, the rows' shape without ``H``)."""
        return self.model.compute_logits(hidden).argmax(dim=-1)

    @torch.inference_mode()
    def draft(
        self, request_ids: Sequence[Hashable], first_tokens: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft one block per request: ``[first_tokens[i], mask × (width - 1)]`` after the
        request's context, every block row seeing the whole context and the whole block.
        Returns the greedy drafts ``[bs, width - 1]`` and the final hidden rows of block
        positions ``1 .. width - 1`` (``[bs, width - 1, H]``; :meth:`compute_logits` gives
        their logits). Replayed from a CUDA graph where one holds the batch. The block's
        cache entries are dropped before returning."""
        bs = len(request_ids)
        first = first_tokens.to(self.device, torch.int64)
        with self.kv.allocating(request_ids, [width] * bs) as alloc:
            if self.can_graph(bs):
                assert self.graphs is not None
                out = self.graphs.run_block(alloc, first)
            else:
                prefix = torch.tensor(alloc.prefix_lens, dtype=torch.int64).to(self.device, non_blocking=True)
                context = self.context(alloc)
                hidden = self.block_hidden(alloc.rows, prefix, alloc.out_cache_loc, context, first, width)
                out = self.greedy_tokens(hidden), hidden
        for rid in request_ids:
            self.kv.truncate(rid, width)
        return out

    def draft_block(
        self, request_ids: Sequence[Hashable], first_tokens: torch.Tensor, width: int
    ) -> torch.Tensor:
        """:meth:`draft`'s logits (float32): ``[bs, width - 1, vocab]``."""
        _, hidden = self.draft(request_ids, first_tokens, width)
        return self.compute_logits(hidden)

    def can_feed_block(self, request_ids: Sequence[Hashable], width: int) -> bool:
        """Whether :meth:`feed_block` can run for these requests after a verify of ``width``
        rows: the graphs hold the batch and its width, and every request has room for the
        verified rows and a block past its context (in its context limit and in the cache)."""
        bs = len(request_ids)
        if not self.can_graph(bs):
            return False
        assert self.graphs is not None
        if width != self.graphs.width:
            return False
        held = [self.held(rid) for rid in request_ids]
        if any(n + 2 * width > self.kv.max_context_len for n in held):
            return False
        return self.kv.num_free_tokens >= 2 * width * bs

    @torch.inference_mode()
    def feed_block(
        self,
        request_ids: Sequence[Hashable],
        features: torch.Tensor,
        tokens: torch.Tensor,
        accept_lens: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """After a greedy verify, in one replay: append the ``width`` verified rows' features
        per request, and draft the next block from the target's token after each request's
        accepted drafts (``tokens[i, accept_lens[i]]``; both device tensors the host need
        not have read), right after the accepted entries. Returns the greedy drafts
        ``[bs, width - 1]``.

        The cache gains ``2 * width`` entries per request; the caller keeps the first
        ``accept_lens[i] + 1`` (:meth:`keep_context`). On failure the cache is left as it was."""
        assert self.graphs is not None
        bs = len(request_ids)
        with self.kv.allocating(request_ids, [2 * width] * bs) as alloc:
            return self.graphs.run_feed_block(
                alloc,
                features.to(self.device, self.dtype),
                tokens.to(self.device, torch.int64).clamp_min(0).reshape(-1),
                accept_lens.to(self.device, torch.int64),
            )

    def keep_context(self, request_ids: Sequence[Hashable], rows: int, keep: Sequence[int]) -> None:
        """Drop all but the first ``keep[i]`` of the last ``rows`` entries of request ``i``."""
        for rid, n in zip(request_ids, keep, strict=True):
            if n < rows:
                self.kv.truncate(rid, rows - n)
