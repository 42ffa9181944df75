"""Typed models of the LoRAServe and Adapter custom resources (``loraserve.io/v1alpha1``).

These pydantic models are the API: ``loraserve.operator.crd`` generates the CRDs in
``crds/`` from them (``make crds``): camelCase names, defaults, enums, bounds, the field
docstrings as descriptions, and the CEL rules (:class:`CelRule`) each model declares in
``cel_rules`` or on a field's type. Rules that span several fields of the runtime
configuration live in the compatibility policy (``loraserve.runtime.contract.policy``),
whose CEL twins are declared beside them there.

Parse with :func:`parse_loraserve_spec` / :func:`parse_adapter_spec` (errors name the
user's field, e.g. ``spec.lora.maxRank``) and write status with ``model.to_dict()``.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError, core_schema

from loraserve.runtime.contract.config import (
    ATTENTION_BACKENDS,
    DEFAULTS,
    DRAFT_LOAD_FORMATS,
    DTYPES,
    LORA_BACKENDS,
    LORA_MODULES,
    MAX_LOAD_TIMEOUT_S,
    RaggedVerify,
    SpecAlgorithm,
)
from loraserve.runtime.contract.policy import (
    DRAFT_ADAPTER_MODULE_NAMES,
    MAX_LORA_RANK,
    MAXIMUM,
    MINIMUM,
)
from loraserve.runtime.contract.policy import cuda_graphs as graph_rules
from loraserve.runtime.contract.policy import lora as lora_rules
from loraserve.runtime.contract.policy import speculative as speculative_rules
from loraserve.runtime.contract.policy.cel import CelRule
from loraserve.runtime.contract.policy.sources import INSIDE_VOLUME

GROUP = "loraserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

LORASERVE_KIND = "LoRAServe"
LORASERVE_PLURAL = "loraserves"
ADAPTER_KIND = "Adapter"
ADAPTER_PLURAL = "adapters"

SOURCE_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?/\S+|/\S*|https://\S+|s3://[^/\s]+/\S+|hf://[^@\s]+(@[^@\s]+)?)$"
)
"""Where model and adapter files come from: ``pvc://<claim>/<path>``, an absolute path in the
pod, ``https://...``, ``s3://<bucket>/<key>`` or ``hf://<repo>[@<revision>]``."""

SHA256_PATTERN = r"^[0-9a-f]{64}$"
HOST_PATTERN = r"^(\*\.)?[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$"
"""A host name or IP address, or ``*.<domain>`` for every subdomain."""

QUANTITY_PATTERN = r"^([1-9][0-9]*(\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*)([KMGTPE]i|[kMGTPE])?$"
"""A positive Kubernetes quantity such as ``20Gi`` or ``500M``."""

GPU_RESOURCE = "nvidia.com/gpu"

MAX_BATCH_SIZE_SWITCH = 4096
"""The API's bound on the batch sizes that switch drafting off (``disableBatchSize``,
``treeMaxBatchSize``): larger than any batch a pod runs."""

SOURCE_MESSAGE = (
    "must be pvc://<claim>/<path>, an absolute path, https://<url>, s3://<bucket>/<key> "
    "or hf://<repo>[@<revision>]"
)
SHA256_MESSAGE = "must be 64 lowercase hex characters (the output of sha256sum)"


@dataclass(frozen=True)
class Cel:
    """Field-type metadata: CEL rules on the value (written into the CRD), each with a Python
    ``check`` run by the model."""

    rules: tuple[CelRule, ...]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: Any) -> Any:
        for rule in self.rules:
            problem = rule.check(value) if rule.check else None
            if problem:
                raise PydanticCustomError("cel_rule", "{problem}", {"problem": problem})
        return value


def _cel_string(text: str) -> str:
    """``text`` as a single-quoted CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _matches(pattern: str, message: str) -> CelRule:
    """A CEL rule that the value matches ``pattern`` (RE2, and Python's ``re`` alike)."""
    compiled = re.compile(pattern)
    return CelRule(
        f"self.matches({_cel_string(pattern)})",
        message,
        check=lambda value: None if compiled.match(value) else message,
    )


SOURCE_FORMAT = _matches(SOURCE_PATTERN, SOURCE_MESSAGE)
SourceURI = Annotated[
    str,
    Field(
        max_length=2048,
        description="pvc://<claim>/<path>, an absolute path in the pod, https://<url>, s3://<bucket>/<key> "
        "or hf://<repo>[@<revision>].",
    ),
    Cel((SOURCE_FORMAT, INSIDE_VOLUME)),
]
# A file inside the draft's source; RE2 (CEL) has no lookahead, so ".." is a second condition.
TOKEN_MAP_PATTERN = r"^[^/\s]\S*\.(json|safetensors|pt)$"
TOKEN_MAP_MESSAGE = (
    "must be a relative path inside the draft model's source ending in .json, .safetensors or .pt"
)
TOKEN_MAP_FORMAT = CelRule(
    f"self.matches({_cel_string(TOKEN_MAP_PATTERN)}) && !self.contains('..')",
    TOKEN_MAP_MESSAGE,
    check=lambda value: None if re.match(TOKEN_MAP_PATTERN, value) and ".." not in value else TOKEN_MAP_MESSAGE,
)
TokenMapPath = Annotated[str, Field(max_length=512), Cel((TOKEN_MAP_FORMAT,))]
Sha256 = Annotated[str, Field(max_length=64), Cel((_matches(SHA256_PATTERN, SHA256_MESSAGE),))]
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]
"""An RFC 3339 time, as Kubernetes writes them."""
StatusText = Annotated[str, Field(max_length=4096)]
"""A message or warning in a status (the operator clips longer ones)."""
LIST_SET = {"x-kubernetes-list-type": "set"}
"""A list of distinct scalars (the API server merges and refuses duplicates)."""


