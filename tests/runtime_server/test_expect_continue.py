"""``Expect: 100-continue`` is judged before ``100 Continue`` is sent: an oversized declared
body gets 413 and never the go-ahead; a body within the limit gets it and is served."""

from __future__ import annotations

import asyncio
import json

import pytest

from .conftest import Server

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _expect(server: Server, route: str, length: int, expect: str = "100-continue") -> bytes:
    """Send the head of a request (``route``: "METHOD /path") with ``Expect``; return the first
    response head read."""
    reader, writer = await asyncio.open_connection(server.server.host, server.server.port)
    try:
        writer.write(
            f"{route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nExpect: {expect}\r\n\r\n".encode()
        )
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
    finally:
        writer.close()


async def test_huge_length_is_413_without_100(server):
    for route in (
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/load_lora_adapter",
        "PUT /v1/lora_catalog",
    ):
        head = await _expect(server, route, 5 * 1024**3)
        assert head.startswith(b"HTTP/1.1 413"), (route, head)
        assert b"connection: close" in head.lower(), head


async def test_small_length_gets_100_then_answer(server):
    body = json.dumps({"model": "tiny-base", "prompt": "hi", "max_tokens": 2}).encode()
    reader, writer = await asyncio.open_connection(server.server.host, server.server.port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        assert head.startswith(b"HTTP/1.1 100"), head
        writer.write(body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30.0)
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        writer.close()


async def test_unknown_expectation_is_417_json(server):
    head = await _expect(server, "POST /v1/completions", 10, expect="something-else")
    assert head.startswith(b"HTTP/1.1 417"), head
    assert b"application/json" in head, head
