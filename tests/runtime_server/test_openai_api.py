"""The OpenAI-compatible API over real HTTP: completions, chat, streaming, models, probes.

Oracles: a streamed answer equals the same request unstreamed; a greedy answer through
the server equals the tokens the model runner produces when driven directly; the same
seed gives the same sample; stop strings cut exactly where the unstopped text shows them.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _sse_events(server, path: str, body: dict) -> tuple[list[dict], int, str]:
    """POST with stream=true; return (parsed data events, status, content type)."""
    events: list[dict] = []
    async with server.session.post(server.url + path, json={**body, "stream": True}) as resp:
        ctype = resp.headers.get("Content-Type", "")
        if resp.status != 200:
            return [await resp.json()], resp.status, ctype
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
        for block in buf.decode().split("\n\n"):
            if not block.strip():
                continue
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events, resp.status, ctype


async def test_probes_and_models(server):
    status, body = await server.get("/health")
    assert status == 200 and body["status"] == "ok"
    status, body = await server.get("/ready")
    assert status == 200 and body["status"] == "ready"
    status, body = await server.get("/v1/models")
    assert status == 200
    ids = {m["id"]: m for m in body["data"]}
    assert set(ids) == {"tiny-base", *server.config.lora.adapters}
    assert ids["tiny-base"]["parent"] is None
    for name, path in server.config.lora.adapters.items():
        assert ids[name]["parent"] == "tiny-base"
        # No token needed here: the pod's file layout is not shown (root is the adapter's name).
        assert ids[name]["root"] == name and "source" not in ids[name]["lora"]
        assert path not in json.dumps(body)
    assert ids["tiny-base"]["root"] == "tiny-base" and server.config.model.path not in json.dumps(body)
    # With the admin token, each adapter's real source is listed (the operator compares it).
    status, body = await server.get("/v1/models", headers=server.admin_headers())
    ids = {m["id"]: m for m in body["data"]}
    for name, path in server.config.lora.adapters.items():
        assert ids[name]["root"] == name and ids[name]["lora"]["source"] == path


async def _greedy_reference(server, prompt_ids: list[int], adapter: str | None, n: int) -> list[int]:
    """Greedy tokens from the engine's own runner, driven directly (no scheduler)."""
    runner = server.engine.runner
    rid = f"ref-{adapter}-{len(prompt_ids)}-{n}"
    out: list[int] = []

    def run() -> list[int]:
        try:
            logits = runner.forward(
                ForwardBatch(
                    ForwardMode.EXTEND,
                    [rid],
                    torch.tensor(prompt_ids),
                    extend_lens=[len(prompt_ids)],
                    lora_names=[adapter],
                )
            ).logits
            tok = int(logits[0].argmax())
            out.append(tok)
            for _ in range(n - 1):
                logits = runner.forward(
                    ForwardBatch(ForwardMode.DECODE, [rid], torch.tensor([tok]), lora_names=[adapter])
                ).logits
                tok = int(logits[0].argmax())
                out.append(tok)
            return out
        finally:
            runner.kv.free(rid)

    # On the engine thread, between steps: the runner is never used concurrently.
    return await asyncio.wrap_future(server.engine.call(run))


@pytest.mark.parametrize("model", ["tiny-base", "sql-r8", "chat-r16"])
async def test_completion_matches_runner(server, model):
    """Completion matches direct runner and stream."""
    prompt = "def parse(text):\n    return"
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    status, full = await server.post("/v1/completions", body)
    assert status == 200, full
    assert full["object"] == "text_completion" and full["model"] == model
    choice = full["choices"][0]
    assert choice["finish_reason"] == "length"
    tok = server.state.tokenizer
    prompt_ids = tok.encode(prompt)
    assert full["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
    }
    ref = await _greedy_reference(server, prompt_ids, None if model == "tiny-base" else model, 12)
    assert choice["text"] == tok.decode(ref)

    events, status, ctype = await _sse_events(server, "/v1/completions", body)
    assert status == 200 and ctype.startswith("text/event-stream")
    assert events[-1] == {"done": True}
    chunks = events[:-1]
    assert len(chunks) >= 2, "a streamed answer arrives in several events"
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["id"] == chunks[0]["id"] for c in chunks)


