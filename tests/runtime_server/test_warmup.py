"""The start-up CUDA-graph warm-up in the real app: ``/ready`` stays 503 until the graphs are
warmed, and a warm-up that fails fails the load (reported, not ready, not hanging).

The engine's graph runner takes the padded static path (``use_graphs=False``, the CPU's
stand-in for a GPU's graphs); a gate in its ``run`` holds the warm-up where a test can see it.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.runner.cuda_graph import CudaGraphRunner
from loraserve.runtime.server import STATE, build_app, wait_until_ready

from .conftest import make_config


class GatedGraphs(CudaGraphRunner):
    """The static graph path, held at its first step until ``gate`` opens; ``fail``: every
    step raises, as a forward that fails at a graph's shape would."""

    def __init__(self, runner, *, fail: bool = False) -> None:
        super().__init__(runner, max_bs=4, use_graphs=False)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.fail = fail

    def run(self, batch, slots, alloc):
        self.entered.set()
        assert self.gate.wait(60)
        if self.fail:
            raise RuntimeError("the graph of this shape failed")
        return super().run(batch, slots, alloc)


def _app(assets, tmp_path, *, fail: bool = False):
    cfg = make_config(assets, max_running_requests=4)
    cfg.cuda_graph.enabled = True
    cfg.cuda_graph.max_bs = 4
    cfg.cuda_graph.warmup_context = 128
    made = {}

    def factory(metrics):
        engine, tokenizer = build_engine(cfg, observer=metrics)
        engine.runner.graphs = made["graphs"] = GatedGraphs(engine.runner, fail=fail)
        made["engine"] = engine
        return engine, tokenizer

    app = build_app(cfg, factory, sources=SourceSettings(cache_dir=tmp_path / "c"), drain_timeout_s=2)
    return app, made


async def _wait_for(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 60), "the warm-up never reached the graph runner"


async def test_ready_only_after_the_warmup(assets, tmp_path):
    app, made = _app(assets, tmp_path)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as session:
            while "graphs" not in made:
                await asyncio.sleep(0.02)
            graphs = made["graphs"]
            await _wait_for(graphs.entered)  # the engine runs, the warm-up is under way
            assert made["engine"].running
            async with session.get(url + "/health") as r:
                assert r.status == 200
            async with session.get(url + "/ready") as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "model_loading"
            graphs.gate.set()
            await wait_until_ready(app)
            async with session.get(url + "/ready") as r:
                assert r.status == 200
            assert graphs.num_shapes >= 2 * 3 * 2  # batch sizes 1, 2, 4 at buckets 64 and 128, base and adapter
            async with session.get(url + "/metrics") as r:
                text = await r.text()
            assert 'loraserve:cuda_graph_warmup_seconds{model_name="tiny-base"}' in text
            # Warm-up requests are not clients' requests: the serving metrics did not count them.
            assert "vllm:request_success_total{" not in text
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 200
            snap = app[STATE].engine.snapshot
            assert snap.kv_free_tokens == snap.kv_total_tokens
    finally:
        await server.close()


async def test_a_failing_warmup_fails_the_load(assets, tmp_path):
    app, made = _app(assets, tmp_path, fail=True)
    server = TestServer(app)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        while "graphs" not in made:
            await asyncio.sleep(0.02)
        made["graphs"].gate.set()
        with pytest.raises(RuntimeError, match="warming up the CUDA graphs failed: warm-up item"):
            await wait_until_ready(app, timeout_s=60)
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/ready") as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "model_load_failed"
                assert "the graph of this shape failed" in body["error"]["message"]
            async with session.post(url + "/v1/completions", json={"prompt": "x"}) as r:
                assert r.status == 503
        assert app[STATE].engine is None and not made["engine"].running  # stopped, not left running
    finally:
        await server.close()
