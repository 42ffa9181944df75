"""Remote source hosts that should not be reached (loopback, link-local, private: SSRF) or that
hang (accept and never answer, stall mid-body): refused by name, or failed within the stall
bound with the public URL and what was waited on. Real servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver
from aiohttp.test_utils import TestServer

from loraserve.runtime.lora.progress import LoadProgress
from loraserve.runtime.lora.sources import (
    ADAPTER_FILES,
    SourceError,
    SourceSettings,
    adapter_digest,
    resolve_source,
)
from loraserve.runtime.remote import GuardedConnector, address_kind, fetch_to

from .conftest import make_config, running_server

SECRET = "hunter2"
TOKEN = "X-Amz-Signature=topsecret"


@pytest.fixture
def adapter_dir(assets) -> Path:
    return assets.demo.adapters["sql-r8"]


@contextlib.asynccontextmanager
async def files_server(adapter_dir: Path, *, redirect_to: str = ""):
    """Serves the adapter under /dir/; /hop/<name> redirects to ``redirect_to``/dir/<name>."""
    hits: list[str] = []
    files = {f"/dir/{n}": (adapter_dir / n).read_bytes() for n in ADAPTER_FILES}

    async def handle(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        if request.path.startswith("/hop/"):
            raise web.HTTPFound(redirect_to + "/dir/" + request.path.rsplit("/", 1)[1])
        body = files.get(request.path)
        return web.Response(body=body) if body is not None else web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server.port, hits
    finally:
        await server.close()


def _settings(tmp_path: Path, **kw) -> SourceSettings:
    env = {"LORASERVE_ALLOW_HTTP_SOURCES": "1", **kw.pop("env", {})}
    return SourceSettings(cache_dir=tmp_path / "cache", pvc_root=tmp_path / "pvc", env=env, **kw)


# --------------------------------------------------------------------------- SSRF


def test_internal_addresses_named():
    """Internal addresses are named public ones pass."""
    for address, kind in (
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.9", "private"),
        ("192.168.1.1", "private"),
        ("fc00::5", "private"),
        ("169.254.169.254", "link-local"),  # the cloud metadata service
        ("fe80::1%eth0", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("::ffff:169.254.169.254", "link-local"),
        ("2002:a00:1::", "private"),  # 6to4 of 10.0.0.1
        ("100.64.0.1", "non-public"),  # carrier-grade NAT
    ):
        assert address_kind(address) == kind, address
    for address in ("8.8.8.8", "2606:4700::1111", "151.101.1.69"):
        assert address_kind(address) is None, address


async def test_no_host_list_refuses_internal(adapter_dir, tmp_path):
    """Without a host list internal hosts are refused."""
    async with files_server(adapter_dir) as (port, hits):
        for source, env, words in (
            (f"http://user:{SECRET}@127.0.0.1:{port}/dir?{TOKEN}", {}, "host '127.0.0.1' is a loopback address"),
            ("hf://org/adapters", {"HF_ENDPOINT": f"http://localhost:{port}"}, "host 'localhost' resolves to"),
            ("s3://bucket/sql", {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}, "a loopback address"),
            ("https://169.254.169.254/latest/meta-data/x.tar.gz", {}, "a link-local address"),
        ):
            with pytest.raises(SourceError) as info:
                await resolve_source(source, _settings(tmp_path, env=env))
            err = info.value
            assert err.field == "lora_path" and not err.transient, err
            assert words in str(err) and "--allow-private-source-hosts" in str(err), err
            assert "--remote-source-hosts" in str(err), err
            assert SECRET not in str(err) and "topsecret" not in str(err), err
        assert hits == [], "nothing was sent to the internal host"
        # Allowed by the flag, or by a host list that names the host: fetched.
        got = await resolve_source(f"http://127.0.0.1:{port}/dir", _settings(tmp_path / "a", allow_private=True))
        assert adapter_digest(got) == adapter_digest(adapter_dir)
        got = await resolve_source(f"http://127.0.0.1:{port}/dir", _settings(tmp_path / "b", remote_hosts=("127.0.0.1",)))
        assert adapter_digest(got) == adapter_digest(adapter_dir)


class _Resolver(AbstractResolver):
    """DNS as an attacker controls it: each name answers the address given here."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict]:
        self.asked.append(host)
        return [
            {"hostname": host, "host": self.answers[host], "port": port, "family": socket.AF_INET, "proto": 0,
             "flags": socket.AI_NUMERICHOST}
        ]  # fmt: skip

    async def close(self) -> None:
        pass


