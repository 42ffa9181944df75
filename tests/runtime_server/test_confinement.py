"""Confinement of adapter and model paths: local roots (``--allowed-local-roots``), ``pvc://``
paths that stay in their claim, and the allow-list of remote source hosts
(``--remote-source-hosts``).

Real files and real symlinks on disk, real TLS servers on loopback, and the production app
over HTTP for the admin API and the catalog path.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime import cli
from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog
from loraserve.runtime.dev.demo import free_port
from loraserve.runtime.lora.sources import (
    ADAPTER_FILES,
    SourceError,
    SourceSettings,
    adapter_digest,
    check_remote_host,
    resolve_source,
)

from .conftest import make_config, running_server
from .runtime_process import runtime_process, wait_ready


@pytest.fixture
def adapter_dir(assets) -> Path:
    return assets.demo.adapters["sql-r8"]


@pytest.fixture
def layout(tmp_path, adapter_dir):
    """``allowed/`` (the root) holding a good adapter, a directory link and a file link that
    lead out of it, and ``outside/`` holding a copy of the adapter."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    shutil.copytree(adapter_dir, allowed / "sql")
    shutil.copytree(adapter_dir, outside / "sql")
    (allowed / "dir-link").symlink_to(outside / "sql", target_is_directory=True)
    (allowed / "file-link").mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", allowed / "file-link")
    (allowed / "file-link" / "adapter_model.safetensors").symlink_to(outside / "sql" / "adapter_model.safetensors")
    (allowed / "inner-link").mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", allowed / "inner-link")
    (allowed / "inner-link" / "adapter_model.safetensors").symlink_to(allowed / "sql" / "adapter_model.safetensors")
    return allowed, outside


def _settings(tmp_path: Path, **kw) -> SourceSettings:
    return SourceSettings(cache_dir=tmp_path / "cache", pvc_root=tmp_path / "pvc", env={}, **kw)


async def _refused(source: str, settings: SourceSettings, *words: str) -> SourceError:
    with pytest.raises(SourceError) as info:
        await resolve_source(source, settings)
    assert info.value.field == "lora_path" and not info.value.transient
    for word in words:
        assert word in str(info.value), str(info.value)
    return info.value


async def test_local_sources_inside_roots(layout, tmp_path, monkeypatch):
    """Local sources resolve inside the allowed roots only."""
    allowed, outside = layout
    settings = _settings(tmp_path, allowed_roots=(str(allowed),))
    assert await resolve_source(str(allowed / "sql"), settings) == allowed / "sql"
    assert await resolve_source(f"file://{allowed}/sql", settings) == allowed / "sql"
    # A link to a file that stays inside is fine: what counts is where it resolves.
    assert await resolve_source(str(allowed / "inner-link"), settings) == allowed / "inner-link"
    for source in (
        str(outside / "sql"),  # a plain path elsewhere
        f"file://{outside}/sql",
        f"{allowed}/../outside/sql",  # '..' after a root
        str(allowed / "dir-link"),  # the directory is a link that leads out
        "/etc",
        str(tmp_path / "no-such-dir"),  # outside and absent: the same answer, no existence probe
    ):
        await _refused(source, settings, "outside the allowed local roots", str(allowed), "--allowed-local-roots")
    # One adapter file linked to outside: refused, though the directory is inside.
    await _refused(str(allowed / "file-link"), settings, "adapter_model.safetensors is a link", str(allowed))
    # A relative path would resolve from the working directory: refused, even from inside.
    monkeypatch.chdir(allowed)
    await _refused("sql", settings, "relative path", str(allowed))


async def test_no_roots_no_confinement(layout, tmp_path, monkeypatch):
    """Settings without roots (a library caller; the command line always sets them), but a
    relative path is refused all the same."""
    allowed, outside = layout
    settings = _settings(tmp_path)
    assert await resolve_source(str(outside / "sql"), settings) == outside / "sql"
    assert await resolve_source(str(allowed / "file-link"), settings) == allowed / "file-link"
    monkeypatch.chdir(allowed)
    for source in ("sql", "./sql", "~/sql"):
        err = await _refused(source, settings, "a relative path resolves from the server's working directory")
        assert "absolute path" in str(err)