def list_map(*keys: str) -> dict[str, Any]:
    """A list of objects keyed by ``keys`` (server-side apply merges items by them)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


# --------------------------------------------------------------------------- runtime settings


@dataclass(frozen=True)
class Sets:
    """Marks a spec field that sets one runtime configuration field (``path``, e.g.
    ``lora.max_rank``): ``loraserve.operator.translate`` copies it across, and names it in
    messages, with no code of its own for the field."""

    path: str


def _config_default(path: str) -> Any:
    value = functools.reduce(getattr, path.split("."), DEFAULTS)
    return list(value) if isinstance(value, tuple) else value


def sets(path: str, **constraints: Any) -> Any:
    """A spec field that sets the runtime's ``path``: its default is the configuration's
    (unless ``default=`` says otherwise) and its bounds the policy's (``MINIMUM`` /
    ``MAXIMUM``), unless given; the CRD generated from the field says the same."""
    constraints.setdefault("default", _config_default(path))
    if path in MINIMUM:
        constraints.setdefault("ge", MINIMUM[path])
    if path in MAXIMUM:
        constraints.setdefault("le", MAXIMUM[path])
    info = Field(**constraints)
    info.metadata.append(Sets(path))
    return info


class _Spec(BaseModel):
    """Common configuration: camelCase names on the wire, snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        # The API server prunes unknown fields; an operator older than its CRD must still
        # read the fields it knows.
        extra="ignore",
        use_enum_values=False,
        # A field's docstring is its description in the CRD (kubectl explain).
        use_attribute_docstrings=True,
    )

    cel_rules: ClassVar[tuple[CelRule, ...]] = ()
    """The CEL rules on this object in the CRD; the model runs each one's ``check`` (a rule
    that ``mirrors`` a policy rule is the webhook's, through the policy)."""

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, enums as values, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    @model_validator(mode="after")
    def _cel_checks(self) -> _Spec:
        for rule in type(self).cel_rules:
            problem = rule.check(self) if rule.check else None
            if problem:
                raise PydanticCustomError("cel_rule", "{problem}", {"problem": problem})
        return self


# --------------------------------------------------------------------------- LoRAServe spec


def _revision_twice(source: str, revision: str | None) -> str | None:
    if not (source.startswith("hf://") and "@" in source and revision is not None):
        return None
    return (
        f"revision {revision!r} is set twice, in source {source!r} and in revision; fix: set it once, "
        "in model.source (hf://<repo>@<revision>) or in model.revision"
    )


class ModelSpec(_Spec):
    """The base (target) model every request runs on."""

    cel_rules = (
        CelRule(
            "!(self.source.startsWith('hf://') && self.source.contains('@') && has(self.revision))",
            "set the revision once: either in model.source (hf://<repo>@<revision>) or in model.revision",
            field_path=".revision",
            check=lambda m: _revision_twice(m.source, m.revision),
        ),
    )

    source: SourceURI
    revision: str | None = Field(default=None, max_length=256)
    dtype: Literal[DTYPES] = sets("model.dtype")  # type: ignore[valid-type]
    context_length: int | None = sets("model.context_length")
    """Maximum tokens per sequence; unset uses the model's own limit."""
    served_name: str | None = Field(default=None, max_length=256)
    """The `model` name clients use for the base model; derived from source when unset."""
    architecture: str | None = sets("model.architecture", max_length=128)
    """e.g. LlamaForCausalLM; read from config.json when unset."""


class DraftModelSpec(_Spec):
    """The speculative draft model (loaded without adapters)."""

    source: SourceURI
    revision: str | None = Field(default=None, max_length=256)
    architecture: str | None = sets("speculative.draft_model_architecture", max_length=128)
    """e.g. LlamaForCausalLMEagle3 or Gemma4AssistantForCausalLM; read from the draft's config.json when unset."""
    token_map: TokenMapPath | None = sets("speculative.token_map")
    """EAGLE and EAGLE3 drafts that use the target's lm_head: a file of the draft's source (a .json list,
    or a .safetensors / .pt tensor, of token ids). The draft predicts over these tokens only, through those
    rows of the target's lm_head (FR-Spec): a smaller LM head in every draft step, for large vocabularies.
    Outputs are unchanged; the accept rate drops where the target picks a token outside the map."""


class NgramSpec(_Spec):
    """Prompt-lookup (NGRAM) matching window."""

    cel_rules = (speculative_rules.NGRAM_WINDOW,)

    min_match: int = sets("speculative.ngram_min")
    max_match: int = sets("speculative.ngram_max", ge=MINIMUM["speculative.ngram_min"])


class DraftLoraSpec(_Spec):
    """The draft's own adapter pool, for Adapters that name a draft adapter (``spec.draft``)."""

    max_loras: int = sets("speculative.draft_max_loras")
    """Draft adapter slots, i.e. distinct draft adapters per batch; 0 is no pool (every request drafts
    unadapted, and Adapters with spec.draft are refused)."""
    max_rank: int = sets("speculative.draft_max_lora_rank")
    """The largest draft adapter rank a draft slot holds."""


