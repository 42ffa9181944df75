"""The DFLASH draft checkpoint format: an HF-style directory, config + safetensors.

DFLASH (block diffusion drafting, the DFlash paper; z-lab's ``DFlashDraftModel``, the
format the reference engine's DFLASH worker loads) proposes a whole block of tokens in
one forward, conditioned on hidden states the target already computed.

``config.json`` is a Qwen3-style decoder config for the draft's ``num_hidden_layers``
layers (heads, ``head_dim``, rope, ``rms_norm_eps``, ``intermediate_size``) plus:

- ``architectures``: ``["DFlashDraftModel"]``;
- ``block_size``: the block the draft was trained on (``dflash_config.block_size`` wins
  when both are set, as in the reference engine);
- ``dflash_config.target_layer_ids``: the target layers whose OUTPUTS form the context
  feature, in Hugging Face's ``hidden_states[i + 1]`` numbering (top-level
  ``target_layer_ids`` is read too). Without them the reference's default: one draft layer
  takes the middle layer ``L // 2``, ``n`` layers spread evenly from 1 to ``L - 3``, with
  ``L`` = ``num_target_layers`` (else the target's layer count);
- ``dflash_config.mask_token_id`` (or ``dflash_config.mask_token``, a string): the token
  that fills the block's unknown positions (see :func:`resolve_mask_token_id` for the order
  of fallbacks);
- ``layer_types``: only ``full_attention`` layers are served (sliding-window DFLASH layers
  are refused); ``input_embedding_scale``, ``output_multiplier`` and
  ``final_logit_softcapping`` (inside ``dflash_config``) are honoured when present.

Tensors (an optional leading ``model.`` is ignored; ``n`` layers, ``K`` target layers):

==============================================  ======================
name                                            shape
==============================================  ======================
``fc.weight``                                   ``[H, K * H]``
``hidden_norm.weight``                          ``[H]``
``layers.{j}.input_layernorm.weight``           ``[H]``
``layers.{j}.self_attn.{q,k,v}_proj.weight``    ``[out, H]`` (+ bias with ``attention_bias``)
``layers.{j}.self_attn.o_proj.weight``          ``[H, q]``
``layers.{j}.self_attn.{q,k}_norm.weight``      ``[head_dim]``
``layers.{j}.post_attention_layernorm.weight``  ``[H]``
``layers.{j}.mlp.{gate,up,down}_proj.weight``   ``[I, H]`` / ``[H, I]``
``norm.weight``                                 ``[H]``
==============================================  ======================

Token embeddings and the LM head are never the draft's: it takes the target's BASE
``embed_tokens`` and ``lm_head`` (a copy stored in the checkpoint is ignored), so its
``hidden_size`` must equal the target's.

Semantics (per request; ``t`` committed tokens, the last one not yet seen by the target):
the context ``c[p] = hidden_norm(fc(concat_k target_out[layer_k][p]))`` for every position
``p < t - 1`` the target has computed; each layer's keys and values of position ``p`` are
``k_norm(k_proj(c[p]))`` (rotated to ``p``) and ``v_proj(c[p])``. The block ``[x_last,
mask × (B - 1)]`` at positions ``t - 1 .. t + B - 2`` runs through the layers (the
target's decoder layer with Qwen3's per-head q/k norms), attending to the whole context
and to every block position (non-causal inside the block); ``lm_head(norm(out))`` at
block positions ``1 .. B - 1`` gives the ``B - 1`` drafts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ...contract.policy.drafts import draft_config_problems
from ...model.arch import (
    ModelArchConfig,
    ModelConfigError,
    arch_from_dict,
    check_draft_tensors,
    declared_architecture,
    read_config_json,
)

log = logging.getLogger("loraserve.spec")

DFLASH_ARCHITECTURES = ("DFlashDraftModel",)
DEFAULT_MASK_TOKEN = "<|MASK|>"
UNSTATED_BLOCK = 16
"""The block a draft that states no ``block_size`` is served with when none is asked for: the
reference engine's default, the block of z-lab's checkpoints."""
"""The reference engine's mask token string when a checkpoint names none."""


