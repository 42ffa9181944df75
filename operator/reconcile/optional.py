"""Objects a LoRAServe owns only when asked, of APIs a cluster may not serve (one pass step).

``spec.routing`` makes an InferencePool (Gateway API Inference Extension CRDs), and
``spec.autoscaling`` an autoscaling/v2 HorizontalPodAutoscaler or a KEDA ScaledObject. Each is
applied when its field is set and deleted when the field goes (only an object this serve
owns: the controller owner reference carries its uid). An API the cluster does not serve is
not an error: discovery (``GET /apis/<group>/<version>``) answers 404 or lists no such
resource, the answer is remembered for :data:`DISCOVERY_TTL_S`, and the Routing / Autoscaling
condition says what is off and why. Nothing here fails the pass: a refused write becomes the
condition's message, and the serve's pods keep running as they are.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import autoscaling as asc
from .. import routing as rt
from ..desired import DesiredSettings, ServeIdentity
from ..diff import needs_update, update_patch
from ..specs import LoRAServeSpec
from ..status import OptionalState
from .kube import HPAS, INFERENCE_POOLS, SCALED_OBJECTS, KubeClient, KubeError, Resource, retry_on_conflict

logger = logging.getLogger(__name__)

DISCOVERY_TTL_S = 60.0
"""How long an answer of discovery is trusted: a CRD installed later is seen within this time."""


class ApiDiscovery:
    """Which optional resources the API server serves, asked of discovery and remembered a while."""

    def __init__(self, ttl_s: float = DISCOVERY_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._seen: dict[tuple[str, str], tuple[bool, float]] = {}

    async def serves(self, kube: KubeClient, res: Resource) -> bool:
        key = (res.api_version, res.plural)
        now = time.monotonic()
        hit = self._seen.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        prefix = "/api/v1" if res.api_version == "v1" else f"/apis/{res.api_version}"
        try:
            answer = await kube.request("GET", prefix)
            present = any(r.get("name") == res.plural for r in (answer or {}).get("resources") or ())
        except KubeError as exc:
            if not exc.not_found:
                raise
            present = False
        if not present:
            logger.info("%s/%s is not served by this cluster", res.api_version, res.plural)
        self._seen[key] = (present, now + self.ttl_s)
        return present

    def forget(self, res: Resource | None = None) -> None:
        """Ask discovery again next time (all resources, or ``res``)."""
        if res is None:
            self._seen.clear()
        else:
            self._seen.pop((res.api_version, res.plural), None)


_DISCOVERY: weakref.WeakKeyDictionary[KubeClient, ApiDiscovery] = weakref.WeakKeyDictionary()


def discovery(kube: KubeClient) -> ApiDiscovery:
    """The discovery cache of one client (one per operator process)."""
    if kube not in _DISCOVERY:
        _DISCOVERY[kube] = ApiDiscovery()
    return _DISCOVERY[kube]


@dataclass(frozen=True)
class Write:
    """One write this step made (the pass turns it into an Event)."""

    verb: str  # Created | Updated | Deleted
    kind: str
    name: str
    detail: str = ""


@dataclass
class OptionalFindings:
    """What the step did and found; ``routing`` / ``autoscaling`` are None when not asked for."""

    routing: OptionalState | None = None
    autoscaling: OptionalState | None = None
    writes: list[Write] = field(default_factory=list)


class _NotOurs(Exception):
    def __init__(self, obj: Mapping) -> None:
        super().__init__(obj.get("kind"))
        self.obj = obj


def owned_by(obj: Mapping, uid: str) -> bool:
    """Whether ``obj`` is controlled by the serve of ``uid``."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or ()
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