class SpeculativeSpec(_Spec):
    """Speculative decoding: a draft proposes tokens, the target verifies with each adapter."""

    cel_rules = (
        speculative_rules.DRAFT_REQUIRED,
        speculative_rules.CHAIN_DRAFT_TOKENS,
        # The operator fills in a chain's width; only the API server asks a tree to state its own.
        CelRule(
            "!has(self.algorithm) || self.algorithm == 'NONE' || self.topK == 1 || has(self.numDraftTokens)",
            "numDraftTokens is required when topK > 1 (tree drafts)",
            field_path=".numDraftTokens",
            reason="FieldValueRequired",
        ),
        speculative_rules.TREE_DRAFT_TOKENS,
        speculative_rules.TREE_ALGORITHM,
    )

    algorithm: SpecAlgorithm = sets("speculative.algorithm")
    """NEXTN resolves to EAGLE (or FROZEN_KV_MTP with a Gemma-4 assistant draft); status.effective shows
    the result."""
    draft_model: DraftModelSpec | None = None
    num_steps: int = sets("speculative.num_steps")
    """Draft forward passes per step."""
    top_k: int = sets("speculative.top_k")
    """Branching per draft step; 1 is a chain."""
    num_draft_tokens: int | None = sets("speculative.num_draft_tokens", default=None)
    """Tokens per request in target-verify; numSteps + 1 for chains (filled in when unset); DFLASH's block,
    at most the draft checkpoint's block_size (when unset, the runtime's start-up takes that block_size, or
    16 where the checkpoint states none)."""
    adaptive: bool = sets("speculative.adaptive")
    """Vary the number of draft steps at run time."""
    ragged_verify: RaggedVerify = sets("speculative.ragged_verify")
    """static verifies numDraftTokens per request; dynamic lets each request verify its own width."""
    draft_load_format: Literal[DRAFT_LOAD_FORMATS] = sets("speculative.draft_load_format")  # type: ignore[valid-type]
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    """Prompt-lookup window for NGRAM."""
    disable_batch_size: int = sets("speculative.disable_batch_size", le=MAX_BATCH_SIZE_SWITCH)
    """Decode steps of at least this many requests run without drafting (one token each, the drafter kept
    in sync); speculation resumes below it. 0 always speculates."""
    tree_max_batch_size: int = sets("speculative.tree_max_batch_size", le=MAX_BATCH_SIZE_SWITCH)
    """With tree drafts (topK > 1), decode steps of more than this many requests verify chains of numSteps
    drafts instead, where a tree's extra verify rows cost more than they gain. 0 uses trees at every batch
    size."""
    auto_disable: bool = sets("speculative.auto_disable")
    """Per batch-size bucket, run the step shape (a tree where topK > 1, a chain, or no drafting) that
    yields the most tokens per second, as measured on this serve's own steps (the others re-measured now
    and then)."""
    draft_lora: DraftLoraSpec = Field(default_factory=DraftLoraSpec)
    """The draft's own adapter pool, for Adapters that name a draft adapter (Adapter spec.draft): a LoRA for
    the draft model (STANDALONE) or for the head's own layers (EAGLE, EAGLE3), loaded with its Adapter;
    DFLASH and DSPARK drafts take none in this version. Output never changes; only the accept rate does."""


class LoRASpec(_Spec):
    """The LoRA adapter pool of each replica."""

    cel_rules = (lora_rules.SLOTS_WITHIN_CACHE,)

    enabled: bool = sets("lora.enabled")
    max_loras_per_batch: int = sets("lora.max_loras_per_batch")
    """Adapters resident on the GPU at once (slots), i.e. distinct adapters per batch."""
    max_loaded_loras: int = sets("lora.max_loaded_loras")
    """Adapters cached in host memory."""
    max_rank: int = sets("lora.max_rank")
    target_modules: list[Literal[LORA_MODULES]] = sets(  # type: ignore[valid-type]
        "lora.target_modules", min_length=1, max_length=len(LORA_MODULES), json_schema_extra=LIST_SET
    )
    backend: Literal[LORA_BACKENDS] = sets("lora.backend")  # type: ignore[valid-type]
    overlap_loading: bool = sets("lora.overlap_loading")
    """Load adapter weights on a side stream while batches run."""
    # Whole seconds on the API; the runtime takes any positive number up to the same maximum.
    load_timeout_seconds: int = sets(
        "lora.load_timeout_s", default=int(DEFAULTS.lora.load_timeout_s), ge=1, le=MAX_LOAD_TIMEOUT_S
    )
    """How long a request for a registered adapter that its pod does not hold waits while the pod loads it;
    past it the request answers 503 with Retry-After."""


class CudaGraphSpec(_Spec):
    enabled: bool = sets("cuda_graph.enabled")
    max_batch_size: int = sets("cuda_graph.max_bs")
    max_prefill_tokens: int = sets("cuda_graph.max_prefill_tokens")
    """Extend (prefill) steps of up to this many padded tokens (every request's chunk padded to one width)
    replay CUDA graphs; 0 runs every prefill eagerly."""
    warmup_context: int = sets("cuda_graph.warmup_context")
    """At start-up, before the pod turns ready, every captured batch size runs at every context bucket up to
    this many tokens (capped at the model's context length), so those graphs exist before the first request;
    0 captures each on first use."""


class EnvVar(_Spec):
    """A container environment variable (``valueFrom`` as in a Pod spec)."""

    name: str = Field(min_length=1, max_length=256)
    value: str | None = None
    value_from: dict[str, Any] | None = None


