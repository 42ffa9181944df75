"""The official ``openai`` Python client against the real runtime server (tiny model, real HTTP).

What clients do: list models, complete, chat and stream, for the base model and an adapter.
Oracles: the client's answers equal the server's raw JSON answers to the same request, a
streamed answer equals the unstreamed one, and an adapter's answer differs from the base's.
"""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, NotFoundError

pytestmark = pytest.mark.asyncio(loop_scope="module")

BASE = "tiny-base"
ADAPTER = "sql-r8"
PROMPT = "def fibonacci(n):\n"
GREEDY = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def test_client_lists_the_base_and_its_adapters(server):
    async with _client(server) as client:
        page = await client.models.list()
    ids = {m.id for m in page.data}
    assert {BASE, ADAPTER, "chat-r16"} <= ids, ids
    assert all(m.object == "model" for m in page.data)


async def test_client_completions_equal_raw(server):
    """Client completions equal the raw API and adapters differ."""
    texts = {}
    async with _client(server) as client:
        for model in (BASE, ADAPTER):
            out = await client.completions.create(model=model, prompt=PROMPT, **GREEDY)
            status, raw = await server.post(
                "/v1/completions",
                {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            )
            assert status == 200, raw
            assert out.choices[0].text == raw["choices"][0]["text"]
            assert out.choices[0].finish_reason == "length"
            assert out.usage.completion_tokens == 12
            assert out.model == model
            texts[model] = out.choices[0].text
    assert texts[BASE] != texts[ADAPTER], "the adapter is applied"


async def test_client_chat_and_streamed_chat_agree(server):
    messages = [{"role": "user", "content": "Write a haiku about GPUs."}]
    async with _client(server) as client:
        for model in (BASE, ADAPTER):
            whole = await client.chat.completions.create(model=model, messages=messages, **GREEDY)
            assert whole.choices[0].message.role == "assistant"
            text = whole.choices[0].message.content
            assert text
            stream = await client.chat.completions.create(
                model=model, messages=messages, stream=True, **GREEDY
            )
            pieces, finish = [], None
            async for chunk in stream:
                for choice in chunk.choices:
                    pieces.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
            assert "".join(pieces) == text
            assert finish == "length"


async def test_client_stream_equals_whole(server):
    """Client streamed completion equals the whole one."""
    async with _client(server) as client:
        whole = await client.completions.create(model=ADAPTER, prompt=PROMPT, **GREEDY)
        stream = await client.completions.create(model=ADAPTER, prompt=PROMPT, stream=True, **GREEDY)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text == whole.choices[0].text


async def test_client_unknown_model_not_found(server):
    """Client sees an unknown model as not found."""
    async with _client(server) as client:
        with pytest.raises(NotFoundError):
            await client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=4)
