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
tail; symlinks that lead out are refused). A plain path or ``file://`` source must be absolute.
With ``allowed_roots`` set (``--allowed-local-roots``; the operator passes the pod's model and
adapter volumes and the adapter cache; a runtime started by hand without the flag gets
:func:`default_local_roots`), it must resolve, symlinks followed, inside one of them, and so
must each adapter file in it; with none set (a library caller), local paths are not confined.
With ``remote_hosts`` set (``--remote-source-hosts``), https/s3/hf sources may only reach those
hosts (``*.example.com`` for subdomains), redirects included. Without it, they may not reach a
loopback, link-local, private, unspecified, multicast or reserved address unless
``allow_private`` (``--allow-private-source-hosts``): every address a host resolves to is
checked, and the connection goes to the checked address (``remote.GuardedConnector``).

Hung sources: connecting, and every read (the answer's headers included), fail after
``stall_timeout_s`` (``--source-stall-timeout``) with a transient error naming the public URL
and what it waited on; ``progress`` (a ``LoadProgress``) follows each phase.

The adapter cache may be shared by many processes and pods (a writable volume). A remote
source's directory is keyed by the source (and digest). One process downloads it while the
others wait on a lock file per key (as long as the download shows progress); the download
lands in a private temporary directory inside the cache, is verified and flushed, then
published with one atomic rename. A completed directory is never deleted, only read (and
verified); a crash or a bad checksum never leaves a partial adapter where the manager could
read it; a race with another writer is resolved by looking again, never reported as the
adapter's fault.

Errors never show a password, a query string or a server path (the cache, the pvc root):
sources are named by their public form (``remote.public_url``).

Digest (``sha256``): one canonical value per adapter whatever the transport, the SHA-256
of the ``sha256sum`` listing of the adapter's two files::

    cd ADAPTER_DIR && sha256sum adapter_config.json adapter_model.safetensors | sha256sum

i.e. over the text ``"<hex>  adapter_config.json\\n<hex>  adapter_model.safetensors\\n"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import tempfile
import unicodedata
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
    Heartbeat,
    Progress,
    SourceError,
    Transport,
    check_sha256,
    download_lock,
    fetch_to,
    fsync_dir,
    fsync_tree,
    internal_address,
    listing_digest,
    open_session,
    public_url,
    redact,
    remove_stale,
    safe_extract,
)
from ..remote import s3_endpoint as s3_endpoint
from ..remote import s3_request as s3_request
from ..remote import sigv4_sign as sigv4_sign

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
COMPLETE = ".complete"
"""Written into a downloaded adapter's directory before the rename that publishes it."""
STALE_DOWNLOAD_S = 3600.0
"""A download directory of the cache untouched this long belongs to a writer that died."""
RACE_RETRIES = 5
"""Looks at the cache after another writer changed it under this one, before giving up."""
LOCKS = ".locks"
"""The cache's folder of lock files, one per entry (kept: removing a lock file races)."""

STALL_HINT = "--source-stall-timeout"
"""The setting that bounds a stalled source, as a stall error names it."""

