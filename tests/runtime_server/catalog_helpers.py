"""Helpers shared by the catalog authority and version-change tests: streamed completions
read to their end, catalog pushes and listings, and a real HTTP file server that holds an
adapter's files back until released (a slow or hung remote source)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.lora.sources import ADAPTER_FILES

PROMPT = "def main("


@dataclass
class Streamed:
    """One streamed completion as the client saw it."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    tokens: int = 0


async def stream(server, model: str, max_tokens: int, prompt: str = PROMPT) -> Streamed:
    """A greedy streamed completion of ``model``, read to its end (EOS ignored)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with server.session.post(server.url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return Streamed(resp.status, error=(await resp.json(content_type=None)).get("error"))
        out = Streamed(200)
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
            for choice in event.get("choices") or []:
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if event.get("usage"):
                out.tokens = event["usage"]["completion_tokens"]
        return out


async def put_catalog(server, adapters: list[dict]) -> tuple[int, dict]:
    """``PUT /v1/lora_catalog`` with the admin token."""
    async with server.session.put(
        server.url + "/v1/lora_catalog", json={"adapters": adapters}, headers=server.admin_headers()
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def catalog_listing(server) -> dict:
    """``GET /v1/lora_catalog``: the whole answer, with ``by_name`` added."""
    status, body = await server.get("/v1/lora_catalog", headers=server.admin_headers())
    assert status == 200, body
    body["by_name"] = {a["name"]: a for a in body["adapters"]}
    return body


async def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    """Poll ``predicate`` (sync or async) until true; fail naming ``what``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def engine_keys(server, name: str) -> set[str]:
    """The engine keys (versions) of adapter ``name`` the engine holds, draining ones too."""
    return {i.name for i in server.engine.list_adapters() if i.name.partition("@")[0] == name}


class SlowFiles:
    """A real HTTP server on 127.0.0.1 holding an adapter's files back until released."""

    def __init__(self, directory: Path) -> None:
        self.files = {f"/a/{name}": (directory / name).read_bytes() for name in ADAPTER_FILES}
        self.release = asyncio.Event()
        self.asked = 0
        self.server: TestServer | None = None

    async def handle(self, request: web.Request) -> web.Response:
        self.asked += 1
        await self.release.wait()
        body = self.files.get(request.path)
        return web.Response(body=body) if body is not None else web.Response(status=404)

    async def __aenter__(self) -> SlowFiles:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        assert self.server is not None
        await self.server.close()

    @property
    def source(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.port}/a/"
