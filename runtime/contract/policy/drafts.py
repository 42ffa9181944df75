"""Draft checkpoint layouts: which published draft layouts the runtime serves, and why it
refuses the others.

One rule per concern, two places that can judge it:

- :func:`draft_layout` (part of ``check_config``: the admission webhook and the runtime's
  start-up alike) judges what the configuration states: the draft's architecture
  (``speculative.draft_model_architecture``; ``draftModel.architecture`` in the CRD, filled
  from the draft's config.json at start-up when the CRD leaves it out).
- :func:`draft_config_problems` judges the draft's config.json itself (its layer count, the
  EAGLE3 options that change its equations, the vLLM speculators format's own fields). The
  runtime's start-up check calls it before any weight is read, and the draft loaders raise
  the same text; the webhook cannot read a checkpoint, so a multi-layer head whose
  architecture is an ordinary EAGLE one is refused at start-up, by name, never by a tensor
  error.

The vLLM speculators format (``speculators_model_type`` at the top of config.json, the
decoder layer's fields nested under ``transformer_layer_config``; architectures
``Eagle3Speculator``, or ``Eagle3DraftModel`` as newer speculators releases save it) is
served for ``speculators_model_type: eagle3`` with one Llama decoder layer; the
speculators options this runtime's head does not run are refused by name
(:func:`speculators_problems`).
"""

from __future__ import annotations

from ..config import RuntimeConfig, SpecAlgorithm
from .findings import Kind, Violation

SERVED_DRAFT_ARCHITECTURES: dict[str, frozenset[SpecAlgorithm]] = {
    "LlamaForCausalLMEagle": frozenset({SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}),
    "LlamaForCausalLMEagle3": frozenset({SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}),
    "Eagle3Speculator": frozenset({SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}),
    "Eagle3DraftModel": frozenset({SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3}),
    "DFlashDraftModel": frozenset({SpecAlgorithm.DFLASH}),
}
"""Draft architectures (config.json ``architectures[0]``) -> the effective algorithms whose
drafter loads them."""

_ONE_LAYER_FIX = (
    "use a single-layer EAGLE/EAGLE3 head (a Llama decoder layer, as yuhuili's, AngelSlim's and "
    "SpecForge's EAGLE3 heads are) or a DFLASH draft"
)
_MTP_REASON = (
    "a model's own multi-token-prediction module: its layer is the target family's decoder layer "
    "(MLA attention, a mixture-of-experts MLP) behind enorm/hnorm/eh_proj, which no draft of this runtime runs"
)

REFUSED_DRAFT_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "DFlash2DraftModel": (
        "DFlash2 drafts (causal convolutions and a candidate selector) are not served",
        "use a DFlashDraftModel checkpoint",
    ),
    "DSparkDraftModel": (
        "a DSPARK draft: its Markov head (markov_w1/markov_w2, each block position's logits depend on the "
        "token drafted before it) and its confidence head (a verify width per request) are not run by the "
        "DFLASH drafter",
        "use a DFlashDraftModel checkpoint with DFLASH",
    ),
    "DeepSeekMTPModel": (_MTP_REASON, _ONE_LAYER_FIX),
    "DeepseekV3ForCausalLMNextN": (_MTP_REASON, _ONE_LAYER_FIX),
    "Glm4MoeMTPModel": (_MTP_REASON, _ONE_LAYER_FIX),
    "MiMoMTPModel": (_MTP_REASON, _ONE_LAYER_FIX),
    "Qwen3NextMTP": (_MTP_REASON, _ONE_LAYER_FIX),
}
"""Published draft architectures the runtime refuses -> (why, the fix)."""

SPECULATORS_ARCHITECTURES = frozenset({"Eagle3Speculator", "Eagle3DraftModel"})
"""config.json ``architectures`` of the vLLM speculators format's EAGLE3 heads (served)."""

_SPECULATORS_FIX = (
    "use a speculators_model_type eagle3 head of one Llama decoder layer (as speculators' eagle3 converter "
    "writes them), or the head in the EAGLE3 layout (architectures LlamaForCausalLMEagle3)"
)


def draft_layout(config: RuntimeConfig, effective: RuntimeConfig) -> list[Violation]:
    """The draft architecture the configuration states, against the effective algorithm."""
    spec = config.speculative
    architecture = spec.draft_model_architecture
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    if not spec.enabled or not architecture:
        return []
    if architecture in REFUSED_DRAFT_ARCHITECTURES:
        reason, fix = REFUSED_DRAFT_ARCHITECTURES[architecture]
        return [
            Violation(
                "draft-layout",
                "speculative.draft_model_architecture",
                f"draft architecture {architecture}: {reason}",
                fix,
                kind=Kind.UNAVAILABLE,
                related=("speculative.algorithm",),
            )
        ]
    served = SERVED_DRAFT_ARCHITECTURES.get(architecture)
    if served is not None and algorithm not in served and _drafts_with_a_head(algorithm):
        wanted = ", ".join(sorted(a.value for a in served))
        return [
            Violation(
                "draft-layout-algorithm",
                "speculative.draft_model_architecture",
                f"a {architecture} draft is loaded by {wanted}, not by {algorithm.value}",
                f"set {{speculative.algorithm}} to {wanted}, or name a draft of {algorithm.value}",
                related=("speculative.algorithm",),
            )
        ]
    return []


