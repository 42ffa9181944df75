"""Typed models of the LoRAServe and Adapter custom resources (``loraserve.io/v1alpha1``).

The CRDs in ``crds/`` are the API; these pydantic models mirror them field for field
(camelCase aliases, the same defaults, enums and bounds, checked by the CRD tests) so that
operator code reads a typed spec instead of nested dicts. Rules that span several fields
live in the CRDs' CEL rules and in the compatibility policy (``loraserve.runtime.contract.policy``),
not here: a model here only says what each field is.

Parse with :func:`parse_loraserve_spec` / :func:`parse_adapter_spec` (errors name the
user's field, e.g. ``spec.lora.maxRank``) and write status with ``model.to_dict()``.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

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
    source_path_problem,
)

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


def _matching(pattern: str, message: str):
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.match(value):
            raise PydanticCustomError("value_format", message)
        return value

    return AfterValidator(check)


def _inside_volume(value: str) -> str:
    # The same rule as the CRD's second CEL rule on every source field (and the runtime's).
    problem = source_path_problem(value)
    if problem:
        raise PydanticCustomError("source_path", "{problem}", {"problem": problem})
    return value


SourceURI = Annotated[
    str,
    Field(max_length=2048),
    _matching(SOURCE_PATTERN, SOURCE_MESSAGE),
    AfterValidator(_inside_volume),
]
# A file inside the draft's source; RE2 (CEL) has no lookahead, so ".." is a second rule there.
TOKEN_MAP_PATTERN = r"^(?!.*\.\.)[^/\s]\S*\.(json|safetensors|pt)$"
TOKEN_MAP_MESSAGE = (
    "must be a relative path inside the draft model's source ending in .json, .safetensors or .pt"
)
TokenMapPath = Annotated[str, Field(max_length=512), _matching(TOKEN_MAP_PATTERN, TOKEN_MAP_MESSAGE)]
Sha256 = Annotated[str, _matching(SHA256_PATTERN, SHA256_MESSAGE)]


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
    ``MAXIMUM``), unless given; the CRD tests hold the CRD equal to both."""
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
    )

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, enums as values, unset optionals left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------- LoRAServe spec


class ModelSpec(_Spec):
    """The base (target) model every request runs on."""

    source: SourceURI
    revision: str | None = Field(default=None, max_length=256)
    dtype: Literal[DTYPES] = sets("model.dtype")  # type: ignore[valid-type]
    context_length: int | None = sets("model.context_length")
    served_name: str | None = Field(default=None, max_length=256)
    architecture: str | None = sets("model.architecture", max_length=128)


class DraftModelSpec(_Spec):
    """The speculative draft model (loaded without adapters)."""

    source: SourceURI
    revision: str | None = Field(default=None, max_length=256)
    architecture: str | None = sets("speculative.draft_model_architecture", max_length=128)
    token_map: TokenMapPath | None = sets("speculative.token_map")  # EAGLE family: the tokens the draft predicts over


class NgramSpec(_Spec):
    """Prompt-lookup (NGRAM) matching window."""

    min_match: int = sets("speculative.ngram_min")
    max_match: int = sets("speculative.ngram_max", ge=MINIMUM["speculative.ngram_min"])


class DraftLoraSpec(_Spec):
    """The draft's own adapter pool, for Adapters that name a draft adapter (``spec.draft``)."""

    max_loras: int = sets("speculative.draft_max_loras")
    """Draft adapter slots: distinct draft adapters per batch (0: no pool, every request drafts unadapted)."""
    max_rank: int = sets("speculative.draft_max_lora_rank")


