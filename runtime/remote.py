"""Remote transfers shared by adapter sources (``lora.sources``) and the model fetcher
(``fetch``): one HTTP session factory (:func:`open_session`: connect and per-read stall
timeouts, a private CA, and the guard that refuses loopback, link-local and private
addresses), S3 requests signed with AWS Signature V4, streaming downloads with a size
limit, safe tar extraction, ``sha256sum``-style directory digests and the durable,
atomic publication of a downloaded directory.

Nothing here imports torch, so the model fetcher's init container starts quickly. Every
error is a :class:`SourceError` whose message starts with the caller's ``subject`` (for
example ``lora_path 'https://...'``), so each caller keeps its own wording.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import shutil
import ssl
import tarfile
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import yarl

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
S3_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
CHUNK = 1 << 20

log = logging.getLogger("loraserve.remote")
_T = TypeVar("_T")


class SourceError(Exception):
    """A source could not be resolved or fetched.

    ``field`` is the request field at fault (``lora_path`` or ``sha256``). ``transient``
    is true for failures worth retrying (network errors, 5xx, throttling); false when the
    source itself is wrong (bad URL, missing file, checksum mismatch, 4xx). ``status`` is
    the HTTP status when a server answered with an error, so callers can tell an absent
    optional file (404) from a real failure.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str = "lora_path",
        transient: bool = False,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.transient = transient
        self.status = status


def is_archive_name(path: str) -> bool:
    """Whether a URL path or key names a tar archive (query strings are ignored)."""
    return path.lower().split("?", 1)[0].endswith(ARCHIVE_SUFFIXES)


# --- S3 ---------------------------------------------------------------------------------------


def s3_endpoint(env: Mapping[str, str]) -> str:
    """The S3 endpoint: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or AWS for the region."""
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        return endpoint.rstrip("/")
    return f"https://s3.{s3_region(env)}.amazonaws.com"


def s3_region(env: Mapping[str, str]) -> str:
    """``AWS_REGION``, else ``AWS_DEFAULT_REGION``, else ``us-east-1``."""
    return env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"


def s3_request(
    bucket: str,
    key: str,
    env: Mapping[str, str],
    *,
    query: Mapping[str, str] | None = None,
    now: _dt.datetime | None = None,
) -> tuple[str, dict[str, str]]:
    """URL and headers of a path-style GET, SigV4-signed when ``AWS_ACCESS_KEY_ID`` and
    ``AWS_SECRET_ACCESS_KEY`` are set (anonymous otherwise).

    ``key`` names one object; an empty ``key`` addresses the bucket itself (with ``query``,
    e.g. a ListObjectsV2 request). The URL comes back fully percent-encoded: send it as
    ``yarl.URL(url, encoded=True)`` so the bytes on the wire are the ones signed.
    """
    endpoint = s3_endpoint(env)
    if key:
        url = f"{endpoint}/{bucket}/{urllib.parse.quote(key, safe='/-_.~')}"
    else:
        url = f"{endpoint}/{bucket}"
    if query:
        url += "?" + "&".join(
            f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}"
            for k, v in sorted(query.items())
        )
    access, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        return url, {}
    headers = {"x-amz-content-sha256": "UNSIGNED-PAYLOAD"}
    if env.get("AWS_SESSION_TOKEN"):
        headers["x-amz-security-token"] = env["AWS_SESSION_TOKEN"]
    headers = sigv4_sign("GET", url, headers, access, secret, s3_region(env), "s3", now=now)
    return url, headers


def sigv4_sign(
    method: str,
    url: str,
    headers: Mapping[str, str],
    access_key: str,
    secret_key: str,
    region: str,
    service: str,
    *,
    payload_hash: str | None = None,
    now: _dt.datetime | None = None,
) -> dict[str, str]:
    """AWS Signature Version 4: return ``headers`` plus host, x-amz-date and Authorization.

    ``payload_hash`` defaults to the ``x-amz-content-sha256`` header. Query parameters are
    canonicalised (sorted, RFC 3986-encoded) as the specification requires.
    """
    now = now or _dt.datetime.now(_dt.UTC)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    date = now.strftime("%Y%m%d")
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc
    out = {k: v for k, v in headers.items()}
    out["host"] = host
    out["x-amz-date"] = amz_date
    if payload_hash is None:
        payload_hash = out.get("x-amz-content-sha256", hashlib.sha256(b"").hexdigest())
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    canonical_query = "&".join(
        f"{urllib.parse.quote(k, safe='-_.~')}={urllib.parse.quote(v, safe='-_.~')}" for k, v in sorted(query)
    )
    lowered = {k.lower().strip(): " ".join(str(v).split()) for k, v in out.items()}
    signed = sorted(lowered)
    canonical_headers = "".join(f"{k}:{lowered[k]}\n" for k in signed)
    signed_headers = ";".join(signed)
    canonical_request = "\n".join(
        [method, parts.path or "/", canonical_query, canonical_headers, signed_headers, payload_hash]
    )
    scope = f"{date}/{region}/{service}/aws4_request"
    to_sign = "\n".join(
        ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()]
    )
    key = f"AWS4{secret_key}".encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed_headers}, Signature={signature}"
    )
    return out


