"""``loraserve-fetch SOURCE DEST``: download a model directory from ``https://`` or ``s3://``.

The operator runs this in an init container (``model-fetch`` / ``draft-fetch``) so the
runtime finds a plain local model directory at DEST. Accepted sources:

- ``https://host/path/model.tar.gz`` (``.tgz``, ``.tar``): downloaded, extracted safely
  (no links, nothing outside the archive), then the shallowest directory holding
  ``config.json`` becomes the model;
- ``https://host/dir/``: a directory URL, which cannot be listed, so the fetch asks for
  ``config.json``, then ``model.safetensors.index.json`` and every shard it names (or
  ``model.safetensors``), plus whichever tokenizer, chat-template and generation files
  exist;
- ``s3://bucket/prefix``: every object under ``prefix/`` (ListObjectsV2, paginated), kept at
  its path relative to the prefix; ``s3://bucket/key.tar.gz``: an archive as above. The
  endpoint and credentials come from ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
  ``AWS_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``
  (requests are SigV4-signed when keys are set, anonymous otherwise).

Pickle weights (``*.bin``, ``*.pt``, ``*.pth``) are never downloaded and are dropped from
archives: the runtime loads safetensors only, and a source that has nothing else fails
naming the fix. A private CA comes from ``--ca-file`` or, as for any OpenSSL client,
``SSL_CERT_FILE``; proxies from ``HTTPS_PROXY`` / ``NO_PROXY``.

Digest (``--sha256``): the adapter digest generalised to every file of the model directory,
sorted by relative path (the marker file excluded)::

    cd MODEL_DIR && find . -type f ! -name .loraserve-fetch.json -printf '%P\\n' \\
        | LC_ALL=C sort | xargs -d '\\n' sha256sum | sha256sum

Atomic and idempotent: the download lands in ``DEST.partial-<random>`` next to DEST, is
checked (and its digest verified), gets a marker file recording the source and digest, and
only then is renamed to DEST. When DEST already holds a marked model from the same source
nothing is downloaded, so a restarting pod starts at once; a marker naming another source is
an error naming both. Pods sharing the volume fetch one at a time (a lock file ``.DEST.lock``
beside DEST): one downloads while the others wait as long as it shows progress, then find
the model there.

Exit status: 0 fetched (or already there), 2 bad arguments or a bad source (the message
names the fix), 1 a transfer failure worth retrying (network, 5xx, local disk).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import aiohttp
import yarl

from ..remote import (
    S3_BUCKET_RE,
    Progress,
    SourceError,
    Transport,
    download_lock,
    fetch_bytes,
    fetch_to,
    fsync_dir,
    fsync_path,
    is_archive_name,
    listing_digest,
    open_session,
    public_url,
    remove_stale,
    s3_request,
    safe_extract,
)
from ..remote import check_sha256 as remote_check_sha256

log = logging.getLogger("loraserve.fetch")

MARKER = ".loraserve-fetch.json"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
OPTIONAL_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
)
"""Fetched from a directory URL when present; a 404 on any of them is fine. Recent
transformers keep the chat template in chat_template.jinja, SentencePiece tokenizers in
tokenizer.model."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")

EXIT_OK = 0
EXIT_TRANSFER = 1
EXIT_BAD_SOURCE = 2

_LISTING_LIMIT = 64 << 20  # one ListObjectsV2 page (1000 keys) is far below this
_INDEX_LIMIT = 64 << 20
_MAX_PAGES = 100_000
_PICKLE_FIX = (
    "the runtime loads safetensors weights only (pickle *.bin/*.pt/*.pth files can run code when "
    "loaded and are never fetched); fix: convert the weights with "
    "model.save_pretrained(dir, safe_serialization=True) and publish model.safetensors "
    "(or model.safetensors.index.json and its shards)"
)


