"""Acceptance of draft tokens against the target: greedy and rejection sampling.

Layout (chain drafts): every request verifies ``k`` tokens, its last committed token
followed by ``k - 1`` drafts ``d[0..k-2]``. The target's row ``i`` is its distribution
for the token after verify input ``i``, so draft ``d[i]`` is judged against row ``i`` and
row ``k - 1`` supplies the bonus token when every draft is accepted. A step therefore
emits ``accept_len + 1`` tokens (1..k) per request.

The uniforms are inputs: the decoder draws them from each request's own generator
(``Sampler.uniform``), so a seeded request is reproducible whatever shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Acceptance:
    """What one verify step decided, per request."""

    accept_lens: torch.Tensor  # int64 [bs]: drafts accepted, 0..k-1
    tokens: torch.Tensor  # int64 [bs, k]: accepted drafts, then the target's token; -1 after
    # Tree drafts: int64 [bs, depth + 1], the accepted path's nodes from the root; -1 after.
    path: torch.Tensor | None = None
    _host: tuple[list[int], list[list[int]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _host_path: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    _staged: tuple[torch.Tensor, torch.cuda.Event] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def num_new_tokens(self) -> torch.Tensor:
        """Tokens each request gains this step (accepted drafts + one from the target)."""
        return self.accept_lens + 1

    def stage(self) -> None:
        """Queue the device-to-host copy now (CUDA: into pinned memory, behind an event).

        :meth:`host` then waits for the work queued before this call only, not for what is
        queued after it: the drafter's next proposal runs on the device while the host does
        the step's bookkeeping and queues the next verify behind it. Elsewhere a no-op."""
        if self._staged is not None or self._host is not None or self.accept_lens.device.type != "cuda":
            return
        both = self._packed()
        pinned = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
        pinned.copy_(both, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._staged = (pinned, done)

    def host(self) -> tuple[list[int], list[list[int]]]:
        """``(accept_lens, token rows)`` as host lists: one device-to-host copy, kept for
        every later reader of this step (the decoder, the drafter)."""
        if self._host is None:
            if self._staged is not None:
                pinned, done = self._staged
                done.synchronize()
                both = pinned.tolist()
            else:
                both = self._packed().tolist()
            width = 1 + self.tokens.shape[1]
            self._host = ([row[0] for row in both], [row[1:width] for row in both])
            if self.path is not None:
                self._host_path = [row[width:] for row in both]
        return self._host

    def host_path(self) -> list[list[int]]:
        """Tree drafts: each request's accepted nodes from the root, as host lists (one copy
        with :meth:`host`)."""
        if self.path is None:
            raise ValueError("a chain acceptance has no tree path")
        self.host()
        assert self._host_path is not None
        return self._host_path

    def _packed(self) -> torch.Tensor:
        parts = [self.accept_lens.long()[:, None], self.tokens.long()]
        if self.path is not None:
            parts.append(self.path.long())
        return torch.cat(parts, dim=1)

    def along_path(self, values: torch.Tensor) -> torch.Tensor:
        """Tree drafts: the rows of ``values`` (``[bs, nodes, X]``, one row per tree node) at
        each request's accepted path, ``[bs, depth + 1, X]`` (node 0's row past its end)."""
        if self.path is None:
            raise ValueError("a chain acceptance has no tree path")
        bs, width = self.path.shape
        return values.gather(1, self.path.clamp_min(0)[..., None].expand(bs, width, values.shape[-1]))

    def host_accept_lens(self) -> list[int]:
        """Drafts accepted per request, as a host list (see :meth:`host`)."""
        return self.host()[0]

    def new_tokens(self) -> list[list[int]]:
        """Host lists of each request's new tokens, in order."""
        lens, rows = self.host()
        return [row[: n + 1] for row, n in zip(rows, lens, strict=True)]


def _check_layout(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if target.dim() != 3:
        raise ValueError(f"target logits/probs must be [bs, k, vocab], got shape {tuple(target.shape)}")
    bs, k, _ = target.shape
    if k < 1:
        raise ValueError("verify needs k >= 1 rows per request")
    if tuple(draft_tokens.shape) != (bs, k - 1):
        raise ValueError(
            f"draft_tokens must be [bs, k-1] = [{bs}, {k - 1}] for target rows {tuple(target.shape)}, "
            f"got {tuple(draft_tokens.shape)}"
        )
    return bs, k


def _prefix_len(accepted: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True per row (the accepted prefix)."""
    if accepted.shape[1] == 0:
        return torch.zeros(accepted.shape[0], dtype=torch.long, device=accepted.device)
    return accepted.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Accept the longest prefix of drafts equal to the target's argmax, plus the bonus token.

    The emitted tokens are exactly the target's argmax at positions ``0..accept_len``,
    which is what decoding without speculation would have produced.
    """
    _, k = _check_layout(draft_tokens, target_logits)
    target = target_logits.argmax(dim=-1)  # [bs, k]
    accept_lens = _prefix_len(draft_tokens.long() == target[:, :-1])
    keep = torch.arange(k, device=target.device)[None, :] <= accept_lens[:, None]
    return Acceptance(accept_lens=accept_lens, tokens=torch.where(keep, target, -1))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of ``probs`` ``[n, vocab]`` (need not sum to 1).

    ``uniforms`` ``[n]`` in ``[0, 1)``. Computed in float64 so a 53-bit uniform keeps its
    resolution; a token of probability zero is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    point = uniforms.double()[:, None] * total
    idx = torch.searchsorted(cdf, point, right=True).squeeze(-1)
    # A uniform within rounding of 1 can land past the last positive entry: take that entry.
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(idx, last_positive)


def rejection_accept(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> Acceptance:
    """Speculative rejection sampling over a batch of chain drafts.

    Draft ``d[i]`` (drawn from ``q_i``) is accepted with probability ``min(1, p_i(d)/q_i(d))``;
    at the first rejection the token is drawn from ``normalise(max(p_i - q_i, 0))``; when
    every draft is accepted the bonus token is drawn from ``p_{k-1}``. The emitted tokens
    are then distributed exactly as sampling from the target ``p`` one token at a time.

    ``target_probs``: ``[bs, k, vocab]``; ``draft_probs``: ``[bs, k-1, vocab]``, or None for
    deterministic drafts (NGRAM, greedy drafters), where ``q`` is one-hot on the draft.
    ``accept_uniforms``: ``[bs, k-1]``; ``sample_uniforms``: ``[bs, k]`` (column ``j`` is used
    when position ``j`` is the one the target decides).
    """
    bs, k = _check_layout(draft_tokens, target_probs)
    if tuple(accept_uniforms.shape) != (bs, k - 1):
        raise ValueError(f"accept_uniforms must be [{bs}, {k - 1}], got {tuple(accept_uniforms.shape)}")
    if tuple(sample_uniforms.shape) != (bs, k):
        raise ValueError(f"sample_uniforms must be [{bs}, {k}], got {tuple(sample_uniforms.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (bs, k - 1, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [{bs}, {k - 1}, {target_probs.shape[-1]}], got {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    drafts = draft_tokens.long()
    p = target_probs.double()
    p_draft = p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1)  # [bs, k-1]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.double().gather(-1, drafts[..., None]).squeeze(-1)
    # u < min(1, p/q)  <=>  u*q < p  (q > 0 for a token the draft actually drew).
    accepted = accept_uniforms.double() * q_draft < p_draft
    accept_lens = _prefix_len(accepted)

    rows = torch.arange(bs, device=device)
    p_final = p[rows, accept_lens]  # [bs, vocab]
    rejected = accept_lens < k - 1
    if bool(rejected.any()):
        at = accept_lens.clamp(max=max(k - 2, 0))
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final[rows, drafts[rows, at]] = 1.0
        else:
            q_final = draft_probs.double()[rows, at]
        residual = (p_final - q_final).clamp_min(0.0)
        # p == q up to rounding leaves no residual mass; p itself is then the exact answer.
        usable = rejected[:, None] & (residual.sum(dim=-1, keepdim=True) > 0)
        p_final = torch.where(usable, residual, p_final)
    final = sample_from_probs(p_final, sample_uniforms[rows, accept_lens])

    pos = torch.arange(k, device=device)[None, :]
    padded = torch.cat([drafts, torch.full((bs, 1), -1, dtype=torch.long, device=device)], dim=1)
    tokens = torch.where(pos < accept_lens[:, None], padded, -1)
    tokens = torch.where(pos == accept_lens[:, None], final[:, None], tokens)
    return Acceptance(accept_lens=accept_lens, tokens=tokens)
