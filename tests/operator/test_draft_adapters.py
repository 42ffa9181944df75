"""The operator's side of draft adapters: catalog entries, the admin load body, per-pod status.

The Adapter reconcile runs against the API stand-in of ``tests/e2e/apiserver.py`` (kmock's
KubernetesEmulator with uid / generation bookkeeping) and small runtime stand-ins: aiohttp
apps that answer the admin API as the runtime does for draft adapters (``draft`` in the
load body loads both or neither; a bad draft adapter is a 4xx naming ``draft``; another
draft for a loaded name is a 409 ``adapter_conflict``; ``GET /v1/lora_catalog`` shows
``draft_state``). The runtime's own behaviour is tested in
``tests/runtime_server/test_draft_adapter_api.py``.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from loraserve.operator import desired as ds
from loraserve.operator.adapter_state import PodState, PodTrack, RetryPolicy
from loraserve.operator.config import OperatorConfig
from loraserve.operator.reconcile.adapters import AdapterMemory, listed_draft, reconcile_adapter, with_draft
from loraserve.operator.reconcile.context import OperatorContext
from loraserve.operator.reconcile.kube import ADAPTERS, LORASERVES
from loraserve.operator.reconcile.pods import PodView
from loraserve.operator.runtime_client import (
    CatalogState,
    PodCatalog,
    RuntimeCallError,
    RuntimeClient,
    parse_catalog_listing,
)
from loraserve.operator.specs import DraftPodState, StorageSpec, parse_adapter_status
from loraserve.operator.status import pods_status
from loraserve.runtime.contract.catalog import CatalogEntry

from .api_standin import LORASERVE_API, api_client

HERE = Path(__file__).parent
NS, SERVE = "ml", "llama"
SHA = "ab" * 32
STORAGE = {"adapters": {"type": "PersistentVolumeClaim", "claimName": "lora", "mountPath": "/adapters"}}


# --------------------------------------------------------------------------- a runtime stand-in


class FakeRuntime:
    """The admin API of one runtime pod, as far as draft adapters go."""

    def __init__(self) -> None:
        self.loaded: dict[str, dict] = {}  # name -> {source, sha256, draft: (path, sha) | None, warm}
        self.drafts: set[str] = set()  # names whose draft adapter is in the draft pool
        self.catalog: list[dict] = []
        self.calls: list[tuple[str, dict]] = []
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_get("/v1/lora_catalog", self.listing)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        data = [{"id": "base", "parent": None}]
        for name, held in self.loaded.items():
            lora = {
                "state": "loaded",
                "source": held["source"],
                "sha256": held["sha256"],
                "warm": held["warm"],
            }
            data.append({"id": name, "parent": "base", "lora": lora})
        return web.json_response({"data": data})

    @staticmethod
    def _error(status: int, message: str, param: str, code: str) -> web.Response:
        return web.json_response({"error": {"message": message, "param": param, "code": code}}, status=status)

    async def load(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("load", body))
        name, raw = body["lora_name"], body.get("draft")
        draft = (raw["lora_path"], raw.get("sha256")) if raw else None
        held = self.loaded.get(name)
        if held is not None:
            if held["source"] != body["lora_path"] or held["draft"] != draft:
                return self._error(
                    409, f"adapter {name!r} is already loaded", "lora_name", "adapter_conflict"
                )
            held["warm"] = body.get("warm", True)
        elif draft is not None and "bad" in draft[0]:
            # All or nothing: the adapter is not left loaded without its draft adapter.
            return self._error(
                400, f"draft adapter of {name!r}: not a PEFT adapter", "draft.lora_path", "bad"
            )
        else:
            self.loaded[name] = {
                "source": body["lora_path"],
                "sha256": body.get("sha256"),
                "draft": draft,
                "warm": body.get("warm", True),
            }
            if draft is not None:
                self.drafts.add(name)
        answer = {"status": "loaded", "lora_name": name, "lora_path": body["lora_path"], "rank": 8}
        answer["draft"] = (
            None if draft is None else {"lora_path": draft[0], "sha256": draft[1], "loaded": True}
        )
        return web.json_response(answer)

    async def unload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("unload", body))
        self.loaded.pop(body["lora_name"], None)
        self.drafts.discard(body["lora_name"])
        return web.json_response({"status": "unloaded"})

    async def listing(self, _: web.Request) -> web.Response:
        self.calls.append(("catalog", {}))
        adapters = []
        for entry in self.catalog:
            item = {**entry, "state": "loaded" if entry["name"] in self.loaded else "registered"}
            if entry.get("draft_source"):
                item["draft_state"] = "loaded" if entry["name"] in self.drafts else "absent"
            adapters.append(item)
        return web.json_response({"digest": "d", "ready": True, "adapters": adapters})


@pytest.fixture
async def api():
    declared = {**LORASERVE_API, "loraserve.io/v1alpha1/adapters": ("Adapter", True)}
    async with api_client(declared) as (_, client):
        http = aiohttp.ClientSession()
        ctx = OperatorContext(
            config=OperatorConfig(webhook_enabled=False),
            kube=client,
            http=http,
            settings=ds.DesiredSettings(image="registry.example/loraserve:1"),
            retry=RetryPolicy(max_tries=2, base_s=0.01, cap_s=0.01),
        )
        try:
            yield ctx
        finally:
            await http.close()


@pytest.fixture
async def runtimes():
    """Two runtime stand-ins on local ports, and their pod views."""
    fakes, runners = [FakeRuntime(), FakeRuntime()], []
    for fake in fakes:
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.port = runner.addresses[0][1]
        runners.append(runner)
    pods = [
        PodView(f"pod-{i}", NS, f"uid-{i}", SERVE, "127.0.0.1", fake.port, ready=True, terminating=False)
        for i, fake in enumerate(fakes)
    ]
    try:
        yield fakes, pods
    finally:
        for runner in runners:
            await runner.cleanup()


async def _objects(ctx: OperatorContext, draft: dict | None, **spec) -> None:
    serve = {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "LoRAServe",
        "metadata": {"name": SERVE, "namespace": NS},
        "spec": {"model": {"source": "/models/llama"}, "storage": STORAGE},
    }
    await ctx.kube.create(LORASERVES, NS, serve)
    body = {"serve": SERVE, "source": "pvc://lora/sql/v1", **spec}
    if draft is not None:
        body["draft"] = draft
    adapter = {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "Adapter",
        "metadata": {"name": "sql", "namespace": NS},
        "spec": body,
    }
    await ctx.kube.create(ADAPTERS, NS, adapter)


async def _pass(ctx: OperatorContext, memory: AdapterMemory, pods) -> dict:
    body = await ctx.kube.get(ADAPTERS, NS, "sql")
    outcome = await reconcile_adapter(ctx, body, memory, pods)
    return outcome.status


def _loads(fake: FakeRuntime) -> list[dict]:
    return [body for verb, body in fake.calls if verb == "load"]


def _asks(fake: FakeRuntime) -> list[str]:
    """The loads and unloads a pod was asked for, in order."""
    return [verb for verb, _ in fake.calls if verb in ("load", "unload")]


# --------------------------------------------------------------------------- pure parts


def test_catalog_entries_carry_draft():
    """Catalog entries carry the draft adapter at its path in the pod."""
    storage = StorageSpec.model_validate(STORAGE)
    with_draft_spec = {
        "serve": SERVE,
        "source": "pvc://lora/sql/v1",
        "draft": {"source": "pvc://lora/sql/d1", "sha256": SHA},
    }
    plain = {"serve": SERVE, "source": "hf://acme/plain@" + "0" * 40}
    unmounted = {"serve": SERVE, "source": "pvc://lora/x", "draft": {"source": "pvc://elsewhere/x-draft"}}
    entries = ds.catalog_entries(storage, [("sql", with_draft_spec), ("plain", plain), ("x", unmounted)])
    assert entries == (
        CatalogEntry(name="plain", source="hf://acme/plain@" + "0" * 40),
        CatalogEntry(
            name="sql", source="/adapters/sql/v1", draft_source="/adapters/sql/d1", draft_sha256=SHA
        ),
    )  # an Adapter whose draft adapter no pod can reach is served with it or not at all: left out


def test_catalog_listing_shows_drafts():
    """The catalog listing says which draft adapters a pod holds."""
    listing = parse_catalog_listing(
        {
            "digest": "d1",
            "ready": True,
            "adapters": [
                {
                    "name": "sql",
                    "state": "loaded",
                    "draft_source": "/a/d",
                    "draft_sha256": SHA,
                    "draft_state": "absent",
                },
                {"name": "plain", "state": "registered"},
                {"state": "bogus"},
            ],
        }
    )
    assert listing.digest == "d1" and set(listing.adapters) == {"sql", "plain"}
    assert listed_draft(listing, "sql", ("/a/d", SHA)) is DraftPodState.ABSENT
    assert listed_draft(listing, "sql", ("/a/d", None)) is DraftPodState.ABSENT
    assert listed_draft(listing, "sql", ("/a/other", None)) is None  # the pod's catalog is not current yet
    assert listed_draft(listing, "sql", ("/a/d", "cd" * 32)) is None
    assert listed_draft(listing, "plain", ("/a/d", None)) is None
    loaded = PodCatalog("d", True, {"sql": CatalogState("sql", "loaded", "/a/d", None, "loaded")})
    assert listed_draft(loaded, "sql", ("/a/d", None)) is DraftPodState.LOADED


def test_track_draft_state():
    """A tracks draft state follows what was learned or what it knew while loaded."""
    loaded = PodTrack("p", "1.2.3.4", "u", state=PodState.LOADED, draft=DraftPodState.LOADED)
    assert with_draft(loaded, ("/d", None), None).draft is DraftPodState.LOADED
    assert with_draft(loaded, ("/d", None), DraftPodState.ABSENT).draft is DraftPodState.ABSENT
    assert with_draft(loaded, None, None).draft is None  # the Adapter no longer names a draft adapter
    pending = PodTrack("p", "1.2.3.4", "u", state=PodState.PENDING, draft=DraftPodState.LOADED)
    assert with_draft(pending, ("/d", None), None).draft is None


def test_pod_status_shows_draft_state():
    """Per pod status shows the draft state and parses back."""
    tracks = [
        PodTrack("a", "1.1.1.1", "u1", state=PodState.LOADED, since=0.0, draft=DraftPodState.LOADED),
        PodTrack("b", "1.1.1.2", "u2", state=PodState.LOADED, since=0.0),
    ]
    pods = pods_status(tracks)
    assert pods[0]["draft"] == "Loaded" and "draft" not in pods[1]
    assert parse_adapter_status({"pods": pods}).pods[0].draft is DraftPodState.LOADED


async def test_load_body_names_draft(runtimes):
    """The load body names the draft and a draft fault is told apart."""
    (fake, _), (pod, _) = runtimes
    async with aiohttp.ClientSession() as http:
        client = RuntimeClient(http, pod.url, None)
        info = await client.load("sql", "/adapters/sql", draft=("/adapters/sql-draft", SHA))
        assert fake.calls[-1][1]["draft"] == {"lora_path": "/adapters/sql-draft", "sha256": SHA}
        assert info.draft_loaded is True
        plain = await client.load("plain", "/adapters/plain")
        assert "draft" not in fake.calls[-1][1] and plain.draft_loaded is None
        with pytest.raises(RuntimeCallError) as caught:
            await client.load("broken", "/adapters/x", draft=("/adapters/bad-draft", None))
        assert caught.value.draft_fault and not caught.value.transient and caught.value.status == 400
        with pytest.raises(RuntimeCallError) as conflict:
            await client.load("sql", "/adapters/sql", draft=("/adapters/other", None))
        assert conflict.value.code == "adapter_conflict" and not conflict.value.draft_fault


# --------------------------------------------------------------------------- reconcile


async def test_adapter_loads_with_draft(api, runtimes):
    """An adapter loads with its draft adapter and reports it per pod."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, {"source": "pvc://lora/sql/draft-v1", "sha256": SHA})
    status = await _pass(ctx, AdapterMemory(), pods)
    assert status["phase"] == "Ready"
    assert [(p["pod"], p["state"], p.get("draft")) for p in status["pods"]] == [
        ("pod-0", "Loaded", "Loaded"),
        ("pod-1", "Loaded", "Loaded"),
    ]
    for fake in fakes:
        (body,) = _loads(fake)
        assert body["lora_path"] == "/adapters/sql/v1"
        assert body["draft"] == {"lora_path": "/adapters/sql/draft-v1", "sha256": SHA}
    stored = await ctx.kube.get(ADAPTERS, NS, "sql")
    assert stored["status"]["pods"][0]["draft"] == "Loaded"


