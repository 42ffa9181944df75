"""STANDALONE drafting: a small model with the target's tokenizer, its own runner and KV.

The draft's cache mirrors the request's tokens: during prefill it runs the same chunks
as the target; per step it decodes the last committed token, then one token per draft
but the last (which nothing reads). After verify, entries of rejected drafts are
truncated, so the cache holds every committed token but the target's newest one; when
every draft was accepted it also lacks the last draft. The next step then starts with one
uniform two-token forward (each request's last two committed tokens; a request missing
only one drops its newest cached entry and recomputes it), so every step is made of
fixed-width forwards that CUDA graphs replay, and no step pays a forward only to cache
the last draft. A request whose draft cache is further behind (new, or re-synced after a
failure) first catches up in one extend. The draft runner never holds the target's
adapters; its own pool, when the serve has one (``speculative.draft_max_loras``), holds
draft adapters: a request whose Adapter has one drafts with it (:mod:`..draft_adapters`),
every other request gets the base draft's proposals.

Prefix caching (``scheduler.prefix_cache``): without draft adapters the draft's KV depends
on the tokens alone, so its pool keeps a prefix cache of its own under one key: a request
starts its draft on the longest cached prefix of its tokens (whatever its target adapter)
and leaves its committed tokens' draft KV cached when it ends or is retracted. With draft
adapters the draft prefills each prompt whole (the target still reuses its own prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraserve.kernels import ForwardMode

from ...engine.request import Request
from ...runner.forward_batch import ForwardBatch, ForwardOutput
from ...sampling import Sampler
from ..acceptance import Acceptance
from ..draft_adapters import DraftAdapterLeases
from ..drafter import DraftProposal, choose_drafts, fit_vocab


class StandaloneDrafter:
    """Drives a draft ``ModelRunner`` (``is_draft=True``)."""

    needs_hidden = False
    hidden_layers = None

    def __init__(self, runner, sampler: Sampler, vocab_size: int):
        if not getattr(runner, "is_draft", False):
            raise ValueError("a STANDALONE drafter drives a draft runner (is_draft=True)")
        self.runner = runner
        self.adapters = DraftAdapterLeases(runner.lora)
        self.sampler = sampler
        self.vocab_size = vocab_size  # the target's
        self.device = runner.device
        # The draft's KV depends on the tokens alone (no draft adapters): one prefix-cache
        # key for every request, whatever its target adapter.
        self._prefix_cache = getattr(runner.kv, "prefix", None) is not None and runner.lora is None

    @property
    def lora(self):
        return self.runner.lora

    def _cached(self, req: Request) -> int:
        return self.runner.kv.seq_len(req.rid)

    def _catch_up(self, chunks: Sequence[tuple[Request, int]], *, last_logits: bool) -> torch.Tensor | None:
        """Extend the draft by ``all_ids[cached : end]`` per request; returns last-row logits."""
        rids, lens, ids, names = [], [], [], []
        for req, end in chunks:
            start = self._cached(req)
            if start > end:  # stale state (should not happen): start this request over
                self.runner.kv.free(req.rid)
                start = 0
            if start == 0 and self._prefix_cache:  # a cached prefix of the draft's own KV
                start = self.runner.kv.match_prefix(req.rid, DRAFT_KEY, req.all_ids[:end])
            if end > start:
                rids.append(req.rid)
                lens.append(end - start)
                ids.extend(req.all_ids[start:end])
                names.append(self.adapters.name_for(req))
        if not rids:
            return None
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            request_ids=rids,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            extend_lens=lens,
            lora_names=names if self.runner.lora is not None else None,
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
        names = self.adapters.names(requests)
        missing = [r.num_tokens - self._cached(r) for r in requests]
        if all(m == 1 for m in missing):
            # The usual case: only the last committed token is new, a (graph-able) decode.
            last = torch.tensor([r.last_token for r in requests], dtype=torch.int64)
            logits = self.runner.forward(
                ForwardBatch(
                    mode=ForwardMode.DECODE,
                    request_ids=rids,
                    input_ids=last.to(self.device, non_blocking=True),
                    lora_names=names,
                )
            ).logits
        elif all(m in (1, 2) for m in missing) and all(r.num_tokens >= 2 for r in requests):
            logits = self._two_token_step(requests, missing)
        else:  # a fresh or re-synced request: catch up on everything not yet cached
            logits = self._catch_up([(req, req.num_tokens) for req in requests], last_logits=True)
        assert logits is not None and logits.shape[0] == bs
        probs: list[torch.Tensor | None] = []
        for j in range(num_tokens):
            if j > 0:
                batch = ForwardBatch(
                    mode=ForwardMode.DECODE,
                    request_ids=rids,
                    input_ids=tokens[:, j - 1].contiguous(),
                    lora_names=names,
                )
                logits = self.runner.forward(batch).logits
            step_tokens, step_probs = choose_drafts(
                fit_vocab(logits, self.vocab_size), requests, self.sampler
            )
            tokens[:, j] = step_tokens
            probs.append(step_probs)
        if all(p is None for p in probs):
            return DraftProposal(tokens)
        return DraftProposal(tokens, torch.stack(probs, dim=1))  # type: ignore[arg-type]

    def _two_token_step(self, requests: Sequence[Request], missing: Sequence[int]) -> torch.Tensor:
        """One fixed-width forward over each request's last two committed tokens (after a
        step that accepted every draft, the last draft and the bonus token are both new);
        returns each request's last-row logits."""
        for req, m in zip(requests, missing, strict=True):
            if m == 1:
                self.runner.kv.truncate(req.rid, 1)  # recompute it: every row has width 2
        ids = [tok for req in requests for tok in _last_two(req)]
        out = self.runner.forward(
            ForwardBatch(
                mode=ForwardMode.TARGET_VERIFY,
                request_ids=[r.rid for r in requests],
                input_ids=torch.tensor(ids, dtype=torch.int64).to(self.device, non_blocking=True),
                num_draft_tokens=2,
                lora_names=self.adapters.names(requests),
            )
        )
        return out.logits.view(len(requests), 2, -1)[:, 1]

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        # The cache holds all_ids (before this step) plus every draft the draft model read
        # (all but the last); keep the accepted ones.
        for req, accepted in zip(requests, acceptance.host_accept_lens(), strict=True):
            keep = req.num_tokens + accepted
            held = self._cached(req)
            if held > keep:
                self.runner.kv.truncate(req.rid, held - keep)

    def on_decode(self, requests: Sequence[Request], tokens: Sequence[int], output: ForwardOutput) -> None:
        """Nothing now: the draft cache falls behind and catches up in one extend when
        drafting resumes (``propose``), rather than paying a draft forward every step."""

    def release(self, request: Request) -> None:
        self.runner.kv.free(request.rid)
        self.adapters.release(request)

    def finish(self, request: Request) -> None:
        """The request leaves (finished or retracted, not failed): between steps the draft's
        entries hold its committed tokens, which stay cached for the next request (with a
        prefix cache; else as :meth:`release`)."""
        if self._prefix_cache:
            self.runner.kv.cache_and_free(request.rid, DRAFT_KEY, request.all_ids)
        self.release(request)


DRAFT_KEY = ("draft", None)
"""The draft pool's one prefix-cache key (its KV depends on no adapter)."""


def _last_two(req: Request) -> list[int]:
    """The request's last two committed tokens (it has at least two)."""
    out = req.output_ids
    if len(out) >= 2:
        return out[-2:]
    return [*req.prompt_ids[-(2 - len(out)) :], *out]