async def test_checked_address_is_connected(adapter_dir, tmp_path):
    """A public-looking name that resolves to loopback is refused (the check sees the
    resolved address, not the name); a host the guard exempts (an operator's proxy) that
    redirects to an internal one is refused at the redirect."""
    async with files_server(adapter_dir) as (port, hits):
        resolver = _Resolver({"adapters.example.com": "127.0.0.1", "cdn.example.com": "127.0.0.1"})
        connector = GuardedConnector(subject="lora_path 'x'", resolver=resolver)
        async with aiohttp.ClientSession(connector=connector) as session:
            with pytest.raises(SourceError, match=r"host 'adapters\.example\.com' resolves to a loopback address"):
                await fetch_to(
                    session, f"http://adapters.example.com:{port}/dir/{ADAPTER_FILES[0]}", {}, tmp_path / "f",
                    subject="lora_path 'x'", max_bytes=1 << 20,
                )  # fmt: skip
        assert resolver.asked == ["adapters.example.com"] and hits == []
        # The same name, exempt: connected to the address the resolver gave (the loopback server).
        resolver = _Resolver({"adapters.example.com": "127.0.0.1", "cdn.example.com": "127.0.0.1"})
        connector = GuardedConnector(
            subject="lora_path 'x'", resolver=resolver, exempt_hosts=frozenset({"adapters.example.com"})
        )
        async with aiohttp.ClientSession(connector=connector) as session:
            size = await fetch_to(
                session, f"http://adapters.example.com:{port}/dir/{ADAPTER_FILES[0]}", {}, tmp_path / "f",
                subject="lora_path 'x'", max_bytes=1 << 20,
            )  # fmt: skip
            assert size == (adapter_dir / ADAPTER_FILES[0]).stat().st_size and len(hits) == 1
    async with files_server(adapter_dir, redirect_to="http://cdn.example.com:1") as (port, hits):
        resolver = _Resolver({"adapters.example.com": "127.0.0.1", "cdn.example.com": "10.0.0.7"})
        connector = GuardedConnector(
            subject="lora_path 'x'", resolver=resolver, exempt_hosts=frozenset({"adapters.example.com"})
        )
        async with aiohttp.ClientSession(connector=connector) as session:
            with pytest.raises(SourceError, match=r"host 'cdn\.example\.com' resolves to a private address"):
                await fetch_to(
                    session, f"http://adapters.example.com:{port}/hop/{ADAPTER_FILES[0]}", {}, tmp_path / "g",
                    subject="lora_path 'x'", max_bytes=1 << 20,
                )  # fmt: skip
        assert hits == [f"/hop/{ADAPTER_FILES[0]}"] and resolver.asked == ["adapters.example.com", "cdn.example.com"]


async def test_admin_refuses_internal_host(assets, tmp_path):
    """The admin API refuses an internal host by default."""
    config = make_config(assets, adapters={})
    assert config.server.allow_private_sources is False  # the default
    async with running_server(config, tmp_path) as srv:
        status, body = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": f"https://user:{SECRET}@169.254.169.254/a.tar.gz?{TOKEN}"},
            headers=srv.admin_headers(),
        )
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "lora_path" and "link-local" in err["message"], err
    assert "--allow-private-source-hosts" in err["message"]
    assert SECRET not in err["message"] and "topsecret" not in err["message"], err