# --- HTTP transfers ---------------------------------------------------------------------------


class Progress(Protocol):
    """What a transfer reports as it goes (``lora.progress.LoadProgress`` fits)."""

    def enter(self, phase: str, target: str | None = None) -> None: ...

    def received(self, count: int) -> None: ...


def public_url(url: str | yarl.URL) -> str:
    """``url`` as anyone may see it: no user name or password, no query string (presigned
    credentials, tokens) and no fragment."""
    text = str(url)
    try:
        parsed = yarl.URL(text, encoded=isinstance(url, yarl.URL))
    except (ValueError, TypeError):
        parsed = None
    if parsed is None or not parsed.absolute:
        return text.split("?", 1)[0].split("#", 1)[0].rpartition("@")[2]
    return str(parsed.with_user(None).with_query(None).with_fragment(None))


def address_kind(address: str) -> str | None:
    """Why a remote source may not reach ``address`` (``loopback``, ``private``, ...), or
    None for a public unicast address. IPv4-mapped and 6to4 IPv6 forms are judged by the
    IPv4 address they carry."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a zone id (fe80::1%eth0) dropped
    except ValueError:
        return "unparseable"
    if isinstance(ip, ipaddress.IPv6Address):
        ip = ip.ipv4_mapped or ip.sixtofour or ip
    for kind, hit in (
        ("loopback", ip.is_loopback),
        ("unspecified", ip.is_unspecified),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
    ):
        if hit:
            return kind
    return None if ip.is_global else "non-public"


PRIVATE_FIX = (
    "fix: pass --allow-private-source-hosts to let remote sources reach internal hosts, or name the "
    "hosts remote sources may reach with --remote-source-hosts (spec.runtime.remoteSourceHosts)"
)


def internal_address(subject: str, host: str, address: str) -> SourceError | None:
    """The refusal of ``host`` for resolving to ``address`` when that address is internal
    (loopback, private, ...), else None. The address itself is not shown: a caller must not
    learn the internal network's layout from the message."""
    kind = address_kind(address)
    if kind is None:
        return None
    where = "is" if host.strip("[]").lower() == address.lower() else "resolves to"
    return SourceError(
        f"{subject}: host {host!r} {where} a {kind} address, which remote sources may not reach unless "
        f"allowed; {PRIVATE_FIX}"
    )


