"""``loraserve-fetch``: model directories from https:// (a real TLS server with a test CA)
and s3:// (a local aiohttp server stands in for S3: no object store is reachable from these
machines). Every fetched model is compared byte for byte with its source and loaded by the
runtime's own loader."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path
from xml.sax.saxutils import escape

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from safetensors.torch import load_file, save_file

from loraserve.runtime.dev.devmodels import build_tiny_model
from loraserve.runtime.remote import SourceError, sigv4_sign
from loraserve.runtime.tools.fetch import (
    EXIT_BAD_SOURCE,
    EXIT_OK,
    EXIT_TRANSFER,
    MARKER,
    FetchOptions,
    fetch_model,
    main,
    model_digest,
    read_marker,
)

BUCKET = "model-store"
ACCESS_KEY, SECRET_KEY, REGION = "AKIDFETCHTEST", "fetch-secret", "eu-central-1"


# --- models ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny model (single safetensors file) and the same weights as a three-shard index."""
    root = tmp_path_factory.mktemp("fetch-models")
    single = build_tiny_model(root / "single", seed=7)
    sharded = root / "sharded"
    shutil.copytree(single, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    index["weight_map"] = weight_map
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"single": single, "sharded": sharded}


def _files(directory: Path) -> dict[str, bytes]:
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _assert_same_model(fetched: Path, source: Path, make_runner) -> None:
    assert _files(fetched) == _files(source), "the fetched files differ from the source's"
    runner = make_runner(fetched)  # the runtime's loader: config.json + safetensors (+ index)
    expected: dict = {}
    for path in source.glob("*.safetensors"):
        expected.update(load_file(str(path)))
    assert runner.embed_tokens.weight.detach().cpu().equal(expected["model.embed_tokens.weight"])
    assert runner.lm_head.weight.detach().cpu().equal(expected["lm_head.weight"])


def _partials(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name) if parent.exists() else []