async def test_bad_draft_fails_adapter(api, runtimes):
    """A bad draft adapter fails the adapter naming the draft."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, {"source": "pvc://lora/sql/bad-draft"})
    status = await _pass(ctx, AdapterMemory(), pods)
    assert status["phase"] == "Failed"
    for entry in status["pods"]:
        assert (entry["state"], entry["draft"]) == ("Failed", "Failed")
        assert "draft adapter of 'sql'" in entry["message"]
    assert all(not fake.loaded for fake in fakes)  # nothing half-loaded


async def test_missing_draft_reloads_both(api, runtimes):
    """A pod holding the adapter without its draft adapter loads both again."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, {"source": "pvc://lora/sql/draft-v1"})
    # Loaded before the Adapter named a draft adapter; the pod's catalog already names it.
    entry = {"name": "sql", "source": "/adapters/sql/v1", "draft_source": "/adapters/sql/draft-v1"}
    for fake in fakes:
        fake.loaded["sql"] = {"source": "/adapters/sql/v1", "sha256": None, "draft": None, "warm": True}
        fake.catalog = [entry]
    memory = AdapterMemory()
    status = await _pass(ctx, memory, pods)
    assert [(p["state"], p.get("draft")) for p in status["pods"]] == [("Loaded", "Loaded")] * 2
    for fake in fakes:
        assert _asks(fake) == ["unload", "load"]
        assert fake.loaded["sql"]["draft"] == ("/adapters/sql/draft-v1", None)
    # Converged: the next pass asks nothing and keeps the state it reads from the listing.
    again = await _pass(ctx, memory, pods)
    assert [p.get("draft") for p in again["pods"]] == ["Loaded", "Loaded"]
    assert all(_asks(fake) == ["unload", "load"] for fake in fakes)


