"""The EAGLE / EAGLE3 draft head: one decoder layer over the target's features.

Built from the target's own classes: the decoder layer is :class:`LlamaDecoderLayer`
(attention, MLP, norms and their forward), parametrised only where EAGLE differs (the
fc over the target's feature, EAGLE3's 2H-wide q/k/v input and its hidden norm, the
optional input norm of the original EAGLE layout), and checkpoint tensors are routed
into its fused weights by the target's loader. So it runs wherever the target runs. The token embedding and (unless the checkpoint has its
own) the LM head are the target's BASE weights, held by reference: the draft reads the
weight tensors directly and never calls the target's modules, so no adapter hook can reach
a draft proposal. See :mod:`.format` for the checkpoint layout and the exact
equations, :mod:`..draft_vocab` for the vocabulary a draft predicts over.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...model.layers import AttentionMetadata, Linear, RMSNorm, RotaryEmbedding
from ...model.llama import LlamaDecoderLayer, WeightLoadError, checkpoint_destination, copy_checkpoint_tensor
from ..draft_vocab import DraftVocab
from .format import EagleDraftConfig


class EagleDecoderLayer(LlamaDecoderLayer):
    """The target's decoder layer with EAGLE's input side (checkpoint prefix ``layers.0.``).

    EAGLE: the fc output is the layer's input and residual, exactly as in the target
    (:meth:`LlamaDecoderLayer.forward`); without ``input_norm`` (the original layout) it
    feeds attention un-normed. EAGLE3 (:meth:`forward_eagle3`): attention reads
    ``[input_layernorm(embedding), hidden_norm(feature)]`` (so q/k/v take ``2H``) over the
    residual ``feature``, or ``hidden_norm(feature)`` where the head sets
    ``norm_before_residual``. The MLP half is the target's either way.
    """

    def __init__(
        self,
        config: EagleDraftConfig,
        rotary: RotaryEmbedding,
        *,
        input_norm: bool,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        layer = config.layer
        super().__init__(layer, rotary, dtype=dtype, device=device, attn_in_features=config.attn_in_features)
        self.norm_before_residual = config.norm_before_residual
        if config.version == 3:
            self.hidden_norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps, dtype=dtype, device=device)
        elif not input_norm:
            self.input_layernorm = nn.Identity()

    def forward_eagle3(
        self,
        embeds: torch.Tensor,
        feature: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """EAGLE3's layer: attention over the normed embedding and feature side by side,
        added to the residual (:meth:`eagle3_inputs`), then the MLP half."""
        residual, x = self.eagle3_inputs(embeds, feature)
        return self.mlp_block(residual, self.self_attn(x, meta, k_cache, v_cache))

    def eagle3_inputs(self, embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE3's ``(residual, attention input)``: ``[input_layernorm(embeds),
        hidden_norm(feature)]`` over the residual ``feature``, or ``hidden_norm(feature)``
        with ``norm_before_residual``. Every caller that unrolls the layer takes both from here."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        return residual, torch.cat([self.input_layernorm(embeds), normed], dim=-1)


class EagleDraftModel(nn.Module):
    """A single-layer EAGLE (version 1) or EAGLE3 (version 3) draft head.

    Parameters carry the checkpoint's names (:mod:`.format`): ``fc``, ``layers.0.*``
    and, for EAGLE3, ``norm``; the embedding and (unless the checkpoint has its own) the
    LM head are the target's, held as plain tensors, never as parameters.
    """

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
        kw = {"dtype": dtype, "device": device}
        self.fc = Linear(config.fc_in_features, (h,), bias=config.fc_bias, **kw)
        self.rotary = RotaryEmbedding(
            layer.rope, layer.head_dim, max_positions, layer.max_position_embeddings, **kw
        )
        self.layers = nn.ModuleList([EagleDecoderLayer(config, self.rotary, input_norm=has_input_norm, **kw)])
        self.norm = RMSNorm(h, layer.rms_norm_eps, **kw) if self.version == 3 else None
        # Shared, not registered: they belong to the target and are not draft parameters.
        # detach(): a plain tensor view of the same storage, so nn.Module does not adopt
        # the target's Parameters as the draft's own.
        self._embed_weight = embed_weight.detach()
        self.vocab = vocab
        # The target's adapters never reach the head. Its own draft adapters (if the serve
        # has a draft adapter pool) hook into its linears from the runner's pool, never into
        # the shared embedding / LM head above.
        self.lora = None

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
        layer = self.layers[0]
        if self.version == 3:
            feature = self.fc(features) if from_target else features
            return layer.forward_eagle3(emb, feature, meta, k_cache, v_cache)
        return layer(self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1)), meta, k_cache, v_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) over the target's vocabulary, ``-inf`` outside the draft's."""
        return self.vocab.full_logits(self._final(hidden))

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax of :meth:`compute_logits` (target ids), scoring the draft's vocabulary only."""
        return self.vocab.greedy(self._final(hidden))

    def _final(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.norm is None else self.norm(hidden)

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy checkpoint tensors (already checked by :func:`load_eagle_tensors`), routed
        into the fused weights as the target's are."""
        params = dict(self.named_parameters())
        for name, tensor in tensors.items():
            dest = checkpoint_destination(self, params, name)
            if dest is None:
                raise WeightLoadError(
                    f"EAGLE draft tensor {name!r} has no place in a version-{self.version} draft"
                )
            copy_checkpoint_tensor(dest, name, tensor)
