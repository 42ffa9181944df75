"""Desired state of a LoRAServe: the Kubernetes objects its runtime pods need (pure).

Everything here is a function of the serve's identity, its parsed spec, the
:class:`RuntimeConfig` translated from it and the operator's settings; nothing reads the
cluster or the clock. The reconcile loop compares these objects with what it observes
(``diff``) and writes only the difference.

Objects, all owned by the LoRAServe (owner reference, garbage-collected with it):

* a Deployment running ``loraserve-runtime`` with the flags the configuration implies,
  GPUs, model/adapter volumes, a memory-backed ``/dev/shm``, probes on ``/health`` and
  ``/ready``, a locked-down security context, the admin token mounted from a Secret, and a
  config-hash annotation on the pod template that changes exactly when the runtime-relevant
  spec changes (so pods roll then, and only then);
* a Service with the API port and a metrics port;
* a PodDisruptionBudget;
* the admin-token Secret, unless the spec names its own (generated once, never rotated);
* the serve's adapter catalog, a ConfigMap every pod mounts and reads at start-up (one
  entry per Adapter; its content never rolls the pods: running pods get it pushed).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loraserve.runtime.contract.catalog import CatalogEntry, catalog_digest, encode_catalog
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.contract.flags import to_argv

from .diff import stable_hash, with_desired_hash
from .specs import (
    API_VERSION,
    GPU_RESOURCE,
    LORASERVE_KIND,
    LoRAServeSpec,
    SpecError,
    StorageSpec,
    VolumeType,
    parse_adapter_spec,
)
from .translate import CATALOG_DIR, CATALOG_KEY, RUNTIME_PORT, hf_revision, pod_path, source_problem

# --------------------------------------------------------------------------- constants

RUNTIME_CONTAINER = "runtime"
MODEL_FETCH_CONTAINER = "model-fetch"
RUNTIME_COMMAND = "loraserve-runtime"
RUNTIME_UID = 10001
"""The image's non-root user (``USER`` in the Dockerfile)."""

ADMIN_TOKEN_KEY = "token"
ADMIN_TOKEN_DIR = "/etc/loraserve/admin"
ADMIN_TOKEN_FILE = f"{ADMIN_TOKEN_DIR}/{ADMIN_TOKEN_KEY}"
CACHE_DIR = "/cache"
METRICS_PORT = 9090
"""Service port for metrics scrapers; the runtime serves ``/metrics`` on its API port."""

MANAGER = "loraserve-operator"
SERVE_LABEL = "loraserve.io/serve"
SERVE_NAME_ANNOTATION = "loraserve.io/serve-name"
CONFIG_HASH_ANNOTATION = "loraserve.io/config-hash"
CATALOG_DIGEST_ANNOTATION = "loraserve.io/catalog-digest"
CATALOG_VOLUME = "catalog"
PRE_STOP_SLEEP_S = 5
"""A deleted pod keeps serving this long before SIGTERM, while endpoints (Services,
gateways) stop sending it requests; then it drains what it has."""
RUNTIME_NAME = "loraserve-runtime"

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_HF_SOURCE = re.compile(r"^hf://(?P<repo>[^@]+?)(?:@(?P<revision>.+))?$")
FETCH_COMMAND = "loraserve-fetch"
FETCHED_SCHEMES = ("hf://", "https://", "s3://")
"""Model sources an init container downloads into the models volume before the runtime starts."""


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ServeIdentity:
    """Who the objects belong to."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class DesiredSettings:
    """Operator-wide inputs to the desired state."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    extra_labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DesiredServe:
    """Every object one LoRAServe should own, plus what the reconcile reports."""

    config: RuntimeConfig
    config_hash: str
    deployment: dict
    service: dict
    pdb: dict
    token_secret_name: str
    token_secret_owned: bool
    selector: str
    """Label selector of the runtime pods (``status.selector``, for the scale subresource)."""
    catalog: dict | None = None
    """The adapter-catalog ConfigMap (None when the serve has LoRA off)."""
    catalog_entries: tuple[CatalogEntry, ...] = ()