class GuardedConnector(aiohttp.TCPConnector):
    """A connector that connects only to the addresses it has checked.

    Every connection (the first request, each redirect, an IP literal or a resolved name,
    cached or not) goes through ``_resolve_host``; the addresses it returns are checked
    here and are the ones the socket connects to, so a DNS answer that changes between a
    check and the connection (rebinding) cannot swap in an internal address. Proxies named
    by the environment (HTTPS_PROXY: the operator's own) are exempt; a request sent through
    one is resolved and connected by the proxy, whose own policy then applies (hosts in
    NO_PROXY, the usual place for internal ones, are connected directly and checked here).
    """

    def __init__(self, *, subject: str, exempt_hosts: frozenset[str] = frozenset(), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._subject = subject
        self._exempt = exempt_hosts

    async def _resolve_host(self, host: str, port: int, traces: Any = None) -> list[Any]:
        results = await super()._resolve_host(host, port, traces=traces)
        name = host.rstrip(".").lower()
        if name in self._exempt:
            return results
        for result in results:
            if problem := internal_address(self._subject, name, str(result["host"])):
                raise problem
        return results


def _proxy_hosts() -> frozenset[str]:
    """Host names of the proxies the environment names (HTTPS_PROXY and the like)."""
    hosts = set()
    for url in urllib.request.getproxies().values():
        with contextlib.suppress(ValueError):
            if host := urllib.parse.urlsplit(url).hostname:
                hosts.add(host.rstrip(".").lower())
    return frozenset(hosts)


@dataclass(frozen=True)
class Transport:
    """How remote sources are reached; one definition for adapter sources and the fetcher."""

    ca_file: str | None = None
    """A CA bundle to trust for https (a private CA); None: the system's store."""
    connect_timeout_s: float = 30.0
    """Connecting (TCP and TLS) fails after this long."""
    stall_timeout_s: float = 30.0
    """A read fails after this long without a byte (the answer's headers included)."""
    total_timeout_s: float | None = None
    """One request's whole transfer; None: unbounded (the stall timeout still holds)."""
    refuse_private: bool = False
    """Refuse loopback, link-local, private, unspecified, multicast and reserved addresses."""


def tls_context(ca_file: str | None) -> ssl.SSLContext | bool:
    """An SSL context trusting ``ca_file`` (a private CA), or True for the default trust store."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


def open_session(transport: Transport, *, subject: str, trace_configs: list | None = None) -> aiohttp.ClientSession:
    """An HTTP session with ``transport``'s timeouts, CA and address guard; proxies from
    the environment (HTTPS_PROXY, NO_PROXY)."""
    timeout = aiohttp.ClientTimeout(
        total=transport.total_timeout_s,
        sock_connect=transport.connect_timeout_s,
        sock_read=transport.stall_timeout_s,
    )
    ssl_arg = tls_context(transport.ca_file)
    if transport.refuse_private:
        connector: aiohttp.TCPConnector = GuardedConnector(subject=subject, exempt_hosts=_proxy_hosts(), ssl=ssl_arg)
    else:
        connector = aiohttp.TCPConnector(ssl=ssl_arg)
    return aiohttp.ClientSession(
        timeout=timeout, trust_env=True, connector=connector, trace_configs=trace_configs or None
    )


async def _raise_for_status(resp: aiohttp.ClientResponse, shown: str, subject: str) -> None:
    if resp.status == 200:
        return
    body = (await resp.content.read(512)).decode("utf-8", "replace").strip()
    transient = resp.status >= 500 or resp.status in (408, 429)
    hint = {
        401: "check the credentials",
        403: "check the credentials and the object's permissions",
        404: "check the path and revision",
    }.get(resp.status, "")
    raise SourceError(
        f"{subject}: GET {shown} answered {resp.status}"
        + (f" ({hint})" if hint else "")
        + (f": {body[:200]}" if body else ""),
        transient=transient,
        status=resp.status,
    )


def _timeout_message(
    exc: BaseException, session: aiohttp.ClientSession, url: str | yarl.URL, shown: str, hint: str
) -> str:
    """What a timeout waited on, in words: the connection, a byte, or the whole transfer;
    ``hint`` names the setting that bounds the first two."""
    timeout = session.timeout
    hint = f"; {hint}" if hint else ""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        host = yarl.URL(str(url)).host or shown
        return f"connecting to {host} took over {timeout.sock_connect:g} s (no answer{hint})"
    if isinstance(exc, aiohttp.SocketTimeoutError):
        return f"{shown} sent no byte for {timeout.sock_read:g} s (stalled{hint})"
    return f"fetching {shown} took over {timeout.total:g} s" if timeout.total else f"fetching {shown} timed out"


@contextlib.asynccontextmanager
async def _checked_get(
    session: aiohttp.ClientSession,
    url: str | yarl.URL,
    headers: Mapping[str, str],
    *,
    subject: str,
    progress: Progress | None = None,
    stall_hint: str = "",
) -> AsyncIterator[tuple[aiohttp.ClientResponse, str]]:
    """One GET whose status is already checked; yields the response and the URL as shown
    in messages (:func:`public_url`: no credentials, no query string).

    Network errors, timeouts (connect, a stalled read, the total) and I/O errors while the
    body is consumed become transient :class:`SourceError` s.
    """
    shown = public_url(url)
    if progress is not None:
        progress.enter("connecting", shown)
    try:
        async with session.get(url, headers=dict(headers), allow_redirects=True) as resp:
            await _raise_for_status(resp, shown, subject)
            if progress is not None:
                progress.enter("downloading", shown)
            yield resp, shown
    except TimeoutError as exc:  # aiohttp's timeouts are TimeoutErrors too
        message = _timeout_message(exc, session, url, shown, stall_hint)
        raise SourceError(f"{subject}: {message}", transient=True) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise SourceError(
            f"{subject}: fetching {shown} failed: {_scrub(str(exc) or type(exc).__name__, url)}", transient=True
        ) from exc


def _scrub(text: str, url: str | yarl.URL) -> str:
    """``text`` without ``url``'s credentials or query string (a library's message may quote
    it): the URL becomes its public form, then any password or query string left goes."""
    return redact(text.replace(str(url), public_url(url)), str(url))


MIN_SECRET = 4
"""Shorter credentials are not looked for inside a message (they would match ordinary words)."""


def redact(text: str, url: str) -> str:
    """``text`` with the password and the query string of ``url`` replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
        secrets = [parts.password, parts.query]
    except ValueError:
        return text
    for secret in secrets:
        if secret and len(secret) >= MIN_SECRET:
            text = text.replace(secret, "***")
            text = text.replace(urllib.parse.unquote(secret), "***")
    return text


