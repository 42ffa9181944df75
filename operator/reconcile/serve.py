"""One LoRAServe reconcile pass: observe → diff → act → report.

Observe the owned objects, build the desired ones (``desired``), write only what differs
(guarded by resourceVersion; a 409 re-observes and tries again), then compute the status
from what is now there. A pass over an unchanged, converged serve makes no write at all.
A spec that fails to parse, breaks the compatibility policy or cannot be built into pods
changes nothing that already runs: the status says why, naming the fields.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraserve.runtime.contract.catalog import CatalogEntry
from loraserve.runtime.contract.policy import check_config

from .. import desired as ds
from ..diff import needs_update, update_patch
from ..specs import LoRAServeSpec, SpecError, parse_loraserve_spec
from ..status import ServeFindings, serve_status, status_patch
from ..translate import effective_status, serve_messages, to_runtime_config
from .kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    LORASERVES,
    PDBS,
    SECRETS,
    SERVICES,
    KubeClient,
    KubeError,
    Resource,
    retry_on_conflict,
)
from .optional import OptionalFindings, reconcile_optional

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Act:
    """One write the pass made, for the Events the handler posts."""

    verb: str  # Created | Updated | Deleted
    kind: str
    name: str
    detail: str = ""


@dataclass
class ServeOutcome:
    """What one pass did and found."""

    acts: list[Act] = field(default_factory=list)
    status: dict = field(default_factory=dict)
    status_written: bool = False
    rejected: list[str] = field(default_factory=list)
    """Why the spec is not applied (empty when it is)."""
    config_hash: str | None = None
    catalog: tuple[CatalogEntry, ...] | None = None
    """The adapter catalog the serve's pods should hold (None: not applied this pass)."""
    rolled_from: str | None = None
    """The previous config hash when this pass rolled the pods."""


async def _apply(
    kube: KubeClient, res: Resource, namespace: str, want: dict, owned: tuple[str, ...]
) -> tuple[dict, str | None]:
    """Create or patch one object; returns (observed afterwards, "Created"/"Updated"/None)."""
    name = want["metadata"]["name"]

    async def attempt() -> tuple[dict, str | None]:
        have = await kube.get(res, namespace, name)
        if have is None:
            return await kube.create(res, namespace, want), "Created"
        if not needs_update(have, want, owned):
            return have, None
        return await kube.patch(res, namespace, name, update_patch(have, want, owned)), "Updated"

    return await retry_on_conflict(attempt)


async def _ensure_token_secret(
    kube: KubeClient, identity: ds.ServeIdentity, plan: ds.DesiredServe, settings
) -> Act | None:
    """The operator-owned admin token: created once if missing, never rewritten."""
    if await kube.get(SECRETS, identity.namespace, plan.token_secret_name) is not None:
        return None
    body = ds.admin_token_secret(identity, plan.token_secret_name, secrets.token_urlsafe(32), settings)
    try:
        await kube.create(SECRETS, identity.namespace, body)
    except KubeError as exc:
        if exc.conflict:  # created meanwhile (another pass or replica): keep that token
            return None
        raise
    return Act("Created", "Secret", plan.token_secret_name, "admin token")


def _analyse(
    spec_raw: Mapping | None,
) -> tuple[LoRAServeSpec | None, list[str], list[str], list[str], object]:
    """Parse and judge a spec: (spec, invalid, violations, warnings, policy report)."""
    try:
        spec = parse_loraserve_spec(dict(spec_raw or {}))
    except SpecError as exc:
        return None, list(exc.problems), [], [], None
    config = to_runtime_config(spec)
    report = check_config(config)
    violations, warnings = serve_messages(report)
    return spec, [], violations, warnings, report