class SpeculativeSpec(_Spec):
    """Speculative decoding: a draft proposes tokens, the target verifies with each adapter."""

    algorithm: SpecAlgorithm = sets("speculative.algorithm")
    draft_model: DraftModelSpec | None = None
    num_steps: int = sets("speculative.num_steps")
    top_k: int = sets("speculative.top_k")
    # Unset: derived from numSteps where the configuration's field says how (a chain).
    num_draft_tokens: int | None = sets("speculative.num_draft_tokens", default=None)
    adaptive: bool = sets("speculative.adaptive")
    ragged_verify: RaggedVerify = sets("speculative.ragged_verify")
    draft_load_format: Literal[DRAFT_LOAD_FORMATS] = sets("speculative.draft_load_format")  # type: ignore[valid-type]
    ngram: NgramSpec = Field(default_factory=NgramSpec)
    disable_batch_size: int = sets("speculative.disable_batch_size", le=MAX_BATCH_SIZE_SWITCH)
    tree_max_batch_size: int = sets("speculative.tree_max_batch_size", le=MAX_BATCH_SIZE_SWITCH)
    auto_disable: bool = sets("speculative.auto_disable")
    draft_lora: DraftLoraSpec = Field(default_factory=DraftLoraSpec)


class LoRASpec(_Spec):
    """The LoRA adapter pool of each replica."""

    enabled: bool = sets("lora.enabled")
    max_loras_per_batch: int = sets("lora.max_loras_per_batch")
    max_loaded_loras: int = sets("lora.max_loaded_loras")
    max_rank: int = sets("lora.max_rank")
    target_modules: list[Literal[LORA_MODULES]] = sets(  # type: ignore[valid-type]
        "lora.target_modules", min_length=1, max_length=len(LORA_MODULES)
    )
    backend: Literal[LORA_BACKENDS] = sets("lora.backend")  # type: ignore[valid-type]
    overlap_loading: bool = sets("lora.overlap_loading")
    # Whole seconds on the API; the runtime takes any positive number up to the same maximum.
    load_timeout_seconds: int = sets(
        "lora.load_timeout_s", default=int(DEFAULTS.lora.load_timeout_s), ge=1, le=MAX_LOAD_TIMEOUT_S
    )
    """How long a request for a registered adapter a pod does not hold waits for its load."""


class CudaGraphSpec(_Spec):
    enabled: bool = sets("cuda_graph.enabled")
    max_batch_size: int = sets("cuda_graph.max_bs")
    max_prefill_tokens: int = sets("cuda_graph.max_prefill_tokens")
    warmup_context: int = sets("cuda_graph.warmup_context")


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
    chunked_prefill_size: int = sets("scheduler.chunked_prefill_size")
    max_prefill_tokens: int = sets("scheduler.max_prefill_tokens")
    max_admission_defer_steps: int = sets("scheduler.max_admission_defer_steps", le=1024)
    kv_memory_fraction: float = sets("scheduler.kv_memory_fraction", gt=0, le=1)
    prefix_cache: bool = sets("scheduler.prefix_cache")
    """Reuse the KV of prompt prefixes cached per adapter (on by default)."""
    attention_backend: Literal[ATTENTION_BACKENDS] = sets("attention_backend")  # type: ignore[valid-type]
    image: str | None = Field(default=None, max_length=512)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    extra_args: list[str] = Field(default_factory=list, max_length=128)
    remote_source_hosts: list[Annotated[str, Field(max_length=253, pattern=HOST_PATTERN)]] | None = sets(
        "server.remote_source_hosts", default=None, max_length=64
    )
    """Hosts remote Adapter sources may reach (``*.example.com``: its subdomains); empty: any host
    with a public address (private ones refused: list in-cluster hosts here)."""


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
    """A Pod ``affinity`` object, passed through as written."""


class VolumeType(enum.StrEnum):
    EMPTY_DIR = "EmptyDir"
    PERSISTENT_VOLUME_CLAIM = "PersistentVolumeClaim"


class _VolumeSpec(_Spec):
    """A volume the runtime pod mounts: an existing claim, or a per-pod emptyDir."""

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
    """The endpoint picker's Service, in the serve's namespace."""
    port: int = Field(default=9002, ge=1, le=65535)
    """The Service port of the picker's ext-proc (gRPC) endpoint."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does when the picker does not answer: FailOpen routes anyway."""


class RoutingSpec(_Spec):
    """``spec.routing``: route each request to a pod that holds its adapter.

    The operator makes an ``InferencePool`` (``inference.networking.k8s.io/v1``) selecting the
    serve's pods on the runtime port; an inference gateway's endpoint picker reads the
    runtime's ``vllm:lora_requests_info``, ``vllm:num_requests_waiting`` and KV usage.
    """

    endpoint_picker: EndpointPickerSpec


