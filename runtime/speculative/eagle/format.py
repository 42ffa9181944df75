"""The EAGLE / EAGLE3 draft checkpoint format: an HF-style directory, config + safetensors.

``config.json`` is a Llama config for the draft's single decoder layer (``num_hidden_layers``
1: a head of more layers is refused by name, see :mod:`...contract.policy.drafts`) plus:

- ``architectures``: ``["LlamaForCausalLMEagle"]`` (EAGLE, also serves NEXTN) or
  ``["LlamaForCausalLMEagle3"]``;
- ``target_hidden_size``: the target's hidden size (defaults to ``hidden_size``);
- EAGLE3: ``eagle_aux_hidden_state_layer_ids`` (top level, or inside ``eagle_config``):
  the target's residual streams that form the feature; entry ``i`` is the stream
  entering target layer ``i`` (the output of layer ``i - 1``; ``num_layers`` is the final
  stream before the model's norm). Published heads mostly leave it out: then the streams
  are vLLM's and SGLang's default for a target of ``L`` layers, ``(2, L // 2, L - 3)``
  (:func:`default_aux_layers`).

Tensors (an optional leading ``model.`` is ignored; ``midlayer.``, the name EAGLE's and
SGLang's training code gives the one layer, reads as ``layers.0.``, as vLLM renames it):

==============================================  ==================================  ======
name                                            shape                               which
==============================================  ==================================  ======
``fc.weight`` (``fc.bias`` if ``"bias": true``)  ``[H, 2H]`` / ``[H, n_aux * H_t]``   both
``layers.0.input_layernorm.weight``             ``[H]``                             both [1]_
``layers.0.hidden_norm.weight``                 ``[H]``                             EAGLE3
``layers.0.self_attn.{q,k,v}_proj.weight``      ``[out, H]`` / ``[out, 2H]``        both
``layers.0.self_attn.o_proj.weight``            ``[H, q]``                          both
``layers.0.post_attention_layernorm.weight``    ``[H]``                             both
``layers.0.mlp.{gate,up}_proj.weight``          ``[I, H]``                          both
``layers.0.mlp.down_proj.weight``               ``[H, I]``                          both
``norm.weight``                                 ``[H]``                             EAGLE3
==============================================  ==================================  ======

.. [1] optional for EAGLE: without it the fc output feeds attention directly, as in the
   original EAGLE layout.

Token embeddings are never stored: the draft takes the target's BASE ``embed_tokens``
(no adapter), so its ``hidden_size`` must equal the target's. The LM head is the
target's BASE ``lm_head`` too, unless config.json sets ``draft_vocab_size`` (as EAGLE3
training writes its drafts): then the checkpoint holds its own ``lm_head.weight``
``[draft_vocab_size, H]`` and, when ``draft_vocab_size`` is below the target's vocabulary,
``d2t`` ``[draft_vocab_size]`` (int64; draft row ``i`` predicts target token ``i + d2t[i]``).
``t2d`` (a training-time mask) is ignored. See :mod:`..draft_vocab`.

Weights are ``*.safetensors`` files; a directory with only pickle weights
(``pytorch_model.bin``, as some heads are published) is refused with the conversion that
fixes it, as every pickle checkpoint is (loading one can run code).

Draft adapters of a head (:mod:`.lora`) are PEFT LoRAs named by these tensors' modules
(``base_model.model.fc.lora_A.weight``, ``base_model.model.layers.0.self_attn.q_proj...``);
their shapes are checked against :meth:`EagleDraftConfig.tensor_shapes`.

Semantics. EAGLE: the feature of position ``i`` is the target's final (normed) hidden
state there; the draft input at position ``i`` is ``fc([embed(x[i+1]), feature[i]])``, its
output is the predicted feature of position ``i + 1`` and ``lm_head(output)`` the
distribution of ``x[i+2]``. EAGLE3: ``feature[i] = fc(concat of the aux layers' states)``;
the layer attends over ``[input_layernorm(embed(x[i+1])), hidden_norm(feature[i])]``
(hence q/k/v take ``2H``) with ``feature[i]`` as residual; logits are
``lm_head(norm(output))``. On later draft steps the draft's own output is the feature.
``norm_before_residual: true`` (EAGLE3 only; default false) makes the residual
``hidden_norm(feature[i])`` instead, as vLLM's ``llama_eagle3.py`` and speculators'
EAGLE3 layer do.

The vLLM speculators format (vllm-project/speculators ``src/speculators/models/eagle3``,
read by vLLM's ``transformers_utils/configs/speculators``) is read too and becomes the
layout above (:func:`flatten_speculators`):

- ``architectures``: ``["Eagle3Speculator"]`` (or ``["Eagle3DraftModel"]``, the class
  newer speculators releases save), ``speculators_model_type: "eagle3"``;
- ``transformer_layer_config``: the decoder layer's Llama config (``num_hidden_layers``
  1, ``vocab_size`` the target's), flattened into the head's config;
- top level: ``draft_vocab_size``, ``norm_before_residual`` (speculators' default false),
  ``target_hidden_size`` (null: the layer's ``hidden_size``),
  ``eagle_aux_hidden_state_layer_ids`` (absent or null: the default streams, as
  speculators' own ``resolve_target_layer_ids`` picks them), and ``speculators_config``
  (verifier, proposal methods: read by neither the head nor its drafter here);
- tensors already carry this format's names (``layers.0.*``, ``fc.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``, a copy of ``embed_tokens``:
  the last two ignored, as above).

What speculators can express beyond this head (another ``speculators_model_type``, a
qwen3 layer with q/k norms, ``norm_before_fc``, more layers) is refused by name in
:mod:`...contract.policy.drafts`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...contract.policy.drafts import SPECULATORS_ARCHITECTURES, draft_config_problems, is_speculators_format
from ...model.arch import (
    ModelArchConfig,
    ModelConfigError,
    arch_from_dict,
    check_draft_tensors,
    declared_architecture,
    read_config_json,
)

INPUT_NORM = "layers.0.input_layernorm.weight"
EAGLE_ARCHITECTURES = {"LlamaForCausalLMEagle": 1, "LlamaForCausalLMEagle3": 3}
SPECULATORS_TOP_LEVEL = (
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
)
"""The speculators format's top-level fields the head reads (the layer's are nested)."""
LAYER_ALIASES = {"midlayer.": "layers.0."}
"""Prefixes published heads give their one decoder layer -> the name this format uses."""
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model-*.bin", "*.pt")


@dataclass(frozen=True)
class EagleDraftConfig:
    """What an EAGLE-family draft head looks like."""

    version: int  # 1: EAGLE (and NEXTN), 3: EAGLE3
    layer: ModelArchConfig  # shapes of the single decoder layer (heads, rope, norms)
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]  # EAGLE3: target layers feeding the feature
    fc_bias: bool
    draft_vocab_size: int | None = None  # set: the checkpoint's own lm_head has this many rows
    norm_before_residual: bool = False  # EAGLE3: the layer's residual is hidden_norm(feature)

    @property
    def own_lm_head(self) -> bool:
        return self.draft_vocab_size is not None

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def fc_in_features(self) -> int:
        if self.version == 3:
            return len(self.aux_layer_ids) * self.target_hidden_size
        return 2 * self.hidden_size

    @property
    def attn_in_features(self) -> int:
        return 2 * self.hidden_size if self.version == 3 else self.hidden_size

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape."""
        h, q, kv, i = self.hidden_size, self.layer.q_size, self.layer.kv_size, self.layer.intermediate_size
        a = self.attn_in_features
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, self.fc_in_features),
            "layers.0.input_layernorm.weight": (h,),
            "layers.0.self_attn.q_proj.weight": (q, a),
            "layers.0.self_attn.k_proj.weight": (kv, a),
            "layers.0.self_attn.v_proj.weight": (kv, a),
            "layers.0.self_attn.o_proj.weight": (h, q),
            "layers.0.post_attention_layernorm.weight": (h,),
            "layers.0.mlp.gate_proj.weight": (i, h),
            "layers.0.mlp.up_proj.weight": (i, h),
            "layers.0.mlp.down_proj.weight": (h, i),
        }
        if self.fc_bias:
            shapes["fc.bias"] = (h,)
        if self.layer.attention_bias:
            shapes["layers.0.self_attn.q_proj.bias"] = (q,)
            shapes["layers.0.self_attn.k_proj.bias"] = (kv,)
            shapes["layers.0.self_attn.v_proj.bias"] = (kv,)
        if self.version == 3:
            shapes["layers.0.hidden_norm.weight"] = (h,)
            shapes["norm.weight"] = (h,)
        if self.draft_vocab_size is not None:
            shapes["lm_head.weight"] = (self.draft_vocab_size, h)
            if self.draft_vocab_size < self.layer.vocab_size:
                shapes["d2t"] = (self.draft_vocab_size,)
        return shapes

    def check_target(self, target: ModelArchConfig) -> None:
        """Raise :class:`ModelConfigError` unless this draft fits ``target``."""
        if self.hidden_size != target.hidden_size:
            raise ModelConfigError(
                f"EAGLE draft hidden_size {self.hidden_size} must equal the target's {target.hidden_size}: "
                "the draft uses the target's embeddings and lm_head"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ModelConfigError(
                f"EAGLE draft target_hidden_size {self.target_hidden_size} does not match the target's "
                f"hidden_size {target.hidden_size}: the draft was made for another model"
            )
        if self.layer.vocab_size != target.vocab_size:
            raise ModelConfigError(
                f"EAGLE draft vocab_size {self.layer.vocab_size} must equal the target's {target.vocab_size}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= target.vocab_size:
            raise ModelConfigError(
                f"EAGLE draft draft_vocab_size {self.draft_vocab_size} must be between 1 and the target's "
                f"vocab_size {target.vocab_size}"
            )
        for layer_id in self.aux_layer_ids:
            if not 0 <= layer_id <= target.num_layers:
                raise ModelConfigError(
                    f"EAGLE3 draft eagle_aux_hidden_state_layer_ids names stream {layer_id}, but the target "
                    f"has {target.num_layers} layers (streams 0..{target.num_layers})"
                )


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """Low, middle and high residual streams (distinct, in range) for an EAGLE3 feature:
    ``(2, L // 2, L - 3)``, vLLM's and SGLang's choice for heads that name none, on any
    target of 8 layers or more."""
    picks = (2, num_target_layers // 2, num_target_layers - 3)
    chosen: list[int] = []
    for layer_id in picks:
        layer_id = min(max(layer_id, 1), num_target_layers)
        if layer_id not in chosen:
            chosen.append(layer_id)
    return tuple(sorted(chosen))


def eagle_config_from_dict(
    raw: dict, *, architecture_override: str | None = None, target_num_layers: int | None = None
) -> EagleDraftConfig:
    """Parse an EAGLE draft's config.json: its decoder layer as the target's config.json is
    parsed (:func:`~...model.arch.arch_from_dict`: heads, rope, norms, biases, dtype), plus
    the fields EAGLE's formats add. ``target_num_layers``: for the default EAGLE3 streams of
    a head that names none."""
    architecture = declared_architecture(raw, architecture_override)
    if architecture in SPECULATORS_ARCHITECTURES or is_speculators_format(raw):
        problems = draft_config_problems("EAGLE3", dict(raw, architectures=[architecture]))
        if problems:
            raise ModelConfigError("; ".join(problems))
        raw, architecture = flatten_speculators(raw), "LlamaForCausalLMEagle3"
    if architecture not in EAGLE_ARCHITECTURES:
        raise ModelConfigError(
            f"draft config.json architecture {architecture!r} is not an EAGLE draft: use one of "
            f"{sorted(EAGLE_ARCHITECTURES)} (speculative.draft_model_architecture overrides config.json)"
        )
    version = EAGLE_ARCHITECTURES[architecture]
    problems = draft_config_problems("EAGLE3" if version == 3 else "EAGLE", raw)
    if problems:
        raise ModelConfigError("; ".join(problems))
    layer_raw = dict(raw, architectures=["LlamaForCausalLM"], num_hidden_layers=1)
    layer = arch_from_dict(layer_raw)
    target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
    aux: tuple[int, ...] = ()
    if version == 3:
        nested = raw.get("eagle_config") or {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))
        if ids is None and target_num_layers is not None:
            ids = list(default_aux_layers(target_num_layers))
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise ModelConfigError(
                "EAGLE3 draft config.json needs eagle_aux_hidden_state_layer_ids: a non-empty list of "
                f"target layer indices, got {ids!r}"
            )
        aux = tuple(ids)
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int)):
        raise ModelConfigError(
            f"EAGLE draft config.json draft_vocab_size must be an integer, got {draft_vocab!r}"
        )
    return EagleDraftConfig(
        version=version,
        layer=layer,
        target_hidden_size=target_hidden,
        aux_layer_ids=aux,
        fc_bias=bool(raw.get("bias", False)),
        draft_vocab_size=draft_vocab,
        norm_before_residual=version == 3 and bool(raw.get("norm_before_residual", False)),
    )


