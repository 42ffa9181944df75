"""The front door against slow and hostile clients, in-process: the production app behind
``FrontDoor`` (as the CLI serves it) on a real 127.0.0.1 socket, with small limits, and raw
sockets for the clients that do not play fair.

- a request head that is not complete within ``--header-timeout`` closes the connection,
  bytes trickled in or not, on the first request and on a keep-alive one;
- at ``--max-connections`` a new connection takes the place of the one idle longest; when
  all are busy it gets 503 ``server_busy`` at once, while probes (``GET /health``) are still
  served from a small reserve;
- a client that stops reading a stream is cut off after ``--write-timeout`` and its engine
  requests are aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.server import STATE, build_app, wait_until_ready
from loraserve.runtime.server.limits import EVICT_IDLE_S, PROBE_RESERVE, FrontDoor, Limits

from .conftest import ADMIN_TOKEN, make_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

LIMITS = Limits(header_timeout_s=2.0, write_timeout_s=2.0, max_connections=6)
SLACK_S = 4.0  # scheduling slack on a loaded machine, on top of a bound


@dataclass
class Door:
    app: web.Application
    door: FrontDoor
    port: int
    stuck_source: str  # an adapter source that accepts requests and never answers

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def quiet(self) -> None:
        """Wait until no client connection is open (earlier tests' are closed by the timeouts)."""
        for _ in range(200):
            if self.door.gate.served == 0 and self.door.gate.probing == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"connections still open: {self.door.gate.served} + {self.door.gate.probing}")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def door(assets, tmp_path_factory) -> AsyncIterator[Door]:
    async def never_answer(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    files_app = web.Application()
    files_app.router.add_get("/{tail:.*}", never_answer)
    files = TestServer(files_app, host="127.0.0.1")
    await files.start_server()
    cfg = make_config(assets)
    cfg.server.allow_private_sources = True  # the stuck source is on loopback
    tmp = tmp_path_factory.mktemp("slow-clients")
    app = build_app(
        cfg,
        lambda metrics: build_engine(cfg, observer=metrics),
        sources=SourceSettings(
            cache_dir=tmp / "cache", pvc_root=tmp / "pvc", env={"LORASERVE_ALLOW_HTTP_SOURCES": "1"}
        ),
        drain_timeout_s=2.0,
    )
    sock = socket.socket()
    # Accepted sockets inherit a small send buffer: a client that stops reading fills it
    # after kilobytes, not the megabytes loopback would otherwise buffer.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    front = await FrontDoor.open(app, [sock], LIMITS)
    try:
        await wait_until_ready(app)
        yield Door(
            app=app, door=front, port=sock.getsockname()[1], stuck_source=f"http://127.0.0.1:{files.port}/a/"
        )
    finally:
        await front.close()
        await files.close()


async def _closed_after(reader: asyncio.StreamReader, bound_s: float) -> float:
    """Seconds until the server closes the connection (everything it sent is read and
    dropped); fails if it is still open ``bound_s`` + slack from now."""
    start = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while await asyncio.wait_for(reader.read(65536), bound_s + SLACK_S):
            pass
    return time.monotonic() - start


async def _head(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One response: status line, headers (lower-case names), body (by Content-Length)."""
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10.0)
    status, *lines = raw.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), 10.0)
    return status.encode(), headers, body


async def test_idle_connection_closed(door):
    reader, writer = await door.connect()
    try:
        took = await _closed_after(reader, LIMITS.header_timeout_s)
    finally:
        writer.close()
    assert took >= LIMITS.header_timeout_s - 0.5, took


async def test_trickled_head_closed(door):
    """A byte every 0.2 s never completes the head: the connection closes at the bound."""
    reader, writer = await door.connect()

    async def trickle() -> None:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with contextlib.suppress(ConnectionError):
            while True:
                await asyncio.sleep(0.2)
                writer.write(b"X")
                await writer.drain()

    task = asyncio.create_task(trickle())
    try:
        took = await _closed_after(reader, LIMITS.header_timeout_s)
    finally:
        task.cancel()
        writer.close()
    assert took < LIMITS.header_timeout_s + SLACK_S, took


async def test_keepalive_head_closed(door):
    """After a full request and its answer, a second head left half-sent is closed too."""
    reader, writer = await door.connect()
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = await _head(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        took = await _closed_after(reader, LIMITS.header_timeout_s)
    finally:
        writer.close()
    assert took < LIMITS.header_timeout_s + SLACK_S, took


async def _until(check, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_idle_make_way_at_the_cap(door):
    """At the cap, a new connection takes the place of the one idle longest (a slow-loris
    cannot crowd out a request)."""
    await door.quiet()
    held = []
    try:
        for _ in range(LIMITS.max_connections):
            held.append(await door.connect())
            await asyncio.sleep(0.05)  # the first is the oldest
        await _until(lambda: door.door.gate.served == LIMITS.max_connections, "not all accepted")
        await asyncio.sleep(EVICT_IDLE_S + 0.2)
        reader, writer = await door.connect()
        held.append((reader, writer))
        writer.write(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = await _head(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
        assert await _closed_after(held[0][0], 1.0) < 1.0 + SLACK_S
        assert door.door.gate.served == LIMITS.max_connections
    finally:
        for _, writer in held:
            writer.close()


async def test_withheld_bodies_make_way(door, caplog):
    """At the cap with every connection trickling a body, a new connection takes the place of
    the one whose body has been arriving longest (its handler ends quietly: no traceback
    per evicted client in the log)."""
    await door.quiet()
    caplog.set_level(logging.INFO)
    state = door.app[STATE]
    held = []
    try:
        for _ in range(LIMITS.max_connections):
            reader, writer = await door.connect()
            held.append((reader, writer))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            await asyncio.sleep(0.05)  # the first is the oldest
        await _until(lambda: state.in_flight == LIMITS.max_connections, "not all busy")
        await asyncio.sleep(EVICT_IDLE_S + 0.2)
        reader, writer = await door.connect()
        held.append((reader, writer))
        writer.write(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = await _head(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
        assert await _closed_after(held[0][0], 1.0) < 1.0 + SLACK_S
        assert door.door.gate.served == LIMITS.max_connections
        await _until(lambda: state.in_flight == LIMITS.max_connections - 1, "the evicted handler runs on")
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    finally:
        for _, writer in held:
            writer.close()


async def test_busy_cap_503_and_probes_served(door):
    """Every connection busy with a whole request (admin loads from a source that never
    answers): a request past the cap gets 503 server_busy at once; a kubelet probe is still
    served, from a bounded reserve."""
    await door.quiet()
    state = door.app[STATE]
    held, extra = [], []
    try:
        for i in range(LIMITS.max_connections):
            reader, writer = await door.connect()
            held.append(writer)
            load = json.dumps({"lora_name": f"stuck-{i}", "lora_path": door.stuck_source}).encode()
            writer.write(
                b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {len(load)}\r\n\r\n".encode()
                + load
            )
        await _until(lambda: state.in_flight == LIMITS.max_connections, "not all busy")
        await asyncio.sleep(EVICT_IDLE_S + 0.2)  # busy ones are never closed for a new one
        reader, writer = await door.connect()
        extra.append(writer)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        status, headers, body = await _head(reader)
        assert status.startswith(b"HTTP/1.1 503"), status
        assert json.loads(body)["error"]["code"] == "server_busy", body
        assert int(headers["retry-after"]) >= 1 and headers["connection"].lower() == "close", headers
        reader, writer = await door.connect()
        extra.append(writer)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, _ = await _head(reader)
        assert status.startswith(b"HTTP/1.1 200"), status
        # The reserve is bounded too: once it is held, everything past the cap is refused.
        for _ in range(PROBE_RESERVE):
            extra.append((await door.connect())[1])
        await _until(lambda: door.door.gate.probing == PROBE_RESERVE, "reserve not held")
        reader, writer = await door.connect()
        extra.append(writer)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = await _head(reader)
        assert status.startswith(b"HTTP/1.1 503"), status
        assert state.in_flight == LIMITS.max_connections
    finally:
        for writer in held + extra:
            writer.close()
    await door.quiet()
    async with aiohttp.ClientSession() as session, session.get(door.url + "/health") as resp:
        assert resp.status == 200


async def _aborted(door: Door) -> float:
    """``vllm:request_success_total`` of finish reason ``abort``, from ``/metrics``."""
    async with aiohttp.ClientSession() as session, session.get(door.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
    )


async def test_unread_stream_cut_and_aborted(door, caplog):
    """A client that sends a streaming request and never reads: once the socket buffers are
    full, the server waits ``--write-timeout`` for progress, then aborts the connection and
    the engine aborts its requests (before: the handler waited forever, holding the slots)."""
    await door.quiet()
    aborted_before = await _aborted(door)
    body = {
        "prompt": "x = [",
        "max_tokens": 1000,
        "n": 16,  # a batch of 16 long generations outlasts the write timeout on any machine
        "logprobs": 5,  # a kilobyte a token: the buffers fill within the first tokens
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", door.port))
    await loop.sock_sendall(
        sock,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload,
    )
    state = door.app[STATE]
    caplog.set_level(logging.INFO, logger="loraserve.server")
    try:
        first = await asyncio.wait_for(loop.sock_recv(sock, 64), 30)
        assert first.startswith(b"HTTP/1.1 200"), first
        # From here on the client reads nothing.
        deadline = time.monotonic() + 120
        while not state.engine.snapshot.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert door.door.gate.served == 1 and state.engine.snapshot.num_running > 0
        while door.door.gate.served and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert door.door.gate.served == 0, "the connection was never cut"
        snap = state.engine.snapshot
        while (snap.num_running or snap.num_waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            snap = state.engine.snapshot
        assert snap.num_running == 0 and snap.num_waiting == 0, snap
    finally:
        sock.close()
    aborted = await _aborted(door) - aborted_before
    # Requests still generating when the connection was cut are aborted, none left running.
    assert aborted >= 1, aborted
    assert aborted <= body["n"], aborted
    # The cut request is counted as closed by the client (499), never as a server error.
    async with aiohttp.ClientSession() as session, session.get(door.url + "/metrics") as resp:
        text = await resp.text()
    completions = [line for line in text.splitlines() if line.startswith("loraserve:http_requests_total{") and "/v1/completions" in line]
    assert any('status="499"' in line for line in completions), completions
    assert not any('status="500"' in line for line in completions), completions
    assert "read nothing for 2 s (--write-timeout)" in caplog.text


async def test_unread_answer_closed(door):
    """A whole answer left unread (tens of KB, below the pause mark): the handler is done and
    the close waits for a flush that never comes; the write timeout aborts the connection
    instead of leaving it (and its file) open as long as the client."""
    await door.quiet()
    body = {"prompt": "x", "max_tokens": 300, "ignore_eos": True, "logprobs": 5}
    payload = json.dumps(body).encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", door.port))
        await loop.sock_sendall(
            sock,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Connection: close\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
            + payload,
        )
        await _until(lambda: door.door.gate.served == 1, "never accepted")
        await _until(lambda: door.app[STATE].in_flight == 0, "never answered", timeout_s=60)
        await _until(
            lambda: door.door.gate.served == 0, "still open", timeout_s=LIMITS.write_timeout_s + SLACK_S
        )
    finally:
        sock.close()


async def test_slow_reader_not_cut(door):
    """A client that reads a long stream slowly but steadily is never taken for one that
    stopped reading: its stream ends with [DONE]."""
    await door.quiet()
    body = {
        "prompt": "x = [",
        "max_tokens": 800,
        "n": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    received = bytearray()
    start = time.monotonic()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", door.port))
        await loop.sock_sendall(
            sock,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload,
        )
        deadline = time.monotonic() + 120
        while b"data: [DONE]" not in received[-64:] and time.monotonic() < deadline:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 4096), 30)
            assert chunk, "the server closed the stream"
            received += chunk
            await asyncio.sleep(0.02)  # 4 KB at a time: the server waits on the reader throughout
    finally:
        sock.close()
    assert b"data: [DONE]" in received[-64:] and len(received) > 64 * 1024, len(received)
    assert time.monotonic() - start > LIMITS.write_timeout_s
