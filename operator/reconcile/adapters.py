"""One Adapter reconcile pass: make every targeted ready pod of its serve hold it.

Observe: the Adapter, its LoRAServe, the serve's ready pods and what each pod holds
(``GET /v1/models``). Decide with the pure state machine (``adapter_state``): a pod that
lists the adapter is Loaded and is never asked again; a pod that does not, and whose track
is due, gets ``POST /v1/load_lora_adapter`` with the serve's admin token. Pods that hold it
but are no longer targeted (placement shrank) are asked to unload it. Report per-pod state
and conditions in the status, written only when it changed.

An Adapter with a draft adapter (``spec.draft``) is loaded with it, all or nothing: every
load names the draft, and the per-pod status says whether the pod holds the draft adapter
(from the load's answer, or from the pod's ``GET /v1/lora_catalog``); a pod that holds the
adapter without it is loaded again.

The operator moves no adapter bytes: the runtime fetches the source and checks its sha256.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .. import adapter_state as st
from .. import desired as ds
from ..runtime_client import CatalogState, LoadedAdapter, PodCatalog, PodModels, RuntimeCallError
from ..specs import (
    AdapterSpec,
    DraftPodState,
    LoRAServeSpec,
    PlacementMode,
    SpecError,
    parse_adapter_spec,
    parse_loraserve_spec,
)
from ..status import AdapterFindings, adapter_status, iso, status_patch
from ..translate import public_source, source_problem
from .context import OperatorContext
from .kube import ADAPTERS, LORASERVES, SECRETS, KubeError
from .pods import PodView

logger = logging.getLogger(__name__)


@dataclass
class AdapterMemory:
    """What one Adapter's loop remembers between passes (lost on restart, rebuilt by observing)."""

    tracks: dict[str, st.PodTrack] = field(default_factory=dict)
    restored: bool = False
    warnings: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Warnings pods returned when they loaded the adapter, by pod (this generation)."""
    warnings_generation: int | None = None
    accept_length: float | None = None
    metrics_read_at: float | None = None
    """Monotonic time /metrics was last read for the accept length (bounded rate)."""


@dataclass(frozen=True)
class Note:
    """Something worth a Kubernetes Event."""

    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class AdapterOutcome:
    status: dict = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    wake_in: float | None = None
    """Seconds until a scheduled retry is due (None: nothing scheduled)."""
    gone: bool = False


def restore_tracks(
    status: Mapping | None, generation: int | None, pods: Sequence[PodView], wall: float
) -> dict[str, st.PodTrack]:
    """Failed per-pod states of the current generation, from a status written before a restart.

    Failed is final until the spec changes, so an operator restart must not retry it; every
    other state is re-derived by observing the pods.
    """
    status = status or {}
    if status.get("observedGeneration") != generation:
        return {}
    by_name = {p.name: p for p in pods}
    tracks = {}
    for entry in status.get("pods") or []:
        pod = by_name.get(entry.get("pod"))
        if entry.get("state") != st.PodState.FAILED.value or pod is None or entry.get("podIP") != pod.ip:
            continue
        tracks[pod.name] = st.PodTrack(
            pod=pod.name,
            pod_ip=pod.ip or "",
            pod_uid=pod.uid,
            state=st.PodState.FAILED,
            message=entry.get("message") or "",
            since=wall,
            generation=generation,
            draft=DraftPodState.FAILED if entry.get("draft") == DraftPodState.FAILED.value else None,
        )
    return tracks


async def read_token(
    ctx: OperatorContext, namespace: str, serve_name: str, spec: LoRAServeSpec
) -> str | None:
    """The serve's admin token from its Secret (None when there is none yet).

    Cached for one resync interval: the operator never rotates it, and a runtime reads its
    token once at start, so a pass needs no API call for it.
    """
    key = (namespace, ds.admin_secret_name(serve_name, spec))
    cached = ctx.tokens.get(key)
    if cached is not None and cached[1] > time.monotonic():
        return cached[0]
    secret = await ctx.kube.get(SECRETS, *key)
    token: str | None = None
    if secret:
        data = (secret.get("data") or {}).get(ds.ADMIN_TOKEN_KEY)
        string = (secret.get("stringData") or {}).get(ds.ADMIN_TOKEN_KEY)
        if data:
            token = base64.b64decode(data).decode().strip()
        elif string:
            token = string.strip()
    if token is not None:
        ctx.tokens[key] = (token, time.monotonic() + ctx.config.resync_interval_s)
    return token


async def observe_catalogs(
    ctx: OperatorContext, pods: Sequence[PodView], token: str | None
) -> dict[str, PodCatalog]:
    """``GET /v1/lora_catalog`` on every pod: the listing of each that answered (the others
    are judged by ``GET /v1/models`` alone this pass)."""
    answers = await asyncio.gather(*(ctx.runtime(p, token).catalog() for p in pods), return_exceptions=True)
    listings: dict[str, PodCatalog] = {}
    for pod, answer in zip(pods, answers, strict=True):
        if isinstance(answer, PodCatalog):
            listings[pod.name] = answer
        elif isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer
    return listings


Draft = tuple[str, str | None]
"""A draft adapter as the runtime is asked to load it: (path or URI in the pod, sha256)."""


def listed_draft(listing: PodCatalog | None, name: str, draft: Draft) -> DraftPodState | None:
    """Whether a pod holds ``name``'s draft adapter, from its catalog listing: None when its
    catalog does not list this draft yet (the operator's push is on its way)."""
    entry = listing.adapters.get(name) if listing is not None else None
    if entry is None or entry.draft_source != draft[0]:
        return None
    if draft[1] is not None and entry.draft_sha256 != draft[1]:
        return None
    return {"loaded": DraftPodState.LOADED, "absent": DraftPodState.ABSENT}.get(entry.draft_state or "")


def unreachable_source(field: str, source: str, serve: str) -> str:
    """Why the pods of ``serve`` cannot be asked to load ``source`` (of ``field``)."""
    claim = source[len("pvc://") :].split("/", 1)[0]
    return source_problem(field, source) or (
        f"{field}: claim {claim!r} is not mounted by LoRAServe {serve!r}; fix: mount it there as "
        "spec.storage.adapters (type PersistentVolumeClaim), or use another source"
    )


async def observe_pods(
    ctx: OperatorContext, pods: Sequence[PodView], token: str | None
) -> tuple[dict[str, PodModels], dict[str, str]]:
    """``GET /v1/models`` on every pod: (what each reachable pod holds, why others did not answer)."""
    answers = await asyncio.gather(*(ctx.runtime(p, token).models() for p in pods), return_exceptions=True)
    held: dict[str, PodModels] = {}
    errors: dict[str, str] = {}
    for pod, answer in zip(pods, answers, strict=True):
        if isinstance(answer, PodModels):
            held[pod.name] = answer
        elif isinstance(answer, RuntimeCallError):
            errors[pod.name] = answer.message
        elif isinstance(answer, BaseException):
            if not isinstance(answer, Exception):
                raise answer
            errors[pod.name] = f"{answer.__class__.__name__}: {answer}"
    return held, errors


def source_differs(loaded: LoadedAdapter, wanted_paths: Sequence[str], sha256: str | None) -> bool:
    """A pod holds the adapter's name from another source or digest (the spec changed)."""
    if loaded.source is not None and loaded.source not in wanted_paths:
        return True
    return sha256 is not None and loaded.sha256 is not None and loaded.sha256 != sha256


def declaration_mismatch(spec: AdapterSpec, loaded: LoadedAdapter) -> str | None:
    """Why the file contradicts the Adapter's declared rank / target modules (None: it agrees)."""
    if spec.rank is not None and loaded.rank is not None and loaded.rank != spec.rank:
        return f"spec.rank is {spec.rank} but the adapter file has rank {loaded.rank}; fix: declare {loaded.rank} or drop spec.rank"
    if spec.target_modules is not None and loaded.target_modules is not None:
        declared, actual = set(spec.target_modules), set(loaded.target_modules)
        if declared != actual:
            return (
                f"spec.targetModules is {sorted(declared)} but the adapter file targets {sorted(actual)}; "
                "fix: declare what the file targets or drop spec.targetModules"
            )
    return None


async def reconcile_adapter(
    ctx: OperatorContext,
    body: Mapping,
    memory: AdapterMemory,
    pods: Sequence[PodView],
    *,
    serve_body: Mapping | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> AdapterOutcome:
    """Run one pass for the Adapter ``body`` (freshly read) over its serve's ``pods``.

    ``serve_body`` is the serve as just read by the caller (read here when not given or
    when it is not the serve the Adapter names).
    """
    meta = body.get("metadata") or {}
    now, wall = time.monotonic(), time.time()
    run = _Pass(ctx, meta["name"], meta["namespace"], meta.get("generation"), body.get("status"), now, wall)
    # Observe: the Adapter, its serve, where the adapter lies in the pods, what the pods hold.
    wanted = await _read_wanted(run, body, memory, serve_body)
    if wanted is None:
        return run.outcome
    observed = await _observe(run, body, memory, pods, wanted)
    # Diff: each targeted pod's track against what it holds.
    diff = _diff(run, memory, observed, wanted)
    # Act: load where due, unload a file that contradicts the declaration, demote the others.
    await _load_due(run, memory, observed, wanted, diff, stopping)
    if run.outcome.gone:  # the Adapter was deleted while its Loading status was written
        return run.outcome
    await _unload_refused(run, observed, diff)
    others = await _others(
        ctx,
        run.outcome,
        run.name,
        wanted.spec,
        wanted.lora_path,
        observed.token,
        observed.usable,
        set(observed.targets),
        observed.held,
        observed.unreachable,
        run.wall,
        wanted.draft,
        observed.listings,
    )
    # Report: the status and when the next retry is due.
    await _report_pass(run, memory, pods, observed, wanted, diff, others)
    return run.outcome


@dataclass
class _Pass:
    """One pass over an Adapter: which it is, when the pass runs, what it has reported."""

    ctx: OperatorContext
    name: str
    namespace: str
    generation: int | None
    previous_status: Mapping | None
    now: float
    wall: float
    outcome: AdapterOutcome = field(default_factory=AdapterOutcome)
    versions: Versions = field(default_factory=lambda: Versions())
    """What the pods' listings said of the adapter's versions and loads, last read."""

    async def report(self, findings: AdapterFindings) -> None:
        """Write the status ``findings`` make, when it changed; an Adapter gone meanwhile is noted."""
        self.outcome.status = adapter_status(findings, self.previous_status, now=iso(self.wall))
        patch = status_patch(self.previous_status, self.outcome.status)
        if patch is None:
            return
        try:
            await self.ctx.kube.patch(
                ADAPTERS, self.namespace, self.name, {"status": patch}, subresource="status"
            )
        except KubeError as exc:
            if not exc.not_found:
                raise
            self.outcome.gone = True
        self.previous_status = self.outcome.status


@dataclass(frozen=True)
class _Wanted:
    """What the Adapter asks for: its spec, its path in the serve's pods, its draft adapter."""

    spec: AdapterSpec
    serve_spec: LoRAServeSpec
    lora_path: str
    draft: Draft | None


@dataclass(frozen=True)
class _Observed:
    """What the serve's pods hold this pass, and the pods the Adapter targets."""

    usable: list[PodView]
    token: str | None
    held: dict[str, PodModels]
    unreachable: dict[str, str]
    listings: Mapping[str, PodCatalog]
    targets: list[str]

    @property
    def by_name(self) -> dict[str, PodView]:
        return {p.name: p for p in self.usable}


@dataclass(frozen=True)
class Versions:
    """The spec's version and what each pod serves and is loading, from the pods' listings."""

    version: str | None = None
    pods: Mapping[str, st.PodVersion] = field(default_factory=dict)
    progress: Mapping[str, str] = field(default_factory=dict)


def identity(wanted_path: str, spec: AdapterSpec, draft: Draft | None) -> tuple:
    """The catalog identity of the Adapter's spec, as a pod's listing states its entry's
    (source and draft in the pod, as the serve's catalog writes them)."""
    return (wanted_path, spec.sha256, draft[0] if draft else None, draft[1] if draft else None)


def read_versions(listings: Mapping[str, PodCatalog], name: str, wanted: tuple, source: str) -> Versions:
    """Each listing pod's versions of ``name`` against the spec's identity ``wanted``, and
    what loads in progress wait on (``source`` as the public may see it)."""
    version, pods, progress = None, {}, {}
    for pod, listing in listings.items():
        entry = listing.adapters.get(name)
        if entry is None:
            continue
        if entry.state == "loading" and (entry.waiting_on or entry.loading_for_s is not None):
            progress[pod] = loading_words(source, entry)
        if entry.version is None:
            continue  # a runtime that does not list versions: judged by its tracks alone
        current = entry.identity() == wanted
        version = entry.version if current else version
        serving = entry.serving_versions
        pods[pod] = st.PodVersion(
            listed=entry.version,
            current=current,
            serving=serving[0] if serving else None,
            draining=serving[1:],
        )
    return Versions(version, pods, progress)


def loading_words(source: str, entry: CatalogState) -> str:
    """``loading <source> for 12.3 s: <what the load is doing>`` (the runtime's words, e.g.
    ``connecting https://host/path``, ``waiting another process's download of …``)."""
    took = f" for {entry.loading_for_s:g} s" if entry.loading_for_s is not None else ""
    doing = f": {entry.waiting_on}" if entry.waiting_on else ""
    return f"loading {source}{took}{doing}"


@dataclass
class _Diff:
    """Each targeted pod's track after observing it, and what the pass must do about it."""

    tracks: dict[str, st.PodTrack] = field(default_factory=dict)
    reload: set[str] = field(default_factory=set)
    refuse: dict[str, str] = field(default_factory=dict)
    """Pod -> why the file it holds contradicts the declaration."""
    seen: LoadedAdapter | None = None
    """What a pod says about the file (rank, modules)."""
    drafts: dict[str, DraftPodState] = field(default_factory=dict)
    """What this pass learned of each pod's draft adapter."""
    loaded_now: list[str] = field(default_factory=list)
    """Pods this pass's loads succeeded on: their listings are read again for the status."""


async def _read_wanted(
    run: _Pass, body: Mapping, memory: AdapterMemory, serve_body: Mapping | None
) -> _Wanted | None:
    """The Adapter's spec and its serve's; None once a finding that ends the pass is reported
    (an invalid spec, a serve missing or invalid, a source the pods cannot reach)."""
    try:
        spec: AdapterSpec = parse_adapter_spec(dict(body.get("spec") or {}))
    except SpecError as exc:
        memory.tracks.clear()
        await run.report(AdapterFindings(generation=run.generation, invalid=exc.problems))
        return None
    if serve_body is None or (serve_body.get("metadata") or {}).get("name") != spec.serve:
        serve_body = await run.ctx.kube.get(LORASERVES, run.namespace, spec.serve)
    if serve_body is None or (serve_body.get("metadata") or {}).get("deletionTimestamp"):
        memory.tracks.clear()
        await run.report(AdapterFindings(generation=run.generation, serve_found=False))
        return None
    try:
        serve_spec = parse_loraserve_spec(dict(serve_body.get("spec") or {}))
    except SpecError:
        await run.report(AdapterFindings(generation=run.generation, ready_pods=0))
        return None
    return await _pod_paths(run, memory, spec, serve_spec)


async def _pod_paths(
    run: _Pass, memory: AdapterMemory, spec: AdapterSpec, serve_spec: LoRAServeSpec
) -> _Wanted | None:
    """Where the adapter and its draft adapter lie in the serve's pods; None once a source
    they cannot reach is reported."""
    lora_path = ds.adapter_pod_path(spec.source, serve_spec.storage)
    draft_path = (
        ds.adapter_pod_path(spec.draft.source, serve_spec.storage) if spec.draft is not None else None
    )
    # An Adapter is served with the draft adapter it names or not at all.
    unreachable_sources = [("spec.source", spec.source)] if lora_path is None else []
    if spec.draft is not None and draft_path is None:
        unreachable_sources.append(("spec.draft.source", spec.draft.source))
    if unreachable_sources:
        memory.tracks.clear()
        problems = [unreachable_source(field, source, spec.serve) for field, source in unreachable_sources]
        await run.report(AdapterFindings(generation=run.generation, invalid=problems))
        return None
    draft: Draft | None = (draft_path, spec.draft.sha256) if spec.draft is not None and draft_path else None
    return _Wanted(spec, serve_spec, lora_path, draft)


async def _observe(
    run: _Pass, body: Mapping, memory: AdapterMemory, pods: Sequence[PodView], wanted: _Wanted
) -> _Observed:
    """What each usable pod holds (and lists, for a draft adapter), and the pods to target."""
    spec = wanted.spec
    usable = sorted((p for p in pods if p.usable), key=lambda p: p.name)
    if not memory.restored:
        memory.tracks.update(restore_tracks(body.get("status"), run.generation, usable, run.wall))
        memory.restored = True
    token = await read_token(run.ctx, run.namespace, spec.serve, wanted.serve_spec)
    held, unreachable = await observe_pods(run.ctx, usable, token)
    # The listings say which versions each pod serves, what a load waits on, and the draft
    # adapter's state: read every pass.
    answering = [p for p in usable if p.name in held]
    listings = await observe_catalogs(run.ctx, answering, token)
    if memory.warnings_generation != run.generation:
        memory.warnings = _restored_warnings(body.get("status"), run.generation, memory.warnings_generation)
        memory.warnings_generation = run.generation
    run.versions = read_versions(
        listings, run.name, identity(wanted.lora_path, spec, wanted.draft), public_source(spec.source)
    )
    return _Observed(usable, token, held, unreachable, listings, _targets(run.name, spec, usable, held))


def _targets(
    name: str, spec: AdapterSpec, usable: Sequence[PodView], held: Mapping[str, PodModels]
) -> list[str]:
    """The pods to hold the adapter: its replicas placed by load, or every usable pod."""
    holding = {pod for pod, models in held.items() if name in models.loaded}
    load = {pod: len(models.loaded) for pod, models in held.items()}
    if spec.placement.mode is PlacementMode.REPLICAS:
        return st.place(name, list(held), spec.placement.replicas, holding, load)
    return [p.name for p in usable]


def _diff(run: _Pass, memory: AdapterMemory, observed: _Observed, wanted: _Wanted) -> _Diff:
    """Each targeted pod's track against what the pod holds."""
    diff = _Diff()
    by_name = observed.by_name
    for pod in observed.targets:
        track = _pod_track(run, memory.tracks.get(pod), by_name[pod])
        diff.tracks[pod] = _observed_track(run, observed, wanted, diff, pod, track)
    return diff


def _pod_track(run: _Pass, track: st.PodTrack | None, view: PodView) -> st.PodTrack:
    """The pod's track for this generation: new for a new pod (or a new pod of that name)."""
    if track is None or track.pod_uid != view.uid:
        track = st.new_track(view.name, view.ip or "", view.uid, generation=run.generation, wall=run.wall)
    track = st.reset_for_generation(track, run.generation, run.wall)
    if track.pod_ip != (view.ip or ""):
        track = dataclasses.replace(track, pod_ip=view.ip or "")
    return track


def _observed_track(
    run: _Pass, observed: _Observed, wanted: _Wanted, diff: _Diff, pod: str, track: st.PodTrack
) -> st.PodTrack:
    """``track`` after what ``pod`` holds; a pod to load again, or to refuse, goes in ``diff``."""
    name, spec, draft = run.name, wanted.spec, wanted.draft
    loaded = observed.held[pod].loaded.get(name) if pod in observed.held else None
    if pod in observed.unreachable:
        if track.state is not st.PodState.FAILED:
            track = dataclasses.replace(track, message=f"pod not answering: {observed.unreachable[pod]}")
    elif loaded is not None and source_differs(loaded, (wanted.lora_path, spec.source), spec.sha256):
        track = _new_version(run, diff, pod, track)
    elif (
        loaded is not None
        and draft
        and listed_draft(observed.listings.get(pod), name, draft) is DraftPodState.ABSENT
    ):
        # Loaded without its draft adapter (loaded before the Adapter named one): load both.
        diff.reload.add(pod)
        track = _load_again(track)
    elif loaded is not None and (why := declaration_mismatch(spec, loaded)):
        diff.refuse[pod] = why
    elif loaded is not None and loaded.warm is False:
        # Loaded on demand, now placed here: the load call keeps it warm (no refetch).
        if track.state is not st.PodState.FAILED:
            track = dataclasses.replace(track, state=st.PodState.PENDING, next_try_at=None)
    elif loaded is not None:
        diff.seen = diff.seen or loaded
        track = st.observed_loaded(track, run.wall)
        if draft and (known := listed_draft(observed.listings.get(pod), name, draft)) is not None:
            diff.drafts[pod] = known
    else:
        track = st.observed_missing(track, run.wall)
    return track


def _new_version(run: _Pass, diff: _Diff, pod: str, track: st.PodTrack) -> st.PodTrack:
    """``track`` of a pod that holds another version than the spec's.

    A pod that lists versions rolls in place: once its catalog has the spec's entry, a load
    brings the new version in beside the old (requests in flight finish on the old one), so
    nothing is unloaded first; until the catalog push reaches it, it is left alone. A pod
    that lists no versions (an older runtime) unloads the old version, then loads the new.
    """
    known = run.versions.pods.get(pod)
    if known is None:
        diff.reload.add(pod)
        return _load_again(track)
    if not known.current:
        if track.state is st.PodState.FAILED:
            return track
        message = f"serves version {known.old}; waiting for the serve's catalog push of the new one"
        return dataclasses.replace(
            track, state=st.PodState.PENDING, message=message, next_try_at=run.now + DRAINING_RETRY_S
        )
    return _load_again(track)


def _load_again(track: st.PodTrack) -> st.PodTrack:
    """``track`` due for a fresh load (with fresh tries), unless it has failed for good."""
    if track.state is st.PodState.FAILED:
        return track
    return dataclasses.replace(track, state=st.PodState.PENDING, failed_tries=0, next_try_at=None)


async def _load_due(
    run: _Pass,
    memory: AdapterMemory,
    observed: _Observed,
    wanted: _Wanted,
    diff: _Diff,
    stopping: Callable[[], bool],
) -> None:
    """Load the adapter on every answering pod whose track is due, reporting Loading meanwhile."""
    tracks = diff.tracks
    due = [pod for pod, track in tracks.items() if pod in observed.held and st.due(track, run.now)]
    if not due or stopping():
        return
    for pod in due:
        tracks[pod] = st.start_loading(tracks[pod], run.wall)
    memory.tracks = tracks
    by_name = observed.by_name
    # The Loading report and the loads go out together: a load often takes less time
    # than a status write.
    reporting = asyncio.ensure_future(
        run.report(
            _findings(run.generation, tracks, observed.usable, wanted.spec, diff.seen, memory, run.versions)
        )
    )
    loads = asyncio.gather(
        *(
            _load(
                run.ctx,
                by_name[pod],
                observed.token,
                run.name,
                wanted.lora_path,
                wanted.spec,
                wanted.draft,
                unload_first=pod in diff.reload,
                in_place=pod in run.versions.pods,
            )
            for pod in due
        )
    )
    results = await _watched(run, memory, observed, wanted, diff, due, loads)
    await reporting
    if run.outcome.gone:
        return
    run.now, run.wall = time.monotonic(), time.time()
    for pod, result in zip(due, results, strict=True):
        _record_load(run, memory, wanted, diff, pod, *result)


LOADING_POLL_S = 2.0
"""While loads are in flight or a pod reports one in progress, the pods' listings are read
this often, so the status names what a slow load waits on within seconds."""


async def _watched(
    run: _Pass,
    memory: AdapterMemory,
    observed: _Observed,
    wanted: _Wanted,
    diff: _Diff,
    pods: Sequence[str],
    loads: Awaitable[list],
) -> list:
    """``loads``' results, reporting what they wait on meanwhile (:func:`_watch_loads`)."""
    watching = asyncio.ensure_future(_watch_loads(run, memory, observed, wanted, diff, pods))
    try:
        return await loads
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            try:
                await watching
            except KubeError as exc:  # a progress report is best effort: the pass reports again
                logger.info("progress report of %s/%s failed: %s", run.namespace, run.name, exc)


async def _watch_loads(
    run: _Pass, memory: AdapterMemory, observed: _Observed, wanted: _Wanted, diff: _Diff, pods: Sequence[str]
) -> None:
    """While the loads to ``pods`` are in flight: every :data:`LOADING_POLL_S`, read those
    pods' listings and report what each load waits on (a load can take up to its timeout)."""
    by_name = observed.by_name
    loading = [by_name[pod] for pod in pods]
    source = public_source(wanted.spec.source)
    wanted_identity = identity(wanted.lora_path, wanted.spec, wanted.draft)
    while True:
        await asyncio.sleep(LOADING_POLL_S)
        listings = await observe_catalogs(run.ctx, loading, observed.token)
        fresh = read_versions(listings, run.name, wanted_identity, source)
        run.versions = dataclasses.replace(run.versions, progress=fresh.progress)
        await run.report(
            _findings(
                run.generation, diff.tracks, observed.usable, wanted.spec, diff.seen, memory, run.versions
            )
        )


def _record_load(
    run: _Pass,
    memory: AdapterMemory,
    wanted: _Wanted,
    diff: _Diff,
    pod: str,
    result: st.LoadOutcome,
    info: LoadedAdapter | None,
    draft_fault: bool,
) -> None:
    """One pod's load answer into its track, its draft adapter's state and an Event note."""
    draft = wanted.draft
    run.ctx.counters.loads[(run.namespace, pod, run.name)] += 1
    if draft and draft_fault:
        diff.drafts[pod] = DraftPodState.FAILED
    elif draft and info is not None and info.draft_loaded is not None:
        diff.drafts[pod] = DraftPodState.LOADED if info.draft_loaded else DraftPodState.ABSENT
    if result.ok and info is not None and (why := declaration_mismatch(wanted.spec, info)):
        diff.refuse[pod] = why
        return
    if result.ok:
        diff.loaded_now.append(pod)
    if result.ok and info is not None:
        diff.seen = diff.seen or info
        memory.warnings[pod] = info.warnings
    diff.tracks[pod] = st.after_load(diff.tracks[pod], result, run.ctx.retry, now=run.now, wall=run.wall)
    after = diff.tracks[pod]
    if after.state is st.PodState.LOADED:
        run.outcome.notes.append(Note("Normal", "Loaded", f"loaded on pod {pod}"))
    elif after.state is st.PodState.FAILED:
        run.outcome.notes.append(Note("Warning", "LoadFailed", f"pod {pod}: {after.message}"))
    else:
        run.outcome.notes.append(Note("Warning", "LoadRetrying", f"pod {pod}: {after.message}"))


async def _unload_refused(run: _Pass, observed: _Observed, diff: _Diff) -> None:
    """The file is not what the Adapter declares: it must not serve. Unload, fail at once."""
    by_name, tracks = observed.by_name, diff.tracks
    for pod, why in sorted(diff.refuse.items()):
        try:
            await run.ctx.runtime(by_name[pod], observed.token).unload(run.name)
            run.ctx.counters.unloads[(run.namespace, pod, run.name)] += 1
        except RuntimeCallError as exc:
            logger.warning("unloading %s/%s from pod %s failed: %s", run.namespace, run.name, pod, exc)
        fault = st.LoadOutcome(ok=False, message=why, transient=False)
        if tracks[pod].state is not st.PodState.FAILED or tracks[pod].message != why:
            run.outcome.notes.append(Note("Warning", "LoadFailed", f"pod {pod}: {why}"))
        tracks[pod] = st.after_load(tracks[pod], fault, run.ctx.retry, now=run.now, wall=run.wall)


async def _report_pass(
    run: _Pass,
    memory: AdapterMemory,
    pods: Sequence[PodView],
    observed: _Observed,
    wanted: _Wanted,
    diff: _Diff,
    others: Sequence[st.PodTrack],
) -> None:
    """The status of the pass (with the accept length and each pod's draft adapter), and
    when the next retry is due; counters of pods that are gone are dropped."""
    await _read_accept_length(run.ctx, memory, run.name, observed.usable, observed.token)
    tracks = {
        pod: with_draft(track, wanted.draft, diff.drafts.get(pod)) for pod, track in diff.tracks.items()
    }
    memory.tracks = tracks
    live = {p.name for p in pods}
    for counter in (run.ctx.counters.loads, run.ctx.counters.unloads):
        for key in [k for k in counter if k[0] == run.namespace and k[2] == run.name and k[1] not in live]:
            del counter[key]  # pods that are gone: keep the counters bounded
    status = await _report_versions(run, memory, observed, wanted, diff, tracks, others)
    run.outcome.wake_in = st.next_wakeup(tracks.values(), time.monotonic())
    if status.get("phase") == st.AdapterPhase.LOADING.value:
        # Loading (or rolling to a new version): look again within seconds, not at the resync.
        wake_in = run.outcome.wake_in
        run.outcome.wake_in = LOADING_POLL_S if wake_in is None else min(wake_in, LOADING_POLL_S)


async def _report_versions(
    run: _Pass,
    memory: AdapterMemory,
    observed: _Observed,
    wanted: _Wanted,
    diff: _Diff,
    tracks: Mapping[str, st.PodTrack],
    others: Sequence[st.PodTrack],
) -> Mapping:
    """Report the pass's status, with the versions read after this pass's loads."""
    if diff.loaded_now:
        listings = await observe_catalogs(
            run.ctx, [observed.by_name[p] for p in diff.loaded_now], observed.token
        )
        fresh = read_versions(
            listings,
            run.name,
            identity(wanted.lora_path, wanted.spec, wanted.draft),
            public_source(wanted.spec.source),
        )
        run.versions = Versions(
            fresh.version or run.versions.version,
            {**run.versions.pods, **fresh.pods},
            {**{p: w for p, w in run.versions.progress.items() if p not in listings}, **fresh.progress},
        )
    await run.report(
        _findings(
            run.generation, tracks, observed.usable, wanted.spec, diff.seen, memory, run.versions, others
        )
    )
    return run.outcome.status


def with_draft(track: st.PodTrack, draft: Draft | None, learned: DraftPodState | None) -> st.PodTrack:
    """``track`` with its draft adapter's state: what this pass learned, else what the track
    knew while the adapter stays Loaded (or Failed), else unknown."""
    if draft is None:
        value = None
    elif learned is not None:
        value = learned
    elif track.state in (st.PodState.LOADED, st.PodState.FAILED):
        value = track.draft
    else:
        value = None
    return track if value is track.draft else dataclasses.replace(track, draft=value)


_RUNTIME_STATES = {
    "loaded": st.PodState.LOADED,
    "loading": st.PodState.LOADING,
    "failed": st.PodState.FAILED,
    "registered": st.PodState.REGISTERED,
}


async def _others(
    ctx: OperatorContext,
    outcome: AdapterOutcome,
    name: str,
    spec: AdapterSpec,
    lora_path: str,
    token: str | None,
    usable: Sequence[PodView],
    targets: set[str],
    held: Mapping[str, PodModels],
    unreachable: Mapping[str, str],
    wall: float,
    draft: Draft | None = None,
    listings: Mapping[str, PodCatalog] | None = None,
) -> list[st.PodTrack]:
    """The pods that do not keep the adapter warm: they serve it on demand. Any that still
    holds it warm (placement moved) is demoted to evictable, never unloaded under traffic.
    Returns their per-pod state as the runtime reports it, for the status."""
    out = []
    for view in usable:
        if view.name in targets:
            continue
        entry = held[view.name].adapters.get(name) if view.name in held else None
        if (
            entry is not None
            and entry.loaded
            and entry.warm is not False
            and not source_differs(entry, (lora_path, spec.source), spec.sha256)
        ):
            try:
                # The same draft adapter: a load naming another (or none) is a conflict.
                await ctx.runtime(view, token).load(
                    name, lora_path, sha256=spec.sha256, warm=False, draft=draft
                )
                outcome.notes.append(
                    Note("Normal", "Demoted", f"pod {view.name} now loads it on demand (placement)")
                )
            except RuntimeCallError as exc:
                logger.warning("demoting %s on pod %s failed: %s", name, view.name, exc)
        if view.name in unreachable:
            state, message = st.PodState.PENDING, f"pod not answering: {unreachable[view.name]}"
        elif entry is None:
            state, message = st.PodState.PENDING, "not in this pod's catalog yet"
        else:
            state, message = _RUNTIME_STATES.get(entry.state, st.PodState.PENDING), entry.message or ""
        known = (
            listed_draft((listings or {}).get(view.name), name, draft)
            if draft and state is st.PodState.LOADED
            else None
        )
        out.append(
            st.PodTrack(
                pod=view.name,
                pod_ip=view.ip or "",
                pod_uid=view.uid,
                state=state,
                message=message,
                since=wall,
                draft=known,
            )
        )
    return out


def _restored_warnings(
    status: Mapping | None, generation: int | None, previous: int | None
) -> dict[str, tuple[str, ...]]:
    """Load warnings survive an operator restart through the status (same generation only)."""
    status = status or {}
    if previous is not None or status.get("observedGeneration") != generation:
        return {}
    kept = tuple(w for w in status.get("warnings") or [] if isinstance(w, str))
    return {"": kept} if kept else {}


async def _read_accept_length(
    ctx: OperatorContext, memory: AdapterMemory, name: str, pods: Sequence[PodView], token: str | None
) -> None:
    """The adapter's mean accept length over its serve's pods, read at a bounded rate."""
    now = time.monotonic()
    if (
        memory.metrics_read_at is not None
        and now - memory.metrics_read_at < ctx.config.adapter_metrics_interval_s
    ):
        return
    memory.metrics_read_at = now
    answers = await asyncio.gather(
        *(ctx.runtime(p, token).accept_stats(name) for p in pods), return_exceptions=True
    )
    total = steps = 0.0
    for answer in answers:
        if isinstance(answer, tuple):
            total, steps = total + answer[0], steps + answer[1]
    if steps > 0:
        memory.accept_length = round(total / steps, 3)


def _findings(
    generation: int | None,
    tracks: Mapping[str, st.PodTrack],
    usable: Sequence[PodView],
    spec: AdapterSpec,
    seen: LoadedAdapter | None,
    memory: AdapterMemory,
    versions: Versions,
    others: Sequence[st.PodTrack] = (),
) -> AdapterFindings:
    """Status inputs; rank and target modules are the file's (as a pod read it) when known."""
    rank = seen.rank if seen is not None and seen.rank is not None else spec.rank
    modules = (
        seen.target_modules if seen is not None and seen.target_modules is not None else spec.target_modules
    )
    return AdapterFindings(
        generation=generation,
        tracks=list(tracks.values()),
        serve_found=True,
        ready_pods=len(usable),
        rank=rank,
        target_modules=sorted(modules) if modules is not None else None,
        others=tuple(others),
        warnings=tuple(dict.fromkeys(w for ws in memory.warnings.values() for w in ws)),
        accept_length=memory.accept_length,
        version=versions.version,
        versions=versions.pods,
        progress=versions.progress,
    )


async def _load(
    ctx: OperatorContext,
    pod: PodView,
    token: str | None,
    name: str,
    path: str,
    spec: AdapterSpec,
    draft: Draft | None,
    *,
    unload_first: bool,
    in_place: bool = False,
) -> tuple[st.LoadOutcome, LoadedAdapter | None, bool]:
    """Load ``name`` on ``pod`` (with its draft adapter): the outcome, what the pod read, and
    whether a failure was the draft adapter's. ``in_place``: the pod lists versions, so its
    catalog decides what the name means and a conflict waits for the serve's push."""
    client = ctx.runtime(pod, token)
    try:
        if unload_first:
            await client.unload(name)
        try:
            info = await client.load(
                name, path, sha256=spec.sha256, pinned=spec.pinned, warm=True, draft=draft
            )
        except RuntimeCallError as exc:
            if exc.code == "adapter_conflict" and in_place:
                # Never unload under traffic: the push of the new entry rolls the version.
                why = f"the pod's catalog names other weights; waiting for the serve's catalog push ({exc.message})"
                return st.LoadOutcome(ok=False, message=why, retry_in=DRAINING_RETRY_S), None, False
            if exc.code != "adapter_conflict" or unload_first:
                raise
            # The pod holds the name from another source or with another draft adapter (its
            # catalog push is on its way): the Adapter decides what the name means.
            await client.unload(name)
            info = await client.load(
                name, path, sha256=spec.sha256, pinned=spec.pinned, warm=True, draft=draft
            )
    except RuntimeCallError as exc:
        return load_failure(exc, pinned=spec.pinned), None, exc.draft_fault
    return st.LoadOutcome(ok=True), info, False


DRAINING_RETRY_S = 1.0
"""A pod still finishing requests on the adapter's previous version is asked again this soon
(its tries are not spent: draining lasts as long as the longest stream)."""


def load_failure(exc: RuntimeCallError, *, pinned: bool) -> st.LoadOutcome:
    """How a refused load is retried: soon while the pod drains the previous version; never
    when a pinned load finds no GPU slot (retrying cannot make one); else by its status."""
    if exc.code == "adapter_draining":
        return st.LoadOutcome(ok=False, message=exc.message, transient=True, retry_in=DRAINING_RETRY_S)
    if exc.code == "adapter_capacity" and pinned:
        message = (
            f"{exc.message} (spec.pinned: a pinned adapter keeps a GPU slot, and the pods have none left; "
            "fix: unpin an Adapter of the serve, or raise its spec.lora.maxLorasPerBatch)"
        )
        return st.LoadOutcome(ok=False, message=message, transient=False)
    return st.LoadOutcome(ok=False, message=exc.message, transient=exc.transient)


async def serve_token(ctx: OperatorContext, namespace: str, serve_name: str) -> str | None:
    """The admin token of serve ``serve_name`` (None when the serve or its Secret is gone)."""
    serve_body = await ctx.kube.get(LORASERVES, namespace, serve_name)
    if serve_body is None:
        return None
    try:
        spec = parse_loraserve_spec(dict(serve_body.get("spec") or {}))
    except SpecError:
        return None
    return await read_token(ctx, namespace, serve_name, spec)


async def unload_everywhere(
    ctx: OperatorContext, body: Mapping, pods: Sequence[PodView]
) -> tuple[list[str], dict[str, str]]:
    """Unload a deleted Adapter from every pod of its serve: (pods unloaded, pods that failed)."""
    meta = body.get("metadata") or {}
    name, namespace = meta["name"], meta["namespace"]
    serve_name = (body.get("spec") or {}).get("serve")
    if not serve_name:
        return [], {}
    token = await serve_token(ctx, namespace, serve_name)
    usable = [p for p in pods if p.usable]
    held, unreachable = await observe_pods(ctx, usable, token)
    done: list[str] = []
    failed = dict(unreachable)
    by_name = {p.name: p for p in usable}
    for pod, models in sorted(held.items()):
        if name not in models.loaded:
            continue
        try:
            await ctx.runtime(by_name[pod], token).unload(name)
            ctx.counters.unloads[(namespace, pod, name)] += 1
            done.append(pod)
        except RuntimeCallError as exc:
            failed[pod] = exc.message
    return done, failed
