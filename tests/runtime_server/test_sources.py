"""Adapter sources: local, pvc://, https:// (a real TLS server with a test CA), and s3:// /
hf:// against local HTTP servers standing in for the object store and the hub (neither can
be reached from these machines). The SigV4 signer is checked against AWS's published
example."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.lora.sources import (
    ADAPTER_FILES,
    SourceError,
    SourceSettings,
    adapter_digest,
    hf_request,
    parse_source,
    resolve_source,
    s3_request,
    sigv4_sign,
)


@pytest.fixture
def adapter_dir(assets) -> Path:
    return assets.demo.adapters["sql-r8"]


def _settings(tmp_path: Path, **kw) -> SourceSettings:
    """Settings whose remote sources may reach this machine's loopback servers."""
    kw.setdefault("allow_private", True)
    return SourceSettings(cache_dir=tmp_path / "cache", pvc_root=tmp_path / "pvc", **kw)


def _cache_entries(tmp_path: Path) -> list[str]:
    """The cache's entries, its folder of lock files aside."""
    cache = tmp_path / "cache"
    return sorted(p.name for p in cache.iterdir() if p.name != ".locks") if cache.exists() else []


def test_digest_of_sha256sum_listing(adapter_dir):
    """Digest is sha256sum of the sha256sum listing."""
    listing = "".join(
        f"{hashlib.sha256((adapter_dir / n).read_bytes()).hexdigest()}  {n}\n" for n in ADAPTER_FILES
    )
    assert adapter_digest(adapter_dir) == hashlib.sha256(listing.encode()).hexdigest()
    if shutil.which("sha256sum"):
        out = subprocess.run(
            f"sha256sum {' '.join(ADAPTER_FILES)} | sha256sum",
            shell=True,
            cwd=adapter_dir,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[0]
        assert adapter_digest(adapter_dir) == out


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("", "non-empty"),
        ("ftp://host/x", "unsupported scheme"),
        ("http://host/x", "https"),
        ("file://relative/x", "absolute"),
        ("pvc://claim", "pvc://<claim>/<path"),
        ("pvc://claim/../etc", "'..'"),
        ("pvc://adapters/../../etc", "leaves the claim's mount (a '..' segment)"),
        ("pvc://adapters//etc/shadow", "leaves the claim's mount (an absolute path after the claim)"),
        ("pvc://adapters/team//sql", "leaves the claim's mount (an empty path segment"),
        ("s3://Bad_Bucket/key", "bucket"),
        ("s3://bucket", "s3://<bucket>/<key"),
        ("hf://justone", "hf://<org>/<repo>"),
        ("hf://org/repo@", "empty revision"),
        ("https:///nohost", "no host"),
    ],
)
def test_bad_sources_are_named(source, words):
    with pytest.raises(SourceError) as info:
        parse_source(source)
    assert words in str(info.value) and info.value.field == "lora_path"


async def test_local_file_and_pvc_sources(adapter_dir, tmp_path):
    settings = _settings(tmp_path)
    assert await resolve_source(str(adapter_dir), settings) == adapter_dir
    assert await resolve_source(f"file://{adapter_dir}", settings) == adapter_dir
    claim = tmp_path / "pvc" / "adapters-claim"
    shutil.copytree(adapter_dir, claim / "team" / "sql")
    got = await resolve_source("pvc://adapters-claim/team/sql", settings, sha256=adapter_digest(adapter_dir))
    assert got == (claim / "team" / "sql").resolve()
    with pytest.raises(SourceError, match="not mounted"):
        await resolve_source("pvc://other-claim/team/sql", settings)
    (claim / "escape").symlink_to(tmp_path)
    with pytest.raises(SourceError, match="outside"):
        await resolve_source("pvc://adapters-claim/escape", settings)
    with pytest.raises(SourceError, match="does not exist"):
        await resolve_source(str(tmp_path / "missing"), settings)
    with pytest.raises(SourceError) as info:
        await resolve_source(str(adapter_dir), settings, sha256="1" * 64)
    assert info.value.field == "sha256" and "sha256sum" in str(info.value)
    assert _cache_entries(tmp_path) == [], "local sources are used in place"


