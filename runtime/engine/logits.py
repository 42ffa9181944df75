"""From a forward's logits to what a request sees: processed logits, logprobs, prompt logprobs.

Every decoder goes through here, so a plain step, a prefill's first token and each position
of a speculative verify apply the same logit processing (:mod:`..sampling.processors`)
and report log-probabilities the same way: those of the model's raw distribution (before
processing, temperature and filters), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sampling.processors import RowState, needs_processing, process_logits
from .request import PromptLogprobs, Request, TopLogprobs


def _state(req: Request) -> RowState:
    allowed = req.constraint.allowed() if req.constraint is not None else None
    return RowState(req.params, req.prompt_ids, req.output_ids, allowed)


def processed(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Row ``i`` of ``logits`` (the next token of ``requests[i]``) after its processing."""
    if not needs_processing([r.params for r in requests]):
        return logits
    return process_logits(logits, [_state(r) if r.params.processes_logits else None for r in requests])


def processed_verify(logits: torch.Tensor, requests: Sequence[Request], drafts: torch.Tensor) -> torch.Tensor:
    """A chain verify's logits ``[bs * k, vocab]`` after processing: row ``(i, j)`` as a
    plain step would process it after request ``i`` had emitted ``drafts[i, :j]``.

    Reads the drafts on the host (one copy, only when some request processes its logits)."""
    if not needs_processing([r.params for r in requests]):
        return logits
    bs, width = drafts.shape[0], drafts.shape[1] + 1
    host = drafts.tolist()
    rows: list[RowState | None] = []
    for req, row in zip(requests, host, strict=True):
        if not req.params.processes_logits:
            rows.extend([None] * width)
            continue
        masks = req.constraint.verify_masks(row) if req.constraint is not None else None
        base = RowState(req.params, req.prompt_ids, req.output_ids)
        rows.extend(base.after(row[:j], None if masks is None else masks[j]) for j in range(width))
    assert len(rows) == bs * width
    return process_logits(logits, rows)


def token_logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, requests: Sequence[Request]
) -> tuple[list[list[float]] | None, list[list[TopLogprobs]] | None]:
    """Log-probabilities of ``tokens`` ``[bs, n]`` (``-1``: none) under the raw logits
    ``[bs * n, vocab]``, and the ``top_logprobs`` alternatives of each position, per request
    (None for requests that did not ask, or when none did)."""
    if not any(r.params.logprobs for r in requests):
        return None, None
    bs, n = tokens.shape
    logp = torch.log_softmax(raw_logits.float().view(bs, n, -1), dim=-1)
    chosen = logp.gather(2, tokens.clamp_min(0)[..., None])[..., 0].tolist()
    logprobs = [row if r.params.logprobs else None for r, row in zip(requests, chosen, strict=True)]
    top_n = max(r.params.top_logprobs for r in requests)
    if top_n == 0:
        return logprobs, None
    values, ids = logp.topk(top_n, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    tops = [
        [
            list(zip(ids[i][j][: r.params.top_logprobs], values[i][j][: r.params.top_logprobs], strict=True))
            for j in range(n)
        ]
        if r.params.top_logprobs
        else None
        for i, r in enumerate(requests)
    ]
    return logprobs, tops


def wants_prompt_logprobs(chunks: Sequence[tuple[Request, int]]) -> bool:
    """Whether a prefill batch must return the logits of every position."""
    return any(req.params.prompt_logprobs is not None and not req.output_ids for req, _ in chunks)


def last_rows(chunks: Sequence[tuple[Request, int]], all_logits: torch.Tensor) -> torch.Tensor:
    """Each chunk's last position from an every-position logits tensor."""
    ends, total = [], 0
    for _, n in chunks:
        total += n
        ends.append(total - 1)
    return all_logits.index_select(0, torch.tensor(ends, device=all_logits.device))


def gather_prompt_logprobs(chunks: Sequence[tuple[Request, int]], all_logits: torch.Tensor) -> None:
    """Record the prompt logprobs of each chunk that asks for them.

    ``all_logits`` ``[sum(n), vocab]``: every position of the chunks, in order. Position
    ``p`` of a request predicts its token ``p + 1``; the first prompt token has none."""
    start = 0
    for req, n in chunks:
        rows = slice(start, start + n)
        start += n
        want = req.params.prompt_logprobs
        if want is None or req.output_ids:  # a re-prefill after a retraction: already sent
            continue
        first = req.num_cached
        if first == 0 or req.prompt_logprobs is None:
            req.prompt_logprobs = PromptLogprobs([None], [[]])
        targets = req.prompt_ids[first + 1 : first + n + 1]
        if not targets:
            continue
        logp = torch.log_softmax(all_logits[rows][: len(targets)].float(), dim=-1)
        ids = torch.tensor(targets, dtype=torch.int64, device=logp.device)
        req.prompt_logprobs.logprobs.extend(logp.gather(1, ids[:, None])[:, 0].tolist())
        if want:
            values, top = logp.topk(want, dim=-1)
            req.prompt_logprobs.top.extend(
                list(zip(t, v, strict=True)) for t, v in zip(top.tolist(), values.tolist(), strict=True)
            )
        else:
            req.prompt_logprobs.top.extend([] for _ in targets)
