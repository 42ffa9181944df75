"""Adapter operations against pods that list versions (issue 39): the catalog reaches pods
still starting, the status says which version each pod serves while a change rolls, names
what a slow load waits on within seconds, and a refused pinned load fails at once.

The runtime is a stand-in on 127.0.0.1 speaking the admin API of ``GET/PUT
/v1/lora_catalog`` (``confirmed``, per-entry ``version``, ``serving_versions``,
``loading_for_s``, ``waiting_on``), ``GET /v1/models`` and ``POST /v1/load_lora_adapter``;
the Kubernetes API is the kmock stand-in (``api_standin``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time

import aiohttp
import pytest
from aiohttp import web

from loraserve.operator import desired as ds
from loraserve.operator import handlers
from loraserve.operator.adapter_state import PodState, PodTrack, PodVersion, RetryPolicy
from loraserve.operator.config import OperatorConfig
from loraserve.operator.reconcile import adapters as adapter_pass
from loraserve.operator.reconcile.adapters import AdapterMemory, reconcile_adapter
from loraserve.operator.reconcile.catalog import sync_catalog
from loraserve.operator.reconcile.context import OperatorContext
from loraserve.operator.reconcile.kube import ADAPTERS, LORASERVES
from loraserve.operator.reconcile.pods import PodView
from loraserve.operator.specs import AdapterPhase
from loraserve.operator.status import AdapterFindings, adapter_phase, pods_status
from loraserve.operator.translate import public_source
from loraserve.runtime.contract.catalog import CatalogEntry, catalog_digest

from .api_standin import LORASERVE_API, api_client

NS, SERVE = "ml", "llama"
STORAGE = {"adapters": {"type": "PersistentVolumeClaim", "claimName": "lora", "mountPath": "/adapters"}}


def version_of(entry: dict) -> str:
    """The stand-in's own short id of an entry's identity (the operator only compares them)."""
    key = "|".join(str(entry.get(k)) for k in ("source", "sha256", "draft_source", "draft_sha256"))
    return hashlib.sha256(key.encode()).hexdigest()[:8]


class VersionedRuntime:
    """One runtime pod that rolls versions in place and confirms its catalog on a PUT."""

    def __init__(self, *, confirmed: bool | None = True) -> None:
        self.catalog: dict[str, dict] = {}
        self.confirmed = confirmed
        self.serving: dict[str, list[str]] = {}  # name -> versions, current first
        self.loading: dict[str, tuple[float, str]] = {}  # name -> (seconds, waiting on)
        self.refuse: tuple[int, str] | None = None  # (status, code) every load answers
        self.hold = asyncio.Event()  # loads wait for it when set_hung
        self.hung = False
        self.calls: list[str] = []
        self.puts_refused = 0
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/lora_catalog", self.listing)
        app.router.add_put("/v1/lora_catalog", self.put)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    def entries(self) -> list[CatalogEntry]:
        return [CatalogEntry(**e) for e in self.catalog.values()]

    async def listing(self, _: web.Request) -> web.Response:
        self.calls.append("catalog")
        items = []
        for name, entry in sorted(self.catalog.items()):
            serving = self.serving.get(name, [])
            state = "loading" if name in self.loading else ("loaded" if serving else "registered")
            item = {**entry, "state": state, "version": version_of(entry), "serving_versions": serving}
            if name in self.loading:
                item["loading_for_s"], item["waiting_on"] = self.loading[name]
            items.append(item)
        answer = {"digest": catalog_digest(self.entries()), "ready": True, "adapters": items}
        if self.confirmed is not None:
            answer["confirmed"] = self.confirmed
        return web.json_response(answer)

    async def put(self, request: web.Request) -> web.Response:
        self.calls.append("put")
        if self.puts_refused > 0:  # the model is still loading: no engine to take the catalog
            self.puts_refused -= 1
            return web.json_response({"error": {"message": "not ready", "code": "not_ready"}}, status=503)
        body = await request.json()
        self.catalog = {e["name"]: e for e in body["adapters"]}
        self.confirmed = True
        return web.json_response({"digest": catalog_digest(self.entries())})

    async def models(self, _: web.Request) -> web.Response:
        data = [{"id": "base", "parent": None}]
        for name, versions in self.serving.items():
            if versions:
                source = next(
                    (e["source"] for e in [self.catalog.get(name, {})] if version_of(e) == versions[0]),
                    f"/adapters/{name}/{versions[0]}",
                )
                data.append(
                    {
                        "id": name,
                        "parent": "base",
                        "lora": {"state": "loaded", "source": source, "warm": True},
                    }
                )
        return web.json_response({"data": data})

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append("load")
        if self.hung:
            await self.hold.wait()
        if self.refuse is not None:
            status, code = self.refuse
            return web.json_response({"error": {"message": f"refused: {code}", "code": code}}, status=status)
        name = body["lora_name"]
        entry = self.catalog.get(name) or {"name": name, "source": body["lora_path"]}
        version = version_of(entry)
        self.serving[name] = [version, *(v for v in self.serving.get(name, []) if v != version)]
        return web.json_response({"status": "loaded", "lora_name": name, "lora_path": body["lora_path"]})

    async def unload(self, request: web.Request) -> web.Response:
        self.calls.append("unload")
        self.serving.pop((await request.json())["lora_name"], None)
        return web.json_response({"status": "unloaded"})


@pytest.fixture
async def ctx():
    declared = {**LORASERVE_API, "loraserve.io/v1alpha1/adapters": ("Adapter", True)}
    async with api_client(declared) as (_, client):
        http = aiohttp.ClientSession()
        context = OperatorContext(
            config=OperatorConfig(webhook_enabled=False),
            kube=client,
            http=http,
            settings=ds.DesiredSettings(image="registry.example/loraserve:1"),
            retry=RetryPolicy(max_tries=3, base_s=30.0, cap_s=30.0),
        )
        try:
            yield context
        finally:
            await http.close()


@pytest.fixture
async def pods():
    """Start stand-ins: ``await pods(n, ready=...)`` -> (runtimes, pod views)."""
    runners = []

    async def start(n: int, *, ready: bool = True, confirmed: bool | None = True):
        fakes, views = [], []
        for i in range(n):
            fake = VersionedRuntime(confirmed=confirmed)
            runner = web.AppRunner(fake.app())
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            fake.port = runner.addresses[0][1]
            runners.append(runner)
            fakes.append(fake)
            views.append(
                PodView(f"pod-{len(runners) - 1}", NS, f"u{i}", SERVE, "127.0.0.1", fake.port, ready, False)
            )
        return fakes, views

    yield start
    for runner in runners:
        await runner.cleanup()


async def _objects(ctx: OperatorContext, source: str = "pvc://lora/sql/v2", **spec) -> None:
    serve = {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "LoRAServe",
        "metadata": {"name": SERVE, "namespace": NS},
        "spec": {"model": {"source": "/models/llama"}, "storage": STORAGE},
    }
    await ctx.kube.create(LORASERVES, NS, serve)
    adapter = {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "Adapter",
        "metadata": {"name": "sql", "namespace": NS},
        "spec": {"serve": SERVE, "source": source, **spec},
    }
    await ctx.kube.create(ADAPTERS, NS, adapter)


async def _pass(ctx: OperatorContext, memory: AdapterMemory, views) -> adapter_pass.AdapterOutcome:
    body = await ctx.kube.get(ADAPTERS, NS, "sql")
    return await reconcile_adapter(ctx, body, memory, views)


def _ready(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


V1 = {"name": "sql", "source": "/adapters/sql/v1"}
V2 = {"name": "sql", "source": "/adapters/sql/v2"}


# --------------------------------------------------------------------------- the catalog push


async def test_the_catalog_reaches_pods_still_starting(ctx, pods):
    entries = (CatalogEntry("sql", "/adapters/sql/v2"),)
    (starting, ready), views = await pods(2, ready=False, confirmed=False)
    # The ConfigMap already gave the starting pod this digest, but it waits for a push.
    starting.catalog = {"sql": dict(V2)}
    ready.catalog, ready.confirmed = {"sql": dict(V2)}, None  # an older runtime: says nothing
    views[1] = PodView("pod-1", NS, "u1", SERVE, "127.0.0.1", ready.port, True, False)
    sync = await sync_catalog(ctx, views, None, entries)
    assert sync.pushed == ["pod-0"] and sync.current == ["pod-1"]
    assert starting.confirmed is True and "put" not in ready.calls
    assert sync.waiting == ["pod-0"] and not sync.again_soon  # its Ready flip is a pod event


async def test_silent_starting_pod_retried_soon(ctx, pods):
    """A starting pod that does not answer is tried again soon."""
    _, views = await pods(1, ready=False)
    closed = PodView("pod-x", NS, "ux", SERVE, "127.0.0.1", 9, False, False)  # nothing listens
    gone = PodView("pod-y", NS, "uy", SERVE, "127.0.0.1", 9, False, True)  # terminating: never pushed
    sync = await sync_catalog(ctx, [*views, closed, gone], None, (CatalogEntry("sql", "/adapters/sql/v2"),))
    assert set(sync.starting) == {"pod-x"} and not sync.failed and sync.again_soon
    assert "pod-y" not in sync.starting and "pod-y" not in sync.pushed


class _Running:
    """kopf's daemon stop flag, never raised here."""

    def __bool__(self) -> bool:
        return False

    async def wait(self) -> None:
        await asyncio.Event().wait()