# --------------------------------------------------------------------------- names and labels


def label_value(name: str) -> str:
    """``name`` as a label value (at most 63 characters; longer names get a hash suffix)."""
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-.')}-{digest}"


def service_name(serve_name: str) -> str:
    """The serve's Service: its own name when that is a valid DNS-1035 label."""
    if _DNS1035.match(serve_name) and len(serve_name) <= 63:
        return serve_name
    digest = hashlib.sha256(serve_name.encode()).hexdigest()[:8]
    cleaned = re.sub(r"[^-a-z0-9]", "-", serve_name.lower()).strip("-")
    return f"lsv-{cleaned[:50]}".rstrip("-") + f"-{digest}"


def _suffixed(serve_name: str, suffix: str) -> str:
    """``<serve><suffix>`` within the 253 characters of an object name (a hash keeps it unique)."""
    if len(serve_name) + len(suffix) <= 253:
        return serve_name + suffix
    digest = hashlib.sha256(serve_name.encode()).hexdigest()[:8]
    return serve_name[: 253 - len(suffix) - 9] + "-" + digest + suffix


def admin_secret_name(serve_name: str, spec: LoRAServeSpec) -> str:
    """The Secret holding the admin token: the spec's own, else one the operator owns."""
    return spec.admin_token_secret_name or _suffixed(serve_name, "-admin-token")


def catalog_configmap_name(serve_name: str) -> str:
    """The ConfigMap holding the serve's adapter catalog."""
    return _suffixed(serve_name, "-adapters")


def selector_labels(serve_name: str) -> dict[str, str]:
    """Labels that select a serve's runtime pods (immutable once a Deployment exists)."""
    return {"app.kubernetes.io/name": RUNTIME_NAME, SERVE_LABEL: label_value(serve_name)}


def label_selector(serve_name: str) -> str:
    """:func:`selector_labels` as a label-selector string."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(serve_name).items())


def object_labels(serve_name: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Standard labels of every object the operator makes for a serve."""
    labels = dict(extra or {})
    labels.update(
        {
            "app.kubernetes.io/name": RUNTIME_NAME,
            "app.kubernetes.io/instance": label_value(serve_name),
            "app.kubernetes.io/component": "runtime",
            "app.kubernetes.io/part-of": "loraserve",
            "app.kubernetes.io/managed-by": MANAGER,
            SERVE_LABEL: label_value(serve_name),
        }
    )
    return labels


