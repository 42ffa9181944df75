"""Admission webhooks for LoRAServe and Adapter, over the runtime's compatibility policy.

Importing this module registers these kopf handlers, and the indexes of ``.index`` they
read, in kopf's default registry (:func:`register` adds them to another registry):

- ``/mutate-loraserve``: fills defaults a CRD default cannot express (a chain's
  ``numDraftTokens`` from ``numSteps``, ``model.servedName`` from the source); never rewrites
  a value the user wrote. A DFLASH ``numDraftTokens`` left out stays out: the runtime's
  start-up takes the draft checkpoint's block size.
- ``/validate-loraserve``: translates the spec to the runtime's configuration and judges
  it with :func:`loraserve.runtime.contract.policy.check_config`; an update that would leave
  existing Adapters unable to load is refused, naming them.
- ``/mutate-adapter``: labels the Adapter with its serve (``loraserve.io/serve``) when the
  label is absent.
- ``/validate-adapter``: judges the Adapter against its LoRAServe, found in the index (an
  absent serve is admitted with a warning: apply order is not guaranteed).

The judging functions (``judge_serve``, ``judge_adapter``, ``derived_defaults``) are pure;
the handlers only fetch from the indexes and report. :func:`configure_webhook_server`
sets up kopf's HTTPS server, from mounted certificate files (presented as they are renewed,
see :class:`ReloadingWebhookServer`) or a generated self-signed CA.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import math
import os
import posixpath
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kopf

from loraserve.runtime.contract.capabilities import CAPABILITIES, Capabilities
from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm, default_draft_tokens
from loraserve.runtime.contract.policy import (
    Namer,
    check_adapter,
    check_config,
    check_source_revision,
    host_allowed,
)

from . import index
from .index import IndexedAdapter, lookup_adapters, lookup_serve
from .specs import (
    ADAPTER_PLURAL,
    GROUP,
    LORASERVE_PLURAL,
    VERSION,
    AdapterSpec,
    LoRAServeSpec,
    PlacementMode,
    SpecError,
    parse_adapter_spec,
    parse_loraserve_spec,
)
from .tls import CertificateReloader, Reload, TLSFiles, check_files, generate_self_signed
from .translate import (
    ADAPTER_FIELD_PATHS,
    adapter_declaration,
    crd_path,
    pod_path,
    serve_messages,
    served_name,
    source_problem,
    to_runtime_config,
    unmounted_sources,
)

__all__ = [
    "ADMISSION_ERROR_CODE",
    "MUTATE_ADAPTER",
    "MUTATE_LORASERVE",
    "SERVE_LABEL",
    "VALIDATE_ADAPTER",
    "VALIDATE_LORASERVE",
    "ReloadingWebhookServer",
    "Verdict",
    "WebhookServerConfig",
    "adapter_labels",
    "configure_webhook_server",
    "derived_defaults",
    "disable_webhook_server",
    "index",
    "judge_adapter",
    "judge_serve",
    "register",
]

VALIDATE_LORASERVE = "validate-loraserve"
MUTATE_LORASERVE = "mutate-loraserve"
VALIDATE_ADAPTER = "validate-adapter"
MUTATE_ADAPTER = "mutate-adapter"
"""Handler ids, which are also the URL paths (``/<id>``) the webhook configurations call."""

SERVE_LABEL = "loraserve.io/serve"
"""Label the mutating webhook puts on each Adapter: its serve's name, for selection
(``kubectl get lora -l loraserve.io/serve=<serve>``)."""

ADMISSION_ERROR_CODE = 422  # Unprocessable Entity: the object is well-formed but refused


@dataclass
class Verdict:
    """An admission decision: refused when there is any problem; warnings either way."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return not self.problems

    def message(self) -> str:
        """One problem as is; several as a list, one per line (kubectl prints it verbatim)."""
        if len(self.problems) == 1:
            return self.problems[0]
        return f"{len(self.problems)} problems:\n" + "\n".join(f"- {p}" for p in self.problems)


# --------------------------------------------------------------------------- mutation


