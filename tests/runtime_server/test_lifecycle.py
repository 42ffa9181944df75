"""The app's lifecycle in-process: /health before the model loads, /ready only when serving,
503 with a reason while loading, after a failed load, and once shutdown begins."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import threading
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.dev.demo import free_port
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.server import STATE, build_app, wait_until_ready

from .conftest import make_config
from .runtime_process import ready_turns_503, runtime_process, wait_ready


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


async def test_failed_load_reported(assets, tmp_path):
    """A failed load is reported by ready and requests."""
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


async def test_failed_tp_rank_gives_503(assets, tmp_path):
    """The pod's readiness follows its tensor-parallel group: once a rank is reported failed
    (the process exits a moment later), /ready and new requests answer 503 with the reason."""
    from loraserve.runtime.distributed import health

    cfg = make_config(assets)
    app = build_app(
        cfg,
        lambda metrics: build_engine(cfg, observer=metrics),
        sources=SourceSettings(cache_dir=tmp_path / "c"),
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


def _runtime(
    assets, port: int, *, drain_timeout: int, log: Path
) -> contextlib.AbstractContextManager[subprocess.Popen]:
    """The runtime on the tiny model at ``port``, draining up to ``drain_timeout`` s after SIGTERM."""
    return runtime_process(
        [
            *("--model", str(assets.model_dir), "--device", "cpu", "--host", "127.0.0.1"),
            *("--port", str(port), "--max-total-tokens", "16384", "--max-lora-rank", "16"),
            *("--drain-timeout", str(drain_timeout)),
        ],
        log,
    )


@pytest.mark.slow
async def test_sigterm_listens_while_draining(assets, tmp_path):
    """A real ``loraserve-runtime`` process: after SIGTERM the socket still answers (before:
    connection refused) — ``/ready`` 503 ``shutting_down``, a new completion 503 with
    ``Retry-After`` — while the long stream already running finishes; then exit 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "log"
    with _runtime(assets, port, drain_timeout=60, log=log) as proc:
        await wait_ready(url, proc, log)
        async with aiohttp.ClientSession() as session:
            # Several choices of many tokens: seconds of work on a CPU.
            body = {
                "prompt": "x = [",
                "max_tokens": 900,
                "n": 8,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                # Every probe gets an answer: none is refused while the stream drains.
                async with aiohttp.ClientSession() as other:
                    ready = await ready_turns_503(other, url, tries=200)
                    assert ready is not None, "/ready never turned 503 after SIGTERM"
                    assert ready["error"]["code"] == "shutting_down", ready
                    async with other.post(
                        url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}
                    ) as r:
                        refused = await r.json()
                        assert r.status == 503, refused
                        assert refused["error"]["code"] == "shutting_down"
                        assert int(r.headers["Retry-After"]) >= 1
                    async with other.get(url + "/health") as r:
                        assert r.status == 200
                    assert proc.poll() is None, "the process waits for the stream"
                rest = await resp.content.read()
        text = (first + rest).decode()
        assert text.rstrip().endswith("data: [DONE]")
        finishes = [
            c["finish_reason"]
            for line in text.splitlines()
            if line.startswith("data: {")
            for c in json.loads(line[6:])["choices"]
            if c["finish_reason"]
        ]
        assert finishes == ["length"] * 8, finishes
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]


@pytest.mark.slow
async def test_a_second_sigterm_ends_the_drain_at_once(assets, tmp_path):
    """The first SIGTERM drains (up to --drain-timeout, here 300 s); a second one stops
    waiting: the in-flight stream is cut short and the process still exits 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "log"
    with _runtime(assets, port, drain_timeout=300, log=log) as proc:
        await wait_ready(url, proc, log)
        async with aiohttp.ClientSession() as session:
            # 64 choices x 1000 tokens: far more than a CPU generates in the seconds this test
            # takes to send the second signal, on a loaded machine or an idle one.
            body = {
                "prompt": ["x = [", "y = (", "z = {", "w = ["],
                "max_tokens": 1000,
                "n": 16,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            text = b""
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                text += await resp.content.readline()
                proc.send_signal(signal.SIGTERM)
                async with aiohttp.ClientSession() as other:
                    await ready_turns_503(other, url, tries=300)
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(aiohttp.ClientError):
                    text += await resp.content.read()
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
        lengths = text.decode(errors="replace").count('"finish_reason":"length"')
        assert lengths < 64, "the stream was cut short, not drained to its end"
        assert "again: ending the drain now" in log.read_text()
