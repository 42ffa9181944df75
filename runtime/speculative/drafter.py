"""The one interface every drafter implements, and how a drafter picks its tokens.

A drafter proposes ``n`` tokens per request WITHOUT any adapter. It sees the target
only through what the decoder hands it: the target's extend and verify outputs (hidden
states, for EAGLE) and the acceptance decided after verify. Per-request state (a draft
KV cache, an n-gram index) lives in the drafter and is released in :meth:`release`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..engine.request import Request
from ..runner.forward_batch import ForwardOutput
from ..sampling import Sampler, processed_probs
from .acceptance import Acceptance, sample_from_probs


@dataclass
class DraftProposal:
    """``tokens``: int64 ``[bs, n]``; ``probs``: the draft's distributions ``[bs, n, vocab]``
    the tokens were drawn from, or None when every proposal is deterministic (one-hot)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes tokens for a batch of decoding requests."""

    needs_hidden: bool
    """The target must return its final hidden states in extend and verify (EAGLE)."""
    hidden_layers: tuple[int, ...] | None
    """Residual streams the target must return (EAGLE3), or None."""

    def on_extend(
        self, chunks: Sequence[tuple[Request, int]], output: ForwardOutput, first_tokens: Sequence[int | None]
    ) -> None:
        """The target ran prefill chunks; ``first_tokens[i]`` is the token sampled for a chunk
        that completed its request's prefill (else None)."""

    def propose(self, requests: Sequence[Request], num_tokens: int) -> DraftProposal:
        """``num_tokens`` drafts per request, continuing ``request.all_ids``."""

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        """The target verified the last proposal; drop rejected draft state, keep the rest.

        Called before the decoder reads ``acceptance`` on the host: device work queued here
        runs right behind the verify. ``acceptance.host()`` (cached, one copy for all
        readers) is where the host waits, for the verify only: its copy was staged before
        this call, so the work queued here keeps the device busy while the host goes on."""

    def on_decode(self, requests: Sequence[Request], tokens: Sequence[int], output: ForwardOutput) -> None:
        """The target decoded one token per request without drafting (a batch too large to
        draft for): ``tokens[i]`` follows ``requests[i].last_token``; ``output`` has one row
        per request (with hidden states when the drafter needs them)."""

    def release(self, request: Request) -> None:
        """Forget a request (finished, retracted, or its draft state is no longer trusted)."""


def fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary: extra columns dropped, missing ones -inf."""
    have = logits.shape[-1]
    if have == vocab_size:
        return logits
    if have > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def choose_drafts(
    logits: torch.Tensor, requests: Sequence[Request], sampler: Sampler
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token per row of ``logits`` ``[bs, vocab]``.

    Greedy requests take the argmax (a one-hot draft distribution). Sampling requests
    draw from the draft's distribution under their own temperature / top-k / top-p, with
    their own generator, which is what lets rejection sampling accept more than a greedy
    draft would. Returns ``(tokens [bs], probs [bs, vocab] or None when all are greedy)``.
    """
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(requests) if not r.params.greedy]
    if not sampled:
        return tokens, None
    probs = processed_probs(logits.float(), [r.params for r in requests])
    rows = torch.tensor(sampled, device=logits.device)
    u = sampler.uniform([requests[i].generator for i in sampled])[:, 0].to(logits.device)
    tokens[rows] = sample_from_probs(probs.index_select(0, rows), u)
    return tokens, probs