def derived_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A merge patch for ``spec`` with the defaults the CRD cannot express; ``{}`` if none.

    Only fields absent from ``spec`` are filled. A spec that does not parse gets nothing
    (validation refuses it with the reasons).
    """
    try:
        parsed = parse_loraserve_spec(dict(spec))
    except SpecError:
        return {}
    patch: dict[str, Any] = {}
    model = spec.get("model") or {}
    if "servedName" not in model:
        patch["model"] = {"servedName": served_name(parsed)}
    speculative = spec.get("speculative") or {}
    chain = parsed.speculative.top_k == 1 and parsed.speculative.algorithm is not SpecAlgorithm.NONE
    # A chain verifies its drafted tokens plus one; a DFLASH block stays unset for the
    # runtime's start-up to take from the checkpoint (the one statement of that default).
    width = default_draft_tokens(parsed.speculative)
    if chain and "numDraftTokens" not in speculative and width is not None:
        patch["speculative"] = {"numDraftTokens": width}
    return patch


def adapter_labels(body: Mapping[str, Any]) -> dict[str, str]:
    """Labels to add to an Adapter: :data:`SERVE_LABEL` when absent; ``{}`` otherwise."""
    spec = body.get("spec")
    serve = spec.get("serve") if isinstance(spec, Mapping) else None
    labels = (body.get("metadata") or {}).get("labels") or {}
    if not isinstance(serve, str) or not serve or SERVE_LABEL in labels:
        return {}
    return {SERVE_LABEL: serve}


# --------------------------------------------------------------------------- LoRAServe


def _adapter_namer(adapter: str):
    def name(path: str) -> str:
        if path in ADAPTER_FIELD_PATHS:
            return f"Adapter {adapter!r} {ADAPTER_FIELD_PATHS[path]}"
        return crd_path(path)

    return name


def _serve_namer(serve: str):
    def name(path: str) -> str:
        if path in ADAPTER_FIELD_PATHS:
            return ADAPTER_FIELD_PATHS[path]
        return f"LoRAServe {serve!r} {crd_path(path)}"

    return name


def _claim_problem(source: str, serve: LoRAServeSpec, serve_name: str, field: str) -> str | None:
    """An Adapter's ``pvc://`` source (or its draft's) whose claim the serve's pods do not mount."""
    if escape := source_problem(field, source):
        return escape
    if not source.startswith("pvc://") or pod_path(source, serve.storage) is not None:
        return None
    claim = source[len("pvc://") :].split("/", 1)[0]
    mounted = [
        f"{volume.claim_name!r} (spec.storage.{label})"
        for label, volume in (("models", serve.storage.models), ("adapters", serve.storage.adapters))
        if volume.claim_name
    ]
    return (
        f"{field}: claim {claim!r} is not mounted by LoRAServe {serve_name!r} "
        f"(it mounts {', '.join(mounted) or 'no claims'}); fix: use a mounted claim, or set the serve's "
        f"spec.storage.adapters to type PersistentVolumeClaim with claimName {claim}"
    )


def _misfits(
    serve: LoRAServeSpec,
    config: RuntimeConfig,
    serve_name: str,
    adapter: IndexedAdapter,
    parsed: AdapterSpec,
    other_pinned: int,
    name: Namer,
) -> tuple[list[str], list[str]]:
    """Why one adapter does not fit a serve (``config`` is the serve translated), and its
    warnings, each rendered with ``name``."""
    report = check_adapter(config, adapter_declaration(adapter.name, parsed), other_pinned=other_pinned)
    problems = [v.render(name) for v in report.violations]
    problems += _source_problems(parsed.source, name("adapter.source"), serve, config, serve_name)
    if parsed.draft is not None:
        # The runtime fetches a draft adapter as it fetches the adapter: the same volumes,
        # roots and hosts bound it.
        problems += _source_problems(parsed.draft.source, name("adapter.draft.source"), serve, config, serve_name)
    return problems, [w.render(name) for w in report.warnings]