log = logging.getLogger("loraserve.sources")


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
    """Hosts remote sources may reach, ``*.example.com`` for subdomains (empty: any public host)."""
    allow_private: bool = False
    """Remote sources may reach loopback, link-local and private addresses (without
    ``remote_hosts``; a host list is its own guard)."""
    stall_timeout_s: float = 30.0
    """Connecting, and each read of a remote source, fail after this long without progress."""

    def with_config(self, server) -> SourceSettings:
        """These settings with the confinement and timeouts of a
        :class:`~loraserve.runtime.contract.config.ServerConfig` (``allowed_local_roots``,
        ``remote_source_hosts``, ``allow_private_sources``, ``source_stall_timeout_s``),
        which the config states once."""
        return dataclasses.replace(
            self,
            allowed_roots=tuple(server.allowed_local_roots),
            remote_hosts=tuple(server.remote_source_hosts),
            allow_private=bool(server.allow_private_sources),
            stall_timeout_s=float(server.source_stall_timeout_s),
        )

    def transport(self) -> Transport:
        """How remote sources are reached under these settings."""
        return Transport(
            ca_file=self.ca_file,
            connect_timeout_s=self.stall_timeout_s,
            stall_timeout_s=self.stall_timeout_s,
            total_timeout_s=self.timeout_s,
            refuse_private=not self.allow_private and not self.remote_hosts,
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
    def shown(self) -> str:
        """The source as anyone may see it (no credentials, no query string)."""
        return _shown(self.raw)

    @property
    def subject(self) -> str:
        """How messages name this source."""
        return f"lora_path {self.shown!r}"

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
    _check_characters(source)
    source = source.strip()
    if "://" not in source:
        return ParsedSource("file", source, path=source)
    scheme, rest = source.split("://", 1)
    scheme = scheme.lower()
    shown = _shown(source)
    if scheme == "file":
        if not rest.startswith("/"):
            raise SourceError(f"lora_path {shown!r}: file:// URIs need an absolute path (file:///dir)")
        path = urllib.parse.unquote(rest)
        _check_characters(path)  # a %00 decodes to a NUL
        return ParsedSource("file", source, path=path)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not claim or not path.strip("/"):
            raise SourceError(f"lora_path {shown!r}: use pvc://<claim>/<path inside the volume>")
        if problem := source_path_problem(f"pvc://{rest}"):
            raise SourceError(f"lora_path {problem}")
        return ParsedSource("pvc", source, path=path.strip("/"), bucket=claim)
    if scheme in ("https", "http"):
        if scheme == "http" and not allow_http:
            raise SourceError(f"lora_path {shown!r}: plain http is refused; use https://")
        parsed = urllib.parse.urlsplit(source)
        if not parsed.hostname:
            raise SourceError(f"lora_path {shown!r}: the URL has no host")
        return ParsedSource(scheme, source, path=parsed.path)
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not bucket or not key.strip("/"):
            raise SourceError(f"lora_path {shown!r}: use s3://<bucket>/<key or prefix>")
        if not S3_BUCKET_RE.fullmatch(bucket):
            raise SourceError(f"lora_path {shown!r}: {bucket!r} is not a valid S3 bucket name")
        _check_relative(key, source)
        return ParsedSource("s3", source, path=key.strip("/"), bucket=bucket)
    if scheme == "hf":
        repo_part, _, revision = rest.partition("@")
        parts = [p for p in repo_part.split("/") if p]
        if len(parts) < 2:
            raise SourceError(f"lora_path {shown!r}: use hf://<org>/<repo>[/<subfolder>][@<revision>]")
        if "@" in rest and not revision:
            raise SourceError(f"lora_path {shown!r}: empty revision after '@'")
        sub = "/".join(parts[2:])
        _check_relative(sub, source)
        return ParsedSource("hf", source, path=sub, bucket="/".join(parts[:2]), revision=revision or "main")
    raise SourceError(
        f"lora_path {shown!r}: unsupported scheme {scheme!r}; use a path, file://, pvc://, https://, s3:// or hf://"
    )


def _check_relative(path: str, source: str) -> None:
    if any(part == ".." for part in path.split("/")):
        raise SourceError(f"lora_path {_shown(source)!r}: '..' is not allowed in the path")


def _check_characters(source: str) -> None:
    """Refuse control characters (NUL, newlines, escapes): a source is one line of text, and
    a NUL cannot be part of a path. The message does not echo the source (it may be a URL
    with credentials, and the character would garble a log)."""
    for index, char in enumerate(source):
        if unicodedata.category(char) == "Cc":
            raise SourceError(
                f"lora_path holds a control character (U+{ord(char):04X}) at position {index}; "
                "fix: give the path or URL as one line of printable characters"
            )


def _shown(source: str) -> str:
    """A source as anyone may see it: a URL without credentials or query string; a path as given."""
    return public_url(source) if "://" in source else source


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


def _check_adapter_dir(directory: Path, subject: str) -> None:
    missing = [n for n in ADAPTER_FILES if not (directory / n).is_file()]
    if missing:
        raise SourceError(f"{subject}: the adapter has no {', '.join(missing)}")


async def resolve_source(
    source: str,
    settings: SourceSettings,
    *,
    sha256: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Return a local directory holding the adapter named by ``source``, verified.

    Raises :class:`SourceError`, whose message shows no credential, query string or server
    path. Local sources are used in place; remote ones land in the cache atomically (see the
    module docstring). ``progress`` (a ``LoadProgress``) follows the phases: ``connecting``
    and ``downloading`` (a public URL), ``waiting`` (on another process's download of the
    same source), ``verifying``.
    """
    sha256 = check_sha256(sha256)
    allow_http = settings.env.get("LORASERVE_ALLOW_HTTP_SOURCES", "") == "1"
    parsed = parse_source(source, allow_http=allow_http)
    try:
        if parsed.scheme in ("file", "pvc"):
            return await _resolve_local(parsed, settings, sha256, progress)
        return await _resolve_remote(parsed, settings, sha256, progress)
    except SourceError as exc:
        raise _redacted(exc, parsed, settings) from exc.__cause__


async def check_source(source: str, settings: SourceSettings) -> None:
    """Refuse, as :func:`resolve_source` would, what can be judged without fetching (a catalog
    PUT's check): the syntax and control characters, a relative path or one outside the
    allowed roots (symlinks followed; absent paths are left to the load), a pvc:// path out
    of its claim, a host outside ``remote_hosts``, a host that resolves to an internal
    address now. Raises :class:`SourceError` with the same message the load would give.

    The load checks again at connect time: a host whose DNS answer changes later is refused
    then. A name that does not resolve now is left to the load (it may be transient).
    """
    parsed = parse_source(source, allow_http=settings.env.get("LORASERVE_ALLOW_HTTP_SOURCES", "") == "1")
    try:
        if parsed.scheme == "file":
            if not os.path.isabs(parsed.path) or settings.allowed_roots:
                await _resolve_local_checks(parsed, settings)
        elif parsed.scheme == "pvc":
            root = _claim_root(parsed, settings)
            if os.path.lexists(root / parsed.path):
                confine(root / parsed.path, [root], subject=parsed.subject, flag="--pvc-root")
        else:
            await _check_remote_hosts(parsed, settings)
    except SourceError as exc:
        raise _redacted(exc, parsed, settings) from None


async def _resolve_local_checks(parsed: ParsedSource, settings: SourceSettings) -> None:
    """The confinement of a plain path, on what exists of it."""
    if not os.path.isabs(parsed.path):
        if settings.allowed_roots:
            confine(parsed.path, settings.allowed_roots, subject=parsed.subject, files=())
        raise SourceError(
            f"{parsed.subject}: a relative path resolves from the server's working directory; give an absolute path"
        )
    files = ADAPTER_FILES if os.path.isdir(parsed.path) else ()
    confine(parsed.path, settings.allowed_roots, subject=parsed.subject, files=files)


async def _check_remote_hosts(parsed: ParsedSource, settings: SourceSettings) -> None:
    """Host list, then (with the address guard on) the addresses each host resolves to now."""
    hosts = []
    for _, fetch in _fetches(parsed, settings.env):
        check_remote_host(fetch.url, settings.remote_hosts, subject=parsed.subject)
        url = yarl.URL(fetch.url)
        hosts.append((url.host or "", url.port or 443))
    if not settings.transport().refuse_private:
        return
    loop = asyncio.get_running_loop()
    for host, port in dict.fromkeys(hosts):
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port), settings.stall_timeout_s)
        except (OSError, TimeoutError):
            continue  # left to the load, which names the failure
        for info in infos:
            if problem := internal_address(parsed.subject, host, str(info[4][0])):
                raise problem


def _redacted(exc: SourceError, parsed: ParsedSource, settings: SourceSettings) -> SourceError:
    """``exc`` with the source's secrets and this server's cache and pvc paths taken out,
    whatever part of the code (or a library's message) put them there."""
    message = str(exc)
    if parsed.is_remote:
        message = redact(message.replace(parsed.raw, parsed.shown), parsed.raw)
    for path, label in ((settings.cache_dir, "<adapter cache>"), (settings.pvc_root, "<pvc root>")):
        for form in {str(path).rstrip("/"), os.path.realpath(path)}:
            if form and form != "/":
                message = message.replace(form, label)
    if message == str(exc):
        return exc
    return SourceError(message, field=exc.field, transient=exc.transient, status=exc.status)


async def _resolve_local(
    parsed: ParsedSource, settings: SourceSettings, sha256: str | None, progress: Progress | None
) -> Path:
    """A plain path, file:// or pvc:// source, confined and verified in place."""
    subject = parsed.subject
    if parsed.scheme == "file":
        if not os.path.isabs(parsed.path):
            if settings.allowed_roots:  # confine names the roots in its refusal
                confine(parsed.path, settings.allowed_roots, subject=subject, files=())
            raise SourceError(
                f"{subject}: a relative path resolves from the server's working directory; give an absolute path"
            )
        if settings.allowed_roots:
            # Before anything is looked up: a refusal says nothing about paths outside.
            confine(parsed.path, settings.allowed_roots, subject=subject, files=())
    directory = _local_dir(parsed, settings)
    if parsed.scheme == "pvc":
        confine(directory, [_claim_root(parsed, settings)], subject=subject, flag="--pvc-root")
    elif settings.allowed_roots:
        directory = confine(directory, settings.allowed_roots, subject=subject)
    _check_adapter_dir(directory, subject)
    if sha256 is not None and progress is not None:
        progress.enter("verifying", parsed.shown)
    await asyncio.to_thread(verify_digest, directory, sha256)
    return directory


class _Raced(Exception):
    """Another writer changed the cache entry under this one: look again."""


async def _resolve_remote(
    parsed: ParsedSource, settings: SourceSettings, sha256: str | None, progress: Progress | None
) -> Path:
    """A remote source from the (possibly shared) cache, downloaded once across processes."""
    subject = parsed.subject
    for _, fetch in _fetches(parsed, settings.env):
        check_remote_host(fetch.url, settings.remote_hosts, subject=subject)
    key = cache_key(parsed.raw, sha256)
    cache = Path(settings.cache_dir)
    final = cache / key
    for _ in range(RACE_RETRIES):
        try:
            if await _cached(final, sha256, subject, progress):
                return final
            (cache / LOCKS).mkdir(parents=True, exist_ok=True)
            async with download_lock(
                cache / LOCKS / key,
                # The holder's own timeouts end a silent download well within this.
                silent_after_s=2 * settings.stall_timeout_s + 5,
                subject=subject,
                what=f"another process's download of {parsed.shown}",
                progress=progress,
            ) as heartbeat:
                if await _cached(final, sha256, subject, heartbeat):
                    return final
                await asyncio.to_thread(_set_aside, final, cache, key)
                for leftovers in (".download-*", ".trash-*"):
                    await asyncio.to_thread(remove_stale, cache, leftovers, STALE_DOWNLOAD_S)
                return await _download_and_publish(parsed, settings, sha256, final, key, heartbeat)
        except _Raced:
            continue
        except FileNotFoundError:  # a directory vanished under this process: another writer
            continue
    raise SourceError(
        f"{subject}: the adapter cache kept changing under this load (other processes writing the same "
        "entry); retry",
        transient=True,
    )


def cache_key(source: str, sha256: str | None) -> str:
    """The name of a remote source's entry in the adapter cache (and of its lock file in
    ``.locks``): one per source and expected digest."""
    return hashlib.sha256(f"{source.strip()}\0{sha256 or ''}".encode()).hexdigest()[:24]


async def _cached(final: Path, sha256: str | None, subject: str, progress: Progress | None) -> bool:
    """Whether ``final`` holds this source's completed, intact adapter (verified)."""
    if not (final / COMPLETE).is_file():
        return False
    if sha256 is not None and progress is not None:
        progress.enter("verifying", subject.removeprefix("lora_path "))
    try:
        _check_adapter_dir(final, subject)
        await asyncio.to_thread(verify_digest, final, sha256)
    except SourceError as exc:
        log.warning("%s: the cached copy is not intact (%s); it is fetched again", subject, exc)
        return False
    return True


def _set_aside(final: Path, cache: Path, key: str) -> None:
    """Remove what lies at ``final`` without being a completed, intact adapter (a copy
    damaged on disk, a leftover of an older layout). Called under the entry's lock only;
    renamed away first, so no reader ever sees a half-deleted directory."""
    if not os.path.lexists(final):
        return
    trash = Path(tempfile.mkdtemp(prefix=f".trash-{key}-", dir=cache))
    try:
        os.rename(final, trash / "old")
    except FileNotFoundError:
        pass
    finally:
        shutil.rmtree(trash, ignore_errors=True)


async def _download_and_publish(
    parsed: ParsedSource, settings: SourceSettings, sha256: str | None, final: Path, key: str, progress: Heartbeat
) -> Path:
    """Download into a private directory of the cache, verify, flush, then publish with one
    atomic rename. A rename that another writer beat is resolved by looking again."""
    tmp = Path(tempfile.mkdtemp(prefix=f".download-{key}-", dir=final.parent))
    try:
        adapter_dir = await _download(parsed, tmp, settings, progress)
        _check_adapter_dir(adapter_dir, parsed.subject)
        if sha256 is not None:
            progress.enter("verifying", parsed.shown)
        await progress.during(verify_digest, adapter_dir, sha256)
        (adapter_dir / COMPLETE).write_text(parsed.shown + "\n")
        await progress.during(fsync_tree, adapter_dir)
        try:
            os.rename(adapter_dir, final)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise _Raced from exc  # another writer published first (or moved a leftover)
            raise SourceError(
                f"{parsed.subject}: the adapter cache cannot be written ({exc.strerror}); check its volume",
                transient=True,
            ) from exc
        fsync_dir(final.parent)
        return final
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise SourceError(
            f"{parsed.subject}: the adapter cache cannot be written ({exc.strerror or exc}); check its volume",
            transient=True,
        ) from exc
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
            f"inside the allowed local roots ({shown}; {flag})"
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
    """The directory a local source names; messages name the source, not the pod's mounts."""
    if parsed.scheme == "file":
        directory = Path(parsed.path)
        if not directory.is_dir():
            raise SourceError(f"{parsed.subject}: directory {parsed.path!r} does not exist")
        return directory
    root = _claim_root(parsed, settings)
    directory = (root / parsed.path).resolve()
    if root != directory and root not in directory.parents:
        raise SourceError(f"{parsed.subject} points outside the volume's mount")
    if not root.is_dir():
        raise SourceError(
            f"{parsed.subject}: volume {parsed.bucket!r} is not mounted on this server; mount the claim "
            "under the pvc root (--pvc-root)"
        )
    if not directory.is_dir():
        raise SourceError(f"{parsed.subject}: {parsed.path!r} does not exist in volume {parsed.bucket!r}")
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


async def _download(parsed: ParsedSource, tmp: Path, settings: SourceSettings, progress: Progress | None) -> Path:
    """Fetch a remote source into ``tmp``; return the directory holding the adapter files."""
    files_dir = tmp / "files"
    files_dir.mkdir()
    subject = parsed.subject
    session = open_session(
        settings.transport(), subject=subject, trace_configs=_host_guard(settings.remote_hosts, subject)
    )
    async with session:
        for name, fetch in _fetches(parsed, settings.env):
            await fetch_to(
                session,
                fetch.url,
                fetch.headers,
                files_dir / name,
                subject=subject,
                max_bytes=settings.max_bytes,
                progress=progress,
                stall_hint=STALL_HINT,
            )
    if (files_dir / "archive").is_file():
        extracted = tmp / "extracted"
        await asyncio.to_thread(
            safe_extract, files_dir / "archive", extracted, subject=subject, max_bytes=settings.max_bytes
        )
        return _find_adapter_dir(extracted, subject)
    return files_dir


def _find_adapter_dir(root: Path, subject: str) -> Path:
    found = sorted({p.parent for p in root.rglob(ADAPTER_FILES[0])})
    if not found:
        raise SourceError(f"{subject}: the archive holds no {ADAPTER_FILES[0]}")
    if len(found) > 1:
        rels = ", ".join(str(p.relative_to(root)) for p in found)
        raise SourceError(f"{subject}: the archive holds several adapters ({rels}); pack one")
    return found[0]


def resolve_source_sync(source: str, settings: SourceSettings, *, sha256: str | None = None) -> Path:
    """:func:`resolve_source` for callers outside an event loop (start-up)."""
    with contextlib.closing(asyncio.new_event_loop()) as loop:
        return loop.run_until_complete(resolve_source(source, settings, sha256=sha256))


def default_local_roots(config) -> tuple[str, ...]:
    """Where local adapter paths may lie when ``--allowed-local-roots`` is not given (a runtime
    started by hand): the model's directory, the draft model's, each ``--lora`` adapter's
    directory, and the adapter cache; each also as its real path, and the real directories of
    the adapter files (a Hugging Face cache snapshot links its files into ``blobs/``)."""
    model, spec = config.model, config.speculative
    dirs = [model.path]
    if spec.enabled and spec.draft_model_path:
        dirs.append(spec.draft_model_path)
    dirs += [*config.lora.adapters.values(), config.server.adapter_cache_dir]
    roots: list[str] = []
    for directory in dirs:
        roots += [os.path.abspath(directory), os.path.realpath(directory)]
    for directory in config.lora.adapters.values():
        roots += [os.path.dirname(os.path.realpath(os.path.join(directory, name))) for name in ADAPTER_FILES]
    return tuple(dict.fromkeys(roots))
