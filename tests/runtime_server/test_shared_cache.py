"""One adapter cache shared by many processes (pods on one writable volume): real OS
processes fetch the same ``hf://`` adapter from a local stand-in hub at once, a rival writer
publishes first, a download holder goes silent, a cached copy is damaged."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.lora.progress import LoadProgress
from loraserve.runtime.lora.sources import (
    ADAPTER_FILES,
    COMPLETE,
    LOCKS,
    SourceError,
    SourceSettings,
    adapter_digest,
    cache_key,
    resolve_source,
)

PROCESSES = 4
ROUNDS = ("r1", "r2", "r3")

# Each child process resolves every round's revision once, all children starting a round
# together (a barrier of files), and prints what it got as JSON.
CHILD = r"""
import json, sys, time
from pathlib import Path
from loraserve.runtime.lora.sources import SourceSettings, adapter_digest, resolve_source_sync

cache, endpoint, barrier, me, count, revisions = sys.argv[1:7]
settings = SourceSettings(cache_dir=Path(cache), env={"HF_ENDPOINT": endpoint}, allow_private=True)
out = []
for rev in revisions.split(","):
    (Path(barrier) / f"{rev}-{me}").touch()
    deadline = time.monotonic() + 60
    while len(list(Path(barrier).glob(f"{rev}-*"))) < int(count) and time.monotonic() < deadline:
        time.sleep(0.002)
    try:
        path = resolve_source_sync(f"hf://org/adapters@{rev}", settings)
        out.append({"rev": rev, "path": str(path), "digest": adapter_digest(path)})
    except Exception as exc:
        out.append({"rev": rev, "error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
"""


class Hub:
    """A stand-in Hugging Face hub: each file sent in slow chunks (a wide race window)."""

    def __init__(self, adapter_dir: Path, revisions: tuple[str, ...]) -> None:
        self.files = {
            f"/org/adapters/resolve/{rev}/{name}": (adapter_dir / name).read_bytes()
            for rev in revisions
            for name in ADAPTER_FILES
        }
        self.hits: dict[str, int] = {}
        self.before_answer = None  # called (with the path) before a file is sent

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = self.files.get(request.path)
        if body is None:
            return web.Response(status=404)
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        if self.before_answer is not None:
            self.before_answer(request.path)
        resp = web.StreamResponse()
        resp.content_length = len(body)
        await resp.prepare(request)
        step = max(1, len(body) // 8)
        for start in range(0, len(body), step):
            await resp.write(body[start : start + step])
            await asyncio.sleep(0.02)
        await resp.write_eof()
        return resp


@contextlib.asynccontextmanager
async def serving(hub: Hub):
    app = web.Application()
    app.router.add_get("/{tail:.*}", hub.handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


@pytest.fixture
def adapter_dir(assets) -> Path:
    return assets.demo.adapters["sql-r8"]


def _settings(cache: Path, endpoint: str, **kw) -> SourceSettings:
    return SourceSettings(cache_dir=cache, env={"HF_ENDPOINT": endpoint}, allow_private=True, **kw)


async def test_concurrent_fetchers_succeed(adapter_dir, tmp_path):
    """Processes fetching one adapter at once all succeed."""
    hub = Hub(adapter_dir, ROUNDS)
    cache, barrier = tmp_path / "shared-cache", tmp_path / "barrier"
    barrier.mkdir()
    async with serving(hub) as endpoint:
        argv = [str(cache), endpoint, str(barrier)]
        children = [
            await asyncio.create_subprocess_exec(
                *(sys.executable, "-c", CHILD, *argv, str(i), str(PROCESSES), ",".join(ROUNDS)),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONSAFEPATH": "1"},
            )
            for i in range(PROCESSES)
        ]
        outputs = [await asyncio.wait_for(child.communicate(), 120) for child in children]
    results = []
    for child, (out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err.decode()[-2000:]
        results += json.loads(out.decode().strip().splitlines()[-1])
    assert [r for r in results if "error" in r] == [], "no process may fail because of another"
    want = adapter_digest(adapter_dir)
    assert {r["digest"] for r in results} == {want}
    for rev in ROUNDS:
        assert len({r["path"] for r in results if r["rev"] == rev}) == 1, "one shared entry per source"
    # One process downloaded each file of each round; the others waited and used its result.
    assert sorted(hub.hits.values()) == [1] * len(ROUNDS) * len(ADAPTER_FILES), hub.hits
    entries = [p for p in cache.iterdir() if p.name != LOCKS]
    assert len(entries) == len(ROUNDS) and all((p / COMPLETE).is_file() for p in entries), entries


async def test_rival_publish_is_used(adapter_dir, tmp_path):
    """A writer outside the lock (another pod on a filesystem without locks) publishes the
    entry while this one downloads: the rename loses, the rival's result is used as is."""
    hub = Hub(adapter_dir, ("main",))
    cache = tmp_path / "cache"
    final = cache / cache_key("hf://org/adapters", None)

    def rival_publishes(path: str) -> None:
        if path.endswith(ADAPTER_FILES[1]) and not final.exists():
            shutil.copytree(adapter_dir, final)
            (final / COMPLETE).write_text("the rival's\n")

    hub.before_answer = rival_publishes
    async with serving(hub) as endpoint:
        got = await resolve_source("hf://org/adapters", _settings(cache, endpoint))
    assert got == final and (final / COMPLETE).read_text() == "the rival's\n", "the rival's entry is kept"
    assert adapter_digest(got) == adapter_digest(adapter_dir)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".download-")] == []