class RuntimeSpec(_Spec):
    """Knobs of the runtime process and its container."""

    overlap_schedule: bool = sets("scheduler.overlap_schedule")
    two_batch_overlap: bool = sets("scheduler.two_batch_overlap")
    cuda_graph: CudaGraphSpec = Field(default_factory=CudaGraphSpec)
    max_running_requests: int = sets("scheduler.max_running_requests")
    max_total_tokens: int | None = sets("scheduler.max_total_tokens")
    """KV-cache token budget; unset derives it from free GPU memory."""
    chunked_prefill_size: int = sets("scheduler.chunked_prefill_size")
    max_prefill_tokens: int = sets("scheduler.max_prefill_tokens")
    max_admission_defer_steps: int = sets("scheduler.max_admission_defer_steps", le=1024)
    """Decode steps admission may wait under a backlog so that several arrivals are prefilled in one extend
    (0 admits at once)."""
    kv_memory_fraction: float = sets("scheduler.kv_memory_fraction", gt=0, le=1)
    prefix_cache: bool = sets("scheduler.prefix_cache")
    """Reuse the KV of the longest prompt prefix cached under the same adapter (the base model is its own
    key); unused entries are evicted least recently used when the pool needs room."""
    attention_backend: Literal[ATTENTION_BACKENDS] = sets("attention_backend")  # type: ignore[valid-type]
    """Decode and verify attention: sdpa gathers each request's context per layer; triton reads the paged KV
    cache in place (CUDA only; its lead over sdpa grows with the context and the batch); auto takes triton on
    CUDA when the image has it, else sdpa."""
    image: str | None = Field(default=None, max_length=512)
    """Runtime image; unset uses the operator's default."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    env: list[EnvVar] = Field(default_factory=list, max_length=128, json_schema_extra=list_map("name"))
    extra_args: list[Annotated[str, Field(max_length=1024)]] = Field(default_factory=list, max_length=128)
    """Extra runtime command-line flags; the runtime checks them again at start-up."""
    remote_source_hosts: list[Annotated[str, Field(max_length=253, pattern=HOST_PATTERN)]] | None = sets(
        "server.remote_source_hosts", default=None, max_length=64
    )
    """Hosts https://, s3:// and hf:// Adapter sources may reach (redirects included); *.example.com allows
    its subdomains. Absent or empty: any host with a public address (loopback, link-local and private
    addresses are refused: list an in-cluster host such as a MinIO service here)."""


class ResourceRequirements(_Spec):
    """Container resources beyond GPUs (GPUs come from ``spec.gpus``)."""

    limits: dict[str, int | str] | None = None
    requests: dict[str, int | str] | None = None


class Toleration(_Spec):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingSpec(_Spec):
    """Where replicas may run."""

    node_selector: dict[str, str] | None = None
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64)
    affinity: dict[str, Any] | None = None
    """A Pod affinity object, passed through as written."""


class VolumeType(enum.StrEnum):
    EMPTY_DIR = "EmptyDir"
    PERSISTENT_VOLUME_CLAIM = "PersistentVolumeClaim"


class _VolumeSpec(_Spec):
    """A volume the runtime pod mounts: an existing claim, or a per-pod emptyDir."""

    cel_rules = (
        CelRule(
            "!has(self.type) || (self.type == 'PersistentVolumeClaim' ? has(self.claimName) : !has(self.claimName))",
            "claimName is required for type PersistentVolumeClaim and not allowed for type EmptyDir",
            field_path=".claimName",
        ),
        CelRule(
            "!has(self.size) || self.type == 'EmptyDir'",
            "size is the sizeLimit of an EmptyDir; a PersistentVolumeClaim brings its own capacity",
            field_path=".size",
            check=lambda v: None
            if v.size is None or v.type is VolumeType.EMPTY_DIR
            else f"size {v.size} is the sizeLimit of an EmptyDir; fix: remove size (a PersistentVolumeClaim "
            "brings its own capacity)",
        ),
    )

    type: VolumeType = VolumeType.EMPTY_DIR
    claim_name: str | None = Field(default=None, max_length=253)
    """The existing PersistentVolumeClaim to mount (type PersistentVolumeClaim only)."""
    mount_path: str
    size: str | None = Field(default=None, pattern=QUANTITY_PATTERN, max_length=32)
    """The emptyDir's sizeLimit (type EmptyDir only)."""
    read_only: bool = False


class ModelsVolumeSpec(_VolumeSpec):
    mount_path: str = Field(default="/models", pattern=r"^/", max_length=1024)


class AdaptersVolumeSpec(_VolumeSpec):
    mount_path: str = Field(default="/adapters", pattern=r"^/", max_length=1024)


class StorageSpec(_Spec):
    """Volumes for base/draft model files and for adapter files."""

    models: ModelsVolumeSpec = Field(default_factory=ModelsVolumeSpec)
    adapters: AdaptersVolumeSpec = Field(default_factory=AdaptersVolumeSpec)


class ServiceSpec(_Spec):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8000, ge=1, le=65535)


class EndpointPickerSpec(_Spec):
    """The Gateway API Inference Extension endpoint picker (EPP) the InferencePool names."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    """The endpoint picker's Service name."""
    port: int = Field(default=9002, ge=1, le=65535)
    """The Service port of the picker's ext-proc endpoint."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does when the picker does not answer (FailOpen routes anyway)."""


class RoutingSpec(_Spec):
    """``spec.routing``: route each request to a pod that holds its adapter.

    The operator makes an ``InferencePool`` (``inference.networking.k8s.io/v1``) selecting the
    serve's pods on the runtime port; an inference gateway's endpoint picker reads the
    runtime's ``vllm:lora_requests_info``, ``vllm:num_requests_waiting`` and KV usage.
    """

    endpoint_picker: EndpointPickerSpec
    """The endpoint picker (EPP) Service the InferencePool names, in this namespace."""


HPA_METRIC_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
PROMETHEUS_METRIC_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
PROMETHEUS_URL_PATTERN = r"^https?://\S+$"


