"""LoRA rules: the adapter pool's slots, cache, rank, modules and pinned adapters, and what
a LoRA serve cannot run beside (speculative algorithms, overlapped scheduling or loading)."""

from __future__ import annotations

from ..algorithms import ALGORITHMS
from ..capabilities import Capabilities
from ..config import LORA_BACKENDS, RaggedVerify, RuntimeConfig, SpecAlgorithm
from .algorithms import named, order
from .bounds import pinned_slot_limit
from .cel import CelRule
from .fields import at_least, at_most, module_list, one_of
from .findings import Violation

LORA_SPEC_ALGORITHMS: frozenset[SpecAlgorithm] = frozenset(
    a for a, t in ALGORITHMS.items() if t.lora_refusal is None and t.resolves_to is None
)
"""Effective algorithms whose adapter-free draft stays valid for every adapter (those with
no ``AlgorithmTraits.lora_refusal``)."""

EMBEDDING_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")


def lora_pool(config: RuntimeConfig) -> list[Violation]:
    """The adapter pool's slots, host cache, rank, modules and backend, then its adapters."""
    lora = config.lora
    out: list[Violation] = []
    out += at_least("lora.max_loras_per_batch", lora.max_loras_per_batch, "lora-slots")
    out += at_least("lora.max_loaded_loras", lora.max_loaded_loras, "lora-cache")
    out += at_least("lora.max_rank", lora.max_rank, "lora-rank")
    out += at_most("lora.max_rank", lora.max_rank, "lora-rank-max", "every slot reserves GPU memory for it")
    if lora.max_loras_per_batch > lora.max_loaded_loras >= 1:
        out.append(
            Violation(
                "lora-slots-cache",
                "lora.max_loras_per_batch",
                f"{lora.max_loras_per_batch} GPU slots exceed the {lora.max_loaded_loras} adapters cached in host "
                "memory ({lora.max_loaded_loras}); every adapter on the GPU is also cached on the host",
                "lower {lora.max_loras_per_batch} or raise {lora.max_loaded_loras}",
                related=("lora.max_loaded_loras",),
            )
        )
    out += module_list("lora.target_modules", lora.target_modules, "lora-modules")
    out += one_of("lora.backend", lora.backend, LORA_BACKENDS, "lora-backend")
    return out + _start_up_adapters(config)


# On a LoRAServe's spec.lora.
SLOTS_WITHIN_CACHE = CelRule(
    "!has(self.maxLorasPerBatch) || self.maxLorasPerBatch <= self.maxLoadedLoras",
    "lora.maxLorasPerBatch (GPU slots) must not exceed lora.maxLoadedLoras (CPU cache)",
    field_path=".maxLorasPerBatch",
    mirrors="lora-slots-cache",
)


def _start_up_adapters(config: RuntimeConfig) -> list[Violation]:
    """The adapters loaded and pinned at start-up against the pool's slots and cache."""
    lora = config.lora
    out: list[Violation] = []
    unknown_pinned = sorted(set(lora.pinned) - set(lora.adapters))
    if unknown_pinned:
        out.append(
            Violation(
                "lora-pinned-unknown",
                "lora.pinned",
                f"pinned adapters {', '.join(unknown_pinned)} are not loaded",
                "pin only adapters listed in {lora.adapters}",
                related=("lora.adapters",),
            )
        )
    if len(set(lora.pinned)) > (limit := pinned_slot_limit(lora.max_loras_per_batch)):
        out.append(
            Violation(
                "lora-pinned-slots",
                "lora.pinned",
                f"{len(set(lora.pinned))} pinned adapters would leave no GPU slot of {{lora.max_loras_per_batch}} "
                f"({lora.max_loras_per_batch}) for unpinned adapters; at most {limit} can be pinned",
                "pin fewer adapters or raise {lora.max_loras_per_batch}",
                related=("lora.max_loras_per_batch",),
            )
        )
    if len(lora.adapters) > lora.max_loaded_loras:
        out.append(
            Violation(
                "lora-preload-cache",
                "lora.adapters",
                f"{len(lora.adapters)} start-up adapters exceed the host cache {{lora.max_loaded_loras}} "
                f"({lora.max_loaded_loras})",
                "load fewer adapters at start-up or raise {lora.max_loaded_loras}",
                related=("lora.max_loaded_loras",),
            )
        )
    return out


