"""Typed runtime configuration: the one description of a serving process.

Everything that decides how a runtime pod behaves lives here as plain dataclasses, so
that the compatibility policy (``loraserve.runtime.contract.policy``) can judge a configuration
without I/O, the operator can build one from a LoRAServe spec, and the CLI can build one
from flags. Field names are the policy's field paths (``speculative.algorithm``,
``lora.max_rank``...).

Dataclasses, not pydantic: the serving image must import this with nothing but torch's
own dependencies.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass, field


class SpecAlgorithm(enum.StrEnum):
    """Speculative-decoding algorithms a LoRAServe may name."""

    NONE = "NONE"
    NGRAM = "NGRAM"
    STANDALONE = "STANDALONE"
    EAGLE = "EAGLE"
    EAGLE3 = "EAGLE3"
    NEXTN = "NEXTN"
    DFLASH = "DFLASH"
    DSPARK = "DSPARK"
    FROZEN_KV_MTP = "FROZEN_KV_MTP"

    @property
    def is_eagle_family(self) -> bool:
        """Drafts that reuse the target's embeddings / lm_head."""
        return self in (SpecAlgorithm.EAGLE, SpecAlgorithm.EAGLE3, SpecAlgorithm.NEXTN)

    @property
    def needs_draft_model(self) -> bool:
        return self in (
            SpecAlgorithm.STANDALONE,
            SpecAlgorithm.EAGLE,
            SpecAlgorithm.EAGLE3,
            SpecAlgorithm.DFLASH,
            SpecAlgorithm.DSPARK,
        )


class RaggedVerify(enum.StrEnum):
    """How many tokens each request carries into target-verify."""

    STATIC = "static"  # every request verifies exactly num_draft_tokens tokens
    DYNAMIC = "dynamic"  # per-request widths (breaks the uniform-width LoRA segment layout)


LORA_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "embed_tokens",
    "lm_head",
)
"""Every module name an adapter may target in a Llama-family model."""

DEFAULT_LORA_MODULES: tuple[str, ...] = LORA_MODULES[:7]


@dataclass
class ModelConfig:
    """The base (target) model."""

    path: str = ""
    """Local directory holding config.json, safetensors weights and tokenizer files."""
    revision: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    context_length: int | None = None  # None: the model's max_position_embeddings
    served_name: str | None = None  # the `model` name clients use for the base model
    architecture: str | None = None  # e.g. LlamaForCausalLM; read from config.json when None


@dataclass
class SpeculativeConfig:
    """Speculative decoding: the draft proposes, the target verifies with each adapter."""

    algorithm: SpecAlgorithm = SpecAlgorithm.NONE
    draft_model_path: str | None = None
    draft_model_architecture: str | None = None  # e.g. Gemma4AssistantForCausalLM
    num_steps: int = 3
    top_k: int = 1  # 1 = chain draft
    num_draft_tokens: int = 4  # tokens per request in target-verify
    adaptive: bool = False  # vary num_steps at run time
    ragged_verify: RaggedVerify = RaggedVerify.STATIC
    draft_load_format: str = "auto"  # applies to the draft only
    # EAGLE family: a file of token ids (JSON list, safetensors or .pt tensor; relative paths
    # are files of the draft's directory). The draft predicts over those tokens only, through
    # those rows of the target's lm_head: a smaller LM head per draft step (FR-Spec).
    token_map: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    # A decode step of at least this many requests runs without drafting (one token each,
    # the drafter kept in sync); speculation resumes below it. 0: always speculate.
    disable_batch_size: int = 0
    # Tree drafts (top_k > 1): decode steps of more than this many requests verify chains
    # of num_steps drafts instead, where a tree's extra verify rows cost more than they
    # gain (bench/results/2026-12-04-spec-h200.md). 0: trees at every batch size.
    tree_max_batch_size: int = 0
    # Per batch-size bucket, draft only while drafting yields more tokens/s than plain
    # decoding, as measured on this serve's own steps (both kinds re-measured now and then).
    auto_disable: bool = False

    @property
    def enabled(self) -> bool:
        return self.algorithm is not SpecAlgorithm.NONE


@dataclass
class LoRAConfig:
    """The LoRA adapter pool."""

    enabled: bool = True
    max_loras_per_batch: int = 8  # GPU slots
    max_loaded_loras: int = 32  # CPU cache
    max_rank: int = 64
    target_modules: tuple[str, ...] = DEFAULT_LORA_MODULES
    backend: str = "auto"  # auto | triton | torch
    overlap_loading: bool = False
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path, loaded at start-up
    pinned: tuple[str, ...] = ()
    # The serve's adapter catalog (a JSON file, read at start-up; the operator keeps the
    # pod's copy current over the admin API). A request for a catalogued adapter the pod
    # does not hold waits up to load_timeout_s while the pod loads it.
    catalog: str | None = None
    load_timeout_s: float = 60.0


@dataclass
class SchedulerConfig:
    """Continuous batching."""

    max_running_requests: int = 64
    max_total_tokens: int | None = None  # KV token budget; None: derived from free memory
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 8192
    # Decode steps admission may wait, under a backlog, to prefill several arrivals in one
    # extend instead of pausing every decode once per arrival (0: admit at once).
    max_admission_defer_steps: int = 8
    overlap_schedule: bool = False
    two_batch_overlap: bool = False
    kv_memory_fraction: float = 0.85


@dataclass
class CudaGraphConfig:
    enabled: bool = False
    max_bs: int = 64
    # Extend batches of one request with at most this many new tokens (a prompt, or one
    # chunk of it) replay graphs too: an eager prefill is bound by host time at small
    # batches. 0: every extend runs eagerly.
    max_prefill_tokens: int = 512


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    admin_token: str | None = None  # bearer token for the admin routes; None: open
    adapter_cache_dir: str = "/tmp/loraserve-adapters"
    max_body_bytes: int = 4 * 1024 * 1024
    # Plain-path and file:// adapter sources, start-up adapters and the model must resolve
    # (symlinks followed) inside these directories. Empty: not confined (a process run by
    # hand); the operator always passes the pod's model and adapter volumes and the cache.
    allowed_local_roots: tuple[str, ...] = ()
    # Hosts https/s3/hf adapter sources may reach (``*.example.com``: its subdomains),
    # redirects included. Empty: any host.
    remote_source_hosts: tuple[str, ...] = ()


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class RuntimeConfig:
    """The whole configuration of one runtime process."""

    model: ModelConfig = field(default_factory=ModelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"  # auto | cpu | cuda
    # Decode and target-verify attention: "sdpa" gathers each request's context for
    # scaled_dot_product_attention; "triton" reads the paged cache in place (CUDA only);
    # "auto" takes triton on CUDA when it is installed, else sdpa.
    attention_backend: str = "auto"
    seed: int = 0

    def copy(self) -> RuntimeConfig:
        """A deep copy: a draft's configuration must never alias the target's."""
        return copy.deepcopy(self)

    def to_dict(self) -> dict:
        """JSON-ready form (enums as their values)."""

        def plain(value):
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        return plain(dataclasses.asdict(self))
