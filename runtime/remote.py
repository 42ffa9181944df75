"""Remote transfers shared by adapter sources (``lora.sources``) and the model fetcher
(``fetch``): S3 requests signed with AWS Signature V4, streaming downloads with a size
limit, safe tar extraction and ``sha256sum``-style directory digests.

Nothing here imports torch, so the model fetcher's init container starts quickly. Every
error is a :class:`SourceError` whose message starts with the caller's ``subject`` (for
example ``lora_path 'https://...'``), so each caller keeps its own wording.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import hmac
import re
import ssl
import tarfile
import urllib.parse
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path

import aiohttp
import yarl

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
S3_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
CHUNK = 1 << 20


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


def tls_connector(ca_file: str | None) -> aiohttp.TCPConnector | None:
    """A connector trusting ``ca_file`` (a private CA), or None for the default trust store."""
    if not ca_file:
        return None
    return aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=ca_file))


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


@contextlib.asynccontextmanager
async def _checked_get(
    session: aiohttp.ClientSession, url: str | yarl.URL, headers: Mapping[str, str], *, subject: str
) -> AsyncIterator[tuple[aiohttp.ClientResponse, str]]:
    """One GET whose status is already checked; yields the response and the URL as shown
    in messages (without its query string, which may carry presigned credentials).

    Network errors, and I/O errors while the body is consumed, become transient
    :class:`SourceError` s.
    """
    shown = str(url).split("?", 1)[0]
    try:
        async with session.get(url, headers=dict(headers), allow_redirects=True) as resp:
            await _raise_for_status(resp, shown, subject)
            yield resp, shown
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise SourceError(
            f"{subject}: fetching {shown} failed: {exc or type(exc).__name__}", transient=True
        ) from exc


async def fetch_to(
    session: aiohttp.ClientSession,
    url: str | yarl.URL,
    headers: Mapping[str, str],
    dest: Path,
    *,
    subject: str,
    max_bytes: int,
) -> int:
    """Stream one GET into ``dest``; return the bytes written.

    Raises :class:`SourceError`: not transient for 4xx answers and size-limit breaches,
    transient for 5xx / 408 / 429 and network errors. Query strings (which may carry
    presigned credentials) never appear in messages.
    """
    async with _checked_get(session, url, headers, subject=subject) as (resp, shown):
        if resp.content_length is not None and resp.content_length > max_bytes:
            raise SourceError(f"{subject}: {shown} is {resp.content_length} bytes, over the {max_bytes}-byte limit")
        written = 0
        with dest.open("wb") as f:
            async for chunk in resp.content.iter_chunked(CHUNK):
                written += len(chunk)
                if written > max_bytes:
                    raise SourceError(f"{subject}: {shown} exceeds the {max_bytes}-byte limit")
                f.write(chunk)
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
