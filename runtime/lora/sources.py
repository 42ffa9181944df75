"""Adapter sources: resolve a ``lora_path`` into a local directory the LoRA manager reads.

Accepted sources:

- a plain path or ``file:///abs/path``: used in place;
- ``pvc://<claim>/<path>``: ``<pvc_root>/<claim>/<path>``, where the serving pod mounts
  each claim under ``pvc_root`` (``--pvc-root``, default ``/mnt/pvc``);
- ``https://...``: an archive (``.tar``, ``.tar.gz``, ``.tgz``) holding the adapter, or a
  directory URL under which ``adapter_config.json`` and ``adapter_model.safetensors`` are
  fetched;
- ``s3://<bucket>/<key>``: the same two shapes, fetched over plain HTTP(S) from
  ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (default
  ``https://s3.<AWS_REGION>.amazonaws.com``, path-style), signed with AWS Signature V4 when
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``) are set,
  anonymous otherwise;
- ``hf://<org>/<repo>[/<subfolder>][@<revision>]``: the two files from
  ``$HF_ENDPOINT/<org>/<repo>/resolve/<revision>/...`` (default ``https://huggingface.co``,
  revision ``main``), with ``Authorization: Bearer $HF_TOKEN`` when set.

Confinement: a ``pvc://`` path stays inside its claim's mount (no ``..``, ``//`` or absolute
tail; symlinks that lead out are refused). With ``allowed_roots`` set (``--allowed-local-roots``;
the operator passes the pod's model and adapter volumes and the adapter cache), a plain path or
``file://`` source must be absolute and resolve, symlinks followed, inside one of them, and so
must each adapter file in it; without it, local paths are not confined (a process run by hand).
With ``remote_hosts`` set (``--remote-source-hosts``), https/s3/hf sources may only reach those
hosts (``*.example.com`` for subdomains), redirects included.

Remote sources are downloaded into a fresh temporary directory inside the adapter cache,
verified, then renamed into place, so a crash or a bad checksum never leaves a partial
adapter where the manager could read it. The cached directory is keyed by the source (and
digest), so loading the same source twice downloads once.

Digest (``sha256``): one canonical value per adapter whatever the transport, the SHA-256
of the ``sha256sum`` listing of the adapter's two files::

    cd ADAPTER_DIR && sha256sum adapter_config.json adapter_model.safetensors | sha256sum

i.e. over the text ``"<hex>  adapter_config.json\\n<hex>  adapter_model.safetensors\\n"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yarl

from ..contract.policy import host_allowed, source_path_problem
from ..remote import ARCHIVE_SUFFIXES as ARCHIVE_SUFFIXES
from ..remote import (
    S3_BUCKET_RE,
    SourceError,
    check_sha256,
    fetch_to,
    listing_digest,
    safe_extract,
    tls_connector,
)
from ..remote import s3_endpoint as s3_endpoint
from ..remote import s3_request as s3_request
from ..remote import sigv4_sign as sigv4_sign

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class SourceSettings:
    """Where adapters are cached and how remote sources are reached."""

    cache_dir: Path = Path("/tmp/loraserve-adapters")
    pvc_root: Path = Path("/mnt/pvc")
    max_bytes: int = 16 << 30  # a download larger than this is refused
    timeout_s: float = 600.0
    ca_file: str | None = None  # extra CA bundle for https sources (a private CA)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    allowed_roots: tuple[str, ...] = ()
    """Directories plain-path and file:// sources must resolve inside (empty: not confined)."""
    remote_hosts: tuple[str, ...] = ()
    """Hosts remote sources may reach, ``*.example.com`` for subdomains (empty: any)."""

    def with_config(self, server) -> SourceSettings:
        """These settings with the confinement of a :class:`~loraserve.runtime.contract.config.ServerConfig`
        (``allowed_local_roots``, ``remote_source_hosts``), which the config states once."""
        return dataclasses.replace(
            self,
            allowed_roots=tuple(server.allowed_local_roots),
            remote_hosts=tuple(server.remote_source_hosts),
        )


@dataclass(frozen=True)
class ParsedSource:
    """A source string, parsed: ``scheme`` is one of file, pvc, https, http, s3, hf."""

    scheme: str
    raw: str
    path: str = ""  # file/pvc: a path; s3: the key; hf: the subfolder
    bucket: str = ""  # s3 bucket / pvc claim / hf repo id
    revision: str = "main"

    @property
    def is_remote(self) -> bool:
        return self.scheme in ("https", "http", "s3", "hf")

    @property
    def is_archive(self) -> bool:
        tail = (self.path or self.raw).lower().split("?", 1)[0]
        return tail.endswith(ARCHIVE_SUFFIXES)