def _hub_snapshot(adapter_dir: Path, root: Path) -> Path:
    """An adapter laid out as a Hugging Face cache snapshot: its files link into ``blobs/``."""
    snapshot, blobs = root / "snapshots" / "0123abc", root / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in ADAPTER_FILES:
        shutil.copy(adapter_dir / name, blobs / name)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / name)
    return snapshot


async def test_by_hand_paths_default_to_flags(assets, layout, adapter_dir, tmp_path):
    """Without --allowed-local-roots, local paths are confined to the model's directory, the
    --lora adapters' directories and the adapter cache; the flag still overrides."""
    allowed, outside = layout
    hub = _hub_snapshot(adapter_dir, tmp_path / "hf" / "models--org--sql")
    cache = tmp_path / "adapter-cache"
    shutil.copytree(adapter_dir, cache / "copied")
    argv = _argv(
        assets.model_dir, "--lora", f"mine={allowed / 'sql'}", "--lora", f"hub={hub}", "--adapter-cache-dir", str(cache)
    )
    cfg = cli.config_from_args(cli.build_parser().parse_args(argv), env={})
    roots = cfg.server.allowed_local_roots
    for directory in (assets.model_dir, allowed / "sql", hub, cache, hub.parent.parent / "blobs"):
        assert str(directory) in roots, (directory, roots)
    assert not [r for r in cli.check(cfg)[1] if "allowed local roots" in r], "the flags' own paths start"
    settings = SourceSettings(cache_dir=cache, env={}).with_config(cfg.server)
    for inside in (allowed / "sql", hub, cache / "copied"):
        assert await resolve_source(str(inside), settings) == Path(os.path.realpath(inside))
    for source in (str(outside / "sql"), str(allowed / "dir-link"), str(allowed / "inner-link"), "/etc"):
        await _refused(source, settings, "outside the allowed local roots", "--allowed-local-roots")
    await _refused("sql", settings, "relative path")
    # Given, the flag is the whole list.
    given = cli.config_from_args(cli.build_parser().parse_args([*argv, "--allowed-local-roots", str(allowed)]), env={})
    assert given.server.allowed_local_roots == (str(allowed),)


async def test_pvc_sources_stay_in_claim(adapter_dir, tmp_path):
    """PVC sources stay in their claim links included."""
    claim = tmp_path / "pvc" / "adapters"
    shutil.copytree(adapter_dir, claim / "sql")
    (claim / "linked").mkdir()
    shutil.copy(adapter_dir / "adapter_config.json", claim / "linked")
    (claim / "linked" / "adapter_model.safetensors").symlink_to(adapter_dir / "adapter_model.safetensors")
    settings = _settings(tmp_path)
    assert await resolve_source("pvc://adapters/sql", settings) == (claim / "sql").resolve()
    err = await _refused("pvc://adapters/linked", settings, "adapter_model.safetensors is a link", "<pvc root>/adapters")
    assert str(tmp_path) not in str(err), "the pod's mount path is not shown"
    await _refused("pvc://adapters/../../etc", settings, "leaves the claim's mount", "'..'")
    await _refused("pvc://adapters//etc/shadow", settings, "leaves the claim's mount", "absolute path")


def _argv(model: Path, *extra: str) -> list[str]:
    return ["--model", str(model), "--device", "cpu", *extra]


