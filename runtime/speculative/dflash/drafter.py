"""DFLASH drafting: a whole block of drafts in ONE draft forward, from the target's features.

The target captures the residual streams of the draft's chosen layers in every extend,
verify and plain decode forward (``hidden_layers``); the drafter appends the rows of the
positions that are now committed to the draft's KV (:class:`.DFlashDraftRunner`): each
prefill chunk's rows, each verify's last committed token and accepted drafts, each plain
decode's row. So before a step the draft holds one context entry per position the target
has computed, every committed token but the newest.

A step drafts the block ``[newest token, mask × (width - 1)]`` right after that context,
through the target's BASE embedding, the draft layers (non-causal inside the block) and
the target's BASE LM head: ``width - 1`` drafts, which the decoder verifies in one
target-verify forward of ``width`` rows per request, each with its own adapter. Nothing
of the draft depends on an adapter: no LoRA manager, the base weights only.

Greedy requests take each position's argmax. Sampling requests draw each position from
the draft's distribution there (under their temperature / top-k / top-p, with their own
generator): the positions are drawn independently given the context, which is a valid
proposal distribution for rejection sampling, so sampled output stays exact.

After a greedy verify of a batch the graphs hold, :meth:`DFlashDrafter.on_verify` queues
the append of the verified rows and the next step's block as one replay before it reads
the acceptance on the host (:meth:`.DFlashDraftRunner.feed_block`); :meth:`DFlashDrafter.propose`
then hands out those drafts without launching anything (a request whose context changed
since, by a step without drafting or a new prefill, drops out of them). The GPU goes from
the verify straight into the draft while the host does the step's bookkeeping.

A request whose draft state was lost (a failed step) drafts from whatever context the
draft has gained since; its proposals are then poor but the target's verify keeps the
output exact.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from ...engine.request import Request
from ...runner.forward_batch import ForwardOutput
from ...sampling import Sampler
from ..acceptance import Acceptance
from ..drafter import DraftProposal, choose_drafts
from .runner import DFlashDraftRunner


@dataclass
class _Pending:
    """The next greedy block, drafted with the append after a verify (see :meth:`DFlashDrafter.propose`)."""

    index: dict[Hashable, int]  # request id -> its row of ``tokens``
    tokens: torch.Tensor  # int64 [bs, width - 1] on the device


class DFlashDrafter:
    """Drives a :class:`DFlashDraftRunner` from the target's captured layer outputs."""

    needs_hidden = False
    supports_trees = False  # a block is one chain; trees are refused by the policy

    def __init__(self, runner: DFlashDraftRunner, sampler: Sampler, vocab_size: int):
        if getattr(runner, "lora", None) is not None:
            raise ValueError("a DFLASH draft runner must have no adapter pool (lora is None)")
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size  # the target's
        self.device = runner.device
        self.hidden_layers: tuple[int, ...] = runner.capture_layers
        self._pending: _Pending | None = None

    @property
    def lora(self):
        return self.runner.lora

    def _features(self, output: ForwardOutput) -> torch.Tensor:
        feats = output.aux_hidden_states
        if feats is None:
            raise RuntimeError(
                "the target forward returned no layer outputs for the DFLASH draft (hidden_layers unset)"
            )
        return feats

    def on_extend(
        self, chunks: Sequence[tuple[Request, int]], output: ForwardOutput, first_tokens: Sequence[int | None]
    ) -> None:
        # Every prefill row is a committed position (a prompt token): all of them are context.
        self._forget_pending([req for req, _ in chunks])
        for req, _ in chunks:
            if req.num_cached == 0:
                self.release(req)  # a (re-)prefill from scratch: nothing earlier is valid
        self.runner.append_context(
            [req.rid for req, _ in chunks], self._features(output), [n for _, n in chunks]
        )

    def propose(self, requests: Sequence[Request], num_tokens: int) -> DraftProposal:
        bs = len(requests)
        if num_tokens == 0:
            return DraftProposal(torch.empty(bs, 0, dtype=torch.int64, device=self.device))
        ready = self._take_pending(requests, num_tokens)
        if ready is not None:
            return DraftProposal(ready)
        last = torch.tensor([r.last_token for r in requests], dtype=torch.int64)
        greedy, hidden = self.runner.draft([r.rid for r in requests], last, num_tokens + 1)
        if all(r.params.greedy for r in requests):
            return DraftProposal(greedy)
        logits = self.runner.compute_logits(hidden)
        tokens = torch.empty(bs, num_tokens, dtype=torch.int64, device=self.device)
        probs = []
        for j in range(num_tokens):
            tokens[:, j], step = choose_drafts(logits[:, j], requests, self.sampler)
            assert step is not None  # a sampled request is in the batch
            probs.append(step)
        return DraftProposal(tokens, torch.stack(probs, dim=1))

    def _take_pending(self, requests: Sequence[Request], num_tokens: int) -> torch.Tensor | None:
        """The greedy block drafted ahead for these requests (any subset of its batch, any
        order; each row depends on its own request only), or None; used at most once."""
        pending, self._pending = self._pending, None
        if pending is None or num_tokens != pending.tokens.shape[1] or not requests:
            return None
        rows = [pending.index.get(r.rid) for r in requests]
        if any(i is None for i in rows):
            return None
        if rows == list(range(pending.tokens.shape[0])):
            return pending.tokens
        return pending.tokens.index_select(0, torch.tensor(rows, device=pending.tokens.device))

    def _forget_pending(self, requests: Sequence[Request]) -> None:
        """These requests' context changed: their rows of a block drafted ahead are stale."""
        if self._pending is not None:
            for req in requests:
                self._pending.index.pop(req.rid, None)

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        """Called before the host has read ``acceptance`` (the decoder's contract). A greedy
        batch the graphs hold appends the verified rows and drafts its next block in one
        replay queued right behind the verify (:meth:`.DFlashDraftRunner.feed_block`); else
        the verified rows go in and the rejected ones are dropped."""
        # Committed now: the verified last token and the accepted drafts, rows 0..accepted.
        self._pending = None
        bs, width = acceptance.tokens.shape
        if acceptance.path is not None:
            raise RuntimeError("a DFLASH draft verifies chains only (speculative.top_k 1)")
        rids = [r.rid for r in requests]
        feats = self._features(output)
        if all(r.params.greedy for r in requests) and self.runner.can_feed_block(rids, width):
            ahead = self.runner.feed_block(rids, feats, acceptance.tokens, acceptance.accept_lens, width)
            keep = [a + 1 for a in acceptance.host_accept_lens()]  # waits for the verify only
            self.runner.keep_context(rids, 2 * width, keep)
            self._pending = _Pending({rid: i for i, rid in enumerate(rids)}, ahead)
            return
        keep = [a + 1 for a in acceptance.host_accept_lens()]
        if self.runner.can_graph(bs):
            # One uniform (graph-replayed) append of every verified row, then the rejected
            # rows dropped: context entries are never queries, so no kept row read them.
            self.runner.append_context(rids, feats, [width] * bs)
            self.runner.keep_context(rids, width, keep)
            return
        rows = torch.cat([feats.view(bs, width, -1)[i, :n] for i, n in enumerate(keep)])
        self.runner.append_context(rids, rows, keep)

    def on_decode(self, requests: Sequence[Request], tokens: Sequence[int], output: ForwardOutput) -> None:
        # The decoded row is the position of each request's last token: committed context.
        self._forget_pending(requests)
        self.runner.append_context([r.rid for r in requests], self._features(output), [1] * len(requests))

    def release(self, request: Request) -> None:
        self._forget_pending([request])
        self.runner.release(request.rid)