def _source_problems(
    source: str, field: str, serve: LoRAServeSpec, config: RuntimeConfig, serve_name: str
) -> list[str]:
    """Why the pods of a serve (``config`` is it translated) cannot read an adapter source."""
    problems = []
    claim = _claim_problem(source, serve, serve_name, field)
    if claim:
        problems.append(claim)
    roots = config.server.allowed_local_roots
    local = posixpath.normpath(source) if source.startswith("/") else None
    if local and roots and not any(local == r or local.startswith(r.rstrip("/") + "/") for r in roots):
        problems.append(
            f"{field}: {source} is outside the volumes of LoRAServe {serve_name!r} "
            f"({', '.join(roots)}), the only directories its pods read adapters from; fix: put the adapter "
            f"under {serve.storage.adapters.mount_path} or use pvc://<claim>/<path>"
        )
    hosts = serve.runtime.remote_source_hosts
    source_host = urlsplit(source).hostname if source.startswith("https://") else None
    if hosts and source_host is not None and not host_allowed(source_host, hosts):
        problems.append(
            f"{field}: host {source_host!r} is not in LoRAServe {serve_name!r} "
            f"spec.runtime.remoteSourceHosts ({', '.join(hosts)}); fix: use one of them or add the host there"
        )
    return problems


def floating_sources(serve: LoRAServeSpec) -> list[str]:
    """Warnings for ``hf://`` model and draft sources not pinned to a commit (they follow a
    branch, so pods started later may serve other weights)."""
    found = [
        check_source_revision(
            "spec.model.source",
            serve.model.source,
            revision=serve.model.revision,
            revision_field="spec.model.revision",
        )
    ]
    draft = serve.speculative.draft_model
    if draft is not None:
        found.append(
            check_source_revision(
                "spec.speculative.draftModel.source",
                draft.source,
                revision=draft.revision,
                revision_field="spec.speculative.draftModel.revision",
            )
        )
    return [w.render() for w in found if w is not None]


def _pinned_others(adapters: Sequence[IndexedAdapter], name: str) -> int:
    return sum(1 for a in adapters if a.name != name and a.spec.get("pinned") is True)


def judge_serve(
    spec: Mapping[str, Any],
    *,
    name: str,
    adapters: Sequence[IndexedAdapter] = (),
    old_spec: Mapping[str, Any] | None = None,
    capabilities: Capabilities = CAPABILITIES,
) -> Verdict:
    """Judge a LoRAServe spec (``old_spec`` on update) and its effect on existing Adapters.

    On create, Adapters that will not fit are warnings (they may have been applied
    first); on update, an Adapter that fitted the old spec and not the new one refuses it.
    """
    verdict = Verdict()
    try:
        serve = parse_loraserve_spec(dict(spec))
    except SpecError as error:
        verdict.problems += error.problems
        return verdict
    config = to_runtime_config(serve)
    report = check_config(config, capabilities)
    problems, warnings = serve_messages(report)
    verdict.problems += unmounted_sources(serve)
    verdict.problems += problems
    verdict.warnings += floating_sources(serve)
    verdict.warnings += warnings
    if report.resolution:
        verdict.warnings.append(f"spec.speculative.algorithm: {report.resolution}")
    if serve.runtime.image:
        verdict.warnings.append(
            f"spec.runtime.image: what is available was judged against the operator's own runtime image; "
            f"{serve.runtime.image} checks the configuration again at start-up"
        )
    if serve.runtime.extra_args:
        verdict.warnings.append(
            "spec.runtime.extraArgs: passed to the runtime as written; admission cannot judge them, "
            "the runtime checks them at start-up"
        )

    old: LoRAServeSpec | None = None
    if old_spec is not None:
        with contextlib.suppress(SpecError):
            old = parse_loraserve_spec(dict(old_spec))
    old_config = to_runtime_config(old) if old is not None else None
    for indexed in adapters:
        try:
            adapter = parse_adapter_spec(indexed.spec)
        except SpecError:
            continue  # refused at its own admission; nothing to compare
        other_pinned = _pinned_others(adapters, indexed.name)
        namer = _adapter_namer(indexed.name)
        broken, _ = _misfits(serve, config, name, indexed, adapter, other_pinned, namer)
        if old is not None and old_config is not None and broken:
            before, _ = _misfits(old, old_config, name, indexed, adapter, other_pinned, namer)
            broken = [message for message in broken if message not in before]
        if old_spec is None:
            verdict.warnings += [f"{message} (the Adapter will not load)" for message in broken]
        else:
            verdict.problems += [f"existing {message}" for message in broken]
    return verdict


