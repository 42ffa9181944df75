"""The per-pod adapter state machine, its retry schedule, placement and summary (all pure).

One :class:`PodTrack` follows one adapter on one pod::

    Pending --load--> Loading --ok--> Loaded
       ^                 |
       |   transient,    +--adapter's fault (4xx)--> Failed
       +-- tries left ---+--transient, no tries left--> Failed

A Failed track stays Failed until the Adapter's spec changes (a new generation resets every
track) or the pod is replaced (a new pod is a new track). Loaded tracks whose pod reports
the adapter missing (the runtime restarted) go back to Pending.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from loraserve.operator.specs import AdapterPhase, DraftPodState
from loraserve.operator.specs import AdapterPodState as PodState


@dataclass(frozen=True)
class RetryPolicy:
    """Transient failures: ``max_tries`` tries, waiting ``base * 2**n`` (at most ``cap``) between."""

    max_tries: int = 5
    base_s: float = 5.0
    cap_s: float = 300.0

    def delay_after(self, failed_tries: int) -> float:
        """Seconds to wait after the ``failed_tries``-th failed try (1-based) before the next."""
        if failed_tries < 1:
            raise ValueError(f"failed_tries must be >= 1, got {failed_tries}")
        return min(self.base_s * 2 ** (failed_tries - 1), self.cap_s)

    def schedule(self) -> list[float]:
        """Every wait between tries: ``max_tries - 1`` entries."""
        return [self.delay_after(n) for n in range(1, self.max_tries)]


@dataclass(frozen=True)
class PodTrack:
    """One adapter on one pod."""

    pod: str
    pod_ip: str
    pod_uid: str
    state: PodState = PodState.PENDING
    message: str = ""
    since: float = 0.0  # wall-clock time of the last state change (for status)
    failed_tries: int = 0
    next_try_at: float | None = None  # monotonic time before which no load is sent
    generation: int | None = None  # the Adapter generation this track works for
    draft: DraftPodState | None = None
    """The Adapter's draft adapter on this pod (Adapters with spec.draft only; None: not known)."""


@dataclass(frozen=True)
class LoadOutcome:
    """The result of one load call."""

    ok: bool
    message: str = ""
    transient: bool = True
    retry_in: float | None = None
    """A transient refusal that is no failure (the pod is busy with the adapter): try again
    this soon, without spending one of the retry policy's tries."""


@dataclass(frozen=True)
class PodVersion:
    """Which versions of an adapter one pod serves, from its catalog listing."""

    listed: str
    """The version of the pod's catalog entry for the adapter."""
    current: bool
    """That entry is the Adapter's spec (else the pod's catalog is older than the spec)."""
    serving: str | None = None
    """The version new requests get on this pod (None: none loaded; it loads on demand)."""
    draining: tuple[str, ...] = ()
    """Older versions still finishing their requests."""

    @property
    def old(self) -> str | None:
        """The version this pod still serves in place of the spec's, or None when it has
        caught up (or holds no version at all)."""
        if not self.current:
            return self.serving or self.listed
        return self.serving if self.serving not in (None, self.listed) else None


def new_track(pod: str, pod_ip: str, pod_uid: str, *, generation: int | None, wall: float) -> PodTrack:
    return PodTrack(pod=pod, pod_ip=pod_ip, pod_uid=pod_uid, since=wall, generation=generation)


def _moved(track: PodTrack, state: PodState, message: str, wall: float, **changes: object) -> PodTrack:
    since = track.since if state is track.state and message == track.message else wall
    return dataclasses.replace(track, state=state, message=message, since=since, **changes)


def start_loading(track: PodTrack, wall: float) -> PodTrack:
    """A load is about to be sent."""
    return _moved(track, PodState.LOADING, "", wall)


def observed_loaded(track: PodTrack, wall: float) -> PodTrack:
    """The pod lists the adapter: Loaded, whatever the track thought (no load is sent)."""
    return _moved(track, PodState.LOADED, "", wall, failed_tries=0, next_try_at=None)


def observed_missing(track: PodTrack, wall: float) -> PodTrack:
    """The pod does not list the adapter. A Loaded track lost it (runtime restart): Pending."""
    if track.state is PodState.LOADED:
        return _moved(track, PodState.PENDING, "the pod no longer lists the adapter; loading again", wall)
    return track


