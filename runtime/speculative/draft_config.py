"""The draft's own configuration, derived from the target's without touching it.

A draft runs in the same process as the target but is a different model: its own path,
its own load format, no LoRA pool (drafts never see adapters, which is what keeps one
draft valid for every adapter). Everything else (dtype, device, context length, KV
budget, graphs) follows the target, so the draft can hold every token the target holds.
The target's :class:`RuntimeConfig` is deep-copied first and never mutated.
"""

from __future__ import annotations

from ..contract.capabilities import CAPABILITIES, Capabilities
from ..contract.config import (
    RaggedVerify,
    RuntimeConfig,
    SpecAlgorithm,
    SpeculativeConfig,
    chain_draft_tokens,
)
from ..contract.policy import MINIMUM, adaptive_unavailable, resolve_speculative, tree_draft_tokens_limit


class SpeculativeConfigError(ValueError):
    """A speculative setting cannot run; ``field`` is its config path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def resolve_algorithm(algorithm: SpecAlgorithm | str, draft_architecture: str | None = None) -> SpecAlgorithm:
    """The algorithm that actually runs, resolved exactly as the compatibility policy does
    (NEXTN is EAGLE; EAGLE or NEXTN with a Gemma-4 assistant draft is FROZEN_KV_MTP)."""
    return resolve_speculative(algorithm, draft_architecture)[0]


def validate_speculative(spec: SpeculativeConfig, capabilities: Capabilities = CAPABILITIES) -> SpecAlgorithm:
    """Check the settings the decoder depends on; return the resolved algorithm.

    Which algorithms run comes from ``capabilities`` (the table the admission webhook
    judges by too). Raises :class:`SpeculativeConfigError` naming the field and the fix.
    """
    try:
        algorithm = resolve_algorithm(spec.algorithm, spec.draft_model_architecture)
    except ValueError:
        raise SpeculativeConfigError(
            "speculative.algorithm", f"unknown speculative.algorithm {spec.algorithm!r}"
        ) from None
    if algorithm is SpecAlgorithm.NONE:
        raise SpeculativeConfigError(
            "speculative.algorithm", "speculative decoding is disabled (speculative.algorithm is NONE)"
        )
    if not capabilities.implements(algorithm):
        runnable = sorted(a.value for a in capabilities.algorithms if a is not SpecAlgorithm.NONE)
        names = ", ".join([*runnable, SpecAlgorithm.NEXTN.value])
        requested = SpecAlgorithm(spec.algorithm)
        how = "" if requested is algorithm else f" ({requested.value} resolves to it)"
        raise SpeculativeConfigError(
            "speculative.algorithm",
            f"speculative.algorithm {algorithm.value}{how} is not implemented in this runtime; use one of {names}",
        )
    least_k = MINIMUM["speculative.top_k"]
    if spec.top_k < least_k:
        raise SpeculativeConfigError(
            "speculative.top_k", f"speculative.top_k must be >= {least_k}, got {spec.top_k}"
        )
    if spec.top_k > 1 and algorithm not in capabilities.tree_algorithms:
        trees = ", ".join(sorted(a.value for a in capabilities.tree_algorithms)) or "no algorithm"
        raise SpeculativeConfigError(
            "speculative.top_k",
            f"speculative.top_k {spec.top_k} asks for tree drafts, which this runtime grows for {trees}, "
            f"not {algorithm.value}: set speculative.top_k to 1",
        )
    least_steps = MINIMUM["speculative.num_steps"]
    if spec.num_steps < least_steps:
        raise SpeculativeConfigError(
            "speculative.num_steps", f"speculative.num_steps must be >= {least_steps}, got {spec.num_steps}"
        )
    if spec.top_k > 1:
        # The policy's bounds (the webhook and start-up judge by the same ones).
        least, most = MINIMUM["speculative.num_draft_tokens"], tree_draft_tokens_limit(spec.top_k, spec.num_steps)
        if not least <= spec.num_draft_tokens <= most:
            raise SpeculativeConfigError(
                "speculative.num_draft_tokens",
                f"a tree of speculative.top_k {spec.top_k} over speculative.num_steps {spec.num_steps} offers "
                f"{most - 1} candidates: speculative.num_draft_tokens must be {least}..{most}, got {spec.num_draft_tokens}",
            )
    elif algorithm is SpecAlgorithm.DFLASH:
        # One draft forward per step: num_draft_tokens is the block (the last token and its
        # drafts); num_steps is not used. The checkpoint's block_size bounds it at start-up.
        if spec.num_draft_tokens < 2:
            raise SpeculativeConfigError(
                "speculative.num_draft_tokens",
                f"a DFLASH block holds the last token and at least one draft: speculative.num_draft_tokens "
                f"must be >= 2, got {spec.num_draft_tokens}",
            )
    elif spec.num_draft_tokens != chain_draft_tokens(spec.num_steps):
        raise SpeculativeConfigError(
            "speculative.num_draft_tokens",
            f"speculative.num_draft_tokens must be speculative.num_steps + 1 = {chain_draft_tokens(spec.num_steps)} for "
            f"chain drafts (the last committed token plus one draft per step), got {spec.num_draft_tokens}",
        )
    if (adaptive := adaptive_unavailable(spec, algorithm, capabilities)) is not None:
        raise SpeculativeConfigError(adaptive.field, adaptive.render())
    if RaggedVerify(spec.ragged_verify) is not RaggedVerify.STATIC:
        raise SpeculativeConfigError(
            "speculative.ragged_verify",
            "speculative.ragged_verify must be 'static': every request verifies num_draft_tokens tokens, "
            "so the batch's LoRA segments stay uniform",
        )
    if algorithm is SpecAlgorithm.NGRAM:
        if spec.ngram_min < 1 or spec.ngram_max < spec.ngram_min:
            raise SpeculativeConfigError(
                "speculative.ngram_max",
                f"need 1 <= speculative.ngram_min <= speculative.ngram_max, got "
                f"{spec.ngram_min}..{spec.ngram_max}",
            )
    elif not spec.draft_model_path:
        raise SpeculativeConfigError(
            "speculative.draft_model_path",
            f"speculative.algorithm {algorithm.value} needs speculative.draft_model_path "
            "(a local directory with the draft's config.json and safetensors)",
        )
    return algorithm


def build_draft_config(target: RuntimeConfig, *, context_length: int | None = None) -> RuntimeConfig:
    """The draft model's own :class:`RuntimeConfig`; ``target`` is left untouched.

    ``context_length``: the target's resolved context length (its model's maximum when
    the configuration leaves it unset); the draft follows it so that every position the
    target can reach, the draft can too.
    """
    validate_speculative(target.speculative)
    draft = target.copy()
    spec = draft.speculative
    if spec.draft_model_path:
        draft.model.path = spec.draft_model_path
    draft.model.architecture = spec.draft_model_architecture
    draft.model.revision = None
    draft.model.served_name = None
    draft.model.context_length = context_length if context_length is not None else target.model.context_length
    if hasattr(draft.model, "load_format"):
        draft.model.load_format = spec.draft_load_format
    # None of the target's adapters in the draft: one draft serves every adapter, and its
    # proposals never depend on which target adapters are loaded. Its own pool (draft
    # adapters, by Adapter name) exists only with speculative.draft_max_loras.
    pool = spec.draft_lora_pool(target.lora)
    if pool is not None:
        draft.lora = pool
    else:
        draft.lora.enabled = False
        draft.lora.adapters = {}
        draft.lora.pinned = ()
    return draft