def _tarball(model_dir: Path, top: str = "llama", extra: dict[str, bytes] | None = None, bad=None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(model_dir.iterdir()):
            tar.add(path, arcname=f"{top}/{path.name}")
        for name, body in (extra or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        if bad is not None:
            tar.addfile(bad)
    return buf.getvalue()


def _shell_digest(directory: Path) -> str:
    """The digest as the documented shell pipeline computes it."""
    out = subprocess.run(
        f"find . -type f ! -name {MARKER} -printf '%P\\n' | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum",
        shell=True,
        cwd=directory,
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    return out.stdout.split()[0]


# --- servers -----------------------------------------------------------------------------------


class ObjectServer:
    """A real aiohttp server handing out bytes by path and counting every request.

    With ``s3=True`` it also answers ListObjectsV2 (``GET /<bucket>?list-type=2``) in pages
    of ``page_size`` keys with continuation tokens, and refuses any request whose SigV4
    signature does not match the bytes it received.
    """

    def __init__(self, files: dict[str, bytes], *, s3: bool = False, page_size: int = 4) -> None:
        self.files = files
        self.s3 = s3
        self.page_size = page_size
        self.hits: list[str] = []
        self.fail_once: set[str] = set()

    def gets(self) -> list[str]:
        return [h for h in self.hits if "list-type" not in h]

    def lists(self) -> list[str]:
        return [h for h in self.hits if "list-type" in h]

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.raw_path)
        if self.s3 and not self._signed(request):
            return web.Response(status=403, text="<Error><Code>SignatureDoesNotMatch</Code></Error>")
        if request.path in self.fail_once:
            self.fail_once.discard(request.path)
            return web.Response(status=503, text="SlowDown")
        if self.s3 and request.query.get("list-type") == "2":
            return self._list(request)
        body = self.files.get(request.path)
        if body is None:
            return web.Response(status=404, text="NoSuchKey")
        return web.Response(body=body)

    def _signed(self, request: web.Request) -> bool:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith(f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/"):
            return False
        signed = auth.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";")
        headers = {k: request.headers[k] for k in signed if k not in ("host", "x-amz-date")}
        now = dt.datetime.strptime(request.headers["x-amz-date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.UTC)
        url = f"http://{request.host}{request.raw_path}"  # exactly what came over the wire
        expected = sigv4_sign(request.method, url, headers, ACCESS_KEY, SECRET_KEY, REGION, "s3", now=now)
        return expected["Authorization"] == auth

    def _list(self, request: web.Request) -> web.Response:
        bucket = request.path.strip("/")
        prefix = request.query.get("prefix", "")
        keys = sorted(p[len(bucket) + 2 :] for p in self.files if p.startswith(f"/{bucket}/"))
        keys = [k for k in keys if k.startswith(prefix)]
        token = request.query.get("continuation-token")
        # Tokens with characters that must be percent-encoded test the query signing.
        start = int(token.split("/")[1].rstrip("+=")) if token else 0
        page = keys[start : start + self.page_size]
        more = start + self.page_size < len(keys)
        contents = "".join(f"<Contents><Key>{escape(k)}</Key><Size>1</Size></Contents>" for k in page)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>"
            f"<IsTruncated>{'true' if more else 'false'}</IsTruncated>{contents}"
            + (
                f"<NextContinuationToken>page/{start + self.page_size}+=</NextContinuationToken>"
                if more
                else ""
            )
            + "</ListBucketResult>"
        )
        return web.Response(body=body.encode(), content_type="application/xml")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        return app


async def _serve(server: ObjectServer, ssl_ctx=None) -> TestServer:
    test_server = TestServer(server.app(), scheme="https" if ssl_ctx else "http", host="127.0.0.1")
    await test_server.start_server(ssl=ssl_ctx)
    return test_server


def _s3_env(port: int, **extra: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": REGION,
        **extra,
    }


async def _fetch(source: str, dest: Path, **options):
    """fetch_model off the event loop that runs the test servers."""
    return await asyncio.to_thread(fetch_model, source, dest, FetchOptions(retry_delay_s=0, **options))


async def _main(args: list[str]) -> int:
    return await asyncio.to_thread(main, args)


# --- https -------------------------------------------------------------------------------------


async def test_https_archive_is_fetched_once_and_loads(models, tmp_path, tls, make_runner):
    server_ctx, ca_file = tls
    source_dir = models["single"]
    # The archive also carries pickle weights: they never reach the model directory.
    body = _tarball(source_dir, extra={"llama/pytorch_model.bin": b"pickle", "README.md": b"hi"})
    files = ObjectServer({"/releases/llama.tar.gz": body})
    server = await _serve(files, server_ctx)
    source = f"https://127.0.0.1:{server.port}/releases/llama.tar.gz"
    dest = tmp_path / "models" / "https" / "llama.tar.gz"
    digest = model_digest(source_dir)
    try:
        result = await _fetch(source, dest, ca_file=ca_file, sha256=digest)
        assert result.downloaded and result.path == dest and result.sha256 == digest
        _assert_same_model(dest, source_dir, make_runner)
        assert not (dest / "pytorch_model.bin").exists()
        marker = read_marker(dest)
        assert marker is not None and marker.source == source and marker.sha256 == digest
        assert digest == _shell_digest(dest), "the documented shell pipeline gives the same digest"
        # A restarting pod: nothing is downloaded again (also through the command line).
        hits = len(files.hits)
        again = await _fetch(source, dest, ca_file=ca_file, sha256=digest)
        assert not again.downloaded and again.sha256 == digest
        assert await _main([source, str(dest), "--ca-file", ca_file]) == EXIT_OK
        assert len(files.hits) == hits, "a fetched model is not downloaded again"
        # Another source, or another digest, for the same destination is refused, naming both.
        other = f"https://127.0.0.1:{server.port}/releases/other.tar.gz"
        with pytest.raises(SourceError) as info:
            await _fetch(other, dest, ca_file=ca_file)
        assert source in str(info.value) and other in str(info.value) and "fix:" in str(info.value)
        with pytest.raises(SourceError) as info:
            await _fetch(source, dest, ca_file=ca_file, sha256="0" * 64)
        assert digest in str(info.value) and "0" * 64 in str(info.value)
        assert len(files.hits) == hits
    finally:
        await server.close()
    assert _partials(dest.parent) == []


async def test_https_directory_with_a_sharded_index(models, tmp_path, tls, make_runner):
    server_ctx, ca_file = tls
    source_dir = models["sharded"]
    served = {f"/m/{name}": body for name, body in _files(source_dir).items()}
    served["/m/pytorch_model.bin"] = b"pickle weights are never fetched"
    files = ObjectServer(served)
    shard = "/m/model-00002-of-00003.safetensors"
    files.fail_once.add(shard)  # a transient 503 is retried
    server = await _serve(files, server_ctx)
    dest = tmp_path / "dir-model"
    try:
        result = await _fetch(
            f"https://127.0.0.1:{server.port}/m/", dest, ca_file=ca_file, sha256=model_digest(source_dir)
        )
    finally:
        await server.close()
    assert result.downloaded and result.files == len(_files(source_dir))
    _assert_same_model(dest, source_dir, make_runner)
    assert files.gets().count(shard) == 2
    assert "/m/pytorch_model.bin" not in files.hits
    assert "/m/model.safetensors" not in files.hits, "with an index, no single file is asked for"
    assert "/m/special_tokens_map.json" in files.hits and not (dest / "special_tokens_map.json").exists()


async def test_digest_mismatch_fails_and_leaves_nothing(models, tmp_path, tls, capsys):
    server_ctx, ca_file = tls
    files = ObjectServer({"/a/llama.tgz": _tarball(models["single"])})
    server = await _serve(files, server_ctx)
    dest = tmp_path / "models" / "llama"
    try:
        code = await _main(
            [
                f"https://127.0.0.1:{server.port}/a/llama.tgz",
                str(dest),
                "--ca-file",
                ca_file,
                "--sha256",
                "ab" * 32,
            ]
        )
        assert code == EXIT_BAD_SOURCE
        assert "sha256 mismatch" in capsys.readouterr().err
        assert not dest.exists() and _partials(dest.parent) == []
        # A server failing every time is a transfer failure (exit 1), after the retries.
        code = await _main(
            [f"https://127.0.0.1:{server.port}/nothing-here/llama.tgz", str(dest), "--ca-file", ca_file]
        )
        assert code == EXIT_BAD_SOURCE and "404" in capsys.readouterr().err
        files.fail_once.update({"/a/llama.tgz"})
        code = await _main(
            [
                f"https://127.0.0.1:{server.port}/a/llama.tgz",
                str(dest),
                "--ca-file",
                ca_file,
                "--retries",
                "0",
            ]
        )
        assert code == EXIT_TRANSFER and "503" in capsys.readouterr().err
        # Without the test CA the server is not trusted.
        assert (
            await _main([f"https://127.0.0.1:{server.port}/a/llama.tgz", str(dest), "--retries", "0"])
            == EXIT_TRANSFER
        )
    finally:
        await server.close()
    assert not dest.exists() and _partials(dest.parent) == []


@pytest.mark.parametrize("shape", ["https-dir", "archive", "s3-prefix"])
async def test_pickle_only_sources_fail_naming_the_fix(models, tmp_path, tls, shape):
    server_ctx, ca_file = tls
    config = (models["single"] / "config.json").read_bytes()
    if shape == "https-dir":
        files = ObjectServer({"/p/config.json": config, "/p/pytorch_model.bin": b"pickle"})
        server = await _serve(files, server_ctx)
        source, options = f"https://127.0.0.1:{server.port}/p", {"ca_file": ca_file}
    elif shape == "archive":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, body in (("m/config.json", config), ("m/pytorch_model.bin", b"pickle")):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
        files = ObjectServer({"/p.tar": buf.getvalue()})
        server = await _serve(files, server_ctx)
        source, options = f"https://127.0.0.1:{server.port}/p.tar", {"ca_file": ca_file}
    else:
        files = ObjectServer(
            {f"/{BUCKET}/p/config.json": config, f"/{BUCKET}/p/pytorch_model.bin": b"pickle"}, s3=True
        )
        server = await _serve(files)
        source, options = f"s3://{BUCKET}/p", {"env": _s3_env(server.port)}
    dest = tmp_path / "pickle"
    try:
        with pytest.raises(SourceError) as info:
            await _fetch(source, dest, **options)
    finally:
        await server.close()
    assert "safetensors" in str(info.value) and "safe_serialization=True" in str(info.value)
    assert not info.value.transient
    if shape != "archive":
        assert not [h for h in files.hits if h.endswith(".bin")], "pickle weights are never downloaded"
    assert not dest.exists() and _partials(tmp_path) == []


@pytest.mark.parametrize("where", ["archive", "s3-key"])
async def test_path_traversal_is_refused(models, tmp_path, tls, where):
    server_ctx, ca_file = tls
    dest = tmp_path / "inner" / "llama"
    if where == "archive":
        escape_member = tarfile.TarInfo("../../evil.txt")
        escape_member.size = 0
        files = ObjectServer({"/x.tar.gz": _tarball(models["single"], bad=escape_member)})
        server = await _serve(files, server_ctx)
        source, options = f"https://127.0.0.1:{server.port}/x.tar.gz", {"ca_file": ca_file}
        words = "escapes the archive"
    else:
        served = {f"/{BUCKET}/llama/{n}": b for n, b in _files(models["single"]).items()}
        served[f"/{BUCKET}/llama/../../evil.txt"] = b"x"
        files = ObjectServer(served, s3=True)
        server = await _serve(files)
        source, options = f"s3://{BUCKET}/llama", {"env": _s3_env(server.port)}
        words = "not a plain relative path"
    try:
        with pytest.raises(SourceError, match=words):
            await _fetch(source, dest, **options)
    finally:
        await server.close()
    assert not dest.exists() and _partials(dest.parent) == []
    assert not list(tmp_path.rglob("evil.txt"))


# --- s3 ----------------------------------------------------------------------------------------


async def test_s3_prefix_fetched_once(models, tmp_path, make_runner):
    """A local aiohttp server stands in for S3 (no object store is reachable from these
    machines): it answers ListObjectsV2 in pages with continuation tokens and checks the
    SigV4 signature of every request against the bytes it received."""
    source_dir = models["sharded"]
    served = {f"/{BUCKET}/team/llama/{n}": b for n, b in _files(source_dir).items()}
    served[f"/{BUCKET}/team/llama/extra/notes.json"] = b"{}"  # nested keys keep their paths
    served[f"/{BUCKET}/team/llama/"] = b""  # a "folder" placeholder object
    served[f"/{BUCKET}/team/llama/pytorch_model.bin"] = b"pickle"
    served[f"/{BUCKET}/team/llama-other/config.json"] = b"{}"  # a sibling prefix, not ours
    files = ObjectServer(served, s3=True, page_size=4)
    server = await _serve(files)
    env = _s3_env(server.port, AWS_SESSION_TOKEN="session-token")
    dest = tmp_path / "s3" / BUCKET / "team" / "llama"
    try:
        result = await _fetch(f"s3://{BUCKET}/team/llama/", dest, env=env)
        assert result.downloaded
        assert len(files.lists()) >= 2, "the listing spans pages"
        assert not [h for h in files.gets() if h.endswith(".bin") or "llama-other" in h]
        assert (dest / "extra" / "notes.json").read_bytes() == b"{}"
        (dest / "extra" / "notes.json").unlink()  # compare the model itself with its source
        (dest / "extra").rmdir()
        _assert_same_model(dest, source_dir, make_runner)
        hits = len(files.hits)
        assert (await _fetch(f"s3://{BUCKET}/team/llama/", dest, env=env)).downloaded is False
        assert len(files.hits) == hits, "a fetched model is not downloaded again"
        # Unsigned (no credentials): the store refuses, and the message says where to look.
        with pytest.raises(SourceError) as info:
            await _fetch(
                f"s3://{BUCKET}/team/llama",
                tmp_path / "anon",
                env={"AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]},
            )
        assert "403" in str(info.value) and "credentials" in str(info.value)
        with pytest.raises(SourceError, match="no objects under"):
            await _fetch(f"s3://{BUCKET}/nothing", tmp_path / "empty", env=env)
    finally:
        await server.close()


async def test_s3_archive_and_the_command_line(models, tmp_path):
    """A local aiohttp server stands in for S3; the command runs as its own process, as in
    the init container, with the endpoint and keys in its environment."""
    files = ObjectServer({f"/{BUCKET}/archives/llama.tar.gz": _tarball(models["single"])}, s3=True)
    server = await _serve(files)
    dest = tmp_path / "models" / "s3" / BUCKET / "archives" / "llama.tar.gz"
    env = {**os.environ, **_s3_env(server.port), "PYTHONSAFEPATH": "1"}
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loraserve.runtime.tools.fetch",
            f"s3://{BUCKET}/archives/llama.tar.gz",
            str(dest),
            "--sha256",
            model_digest(models["single"]),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    finally:
        await server.close()
    assert proc.returncode == EXIT_OK, err.decode()
    assert "fetched" in out.decode() and model_digest(models["single"]) in out.decode()
    assert _files(dest) == _files(models["single"])
    assert files.gets() == [f"/{BUCKET}/archives/llama.tar.gz"]


async def test_private_ca_from_ssl_cert_file(models, tmp_path, tls):
    """The operator passes only SOURCE and DEST: a private CA set as SSL_CERT_FILE in
    spec.runtime.env is trusted by the fetch process without --ca-file."""
    server_ctx, ca_file = tls
    files = ObjectServer({"/m.tar.gz": _tarball(models["single"])})
    server = await _serve(files, server_ctx)
    source = f"https://127.0.0.1:{server.port}/m.tar.gz"
    codes = {}
    try:
        for name, extra in (("untrusted", {}), ("trusted", {"SSL_CERT_FILE": ca_file})):
            env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "loraserve.runtime.tools.fetch",
                source,
                str(tmp_path / name),
                "--retries",
                "0",
                env={**env, **extra, "PYTHONSAFEPATH": "1"},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            _out, err = await proc.communicate()
            codes[name] = (proc.returncode, err.decode())
    finally:
        await server.close()
    assert codes["untrusted"][0] == EXIT_TRANSFER and "certificate" in codes["untrusted"][1].lower()
    assert codes["trusted"][0] == EXIT_OK, codes["trusted"][1]
    assert _files(tmp_path / "trusted") == _files(models["single"])


async def test_sigterm_mid_download_leaves_no_partial(tmp_path):
    """Kubernetes stops an init container with SIGTERM: the fetch exits 143 and removes its
    partial directory (a real process against a server that stalls mid-body)."""
    started = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(1 << 20)})
        await resp.prepare(request)
        await resp.write(b"x" * 1024)
        started.set()
        await asyncio.sleep(60)
        return resp

    app = web.Application()
    app.router.add_get("/{tail:.*}", stall)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    dest = tmp_path / "models" / "llama"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "loraserve.runtime.tools.fetch",
            f"http://127.0.0.1:{server.port}/llama.tar.gz",
            str(dest),
            env={**os.environ, "LORASERVE_ALLOW_HTTP_SOURCES": "1", "PYTHONSAFEPATH": "1"},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await asyncio.wait_for(started.wait(), 30)
        assert _partials(dest.parent), "the download runs in a partial directory"
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        await server.close()
    assert code == 128 + signal.SIGTERM
    assert not dest.exists() and _partials(dest.parent) == []


def test_the_console_script_is_declared():
    """`loraserve-fetch` is a console script of the package, so the image puts it on PATH."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["loraserve-fetch"]
    module, _, attr = target.partition(":")
    assert getattr(importlib.import_module(module), attr) is main


# --- arguments and leftovers -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,words",
    [
        (["hf://org/repo", "/tmp/x"], "use https://"),
        (["http://example.com/m.tar.gz", "/tmp/x"], "plain http is refused"),
        (["s3://Bad_Bucket/m", "/tmp/x"], "not a valid S3 bucket name"),
        (["s3://bucket/../m", "/tmp/x"], "not a plain relative path"),
        (["https://example.com/m.tar.gz", "/tmp/x", "--sha256", "xyz"], "--sha256 must be 64"),
    ],
)
def test_bad_arguments_exit_2_naming_the_fix(args, words, capsys):
    assert main(args) == EXIT_BAD_SOURCE
    assert words in capsys.readouterr().err


def test_a_foreign_destination_is_not_overwritten(tmp_path, capsys):
    dest = tmp_path / "llama"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    assert main(["https://example.com/llama.tar.gz", str(dest)]) == EXIT_BAD_SOURCE
    assert "no .loraserve-fetch.json" in capsys.readouterr().err
    assert (dest / "config.json").read_text() == "{}"


async def test_stale_partials_removed(models, tmp_path, tls):
    """Stale partials of killed fetches are removed."""
    server_ctx, ca_file = tls
    dest = tmp_path / "llama"
    stale, fresh = tmp_path / "llama.partial-dead", tmp_path / "llama.partial-busy"
    for d in (stale, fresh):
        (d / "model").mkdir(parents=True)
        (d / "model" / "model.safetensors").write_bytes(b"half")
    old = time.time() - 7200
    for p in (stale / "model" / "model.safetensors", stale / "model", stale):
        os.utime(p, (old, old))
    files = ObjectServer({"/l.tar.gz": _tarball(models["single"])})
    server = await _serve(files, server_ctx)
    try:
        await _fetch(f"https://127.0.0.1:{server.port}/l.tar.gz", dest, ca_file=ca_file)
    finally:
        await server.close()
    assert _partials(tmp_path) == ["llama.partial-busy"], "only the idle leftover goes"
