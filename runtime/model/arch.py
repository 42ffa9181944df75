"""The tokenizer-independent shape of a model, read from a Hugging Face ``config.json``.

One dataclass for every supported Llama-family layout, so layers never look at raw
config dicts. Both rope spellings are read: transformers 5's ``rope_parameters`` and the
older ``rope_theta`` + ``rope_scaling`` pair.

Phi-3 / Phi-3.5 / Phi-4-mini (``phi3``) is the Llama decoder with checkpoint tensors already
fused (``qkv_proj``, ``gate_up_proj``), no biases, an optional rotary fraction of each head
(``partial_rotary_factor``) and LongRoPE (``rope_type`` ``longrope``; ``su`` and, as
transformers' ``Phi3Config`` reads it, ``yarn`` are its older names).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..contract.errors import ModelConfigError
from ..contract.policy.families import ARCHITECTURE_FAMILIES, MOE_FAMILIES
from .gemma3_config import GEMMA_FAMILIES, GemmaSpec, gemma_spec

# The families served are the policy's table (the start-up check and admission judge it too).
SUPPORTED_ARCHITECTURES = ARCHITECTURE_FAMILIES

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (``rope_type``: default, linear, llama3, yarn or longrope).

    ``partial_rotary_factor``: the fraction of each head's leading dims that rotate (the rest
    pass through). ``short_factor`` / ``long_factor``: LongRoPE's per-frequency divisors (one per
    rotated pair); ``factor`` is then the context extension (``max_position_embeddings /
    original_max_position_embeddings`` unless config.json gives it)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def rotary_dim(self, head_dim: int) -> int:
        """The leading dims of a ``head_dim`` head that rotate."""
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class MoESpec:
    """A sparse mixture-of-experts MLP: a router picks ``top_k`` of ``num_experts`` gated
    SiLU experts per token (softmax over all experts, then the top k, renormalised to sum
    to one when ``norm_topk_prob``). ``sparse_layers``: the layers whose MLP is the MoE
    block; the others keep a dense MLP of the model's ``intermediate_size``.

    ``shared_intermediate_size``: Qwen2-MoE's shared expert, a dense gated SiLU MLP of that
    size that every token runs beside its routed experts (0: none); ``shared_gated``: its
    output is scaled by ``sigmoid(shared_expert_gate(x))`` (a Linear H -> 1) before it is
    added to the routed experts' sum."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0
    shared_gated: bool = False


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything the layers need to know about a model, independent of the tokenizer."""

    architecture: str  # e.g. LlamaForCausalLM
    family: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | qwen2_moe | mixtral | gemma2 | gemma3 | phi3
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2)
    o_bias: bool = False
    mlp_bias: bool = False
    rope: RopeSpec = field(default_factory=RopeSpec)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    qk_norm: bool = False  # an RMSNorm over each query and key head before rotary (Qwen3)
    moe: MoESpec | None = None  # the sparse MLP of MoE families; None: every MLP is dense
    gemma: GemmaSpec | None = None  # Gemma 2/3's layer pattern, ropes, caps and scalings
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int | None) -> bool:
        """Whether ``layer``'s MLP is the sparse MoE block (its gate/up/down are experts)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def expert_dims(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one expert's ``gate_proj``/``up_proj``/``down_proj``."""
        if self.moe is None:
            raise KeyError(module)
        h, i = self.hidden_size, self.moe.intermediate_size
        dims = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return dims[module]

    def shared_expert_dims(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of the shared expert's ``gate_proj``/``up_proj``/
        ``down_proj`` and of its gate ``shared_expert_gate`` (Qwen2-MoE)."""
        if self.moe is None or not self.moe.shared_intermediate_size:
            raise KeyError(module)
        h, i = self.hidden_size, self.moe.shared_intermediate_size
        dims = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "shared_expert_gate": (h, 1)}
        return dims[module]

    def module_dims(self, module: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of a LoRA-targetable module."""
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        dims = {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "embed_tokens": (self.vocab_size, h),
            "lm_head": (h, self.vocab_size),
        }
        if module not in dims:
            raise KeyError(module)
        return dims[module]


def parse_dtype(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """Map a config dtype string to a torch dtype (``auto``/None gives ``default``)."""
    if name is None or name == "auto":
        return default
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise ModelConfigError(f"dtype {name!r} is not supported: use auto, bfloat16, float16 or float32")
    return _DTYPES[key]


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
"""The rope types the rotary tables implement (:mod:`.layers.rotary`)."""

_PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
"""Older names Phi-3 configs give LongRoPE (transformers' ``Phi3Config`` reads both so)."""


def _rope_spec(raw: dict, family: str, head_dim: int) -> RopeSpec:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; one type for these models
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if family == "phi3":
        rope_type = _PHI3_ROPE_ALIASES.get(rope_type, rope_type)
        if rope_type not in ("default", "longrope"):
            raise ModelConfigError(
                f"config.json rope type {rope_type!r} is not supported for Phi-3: use default or longrope"
            )
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"config.json rope type {rope_type!r} is not supported: use default, linear, llama3, yarn or longrope"
        )
    # Phi-3 keeps the pretraining length beside rope_scaling; transformers prefers that one.
    original = raw.get("original_max_position_embeddings") if family == "phi3" else None
    original = original or params.get("original_max_position_embeddings")
    factor = params.get("factor")
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    short, long = (), ()
    if rope_type == "longrope":
        short, long, original = _longrope_factors(params, original, pairs=int(head_dim * partial) // 2)
        if factor is None:  # the context extension, as transformers and vLLM derive it
            factor = int(raw.get("max_position_embeddings", 2048)) / original
    return RopeSpec(
        theta=float(params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(factor) if factor is not None else 1.0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
        partial_rotary_factor=partial,
        short_factor=short,
        long_factor=long,
    )


def _longrope_factors(
    params: dict, original: int | None, *, pairs: int
) -> tuple[tuple[float, ...], tuple[float, ...], int]:
    """LongRoPE's ``short_factor`` / ``long_factor`` (one per rotated pair: ``pairs`` of them)
    and its pretraining length; :class:`ModelConfigError` naming the field."""
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ModelConfigError(
            "config.json longrope needs original_max_position_embeddings (a positive integer), "
            f"got {original!r}"
        )
    out = []
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in values
        ):
            raise ModelConfigError(
                f"config.json longrope {key} must be a list of positive numbers, got {values!r}"
            )
        if len(values) != pairs:
            raise ModelConfigError(
                f"config.json longrope {key} has {len(values)} entries, the heads rotate {pairs} pairs of dims"
            )
        out.append(tuple(float(v) for v in values))
    return out[0], out[1], original


def declared_architecture(raw: dict, override: str | None = None) -> str | None:
    """The architecture a config.json declares (its first ``architectures`` entry), unless
    ``override`` (the runtime configuration's) names one."""
    archs = raw.get("architectures") or []
    return override or (archs[0] if archs else None)


def arch_from_dict(raw: dict, *, architecture_override: str | None = None) -> ModelArchConfig:
    """Build a :class:`ModelArchConfig` from a parsed config.json."""
    architecture = declared_architecture(raw, architecture_override)
    if architecture is None:
        model_type = raw.get("model_type")
        architecture = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}.get(model_type)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"config.json architecture {architecture!r} is not supported: "
            f"use one of {sorted(SUPPORTED_ARCHITECTURES)} (model.architecture overrides config.json)"
        )
    family = SUPPORTED_ARCHITECTURES[architecture]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ModelConfigError(f"config.json field {key!r} must be a positive integer, got {raw.get(key)!r}")
    num_heads = raw["num_attention_heads"]
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ModelConfigError(
            f"config.json num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
    act = raw.get("hidden_act", "silu")
    if family in GEMMA_FAMILIES:  # Gemma's GELU (tanh approximation), under its own key
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelConfigError(f"config.json hidden_activation {act!r} is not served for Gemma")
    elif act not in ("silu", "swish"):
        raise ModelConfigError(f"config.json hidden_act {act!r} is not supported: Llama-family models use silu")
    sliding = raw.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not raw.get("use_sliding_window", False):
        sliding = None
    if family in GEMMA_FAMILIES:
        sliding = None  # per layer: arch.gemma.sliding_layers
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope = _rope_spec(raw, family, head_dim)
    _check_rotary_dim(rope, head_dim, family)
    if family == "phi3":
        _check_phi3(raw)
    if family == "qwen2_moe":
        _check_qwen2_moe(raw)
    return ModelArchConfig(
        architecture=architecture,
        family=family,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=_qkv_bias(raw, family),
        o_bias=bool(raw.get("attention_bias", False)) and family not in ("qwen2", "qwen2_moe", "phi3"),
        mlp_bias=bool(raw.get("mlp_bias", False)) and family not in ("phi3", "qwen2_moe"),
        rope=rope,
        sliding_window=int(sliding) if sliding else None,
        hidden_act=act,
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        moe=moe_spec(raw, family),
        gemma=gemma_spec(raw, raw["num_hidden_layers"], family) if family in GEMMA_FAMILIES else None,
        torch_dtype=parse_dtype(raw.get("torch_dtype") or raw.get("dtype"), torch.float32),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _qkv_bias(raw: dict, family: str) -> bool:
    """Whether q/k/v carry biases: always on Qwen2, ``qkv_bias`` (default true) on Qwen2-MoE,
    never on Phi-3, ``attention_bias`` elsewhere."""
    if family == "qwen2_moe":
        return bool(raw.get("qkv_bias", True))
    return (bool(raw.get("attention_bias", False)) or family == "qwen2") and family != "phi3"


def _check_rotary_dim(rope: RopeSpec, head_dim: int, family: str) -> None:
    """A rotary fraction of each head: an even number of dims, at least two; not on Gemma."""
    if rope.partial_rotary_factor == 1.0:
        return
    if family in GEMMA_FAMILIES:
        raise ModelConfigError("config.json partial_rotary_factor != 1 is not supported for Gemma")
    dim = rope.rotary_dim(head_dim)
    if not 0 < rope.partial_rotary_factor <= 1 or dim < 2 or dim % 2:
        raise ModelConfigError(
            f"config.json partial_rotary_factor {rope.partial_rotary_factor} rotates {dim} of the {head_dim} dims of "
            "a head: served for an even number of dims, at least two"
        )


_PHI3_UNSERVED = {
    # config.json fields Phi3Config does not have, which a hand-edited config might carry
    "attention_bias": "Phi-3's projections have no biases",
    "mlp_bias": "Phi-3's projections have no biases",
}


def _check_phi3(raw: dict) -> None:
    """Fields of a Phi-3 config.json the layers cannot honour, refused by name. Dropout
    (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) is training-only."""
    for key, reason in _PHI3_UNSERVED.items():
        if raw.get(key):
            raise ModelConfigError(f"config.json {key}={raw[key]!r} is not served for Phi-3: {reason}")


_QWEN2_MOE_UNSERVED = {
    # config.json fields of Qwen2MoeConfig whose behaviour the layers do not implement
    "use_sliding_window": "its sliding window covers only some layers (max_window_layers)",
    "attention_bias": "its o_proj has no bias (q/k/v biases are qkv_bias)",
    "mlp_bias": "its MLPs and experts have no biases",
}


def _check_qwen2_moe(raw: dict) -> None:
    """Fields of a Qwen2-MoE config.json the layers cannot honour, refused by name."""
    for key, reason in _QWEN2_MOE_UNSERVED.items():
        if raw.get(key):
            raise ModelConfigError(f"config.json {key}={raw[key]!r} is not served for Qwen2-MoE: {reason}")


def _positive(raw: dict, *keys: str) -> int:
    """The first of ``keys`` that config.json holds, as a positive integer (hub and
    transformers spellings of one field); :class:`ModelConfigError` naming them otherwise."""
    for key in keys:
        if key in raw and raw[key] is not None:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"config.json field {key!r} must be a positive integer, got {value!r}")
            return value
    spelled = " or ".join(repr(k) for k in keys)
    raise ModelConfigError(f"config.json needs {spelled} (a positive integer) for a mixture-of-experts model")


def moe_spec(raw: dict, family: str) -> MoESpec | None:
    """The MoE block of a ``qwen3_moe`` / ``qwen2_moe`` / ``mixtral`` config.json (None for
    dense families).

    Expert counts are read under both spellings: ``num_experts`` (Qwen3-MoE as published
    on the hub) and ``num_local_experts`` (what transformers 5 writes, and Mixtral's).
    Qwen3-MoE's sparse layers follow transformers: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``, as are Qwen2-MoE's, whose sparse layers add a
    gated shared expert of ``shared_expert_intermediate_size`` (0 or absent: none); Mixtral's
    are all layers, renormalised."""
    if family not in MOE_FAMILIES:
        return None
    layers = raw["num_hidden_layers"]
    experts = _positive(raw, "num_experts", "num_local_experts")
    top_k = _positive(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ModelConfigError(
            f"config.json num_experts_per_tok ({top_k}) exceeds the number of experts ({experts})"
        )
    if family == "mixtral":
        return MoESpec(experts, top_k, raw["intermediate_size"], True, tuple(range(layers)))
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if family == "qwen2_moe":
        shared = raw.get("shared_expert_intermediate_size") or 0
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ModelConfigError(
                f"config.json field 'shared_expert_intermediate_size' must be a non-negative integer, got {shared!r}"
            )
    return MoESpec(
        experts,
        top_k,
        _positive(raw, "moe_intermediate_size"),
        bool(raw.get("norm_topk_prob", False)),
        sparse,
        shared_intermediate_size=shared,
        shared_gated=shared > 0,
    )


DRAFT_SHAPE_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "rope_theta",
    "rope_scaling",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
"""The target's config.json keys a draft head built for it copies (EAGLE, DFLASH builders)."""


def check_draft_tensors(
    kind: str,
    path: str | Path,
    tensors: Mapping[str, torch.Tensor],
    expected: Mapping[str, tuple[int, ...]],
    *,
    detail: str,
    show: int | None = None,
) -> None:
    """A draft checkpoint's tensors against the names and shapes its config.json implies;
    :class:`ModelConfigError` naming the first disagreement (``show``: list at most that many
    missing / unexpected names)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ModelConfigError(
            f"{kind} draft {path} does not match its config.json ({detail}): "
            f"missing {missing[:show]}, unexpected {unexpected[:show]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ModelConfigError(
                f"{kind} draft tensor {name} has shape {tuple(tensors[name].shape)}, config.json implies {shape}"
            )


def read_config_json(directory: str | Path, *, missing: str) -> dict:
    """``directory/config.json``, parsed; local files only. ``missing``: the fix to name
    when the file is absent (which setting must point at which directory)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path} not found: {missing}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc


def load_arch_config(model_dir: str | Path, *, architecture_override: str | None = None) -> ModelArchConfig:
    """Read ``model_dir/config.json``; local files only."""
    raw = read_config_json(
        model_dir, missing="model.path must be a local directory with config.json and safetensors weights"
    )
    return arch_from_dict(raw, architecture_override=architecture_override)