def flatten_speculators(raw: dict) -> dict:
    """A speculators-format config.json (already judged by
    :func:`~...contract.policy.drafts.speculators_problems`) in this module's EAGLE3 layout:
    the layer's fields from ``transformer_layer_config``, the head's from the top level
    (a null ``target_hidden_size`` / ``eagle_aux_hidden_state_layer_ids`` left out, so
    the defaults apply). Pure: ``raw`` is not changed."""
    flat = dict(raw["transformer_layer_config"])
    for key in SPECULATORS_TOP_LEVEL:
        if raw.get(key) is not None:
            flat[key] = raw[key]
    dtype = raw.get("torch_dtype") or raw.get("dtype")
    if dtype and not (flat.get("torch_dtype") or flat.get("dtype")):
        flat["torch_dtype"] = dtype
    flat["architectures"] = ["LlamaForCausalLMEagle3"]
    return flat


def load_eagle_config(
    path: str | Path, *, architecture_override: str | None = None, target_num_layers: int | None = None
) -> EagleDraftConfig:
    """Read ``path/config.json`` of an EAGLE draft; local files only."""
    raw = read_config_json(path, missing="speculative.draft_model_path must be a local EAGLE draft directory")
    return eagle_config_from_dict(
        raw, architecture_override=architecture_override, target_num_layers=target_num_layers
    )