async def fetch_to(
    session: aiohttp.ClientSession,
    url: str | yarl.URL,
    headers: Mapping[str, str],
    dest: Path,
    *,
    subject: str,
    max_bytes: int,
    progress: Progress | None = None,
    stall_hint: str = "",
) -> int:
    """Stream one GET into ``dest``; return the bytes written. ``progress`` hears of the
    connection, the download and every chunk; ``stall_hint`` (the setting that bounds a
    stall) is named when the source stalls.

    Raises :class:`SourceError`: not transient for 4xx answers and size-limit breaches,
    transient for 5xx / 408 / 429, network errors and timeouts. Credentials and query
    strings (which may carry presigned credentials) never appear in messages.
    """
    checked = _checked_get(session, url, headers, subject=subject, progress=progress, stall_hint=stall_hint)
    async with checked as (resp, shown):
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise SourceError(f"{subject}: {shown} is {resp.content_length} bytes, over the {max_bytes}-byte limit")
        written = 0
        with dest.open("wb") as f:
            async for chunk in resp.content.iter_chunked(CHUNK):
                written += len(chunk)
                if written > max_bytes:
                    raise SourceError(f"{subject}: {shown} exceeds the {max_bytes}-byte limit")
                f.write(chunk)
                if progress is not None:
                    progress.received(len(chunk))
        return written


async def fetch_bytes(
    session: aiohttp.ClientSession,
    url: str | yarl.URL,
    headers: Mapping[str, str],
    *,
    subject: str,
    max_bytes: int,
) -> bytes:
    """One GET whose (small) body is returned in memory; errors as :func:`fetch_to`."""
    async with _checked_get(session, url, headers, subject=subject) as (resp, shown):
        body = await resp.content.read(max_bytes + 1)
        if len(body) > max_bytes:
            raise SourceError(f"{subject}: {shown} exceeds the {max_bytes}-byte limit")
        return body


# --- archives and digests ---------------------------------------------------------------------


def safe_extract(archive: Path, dest: Path, *, subject: str, max_bytes: int) -> None:
    """Extract regular files and directories only, never outside ``dest``.

    Links, devices, absolute names and ``..`` are refused before anything is written, as
    is an archive that unpacks past ``max_bytes``.
    """
    dest.mkdir()
    try:
        with tarfile.open(archive, "r:*") as tar:
            total = 0
            members = []
            for m in tar.getmembers():
                if not (m.isfile() or m.isdir()):
                    raise SourceError(f"{subject}: the archive holds a link or device ({m.name!r}); refused")
                if m.name.startswith("/") or ".." in Path(m.name).parts:
                    raise SourceError(f"{subject}: the archive member {m.name!r} escapes the archive")
                total += m.size
                if total > max_bytes:
                    raise SourceError(f"{subject}: the archive unpacks past the {max_bytes}-byte limit")
                members.append(m)
            tar.extractall(dest, members=members, filter="data")
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise SourceError(f"{subject}: not a readable tar archive: {exc}") from exc


_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def check_sha256(value: object, *, name: str = "sha256") -> str | None:
    """Normalise an optional hex digest (lower case); raise naming ``name`` when malformed."""
    if value is None:
        return None
    if not isinstance(value, str) or not _SHA256_RE.match(value.lower()):
        raise SourceError(f"{name} must be 64 hexadecimal characters", field="sha256")
    return value.lower()


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of one file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def listing_digest(directory: Path, names: Iterable[str]) -> str:
    """SHA-256 of the ``sha256sum`` listing of ``names`` (relative paths, in the given order)
    under ``directory``: what ``cd DIR && sha256sum NAMES... | sha256sum`` prints."""
    listing = "".join(f"{file_sha256(directory / name)}  {name}\n" for name in names)
    return hashlib.sha256(listing.encode()).hexdigest()


