"""How a Llama-family model and its adapters are cut across tensor-parallel ranks (pure).

Megatron-style layout, one rank's view:

- column-parallel (q/k/v, gate/up): each rank holds a contiguous block of output rows of
  every part; attention heads are split, so attention needs no communication;
- row-parallel (o, down): each rank holds the matching block of input columns and
  produces a partial sum, which an all-reduce completes;
- vocab-parallel (embed_tokens, lm_head): each rank holds ``ceil(vocab / size)`` rows
  (the last shard zero-padded); embeddings are completed by an all-reduce, logits by an
  all-gather.

KV heads are split like query heads when there are at least as many as ranks; with
fewer (GQA with ``num_kv_heads < size``) each rank holds one KV head, the one its query
heads read, so a KV head is replicated on ``size / num_kv_heads`` ranks.

Mixture-of-experts layers (the "TP MoE" layout of vLLM / SGLang): every rank holds every
expert, each cut along its intermediate dimension as a dense MLP is: its block of gate rows
and of up rows (``gate_up_proj [E, 2I, H]`` holds gate rows then up rows, so each half is
cut on its own: the rank's gate rows, then its up rows) and the matching block of
``down_proj`` columns. The router is whole on every rank, so every rank routes each token to
the same experts; the layer's output, a partial sum like a row-parallel projection's, is
completed by one all-reduce. Qwen2-MoE's shared expert (``mlp.shared_expert.*``) is cut as a
dense MLP of its own intermediate size (gate / up rows, down columns) and adds its partial sum
to the same all-reduce; its gate ``mlp.shared_expert_gate`` (H -> 1) is whole on every rank.

LoRA follows the same cut: a column-parallel module keeps A whole and splits B by output
rows (per part of a fused module); a row-parallel module splits A by input columns and
keeps B whole, so each rank's delta is a partial sum that joins the base output's
all-reduce (the scaling is applied once per partial, hence once in total). Expert LoRA is
cut the same way per expert (gate / up: B by rows; down: A by columns); the router's is
whole. The shared expert's LoRA (``shared_expert.gate_proj`` ...) is cut as a dense MLP's, its
gate's is whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .errors import TensorParallelConfigError

COLUMN_PARTS = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
ROW_PARTS = {"o_proj": "q", "down_proj": "mlp"}
VOCAB_MODULES = ("embed_tokens", "lm_head")
REPLICATED_LORA = ("gate", "shared_expert_gate")
"""Adapted modules whole on every rank: an MoE layer's router and its shared expert's gate."""
SHARED_EXPERT = "shared_expert"
"""Qwen2-MoE's shared expert: its checkpoint tensors ``mlp.shared_expert.*`` and LoRA modules
``shared_expert.gate_proj`` ... are cut as a dense MLP of its own size (part ``shared``)."""


class ExpertShape(Protocol):
    """The size of one expert (``loraserve.runtime.model.arch.MoESpec`` is one)."""

    intermediate_size: int
    shared_intermediate_size: int  # the shared expert's (0: none)


class ShardableArch(Protocol):
    """The shape of a model a split needs (``loraserve.runtime.model.arch.ModelArchConfig`` is one)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe: ExpertShape | None


