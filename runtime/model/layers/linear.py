"""Linear and embedding layers that hold base weights and, optionally, a LoRA hook.

A layer's ``lora`` attribute is whatever object the adapter pool attaches (it has
``apply(x, out)``); it stays ``None`` in a draft model, which therefore runs the base
weights only. Fused layers (QKV, gate/up) keep their parts' output sizes so weight
loading and LoRA slicing agree on the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


def _frozen(rows: int, cols: int, *, dtype: torch.dtype, device: torch.device | str | None) -> nn.Parameter:
    """An uninitialised ``[rows, cols]`` weight for the checkpoint loader to fill (never trained)."""
    return nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)


class LoRAHook(Protocol):
    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the batch's LoRA delta for ``x`` into ``out`` in place."""

    def linear(self, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``base()`` plus the batch's LoRA delta for ``x`` (the hook may run both side by side)."""


class Linear(nn.Module):
    """``y = x Wᵀ + b`` over flat token rows, with ``out_sizes`` naming fused parts."""

    def __init__(
        self,
        in_features: int,
        out_sizes: tuple[int, ...],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_sizes = tuple(out_sizes)
        self.out_features = sum(out_sizes)
        self.weight = _frozen(self.out_features, in_features, dtype=dtype, device=device)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.lora: LoRAHook | None = None

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offsets = [0]
        for size in self.out_sizes:
            offsets.append(offsets[-1] + size)
        return tuple(offsets)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return F.linear(x, self.weight, self.bias)
        return self.lora.linear(x, lambda: F.linear(x, self.weight, self.bias))


class VocabEmbedding(nn.Module):
    """Token embedding table (base weights only; an adapter's delta is added by the model)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        rows: int | None = None,
    ):
        """``rows``: the table rows this layer holds (default ``vocab_size``; a tensor-parallel
        shard holds its part of the vocabulary)."""
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = _frozen(vocab_size if rows is None else rows, dim, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Output projection to vocabulary logits; shares the embedding's weight when tied."""

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        tied_to: VocabEmbedding | None = None,
        rows: int | None = None,
    ):
        """``rows``: the vocabulary rows this head holds, as :class:`VocabEmbedding`'s."""
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = _frozen(vocab_size if rows is None else rows, dim, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
