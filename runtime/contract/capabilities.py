"""What this runtime image implements, as opposed to what is merely compatible.

The compatibility policy (``loraserve.runtime.contract.policy``) reports a configuration this image
cannot run yet as *unavailable*, distinct from *incompatible* (which no image will ever
run). Enabling a feature in the runtime is a one-line change here, an algorithm one in
``loraserve.runtime.contract.algorithms`` (its ``implemented`` trait): both the admission
webhook and the runtime's start-up check follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .algorithms import ALGORITHMS, SpecAlgorithm, having

IMPLEMENTED_ALGORITHMS: dict[SpecAlgorithm, bool] = {
    algorithm: traits.implemented for algorithm, traits in ALGORITHMS.items() if traits.resolves_to is None
}
"""Speculative algorithms this image runs (``AlgorithmTraits.implemented``). NEXTN has no
entry: it is judged as the algorithm it resolves to (EAGLE, or FROZEN_KV_MTP with a Gemma-4
assistant draft)."""


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
    adaptive_speculation: bool = False
    """The decoder varies the verify width at run time (``speculative.adaptive``); until
    then every adaptive serve is refused, by the webhook and at start-up alike."""

    def implements(self, algorithm: SpecAlgorithm) -> bool:
        return algorithm in self.algorithms


TREE_DRAFTS: frozenset[SpecAlgorithm] = having("trees_implemented")
"""Algorithms this image grows draft trees for (greedy requests; sampled ones verify a chain)."""

CAPABILITIES = Capabilities(
    algorithms=frozenset(
        algorithm for algorithm, implemented in IMPLEMENTED_ALGORITHMS.items() if implemented
    ),
    tree_algorithms=TREE_DRAFTS,
)
"""This image's capabilities; the default of every policy function."""


# --- Triton ---------------------------------------------------------------------------

TRITON_OLDEST: tuple[int, int] = (3, 6)
"""The oldest Triton the CUDA kernels (LoRA shrink/expand, paged attention) are validated
on: the GPU tests and benchmarks run on Triton 3.6 (with torch 2.11), the CPU tests on
3.9. pyproject's ``triton`` extra starts here and the image's base ships it
(tests/packaging/test_versions.py holds the three together)."""

BASE_IMAGE_HINT = "pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime"
"""The image's base (Dockerfile ``BASE_IMAGE``): torch 2.11 with Triton 3.6."""


def version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"3.6.0+git1a2b"`` -> ``(3, 6, 0)``."""
    parts = []
    for piece in version.strip().split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):
            break
    return tuple(parts)


def installed_triton_version() -> str | None:
    """Triton's version from the package metadata (``triton``, or the ``pytorch-triton``
    of nightly torch builds), without importing it; None where it is not installed."""
    import importlib.metadata

    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def triton_kernels_used(cfg, cuda_available: bool) -> list[str]:
    """The Triton kernels a start with ``cfg`` would run compiled for CUDA (empty: none):
    ``auto`` takes them on CUDA (LoRA and attention alike), never on the CPU."""
    on_cuda = cfg.device == "cuda" or (cfg.device == "auto" and cuda_available)
    if not on_cuda:
        return []
    used = []
    if cfg.lora.enabled and cfg.lora.backend in ("auto", "triton"):
        used.append(f"LoRA (--lora-backend {cfg.lora.backend})")
    if cfg.attention_backend in ("auto", "triton"):
        used.append(f"paged attention (--attention-backend {cfg.attention_backend})")
    return used


def triton_version_problem(version: str | None, used: Sequence[str]) -> str | None:
    """Why a start that runs the Triton kernels ``used`` must be refused with Triton
    ``version`` installed, or None: only a Triton older than :data:`TRITON_OLDEST` is
    refused, and only where a Triton kernel would run (none: any version, or none at all,
    is fine)."""
    if not used or version is None:
        return None
    parsed = version_tuple(version)
    if not parsed or parsed >= TRITON_OLDEST:  # (a version that names no release cannot be judged)
        return None
    oldest = ".".join(map(str, TRITON_OLDEST))
    return (
        f"triton {version} is installed, but the oldest Triton the {' and '.join(used)} kernels were run and "
        f"tested on is {oldest}: install triton>={oldest} (pip install 'loraserve[triton]', or build the image "
        f"on its base, {BASE_IMAGE_HINT}), or start without the Triton kernels (--lora-backend torch "
        f"--attention-backend sdpa)"
    )


def check_triton(cfg) -> str | None:
    """:func:`triton_version_problem` for this machine: the installed Triton, and CUDA as torch sees it."""
    version = installed_triton_version()
    if version is None:
        return None
    import torch

    return triton_version_problem(version, triton_kernels_used(cfg, torch.cuda.is_available()))
