"""What this runtime image does not implement yet (``unavailable`` findings): an algorithm,
a tree for it, trees under tensor parallelism, dynamic ragged verify, adaptive speculation;
judged against the image's :class:`Capabilities`. The draft factory judges by these too
(``check_speculation``): one rule, every caller."""

from __future__ import annotations

from ..algorithms import ALGORITHMS
from ..capabilities import Capabilities
from ..config import RaggedVerify, RuntimeConfig, SpecAlgorithm, SpeculativeConfig
from .algorithms import TREE_ALGORITHMS, named, order
from .findings import Kind, Violation


def availability(
    config: RuntimeConfig, effective: RuntimeConfig, note: str | None, caps: Capabilities
) -> list[Violation]:
    """The effective configuration against what this image implements."""
    spec = config.speculative
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out: list[Violation] = []
    if not caps.implements(algorithm):
        implemented = ", ".join(a.value for a in sorted(caps.algorithms, key=order)) or "none"
        out.append(
            Violation(
                "algorithm-unavailable",
                "speculative.algorithm",
                f"speculative algorithm {named(algorithm, note)}; this image implements {implemented}"
                + (f" (it lacks {lacks})" if (lacks := ALGORITHMS[algorithm].unimplemented_reason) else ""),
                "choose an implemented algorithm, or upgrade the runtime image",
                kind=Kind.UNAVAILABLE,
            )
        )
    if algorithm in TREE_ALGORITHMS and spec.top_k > 1 and algorithm not in caps.tree_algorithms:
        trees = ", ".join(a.value for a in sorted(caps.tree_algorithms, key=order)) or "no algorithm"
        out.append(
            Violation(
                "tree-unavailable",
                "speculative.top_k",
                f"tree drafts ({{speculative.top_k}} > 1) with {named(algorithm, note)}; this image grows "
                f"trees for {trees}",
                "set {speculative.top_k} to 1 (a chain draft)",
                kind=Kind.UNAVAILABLE,
            )
        )
    if algorithm is not SpecAlgorithm.NONE and spec.top_k > 1 and config.parallel.tensor_parallel_size > 1:
        out.append(
            Violation(
                "tree-tensor-parallel",
                "speculative.top_k",
                "tree drafts ({speculative.top_k} > 1) with tensor parallelism",
                "set {speculative.top_k} to 1 (a chain draft), or {parallel.tensor_parallel_size} to 1",
                related=("parallel.tensor_parallel_size",),
                kind=Kind.UNAVAILABLE,
            )
        )
    if (adaptive := adaptive_unavailable(spec, algorithm, caps)) is not None:
        out.append(adaptive)
    if (
        algorithm is not SpecAlgorithm.NONE
        and spec.ragged_verify is RaggedVerify.DYNAMIC
        and not caps.dynamic_ragged_verify
    ):
        out.append(
            Violation(
                "ragged-unavailable",
                "speculative.ragged_verify",
                "dynamic ragged verify",
                "set {speculative.ragged_verify} to static",
                kind=Kind.UNAVAILABLE,
            )
        )
    return out


def adaptive_unavailable(
    spec: SpeculativeConfig, algorithm: SpecAlgorithm, caps: Capabilities
) -> Violation | None:
    """Adaptive speculation (``algorithm`` is the effective one) where this image keeps the
    verify width fixed; None when it is off, speculation is off, or the image varies it."""
    if not spec.adaptive or algorithm is SpecAlgorithm.NONE or caps.adaptive_speculation:
        return None
    return Violation(
        "adaptive-unavailable",
        "speculative.adaptive",
        "adaptive speculation: the verify width stays {speculative.num_draft_tokens}, which keeps the "
        "batch's LoRA segment layout and captured CUDA graphs fixed",
        "set {speculative.adaptive} to false",
        kind=Kind.UNAVAILABLE,
    )