@dataclass(frozen=True)
class FetchOptions:
    """How a fetch reaches the source and what it accepts."""

    sha256: str | None = None
    ca_file: str | None = None  # a CA bundle to trust for https (replaces the system store)
    max_bytes: int = 1 << 40  # per file, and for an archive's unpacked size
    parallel: int = 4  # files downloaded at once (shards, S3 objects)
    retries: int = 3  # further attempts of one request after a transient failure
    retry_delay_s: float = 2.0  # doubled after every failed attempt
    connect_timeout_s: float = 30.0  # connecting (TCP and TLS) fails after this long
    read_timeout_s: float = 300.0  # a stalled connection fails after this long without data
    stale_partial_s: float = 3600.0  # leftovers of killed fetches older than this are removed
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


@dataclass(frozen=True)
class FetchResult:
    """What a fetch left at ``path``; ``downloaded`` is False when it was already there."""

    path: Path
    source: str
    sha256: str
    files: int
    bytes: int
    downloaded: bool


@dataclass(frozen=True)
class Marker:
    """The record written last into a fetched model directory."""

    source: str
    sha256: str
    files: int
    bytes: int
    fetched_at: str


@dataclass(frozen=True)
class ModelSource:
    """A parsed ``https://`` or ``s3://`` model source."""

    raw: str
    scheme: str  # https, http (only when allowed), s3
    bucket: str = ""  # s3 only
    key: str = ""  # s3: the object key or prefix, without surrounding slashes

    @property
    def shown(self) -> str:
        """The source as anyone may see it: no credentials, no query string (which may hold
        presigned credentials)."""
        return public_url(self.raw)

    @property
    def base(self) -> str:
        """A directory URL's base for its files (credentials kept, query string dropped)."""
        return self.raw.split("?", 1)[0].rstrip("/")

    @property
    def subject(self) -> str:
        return f"source {self.shown!r}"

    @property
    def is_archive(self) -> bool:
        return is_archive_name(self.key if self.scheme == "s3" else urllib.parse.urlsplit(self.raw).path)


def parse_model_source(source: str, env: Mapping[str, str] | None = None) -> ModelSource:
    """Parse SOURCE; raise :class:`SourceError` naming what is wrong and the fix."""
    env = os.environ if env is None else env
    source = (source or "").strip()
    scheme, sep, rest = source.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("https", "http", "s3"):
        raise SourceError(
            f"source {source!r}: use https://<host>/<model.tar.gz or directory/> or s3://<bucket>/<prefix or "
            "key.tar.gz> (pvc:// and absolute paths need no fetch; hf:// is fetched with `hf download`)"
        )
    if scheme == "http" and env.get("LORASERVE_ALLOW_HTTP_SOURCES", "") != "1":
        raise SourceError(f"source {source!r}: plain http is refused; use https://")
    if scheme in ("https", "http"):
        parts = urllib.parse.urlsplit(source)
        if not parts.hostname:
            raise SourceError(f"source {source!r}: the URL has no host; use https://<host>/<path>")
        if not parts.path.strip("/"):
            raise SourceError(
                f"source {source!r}: the URL has no path; point it at the model's archive or directory"
            )
        _check_relative(parts.path.strip("/"), f"source {source!r}")
        return ModelSource(source, scheme)
    bucket, _, key = rest.partition("/")
    if not bucket or not key.strip("/"):
        raise SourceError(f"source {source!r}: use s3://<bucket>/<prefix> or s3://<bucket>/<key>.tar.gz")
    if not S3_BUCKET_RE.fullmatch(bucket):
        raise SourceError(f"source {source!r}: {bucket!r} is not a valid S3 bucket name")
    _check_relative(key.strip("/"), f"source {source!r}")
    return ModelSource(source, "s3", bucket=bucket, key=key.strip("/"))


def _check_relative(path: str, subject: str) -> None:
    """Refuse a path that is absolute or has ``..``, ``.`` or empty segments."""
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise SourceError(
            f"{subject}: {path!r} is not a plain relative path ('..', '.' and '//' are refused)"
        )


def check_sha256(value: str | None) -> str | None:
    """Normalise an optional digest (surrounding blanks dropped); raise naming ``--sha256``."""
    return remote_check_sha256(value.strip() if value is not None else None, name="--sha256")


