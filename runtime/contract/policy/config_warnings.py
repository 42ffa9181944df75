"""The warnings of a serve's configuration: legal settings with a cost worth knowing, and
settings that are ignored where they stand."""

from __future__ import annotations

from ..config import RuntimeConfig, SpecAlgorithm
from .algorithms import TREE_ALGORITHMS, resolve_algorithm
from .bounds import LARGE_RANK, TREE_COSTLY_BATCH
from .draft_adapters import NO_DRAFT_MODEL_ALGORITHMS, no_draft_model
from .findings import PolicyWarning
from .lora import EMBEDDING_MODULES


def config_warnings(config: RuntimeConfig, effective: RuntimeConfig) -> list[PolicyWarning]:
    """Every warning of ``config``, whose effective form is ``effective``."""
    return [
        *_lora_costs(config, effective),
        *_ignored_drafting(config),
        *_batch_switches(config),
        *_runtime_costs(config),
    ]


def _lora_costs(config: RuntimeConfig, effective: RuntimeConfig) -> list[PolicyWarning]:
    """Adapters on the embeddings beside a draft that shares the base ones (EAGLE family, DFLASH),
    and a large rank in every slot."""
    algorithm = SpecAlgorithm(effective.speculative.algorithm)
    out: list[PolicyWarning] = []
    if config.lora.enabled and algorithm.shares_target_embeddings:
        touched = [m for m in EMBEDDING_MODULES if m in config.lora.target_modules]
        if touched:
            out.append(
                PolicyWarning(
                    "eagle-embeddings",
                    "lora.target_modules",
                    f"adapters may change {' and '.join(touched)}, but the shared {algorithm.value} draft uses the "
                    "base model's; the accept rate drops for such adapters (output is unaffected)",
                )
            )
    if config.lora.enabled and config.lora.max_rank > LARGE_RANK:
        out.append(
            PolicyWarning(
                "large-rank",
                "lora.max_rank",
                f"max rank {config.lora.max_rank} reserves GPU memory for that rank in every one of the "
                f"{config.lora.max_loras_per_batch} slots, whatever the adapters' own ranks",
            )
        )
    return out


def _ignored_drafting(config: RuntimeConfig) -> list[PolicyWarning]:
    """A draft model, draft adapter pool, token map or adaptive switch the serve does not use."""
    spec = config.speculative
    requested = SpecAlgorithm(spec.algorithm)
    out: list[PolicyWarning] = []
    if requested in NO_DRAFT_MODEL_ALGORITHMS and spec.draft_model_path:
        out.append(
            PolicyWarning(
                "draft-ignored",
                "speculative.draft_model_path",
                f"{requested.value} uses no draft model; it is ignored",
            )
        )
    if spec.draft_max_loras > 0 and requested in NO_DRAFT_MODEL_ALGORITHMS:
        out.append(
            PolicyWarning(
                "draft-lora-ignored",
                "speculative.draft_max_loras",
                no_draft_model(requested) + "; the draft adapter pool is ignored",
            )
        )
    elif spec.draft_max_loras > 0 and not config.lora.enabled:
        out.append(
            PolicyWarning(
                "draft-lora-ignored",
                "speculative.draft_max_loras",
                "draft adapters come with adapters, and {lora.enabled} is false; the draft adapter pool is ignored",
            )
        )
    if requested is SpecAlgorithm.NONE and spec.token_map:
        out.append(
            PolicyWarning(
                "token-map-ignored", "speculative.token_map", "ignored without speculative decoding"
            )
        )
    if requested is SpecAlgorithm.NONE and spec.adaptive:
        out.append(
            PolicyWarning("adaptive-ignored", "speculative.adaptive", "ignored without speculative decoding")
        )
    return out


def _batch_switches(config: RuntimeConfig) -> list[PolicyWarning]:
    """The batch sizes that switch speculation off or trees to chains: unreachable, costly or unused."""
    spec = config.speculative
    requested = SpecAlgorithm(spec.algorithm)
    out: list[PolicyWarning] = []
    if (
        requested is not SpecAlgorithm.NONE
        and spec.disable_batch_size > config.scheduler.max_running_requests
    ):
        out.append(
            PolicyWarning(
                "disable-batch-size-unreachable",
                "speculative.disable_batch_size",
                f"{spec.disable_batch_size} is above {{scheduler.max_running_requests}} "
                f"({config.scheduler.max_running_requests}): no step is that large, so every step drafts",
            )
        )
    tree_batches = spec.tree_max_batch_size or config.scheduler.max_running_requests
    grows_trees = resolve_algorithm(config)[0] in TREE_ALGORITHMS  # a tree of another is refused instead
    if grows_trees and spec.top_k > 1 and tree_batches >= TREE_COSTLY_BATCH:
        out.append(
            PolicyWarning(
                "tree-large-batches",
                "speculative.tree_max_batch_size",
                f"tree drafts verify {{speculative.num_draft_tokens}} ({spec.num_draft_tokens}) rows per request in "
                f"steps of up to {tree_batches} requests; from {TREE_COSTLY_BATCH} requests on a chain was faster "
                "in the benchmark: set {speculative.tree_max_batch_size} to the batch size where trees stop paying",
            )
        )
    if requested is not SpecAlgorithm.NONE and spec.tree_max_batch_size and spec.top_k == 1:
        out.append(
            PolicyWarning(
                "tree-batch-size-ignored",
                "speculative.tree_max_batch_size",
                "only tree drafts ({speculative.top_k} > 1) switch to chains by batch size; with top_k 1 it is ignored",
            )
        )
    if requested is SpecAlgorithm.NONE and (spec.disable_batch_size or spec.auto_disable):
        field = "speculative.auto_disable" if spec.auto_disable else "speculative.disable_batch_size"
        out.append(PolicyWarning("spec-switch-ignored", field, "ignored without speculative decoding"))
    return out


def _runtime_costs(config: RuntimeConfig) -> list[PolicyWarning]:
    """Overlapped loading without LoRA, SDPA attention on a GPU, and batches larger than the graphs."""
    out: list[PolicyWarning] = []
    if not config.lora.enabled and config.lora.overlap_loading:
        out.append(
            PolicyWarning("overlap-loading-ignored", "lora.overlap_loading", "ignored with LoRA disabled")
        )
    if config.attention_backend == "sdpa" and config.device == "cuda":
        out.append(
            PolicyWarning(
                "attention-sdpa-gpu",
                "attention_backend",
                "sdpa gathers each request's whole context into a padded block for every layer; on an H200 the "
                "paged Triton kernel decoded 1.2x (1 request) to 3.4x (64) faster at a 512-token context and "
                "2.6-4.0x at 4096: set {attention_backend} to auto",
            )
        )
    if config.cuda_graph.enabled and config.cuda_graph.max_bs < config.scheduler.max_running_requests:
        out.append(
            PolicyWarning(
                "cuda-graph-partial",
                "cuda_graph.max_bs",
                f"batches above {config.cuda_graph.max_bs} requests run without CUDA graphs "
                f"({{scheduler.max_running_requests}} is {config.scheduler.max_running_requests})",
            )
        )
    return out
