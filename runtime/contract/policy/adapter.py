"""The adapter check: one adapter (and its draft adapter) against the serve configuration it
is meant for. Field paths of the adapter are ``adapter.*``; the serve's are the
configuration's own."""

from __future__ import annotations

from ..config import LORA_MODULES, RuntimeConfig, SpecAlgorithm, pool_modules
from .algorithms import effective_config
from .bounds import pinned_slot_limit
from .declarations import AdapterDeclaration
from .draft_adapters import draft_adapter
from .fields import module_list
from .findings import PolicyWarning, Report, Violation
from .lora import EMBEDDING_MODULES

Findings = tuple[list[Violation], list[PolicyWarning]]


def check_adapter(
    config: RuntimeConfig,
    adapter: AdapterDeclaration,
    *,
    other_pinned: int = 0,
) -> Report:
    """Judge one adapter against the serve configuration it is meant for.

    ``other_pinned``: how many other adapters of the same serve are pinned. Field paths
    of the adapter are ``adapter.name``, ``adapter.serve``, ``adapter.rank``,
    ``adapter.target_modules``, ``adapter.pinned`` and, for its draft adapter,
    ``adapter.draft``, ``adapter.draft.rank`` and ``adapter.draft.target_modules``; the
    serve's are the configuration's own.
    """
    effective, note = effective_config(config)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    violations = _serve_takes_it(config, adapter) + _rank(config, adapter)
    module_violations, module_warnings = _modules(config, adapter, algorithm)
    violations += module_violations
    violations += draft_adapter(config, adapter.draft, algorithm, note)
    pinned_violations, pinned_warnings = _pinned(config, adapter, other_pinned)
    violations += pinned_violations
    return Report(tuple(violations), (*module_warnings, *pinned_warnings))


def _serve_takes_it(config: RuntimeConfig, adapter: AdapterDeclaration) -> list[Violation]:
    """A serve with LoRA enabled, whose base model is not served under the adapter's name."""
    out: list[Violation] = []
    if not config.lora.enabled:
        out.append(
            Violation(
                "adapter-lora-disabled",
                "adapter.serve",
                "the serve has LoRA disabled",
                "set {lora.enabled} to true, or serve this adapter elsewhere",
                related=("lora.enabled",),
            )
        )
    if config.model.served_name and adapter.name == config.model.served_name:
        out.append(
            Violation(
                "adapter-name-clash",
                "adapter.name",
                f"{adapter.name!r} is the base model's served name, so requests could not tell them apart",
                "rename the adapter, or change {model.served_name}",
                related=("model.served_name",),
            )
        )
    return out


def _rank(config: RuntimeConfig, adapter: AdapterDeclaration) -> list[Violation]:
    """The adapter's rank, when known: at least 1 and within the serve's ``lora.max_rank``."""
    lora = config.lora
    if adapter.rank is None:
        return []
    if adapter.rank < 1:
        return [
            Violation(
                "adapter-rank",
                "adapter.rank",
                f"must be at least 1, got {adapter.rank}",
                "use the adapter's rank",
            )
        ]
    if adapter.rank > lora.max_rank:
        return [
            Violation(
                "adapter-rank-too-large",
                "adapter.rank",
                f"rank {adapter.rank} exceeds {{lora.max_rank}} ({lora.max_rank})",
                f"raise {{lora.max_rank}} to at least {adapter.rank}, or use a lower-rank adapter",
                related=("lora.max_rank",),
            )
        ]
    return []


def _modules(config: RuntimeConfig, adapter: AdapterDeclaration, algorithm: SpecAlgorithm) -> Findings:
    """The adapter's target modules, when known: valid, wrapped by the serve, and a warning
    for embeddings an EAGLE-family draft shares unadapted."""
    lora = config.lora
    violations: list[Violation] = []
    warnings: list[PolicyWarning] = []
    if adapter.target_modules is None:
        return violations, warnings
    modules = tuple(adapter.target_modules)
    violations += module_list("adapter.target_modules", modules, "adapter-modules")
    served = set(pool_modules(lora.target_modules))  # a router / expert name is served by its slots
    missing = [m for m in dict.fromkeys(modules) if m in LORA_MODULES and not set(pool_modules([m])) <= served]
    if missing:
        violations.append(
            Violation(
                "adapter-modules-not-served",
                "adapter.target_modules",
                f"targets {', '.join(missing)}, which {{lora.target_modules}} "
                f"({', '.join(lora.target_modules)}) does not wrap",
                f"add {', '.join(missing)} to {{lora.target_modules}}, or retrain without them",
                related=("lora.target_modules",),
            )
        )
    touched = [m for m in EMBEDDING_MODULES if m in modules]
    if touched and algorithm.shares_target_embeddings:
        warnings.append(
            PolicyWarning(
                "adapter-eagle-embeddings",
                "adapter.target_modules",
                f"this adapter changes {' and '.join(touched)}, but the shared {algorithm.value} draft uses the "
                "base model's; its accept rate drops (output is unaffected)",
            )
        )
    return violations, warnings


def _pinned(config: RuntimeConfig, adapter: AdapterDeclaration, other_pinned: int) -> Findings:
    """A pinned adapter, with the serve's ``other_pinned``, against the slots pins may hold."""
    lora = config.lora
    if not adapter.pinned:
        return [], []
    pinned, limit = other_pinned + 1, pinned_slot_limit(lora.max_loras_per_batch)
    if pinned > limit:
        return [
            Violation(
                "adapter-pinned-slots",
                "adapter.pinned",
                f"{pinned} pinned adapters would leave no GPU slot of {{lora.max_loras_per_batch}} "
                f"({lora.max_loras_per_batch}) for unpinned adapters; at most {limit} can be pinned",
                "unpin an adapter, or raise {lora.max_loras_per_batch}",
                related=("lora.max_loras_per_batch",),
            )
        ], []
    if pinned == limit:
        return [], [
            PolicyWarning(
                "adapter-pinned-all-slots",
                "adapter.pinned",
                f"pinned adapters now hold {limit} of the {lora.max_loras_per_batch} GPU slots "
                "({lora.max_loras_per_batch}); requests for unpinned adapters share the last one",
            )
        ]
    return [], []
