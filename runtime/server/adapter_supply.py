"""Adapters on demand: the pod's catalog, loads on first request, warmth and eviction.

Every pod of a serve knows the serve's catalog (``loraserve.runtime.contract.catalog``), read from
a file at start-up, reread when a request names an adapter the pod does not know (until
the operator's first push), and replaced by the operator's pushes. A request naming a
catalogued adapter the pod does not hold waits while the pod fetches, verifies and loads
it (one load per version however many requests wait), then runs; a load that does not
finish within ``lora.load_timeout_s`` answers 503 ``adapter_loading`` with ``Retry-After``,
saying what it waits on, and goes on in the background.

Versions side by side: each loaded version of an adapter lives in the engine under its own
key (``name@version``, see the catalog module); clients only ever see the name. A request
resolves the name, when it arrives, to the version current then and holds (leases) that
version for its whole life. When the catalog gives a name another version, new requests
get the new one (loaded at once in the background if the old one was loaded here), the old
one finishes its requests and is freed after the last. One authority per name: a
catalogued name serves only its entry's weights; a load whose entry changed or left while
it ran is discarded, and an admin load from other weights is refused (409).

Adapters loaded through the admin API or at start-up are *warm*: never evicted. Adapters
loaded on demand are not: when the host cache (``lora.max_loaded_loras``) is full, the
least recently used one that is neither warm nor pinned nor in use is unloaded to make
room. A request's lease keeps its version from eviction from the moment it names it until
it ends.

A bad adapter (the runtime refuses the files, the source does not exist, the digest does
not match) fails with the same error the admin API gives, and the failure is remembered
(listed with ``state: failed``) until its catalog entry changes or an admin load succeeds;
transient failures (an unreachable source) are retried by the next request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from ..contract.catalog import (
    VERSION_HEX,
    CatalogEntry,
    CatalogError,
    adapter_version,
    catalog_digest,
    engine_key,
    public_name,
    read_catalog_file,
)
from ..contract.config import RuntimeConfig
from ..engine import Engine, EngineError
from ..lora import AdapterCapacityError, AdapterError, AdapterNotFoundError
from ..lora.progress import LoadProgress
from ..lora.sources import SourceError, SourceSettings, resolve_source
from .errors import ApiError
from .metrics import Metrics

log = logging.getLogger("loraserve.server")

RETRY_AFTER_S = 5
ROOM_POLL_S = 0.1
"""How often a load waiting for room in a full host cache looks again."""


@dataclass
class AdapterRecord:
    """Where a loaded adapter came from, as the client (or the catalog) named it."""

    name: str
    source: str
    sha256: str | None
    local_path: str
    pinned: bool
    loaded_at: int
    draft: tuple[str, str | None] | None = None  # the draft adapter's (source, sha256)
    key: str = ""
    """The engine's key for these weights (``name@version``; a start-up adapter's is its name)."""

    def __post_init__(self) -> None:
        self.key = self.key or self.name

    @property
    def version(self) -> str:
        """The short id of what this record loaded (see ``adapter_version``)."""
        return adapter_version(self.source, self.sha256, *(self.draft or (None, None)))


@dataclass(frozen=True)
class CatalogChange:
    """What replacing the catalog did."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    unloaded: tuple[str, ...] = ()


def public_root(name: str, source: str) -> str:
    """What ``GET /v1/models`` (no token needed) shows as an adapter's ``root``: a remote or
    ``pvc://`` source as named (without credentials, query or fragment), never a path of the
    pod's file system (a plain path or ``file://`` shows as the adapter's name)."""
    scheme, sep, _ = source.partition("://")
    if not sep or scheme.lower() == "file":
        return name
    parts = urllib.parse.urlsplit(source)
    netloc = parts.netloc.rpartition("@")[2]  # no user:password
    return f"{parts.scheme}://{netloc}{parts.path}"