def _tarball(adapter_dir: Path, top: str = "my-adapter", extra: tarfile.TarInfo | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ADAPTER_FILES:
            tar.add(adapter_dir / name, arcname=f"{top}/{name}")
        if extra is not None:
            tar.addfile(extra, io.BytesIO(b"x" * extra.size) if extra.isfile() else None)
    return buf.getvalue()


class FileServer:
    """A real aiohttp server handing out bytes by path, counting hits, checking headers."""

    def __init__(self, files: dict[str, bytes], require_headers: dict[str, str] | None = None) -> None:
        self.files = files
        self.require = require_headers or {}
        self.hits: list[str] = []
        self.headers: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(request.path)
        self.headers.append(dict(request.headers))
        for k, v in self.require.items():
            if not request.headers.get(k, "").startswith(v):
                return web.Response(status=403, text="AccessDenied")
        if request.path.startswith("/boom"):
            return web.Response(status=503, text="SlowDown")
        body = self.files.get(request.path)
        if body is None:
            return web.Response(status=404, text="NoSuchKey")
        return web.Response(body=body)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self.handle)
        return app


async def _serve(files, *, ssl_ctx=None, require=None):
    fs = FileServer(files, require)
    server = TestServer(fs.app(), scheme="https" if ssl_ctx else "http", host="127.0.0.1")
    await server.start_server(ssl=ssl_ctx)
    return fs, server


async def test_https_archive_and_directory_sources(adapter_dir, tmp_path, tls):
    server_ctx, ca_file = tls
    digest = adapter_digest(adapter_dir)
    files = {"/a/adapter.tar.gz": _tarball(adapter_dir)}
    for name in ADAPTER_FILES:
        files[f"/dir/{name}"] = (adapter_dir / name).read_bytes()
    fs, server = await _serve(files, ssl_ctx=server_ctx)
    base = f"https://127.0.0.1:{server.port}"
    settings = _settings(tmp_path, ca_file=ca_file)
    try:
        got = await resolve_source(f"{base}/a/adapter.tar.gz", settings, sha256=digest)
        assert adapter_digest(got) == digest and got.parent == tmp_path / "cache"
        hits = len(fs.hits)
        assert await resolve_source(f"{base}/a/adapter.tar.gz", settings, sha256=digest) == got
        assert len(fs.hits) == hits, "a cached source is not fetched again"
        got2 = await resolve_source(f"{base}/dir/", settings)
        assert adapter_digest(got2) == digest
        # A wrong digest leaves nothing behind.
        before = _cache_entries(tmp_path)
        with pytest.raises(SourceError) as info:
            await resolve_source(f"{base}/dir", settings, sha256="ab" * 32)
        assert info.value.field == "sha256" and not info.value.transient
        assert _cache_entries(tmp_path) == before
        with pytest.raises(SourceError) as info:
            await resolve_source(f"{base}/nothing/here.tar.gz", settings)
        assert "404" in str(info.value) and not info.value.transient
        with pytest.raises(SourceError) as info:
            await resolve_source(f"{base}/boom", settings)
        assert info.value.transient
        # Without the test CA the certificate is not trusted: a transient failure, clearly said.
        with pytest.raises(SourceError, match="failed"):
            await resolve_source(f"{base}/dir", _settings(tmp_path / "untrusted"))
    finally:
        await server.close()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".download-")]


@pytest.mark.parametrize("kind", ["symlink", "escape", "two-adapters", "not-a-tar", "too-big"])
async def test_unsafe_or_broken_archives_are_refused(adapter_dir, tmp_path, tls, kind):
    server_ctx, ca_file = tls
    if kind == "symlink":
        info = tarfile.TarInfo("my-adapter/link")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        body = _tarball(adapter_dir, extra=info)
    elif kind == "escape":
        info = tarfile.TarInfo("../../evil.txt")
        info.size = 4
        body = _tarball(adapter_dir, extra=info)
    elif kind == "two-adapters":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for top in ("one", "two"):
                for name in ADAPTER_FILES:
                    tar.add(adapter_dir / name, arcname=f"{top}/{name}")
        body = buf.getvalue()
    elif kind == "too-big":
        body = _tarball(adapter_dir)
    else:
        body = b"this is not an archive"
    _fs, server = await _serve({"/x.tar.gz": body}, ssl_ctx=server_ctx)
    max_bytes = 1000 if kind == "too-big" else 16 << 30
    try:
        with pytest.raises(SourceError) as err:
            await resolve_source(
                f"https://127.0.0.1:{server.port}/x.tar.gz",
                _settings(tmp_path, ca_file=ca_file, max_bytes=max_bytes),
            )
    finally:
        await server.close()
    words = {
        "symlink": "link",
        "escape": "escapes",
        "two-adapters": "several",
        "not-a-tar": "tar",
        "too-big": "limit",
    }[kind]
    assert words in str(err.value)
    assert not (tmp_path.parent / "evil.txt").exists()
    assert _cache_entries(tmp_path) == [], "nothing half-downloaded stays in the cache"


