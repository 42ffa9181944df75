"""STANDALONE drafting: a small model with the target's tokenizer, its own runner and KV.

The draft's cache mirrors the request's tokens: during prefill it runs the same chunks
as the target; per step it decodes the last committed token, then one token per draft,
and finally caches the last draft as well. After verify, entries of rejected drafts are
truncated, so the cache holds every committed token but the target's newest one, and
every step is made of decodes only (which CUDA graphs replay). A request whose draft
cache is behind (new, or re-synced after a failure) first catches up in one extend. The draft runner has no adapter pool
(``lora is None``): every adapter's requests get the same, base-model proposals.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraserve.kernels import ForwardMode

from ..engine.request import Request
from ..model.forward_batch import ForwardBatch, ForwardOutput
from ..sampling import Sampler
from .acceptance import Acceptance
from .drafter import DraftProposal, choose_drafts, fit_vocab


class StandaloneDrafter:
    """Drives a draft ``ModelRunner`` (``is_draft=True``)."""

    needs_hidden = False
    hidden_layers = None

    def __init__(self, runner, sampler: Sampler, vocab_size: int):
        if getattr(runner, "lora", None) is not None:
            raise ValueError("a STANDALONE draft runner must have no adapter pool (lora is None)")
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size  # the target's
        self.device = runner.device

    @property
    def lora(self):
        return self.runner.lora

    def _cached(self, req: Request) -> int:
        return self.runner.kv.seq_len(req.rid)

    def _catch_up(self, chunks: Sequence[tuple[Request, int]], *, last_logits: bool) -> torch.Tensor | None:
        """Extend the draft by ``all_ids[cached : end]`` per request; returns last-row logits."""
        rids, lens, ids = [], [], []
        for req, end in chunks:
            start = self._cached(req)
            if start > end:  # stale state (should not happen): start this request over
                self.runner.kv.free(req.rid)
                start = 0
            if end > start:
                rids.append(req.rid)
                lens.append(end - start)
                ids.extend(req.all_ids[start:end])
        if not rids:
            return None
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            request_ids=rids,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            extend_lens=lens,
        )
        logits = self.runner.forward(batch).logits
        return logits if last_logits else None

    def on_extend(
        self, chunks: Sequence[tuple[Request, int]], output: ForwardOutput, first_tokens: Sequence[int | None]
    ) -> None:
        # Mirror the target's prefill chunk by chunk, so a long prompt never lands in one
        # draft forward during a decode step.
        self._catch_up([(req, req.num_cached + n) for req, n in chunks], last_logits=False)

    def propose(self, requests: Sequence[Request], num_tokens: int) -> DraftProposal:
        bs = len(requests)
        tokens = torch.empty(bs, num_tokens, dtype=torch.int64, device=self.device)
        if num_tokens == 0:
            return DraftProposal(tokens)
        rids = [r.rid for r in requests]
        if all(self._cached(r) == r.num_tokens - 1 for r in requests):
            # The usual case: only the last committed token is new, a (graph-able) decode.
            last = torch.tensor([r.last_token for r in requests], dtype=torch.int64, device=self.device)
            logits = self.runner.forward(
                ForwardBatch(mode=ForwardMode.DECODE, request_ids=rids, input_ids=last)
            ).logits
        else:  # a fresh or re-synced request: catch up on everything not yet cached
            logits = self._catch_up([(req, req.num_tokens) for req in requests], last_logits=True)
        assert logits is not None and logits.shape[0] == bs
        probs: list[torch.Tensor | None] = []
        for j in range(num_tokens):
            if j > 0:
                batch = ForwardBatch(
                    mode=ForwardMode.DECODE, request_ids=rids, input_ids=tokens[:, j - 1].contiguous()
                )
                logits = self.runner.forward(batch).logits
            step_tokens, step_probs = choose_drafts(
                fit_vocab(logits, self.vocab_size), requests, self.sampler
            )
            tokens[:, j] = step_tokens
            probs.append(step_probs)
        # Cache the last draft too, so that after verify only the target's own token is
        # new and the next step again starts with a decode.
        self.runner.forward(
            ForwardBatch(mode=ForwardMode.DECODE, request_ids=rids, input_ids=tokens[:, -1].contiguous())
        )
        if all(p is None for p in probs):
            return DraftProposal(tokens)
        return DraftProposal(tokens, torch.stack(probs, dim=1))  # type: ignore[arg-type]

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        # The cache holds all_ids (before this step) plus every draft; keep the accepted ones.
        for req, accepted in zip(requests, acceptance.accept_lens.tolist(), strict=True):
            keep = req.num_tokens + accepted
            held = self._cached(req)
            if held > keep:
                self.runner.kv.truncate(req.rid, held - keep)

    def release(self, request: Request) -> None:
        self.runner.kv.free(request.rid)