SERVE_BODY = {"metadata": {"name": SERVE, "namespace": NS}, "spec": {"model": {"source": "/models/llama"}}}


async def test_starting_pod_gets_catalog_fast(ctx, pods, monkeypatch):
    """Only the push repeats (every CATALOG_RETRY_S) until the starting pod takes it."""
    monkeypatch.setattr(handlers, "CATALOG_RETRY_S", 0.1)
    (fake,), views = await pods(1, ready=False, confirmed=False)
    fake.puts_refused = 2  # its model is still loading
    key = ("serve", NS, SERVE)
    entries = (CatalogEntry("sql", "/adapters/sql/v2"),)
    assert await handlers._push_until_taken(ctx, key, _Running(), SERVE_BODY, lambda: views, entries) is None
    assert fake.confirmed is True
    assert fake.calls.count("put") == 3
    # An event (a spec change, a pod turning Ready) ends the loop: the full pass comes next.
    fake.confirmed, fake.puts_refused = False, 100
    ctx.wakers.wake(key)
    assert await handlers._push_until_taken(ctx, key, _Running(), SERVE_BODY, lambda: views, entries) is None
    assert fake.calls.count("put") == 3


# --------------------------------------------------------------------------- versions


async def test_status_names_pod_versions(ctx, pods):
    """Status names each pods version while a change rolls."""
    await _objects(ctx)
    fakes, views = await pods(2)
    new, old = version_of(V2), version_of(V1)
    # pod-0 has the new catalog and serves the new version, the old one still draining;
    # pod-1's catalog push has not landed: it still serves the old version.
    fakes[0].catalog, fakes[0].serving = {"sql": dict(V2)}, {"sql": [new, old]}
    fakes[1].catalog, fakes[1].serving = {"sql": dict(V1)}, {"sql": [old]}
    memory = AdapterMemory()
    outcome = await _pass(ctx, memory, views)
    status = outcome.status
    assert status["phase"] == "Loading" and status["version"] == new
    assert _ready(status)["reason"] == "VersionRolling"
    assert f"1 of 2 pods serve version {new}, 1 still serves {old}" in _ready(status)["message"]
    by_pod = {p["pod"]: p for p in status["pods"]}
    assert by_pod["pod-0"]["version"] == new and by_pod["pod-0"]["drainingVersions"] == [old]
    assert by_pod["pod-1"]["version"] == old
    # Nothing unloads the old version: pod-1 waits for its catalog push.
    assert "unload" not in fakes[1].calls and "load" not in fakes[1].calls
    assert outcome.wake_in is not None and outcome.wake_in <= adapter_pass.LOADING_POLL_S
    # The push lands, pod-1 loads the new version beside the old: Ready.
    fakes[1].catalog = {"sql": dict(V2)}
    fakes[1].serving = {"sql": [new, old]}
    status = (await _pass(ctx, memory, views)).status
    assert status["phase"] == "Ready", status
    assert all(p["version"] == new for p in status["pods"])


