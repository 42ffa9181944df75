"""Logit processing: what a request asks to change in the model's logits before sampling.

Applied per row, in this order (vLLM's): the structured-output mask (disallowed tokens get
``-inf``), the ``min_tokens`` mask (while fewer than ``min_tokens`` tokens are out, every
stop token and end-of-sequence token gets ``-inf``), ``logit_bias`` (added), ``repetition_penalty`` (HF / vLLM: a seen token's
positive logit is divided by it, a negative one multiplied; "seen" = in the prompt or the
output), then ``frequency_penalty`` × count and ``presence_penalty`` × [count > 0] over the
tokens generated so far (OpenAI's definitions; prompt tokens do not count). Temperature,
min-p, top-k and top-p come after, in the sampler.

A row is one position where a token is chosen: a plain decode step's row sees the
request's output so far; a speculative verify's row ``j`` sees the output plus the drafts
``d[:j]`` before it, exactly what a plain step would have seen had those drafts been
emitted, so greedy and rejection-sampled verifies stay lossless (``RowState.after``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .params import SamplingParams


@dataclass
class RowState:
    """What processing needs to know about one row's request at one position."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    allowed: torch.Tensor | None = None  # bool [vocab] from a structured-output constraint

    def after(self, drafts: Sequence[int], allowed: torch.Tensor | None) -> RowState:
        """The same request one or more drafted tokens later."""
        if not drafts:
            return RowState(self.params, self.prompt_ids, self.output_ids, allowed)
        return RowState(self.params, self.prompt_ids, [*self.output_ids, *drafts], allowed)


def needs_processing(params: Sequence[SamplingParams]) -> bool:
    """Whether any of these requests changes its logits."""
    return any(p.processes_logits for p in params)


def process_logits(logits: torch.Tensor, rows: Sequence[RowState | None]) -> torch.Tensor:
    """``logits`` ``[len(rows), vocab]`` with each row's processing applied (float32, a new
    tensor when anything changes). Rows given as None, or whose request asks for nothing,
    are returned unchanged."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [{len(rows)}, vocab], got {tuple(logits.shape)}")
    picked = [i for i, r in enumerate(rows) if r is not None and r.params.processes_logits]
    if not picked:
        return logits
    out = logits.float().clone()
    index = torch.tensor(picked, device=logits.device)
    sub = out.index_select(0, index)
    states = [rows[i] for i in picked]
    sub = _mask(sub, states)
    sub = _min_tokens(sub, states)
    sub = _bias(sub, states)
    sub = _penalties(sub, states)
    out.index_copy_(0, index, sub)
    return out


def _mask(logits: torch.Tensor, states: Sequence[RowState]) -> torch.Tensor:
    rows = [i for i, s in enumerate(states) if s.allowed is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    allowed = torch.ones_like(logits, dtype=torch.bool)
    for i in rows:
        mask = states[i].allowed
        assert mask is not None
        n = min(vocab, mask.shape[0])
        allowed[i, :n] = mask[:n].to(logits.device)
        allowed[i, n:] = False  # padded vocabulary rows beyond the tokenizer: never text
    return logits.masked_fill(~allowed, float("-inf"))


def _min_tokens(logits: torch.Tensor, states: Sequence[RowState]) -> torch.Tensor:
    """Stop and end-of-sequence tokens at ``-inf`` in rows with fewer than ``min_tokens``
    outputs before them. A row left with no finite logit keeps its stop tokens: only a
    structured-output constraint that is complete (it allows nothing but stopping) does that,
    and a row must always have a token to choose."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        p = s.params
        if p.stops_masked(len(s.output_ids)):
            ids = sorted({t for t in (*p.stop_token_ids, *p.eos_token_ids) if 0 <= t < vocab})
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if not rows:
        return logits
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    masked = logits.index_put(index, torch.tensor(float("-inf"), device=device, dtype=logits.dtype))
    alive = (masked > float("-inf")).any(dim=1, keepdim=True)
    return torch.where(alive, masked, logits)


def _bias(logits: torch.Tensor, states: Sequence[RowState]) -> torch.Tensor:
    rows, cols, values = [], [], []
    for i, s in enumerate(states):
        for token, bias in s.params.logit_bias:
            rows.append(i)
            cols.append(token)
            values.append(float(bias))
    if not rows:
        return logits
    device = logits.device
    return logits.index_put(
        (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
        torch.tensor(values, device=device, dtype=logits.dtype),
        accumulate=True,
    )


def _penalties(logits: torch.Tensor, states: Sequence[RowState]) -> torch.Tensor:
    rows = [
        i
        for i, s in enumerate(states)
        if s.params.presence_penalty or s.params.frequency_penalty or s.params.repetition_penalty != 1.0
    ]
    if not rows:
        return logits
    vocab, device = logits.shape[1], logits.device
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    for r, i in enumerate(rows):
        ids = _ids(states[i].output_ids, vocab, device)
        if ids.numel():
            counts[r] = torch.bincount(ids, minlength=vocab)[:vocab].float()
    params = [states[i].params for i in rows]
    sub = logits[rows]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if bool((rep != 1.0).any()):
        seen = counts > 0
        for r, i in enumerate(rows):
            prompt = _ids(states[i].prompt_ids, vocab, device)
            if prompt.numel():
                seen[r, prompt] = True
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
    freq = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).float()
    logits = logits.clone()
    logits[rows] = sub
    return logits


def _ids(ids: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(list(ids), dtype=torch.int64, device=device)
    return t[(t >= 0) & (t < vocab)]
