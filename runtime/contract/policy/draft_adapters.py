"""Draft adapter rules: which drafts take adapters and over which modules, the serve's draft
adapter pool (``speculative.draft_max_loras`` / ``draft_max_lora_rank``), and an adapter's
draft adapter against the serve's draft."""

from __future__ import annotations

from collections.abc import Sequence

from ..algorithms import having
from ..config import DEFAULT_LORA_MODULES, DENSE_LORA_MODULES, RuntimeConfig, SpecAlgorithm
from .algorithms import named
from .declarations import DraftAdapterDeclaration
from .fields import at_least, at_most, module_list
from .findings import Kind, Violation

DRAFT_ADAPTER_ALGORITHMS: frozenset[SpecAlgorithm] = having("draft_adapters")
"""Effective algorithms whose draft takes draft adapters in this runtime: a STANDALONE draft
(a whole model with its own adapter pool) and an EAGLE / EAGLE3 head (a pool over the
head's own linear layers; NEXTN resolves to EAGLE). DFLASH / DSPARK drafts and the
FROZEN_KV_MTP assistant take none in this version."""
NO_DRAFT_MODEL_ALGORITHMS: frozenset[SpecAlgorithm] = having("model_free")
"""Algorithms with no draft model at all: nothing a draft adapter could adapt."""
DRAFT_LORA_MODULES: tuple[str, ...] = DEFAULT_LORA_MODULES
"""The modules of the draft's adapter pool (``SpeculativeConfig.draft_lora_pool``): never the
embeddings or lm_head."""
HEAD_DRAFT_LORA_MODULES: tuple[str, ...] = (*DRAFT_LORA_MODULES, "fc")
"""The modules of an EAGLE / EAGLE3 head's draft adapter pool: its decoder layer's
projections and the fc that fuses the target's features, as the head's checkpoint names
them. The embed_tokens / lm_head it shares with the target are never adapted."""
DRAFT_ADAPTER_MODULE_NAMES: tuple[str, ...] = (*DENSE_LORA_MODULES, "fc")
"""Every module name an Adapter's ``spec.draft.targetModules`` may declare (the policy then
judges them against the serve's draft)."""

_NO_DRAFT_ADAPTERS = (
    "draft adapters serve STANDALONE drafts and EAGLE / EAGLE3 heads in this version (this draft's layers "
    "have no draft adapter pool)"
)
_SERVE_IT_ELSEWHERE = "remove {adapter.draft}, or serve the adapter from a STANDALONE, EAGLE or EAGLE3 serve"


def draft_pool_refusal(modules: Sequence[str], served: Sequence[str]) -> str:
    """Why a draft adapter over ``modules``, outside its pool's ``served`` modules, is refused,
    and its fix. A draft pool never wraps embed_tokens / lm_head (a STANDALONE draft's own,
    or those an EAGLE head shares with the target) whatever ``lora.target_modules`` holds:
    that is the target's pool, so only another draft adapter fixes this."""
    names = ", ".join(modules)
    return (
        f"the draft adapter targets {names}, which the draft adapter pool never wraps (it wraps "
        f"{', '.join(served)}; the draft's embed_tokens and lm_head stay unadapted, and lora.target_modules, "
        f"the target's pool, does not change that): use a draft adapter without {names}"
    )


def draft_lora_modules(algorithm: SpecAlgorithm) -> tuple[str, ...]:
    """The modules the draft adapter pool of an ``algorithm`` serve (the effective one) wraps."""
    return HEAD_DRAFT_LORA_MODULES if algorithm.is_eagle_family else DRAFT_LORA_MODULES


def no_draft_model(algorithm: SpecAlgorithm) -> str:
    """Why a serve of ``algorithm`` (NONE or NGRAM) has nothing a draft adapter could adapt."""
    if algorithm is SpecAlgorithm.NGRAM:
        return "NGRAM drafts from the prompt: there is no draft model to adapt"
    return "the serve does not speculate ({speculative.algorithm} NONE): there is no draft model to adapt"


def draft_lora_pool(config: RuntimeConfig, effective: RuntimeConfig, note: str | None) -> list[Violation]:
    """The draft adapter pool (``speculative.draft_max_loras`` / ``draft_max_lora_rank``).

    A pool serves STANDALONE drafts and EAGLE / EAGLE3 heads. On a serve whose draft is a
    DFLASH / DSPARK draft or the FROZEN_KV_MTP assistant it is refused (not available yet):
    those drafts would run unadapted while the serve's Adapters name draft adapters for
    them. NONE / NGRAM have no draft at all, so a pool there is only a warning
    (``config_warnings``), as a draft model named for NGRAM is.
    """
    spec = config.speculative
    out = _draft_pool_bounds(config)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    if spec.draft_max_loras <= 0 or algorithm in NO_DRAFT_MODEL_ALGORITHMS:
        return out
    if algorithm not in DRAFT_ADAPTER_ALGORITHMS:
        out.append(
            Violation(
                "draft-lora-algorithm",
                "speculative.draft_max_loras",
                f"a draft adapter pool for the {named(algorithm, note)} draft: {_NO_DRAFT_ADAPTERS}",
                "set {speculative.draft_max_loras} to 0, or draft with STANDALONE, EAGLE or EAGLE3",
                related=("speculative.algorithm",),
                kind=Kind.UNAVAILABLE,
            )
        )
    if config.lora.enabled and spec.draft_max_loras > config.lora.max_loaded_loras >= 1:
        out.append(
            Violation(
                "draft-lora-slots-cache",
                "speculative.draft_max_loras",
                f"{spec.draft_max_loras} draft adapter slots exceed the {config.lora.max_loaded_loras} adapters "
                "cached in host memory ({lora.max_loaded_loras}); a draft adapter is cached beside its adapter",
                "lower {speculative.draft_max_loras} or raise {lora.max_loaded_loras}",
                related=("lora.max_loaded_loras",),
            )
        )
    return out


