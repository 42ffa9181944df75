"""Tensor-parallel variants of the layers: row-parallel linear, vocab-parallel embedding / head.

Column-parallel layers need no class of their own: a :class:`Linear` holding this rank's
output rows (attention and the MLP activation then run on local heads / columns). The
classes here are the ones whose output is incomplete on one rank:

- :class:`RowParallelLinear` sums partial outputs with one all-reduce, AFTER its LoRA
  hook has added this rank's partial delta, so adapters cost no extra collective;
- :class:`VocabParallelEmbedding` returns a partial embedding (zeros for tokens other
  ranks own); the model all-reduces it after the embedding adapter's delta;
- :class:`ParallelLMHead` returns this rank's vocabulary columns; the model gathers them
  after the lm_head adapter's delta.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .linear import Linear, LMHead, VocabEmbedding


class Collectives(Protocol):
    """What the layers need of a tensor-parallel group."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor: ...


class RowParallelLinear(Linear):
    """``y = Σ_ranks x_r W_rᵀ (+ b)``: this rank holds input columns ``W_r``; the bias is full."""

    def __init__(
        self,
        in_features: int,
        out_sizes: tuple[int, ...],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        group: Collectives,
    ):
        super().__init__(in_features, out_sizes, bias=bias, dtype=dtype, device=device)
        self.group = group
        self.adds_bias = group.rank == 0  # the sum must carry the bias once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.adds_bias else None
        if self.lora is None:
            out = F.linear(x, self.weight, bias)
        else:  # a partial delta: it joins the same all-reduce
            out = self.lora.linear(x, lambda: F.linear(x, self.weight, bias))
        return self.group.all_reduce(out)


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's rows ``[vocab_start, vocab_end)`` of the table, padded to ``shard_rows``."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        vocab_range: tuple[int, int],
        shard_rows: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        super().__init__(vocab_size, dim, dtype=dtype, device=device, rows=shard_rows)
        self.vocab_start, self.vocab_end = vocab_range
        self.shard_rows = shard_rows

    def local_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row in this shard, owned mask)``; rows of tokens other ranks own point at row 0."""
        owned = (ids >= self.vocab_start) & (ids < self.vocab_end)
        return torch.where(owned, ids - self.vocab_start, 0), owned

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The PARTIAL embedding: zero for tokens this rank does not own (all-reduce completes it)."""
        local, owned = self.local_ids(ids)
        return F.embedding(local, self.weight).masked_fill_(~owned[:, None], 0)


class ParallelLMHead(LMHead):
    """This rank's vocabulary columns of the logits; shares the embedding's shard when tied."""

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        *,
        shard_rows: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        tied_to: VocabParallelEmbedding | None = None,
    ):
        super().__init__(dim, vocab_size, dtype=dtype, device=device, tied_to=tied_to, rows=shard_rows)
        self.shard_rows = shard_rows