HPA_METRIC_PATTERN = r"^[a-zA-Z_][a-zA-Z0-9_]*$"
PROMETHEUS_METRIC_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
PROMETHEUS_URL_PATTERN = r"^https?://\S+$"


class KedaSpec(_Spec):
    """How KEDA's prometheus trigger reads the runtime's metrics."""

    server_address: str = Field(max_length=2048, pattern=PROMETHEUS_URL_PATTERN)
    """The Prometheus (or compatible) HTTP API KEDA queries, e.g. http://prometheus-operated.monitoring:9090."""
    metric: str = Field(default="vllm:num_requests_waiting", max_length=256, pattern=PROMETHEUS_METRIC_PATTERN)
    """The runtime series the default query sums over the serve's pods."""
    query: str | None = Field(default=None, min_length=1, max_length=4096)
    """A PromQL query that replaces the default one (it must return the serve's total)."""
    wake_query: str | None = Field(default=None, min_length=1, max_length=4096)
    """A PromQL query above 0 while requests for the serve wait, answered with no pod of the
    serve running (a gateway's or proxy's series): the ScaledObject's wake-up trigger, which
    minReplicas 0 needs (the serve's own series vanish with its last pod)."""
    polling_interval_seconds: int = Field(default=15, ge=1, le=3600)
    cooldown_seconds: int = Field(default=300, ge=0, le=86400)


class AutoscalingSpec(_Spec):
    """``spec.autoscaling``: scale ``spec.replicas`` with load, through the scale subresource."""

    mode: Literal["HPA", "KEDA"] = "HPA"
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(ge=1, le=1000)
    target_per_replica: int = Field(default=4, ge=1, le=100000)
    """The average of the metric per replica to aim at (waiting requests, by default)."""
    metric_name: str = Field(default="vllm_num_requests_waiting", max_length=256, pattern=HPA_METRIC_PATTERN)
    """HPA: the Pods metric as the custom-metrics API serves it (no ':'; see the README's adapter rule)."""
    keda: KedaSpec | None = None
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        # The same rules as the CRD's CEL rules on spec.autoscaling, worded for the webhook.
        if self.min_replicas > self.max_replicas:
            raise PydanticCustomError(
                "autoscaling",
                "minReplicas ({lo}) is above maxReplicas ({hi}); fix: lower spec.autoscaling.minReplicas "
                "or raise spec.autoscaling.maxReplicas",
                {"lo": self.min_replicas, "hi": self.max_replicas},
            )
        if self.min_replicas == 0 and self.mode != "KEDA":
            raise PydanticCustomError(
                "autoscaling",
                "minReplicas 0 (scale to zero) needs mode KEDA; fix: set spec.autoscaling.minReplicas >= 1 "
                "or spec.autoscaling.mode: KEDA",
            )
        if self.mode == "KEDA" and self.keda is None:
            raise PydanticCustomError(
                "autoscaling",
                "mode KEDA needs the Prometheus KEDA queries; fix: set "
                "spec.autoscaling.keda.serverAddress (e.g. http://prometheus-operated.monitoring:9090)",
            )
        if self.min_replicas == 0 and self.keda is not None and self.keda.wake_query is None:
            raise PydanticCustomError(
                "autoscaling",
                "minReplicas 0 can never scale up again: at zero pods the serve's own metrics do not exist; "
                "fix: set spec.autoscaling.keda.wakeQuery to a query that counts waiting requests without the "
                "serve's pods (the inference gateway's pending or refused requests on its route, or the KEDA "
                "HTTP add-on's queue), or set spec.autoscaling.minReplicas >= 1",
            )
        if self.mode != "KEDA" and self.keda is not None:
            raise PydanticCustomError(
                "autoscaling",
                "keda is read only with mode KEDA; fix: set spec.autoscaling.mode: KEDA or remove "
                "spec.autoscaling.keda",
            )
        return self


