"""The adapter catalog over real HTTP: every catalogued adapter is served by a pod that does
not hold it yet (loaded on its first request), with a bound on the wait, eviction of idle
on-demand adapters, the admin API's errors for bad ones, readiness gated on the catalog,
and the operator's pushes (``PUT /v1/lora_catalog``).

Real servers throughout: the production app on a real port, a real engine, and a real
HTTP file server for the slow remote source.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.contract.catalog import CatalogEntry, catalog_digest, encode_catalog
from loraserve.runtime.lora.sources import ADAPTER_FILES, SourceSettings
from loraserve.runtime.server import STATE, build_app

from .conftest import make_config, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "def main("


def write_catalog(path: Path, entries: list[CatalogEntry]) -> Path:
    path.write_text(encode_catalog(entries))
    return path


async def complete(server, model: str, prompt: str = PROMPT) -> tuple[int, dict, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    async with server.session.post(server.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


async def models(server) -> dict[str, dict]:
    status, body = await server.get("/v1/models")
    assert status == 200
    return {m["id"]: m for m in body["data"]}


def demand_loads(server, outcome: str = "loaded") -> float:
    return server.state.metrics.adapter_loads.labels("demand", outcome)._value.get()


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """Greedy outputs of each demo adapter on a server that loaded them at start-up."""

    async def run() -> dict[str, str]:
        async with running_server(make_config(assets), tmp_path_factory.mktemp("ref")) as srv:
            out = {}
            for name in assets.demo.adapters:
                status, body, _ = await complete(srv, name)
                assert status == 200
                out[name] = body["choices"][0]["text"]
            return out

    return asyncio.run(run())


async def test_catalogued_load_on_first_request(assets, tmp_path, reference):
    """Catalogued adapters load on their first request."""
    entries = [CatalogEntry(name, str(path)) for name, path in assets.demo.adapters.items()]
    config = make_config(assets, adapters={})
    config.lora.catalog = str(write_catalog(tmp_path / "catalog.json", entries))
    async with running_server(config, tmp_path) as srv:
        listed = await models(srv)
        assert {n: listed[n]["lora"]["state"] for n in assets.demo.adapters} == dict.fromkeys(
            assets.demo.adapters, "registered"
        )
        assert srv.engine.adapter_names == frozenset()
        # Many requests for one registered adapter at once: one load, all served, same output.
        results = await asyncio.gather(*(complete(srv, "sql-r8") for _ in range(6)))
        assert [status for status, _, _ in results] == [200] * 6
        assert {body["choices"][0]["text"] for _, body, _ in results} == {reference["sql-r8"]}
        assert demand_loads(srv) == 1
        status, body, _ = await complete(srv, "chat-r16")
        assert status == 200 and body["choices"][0]["text"] == reference["chat-r16"]
        listed = await models(srv)
        assert listed["sql-r8"]["lora"]["state"] == "loaded" and listed["sql-r8"]["lora"]["warm"] is False
        assert listed["sql-r8"]["root"] == "sql-r8", "a path in the pod is shown as the adapter's name"
        # A name in no catalog is a 404 at once, pointing at the listing (not copying it).
        status, body, _ = await complete(srv, "nope")
        assert status == 404 and body["error"]["code"] == "model_not_found"
        assert "GET /v1/models" in body["error"]["message"] and "sql-r8" not in body["error"]["message"]
        # The catalog, its digest and each adapter's state, behind the admin token.
        status, _ = await srv.get("/v1/lora_catalog")
        assert status == 401
        status, cat = await srv.get("/v1/lora_catalog", headers=srv.admin_headers())
        assert status == 200 and cat["digest"] == catalog_digest(entries) and cat["ready"] is True
        assert {a["name"]: a["state"] for a in cat["adapters"]} == {"chat-r16": "loaded", "sql-r8": "loaded"}


async def test_idle_on_demand_evicted(assets, tmp_path):
    """Idle on demand adapters are evicted warm ones never."""
    extra = assets.extra_adapters
    entries = [CatalogEntry(name, str(path)) for name, path in extra.items()]
    config = make_config(assets, adapters={"sql-r8": str(assets.demo.adapters["sql-r8"])}, max_loaded_loras=2)
    config.lora.catalog = str(write_catalog(tmp_path / "catalog.json", entries))
    async with running_server(config, tmp_path) as srv:
        for name in ("extra-0", "extra-1", "extra-2", "extra-0"):
            status, body, _ = await complete(srv, name)
            assert status == 200, body
            held = srv.state.supply.loaded_names()
            assert held == {"sql-r8", name}, "the start-up adapter is warm; one on-demand slot turns over"
        assert srv.state.metrics.adapter_evictions._value.get() == 3
        listed = await models(srv)
        assert listed["extra-1"]["lora"]["state"] == "registered"
        # The cache full of warm adapters: an on-demand load cannot make room, and says so.
        status, resp = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "warm-2", "lora_path": str(assets.demo.adapters["chat-r16"])},
            headers=srv.admin_headers(),
        )
        assert status == 200 and resp["warm"] is True
        assert srv.state.supply.loaded_names() == {"sql-r8", "warm-2"}, "the idle on-demand adapter made room"
        status, body, headers = await complete(srv, "extra-2")
        assert status == 503 and body["error"]["param"] == "lora.max_loaded_loras"
        assert "maxLoadedLoras" in body["error"]["message"] and headers["Retry-After"]
        # Demoting a warm adapter (the operator does this when placement moves) makes room.
        status, resp = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "warm-2", "lora_path": str(assets.demo.adapters["chat-r16"]), "warm": False},
            headers=srv.admin_headers(),
        )
        assert status == 200 and resp["status"] == "already_loaded" and resp["warm"] is False
        status, body, _ = await complete(srv, "extra-2")
        assert status == 200, body


async def test_bad_catalogued_adapter_remembered(assets, tmp_path):
    """Bad catalogued adapter fails like the admin API and is remembered."""
    broken = tmp_path / "broken"
    shutil.copytree(assets.extra_adapters["extra-0"], broken)
    config_file = broken / "adapter_config.json"
    cfg = json.loads(config_file.read_text())
    cfg["r"] = 99  # above the pool's max rank (16)
    config_file.write_text(json.dumps(cfg))
    entries = [
        CatalogEntry("broken", str(broken)),
        CatalogEntry("missing", str(tmp_path / "nowhere")),
        CatalogEntry("misdeclared", str(assets.extra_adapters["extra-1"]), rank=5),  # the file has rank 6
    ]
    config = make_config(assets, adapters={})
    config.lora.catalog = str(write_catalog(tmp_path / "catalog.json", entries))
    async with running_server(config, tmp_path / "srv") as srv:
        admin_status, admin = await srv.post(
            "/v1/load_lora_adapter", {"lora_name": "via-admin", "lora_path": str(broken)}, headers=srv.admin_headers()
        )
        status, body, _ = await complete(srv, "broken")
        assert status == admin_status == 400
        assert body["error"]["code"] == admin["error"]["code"] and body["error"]["message"].replace(
            "'broken'", "X"
        ) == admin["error"]["message"].replace("'via-admin'", "X")
        status, body2, _ = await complete(srv, "broken")
        assert status == 400 and body2 == body
        assert demand_loads(srv, "failed") == 1, "a bad adapter is not fetched again for every request"
        status, body, _ = await complete(srv, "missing")
        assert status == 400 and body["error"]["code"] == "invalid_source"
        assert str(tmp_path) not in body["error"]["message"], "no pod path reaches an inference client"
        assert "'missing'" in body["error"]["message"] or "missing" in body["error"]["message"]
        status, body, _ = await complete(srv, "misdeclared")
        assert status == 400 and "declares rank 5" in body["error"]["message"]
        assert str(assets.extra_adapters["extra-1"]) not in body["error"]["message"]
        assert "misdeclared" not in srv.state.supply.loaded_names() and len(srv.engine.adapter_names) == 0
        listed = await models(srv)
        assert listed["broken"]["lora"]["state"] == "failed" and "rank" in listed["broken"]["lora"]["message"]
        assert not any(str(tmp_path) in (m.get("lora") or {}).get("message", "") for m in listed.values())
        assert listed["misdeclared"]["lora"]["state"] == "failed"
        # The operator fixes the source: the new entry is tried afresh and served.
        fixed = [CatalogEntry("broken", str(assets.extra_adapters["extra-0"]))]
        status, change = await _put(srv, {"adapters": [e.to_dict() for e in fixed]})
        assert status == 200 and change["changed"] == ["broken"]
        assert change["removed"] == ["misdeclared", "missing"]
        status, body, _ = await complete(srv, "broken")
        assert status == 200
        status, body, _ = await complete(srv, "missing")
        assert status == 404, "removed from the catalog: no longer a model"


async def _put(srv, body) -> tuple[int, dict]:
    async with srv.session.put(srv.url + "/v1/lora_catalog", json=body, headers=srv.admin_headers()) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_catalog_pushes(assets, tmp_path, reference):
    """Catalog pushes replace unload and refuse bad bodies."""
    a, b = assets.demo.adapters["sql-r8"], assets.demo.adapters["chat-r16"]
    config = make_config(assets, adapters={})
    config.lora.catalog = str(write_catalog(tmp_path / "catalog.json", [CatalogEntry("x", str(a))]))
    async with running_server(config, tmp_path / "srv") as srv:
        status, body, _ = await complete(srv, "x")
        assert status == 200 and body["choices"][0]["text"] == reference["sql-r8"]
        for bad, field in (
            ({"adapters": [{"name": "x"}]}, "adapters[0].source"),
            ({"adapters": [{"name": "x", "source": str(a), "rank": 0}]}, "adapters[0].rank"),
            ({"adapters": [{"name": "x", "source": str(a)}, {"name": "x", "source": str(b)}]}, "adapters"),
            ({"adapters": "x"}, "adapters"),
            ({"adapters": [{"name": "bad name", "source": str(a)}]}, "adapters[0].name"),
            ({"adapters": [{"name": "x", "source": str(a), "draft_source": 5}]}, "adapters[0].draft_source"),
            ({"adapters": [{"name": "x", "source": str(a), "draft_source": " "}]}, "adapters[0].draft_source"),
            ({"adapters": [{"name": "x", "source": str(a), "draft_sha256": "0" * 64}]}, "adapters[0].draft_sha256"),
            (
                {"adapters": [{"name": "x", "source": str(a), "draft_source": str(a), "draft_sha256": "xyz"}]},
                "adapters[0].draft_sha256",
            ),
        ):
            status, err = await _put(srv, bad)
            assert status == 400 and err["error"]["param"] == field, (bad, err)
        status, body, _ = await complete(srv, "x")
        assert status == 200, "a refused push changes nothing"
        async with srv.session.put(srv.url + "/v1/lora_catalog", json={"adapters": []}) as resp:
            assert resp.status == 401
        # Same name, another source: the old weights go, the next request loads the new ones.
        status, change = await _put(srv, {"adapters": [{"name": "x", "source": str(b)}]})
        assert status == 200 and change["changed"] == ["x"] and change["unloaded"] == ["x"]
        status, body, _ = await complete(srv, "x")
        assert status == 200 and body["choices"][0]["text"] == reference["chat-r16"]
        status, again = await _put(srv, {"adapters": [{"name": "x", "source": str(b)}]})
        assert status == 200 and again["changed"] == again["unloaded"] == [], "a push is idempotent"
        status, change = await _put(srv, {"adapters": []})
        assert change["removed"] == ["x"] and change["unloaded"] == ["x"]
        status, body, _ = await complete(srv, "x")
        assert status == 404


class SlowFiles:
    """A real HTTP server holding an adapter's files back until released."""

    def __init__(self, directory: Path) -> None:
        self.files = {f"/a/{name}": (directory / name).read_bytes() for name in ADAPTER_FILES}
        self.release = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        await self.release.wait()
        body = self.files.get(request.path)
        return web.Response(body=body) if body is not None else web.Response(status=404)


