"""The per-pod adapter state machine: retry schedule, fault vs transient, placement, phase."""

from __future__ import annotations

import itertools

import pytest

from loraserve.operator import adapter_state as st
from loraserve.operator.adapter_state import LoadOutcome, PodState, RetryPolicy
from loraserve.operator.specs import AdapterPhase


def _track(**kw) -> st.PodTrack:
    return st.new_track("pod-a", "10.0.0.1", "uid-a", generation=kw.pop("generation", 1), wall=0.0)


@pytest.mark.parametrize("base,cap,tries", [(5.0, 300.0, 5), (0.05, 0.3, 5), (1.0, 3.0, 8), (2.0, 2.0, 3)])
def test_schedule_doubles_to_cap(base: float, cap: float, tries: int) -> None:
    """Schedule doubles from base and stops at cap."""
    policy = RetryPolicy(max_tries=tries, base_s=base, cap_s=cap)
    schedule = policy.schedule()
    assert len(schedule) == tries - 1  # waits between tries, none after the last
    for n, delay in enumerate(schedule):
        assert delay == min(base * 2**n, cap)
    assert all(b >= a for a, b in itertools.pairwise(schedule))
    assert max(schedule) <= cap


def test_default_schedule() -> None:
    """Default schedule is five tries from five seconds."""
    policy = RetryPolicy()
    assert policy.max_tries == 5
    assert policy.schedule() == [5.0 * 2**n for n in range(4)]


def test_transient_failures_back_off() -> None:
    """Transient failures back off then fail after max tries."""
    policy = RetryPolicy(max_tries=5, base_s=5.0, cap_s=300.0)
    track = _track()
    now = 1000.0
    waits = []
    for attempt in range(1, policy.max_tries + 1):
        assert st.due(track, now), f"try {attempt} should be due"
        track = st.start_loading(track, wall=now)
        assert track.state is PodState.LOADING
        track = st.after_load(
            track, LoadOutcome(ok=False, message="connection refused"), policy, now=now, wall=now
        )
        if attempt < policy.max_tries:
            assert track.state is PodState.PENDING
            assert "connection refused" in track.message
            assert not st.due(track, now), "a retry must wait for its backoff"
            waits.append(track.next_try_at - now)
            assert st.next_wakeup([track], now) == pytest.approx(waits[-1])
            now = track.next_try_at
        else:
            assert track.state is PodState.FAILED
            assert f"gave up after {policy.max_tries} tries" in track.message
            assert "connection refused" in track.message
            assert not st.due(track, now + 1e6), "Failed is final until the spec changes"
    assert waits == policy.schedule()


def test_adapter_fault_fails_at_once() -> None:
    """Adapter fault fails at once with the runtime message."""
    policy = RetryPolicy()
    track = st.start_loading(_track(), wall=1.0)
    msg = "adapter rank 128 exceeds max_lora_rank 64"
    track = st.after_load(
        track, LoadOutcome(ok=False, message=msg, transient=False), policy, now=1.0, wall=1.0
    )
    assert track.state is PodState.FAILED
    assert track.message == msg
    assert track.failed_tries == 0
    assert not st.due(track, 1e9)


def test_success_resets_the_retry_clock() -> None:
    policy = RetryPolicy(base_s=1.0)
    track = st.after_load(_track(), LoadOutcome(ok=False, message="503"), policy, now=0.0, wall=0.0)
    assert track.failed_tries == 1
    track = st.after_load(track, LoadOutcome(ok=True), policy, now=5.0, wall=5.0)
    assert track.state is PodState.LOADED
    assert (track.failed_tries, track.next_try_at, track.message) == (0, None, "")


def test_spec_change_retries_failed() -> None:
    """Spec change retries failed tracks and keeps loaded ones."""
    policy = RetryPolicy()
    failed = st.after_load(
        _track(), LoadOutcome(ok=False, message="bad", transient=False), policy, now=0, wall=0
    )
    loaded = st.after_load(_track(), LoadOutcome(ok=True), policy, now=0, wall=0)
    same = st.reset_for_generation(failed, 1, wall=5.0)
    assert same is failed, "the same generation changes nothing"
    retried = st.reset_for_generation(failed, 2, wall=5.0)
    assert retried.state is PodState.PENDING and retried.generation == 2 and st.due(retried, 0.0)
    kept = st.reset_for_generation(loaded, 2, wall=5.0)
    assert kept.state is PodState.LOADED and kept.generation == 2


def test_observations_override_the_track() -> None:
    loaded = st.observed_loaded(_track(), wall=3.0)
    assert loaded.state is PodState.LOADED
    lost = st.observed_missing(loaded, wall=4.0)
    assert lost.state is PodState.PENDING and "no longer lists" in lost.message and st.due(lost, 0.0)
    failed = st.after_load(
        _track(), LoadOutcome(ok=False, message="x", transient=False), RetryPolicy(), now=0, wall=0
    )
    assert st.observed_missing(failed, wall=5.0) is failed, "a missing adapter on a Failed pod stays Failed"


def test_transition_time_moves_only_on_a_change() -> None:
    track = st.start_loading(_track(), wall=10.0)
    again = st.start_loading(track, wall=20.0)
    assert again.since == 10.0
    done = st.observed_loaded(again, wall=30.0)
    assert done.since == 30.0


PODS = [f"serve-{i}" for i in range(6)]


def test_placement_all_takes_every_ready_pod() -> None:
    assert st.place("a", PODS[::-1], None, holding=[], load={}) == sorted(PODS)
    assert st.place("a", PODS, 10, holding=[], load={}) == sorted(PODS)


def test_placement_least_loaded() -> None:
    """Placement takes the least loaded and keeps holders."""
    load = {p: i for i, p in enumerate(PODS)}  # serve-0 least loaded
    assert st.place("a", PODS, 2, holding=[], load=load) == ["serve-0", "serve-1"]
    # Holders keep the adapter even when more loaded (no churn), the rest is filled up.
    assert st.place("a", PODS, 2, holding=["serve-5"], load=load) == ["serve-0", "serve-5"]
    assert st.place("a", PODS, 1, holding=["serve-4", "serve-5"], load=load) == ["serve-4"]
    # A holder that is not ready is not chosen.
    assert st.place("a", PODS[:3], 2, holding=["serve-5"], load=load) == ["serve-0", "serve-1"]


def test_placement_spreads_ties_over_pods() -> None:
    chosen = {st.place(f"adapter-{i}", PODS, 1, holding=[], load={})[0] for i in range(40)}
    assert len(chosen) >= 4, f"40 adapters on equally loaded pods landed on only {chosen}"


@pytest.mark.parametrize(
    "states,phase",
    [
        ([], AdapterPhase.PENDING),
        ([PodState.LOADED, PodState.LOADED], AdapterPhase.READY),
        ([PodState.FAILED, PodState.FAILED], AdapterPhase.FAILED),
        ([PodState.LOADED, PodState.FAILED], AdapterPhase.DEGRADED),
        ([PodState.LOADED, PodState.PENDING], AdapterPhase.LOADING),
        ([PodState.LOADING, PodState.FAILED], AdapterPhase.LOADING),
        ([PodState.PENDING], AdapterPhase.LOADING),
    ],
)
def test_phase_summarises_pod_states(states: list[PodState], phase: AdapterPhase) -> None:
    tracks = [st.PodTrack(pod=f"p{i}", pod_ip="", pod_uid="", state=s) for i, s in enumerate(states)]
    assert st.summarise(tracks) is phase
