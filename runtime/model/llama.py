"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral, Phi-3)
over flat batched token rows. An MoE layer's MLP is :class:`~.moe.SparseMoE` (Qwen2-MoE's
shared expert inside it is a :class:`LlamaMLP` of its own size).

Fused projections: ``qkv_proj`` holds q, k and v; ``gate_up_proj`` holds gate and up.
Checkpoint tensors keep their Hugging Face names and are routed into the fused weights
by :meth:`LlamaForCausalLM.load_weights`. Phi-3's checkpoints hold the fused tensors already:
each is read as its parts (:func:`split_fused_checkpoint`), so one path loads, shards and
checks every family.

Tensor parallelism (``shard`` and ``group`` given): q/k/v and gate/up hold this rank's
output rows, o/down are row-parallel, the embedding and lm_head vocab-parallel, an MoE
layer's experts cut along their intermediate dimension (router whole, one all-reduce per
layer; see ``loraserve.runtime.distributed.sharding``). Without them the model is built
exactly as for one device: plain layers, no collective anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from loraserve.kernels import model_ops

from ..contract.config import FUSED_PROJECTIONS
from .arch import ModelArchConfig
from .layers import (
    Attention,
    AttentionMetadata,
    Linear,
    LMHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
)
from .layers.parallel import Collectives, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from .moe import SparseMoE, moe_checkpoint_names, moe_destination, shard_moe_tensor

if TYPE_CHECKING:
    from ..distributed.sharding import ShardPlan

# HF checkpoint part -> (our fused module, index of the part inside it)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model; the message names the tensor and the fix."""


def split_fused_checkpoint(
    arch: ModelArchConfig, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """A Phi-3 checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` tensor as the parts other
    families' checkpoints hold (row views, named ``q_proj`` ... ``up_proj``); any other tensor
    as it is."""
    parts = name.split(".")
    if arch.family != "phi3" or len(parts) < 2 or parts[-2] not in FUSED_PROJECTIONS:
        return [(name, tensor)]
    if parts[-2] == "qkv_proj":
        sizes = (arch.q_size, arch.kv_size, arch.kv_size)
    else:
        sizes = (arch.intermediate_size, arch.intermediate_size)
    if tensor.shape[0] != sum(sizes):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, config.json implies {sum(sizes)} "
            f"({' + '.join(map(str, sizes))}): the checkpoint does not match config.json"
        )
    names = FUSED_PROJECTIONS[parts[-2]]
    return [
        (".".join([*parts[:-2], part, parts[-1]]), piece)
        for part, piece in zip(names, tensor.split(sizes, dim=0), strict=True)
    ]


def _output_linear(
    in_features: int,
    hidden_size: int,
    *,
    bias: bool,
    dtype: torch.dtype,
    device,
    shard: ShardPlan | None,
    group: Collectives | None,
) -> Linear:
    """The projection back to the residual stream (attention's o_proj, the MLP's down_proj).

    Sharded, it reads this rank's heads / columns and sums the ranks' partial outputs
    (:class:`RowParallelLinear`); unsharded, a plain :class:`Linear`.
    """
    if shard is None:
        return Linear(in_features, (hidden_size,), bias=bias, dtype=dtype, device=device)
    return RowParallelLinear(in_features, (hidden_size,), bias=bias, dtype=dtype, device=device, group=group)