# --------------------------------------------------------------------------- hung hosts


@contextlib.asynccontextmanager
async def silent_server():
    """Accepts connections, reads what is sent, never answers."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(4096):
                pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_silent_host_fails_in_bound(tmp_path):
    """A host that never answers fails within the stall bound."""
    async with silent_server() as port:
        for source, waited in (
            (f"http://user:{SECRET}@127.0.0.1:{port}/dir?{TOKEN}", "sent no byte for 0.3 s"),
            (f"https://127.0.0.1:{port}/dir", "connecting to 127.0.0.1 took over 0.3 s"),  # TLS never starts
            ("hf://org/adapters", "sent no byte for 0.3 s"),
        ):
            progress = LoadProgress()
            settings = _settings(
                tmp_path, allow_private=True, stall_timeout_s=0.3, env={"HF_ENDPOINT": f"http://127.0.0.1:{port}"}
            )
            start = time.monotonic()
            with pytest.raises(SourceError) as info:
                await asyncio.wait_for(resolve_source(source, settings, progress=progress), 10)
            assert time.monotonic() - start < 5, "bounded by the stall timeout, not the load timeout"
            err = str(info.value)
            assert info.value.transient and waited in err and "--source-stall-timeout" in err, err
            assert SECRET not in err and "topsecret" not in err, err
            assert f"127.0.0.1:{port}/" in err, "the public URL waited on is named"
            assert progress.phase == "connecting" and f"127.0.0.1:{port}/" in progress.target
            assert SECRET not in progress.target and "topsecret" not in progress.target


async def test_stalled_body_fails_in_bound(adapter_dir, tmp_path):
    """A body that stalls midway fails within the bound."""
    body = (adapter_dir / ADAPTER_FILES[1]).read_bytes()

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path.endswith(ADAPTER_FILES[0]):
            return web.Response(body=(adapter_dir / ADAPTER_FILES[0]).read_bytes())
        resp = web.StreamResponse()
        resp.content_length = len(body)
        await resp.prepare(request)
        await resp.write(body[:1000])
        await asyncio.sleep(30)  # the rest never comes
        return resp

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        progress = LoadProgress()
        start = time.monotonic()
        with pytest.raises(SourceError) as info:
            await asyncio.wait_for(
                resolve_source(
                    f"http://127.0.0.1:{server.port}/dir?{TOKEN}",
                    _settings(tmp_path, allow_private=True, stall_timeout_s=0.3),
                    progress=progress,
                ),
                10,
            )
        assert time.monotonic() - start < 5
    finally:
        await server.close()
    err = str(info.value)
    assert info.value.transient and f"/dir/{ADAPTER_FILES[1]} sent no byte for 0.3 s" in err, err
    assert "topsecret" not in err
    assert progress.phase == "downloading" and progress.received_bytes >= 1000
    assert progress.target.endswith(f"/dir/{ADAPTER_FILES[1]}")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".download-")]


async def test_the_model_fetcher_shares_the_stall_bound(tmp_path):
    """``loraserve-fetch`` downloads with the same session: a silent host fails it in time."""
    from loraserve.runtime.tools.fetch import FetchOptions, fetch_model

    options = FetchOptions(read_timeout_s=0.3, retries=0, env={"LORASERVE_ALLOW_HTTP_SOURCES": "1"})
    async with silent_server() as port:
        start = time.monotonic()
        with pytest.raises(SourceError) as info:
            source = f"http://user:{SECRET}@127.0.0.1:{port}/model.tar.gz?{TOKEN}"
            await asyncio.wait_for(asyncio.to_thread(fetch_model, source, tmp_path / "model", options), 10)
        assert time.monotonic() - start < 5
    err = str(info.value)
    assert info.value.transient and f"127.0.0.1:{port}/model.tar.gz sent no byte for 0.3 s (stalled)" in err, err
    assert SECRET not in err and "topsecret" not in err, err
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob("model.partial-*"))