def owner_reference(serve: ServeIdentity) -> dict:
    """The controller reference that makes the garbage collector delete objects with the serve."""
    return {
        "apiVersion": API_VERSION,
        "kind": LORASERVE_KIND,
        "name": serve.name,
        "uid": serve.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def owned_metadata(serve: ServeIdentity, name: str, settings: DesiredSettings) -> dict:
    """Name, namespace, standard labels, the serve-name annotation and the controller reference."""
    return {
        "name": name,
        "namespace": serve.namespace,
        "labels": object_labels(serve.name, settings.extra_labels),
        "annotations": {SERVE_NAME_ANNOTATION: serve.name},
        "ownerReferences": [owner_reference(serve)],
    }


# --------------------------------------------------------------------------- runtime command line


def runtime_args(config: RuntimeConfig) -> list[str]:
    """The ``loraserve-runtime`` flags that reproduce ``config`` (admin token excluded).

    Generated from the configuration's fields (:func:`loraserve.runtime.contract.flags.to_argv`):
    every field is written, defaults included, so a pod's command line states its whole
    configuration and does not depend on the image's defaults.
    """
    return to_argv(config)


# --------------------------------------------------------------------------- config hash


def config_hash(spec: LoRAServeSpec, config: RuntimeConfig, image: str, token_secret: str) -> str:
    """Hash of everything that changes what a runtime process does.

    In: the runtime configuration, image, environment, extra arguments, GPUs and other
    resources, volumes, the admin token's Secret. Out: replicas, the Service, scheduling,
    labels. A change of the hash rolls the pods; nothing else does.
    """
    relevant = {
        "config": config.to_dict(),
        "image": image,
        "env": [e.to_dict() for e in spec.runtime.env],
        "extraArgs": list(spec.runtime.extra_args),
        "gpus": spec.gpus,
        "resources": spec.resources.to_dict() if spec.resources else None,
        "storage": spec.storage.to_dict(),
        "adminTokenSecret": token_secret,
    }
    return stable_hash(relevant)


# --------------------------------------------------------------------------- feasibility


def problems(spec: LoRAServeSpec, config: RuntimeConfig) -> list[str]:
    """What keeps this spec from becoming runnable pods, beyond the compatibility policy.

    Each entry names the field and the fix. An empty list means the objects can be built.
    """
    found: list[str] = []
    storage = spec.storage
    sources = [("spec.model.source", spec.model.source)]
    if spec.speculative.draft_model is not None:
        sources.append(("spec.speculative.draftModel.source", spec.speculative.draft_model.source))
    for path, source in sources:
        if escape := source_problem(path, source):
            found.append(escape)
        elif source.startswith("pvc://") and pod_path(source, storage) is None:
            claim = source[len("pvc://") :].split("/", 1)[0]
            found.append(
                f"{path}: claim {claim!r} is not mounted by this serve; fix: set spec.storage.models "
                f"(or spec.storage.adapters) to type PersistentVolumeClaim with claimName {claim!r}"
            )
        elif source.startswith(FETCHED_SCHEMES) and storage.models.read_only:
            found.append(
                f"{path}: an {source.split('://')[0]}:// model is downloaded into the models volume, which is "
                "read-only; fix: set spec.storage.models.readOnly to false, or use pvc://<claim>/<path>"
            )
    if storage.models.mount_path == storage.adapters.mount_path:
        found.append(
            "spec.storage.adapters.mountPath: the same path as spec.storage.models.mountPath; fix: give each "
            "volume its own mount path"
        )
    reserved = {"/tmp", CACHE_DIR, "/dev/shm", ADMIN_TOKEN_DIR, CATALOG_DIR}
    for path, volume in (
        ("spec.storage.models", storage.models),
        ("spec.storage.adapters", storage.adapters),
    ):
        if volume.mount_path.rstrip("/") in reserved:
            found.append(
                f"{path}.mountPath: {volume.mount_path} is used by the runtime pod; fix: choose another path"
            )
    if not config.model.path:
        found.append(
            "spec.model.source: no path in the pod could be derived; fix: use pvc://, hf:// or an absolute path"
        )
    return found


# --------------------------------------------------------------------------- pod template parts


def _volume(name: str, volume, *, claim_read_only: bool) -> dict:
    if volume.type is VolumeType.PERSISTENT_VOLUME_CLAIM:
        return {
            "name": name,
            "persistentVolumeClaim": {"claimName": volume.claim_name, "readOnly": claim_read_only},
        }
    empty: dict = {}
    if volume.size:
        empty["sizeLimit"] = volume.size
    return {"name": name, "emptyDir": empty}


def _storage(storage: StorageSpec) -> tuple[list[dict], list[dict]]:
    volumes = [
        _volume("models", storage.models, claim_read_only=storage.models.read_only),
        _volume("adapters", storage.adapters, claim_read_only=storage.adapters.read_only),
    ]
    mounts = [
        {"name": "models", "mountPath": storage.models.mount_path, "readOnly": storage.models.read_only},
        {
            "name": "adapters",
            "mountPath": storage.adapters.mount_path,
            "readOnly": storage.adapters.read_only,
        },
    ]
    return volumes, mounts


def _scratch_mounts() -> list[dict]:
    return [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": CACHE_DIR},
    ]


def _container_security() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "capabilities": {"drop": ["ALL"]},
    }


