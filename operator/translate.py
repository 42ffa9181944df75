"""LoRAServe spec -> the runtime's own configuration, and back to the user's field names.

Pure functions. :func:`to_runtime_config` builds the :class:`RuntimeConfig` a runtime pod
of the serve runs with, so the compatibility policy judges exactly what will run;
:func:`crd_path` renames the policy's field paths (``lora.max_rank``) to the fields the
user wrote (``spec.lora.maxRank``), so every message names something in their manifest.

Where files live inside the runtime pod is decided here too (:func:`pod_path`): a
``pvc://<claim>/<path>`` source resolves under the mount path of the serve's volume that
holds that claim; remote model sources (``hf://``, ``s3://``, ``https://``) resolve to a
fixed directory under the models volume, which the pod's model fetch step fills.
"""

from __future__ import annotations

import posixpath
import re
from urllib.parse import urlsplit

from loraserve.runtime.contract.config import (
    CudaGraphConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from loraserve.runtime.contract.policy import AdapterDeclaration, Report, source_path_problem

from .specs import AdapterSpec, EffectiveSpeculative, LoRAServeSpec, StorageSpec, VolumeType

FIELD_PATHS: dict[str, str] = {
    "model.path": "spec.model.source",
    "model.revision": "spec.model.revision",
    "model.dtype": "spec.model.dtype",
    "model.context_length": "spec.model.contextLength",
    "model.served_name": "spec.model.servedName",
    "model.architecture": "spec.model.architecture",
    "speculative.algorithm": "spec.speculative.algorithm",
    "speculative.draft_model_path": "spec.speculative.draftModel",
    "speculative.draft_model_architecture": "spec.speculative.draftModel.architecture",
    "speculative.num_steps": "spec.speculative.numSteps",
    "speculative.top_k": "spec.speculative.topK",
    "speculative.num_draft_tokens": "spec.speculative.numDraftTokens",
    "speculative.adaptive": "spec.speculative.adaptive",
    "speculative.ragged_verify": "spec.speculative.raggedVerify",
    "speculative.draft_load_format": "spec.speculative.draftLoadFormat",
    "speculative.token_map": "spec.speculative.draftModel.tokenMap",
    "speculative.ngram_min": "spec.speculative.ngram.minMatch",
    "speculative.ngram_max": "spec.speculative.ngram.maxMatch",
    "speculative.disable_batch_size": "spec.speculative.disableBatchSize",
    "speculative.tree_max_batch_size": "spec.speculative.treeMaxBatchSize",
    "speculative.auto_disable": "spec.speculative.autoDisable",
    "lora.enabled": "spec.lora.enabled",
    "lora.max_loras_per_batch": "spec.lora.maxLorasPerBatch",
    "lora.max_loaded_loras": "spec.lora.maxLoadedLoras",
    "lora.max_rank": "spec.lora.maxRank",
    "lora.target_modules": "spec.lora.targetModules",
    "lora.backend": "spec.lora.backend",
    "lora.overlap_loading": "spec.lora.overlapLoading",
    "lora.load_timeout_s": "spec.lora.loadTimeoutSeconds",
    "lora.catalog": "the serve's Adapters",
    "lora.adapters": "the serve's Adapters",
    "lora.pinned": "the serve's pinned Adapters",
    "scheduler.max_running_requests": "spec.runtime.maxRunningRequests",
    "scheduler.max_total_tokens": "spec.runtime.maxTotalTokens",
    "scheduler.chunked_prefill_size": "spec.runtime.chunkedPrefillSize",
    "scheduler.max_prefill_tokens": "spec.runtime.maxPrefillTokens",
    "scheduler.max_admission_defer_steps": "spec.runtime.maxAdmissionDeferSteps",
    "scheduler.overlap_schedule": "spec.runtime.overlapSchedule",
    "scheduler.two_batch_overlap": "spec.runtime.twoBatchOverlap",
    "scheduler.kv_memory_fraction": "spec.runtime.kvMemoryFraction",
    "attention_backend": "spec.runtime.attentionBackend",
    "cuda_graph.enabled": "spec.runtime.cudaGraph.enabled",
    "cuda_graph.max_bs": "spec.runtime.cudaGraph.maxBatchSize",
    "cuda_graph.max_prefill_tokens": "spec.runtime.cudaGraph.maxPrefillTokens",
    "parallel.tensor_parallel_size": "spec.gpus",
    "device": "spec.gpus",
    "server.admin_token": "spec.adminTokenSecretName",
    "server.remote_source_hosts": "spec.runtime.remoteSourceHosts",
}
"""Runtime configuration field -> the LoRAServe field it comes from."""

ADAPTER_FIELD_PATHS: dict[str, str] = {
    "adapter.name": "metadata.name",
    "adapter.serve": "spec.serve",
    "adapter.source": "spec.source",
    "adapter.rank": "spec.rank",
    "adapter.target_modules": "spec.targetModules",
    "adapter.pinned": "spec.pinned",
}
"""The policy's adapter fields -> the Adapter's fields."""

FIXED_IN_POD: frozenset[str] = frozenset(
    {
        "server.host",
        "server.port",
        "server.adapter_cache_dir",
        "server.allowed_local_roots",
        "server.max_body_bytes",
        "seed",
    }
)
"""Runtime fields a LoRAServe does not set: the operator fixes them for every pod."""

RUNTIME_PORT = 8000
CATALOG_DIR = "/etc/loraserve/catalog"
CATALOG_KEY = "catalog.json"
CATALOG_FILE = f"{CATALOG_DIR}/{CATALOG_KEY}"
"""Where a runtime pod reads its serve's adapter catalog (a ConfigMap the operator keeps)."""
"""The runtime container's port (the Service maps spec.service.port onto it)."""


def crd_path(config_path: str) -> str:
    """The user's name for a runtime configuration (or adapter) field path."""
    if config_path in FIELD_PATHS:
        return FIELD_PATHS[config_path]
    if config_path in ADAPTER_FIELD_PATHS:
        return ADAPTER_FIELD_PATHS[config_path]
    return f"runtime setting {config_path}"


def serve_messages(report: Report) -> tuple[list[str], list[str]]:
    """A serve report as (violations, warnings) in the LoRAServe's own field names."""
    return [v.render(crd_path) for v in report.violations], [w.render(crd_path) for w in report.warnings]


# --------------------------------------------------------------------------- paths in the pod

_HF = re.compile(r"^hf://(?P<repo>[^@]+?)(?:@(?P<revision>.+))?$")


def hf_revision(source: str) -> str | None:
    """The revision pinned in an ``hf://<repo>@<revision>`` source, if any."""
    match = _HF.match(source)
    return match.group("revision") if match else None


def pod_path(source: str, storage: StorageSpec, *, revision: str | None = None) -> str | None:
    """Where the files of ``source`` are inside a runtime pod of a serve with ``storage``.

    ``pvc://<claim>/<path>``: under the mount path of the serve volume using that claim,
    or None when neither volume mounts it, or when the path would leave the mount (a
    ``..`` segment, ``//`` or an absolute tail: :func:`source_problem` says which; the CRD
    and the webhook refuse such sources, this never maps one). An absolute path: itself.
    Remote sources: a directory under the models volume named after the source
    (``hf://org/repo@rev`` -> ``<models>/hf/org/repo/rev``).
    """
    if source.startswith("pvc://"):
        if source_path_problem(source):
            return None
        claim, _, rest = source[len("pvc://") :].partition("/")
        for volume in (storage.models, storage.adapters):
            if volume.type is VolumeType.PERSISTENT_VOLUME_CLAIM and volume.claim_name == claim:
                mount = posixpath.normpath(volume.mount_path)
                path = posixpath.normpath(posixpath.join(mount, rest))
                if path != mount and not path.startswith(mount.rstrip("/") + "/"):
                    return None  # unreachable after source_path_problem; never a path outside
                return posixpath.join(volume.mount_path, rest)
        return None
    if source.startswith("/"):
        return source
    root = storage.models.mount_path
    match = _HF.match(source)
    if match:
        return posixpath.join(root, "hf", match.group("repo"), match.group("revision") or revision or "main")
    parts = urlsplit(source)
    return posixpath.join(root, parts.scheme, parts.netloc, parts.path.lstrip("/"))


def source_problem(field: str, source: str) -> str | None:
    """Why ``source`` (of ``field``) has no safe path in a pod: it leaves its volume."""
    problem = source_path_problem(source)
    return f"{field}: {problem}" if problem else None


def unmounted_sources(spec: LoRAServeSpec) -> list[str]:
    """Messages for model or draft ``pvc://`` sources whose claim the serve does not mount,
    or whose path leaves the claim (the CRD's CEL rules refuse them too; this names them
    where CEL does not run)."""
    sources = [("spec.model.source", spec.model.source)]
    if spec.speculative.draft_model is not None:
        sources.append(("spec.speculative.draftModel.source", spec.speculative.draft_model.source))
    problems = []
    for path, source in sources:
        if escape := source_problem(path, source):
            problems.append(escape)
        elif source.startswith("pvc://") and pod_path(source, spec.storage) is None:
            claim = source[len("pvc://") :].split("/", 1)[0]
            problems.append(
                f"{path}: claim {claim!r} is not mounted; fix: set spec.storage.models to type "
                f"PersistentVolumeClaim with claimName {claim}"
            )
    return problems


def served_name(spec: LoRAServeSpec) -> str:
    """The base model's name for clients: ``model.servedName``, else derived from the source
    (an ``hf://`` repo id, or the last path component)."""
    if spec.model.served_name:
        return spec.model.served_name
    source = spec.model.source
    match = _HF.match(source)
    if match:
        return match.group("repo")
    path = urlsplit(source).path if "://" in source and not source.startswith("pvc://") else source
    name = posixpath.basename(path.rstrip("/"))
    return name or source


# --------------------------------------------------------------------------- translation


def to_runtime_config(spec: LoRAServeSpec) -> RuntimeConfig:
    """The configuration every runtime pod of this serve runs with (before start-up reads
    the model's own files)."""
    model = spec.model
    speculative = spec.speculative
    draft = speculative.draft_model
    # An unmounted claim keeps its URI, which :func:`unmounted_sources` reports.
    model_path = pod_path(model.source, spec.storage, revision=model.revision) or model.source
    draft_path = (
        (pod_path(draft.source, spec.storage, revision=draft.revision) or draft.source) if draft else None
    )
    num_draft_tokens = speculative.num_draft_tokens
    if num_draft_tokens is None:
        # A chain verifies its drafted tokens plus one; trees must say (the CRD requires it).
        num_draft_tokens = speculative.num_steps + 1
    adapters = spec.storage.adapters
    cache_dir = ServerConfig().adapter_cache_dir
    if not adapters.read_only:
        cache_dir = posixpath.join(adapters.mount_path, ".cache")
    return RuntimeConfig(
        model=ModelConfig(
            path=model_path,
            revision=model.revision or hf_revision(model.source),
            dtype=model.dtype,
            context_length=model.context_length,
            served_name=served_name(spec),
            architecture=model.architecture,
        ),
        speculative=SpeculativeConfig(
            algorithm=speculative.algorithm,
            draft_model_path=draft_path,
            draft_model_architecture=draft.architecture if draft else None,
            num_steps=speculative.num_steps,
            top_k=speculative.top_k,
            num_draft_tokens=num_draft_tokens,
            adaptive=speculative.adaptive,
            ragged_verify=speculative.ragged_verify,
            draft_load_format=speculative.draft_load_format,
            token_map=draft.token_map if draft else None,
            ngram_min=speculative.ngram.min_match,
            ngram_max=speculative.ngram.max_match,
            disable_batch_size=speculative.disable_batch_size,
            tree_max_batch_size=speculative.tree_max_batch_size,
            auto_disable=speculative.auto_disable,
        ),
        lora=LoRAConfig(
            enabled=spec.lora.enabled,
            max_loras_per_batch=spec.lora.max_loras_per_batch,
            max_loaded_loras=spec.lora.max_loaded_loras,
            max_rank=spec.lora.max_rank,
            target_modules=tuple(spec.lora.target_modules),
            backend=spec.lora.backend,
            overlap_loading=spec.lora.overlap_loading,
            catalog=CATALOG_FILE,
            load_timeout_s=float(spec.lora.load_timeout_seconds),
        ),
        scheduler=SchedulerConfig(
            max_running_requests=spec.runtime.max_running_requests,
            max_total_tokens=spec.runtime.max_total_tokens,
            chunked_prefill_size=spec.runtime.chunked_prefill_size,
            max_prefill_tokens=spec.runtime.max_prefill_tokens,
            max_admission_defer_steps=spec.runtime.max_admission_defer_steps,
            overlap_schedule=spec.runtime.overlap_schedule,
            two_batch_overlap=spec.runtime.two_batch_overlap,
            kv_memory_fraction=spec.runtime.kv_memory_fraction,
        ),
        cuda_graph=CudaGraphConfig(
            enabled=spec.runtime.cuda_graph.enabled,
            max_bs=spec.runtime.cuda_graph.max_batch_size,
            max_prefill_tokens=spec.runtime.cuda_graph.max_prefill_tokens,
        ),
        server=ServerConfig(
            port=RUNTIME_PORT,
            adapter_cache_dir=cache_dir,
            allowed_local_roots=allowed_local_roots(spec, cache_dir, model_path, draft_path),
            remote_source_hosts=tuple(spec.runtime.remote_source_hosts or ()),
        ),
        parallel=ParallelConfig(tensor_parallel_size=max(spec.gpus, 1)),
        device="cuda" if spec.gpus >= 1 else "cpu",
        attention_backend=spec.runtime.attention_backend,
    )


def allowed_local_roots(
    spec: LoRAServeSpec, cache_dir: str, model_path: str, draft_path: str | None
) -> tuple[str, ...]:
    """The directories a runtime pod may read local adapter and model files from: the models
    and adapters volumes, the adapter cache, and a model or draft given as an absolute path
    outside them (a directory of the image)."""
    roots: list[str] = []
    for path in (spec.storage.models.mount_path, spec.storage.adapters.mount_path, cache_dir, model_path, draft_path):
        if not path or not path.startswith("/"):
            continue  # an unmounted pvc:// URI, reported elsewhere
        path = posixpath.normpath(path)
        if not any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots):
            roots.append(path)
    return tuple(roots)


def adapter_declaration(name: str, spec: AdapterSpec) -> AdapterDeclaration:
    """What an Adapter object declares, for :func:`loraserve.runtime.contract.policy.check_adapter`."""
    return AdapterDeclaration(
        name=name,
        rank=spec.rank,
        target_modules=tuple(spec.target_modules) if spec.target_modules is not None else None,
        pinned=spec.pinned,
    )


def effective_status(report: Report) -> EffectiveSpeculative | None:
    """``status.effective`` of a LoRAServe from its policy report."""
    if report.effective is None:
        return None
    spec = report.effective.speculative
    return EffectiveSpeculative(
        algorithm=spec.algorithm,
        requested_algorithm=report.requested if report.resolution else None,
        num_steps=spec.num_steps,
        top_k=spec.top_k,
        num_draft_tokens=spec.num_draft_tokens,
        adaptive=spec.adaptive,
        ragged_verify=spec.ragged_verify,
    )
