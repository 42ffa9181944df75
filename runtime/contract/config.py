"""Typed runtime configuration: the one description of a serving process.

Everything that decides how a runtime pod behaves lives here as plain dataclasses, so
that the compatibility policy (``loraserve.runtime.contract.policy``) can judge a configuration
without I/O, the operator can build one from a LoRAServe spec, and the CLI can build one
from flags. Field names are the policy's field paths (``speculative.algorithm``,
``lora.max_rank``...).

Each field is declared once, with :func:`setting`: its default, its command-line flag and
its help text (the field's documentation). :mod:`.flags` derives both directions from
these declarations: the runtime's argument parser (argv -> config) and the operator's
container arguments (config -> argv).

How to add a setting
--------------------
1. The operator's spec model: the field in ``loraserve.operator.specs``, declared as
   ``name: type = sets("<section>.<field>")``. Its default then comes from here and its
   bounds from the policy (``MINIMUM`` / ``MAXIMUM``; pass others, such as an API-only
   ``le=``, as keywords), its docstring is its description; ``make crds`` writes it into
   the CRDs (``crds/`` and the chart's copy), and ``loraserve.operator.translate`` copies
   it into the configuration and names it in messages with no code of its own.
2. The config field: ``name: type = setting(default, "--flag-name", "help text")`` in its
   section below; ``gated=True`` when the flag matters only while the section is enabled.
   A bound the runtime must enforce goes in the policy's ``MINIMUM`` / ``MAXIMUM``.

Nothing else: the runtime's flag, its parsing, the operator's container argv and
``--help`` all follow from the field. (A new field changes every pod's configuration hash,
and a flag written by default every pod's argv: existing pods roll once on the upgrade.) ``tests/crds/test_settings_agree.py`` proves the two
agree (every runtime field of the CRD reaches the runtime's parsed configuration; every
field has a flag that round-trips), ``tests/crds/test_generated.py`` that the committed
CRDs are the generated ones. A rule that spans fields goes in ``.policy``, once:
the webhook and the runtime's start-up both call it.

Dataclasses, not pydantic: the serving image must import this with nothing but torch's
own dependencies, and the operator's image imports it without torch.
"""

# setting(), not_a_flag() and section() return dataclasses.field(...): field specifiers, not defaults.
# ruff: noqa: RUF009

from __future__ import annotations

import copy
import dataclasses
import enum
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .algorithms import SpecAlgorithm, chain_verify


class RaggedVerify(enum.StrEnum):
    """How many tokens each request carries into target-verify."""

    STATIC = "static"  # every request verifies exactly num_draft_tokens tokens
    DYNAMIC = "dynamic"  # per-request widths (breaks the uniform-width LoRA segment layout)


