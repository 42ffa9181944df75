"""Speculative algorithm resolution: which algorithm runs for the one configured (NEXTN as
EAGLE, a Gemma-4 assistant as FROZEN_KV_MTP), the algorithms that grow trees, and how an
algorithm is named in a finding."""

from __future__ import annotations

from ..algorithms import ALGORITHMS, having
from ..config import RuntimeConfig, SpecAlgorithm

TREE_ALGORITHMS: frozenset[SpecAlgorithm] = having("grows_trees")
"""Effective algorithms that can draft a tree (``top_k > 1``): ``AlgorithmTraits.grows_trees``."""

FROZEN_KV_MTP_DRAFT_ARCHITECTURES: frozenset[str] = frozenset({"Gemma4AssistantForCausalLM"})
"""Draft architectures that run as FROZEN_KV_MTP when named under EAGLE or NEXTN."""


def resolve_speculative(
    requested: SpecAlgorithm | str, draft_architecture: str | None = None
) -> tuple[SpecAlgorithm, str | None]:
    """The algorithm that runs for ``requested`` with a draft of ``draft_architecture``,
    and a note saying how it was resolved (or None).

    NEXTN (a model's own next-n head) runs as EAGLE; EAGLE or NEXTN with a Gemma-4
    assistant draft runs as FROZEN_KV_MTP. Raises ``ValueError`` on an unknown name.
    """
    requested = SpecAlgorithm(requested)
    resolves_to = ALGORITHMS[requested].resolves_to
    if (requested if resolves_to is None else resolves_to) is SpecAlgorithm.EAGLE and (
        draft_architecture in FROZEN_KV_MTP_DRAFT_ARCHITECTURES
    ):
        return SpecAlgorithm.FROZEN_KV_MTP, (
            f"{requested.value} with the Gemma-4 assistant draft {draft_architecture} resolves to FROZEN_KV_MTP"
        )
    if resolves_to is not None:
        return resolves_to, f"{requested.value} resolves to {resolves_to.value}"
    return requested, None


def resolve_algorithm(config: RuntimeConfig) -> tuple[SpecAlgorithm, str | None]:
    """The algorithm that actually runs for ``config``, and the resolution note (or None).

    ``speculative.draft_model_architecture`` must be known for the Gemma-4 case (the
    runtime reads it from the draft's config.json first).
    """
    spec = config.speculative
    return resolve_speculative(spec.algorithm, spec.draft_model_architecture)


def effective_config(config: RuntimeConfig) -> tuple[RuntimeConfig, str | None]:
    """A resolved copy of ``config`` (the input is never changed) and the resolution note."""
    algorithm, note = resolve_algorithm(config)
    effective = config.copy()
    if (
        ALGORITHMS[SpecAlgorithm(config.speculative.algorithm)].resolves_to is not None
        and not config.speculative.draft_model_path
    ):
        # NEXTN without a separate draft reads the next-n layers from the target checkpoint.
        effective.speculative.draft_model_path = config.model.path
    effective.speculative.algorithm = algorithm
    return effective, note


def named(algorithm: SpecAlgorithm, note: str | None) -> str:
    """The algorithm's name in a finding, with its resolution note when it was resolved."""
    return f"{algorithm.value} ({note})" if note else algorithm.value


def order(algorithm: SpecAlgorithm) -> int:
    """The algorithm's place in :class:`SpecAlgorithm`, to list algorithms in that order."""
    return list(SpecAlgorithm).index(algorithm)
