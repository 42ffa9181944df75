"""What this runtime image implements, as opposed to what is merely compatible.

The compatibility policy (``loraserve.runtime.policy``) reports a configuration this image
cannot run yet as *unavailable*, distinct from *incompatible* (which no image will ever
run). Enabling an algorithm or a feature in the runtime is a one-line change here: flip
its entry, and both the admission webhook and the runtime's start-up check follow.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import SpecAlgorithm

IMPLEMENTED_ALGORITHMS: dict[SpecAlgorithm, bool] = {
    SpecAlgorithm.NONE: True,
    SpecAlgorithm.NGRAM: True,
    SpecAlgorithm.STANDALONE: True,
    SpecAlgorithm.EAGLE: True,
    SpecAlgorithm.EAGLE3: True,
    SpecAlgorithm.DFLASH: False,
    SpecAlgorithm.DSPARK: False,
    SpecAlgorithm.FROZEN_KV_MTP: False,
}
"""Speculative algorithms this image runs. NEXTN has no entry: it is judged as the
algorithm it resolves to (EAGLE, or FROZEN_KV_MTP with a Gemma-4 assistant draft)."""


@dataclass(frozen=True)
class Capabilities:
    """Feature flags of one runtime image (the policy takes them as an argument so tests
    can judge a configuration against any image)."""

    algorithms: frozenset[SpecAlgorithm]
    lora_graph_width_rebuild: bool = False
    """The runtime can rebuild LoRA graph metadata when the verify width changes at run
    time; until then adaptive speculation is refused with LoRA."""
    tree_algorithms: frozenset[SpecAlgorithm] = frozenset()
    """Algorithms whose drafts may be trees (``top_k > 1``) in this image; others draft chains."""
    dynamic_ragged_verify: bool = False
    """Per-request verify widths (``ragged_verify: dynamic``)."""

    def implements(self, algorithm: SpecAlgorithm) -> bool:
        return algorithm in self.algorithms


TREE_DRAFTS: frozenset[SpecAlgorithm] = frozenset({SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3})
"""Algorithms this image grows draft trees for (greedy requests; sampled ones verify a chain)."""

CAPABILITIES = Capabilities(
    algorithms=frozenset(
        algorithm for algorithm, implemented in IMPLEMENTED_ALGORITHMS.items() if implemented
    ),
    tree_algorithms=TREE_DRAFTS,
)
"""This image's capabilities; the default of every policy function."""
