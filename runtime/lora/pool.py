"""The device-side adapter slot pool and the hooks that apply it inside the model.

Buffers use the kernels' layout (see ``loraserve.kernels.backend``): per fused module
``A [slots, slices * max_rank, in]`` and ``B [slots, out_total, max_rank]``; q/k/v share
one QKV buffer and gate/up one gate-up buffer, matching the model's fused projections.
The embedding adapter is ``A [slots, vocab, max_rank]``, ``B [slots, hidden, max_rank]``.
Every ``B`` is stored rank-major (``[slots, max_rank, out]``) and exposed as its
transposed view: an adapter below the pool's rank then reads only its own rank's rows.
Writing a slot zeroes it first, so parts an adapter does not target contribute nothing.

In a tensor-parallel model the buffers take the shapes of this rank's layers (an adapter
arrives already cut by ``loraserve.runtime.distributed.sharding``): B by output rows for
column-parallel modules, A by input columns for row-parallel ones, and the vocabulary
side of the embedding / lm_head adapters by this rank's vocabulary rows. The embedding's
A then has one extra, always-zero row that tokens of other ranks gather, so their
partial delta is zero and the embedding's all-reduce adds each token's delta once.

On a mixture-of-experts layer, ``gate_up_proj`` / ``down_proj`` are the experts': their
buffers gain an expert dimension (``A [slots, experts, slices * max_rank, in]``, ``B
[slots, experts, out, max_rank]``, rank-major) and an :class:`ExpertLoRAHook` adds each
routed row's delta for that expert only. The router (``gate``) of every MoE layer always
has a small buffer of its own: peft's ``all-linear`` adapts it on MoE models. Qwen2-MoE's
shared expert is a dense MLP inside the MoE layer: its gate-up and down Linear layers take
ordinary hooks under ``("shared_expert.gate_up_proj", layer)`` / ``("shared_expert.down_proj",
layer)`` when gate/up and down are pooled, and its gate, like the router, always has a buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from loraserve.kernels import LoRABackend, LoRABatchInfo
from loraserve.kernels.metadata import ensure_tiles
from loraserve.kernels.moe import ExpertLoRA
from loraserve.kernels.overlap import OverlapMode, OverlapPolicy, linear_with_lora

from ..model.layers.parallel import VocabParallelEmbedding
from ..model.llama import LlamaForCausalLM
from ..model.moe import SparseMoE
from .adapter import SHARED, SHARED_GATE, AdapterWeights

# module -> (fused group, part index); the group names the model's attribute
GROUP_OF = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
ROUTER = "gate"
"""An MoE layer's router, adapted like a linear module (pool key ``("gate", layer)``)."""