async def _apply(
    kube: KubeClient, res: Resource, want: dict, owned: tuple[str, ...], uid: str
) -> tuple[dict, str | None]:
    """Create or patch an object this serve owns: (as observed after, "Created"/"Updated"/None)."""
    meta = want["metadata"]
    namespace, name = meta["namespace"], meta["name"]

    async def attempt() -> tuple[dict, str | None]:
        have = await kube.get(res, namespace, name)
        if have is None:
            return await kube.create(res, namespace, want), "Created"
        if not owned_by(have, uid):
            raise _NotOurs(have)
        if not needs_update(have, want, owned):
            return have, None
        return await kube.patch(res, namespace, name, update_patch(have, want, owned)), "Updated"

    return await retry_on_conflict(attempt)


async def _delete(kube: KubeClient, res: Resource, namespace: str, name: str, uid: str) -> bool:
    """Delete the object if this serve owns it; True when something was deleted."""
    have = await kube.get(res, namespace, name)
    if have is None or not owned_by(have, uid):
        return False
    return await kube.delete(res, namespace, name)


def _not_ours(kind: str, identity: ServeIdentity, field_: str) -> OptionalState:
    return OptionalState(
        False,
        "NameTaken",
        f"{kind} {identity.namespace}/{identity.name} exists and is not owned by this LoRAServe; fix: delete "
        f"or rename that {kind}, or remove {field_}",
    )


def _failed(kind: str, exc: KubeError) -> OptionalState:
    return OptionalState(False, "ApplyFailed", f"{kind}: {exc.status} {exc.reason}: {exc.message}")


async def _routing(
    kube: KubeClient,
    seen: ApiDiscovery,
    identity: ServeIdentity,
    spec: LoRAServeSpec,
    settings: DesiredSettings,
    target_port: int,
    writes: list[Write],
) -> OptionalState | None:
    res, name = INFERENCE_POOLS, rt.pool_name(identity.name)
    if spec.routing is None:
        if await seen.serves(kube, res) and await _delete(kube, res, identity.namespace, name, identity.uid):
            writes.append(Write("Deleted", rt.KIND, name, "spec.routing removed"))
        return None
    missing = OptionalState(
        False,
        "InferencePoolCRDMissing",
        f"routing by adapter is off: this cluster does not serve {rt.API_VERSION} {rt.PLURAL} (the Gateway API "
        "Inference Extension CRDs); fix: install them and an inference gateway. Requests still reach every "
        "pod through the Service",
    )
    if not await seen.serves(kube, res):
        return missing
    want = rt.inference_pool(identity, spec.routing, settings, target_port=target_port)
    try:
        have, verb = await _apply(kube, res, want, rt.INFERENCE_POOL_OWNED, identity.uid)
    except _NotOurs:
        return _not_ours(rt.KIND, identity, "spec.routing")
    except KubeError as exc:
        if exc.not_found:  # the CRD went away since discovery answered
            seen.forget(res)
            return missing
        return _failed(rt.KIND, exc)
    if verb:
        writes.append(Write(verb, rt.KIND, name))
    return OptionalState(True, "InferencePoolApplied", f"{rt.describe(want)}; {rt.parents(have)}")


def _scaler_health(observed: Mapping | None, kind: str, metric: str) -> OptionalState | None:
    """A failure the HPA / KEDA reports about reading the metric, if any."""
    for cond in ((observed or {}).get("status") or {}).get("conditions") or ():
        if kind == asc.HPA_KIND and cond.get("type") == "ScalingActive" and cond.get("status") == "False":
            return OptionalState(
                False,
                "MetricUnavailable",
                f"the HorizontalPodAutoscaler cannot read the Pods metric {metric}: {cond.get('message', '')}; "
                "fix: serve it through a custom-metrics adapter (README: prometheus-adapter rule)",
            )
        if kind == asc.KEDA_KIND and cond.get("type") == "Ready" and cond.get("status") == "False":
            return OptionalState(
                False, "ScaledObjectNotReady", f"KEDA: {cond.get('reason', '')}: {cond.get('message', '')}"
            )
    return None


