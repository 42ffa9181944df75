"""CUDA graphs for the EAGLE head's uniform steps.

Two kinds of draft forward are uniform (every request carries the same number of rows),
so like the target's decode they are padded to a batch-size bucket and a power-of-two
context and replayed from a graph per shape:

- the single-row draft steps of a proposal after the first: the previous draft token and
  the head's own output feature;
- feeding the target's features after a verify: every request's ``k`` verified positions
  go in, and the entries past each request's accepted ones are truncated afterwards (the
  head is causal, so the kept rows never see the dropped ones).

Eager, each forward is a few dozen small launches plus attention metadata built on the
host; at small batches that host work, not the GPU, sets the EAGLE step's cost
(docs/benchmarks.md). Padded rows use KV row 0 and slot 0, which
the cache never hands out. Prefill chunks (ragged) stay eager.

A greedy proposal runs as one *chain* graph: the LM head's argmax of each request's tail
gives the first token, and every step's argmax feeds the next inside the graph, so ``n``
draft tokens cost one replay and one set of host work instead of ``n`` (the steps' KV rows
are allocated up front; each step's query sees its own position only, as it would step by
step).

Tree drafts (``top_k`` > 1) grow the same way as one *tree* graph (:func:`grow_tree`:
each step runs the head on the frontier, every node seeing the request's cache and its
own ancestors' entries), and after a tree verify the accepted path is fed and the next
tree grown as one *feed-tree* graph.

After a greedy verify, feeding the verified positions and the next proposal run as one
*feed-chain* graph, queued before the host has read the acceptance: the accepted counts
stay on the device, where they pick each request's tail row and place the chain's rows
right after the accepted entries. The verify, the acceptance and the whole draft then run
back to back on the GPU with no host round trip between them.

Draft adapters (:mod:`.lora`): a batch where some request drafts with a draft
adapter replays graphs of its own, captured with the LoRA ops of the head's linears. Their
segment layouts live in fixed buffers, one per row width the body runs (1 for draft steps,
``k`` for a feed or a tree frontier), rewritten before each replay with the batch's slots
padded by base rows; a batch without draft adapters replays the plain graphs.

Buckets, static buffers, capture and replay are the engine core's
:class:`~loraserve.runtime.runner.graph_runner.GraphRunner`, the target's too: this module
holds the draft's keys, buffers and forward bodies only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from ...kv import Allocation
from ...model.layers import AttentionMetadata
from ...runner.graph_runner import Captured, StaticRequests, fill_padded
from ..draft.graphs import DraftGraphRunner
from ..tree import DraftTree, TreeShape, expand_tree, tree_attention_mask
from .lora import HeadAdapterBatch, HeadGraphLoRA

if TYPE_CHECKING:
    from .runner import EagleDraftRunner

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class _Key(NamedTuple):
    width: int  # rows per request
    from_target: bool  # the features are the target's (else the head's own outputs)
    batch_size: int  # padded
    context: int  # key columns


class _TreeKey(NamedTuple):
    shape: TreeShape
    width: int  # verified positions fed first (0: grow from the stored tails)
    batch_size: int  # padded
    context: int


class _ChainKey(NamedTuple):
    steps: int  # greedy draft steps in one replay
    batch_size: int  # padded
    context: int  # key columns, enough for the last step


class _FeedChainKey(NamedTuple):
    width: int  # verified positions fed per request
    steps: int  # greedy draft steps after the first token
    batch_size: int  # padded
    context: int  # key columns, enough for every row allocated


@dataclass
class _ChainStatic(StaticRequests):
    hidden: torch.Tensor  # [max_bs, H]: the head's output that proposes each request's first token
    out_cache_loc: torch.Tensor  # int64 [max_bs * steps], request-major


@dataclass
class _FeedChainStatic(StaticRequests):
    input_ids: torch.Tensor  # int64 [max_bs * width]: the token after each verified position
    features: torch.Tensor  # [max_bs * width, feature width]: the target's features there
    slots: torch.Tensor  # int64 [max_bs * (width + steps)], request-major: every row allocated
    accept: torch.Tensor  # int64 [max_bs]: drafts accepted (the tail is fed row ``accept``)


@dataclass
class _Static(StaticRequests):
    input_ids: torch.Tensor  # int64 [max_bs * width]
    features: torch.Tensor  # [max_bs * width, feature width]
    out_cache_loc: torch.Tensor  # int64 [max_bs * width]


_Hidden = tuple[torch.Tensor, torch.Tensor | None]  # output features, logits of single steps


class EagleGraphRunner(DraftGraphRunner):
    """Pads uniform EAGLE draft forwards into static buffers and replays captured graphs.

    ``use_graphs=False`` runs the same padded static path eagerly (the CPU tests use it).
    A capture that fails turns graphs off for this runner (logged); forwards then run eagerly.
    """

    def __init__(self, runner: EagleDraftRunner, *, max_bs: int, use_graphs: bool | None = None):
        super().__init__(runner, max_bs=max_bs, use_graphs=use_graphs, what="the EAGLE draft forward")
        self.runner: EagleDraftRunner = runner
        self._static: dict[tuple[int, bool], _Static] = {}
        self._graphs: dict[_Key, Captured[_Hidden]] = self.new_table()
        self._chain_static: dict[int, _ChainStatic] = {}
        self._chains: dict[_ChainKey, Captured[torch.Tensor]] = self.new_table()
        self._feed_static: dict[tuple[int, int], _FeedChainStatic] = {}
        self._feed_chains: dict[_FeedChainKey, Captured[tuple[torch.Tensor, torch.Tensor]]] = self.new_table()
        self._trees: dict[_TreeKey, Captured[tuple[torch.Tensor, ...]]] = self.new_table()
        self._lora: HeadGraphLoRA | None = None  # draft adapters' fixed layouts, made on first use
        self._adapted: dict[int, dict] = {}  # id of a plain table -> its graphs with draft adapters

    def run(
        self,
        alloc: Allocation,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        *,
        width: int = 1,
        from_target: bool = False,
        slots: Sequence[int] | None = None,
    ) -> _Hidden:
        """``width`` rows per request of ``alloc`` (already allocated); returns the output
        features ``[bs * width, H]`` and, for single-row steps on the head's own features,
        the logits ``[bs, vocab]`` (float32). ``slots``: each request's draft adapter slot
        (None: no request has one)."""
        bs, padded, context = self.shape(alloc)
        key = _Key(width, from_target, padded, context)
        s = self._static_for(width, from_target)
        n, total = padded * width, bs * width
        fill_padded(s.input_ids, input_ids, total, n)
        fill_padded(s.features, features, total, n)
        s.fill_requests(alloc, padded)
        fill_padded(s.out_cache_loc, alloc.out_cache_loc, total, n)
        hidden, logits = self._replay(self._graphs, key, lambda: self._body(key), slots, (width,), padded)
        return hidden[:total].clone(), None if logits is None else logits[:bs].clone()

    def run_chain(
        self, alloc: Allocation, hidden: torch.Tensor, steps: int, *, slots: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Each request's first greedy draft token from the head output ``hidden``, then
        ``steps`` draft steps per request of ``alloc`` (``steps`` rows each, already
        allocated); returns the tokens ``[bs, steps + 1]``."""
        bs, padded, context = self._fill_chain(alloc, hidden, steps)
        key = _ChainKey(steps, padded, context)
        widths = (1,) if steps else ()
        return self._replay(self._chains, key, lambda: self._chain_body(key), slots, widths, padded)[
            :bs
        ].clone()

    def run_feed_chain(
        self,
        alloc: Allocation,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        accept: torch.Tensor,
        *,
        width: int,
        steps: int,
        slots: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``width`` verified pairs per request of ``alloc`` (``width + steps`` rows each,
        already allocated), then propose greedily from each request's tail, the output at row
        ``accept[i]`` (a device tensor, never read on the host): the first token from the LM
        head, then ``steps`` draft steps placed right after the accepted entries. Returns the
        tokens ``[bs, steps + 1]`` and the tails ``[bs, H]``."""
        bs, padded, context = self._fill_feed(alloc, input_ids, features, accept, width, steps)
        key = _FeedChainKey(width, steps, padded, context)
        widths = (width, 1) if steps else (width,)
        tokens, tails = self._replay(
            self._feed_chains, key, lambda: self._feed_chain_body(key), slots, widths, padded
        )
        return tokens[:bs].clone(), tails[:bs].clone()

    def run_tree(
        self, alloc: Allocation, hidden: torch.Tensor, shape: TreeShape, *, slots: Sequence[int] | None = None
    ) -> DraftTree:
        """Grow each request's tree from the head output ``hidden`` (its tail) over the
        ``shape.entries`` rows per request of ``alloc`` (already allocated)."""
        bs, padded, context = self._fill_chain(alloc, hidden, shape.entries)
        key = _TreeKey(shape, 0, padded, context)
        out = self._replay(self._trees, key, lambda: self._tree_body(key), slots, (shape.top_k,), padded)
        return DraftTree(*(t[:bs].clone() for t in out), shape.num_steps)

    def run_feed_tree(
        self,
        alloc: Allocation,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        accept: torch.Tensor,
        *,
        width: int,
        shape: TreeShape,
        slots: Sequence[int] | None = None,
    ) -> tuple[DraftTree, torch.Tensor]:
        """Feed ``width`` pairs of each request's accepted path, then grow its next tree from
        the output at row ``accept[i]`` over the entries right after the accepted ones
        (``width + shape.entries`` rows per request allocated). Returns the trees and the tails."""
        bs, padded, context = self._fill_feed(alloc, input_ids, features, accept, width, shape.entries)
        key = _TreeKey(shape, width, padded, context)
        *tree, tails = self._replay(
            self._trees, key, lambda: self._feed_tree_body(key), slots, (width, shape.top_k), padded
        )
        return DraftTree(*(t[:bs].clone() for t in tree), shape.num_steps), tails[:bs].clone()

    def _replay(
        self,
        table: dict[K, Captured[T]],
        key: K,
        body: Callable[[], T],
        slots: Sequence[int] | None,
        widths: Sequence[int],
        padded: int,
    ) -> T:
        """:meth:`replay` with the call's draft adapters: their layouts for every row width
        the body runs (``widths``) are written into the fixed buffers first, and the body
        (at capture, or on the static path) reads those buffers. A batch with draft adapters
        replays graphs of its own (holding the LoRA ops); one without keeps the plain ones."""
        if slots is None:
            return self.replay(table, key, body)
        table = self.cached(self._adapted, id(table), self.new_table)
        manager = self.runner.lora
        assert manager is not None, "draft adapter slots without a draft adapter pool"
        if self._lora is None:
            self._lora = HeadGraphLoRA(manager, self.max_bs, self.device)
        lora = self._lora
        lora.update(widths, slots, padded)
        batch = HeadAdapterBatch(manager, slots, graph=lora, padded=padded)
        with self.runner.adapters_for_replay(batch):
            return self.replay(table, key, body, before_capture=lambda: lora.capture(widths, padded))

    # ------------------------------------------------------------------ static inputs
    def _fill_chain(self, alloc: Allocation, hidden: torch.Tensor, entries: int) -> tuple[int, int, int]:
        """Stage a chain's or a tree's inputs (tails, requests, ``entries`` slots each) in its
        static buffers; returns :meth:`shape`'s ``(bs, padded, context)``."""
        bs, padded, context = self.shape(alloc)
        s = self._chain_static_for(entries)
        fill_padded(s.hidden, hidden, bs, padded)
        s.fill_requests(alloc, padded)
        fill_padded(s.out_cache_loc, alloc.out_cache_loc, bs * entries, padded * entries)
        return bs, padded, context

    def _fill_feed(
        self, alloc: Allocation, input_ids: torch.Tensor, features: torch.Tensor, accept: torch.Tensor,
        width: int, entries: int,
    ) -> tuple[int, int, int]:  # fmt: skip
        """Stage a feed's inputs (``width`` pairs, then ``entries`` draft slots per request,
        the accepted counts) in its static buffers; returns ``(bs, padded, context)``."""
        bs, padded, context = self.shape(alloc)
        s = self._feed_static_for(width, entries)
        n, total = padded * width, bs * width
        fill_padded(s.input_ids, input_ids, total, n)
        fill_padded(s.features, features, total, n)
        s.fill_requests(alloc, padded)
        per = width + entries
        fill_padded(s.slots, alloc.out_cache_loc, bs * per, padded * per)
        fill_padded(s.accept, accept, bs, padded)
        return bs, padded, context

    def _static_for(self, width: int, from_target: bool) -> _Static:
        model, rows = self.runner.model, self.max_bs * width
        feature = model.feature_size if from_target else model.hidden_size
        return self.cached(
            self._static,
            (width, from_target),
            lambda: self.static_requests(
                _Static,
                self.max_bs,
                input_ids=self.zeros(rows),
                features=self.zeros(rows, feature, dtype=self.runner.dtype),
                out_cache_loc=self.zeros(rows),
            ),
        )

    def _chain_static_for(self, steps: int) -> _ChainStatic:
        return self.cached(
            self._chain_static,
            steps,
            lambda: self.static_requests(
                _ChainStatic,
                self.max_bs,
                hidden=self.zeros(self.max_bs, self.runner.model.hidden_size, dtype=self.runner.dtype),
                out_cache_loc=self.zeros(self.max_bs * max(steps, 1)),
            ),
        )

    def _feed_static_for(self, width: int, steps: int) -> _FeedChainStatic:
        max_bs, feature = self.max_bs, self.runner.model.feature_size
        return self.cached(
            self._feed_static,
            (width, steps),
            lambda: self.static_requests(
                _FeedChainStatic,
                max_bs,
                input_ids=self.zeros(max_bs * width),
                features=self.zeros(max_bs * width, feature, dtype=self.runner.dtype),
                slots=self.zeros(max_bs * (width + steps)),
                accept=self.zeros(max_bs),
            ),
        )

    # ------------------------------------------------------------------ bodies
    def _body(self, key: _Key) -> _Hidden:
        s = self._static[(key.width, key.from_target)]
        bs, n = key.batch_size, key.batch_size * key.width
        hidden = self.runner.head(
            s.rows[:bs], s.prefix_lens[:bs], s.out_cache_loc[:n], key.width, key.context,
            s.input_ids[:n], s.features[:n], from_target=key.from_target,
        )  # fmt: skip
        single = key.width == 1 and not key.from_target
        return hidden, self.runner.model.compute_logits(hidden) if single else None

    def _chain_body(self, key: _ChainKey) -> torch.Tensor:
        s = self._chain_static[key.steps]
        bs = key.batch_size
        locs = s.out_cache_loc[: bs * key.steps].view(bs, key.steps)
        return self._chain(s.rows[:bs], s.prefix_lens[:bs], locs, key.context, s.hidden[:bs])

    def _feed_chain_body(self, key: _FeedChainKey) -> tuple[torch.Tensor, torch.Tensor]:
        s = self._feed_static[(key.width, key.steps)]
        rows, prefix, locs, tail = self._fed(s, key.batch_size, key.width, key.steps, key.context)
        return self._chain(rows, prefix, locs, key.context, tail), tail

    def _tree_body(self, key: _TreeKey) -> tuple[torch.Tensor, ...]:
        s = self._chain_static[key.shape.entries]
        bs, n = key.batch_size, key.shape.entries
        locs = s.out_cache_loc[: bs * n].view(bs, n)
        tree = grow_tree(
            self.runner, s.rows[:bs], s.prefix_lens[:bs], locs, key.context, s.hidden[:bs], key.shape
        )
        return tree.tensors()

    def _feed_tree_body(self, key: _TreeKey) -> tuple[torch.Tensor, ...]:
        s = self._feed_static[(key.width, key.shape.entries)]
        rows, prefix, locs, tail = self._fed(s, key.batch_size, key.width, key.shape.entries, key.context)
        tree = grow_tree(self.runner, rows, prefix, locs, key.context, tail, key.shape)
        return (*tree.tensors(), tail)

    def _fed(
        self, s: _FeedChainStatic, bs: int, width: int, after: int, context: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The feed of ``width`` verified positions per request from the static inputs, and
        where the next draft goes: ``(rows, prefix after the kept pairs, the next ``after``
        entries' slots, each request's tail feature)``. Entry ``accept + 1 + j`` of the
        allocation holds draft entry ``j``: right after the kept pairs, over the rejected
        positions' rows (the head is causal and the draft runs after the feed, so nothing
        kept reads them)."""
        slots = s.slots[: bs * (width + after)].view(bs, width + after)
        rows, prefix, accept = s.rows[:bs], s.prefix_lens[:bs], s.accept[:bs]
        n = bs * width
        hidden = self.runner.head(
            rows, prefix, slots[:, :width].reshape(-1), width, context,
            s.input_ids[:n], s.features[:n], from_target=True,
        )  # fmt: skip
        tail = hidden.view(bs, width, -1)[torch.arange(bs, device=self.device), accept]
        offsets = accept[:, None] + 1 + torch.arange(after, device=self.device)[None, :]
        return rows, prefix + accept + 1, slots.gather(1, offsets), tail

    def _chain(
        self,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        locs: torch.Tensor,
        context: int,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """Greedy tokens ``[bs, steps + 1]``: the LM head's argmax of ``hidden``, then one
        single-row head step per column of ``locs`` (each fed the previous token and output),
        the first at position ``prefix_lens``."""
        runner, model = self.runner, self.runner.model
        tokens = model.greedy_tokens(hidden)
        out = [tokens]
        for j in range(locs.shape[1]):
            hidden = runner.head(
                rows, prefix_lens + j, locs[:, j], 1, context, tokens, hidden, from_target=False
            )
            tokens = model.greedy_tokens(hidden)
            out.append(tokens)
        return torch.stack(out, dim=1)


def grow_tree(
    runner: EagleDraftRunner,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    locs: torch.Tensor,
    context: int,
    tails: torch.Tensor,
    shape: TreeShape,
) -> DraftTree:
    """Grow every request's tree from its tail (the head's output at its last committed
    pair): the frontier of step ``d`` goes in at position ``prefix + d - 1`` and into the
    entries ``locs[:, (d - 1) * K : d * K]`` (table positions right after the prefix), each
    node seeing the request's committed entries and its ancestors' (:mod:`..tree`). Static
    shapes throughout: the graph runner captures it; eager callers pass their allocation."""
    model, groups = runner.model, runner.attn_groups
    bs, k = rows.shape[0], shape.top_k
    kv_indices = runner.kv.req_to_token.index_select(0, rows)[:, :context]
    own = torch.eye(shape.entries, dtype=torch.bool, device=rows.device)

    def step(tokens: torch.Tensor, feats: torch.Tensor, d: int, visible: torch.Tensor):
        first = (d - 1) * k
        seen = visible | own[first : first + k][None]
        meta = AttentionMetadata(
            batch_size=bs,
            max_q=k,
            max_ctx=context,
            positions=(prefix_lens + d - 1)[:, None].expand(bs, k).reshape(-1),
            out_cache_loc=locs[:, first : first + k].reshape(-1),
            kv_indices=kv_indices,
            mask=tree_attention_mask(prefix_lens, seen, context, groups),
            q_dest=None,
        )
        runner.apply_adapters(k)  # each request's draft adapter over its k frontier rows
        hidden = model(
            tokens.reshape(-1), feats.reshape(bs * k, -1), meta, runner.kv.k_buffers[0], runner.kv.v_buffers[0],
            from_target=False,
        )  # fmt: skip
        logprobs = torch.log_softmax(model.compute_logits(hidden), dim=-1)
        return hidden.view(bs, k, -1), logprobs.view(bs, k, -1)

    first_logprobs = torch.log_softmax(model.compute_logits(tails), dim=-1)
    return expand_tree(
        first_logprobs, tails, step, top_k=k, num_steps=shape.num_steps, num_nodes=shape.num_nodes
    )