def lora_compatibility(
    config: RuntimeConfig, effective: RuntimeConfig, note: str | None, caps: Capabilities
) -> list[Violation]:
    """What a LoRA serve cannot run beside: its speculation first, then its scheduling."""
    if not config.lora.enabled:
        return []
    return _lora_speculation(config, effective, note, caps) + _lora_scheduling(config)


def _lora_speculation(
    config: RuntimeConfig, effective: RuntimeConfig, note: str | None, caps: Capabilities
) -> list[Violation]:
    """LoRA beside the effective speculative algorithm, DSPARK's ragged verify and adaptive speculation."""
    spec = config.speculative
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out: list[Violation] = []
    if algorithm not in LORA_SPEC_ALGORITHMS:
        allowed = ", ".join(a.value for a in sorted(LORA_SPEC_ALGORITHMS - {SpecAlgorithm.NONE}, key=order))
        out.append(
            Violation(
                "lora-algorithm",
                "speculative.algorithm",
                f"LoRA adapters cannot be served with speculative algorithm {named(algorithm, note)}: "
                f"{ALGORITHMS[algorithm].lora_refusal}",
                f"use one of {allowed} (or NONE), or set {{lora.enabled}} to false",
                related=("lora.enabled", "speculative.draft_model_architecture")
                if note
                else ("lora.enabled",),
            )
        )
    if ALGORITHMS[algorithm].lora_static_verify and spec.ragged_verify is RaggedVerify.DYNAMIC:
        out.append(
            Violation(
                "lora-dspark-ragged",
                "speculative.ragged_verify",
                f"{algorithm.value} with LoRA needs static ragged verify: per-request verify lengths break the uniform-width "
                "LoRA segment layout of target-verify",
                "set {speculative.ragged_verify} to static",
                related=("speculative.algorithm", "lora.enabled"),
            )
        )
    if spec.adaptive and algorithm is not SpecAlgorithm.NONE and not caps.lora_graph_width_rebuild:
        out.append(
            Violation(
                "lora-adaptive",
                "speculative.adaptive",
                "adaptive speculation changes the verify width at run time, and the runtime cannot rebuild its "
                "LoRA graph metadata on a width change",
                # Without LoRA adaptive runs only where the image varies the width at all.
                "set {speculative.adaptive} to false"
                + (", or {lora.enabled} to false" if caps.adaptive_speculation else ""),
                related=("lora.enabled",),
            )
        )
    return out


def _lora_scheduling(config: RuntimeConfig) -> list[Violation]:
    """LoRA beside the overlap schedule, two-batch overlap and overlapped adapter loading."""
    out: list[Violation] = []
    if config.scheduler.overlap_schedule:
        out.append(
            Violation(
                "lora-overlap-schedule",
                "scheduler.overlap_schedule",
                "the overlap schedule prepares the next batch's adapter slots unordered against the forward in "
                "flight, which may still read them",
                "set {scheduler.overlap_schedule} to false, or {lora.enabled} to false",
                related=("lora.enabled",),
            )
        )
    if config.scheduler.two_batch_overlap:
        out.append(
            Violation(
                "lora-two-batch-overlap",
                "scheduler.two_batch_overlap",
                "two-batch overlap splits a batch into micro-batches that the LoRA segment metadata does not follow",
                "set {scheduler.two_batch_overlap} to false, or {lora.enabled} to false",
                related=("lora.enabled",),
            )
        )
    if config.lora.overlap_loading:
        out.append(
            Violation(
                "lora-overlap-loading",
                "lora.overlap_loading",
                "overlapped adapter loading fails silently: a batch can run before its adapter's weights land",
                "set {lora.overlap_loading} to false",
                related=("lora.enabled",),
            )
        )
    return out