class KedaSpec(_Spec):
    """How KEDA's prometheus trigger reads the runtime's metrics."""

    server_address: str = Field(max_length=2048, pattern=PROMETHEUS_URL_PATTERN)
    """The Prometheus HTTP API KEDA queries, e.g. http://prometheus-operated.monitoring:9090."""
    metric: str = Field(default="vllm:num_requests_waiting", max_length=256, pattern=PROMETHEUS_METRIC_PATTERN)
    """The runtime series the default query sums over this serve's pods."""
    query: str | None = Field(default=None, min_length=1, max_length=4096)
    """A PromQL query replacing the default one; it must return the serve's total."""
    wake_query: str | None = Field(default=None, min_length=1, max_length=4096)
    """Required with minReplicas 0. A PromQL query, above 0 while requests for this serve wait, whose series
    exist with no pod of the serve running: the inference gateway's pending or refused (503) requests on the
    serve's route, or the KEDA HTTP add-on interceptor's queue. It becomes a second trigger of the
    ScaledObject; KEDA wakes the serve from zero when it is above 0."""
    polling_interval_seconds: int = Field(default=15, ge=1, le=3600)
    cooldown_seconds: int = Field(default=300, ge=0, le=86400)


def _replicas_in_order(a: AutoscalingSpec) -> str | None:
    if a.min_replicas <= a.max_replicas:
        return None
    return (
        f"minReplicas ({a.min_replicas}) is above maxReplicas ({a.max_replicas}); fix: lower "
        "spec.autoscaling.minReplicas or raise spec.autoscaling.maxReplicas"
    )


def _zero_needs_keda(a: AutoscalingSpec) -> str | None:
    if a.mode == "KEDA" or a.min_replicas >= 1:
        return None
    return (
        "minReplicas 0 (scale to zero) needs mode KEDA; fix: set spec.autoscaling.minReplicas >= 1 "
        "or spec.autoscaling.mode: KEDA"
    )


def _keda_needs_queries(a: AutoscalingSpec) -> str | None:
    if a.mode != "KEDA" or a.keda is not None:
        return None
    return (
        "mode KEDA needs the Prometheus KEDA queries; fix: set spec.autoscaling.keda.serverAddress "
        "(e.g. http://prometheus-operated.monitoring:9090)"
    )


def _keda_only_with_keda(a: AutoscalingSpec) -> str | None:
    if a.mode == "KEDA" or a.keda is None:
        return None
    return "keda is read only with mode KEDA; fix: set spec.autoscaling.mode: KEDA or remove spec.autoscaling.keda"


def _zero_needs_wake_query(a: AutoscalingSpec) -> str | None:
    if a.min_replicas >= 1 or a.keda is None or a.keda.wake_query is not None:
        return None
    return (
        "minReplicas 0 can never scale up again: at zero pods the serve's own metrics do not exist; "
        "fix: set spec.autoscaling.keda.wakeQuery to a query that counts waiting requests without the "
        "serve's pods (the inference gateway's pending or refused requests on its route, or the KEDA "
        "HTTP add-on's queue), or set spec.autoscaling.minReplicas >= 1"
    )


class AutoscalingSpec(_Spec):
    """``spec.autoscaling``: scale ``spec.replicas`` with load, through the scale subresource."""

    cel_rules = (
        CelRule(
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must be at most autoscaling.maxReplicas",
            field_path=".minReplicas",
            check=_replicas_in_order,
        ),
        CelRule(
            "self.mode == 'KEDA' || self.minReplicas >= 1",
            "minReplicas 0 (scale to zero) needs mode KEDA: set minReplicas >= 1 or mode: KEDA",
            field_path=".minReplicas",
            check=_zero_needs_keda,
        ),
        CelRule(
            "self.mode != 'KEDA' || has(self.keda)",
            "mode KEDA needs keda.serverAddress (the Prometheus KEDA queries)",
            field_path=".keda",
            check=_keda_needs_queries,
        ),
        CelRule(
            "self.mode == 'KEDA' || !has(self.keda)",
            "keda is read only with mode KEDA: set mode: KEDA or remove keda",
            field_path=".keda",
            check=_keda_only_with_keda,
        ),
        CelRule(
            "self.minReplicas >= 1 || !has(self.keda) || has(self.keda.wakeQuery)",
            "minReplicas 0 needs keda.wakeQuery: at zero pods the serve's own metrics do not exist, so nothing "
            "would scale it up; set keda.wakeQuery to a query that counts waiting requests without the serve's "
            "pods (the inference gateway's), or set minReplicas >= 1",
            field_path=".minReplicas",
            check=_zero_needs_wake_query,
        ),
    )

    mode: Literal["HPA", "KEDA"] = "HPA"
    """HPA (a custom-metrics adapter serves metricName) or KEDA (a prometheus trigger)."""
    min_replicas: int = Field(default=1, ge=0, le=1000)
    """The fewest replicas; 0 (scale to zero) only with mode KEDA and a keda.wakeQuery that answers at zero
    pods."""
    max_replicas: int = Field(ge=1, le=1000)
    target_per_replica: int = Field(default=4, ge=1, le=100000)
    """The average of the metric per replica to aim at (waiting requests by default)."""
    metric_name: str = Field(default="vllm_num_requests_waiting", max_length=256, pattern=HPA_METRIC_PATTERN)
    """Mode HPA: the Pods metric as the custom-metrics API serves it. Names there cannot hold ':', so a
    prometheus-adapter rule renames the runtime's vllm:num_requests_waiting (see the README)."""
    keda: KedaSpec | None = None
    """Mode KEDA only. The prometheus trigger's settings."""
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)
    """How long a lower recommendation must hold before replicas are removed."""


