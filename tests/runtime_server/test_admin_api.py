"""Admin API over real HTTP: bearer auth, idempotent load/unload, bad adapters, and adapter
churn while requests run (no request is lost or changed)."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from loraserve.runtime.lora.sources import adapter_digest

from .conftest import ADMIN_TOKEN

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _load(server, body: dict, token: str | None = ADMIN_TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return await server.post("/v1/load_lora_adapter", body, headers=headers)


async def _unload(server, name: str) -> tuple[int, dict]:
    return await server.post("/v1/unload_lora_adapter", {"lora_name": name}, headers=server.admin_headers())


async def _model_ids(server) -> set[str]:
    status, body = await server.get("/v1/models")
    assert status == 200
    return {m["id"] for m in body["data"]}


async def test_admin_routes_need_the_bearer_token(server, assets):
    body = {"lora_name": "auth-probe", "lora_path": str(assets.extra_adapters["extra-0"])}
    for token, code in ((None, "missing_token"), ("wrong-token", "invalid_token")):
        status, resp = await _load(server, body, token=token)
        assert status == 401 and resp["error"]["code"] == code
    async with server.session.post(
        server.url + "/v1/load_lora_adapter", json=body, headers={"Authorization": f"Basic {ADMIN_TOKEN}"}
    ) as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": "sql-r8"})
    assert status == 401
    assert "auth-probe" not in await _model_ids(server)
    assert "sql-r8" in await _model_ids(server), "an unauthorised unload must change nothing"
    status, resp = await _load(server, body)
    assert status == 200 and resp["status"] == "loaded"
    assert "auth-probe" in await _model_ids(server)
    status, resp = await _unload(server, "auth-probe")
    assert status == 200 and resp["status"] == "unloaded"


async def test_load_is_idempotent_and_conflicts_are_409(server, assets):
    path = str(assets.extra_adapters["extra-1"])
    status, first = await _load(server, {"lora_name": "idem", "lora_path": path})
    assert status == 200 and first["status"] == "loaded" and first["rank"] == 6
    status, again = await _load(server, {"lora_name": "idem", "lora_path": path})
    assert status == 200 and again["status"] == "already_loaded"
    status, conflict = await _load(
        server, {"lora_name": "idem", "lora_path": str(assets.extra_adapters["extra-2"])}
    )
    assert status == 409 and conflict["error"]["param"] == "lora_name"
    # Unload is idempotent too.
    assert (await _unload(server, "idem"))[1]["status"] == "unloaded"
    status, body = await _unload(server, "idem")
    assert status == 200 and body["status"] == "not_loaded"
    assert "idem" not in await _model_ids(server)


async def test_bad_adapters_refused(server, assets, tmp_path):
    """Bad adapters are refused with the field and nothing changes."""
    before = await _model_ids(server)
    good = assets.extra_adapters["extra-0"]
    high_rank = tmp_path / "high-rank"
    shutil.copytree(assets.demo.adapters["chat-r16"], high_rank)
    cfg = json.loads((high_rank / "adapter_config.json").read_text())
    cfg["r"] = 64  # the tensors still say 16 and the server's max rank is 16
    (high_rank / "adapter_config.json").write_text(json.dumps(cfg))
    pickle_dir = tmp_path / "pickle"
    pickle_dir.mkdir()
    shutil.copy(good / "adapter_config.json", pickle_dir / "adapter_config.json")
    (pickle_dir / "adapter_model.bin").write_bytes(b"\x80\x04not really")
    cases = [
        ({"lora_name": "bad-1", "lora_path": str(tmp_path / "missing")}, 400, "lora_path"),
        ({"lora_name": "bad-2", "lora_path": str(high_rank)}, 400, None),
        ({"lora_name": "bad-3", "lora_path": str(pickle_dir)}, 400, "lora_path"),
        ({"lora_name": "bad-4", "lora_path": str(good), "sha256": "0" * 64}, 400, "sha256"),
        ({"lora_name": "bad-5", "lora_path": str(good), "sha256": "xyz"}, 400, "sha256"),
        ({"lora_name": "", "lora_path": str(good)}, 400, "lora_name"),
        ({"lora_name": "tiny-base", "lora_path": str(good)}, 400, "lora_name"),
        ({"lora_path": str(good)}, 400, "lora_name"),
        ({"lora_name": "bad-6"}, 400, "lora_path"),
        ({"lora_name": "bad-7", "lora_path": str(good), "pinned": "yes"}, 400, "pinned"),
        ({"lora_name": "bad-8", "lora_path": "ftp://host/x"}, 400, "lora_path"),
    ]
    for body, status, param in cases:
        got, resp = await _load(server, body)
        assert got == status, (body, resp)
        if param is not None:
            assert resp["error"]["param"] == param, (body, resp)
        assert resp["error"]["message"]
    assert await _model_ids(server) == before
    # The right digest loads.
    status, resp = await _load(
        server, {"lora_name": "digest-ok", "lora_path": str(good), "sha256": adapter_digest(good)}
    )
    assert status == 200, resp
    await _unload(server, "digest-ok")


async def _stream_tokens(server, body: dict) -> tuple[str, str | None, int]:
    text, reason, usage = "", None, 0
    async with server.session.post(
        server.url + "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"]:
                text += event["choices"][0]["text"]
                reason = event["choices"][0]["finish_reason"] or reason
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
    return text, reason, usage


async def test_unload_under_traffic(server, assets):
    """Unload while requests run loses none and refuses new ones."""
    path = str(assets.extra_adapters["extra-2"])
    assert (await _load(server, {"lora_name": "churn", "lora_path": path}))[0] == 200
    body = {
        "model": "churn",
        "prompt": "async def main():",
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,
    }
    reference = await _stream_tokens(server, body)
    tasks = [asyncio.create_task(_stream_tokens(server, body)) for _ in range(4)]
    engine = server.engine
    for _ in range(500):  # until they are all running
        if engine.snapshot.num_running >= 4:
            break
        await asyncio.sleep(0.01)
    status, resp = await _unload(server, "churn")
    assert status == 200 and resp["status"] == "unloaded"
    status, refused = await server.post("/v1/completions", body)
    assert status == 404 and refused["error"]["param"] == "model"
    results = await asyncio.gather(*tasks)
    assert all(r == reference for r in results), "in-flight requests finish exactly as if nothing happened"
    assert reference[1] == "length" and reference[2] == 48
    assert "churn" not in await _model_ids(server)
    assert all(info.name != "churn" for info in engine.list_adapters()), "freed once the last request ended"
    # The same name can come back.
    assert (await _load(server, {"lora_name": "churn", "lora_path": path}))[0] == 200
    await _unload(server, "churn")


async def test_loads_under_traffic(server, assets):
    """Loads while requests run change nothing for them."""
    body = {
        "model": "sql-r8",
        "prompt": "import sys\n",
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    reference = await _stream_tokens(server, body)
    tasks = [asyncio.create_task(_stream_tokens(server, body)) for _ in range(3)]
    names = []
    for i, path in enumerate(assets.extra_adapters.values()):
        status, resp = await _load(server, {"lora_name": f"live-{i}", "lora_path": str(path)})
        assert status == 200, resp
        names.append(f"live-{i}")
    results = await asyncio.gather(*tasks)
    assert all(r == reference for r in results)
    ids = await _model_ids(server)
    assert set(names) <= ids
    for name in names:
        assert (await _unload(server, name))[0] == 200


async def test_pool_capacity_is_a_clear_503(server, assets, tmp_path):
    limit = server.config.lora.max_loaded_loras
    loaded = len([i for i in server.engine.list_adapters()])
    names = []
    for i in range(limit - loaded):
        d = tmp_path / f"cap-{i}"
        shutil.copytree(assets.extra_adapters["extra-0"], d)
        status, resp = await _load(server, {"lora_name": f"cap-{i}", "lora_path": str(d)})
        assert status == 200, resp
        names.append(f"cap-{i}")
    status, resp = await _load(
        server, {"lora_name": "one-too-many", "lora_path": str(assets.extra_adapters["extra-1"])}
    )
    assert status == 503
    assert "max_loaded_loras" in resp["error"]["message"]
    for name in names:
        await _unload(server, name)
    status, resp = await _load(
        server, {"lora_name": "one-too-many", "lora_path": str(assets.extra_adapters["extra-1"])}
    )
    assert status == 200
    await _unload(server, "one-too-many")


async def test_pinned_adapters_keep_slots(server, assets, tmp_path):
    """Pinned adapters keep slots and unpinned ones take turns."""
    slots = server.config.lora.max_loras_per_batch
    names = []
    for i in range(slots - 1):
        d = tmp_path / f"pin-{i}"
        shutil.copytree(assets.extra_adapters["extra-0"], d)
        status, resp = await _load(server, {"lora_name": f"pin-{i}", "lora_path": str(d), "pinned": True})
        assert status == 200 and resp["pinned"], resp
        names.append(f"pin-{i}")
    d = tmp_path / "pin-last"
    shutil.copytree(assets.extra_adapters["extra-0"], d)
    status, refused = await _load(server, {"lora_name": "pin-last", "lora_path": str(d), "pinned": True})
    assert status == 503 and refused["error"]["param"] == "pinned", "one slot always stays unpinned"
    # Two unpinned adapters share the one free slot: both are served, one after the other.
    body = {"prompt": "x = 1", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    alone = {}
    for model in ("sql-r8", "chat-r16"):
        status, resp = await server.post("/v1/completions", {**body, "model": model})
        assert status == 200
        alone[model] = resp["choices"][0]["text"]
    results = await asyncio.gather(
        *[
            server.post("/v1/completions", {**body, "model": m})
            for m in ("sql-r8", "chat-r16", "pin-0", "tiny-base")
        ]
    )
    assert all(status == 200 for status, _ in results)
    assert results[0][1]["choices"][0]["text"] == alone["sql-r8"]
    assert results[1][1]["choices"][0]["text"] == alone["chat-r16"]
    for name in names:
        await _unload(server, name)


async def test_reload_while_the_old_one_drains(server, assets):
    """Unload, then load the same name from other weights while the old adapter still serves
    its requests: the new weights load at once under their own engine key (before: 503
    ``adapter_draining`` until the old requests ended); in-flight requests finish on the old
    weights, new ones get the new."""
    old_path, new_path = str(assets.extra_adapters["extra-2"]), str(assets.extra_adapters["extra-0"])
    assert (await _load(server, {"lora_name": "redo", "lora_path": old_path}))[0] == 200
    body = {"model": "redo", "prompt": "def f(x):", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
    tasks = [asyncio.create_task(_stream_tokens(server, body)) for _ in range(4)]
    engine = server.engine
    for _ in range(500):
        if engine.snapshot.num_running >= 4:
            break
        await asyncio.sleep(0.01)
    status, resp = await _unload(server, "redo")
    assert status == 200 and resp["status"] == "unloaded"
    status, loaded = await _load(server, {"lora_name": "redo", "lora_path": new_path})
    assert status == 200 and loaded["status"] == "loaded" and loaded["rank"] == 4, loaded
    assert not all(t.done() for t in tasks), "the old requests were still running"
    assert (await server.post("/v1/completions", {**body, "max_tokens": 2}))[0] == 200
    results = await asyncio.gather(*tasks)
    assert all(r[1] == "length" and r[2] == 600 for r in results)
    assert len({r[0] for r in results}) == 1, "every old request ran on the old weights alone"
    await _unload(server, "redo")


async def test_catalog_change_under_traffic(assets, tmp_path):
    """The operator pushes a new source for ``x`` while requests still run on the old one: a
    new request for ``x`` meanwhile is served by the new version (before: 503
    ``adapter_draining``); the old requests run to their end on the old one."""
    from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog

    from .conftest import make_config, running_server

    a, b = assets.demo.adapters["sql-r8"], assets.demo.adapters["chat-r16"]
    config = make_config(assets, adapters={})
    catalog = tmp_path / "catalog.json"
    catalog.write_text(encode_catalog([CatalogEntry("x", str(a))]))
    config.lora.catalog = str(catalog)
    async with running_server(config, tmp_path / "srv") as srv:
        body = {"model": "x", "prompt": "def f(x):", "max_tokens": 600, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(_stream_tokens(srv, body)) for _ in range(3)]
        for _ in range(1000):
            if srv.engine.snapshot.num_running >= 3:
                break
            await asyncio.sleep(0.01)
        async with srv.session.put(
            srv.url + "/v1/lora_catalog",
            json={"adapters": [{"name": "x", "source": str(b)}]},
            headers=srv.admin_headers(),
        ) as resp:
            change = await resp.json()
            assert resp.status == 200 and change["unloaded"] == ["x"], change
        status, done = await srv.post("/v1/completions", {**body, "max_tokens": 2})
        assert status == 200, done
        assert not all(t.done() for t in tasks), "the old requests were still running"
        status, info = await srv.get("/v1/models")
        assert {m["id"]: m for m in info["data"]}["x"]["lora"]["rank"] == 16
        results = await asyncio.gather(*tasks)
        assert all(r[1] == "length" and r[2] == 600 for r in results)


async def test_unpinned_hf_load_warns(assets, tmp_path):
    """``hf://org/repo`` without ``@<commit>`` follows main: loaded, with a warning naming
    lora_path and the fix in the response (the operator copies load warnings into the
    Adapter's status); a pinned commit loads without one."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from loraserve.runtime.lora.sources import ADAPTER_FILES

    from .conftest import make_config, running_server

    commit = "0123456789abcdef0123456789abcdef01234567"
    directory = assets.extra_adapters["extra-0"]
    files = {
        f"/org/adapters/resolve/{rev}/{name}": (directory / name).read_bytes()
        for rev in ("main", commit)
        for name in ADAPTER_FILES
    }

    async def handle(request: web.Request) -> web.Response:
        body = files.get(request.path)
        return web.Response(body=body) if body is not None else web.Response(status=404)

    hub_app = web.Application()
    hub_app.router.add_get("/{tail:.*}", handle)
    hub = TestServer(hub_app, host="127.0.0.1")
    await hub.start_server()
    try:
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{hub.port}"}
        config = make_config(assets)
        config.server.allow_private_sources = True  # the stand-in hub is on loopback
        async with running_server(config, tmp_path, env=env) as srv:
            status, floating = await _load(srv, {"lora_name": "hub-main", "lora_path": "hf://org/adapters"})
            assert status == 200, floating
            assert [w for w in floating["warnings"] if w.startswith("lora_path:")] == [
                "lora_path: hf://org/adapters names no revision, so it follows the repository's main branch: a new "
                "pod, a restart or a reload may fetch other weights than the running ones; pin a commit: "
                "hf://org/adapters@<40-character commit sha>"
            ]
            status, pinned = await _load(
                srv, {"lora_name": "hub-pinned", "lora_path": f"hf://org/adapters@{commit}"}
            )
            assert status == 200, pinned
            assert not any(w.startswith("lora_path:") for w in pinned["warnings"]), pinned["warnings"]
    finally:
        await hub.close()