def _draft_pool_bounds(config: RuntimeConfig) -> list[Violation]:
    """The draft adapter pool's slots and rank within their bounds."""
    spec = config.speculative
    out: list[Violation] = []
    out += at_least("speculative.draft_max_loras", spec.draft_max_loras, "draft-lora-slots")
    out += at_most(
        "speculative.draft_max_loras",
        spec.draft_max_loras,
        "draft-lora-slots-max",
        "each slot reserves GPU memory",
    )
    out += at_least("speculative.draft_max_lora_rank", spec.draft_max_lora_rank, "draft-lora-rank")
    out += at_most(
        "speculative.draft_max_lora_rank",
        spec.draft_max_lora_rank,
        "draft-lora-rank-max",
        "every draft slot reserves GPU memory for it",
    )
    return out


def draft_adapter(
    config: RuntimeConfig,
    draft: DraftAdapterDeclaration | None,
    algorithm: SpecAlgorithm,
    note: str | None,
) -> list[Violation]:
    """An adapter's draft adapter against the serve's draft (``algorithm`` is the effective one).

    The draft adapter only changes what is proposed, never the output (the target verifies
    with the adapter itself), but a draft adapter the serve cannot load fails its Adapter's
    load, all or nothing: so every misfit is refused here, with the fix.
    """
    if draft is None:
        return []
    if algorithm in NO_DRAFT_MODEL_ALGORITHMS:
        return [
            Violation(
                "adapter-draft-no-draft-model",
                "adapter.draft",
                no_draft_model(algorithm),
                _SERVE_IT_ELSEWHERE,
                related=("speculative.algorithm",),
            )
        ]
    if algorithm not in DRAFT_ADAPTER_ALGORITHMS:
        return [
            Violation(
                "adapter-draft-algorithm",
                "adapter.draft",
                f"the serve's {named(algorithm, note)} draft cannot take adapters: {_NO_DRAFT_ADAPTERS}",
                _SERVE_IT_ELSEWHERE,
                related=("speculative.algorithm",),
                kind=Kind.UNAVAILABLE,
            )
        ]
    out = _draft_pool_and_rank(config, draft)
    if draft.target_modules is not None:
        out += _draft_modules(tuple(draft.target_modules), algorithm)
    return out


def _draft_pool_and_rank(config: RuntimeConfig, draft: DraftAdapterDeclaration) -> list[Violation]:
    """The serve's draft adapter pool, present and wide enough for the draft adapter's rank."""
    spec = config.speculative
    out: list[Violation] = []
    if spec.draft_max_loras <= 0:
        out.append(
            Violation(
                "adapter-draft-no-pool",
                "adapter.draft",
                "the serve has no draft adapter pool ({speculative.draft_max_loras} is 0)",
                "set {speculative.draft_max_loras} to 1 or more (draft adapters per batch), or remove {adapter.draft}",
                related=("speculative.draft_max_loras",),
            )
        )
    if draft.rank is None:
        return out
    if draft.rank < 1:
        out.append(
            Violation(
                "adapter-draft-rank",
                "adapter.draft.rank",
                f"must be at least 1, got {draft.rank}",
                "use the draft adapter's rank",
            )
        )
    elif draft.rank > spec.draft_max_lora_rank:
        out.append(
            Violation(
                "adapter-draft-rank-too-large",
                "adapter.draft.rank",
                f"draft rank {draft.rank} exceeds {{speculative.draft_max_lora_rank}} ({spec.draft_max_lora_rank})",
                f"raise {{speculative.draft_max_lora_rank}} to at least {draft.rank}, or use a lower-rank "
                "draft adapter",
                related=("speculative.draft_max_lora_rank",),
            )
        )
    return out


def _draft_modules(modules: tuple[str, ...], algorithm: SpecAlgorithm) -> list[Violation]:
    """Declared draft adapter modules against the pool of the serve's draft: a STANDALONE
    draft's linears, or an EAGLE head's (its layer's projections and its fc; the head
    shares the target's embed_tokens / lm_head, which stay unadapted)."""
    served = draft_lora_modules(algorithm)
    out = module_list(
        "adapter.draft.target_modules", modules, "adapter-draft-modules", known=DRAFT_ADAPTER_MODULE_NAMES
    )
    outside = [m for m in dict.fromkeys(modules) if m in DRAFT_ADAPTER_MODULE_NAMES and m not in served]
    if not outside:
        return out
    if algorithm.is_eagle_family:
        why = (
            f"targets {', '.join(outside)}, which an {algorithm.value} head's draft adapter pool does not wrap "
            f"(it wraps {', '.join(served)}; the head shares the target's base embed_tokens and lm_head, "
            "which stay unadapted for every request)"
        )
    else:
        why = (
            f"targets {', '.join(outside)}, which the draft adapter pool does not wrap (it wraps "
            f"{', '.join(served)})"
        )
    out.append(
        Violation(
            "adapter-draft-modules-not-served",
            "adapter.draft.target_modules",
            why,
            f"retrain the draft adapter without {', '.join(outside)}",
        )
    )
    return out