DENSE_LORA_MODULES: tuple[str, ...] = (
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
"""The modules of a Llama-family decoder an adapter may target: one adapter-pool slot each. On a
mixture-of-experts layer gate_proj / up_proj / down_proj are the experts' (Qwen3-MoE's names)."""

MOE_LORA_MODULES: dict[str, tuple[str, ...]] = {
    "gate": (),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "w1": ("gate_proj",),
    "w3": ("up_proj",),
    "w2": ("down_proj",),
    "shared_expert_gate": (),
}
"""A mixture-of-experts model's router and expert names, as peft configs write them -> the pool
slots that serve them: ``gate`` is the router (every MoE layer's router always has its slot, so
it adds none), ``gate_up_proj`` the experts' fused gate and up parameter (peft
``target_parameters``), ``w1`` / ``w3`` / ``w2`` Mixtral's per-expert gate, up and down,
``shared_expert_gate`` Qwen2-MoE's gate of its shared expert (always slotted, as the router is;
the shared expert's own gate_proj / up_proj / down_proj are served by those slots)."""

FUSED_LORA_MODULES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
"""A dense model's fused projections as peft configs name them (Phi-3's) -> the pool slots that
serve them; Phi-3's fused ``gate_up_proj`` is served as the experts' one (:data:`MOE_LORA_MODULES`)."""

FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {**FUSED_LORA_MODULES, "gate_up_proj": MOE_LORA_MODULES["gate_up_proj"]}
"""A fused projection (Phi-3's checkpoint tensors and its adapters' modules) -> its parts, in
the order their rows are stacked."""

LORA_MODULES: tuple[str, ...] = (*DENSE_LORA_MODULES, *MOE_LORA_MODULES, *FUSED_LORA_MODULES)
"""Every name ``lora.target_modules`` and an adapter's declared modules accept (the CRD's enum).
Which of them a model has depends on its family (``policy.families.FAMILY_LORA_MODULES``);
:func:`pool_modules` turns a list into the adapter pool's slots."""

DEFAULT_LORA_MODULES: tuple[str, ...] = DENSE_LORA_MODULES[:7]


def pool_modules(names: Sequence[str]) -> tuple[str, ...]:
    """The adapter pool's slots for the module ``names`` (``lora.target_modules``): dense names as
    they are, mixture-of-experts and fused names as the slots that serve them, in
    :data:`DENSE_LORA_MODULES` order."""
    wanted: set[str] = set()
    for name in names:
        wanted.update(MOE_LORA_MODULES.get(name, FUSED_LORA_MODULES.get(name, (name,))))
    return tuple(m for m in DENSE_LORA_MODULES if m in wanted)

DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")
LORA_BACKENDS = ("auto", "triton", "torch")
DRAFT_LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
MAX_LOAD_TIMEOUT_S = 3600
"""The longest ``lora.load_timeout_s`` (an hour: a request waiting longer has been abandoned)."""


def chain_draft_tokens(num_steps: int) -> int:
    """The verify width of a chain draft: the last committed token plus one per draft step
    (the policy's chain rule; :func:`default_draft_tokens` for chains)."""
    return num_steps + 1


def default_draft_tokens(spec: Any) -> int | None:
    """``speculative.num_draft_tokens`` when it is not given (the flag, the webhook's
    defaulting, the operator's translation), from ``spec``'s ``algorithm`` and ``num_steps``.

    A chain verifies its drafts plus one: :func:`chain_draft_tokens`. A DFLASH block is the
    draft checkpoint's ``block_size``, as the reference engine defaults it; only the
    runtime's start-up can read the checkpoint, so until then the width is None (no flag on
    the pod's command line) and start-up fills it in (``runtime.cli``; a checkpoint that
    states no block gets the reference's default, ``speculative.dflash.format.UNSTATED_BLOCK``).
    """
    if not chain_verify(spec.algorithm):
        return None
    return chain_draft_tokens(spec.num_steps)


# --------------------------------------------------------------------------- declaring fields


class FlagError(ValueError):
    """A flag value that cannot become a configuration; the message names the flag."""


@dataclass(frozen=True)
class Flag:
    """How one configuration field appears on the runtime's command line.

    The value's shape (a switch, a number, a list...) follows from the field's type; the
    hooks cover what the type cannot say.
    """

    name: str
    """The flag, e.g. ``--num-draft-tokens``."""
    help: str
    """The field's documentation; ``--help`` prints it."""
    gated: bool = False
    """Written into argv only while the section's ``enabled`` holds (a disabled feature's
    knobs stay off the pod's command line)."""
    choices: tuple[str, ...] | None = None
    upper: bool = False
    """Values are upper-cased before the choices are checked (``ngram`` is NGRAM)."""
    metavar: str | None = None
    required: bool = False
    parse: Callable[[Any], Any] | None = None
    """The parsed flag value -> the field value; raises :class:`FlagError` naming the flag."""
    render: Callable[[Any], str] | None = None
    """The field value -> its argv word, where ``str`` is not the form the runtime reads back."""
    derive: Callable[[Any], Any] | None = None
    """The value when the flag is absent, from the rest of its section (the flag's default is None)."""


FLAG = "loraserve.flag"
"""Field metadata key of a field's :class:`Flag`."""
NO_FLAG = "loraserve.no_flag"
"""Field metadata key of a field that is not a flag: the reason."""
GROUP = "loraserve.group"
"""Field metadata key of a section's ``--help`` group."""


def setting(default: Any = dataclasses.MISSING, flag: str = "", help: str = "", **options: Any) -> Any:
    """A configuration field with its flag; ``default`` may be a zero-argument factory
    through ``factory=`` (mutable defaults)."""
    factory = options.pop("factory", dataclasses.MISSING)
    metadata = {FLAG: Flag(flag, help, **options)}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def seconds_setting(default: float, flag: str, help: str, **options: Any) -> Any:
    """A time bound in seconds: positive, at most an hour, written back as ``%g``."""
    return setting(default, flag, help, metavar="SECONDS", parse=_positive_seconds(flag), render=_seconds, **options)


def not_a_flag(default: Any, why: str) -> Any:
    """A configuration field with no flag of its own; ``why`` says where it comes from."""
    return field(default=default, metadata={NO_FLAG: why})


def section(factory: Callable[[], Any], group: str) -> Any:
    """A section of :class:`RuntimeConfig`, shown under ``group`` in ``--help``."""
    return field(default_factory=factory, metadata={GROUP: group})


# ----------------------------------------------------------------------- flag value conversions


def _modules(values: Sequence[str]) -> tuple[str, ...]:
    # 'all': every slot, which serves every family's modules (experts and router included).
    return DENSE_LORA_MODULES if list(values) == ["all"] else tuple(values)


def _adapter_pairs(values: Sequence[str]) -> dict[str, str]:
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise FlagError(f"--lora {value!r}: use --lora NAME=DIR")
        name = name.strip()
        if name in adapters:
            raise FlagError(f"--lora {name!r} is given twice: each adapter name once")
        adapters[name] = path.strip()
    return adapters


def _positive_seconds(flag: str) -> Callable[[float], float]:
    """A parser for a time bound in seconds: positive and at most an hour."""

    def parse(value: float) -> float:
        if not value > 0 or value > MAX_LOAD_TIMEOUT_S:
            raise FlagError(f"{flag} {value:g}: give seconds in (0, {MAX_LOAD_TIMEOUT_S}]")
        return value

    return parse


def _non_negative(flag: str) -> Callable[[int], int]:
    """A parser for a count where 0 means "derived" (see the field's help)."""

    def parse(value: int) -> int:
        if value < 0:
            raise FlagError(f"{flag} {value}: give 0 (derived) or a positive number")
        return value

    return parse


def _seconds(value: float) -> str:
    return f"{value:g}"


def _absolute_dirs(values: Sequence[str]) -> tuple[str, ...]:
    for value in values:
        if not os.path.isabs(value):
            raise FlagError(f"--allowed-local-roots {value}: give absolute directories")
    return tuple(values)


def _hosts(values: Sequence[str]) -> tuple[str, ...]:
    # Commas separate too, so one environment variable can carry the list.
    return tuple(h.strip() for value in values for h in value.split(",") if h.strip())


# --------------------------------------------------------------------------- the sections

_NUM_STEPS = 3


@dataclass
class ModelConfig:
    """The base (target) model."""

    path: str = setting(
        "", "--model", "local directory with config.json, safetensors and tokenizer", required=True
    )
    revision: str | None = setting(None, "--revision", "recorded revision of the model files")
    dtype: str = setting("auto", "--dtype", "weights and activations dtype", choices=DTYPES)
    context_length: int | None = setting(
        None, "--context-length", "maximum tokens per sequence (default: the model's max positions)"
    )
    served_name: str | None = setting(
        None, "--served-model-name", "the `model` name clients use for the base (default: dir name)"
    )
    architecture: str | None = setting(
        None, "--architecture", "e.g. LlamaForCausalLM (default: config.json's architecture)"
    )


@dataclass
class SpeculativeConfig:
    """Speculative decoding: the draft proposes, the target verifies with each adapter."""

    algorithm: SpecAlgorithm = setting(
        SpecAlgorithm.NONE,
        "--speculative-algorithm",
        "the speculative-decoding algorithm (NONE: plain decoding)",
        upper=True,
    )
    draft_model_path: str | None = setting(
        None, "--draft-model", "local directory of the draft model", gated=True
    )
    draft_model_architecture: str | None = setting(
        None,
        "--draft-model-architecture",
        "e.g. Gemma4AssistantForCausalLM (default: the draft's config.json)",
        gated=True,
    )
    num_steps: int = setting(_NUM_STEPS, "--num-steps", "draft forward passes per step", gated=True)
    top_k: int = setting(1, "--top-k", "draft tree width (1: chain)", gated=True)
    # None only before start-up has read a DFLASH draft's block (default_draft_tokens).
    num_draft_tokens: int | None = setting(
        chain_draft_tokens(_NUM_STEPS),
        "--num-draft-tokens",
        "tokens per request in target-verify (default: num-steps + 1; DFLASH: the draft's block_size)",
        gated=True,
        derive=default_draft_tokens,
    )
    adaptive: bool = setting(False, "--adaptive-speculation", "vary num-steps at run time", gated=True)
    ragged_verify: RaggedVerify = setting(
        RaggedVerify.STATIC,
        "--ragged-verify",
        "static: every request verifies num-draft-tokens tokens; dynamic: per-request widths",
        gated=True,
    )
    draft_load_format: str = setting(
        "auto", "--draft-load-format", "weight format of the draft only", gated=True
    )
    token_map: str | None = setting(
        None,
        "--speculative-token-map",
        "EAGLE/EAGLE3: a .json/.safetensors/.pt list of token ids the draft predicts over, through "
        "those rows of the target's lm_head (relative: a file of the draft's directory)",
        gated=True,
    )
    ngram_min: int = setting(1, "--ngram-min", "NGRAM: shortest prompt match", gated=True)
    ngram_max: int = setting(4, "--ngram-max", "NGRAM: longest prompt match", gated=True)
    disable_batch_size: int = setting(
        0,
        "--speculative-disable-batch-size",
        "decode steps of at least this many requests skip drafting, one token each, the drafter "
        "kept in sync (0: always speculate)",
        gated=True,
    )
    tree_max_batch_size: int = setting(
        0,
        "--speculative-tree-max-batch-size",
        "tree drafts (--top-k > 1): decode steps of more than this many requests verify chains "
        "instead, where a tree's extra verify rows cost more than they gain (0: trees always)",
        gated=True,
    )
    auto_disable: bool = setting(
        False,
        "--speculative-auto-disable",
        "per batch-size bucket, run the step shape (a tree where top_k > 1, a chain, or no drafting) "
        "that yields the most tokens/s (measured on this serve's own steps)",
        gated=True,
    )

    draft_max_loras: int = setting(
        0,
        "--draft-max-loras",
        "draft adapters: GPU slots of the draft's own adapter pool, for Adapters that name a "
        "draft adapter (0: every request drafts unadapted)",
        gated=True,
    )
    draft_max_lora_rank: int = setting(
        16, "--draft-max-lora-rank", "draft adapters: the largest rank a draft slot holds", gated=True
    )

    @property
    def enabled(self) -> bool:
        return self.algorithm is not SpecAlgorithm.NONE

    def draft_lora_pool(self, target: LoRAConfig) -> LoRAConfig | None:
        """The draft's own adapter pool, or None. Built from the draft settings: the target's
        adapters (``target.adapters``) never reach the draft; only the host cache's size
        (one draft adapter per target adapter at most) and the kernels are shared."""
        if self.draft_max_loras <= 0 or not target.enabled:
            return None
        return LoRAConfig(
            enabled=True,
            max_loras_per_batch=self.draft_max_loras,
            max_loaded_loras=target.max_loaded_loras,
            max_rank=self.draft_max_lora_rank,
            target_modules=DEFAULT_LORA_MODULES,
            backend=target.backend,
            adapters={},
            pinned=(),
        )


@dataclass
class LoRAConfig:
    """The LoRA adapter pool."""

    enabled: bool = setting(True, "--enable-lora", "serve LoRA adapters")
    max_loras_per_batch: int = setting(
        8, "--max-loras-per-batch", "GPU adapter slots: distinct adapters per batch", gated=True
    )
    max_loaded_loras: int = setting(32, "--max-loaded-loras", "adapters cached in host memory", gated=True)
    max_rank: int = setting(64, "--max-lora-rank", "the largest adapter rank a slot holds", gated=True)
    target_modules: tuple[str, ...] = setting(
        DEFAULT_LORA_MODULES,
        "--lora-target-modules",
        f"modules adapters may wrap: any of {', '.join(LORA_MODULES)}, or 'all'",
        gated=True,
        metavar="MODULE",
        parse=_modules,
    )
    backend: str = setting("auto", "--lora-backend", "LoRA kernels", choices=LORA_BACKENDS, gated=True)
    overlap_loading: bool = setting(
        False, "--overlap-lora-loading", "load adapter weights on a side stream", gated=True
    )
    adapters: dict[str, str] = setting(
        factory=dict,
        flag="--lora",
        help="an adapter to load at start-up (repeatable)",
        gated=True,
        metavar="NAME=DIR",
        parse=_adapter_pairs,
    )
    pinned: tuple[str, ...] = setting(
        (), "--pinned-loras", "start-up adapters that keep a GPU slot", gated=True, metavar="NAME"
    )
    catalog: str | None = setting(
        None,
        "--adapter-catalog",
        "the serve's adapter catalog (JSON, read at start-up; the operator keeps the pod's copy "
        "current over the admin API): catalogued adapters load on their first request",
        gated=True,
        metavar="FILE",
    )
    load_timeout_s: float = seconds_setting(
        60.0,
        "--adapter-load-timeout",
        "how long a request waits for an on-demand adapter load before a 503 with Retry-After",
        gated=True,
    )
    catalog_confirm: bool = setting(
        False,
        "--catalog-confirm",
        "not ready until the operator has pushed the catalog once (a ConfigMap volume lags "
        "behind Adapters created while the pod started)",
        gated=True,
    )


@dataclass
class SchedulerConfig:
    """Continuous batching."""

    max_running_requests: int = setting(64, "--max-running-requests", "requests decoded together")
    max_total_tokens: int | None = setting(
        None, "--max-total-tokens", "KV cache tokens (default: from free memory)"
    )
    chunked_prefill_size: int = setting(2048, "--chunked-prefill-size", "longest prefill chunk")
    max_prefill_tokens: int = setting(8192, "--max-prefill-tokens", "most prompt tokens per extend batch")
    max_admission_defer_steps: int = setting(
        8,
        "--max-admission-defer-steps",
        "decode steps admission may wait under a backlog to prefill several arrivals in one extend "
        "instead of pausing every decode once per arrival (0: admit at once)",
    )
    overlap_schedule: bool = setting(False, "--overlap-schedule", "prepare the next batch during the forward")
    two_batch_overlap: bool = setting(
        False, "--two-batch-overlap", "split batches into two overlapped halves"
    )
    kv_memory_fraction: float = setting(
        0.85, "--kv-memory-fraction", "share of free GPU memory the KV cache takes"
    )
    prefix_cache: bool = setting(
        True,
        "--prefix-cache",
        "reuse the KV of the longest prompt prefix cached under the same adapter (the base model is "
        "its own key); finished requests leave their KV cached, evicted least recently used when the "
        "pool needs room (--no-prefix-cache: prefill every prompt whole)",
    )


@dataclass
class CudaGraphConfig:
    enabled: bool = setting(False, "--cuda-graph", "replay decode and verify steps from CUDA graphs")
    max_bs: int = setting(64, "--cuda-graph-max-bs", "the largest batch captured", gated=True)
    max_prefill_tokens: int = setting(
        512,
        "--cuda-graph-max-prefill-tokens",
        "extend (prefill) steps of up to this many tokens, every request's chunk padded to one "
        "width, replay CUDA graphs too, an eager prefill being host-bound at small batches "
        "(0: prefill runs eagerly)",
        gated=True,
    )
    warmup_context: int = setting(
        1024,
        "--cuda-graph-warmup-context",
        "at start-up, before the pod turns ready, run every captured batch size at every context "
        "bucket up to this many tokens (capped at the model's context length), so those graphs are "
        "captured before the first request instead of inside it (0: capture each on first use)",
        gated=True,
    )


@dataclass
class ServerConfig:
    host: str = setting("0.0.0.0", "--host", "listening address")
    port: int = setting(8000, "--port", "listening port")
    admin_token: str | None = not_a_flag(
        None,
        "a secret never goes on a command line: --admin-token-file or $LORASERVE_ADMIN_TOKEN "
        "(the bearer token of the admin routes; None: open)",
    )
    adapter_cache_dir: str = setting(
        "/tmp/loraserve-adapters", "--adapter-cache-dir", "where fetched adapters are kept"
    )
    max_body_bytes: int = setting(4 * 1024 * 1024, "--max-body-bytes", "largest request body")
    allowed_local_roots: tuple[str, ...] = setting(
        (),
        "--allowed-local-roots",
        "plain-path and file:// adapter sources, --lora adapters and the model must resolve (symlinks "
        "followed) inside these directories (default: the model's, the draft model's and each --lora "
        "adapter's directory and the adapter cache; the operator always passes the pod's volumes and cache)",
        metavar="DIR",
        parse=_absolute_dirs,
    )
    remote_source_hosts: tuple[str, ...] = setting(
        (),
        "--remote-source-hosts",
        "hosts https://, s3:// and hf:// adapter sources may reach, redirects included; "
        "*.example.com allows its subdomains; commas separate too (default: any host whose addresses are "
        "public; see --allow-private-source-hosts)",
        metavar="HOST",
        parse=_hosts,
    )
    allow_private_sources: bool = setting(
        False,
        "--allow-private-source-hosts",
        "remote adapter sources may reach loopback, link-local and private addresses (default: "
        "refused, whatever the host name resolves to)",
    )
    source_stall_timeout_s: float = seconds_setting(
        30.0,
        "--source-stall-timeout",
        "a remote adapter source that connects or sends no byte for this long fails as unavailable",
    )
    header_timeout_s: float = seconds_setting(
        10.0,
        "--header-timeout",
        "time a client has to send a request's headers",
    )
    body_timeout_s: float = seconds_setting(
        30.0,
        "--body-timeout",
        "time a client has to send a request's body",
    )
    write_timeout_s: float = seconds_setting(
        60.0,
        "--write-timeout",
        "time a client may leave the server's writes unread before the connection is closed",
    )
    max_connections: int = setting(
        0,
        "--max-connections",
        "open client connections at most; 0: derived from the process's file limit",
        metavar="N",
        parse=_non_negative("--max-connections"),
    )
    structured_max_bytes: int = setting(
        32 * 1024,
        "--structured-max-bytes",
        "largest response_format schema, regex, grammar or choice list (bytes of its JSON)",
        metavar="BYTES",
    )
    structured_compile_timeout_s: float = seconds_setting(
        5.0,
        "--structured-compile-timeout",
        "time one response_format may take to compile before a 400",
    )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = setting(1, "--tensor-parallel-size", "GPUs the model is split over")


@dataclass
class RuntimeConfig:
    """The whole configuration of one runtime process.

    Field order is the order of the operator's container argv (a reordering would roll
    every existing pod on an operator upgrade).
    """

    model: ModelConfig = section(ModelConfig, "model")
    speculative: SpeculativeConfig = section(SpeculativeConfig, "speculative decoding")
    lora: LoRAConfig = section(LoRAConfig, "LoRA")
    scheduler: SchedulerConfig = section(SchedulerConfig, "scheduler")
    cuda_graph: CudaGraphConfig = section(CudaGraphConfig, "device")
    parallel: ParallelConfig = section(ParallelConfig, "device")
    device: str = setting("auto", "--device", "where the model runs", choices=DEVICES)
    attention_backend: str = setting(
        "auto",
        "--attention-backend",
        "decode/verify attention: sdpa gathers each context for scaled_dot_product_attention; triton "
        "reads the paged cache in place (CUDA); auto: triton on CUDA when installed, else sdpa",
        choices=ATTENTION_BACKENDS,
    )
    seed: int = setting(0, "--seed", "sampling seed")
    server: ServerConfig = section(ServerConfig, "server")

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


DEFAULTS = RuntimeConfig()
"""Every field's default, for code that states a default elsewhere (the operator's spec
model): read it, never change it."""
