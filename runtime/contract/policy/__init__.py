"""The one compatibility policy: is a :class:`RuntimeConfig` servable, and as what?

Pure functions over the typed configuration, no I/O. The operator's admission webhook
calls them on a LoRAServe translated to a ``RuntimeConfig``; the runtime calls the same
functions at start-up. Each finding names a configuration field path
(``lora.max_rank``); callers render it under their own names (the webhook as
``spec.lora.maxRank``) with ``render(namer)``. Texts refer to other fields as
``{lora.max_rank}`` so that they are renamed too.

Every violation is collected (never stop at the first), with a reason, a fix and a kind:
``incompatible`` (no runtime will run it) or ``unavailable`` (this runtime image does not
implement it yet; see ``loraserve.runtime.contract.capabilities``).

The modules, one concern each:

- ``findings``: violations, warnings, the report and its error;
- ``bounds``: each numeric field's minimum and maximum;
- ``fields``: the generic field rules (a bound, a value from a list, a module list);
- ``algorithms``: how a speculative algorithm resolves, and which grow trees;
- ``basic``: enum fields, the model, placement, scheduler and server fields;
- ``cuda_graphs``: CUDA graph and GPU-only rules;
- ``lora``: the adapter pool and what LoRA cannot run beside;
- ``speculative``: the draft model and the draft's shape;
- ``availability``: what this runtime image does not implement yet;
- ``draft_adapters``: draft adapter pools and an adapter's draft adapter;
- ``config_warnings``: the warnings of a configuration;
- ``sources``: where weights come from (pinned revisions, volume paths, hosts);
- ``declarations``: what an adapter declares;
- ``config_check`` and ``adapter``: the two checks, ``check_config`` and ``check_adapter``
  (and ``check_speculation``, the speculative rules alone, for the draft factory).
"""

from __future__ import annotations

from .adapter import check_adapter
from .algorithms import (
    FROZEN_KV_MTP_DRAFT_ARCHITECTURES,
    TREE_ALGORITHMS,
    effective_config,
    resolve_algorithm,
    resolve_speculative,
)
from .availability import adaptive_unavailable
from .bounds import (
    LARGE_RANK,
    MAX_DRAFT_LORAS,
    MAX_LORA_RANK,
    MAX_NUM_DRAFT_TOKENS,
    MAX_NUM_STEPS,
    MAX_TOP_K,
    MAXIMUM,
    MINIMUM,
    TREE_COSTLY_BATCH,
    pinned_slot_limit,
    tree_draft_tokens_limit,
)
from .config_check import check_config, check_speculation
from .declarations import AdapterDeclaration, DraftAdapterDeclaration
from .draft_adapters import (
    DRAFT_ADAPTER_ALGORITHMS,
    DRAFT_ADAPTER_MODULE_NAMES,
    DRAFT_LORA_MODULES,
    HEAD_DRAFT_LORA_MODULES,
    NO_DRAFT_MODEL_ALGORITHMS,
    draft_lora_modules,
)
from .findings import Kind, Namer, PolicyError, PolicyWarning, Report, Violation
from .lora import EMBEDDING_MODULES, LORA_SPEC_ALGORITHMS
from .sources import check_source_revision, host_allowed, source_path_problem

__all__ = [
    "DRAFT_ADAPTER_ALGORITHMS",
    "DRAFT_ADAPTER_MODULE_NAMES",
    "DRAFT_LORA_MODULES",
    "EMBEDDING_MODULES",
    "FROZEN_KV_MTP_DRAFT_ARCHITECTURES",
    "HEAD_DRAFT_LORA_MODULES",
    "LARGE_RANK",
    "LORA_SPEC_ALGORITHMS",
    "MAXIMUM",
    "MAX_DRAFT_LORAS",
    "MAX_LORA_RANK",
    "MAX_NUM_DRAFT_TOKENS",
    "MAX_NUM_STEPS",
    "MAX_TOP_K",
    "MINIMUM",
    "NO_DRAFT_MODEL_ALGORITHMS",
    "TREE_ALGORITHMS",
    "TREE_COSTLY_BATCH",
    "AdapterDeclaration",
    "DraftAdapterDeclaration",
    "Kind",
    "Namer",
    "PolicyError",
    "PolicyWarning",
    "Report",
    "Violation",
    "adaptive_unavailable",
    "check_adapter",
    "check_config",
    "check_source_revision",
    "check_speculation",
    "draft_lora_modules",
    "effective_config",
    "host_allowed",
    "pinned_slot_limit",
    "resolve_algorithm",
    "resolve_speculative",
    "source_path_problem",
    "tree_draft_tokens_limit",
]