def model_digest(directory: str | Path) -> str:
    """The digest of a model directory: see the module docstring."""
    directory = Path(directory)
    # Names sorted by code point, as `LC_ALL=C sort` does.
    names = sorted(
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != MARKER
    )
    return listing_digest(directory, names)


def read_marker(directory: Path) -> Marker | None:
    """The marker of a fetched model directory, None when there is none."""
    path = directory / MARKER
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Marker(**{k: data[k] for k in Marker.__dataclass_fields__})
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise SourceError(
            f"{path} is unreadable ({exc}); fix: delete {directory} so the model is fetched again"
        ) from exc


# --- the fetch ------------------------------------------------------------------------------------


def fetch_model(source: str, dest: str | Path, options: FetchOptions | None = None) -> FetchResult:
    """Make ``dest`` hold the model named by ``source``, downloading only when needed.

    Raises :class:`SourceError` (``transient`` when retrying may help) and ``OSError`` for
    local disk failures. Nothing but a complete, verified model is ever left at ``dest``.
    Blocking: it runs its own event loop, so call it from a thread where a loop is running.
    """
    options = options or FetchOptions()
    parsed = parse_model_source(source, options.env)
    expected = check_sha256(options.sha256)
    dest = Path(dest)
    existing = _existing(dest, parsed, expected)
    if existing is not None:
        return existing
    dest.parent.mkdir(parents=True, exist_ok=True)
    return _run_on_loop(lambda: _fetch_once(parsed, dest, expected, options))


async def _fetch_once(parsed: ModelSource, dest: Path, expected: str | None, options: FetchOptions) -> FetchResult:
    """Fetch into a private ``DEST.partial-*`` and publish it, holding the destination's lock:
    pods that share the models volume fetch one at a time, and those that waited find the
    model there (the adapter cache's protocol, ``remote.download_lock``)."""
    async with download_lock(
        dest.parent / f".{dest.name}.lock",
        silent_after_s=options.connect_timeout_s + 2 * options.read_timeout_s + 5,
        subject=parsed.subject,
        what=f"another fetch of {parsed.shown} into {dest}",
    ) as heartbeat:
        existing = _existing(dest, parsed, expected)
        if existing is not None:
            return existing
        remove_stale(dest.parent, f"{dest.name}.partial-*", options.stale_partial_s)
        partial = Path(tempfile.mkdtemp(prefix=f"{dest.name}.partial-", dir=dest.parent))
        try:
            model_dir = await _download(parsed, partial, options, heartbeat)
            return await heartbeat.during(_publish, parsed, model_dir, dest, expected)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def _publish(parsed: ModelSource, model_dir: Path, dest: Path, expected: str | None) -> FetchResult:
    """Check and verify ``model_dir``, mark it, flush it, then rename it to ``dest``."""
    _drop_pickles(model_dir)
    _check_model_dir(model_dir, parsed)
    digest = model_digest(model_dir)
    if expected is not None and digest != expected:
        raise SourceError(
            f"{parsed.subject}: sha256 mismatch: the model's digest is {digest}, --sha256 expects {expected}. "
            f"Compute it in the model directory with: find . -type f -printf '%P\\n' | LC_ALL=C sort "
            "| xargs -d '\\n' sha256sum | sha256sum",
            field="sha256",
        )
    files = [p for p in model_dir.rglob("*") if p.is_file()]
    marker = Marker(
        source=parsed.shown,
        sha256=digest,
        files=len(files),
        bytes=sum(p.stat().st_size for p in files),
        fetched_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )
    # Data reaches the disk before the marker, and the marker before the rename: a node
    # crash can never leave a marked DEST with missing bytes.
    for path in files:
        fsync_path(path)
    (model_dir / MARKER).write_text(json.dumps(asdict(marker), indent=2) + "\n")
    fsync_path(model_dir / MARKER)
    try:
        os.rename(model_dir, dest)
    except OSError:
        # A writer outside the lock (a filesystem without locks) finished first: its model
        # is as good as ours.
        won = _existing(dest, parsed, expected)
        if won is None:
            raise
        return won
    fsync_dir(dest.parent)
    return FetchResult(dest, parsed.shown, digest, marker.files, marker.bytes, downloaded=True)


