"""NGRAM: prompt lookup, no draft model (:mod:`.index` finds, :mod:`.drafter` proposes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...contract.config import RuntimeConfig, SpecAlgorithm
    from ...sampling import Sampler
    from ..drafter import Drafter


def build_drafter(config: RuntimeConfig, runner, sampler: Sampler, requested: SpecAlgorithm) -> Drafter:
    """An n-gram drafter over ``config``'s window, on the target ``runner``'s device."""
    from .drafter import NgramDrafter

    spec = config.speculative
    return NgramDrafter(spec.ngram_min, spec.ngram_max, device=runner.device)