async def test_draining_version_retried_soon(ctx, pods):
    """A version draining is retried soon not backed off."""
    await _objects(ctx)
    fakes, views = await pods(1)
    fakes[0].catalog = {"sql": dict(V2)}
    fakes[0].refuse = (503, "adapter_draining")
    memory = AdapterMemory()
    outcome = await _pass(ctx, memory, views)
    (pod,) = outcome.status["pods"]
    assert pod["state"] == "Pending" and "retrying in 1 s" in pod["message"]
    assert outcome.wake_in is not None and outcome.wake_in <= adapter_pass.DRAINING_RETRY_S
    assert memory.tracks["pod-0"].failed_tries == 0  # draining spends no try


async def test_versioned_conflict_waits_for_push(ctx, pods):
    """A conflict on a versioned pod waits for the push and never unloads."""
    await _objects(ctx)
    fakes, views = await pods(1)
    fakes[0].catalog = {"sql": dict(V2)}
    fakes[0].refuse = (409, "adapter_conflict")
    outcome = await _pass(ctx, AdapterMemory(), views)
    (pod,) = outcome.status["pods"]
    assert pod["state"] == "Pending" and "waiting for the serve's catalog push" in pod["message"]
    assert "unload" not in fakes[0].calls


async def test_pinned_load_without_slot_fails(ctx, pods):
    """A pinned load without a slot fails at once with the fix."""
    await _objects(ctx, pinned=True)
    fakes, views = await pods(1)
    fakes[0].catalog = {"sql": {**V2, "pinned": True}}
    fakes[0].refuse = (503, "adapter_capacity")
    outcome = await _pass(ctx, AdapterMemory(), views)
    assert outcome.status["phase"] == "Failed"
    assert "maxLorasPerBatch" in _ready(outcome.status)["message"]
    assert fakes[0].calls.count("load") == 1