async def test_silent_lock_holder_bounded(adapter_dir, tmp_path):
    """A silent lock holder is waited for within a bound."""
    hub = Hub(adapter_dir, ("main",))
    cache = tmp_path / "cache"
    lock = cache / LOCKS / cache_key("hf://org/adapters", None)
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the entry and never shows progress
    try:
        async with serving(hub) as endpoint:
            progress = LoadProgress()
            start = time.monotonic()
            with pytest.raises(SourceError) as info:
                await resolve_source(
                    "hf://org/adapters", _settings(cache, endpoint, stall_timeout_s=0.2), progress=progress
                )
            assert time.monotonic() - start < 10
            assert info.value.transient, "the wait is not the adapter's fault"
            assert "another process's download of hf://org/adapters, which showed no progress" in str(info.value)
            assert progress.phase == "waiting" and hub.hits == {}
            # A holder that shows progress is waited for past that bound, and its result used.
            waiter = asyncio.create_task(
                resolve_source("hf://org/adapters", _settings(cache, endpoint, stall_timeout_s=0.2))
            )
            for _ in range(int(7.0 / 0.25)):  # longer than the silent bound (2 * 0.2 + 5 s)
                os.utime(lock)
                await asyncio.sleep(0.25)
            assert not waiter.done()
            final = cache / cache_key("hf://org/adapters", None)
            shutil.copytree(adapter_dir, final)
            (final / COMPLETE).write_text("x\n")
            os.close(fd)
            fd = -1
            assert await asyncio.wait_for(waiter, 10) == final and hub.hits == {}
    finally:
        if fd >= 0:
            os.close(fd)


async def test_a_damaged_cached_copy_is_fetched_again(adapter_dir, tmp_path):
    hub = Hub(adapter_dir, ("main",))
    cache = tmp_path / "cache"
    digest = adapter_digest(adapter_dir)
    async with serving(hub) as endpoint:
        settings = _settings(cache, endpoint)
        got = await resolve_source("hf://org/adapters", settings, sha256=digest)
        (got / ADAPTER_FILES[1]).write_bytes(b"truncated")  # a disk fault, a hand edit
        again = await resolve_source("hf://org/adapters", settings, sha256=digest)
    assert again == got and adapter_digest(again) == digest
    assert hub.hits[f"/org/adapters/resolve/main/{ADAPTER_FILES[1]}"] == 2


async def test_shared_volume_downloads_once(tmp_path):
    """``loraserve-fetch`` init containers of several pods, one models volume, one model:
    the same lock protocol; one downloads, the others find the model there."""
    model = tmp_path / "src"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(os.urandom(200_000))
    archive = tmp_path / "model.tar.gz"
    shutil.make_archive(str(archive).removesuffix(".tar.gz"), "gztar", model)
    body, hits = archive.read_bytes(), []

    async def handle(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        resp = web.StreamResponse()
        resp.content_length = len(body)
        await resp.prepare(request)
        step = len(body) // 20 + 1
        for start in range(0, len(body), step):  # about 2 s: the other fetchers arrive meanwhile
            await resp.write(body[start : start + step])
            await asyncio.sleep(0.1)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    dest = tmp_path / "models-volume" / "llama"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "LORASERVE_ALLOW_HTTP_SOURCES": "1"}
    try:
        source = f"http://127.0.0.1:{server.port}/model.tar.gz"
        fetchers = [
            await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "loraserve.runtime.tools.fetch", source, str(dest)),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            for _ in range(3)
        ]
        outputs = [await asyncio.wait_for(f.communicate(), 120) for f in fetchers]
    finally:
        await server.close()
    for fetcher, (_, err) in zip(fetchers, outputs, strict=True):
        assert fetcher.returncode == 0, err.decode()[-2000:]
    said = sorted(out.decode().split(":")[1].strip().split()[0] for out, _ in outputs)
    assert said == ["already", "already", "fetched"], outputs
    assert hits == ["/model.tar.gz"], "one download for all"
    assert (dest / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert not list(dest.parent.glob("llama.partial-*"))