@dataclass(frozen=True)
class DFlashDraftConfig:
    """What a DFLASH draft looks like (its layers' shapes and the fields DFLASH adds)."""

    layer: ModelArchConfig  # the draft's decoder layers (num_layers = draft layers)
    block_size: int | None  # the block the checkpoint was trained on (None: unstated)
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context
    mask_token_id: int | None  # from config.json; None: resolved from a tokenizer
    mask_token: str  # the mask token's text, for a tokenizer lookup
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def num_layers(self) -> int:
        return self.layer.num_layers

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target's residual streams to capture (``ForwardBatch.hidden_layers``): the
        output of layer ``i`` is the stream entering layer ``i + 1``."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape."""
        layer = self.layer
        h, q, kv, i, d = (
            layer.hidden_size,
            layer.q_size,
            layer.kv_size,
            layer.intermediate_size,
            layer.head_dim,
        )
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, self.fc_in_features),
            "hidden_norm.weight": (h,),
            "norm.weight": (h,),
        }
        for j in range(layer.num_layers):
            p = f"layers.{j}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (d,),
                    p + "self_attn.k_norm.weight": (d,),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                }
            )
            if layer.attention_bias:
                shapes.update(
                    {
                        p + "self_attn.q_proj.bias": (q,),
                        p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,),
                    }
                )
            if layer.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
        return shapes

    def check_target(self, target: ModelArchConfig) -> None:
        """Raise :class:`ModelConfigError` unless this draft fits ``target``."""
        if self.hidden_size != target.hidden_size:
            raise ModelConfigError(
                f"DFLASH draft hidden_size {self.hidden_size} must equal the target's {target.hidden_size}: "
                "the draft uses the target's embeddings and lm_head"
            )
        if self.layer.vocab_size != target.vocab_size:
            raise ModelConfigError(
                f"DFLASH draft vocab_size {self.layer.vocab_size} must equal the target's {target.vocab_size}: "
                "the draft was made for another model"
            )
        check_target_layer_ids(self.target_layer_ids, target.num_layers)

    def check_block(self, width: int) -> None:
        """Raise :class:`ModelConfigError` unless a verify of ``width`` tokens (the block:
        the last committed token and ``width - 1`` drafts) fits what the draft was trained on."""
        if width < 2:
            raise ModelConfigError(f"a DFLASH block holds the last token and at least one draft, got {width}")
        if self.block_size is not None and width > self.block_size:
            raise ModelConfigError(
                f"speculative.num_draft_tokens {width} is above the DFLASH draft's block_size {self.block_size}: "
                f"the draft never learned positions past its block; set speculative.num_draft_tokens to at most "
                f"{self.block_size}"
            )