def adapter_error(exc: AdapterError, name: str | None = None) -> ApiError:
    """The API error for an adapter the runtime refused (admin loads and on-demand loads
    alike); ``name``'s engine keys in the message show as ``name``."""
    status = int(getattr(exc, "http_status", 400))
    code = {404: "adapter_not_found", 409: "adapter_conflict", 503: "adapter_capacity"}.get(
        status, "invalid_adapter"
    )
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    message = str(exc) if name is None else public_message(str(exc), name)
    return ApiError(status, message, param=exc.field or "lora_path", code=code, headers=headers)


def public_message(message: str, name: str) -> str:
    """``message`` with ``name``'s engine keys (``name@version``) shown as ``name``."""
    return re.sub(re.escape(name) + f"@[0-9a-f]{{{VERSION_HEX}}}", lambda _: name, message)


def source_error(exc: SourceError) -> ApiError:
    """The API error for a source that could not be fetched or verified."""
    if exc.transient:
        return ApiError(
            502,
            str(exc),
            param=exc.field,
            code="source_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    return ApiError(400, str(exc), param=exc.field, code="invalid_source")


@dataclass(frozen=True)
class LoadSpec:
    """What one load fetches, and the engine key it goes under."""

    name: str
    source: str
    sha256: str | None = None
    draft: tuple[str, str | None] | None = None  # the draft adapter's (source, sha256)
    rank: int | None = None
    """The rank the catalog declares; a file of another rank is refused."""
    from_catalog: bool = False
    """Made for a catalog entry: discarded if the entry leaves while it runs."""

    @classmethod
    def of(cls, entry: CatalogEntry) -> LoadSpec:
        """The load of a catalog entry."""
        draft = None if entry.draft_source is None else (entry.draft_source, entry.draft_sha256)
        return cls(entry.name, entry.source, entry.sha256, draft, entry.rank, from_catalog=True)

    @property
    def key(self) -> str:
        """The engine key: the name and the version of what it loads (a catalog entry's
        ``key`` for the same identity)."""
        return engine_key(self.name, adapter_version(self.source, self.sha256, *(self.draft or (None, None))))


class LoadSuperseded(Exception):
    """A load's catalog entry changed or left while it ran: its result was discarded and
    whoever waited on it resolves the name again."""


@dataclass
class AdapterSupply:
    """The catalog and everything about getting its adapters into the engine.

    Invariants: ``records[name]`` is the version new requests for ``name`` get (its
    ``key`` is loaded in the engine); for a catalogued name it matches the current entry
    (:func:`_matches`). ``_retiring`` holds replaced versions still leased by requests;
    each is unloaded from the engine when its last lease ends. A request leases one key
    for its whole life, so it never mixes versions.
    """

    config: RuntimeConfig
    sources: SourceSettings
    metrics: Metrics
    engine: Engine | None = None
    reserved: frozenset[str] = frozenset()
    """Names an adapter may not take (the base model's)."""
    catalog: dict[str, CatalogEntry] = field(default_factory=dict)
    digest: str | None = None
    catalog_ready: bool = False
    catalog_error: str | None = None
    pushed: bool = False
    """A catalog was pushed (``PUT /v1/lora_catalog``) since start: the file is read no more."""
    records: dict[str, AdapterRecord] = field(default_factory=dict)
    warm: set[str] = field(default_factory=set)
    _retiring: dict[str, AdapterRecord] = field(default_factory=dict)
    _loading: dict[str, asyncio.Task] = field(default_factory=dict)
    _progress: dict[str, LoadProgress] = field(default_factory=dict)
    _failed: dict[str, ApiError] = field(default_factory=dict)
    _leases: collections.Counter = field(default_factory=collections.Counter)
    _used: dict[str, float] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _changed: asyncio.Event | None = None
    _freed: asyncio.Event | None = None
    _file_stamp: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        self.catalog_ready = self.config.lora.catalog is None

    @property
    def confirmed(self) -> bool:
        """Whether the operator has pushed a catalog since start (``lora.catalog_confirm``)."""
        return self.pushed

    # ------------------------------------------------------------------ set-up
    def attach(self, engine: Engine) -> None:
        """The engine serves: adapters loaded at start-up get records and stay warm."""
        self.engine = engine
        now = int(time.time())
        for name, path in self.config.lora.adapters.items():
            self.records.setdefault(
                name, AdapterRecord(name, str(path), None, str(path), name in self.config.lora.pinned, now)
            )
            self.warm.add(name)

    def lock(self, name: str) -> asyncio.Lock:
        """Serialises admin calls for one adapter name, and loads of one engine key."""
        return self._locks.setdefault(name, asyncio.Lock())

    # ------------------------------------------------------------------ the catalog
    def replace_catalog(self, entries: Iterable[CatalogEntry], *, pushed: bool = False) -> CatalogChange:
        """Make ``entries`` the catalog. A name whose version changed or that left retires
        its loaded version (its requests finish on it); a changed one that was loaded starts
        loading its new version at once. New requests get the new version."""
        new = {e.name: e for e in entries}
        old = self.catalog
        removed = sorted(set(old) - set(new))
        changed = sorted(n for n in set(old) & set(new) if _identity(old[n]) != _identity(new[n]))
        added = sorted(set(new) - set(old))
        self.catalog = new
        self.digest = catalog_digest(new.values())
        self.catalog_ready = True
        self.catalog_error = None
        self.pushed = self.pushed or pushed
        unloaded = []
        for name in sorted({*removed, *changed, *added}):
            record = self.records.get(name)
            entry = new.get(name)
            if record is None or (entry is not None and _matches(record, entry)):
                continue
            # The catalog is the authority for its names: other weights under one go.
            self._retire(name)
            unloaded.append(name)
            if entry is not None and self.engine is not None:
                self._start_load(name, entry.key)  # was served here: have the new one soon
        self._failed = {k: v for k, v in self._failed.items() if self.wanted_key(public_name(k)) == k}
        self._notify_change()
        return CatalogChange(tuple(added), tuple(removed), tuple(changed), tuple(unloaded))

    def _notify_change(self) -> None:
        """Wake every request waiting on a load: it checks whether its version is still current."""
        if self._changed is not None:
            self._changed.set()
        self._changed = asyncio.Event()

    def refresh_from_file(self) -> bool:
        """Reread ``--adapter-catalog`` if it changed since last read (never after a push);
        True when the catalog changed."""
        path = self.config.lora.catalog
        if path is None or self.pushed:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._file_stamp:
            return False
        self._file_stamp = stamp
        try:
            entries = read_catalog_file(path, reserved=self.reserved)
        except CatalogError as exc:
            log.warning("rereading the adapter catalog: %s (the current one stays)", exc)
            return False
        if catalog_digest(entries) == self.digest:
            return False
        change = self.replace_catalog(entries)
        log.info(
            "adapter catalog %s reread from %s: added %s, removed %s, changed %s",
            self.digest,
            path,
            list(change.added),
            list(change.removed),
            list(change.changed),
        )
        return True

    def read_file(self, path: str) -> tuple[CatalogEntry, ...]:
        """Read the catalog file (start-up) and remember its stamp; :class:`CatalogError` if bad."""
        with contextlib.suppress(OSError):
            st = os.stat(path)
            self._file_stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        return read_catalog_file(path, reserved=self.reserved)

    def wanted_key(self, name: str) -> str | None:
        """The engine key a new request for ``name`` gets now, or None (no such adapter)."""
        entry = self.catalog.get(name)
        record = self.records.get(name)
        if entry is not None:
            return record.key if record is not None and _matches(record, entry) else entry.key
        return record.key if record is not None else None

    def _retire(self, name: str) -> None:
        """``name``'s current version takes no new requests; freed when its leases end."""
        record = self.records.pop(name, None)
        if record is None:
            return
        self._retiring[record.key] = record
        self._free_if_idle(record.key)

    def _free_if_idle(self, key: str) -> None:
        if key not in self._retiring or self._leases.get(key):
            return
        self._retiring.pop(key)
        self._engine_unload(key)
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    async def _room_freed(self) -> bool:
        """The host cache is full: wait until a replaced version (or an unloaded adapter
        still finishing requests) leaves it, so a version change waits instead of failing.
        False at once when nothing is leaving."""
        leaving = bool(self._retiring) or any(
            str(getattr(i, "state", "")) == "unloading" for i in self._engine().list_adapters()
        )
        if not leaving:
            return False
        if self._freed is None:
            self._freed = asyncio.Event()
        with contextlib.suppress(TimeoutError):  # an engine-side drain ends without a signal: poll
            await asyncio.wait_for(self._freed.wait(), ROOM_POLL_S)
        return True

    def _engine_unload(self, key: str) -> None:
        if self.engine is None:
            return
        try:
            self.engine.unload_adapter(key)
            self.engine.unload_draft_adapter(key)
        except (AdapterError, EngineError) as exc:
            log.warning("unloading adapter version %s failed: %s", key, exc)
        self._used.pop(key, None)

    def _loaded(self, key: str) -> bool:
        return self.engine is not None and key in self.engine.adapter_names

    @property
    def settled(self) -> bool:
        """No load runs and no replaced version still finishes requests."""
        return not self._loading and not self._retiring

    def is_loaded(self, name: str) -> bool:
        """Whether ``name`` has a current version loaded (what new requests would use)."""
        record = self.records.get(name)
        return record is not None and self._loaded(record.key)

    def loaded_names(self) -> set[str]:
        """The public names with a current version loaded here."""
        return {name for name in self.records if self.is_loaded(name)}

    def _revive(self, name: str, key: str) -> bool:
        """``key`` is wanted for ``name`` again while still loaded for its old requests
        (an entry changed back, an unload undone): it becomes current again."""
        record = self._retiring.get(key)
        if record is None or not self._loaded(key):
            return False
        current = self.records.get(name)
        if current is not None and current.key != key:
            self._retire(name)
        self.records[name] = self._retiring.pop(key)
        return True

    def state_of(self, name: str) -> tuple[str, str | None]:
        """(``loaded`` | ``loading`` | ``failed`` | ``registered``, the failure's message)."""
        key = self.wanted_key(name)
        if key is None:
            return "registered", None
        record = self.records.get(name)
        if record is not None and record.key == key and self._loaded(key):
            return "loaded", None
        task = self._loading.get(key)
        if task is not None and not task.done():
            return "loading", None
        failure = self._failed.get(key)
        if failure is not None:
            return "failed", failure.message
        return "registered", None

    def serving_versions(self, name: str) -> list[str]:
        """The versions of ``name`` loaded here, the current one first."""
        out = []
        record = self.records.get(name)
        if record is not None and self._loaded(record.key):
            out.append(record.version)
        out += sorted(r.version for k, r in self._retiring.items() if r.name == name and self._loaded(k))
        return out

    def progress(self, name: str) -> LoadProgress | None:
        """What the load of ``name``'s current version is doing, while it runs."""
        key = self.wanted_key(name)
        task = None if key is None else self._loading.get(key)
        return None if task is None or task.done() else self._progress.get(key)

    def listing(self) -> list[dict]:
        """The catalog with each adapter's state on this pod (``GET /v1/lora_catalog``)."""
        out = []
        for name, entry in sorted(self.catalog.items()):
            state, message = self.state_of(name)
            item = {
                **entry.to_dict(),
                "state": state,
                "warm": name in self.warm,
                "version": entry.version,
                "serving_versions": self.serving_versions(name),
            }
            if entry.draft_source is not None:
                item["draft_state"] = "loaded" if self.draft_loaded(name) else "absent"
            progress = self.progress(name) if state == "loading" else None
            if progress is not None:
                item["loading_for_s"] = round(time.monotonic() - progress.started, 1)
                item["waiting_on"] = progress.describe()
            if message:
                item["message"] = message
            out.append(item)
        return out

    # ------------------------------------------------------------------ requests
    @contextlib.asynccontextmanager
    async def serve(self, name: str) -> AsyncIterator[str]:
        """The engine key of ``name``'s version current when the request arrived, loaded
        and leased for the block (the request's whole life); raises the :class:`ApiError`
        a client should get. A load superseded while the request waited is retried on the
        name's new version."""
        deadline = time.monotonic() + self.config.lora.load_timeout_s
        while True:
            key = self._resolve(name)
            self._acquire(key)
            try:
                await self._ready(name, key, deadline)
            except LoadSuperseded:
                self._release(key)
                continue
            except BaseException:
                self._release(key)
                raise
            break
        try:
            yield key
        finally:
            self._release(key)

    def _acquire(self, key: str) -> None:
        self._leases[key] += 1
        self._used[key] = time.monotonic()

    def _release(self, key: str) -> None:
        self._leases[key] -= 1
        if self._leases[key] <= 0:
            del self._leases[key]
        self._used[key] = time.monotonic()
        self._free_if_idle(key)

    def _resolve(self, name: str) -> str:
        """The key a request for ``name`` gets now; on a miss the catalog file is checked
        first. 404 only for a name in no catalog and not loaded."""
        key = self.wanted_key(name)
        if key is None and self.refresh_from_file():
            key = self.wanted_key(name)
        unconfirmed = self.config.lora.catalog_confirm and not self.confirmed
        if key is None:
            if unconfirmed:
                raise ApiError(
                    503,
                    f"adapter {shown_name(name)} is not known to this pod yet: its catalog has not been "
                    "confirmed by the operator since start-up; retry shortly",
                    param="model",
                    code="catalog_not_confirmed",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            raise ApiError(
                404,
                f"the model {shown_name(name)} does not exist on this serve (GET /v1/models lists the models)",
                param="model",
                code="model_not_found",
            )
        if unconfirmed and name in self.catalog and not self.is_loaded(name):
            raise ApiError(
                503,
                f"adapter {name!r} is not loadable on this pod yet: its catalog has not been confirmed "
                "by the operator since start-up; retry shortly",
                param="model",
                code="adapter_loading",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return key

    async def _ready(self, name: str, key: str, deadline: float) -> None:
        """Wait until ``key`` (``name``'s version) is loaded; :class:`LoadSuperseded` when the
        name's current version changed meanwhile; 503 ``adapter_loading`` past ``deadline``."""
        while True:
            if self.wanted_key(name) != key:
                raise LoadSuperseded
            record = self.records.get(name)
            if (record is not None and record.key == key and self._loaded(key)) or self._revive(name, key):
                return
            failure = self._failed.get(key)
            if failure is not None:
                raise failure
            task = self._start_load(name, key)
            if self._changed is None:
                self._changed = asyncio.Event()
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                done, _ = await asyncio.wait(
                    {task, changed},
                    timeout=max(deadline - time.monotonic(), 0.0),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                changed.cancel()
            if task in done and not task.cancelled():
                exc = task.exception()
                if exc is not None and not isinstance(exc, LoadSuperseded):
                    raise exc
            elif not done:
                raise self._still_loading(name, key)

    def _still_loading(self, name: str, key: str) -> ApiError:
        progress = self._progress.get(key)
        timeout = self.config.lora.load_timeout_s
        detail = f" ({progress.describe()})" if progress is not None else ""
        return ApiError(
            503,
            f"adapter {name!r} is still loading on this pod after {timeout:g} s (lora.load_timeout_s){detail}: "
            "retry shortly",
            param="model",
            code="adapter_loading",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    def _start_load(self, name: str, key: str) -> asyncio.Task:
        """The running load of ``key`` (started now if none runs)."""
        task = self._loading.get(key)
        if task is None or task.done():
            self._progress[key] = LoadProgress(target=name)
            task = asyncio.create_task(self._load_on_demand(name, key), name=f"load-adapter-{key}")
            self._loading[key] = task
            task.add_done_callback(self._load_done)
        return task

    def _load_done(self, task: asyncio.Task) -> None:
        for key, running in list(self._loading.items()):
            if running is task:
                del self._loading[key]
                self._progress.pop(key, None)
                lock = self._locks.get(key)
                if lock is not None and not lock.locked():
                    del self._locks[key]  # one lock per version ever loaded would only grow
        if not task.cancelled():
            task.exception()  # retrieved: waiters that timed out have already been answered

    async def _load_on_demand(self, name: str, key: str) -> None:
        started = time.monotonic()
        async with self.lock(key):
            if self.wanted_key(name) != key:
                raise LoadSuperseded
            if self._revive(name, key) or (self.is_loaded(name) and self.records[name].key == key):
                return
            entry = self.catalog.get(name)
            if entry is None or entry.key != key:
                # A record whose weights left the engine: forgotten, the name resolves afresh.
                self.records.pop(name, None)
                raise LoadSuperseded
            try:
                await self._load(LoadSpec.of(entry), pinned=False, warm=name in self.warm)
            except LoadSuperseded:
                log.info(
                    "discarded the load of adapter %s (version %s): its catalog entry changed", name, key
                )
                raise
            except ApiError as exc:
                outcome = "transient" if exc.status >= 500 else "failed"
                self.metrics.adapter_loads.labels("demand", outcome).inc()
                log.warning("on-demand load of adapter %s failed: %s", name, exc.message)
                public = self._public(exc, name, entry.source)
                if exc.status < 500 and self.wanted_key(name) == key:
                    self._failed[key] = public
                raise public from None
        self.metrics.adapter_loads.labels("demand", "loaded").inc()
        self.metrics.adapter_load_seconds.observe(time.monotonic() - started)
        log.info("adapter %s (version %s) loaded on demand in %.2f s", name, key, time.monotonic() - started)

    # ------------------------------------------------------------------ loading
    def draft_loaded(self, name: str) -> bool:
        """Whether Adapter ``name``'s current version has its draft adapter in the draft's
        pool (one lookup, not a listing of the pool: the catalog listing asks once per entry)."""
        pool = None if self.engine is None else self.engine.draft_pool
        record = self.records.get(name)
        if pool is None or record is None:
            return False
        try:
            pool.get(record.key)
        except AdapterNotFoundError:
            return False
        return True

    async def load(
        self,
        name: str,
        source: str,
        *,
        sha256: str | None,
        pinned: bool,
        warm: bool,
        draft: tuple[str, str | None] | None = None,
    ):
        """Fetch, verify and load ``name`` from ``source`` (an admin load), then its draft
        adapter (``draft``: source, sha256), all or nothing, as ``name``'s current version.
        Returns the engine's info; :class:`LoadSuperseded` if the catalog meanwhile took
        the name for other weights."""
        return await self._load(LoadSpec(name, source, sha256, draft), pinned=pinned, warm=warm)

    async def _load(self, spec: LoadSpec, *, pinned: bool, warm: bool):
        """Load ``spec`` under its engine key, evicting an idle on-demand adapter if the host
        cache is full, and publish it as its name's current version unless the catalog has
        meanwhile given the name another version (or removed it): then it is discarded."""
        engine = self._engine()
        key, name = spec.key, spec.name
        owned = key not in self._progress  # an admin load's own progress, dropped after
        progress = self._progress.setdefault(key, LoadProgress(target=name))
        try:
            local = await self._resolve_source(spec.source, spec.sha256, progress)
            progress.enter("loading", name)
        finally:
            if owned:
                self._progress.pop(key, None)
        fresh = engine.adapter_info(key) is None
        info = await self._engine_load(name, key, local, pinned)
        if spec.draft is not None:
            await self._load_draft(name, key, *spec.draft, fresh=fresh)
        if spec.rank is not None and getattr(info, "rank", None) not in (None, spec.rank):
            if fresh:
                self._engine_unload(key)
            raise _rank_error(name, spec.rank, spec.source, info.rank)
        if not self._still_wanted(spec):
            if fresh and key not in self._retiring:
                self._engine_unload(key)
            raise LoadSuperseded
        if name in self.records and self.records[name].key != key:
            self._retire(name)
        self._retiring.pop(key, None)
        self.records[name] = AdapterRecord(
            name, spec.source, spec.sha256, str(local), pinned, int(time.time()), spec.draft, key
        )
        self._failed.pop(key, None)
        self._used[key] = time.monotonic()
        self.set_warm(name, warm)
        return info

    async def _engine_load(self, name: str, key: str, local, pinned: bool):
        """``engine.load_adapter`` under ``key``; each pass either loads or evicts one idle
        adapter, so it ends. Errors name ``name``, never the key."""
        engine = self._engine()
        while True:
            try:
                return await asyncio.to_thread(engine.load_adapter, key, local, pinned=pinned)
            except AdapterCapacityError as exc:
                if exc.field != "lora.max_loaded_loras":
                    raise adapter_error(exc, name) from None
                if not self._evict_one() and not await self._room_freed():
                    raise adapter_error(_full(exc, self.config), name) from None
            except AdapterError as exc:
                raise adapter_error(exc, name) from None
            except EngineError as exc:
                raise ApiError.from_request_error(exc.error) from None

    def _still_wanted(self, spec: LoadSpec) -> bool:
        """Whether a load just finished may be published: a catalogued name only as its
        current entry's version (the catalog is the authority); a load made for a catalog
        entry only while the entry is there."""
        entry = self.catalog.get(spec.name)
        return entry.key == spec.key if entry is not None else not spec.from_catalog

    async def _resolve_source(self, source: str, sha256: str | None, progress: LoadProgress):
        """The local directory of ``source``, fetched and verified; the resolver reports
        each phase to ``progress``."""
        try:
            return await resolve_source(source, self.sources, sha256=sha256, progress=progress)
        except SourceError as exc:
            raise source_error(exc) from None

    async def _load_draft(self, name: str, key: str, source: str, sha256: str | None, *, fresh: bool) -> None:
        """Load the draft adapter of ``name``'s version ``key``; on failure unload ``key``
        again (an Adapter is served with the draft adapter it declares, or not at all) and
        raise naming ``draft``."""
        engine = self._engine()
        try:
            local = await resolve_source(source, self.sources, sha256=sha256)
            await asyncio.to_thread(engine.load_draft_adapter, key, local)
        except (SourceError, AdapterError, EngineError) as exc:
            if fresh:
                engine.unload_adapter(key)
            if isinstance(exc, SourceError):
                err = source_error(exc)
            elif isinstance(exc, AdapterError):
                err = adapter_error(exc, name)
            else:
                err = ApiError.from_request_error(exc.error)
            raise ApiError(
                err.status,
                f"draft adapter of {name!r}: {err.message}",
                param="draft" if err.param in (None, "draft") else f"draft.{err.param}",
                code=err.code,
                headers=err.headers,
            ) from None

    def catalog_conflict(
        self, name: str, source: str, sha256: str | None, draft: tuple[str, str | None] | None
    ) -> ApiError | None:
        """The 409 for an admin load of ``name`` that its catalog entry contradicts (another
        source, sha256 or draft adapter), or None (not catalogued, or the same adapter)."""
        entry = self.catalog.get(name)
        if entry is None:
            return None
        same = (
            source == entry.source
            and (sha256 is None or sha256 == entry.sha256)
            and (draft is None or (draft[0] == entry.draft_source and draft[1] in (None, entry.draft_sha256)))
        )
        if same:
            return None
        return ApiError(
            409,
            f"adapter {name!r} is in this serve's catalog from {entry.source!r}"
            + (f" (sha256 {entry.sha256})" if entry.sha256 else "")
            + (f" with the draft adapter {entry.draft_source!r}" if entry.draft_source else "")
            + ": the catalog is the authority for its names; change the Adapter (the catalog) "
            "or load these weights under another lora_name",
            param="lora_name",
            code="adapter_conflict",
        )

    async def load_entry(
        self,
        name: str,
        source: str,
        sha256: str | None,
        draft: tuple[str, str | None] | None,
        *,
        pinned: bool,
        warm: bool,
    ):
        """An admin load of catalogued ``name`` naming its entry's weights: the entry's
        version, loaded (waiting as long as it takes), then pinned and kept warm as asked.
        Returns (engine info, whether it was loaded already); 409 if the entry changes to
        other weights meanwhile."""
        engine = self._engine()
        already = self.is_loaded(name)
        while not self.is_loaded(name):
            conflict = self.catalog_conflict(name, source, sha256, draft)
            key = self.wanted_key(name)
            if conflict is not None or key is None or name not in self.catalog:
                raise conflict or ApiError(
                    409,
                    f"adapter {name!r} left the catalog during the load",
                    param="lora_name",
                    code="adapter_conflict",
                )
            if self._revive(name, key):
                break
            failure = self._failed.get(key)
            if failure is not None:
                raise failure
            task = self._start_load(name, key)
            with contextlib.suppress(LoadSuperseded):
                await asyncio.shield(task)
        record = self.records[name]
        if pinned and not record.pinned:
            try:
                await asyncio.to_thread(engine.load_adapter, record.key, record.local_path, pinned=True)
            except AdapterError as exc:
                raise adapter_error(exc, name) from None
            record.pinned = True
        self.set_warm(name, warm)
        if not already:
            self.metrics.adapter_loads.labels("admin", "loaded").inc()
        return engine.adapter_info(record.key), already

    def set_warm(self, name: str, warm: bool) -> None:
        """Keep ``name`` loaded (True) or let it be evicted when idle (False)."""
        if warm:
            self.warm.add(name)
        else:
            self.warm.discard(name)

    def _evict_one(self) -> bool:
        """Unload the least recently used idle adapter that is not warm: True if one was."""
        engine = self._engine()
        idle = [
            record.name
            for record in self.records.values()
            if record.name not in self.warm
            and not record.pinned
            and not self._leases.get(record.key)
            and (info := engine.adapter_info(record.key)) is not None
            and not info.pinned
            and info.refcount == 0
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda n: self._used.get(self.records[n].key, 0.0))
        self._retire(victim)
        self.metrics.adapter_evictions.inc()
        log.info("evicted idle adapter %s to make room", victim)
        return True

    def _public(self, exc: ApiError, name: str, source: str) -> ApiError:
        """``exc`` as an inference client (no token) may see it: the same error, with the
        pod's paths replaced by the adapter's public source (the log keeps them)."""
        message = exc.message.replace(source, public_root(name, source))
        for root, label in (
            (str(self.sources.cache_dir), "<adapter cache>"),
            *((r, "<volume>") for r in self.sources.allowed_roots),
        ):
            if root and root != "/":
                message = message.replace(root.rstrip("/"), label)
        return ApiError(
            exc.status, message, param=exc.param, code=exc.code, type=exc.type, headers=dict(exc.headers)
        )

    def unload(self, name: str) -> bool:
        """An admin unload: ``name``'s current version takes no new requests (its running
        ones finish on it); its warmth and remembered failures go; a catalog entry stays
        (the next request loads it again). True if a version was loaded."""
        loaded = self.is_loaded(name)
        self._retire(name)
        self.warm.discard(name)
        self._failed = {k: v for k, v in self._failed.items() if public_name(k) != name}
        return loaded

    def _engine(self) -> Engine:
        if self.engine is None:
            raise ApiError(
                503,
                "the model is still loading: retry shortly",
                code="model_loading",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return self.engine


def shown_name(name: str) -> str:
    """A requested name as an error echoes it: at most 100 characters."""
    return repr(name) if len(name) <= 100 else repr(name[:100]) + f"... ({len(name)} characters)"


def _matches(record: AdapterRecord, entry: CatalogEntry) -> bool:
    """Whether ``record``'s weights are ``entry``'s: the same identity (source, sha256 and
    draft adapter), hence the same version id."""
    return record.version == entry.version


def _rank_error(name: str, declared: int, source: str, actual: int) -> ApiError:
    """An Adapter that declares a rank must get a file of that rank."""
    return ApiError(
        400,
        f"adapter {name!r}: the Adapter declares rank {declared} (spec.rank) but the file at "
        f"{source!r} has rank {actual}; fix: declare {actual} or drop spec.rank",
        param="model",
        code="invalid_adapter",
    )


def _identity(entry: CatalogEntry) -> tuple[str | None, ...]:
    """What an entry loads: a change of any of it reloads the adapter."""
    return entry.source, entry.sha256, entry.draft_source, entry.draft_sha256


def _full(exc: AdapterCapacityError, config: RuntimeConfig) -> AdapterCapacityError:
    return AdapterCapacityError(
        f"lora.max_loaded_loras={config.lora.max_loaded_loras} adapters are loaded and every one is kept "
        "warm, pinned or in use: retry shortly, or raise lora.max_loaded_loras (spec.lora.maxLoadedLoras)",
        field="lora.max_loaded_loras",
        adapter=exc.adapter,
    )
