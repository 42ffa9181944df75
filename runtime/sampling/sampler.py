"""Batched sampling: greedy, temperature, min-p, top-k, top-p, with per-request seeds.

One token per row of a ``[bs, vocab]`` logits tensor, vectorised over the batch. Random
rows are drawn by inverse-CDF sampling from one uniform number per row; a request with a
seed draws its number from its own ``torch.Generator`` (on the host), so its tokens do not
depend on which other requests share the batch or on how many tokens they drew. Requests
without a seed draw from the sampler's shared generator.

Log-probabilities reported for chosen tokens are those of the model's raw distribution
(``log_softmax`` of the unscaled logits), as OpenAI-compatible servers report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams


@dataclass
class SampleOutput:
    """Chosen tokens (host, int64 ``[bs]``) and, when asked, their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float] | None = None


def make_generator(seed: int | None) -> torch.Generator | None:
    """A host generator for a request's seed, or ``None`` for an unseeded request."""
    if seed is None:
        return None
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


@dataclass
class _Filters:
    """The per-row filter settings of a batch, as tensors on the logits' device."""

    temps: torch.Tensor  # float32 [bs], > 0
    top_ps: torch.Tensor  # float32 [bs]
    top_ks: torch.Tensor  # int64 [bs], 0: off
    min_ps: torch.Tensor | None  # float32 [bs]; None when no row sets min_p
    needs_sort: bool  # some row filters (top-k, top-p or min_p)


def _filter_params(params: Sequence[SamplingParams], device: torch.device) -> _Filters:
    temps = torch.tensor([max(p.temperature, 1e-6) for p in params], dtype=torch.float32, device=device)
    top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else 0 for p in params], dtype=torch.int64, device=device)
    min_ps = None
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
    needs_sort = min_ps is not None or any(p.top_p < 1.0 or p.top_k > 0 for p in params)
    return _Filters(temps, top_ps, top_ks, min_ps, needs_sort)


def _sorted_filtered_probs(logits: torch.Tensor, f: _Filters) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities in descending-logit order after temperature, min-p, top-k and top-p
    (vLLM's order).

    Returns ``(probs_sorted, order)``; ``order[i, j]`` is the vocabulary id at sorted
    position ``j``. Filtered entries are exactly zero; rows are not renormalised (the
    inverse-CDF draw scales by the row total).
    """
    scaled = logits.float() / f.temps[:, None]
    values, order = torch.sort(scaled, dim=-1, descending=True)
    if f.min_ps is not None:
        # min_p against the top token's probability (position 0) over the whole vocabulary;
        # a token exactly at the threshold stays. min_p 0 removes nothing.
        full = torch.softmax(values, dim=-1)
        values = values.masked_fill(full < f.min_ps[:, None] * full[:, :1], float("-inf"))
    vocab = values.shape[-1]
    positions = torch.arange(vocab, device=values.device)[None, :]
    k = torch.where(f.top_ks > 0, f.top_ks, torch.full_like(f.top_ks, vocab))
    values = values.masked_fill(positions >= k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    exclusive = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(exclusive >= f.top_ps[:, None], 0.0)
    return probs, order


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, ``[bs, vocab]`` float32, rows summing to 1.

    Greedy rows are one-hot on the argmax. This is the target distribution rejection
    sampling must preserve.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [{len(params)}, vocab], got {tuple(logits.shape)}")
    probs_sorted, order = _sorted_filtered_probs(logits, _filter_params(params, logits.device))
    probs = torch.zeros_like(probs_sorted).scatter_(1, order, probs_sorted)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.any()):
        onehot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(probs.dtype)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


class Sampler:
    """Samples one token per row; owns the generator of unseeded requests."""

    def __init__(self, seed: int = 0) -> None:
        self._shared = torch.Generator(device="cpu")
        self._shared.manual_seed(seed)

    def uniform(self, generators: Sequence[torch.Generator | None], count: int = 1) -> torch.Tensor:
        """``[len(generators), count]`` uniforms in [0, 1), float64 on the host.

        Row ``i`` comes from ``generators[i]`` when set, else from the shared generator.
        Speculative acceptance uses this too, so seeded runs stay reproducible.
        """
        out = torch.empty(len(generators), count, dtype=torch.float64)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            out[shared_rows] = torch.rand(
                len(shared_rows), count, generator=self._shared, dtype=torch.float64
            )
        for i, g in enumerate(generators):
            if g is not None:
                out[i] = torch.rand(count, generator=g, dtype=torch.float64)
        return out

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> SampleOutput:
        """Pick one token per row of ``logits`` ``[bs, vocab]``."""
        bs = len(params)
        if logits.dim() != 2 or logits.shape[0] != bs or len(generators) != bs:
            raise ValueError(
                f"logits {tuple(logits.shape)}, {bs} params and {len(generators)} generators must agree"
            )
        if bs == 0:
            return SampleOutput([], [] if any(p.logprobs for p in params) else None)
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            sub = logits.index_select(0, rows)
            sub_params = [params[i] for i in sampled_rows]
            u = self.uniform([generators[i] for i in sampled_rows])[:, 0]
            tokens[rows] = self._draw(sub, sub_params, u.to(device=logits.device, dtype=torch.float32))
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0].tolist()
        return SampleOutput(tokens.tolist(), logprobs)

    @staticmethod
    def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
        f = _filter_params(params, logits.device)
        if f.needs_sort:
            probs, order = _sorted_filtered_probs(logits, f)
        else:
            probs, order = torch.softmax(logits / f.temps[:, None], dim=-1), None
        cdf = torch.cumsum(probs, dim=-1)
        total = cdf[:, -1]
        # u < 1, but u * total can round up to total; stay strictly below it.
        x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        idx = torch.searchsorted(cdf, x[:, None], right=True)[:, 0]
        idx = idx.clamp_(max=probs.shape[-1] - 1)
        if order is None:
            return idx
        return order.gather(1, idx[:, None])[:, 0]