def check_tensor_parallel(arch: ShardableArch, size: int) -> None:
    """Raise :class:`TensorParallelConfigError` unless ``arch`` splits evenly over ``size`` ranks."""
    field = "parallel.tensor_parallel_size"
    if size < 1:
        raise TensorParallelConfigError(f"{field} must be >= 1, got {size}")
    if size == 1:
        return
    if arch.num_heads % size:
        raise TensorParallelConfigError(
            f"{field}={size} does not divide the model's {arch.num_heads} attention heads: "
            f"use a size that divides {arch.num_heads} (the pod's GPU count is the size)"
        )
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        raise TensorParallelConfigError(
            f"{field}={size} and the model's {arch.num_kv_heads} KV heads neither divide each other: "
            f"use a size that divides {arch.num_kv_heads} or a multiple of it"
        )
    if arch.intermediate_size % size:
        raise TensorParallelConfigError(
            f"{field}={size} does not divide the model's intermediate_size {arch.intermediate_size}: "
            "use a size that divides it"
        )
    if arch.moe is not None and arch.moe.intermediate_size % size:
        raise TensorParallelConfigError(
            f"{field}={size} does not divide the model's moe_intermediate_size {arch.moe.intermediate_size} "
            "(every expert is cut along it over the ranks): use a size that divides it"
        )
    if arch.moe is not None and arch.moe.shared_intermediate_size % size:
        raise TensorParallelConfigError(
            f"{field}={size} does not divide the model's shared_expert_intermediate_size "
            f"{arch.moe.shared_intermediate_size} (the shared expert is cut along it over the ranks): "
            "use a size that divides it"
        )


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share of every sharded tensor of a model (row / column ranges)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    moe_intermediate_size: int = 0  # one expert's; 0: the model has no MoE layer
    shared_intermediate_size: int = 0  # the shared expert's; 0: none

    @classmethod
    def for_arch(cls, arch: ShardableArch, rank: int, size: int) -> ShardPlan:
        check_tensor_parallel(arch, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        return cls(
            rank=rank,
            size=size,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size,
            vocab_size=arch.vocab_size,
            moe_intermediate_size=0 if arch.moe is None else arch.moe.intermediate_size,
            shared_intermediate_size=0 if arch.moe is None else arch.moe.shared_intermediate_size,
        )

    # ------------------------------------------------------------------ sizes
    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        # Split: a contiguous block; replicated: the head this rank's query heads share.
        return self.rank * self.num_kv_heads // self.size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def local_moe_intermediate(self) -> int:
        """One expert's intermediate columns on this rank."""
        return self.moe_intermediate_size // self.size

    @property
    def vocab_shard_rows(self) -> int:
        """Rows every rank holds of the embedding / lm_head (padded to the same count)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids ``[start, end)`` this rank's rows hold (``end - start`` may be short)."""
        start = min(self.rank * self.vocab_shard_rows, self.vocab_size)
        return start, min(start + self.vocab_shard_rows, self.vocab_size)

    def part_range(self, part: str) -> tuple[int, int]:
        """Rows of a column-parallel part (or columns of a row-parallel input) this rank holds."""
        if part == "q":
            n = self.local_heads * self.head_dim
            return self.rank * n, (self.rank + 1) * n
        if part == "kv":
            start = self.kv_head_start * self.head_dim
            return start, start + self.local_kv_heads * self.head_dim
        if part == "mlp":
            n = self.local_intermediate
            return self.rank * n, (self.rank + 1) * n
        if part == "expert":
            n = self.local_moe_intermediate
            return self.rank * n, (self.rank + 1) * n
        if part == "shared":
            n = self.shared_intermediate_size // self.size
            return self.rank * n, (self.rank + 1) * n
        raise KeyError(part)

    # ------------------------------------------------------------------ slicing
    def vocab_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a ``[vocab, ...]`` tensor, zero-padded to :attr:`vocab_shard_rows`."""
        start, end = self.vocab_range
        rows = full[start:end]
        pad = self.vocab_shard_rows - rows.shape[0]
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])])
        return rows

    def shard_module_tensor(
        self, module: str, kind: str, full: torch.Tensor, *, shared: bool = False
    ) -> torch.Tensor:
        """This rank's slice of a base tensor of ``module`` (``kind``: weight or bias);
        ``shared``: a Qwen2-MoE shared expert's gate / up / down (cut by its own size).

        Modules that are not sharded (norms) come back unchanged, as does a row-parallel
        bias: it is added once, by rank 0, before the all-reduce.
        """
        if module in COLUMN_PARTS:
            lo, hi = self.part_range("shared" if shared else COLUMN_PARTS[module])
            return full[lo:hi]
        if module in ROW_PARTS:
            if kind == "bias":
                return full
            lo, hi = self.part_range("shared" if shared else ROW_PARTS[module])
            return full[:, lo:hi]
        if module in VOCAB_MODULES:
            return self.vocab_rows(full)
        return full

    def shard_checkpoint_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a Hugging Face-named checkpoint tensor."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
            shared = len(parts) >= 3 and parts[-3] == SHARED_EXPERT
            return self.shard_module_tensor(parts[-2], parts[-1], full, shared=shared)
        return full

    def shard_expert_weight(self, proj: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of expert weights ``[..., out, in]``: one expert's (``[out, in]``)
        or every expert's stacked (``[E, out, in]``). ``proj``: ``gate_proj`` / ``up_proj``
        (rows), ``down_proj`` (columns), or ``gate_up_proj`` (gate rows then up rows, each
        half cut on its own: ``[gate slice ; up slice]``)."""
        lo, hi = self.part_range("expert")
        if proj in ("gate_proj", "up_proj"):
            return full[..., lo:hi, :]
        if proj == "down_proj":
            return full[..., lo:hi]
        if proj == "gate_up_proj":
            half = self.moe_intermediate_size
            return torch.cat([full[..., lo:hi, :], full[..., half + lo : half + hi, :]], dim=-2)
        raise KeyError(proj)

    def shard_lora(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` of an adapter's module, as the slot pool stores them.

        ``a``/``b`` are the adapter's host layout: ``A [r, in]``, ``B [out, r]`` for linear
        modules; ``A [vocab, r]``, ``B [hidden, r]`` for ``embed_tokens``. Vocab-sharded
        tensors are NOT padded: the pool's padding rows stay zero. A shared expert's module
        (``shared_expert.gate_proj`` ...) is cut as the dense one, by the shared expert's size.
        """
        if module.startswith(SHARED_EXPERT + "."):
            inner = module.removeprefix(SHARED_EXPERT + ".")
            lo, hi = self.part_range("shared")
            if inner in ("gate_proj", "up_proj"):
                return a, b[lo:hi]
            if inner == "down_proj":
                return a[:, lo:hi], b
            raise KeyError(module)
        if module in COLUMN_PARTS:
            lo, hi = self.part_range(COLUMN_PARTS[module])
            return a, b[lo:hi]
        if module in ROW_PARTS:
            lo, hi = self.part_range(ROW_PARTS[module])
            return a[:, lo:hi], b
        start, end = self.vocab_range
        if module == "embed_tokens":
            return a[start:end], b
        if module == "lm_head":
            return a, b[start:end]
        if module in REPLICATED_LORA:
            return a, b
        raise KeyError(module)

    def shard_expert_lora(
        self, module: str, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A [E, r, in], B [E, out, r])`` of an adapter's expert module, cut as
        the experts are: ``gate_proj`` / ``up_proj`` keep A and take B's rows of this rank's
        slice of the intermediate dimension; ``down_proj`` takes A's columns of it and keeps
        B, so its delta is a partial sum that joins the layer's all-reduce (scaled once per
        partial, hence once in total). peft's fused ``gate_up_proj`` at double rank arrives
        here already split into its gate and up rows (A shared), each cut alike."""
        lo, hi = self.part_range("expert")
        if module in ("gate_proj", "up_proj"):
            return a, b[:, lo:hi]
        if module == "down_proj":
            return a[..., lo:hi], b
        raise KeyError(module)