async def test_load_past_bound_503_then_serves(assets, tmp_path, reference):
    """A load past the bound answers 503 then serves."""
    slow = SlowFiles(assets.demo.adapters["sql-r8"])
    app = web.Application()
    app.router.add_get("/{tail:.*}", slow.handle)
    files = TestServer(app, host="127.0.0.1")
    await files.start_server()
    config = make_config(assets, adapters={})
    source = f"http://127.0.0.1:{files.port}/a/"
    config.lora.catalog = str(write_catalog(tmp_path / "catalog.json", [CatalogEntry("slow", source)]))
    config.lora.load_timeout_s = 0.5
    config.server.allow_private_sources = True  # the source is on loopback
    try:
        async with running_server(config, tmp_path / "srv", env={"LORASERVE_ALLOW_HTTP_SOURCES": "1"}) as srv:
            status, body, headers = await complete(srv, "slow")
            assert status == 503 and body["error"]["code"] == "adapter_loading"
            assert "'slow'" in body["error"]["message"] and int(headers["Retry-After"]) > 0
            assert (await models(srv))["slow"]["lora"]["state"] == "loading"
            slow.release.set()
            for _ in range(100):  # the load went on in the background
                if srv.state.supply.is_loaded("slow"):
                    break
                await asyncio.sleep(0.05)
            status, body, _ = await complete(srv, "slow")
            assert status == 200 and body["choices"][0]["text"] == reference["sql-r8"]
            assert demand_loads(srv) == 1
    finally:
        await files.close()


async def test_not_ready_until_the_catalog_is_read(assets, tmp_path):
    path = tmp_path / "later" / "catalog.json"
    config = make_config(assets, adapters={})
    config.lora.catalog = str(path)
    app = build_app(
        config,
        lambda metrics: build_engine(config, observer=metrics),
        sources=SourceSettings(cache_dir=tmp_path / "cache"),
    )
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            url = str(server.make_url("/ready"))
            for _ in range(200):
                if app[STATE].engine is not None:
                    break
                await asyncio.sleep(0.05)
            async with session.get(url) as resp:
                body = await resp.json()
                assert resp.status == 503 and body["error"]["code"] == "catalog_not_ready"
                assert str(path) in body["error"]["message"]
            path.parent.mkdir()
            write_catalog(path, [CatalogEntry("sql-r8", str(assets.demo.adapters["sql-r8"]))])
            for _ in range(100):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
            assert resp.status == 200
            assert "sql-r8" in app[STATE].supply.catalog
    finally:
        await server.close()