async def _autoscaling(
    kube: KubeClient,
    seen: ApiDiscovery,
    identity: ServeIdentity,
    spec: LoRAServeSpec,
    settings: DesiredSettings,
    writes: list[Write],
) -> OptionalState | None:
    name = asc.object_name(identity.name)
    wanted = spec.autoscaling
    kinds = {"HPA": (HPAS, asc.HPA_KIND), "KEDA": (SCALED_OBJECTS, asc.KEDA_KIND)}
    # Whatever kind is not wanted (field removed, or the mode switched) goes.
    for mode, (res, kind) in kinds.items():
        if wanted is not None and wanted.mode == mode:
            continue
        if await seen.serves(kube, res) and await _delete(kube, res, identity.namespace, name, identity.uid):
            why = "spec.autoscaling removed" if wanted is None else f"spec.autoscaling.mode is {wanted.mode}"
            writes.append(Write("Deleted", kind, name, why))
    if wanted is None:
        return None
    res, kind = kinds[wanted.mode]
    if wanted.mode == "KEDA":
        missing = OptionalState(
            False,
            "KEDACRDMissing",
            f"autoscaling is off: this cluster does not serve {asc.KEDA_API_VERSION} {asc.KEDA_PLURAL} (KEDA is "
            f"not installed); fix: install KEDA, or set spec.autoscaling.mode: HPA. spec.replicas "
            f"({spec.replicas}) stays as set",
        )
        want = asc.scaled_object(identity, wanted, settings)
        owned, metric = asc.SCALED_OBJECT_OWNED, wanted.keda.metric if wanted.keda else ""
    else:
        missing = OptionalState(
            False,
            "HorizontalPodAutoscalerAPIMissing",
            f"autoscaling is off: this cluster does not serve {asc.HPA_API_VERSION} {asc.HPA_PLURAL}; "
            f"spec.replicas ({spec.replicas}) stays as set",
        )
        want = asc.horizontal_pod_autoscaler(identity, wanted, settings)
        owned, metric = asc.HPA_OWNED, wanted.metric_name
    if not await seen.serves(kube, res):
        return missing
    try:
        have, verb = await _apply(kube, res, want, owned, identity.uid)
    except _NotOurs:
        return _not_ours(kind, identity, "spec.autoscaling")
    except KubeError as exc:
        if exc.not_found:
            seen.forget(res)
            return missing
        return _failed(kind, exc)
    if verb:
        writes.append(Write(verb, kind, name))
    unhealthy = _scaler_health(have, kind, metric)
    if unhealthy is not None:
        return unhealthy
    reason = "HorizontalPodAutoscalerApplied" if kind == asc.HPA_KIND else "ScaledObjectApplied"
    return OptionalState(
        True, reason, asc.describe(want) + "; it writes spec.replicas (the scale subresource)"
    )


async def reconcile_optional(
    kube: KubeClient,
    identity: ServeIdentity,
    spec: LoRAServeSpec,
    settings: DesiredSettings,
    *,
    target_port: int,
) -> OptionalFindings:
    """Apply or delete the serve's InferencePool, HPA and ScaledObject; report what is on and off."""
    seen = discovery(kube)
    found = OptionalFindings()
    for part in ("routing", "autoscaling"):
        try:
            if part == "routing":
                found.routing = await _routing(
                    kube, seen, identity, spec, settings, target_port, found.writes
                )
            else:
                found.autoscaling = await _autoscaling(kube, seen, identity, spec, settings, found.writes)
        except KubeError as exc:  # discovery or a delete refused: report, never fail the pass
            logger.warning("%s of %s/%s: %s", part, identity.namespace, identity.name, exc)
            state = OptionalState(False, "ApplyFailed", f"{exc.status} {exc.reason}: {exc.message}")
            if part == "routing" and spec.routing is not None:
                found.routing = state
            if part == "autoscaling" and spec.autoscaling is not None:
                found.autoscaling = state
    return found