def _gpus_not_as_resources(kind: str) -> CelRule:
    def check(spec: LoRAServeSpec) -> str | None:
        if spec.resources is None or GPU_RESOURCE not in (getattr(spec.resources, kind) or {}):
            return None
        return f"resources.{kind}['{GPU_RESOURCE}'] is set; fix: set GPUs with spec.gpus (the operator requests them)"

    return CelRule(
        f"!has(self.resources) || !has(self.resources.{kind}) || !('{GPU_RESOURCE}' in self.resources.{kind})",
        f"set GPUs with spec.gpus, not spec.resources.{kind}['{GPU_RESOURCE}']",
        field_path=f".resources.{kind}",
        check=check,
    )


def _pvc_names_models_claim(source: str, what: str) -> CelRule:
    present = "" if source == "self.model.source" else f"!has({source.rsplit('.', 1)[0]}) || "
    return CelRule(
        f"{present}!{source}.startsWith('pvc://') || (self.storage.models.type == 'PersistentVolumeClaim' && "
        f"has(self.storage.models.claimName) && {source}.startsWith('pvc://' + self.storage.models.claimName + '/'))",
        f"a pvc:// {what} source must name the claim mounted as spec.storage.models (type "
        "PersistentVolumeClaim, claimName <claim>)",
        field_path=source.removeprefix("self"),
    )


class LoRAServeSpec(_Spec):
    """``LoRAServe.spec``: one base model, its speculative draft, its adapter pool."""

    cel_rules = (
        graph_rules.CPU_CUDA_GRAPHS,
        graph_rules.CPU_TRITON_ATTENTION,
        _gpus_not_as_resources("limits"),
        _gpus_not_as_resources("requests"),
        _pvc_names_models_claim("self.model.source", "model"),
        _pvc_names_models_claim("self.speculative.draftModel.source", "draft model"),
    )

    model: ModelSpec
    """The base (target) model."""
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    """Speculative decoding. The draft runs without adapters; the target verifies with each request's
    adapter."""
    lora: LoRASpec = Field(default_factory=LoRASpec)
    """The LoRA adapter pool of each replica."""
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    """Knobs of the runtime process and its container."""
    replicas: int = Field(default=1, ge=0)
    gpus: int = Field(default=1, ge=0)
    """GPUs per replica, also the tensor-parallel size; 0 runs on CPU."""
    resources: ResourceRequirements | None = None
    """Container resources other than GPUs."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    """Volumes for model files and adapter files."""
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    admin_token_secret_name: str | None = Field(default=None, max_length=253)
    """Secret (key `token`) holding the bearer token of the runtime's admin API."""
    routing: RoutingSpec | None = None
    """Route each request to a pod that already holds its adapter, through an inference gateway (Gateway
    API Inference Extension). The operator makes an InferencePool (inference.networking.k8s.io/v1) named
    after this LoRAServe, selecting its pods on the runtime port, whose endpoint picker reads the runtime's
    vllm:lora_requests_info, vllm:num_requests_waiting and KV-cache usage. Absent: no pool (the Service
    still reaches every pod). When the InferencePool API is not installed, the Routing condition says so."""
    autoscaling: AutoscalingSpec | None = None
    """Scale with load. The operator makes an autoscaling/v2 HorizontalPodAutoscaler (mode HPA) or a KEDA
    ScaledObject (mode KEDA) on this LoRAServe's scale subresource: the autoscaler writes spec.replicas and
    the operator copies it into the Deployment (GitOps tools should then not manage spec.replicas). Absent:
    spec.replicas is fixed. When the API is missing (KEDA not installed), the Autoscaling condition says
    so."""


# --------------------------------------------------------------------------- LoRAServe status


class ConditionType(enum.StrEnum):
    COMPATIBLE = "Compatible"
    PROGRESSING = "Progressing"
    AVAILABLE = "Available"
    DEGRADED = "Degraded"
    ROUTING = "Routing"
    AUTOSCALING = "Autoscaling"


class ConditionStatus(enum.StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(_Spec):
    type: str = Field(max_length=64)
    status: ConditionStatus
    reason: str | None = Field(default=None, max_length=256)
    message: str | None = Field(default=None, max_length=32768)
    last_transition_time: Timestamp | None = None
    observed_generation: int | None = None


class LoRAServePhase(enum.StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class EffectiveSpeculative(_Spec):
    """What the runtime actually runs after policy resolution (e.g. NEXTN -> EAGLE)."""

    algorithm: SpecAlgorithm
    requested_algorithm: SpecAlgorithm | None = None
    num_steps: int | None = None
    top_k: int | None = None
    num_draft_tokens: int | None = None
    adaptive: bool | None = None
    ragged_verify: RaggedVerify | None = None


class LoRAServeStatus(_Spec):
    observed_generation: int | None = None
    phase: LoRAServePhase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16, json_schema_extra=list_map("type"))
    replicas: int | None = None
    ready_replicas: int | None = None
    selector: str | None = None
    """Label selector of the runtime pods (for the scale subresource)."""
    effective: EffectiveSpeculative | None = None
    """The speculative configuration the runtime runs after resolution (e.g. NEXTN as EAGLE)."""
    warnings: list[StatusText] = Field(default_factory=list, max_length=64)
    adapters: int | None = None
    """Adapters that reference this serve."""


# --------------------------------------------------------------------------- Adapter


class PlacementMode(enum.StrEnum):
    ALL = "All"
    REPLICAS = "Replicas"


class PlacementSpec(_Spec):
    """On which replicas of the serve the adapter is loaded."""

    cel_rules = (
        CelRule(
            "!has(self.mode) || (self.mode == 'Replicas' ? has(self.replicas) : !has(self.replicas))",
            "placement.replicas is required for mode Replicas and not allowed for mode All",
            field_path=".replicas",
            check=lambda p: None
            if (p.mode is PlacementMode.REPLICAS) == (p.replicas is not None)
            else "placement.replicas is required for mode Replicas and not allowed for mode All; fix: set both "
            "mode: Replicas and replicas, or neither",
        ),
    )

    mode: PlacementMode = PlacementMode.ALL
    replicas: int | None = Field(default=None, ge=1)
    """How many replicas load the adapter (mode Replicas only)."""


class DraftAdapterSpec(_Spec):
    """``Adapter.spec.draft``: a LoRA for the serve's draft model (PEFT format), loaded and
    unloaded with the adapter. It changes what the draft proposes, never the output."""

    source: SourceURI
    sha256: Sha256 | None = None
    """Expected SHA-256 of the draft adapter's weights file; the runtime refuses a mismatch (and with it
    the adapter)."""
    rank: int | None = Field(default=None, ge=1, le=MAX_LORA_RANK)
    """Declared draft adapter rank; checked against the serve's spec.speculative.draftLora.maxRank now, and
    the file against it at load time."""
    target_modules: list[Literal[DRAFT_ADAPTER_MODULE_NAMES]] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=len(DRAFT_ADAPTER_MODULE_NAMES), json_schema_extra=LIST_SET
    )
    """Declared draft adapter target modules; the draft pool wraps q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj and down_proj, and for an EAGLE / EAGLE3 head also its fc (never embed_tokens or
    lm_head: an EAGLE head shares the target's, which stay unadapted)."""