# --------------------------------------------------------------------------- Adapter


def judge_adapter(
    spec: Mapping[str, Any],
    *,
    name: str,
    namespace: str | None,
    serve_spec: Mapping[str, Any] | None,
    siblings: Sequence[IndexedAdapter] = (),
    metadata: Mapping[str, Any] | None = None,
) -> Verdict:
    """Judge an Adapter against its LoRAServe's spec (None when the serve is not known)."""
    verdict = Verdict()
    try:
        adapter = parse_adapter_spec(dict(spec))
    except SpecError as error:
        verdict.problems += error.problems
        return verdict
    floating = check_source_revision("spec.source", adapter.source, sha256=adapter.sha256)
    if floating is not None:
        verdict.warnings.append(floating.render())
    if adapter.draft is not None:
        floating = check_source_revision("spec.draft.source", adapter.draft.source, sha256=adapter.draft.sha256)
        if floating is not None:
            verdict.warnings.append(floating.render())
    labels = (metadata or {}).get("labels") or {}
    if SERVE_LABEL in labels and labels[SERVE_LABEL] != adapter.serve:
        verdict.warnings.append(
            f"metadata.labels[{SERVE_LABEL}]: is {labels[SERVE_LABEL]!r} but spec.serve is {adapter.serve!r}; "
            "selections by this label will miss the adapter"
        )
    if serve_spec is None:
        verdict.warnings.append(
            f"spec.serve: LoRAServe {adapter.serve!r} does not exist in namespace {namespace!r} yet; the adapter "
            "is checked against it when it is created and again when the adapter loads"
        )
        return verdict
    try:
        serve = parse_loraserve_spec(dict(serve_spec))
    except SpecError as error:
        verdict.warnings.append(
            f"spec.serve: LoRAServe {adapter.serve!r} has an invalid spec ({error}); the adapter is checked "
            "when it loads"
        )
        return verdict
    problems, warnings = _misfits(
        serve,
        to_runtime_config(serve),
        adapter.serve,
        IndexedAdapter(name, dict(spec)),
        adapter,
        _pinned_others(siblings, name),
        _serve_namer(adapter.serve),
    )
    verdict.problems += problems
    verdict.warnings += warnings
    placement = adapter.placement
    if placement.mode is PlacementMode.REPLICAS and (placement.replicas or 0) > serve.replicas:
        verdict.warnings.append(
            f"spec.placement.replicas: {placement.replicas} exceeds LoRAServe {adapter.serve!r} spec.replicas "
            f"({serve.replicas}); the adapter loads on every replica"
        )
    return verdict


# --------------------------------------------------------------------------- kopf handlers


def _spec(body: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = body.get("spec")
    if spec is not None and not isinstance(spec, Mapping):
        raise kopf.AdmissionError("spec: must be an object", code=ADMISSION_ERROR_CODE)
    return spec or {}


def _unchanged(operation: str | None, old: Mapping[str, Any] | None, body: Mapping[str, Any]) -> bool:
    """An update that leaves the spec as it was (finalizers, labels, annotations) or that
    touches an object being deleted is always allowed: refusing it could wedge deletion."""
    if operation != "UPDATE" or old is None:
        return False
    deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))
    return deleting or dict(old.get("spec") or {}) == dict(body.get("spec") or {})


def _report(verdict: Verdict, warnings: list[str]) -> None:
    warnings.extend(verdict.warnings)
    if not verdict.allowed:
        raise kopf.AdmissionError(verdict.message(), code=ADMISSION_ERROR_CODE)


