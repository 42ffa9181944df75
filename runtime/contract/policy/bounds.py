"""The numeric bounds of the policy: the one statement of each field's minimum and maximum
(the operator's spec model takes them from here; a test holds the CRD's equal), the limits
behind them and the largest tree a draft can grow."""

from __future__ import annotations

MAX_DRAFT_LORAS = 64
"""The most draft adapter slots (``speculative.draft_max_loras``): each holds A and B at the
draft rank for every draft module, beside the target's slots."""

LARGE_RANK = 256
MAX_LORA_RANK = 512
"""The largest ``lora.max_rank``: every GPU slot reserves A and B at this rank for every
target module (a rank-512 pool of an 8B model already holds ~0.3 GiB per slot)."""
MAX_NUM_STEPS = 32
"""The most draft forward passes per step: accept lengths fall with depth (a draft rarely
stays right 32 tokens in a row) while each step costs a forward."""
MAX_TOP_K = 16
"""The widest tree branching (a level scores top_k² candidates)."""
MAX_NUM_DRAFT_TOKENS = 256
"""The most tokens verified per request and step (a chain verifies num_steps + 1 ≤ 33; a
tree at most this many nodes): every decode request verifies that many rows."""
# Tree drafts verify num_draft_tokens rows per request, so from about this many requests a
# tree's wider verify costs more than its extra accepted drafts (docs/speculative.md).
TREE_COSTLY_BATCH = 8

MINIMUM: dict[str, int] = {
    "model.context_length": 1,
    "parallel.tensor_parallel_size": 1,
    "scheduler.max_running_requests": 1,
    "scheduler.max_total_tokens": 1,
    "scheduler.chunked_prefill_size": 1,
    "scheduler.max_prefill_tokens": 1,
    "scheduler.max_admission_defer_steps": 0,
    "cuda_graph.max_bs": 1,
    "cuda_graph.max_prefill_tokens": 0,
    "cuda_graph.warmup_context": 0,
    "lora.max_loras_per_batch": 1,
    "lora.max_loaded_loras": 1,
    "lora.max_rank": 1,
    "speculative.num_steps": 1,
    "speculative.top_k": 1,
    "speculative.num_draft_tokens": 2,
    "speculative.ngram_min": 1,
    "speculative.disable_batch_size": 0,
    "speculative.tree_max_batch_size": 0,
    "speculative.draft_max_loras": 0,
    "speculative.draft_max_lora_rank": 1,
}
"""The smallest value of each numeric field the policy bounds: the one statement of these
bounds (the operator's spec model takes them from here; a test holds the CRD's equal)."""
MAXIMUM: dict[str, int] = {
    "lora.max_rank": MAX_LORA_RANK,
    "speculative.num_steps": MAX_NUM_STEPS,
    "speculative.top_k": MAX_TOP_K,
    "speculative.num_draft_tokens": MAX_NUM_DRAFT_TOKENS,
    "speculative.draft_max_loras": MAX_DRAFT_LORAS,
    "speculative.draft_max_lora_rank": MAX_LORA_RANK,
}
"""The largest value of each numeric field the policy bounds above (as :data:`MINIMUM`)."""


def tree_draft_tokens_limit(top_k: int, num_steps: int) -> int:
    """The most tokens a tree of ``top_k`` over ``num_steps`` can verify per request: its
    root plus ``top_k`` first-level nodes plus ``top_k²`` candidates per further step."""
    return 1 + top_k + (num_steps - 1) * top_k**2


def pinned_slot_limit(max_loras_per_batch: int) -> int:
    """The most adapters a pool of ``max_loras_per_batch`` GPU slots can pin: all slots but
    one, which stays free for unpinned adapters (the runtime's pool refuses the pin that
    would take the last slot with 503 ``adapter_capacity``)."""
    return max(max_loras_per_batch - 1, 0)