async def test_adapters_change_the_output(server):
    texts = set()
    for model in ("tiny-base", "sql-r8", "chat-r16"):
        status, body = await server.post(
            "/v1/completions",
            {"model": model, "prompt": "import os\n", "max_tokens": 10, "temperature": 0, "ignore_eos": True},
        )
        assert status == 200
        texts.add(body["choices"][0]["text"])
    assert len(texts) == 3


async def test_chat_stream_equals_non_stream_and_usage(server):
    body = {
        "model": "chat-r16",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        "max_tokens": 9,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, full = await server.post("/v1/chat/completions", body)
    assert status == 200, full
    assert full["object"] == "chat.completion"
    message = full["choices"][0]["message"]
    assert message["role"] == "assistant"
    tok = server.state.tokenizer
    from loraserve.runtime.tokenizer import ChatMessage

    prompt_ids = tok.encode_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hello there")])
    assert full["usage"]["prompt_tokens"] == len(prompt_ids)
    assert message["content"] == tok.decode(await _greedy_reference(server, prompt_ids, "chat-r16", 9))

    events, status, _ = await _sse_events(
        server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert status == 200
    assert events[-1] == {"done": True}
    chunks = events[:-1]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c["choices"])
    assert content == message["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_seeded_sampling_reproducible(server):
    """Seeded sampling is reproducible and seeds differ."""
    body = {
        "model": "sql-r8",
        "prompt": "class Parser:",
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 0.95,
        "seed": 1234,
        "ignore_eos": True,
    }
    a = await server.post("/v1/completions", body)
    # Same seed while other requests share the batch.
    others = {
        "model": "tiny-base",
        "prompt": "x = 1",
        "max_tokens": 16,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    results = await asyncio.gather(
        server.post("/v1/completions", body), *[server.post("/v1/completions", others) for _ in range(3)]
    )
    b = results[0]
    c = await server.post("/v1/completions", {**body, "seed": 99})
    assert a[0] == b[0] == c[0] == 200
    assert a[1]["choices"][0]["text"] == b[1]["choices"][0]["text"]
    assert a[1]["choices"][0]["text"] != c[1]["choices"][0]["text"]


async def test_n_choices_and_prompt_batches(server):
    status, body = await server.post(
        "/v1/completions",
        {
            "prompt": ["a = ", "b = "],
            "n": 2,
            "max_tokens": 5,
            "temperature": 1.0,
            "seed": 7,
            "ignore_eos": True,
        },
    )
    assert status == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 20
    tok = server.state.tokenizer
    assert body["usage"]["prompt_tokens"] == len(tok.encode("a = ")) + len(tok.encode("b = "))
    # Token-id prompts are accepted as they are.
    ids = tok.encode("def f():")
    status, body2 = await server.post("/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0})
    status3, body3 = await server.post(
        "/v1/completions", {"prompt": "def f():", "max_tokens": 4, "temperature": 0}
    )
    assert status == status3 == 200
    assert body2["choices"][0]["text"] == body3["choices"][0]["text"]


async def test_stop_strings_cut_text(server):
    """Stop strings cut where the text shows them."""
    base = {
        "model": "tiny-base",
        "prompt": "for i in range(10):",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    status, full = await server.post("/v1/completions", base)
    assert status == 200
    text = full["choices"][0]["text"]
    assert len(text) >= 6
    stop = text[3:6]  # a string the unstopped output contains
    expected = text[: text.find(stop)]
    status, stopped = await server.post("/v1/completions", {**base, "stop": [stop]})
    assert status == 200
    assert stopped["choices"][0]["text"] == expected
    assert stopped["choices"][0]["finish_reason"] == "stop"
    events, status, _ = await _sse_events(server, "/v1/completions", {**base, "stop": stop})
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == expected
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    status, incl = await server.post(
        "/v1/completions", {**base, "stop": [stop], "include_stop_str_in_output": True}
    )
    assert incl["choices"][0]["text"] == expected + stop


async def test_stop_token_ids_and_logprobs(server):
    base = {
        "model": "sql-r8",
        "prompt": "while True:",
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    status, full = await server.post("/v1/completions", base)
    assert status == 200
    lp = full["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 10 and all(v <= 0 for v in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == full["choices"][0]["text"] or len(lp["tokens"]) == 10
    # The chosen token's logprob is the model's log-softmax at that token.
    tok = server.state.tokenizer
    ids = tok.encode(base["prompt"])
    runner = server.engine.runner

    def first_logprob():
        try:
            logits = runner.forward(
                ForwardBatch(
                    ForwardMode.EXTEND,
                    ["lp-ref"],
                    torch.tensor(ids),
                    extend_lens=[len(ids)],
                    lora_names=["sql-r8"],
                )
            ).logits
            return torch.log_softmax(logits[0].float(), -1)
        finally:
            runner.kv.free("lp-ref")

    ref = await asyncio.wrap_future(server.engine.call(first_logprob))
    first_id = int(ref.argmax())
    assert lp["token_logprobs"][0] == pytest.approx(float(ref[first_id]), abs=1e-4)
    # Stopping on the third generated token id ends there with reason "stop".
    gen_ids = await _greedy_reference(server, ids, "sql-r8", 10)
    stop_id = gen_ids[2]
    cut = gen_ids.index(stop_id)
    status, stopped = await server.post("/v1/completions", {**base, "stop_token_ids": [stop_id]})
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == cut + 1


async def _aborted(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with server.session.get(server.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_aborts_request(server, stream):
    """A client that disconnects aborts its request."""
    aborted_before = await _aborted(server)
    body = {
        "prompt": "def long():",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.4)) as short:
        with pytest.raises((asyncio.TimeoutError, aiohttp.ClientError)):
            async with short.post(server.url + "/v1/completions", json=body) as resp:
                await resp.read()
    for _ in range(200):
        if server.engine.snapshot.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert server.engine.snapshot.num_running == 0, "the request stopped long before its 900 tokens"
    assert await _aborted(server) == aborted_before + 1
    assert server.engine.kv.num_free_tokens == server.engine.kv.capacity


async def test_streamed_choices_echo_and_chat_logprobs(server):
    body = {
        "prompt": ["p = ", "q = "],
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
    }
    status, full = await server.post("/v1/completions", body)
    assert status == 200
    events, status, _ = await _sse_events(server, "/v1/completions", body)
    texts: dict[int, str] = {}
    finished = set()
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert finished == {0, 1, 2, 3}
    assert [texts[i] for i in range(4)] == [c["text"] for c in full["choices"]]

    echo = {"prompt": "def g(y):", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, plain = await server.post("/v1/completions", echo)
    status, echoed = await server.post("/v1/completions", {**echo, "echo": True})
    assert echoed["choices"][0]["text"] == "def g(y):" + plain["choices"][0]["text"]
    events, _, _ = await _sse_events(server, "/v1/completions", {**echo, "echo": True})
    # The echo rides on the choice's first chunk, with its first generated text (vLLM's stream).
    assert events[0]["choices"][0]["text"].startswith("def g(y):")
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echoed["choices"][0]["text"]

    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "model": "sql-r8",
    }
    status, resp = await server.post("/v1/chat/completions", chat)
    assert status == 200
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"] == 7
    assert all(item["logprob"] <= 0 and isinstance(item["token"], str) for item in content)


async def test_concurrent_matches_alone(server):
    """Continuous batching over HTTP: mixed adapters, prompt lengths and lengths, joined mid-flight."""
    models = ["tiny-base", "sql-r8", "chat-r16"]
    bodies = [
        {
            "model": models[i % 3],
            "prompt": "def f():\n" + "    x = 1\n" * (i % 5),
            "max_tokens": 8 + 3 * i,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 2 == 0,
        }
        for i in range(12)
    ]

    async def run(body):
        if body["stream"]:
            events, status, _ = await _sse_events(server, "/v1/completions", body)
            assert status == 200
            return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
        status, resp = await server.post("/v1/completions", body)
        assert status == 200
        return resp["choices"][0]["text"]

    alone = [await run(b) for b in bodies]

    async def staggered(i, body):
        await asyncio.sleep(0.01 * i)  # later requests join a batch already decoding
        return await run(body)

    together = await asyncio.gather(*(staggered(i, b) for i, b in enumerate(bodies)))
    assert list(together) == alone