def _existing(dest: Path, parsed: ModelSource, expected: str | None) -> FetchResult | None:
    """The model already at ``dest`` when it is this source's; raise when it is another's."""
    if not dest.exists():
        return None
    if not dest.is_dir():
        raise SourceError(f"destination {str(dest)!r} exists and is not a directory; fix: remove it")
    marker = read_marker(dest)
    if marker is None:
        if not any(dest.iterdir()):
            dest.rmdir()  # an empty directory (made ahead of time by hand or a tool) is replaced
            return None
        raise SourceError(
            f"destination {str(dest)!r} holds files but no {MARKER}, so it was not written by "
            "loraserve-fetch; fix: delete it, or point the model source at it directly (pvc:// or a path)"
        )
    if marker.source != parsed.shown:
        raise SourceError(
            f"destination {str(dest)!r} already holds the model fetched from {marker.source!r}, not "
            f"{parsed.shown!r}; fix: delete {str(dest)!r} to fetch the new source, or use another destination"
        )
    if expected is not None and marker.sha256 != expected:
        raise SourceError(
            f"destination {str(dest)!r} holds {marker.source!r} with digest {marker.sha256}, but --sha256 "
            f"expects {expected}; fix: correct --sha256, or delete {str(dest)!r} to fetch the source again",
            field="sha256",
        )
    return FetchResult(dest, marker.source, marker.sha256, marker.files, marker.bytes, downloaded=False)


def _drop_pickles(model_dir: Path) -> None:
    for path in sorted(model_dir.rglob("*")):
        if path.is_file() and path.name.lower().endswith(PICKLE_SUFFIXES):
            log.info("dropping pickle weights %s (the runtime loads safetensors only)", path.name)
            path.unlink()


def _check_model_dir(model_dir: Path, parsed: ModelSource) -> None:
    """A model directory has config.json and safetensors weights (every shard of an index)."""
    if not (model_dir / CONFIG_FILE).is_file():
        raise SourceError(
            f"{parsed.subject}: no {CONFIG_FILE} at the top of the model; fix: point the source at the "
            "model directory (the prefix or URL under which config.json lies)"
        )
    if (model_dir / INDEX_FILE).is_file():
        missing = [s for s in _index_shards(model_dir / INDEX_FILE, parsed) if not (model_dir / s).is_file()]
        if missing:
            raise SourceError(f"{parsed.subject}: shards named by {INDEX_FILE} are missing: {missing}")
        return
    if not list(model_dir.glob("*.safetensors")):
        raise SourceError(f"{parsed.subject}: no safetensors weights; {_PICKLE_FIX}")


