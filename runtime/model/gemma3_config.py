"""What Gemma 3 (text) adds to a Llama-family config: its layer pattern, second rope, norms
and scalings, read from a ``Gemma3ForCausalLM`` config.json in both spellings (transformers
5's ``layer_types`` / per-type ``rope_parameters``, and the older ``sliding_window_pattern`` /
``rope_local_base_freq``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract.errors import ModelConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_PATTERN = 6
"""Every sixth layer is global when a config states neither ``layer_types`` nor a pattern."""


@dataclass(frozen=True)
class GemmaSpec:
    """Gemma 3's additions: which layers see a sliding window, and its scalings."""

    sliding_window: int
    sliding_layers: tuple[bool, ...]  # per layer: True = sliding (local rope), False = global
    local_rope_theta: float  # the sliding layers' rope base; the global layers use arch.rope
    query_pre_attn_scalar: float  # attention scale = query_pre_attn_scalar ** -0.5
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)


def gemma_spec(raw: dict, num_layers: int) -> GemmaSpec:
    """Gemma 3's additions from its config.json; :class:`ModelConfigError` names what is not served."""
    if raw.get("attn_logit_softcapping"):
        raise ModelConfigError(
            "config.json attn_logit_softcapping is set: soft-capped attention scores (Gemma 2) are not served; "
            "Gemma 3 configs leave it null"
        )
    if raw.get("use_bidirectional_attention"):
        raise ModelConfigError("config.json use_bidirectional_attention: only causal Gemma 3 decoders are served")
    window = raw.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelConfigError(f"config.json sliding_window must be a positive integer for Gemma 3, got {window!r}")
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or DEFAULT_PATTERN)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ModelConfigError(
            f"config.json layer_types must list {num_layers} of {SLIDING!r} / {FULL!r}, got {types!r}"
        )
    params = raw.get("rope_parameters")
    local = params.get(SLIDING) if isinstance(params, dict) else None
    if isinstance(local, dict):
        if (local.get("rope_type") or "default") != "default":
            raise ModelConfigError("config.json rope_parameters.sliding_attention: only the default rope is served")
        local_theta = float(local.get("rope_theta", 10000.0))
    else:
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    softcap = raw.get("final_logit_softcapping")
    return GemmaSpec(
        sliding_window=window,
        sliding_layers=tuple(t == SLIDING for t in types),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
        final_logit_softcap=float(softcap) if softcap else None,
    )
