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

import functools
import posixpath
import re
import typing
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.contract.flags import settings
from loraserve.runtime.contract.policy import (
    AdapterDeclaration,
    DraftAdapterDeclaration,
    Report,
    source_path_problem,
)

from .specs import AdapterSpec, EffectiveSpeculative, LoRAServeSpec, Sets, StorageSpec, VolumeType

SPECIAL_FIELD_PATHS: dict[str, str] = {
    "model.path": "spec.model.source",
    "model.revision": "spec.model.revision",
    "model.served_name": "spec.model.servedName",
    "speculative.draft_model_path": "spec.speculative.draftModel",
    "lora.catalog": "the serve's Adapters",
    "lora.adapters": "the serve's Adapters",
    "lora.pinned": "the serve's pinned Adapters",
    "parallel.tensor_parallel_size": "spec.gpus",
    "device": "spec.gpus",
    "server.admin_token": "spec.adminTokenSecretName",
}
"""Runtime fields a LoRAServe sets through code of its own here (paths in the pod, derived
names, the GPUs); every other one is a spec field marked :class:`~.specs.Sets`."""


@dataclass(frozen=True)
class SpecSetting:
    """A spec field that sets one runtime configuration field as it is."""

    attrs: tuple[str, ...]
    """Its attribute path in :class:`LoRAServeSpec` (``("lora", "max_rank")``)."""
    config_path: str
    crd_path: str


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The spec model a field holds (through ``X | None``), if it holds one."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _spec_settings(model: type[BaseModel], attrs: tuple[str, ...], crd: str) -> typing.Iterator[SpecSetting]:
    for name, info in model.model_fields.items():
        here, crd_here = (*attrs, name), f"{crd}.{info.alias or name}"
        marker = next((m for m in info.metadata if isinstance(m, Sets)), None)
        if marker is not None:
            yield SpecSetting(here, marker.path, crd_here)
        elif (sub := _model_of(info.annotation)) is not None:
            yield from _spec_settings(sub, here, crd_here)


@functools.cache
def spec_settings() -> tuple[SpecSetting, ...]:
    """Every LoRAServe field that sets a runtime field as it is (marked :class:`~.specs.Sets`)."""
    return tuple(_spec_settings(LoRAServeSpec, (), "spec"))


FIELD_PATHS: dict[str, str] = {
    **{s.config_path: s.crd_path for s in spec_settings()},
    **SPECIAL_FIELD_PATHS,
}
"""Runtime configuration field -> the LoRAServe field it comes from."""

ADAPTER_FIELD_PATHS: dict[str, str] = {
    "adapter.name": "metadata.name",
    "adapter.serve": "spec.serve",
    "adapter.source": "spec.source",
    "adapter.rank": "spec.rank",
    "adapter.target_modules": "spec.targetModules",
    "adapter.pinned": "spec.pinned",
    "adapter.draft": "spec.draft",
    "adapter.draft.source": "spec.draft.source",
    "adapter.draft.rank": "spec.draft.rank",
    "adapter.draft.target_modules": "spec.draft.targetModules",
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


def public_source(source: str) -> str:
    """``source`` as anyone may read it (a status, an Event): a URI without its user,
    password, query or fragment (where presigned URLs and tokens live); a path as it is."""
    if "://" not in source:
        return source
    parts = urlsplit(source)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"


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
    config = RuntimeConfig()
    _copy_settings(spec, config)
    _place_in_pod(spec, config)
    config.parallel.tensor_parallel_size = max(spec.gpus, 1)
    config.device = "cuda" if spec.gpus >= 1 else "cpu"
    return config


def _read(spec: LoRAServeSpec, attrs: tuple[str, ...]) -> Any:
    """A spec field's value; None under an absent optional parent (``draftModel``)."""
    value: Any = spec
    for attr in attrs:
        if value is None:
            return None
        value = getattr(value, attr)
    return value


def _as_field(current: Any, value: Any) -> Any:
    """``value`` in the form of the configuration field now holding ``current``."""
    if isinstance(current, tuple):
        return tuple(value)
    if isinstance(current, float) and isinstance(value, int):
        return float(value)
    return value


def _copy_settings(spec: LoRAServeSpec, config: RuntimeConfig) -> None:
    """Every :class:`~.specs.Sets` field into its runtime field. An unset one keeps the
    configuration's default, or takes what the field derives from its section (a chain's
    numDraftTokens from numSteps), once the rest of the section is in."""
    flags = {s.path: s for s in settings()}
    unset = []
    for setting in spec_settings():
        holder_path, _, name = setting.config_path.rpartition(".")
        holder = functools.reduce(getattr, holder_path.split("."), config) if holder_path else config
        value = _read(spec, setting.attrs)
        if value is None:
            unset.append((holder, name, flags[setting.config_path].flag.derive))
            continue
        setattr(holder, name, _as_field(getattr(holder, name), value))
    for holder, name, derive in unset:
        if derive is not None:
            setattr(holder, name, derive(holder))


def _place_in_pod(spec: LoRAServeSpec, config: RuntimeConfig) -> None:
    """The fields that depend on where files are in the pod, and the derived names."""
    model, draft = spec.model, spec.speculative.draft_model
    # An unmounted claim keeps its URI, which :func:`unmounted_sources` reports.
    model_path = pod_path(model.source, spec.storage, revision=model.revision) or model.source
    draft_path = (
        (pod_path(draft.source, spec.storage, revision=draft.revision) or draft.source) if draft else None
    )
    config.model.path = model_path
    config.model.revision = model.revision or hf_revision(model.source)
    config.model.served_name = served_name(spec)
    config.speculative.draft_model_path = draft_path
    config.lora.catalog = CATALOG_FILE
    # Not Ready until the operator's push: the ConfigMap volume lags behind Adapters created
    # while the pod started (the flag is written only with LoRA on, like every lora field).
    config.lora.catalog_confirm = True
    server = config.server
    server.port = RUNTIME_PORT
    if not spec.storage.adapters.read_only:
        server.adapter_cache_dir = posixpath.join(spec.storage.adapters.mount_path, ".cache")
    server.allowed_local_roots = allowed_local_roots(spec, server.adapter_cache_dir, model_path, draft_path)


def allowed_local_roots(
    spec: LoRAServeSpec, cache_dir: str, model_path: str, draft_path: str | None
) -> tuple[str, ...]:
    """The directories a runtime pod may read local adapter and model files from: the models
    and adapters volumes, the adapter cache, and a model or draft given as an absolute path
    outside them (a directory of the image)."""
    roots: list[str] = []
    for path in (
        spec.storage.models.mount_path,
        spec.storage.adapters.mount_path,
        cache_dir,
        model_path,
        draft_path,
    ):
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
        draft=None
        if spec.draft is None
        else DraftAdapterDeclaration(
            rank=spec.draft.rank,
            target_modules=tuple(spec.draft.target_modules)
            if spec.draft.target_modules is not None
            else None,
        ),
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