def mutate_loraserve(body: Mapping[str, Any], patch: kopf.Patch, **_: Any) -> None:
    """Fill derived defaults into a LoRAServe."""
    spec = body.get("spec")
    fragment = derived_defaults(spec) if isinstance(spec, Mapping) else {}
    if fragment:
        patch["spec"] = fragment


def mutate_adapter(body: Mapping[str, Any], patch: kopf.Patch, **_: Any) -> None:
    """Label an Adapter with its serve's name."""
    labels = adapter_labels(body)
    if labels:
        patch["metadata"] = {"labels": labels}


@dataclass(frozen=True)
class _Review:
    """What a validating handler reads of one admission review (kopf passes each by name)."""

    body: Mapping[str, Any]
    old: Mapping[str, Any] | None
    operation: str | None
    namespace: str | None
    name: str | None

    @property
    def old_spec(self) -> Mapping[str, Any] | None:
        """The spec before an update; None on create."""
        if self.operation != "UPDATE" or self.old is None:
            return None
        return self.old.get("spec") or {}


def _validating(judge: Callable[..., Verdict]) -> Callable[..., None]:
    """A kopf validating handler around ``judge(review, **indexes)``.

    Both kinds are admitted the same way: an update that leaves the spec alone passes
    unjudged (see :func:`_unchanged`), the rest is refused on ``judge``'s problems and
    given its warnings. ``judge`` names the kopf indexes it reads as keyword arguments.
    """

    @functools.wraps(judge)
    def handler(
        body: Mapping[str, Any],
        old: Mapping[str, Any] | None,
        operation: str | None,
        namespace: str | None,
        name: str | None,
        warnings: list[str],
        **kwargs: Any,
    ) -> None:
        if _unchanged(operation, old, body):
            return
        _report(judge(_Review(body, old, operation, namespace, name), **kwargs), warnings)

    return handler


@_validating
def validate_loraserve(review: _Review, *, adapters_by_serve: kopf.Index, **_: Any) -> Verdict:
    """Refuse a LoRAServe the runtime cannot serve, or an update that strands its Adapters."""
    name = review.name or ""
    return judge_serve(
        _spec(review.body),
        name=name,
        adapters=lookup_adapters(adapters_by_serve, review.namespace or "", name),
        old_spec=review.old_spec,
    )


@_validating
def validate_adapter(
    review: _Review, *, serve_specs: kopf.Index, adapters_by_serve: kopf.Index, **_: Any
) -> Verdict:
    """Refuse an Adapter its LoRAServe cannot load."""
    spec = _spec(review.body)
    serve = spec.get("serve") if isinstance(spec.get("serve"), str) else ""
    namespace = review.namespace or ""
    return judge_adapter(
        spec,
        name=review.name or "",
        namespace=review.namespace,
        serve_spec=lookup_serve(serve_specs, namespace, serve) if serve else None,
        siblings=lookup_adapters(adapters_by_serve, namespace, serve) if serve else (),
        metadata=review.body.get("metadata") or {},
    )


_OPERATIONS = ["CREATE", "UPDATE"]
_registered: list[kopf.OperatorRegistry] = []


def register(registry: kopf.OperatorRegistry) -> None:
    """Add the admission handlers and the indexes they read to ``registry`` (once)."""
    if any(known is registry for known in _registered):
        return
    index.register(registry)
    kopf.on.mutate(
        GROUP, VERSION, LORASERVE_PLURAL, id=MUTATE_LORASERVE, operations=_OPERATIONS, registry=registry
    )(mutate_loraserve)
    kopf.on.mutate(
        GROUP, VERSION, ADAPTER_PLURAL, id=MUTATE_ADAPTER, operations=_OPERATIONS, registry=registry
    )(mutate_adapter)
    kopf.on.validate(
        GROUP, VERSION, LORASERVE_PLURAL, id=VALIDATE_LORASERVE, operations=_OPERATIONS, registry=registry
    )(validate_loraserve)
    kopf.on.validate(
        GROUP, VERSION, ADAPTER_PLURAL, id=VALIDATE_ADAPTER, operations=_OPERATIONS, registry=registry
    )(validate_adapter)
    _registered.append(registry)


register(kopf.get_default_registry())


