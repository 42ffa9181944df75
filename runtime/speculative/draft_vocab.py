"""The vocabulary an EAGLE-family draft predicts over, and the LM head that scores it.

Three cases, one object (:class:`DraftVocab`):

- the target's full vocabulary through the target's BASE lm_head (shared, no copy);
- a reduced vocabulary through rows of the target's base lm_head, chosen by a token map
  (``speculative.token_map``, FR-Spec: the most frequent tokens of a corpus). The draft's
  LM head, the largest GEMM of a draft step for a 128k vocabulary, shrinks with it;
- the draft checkpoint's own LM head (``draft_vocab_size`` in its config.json, as EAGLE3
  training writes them), with ``d2t`` mapping each draft row to its target token when the
  draft vocabulary is smaller than the target's.

Proposals are target token ids either way. A reduced vocabulary only changes which tokens
a draft can propose; the target still verifies every token, so greedy outputs are
unchanged and rejection sampling stays exact (the draft's distribution is zero outside its
vocabulary, and the residual ``(p - q)+`` covers the rest).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..model.arch import ModelConfigError

TOKEN_MAP_SUFFIXES = (".json", ".safetensors", ".pt")


class TokenMapError(ModelConfigError):
    """``speculative.token_map`` cannot be used: unreadable, malformed, or not for this draft."""


@dataclass(frozen=True)
class DraftVocab:
    """Scores a draft's output features over its vocabulary and maps rows to target ids."""

    head_weight: torch.Tensor  # [V_draft, H]
    to_target: torch.Tensor | None  # int64 [V_draft]: the target id of each row; None: identity
    target_vocab_size: int
    source: str  # where the head and the vocabulary come from (logged at start-up)

    @property
    def size(self) -> int:
        return int(self.head_weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary, ``[T, V_draft]``."""
        return F.linear(hidden.to(self.head_weight.dtype), self.head_weight).float()

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the target vocabulary, ``-inf`` where the draft has no row."""
        scores = self.logits(hidden)
        if self.to_target is None:
            return scores
        full = scores.new_full((scores.shape[0], self.target_vocab_size), float("-inf"))
        return full.index_copy_(1, self.to_target, scores)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's argmax as target token ids, ``[T]`` int64 (no full-vocabulary pass)."""
        best = self.logits(hidden).argmax(dim=-1)
        return best if self.to_target is None else self.to_target[best]


def check_target_ids(
    ids: torch.Tensor, vocab_size: int, what: str, error: type[ModelConfigError] = ModelConfigError
) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor of distinct target token ids, or ``error`` naming ``what``."""
    if ids.dim() != 1 or ids.numel() == 0:
        raise error(f"{what} must be a non-empty 1-D list of token ids, got shape {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise error(f"{what} must hold integer token ids, got {ids.dtype}")
    ids = ids.to(torch.int64)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise error(
            f"{what} holds token ids from {low} to {high}; the target's vocabulary is 0..{vocab_size - 1}"
        )
    if int(torch.unique(ids).numel()) != ids.numel():
        raise error(f"{what} lists a token id more than once: each draft row maps to one target token")
    return ids


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The token ids of an FR-Spec token map file (``speculative.token_map``).

    ``.json``: a list of ids. ``.safetensors``: one 1-D integer tensor. ``.pt``: one tensor,
    read with ``torch.load(weights_only=True)`` (tensors only: nothing in the file runs).
    """
    path = Path(path)
    field = f"speculative.token_map {path}"
    if not path.is_file():
        raise TokenMapError(f"{field} not found: point it at a .json, .safetensors or .pt list of token ids")
    if path.suffix == ".json":
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise TokenMapError(f"{field} is not valid JSON: {exc}") from exc
        if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
            raise TokenMapError(f"{field} must be a JSON list of integer token ids")
        ids = torch.tensor(raw, dtype=torch.int64)
    elif path.suffix == ".safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(path))
        if len(tensors) != 1:
            raise TokenMapError(f"{field} must hold exactly one tensor, found {sorted(tensors)}")
        ids = next(iter(tensors.values()))
    elif path.suffix == ".pt":
        try:
            ids = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:  # any unreadable file gets the same answer
            raise TokenMapError(f"{field} could not be read as a tensor file: {exc}") from exc
        if not isinstance(ids, torch.Tensor):
            raise TokenMapError(f"{field} must hold one tensor of token ids, found {type(ids).__name__}")
    else:
        raise TokenMapError(f"{field}: use a {', '.join(TOKEN_MAP_SUFFIXES)} file of token ids")
    return check_target_ids(ids, vocab_size, field, TokenMapError)


def resolve_token_map(token_map: str, draft_model_path: str | None) -> Path:
    """A relative token map path is a file of the draft model's directory."""
    path = Path(token_map)
    if not path.is_absolute() and draft_model_path:
        return Path(draft_model_path) / path
    return path


def target_head_vocab(
    lm_head_weight: torch.Tensor, token_ids: torch.Tensor | None, source: str
) -> DraftVocab:
    """The target's base LM head: whole (shared), or the rows of ``token_ids`` (a copy)."""
    vocab = int(lm_head_weight.shape[0])
    if token_ids is None:
        return DraftVocab(lm_head_weight.detach(), None, vocab, source)
    ids = token_ids.to(lm_head_weight.device)
    rows = lm_head_weight.detach().index_select(0, ids).contiguous()
    return DraftVocab(rows, ids, vocab, f"{source}, {ids.numel()} of {vocab} tokens")


def own_head_vocab(head_weight: torch.Tensor, d2t: torch.Tensor | None, target_vocab_size: int) -> DraftVocab:
    """A draft checkpoint's own LM head; ``d2t[i]`` is target id minus draft id of row ``i``."""
    size = int(head_weight.shape[0])
    if d2t is None:
        if size != target_vocab_size:
            raise ModelConfigError(
                f"the draft's lm_head has {size} rows but no d2t tensor maps them to the target's "
                f"{target_vocab_size} tokens: add d2t to the checkpoint (or set draft_vocab_size to the target's)"
            )
        return DraftVocab(head_weight, None, target_vocab_size, "the draft's own lm_head")
    ids = torch.arange(size, dtype=torch.int64) + d2t.to(torch.int64).cpu()
    ids = check_target_ids(ids, target_vocab_size, "the draft checkpoint's d2t (draft id + d2t = target id)")
    return DraftVocab(
        head_weight,
        ids.to(head_weight.device),
        target_vocab_size,
        f"the draft's own lm_head, {size} of {target_vocab_size} tokens (d2t)",
    )
