"""Status computation (pure): phases, conditions with reasons, stable transition times."""

from __future__ import annotations

import pytest

from loraserve.operator import status as st
from loraserve.operator.adapter_state import PodState, PodTrack

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def _deployment(
    ready: int,
    *,
    replicas: int = 2,
    updated: int | None = None,
    generation: int = 1,
    observed: int = 1,
    progress: str = "NewReplicaSetAvailable",
    progress_status: str = "True",
) -> dict:
    return {
        "metadata": {"generation": generation},
        "status": {
            "replicas": replicas,
            "updatedReplicas": replicas if updated is None else updated,
            "readyReplicas": ready,
            "observedGeneration": observed,
            "conditions": [{"type": "Progressing", "status": progress_status, "reason": progress}],
        },
    }


def _serve(**kw) -> dict:
    findings = st.ServeFindings(generation=3, desired_replicas=2, selector="a=b", adapters=2, **kw)
    return st.serve_status(findings, None, now=T0)


def _conditions(status: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


@pytest.mark.parametrize(
    "deployment,phase,progressing",
    [
        (None, "Pending", ("True", "Creating")),
        (_deployment(2), "Running", ("False", "RolloutComplete")),
        (_deployment(1, updated=1), "Progressing", ("True", "RollingOut")),
        (_deployment(2, generation=2, observed=1), "Progressing", ("True", "RollingOut")),
        (_deployment(0, progress="ReplicaSetUpdated"), "Progressing", ("True", "WaitingForReplicas")),
        (_deployment(1), "Degraded", ("False", "ReplicasUnavailable")),
        (
            _deployment(1, progress="ProgressDeadlineExceeded", progress_status="False"),
            "Degraded",
            ("False", "ProgressDeadlineExceeded"),
        ),
    ],
)
def test_serve_phase_follows_the_deployment(deployment: dict | None, phase: str, progressing: tuple) -> None:
    status = _serve(deployment=deployment)
    assert status["phase"] == phase
    conditions = _conditions(status)
    assert conditions["Progressing"] == progressing
    assert conditions["Compatible"] == ("True", "PolicySatisfied")
    assert conditions["Degraded"][0] == ("True" if phase == "Degraded" else "False")
    assert status["observedGeneration"] == 3 and status["adapters"] == 2 and status["selector"] == "a=b"


def test_rejected_spec_keeps_serving() -> None:
    """Rejected spec keeps serving when pods run."""
    violation = "spec.lora.maxLorasPerBatch: 16 > spec.lora.maxLoadedLoras 8; fix: lower it"
    serving = _serve(violations=[violation], deployment=_deployment(2))
    assert serving["phase"] == "Degraded"
    conditions = _conditions(serving)
    assert conditions["Compatible"] == ("False", "PolicyViolation")
    assert conditions["Available"] == ("True", "PreviousSpecServing")
    message = next(c["message"] for c in serving["conditions"] if c["type"] == "Compatible")
    assert violation in message
    nothing = _serve(invalid=["spec.replicas: must be >= 0"], deployment=None)
    assert nothing["phase"] == "Failed" and _conditions(nothing)["Compatible"] == ("False", "InvalidSpec")
    blocked = _serve(blockers=["spec.model.source: claim 'x' is not mounted; fix: ..."], deployment=None)
    assert _conditions(blocked)["Compatible"] == ("False", "NotRunnable")


def test_transition_time_on_flip_only() -> None:
    """Transition time moves only when a condition flips."""
    findings = st.ServeFindings(generation=1, desired_replicas=2, deployment=_deployment(2))
    first = st.serve_status(findings, None, now=T0)
    again = st.serve_status(findings, first, now=T1)
    assert again == first, "nothing new observed: the same status, so nothing is written"
    assert st.status_patch(first, again) is None
    degraded = st.serve_status(
        st.ServeFindings(generation=1, desired_replicas=2, deployment=_deployment(1)), first, now=T1
    )
    times = {c["type"]: c["lastTransitionTime"] for c in degraded["conditions"]}
    assert times["Degraded"] == T1 and times["Compatible"] == T0


def test_status_patch_removes_keys() -> None:
    """Status patch removes keys and nested fields."""
    old = {
        "phase": "Running",
        "effective": {"algorithm": "EAGLE", "requestedAlgorithm": "NEXTN"},
        "warnings": ["w"],
    }
    new = {"phase": "Running", "effective": {"algorithm": "NONE"}}
    patch = st.status_patch(old, new)
    assert patch == {"effective": {"algorithm": "NONE", "requestedAlgorithm": None}, "warnings": None}


def _track(pod: str, state: PodState, message: str = "") -> PodTrack:
    return PodTrack(pod=pod, pod_ip="10.0.0.1", pod_uid="u", state=state, message=message, since=0.0)


@pytest.mark.parametrize(
    "findings,phase,reason",
    [
        (st.AdapterFindings(generation=1, serve_found=False), "Pending", "ServeNotFound"),
        (st.AdapterFindings(generation=1, ready_pods=0), "Pending", "NoReadyPods"),
        (st.AdapterFindings(generation=1, invalid=["spec.source: bad"]), "Failed", "InvalidSpec"),
        (st.AdapterFindings(generation=1, tracks=[_track("a", PodState.LOADED)] * 2), "Ready", "Loaded"),
        (
            st.AdapterFindings(
                generation=1, tracks=[_track("a", PodState.LOADED), _track("b", PodState.LOADING)]
            ),
            "Loading",
            "Loading",
        ),
        (
            st.AdapterFindings(
                generation=1, tracks=[_track("a", PodState.LOADED), _track("b", PodState.FAILED, "x")]
            ),
            "Degraded",
            "LoadFailed",
        ),
        (
            st.AdapterFindings(generation=1, tracks=[_track("a", PodState.FAILED, "rank 128 > 64")]),
            "Failed",
            "LoadFailed",
        ),
    ],
)
def test_adapter_phase_and_reason(findings: st.AdapterFindings, phase: str, reason: str) -> None:
    status = st.adapter_status(findings, None, now=T0)
    assert status["phase"] == phase
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == reason and ready["status"] == ("True" if phase == "Ready" else "False")
    assert status["loadedReplicas"] == sum(t.state is PodState.LOADED for t in findings.tracks)


def test_pod_list_clips_runtime_message() -> None:
    """Adapter pod list carries the runtime message clipped."""
    long = "x" * 10_000
    tracks = [_track("b", PodState.FAILED, long), _track("a", PodState.LOADED)]
    status = st.adapter_status(st.AdapterFindings(generation=2, tracks=tracks), None, now=T0)
    assert [p["pod"] for p in status["pods"]] == ["a", "b"]
    failed = status["pods"][1]
    assert (
        failed["state"] == "Failed"
        and len(failed["message"]) == st.MAX_MESSAGE
        and failed["podIP"] == "10.0.0.1"
    )
    assert failed["time"] == "1970-01-01T00:00:00Z"


def test_on_demand_pods_dont_hold_phase() -> None:
    """Pods that load on demand are listed but do not hold the phase back."""
    placed = PodTrack(pod="p0", pod_ip="10.0.0.1", pod_uid="u0", state=PodState.LOADED, since=0.0)
    others = [
        PodTrack(pod="p1", pod_ip="10.0.0.2", pod_uid="u1", state=PodState.REGISTERED, since=0.0),
        PodTrack(pod="p2", pod_ip="10.0.0.3", pod_uid="u2", state=PodState.LOADED, since=0.0),
    ]
    findings = st.AdapterFindings(
        generation=1, tracks=[placed], ready_pods=3, others=others, accept_length=2.5, warnings=("w",)
    )
    status = st.adapter_status(findings, None, now="2026-01-01T00:00:00Z")
    assert status["phase"] == "Ready"
    assert [(p["pod"], p["state"]) for p in status["pods"]] == [
        ("p0", "Loaded"),
        ("p1", "Registered"),
        ("p2", "Loaded"),
    ]
    assert status["loadedReplicas"] == 2 and status["registeredReplicas"] == 1
    assert status["acceptLength"] == 2.5 and status["warnings"] == ["w"]
    assert "1/1 placed pods; 2 more load it on demand" in status["conditions"][0]["message"]
