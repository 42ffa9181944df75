"""The app's lifecycle in-process: /health before the model loads, /ready only when serving,
503 with a reason while loading, after a failed load, and once shutdown begins."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
from aiohttp.test_utils import TestServer

from loraserve.runtime.engine.factory import build_engine
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.server import STATE, build_app, wait_until_ready

from .conftest import make_config


async def test_ready_only_once_the_model_serves(assets, tmp_path):
    cfg = make_config(assets)
    release = threading.Event()

    def slow_factory(metrics):
        assert release.wait(60)
        return build_engine(cfg, observer=metrics)

    app = build_app(cfg, slow_factory, sources=SourceSettings(cache_dir=tmp_path / "c"), drain_timeout_s=2)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as r:
                assert r.status == 200
            async with session.get(url + "/ready") as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "model_loading"
            async with session.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "5"
            release.set()
            await wait_until_ready(app)
            async with session.get(url + "/ready") as r:
                assert r.status == 200
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 200
            # Shutdown begins: no new work, /ready says so; the engine is still draining.
            app[STATE].draining = True
            app[STATE].engine.stop_accepting()
            async with session.get(url + "/ready") as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
            async with session.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
    finally:
        release.set()
        await server.close()
    assert not app[STATE].engine.running, "cleanup stops the engine thread"


async def test_a_failed_load_is_reported_by_ready_and_requests(assets, tmp_path):
    cfg = make_config(assets)

    def failing_factory(metrics):
        raise RuntimeError("weights are corrupt")

    app = build_app(cfg, failing_factory, sources=SourceSettings(cache_dir=tmp_path / "c"))
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        for _ in range(100):
            if app[STATE].load_error:
                break
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/ready") as r:
                body = await r.json()
                assert r.status == 503 and "weights are corrupt" in body["error"]["message"]
            async with session.post(url + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 503
            async with session.get(url + "/health") as r:
                assert r.status == 200
    finally:
        await server.close()


async def test_a_failed_tensor_parallel_rank_turns_ready_and_requests_to_503(assets, tmp_path):
    """The pod's readiness follows its tensor-parallel group: once a rank is reported failed
    (the process exits a moment later), /ready and new requests answer 503 with the reason."""
    from loraserve.runtime.parallel import health

    cfg = make_config(assets)
    app = build_app(
        cfg, lambda metrics: build_engine(cfg, observer=metrics), sources=SourceSettings(cache_dir=tmp_path / "c")
    )
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    state = health.reset_health(exit_on_failure=False)
    try:
        await wait_until_ready(app)
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/ready") as r:
                assert r.status == 200
            state.report_failure("rank 1 stopped answering")
            async with session.get(url + "/ready") as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "tensor_parallel_failed"
                assert "rank 1 stopped answering" in body["error"]["message"]
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "tensor_parallel_failed"
    finally:
        health.reset_health()
        await server.close()