# --- publication into a shared directory ----------------------------------------------------------


def fsync_path(path: Path) -> None:
    """Flush one file (or directory) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it); a no-op where unsupported."""
    with contextlib.suppress(OSError):  # not every filesystem syncs directories
        fsync_path(path)


def fsync_tree(directory: Path) -> None:
    """Flush every file under ``directory``, so a node crash after a rename that publishes it
    can never leave a published directory with missing bytes."""
    for path in directory.rglob("*"):
        if path.is_file():
            fsync_path(path)


def remove_stale(parent: Path, pattern: str, max_age_s: float) -> None:
    """Delete the directories ``parent/pattern`` whose newest entry is older than ``max_age_s``:
    leftovers of writers killed outright (SIGKILL, a node lost). A writer at work writes
    continuously, so a live one's directory is never this old and is left alone."""
    now = time.time()
    for candidate in parent.glob(pattern):
        if not candidate.is_dir():
            continue
        try:
            newest = max([candidate.stat().st_mtime, *(p.stat().st_mtime for p in candidate.rglob("*"))])
        except OSError:
            continue  # vanished meanwhile: its owner cleaned up
        if now - newest > max_age_s:
            log.info("removing %s, left by an interrupted download", candidate)
            shutil.rmtree(candidate, ignore_errors=True)


class Heartbeat:
    """Progress of the process that holds a :func:`download_lock`: forwards to ``inner`` and
    touches the lock file (at most twice a second), which is how waiting processes see that
    the download is alive."""

    def __init__(self, lock_path: Path, inner: Progress | None) -> None:
        self.lock_path = lock_path
        self.inner = inner
        self._last = 0.0

    def beat(self) -> None:
        """Show a sign of life to the waiters."""
        now = time.monotonic()
        if now - self._last >= 0.5:
            self._last = now
            with contextlib.suppress(OSError):
                os.utime(self.lock_path)

    def enter(self, phase: str, target: str | None = None) -> None:
        self._last = 0.0
        self.beat()
        if self.inner is not None:
            self.inner.enter(phase, target)

    def received(self, count: int) -> None:
        self.beat()
        if self.inner is not None:
            self.inner.received(count)

    async def during(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` in a worker thread (a digest, a flush), beating every second meanwhile,
        so waiters never take a long verification for a dead holder."""
        work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        while True:
            done, _ = await asyncio.wait({work}, timeout=1.0)
            if done:
                return work.result()
            self._last = 0.0
            self.beat()


LOCK_POLL_S = 0.05


def _fresh_mtime(path: Path) -> int:
    """The lock file's modification time as the server has it now: opened afresh, because
    NFS revalidates a file's attributes on open (close-to-open consistency) and may serve
    cached ones, up to a minute old, to a descriptor held open."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def download_lock(
    path: Path, *, silent_after_s: float, subject: str, what: str, progress: Progress | None = None
) -> AsyncIterator[Heartbeat]:
    """Hold an exclusive lock on ``path`` (``flock``) between processes and pods sharing a
    volume, so one downloads while the others wait; yields the holder's :class:`Heartbeat`.

    A waiter waits as long as the holder shows signs of life (the lock file's time changes)
    and gives up with a transient :class:`SourceError` after ``silent_after_s`` without one.
    A holder that dies releases the lock with its file descriptor. Where the filesystem has
    no locks, nothing is held: the atomic publication alone keeps the result whole.
    """
    import fcntl  # POSIX only; the runtime and the fetcher run on Linux

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waiting_since = None
        seen, quiet_since = _fresh_mtime(path), time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            except OSError as exc:  # ENOLCK, EOPNOTSUPP: a filesystem without locks
                log.warning("%s: no lock on %s (%s): downloading without waiting for others", subject, path, exc)
                break
            now = time.monotonic()
            if waiting_since is None:
                waiting_since = now
                if progress is not None:
                    progress.enter("waiting", what)
            mtime = _fresh_mtime(path)
            if mtime != seen:
                seen, quiet_since = mtime, now
                if progress is not None:
                    progress.received(0)
            elif now - quiet_since > silent_after_s:
                raise SourceError(
                    f"{subject}: waited {now - waiting_since:.0f} s for {what}, which showed no progress for "
                    f"{silent_after_s:g} s; retry later",
                    transient=True,
                )
            await asyncio.sleep(LOCK_POLL_S)
        heartbeat = Heartbeat(path, progress)
        heartbeat.beat()
        yield heartbeat
    finally:
        os.close(fd)  # releases the lock
