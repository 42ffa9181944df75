"""The EAGLE / EAGLE3 draft head: one decoder layer over the target's features.

Built from the runtime's own layers (fused projections, rope table, paged attention), so
it runs wherever the target runs. The token embedding and (unless the checkpoint has its
own) the LM head are the target's BASE weights, held by reference: the draft reads the
weight tensors directly and never calls the target's modules, so no adapter hook can reach
a draft proposal. See :mod:`.eagle_format` for the checkpoint layout and the exact
equations, :mod:`.draft_vocab` for the vocabulary a draft predicts over.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..model.layers import Attention, AttentionMetadata, Linear, RMSNorm, RotaryEmbedding
from .draft_vocab import DraftVocab
from .eagle_format import EagleDraftConfig

_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def base_weight(module: nn.Module) -> torch.Tensor:
    """The base weight of an embedding / LM head, unwrapped from any adapter wrapper.

    Wrappers in the PEFT style keep the original module as ``base_layer``; the runtime's
    own layers keep adapters outside the module. Either way the returned tensor is the
    base model's weight, and a draft using it sees no adapter.
    """
    while hasattr(module, "base_layer"):
        module = module.base_layer
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor to share with a draft")
    return weight


class EagleDraftModel(nn.Module):
    """A single-layer EAGLE (version 1) or EAGLE3 (version 3) draft head."""

    def __init__(
        self,
        config: EagleDraftConfig,
        *,
        embed_weight: torch.Tensor,
        vocab: DraftVocab,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
        has_input_norm: bool = True,
    ):
        super().__init__()
        layer = config.layer
        h = config.hidden_size
        if embed_weight.shape[1] != h or vocab.head_weight.shape[1] != h:
            raise ValueError(
                f"the target's embeddings {tuple(embed_weight.shape)} / the draft's LM head "
                f"{tuple(vocab.head_weight.shape)} do not fit a draft of hidden_size {h}"
            )
        self.config = config
        self.version = config.version
        self.hidden_size = h
        self.num_heads, self.num_kv_heads, self.head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        self.q_size, self.kv_size = layer.q_size, layer.kv_size
        self.intermediate_size = layer.intermediate_size
        eps = layer.rms_norm_eps
        kw = {"dtype": dtype, "device": device}
        self.fc = Linear(config.fc_in_features, (h,), bias=config.fc_bias, **kw)
        # EAGLE's layer 0 traditionally has no input norm (the fc output feeds attention).
        self.input_layernorm = RMSNorm(h, eps, **kw) if (has_input_norm or self.version == 3) else None
        self.hidden_norm = RMSNorm(h, eps, **kw) if self.version == 3 else None
        self.qkv_proj = Linear(
            config.attn_in_features,
            (self.q_size, self.kv_size, self.kv_size),
            bias=layer.attention_bias,
            **kw,
        )
        self.o_proj = Linear(self.q_size, (h,), bias=layer.o_bias, **kw)
        self.post_attention_layernorm = RMSNorm(h, eps, **kw)
        self.gate_up_proj = Linear(h, (self.intermediate_size,) * 2, bias=layer.mlp_bias, **kw)
        self.down_proj = Linear(self.intermediate_size, (h,), bias=layer.mlp_bias, **kw)
        self.norm = RMSNorm(h, eps, **kw) if self.version == 3 else None
        self.rotary = RotaryEmbedding(
            layer.rope, layer.head_dim, max_positions, layer.max_position_embeddings, **kw
        )
        self.attn = Attention(layer.num_heads, layer.num_kv_heads, layer.head_dim)
        # Shared, not registered: they belong to the target and are not draft parameters.
        # detach(): a plain tensor view of the same storage, so nn.Module does not adopt
        # the target's Parameters as the draft's own.
        self._embed_weight = embed_weight.detach()
        self.vocab = vocab
        self.lora = None  # a draft never carries adapters

    @property
    def feature_size(self) -> int:
        """Width of the target feature this draft consumes (fc input less the embedding)."""
        if self.version == 3:
            return self.config.fc_in_features
        return self.hidden_size

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self._embed_weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        from_target: bool = True,
    ) -> torch.Tensor:
        """One draft layer over ``T`` rows; returns the output feature ``[T, H]``.

        ``input_ids[t]`` is the token after the position whose feature is ``features[t]``.
        ``features`` is the target's feature (``from_target``; EAGLE: ``[T, H]``, EAGLE3:
        ``[T, n_aux*H_t]``) or, on later draft steps, the draft's own output (``[T, H]``).
        """
        emb = self.embed(input_ids)
        if self.version == 3:
            feature = self.fc(features) if from_target else features
            assert self.input_layernorm is not None and self.hidden_norm is not None
            x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feature)], dim=-1)
            residual = feature
        else:
            residual = self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1))
            x = residual if self.input_layernorm is None else self.input_layernorm(residual)
        h = residual + self._attention(x, meta, k_cache, v_cache)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).split(self.intermediate_size, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def _attention(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = self.rotary(
            meta.positions,
            q.reshape(tokens, self.num_heads, self.head_dim),
            k.reshape(tokens, self.num_kv_heads, self.head_dim),
        )
        out = self.attn(q.reshape(tokens, -1), k.reshape(tokens, -1), v, k_cache, v_cache, meta)
        return self.o_proj(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) over the target's vocabulary, ``-inf`` outside the draft's."""
        return self.vocab.full_logits(self._final(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of :meth:`compute_logits` (target ids), scoring the draft's vocabulary only."""
        return self.vocab.greedy(self._final(hidden))

    def _final(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.norm is None else self.norm(hidden)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors (already checked by :func:`load_eagle_tensors`)."""
        params = dict(self.named_parameters())
        for name, tensor in tensors.items():
            key = name.removeprefix("layers.0.").removeprefix("self_attn.").removeprefix("mlp.")
            parts = key.split(".")
            if parts[0] in _FUSED:
                fused, index = _FUSED[parts[0]]
                module = getattr(self, fused)
                offsets = module.slice_offsets
                dest = getattr(module, parts[1]).data[offsets[index] : offsets[index + 1]]
            else:
                if key not in params:
                    raise ValueError(
                        f"EAGLE draft tensor {name!r} has no place in a version-{self.version} draft"
                    )
                dest = params[key].data
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"EAGLE draft tensor {name!r}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