def parse_source(source: str, *, allow_http: bool = False) -> ParsedSource:
    """Parse ``lora_path``; raise :class:`SourceError` naming what is wrong and the fix."""
    if not isinstance(source, str) or not source.strip():
        raise SourceError(
            "lora_path must be a non-empty string (a path or a pvc://, https://, s3://, hf:// URI)"
        )
    source = source.strip()
    if "://" not in source:
        return ParsedSource("file", source, path=source)
    scheme, rest = source.split("://", 1)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/"):
            raise SourceError(f"lora_path {source!r}: file:// URIs need an absolute path (file:///dir)")
        return ParsedSource("file", source, path=urllib.parse.unquote(rest))
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not claim or not path.strip("/"):
            raise SourceError(f"lora_path {source!r}: use pvc://<claim>/<path inside the volume>")
        if problem := source_path_problem(f"pvc://{rest}"):
            raise SourceError(f"lora_path {problem}")
        return ParsedSource("pvc", source, path=path.strip("/"), bucket=claim)
    if scheme in ("https", "http"):
        if scheme == "http" and not allow_http:
            raise SourceError(f"lora_path {source!r}: plain http is refused; use https://")
        parsed = urllib.parse.urlsplit(source)
        if not parsed.hostname:
            raise SourceError(f"lora_path {source!r}: the URL has no host")
        return ParsedSource(scheme, source, path=parsed.path)
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not bucket or not key.strip("/"):
            raise SourceError(f"lora_path {source!r}: use s3://<bucket>/<key or prefix>")
        if not S3_BUCKET_RE.fullmatch(bucket):
            raise SourceError(f"lora_path {source!r}: {bucket!r} is not a valid S3 bucket name")
        _check_relative(key, source)
        return ParsedSource("s3", source, path=key.strip("/"), bucket=bucket)
    if scheme == "hf":
        repo_part, _, revision = rest.partition("@")
        parts = [p for p in repo_part.split("/") if p]
        if len(parts) < 2:
            raise SourceError(f"lora_path {source!r}: use hf://<org>/<repo>[/<subfolder>][@<revision>]")
        if "@" in rest and not revision:
            raise SourceError(f"lora_path {source!r}: empty revision after '@'")
        sub = "/".join(parts[2:])
        _check_relative(sub, source)
        return ParsedSource("hf", source, path=sub, bucket="/".join(parts[:2]), revision=revision or "main")
    raise SourceError(
        f"lora_path {source!r}: unsupported scheme {scheme!r}; use a path, file://, pvc://, https://, s3:// or hf://"
    )


def _check_relative(path: str, source: str) -> None:
    if any(part == ".." for part in path.split("/")):
        raise SourceError(f"lora_path {source!r}: '..' is not allowed in the path")


def adapter_digest(directory: str | Path) -> str:
    """The canonical digest of an adapter directory (see the module docstring)."""
    directory = Path(directory)
    for name in ADAPTER_FILES:
        if not (directory / name).is_file():
            raise SourceError(f"adapter directory {str(directory)!r} has no {name}")
    return listing_digest(directory, ADAPTER_FILES)


def verify_digest(directory: Path, expected: str | None) -> None:
    if expected is None:
        return
    actual = adapter_digest(directory)
    if actual != expected:
        raise SourceError(
            f"sha256 mismatch: the adapter's digest is {actual}, the request expects {expected}. "
            "Compute it with: sha256sum adapter_config.json adapter_model.safetensors | sha256sum",
            field="sha256",
        )


def _check_adapter_dir(directory: Path, source: str) -> None:
    missing = [n for n in ADAPTER_FILES if not (directory / n).is_file()]
    if missing:
        raise SourceError(f"lora_path {source!r}: {str(directory)!r} has no {', '.join(missing)}")