def test_start_up_refuses_outside_roots(assets, layout, adapter_dir):
    """Start up refuses a model or adapter outside the roots."""
    allowed, outside = layout
    parser = cli.build_parser()
    # The model's directory is outside the roots, and so are two of three adapters.
    argv = _argv(
        assets.model_dir,
        "--allowed-local-roots",
        str(allowed),
        "--lora",
        f"ok={allowed / 'sql'}",
        "--lora",
        f"far={outside / 'sql'}",
        "--lora",
        f"linked={allowed / 'file-link'}",
    )
    cfg = cli.config_from_args(parser.parse_args(argv), env={})
    assert cfg.server.allowed_local_roots == (str(allowed),)
    _, reasons, _ = cli.check(cfg)
    text = "\n".join(reasons)
    assert f"--model {assets.model_dir}: the directory resolves outside the allowed local roots ({allowed}" in text
    assert f"--lora far={outside / 'sql'} (lora_path)" in text
    assert f"--lora linked={allowed / 'file-link'} (lora_path): adapter_model.safetensors is a link" in text
    assert "--lora ok=" not in text
    # With the model's directory among the roots, only the adapters are left.
    roots = ["--allowed-local-roots", str(allowed), str(assets.model_dir)]
    cfg = cli.config_from_args(parser.parse_args(_argv(assets.model_dir, *roots)), env={})
    assert not [r for r in cli.check(cfg)[1] if "allowed local roots" in r]
    with pytest.raises(cli.ConfigError, match="absolute"):
        cli.config_from_args(parser.parse_args(_argv(assets.model_dir, "--allowed-local-roots", "rel")), env={})
    # Hosts: repeated or comma-separated.
    args = parser.parse_args(_argv(assets.model_dir, "--remote-source-hosts", "a.example", "b.example,*.c.example"))
    assert cli.config_from_args(args, env={}).server.remote_source_hosts == ("a.example", "b.example", "*.c.example")


@pytest.mark.slow
async def test_by_hand_runtime_loads_from_flags(assets, layout, tmp_path):
    """The real process, no --allowed-local-roots: an admin load from the --lora adapter's
    directory works, one from elsewhere is a 400 naming the flag, a relative one too."""
    allowed, outside = layout
    port, token, log = free_port(), "by-hand-token-0123456789", tmp_path / "log"
    (tmp_path / "token").write_text(token)
    argv = _argv(
        assets.model_dir,
        *("--host", "127.0.0.1", "--port", str(port), "--max-lora-rank", "16", "--max-total-tokens", "4096"),
        *("--lora", f"mine={allowed / 'sql'}", "--admin-token-file", str(tmp_path / "token")),
        *("--adapter-cache-dir", str(tmp_path / "cache")),
    )
    url = f"http://127.0.0.1:{port}"
    with runtime_process(argv, log) as proc:
        await wait_ready(url, proc, log)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
            for path, want, words in (
                (str(outside / "sql"), 400, "outside the allowed local roots"),
                ("sql", 400, "relative path"),
                (str(allowed / "sql"), 200, ""),
            ):
                body = {"lora_name": "again", "lora_path": path}
                async with session.post(url + "/v1/load_lora_adapter", json=body) as resp:
                    answer = await resp.json()
                assert resp.status == want, answer
                if want == 400:
                    assert answer["error"]["param"] == "lora_path" and words in answer["error"]["message"], answer
                    assert "--allowed-local-roots" in answer["error"]["message"], answer
    assert "--allowed-local-roots not given: local adapter paths must lie in" in log.read_text()


async def test_admin_refuses_outside_roots(assets, layout, tmp_path):
    """Admin API and catalog refuse paths outside the roots."""
    allowed, outside = layout
    config = make_config(assets, adapters={})
    config.server.allowed_local_roots = (str(allowed),)
    config.lora.catalog = str(tmp_path / "catalog.json")
    (tmp_path / "catalog.json").write_text(encode_catalog([]))
    async with running_server(config, tmp_path / "srv") as srv:
        for path, words in (
            (str(outside / "sql"), "outside the allowed local roots"),
            (str(allowed / "file-link"), "adapter_model.safetensors is a link"),
            ("/etc", "outside the allowed local roots"),
        ):
            status, body = await srv.post(
                "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path}, headers=srv.admin_headers()
            )
            assert status == 400, body
            assert body["error"]["param"] == "lora_path" and body["error"]["code"] == "invalid_source"
            assert words in body["error"]["message"] and str(allowed) in body["error"]["message"]
        assert srv.engine.adapter_names == frozenset()
        status, body = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "inside", "lora_path": str(allowed / "sql")},
            headers=srv.admin_headers(),
        )
        assert status == 200, body
        # The catalog path: an entry outside the roots fails on its first request, naming the field.
        catalog = {
            "adapters": [
                CatalogEntry("far", str(outside / "sql")).to_dict(),
                CatalogEntry("near", str(allowed / "sql")).to_dict(),
            ]
        }
        async with srv.session.put(
            srv.url + "/v1/lora_catalog", json=catalog, headers=srv.admin_headers()
        ) as resp:
            assert resp.status == 200, await resp.text()
        for name, want in (("far", 400), ("near", 200)):
            status, body = await srv.post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2})
            assert status == want, body
        status, body = await srv.post("/v1/completions", {"model": "far", "prompt": "hi", "max_tokens": 2})
        assert body["error"]["param"] == "lora_path" and "outside the allowed local roots" in body["error"]["message"]