async def test_s3_source_fetches_signed(adapter_dir, tmp_path):
    """S3 source fetches signed objects from the configured endpoint."""
    files = {f"/models-bucket/team/sql/{n}": (adapter_dir / n).read_bytes() for n in ADAPTER_FILES}
    fs, server = await _serve(files, require={"Authorization": "AWS4-HMAC-SHA256 Credential=AKIDTEST/"})
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}",
        "AWS_ACCESS_KEY_ID": "AKIDTEST",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_REGION": "eu-west-1",
        "AWS_SESSION_TOKEN": "tok",
    }
    try:
        got = await resolve_source(
            "s3://models-bucket/team/sql", _settings(tmp_path, env=env), sha256=adapter_digest(adapter_dir)
        )
        assert adapter_digest(got) == adapter_digest(adapter_dir)
        sent = fs.headers[-1]
        assert "/eu-west-1/s3/aws4_request" in sent["Authorization"]
        assert sent["x-amz-security-token"] == "tok"
        assert sent["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        with pytest.raises(SourceError) as info:
            await resolve_source(
                "s3://models-bucket/team/sql",
                _settings(tmp_path / "anon", env={"AWS_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]}),
            )
        assert "403" in str(info.value) and "credentials" in str(info.value) and not info.value.transient
    finally:
        await server.close()


def test_s3_and_hf_request_construction():
    url, headers = s3_request("bkt", "a b/adapter_config.json", {"AWS_REGION": "us-west-2"})
    assert url == "https://s3.us-west-2.amazonaws.com/bkt/a%20b/adapter_config.json" and headers == {}
    url, _ = s3_request(
        "bkt", "k", {"AWS_ENDPOINT_URL_S3": "https://minio.local:9000/", "AWS_ENDPOINT_URL": "x"}
    )
    assert url == "https://minio.local:9000/bkt/k"
    url, headers = hf_request("org/repo", "v1.0", "sub/adapter_config.json", {"HF_TOKEN": "hf_abc"})
    assert url == "https://huggingface.co/org/repo/resolve/v1.0/sub/adapter_config.json"
    assert headers == {"Authorization": "Bearer hf_abc"}
    parsed = parse_source("hf://org/repo/sub/dir@refs/pr/1")
    assert (parsed.bucket, parsed.path, parsed.revision) == ("org/repo", "sub/dir", "refs/pr/1")


def test_sigv4_matches_the_aws_documented_example():
    """AWS S3 documentation, "Signature Calculations for the Authorization Header", GET Object."""
    headers = sigv4_sign(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        {
            "Range": "bytes=0-9",
            "x-amz-content-sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        },
        "AKIAIOSFODNN7EXAMPLE",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "us-east-1",
        "s3",
        now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC),
    )
    assert headers["Authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request, "
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date, "
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )


async def test_hf_source_settings(adapter_dir, tmp_path):
    """HF source uses endpoint revision and token."""
    files = {f"/org/adapters/resolve/abc123/sql/{n}": (adapter_dir / n).read_bytes() for n in ADAPTER_FILES}
    _fs, server = await _serve(files, require={"Authorization": "Bearer hf_secret"})
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.port}", "HF_TOKEN": "hf_secret"}
    try:
        got = await resolve_source("hf://org/adapters/sql@abc123", _settings(tmp_path, env=env))
        assert adapter_digest(got) == adapter_digest(adapter_dir)
        with pytest.raises(SourceError, match="404"):
            await resolve_source("hf://org/adapters/sql@other", _settings(tmp_path, env=env))
    finally:
        await server.close()


def test_environment_from_process():
    """Environment is read from the process by default."""
    assert SourceSettings().env.get("PATH") == os.environ.get("PATH")


@pytest.mark.parametrize(
    ("source", "char"),
    [
        ("/adapters/sql\x00.evil", "U+0000"),
        ("https://host.example/a.tar.gz\n", "U+000A"),
        ("hf://org/repo\r@main", "U+000D"),
        ("pvc://claim/sql\x1b[2J", "U+001B"),
        ("s3://bucket/key\x7f", "U+007F"),
        ("/adapters/sql\x85", "U+0085"),
    ],
)
def test_control_characters_are_refused_by_name(source, char):
    with pytest.raises(SourceError) as info:
        parse_source(source)
    err = info.value
    assert err.field == "lora_path" and not err.transient
    assert "lora_path holds a control character" in str(err) and char in str(err), str(err)


async def test_a_percent_encoded_nul_is_refused_too(tmp_path):
    with pytest.raises(SourceError, match="control character"):
        await resolve_source("file:///adapters/sql%00x", _settings(tmp_path))


SECRET, TOKEN = "hunter2", "X-Amz-Signature=topsecret"


async def test_errors_show_no_secret_or_server_path(adapter_dir, tmp_path, tls):
    server_ctx, ca_file = tls
    files = {f"/noweights/{ADAPTER_FILES[0]}": (adapter_dir / ADAPTER_FILES[0]).read_bytes()}
    _fs, server = await _serve(files, ssl_ctx=server_ctx)
    port = server.port
    base = f"https://user:{SECRET}@127.0.0.1:{port}"
    settings = _settings(tmp_path, ca_file=ca_file)
    (tmp_path / "pvc" / "claim").mkdir(parents=True)
    messages = []
    try:
        for source in (
            f"{base}/missing/a.tar.gz?{TOKEN}",  # 404
            f"{base}/noweights?{TOKEN}",  # 404 on the second file
            f"https://user:{SECRET}@/nohost?{TOKEN}",  # a parse error
            f"http://user:{SECRET}@host.example/a?{TOKEN}",  # plain http
            f"https://user:{SECRET}@127.0.0.1:1/a.tar.gz?{TOKEN}",  # connection refused
            "pvc://elsewhere/sql",  # not mounted
            "pvc://claim/absent",  # absent in the claim
        ):
            with pytest.raises(SourceError) as info:
                await resolve_source(source, settings)
            messages.append(str(info.value))
    finally:
        await server.close()
    for message in messages:
        assert SECRET not in message and "topsecret" not in message, message
        assert str(tmp_path) not in message, message  # neither the cache nor the pvc root
    assert f"GET https://127.0.0.1:{port}/missing/a.tar.gz answered 404" in messages[0]
    assert "lora_path 'pvc://claim/absent': 'absent' does not exist in volume 'claim'" in messages[-1]
    assert "volume 'elsewhere' is not mounted" in messages[-2] and "--pvc-root" in messages[-2]


async def test_hung_source_settings_from_config():
    """Hung source settings come from the server config."""
    from loraserve.runtime.contract.config import ServerConfig

    server = ServerConfig(allow_private_sources=True, source_stall_timeout_s=7.5)
    settings = SourceSettings().with_config(server)
    assert settings.allow_private and settings.stall_timeout_s == 7.5
    transport = settings.transport()
    assert (transport.connect_timeout_s, transport.stall_timeout_s, transport.refuse_private) == (7.5, 7.5, False)
    defaults = SourceSettings().with_config(ServerConfig()).transport()
    assert defaults.refuse_private and defaults.stall_timeout_s == 30.0
    listed = SourceSettings().with_config(ServerConfig(remote_source_hosts=("a.example",))).transport()
    assert not listed.refuse_private, "a host list is its own guard"


def test_library_url_message_redacted():
    """A library message quoting the URL is redacted."""
    from loraserve.runtime.remote import public_url, redact

    url = "https://svc:hunter2%21@h.example:8443/a/b.tar.gz?X-Amz-Signature=topsecret#frag"
    assert public_url(url) == "https://h.example:8443/a/b.tar.gz"
    text = redact(f"Cannot connect to {url} (auth hunter2!, sig X-Amz-Signature=topsecret)", url)
    assert "hunter2" not in text and "topsecret" not in text, text
    # A credential too short to look for does not garble the rest of the message.
    assert redact("password pp rejected", "https://u:pp@h/x") == "password pp rejected"