SERVE_IMMUTABLE = CelRule(
    "self == oldSelf", "serve is immutable: create a new Adapter to serve it from another LoRAServe"
)
"""A transition rule (on updates): the pods that hold an adapter belong to its serve."""


class AdapterSpec(_Spec):
    """``Adapter.spec``: one LoRA adapter served by one LoRAServe of the same namespace."""

    serve: Annotated[str, Cel((SERVE_IMMUTABLE,))] = Field(min_length=1, max_length=253)
    """Name of the LoRAServe (same namespace) that serves this adapter."""
    source: SourceURI
    sha256: Sha256 | None = None
    """Expected SHA-256 of the adapter's weights file; the runtime refuses a mismatch."""
    rank: int | None = Field(default=None, ge=1, le=MAX_LORA_RANK)
    """Declared LoRA rank; checked against the serve now and against the file at load time."""
    target_modules: list[Literal[LORA_MODULES]] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=len(LORA_MODULES), json_schema_extra=LIST_SET
    )
    """Declared target modules; checked against the serve now and against the file at load time."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    """Which replicas load the adapter."""
    pinned: bool = False
    """Keep the adapter in a GPU slot even when idle."""
    draft: DraftAdapterSpec | None = None
    """A draft adapter: a LoRA (PEFT format) for the serve's draft (a STANDALONE draft model, or an EAGLE /
    EAGLE3 head's own layers, named as the head's checkpoint names them), loaded and unloaded with this
    adapter; this adapter's requests draft with it. The serve needs a STANDALONE, EAGLE or EAGLE3 draft and
    spec.speculative.draftLora.maxLoras > 0 (NGRAM, DFLASH and DSPARK serves refuse it). Output never
    changes; only the accept rate does."""


class AdapterPodState(enum.StrEnum):
    PENDING = "Pending"
    REGISTERED = "Registered"
    """In the pod's catalog, not loaded: the pod loads it on the first request."""
    LOADING = "Loading"
    LOADED = "Loaded"
    FAILED = "Failed"


class DraftPodState(enum.StrEnum):
    """An Adapter's draft adapter on one pod (only for Adapters with ``spec.draft``)."""

    LOADED = "Loaded"
    ABSENT = "Absent"
    """The adapter is loaded and its draft adapter is not: its requests draft unadapted."""
    FAILED = "Failed"
    """The pod refused the draft adapter (so the adapter's load failed too: all or nothing)."""


class AdapterPodStatus(_Spec):
    pod: str = Field(max_length=253)
    pod_ip: str | None = Field(default=None, alias="podIP", max_length=64)
    state: AdapterPodState
    version: str | None = Field(default=None, max_length=64)
    """The version of the adapter this pod serves new requests with (a short id of its source, sha256 and
    draft adapter); absent while it holds none."""
    draining_versions: list[Annotated[str, Field(max_length=64)]] | None = Field(default=None, max_length=16)
    """Older versions this pod still serves to requests that began before the change; each goes when its
    last request ends."""
    draft: DraftPodState | None = None
    """Adapters with spec.draft: the draft adapter on this pod (Absent: the adapter is loaded, its draft
    adapter is not, so its requests draft unadapted)."""
    message: StatusText | None = None
    time: Timestamp | None = None


class AdapterPhase(enum.StrEnum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class AdapterStatus(_Spec):
    observed_generation: int | None = None
    phase: AdapterPhase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16, json_schema_extra=list_map("type"))
    rank: int | None = None
    target_modules: list[Annotated[str, Field(max_length=64)]] | None = Field(
        default=None, max_length=len(LORA_MODULES)
    )
    pods: list[AdapterPodStatus] = Field(default_factory=list, max_length=1024, json_schema_extra=list_map("pod"))
    version: str | None = Field(default=None, max_length=64)
    """The version of the current spec as the pods compute it; the Adapter is Ready once every targeted pod
    serves it (pods[].version)."""
    loaded_replicas: int | None = None
    registered_replicas: int | None = None
    """Pods that hold the adapter in their catalog without keeping it loaded (they load it on demand)."""
    accept_length: float | None = None
    """Mean speculative accept length (tokens per verify step) of this adapter's requests over the serve's
    pods; absent without speculation or traffic."""
    warnings: list[StatusText] = Field(default_factory=list, max_length=64)


