"""Builds the drafter and the speculative decoder for a configuration.

The configuration is judged by the policy's speculative rules first
(:func:`~.draft_config.check_speculative`); the effective algorithm's entry in
:data:`~..contract.algorithms.ALGORITHMS` names the package that builds its drafter
(``build_drafter(config, runner, sampler, requested)``). The draft is built next to an
already-built target runner: it follows the target's device, dtype, context length and KV
capacity. Settings that cannot run raise :class:`~.draft_config.SpeculativeConfigError`
naming the field and the fix.
"""

from __future__ import annotations

import importlib

from ..contract.config import RuntimeConfig, SpecAlgorithm
from ..sampling import Sampler
from .decoder import SpeculativeDecoder
from .draft_config import SpeculativeConfigError, check_speculative
from .drafter import Drafter


def build_drafter(config: RuntimeConfig, runner, sampler: Sampler) -> tuple[Drafter, SpecAlgorithm]:
    """The drafter for ``config.speculative`` next to the target ``runner``, and the algorithm it runs."""
    effective = check_speculative(config)  # NEXTN as EAGLE, with its draft path
    requested = SpecAlgorithm(config.speculative.algorithm)
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    package = algorithm.traits.package
    if package is None:  # the policy refuses an unimplemented algorithm first
        raise SpeculativeConfigError("speculative.algorithm", f"{algorithm.value} has no drafter in this runtime")
    drafter = importlib.import_module(package).build_drafter(effective, runner, sampler, requested)
    return drafter, algorithm


def build_decoder(*, config: RuntimeConfig, runner, sampler: Sampler) -> SpeculativeDecoder:
    """The engine's entry point: a :class:`SpeculativeDecoder` for ``config``."""
    drafter, algorithm = build_drafter(config, runner, sampler)
    return SpeculativeDecoder(config, runner, sampler, drafter, algorithm=algorithm)