class LoRAServeSpec(_Spec):
    """``LoRAServe.spec``: one base model, its speculative draft, its adapter pool."""

    model: ModelSpec
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec)
    lora: LoRASpec = Field(default_factory=LoRASpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    replicas: int = Field(default=1, ge=0)
    gpus: int = Field(default=1, ge=0)
    """GPUs per replica; also the tensor-parallel size. 0 runs on CPU."""
    resources: ResourceRequirements | None = None
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    admin_token_secret_name: str | None = Field(default=None, max_length=253)
    """Secret (key ``token``) holding the bearer token of the runtime's admin API."""
    routing: RoutingSpec | None = None
    """Route by adapter through an inference gateway (an InferencePool); absent: Service only."""
    autoscaling: AutoscalingSpec | None = None
    """Scale with load (an HPA or a KEDA ScaledObject on the scale subresource); absent: fixed replicas."""


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
    type: str
    status: ConditionStatus
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None
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
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    replicas: int | None = None
    ready_replicas: int | None = None
    selector: str | None = None
    """Label selector of the runtime pods, for the scale subresource."""
    effective: EffectiveSpeculative | None = None
    warnings: list[str] = Field(default_factory=list, max_length=64)
    adapters: int | None = None


# --------------------------------------------------------------------------- Adapter


class PlacementMode(enum.StrEnum):
    ALL = "All"
    REPLICAS = "Replicas"


class PlacementSpec(_Spec):
    """On which replicas of the serve the adapter is loaded."""

    mode: PlacementMode = PlacementMode.ALL
    replicas: int | None = Field(default=None, ge=1)
    """How many replicas load the adapter (mode Replicas only)."""


class DraftAdapterSpec(_Spec):
    """``Adapter.spec.draft``: a LoRA for the serve's draft model (PEFT format), loaded and
    unloaded with the adapter. It changes what the draft proposes, never the output."""

    source: SourceURI
    sha256: Sha256 | None = None
    rank: int | None = Field(default=None, ge=1, le=MAX_LORA_RANK)
    """Declared rank, checked against the serve's spec.speculative.draftLora.maxRank now."""
    target_modules: list[Literal[DRAFT_ADAPTER_MODULE_NAMES]] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=len(DRAFT_ADAPTER_MODULE_NAMES)
    )
    """Declared modules (an EAGLE head's draft adapter may name its ``fc``), judged by the policy."""


class AdapterSpec(_Spec):
    """``Adapter.spec``: one LoRA adapter served by one LoRAServe of the same namespace."""

    serve: str = Field(min_length=1, max_length=253)
    source: SourceURI
    sha256: Sha256 | None = None
    rank: int | None = Field(default=None, ge=1, le=MAX_LORA_RANK)
    """Declared rank, checked against the serve now and against the file at load time."""
    target_modules: list[Literal[LORA_MODULES]] | None = Field(  # type: ignore[valid-type]
        default=None, min_length=1, max_length=len(LORA_MODULES)
    )
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    pinned: bool = False
    """Keep the adapter in a GPU slot even when idle."""
    draft: DraftAdapterSpec | None = None
    """Its draft adapter (None: requests draft unadapted)."""


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
    pod: str
    pod_ip: str | None = Field(default=None, alias="podIP")
    state: AdapterPodState
    draft: DraftPodState | None = None
    version: str | None = Field(default=None, max_length=64)
    """The version this pod serves new requests with."""
    draining_versions: list[str] | None = Field(default=None, max_length=16)
    """Older versions it still serves to requests begun before the change."""
    message: str | None = None
    time: str | None = None


class AdapterPhase(enum.StrEnum):
    PENDING = "Pending"
    LOADING = "Loading"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class AdapterStatus(_Spec):
    observed_generation: int | None = None
    phase: AdapterPhase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    rank: int | None = None
    target_modules: list[str] | None = Field(default=None, max_length=len(LORA_MODULES))
    version: str | None = Field(default=None, max_length=64)
    """The current spec's version; Ready once every targeted pod serves it."""
    pods: list[AdapterPodStatus] = Field(default_factory=list, max_length=1024)
    loaded_replicas: int | None = None
    registered_replicas: int | None = None
    accept_length: float | None = None
    """Mean speculative accept length of this adapter's requests, over the serve's pods."""
    warnings: list[str] = Field(default_factory=list, max_length=64)


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
