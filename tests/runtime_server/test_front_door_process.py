"""The front door in a real ``loraserve-runtime`` process (the CLI's own serving path):

- a slow-loris of 1,100 half-sent requests against a process limited to 1,024 open files
  leaves ``/health`` and a completion answering within seconds, and the log quiet (before:
  both timed out and accept errors wrote 158 MB of log in a minute);
- a request still waiting on an on-demand adapter load when the drain timeout ends gets
  503 ``shutting_down`` (before: the connection was dropped without an answer);
- ``--body-timeout`` reaches the server: a withheld body gets 408 at that bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog
from loraserve.runtime.dev.demo import free_port

from .runtime_process import wait_ready

pytestmark = pytest.mark.slow

FILE_LIMIT = 1024
ATTACKERS = 1100


@contextlib.contextmanager
def _runtime(assets, port: int, log: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator:
    """The runtime on the tiny model, its open files limited to ``FILE_LIMIT``."""

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (FILE_LIMIT, FILE_LIMIT))

    args = [
        *("--model", str(assets.model_dir), "--device", "cpu", "--host", "127.0.0.1"),
        *("--port", str(port), "--max-total-tokens", "4096", "--max-lora-rank", "16"),
        *flags,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraserve.runtime", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONSAFEPATH": "1", **(env or {})},
        preexec_fn=limit_files,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _half_sent(port: int) -> asyncio.StreamWriter | None:
    """A connection that sends part of a request head and then nothing."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
        return writer
    except OSError:
        return None


async def _timed(session: aiohttp.ClientSession, method: str, url: str, **kw) -> tuple[int, float]:
    start = time.monotonic()
    async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=30), **kw) as resp:
        await resp.read()
        return resp.status, time.monotonic() - start


async def test_slowloris_under_a_file_limit(assets, tmp_path):
    port, log = free_port(), tmp_path / "log"
    url = f"http://127.0.0.1:{port}"
    with _runtime(assets, port, log, "--header-timeout", "30") as proc:
        await wait_ready(url, proc, log)
        assert f"Max open files            {FILE_LIMIT}" in Path(f"/proc/{proc.pid}/limits").read_text()
        writers = await asyncio.gather(*(_half_sent(port) for _ in range(ATTACKERS)))
        try:
            await asyncio.sleep(1.5)  # every attacker is accepted, refused or waiting
            async with aiohttp.ClientSession() as session:
                status, took = await _timed(session, "GET", url + "/health")
                assert status == 200 and took < 5, (status, took)
                body = {"prompt": "x = [", "max_tokens": 4, "temperature": 0}
                status, took = await _timed(session, "POST", url + "/v1/completions", json=body)
                assert status == 200 and took < 15, (status, took)
            assert proc.poll() is None
            open_files = len(os.listdir(f"/proc/{proc.pid}/fd"))
            assert open_files < FILE_LIMIT, open_files
        finally:
            for writer in writers:
                if writer is not None:
                    writer.close()
    text = log.read_text()
    assert "client limits: 768 connections" in text, text[-2000:]
    assert text.count("accept() failed") <= 2, text[-2000:]
    assert len(text) < 100_000, len(text)


class _NeverAnswers:
    """An adapter source that accepts requests and never answers them."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.asked.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_drain_end_answers_a_waiting_load(assets, tmp_path):
    source = _NeverAnswers()
    files_app = web.Application()
    files_app.router.add_get("/{tail:.*}", source.handle)
    files = TestServer(files_app, host="127.0.0.1")
    await files.start_server()
    catalog = tmp_path / "catalog.json"
    catalog.write_text(encode_catalog([CatalogEntry("slow", f"http://127.0.0.1:{files.port}/a/")]))
    port, log = free_port(), tmp_path / "log"
    url = f"http://127.0.0.1:{port}"
    flags = (
        *("--adapter-catalog", str(catalog), "--allow-private-source-hosts"),
        *("--adapter-load-timeout", "300", "--drain-timeout", "1", "--body-timeout", "1"),
    )
    try:
        with _runtime(assets, port, log, *flags, env={"LORASERVE_ALLOW_HTTP_SOURCES": "1"}) as proc:
            await wait_ready(url, proc, log)
            assert await _withheld_body(port) < 1 + 4  # --body-timeout, and slack
            async with aiohttp.ClientSession() as session:
                body = {"model": "slow", "prompt": "x", "max_tokens": 2}
                waiting = asyncio.create_task(_answer(session, url + "/v1/completions", body))
                await asyncio.wait_for(source.asked.wait(), 30)
                proc.send_signal(signal.SIGTERM)
                status, headers, answer = await asyncio.wait_for(waiting, 30)
            assert status == 503, (status, answer)
            assert answer["error"]["code"] == "shutting_down", answer
            assert int(headers["Retry-After"]) >= 1
            assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    finally:
        await files.close()


async def _answer(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict, dict]:
    async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=120)) as resp:
        return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def _withheld_body(port: int) -> float:
    """Seconds until a POST announcing 100 bytes and sending 1 gets its 408 ``body_timeout``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.monotonic()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        took = time.monotonic() - start
        length = next(int(h[15:]) for h in head.decode().lower().split("\r\n") if h.startswith("content-length:"))
        assert head.startswith(b"HTTP/1.1 408") and b"body_timeout" in await reader.readexactly(length), head
        return took
    finally:
        writer.close()