async def reconcile_serve(
    kube: KubeClient,
    body: Mapping,
    settings: ds.DesiredSettings,
    *,
    adapters: int,
    now: str,
    catalog: Sequence[tuple[str, Mapping]] = (),
) -> ServeOutcome:
    """Run one pass for the LoRAServe ``body`` (as last observed by the watch).

    ``catalog``: the serve's Adapters that are not being deleted, as (name, spec).
    """
    meta = body.get("metadata") or {}
    identity = ds.ServeIdentity(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid") or "")
    generation = meta.get("generation")
    outcome = ServeOutcome()

    spec, invalid, violations, warnings, report = _analyse(body.get("spec"))
    blockers: list[str] = []
    plan: ds.DesiredServe | None = None
    if spec is not None and not violations:
        config = to_runtime_config(spec)
        blockers = ds.problems(spec, config)
        user_secret = spec.admin_token_secret_name
        if user_secret and not blockers and await kube.get(SECRETS, identity.namespace, user_secret) is None:
            blockers.append(
                f"spec.adminTokenSecretName: Secret {user_secret!r} not found; fix: create it "
                "with the key 'token', or remove the field to let the operator generate one"
            )
        if not blockers:
            entries = ds.catalog_entries(spec.storage, catalog)
            plan = ds.desired_serve(identity, spec, config, settings, entries)

    deployment = await kube.get(DEPLOYMENTS, identity.namespace, identity.name)
    optional = OptionalFindings()
    if plan is not None:
        outcome.config_hash = plan.config_hash
        previous_hash = (
            (deployment or {}).get("spec", {}).get("template", {}).get("metadata", {}).get("annotations")
            or {}
        ).get(ds.CONFIG_HASH_ANNOTATION)
        if plan.token_secret_owned:
            act = await _ensure_token_secret(kube, identity, plan, settings)
            if act:
                outcome.acts.append(act)
        if plan.catalog is not None:  # before the pods that mount it
            _, verb = await _apply(kube, CONFIGMAPS, identity.namespace, plan.catalog, ds.CONFIGMAP_OWNED)
            if verb:
                digest = plan.catalog["metadata"]["annotations"][ds.CATALOG_DIGEST_ANNOTATION]
                outcome.acts.append(
                    Act(verb, "ConfigMap", plan.catalog["metadata"]["name"], f"catalog {digest}")
                )
            outcome.catalog = plan.catalog_entries
        deployment, verb = await _apply(
            kube, DEPLOYMENTS, identity.namespace, plan.deployment, ds.DEPLOYMENT_OWNED
        )
        if verb:
            rolled = previous_hash is not None and previous_hash != plan.config_hash
            if rolled:
                outcome.rolled_from = previous_hash
            detail = (
                f"config {previous_hash} -> {plan.config_hash}" if rolled else f"config {plan.config_hash}"
            )
            outcome.acts.append(Act(verb, "Deployment", identity.name, detail))
        for res, want, owned in (
            (SERVICES, plan.service, ds.SERVICE_OWNED),
            (PDBS, plan.pdb, ds.PDB_OWNED),
        ):
            _, verb = await _apply(kube, res, identity.namespace, want, owned)
            if verb:
                outcome.acts.append(Act(verb, want["kind"], want["metadata"]["name"]))
        optional = await reconcile_optional(
            kube, identity, spec, settings, target_port=plan.config.server.port
        )
        outcome.acts += [Act(w.verb, w.kind, w.name, w.detail) for w in optional.writes]
    else:
        outcome.rejected = [*invalid, *violations, *blockers]

    findings = ServeFindings(
        generation=generation,
        desired_replicas=spec.replicas if spec is not None else 0,
        invalid=invalid,
        violations=violations,
        blockers=blockers,
        warnings=warnings,
        effective=effective_status(report) if report is not None else None,
        deployment=deployment,
        desired_hash=plan.config_hash if plan else None,
        selector=ds.label_selector(identity.name),
        adapters=adapters,
        routing=optional.routing,
        autoscaling=optional.autoscaling,
    )
    outcome.status = serve_status(findings, body.get("status"), now=now)
    patch = status_patch(body.get("status"), outcome.status)
    if patch is not None:
        try:
            await kube.patch(
                LORASERVES, identity.namespace, identity.name, {"status": patch}, subresource="status"
            )
            outcome.status_written = True
        except KubeError as exc:
            if not exc.not_found:  # deleted meanwhile: nothing to report on
                raise
    return outcome