# --------------------------------------------------------------------------- the server

ENV_PREFIX = "LORASERVE_WEBHOOK_"
DEFAULT_CERT_RELOAD_S = 20.0
"""How often mounted certificate files are reread: cert-manager renews days before expiry,
and the kubelet takes up to a minute or so to update a mounted Secret anyway."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WebhookServerConfig:
    """Where the webhook server listens and which certificate it presents.

    From the environment (the chart sets these): ``LORASERVE_WEBHOOK_ADDR``, ``_PORT``,
    ``_HOST``, ``_CERT_FILE``, ``_KEY_FILE``, ``_CA_FILE``, ``_CERT_DIR``, ``_MANAGED``,
    ``_CERT_RELOAD_S``.
    """

    addr: str = "0.0.0.0"
    port: int = 9443
    host: str | None = None
    """The name clients use to reach the server (a certificate SAN); None: ``addr``."""
    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    """Both ``certfile`` and ``keyfile`` unset: a self-signed CA and certificate are made."""
    cert_dir: str | None = None
    """Where a self-signed certificate is written; None: a fresh temporary directory."""
    managed: str | None = None
    """Name of the Validating/MutatingWebhookConfiguration kopf keeps pointed at this server;
    None leaves them to the installer (the chart)."""
    cert_reload_s: float = DEFAULT_CERT_RELOAD_S
    """Seconds between rereads of mounted certificate files (renewals are applied without a
    restart); unused for a self-signed certificate, which is never renewed."""

    def __post_init__(self) -> None:
        _check_reload_s(self.cert_reload_s, f"cert_reload_s ({ENV_PREFIX}CERT_RELOAD_S)", self.cert_reload_s)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WebhookServerConfig:
        env = os.environ if env is None else env

        def get(key: str) -> str | None:
            value = env.get(ENV_PREFIX + key, "").strip()
            return value or None

        port_text = get("PORT")
        port = cls.port
        if port_text is not None:
            try:
                port = int(port_text)
            except ValueError:
                port = 0
            if not 1 <= port <= 65535:
                raise ValueError(f"{ENV_PREFIX}PORT must be a TCP port (1-65535), got {port_text!r}")
        certfile, keyfile = get("CERT_FILE"), get("KEY_FILE")
        if (certfile is None) != (keyfile is None):
            raise ValueError(
                f"set both {ENV_PREFIX}CERT_FILE and {ENV_PREFIX}KEY_FILE (mounted PEM files), or neither "
                "for a self-signed certificate"
            )
        reload_text = get("CERT_RELOAD_S")
        reload_s = DEFAULT_CERT_RELOAD_S
        if reload_text is not None:
            try:
                reload_s = float(reload_text)
            except ValueError:
                reload_s = math.nan
            _check_reload_s(reload_s, f"{ENV_PREFIX}CERT_RELOAD_S", reload_text)
        return cls(
            addr=get("ADDR") or cls.addr,
            port=port,
            host=get("HOST"),
            certfile=certfile,
            keyfile=keyfile,
            cafile=get("CA_FILE"),
            cert_dir=get("CERT_DIR"),
            managed=get("MANAGED"),
            cert_reload_s=reload_s,
        )

    def hostnames(self) -> list[str]:
        names = [self.host] if self.host else []
        if self.addr not in ("0.0.0.0", "::", ""):
            names.append(self.addr)
        return names or ["localhost", "127.0.0.1"]


def _check_reload_s(value: float, name: str, shown: object) -> None:
    """Refuse a reload interval that is not a finite number of seconds above 0."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{name} must be a number of seconds greater than 0 (default {DEFAULT_CERT_RELOAD_S:g}), got {shown!r}"
        )


class ReloadingWebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server, presenting renewed certificate files without a restart.

    kopf's own server notices changed files by closing its listener and building a new
    one: connections are refused in between, and a renewal caught half-way makes the new
    context raise, which ends the webhook server for good. Here the SSL context is the
    ``reloader``'s, loaded from one checked read of the files; every ``reload_interval_s``
    the reloader rereads them and loads a renewed pair into that same context, so new
    handshakes present it while the listener and its connections stay up. kopf's restart
    path is never entered. A changed CA bundle is yielded as a new client configuration
    (kopf patches it into the webhook configurations it manages).
    """

    def __init__(self, *, reloader: CertificateReloader, reload_interval_s: float, **kwargs: Any) -> None:
        files = reloader.files
        super().__init__(
            context=reloader.context,
            certfile=str(files.certfile),
            pkeyfile=str(files.keyfile),
            cafile=str(files.cafile) if files.cafile else None,
            **kwargs,
        )
        self.reloader = reloader
        self.reload_interval_s = reload_interval_s
        self._errors: set[str] = set()

    def _build_ssl(self) -> tuple[bytes | None, ssl.SSLContext | None]:
        # kopf would load the files into the context once more: a second read, which could
        # meet a swap half-way. The reloader has loaded a checked pair into it already.
        return self.reloader.current.ca_bundle, self.reloader.context

    async def __call__(self, fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        # kopf's generator listens and yields the client configuration; it is never advanced
        # again (advancing it is what restarts the listener), only closed when we are.
        served = super().__call__(fn)
        try:
            client_config = await anext(served)
            yield client_config
            bundle = self.reloader.current.ca_bundle
            while True:
                await asyncio.sleep(self.reload_interval_s)
                # On the event loop's thread, which also creates connections from the context.
                self._poll()
                if self.reloader.current.ca_bundle != bundle:
                    bundle = self.reloader.current.ca_bundle
                    client_config = kopf.WebhookClientConfig(
                        client_config, caBundle=base64.b64encode(bundle).decode("ascii")
                    )
                    yield client_config
        finally:
            await served.aclose()

    def _poll(self) -> Reload | None:
        try:
            return self.reloader.poll()
        except Exception as error:  # a defect here must not stop admission
            text = repr(error)
            if text not in self._errors:
                self._errors.add(text)
                logger.exception("webhook TLS certificate check failed; the served certificate is unchanged")
            return None


def configure_webhook_server(
    settings: kopf.OperatorSettings, config: WebhookServerConfig | None = None
) -> TLSFiles:
    """Point kopf's admission server at ``config`` (default: from the environment).

    Mounted certificate files are checked now, so a bad mount stops the operator at
    start-up with the file named, and are then reread every ``config.cert_reload_s``
    seconds so that a renewal is served without a restart; without files, a self-signed
    CA is generated. Returns the files in use (``cafile`` is the bundle clients and
    webhook configurations trust).
    """
    config = config or WebhookServerConfig.from_env()
    server: kopf.WebhookServer
    if config.certfile and config.keyfile:
        files = check_files(config.certfile, config.keyfile, config.cafile)
        reloader = CertificateReloader(files)
        reloader.load()
        server = ReloadingWebhookServer(
            addr=config.addr,
            port=config.port,
            host=config.host,
            reloader=reloader,
            reload_interval_s=config.cert_reload_s,
        )
    else:
        directory = (
            Path(config.cert_dir) if config.cert_dir else Path(tempfile.mkdtemp(prefix="loraserve-webhook-"))
        )
        files = generate_self_signed(directory, config.hostnames())
        server = kopf.WebhookServer(
            addr=config.addr,
            port=config.port,
            host=config.host,
            certfile=str(files.certfile),
            pkeyfile=str(files.keyfile),
            cafile=str(files.cafile) if files.cafile else None,
        )
    settings.admission.server = server
    settings.admission.managed = config.managed
    return files


class _NoWebhookServer:
    """An admission "server" that never listens.

    kopf refuses to start when admission handlers are registered and no server is set;
    an operator run without its webhook (the chart's webhook disabled) uses this instead.
    """

    async def __call__(self, fn: Any):
        await asyncio.Event().wait()  # until the operator stops
        return
        yield  # an async generator that yields no client configuration


def disable_webhook_server(settings: kopf.OperatorSettings) -> None:
    """Run kopf without serving admission although the handlers are registered."""
    settings.admission.server = _NoWebhookServer()
    settings.admission.managed = None