class LlamaAttention(nn.Module):
    """Self-attention with fused q/k/v, rotary positions and the paged KV cache.

    ``in_features``: the width q/k/v read (default ``hidden_size``; an EAGLE3 draft layer
    reads ``[embedding; feature]``, twice that). The output is always ``hidden_size`` wide.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
        in_features: int | None = None,
    ):
        super().__init__()
        heads, kv_heads = arch.num_heads, arch.num_kv_heads
        if shard is not None:
            heads, kv_heads = shard.local_heads, shard.local_kv_heads
        q_size, kv_size = heads * arch.head_dim, kv_heads * arch.head_dim
        self.qkv_proj = Linear(
            in_features or arch.hidden_size,
            (q_size, kv_size, kv_size),
            bias=arch.attention_bias,
            dtype=dtype,
            device=device,
        )
        self.o_proj = _output_linear(
            q_size, arch.hidden_size, bias=arch.o_bias, dtype=dtype, device=device, shard=shard, group=group
        )
        self.attn = Attention(heads, kv_heads, arch.head_dim)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype=dtype, device=device)
        self.qk_norm = arch.qk_norm
        self.rotary = rotary
        self.q_size, self.kv_size = q_size, kv_size
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, arch.head_dim

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.rope_and_attend(q, k, v, meta, k_cache, v_cache))

    def rope_and_attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Rotary on ``q [T, H, D]`` and ``k [T, KH, D]``, the rotated keys and ``v`` written
        to the cache slots ``meta.out_cache_loc`` (one kernel on CUDA), then attention over
        each request's context; ``[T, H * D]``."""
        tokens = q.shape[0]
        cos, sin = self.rotary.cos, self.rotary.sin
        q = model_ops.rotary_kv_write(meta.positions, q, k, v, cos, sin, k_cache, v_cache, meta.out_cache_loc)
        return self.attn(q.reshape(tokens, -1), k, v, k_cache, v_cache, meta, kv_written=True)


class LlamaMLP(nn.Module):
    """The gated SiLU MLP with fused gate/up.

    ``intermediate_size``: the whole MLP's (default the model's; an MoE layer's shared expert
    has its own), cut over the ranks when ``shard`` is given. ``partial``: under tensor
    parallelism the down projection returns this rank's partial sum unreduced (the shared
    expert's joins its MoE layer's one all-reduce; Qwen2-MoE's MLPs have no bias).
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        *,
        dtype: torch.dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
        intermediate_size: int | None = None,
        partial: bool = False,
    ):
        super().__init__()
        whole = arch.intermediate_size if intermediate_size is None else intermediate_size
        i = whole if shard is None else whole // shard.size
        self.gate_up_proj = Linear(arch.hidden_size, (i, i), bias=arch.mlp_bias, dtype=dtype, device=device)
        if partial:
            self.down_proj = Linear(i, (arch.hidden_size,), bias=False, dtype=dtype, device=device)
        else:
            self.down_proj = _output_linear(
                i, arch.hidden_size, bias=arch.mlp_bias, dtype=dtype, device=device, shard=shard, group=group
            )
        self.intermediate_size = i

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(model_ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream.

    ``attn_in_features``: the width the attention's q/k/v read (see :class:`LlamaAttention`;
    a draft head's layer may read more than ``hidden_size``). ``layer_id``: the layer's
    index, which decides whether an MoE model's layer has the sparse MLP.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device,
        shard: ShardPlan | None = None,
        group: Collectives | None = None,
        attn_in_features: int | None = None,
        layer_id: int = 0,
    ):
        super().__init__()
        # Typed as any module: a draft head's layer may replace it (EAGLE without an input norm).
        self.input_layernorm: nn.Module = RMSNorm(
            arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device
        )
        self.self_attn = LlamaAttention(
            arch, rotary, dtype=dtype, device=device, shard=shard, group=group, in_features=attn_in_features
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)
        self.mlp: LlamaMLP | SparseMoE
        if arch.is_moe_layer(layer_id):
            assert arch.moe is not None
            shared = arch.moe.shared_intermediate_size
            shared_expert = None
            if shared:
                shared_expert = LlamaMLP(
                    arch, dtype=dtype, device=device, shard=shard, intermediate_size=shared, partial=True
                )
            self.mlp = SparseMoE(
                arch, dtype=dtype, device=device, shard=shard, group=group, shared_expert=shared_expert
            )
        else:
            self.mlp = LlamaMLP(arch, dtype=dtype, device=device, shard=shard, group=group)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        return self.mlp_block(x, self.self_attn(self.input_layernorm(x), meta, k_cache, v_cache))

    def mlp_block(self, h: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's second half: the residual ``h`` (plus ``delta``, the attention's
        output, added in the same pass as the norm when given) plus its normed MLP."""
        norm = self.post_attention_layernorm
        if delta is None:
            return h + self.mlp(norm(h))
        if isinstance(norm, RMSNorm):
            h, normed = norm.add_forward(h, delta)
        else:
            h = h + delta
            normed = norm(h)
        return h + self.mlp(normed)