# --------------------------------------------------------------------------- the custom resources


@dataclass(frozen=True)
class PrinterColumn:
    """A ``kubectl get`` column of a custom resource (``additionalPrinterColumns``)."""

    name: str
    type: Literal["string", "integer", "number", "boolean", "date"]
    json_path: str
    priority: int | None = None
    """1: shown only with ``-o wide``."""
    description: str | None = None


@dataclass(frozen=True)
class ScaleSubresource:
    """Where the scale subresource (``kubectl scale``, HPA, KEDA) reads and writes replicas."""

    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    label_selector_path: str = ".status.selector"


@dataclass(frozen=True)
class CustomResource:
    """A custom resource of ``loraserve.io/v1alpha1`` as its CRD declares it: names, columns and
    subresources beside the models of its spec and status."""

    kind: str
    plural: str
    short_name: str
    spec: type[_Spec]
    status: type[_Spec]
    description: str
    about: str
    """What the CRD file's header says about the resource and where its rules live."""
    columns: tuple[PrinterColumn, ...]
    scale: ScaleSubresource | None = None


_AGE = PrinterColumn("Age", "date", ".metadata.creationTimestamp")

LORASERVE = CustomResource(
    kind=LORASERVE_KIND,
    plural=LORASERVE_PLURAL,
    short_name="lsv",
    spec=LoRAServeSpec,
    status=LoRAServeStatus,
    description="A base model served with many LoRA adapters and optional speculative decoding.",
    about="""LoRAServe: one base model served with many LoRA adapters and an optional speculative draft.
CEL rules below hold every rule that needs only this object. Rules that depend on what the
runtime image implements (speculative algorithms, LoRA x speculative compatibility) are
checked by the operator's admission webhook and again by the runtime at start-up, from one
policy (loraserve.runtime.contract.policy), so that relaxing them needs no CRD change.""",
    columns=(
        PrinterColumn("Phase", "string", ".status.phase"),
        PrinterColumn("Ready", "integer", ".status.readyReplicas"),
        PrinterColumn("Desired", "integer", ".spec.replicas"),
        PrinterColumn("Algorithm", "string", ".spec.speculative.algorithm"),
        PrinterColumn("Adapters", "integer", ".status.adapters"),
        _AGE,
    ),
    scale=ScaleSubresource(),
)

ADAPTER = CustomResource(
    kind=ADAPTER_KIND,
    plural=ADAPTER_PLURAL,
    short_name="lora",
    spec=AdapterSpec,
    status=AdapterStatus,
    description="A LoRA adapter served by a LoRAServe in the same namespace; clients select it by the "
    "Adapter's name.",
    about="""Adapter: one LoRA adapter served by a LoRAServe in the same namespace. Clients select it
with the OpenAI `model` field set to the Adapter's name. Whether it fits its serve (rank,
target modules, pinned slots) is checked by the operator's admission webhook, and again by
the runtime against the file itself when it loads.""",
    columns=(
        PrinterColumn("Serve", "string", ".spec.serve"),
        PrinterColumn("Phase", "string", ".status.phase"),
        PrinterColumn("Rank", "integer", ".status.rank"),
        PrinterColumn("Loaded", "integer", ".status.loadedReplicas"),
        PrinterColumn("Accept", "number", ".status.acceptLength"),
        PrinterColumn(
            "Version",
            "string",
            ".status.version",
            priority=1,
            description="The spec's version; the Adapter is Ready once every targeted pod serves it "
            "(kubectl get -o wide).",
        ),
        PrinterColumn(
            "Draft",
            "string",
            ".spec.draft.source",
            priority=1,
            description="The draft adapter loaded with this adapter (kubectl get -o wide).",
        ),
        PrinterColumn("Pinned", "boolean", ".spec.pinned"),
        _AGE,
    ),
)

CUSTOM_RESOURCES = (LORASERVE, ADAPTER)


# --------------------------------------------------------------------------- parsing


class SpecError(ValueError):
    """A resource's spec does not parse; ``problems`` name each field as the user wrote it."""

    def __init__(self, kind: str, problems: list[str]) -> None:
        self.kind = kind
        self.problems = problems
        super().__init__(f"invalid {kind}: " + "; ".join(problems))


def _field_path(prefix: str, loc: tuple[int | str, ...]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith(("literal[", "function-")):
            continue  # pydantic's union-branch labels, not user fields
        else:
            path += f".{part}"
    return path


def _problems(error: ValidationError, prefix: str) -> list[str]:
    return [f"{_field_path(prefix, tuple(e['loc']))}: {e['msg']}" for e in error.errors()]


def parse_loraserve_spec(spec: dict[str, Any] | None) -> LoRAServeSpec:
    """Parse ``LoRAServe.spec``; raises :class:`SpecError` naming every bad field."""
    try:
        return LoRAServeSpec.model_validate(spec or {})
    except ValidationError as error:
        raise SpecError(LORASERVE_KIND, _problems(error, "spec")) from None


def parse_adapter_spec(spec: dict[str, Any] | None) -> AdapterSpec:
    """Parse ``Adapter.spec``; raises :class:`SpecError` naming every bad field."""
    try:
        return AdapterSpec.model_validate(spec or {})
    except ValidationError as error:
        raise SpecError(ADAPTER_KIND, _problems(error, "spec")) from None


def parse_loraserve_status(status: dict[str, Any] | None) -> LoRAServeStatus:
    return LoRAServeStatus.model_validate(status or {})


def parse_adapter_status(status: dict[str, Any] | None) -> AdapterStatus:
    return AdapterStatus.model_validate(status or {})
