"""One authority per adapter name: the catalog's current entry decides which weights answer.

Real runtime apps on real ports, real engines, and a real HTTP file server on 127.0.0.1
that stalls (a slow remote source). Covers loads discarded when their entry changes or
leaves mid-load, admin loads that contradict the catalog, the catalog file reread on a
miss, readiness gated on the operator's push, and what a catalog refuses at PUT.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog
from loraserve.runtime.lora.sources import SourceSettings, adapter_digest
from loraserve.runtime.server import STATE, build_app, wait_until_ready

from .catalog_helpers import SlowFiles, catalog_listing, engine_keys, put_catalog, stream, wait_for
from .conftest import Server, make_config, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS = 8


def _slow_config(assets, tmp_path, entries: list[CatalogEntry], timeout_s: float = 60.0):
    config = make_config(assets, adapters={})
    config.server.allow_private_sources = True  # the slow source is on loopback
    config.lora.load_timeout_s = timeout_s
    path = tmp_path / "catalog.json"
    path.write_text(encode_catalog(entries))
    config.lora.catalog = str(path)
    return config


def _load_tasks(name: str) -> list[asyncio.Task]:
    return [
        t for t in asyncio.all_tasks() if t.get_name().startswith(f"load-adapter-{name}@") and not t.done()
    ]


async def test_mid_load_change_never_serves_old(assets, tmp_path):
    """An entry changed mid load never serves the old weights."""
    a, b = str(assets.demo.adapters["sql-r8"]), str(assets.demo.adapters["chat-r16"])
    async with SlowFiles(assets.demo.adapters["sql-r8"]) as slow:
        entries = [CatalogEntry("x", slow.source), CatalogEntry("ref-a", a), CatalogEntry("ref-b", b)]
        config = _slow_config(assets, tmp_path, entries)
        env = {"LORASERVE_ALLOW_HTTP_SOURCES": "1"}
        async with running_server(config, tmp_path / "srv", env=env) as srv:
            ref_b = (await stream(srv, "ref-b", TOKENS)).text
            assert ref_b != (await stream(srv, "ref-a", TOKENS)).text
            waiting = asyncio.create_task(stream(srv, "x", TOKENS))
            await wait_for(lambda: slow.asked > 0, "the slow source asked")
            listed = (await catalog_listing(srv))["by_name"]["x"]
            assert listed["state"] == "loading" and listed["loading_for_s"] >= 0, listed
            assert str(slow.server.port) in listed["waiting_on"], listed
            status, _ = await put_catalog(srv, [{"name": "x", "source": b}, {"name": "ref-b", "source": b}])
            assert status == 200
            # The waiting request retries on the new entry at once: no need for the old load.
            got = await asyncio.wait_for(waiting, 30)
            assert got.status == 200 and got.text == ref_b, got
            slow.release.set()
            await wait_for(lambda: not _load_tasks("x"), "the stale load to end")
            for _ in range(3):
                got = await stream(srv, "x", TOKENS)
                assert got.status == 200 and got.text == ref_b, got
            new = CatalogEntry("x", b)
            assert engine_keys(srv, "x") == {new.key}, "the stale load was discarded, never published"
            listed = (await catalog_listing(srv))["by_name"]["x"]
            assert listed["state"] == "loaded" and listed["serving_versions"] == [new.version]


async def test_an_entry_removed_mid_load_is_discarded(assets, tmp_path):
    async with SlowFiles(assets.demo.adapters["sql-r8"]) as slow:
        config = _slow_config(assets, tmp_path, [CatalogEntry("x", slow.source)])
        async with running_server(config, tmp_path / "srv", env={"LORASERVE_ALLOW_HTTP_SOURCES": "1"}) as srv:
            waiting = asyncio.create_task(stream(srv, "x", TOKENS))
            await wait_for(lambda: slow.asked > 0, "the slow source asked")
            assert (await put_catalog(srv, []))[0] == 200
            got = await asyncio.wait_for(waiting, 30)
            assert got.status == 404 and got.error["code"] == "model_not_found", got
            slow.release.set()
            await wait_for(lambda: not _load_tasks("x"), "the stale load to end")
            got = await stream(srv, "x", TOKENS)
            assert got.status == 404 and got.error["code"] == "model_not_found", got
            assert engine_keys(srv, "x") == set()
            _, models = await srv.get("/v1/models")
            assert "x" not in {m["id"] for m in models["data"]}


async def test_load_past_bound_names_wait(assets, tmp_path):
    """A load past the bound says what it waits on."""
    async with SlowFiles(assets.demo.adapters["sql-r8"]) as slow:
        config = _slow_config(assets, tmp_path, [CatalogEntry("slow", slow.source)], timeout_s=0.3)
        async with running_server(config, tmp_path / "srv", env={"LORASERVE_ALLOW_HTTP_SOURCES": "1"}) as srv:
            got = await stream(srv, "slow", TOKENS)
            assert got.status == 503 and got.error["code"] == "adapter_loading", got
            message = got.error["message"]
            assert "since the load began" in message and f"127.0.0.1:{slow.server.port}" in message, message
            assert str(tmp_path) not in message


async def _admin_load(srv, body: dict) -> tuple[int, dict]:
    return await srv.post("/v1/load_lora_adapter", body, headers=srv.admin_headers())


async def test_admin_load_must_match_catalog(server, assets):
    """Admin loads of a catalogued name must match the catalog."""
    a, b = assets.demo.adapters["sql-r8"], assets.extra_adapters["extra-0"]
    digest = adapter_digest(a)
    assert (await put_catalog(server, [{"name": "cat", "source": str(a), "sha256": digest}]))[0] == 200
    try:
        for body in (
            {"lora_name": "cat", "lora_path": str(b)},
            {"lora_name": "cat", "lora_path": str(a), "sha256": "0" * 64},
        ):
            status, err = await _admin_load(server, body)
            assert status == 409 and err["error"]["code"] == "adapter_conflict", err
            assert (
                err["error"]["param"] == "lora_name" and "catalog is the authority" in err["error"]["message"]
            )
        assert not engine_keys(server, "cat"), "a refused load loads nothing"
        status, loaded = await _admin_load(server, {"lora_name": "cat", "lora_path": str(a)})
        assert status == 200 and loaded["status"] == "loaded" and loaded["warm"] is True, loaded
        status, again = await _admin_load(server, {"lora_name": "cat", "lora_path": str(a), "sha256": digest})
        assert status == 200 and again["status"] == "already_loaded", again
        assert engine_keys(server, "cat") == {CatalogEntry("cat", str(a), digest).key}
        listed = (await catalog_listing(server))["by_name"]["cat"]
        assert listed["state"] == "loaded" and listed["warm"] is True
    finally:
        await put_catalog(server, [])
        await server.post("/v1/unload_lora_adapter", {"lora_name": "cat"}, headers=server.admin_headers())


async def test_miss_rereads_catalog_file(assets, tmp_path):
    """A miss rereads the catalog file until a push."""
    a, b = str(assets.demo.adapters["sql-r8"]), str(assets.demo.adapters["chat-r16"])
    config = make_config(assets, adapters={})
    path = tmp_path / "catalog.json"
    path.write_text(encode_catalog([CatalogEntry("a", a)]))
    config.lora.catalog = str(path)
    async with running_server(config, tmp_path / "srv") as srv:
        assert (await stream(srv, "a", TOKENS)).status == 200
        # The file gains "late" after the pod read it (a ConfigMap refreshed meanwhile).
        path.write_text(encode_catalog([CatalogEntry("a", a), CatalogEntry("late", b)]))
        got = await stream(srv, "late", TOKENS)
        assert got.status == 200, got
        # Once the operator pushed, the push is the catalog: the file is not read again.
        assert (await put_catalog(srv, [{"name": "a", "source": a}]))[0] == 200
        path.write_text(encode_catalog([CatalogEntry("a", a), CatalogEntry("later", b)]))
        got = await stream(srv, "later", TOKENS)
        assert got.status == 404 and got.error["code"] == "model_not_found", got


@contextlib.asynccontextmanager
async def _unready_server(config, tmp_path):
    """The app on a real port, waiting for the engine only (not for ``/ready``)."""
    app = build_app(
        config,
        lambda metrics: build_engine(config, observer=metrics),
        sources=SourceSettings(cache_dir=tmp_path),
    )
    server = TestServer(app)
    await server.start_server()
    session = aiohttp.ClientSession()
    try:
        await wait_for(
            lambda: app[STATE].engine is not None and app[STATE].supply.catalog_ready, "the engine"
        )
        yield Server(app=app, server=server, session=session, config=config)
    finally:
        await session.close()
        await server.close()


async def test_confirm_holds_readiness(assets, tmp_path):
    """Catalog confirm holds readiness until the first push."""
    a = str(assets.demo.adapters["sql-r8"])
    config = make_config(assets, adapters={})
    path = tmp_path / "catalog.json"
    path.write_text(encode_catalog([CatalogEntry("a", a)]))
    config.lora.catalog = str(path)
    config.lora.catalog_confirm = True
    async with _unready_server(config, tmp_path) as srv:
        status, body = await srv.get("/ready")
        assert status == 503 and body["error"]["code"] == "catalog_not_confirmed", body
        got = await stream(srv, "a", TOKENS)  # catalogued, but maybe stale until confirmed
        assert got.status == 503 and got.error["code"] == "adapter_loading", got
        got = await stream(srv, "unknown", TOKENS)  # not known yet, not "does not exist"
        assert got.status == 503 and got.error["code"] == "catalog_not_confirmed", got
        assert (await catalog_listing(srv))["confirmed"] is False
        assert (await put_catalog(srv, [{"name": "a", "source": a}]))[0] == 200
        status, body = await srv.get("/ready")
        assert status == 200, body
        assert (await stream(srv, "a", TOKENS)).status == 200
        got = await stream(srv, "unknown", TOKENS)
        assert got.status == 404 and got.error["code"] == "model_not_found", got
        assert (await catalog_listing(srv))["confirmed"] is True


async def test_push_during_model_load_confirms(assets, tmp_path):
    """The operator pushes to a pod still loading its model: taken at once (before: 503
    ``model_loading``), so the pod turns Ready as soon as the model serves."""
    a = str(assets.demo.adapters["sql-r8"])
    config = make_config(assets, adapters={})
    config.lora.catalog_confirm = True
    gate = threading.Event()

    def factory(metrics):
        gate.wait(60)
        return build_engine(config, observer=metrics)

    app = build_app(config, factory, sources=SourceSettings(cache_dir=tmp_path))
    server = TestServer(app)
    await server.start_server()
    session = aiohttp.ClientSession()
    srv = Server(app=app, server=server, session=session, config=config)
    try:
        status, body = await srv.get("/ready")
        assert status == 503 and body["error"]["code"] == "model_loading", body
        assert (await put_catalog(srv, [{"name": "a", "source": a}]))[0] == 200
        gate.set()
        await wait_until_ready(app)
        assert (await srv.get("/ready"))[0] == 200
        assert (await stream(srv, "a", TOKENS)).status == 200
    finally:
        gate.set()
        await session.close()
        await server.close()


async def test_catalog_refuses_bad_names(server, assets):
    """The catalog refuses control characters newlines and the base name."""
    a = str(assets.demo.adapters["sql-r8"])
    for entry, field in (
        ({"name": "n", "source": a + "\x00/x"}, "adapters[0].source"),
        ({"name": "n", "source": a, "draft_source": a + "\x00"}, "adapters[0].draft_source"),
        ({"name": "n", "source": "https://host/a\r\nX-Injected: 1"}, "adapters[0].source"),
        ({"name": "n\n", "source": a}, "adapters[0].name"),
        ({"name": "n", "source": a, "sha256": "a" * 64 + "\n"}, "adapters[0].sha256"),
        ({"name": "tiny-base", "source": a}, "adapters[0].name"),
        (
            {"name": "n", "source": a, "draft_source": a, "draft_sha256": "b" * 64 + "\n"},
            "adapters[0].draft_sha256",
        ),
    ):
        status, err = await put_catalog(server, [entry])
        assert status == 400 and err["error"]["param"] == field, (entry, err)
    assert (await catalog_listing(server))["adapters"] == [], "a refused push changes nothing"
    got = await stream(server, "n", TOKENS)
    assert got.status == 404, "never a 500 for a refused entry"
    # A 404 echoes a bounded piece of the name and lists nothing.
    assert (await put_catalog(server, [{"name": f"a-{i}", "source": a} for i in range(50)]))[0] == 200
    try:
        got = await stream(server, "z" * 5000, TOKENS)
        assert got.status == 404 and got.error["code"] == "model_not_found", got
        assert len(got.error["message"]) < 300 and "a-1" not in got.error["message"], got.error
        status, err = await server.get("/v1/models/" + "z" * 5000)
        assert status == 404 and len(err["error"]["message"]) < 300, err
    finally:
        assert (await put_catalog(server, []))[0] == 200


async def test_longest_name_loads(server, assets):
    """A 253-character name (the catalog's limit) plus ``@version`` is still an engine key."""
    name = "n" * 253
    status, _ = await put_catalog(server, [{"name": name, "source": str(assets.demo.adapters["sql-r8"])}])
    assert status == 200
    try:
        got = await stream(server, name, TOKENS)
        assert got.status == 200, got
        assert len(next(iter(engine_keys(server, name)))) > 256
    finally:
        assert (await put_catalog(server, []))[0] == 200


async def test_changed_loaded_entry_reloads(server, assets):
    """No request needs to come first: the pod that served the old version fetches the new."""
    a, b = str(assets.demo.adapters["sql-r8"]), str(assets.extra_adapters["extra-1"])
    assert (await put_catalog(server, [{"name": "pf", "source": a}]))[0] == 200
    try:
        assert (await stream(server, "pf", TOKENS)).status == 200
        assert (await put_catalog(server, [{"name": "pf", "source": b}]))[0] == 200
        new = CatalogEntry("pf", b)
        await wait_for(
            lambda: engine_keys(server, "pf") == {new.key}, "the new version loaded, the old freed"
        )
        # Never served here: a changed entry waits for its first request.
        assert (await put_catalog(server, [{"name": "pf", "source": a}, {"name": "cold", "source": a}]))[
            0
        ] == 200
        assert (await put_catalog(server, [{"name": "pf", "source": a}, {"name": "cold", "source": b}]))[
            0
        ] == 200
        await wait_for(lambda: engine_keys(server, "pf") == {CatalogEntry("pf", a).key}, "pf back on a")
        assert engine_keys(server, "cold") == set()
    finally:
        assert (await put_catalog(server, []))[0] == 200


async def test_taken_over_name_serves_entry(server, assets):
    """An admin-loaded name that the catalog then lists: the same identity is kept as is
    (still loaded and warm); another identity (here: a sha256 the entry does not give) is
    replaced by the entry's version, so the listing never shows a version it does not serve."""
    a = str(assets.demo.adapters["sql-r8"])
    digest = adapter_digest(assets.demo.adapters["sql-r8"])
    for name, sha in (("same", None), ("other", digest)):
        status, body = await _admin_load(server, {"lora_name": name, "lora_path": a, "sha256": sha})
        assert status == 200, body
    try:
        assert (await put_catalog(server, [{"name": "same", "source": a}, {"name": "other", "source": a}]))[
            0
        ] == 200
        listed = (await catalog_listing(server))["by_name"]
        assert listed["same"]["state"] == "loaded" and listed["same"]["warm"] is True
        assert listed["same"]["serving_versions"] == [listed["same"]["version"]]
        assert (await stream(server, "other", TOKENS)).status == 200
        listed = (await catalog_listing(server))["by_name"]
        assert listed["other"]["serving_versions"] == [listed["other"]["version"]]
        assert engine_keys(server, "other") == {CatalogEntry("other", a).key}
    finally:
        assert (await put_catalog(server, []))[0] == 200
