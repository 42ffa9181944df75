"""Gemma 3 (text): the Llama-family decoder with Gemma's differences, as transformers'
``Gemma3ForCausalLM`` computes them.

- every RMSNorm scales by ``1 + weight`` (float32 throughout, cast back), the q/k head norms too;
- four norms per layer: attention and MLP are each normed before and after, then added;
- the MLP is ``down(gelu_tanh(gate) * up)``;
- embeddings are scaled by ``sqrt(hidden_size)`` (in the model's dtype);
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding layers see the last ``sliding_window`` positions and rotate with the local rope
  base; global layers see the whole context with the config's rope;
- logits are soft-capped when ``final_logit_softcapping`` is set.

Gemma 2 (``Gemma2ForCausalLM``, ``arch.family == "gemma2"``) is built from the same classes:
no q/k head norms, one rope base for every layer, and attention scores soft-capped
(``attn_logit_softcapping``) before the mask, in the SDPA and the paged paths alike.

Module names are the Llama layers' (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``), so adapters attach as on any Llama-family model. The KV cache keeps every
position of a sliding layer; the window is a mask (SDPA) or the paged kernel's window.

Tensor parallelism (``shard`` and ``group`` given) cuts Gemma as the Llama layers are cut
(see ``loraserve.runtime.distributed.sharding``): heads and KV heads split, o/down
row-parallel, embedding and lm_head vocab-parallel. What Gemma adds is held whole on every
rank: the q/k head norms act per head (each rank norms its own heads), the four layer norms
act on the complete residual stream, and ``query_pre_attn_scalar`` is a scalar. The
embedding is scaled after its all-reduce and the logits capped after their all-gather, so
each happens once, on complete values.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .arch import ModelArchConfig, RopeSpec
from .gemma3_config import GemmaSpec
from .layers import AttentionMetadata, RMSNorm, RotaryEmbedding
from .layers.parallel import Collectives
from .llama import LlamaAttention, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from ..distributed.sharding import ShardPlan


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)``, computed in float32 and cast back (Gemma's norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + delta
        return h, self(h)


class GemmaMLP(LlamaMLP):
    """``down(gelu_tanh(gate) * up)`` over the fused gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """``meta`` for a layer that sees only keys ``k > q - window``, built once per forward
    (cached on ``meta``, which :meth:`Gemma3ForCausalLM.forward` clears first, so a captured
    CUDA graph recomputes it from the replayed positions) and shared by every sliding layer."""
    cached = getattr(meta, "_gemma_window", None)
    if cached is not None and cached[0] == window:
        return cached[1]
    if meta.paged is not None:
        out = dataclasses.replace(meta, paged=dataclasses.replace(meta.paged, sliding_window=window))
    else:
        assert meta.mask is not None
        bs, max_q, max_ctx = meta.batch_size, meta.max_q, meta.max_ctx
        if meta.q_dest is None:
            q_pos = meta.positions.view(bs, max_q)
        else:  # padded rows keep position 0: their output is dropped
            q_pos = meta.positions.new_zeros(bs * max_q).index_copy_(0, meta.q_dest, meta.positions)
            q_pos = q_pos.view(bs, max_q)
        key = torch.arange(max_ctx, device=q_pos.device)
        near = key[None, None, :] > q_pos[:, :, None] - window  # [bs, max_q, ctx]
        groups = meta.mask.shape[2] // max_q
        near = near[:, None, None].expand(bs, 1, groups, max_q, max_ctx).reshape(meta.mask.shape)
        out = dataclasses.replace(meta, mask=meta.mask & near)
    meta._gemma_window = (window, out)  # type: ignore[attr-defined]
    return out


class GemmaAttention(LlamaAttention):
    """Llama attention with Gemma's head norms (Gemma 3), score scale, score cap (Gemma 2)
    and (sliding layers) window.

    Sharded, this rank's heads only; the head norms (``head_dim`` wide) are whole."""

    def __init__(
        self,
        arch: ModelArchConfig,
        rotary: RotaryEmbedding,
        *,
        window: int | None,
        dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
    ):
        super().__init__(arch, rotary, dtype=dtype, device=device, shard=shard, group=group)
        assert arch.gemma is not None
        if arch.gemma.head_norms:  # applied by LlamaAttention where arch.qk_norm (Gemma 3)
            self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
        self.attn.scale = arch.gemma.query_pre_attn_scalar**-0.5
        self.attn.softcap = arch.gemma.attn_softcap
        self.window = window

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        return super().forward(
            x, meta if self.window is None else windowed(meta, self.window), k_cache, v_cache
        )


class Gemma3DecoderLayer(nn.Module):
    """Normed attention and normed MLP, each normed again before its residual add (the norms
    see the complete stream: the row-parallel o/down have reduced before them)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        rotary: RotaryEmbedding,
        *,
        window: int | None,
        dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
    ):
        super().__init__()
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)
        self.self_attn = GemmaAttention(
            arch, rotary, window=window, dtype=dtype, device=device, shard=shard, group=group
        )
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)
        self.mlp = GemmaMLP(arch, dtype=dtype, device=device, shard=shard, group=group)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's (or Gemma 2's) decoder in the Llama model's frame: the same embedding, head,
    adapter hooks and weight loading; Gemma's layers, final norm, embedding scale and logit cap."""

    def __init__(
        self,
        arch: ModelArchConfig,
        *,
        max_positions: int,
        dtype: torch.dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
    ):
        # The Llama frame without its layers (Gemma's are built below), then the real arch.
        super().__init__(
            dataclasses.replace(arch, num_layers=0),
            max_positions=max_positions,
            dtype=dtype,
            device=device,
            shard=shard,
            group=group,
        )
        self.arch = arch
        gemma: GemmaSpec | None = arch.gemma
        if gemma is None:
            raise ValueError(f"{arch.architecture} has no Gemma config")
        if gemma.local_rope_theta is None:  # Gemma 2: one rope for every layer
            local = self.model.rotary
        else:
            local = RotaryEmbedding(
                RopeSpec(theta=gemma.local_rope_theta),
                arch.head_dim,
                max_positions,
                arch.max_position_embeddings,
                dtype=dtype,
                device=device,
            )
            self.model.local_rotary = local
        self.model.layers = nn.ModuleList(
            [
                Gemma3DecoderLayer(
                    arch,
                    local if sliding else self.model.rotary,
                    window=gemma.sliding_window if sliding else None,
                    dtype=dtype,
                    device=device,
                    shard=shard,
                    group=group,
                )
                for sliding in gemma.sliding_layers
            ]
        )
        self.model.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)
        self.embed_scale = math.sqrt(arch.hidden_size)
        self.softcap = gemma.final_logit_softcap

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        aux_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """As :meth:`LlamaForCausalLM.forward`, the embedding scaled first (in its dtype, as
        transformers scales it; an embedding adapter's delta is scaled with it, as peft does).
        Sharded, the scale applies to the complete embedding, after the all-reduce."""
        meta._gemma_window = None  # type: ignore[attr-defined]  # windows are built inside each forward (graphs too)
        h = self.model.embed_tokens(input_ids)
        if self.embed_lora is not None:
            self.embed_lora.apply(input_ids, h)
        if self.group is not None:
            h = self.group.all_reduce(h)  # partial embeddings (and their adapter deltas) summed
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return self.run_layers(h, meta, k_caches, v_caches, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.compute_logits` (whose logits are gathered over every
        rank's vocabulary columns), then soft-capped: the cap sees complete float32 logits."""
        logits = super().compute_logits(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