def check_target_layer_ids(layer_ids: Sequence[int], num_layers: int) -> None:
    """Raise :class:`ModelConfigError` unless every id names a layer of a ``num_layers``-layer
    target whose output is captured: ``0 .. L-2``. The last layer's output is the final
    norm's input, but Hugging Face's ``hidden_states[L]`` (what a draft is trained on) is
    the normed state: a draft trained on it would be served other features. Training
    calls this too, so a draft is never trained on a feature serving cannot give it."""
    last = num_layers - 1
    for layer_id in layer_ids:
        if not 0 <= layer_id < last:
            raise ModelConfigError(
                f"DFLASH draft target_layer_ids names layer {layer_id}, but the target has {num_layers} layers:"
                f" ids must be in 0..{last - 1} (the output of the last layer is not captured)"
            )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's choice: one draft layer takes the middle target layer; ``n`` layers
    spread evenly from layer 1 to ``L - 3``."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ModelConfigError(
            f"DFLASH needs positive layer counts, got {num_target_layers} target and {num_draft_layers} draft layers"
        )
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ModelConfigError(
            f"DFLASH's default target layers need a target of at least 4 layers, got {num_target_layers}: "
            "set dflash_config.target_layer_ids in the draft's config.json"
        )
    span = end - start
    return tuple(round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _positive_int(value, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelConfigError(f"DFLASH draft config.json {name} must be a positive integer, got {value!r}")
    return value


def block_size_of(raw: dict) -> int | None:
    """The block a draft's config.json says it was trained on (``dflash_config.block_size``
    wins over a top-level ``block_size``); None when it states none."""
    nested = raw.get("dflash_config")
    nested = nested if isinstance(nested, dict) else {}
    nested_block = _positive_int(nested.get("block_size"), "dflash_config.block_size")
    top_block = _positive_int(raw.get("block_size"), "block_size")
    if nested_block is not None and top_block is not None and nested_block != top_block:
        log.warning("DFLASH draft config.json sets block_size %s and dflash_config.block_size %s: using the latter",
                    top_block, nested_block)  # fmt: skip
    return nested_block if nested_block is not None else top_block


def dflash_config_from_dict(
    raw: dict, *, target_num_layers: int, architecture_override: str | None = None
) -> DFlashDraftConfig:
    """Parse a DFLASH draft's config.json (its layers as a Llama-family config, plus the
    fields DFLASH adds). ``target_num_layers``: for the default target layers."""
    architecture = declared_architecture(raw, architecture_override)
    problems = draft_config_problems("DFLASH", dict(raw, architectures=[architecture]))
    if problems:  # a published layout refused by name (DFlash2, DSPARK), before any tensor is read
        raise ModelConfigError("; ".join(problems))
    if architecture not in DFLASH_ARCHITECTURES:
        raise ModelConfigError(
            f"draft config.json architecture {architecture!r} is not a DFLASH draft: use one of "
            f"{list(DFLASH_ARCHITECTURES)} (speculative.draft_model_architecture overrides config.json)"
        )
    nested = raw.get("dflash_config") or {}
    if not isinstance(nested, dict):
        raise ModelConfigError(f"DFLASH draft config.json dflash_config must be an object, got {nested!r}")
    kinds = set(raw.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ModelConfigError(
            f"DFLASH draft layer_types {sorted(kinds)}: only full_attention layers are served (sliding-window "
            "draft layers are not)"
        )
    # The layers are Llama-family decoder layers (plus Qwen3's q/k norms): parse them as such;
    # a Qwen3 config's sliding_window is inert unless use_sliding_window, and is refused above.
    layer_raw = dict(raw, architectures=["LlamaForCausalLM"], sliding_window=None)
    layer = arch_from_dict(layer_raw)
    block = block_size_of(raw)
    ids = nested.get("target_layer_ids", raw.get("target_layer_ids"))
    if ids is None:
        num_target = _positive_int(raw.get("num_target_layers"), "num_target_layers") or target_num_layers
        layer_ids = default_target_layer_ids(num_target, layer.num_layers)
    else:
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise ModelConfigError(
                f"DFLASH draft dflash_config.target_layer_ids must be a non-empty list of layer indices, got {ids!r}"
            )
        layer_ids = tuple(ids)
        if len(set(layer_ids)) != len(layer_ids):
            raise ModelConfigError(
                f"DFLASH draft dflash_config.target_layer_ids must name distinct layers, got {ids!r}"
            )
    mask_id = nested.get("mask_token_id", raw.get("mask_token_id"))
    if mask_id is not None and (isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id < 0):
        raise ModelConfigError(
            f"DFLASH draft dflash_config.mask_token_id must be a token id >= 0, got {mask_id!r}"
        )
    mask_token = nested.get("mask_token", DEFAULT_MASK_TOKEN)
    if not isinstance(mask_token, str) or not mask_token:
        raise ModelConfigError(
            f"DFLASH draft dflash_config.mask_token must be a non-empty string, got {mask_token!r}"
        )
    softcap = nested.get("final_logit_softcapping")
    return DFlashDraftConfig(
        layer=layer,
        block_size=block,
        target_layer_ids=layer_ids,
        mask_token_id=mask_id,
        mask_token=mask_token,
        input_embedding_scale=float(
            nested.get("input_embedding_scale", raw.get("input_embedding_scale", 1.0))
        ),
        output_multiplier=float(nested.get("output_multiplier", 1.0)),
        logit_softcap=float(softcap) if softcap else None,
    )


def load_dflash_config(
    path: str | Path, *, target_num_layers: int, architecture_override: str | None = None
) -> DFlashDraftConfig:
    """Read ``path/config.json`` of a DFLASH draft; local files only."""
    raw = read_config_json(
        path, missing="speculative.draft_model_path must be a local DFLASH draft directory"
    )
    return dflash_config_from_dict(
        raw, target_num_layers=target_num_layers, architecture_override=architecture_override
    )


# --------------------------------------------------------------------------- mask token


def _tokenizer_ids(directory: Path) -> dict[str, int]:
    """Token text -> id from a directory's ``tokenizer.json`` (added tokens and vocabulary)
    and ``tokenizer_config.json``'s ``added_tokens_decoder``; empty when there is none."""
    ids: dict[str, int] = {}
    file = directory / "tokenizer.json"
    if file.is_file():
        raw = json.loads(file.read_text())
        vocab = (raw.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids.update({str(k): int(v) for k, v in vocab.items()})
        for tok in raw.get("added_tokens") or []:
            if isinstance(tok, dict) and "content" in tok and "id" in tok:
                ids[str(tok["content"])] = int(tok["id"])
    config = _tokenizer_config(directory)
    for key, tok in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(tok, dict) and "content" in tok:
            ids[str(tok["content"])] = int(key)
    return ids


def _tokenizer_config(directory: Path) -> dict:
    file = directory / "tokenizer_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def _declared_mask(directory: Path) -> str | None:
    """The mask token a tokenizer declares (``tokenizer_config.json`` ``mask_token``)."""
    token = _tokenizer_config(directory).get("mask_token")
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def resolve_mask_token_id(
    config: DFlashDraftConfig, *, draft_dir: str | Path, target_dir: str | Path, vocab_size: int
) -> tuple[int, str]:
    """The token id that fills a block's unknown positions, and where it came from.

    In order, the first that exists:

    1. ``dflash_config.mask_token_id`` (or top-level ``mask_token_id``) in the draft's
       config.json;
    2. the mask token's text (``dflash_config.mask_token``, default ``<|MASK|>``) in the
       draft directory's tokenizer files, then in the target's;
    3. the mask token a tokenizer declares (``tokenizer_config.json`` ``mask_token``), the
       draft's then the target's;
    4. the first embedding row past the target tokenizer's vocabulary, when the target's
       embedding has such spare rows: the id the reference engine gets by adding the mask
       token to the tokenizer (151669 for Qwen3, what its DFLASH drafts train with).

    Otherwise :class:`ModelConfigError` names the field to set. Every id must be below the
    target's ``vocab_size`` (the draft embeds it with the target's embedding).
    """
    dirs = [Path(draft_dir), Path(target_dir)]

    def checked(token_id: int, source: str) -> tuple[int, str]:
        if not 0 <= token_id < vocab_size:
            raise ModelConfigError(
                f"the DFLASH mask token id {token_id} ({source}) is outside the target's vocabulary of {vocab_size}: "
                "set dflash_config.mask_token_id in the draft's config.json to a token of the target's embedding"
            )
        return token_id, source

    if config.mask_token_id is not None:
        return checked(config.mask_token_id, "dflash_config.mask_token_id")
    tables = [(d, _tokenizer_ids(d)) for d in dirs]
    for directory, table in tables:
        if config.mask_token in table:
            return checked(table[config.mask_token], f"{config.mask_token!r} in the tokenizer of {directory}")
    for directory, table in tables:
        declared = _declared_mask(directory)
        if declared is not None and declared in table:
            return checked(table[declared], f"the tokenizer's mask token {declared!r} in {directory}")
    target_table = tables[1][1]
    if target_table:
        spare = max(target_table.values()) + 1
        if spare < vocab_size:
            return checked(spare, f"the first embedding row past the tokenizer of {target_dir} (id {spare})")
    raise ModelConfigError(
        f"the DFLASH draft names no mask token id and none could be resolved: {config.mask_token!r} is in neither "
        f"tokenizer, neither declares a mask token, and the target's embedding has no row past its tokenizer; set "
        "dflash_config.mask_token_id in the draft's config.json (the id the draft was trained with)"
    )


# --------------------------------------------------------------------------- tensors


def load_dflash_tensors(path: str | Path, config: DFlashDraftConfig) -> dict[str, torch.Tensor]:
    """Read and check every tensor of a DFLASH draft (names and shapes)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"no *.safetensors files in DFLASH draft directory {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            tensors[name.removeprefix("model.")] = tensor
    # A copy of the target's embeddings or head: the draft uses the target's base weights.
    for shared in ("embed_tokens.weight", "lm_head.weight"):
        tensors.pop(shared, None)
    for name in [n for n in tensors if n.endswith("rotary_emb.inv_freq")]:
        del tensors[name]  # recomputed from the config
    expected = config.tensor_shapes()
    detail = f"{config.num_layers} layers, {len(config.target_layer_ids)} target layers"
    check_draft_tensors("DFLASH", path, tensors, expected, detail=detail, show=6)
    return tensors


def random_dflash_tensors(
    config: DFlashDraftConfig, *, seed: int, std: float = 0.02
) -> dict[str, torch.Tensor]:
    """Weights of the right shapes (norms one, the rest N(0, std)): ``draft_load_format: dummy``."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.ones(shape)
        if name.endswith("norm.weight")
        else torch.randn(shape, generator=generator) * std
        for name, shape in sorted(config.tensor_shapes().items())
    }