def _user_env(spec: LoRAServeSpec) -> list[dict]:
    return [e.to_dict() for e in spec.runtime.env]


def _env(spec: LoRAServeSpec) -> list[dict]:
    user = _user_env(spec)
    names = {e["name"] for e in user}
    own = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    return [e for e in own if e["name"] not in names] + user


def _resources(spec: LoRAServeSpec) -> dict:
    requests = dict((spec.resources.requests or {}) if spec.resources else {})
    limits = dict((spec.resources.limits or {}) if spec.resources else {})
    requests.pop(GPU_RESOURCE, None)
    limits.pop(GPU_RESOURCE, None)
    if spec.gpus > 0:
        # Extended resources are requested through limits (requests must equal them).
        limits[GPU_RESOURCE] = spec.gpus
        requests[GPU_RESOURCE] = spec.gpus
    resources: dict = {}
    if requests:
        resources["requests"] = {k: v for k, v in sorted(requests.items())}
    if limits:
        resources["limits"] = {k: v for k, v in sorted(limits.items())}
    return resources


def _fetch_containers(
    spec: LoRAServeSpec, image: str, pull_policy: str, storage_mounts: list[dict]
) -> list[dict]:
    """Init containers that download remote model and draft sources into the models volume.

    ``hf://`` runs ``hf download``; ``https://`` and ``s3://`` run ``loraserve-fetch SOURCE
    DEST``, which is atomic and skips a model already fetched, so a restarting pod does not
    download again. Both see the user's ``spec.runtime.env``: HF_TOKEN, AWS_* credentials
    and endpoint, SSL_CERT_FILE or proxies, literal or from Secrets.
    """
    containers = []
    sources = [("model", spec.model.source, spec.model.revision)]
    if spec.speculative.draft_model is not None:
        sources.append(("draft", spec.speculative.draft_model.source, spec.speculative.draft_model.revision))
    for role, source, revision in sources:
        match = _HF_SOURCE.match(source)
        if match:
            dest = pod_path(source, spec.storage, revision=revision)
            rev = revision or hf_revision(source) or "main"
            command = ["hf", "download", match.group("repo"), "--revision", rev, "--local-dir", dest]
            env = [e for e in _user_env(spec) if e["name"] != "HF_HUB_OFFLINE"]
            env.append({"name": "HF_HUB_OFFLINE", "value": "0"})  # the image is offline by default
        elif source.startswith(("https://", "s3://")):
            command = [FETCH_COMMAND, source, pod_path(source, spec.storage)]
            env = _user_env(spec)
        else:
            continue
        containers.append(
            {
                "name": f"{role}-fetch",
                "image": image,
                "imagePullPolicy": pull_policy,
                "command": command,
                "env": env,
                "volumeMounts": storage_mounts + _scratch_mounts(),
                "securityContext": _container_security(),
                # A failed fetch's last lines (which name the fix) become the status message.
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        )
    return containers


def _catalog_volume(serve: ServeIdentity, config: RuntimeConfig) -> tuple[list[dict], list[dict]]:
    """The catalog ConfigMap as a volume at the directory of ``--adapter-catalog``."""
    if config.lora.catalog is None:
        return [], []
    volume = {
        "name": CATALOG_VOLUME,
        "configMap": {
            "name": catalog_configmap_name(serve.name),
            "items": [{"key": CATALOG_KEY, "path": CATALOG_KEY}],
            "defaultMode": 0o444,
        },
    }
    return [volume], [{"name": CATALOG_VOLUME, "mountPath": CATALOG_DIR, "readOnly": True}]


def _probe(path: str, *, period: int, failures: int, timeout: int = 5) -> dict:
    return {
        "httpGet": {"path": path, "port": "http", "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }


def _pod_template(
    serve: ServeIdentity,
    spec: LoRAServeSpec,
    config: RuntimeConfig,
    settings: DesiredSettings,
    token_secret: str,
    hash_: str,
) -> dict:
    image = spec.runtime.image or settings.image
    pull_policy = spec.runtime.image_pull_policy if spec.runtime.image else settings.image_pull_policy
    storage_volumes, storage_mounts = _storage(spec.storage)
    catalog_volumes, catalog_mounts = _catalog_volume(serve, config)
    args = [*runtime_args(config), "--admin-token-file", ADMIN_TOKEN_FILE, *spec.runtime.extra_args]
    container = {
        "name": RUNTIME_CONTAINER,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": [RUNTIME_COMMAND],
        "args": args,
        "env": _env(spec),
        "ports": [{"name": "http", "containerPort": config.server.port, "protocol": "TCP"}],
        "resources": _resources(spec),
        "volumeMounts": [
            *storage_mounts,
            *_scratch_mounts(),
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "admin-token", "mountPath": ADMIN_TOKEN_DIR, "readOnly": True},
            *catalog_mounts,
        ],
        # Loading weights can take long: the startup probe holds liveness off for up to 30 min.
        "startupProbe": _probe("/health", period=10, failures=180),
        "readinessProbe": _probe("/ready", period=5, failures=3, timeout=3),
        "livenessProbe": _probe("/health", period=15, failures=4),
        # Endpoints drop a deleted pod asynchronously: keep serving until they have.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SLEEP_S)]}}},
        "securityContext": _container_security(),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    fetch_mounts = [dict(m, readOnly=False) if m["name"] == "models" else m for m in storage_mounts]
    pod_spec: dict = {
        "automountServiceAccountToken": False,  # the runtime never calls the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            *storage_volumes,
            {"name": "tmp", "emptyDir": {}},
            {"name": "cache", "emptyDir": {}},
            # Tensor-parallel workers exchange tensors through shared memory.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {
                "name": "admin-token",
                "secret": {
                    "secretName": token_secret,
                    "items": [{"key": ADMIN_TOKEN_KEY, "path": ADMIN_TOKEN_KEY}],
                    "defaultMode": 0o440,
                },
            },
            *catalog_volumes,
        ],
    }
    init = _fetch_containers(spec, image, pull_policy, fetch_mounts)
    if init:
        pod_spec["initContainers"] = init
    scheduling = spec.scheduling
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [t.to_dict() for t in scheduling.tolerations]
    if scheduling.affinity:
        pod_spec["affinity"] = scheduling.affinity
    labels = object_labels(serve.name, settings.extra_labels)
    return {
        "metadata": {
            "labels": labels,
            "annotations": {
                CONFIG_HASH_ANNOTATION: hash_,
                SERVE_NAME_ANNOTATION: serve.name,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(config.server.port),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": pod_spec,
    }


# --------------------------------------------------------------------------- the objects


DEPLOYMENT_OWNED = ("spec.replicas", "spec.strategy", "spec.template", "spec.revisionHistoryLimit")
SERVICE_OWNED = ("spec.type", "spec.selector", "spec.ports")
PDB_OWNED = ("spec.selector", "spec.maxUnavailable")


def desired_serve(
    serve: ServeIdentity,
    spec: LoRAServeSpec,
    config: RuntimeConfig,
    settings: DesiredSettings,
    catalog: Iterable[CatalogEntry] = (),
) -> DesiredServe:
    """The Deployment, Service, PodDisruptionBudget and adapter catalog one LoRAServe should own."""
    catalog = tuple(catalog)
    token_secret = admin_secret_name(serve.name, spec)
    image = spec.runtime.image or settings.image
    hash_ = config_hash(spec, config, image, token_secret)
    selector = selector_labels(serve.name)
    surge, unavailable = (0, 1) if spec.gpus > 0 else (1, 0)  # GPU nodes rarely have a spare
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": owned_metadata(serve, serve.name, settings),
        "spec": {
            "replicas": spec.replicas,
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": surge, "maxUnavailable": unavailable},
            },
            "template": _pod_template(serve, spec, config, settings, token_secret, hash_),
        },
    }
    deployment["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] = hash_
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(serve, service_name(serve.name), settings),
        "spec": {
            "type": spec.service.type,
            "selector": selector,
            "ports": [
                {"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_metadata(serve, serve.name, settings),
        "spec": {"selector": {"matchLabels": selector}, "maxUnavailable": 1},
    }
    return DesiredServe(
        config=config,
        config_hash=hash_,
        deployment=with_desired_hash(deployment),
        service=with_desired_hash(service),
        pdb=with_desired_hash(pdb),
        token_secret_name=token_secret,
        token_secret_owned=not spec.admin_token_secret_name,
        selector=label_selector(serve.name),
        catalog=catalog_configmap(serve, catalog, settings) if config.lora.catalog is not None else None,
        catalog_entries=catalog,
    )


def admin_token_secret(serve: ServeIdentity, name: str, token: str, settings: DesiredSettings) -> dict:
    """The operator-owned Secret with the runtime's admin token (created once, never rewritten)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": owned_metadata(serve, name, settings),
        "type": "Opaque",
        "stringData": {ADMIN_TOKEN_KEY: token},
    }


def catalog_entries(
    storage: StorageSpec, adapters: Iterable[tuple[str, Mapping]]
) -> tuple[CatalogEntry, ...]:
    """The serve's catalog from its Adapters (name, raw spec): one entry per Adapter whose
    spec parses and whose source the pods can reach (an Adapter's own status says why the
    others are left out)."""
    entries = []
    for name, raw in adapters:
        try:
            spec = parse_adapter_spec(dict(raw))
        except SpecError:
            continue
        path = adapter_pod_path(spec.source, storage)
        # An Adapter is served with the draft adapter it names or not at all (the runtime
        # loads both or neither): an unreachable draft source leaves the entry out too.
        draft = adapter_pod_path(spec.draft.source, storage) if spec.draft is not None else None
        if path is None or (spec.draft is not None and draft is None):
            continue
        entries.append(
            CatalogEntry(
                name=name,
                source=path,
                sha256=spec.sha256,
                rank=spec.rank,
                pinned=spec.pinned,
                draft_source=draft,
                draft_sha256=spec.draft.sha256 if spec.draft is not None else None,
            )
        )
    return tuple(sorted(entries, key=lambda e: e.name))


def catalog_configmap(
    serve: ServeIdentity, entries: Iterable[CatalogEntry], settings: DesiredSettings
) -> dict:
    """The ConfigMap the serve's pods read their catalog from at start-up."""
    entries = tuple(entries)
    meta = owned_metadata(serve, catalog_configmap_name(serve.name), settings)
    meta["annotations"][CATALOG_DIGEST_ANNOTATION] = catalog_digest(entries)
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {CATALOG_KEY: encode_catalog(entries)},
    }
    return with_desired_hash(body)


CONFIGMAP_OWNED = ("data",)


def runtime_port(pod: dict) -> int:
    """The runtime's port in a pod: its ``http`` container port (the template's), else the default."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") != RUNTIME_CONTAINER:
            continue
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return RUNTIME_PORT


def adapter_pod_path(source: str, storage: StorageSpec) -> str | None:
    """What the operator asks a runtime pod to load for an Adapter source.

    ``pvc://`` sources are resolved to the serve's mount of that claim (None when the serve
    mounts no such claim, or when the path would leave the mount: ``..``, ``//`` or an
    absolute tail; :func:`loraserve.operator.translate.source_problem` says why); absolute
    paths are inside the pod already (None with a ``..`` segment); remote sources are passed
    as they are (the runtime fetches and verifies them).
    """
    if source_problem("spec.source", source):
        return None
    if source.startswith("pvc://"):
        return pod_path(source, storage)
    return source
