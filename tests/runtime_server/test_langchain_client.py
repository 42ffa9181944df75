"""``langchain-openai``'s ChatOpenAI against the real runtime server (tiny model, real HTTP).

What its users do: invoke, stream, structured output through a JSON schema, log-probabilities,
and tools (refused with a 400 naming ``tools``). langchain-openai is a test dependency
(requirements-dev.txt).
"""

from __future__ import annotations

import logging
from typing import Literal

import langchain_openai
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADAPTER = "sql-r8"
QUESTION = "Write a haiku about GPUs."


def _chat(server, **kwargs):
    return langchain_openai.ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="unused",
        model=ADAPTER,
        temperature=0,
        max_retries=0,
        timeout=60,
        **kwargs,
    )


async def test_invoke_and_stream_agree(server, caplog):
    """Invoke and stream agree with the raw API and send nothing ignored."""
    chat = _chat(server, max_tokens=12, extra_body={"ignore_eos": True})
    with caplog.at_level(logging.WARNING, logger="loraserve.server"):
        message = await chat.ainvoke(QUESTION)
        pieces = [chunk.content async for chunk in chat.astream(QUESTION)]
    assert not [r for r in caplog.records if "ignored" in r.getMessage()], "every field it sends is known"
    status, raw = await server.post(
        "/v1/chat/completions",
        {
            "model": ADAPTER,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert status == 200, raw
    assert message.content == raw["choices"][0]["message"]["content"] == "".join(pieces)
    assert message.response_metadata["finish_reason"] == "length"
    assert message.usage_metadata["output_tokens"] == 12


async def test_structured_output_through_a_json_schema(server):
    class Pick(BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool

    picked = (
        await _chat(server, max_tokens=60)
        .with_structured_output(Pick, method="json_schema")
        .ainvoke("Pick a color.")
    )
    assert isinstance(picked, Pick) and picked.color in ("red", "green", "blue")


async def test_logprobs_reach_the_response_metadata(server):
    chat = _chat(server, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    message = await chat.ainvoke(QUESTION)
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == 5 and all(len(item["top_logprobs"]) == 3 for item in content)


async def test_tools_are_refused_naming_the_field(server):
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with pytest.raises(openai.BadRequestError) as info:
        await _chat(server, max_tokens=5).bind_tools([add]).ainvoke("1 + 2?")
    assert info.value.body["param"] == "tools" and info.value.body["code"] == "unsupported_parameter"
