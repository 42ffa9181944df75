"""EAGLE / EAGLE3 drafting: a draft head over the target's features (NEXTN runs as EAGLE).

Per request the draft cache holds one entry per target position whose successor token
is committed: the pair (feature of position ``i``, token ``i + 1``). The target's
prefill chunks and each verify's accepted positions are fed in as they arrive, and the
draft's output at the last pair (``tail``) yields the first proposal of the next step;
later proposals feed the draft's own output back as the feature. Draft entries written
while proposing are truncated after verify and replaced by the target's real features.

A request whose draft state was lost (a failed step) proposes its last token until the
next verify supplies features again; rotary attention depends only on relative
positions, so the draft resumes from there without recomputing the past.

After a greedy verify of a batch the graphs hold, :meth:`EagleDrafter.on_verify` queues
the feed and the next step's proposal as one replay before it reads the acceptance on the
host (:meth:`.EagleDraftRunner.feed_chain`); :meth:`EagleDrafter.propose` then hands out
those tokens without launching anything. The GPU goes from the verify straight into the
draft, and the host, which waits for the verify's acceptance only (its copy is staged
before the draft is queued), does the step's bookkeeping and queues the next verify while
the draft runs.

Tree drafts (:meth:`EagleDrafter.propose_tree`, greedy batches): the tree grows from the
same tails (:mod:`..tree`); after its verify the accepted path is fed like a chain's
verified positions (the target's features at the path's nodes), and the next tree grows
in the same replay.

Draft adapters: with a draft adapter pool on the head (:mod:`.lora`), a request
whose Adapter has a draft adapter runs every head forward of its own with it, from its
first fed pair to its release (:class:`~..draft_adapters.DraftAdapterLeases`); every other
request of the same batch runs the base head. The target still verifies with the
request's own adapter, so only proposals change.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...engine.request import Request
from ...runner.forward_batch import ForwardOutput
from ...sampling import Sampler
from ..acceptance import Acceptance
from ..draft_adapters import DraftAdapterLeases
from ..drafter import DraftProposal, choose_drafts
from ..tree import DraftTree, TreeShape, ancestor_closure
from .runner import EagleDraftRunner


@dataclass
class _State:
    committed: int = 0  # draft entries holding the target's features
    tail: torch.Tensor | None = None  # draft output at the last committed pair [H]


@dataclass
class _Pending:
    """The next proposal, computed with the feed after a verify (see :meth:`EagleDrafter.propose`)."""

    index: dict[str, int]  # request id -> its row of ``tokens``
    tokens: torch.Tensor | None  # int64 [bs, num_tokens] on the device (a chain)
    tree: DraftTree | None = None  # or the trees grown ahead


class EagleDrafter:
    """Drives an :class:`EagleDraftRunner` from the target's hidden states."""

    supports_trees = True

    def __init__(
        self, runner: EagleDraftRunner, sampler: Sampler, vocab_size: int, *, tree: TreeShape | None = None
    ):
        """``tree``: the shape of the trees :meth:`propose_tree` grows (None: chains only)."""
        self.runner = runner
        self.tree_shape = tree
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = runner.device
        self.needs_hidden = runner.version != 3
        self.hidden_layers: tuple[int, ...] | None = runner.aux_layer_ids if runner.version == 3 else None
        self._states: dict[str, _State] = {}
        self._pending: _Pending | None = None
        self.adapters = DraftAdapterLeases(runner.lora)

    @property
    def lora(self):
        return self.runner.lora

    def _features(self, output: ForwardOutput) -> torch.Tensor:
        feats = output.aux_hidden_states if self.hidden_layers else output.hidden_states
        if feats is None:
            raise RuntimeError("the target forward returned no hidden states for the EAGLE draft")
        return feats

    def _append(self, items: Sequence[tuple[Request, torch.Tensor, torch.Tensor]]) -> None:
        """Feed committed pairs ``(request, token ids [n], target features [n, F])``."""
        items = [item for item in items if item[1].numel()]
        if not items:
            return
        self._drop_speculative([req for req, _, _ in items])
        lens = [int(ids.numel()) for _, ids, _ in items]
        out = self.runner.forward(
            [req.rid for req, _, _ in items],
            torch.cat([ids.to(self.device) for _, ids, _ in items]),
            torch.cat([feats for _, _, feats in items]),
            lens,
            from_target=True,
            lora_names=self.adapters.names([req for req, _, _ in items]),
        )
        ends = torch.tensor(lens, device=out.device).cumsum(0) - 1
        self._commit([req for req, _, _ in items], lens, out.index_select(0, ends))

    def _commit(self, requests: Sequence[Request], counts: Sequence[int], tails: torch.Tensor) -> None:
        """Record ``counts[i]`` new committed pairs for request ``i``, whose last output is ``tails[i]``."""
        for req, n, tail in zip(requests, counts, tails, strict=True):
            state = self._states[req.rid]
            state.committed += n
            state.tail = tail

    def _drop_speculative(self, requests: Sequence[Request]) -> None:
        """Truncate the entries the last proposal wrote past each request's committed pairs."""
        for req in requests:
            state = self._states.setdefault(req.rid, _State())
            held = self.runner.kv.seq_len(req.rid)
            if held > state.committed:
                self.runner.kv.truncate(req.rid, held - state.committed)

    def _append_verified(
        self, requests: Sequence[Request], tokens: torch.Tensor, feats: torch.Tensor, keep: Sequence[int]
    ) -> None:
        """Feed all ``k`` verified positions of every request in one uniform (graph-replayed)
        forward, then drop the entries past each request's ``keep`` committed pairs. The
        head is causal: the kept rows never attend to the dropped ones."""
        bs, k = tokens.shape
        self._drop_speculative(requests)
        out = self.runner.forward_uniform(
            [r.rid for r in requests],
            tokens.clamp_min(0).reshape(-1),
            feats.reshape(bs * k, -1),
            k,
            lora_names=self.adapters.names(requests),
        )
        for req, n in zip(requests, keep, strict=True):
            if n < k:
                self.runner.kv.truncate(req.rid, k - n)
        last = torch.tensor([n - 1 for n in keep], device=out.device)
        self._commit(requests, keep, out.view(bs, k, -1)[torch.arange(bs, device=out.device), last])

    def on_extend(
        self, chunks: Sequence[tuple[Request, int]], output: ForwardOutput, first_tokens: Sequence[int | None]
    ) -> None:
        self._invalidate([req for req, _ in chunks])
        feats = self._features(output)
        items = []
        offset = 0
        for (req, n), first in zip(chunks, first_tokens, strict=True):
            rows = feats[offset : offset + n]
            offset += n
            start = req.num_cached
            following = req.all_ids[start + 1 : start + n + 1]
            if len(following) < n:  # the chunk ends the prefill: its successor was just sampled
                if first is None:
                    rows = rows[: len(following)]
                else:
                    following = [*following, int(first)]
            if start == 0:
                self.release(req)  # a (re-)prefill from scratch: nothing earlier is valid
            items.append((req, torch.tensor(following, dtype=torch.int64), rows))
        self._append(items)

    def propose(self, requests: Sequence[Request], num_tokens: int) -> DraftProposal:
        ready = self._take_pending(requests, num_tokens)
        if ready is not None:
            return DraftProposal(ready)
        bs = len(requests)
        live = [
            i
            for i, r in enumerate(requests)
            if (s := self._states.get(r.rid)) is not None and s.tail is not None
        ]
        reqs = [requests[i] for i in live]
        self._drop_speculative(reqs)  # entries of a proposal computed ahead and not used
        chained = None
        if (
            num_tokens > 1
            and reqs
            and all(r.params.greedy for r in reqs)
            and self.runner.can_chain(len(reqs))
        ):
            # Greedy: the first token's argmax and every later step in one replay.
            hidden = torch.stack([self._states[r.rid].tail for r in reqs])  # type: ignore[misc]
            chained = self.runner.draft_chain(
                [r.rid for r in reqs], hidden, num_tokens, lora_names=self.adapters.names(reqs)
            )
            if len(live) == bs:  # the usual step: nothing else to launch
                return DraftProposal(chained)
        tokens = torch.tensor([r.last_token for r in requests], dtype=torch.int64, device=self.device)
        tokens = tokens[:, None].repeat(1, max(num_tokens, 0))
        if num_tokens == 0 or not live:
            return DraftProposal(tokens)
        rows = torch.tensor(live, device=self.device)
        if chained is not None:
            tokens[rows] = chained
            return DraftProposal(tokens)
        rids, names = [r.rid for r in reqs], self.adapters.names(reqs)
        hidden = torch.stack([self._states[r.rid].tail for r in reqs])  # type: ignore[misc]
        probs: list[torch.Tensor | None] = []
        for j in range(num_tokens):
            if j > 0:
                hidden, logits = self.runner.step(rids, tokens[rows, j - 1], hidden, lora_names=names)
            else:
                logits = self.runner.compute_logits(hidden)
            step_tokens, step_probs = choose_drafts(logits, reqs, self.sampler)
            tokens[rows, j] = step_tokens
            probs.append(step_probs)
        if all(p is None for p in probs):
            return DraftProposal(tokens)
        full = torch.zeros(bs, num_tokens, self.vocab_size, device=self.device)
        full.scatter_(2, tokens[:, :, None], 1.0)  # one-hot for rows drafted without a model
        for j, p in enumerate(probs):
            if p is not None:
                full[rows, j] = p.to(full.dtype)
            else:
                full[rows, j] = torch.nn.functional.one_hot(tokens[rows, j], self.vocab_size).to(full.dtype)
        return DraftProposal(tokens, full)

    def _take_pending(self, requests: Sequence[Request], num_tokens: int) -> torch.Tensor | None:
        """The chain computed ahead for these requests (any subset of its batch, any
        order), or None; either way it is used at most once."""
        pending, self._pending = self._pending, None
        if pending is None or pending.tokens is None or num_tokens != pending.tokens.shape[1] or not requests:
            return None
        rows = self._pending_rows(pending, requests)
        if rows is None:
            return None
        return (
            pending.tokens
            if rows == list(range(len(pending.index)))
            else pending.tokens.index_select(0, self._index(rows))
        )

    def _take_pending_tree(self, requests: Sequence[Request]) -> DraftTree | None:
        """The trees grown ahead for these requests, or None (used at most once)."""
        pending, self._pending = self._pending, None
        if pending is None or pending.tree is None or not requests:
            return None
        rows = self._pending_rows(pending, requests)
        if rows is None:
            return None
        return (
            pending.tree
            if rows == list(range(len(pending.index)))
            else pending.tree.select(self._index(rows))
        )

    @staticmethod
    def _pending_rows(pending: _Pending, requests: Sequence[Request]) -> list[int] | None:
        rows = [pending.index.get(r.rid) for r in requests]
        return None if any(i is None for i in rows) else rows  # type: ignore[return-value]

    def _index(self, rows: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(rows), device=self.device)

    def propose_tree(self, requests: Sequence[Request], shape: TreeShape) -> DraftTree:
        """A greedy draft tree per request (see :mod:`..tree`). A request whose draft state
        was lost gets a tree whose drafts (-1) the target rejects: it gains one token."""
        ready = self._take_pending_tree(requests)
        if ready is not None:
            return ready
        live = [
            i
            for i, r in enumerate(requests)
            if (s := self._states.get(r.rid)) is not None and s.tail is not None
        ]
        reqs = [requests[i] for i in live]
        self._drop_speculative(reqs)
        if not reqs:
            return blank_tree(len(requests), shape, self.device)
        hidden = torch.stack([self._states[r.rid].tail for r in reqs])  # type: ignore[misc]
        grown = self.runner.draft_tree(
            [r.rid for r in reqs], hidden, shape, lora_names=self.adapters.names(reqs)
        )
        if len(reqs) == len(requests):
            return grown
        tree = blank_tree(len(requests), shape, self.device)
        rows = self._index(live)
        for mine, theirs in zip(tree.tensors(), grown.tensors(), strict=True):
            mine[rows] = theirs
        return tree

    def _can_propose_ahead(self, requests: Sequence[Request], width: int, steps: int | None = None) -> bool:
        """Whether the feed and the next proposal (``steps`` more entries per request; a
        chain's by default) can run as one replay for this batch."""
        if steps is None:
            steps = width - 2  # the next proposal is width - 1 tokens: the first, then steps
        if (
            steps < 0
            or not all(r.params.greedy for r in requests)
            or not self.runner.can_chain(len(requests))
        ):
            return False
        kv = self.runner.kv
        committed = [s.committed if (s := self._states.get(r.rid)) is not None else 0 for r in requests]
        if any(c + width + steps > kv.max_context_len for c in committed):
            return False  # near the context limit: feed only, propose next step
        # the feed first frees the entries of the last proposal past the committed ones
        freed = sum(max(0, kv.seq_len(r.rid) - c) for r, c in zip(requests, committed, strict=True))
        return kv.num_free_tokens + freed >= len(requests) * (width + steps)

    def _feed_ahead(
        self, requests: Sequence[Request], acceptance: Acceptance, feats: torch.Tensor, feed
    ) -> None:
        """Feed the verified positions and draft the next step (``feed``: the runner's
        ``feed_chain`` or ``feed_tree`` with its last argument bound) in one replay, queued
        before the host reads the acceptance (that read waits for the verify, not for this
        replay)."""
        bs, width = acceptance.tokens.shape
        self._drop_speculative(requests)
        ahead, tails = feed(
            [r.rid for r in requests],
            acceptance.tokens.clamp_min(0).reshape(-1),
            feats.reshape(bs * width, -1),
            acceptance.accept_lens,
            width,
            lora_names=self.adapters.names(requests),
        )
        self._commit(requests, [a + 1 for a in acceptance.host_accept_lens()], tails)
        index = {r.rid: i for i, r in enumerate(requests)}
        self._pending = (
            _Pending(index, None, ahead) if isinstance(ahead, DraftTree) else _Pending(index, ahead)
        )

    def _invalidate(self, requests: Sequence[Request]) -> None:
        """Drop a proposal computed ahead if any of these requests' draft state changes."""
        if self._pending is not None and any(r.rid in self._pending.index for r in requests):
            self._pending = None

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        """Called before the host has read ``acceptance`` (the decoder's contract), so the
        feed and the next proposal queue right behind the verify on the device. After a
        tree verify the fed positions are the accepted path's nodes."""
        self._pending = None
        feats = self._features(output)
        bs, k = len(requests), acceptance.tokens.shape[1]
        if acceptance.path is not None:
            feats = acceptance.along_path(feats.view(bs, -1, feats.shape[-1]))
            shape = self.tree_shape
            if shape is not None and self._can_propose_ahead(requests, k, shape.entries):
                self._feed_ahead(
                    requests, acceptance, feats, functools.partial(self.runner.feed_tree, shape=shape)
                )
                return
        else:
            feats = feats.view(bs, k, -1)
        if acceptance.path is None and self._can_propose_ahead(requests, k):
            self._feed_ahead(
                requests, acceptance, feats, functools.partial(self.runner.feed_chain, num_tokens=k - 1)
            )
            return
        graphs = self.runner.graphs
        if graphs is not None and graphs.can_run(len(requests)):
            keep = [a + 1 for a in acceptance.host_accept_lens()]
            self._append_verified(requests, acceptance.tokens, feats, keep)
            return
        items = []
        for i, (req, accepted) in enumerate(zip(requests, acceptance.host_accept_lens(), strict=True)):
            n = accepted + 1
            items.append((req, acceptance.tokens[i, :n], feats[i, :n]))
        self._append(items)

    def on_decode(self, requests: Sequence[Request], tokens: Sequence[int], output: ForwardOutput) -> None:
        self._invalidate(requests)
        # The decoded position's feature and the token that followed it: the same pair a
        # verify that accepted no draft would commit.
        feats = self._features(output)
        self._append(
            [
                (req, torch.tensor([int(tok)], dtype=torch.int64), feats[i : i + 1])
                for i, (req, tok) in enumerate(zip(requests, tokens, strict=True))
            ]
        )

    def release(self, request: Request) -> None:
        self._invalidate([request])
        self._states.pop(request.rid, None)
        self.runner.release(request.rid)
        self.adapters.release(request)


def blank_tree(batch_size: int, shape: TreeShape, device: torch.device) -> DraftTree:
    """Trees whose drafts (-1) no target accepts: every node a child of the root."""
    n = shape.num_nodes
    parents = torch.zeros(batch_size, n, dtype=torch.long, device=device)
    parents[:, 0] = -1
    depths = (parents >= 0).long()
    tokens = torch.full((batch_size, n), -1, dtype=torch.long, device=device)
    return DraftTree(tokens, parents, depths, ancestor_closure(parents, shape.num_steps), shape.num_steps)
