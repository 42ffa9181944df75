"""CUDA graph and GPU-only rules: the graphs' batch, prefill and warm-up bounds, features that need a
GPU, and speculation that changes the verify width a graph was captured for."""

from __future__ import annotations

from ..capabilities import Capabilities
from ..config import RaggedVerify, RuntimeConfig, SpecAlgorithm
from .bounds import MINIMUM
from .cel import CelRule
from .fields import at_least
from .findings import Violation


def gpu_fields(config: RuntimeConfig) -> list[Violation]:
    """The CUDA graphs' bounds, and CUDA graphs or Triton attention asked of a CPU."""
    graphs = config.cuda_graph
    out: list[Violation] = []
    out += at_least("cuda_graph.max_bs", graphs.max_bs, "cuda-graph-bs")
    if graphs.max_prefill_tokens < MINIMUM["cuda_graph.max_prefill_tokens"]:
        out.append(
            Violation(
                "cuda-graph-prefill",
                "cuda_graph.max_prefill_tokens",
                f"must be at least 0, got {graphs.max_prefill_tokens}",
                "set {cuda_graph.max_prefill_tokens} to 0 (prefills run eagerly) or to the longest single "
                "prefill chunk to replay from CUDA graphs, such as 512",
            )
        )
    if graphs.warmup_context < MINIMUM["cuda_graph.warmup_context"]:
        out.append(
            Violation(
                "cuda-graph-warmup",
                "cuda_graph.warmup_context",
                f"must be at least 0, got {graphs.warmup_context}",
                "set {cuda_graph.warmup_context} to 0 (graphs are captured on first use) or to the longest "
                "context to capture at start-up, such as 1024",
            )
        )
    if graphs.enabled and config.device == "cpu":
        out.append(
            Violation(
                "cuda-graph-cpu",
                "cuda_graph.enabled",
                "CUDA graphs need a GPU and this configuration runs on CPU",
                "set {cuda_graph.enabled} to false, or run on a GPU",
                related=("device",),
            )
        )
    if config.attention_backend == "triton" and config.device == "cpu":
        out.append(
            Violation(
                "attention-triton-cpu",
                "attention_backend",
                "the paged Triton attention needs a GPU and this configuration runs on CPU",
                "set {attention_backend} to auto (SDPA on a CPU) or sdpa, or run on a GPU",
                related=("device",),
            )
        )
    return out


# On a LoRAServe's spec: spec.gpus 0 is the CPU device (the operator's translation).
CPU_CUDA_GRAPHS = CelRule(
    "!(self.gpus == 0 && self.runtime.cudaGraph.enabled)",
    "CUDA graphs need a GPU: set spec.gpus >= 1 or spec.runtime.cudaGraph.enabled: false",
    field_path=".runtime.cudaGraph.enabled",
    mirrors="cuda-graph-cpu",
)
CPU_TRITON_ATTENTION = CelRule(
    "!(self.gpus == 0 && self.runtime.attentionBackend == 'triton')",
    "The paged Triton attention needs a GPU: set spec.gpus >= 1 or spec.runtime.attentionBackend: auto",
    field_path=".runtime.attentionBackend",
    mirrors="attention-triton-cpu",
)


def graph_verify_width(config: RuntimeConfig, caps: Capabilities) -> list[Violation]:
    """CUDA graphs beside speculation whose verify width varies (dynamic ragged, adaptive).
    Each fix offers turning graphs off only where the image runs the varying width at all."""
    spec = config.speculative
    if not config.cuda_graph.enabled or SpecAlgorithm(spec.algorithm) is SpecAlgorithm.NONE:
        return []
    out: list[Violation] = []
    if spec.ragged_verify is RaggedVerify.DYNAMIC:
        out.append(
            Violation(
                "cuda-graph-ragged",
                "cuda_graph.enabled",
                "CUDA graphs are captured for one verify width, and dynamic ragged verify gives each request its own",
                _either("{speculative.ragged_verify} to static", caps.dynamic_ragged_verify),
                related=("speculative.ragged_verify",),
            )
        )
    if spec.adaptive:
        out.append(
            Violation(
                "cuda-graph-adaptive",
                "cuda_graph.enabled",
                "CUDA graphs are captured for one verify width, and adaptive speculation changes it at run time",
                _either("{speculative.adaptive} to false", caps.adaptive_speculation),
                related=("speculative.adaptive",),
            )
        )
    return out


def _either(keep_graphs: str, runs_without_graphs: bool) -> str:
    """The fix: ``keep_graphs``, or turning graphs off where that alone makes it run."""
    if runs_without_graphs:
        return f"set {{cuda_graph.enabled}} to false or {keep_graphs}"
    return f"set {keep_graphs}"
