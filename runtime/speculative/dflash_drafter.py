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

A request whose draft state was lost (a failed step) drafts from whatever context the
draft has gained since; its proposals are then poor but the target's verify keeps the
output exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..engine.request import Request
from ..runner.forward_batch import ForwardOutput
from ..sampling import Sampler
from .acceptance import Acceptance
from .dflash_runner import DFlashDraftRunner
from .drafter import DraftProposal, choose_drafts


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
        last = torch.tensor([r.last_token for r in requests], dtype=torch.int64)
        logits = self.runner.draft_block([r.rid for r in requests], last, num_tokens + 1)
        if all(r.params.greedy for r in requests):
            return DraftProposal(logits.argmax(dim=-1))
        tokens = torch.empty(bs, num_tokens, dtype=torch.int64, device=self.device)
        probs = []
        for j in range(num_tokens):
            tokens[:, j], step = choose_drafts(logits[:, j], requests, self.sampler)
            assert step is not None  # a sampled request is in the batch
            probs.append(step)
        return DraftProposal(tokens, torch.stack(probs, dim=1))

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        # Committed now: the verified last token and the accepted drafts, rows 0..accepted.
        bs, width = acceptance.tokens.shape
        if acceptance.path is not None:
            raise RuntimeError("a DFLASH draft verifies chains only (speculative.top_k 1)")
        feats = self._features(output).view(bs, width, -1)
        keep = [a + 1 for a in acceptance.host_accept_lens()]
        rows = torch.cat([feats[i, :n] for i, n in enumerate(keep)])
        self.runner.append_context([r.rid for r in requests], rows, keep)

    def on_decode(self, requests: Sequence[Request], tokens: Sequence[int], output: ForwardOutput) -> None:
        # The decoded row is the position of each request's last token: committed context.
        self.runner.append_context([r.rid for r in requests], self._features(output), [1] * len(requests))

    def release(self, request: Request) -> None:
        self.runner.release(request.rid)