async def test_unpinned_load_without_slot_waits(ctx, pods):
    """An unpinned load without a slot stays transient."""
    await _objects(ctx)
    fakes, views = await pods(1)
    fakes[0].refuse = (503, "adapter_capacity")
    outcome = await _pass(ctx, AdapterMemory(), views)
    assert outcome.status["phase"] == "Loading"


# --------------------------------------------------------------------------- a slow source


async def test_hung_load_named_in_status(ctx, pods, monkeypatch):
    """A hung load is named in the status within seconds."""
    monkeypatch.setattr(adapter_pass, "LOADING_POLL_S", 0.2)
    source = "https://user:secret@models.example/sql.tar.gz?token=abc"
    await _objects(ctx, source=source, sha256="ab" * 32)
    fakes, views = await pods(1)
    fake = fakes[0]
    fake.hung = True
    fake.catalog = {"sql": {"name": "sql", "source": source, "sha256": "ab" * 32}}
    running = asyncio.ensure_future(_pass(ctx, AdapterMemory(), views))
    try:
        while "load" not in fake.calls:
            await asyncio.sleep(0.05)
        # The pod starts reporting its slow load only once the operator's load call hangs.
        fake.loading["sql"] = (12.5, "connecting https://models.example/sql")
        started = time.monotonic()
        while True:
            await asyncio.sleep(0.1)
            status = (await ctx.kube.get(ADAPTERS, NS, "sql")).get("status") or {}
            if "connecting" in _ready(status).get("message", "") if status.get("conditions") else False:
                break
            assert time.monotonic() - started < 5, status
        message = _ready(status)["message"]
        assert "pod-0: loading https://models.example/sql.tar.gz for 12.5 s" in message
        assert "for 12.5 s: connecting https://models.example/sql" in message
        assert "secret" not in str(status) and "token=abc" not in str(status)
        (pod,) = status["pods"]
        assert pod["state"] == "Loading" and "connecting https://models.example/sql" in pod["message"]
    finally:
        fake.loading.clear()
        fake.hold.set()
        await running


def test_ready_waits_for_spec_version():
    """Pods that answer Loaded but still serve the old version keep the Adapter from Ready."""
    tracks = [PodTrack(f"pod-{i}", "10.0.0.1", f"u{i}", state=PodState.LOADED) for i in range(3)]
    new = PodVersion(listed="v2", current=True, serving="v2", draining=("v1",))
    versions = {"pod-0": new, "pod-1": new, "pod-2": PodVersion(listed="v2", current=True, serving="v1")}
    findings = AdapterFindings(generation=1, tracks=tracks, ready_pods=3, version="v2", versions=versions)
    phase, reason, message = adapter_phase(findings)
    assert (phase, reason) == (AdapterPhase.LOADING, "VersionRolling")
    assert message == "2 of 3 pods serve version v2, 1 still serves v1"
    caught_up = AdapterFindings(generation=1, tracks=tracks, ready_pods=3, version="v2", versions={"pod-2": new})
    assert adapter_phase(caught_up)[0] is AdapterPhase.READY


def test_failed_pod_keeps_reason():
    """A failed pod keeps its reason while the runtime loads again."""
    failed = PodTrack("pod-0", "10.0.0.1", "u0", state=PodState.FAILED, message="gave up after 5 tries: 502")
    loading = PodTrack("pod-1", "10.0.0.2", "u1", state=PodState.LOADING)
    progress = {"pod-0": "loading https://h/a for 3 s", "pod-1": "loading https://h/a for 3 s"}
    by_pod = {p["pod"]: p["message"] for p in pods_status([failed, loading], {}, progress)}
    assert by_pod == {"pod-0": "gave up after 5 tries: 502", "pod-1": "loading https://h/a for 3 s"}


def test_public_source_drops_secrets():
    """Public source drops credentials and queries."""
    assert public_source("https://u:p@h.example/a.tgz?X-Amz-Signature=s#f") == "https://h.example/a.tgz"
    assert public_source("s3://bucket/key") == "s3://bucket/key"
    assert public_source("/adapters/sql") == "/adapters/sql"