def after_load(
    track: PodTrack, outcome: LoadOutcome, policy: RetryPolicy, *, now: float, wall: float
) -> PodTrack:
    """Apply a load result; ``now`` is monotonic time (for the retry clock), ``wall`` is for status."""
    if outcome.ok:
        return _moved(track, PodState.LOADED, "", wall, failed_tries=0, next_try_at=None)
    if outcome.retry_in is not None:
        message = f"retrying in {outcome.retry_in:g} s: {outcome.message}"
        return _moved(track, PodState.PENDING, message, wall, next_try_at=now + outcome.retry_in)
    if not outcome.transient:
        return _moved(track, PodState.FAILED, outcome.message, wall, next_try_at=None)
    tries = track.failed_tries + 1
    if tries >= policy.max_tries:
        message = f"gave up after {tries} tries: {outcome.message}"
        return _moved(track, PodState.FAILED, message, wall, failed_tries=tries, next_try_at=None)
    delay = policy.delay_after(tries)
    message = f"try {tries}/{policy.max_tries} failed, retrying in {delay:g} s: {outcome.message}"
    return _moved(track, PodState.PENDING, message, wall, failed_tries=tries, next_try_at=now + delay)


def due(track: PodTrack, now: float) -> bool:
    """Whether a load should be sent to this pod now."""
    if track.state not in (PodState.PENDING, PodState.LOADING):
        return False
    return track.next_try_at is None or now >= track.next_try_at


def reset_for_generation(track: PodTrack, generation: int | None, wall: float) -> PodTrack:
    """A spec change: failures are forgotten and tried again; Loaded stays until observed."""
    if track.generation == generation:
        return track
    if track.state is PodState.FAILED or track.failed_tries:
        return dataclasses.replace(
            _moved(track, PodState.PENDING, "", wall), failed_tries=0, next_try_at=None, generation=generation
        )
    return dataclasses.replace(track, generation=generation)


def next_wakeup(tracks: Iterable[PodTrack], now: float) -> float | None:
    """Seconds until the earliest scheduled retry, or None when nothing waits on the clock."""
    waits = [t.next_try_at - now for t in tracks if t.state is PodState.PENDING and t.next_try_at is not None]
    return max(0.0, min(waits)) if waits else None


def place(
    adapter: str,
    ready_pods: Sequence[str],
    replicas: int | None,
    holding: Iterable[str],
    load: Mapping[str, int],
) -> list[str]:
    """The pods that should hold ``adapter``: all ready pods, or ``replicas`` of them.

    Pods that already hold it keep it (no churn); the rest are the least loaded (fewest
    adapters). Ties are broken by a hash of (adapter, pod), so adapters placed at the same
    moment spread over the pods instead of piling onto the alphabetically first one.
    """
    pods = sorted(set(ready_pods))
    if replicas is None or replicas >= len(pods):
        return pods
    if replicas <= 0:
        return []
    have = set(holding)

    def rank(pod: str) -> tuple[int, int, str]:
        tie = int.from_bytes(hashlib.sha256(f"{adapter}/{pod}".encode()).digest()[:8], "big")
        return (load.get(pod, 0), tie, pod)

    keep = sorted((p for p in pods if p in have), key=rank)[:replicas]
    rest = sorted((p for p in pods if p not in have), key=rank)
    return sorted(keep + rest[: replicas - len(keep)])


def summarise(tracks: Iterable[PodTrack]) -> AdapterPhase:
    """The Adapter's phase from its per-pod states.

    No targeted pod: Pending. All Loaded: Ready. All Failed: Failed. Some Loaded and some
    Failed: Degraded (it serves, but not everywhere it should). Anything else: Loading.
    """
    states = [t.state for t in tracks]
    if not states:
        return AdapterPhase.PENDING
    if all(s is PodState.LOADED for s in states):
        return AdapterPhase.READY
    if all(s is PodState.FAILED for s in states):
        return AdapterPhase.FAILED
    if PodState.FAILED in states and PodState.LOADING not in states and PodState.PENDING not in states:
        return AdapterPhase.DEGRADED
    return AdapterPhase.LOADING


def lagging(tracks: Iterable[PodTrack], versions: Mapping[str, PodVersion]) -> dict[str, str]:
    """Targeted pods that still serve an older version than the spec's: pod -> that version."""
    out = {}
    for track in tracks:
        known = versions.get(track.pod)
        if known is not None and known.old is not None:
            out[track.pod] = known.old
    return out