def canonical_name(name: str) -> str:
    """A checkpoint tensor's name in this format: no ``model.`` prefix, ``midlayer.`` as ``layers.0.``."""
    name = name.removeprefix("model.")
    for alias, canonical in LAYER_ALIASES.items():
        if name.startswith(alias):
            return canonical + name[len(alias) :]
    return name


def _refuse_pickles(path: Path) -> None:
    """A draft directory with pickle weights and no safetensors: refused, with the conversion."""
    pickles = sorted({f.name for pattern in PICKLE_WEIGHTS for f in path.glob(pattern)})
    if not pickles:
        raise ModelConfigError(f"no *.safetensors files in EAGLE draft directory {path}")
    raise ModelConfigError(
        f"the EAGLE draft directory {path} holds pickle weights ({', '.join(pickles)}) and no *.safetensors: "
        "pickle checkpoints are refused (loading one can run code); convert it once with "
        "safetensors.torch.save_file(torch.load(FILE, weights_only=True), 'model.safetensors') "
        "beside config.json"
    )


def load_eagle_tensors(
    path: str | Path, config: EagleDraftConfig, *, exclude: tuple[Path, ...] = ()
) -> dict[str, torch.Tensor]:
    """Read and check every tensor of an EAGLE draft (names and shapes). ``exclude``: files
    of the directory that are not weights (a token map kept beside them)."""
    from safetensors.torch import load_file

    skip = {Path(f).resolve() for f in exclude}
    files = sorted(f for f in Path(path).glob("*.safetensors") if f.resolve() not in skip)
    if not files:
        _refuse_pickles(Path(path))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            canonical = canonical_name(name)
            if canonical in tensors:
                raise ModelConfigError(
                    f"EAGLE draft {path}: tensors {name!r} and another both name {canonical!r}"
                )
            tensors[canonical] = tensor
    tensors.pop("t2d", None)  # the training-time target-to-draft mask
    if "d2t" in tensors and not config.own_lm_head:
        raise ModelConfigError(
            f"EAGLE draft {path} has a d2t vocabulary map but its config.json sets no draft_vocab_size: "
            "set draft_vocab_size to the number of rows of its lm_head.weight"
        )
    # Checkpoints that carry their own copy of the target's embeddings (or, without
    # draft_vocab_size, of its head): the draft uses the target's base weights instead.
    tensors.pop("embed_tokens.weight", None)
    if not config.own_lm_head:
        tensors.pop("lm_head.weight", None)
    expected = config.tensor_shapes()
    if config.version == 1 and INPUT_NORM not in tensors:
        del expected[INPUT_NORM]
    if config.own_lm_head and "d2t" in tensors and "d2t" not in expected:
        expected["d2t"] = (config.draft_vocab_size,)  # optional at full size: a permutation
    check_draft_tensors("EAGLE", path, tensors, expected, detail=f"version {config.version}")
    return tensors
