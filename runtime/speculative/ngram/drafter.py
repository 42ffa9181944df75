"""NGRAM drafting: prompt lookup over each request's own tokens, no model at all."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...engine.request import Request
from ...runner.forward_batch import ForwardOutput
from ..acceptance import Acceptance
from ..drafter import DraftProposal
from .index import NgramIndex


class NgramDrafter:
    """Keeps one incremental :class:`NgramIndex` per request."""

    needs_hidden = False
    hidden_layers = None
    lora = None  # no model, so certainly no adapter

    def __init__(self, ngram_min: int, ngram_max: int, device: torch.device | str = "cpu"):
        NgramIndex(ngram_min, ngram_max)  # validates the bounds once, up front
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.device = torch.device(device)
        self._indexes: dict[str, NgramIndex] = {}

    def on_extend(
        self, chunks: Sequence[tuple[Request, int]], output: ForwardOutput, first_tokens: Sequence[int | None]
    ) -> None:
        return None  # the index is brought up to date lazily from all_ids

    def propose(self, requests: Sequence[Request], num_tokens: int) -> DraftProposal:
        rows = []
        for req in requests:
            index = self._indexes.get(req.rid)
            ids = req.all_ids
            if index is None or len(index) > len(ids):
                index = self._indexes[req.rid] = NgramIndex(self.ngram_min, self.ngram_max)
            index.extend(ids[len(index) :])
            rows.append(index.propose(num_tokens)[0])
        tokens = torch.tensor(rows, dtype=torch.int64).view(len(requests), num_tokens)
        return DraftProposal(tokens=tokens.to(self.device, non_blocking=True))

    def on_verify(self, requests: Sequence[Request], acceptance: Acceptance, output: ForwardOutput) -> None:
        return None

    def on_decode(self, requests: Sequence[Request], tokens: Sequence[int], output: ForwardOutput) -> None:
        return None  # as on_extend: the index catches up from all_ids

    def release(self, request: Request) -> None:
        self._indexes.pop(request.rid, None)
