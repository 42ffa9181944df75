"""What Gemma 3 (text) adds to a Llama-family config: its layer pattern, second rope, norms
and scalings, read from a ``Gemma3ForCausalLM`` config.json in both spellings (transformers
5's ``layer_types`` / per-type ``rope_parameters``, and the older ``sliding_window_pattern`` /
``rope_local_base_freq``). Gemma 2 (``Gemma2ForCausalLM``) is the same spec without the q/k
head norms, with one rope base for every layer and soft-capped attention scores."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.errors import ModelConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_FAMILIES = ("gemma2", "gemma3")
"""The families built by :mod:`.gemma3` (``arch.gemma`` set)."""
DEFAULT_PATTERN = 6
"""Every sixth layer is global when a Gemma 3 config states neither ``layer_types`` nor a pattern."""
GEMMA2_PATTERN = 2
"""Gemma 2 alternates sliding and global layers, the first sliding (transformers' default)."""


@dataclass(frozen=True)
class GemmaSpec:
    """Gemma's additions: which layers see a sliding window, and its scalings."""

    sliding_window: int
    sliding_layers: tuple[bool, ...]  # per layer: True = sliding (local rope), False = global
    # the sliding layers' rope base; the global layers use arch.rope. None: arch.rope for every layer (Gemma 2)
    local_rope_theta: float | None
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    head_norms: bool = True  # q/k head norms (Gemma 3); Gemma 2 has none
    attn_softcap: float | None = None  # attention scores = c * tanh(scores / c), before the mask (Gemma 2)


def gemma_spec(raw: dict, num_layers: int, family: str = "gemma3") -> GemmaSpec:
    """Gemma 3's (``family="gemma3"``) or Gemma 2's (``"gemma2"``) additions from its
    config.json; :class:`ModelConfigError` names what is not served."""
    gemma2 = family == "gemma2"
    if raw.get("attn_logit_softcapping") and not gemma2:
        raise ModelConfigError(
            "config.json attn_logit_softcapping is set: soft-capped attention scores (Gemma 2) are not served; "
            "Gemma 3 configs leave it null"
        )
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("config.json use_bidirectional_attention: only causal Gemma decoders are served")
    name = "Gemma 2" if gemma2 else "Gemma 3"
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelConfigError(f"config.json sliding_window must be a positive integer for {name}, got {window!r}")
    types = raw.get("layer_types")
    if types is None:
        default = GEMMA2_PATTERN if gemma2 else DEFAULT_PATTERN
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or default)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ModelConfigError(
            f"config.json layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}, got {types!r}"
        )
    attn_cap = raw.get("attn_logit_softcapping")
    softcap = raw.get("final_logit_softcapping")
    scalar = float(raw.get("query_pre_attn_scalar") or 256)
    if gemma2:
        if attn_cap is not None and (isinstance(attn_cap, bool) or not isinstance(attn_cap, (int, float))):
            raise ModelConfigError(f"config.json attn_logit_softcapping must be a number or null, got {attn_cap!r}")
        if attn_cap is not None and attn_cap < 0:
            raise ModelConfigError(f"config.json attn_logit_softcapping must not be negative, got {attn_cap!r}")
        return GemmaSpec(
            sliding_window=window,
            sliding_layers=tuple(t == SLIDING for t in types),
            local_rope_theta=None,  # one rope base (arch.rope) for every layer
            query_pre_attn_scalar=scalar,
            final_logit_softcap=float(softcap) if softcap else None,
            head_norms=False,
            attn_softcap=float(attn_cap) if attn_cap else None,
        )
    params = raw.get("rope_parameters")
    local = params.get(SLIDING) if isinstance(params, dict) else None
    if isinstance(local, dict):
        if (local.get("rope_type") or "default") != "default":
            raise ModelConfigError("config.json rope_parameters.sliding_attention: only the default rope is served")
        local_theta = float(local.get("rope_theta", 10000.0))
    else:
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    return GemmaSpec(
        sliding_window=window,
        sliding_layers=tuple(t == SLIDING for t in types),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=scalar,
        final_logit_softcap=float(softcap) if softcap else None,
    )