async def resolve_source(source: str, settings: SourceSettings, *, sha256: str | None = None) -> Path:
    """Return a local directory holding the adapter named by ``source``, verified.

    Raises :class:`SourceError`. Local sources are used in place; remote ones land in the
    cache atomically (see the module docstring).
    """
    sha256 = check_sha256(sha256)
    allow_http = settings.env.get("LORASERVE_ALLOW_HTTP_SOURCES", "") == "1"
    parsed = parse_source(source, allow_http=allow_http)
    if parsed.scheme in ("file", "pvc"):
        if parsed.scheme == "file" and settings.allowed_roots:
            # Before anything is looked up: a refusal says nothing about paths outside.
            confine(Path(parsed.path).expanduser(), settings.allowed_roots, subject=f"lora_path {source!r}", files=())
        directory = _local_dir(parsed, settings)
        if parsed.scheme == "pvc":
            confine(directory, [_claim_root(parsed, settings)], subject=f"lora_path {source!r}", flag="--pvc-root")
        elif settings.allowed_roots:
            directory = confine(directory, settings.allowed_roots, subject=f"lora_path {source!r}")
        _check_adapter_dir(directory, source)
        await asyncio.to_thread(verify_digest, directory, sha256)
        return directory
    for _, fetch in _fetches(parsed, settings.env):
        check_remote_host(fetch.url, settings.remote_hosts, subject=f"lora_path {source!r}")
    key = hashlib.sha256(f"{parsed.raw}\0{sha256 or ''}".encode()).hexdigest()[:24]
    final = Path(settings.cache_dir) / key
    if (final / ".complete").is_file():
        await asyncio.to_thread(verify_digest, final, sha256)
        return final
    Path(settings.cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=settings.cache_dir))
    try:
        adapter_dir = await _download(parsed, tmp, settings)
        _check_adapter_dir(adapter_dir, source)
        await asyncio.to_thread(verify_digest, adapter_dir, sha256)
        (adapter_dir / ".complete").write_text(source + "\n")
        if final.exists():  # a stale, incomplete leftover
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.replace(adapter_dir, final)
        except OSError:
            if not (final / ".complete").is_file():  # lost a race to nothing usable
                raise
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _claim_root(parsed: ParsedSource, settings: SourceSettings) -> Path:
    return (Path(settings.pvc_root) / parsed.bucket).resolve()


