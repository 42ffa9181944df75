"""/metrics: Prometheus text that prometheus_client's own parser reads, with counts that move."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _scrape(server) -> dict[str, list]:
    async with server.session.get(server.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def _value(samples: dict, name: str, **labels) -> float:
    total = 0.0
    for s in samples.get(name, []):
        if all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


async def test_counters_and_histograms_move(server):
    before = await _scrape(server)
    body = {
        "model": "sql-r8",
        "prompt": "def add(a, b):",
        "max_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, resp = await server.post("/v1/completions", body)
    assert status == 200
    status, _ = await server.post("/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert status == 400
    after = await _scrape(server)
    m = {"model_name": "tiny-base"}
    prompt = resp["usage"]["prompt_tokens"]
    assert (
        _value(after, "vllm:prompt_tokens_total", **m) - _value(before, "vllm:prompt_tokens_total", **m)
        == prompt
    )
    assert (
        _value(after, "vllm:generation_tokens_total", **m)
        - _value(before, "vllm:generation_tokens_total", **m)
        == 7
    )
    assert (
        _value(after, "vllm:request_success_total", finished_reason="length")
        - _value(before, "vllm:request_success_total", finished_reason="length")
    ) == 1
    assert (
        _value(after, "loraserve:requests_total", model="sql-r8")
        - _value(before, "loraserve:requests_total", model="sql-r8")
    ) == 1
    for hist, n in (
        ("vllm:time_to_first_token_seconds", 1),
        ("vllm:e2e_request_latency_seconds", 1),
        ("vllm:inter_token_latency_seconds", 6),
    ):
        assert _value(after, hist + "_count") - _value(before, hist + "_count") == n, hist
    assert _value(after, "loraserve:batch_size_count", kind="decode") > _value(
        before, "loraserve:batch_size_count", kind="decode"
    )
    assert (
        _value(after, "loraserve:http_requests_total", route="/v1/completions", status="400")
        - _value(before, "loraserve:http_requests_total", route="/v1/completions", status="400")
    ) == 1
    assert _value(after, "loraserve:adapters_loaded") == len(server.config.lora.adapters)
    assert _value(after, "loraserve:kv_cache_total_tokens") == server.config.scheduler.max_total_tokens
    # The engine's step counters: one extend for the prompt (its first token), six decode
    # tokens. The snapshot is published after the step that answered the request, so it
    # may trail the response by that one step: scrape until it has caught up.
    ext = {"model_name": "tiny-base", "kind": "extend"}
    dec = {"model_name": "tiny-base", "kind": "decode"}

    def delta(name: str, **labels) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    for _ in range(100):
        if delta("loraserve:engine_step_tokens_total", **dec) >= 6:
            break
        await asyncio.sleep(0.02)
        after = await _scrape(server)
    assert delta("loraserve:engine_step_tokens_total", **dec) == 6
    assert delta("loraserve:engine_steps_total", **ext) >= 1
    assert delta("loraserve:engine_step_tokens_total", **ext) == prompt
    assert delta("loraserve:engine_decoder_seconds_total", **dec) > 0
    assert delta("loraserve:engine_host_seconds_total", **m) > 0
    assert 0 < _value(after, "loraserve:decode_occupancy", **m) <= 1
    assert "loraserve:deferred_admission_steps_total" in after
    assert "loraserve:extends_during_decode_total" in after
    # CPU serve: no CUDA graphs, no failed captures (exported, so a GPU serve that falls
    # back to eager steps after a failed capture shows it)
    assert _value(after, "loraserve:cuda_graphs", **m) == 0
    assert _value(after, "loraserve:cuda_graph_capture_failures_total", **m) == 0
    assert "loraserve:cuda_graph_capture_failures_total" in after


async def test_lora_gauges_follow_adapters(server):
    """LoRA requests info and queue gauges follow running adapters."""
    idle = await _scrape(server)
    info = idle["vllm:lora_requests_info"]
    assert len(info) == 1
    assert info[0].labels == {
        "max_lora": str(server.config.lora.max_loras_per_batch),
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert info[0].value > 1e9  # the sample's time, as vLLM reports it

    async def stream(model: str):
        async with server.session.post(
            server.url + "/v1/completions",
            json={
                "model": model,
                "prompt": "while x:",
                "max_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as resp:
            async for line in resp.content:
                if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["finish_reason"]:
                    break

    tasks = [asyncio.create_task(stream(m)) for m in ("sql-r8", "chat-r16", "tiny-base")]
    seen = None
    for _ in range(400):
        samples = await _scrape(server)
        if _value(samples, "vllm:num_requests_running") == 3:
            seen = samples
            break
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert seen is not None, "never saw the three requests running"
    labels = seen["vllm:lora_requests_info"][0].labels
    assert labels["running_lora_adapters"].split(",") == ["chat-r16", "sql-r8"]
    assert _value(seen, "vllm:kv_cache_usage_perc") > 0
    done = await _scrape(server)
    assert _value(done, "vllm:num_requests_running") == 0