class LlamaModel(nn.Module):
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
        super().__init__()
        if shard is None:
            self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        else:
            self.embed_tokens = VocabParallelEmbedding(
                arch.vocab_size,
                arch.hidden_size,
                vocab_range=shard.vocab_range,
                shard_rows=shard.vocab_shard_rows,
                dtype=dtype,
                device=device,
            )
        # One rope table for all layers (not a registered child of each layer).
        self.rotary = RotaryEmbedding(
            arch.rope,
            arch.head_dim,
            max_positions,
            arch.max_position_embeddings,
            dtype=dtype,
            device=device,
        )
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(
                    arch, self.rotary, dtype=dtype, device=device, shard=shard, group=group, layer_id=i
                )
                for i in range(arch.num_layers)
            ]
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus output head; LoRA hooks are attached by the adapter pool.

    ``embed_lora`` / ``lm_head_lora``: optional hooks adding an adapter's embedding and
    output-projection deltas; ``None`` in a draft model. ``shard`` / ``group``: this
    rank's share of a tensor-parallel model and the group it reduces over.
    """

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
        super().__init__()
        if (shard is None) != (group is None):
            raise ValueError("a tensor-parallel model needs both its shard plan and its group")
        self.arch = arch
        self.dtype = dtype
        self.shard = shard
        self.group = group
        self.model = LlamaModel(
            arch, max_positions=max_positions, dtype=dtype, device=device, shard=shard, group=group
        )
        tied = self.model.embed_tokens if arch.tie_word_embeddings else None
        if shard is None:
            self.lm_head = LMHead(arch.hidden_size, arch.vocab_size, dtype=dtype, device=device, tied_to=tied)
        else:
            self.lm_head = ParallelLMHead(
                arch.hidden_size,
                arch.vocab_size,
                shard_rows=shard.vocab_shard_rows,
                dtype=dtype,
                device=device,
                tied_to=tied,  # type: ignore[arg-type]
            )
        self.embed_lora = None
        self.lm_head_lora = None

    @property
    def embed_tokens(self) -> VocabEmbedding:
        return self.model.embed_tokens

    @property
    def _num_experts(self) -> int:
        return 0 if self.arch.moe is None else self.arch.moe.num_experts

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        aux_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the decoder; returns ``(final normed hidden [T, H], aux hiddens)``.

        ``aux_layers``: layer indices whose input residual stream (the output of layer
        ``i-1``; the embeddings for ``i == 0``; the final un-normed stream for
        ``i == num_layers``) is returned, in the order given.
        """
        h = self.model.embed_tokens(input_ids)
        if self.embed_lora is not None:
            self.embed_lora.apply(input_ids, h)
        if self.group is not None:
            h = self.group.all_reduce(h)  # partial embeddings (and their adapter deltas) summed
        return self.run_layers(h, meta, k_caches, v_caches, aux_layers)

    def run_layers(
        self,
        h: torch.Tensor,
        meta: AttentionMetadata,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        aux_layers: Sequence[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers over the embedded rows ``h``, then the final norm; returns
        ``(final normed hidden, aux hiddens)`` as :meth:`forward` does."""
        wanted = {layer: pos for pos, layer in enumerate(aux_layers)}
        aux: list[torch.Tensor | None] = [None] * len(aux_layers)
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                aux[wanted[i]] = h
            h = layer(h, meta, k_caches[i], v_caches[i])
        if len(self.model.layers) in wanted:
            aux[wanted[len(self.model.layers)]] = h
        return self.model.norm(h), aux  # type: ignore[return-value]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits (float32) for the given hidden rows, with the lm_head adapter."""
        logits = self.lm_head(hidden)
        if self.lm_head_lora is not None:
            self.lm_head_lora.apply(hidden, logits)
        if self.group is not None:
            # This rank's vocabulary columns, adapter delta included, then everyone's.
            logits = self.group.all_gather_last_dim(logits)[:, : self.arch.vocab_size]
        return logits.float()

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters; checks completeness."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        weights = (part for n, t in weights for part in split_fused_checkpoint(self.arch, n, t))
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # recomputed from the config
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue  # some tied checkpoints store a copy; the embedding is the source
            dest = checkpoint_destination(self, params, name)
            if dest is None:
                raise WeightLoadError(
                    f"checkpoint tensor {name!r} has no place in a {self.arch.architecture} with "
                    f"{self.arch.num_layers} layers: the checkpoint does not match config.json"
                )
            if self.shard is not None:
                experts = shard_moe_tensor(self.shard, name, tensor)
                tensor = self.shard.shard_checkpoint_tensor(name, tensor) if experts is None else experts
            copy_checkpoint_tensor(dest, name, tensor)
            loaded.update(moe_checkpoint_names(name, self._num_experts) or (name,))
        expected = set(expected_checkpoint_names(self))
        missing = sorted(expected - loaded)
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            experts = (
                " (experts are named per expert, as Qwen does; Mixtral's block_sparse_moe.experts.N.w1/w3/w2 "
                "are gate_proj/up_proj/down_proj, and a fused mlp.experts.gate_up_proj provides every expert's "
                "gate_proj and up_proj)"
                if any(".experts." in name for name in missing)
                else ""
            )
            raise WeightLoadError(
                f"checkpoint is missing tensors {missing[:5]}{more}{experts}: the weights are incomplete"
            )


def checkpoint_destination(
    model: nn.Module, params: dict[str, nn.Parameter], name: str
) -> torch.Tensor | None:
    """Where the Hugging Face-named tensor ``name`` goes in ``model``: its parameter, or its
    part of a fused one (``q_proj`` -> a slice of ``qkv_proj``); None where it has no place.
    ``params``: ``model``'s named parameters. Expert weights arrive fused or per expert
    (:func:`~.moe.moe_destination`)."""
    moe = moe_destination(params, name)
    if moe is not None:
        return moe
    target, part = _route(name)
    if target not in params:
        return None
    param = params[target]
    if part is None:
        return param.data
    offsets = model.get_submodule(target.rsplit(".", 1)[0]).slice_offsets
    return param.data[offsets[part] : offsets[part + 1]]


def copy_checkpoint_tensor(dest: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """``dest[...] = tensor`` in ``dest``'s dtype, refusing a shape that does not fit."""
    if tuple(dest.shape) != tuple(tensor.shape):
        raise WeightLoadError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
            f"{tuple(dest.shape)}: the checkpoint does not match config.json"
        )
    dest.copy_(tensor.to(dest.dtype))


def _route(name: str) -> tuple[str, int | None]:
    """Map a HF tensor name to ``(our parameter name, fused part index or None)``."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        fused, index = _STACKED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), index
    return name, None


def expected_checkpoint_names(model: LlamaForCausalLM) -> list[str]:
    """The Hugging Face tensor names a complete checkpoint for ``model`` provides."""
    names = []
    inverse = {}
    for part, (fused, index) in _STACKED.items():
        inverse.setdefault(fused, {})[index] = part
    for name, param in model.named_parameters():
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue
        del param
        experts = moe_checkpoint_names(name, model._num_experts)
        if experts is not None:
            names.extend(experts)  # complete in either layout: counted per expert
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in inverse:
            for index in sorted(inverse[parts[-2]]):
                names.append(".".join([*parts[:-2], inverse[parts[-2]][index], parts[-1]]))
        else:
            names.append(name)
    return names