def _inside(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def confine(
    directory: str | Path,
    roots,
    *,
    subject: str,
    files: tuple[str, ...] = ADAPTER_FILES,
    flag: str = "--allowed-local-roots",
) -> Path:
    """The real path of ``directory`` (symlinks followed); :class:`SourceError` unless it,
    and each of ``files`` in it that exists, resolves inside one of ``roots``.

    A relative ``directory`` is refused (it would resolve from the working directory).
    """
    shown = ", ".join(str(r) for r in roots)
    if not os.path.isabs(str(directory)):
        raise SourceError(
            f"{subject}: a relative path resolves from the working directory; give an absolute path "
            f"inside the allowed local roots ({shown})"
        )
    real_roots = [os.path.realpath(r) for r in roots]
    real = os.path.realpath(directory)
    if not _inside(real, real_roots):
        raise SourceError(
            f"{subject}: the directory resolves outside the allowed local roots ({shown}; {flag}); "
            "fix: put the adapter inside one of them"
        )
    for name in files:
        path = os.path.join(real, name)
        if os.path.lexists(path) and not _inside(os.path.realpath(path), real_roots):
            raise SourceError(
                f"{subject}: {name} is a link that resolves outside the allowed local roots ({shown}; {flag}); "
                "fix: copy the file there instead of linking to it"
            )
    return Path(real)


def check_remote_host(url: str | yarl.URL, allowed, *, subject: str) -> None:
    """:class:`SourceError` unless ``url``'s host is in ``allowed`` (empty: any host)."""
    if not allowed:
        return
    host = yarl.URL(str(url)).host or ""
    if not host_allowed(host, allowed):
        raise SourceError(
            f"{subject}: host {host!r} is not an allowed remote source host ({', '.join(allowed)}; "
            "--remote-source-hosts, spec.runtime.remoteSourceHosts); fix: use one of them or add the host there"
        )


def _host_guard(allowed, subject: str) -> list[aiohttp.TraceConfig]:
    """A trace that refuses a redirect to a host outside ``allowed`` before it is followed."""
    if not allowed:
        return []

    async def on_redirect(session, ctx, params: aiohttp.TraceRequestRedirectParams) -> None:
        location = params.response.headers.get("Location") or params.response.headers.get("URI")
        if location:
            check_remote_host(params.url.join(yarl.URL(location)), allowed, subject=subject)

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(on_redirect)
    return [trace]


def _local_dir(parsed: ParsedSource, settings: SourceSettings) -> Path:
    if parsed.scheme == "file":
        directory = Path(parsed.path).expanduser()
    else:
        root = _claim_root(parsed, settings)
        directory = (root / parsed.path).resolve()
        if root != directory and root not in directory.parents:
            raise SourceError(f"lora_path {parsed.raw!r} points outside the volume's mount")
        if not root.is_dir():
            raise SourceError(
                f"lora_path {parsed.raw!r}: volume {parsed.bucket!r} is not mounted at {str(root)!r}; "
                "mount the claim there or set --pvc-root"
            )
    if not directory.is_dir():
        raise SourceError(f"lora_path {parsed.raw!r}: directory {str(directory)!r} does not exist")
    return directory


# --- remote sources -------------------------------------------------------------------------


@dataclass
class _Fetch:
    url: str
    headers: dict[str, str]


def hf_request(repo: str, revision: str, filename: str, env: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """URL and headers for one file of a Hugging Face repository at a revision."""
    endpoint = (env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
    url = f"{endpoint}/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(filename)}"
    token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN")
    return url, ({"Authorization": f"Bearer {token}"} if token else {})


def _fetches(parsed: ParsedSource, env: Mapping[str, str]) -> list[tuple[str, _Fetch]]:
    """(local file name, request) pairs for a remote source."""
    if parsed.scheme in ("https", "http"):
        if parsed.is_archive:
            return [("archive", _Fetch(parsed.raw, {}))]
        base = parsed.raw.split("?", 1)[0].rstrip("/")
        return [(name, _Fetch(f"{base}/{name}", {})) for name in ADAPTER_FILES]
    if parsed.scheme == "s3":
        if parsed.is_archive:
            url, headers = s3_request(parsed.bucket, parsed.path, env)
            return [("archive", _Fetch(url, headers))]
        out = []
        for name in ADAPTER_FILES:
            url, headers = s3_request(parsed.bucket, f"{parsed.path}/{name}", env)
            out.append((name, _Fetch(url, headers)))
        return out
    if parsed.scheme == "hf":
        out = []
        for name in ADAPTER_FILES:
            filename = f"{parsed.path}/{name}" if parsed.path else name
            url, headers = hf_request(parsed.bucket, parsed.revision, filename, env)
            out.append((name, _Fetch(url, headers)))
        return out
    raise AssertionError(parsed.scheme)


async def _download(parsed: ParsedSource, tmp: Path, settings: SourceSettings) -> Path:
    """Fetch a remote source into ``tmp``; return the directory holding the adapter files."""
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s, sock_connect=30)
    files_dir = tmp / "files"
    files_dir.mkdir()
    connector = tls_connector(settings.ca_file)
    subject = f"lora_path {parsed.raw!r}"
    async with aiohttp.ClientSession(
        timeout=timeout,
        trust_env=True,
        connector=connector,
        trace_configs=_host_guard(settings.remote_hosts, subject),
    ) as session:
        for name, fetch in _fetches(parsed, settings.env):
            await fetch_to(
                session,
                fetch.url,
                fetch.headers,
                files_dir / name,
                subject=subject,
                max_bytes=settings.max_bytes,
            )
    if (files_dir / "archive").is_file():
        extracted = tmp / "extracted"
        await asyncio.to_thread(
            safe_extract, files_dir / "archive", extracted, subject=subject, max_bytes=settings.max_bytes
        )
        return _find_adapter_dir(extracted, parsed.raw)
    return files_dir


def _find_adapter_dir(root: Path, source: str) -> Path:
    found = sorted({p.parent for p in root.rglob(ADAPTER_FILES[0])})
    if not found:
        raise SourceError(f"lora_path {source!r}: the archive holds no {ADAPTER_FILES[0]}")
    if len(found) > 1:
        rels = ", ".join(str(p.relative_to(root)) for p in found)
        raise SourceError(f"lora_path {source!r}: the archive holds several adapters ({rels}); pack one")
    return found[0]


def resolve_source_sync(source: str, settings: SourceSettings, *, sha256: str | None = None) -> Path:
    """:func:`resolve_source` for callers outside an event loop (start-up)."""
    with contextlib.closing(asyncio.new_event_loop()) as loop:
        return loop.run_until_complete(resolve_source(source, settings, sha256=sha256))