# --------------------------------------------------------------------------- remote hosts


def test_host_allow_list_matching():
    subject = "lora_path 'x'"
    for url, allowed in (
        ("https://models.example.com/a.tgz", ("models.example.com",)),
        ("https://MODELS.example.com./a.tgz", ("models.example.com",)),
        ("https://eu.s3.example.com/b/k", ("*.s3.example.com",)),
        ("https://127.0.0.1:8443/x", ()),  # no list: any host
    ):
        check_remote_host(url, allowed, subject=subject)
    for url, allowed in (
        ("https://127.0.0.1/x", ("models.example.com",)),
        ("https://localhost/x", ("models.example.com",)),
        ("https://s3.example.com/k", ("*.s3.example.com",)),  # the wildcard is for subdomains only
        ("https://evil-s3.example.com/k", ("*.s3.example.com",)),
        ("https://models.example.com.evil.net/x", ("models.example.com",)),
    ):
        with pytest.raises(SourceError) as info:
            check_remote_host(url, allowed, subject=subject)
        assert info.value.field == "lora_path" and ", ".join(allowed) in str(info.value)
        assert "--remote-source-hosts" in str(info.value) and "spec.runtime.remoteSourceHosts" in str(info.value)


class _Files:
    def __init__(self, adapter_dir: Path) -> None:
        self.files = {f"/dir/{n}": (adapter_dir / n).read_bytes() for n in ADAPTER_FILES}
        self.hits: list[str] = []
        self.redirect_to = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(f"{request.host} {request.path}")
        if request.path.startswith("/hop/"):
            raise web.HTTPFound(self.redirect_to + "/dir/" + request.path.rsplit("/", 1)[1])
        body = self.files.get(request.path)
        return web.Response(body=body) if body is not None else web.Response(status=404)


async def test_remote_sources_allowed_hosts(adapter_dir, tmp_path, tls):
    """Remote sources reach only the allowed hosts redirects included."""
    server_ctx, ca_file = tls
    files = _Files(adapter_dir)
    app = web.Application()
    app.router.add_get("/{tail:.*}", files.handle)
    server = TestServer(app, scheme="https", host="127.0.0.1")
    await server.start_server(ssl=server_ctx)
    port = server.port
    files.redirect_to = f"https://127.0.0.1:{port}"
    try:

        def settings(*hosts: str, name: str) -> SourceSettings:
            return _settings(tmp_path / name, ca_file=ca_file, remote_hosts=hosts)

        # Loopback is refused when the list names other hosts, before anything is fetched.
        err = await _refused(
            f"https://127.0.0.1:{port}/dir", settings("models.example.com", name="a"), "'127.0.0.1'", "models.example.com"
        )
        assert "spec.runtime.remoteSourceHosts" in str(err) and files.hits == []
        # Listed: fetched.
        got = await resolve_source(f"https://127.0.0.1:{port}/dir", settings("127.0.0.1", name="b"))
        assert adapter_digest(got) == adapter_digest(adapter_dir)
        # A listed host that redirects to an unlisted one: refused at the redirect.
        files.hits.clear()
        await _refused(f"https://localhost:{port}/hop", settings("localhost", name="c"), "'127.0.0.1'", "localhost")
        assert files.hits == [f"localhost:{port} /hop/adapter_config.json"], files.hits
        # Both listed: the redirect is followed.
        got = await resolve_source(f"https://localhost:{port}/hop", settings("localhost", "127.0.0.1", name="d"))
        assert adapter_digest(got) == adapter_digest(adapter_dir)
        # s3:// and hf:// are judged by the endpoint they reach.
        env = {"AWS_ENDPOINT_URL": "https://127.0.0.1:9", "HF_ENDPOINT": "https://127.0.0.1:9"}
        for source in ("s3://bucket/key", "hf://org/repo"):
            await _refused(
                source,
                SourceSettings(cache_dir=tmp_path / "e", env=env, remote_hosts=("example.com",)),
                "'127.0.0.1' is not an allowed remote source host",
            )
    finally:
        await server.close()