def rank_major_b(num_slots: int, out_dim: int, max_rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed ``B [slots, out_dim, max_rank]`` stored rank-major (a transposed view).

    The kernels accept any strides; with this storage a rank-r adapter in a rank-R pool
    reads r contiguous rows of ``out_dim`` values instead of r of every R columns.
    """
    return torch.zeros(num_slots, max_rank, out_dim, dtype=dtype, device=device).transpose(1, 2)


class LoRAContext:
    """Per-forward state every hook reads: the backend and the batch's segment layout.

    ``info`` describes the decoder's token rows; ``logits_info`` the rows handed to the
    lm_head (fewer than ``info``'s in an extend that returns only last positions). Both
    are None when no request of the batch uses an adapter: the hooks then do nothing.
    """

    def __init__(self, backend: LoRABackend, overlap: OverlapPolicy | None = None):
        self.backend = backend
        self.info: LoRABatchInfo | None = None
        self.logits_info: LoRABatchInfo | None = None
        # Decode/verify-sized batches run each module's LoRA beside its base GEMM on a
        # second stream (``loraserve.kernels.overlap``); ``LORASERVE_LORA_OVERLAP`` overrides.
        self.overlap = overlap if overlap is not None else OverlapPolicy.from_env()
        self._side: dict[torch.device, torch.cuda.Stream] = {}

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The second stream for ``device`` (one per context, created on first use)."""
        stream = self._side.get(device)
        if stream is None:
            stream = self._side[device] = torch.cuda.Stream(device)
        return stream

    def set(self, info: LoRABatchInfo | None, logits_info: LoRABatchInfo | None) -> None:
        self.info = info
        self.logits_info = logits_info

    def clear(self) -> None:
        self.info = None
        self.logits_info = None


@dataclass
class LinearLoRAHook:
    """LoRA delta of one (possibly fused) linear layer."""

    ctx: LoRAContext
    A: torch.Tensor
    B: torch.Tensor
    slice_offsets: tuple[int, ...]
    logits: bool = False  # the lm_head: uses the logits rows' layout

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        info = self.ctx.logits_info if self.logits else self.ctx.info
        if info is not None:
            self.ctx.backend.apply(x, self.A, self.B, info, out, self.slice_offsets)

    def linear(self, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``base()`` (the layer's GEMM on ``x``) plus the batch's LoRA delta, overlapped where it pays."""
        info = self.ctx.logits_info if self.logits else self.ctx.info
        if info is None:
            return base()
        mode = self.ctx.overlap.mode_for(x.shape[0], ensure_tiles(info).num_tiles, x.device)
        side = None if mode is OverlapMode.SERIAL else self.ctx.side_stream(x.device)
        return linear_with_lora(self.ctx.backend, x, self.A, self.B, info, self.slice_offsets, base, mode=mode, side=side)


@dataclass
class ExpertLoRAHook:
    """LoRA delta of one part (``gate_up`` or ``down``) of every expert of one MoE layer.

    ``A [slots, experts, slices * max_rank, in]``, ``B [slots, experts, out, max_rank]``.
    The torch path: for the rows an expert runs on, each adapter's rows in one matmul pair
    (a host loop over the adapters present, as the torch LoRA backend loops segments). The
    fused path (:meth:`fused`) reads the same buffers plus ``ranks``: each slot's rank on
    this part (int32, on the device), 0 where the slot's adapter has no LoRA here, so the
    kernels skip its rows."""

    ctx: LoRAContext
    A: torch.Tensor
    B: torch.Tensor
    slice_offsets: tuple[int, ...]
    ranks: torch.Tensor = field(init=False)
    _ranks_cpu: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.ranks = torch.zeros(self.A.shape[0], dtype=torch.int32, device=self.A.device)
        self._ranks_cpu = [0] * self.A.shape[0]

    def set_rank(self, slot: int, rank: int) -> None:
        """Record ``slot``'s rank on this part (0 on clearing; the largest of its slices)."""
        rank = 0 if rank == 0 else max(rank, self._ranks_cpu[slot])
        if rank != self._ranks_cpu[slot]:
            self._ranks_cpu[slot] = rank
            self.ranks[slot] = rank

    def fused(self) -> tuple[torch.Tensor, torch.Tensor, ExpertLoRA] | None:
        """See :meth:`loraserve.runtime.model.moe.ExpertLoRAHook.fused`."""
        info = self.ctx.info
        if info is None:
            return None
        return info.token_slots, info.scalings, ExpertLoRA(self.A, self.B, self.slice_offsets, self.ranks)

    def add(self, expert: int, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        info = self.ctx.info
        if info is None:
            return
        slots = info.token_slots.index_select(0, rows).long()
        num_slices = len(self.slice_offsets) - 1
        max_rank = self.A.shape[2] // num_slices
        for slot in torch.unique(slots).tolist():
            rank = info.lora_ranks_cpu[slot] if slot >= 0 else 0
            if rank == 0:
                continue
            sel = (slots == slot).nonzero().squeeze(1)
            xs = x.index_select(0, sel).float()
            scale = info.scalings[slot].float()
            for s in range(num_slices):
                lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
                a = self.A[slot, expert, s * max_rank : s * max_rank + rank].float()
                b = self.B[slot, expert, lo:hi, :rank].float()
                delta = (xs @ a.T) @ b.T * scale
                out[sel, lo:hi] = (out[sel, lo:hi].float() + delta).to(out.dtype)


@dataclass
class EmbeddingLoRAHook:
    """LoRA delta of the token embedding (a gather, not a GEMM).

    ``vocab_shard``: the tensor-parallel embedding whose rows ``A`` mirrors; token ids
    are mapped to its rows, and tokens it does not own to ``A``'s last, zero row.
    """

    ctx: LoRAContext
    A: torch.Tensor
    B: torch.Tensor
    vocab_shard: VocabParallelEmbedding | None = None

    def apply(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        info = self.ctx.info
        if info is None:
            return
        if self.vocab_shard is not None:
            local, owned = self.vocab_shard.local_ids(ids)
            ids = torch.where(owned, local, self.A.shape[1] - 1)
        self.ctx.backend.embedding(ids, self.A, self.B, info, out)


class SlotPool:
    """Allocates the slot buffers for ``modules`` and attaches hooks to the model."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        modules: tuple[str, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        ctx: LoRAContext,
    ):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.modules = modules
        self.ctx = ctx
        # (group, layer or None) -> hook; the hook's A/B are the buffers
        self.hooks: dict[tuple[str, int | None], LinearLoRAHook | EmbeddingLoRAHook | ExpertLoRAHook] = {}
        arch = model.arch
        groups = sorted({GROUP_OF[m][0] for m in modules if m in GROUP_OF})
        R = max_rank
        for layer_id, layer in enumerate(model.model.layers):
            if isinstance(layer.mlp, SparseMoE):
                self._attach_moe(layer.mlp, layer_id, groups, dtype, device)
            for group in groups:
                if group in ("gate_up_proj", "down_proj") and isinstance(layer.mlp, SparseMoE):
                    continue
                linear = layer.self_attn.get_submodule(group) if group in ("qkv_proj", "o_proj") else layer.mlp.get_submodule(group)
                slices = len(linear.out_sizes)
                hook = LinearLoRAHook(
                    ctx,
                    torch.zeros(num_slots, slices * R, linear.in_features, dtype=dtype, device=device),
                    rank_major_b(num_slots, linear.out_features, R, dtype, device),
                    linear.slice_offsets,
                )
                linear.lora = hook
                self.hooks[(group, layer_id)] = hook
        embed = model.embed_tokens
        vocab_shard = embed if isinstance(embed, VocabParallelEmbedding) else None
        # Vocabulary rows this rank's embedding / lm_head hold (all of them on one device).
        vocab_rows = arch.vocab_size if vocab_shard is None else vocab_shard.shard_rows
        if "embed_tokens" in modules:
            hook = EmbeddingLoRAHook(
                ctx,
                torch.zeros(num_slots, vocab_rows + (vocab_shard is not None), R, dtype=dtype, device=device),
                rank_major_b(num_slots, arch.hidden_size, R, dtype, device),
                vocab_shard,
            )
            model.embed_lora = hook
            self.hooks[("embed_tokens", None)] = hook
        if "lm_head" in modules:
            hook = LinearLoRAHook(
                ctx,
                torch.zeros(num_slots, R, arch.hidden_size, dtype=dtype, device=device),
                rank_major_b(num_slots, vocab_rows, R, dtype, device),
                (0, vocab_rows),
                logits=True,
            )
            model.lm_head_lora = hook
            self.hooks[("lm_head", None)] = hook

    def _attach_moe(
        self, mlp: SparseMoE, layer_id: int, groups: list[str], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Buffers and hooks of one MoE layer: its router, and its experts' parts in ``groups``."""
        R, slots = self.max_rank, self.num_slots
        gate = mlp.gate
        hook = LinearLoRAHook(
            self.ctx,
            torch.zeros(slots, R, gate.in_features, dtype=dtype, device=device),
            rank_major_b(slots, gate.out_features, R, dtype, device),
            gate.slice_offsets,
        )
        gate.lora = hook
        self.hooks[(ROUTER, layer_id)] = hook
        experts = mlp.experts
        num, hidden, inter = experts.num_experts, experts.hidden_size, experts.intermediate_size
        for group, attr, in_dim, offsets in (
            ("gate_up_proj", "lora_gate_up", hidden, (0, inter, 2 * inter)),
            ("down_proj", "lora_down", inter, (0, hidden)),
        ):
            if group not in groups:
                continue
            out_dim, num_slices = offsets[-1], len(offsets) - 1
            expert_hook = ExpertLoRAHook(
                self.ctx,
                torch.zeros(slots, num, num_slices * R, in_dim, dtype=dtype, device=device),
                torch.zeros(slots, num, R, out_dim, dtype=dtype, device=device).transpose(2, 3),
                offsets,
            )
            setattr(experts, attr, expert_hook)
            self.hooks[(group, layer_id)] = expert_hook
        shared = mlp.shared_expert
        linears = {SHARED_GATE: mlp.shared_expert_gate}
        if shared is not None:
            parts = [g for g in groups if g in ("gate_up_proj", "down_proj")]
            linears.update({SHARED + g: shared.get_submodule(g) for g in parts})
        for key, linear in linears.items():
            if linear is None:
                continue
            hook = LinearLoRAHook(
                self.ctx,
                torch.zeros(slots, len(linear.out_sizes) * R, linear.in_features, dtype=dtype, device=device),
                rank_major_b(slots, linear.out_features, R, dtype, device),
                linear.slice_offsets,
            )
            linear.lora = hook
            self.hooks[(key, layer_id)] = hook

    @property
    def num_bytes(self) -> int:
        return sum(h.A.numel() * h.A.element_size() + h.B.numel() * h.B.element_size() for h in self.hooks.values())

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy an adapter into ``slot`` (zeroing whatever was there)."""
        for hook in self.hooks.values():
            hook.A[slot].zero_()
            hook.B[slot].zero_()
            if isinstance(hook, ExpertLoRAHook):
                hook.set_rank(slot, 0)
        R = self.max_rank
        for (module, layer), (a, b) in adapter.weights.items():
            r = b.shape[-1]  # this module's rank (at most the slot's, adapter.rank)
            prefix = SHARED if module.startswith(SHARED) else ""  # a shared expert's part
            if module.removeprefix(prefix) in GROUP_OF:
                group, part = GROUP_OF[module.removeprefix(prefix)]
                hook = self.hooks[(prefix + group, layer)]
                lo, hi = hook.slice_offsets[part], hook.slice_offsets[part + 1]
                if isinstance(hook, ExpertLoRAHook):  # a: [experts, r, in], b: [experts, out, r]
                    hook.A[slot, :, part * R : part * R + r].copy_(a, non_blocking=True)
                    hook.B[slot, :, lo:hi, :r].copy_(b, non_blocking=True)
                    hook.set_rank(slot, r)
                    continue
                hook.A[slot, part * R : part * R + r].copy_(a, non_blocking=True)
                hook.B[slot, lo:hi, :r].copy_(b, non_blocking=True)
            elif module in (ROUTER, SHARED_GATE):
                hook = self.hooks[(module, layer)]
                hook.A[slot, :r].copy_(a, non_blocking=True)
                hook.B[slot, :, :r].copy_(b, non_blocking=True)
            else:
                hook = self.hooks[(module, None)]
                # Vocabulary-side tensors may be one rank's rows: copy as many as given.
                if module == "embed_tokens":
                    hook.A[slot, : a.shape[0], :r].copy_(a, non_blocking=True)  # a: [vocab rows, r]
                else:
                    hook.A[slot, :r].copy_(a, non_blocking=True)
                hook.B[slot, : b.shape[0], :r].copy_(b, non_blocking=True)
