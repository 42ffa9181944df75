"""The prefix cache over HTTP: a repeated prompt prefix is served from the cache (visible in
``/metrics``), and ``POST /reset_prefix_cache`` (vLLM's route, admin token) empties it."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _metric(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def test_hits_in_metrics_and_reset(server):
    """Hits show in metrics and reset empties the cache."""
    prompt = list(range(40, 100))
    body = {"model": "sql-r8", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, first = await server.post("/v1/completions", {**body, "prompt": [*prompt, 1]})
    assert status == 200, first
    _, text = await server.get("/metrics")
    before = _metric(text, "loraserve:prefix_cache_hit_tokens_total", 'model="sql-r8"')
    status, second = await server.post("/v1/completions", {**body, "prompt": [*prompt, 2]})
    assert status == 200, second
    _, text = await server.get("/metrics")
    assert _metric(text, "loraserve:prefix_cache_hit_tokens_total", 'model="sql-r8"') - before >= len(prompt)
    assert _metric(text, "loraserve:prefix_cache_tokens", 'model_name="tiny-base"') > 0

    status, refused = await server.post("/reset_prefix_cache")
    assert status == 401, refused
    status, reset = await server.post("/reset_prefix_cache", headers=server.admin_headers())
    assert status == 200 and reset["status"] == "reset" and reset["freed_tokens"] > 0
    assert server.engine.kv.num_cached_tokens == 0
    # the next request misses, and caches again
    _, text = await server.get("/metrics")
    hits = _metric(text, "loraserve:prefix_cache_hit_tokens_total", 'model="sql-r8"')
    status, third = await server.post("/v1/completions", {**body, "prompt": [*prompt, 3]})
    assert status == 200, third
    _, text = await server.get("/metrics")
    assert _metric(text, "loraserve:prefix_cache_hit_tokens_total", 'model="sql-r8"') == hits
    assert server.engine.kv.num_cached_tokens > 0
