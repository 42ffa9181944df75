"""Status of LoRAServe and Adapter objects, computed from what was observed (pure).

Conditions follow the Kubernetes convention: ``lastTransitionTime`` moves only when a
condition's status flips, so a reconcile that observes nothing new produces a status equal
to the stored one and writes nothing.
"""

from __future__ import annotations

import collections
import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .adapter_state import PodState, PodTrack, PodVersion, lagging, summarise
from .diff import replace_patch
from .specs import AdapterPhase, ConditionType, EffectiveSpeculative, LoRAServePhase

MAX_MESSAGE = 4096  # the CRDs' maxLength for per-pod and warning messages


def iso(ts: float) -> str:
    """A wall-clock time as RFC 3339 (seconds), as Kubernetes writes times."""
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def condition(
    previous: Sequence[Mapping] | None,
    type_: str,
    status: bool,
    reason: str,
    message: str,
    *,
    generation: int | None,
    now: str,
) -> dict:
    """One condition, keeping the previous transition time when the status did not flip."""
    value = "True" if status else "False"
    before = next((c for c in previous or () if c.get("type") == type_), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == value else None
    out = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": clip(message, 32768),
        "lastTransitionTime": since or now,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


# --------------------------------------------------------------------------- LoRAServe


@dataclass(frozen=True)
class OptionalState:
    """The Routing or Autoscaling condition of a serve: is the feature on, and if not, why."""

    active: bool
    reason: str
    message: str


OPTIONAL_CONDITIONS = (ConditionType.ROUTING, ConditionType.AUTOSCALING)


@dataclass(frozen=True)
class ServeFindings:
    """What a LoRAServe reconcile learned, as input to its status."""

    generation: int | None
    desired_replicas: int
    invalid: Sequence[str] = ()
    """The spec does not parse (each entry names a field)."""
    violations: Sequence[str] = ()
    """Compatibility-policy violations, in the user's field names."""
    blockers: Sequence[str] = ()
    """Other reasons no pods can be built (missing volume claim, missing Secret...)."""
    warnings: Sequence[str] = ()
    effective: EffectiveSpeculative | None = None
    deployment: Mapping | None = None
    """The Deployment as observed after this reconcile's writes."""
    desired_hash: str | None = None
    selector: str | None = None
    adapters: int = 0
    routing: OptionalState | None = None
    """spec.routing's outcome (None: not asked for, or the spec was not applied)."""
    autoscaling: OptionalState | None = None
    """spec.autoscaling's outcome (None: not asked for, or the spec was not applied)."""

    @property
    def compatible(self) -> bool:
        return not (self.invalid or self.violations or self.blockers)


def _deployment_numbers(deployment: Mapping | None) -> dict[str, int]:
    status = (deployment or {}).get("status") or {}
    return {
        key: int(status.get(key) or 0)
        for key in ("replicas", "readyReplicas", "updatedReplicas", "availableReplicas", "observedGeneration")
    }


def _deployment_condition(deployment: Mapping | None, type_: str) -> Mapping:
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return cond
    return {}


def serve_status(findings: ServeFindings, previous: Mapping | None, *, now: str) -> dict:
    """``LoRAServe.status`` from one reconcile's findings."""
    prev_conds = (previous or {}).get("conditions") or []
    gen = findings.generation
    numbers = _deployment_numbers(findings.deployment)
    want, ready = findings.desired_replicas, numbers["readyReplicas"]
    conds: list[dict] = []

    def add(type_: ConditionType, status: bool, reason: str, message: str) -> None:
        conds.append(condition(prev_conds, type_.value, status, reason, message, generation=gen, now=now))

    if not findings.compatible:
        if findings.invalid:
            reason, lines = "InvalidSpec", findings.invalid
        elif findings.violations:
            reason, lines = "PolicyViolation", findings.violations
        else:
            reason, lines = "NotRunnable", findings.blockers
        message = "; ".join([*findings.invalid, *findings.violations, *findings.blockers])
        add(ConditionType.COMPATIBLE, False, reason, message)
        serving = findings.deployment is not None and ready > 0
        phase = LoRAServePhase.DEGRADED if serving else LoRAServePhase.FAILED
        add(ConditionType.PROGRESSING, False, "SpecRejected", "the spec is not applied: " + lines[0])
        add(
            ConditionType.AVAILABLE,
            serving,
            "PreviousSpecServing" if serving else "NoReplicasReady",
            f"{ready}/{want} replicas ready" + (" with the previous spec" if serving else ""),
        )
        add(ConditionType.DEGRADED, True, "SpecRejected", message)
    else:
        add(ConditionType.COMPATIBLE, True, "PolicySatisfied", "the spec is servable by this runtime")
        phase, progressing, reason, message = _rollout(findings, numbers)
        add(ConditionType.PROGRESSING, progressing, reason, message)
        add(
            ConditionType.AVAILABLE,
            ready > 0,
            "MinimumReplicasAvailable" if ready > 0 else "NoReplicasReady",
            f"{ready}/{want} replicas ready",
        )
        degraded = phase is LoRAServePhase.DEGRADED
        add(
            ConditionType.DEGRADED,
            degraded,
            reason if degraded else "AsExpected",
            message if degraded else "",
        )

    for type_, state in zip(OPTIONAL_CONDITIONS, (findings.routing, findings.autoscaling), strict=True):
        if state is not None:
            add(type_, state.active, state.reason, state.message)
        elif not findings.compatible:
            # The spec is not applied, so neither are its routing / autoscaling changes: keep saying
            # what runs (the objects made for the previous spec are left as they are).
            conds += [c for c in prev_conds if c.get("type") == type_.value]

    status: dict = {
        "observedGeneration": gen,
        "phase": phase.value,
        "conditions": conds,
        "replicas": numbers["replicas"],
        "readyReplicas": ready,
        "selector": findings.selector,
        "effective": findings.effective.to_dict() if findings.effective else None,
        "warnings": [clip(w) for w in findings.warnings][:64],
        "adapters": findings.adapters,
    }
    return {k: v for k, v in status.items() if v is not None}


def _rollout(findings: ServeFindings, numbers: Mapping[str, int]) -> tuple[LoRAServePhase, bool, str, str]:
    """(phase, Progressing status, reason, message) of a compatible serve."""
    deployment = findings.deployment
    want = findings.desired_replicas
    ready, updated, total = numbers["readyReplicas"], numbers["updatedReplicas"], numbers["replicas"]
    if deployment is None:
        return LoRAServePhase.PENDING, True, "Creating", "creating the runtime Deployment"
    if want == 0:
        return LoRAServePhase.PENDING, False, "ScaledToZero", "spec.replicas is 0"
    progress = _deployment_condition(deployment, "Progressing")
    if progress.get("status") == "False" and progress.get("reason") == "ProgressDeadlineExceeded":
        return LoRAServePhase.DEGRADED, False, "ProgressDeadlineExceeded", str(progress.get("message") or "")
    generation = int(((deployment.get("metadata") or {}).get("generation")) or 0)
    rolling = numbers["observedGeneration"] < generation or updated < want or total > updated
    if rolling:
        return (
            LoRAServePhase.PROGRESSING,
            True,
            "RollingOut",
            f"{updated}/{want} replicas updated, {ready} ready (config {findings.desired_hash})",
        )
    if ready >= want:
        return LoRAServePhase.RUNNING, False, "RolloutComplete", f"{ready}/{want} replicas ready"
    if progress.get("reason") == "NewReplicaSetAvailable":
        # The rollout had completed: replicas were lost since (crashes, evictions, nodes).
        return LoRAServePhase.DEGRADED, False, "ReplicasUnavailable", f"{ready}/{want} replicas ready"
    return LoRAServePhase.PROGRESSING, True, "WaitingForReplicas", f"{ready}/{want} replicas ready"


# --------------------------------------------------------------------------- Adapter


@dataclass(frozen=True)
class AdapterFindings:
    """What an Adapter reconcile learned, as input to its status."""

    generation: int | None
    tracks: Sequence[PodTrack] = ()
    serve_found: bool = True
    ready_pods: int = 0
    invalid: Sequence[str] = ()
    """Problems of the Adapter itself that no pod can fix (spec, unmounted claim...)."""
    rank: int | None = None
    target_modules: Sequence[str] | None = None
    warnings: Sequence[str] = ()
    others: Sequence[PodTrack] = ()
    """Pods that do not keep the adapter warm (placement): they load it on demand."""
    accept_length: float | None = None
    version: str | None = None
    """The version of the spec, as the pods that list it compute it (None: none lists it yet)."""
    versions: Mapping[str, PodVersion] = field(default_factory=dict)
    """Which versions each pod serves (pods whose runtime lists versions)."""
    progress: Mapping[str, str] = field(default_factory=dict)
    """Pods loading the adapter now: what the load waits on, in words."""


def pods_status(
    tracks: Iterable[PodTrack],
    versions: Mapping[str, PodVersion] | None = None,
    progress: Mapping[str, str] | None = None,
) -> list[dict]:
    """The per-pod list of an Adapter's status, sorted by pod name: state, the version it
    serves and the ones still draining, and what a load in progress waits on."""
    out = []
    for track in sorted(tracks, key=lambda t: t.pod):
        known = (versions or {}).get(track.pod)
        entry = {
            "pod": track.pod,
            "podIP": track.pod_ip or None,
            "state": track.state.value,
            "draft": track.draft.value if track.draft is not None else None,
            "version": known.serving if known is not None else None,
            "drainingVersions": list(known.draining) if known is not None and known.draining else None,
            "time": iso(track.since),
        }
        # A failure's reason stays; any other state shows what a load in progress waits on.
        live = None if track.state is PodState.FAILED else (progress or {}).get(track.pod)
        message = live or track.message
        if message:
            entry["message"] = clip(message)
        out.append({k: v for k, v in entry.items() if v is not None})
    return out


def _versions_message(findings: AdapterFindings, behind: Mapping[str, str]) -> str:
    """``2 of 3 pods serve version abc, 1 still serves def``."""
    total = len(findings.tracks)
    olds = collections.Counter(behind.values())
    still = ", ".join(
        f"{n} still serve{'s' if n == 1 else ''} {version}" for version, n in sorted(olds.items())
    )
    current = f"version {findings.version}" if findings.version else "the spec's version (no pod lists it yet)"
    return f"{total - len(behind)} of {total} pods serve {current}, {still}"


def _progress_message(findings: AdapterFindings) -> str:
    """``; pod-b: loading <source> for 3 s: connecting ...`` for the pods loading now (empty: none)."""
    targeted = {t.pod for t in findings.tracks}
    lines = [f"{pod}: {text}" for pod, text in sorted(findings.progress.items()) if pod in targeted]
    return "".join(f"; {line}" for line in lines)


def adapter_phase(findings: AdapterFindings) -> tuple[AdapterPhase, str, str]:
    """(phase, reason, message) of an Adapter."""
    if findings.invalid:
        return AdapterPhase.FAILED, "InvalidSpec", "; ".join(findings.invalid)
    if not findings.serve_found:
        return AdapterPhase.PENDING, "ServeNotFound", "the LoRAServe named by spec.serve does not exist (yet)"
    if not findings.tracks:
        if findings.ready_pods == 0:
            return AdapterPhase.PENDING, "NoReadyPods", "the serve has no ready pods yet"
        return AdapterPhase.PENDING, "Placing", "choosing pods"
    phase = summarise(findings.tracks)
    loaded = sum(t.state is PodState.LOADED for t in findings.tracks)
    failed = [t for t in findings.tracks if t.state is PodState.FAILED]
    total = len(findings.tracks)
    on_demand = len(findings.others)
    behind = lagging(findings.tracks, findings.versions)
    if phase is AdapterPhase.READY and behind:
        # Ready only once every targeted pod serves the spec's version (old ones may drain).
        return AdapterPhase.LOADING, "VersionRolling", _versions_message(findings, behind)
    if phase is AdapterPhase.READY:
        if on_demand:
            return phase, "Loaded", f"kept loaded on {loaded}/{total} placed pods; {on_demand} more load it on demand"
        return phase, "Loaded", f"loaded on {loaded}/{total} pods"
    if failed:
        first = failed[0]
        message = f"failed on {len(failed)}/{total} pods ({first.pod}: {first.message})"
        return phase, "LoadFailed", message
    rolling = f"; {_versions_message(findings, behind)}" if behind else ""
    reason = "VersionRolling" if behind else "Loading"
    return phase, reason, f"loaded on {loaded}/{total} pods{_progress_message(findings)}{rolling}"


def adapter_status(findings: AdapterFindings, previous: Mapping | None, *, now: str) -> dict:
    """``Adapter.status`` from one reconcile's findings."""
    prev_conds = (previous or {}).get("conditions") or []
    gen = findings.generation
    phase, reason, message = adapter_phase(findings)
    conds = [
        condition(prev_conds, "Ready", phase is AdapterPhase.READY, reason, message, generation=gen, now=now),
        condition(
            prev_conds,
            ConditionType.PROGRESSING.value,
            phase in (AdapterPhase.LOADING, AdapterPhase.PENDING),
            reason,
            message,
            generation=gen,
            now=now,
        ),
        condition(
            prev_conds,
            ConditionType.DEGRADED.value,
            phase in (AdapterPhase.DEGRADED, AdapterPhase.FAILED),
            reason if phase in (AdapterPhase.DEGRADED, AdapterPhase.FAILED) else "AsExpected",
            message if phase in (AdapterPhase.DEGRADED, AdapterPhase.FAILED) else "",
            generation=gen,
            now=now,
        ),
    ]
    status: dict = {
        "observedGeneration": gen,
        "phase": phase.value,
        "conditions": conds,
        "version": findings.version,
        "pods": pods_status([*findings.tracks, *findings.others], findings.versions, findings.progress),
        "loadedReplicas": sum(t.state is PodState.LOADED for t in [*findings.tracks, *findings.others]),
        "registeredReplicas": sum(t.state is PodState.REGISTERED for t in findings.others),
        "acceptLength": findings.accept_length,
        "rank": findings.rank,
        "targetModules": list(findings.target_modules) if findings.target_modules is not None else None,
        "warnings": [clip(w) for w in findings.warnings][:64],
    }
    return {k: v for k, v in status.items() if v is not None}


def status_patch(previous: Mapping | None, new: Mapping) -> dict | None:
    """A merge patch turning ``previous`` status into ``new`` (None when they are equal).

    Top-level keys absent from ``new`` are removed; lists and nested objects are replaced
    whole, as the status is always written complete.
    """
    prev = dict(previous or {})
    patch: dict = {}
    for key, value in new.items():
        if prev.get(key) != value:
            patch[key] = replace_patch(prev[key], value) if key in prev else value
    for key in prev:
        if key not in new:
            patch[key] = None
    return patch or None