async def test_admin_refuses_unlisted_host(assets, tmp_path):
    """Admin API refuses a remote host outside the list."""
    config = make_config(assets, adapters={})
    config.server.remote_source_hosts = ("adapters.example.com", "*.hf.example.com")
    async with running_server(config, tmp_path) as srv:
        status, body = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "https://127.0.0.1:1/adapter.tar.gz"},
            headers=srv.admin_headers(),
        )
        assert status == 400, body
        assert body["error"]["param"] == "lora_path"
        assert "adapters.example.com, *.hf.example.com" in body["error"]["message"]
        await asyncio.sleep(0)
    assert not os.path.exists(tmp_path / "adapter-cache") or not any((tmp_path / "adapter-cache").iterdir())


# --------------------------------------------------------------------------- GET /v1/models root


def test_models_root_hides_layout():
    """Models root never shows the pods file layout."""
    from loraserve.runtime.server.adapter_supply import public_root

    assert public_root("sql", "/adapters/team/sql") == "sql"
    assert public_root("sql", "file:///adapters/team/sql") == "sql"
    assert public_root("sql", "pvc://adapters/team/sql") == "pvc://adapters/team/sql"
    assert public_root("med", "hf://Org/Repo/sub@0123abc") == "hf://Org/Repo/sub@0123abc"
    assert public_root("s", "s3://bucket/a/b.tgz") == "s3://bucket/a/b.tgz"
    # Credentials in the URL, a presigned query, a fragment: left out.
    shown = public_root("x", "https://user:secret@h.example:8443/a/b.tar.gz?X-Amz-Signature=abc#frag")
    assert shown == "https://h.example:8443/a/b.tar.gz"


async def test_check_source_without_fetching(layout, tmp_path):
    """What a catalog PUT can refuse at once: the same messages a load would give."""
    from loraserve.runtime.lora.sources import check_source

    allowed, outside = layout
    claim = tmp_path / "pvc" / "adapters"
    claim.mkdir(parents=True)
    (claim / "out").symlink_to(outside / "sql", target_is_directory=True)
    settings = _settings(tmp_path, allowed_roots=(str(allowed),))
    for fine in (
        str(allowed / "sql"),
        str(allowed / "not-yet-there"),  # left to the load
        "pvc://adapters/not-yet-there",
        "https://offline.invalid/a.tar.gz",  # does not resolve now: left to the load
        "hf://org/adapters@0123abc",  # a public host (not resolvable here either)
    ):
        await check_source(fine, settings)
    for source, words in (
        (str(outside / "sql"), "outside the allowed local roots"),
        (str(allowed / "dir-link"), "outside the allowed local roots"),
        (str(allowed / "file-link"), "adapter_model.safetensors is a link"),
        ("sql", "relative path"),
        ("pvc://adapters/out", "outside the allowed local roots (<pvc root>/adapters; --pvc-root)"),
        ("/adapters/x\x00y", "control character"),
        ("https://169.254.169.254/latest/a.tar.gz", "is a link-local address"),
        ("https://localhost/a.tar.gz", "'localhost' resolves to a loopback address"),
    ):
        with pytest.raises(SourceError) as info:
            await check_source(source, settings)
        assert info.value.field == "lora_path" and words in str(info.value), (source, str(info.value))
        assert str(tmp_path / "pvc") not in str(info.value)
    await check_source("https://localhost/a.tar.gz", _settings(tmp_path, allow_private=True))
    with pytest.raises(SourceError, match="not an allowed remote source host"):
        await check_source("https://localhost/a.tar.gz", _settings(tmp_path, remote_hosts=("a.example",)))