def _index_shards(index: Path, parsed: ModelSource) -> list[str]:
    """The shard files an index names, each a plain relative ``*.safetensors`` path."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as exc:
        raise SourceError(f"{parsed.subject}: {INDEX_FILE} is not a JSON object: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceError(f"{parsed.subject}: {INDEX_FILE} has no weight_map")
    shards = sorted({str(v) for v in weight_map.values()})
    for shard in shards:
        _check_relative(shard, f"{parsed.subject}: {INDEX_FILE} names a shard")
        if not shard.endswith(".safetensors"):
            raise SourceError(f"{parsed.subject}: {INDEX_FILE} names {shard!r}; {_PICKLE_FIX}")
    return shards


# --- transfers --------------------------------------------------------------------------------------


_T = TypeVar("_T")

Request = Callable[[], tuple[str | yarl.URL, dict[str, str]]]
"""Builds a request at send time (an S3 signature is valid for 15 minutes only)."""


class _Transfer:
    """One session's downloads for one source, with retries and bounded parallelism."""

    def __init__(
        self, session: aiohttp.ClientSession, parsed: ModelSource, options: FetchOptions, progress: Progress
    ) -> None:
        self.session = session
        self.parsed = parsed
        self.options = options
        self.progress = progress
        self.slots = asyncio.Semaphore(max(1, options.parallel))

    async def retrying(self, attempt: Callable[[], Awaitable[_T]]) -> _T:
        delay = self.options.retry_delay_s
        for tries_left in range(self.options.retries, -1, -1):
            try:
                return await attempt()
            except SourceError as exc:
                if not exc.transient or tries_left == 0:
                    raise
                log.warning("%s; retrying in %.0f s (%d attempt(s) left)", exc, delay, tries_left)
                await asyncio.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    async def file(self, request: Request, dest: Path, *, optional: bool = False) -> bool:
        """Download one file into ``dest``; False when ``optional`` and the server says 404."""

        async def attempt() -> int:
            url, headers = request()
            return await fetch_to(
                self.session,
                url,
                headers,
                dest,
                subject=self.parsed.subject,
                max_bytes=self.options.max_bytes,
                progress=self.progress,
            )

        dest.parent.mkdir(parents=True, exist_ok=True)
        async with self.slots:
            try:
                size = await self.retrying(attempt)
            except SourceError as exc:
                if optional and exc.status == 404:
                    dest.unlink(missing_ok=True)
                    return False
                raise
        log.info("fetched %s (%d bytes)", dest.name, size)
        return True

    async def files(self, jobs: list[tuple[Request, Path]], *, optional: bool = False) -> None:
        """Download several files at once; the first failure cancels the rest and is raised."""
        try:
            async with asyncio.TaskGroup() as group:
                for request, dest in jobs:
                    group.create_task(self.file(request, dest, optional=optional))
        except ExceptionGroup as failures:
            raise _first_leaf(failures) from None

    def https(self, url: str) -> Request:
        return lambda: (url, {})

    def s3(self, key: str) -> Request:
        def build() -> tuple[yarl.URL, dict[str, str]]:
            url, headers = s3_request(self.parsed.bucket, key, self.options.env)
            return yarl.URL(url, encoded=True), headers

        return build

    async def s3_list(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (ListObjectsV2, following continuation tokens)."""
        keys: list[str] = []
        token: str | None = None
        for _ in range(_MAX_PAGES):
            query = {"list-type": "2", "prefix": prefix}
            if token is not None:
                query["continuation-token"] = token

            async def page(query: dict[str, str] = query) -> bytes:
                url, headers = s3_request(self.parsed.bucket, "", self.options.env, query=query)
                return await fetch_bytes(
                    self.session,
                    yarl.URL(url, encoded=True),
                    headers,
                    subject=self.parsed.subject,
                    max_bytes=_LISTING_LIMIT,
                )

            found, token = _parse_listing(await self.retrying(page), self.parsed)
            keys.extend(found)
            if token is None:
                return keys
        raise SourceError(f"{self.parsed.subject}: the listing did not end after {_MAX_PAGES} pages")


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _parse_listing(body: bytes, parsed: ModelSource) -> tuple[list[str], str | None]:
    """Keys of one ListObjectsV2 page and the token of the next (None on the last page)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise SourceError(
            f"{parsed.subject}: the bucket listing is not S3 XML ({exc}); fix: check that AWS_ENDPOINT_URL "
            "points at an S3 API"
        ) from exc

    def local(tag: str) -> str:
        return tag.rsplit("}", 1)[-1]  # drop the namespace S3 puts on every element

    keys, truncated, token = [], False, None
    for child in root:
        name = local(child.tag)
        if name == "Contents":
            for item in child:
                if local(item.tag) == "Key" and item.text:
                    keys.append(item.text)
        elif name == "IsTruncated":
            truncated = (child.text or "").strip().lower() == "true"
        elif name == "NextContinuationToken":
            token = child.text or None
    if truncated and not token:
        raise SourceError(
            f"{parsed.subject}: the bucket listing is truncated but has no NextContinuationToken"
        )
    return keys, token if truncated else None


def _run_on_loop(work: Callable[[], Awaitable[_T]]) -> _T:
    """``work()`` on its own loop. In the main thread, SIGTERM ends it wherever the kernel
    delivers the signal: a plain handler runs only when the main thread executes, and a
    stalled read with the signal landing on an idle worker thread never would."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(work())
    terminated: list[int] = []

    async def guarded() -> _T:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, lambda: (terminated.append(signal.SIGTERM), task.cancel()))
        return await work()

    previous = signal.getsignal(signal.SIGTERM)
    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if terminated:
            raise SystemExit(128 + terminated[0]) from None
        raise
    finally:
        if previous is not None:  # the loop's close reset it to the default
            signal.signal(signal.SIGTERM, previous)


async def _download(parsed: ModelSource, partial: Path, options: FetchOptions, progress: Progress) -> Path:
    """Fetch ``parsed`` under ``partial``; return the directory holding the model."""
    transport = Transport(
        ca_file=options.ca_file,
        connect_timeout_s=options.connect_timeout_s,
        stall_timeout_s=options.read_timeout_s,
    )
    async with open_session(transport, subject=parsed.subject) as session:
        transfer = _Transfer(session, parsed, options, progress)
        if parsed.is_archive:
            return await _download_archive(transfer, partial)
        model_dir = partial / "model"
        model_dir.mkdir()
        if parsed.scheme == "s3":
            await _download_s3_prefix(transfer, model_dir)
        else:
            await _download_https_dir(transfer, model_dir)
        return model_dir


async def _download_archive(transfer: _Transfer, partial: Path) -> Path:
    parsed = transfer.parsed
    archive = partial / "archive"
    request = transfer.s3(parsed.key) if parsed.scheme == "s3" else transfer.https(parsed.raw)
    await transfer.file(request, archive)
    extracted = partial / "extracted"
    await asyncio.to_thread(
        safe_extract, archive, extracted, subject=parsed.subject, max_bytes=transfer.options.max_bytes
    )
    archive.unlink()  # free the space before the model is renamed into place
    configs = sorted({p.parent for p in extracted.rglob(CONFIG_FILE)}, key=lambda p: (len(p.parts), p))
    if not configs:
        raise SourceError(
            f"{parsed.subject}: the archive holds no {CONFIG_FILE}; fix: pack the model directory "
            "(config.json and its *.safetensors)"
        )
    top = [p for p in configs if len(p.parts) == len(configs[0].parts)]
    if len(top) > 1:
        rels = ", ".join(str(p.relative_to(extracted)) for p in top)
        raise SourceError(f"{parsed.subject}: the archive holds several models ({rels}); pack one")
    return configs[0]


async def _download_s3_prefix(transfer: _Transfer, model_dir: Path) -> None:
    parsed = transfer.parsed
    prefix = parsed.key + "/"
    jobs: list[tuple[Request, Path]] = []
    pickles: list[str] = []
    for key in await transfer.s3_list(prefix):
        if key.endswith("/") or not key.startswith(prefix):
            continue  # "folder" placeholder objects; keys outside the prefix (a broken listing)
        rel = key[len(prefix) :]
        _check_relative(rel, f"{parsed.subject}: the object key {key!r}")
        if rel.lower().endswith(PICKLE_SUFFIXES):
            pickles.append(rel)
            continue
        jobs.append((transfer.s3(key), model_dir / rel))
    if not jobs and not pickles:
        raise SourceError(
            f"{parsed.subject}: no objects under s3://{parsed.bucket}/{prefix}; fix: check the prefix, and that "
            "the credentials may list the bucket (s3:ListBucket)"
        )
    if pickles:
        log.info("not fetching pickle weights %s (the runtime loads safetensors only)", ", ".join(pickles))
    if not any(p.name.endswith(".safetensors") for _, p in jobs):
        raise SourceError(f"{parsed.subject}: only pickle or no weights under the prefix; {_PICKLE_FIX}")
    await transfer.files(jobs)


async def _download_https_dir(transfer: _Transfer, model_dir: Path) -> None:
    parsed = transfer.parsed
    base = parsed.base

    def url(name: str) -> Request:
        return transfer.https(f"{base}/{urllib.parse.quote(name)}")

    try:
        await transfer.file(url(CONFIG_FILE), model_dir / CONFIG_FILE)
    except SourceError as exc:
        if exc.status == 404:
            raise SourceError(
                f"{exc}; fix: point the source at the model directory (the URL under which {CONFIG_FILE} "
                "lies) or at a .tar.gz of it"
            ) from exc
        raise
    if await transfer.file(url(INDEX_FILE), model_dir / INDEX_FILE, optional=True):
        shards = _index_shards(model_dir / INDEX_FILE, parsed)
        await transfer.files([(url(s), model_dir / s) for s in shards])
    elif not await transfer.file(url(SINGLE_FILE), model_dir / SINGLE_FILE, optional=True):
        raise SourceError(
            f"{parsed.subject}: neither {SINGLE_FILE} nor {INDEX_FILE} is at {base}/; {_PICKLE_FIX}"
        )
    await transfer.files([(url(name), model_dir / name) for name in OPTIONAL_FILES], optional=True)


# --- command line -----------------------------------------------------------------------------------


def _terminate(signum: int, _frame: object) -> None:
    # Kubernetes stops an init container with SIGTERM: unwind so the partial directory goes.
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    """The ``loraserve-fetch`` command line."""
    parser = argparse.ArgumentParser(
        prog="loraserve-fetch",
        description="Download a model directory from https:// or s3:// into DEST, atomically and once.",
        epilog="Exit status: 0 done (or already there), 2 bad arguments or source, 1 transfer failure.",
    )
    parser.add_argument(
        "source", help="https://…/model.tar.gz, https://…/dir/, s3://bucket/prefix or s3://bucket/key.tar.gz"
    )
    parser.add_argument("dest", help="the model directory to create (its parent is created when missing)")
    parser.add_argument(
        "--sha256",
        default=None,
        help="expected digest: sha256sum of the sorted sha256sum listing of every file",
    )
    parser.add_argument(
        "--ca-file", default=None, help="CA bundle for https (default: the system's, or $SSL_CERT_FILE)"
    )
    parser.add_argument(
        "--max-bytes", type=int, default=FetchOptions.max_bytes, help="largest file or unpacked archive"
    )
    parser.add_argument(
        "--parallel", type=int, default=FetchOptions.parallel, help="files downloaded at once"
    )
    parser.add_argument(
        "--retries", type=int, default=FetchOptions.retries, help="retries of a transient failure"
    )
    parser.add_argument(
        "--stale-partial-seconds",
        type=float,
        default=FetchOptions.stale_partial_s,
        help="remove DEST.partial-* directories idle for longer than this (left by killed fetches)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``loraserve-fetch``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_bytes", "parallel"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.retries < 0 or args.stale_partial_seconds < 0:
        parser.error("--retries and --stale-partial-seconds must not be negative")
    logging.basicConfig(level=logging.INFO, format="loraserve-fetch: %(message)s", stream=sys.stderr)
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        signal.signal(signal.SIGTERM, _terminate)
    options = FetchOptions(
        sha256=args.sha256,
        ca_file=args.ca_file,
        max_bytes=args.max_bytes,
        parallel=args.parallel,
        retries=args.retries,
        stale_partial_s=args.stale_partial_seconds,
    )
    try:
        result = fetch_model(args.source, args.dest, options)
    except SourceError as exc:
        print(f"loraserve-fetch: {exc}", file=sys.stderr)
        return EXIT_TRANSFER if exc.transient else EXIT_BAD_SOURCE
    except OSError as exc:
        print(f"loraserve-fetch: writing {args.dest!r} failed: {exc}", file=sys.stderr)
        return EXIT_TRANSFER
    verb = "fetched" if result.downloaded else "already present:"
    print(
        f"loraserve-fetch: {verb} {result.source} at {result.path} "
        f"({result.files} files, {result.bytes} bytes, sha256 {result.sha256})"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