def _drafts_with_a_head(algorithm: SpecAlgorithm) -> bool:
    """Algorithms whose drafter loads one of :data:`SERVED_DRAFT_ARCHITECTURES`."""
    return any(algorithm in algorithms for algorithms in SERVED_DRAFT_ARCHITECTURES.values())


def draft_config_problems(algorithm: SpecAlgorithm | str, raw: dict) -> list[str]:
    """Why the draft whose config.json is ``raw`` cannot be served by the effective
    ``algorithm`` (empty: nothing in its config.json says so). Pure: the caller reads the file."""
    algorithm = SpecAlgorithm(algorithm)
    archs = raw.get("architectures")
    architecture = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if architecture in REFUSED_DRAFT_ARCHITECTURES:
        reason, fix = REFUSED_DRAFT_ARCHITECTURES[architecture]
        return [f"draft config.json architecture {architecture}: {reason}; fix: {fix}"]
    if algorithm in (SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3):
        return _eagle_head_problems(raw)
    if algorithm is SpecAlgorithm.DFLASH:
        nested = raw.get("dflash_config")
        if isinstance(nested, dict) and (nested.get("markov_rank") or nested.get("enable_confidence_head")):
            reason, fix = REFUSED_DRAFT_ARCHITECTURES["DSparkDraftModel"]
            return [
                f"draft config.json dflash_config has markov_rank / enable_confidence_head: {reason}; fix: {fix}"
            ]
    return []


def is_speculators_format(raw: dict) -> bool:
    """Whether ``raw`` (a draft's config.json) is in the vLLM speculators format."""
    archs = raw.get("architectures")
    named = isinstance(archs, list) and bool(archs) and archs[0] in SPECULATORS_ARCHITECTURES
    return named or "speculators_model_type" in raw or "transformer_layer_config" in raw


def speculators_problems(raw: dict) -> list[str]:
    """What a speculators-format config.json asks for beyond one EAGLE3 Llama layer over
    the target's auxiliary hidden states (empty: the head is served). ``norm_before_residual``
    is served; the layer count is judged with the layer's other fields by the caller."""
    kind = raw.get("speculators_model_type")
    if kind != "eagle3":
        return [
            f"the draft's config.json is in the vLLM speculators format with speculators_model_type {kind!r}: "
            f"only eagle3 speculators are read; fix: {_SPECULATORS_FIX}"
        ]
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return [
            "the draft's config.json is in the vLLM speculators format without a transformer_layer_config "
            f"object (the decoder layer's fields); fix: {_SPECULATORS_FIX}"
        ]
    out: list[str] = []
    layer_type = layer.get("model_type", "llama")
    if layer_type != "llama":
        out.append(
            f"the speculators head's transformer_layer_config.model_type is {layer_type!r}: this runtime's EAGLE3 "
            "head is a Llama decoder layer (a qwen3 layer adds per-head q/k norms it does not run); "
            f"fix: {_SPECULATORS_FIX}"
        )
    layer_types = layer.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        out.append(
            f"the speculators head's transformer_layer_config.layer_types is {layer_types}: the head's one layer "
            f"attends over the whole context here, never a sliding window; fix: {_SPECULATORS_FIX}"
        )
    if raw.get("norm_before_fc"):
        out.append(
            "the speculators head sets norm_before_fc (an RMSNorm input_norm over the concatenated target "
            f"states before fc), which this runtime's EAGLE3 head does not run; fix: {_SPECULATORS_FIX}"
        )
    if raw.get("fc_norm"):
        out.append(
            f"the speculators head sets fc_norm, which this runtime's EAGLE3 head does not run; fix: {_SPECULATORS_FIX}"
        )
    if raw.get("norm_output") is False:
        out.append(
            "the speculators head sets norm_output false (no final norm before its lm_head): this runtime's EAGLE3 "
            f"head always applies norm; fix: {_SPECULATORS_FIX}"
        )
    return out


def _eagle_head_problems(raw: dict) -> list[str]:
    """What an EAGLE-family head's config.json asks for that the runtime's head does not run.
    ``norm_before_residual`` (the layer's residual is the normed feature) is served."""
    out: list[str] = []
    if is_speculators_format(raw):
        out += speculators_problems(raw)
        nested = raw.get("transformer_layer_config")
        raw = nested if isinstance(nested, dict) else {}
    layers = raw.get("num_hidden_layers", 1)
    if isinstance(layers, int) and not isinstance(layers, bool) and layers != 1:
        out.append(
            f"the EAGLE draft's config.json has num_hidden_layers {layers}: this runtime's EAGLE heads are one "
            "decoder layer over the target's feature (EAGLE3: attention over [embedding, feature] at twice the "
            f"hidden size); a head of {layers} layers (vLLM's multi-layer EAGLE3, an MTP stack) is not served; "
            f"fix: {_ONE_LAYER_FIX}"
        )
    nested = raw.get("eagle_config")
    if isinstance(nested, dict) and nested.get("use_aux_hidden_state") is False:
        out.append(
            "the EAGLE draft's config.json sets eagle_config.use_aux_hidden_state false (no fc over the "
            "target's layers): this runtime's EAGLE3 heads always fuse the target's auxiliary hidden states; "
            "fix: use an EAGLE3 head with an fc over its eagle_aux_hidden_state_layer_ids"
        )
    return out
