"""The DFLASH draft: decoder layers that draft a whole block from the target's features.

Built from the target's own pieces: each layer is the target's pre-norm attention + MLP
(:class:`~...model.llama.LlamaAttention`, :class:`~...model.llama.LlamaMLP`, the paged KV
attention) with Qwen3's per-head q/k norms added, and checkpoint tensors are routed into
the fused weights by the target's loader. See :mod:`.format` for the equations.

Two entry points, both over the draft's own KV cache (one entry per context position):

- :meth:`DFlashDraftModel.write_context` projects the target's captured features and
  writes every layer's keys and values for those positions (no attention runs: context
  positions are never queries);
- :meth:`DFlashDraftModel.forward` runs a block of token rows through the layers; the
  attention metadata decides what each row sees (the drafter passes a "tree" whose nodes
  all see each other: non-causal inside the block, causal to the context).

The token embedding and the LM head are the target's BASE weights, held as plain tensors
(never as the target's modules), so no adapter hook can reach a proposal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.kernels import model_ops

from ...model.layers import AttentionMetadata, Linear, RMSNorm, RotaryEmbedding
from ...model.llama import (
    LlamaAttention,
    LlamaMLP,
    WeightLoadError,
    checkpoint_destination,
    copy_checkpoint_tensor,
)
from .format import DFlashDraftConfig


class DFlashAttention(LlamaAttention):
    """The target's attention with per-head RMSNorms on q and k before the rotation."""

    def __init__(self, config: DFlashDraftConfig, rotary: RotaryEmbedding, *, dtype: torch.dtype, device):
        layer = config.layer
        super().__init__(layer, rotary, dtype=dtype, device=device)
        self.q_norm = RMSNorm(layer.head_dim, layer.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = RMSNorm(layer.head_dim, layer.rms_norm_eps, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
        return self.o_proj(self.rope_and_attend(q, k, v, meta, k_cache, v_cache))

    def write_context_kv(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Keys (normed, rotated to ``positions``) and values of projected context rows,
        written to cache ``slots``. Only the k/v rows of the fused weight run: context
        positions are never queries."""
        n = context.shape[0]
        start = self.q_size
        weight = self.qkv_proj.weight[start:]
        bias = self.qkv_proj.bias[start:] if self.qkv_proj.bias is not None else None
        k, v = F.linear(context, weight, bias).split((self.kv_size, self.kv_size), dim=-1)
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        # The rotary write rotates queries and keys together: an empty query set costs nothing.
        cos, sin = self.rotary.cos, self.rotary.sin
        model_ops.rotary_kv_write(positions, k[:, :0], k, v, cos, sin, k_cache, v_cache, slots)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, as the target's layer (checkpoint prefix ``layers.{j}.``)."""

    def __init__(self, config: DFlashDraftConfig, rotary: RotaryEmbedding, *, dtype: torch.dtype, device):
        super().__init__()
        layer = config.layer
        self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = DFlashAttention(config, rotary, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(
            layer.hidden_size, layer.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = LlamaMLP(layer, dtype=dtype, device=device)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache)
        h, normed = self.post_attention_layernorm.add_forward(x, attn)
        return h + self.mlp(normed)


class DFlashDraftModel(nn.Module):
    """The DFLASH draft: ``fc`` + ``hidden_norm`` over the target's features, ``n`` layers,
    a final ``norm``; the target's base embedding and LM head by reference."""

    def __init__(
        self,
        config: DFlashDraftConfig,
        *,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        h = config.hidden_size
        if embed_weight.shape[1] != h or lm_head_weight.shape[1] != h:
            raise ValueError(
                f"the target's embeddings {tuple(embed_weight.shape)} / lm_head {tuple(lm_head_weight.shape)} "
                f"do not fit a DFLASH draft of hidden_size {h}"
            )
        layer = config.layer
        kw = {"dtype": dtype, "device": device}
        self.config = config
        self.fc = Linear(config.fc_in_features, (h,), bias=False, **kw)
        self.hidden_norm = RMSNorm(h, layer.rms_norm_eps, **kw)
        self.rotary = RotaryEmbedding(
            layer.rope, layer.head_dim, max_positions, layer.max_position_embeddings, **kw
        )
        self.layers = nn.ModuleList(
            [DFlashDecoderLayer(config, self.rotary, **kw) for _ in range(layer.num_layers)]
        )
        self.norm = RMSNorm(h, layer.rms_norm_eps, **kw)
        # Shared, not registered: they belong to the target. detach(): a plain view of the
        # same storage, so nn.Module does not adopt the target's Parameters as the draft's.
        self._embed_weight = embed_weight.detach()
        self._head_weight = lm_head_weight.detach()
        self.lora = None  # a draft never carries adapters

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's BASE embedding of ``ids`` (scaled as the checkpoint asks)."""
        emb = F.embedding(ids, self._embed_weight)
        scale = self.config.input_embedding_scale
        return emb if scale == 1.0 else emb * scale

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Context rows ``[n, H]`` from the target's captured features ``[n, K * H]``."""
        return self.hidden_norm(self.fc(features))

    def write_context(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> None:
        """Write every layer's keys and values of the context rows ``features`` (at
        ``positions``) into cache ``slots``."""
        context = self.project(features)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            layer.self_attn.write_context_kv(context, positions, slots, k_cache, v_cache)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """The block rows through every layer; returns the final normed hidden ``[T, H]``."""
        x = self.embed(input_ids)
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches, strict=True):
            x = layer(x, meta, k_cache, v_cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the target's vocabulary, through its BASE lm_head."""
        logits = F.linear(hidden.to(self._head_weight.dtype), self._head_weight).float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors (checked by :func:`.format.load_dflash_tensors`),
        routed into the fused weights as the target's are."""
        params = dict(self.named_parameters())
        for name, tensor in tensors.items():
            dest = checkpoint_destination(self, params, name)
            if dest is None:
                raise WeightLoadError(f"DFLASH draft tensor {name!r} has no place in the draft")
            copy_checkpoint_tensor(dest, name, tensor)