async def test_other_draft_reloaded(api, runtimes):
    """A pod holding another draft adapter is reloaded after its conflict."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, {"source": "pvc://lora/sql/draft-v2"})
    # The pod still holds the old draft adapter, warm=False (loaded on demand), and its catalog
    # push has not happened: only the 409 tells the operator.
    for fake in fakes:
        fake.loaded["sql"] = {
            "source": "/adapters/sql/v1",
            "sha256": None,
            "draft": ("/adapters/sql/draft-v1", None),
            "warm": False,
        }
        fake.drafts.add("sql")
    status = await _pass(ctx, AdapterMemory(), pods)
    assert [(p["state"], p.get("draft")) for p in status["pods"]] == [("Loaded", "Loaded")] * 2
    for fake in fakes:
        assert _asks(fake) == ["load", "unload", "load"]
        assert fake.loaded["sql"]["draft"] == ("/adapters/sql/draft-v2", None)


async def test_on_demand_pods_report_drafts(api, runtimes):
    """Pods that load on demand report the draft state they list."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, {"source": "pvc://lora/sql/draft-v1"}, placement={"mode": "Replicas", "replicas": 1})
    entry = {"name": "sql", "source": "/adapters/sql/v1", "draft_source": "/adapters/sql/draft-v1"}
    for fake in fakes:
        fake.catalog = [entry]
    memory = AdapterMemory()
    first = await _pass(ctx, memory, pods)
    placed = [p for p in first["pods"] if p["state"] == "Loaded"]
    assert len(placed) == 1 and placed[0]["draft"] == "Loaded"
    # The other pod loads it on its first request (here: as the runtime would, from its catalog).
    other = next(fake for fake, pod in zip(fakes, pods, strict=True) if pod.name != placed[0]["pod"])
    other.loaded["sql"] = {
        "source": "/adapters/sql/v1",
        "sha256": None,
        "draft": ("/adapters/sql/draft-v1", None),
        "warm": False,
    }
    other.drafts.add("sql")
    second = await _pass(ctx, memory, pods)
    assert [(p["state"], p.get("draft")) for p in second["pods"]] == [("Loaded", "Loaded")] * 2


async def test_no_draft_no_draft_state(api, runtimes):
    """An adapter without a draft adapter reports no draft state."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, None)
    status = await _pass(ctx, AdapterMemory(), pods)
    assert status["phase"] == "Ready" and all("draft" not in p for p in status["pods"])
    assert all("draft" not in body for fake in fakes for body in _loads(fake))
    # The listings are read every pass (versions, loads in progress); no draft state comes of them.
    assert all(any(verb == "catalog" for verb, _ in fake.calls) for fake in fakes)


async def test_unmounted_draft_fails_adapter(api, runtimes):
    """An unmounted draft source is the adapters own problem."""
    ctx, (fakes, pods) = api, runtimes
    await _objects(ctx, {"source": "pvc://elsewhere/sql-draft"})
    status = await _pass(ctx, AdapterMemory(), pods)
    assert status["phase"] == "Failed"
    message = next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
    assert message.startswith("spec.draft.source: claim 'elsewhere' is not mounted by LoRAServe 'llama'")
    assert all(not fake.calls for fake in fakes)
