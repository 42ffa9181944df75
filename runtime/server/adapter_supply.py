"""Adapters on demand: the pod's catalog, loads on first request, warmth and eviction.

Every pod of a serve knows the serve's catalog (``loraserve.runtime.contract.catalog``), read from
a file at start-up and replaced by the operator's pushes. A request naming a catalogued
adapter the pod does not hold waits while the pod fetches, verifies and loads it (one load
per name however many requests wait), then runs; a load that does not finish within
``lora.load_timeout_s`` answers 503 with ``Retry-After`` and goes on in the background.

Adapters loaded through the admin API or at start-up are *warm*: never evicted. Adapters
loaded on demand are not: when the host cache (``lora.max_loaded_loras``) is full, the
least recently used one that is neither warm nor pinned nor in use is unloaded to make
room. A request holds a lease on its adapter from the moment it names it until it ends,
so an adapter is never evicted between its load and its request's admission.

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
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from ..contract.catalog import CatalogEntry, catalog_digest
from ..contract.config import RuntimeConfig
from ..engine import Engine, EngineError
from ..lora import AdapterCapacityError, AdapterError, AdapterNotFoundError
from ..lora.sources import SourceError, SourceSettings, resolve_source
from .errors import ApiError
from .metrics import Metrics

log = logging.getLogger("loraserve.server")

RETRY_AFTER_S = 5


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


def adapter_error(exc: AdapterError) -> ApiError:
    """The API error for an adapter the runtime refused (admin loads and on-demand loads alike)."""
    status = int(getattr(exc, "http_status", 400))
    code = {404: "adapter_not_found", 409: "adapter_conflict", 503: "adapter_capacity"}.get(
        status, "invalid_adapter"
    )
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return ApiError(status, str(exc), param=exc.field or "lora_path", code=code, headers=headers)


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


@dataclass
class AdapterSupply:
    """The catalog and everything about getting its adapters into the engine."""

    config: RuntimeConfig
    sources: SourceSettings
    metrics: Metrics
    engine: Engine | None = None
    catalog: dict[str, CatalogEntry] = field(default_factory=dict)
    digest: str | None = None
    catalog_ready: bool = False
    catalog_error: str | None = None
    records: dict[str, AdapterRecord] = field(default_factory=dict)
    warm: set[str] = field(default_factory=set)
    _loading: dict[str, asyncio.Task] = field(default_factory=dict)
    _failed: dict[str, ApiError] = field(default_factory=dict)
    _leases: collections.Counter = field(default_factory=collections.Counter)
    _used: dict[str, float] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.catalog_ready = self.config.lora.catalog is None

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
        """Serialises loads and unloads of one adapter name (different names overlap)."""
        return self._locks.setdefault(name, asyncio.Lock())

    # ------------------------------------------------------------------ the catalog
    def replace_catalog(self, entries: Iterable[CatalogEntry]) -> CatalogChange:
        """Make ``entries`` the catalog. Adapters that left it, or whose source or digest
        changed, are unloaded (their in-flight requests finish); new ones load on demand."""
        new = {e.name: e for e in entries}
        old = self.catalog
        removed = sorted(set(old) - set(new))
        changed = sorted(n for n in set(old) & set(new) if _identity(old[n]) != _identity(new[n]))
        added = sorted(set(new) - set(old))
        unloaded = []
        for name in [*removed, *changed]:
            self._failed.pop(name, None)
            if self._unload_if_from(name, old[name]):
                unloaded.append(name)
        for name in added:
            self._failed.pop(name, None)
            record = self.records.get(name)
            if record is not None and record.source != new[name].source and self._loaded(name):
                # Loaded under this name from elsewhere: the catalog decides what it means.
                self._unload(name)
                unloaded.append(name)
        self.catalog = new
        self.digest = catalog_digest(new.values())
        self.catalog_ready = True
        self.catalog_error = None
        return CatalogChange(tuple(added), tuple(removed), tuple(changed), tuple(unloaded))

    def _unload_if_from(self, name: str, entry: CatalogEntry) -> bool:
        record = self.records.get(name)
        if record is None or not self._loaded(name) or record.source != entry.source:
            return False
        self._unload(name)
        return True

    def _unload(self, name: str) -> None:
        assert self.engine is not None
        self.engine.unload_adapter(name)
        self.engine.unload_draft_adapter(name)
        self.records.pop(name, None)
        self.warm.discard(name)

    def _loaded(self, name: str) -> bool:
        return self.engine is not None and name in self.engine.adapter_names

    def state_of(self, name: str) -> tuple[str, str | None]:
        """(``loaded`` | ``loading`` | ``failed`` | ``registered``, the failure's message)."""
        if self._loaded(name):
            return "loaded", None
        task = self._loading.get(name)
        if task is not None and not task.done():
            return "loading", None
        failure = self._failed.get(name)
        if failure is not None:
            return "failed", failure.message
        return "registered", None

    def listing(self) -> list[dict]:
        """The catalog with each adapter's state on this pod (``GET /v1/lora_catalog``)."""
        out = []
        for name, entry in sorted(self.catalog.items()):
            state, message = self.state_of(name)
            item = {**entry.to_dict(), "state": state, "warm": name in self.warm}
            if entry.draft_source is not None:
                item["draft_state"] = "loaded" if self.draft_loaded(name) else "absent"
            if message:
                item["message"] = message
            out.append(item)
        return out

    # ------------------------------------------------------------------ requests
    @contextlib.asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[None]:
        """Hold ``name`` against eviction for the block (a request's whole life)."""
        if name is None:
            yield
            return
        self._leases[name] += 1
        self._used[name] = time.monotonic()
        try:
            yield
        finally:
            self._leases[name] -= 1
            if self._leases[name] <= 0:
                del self._leases[name]
            self._used[name] = time.monotonic()

    async def ensure(self, name: str) -> None:
        """Return once ``name`` is loaded (loading it from the catalog if needed), or raise
        the :class:`ApiError` a client should get."""
        if self._loaded(name):
            return
        failure = self._failed.get(name)
        if failure is not None:
            raise failure
        task = self._loading.get(name)
        if task is None or task.done():
            task = asyncio.create_task(self._load_on_demand(name), name=f"load-adapter-{name}")
            self._loading[name] = task
            task.add_done_callback(self._load_done)
        timeout = self.config.lora.load_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            raise ApiError(
                503,
                f"adapter {name!r} is still loading on this pod after {timeout:g} s "
                "(lora.load_timeout_s): retry shortly",
                param="model",
                code="adapter_loading",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None

    def _load_done(self, task: asyncio.Task) -> None:
        for name, running in list(self._loading.items()):
            if running is task:
                del self._loading[name]
        if not task.cancelled():
            task.exception()  # retrieved: waiters that timed out have already been answered

    async def _load_on_demand(self, name: str) -> None:
        started = time.monotonic()
        async with self.lock(name):
            if self._loaded(name):
                return
            entry = self.catalog.get(name)
            if entry is None:  # left the catalog while waiting for the lock
                raise ApiError(
                    404,
                    f"the model {name!r} was removed from this serve",
                    param="model",
                    code="model_not_found",
                )
            try:
                draft = None if entry.draft_source is None else (entry.draft_source, entry.draft_sha256)
                info = await self.load(
                    name, entry.source, sha256=entry.sha256, pinned=False, warm=False, draft=draft
                )
                _check_declared_rank(self, name, entry, info)
            except ApiError as exc:
                outcome = "transient" if exc.status >= 500 else "failed"
                self.metrics.adapter_loads.labels("demand", outcome).inc()
                log.warning("on-demand load of adapter %s failed: %s", name, exc.message)
                public = self._public(exc, name, entry.source)
                if exc.status < 500 and self.catalog.get(name) == entry:
                    self._failed[name] = public
                raise public from None
        self.metrics.adapter_loads.labels("demand", "loaded").inc()
        self.metrics.adapter_load_seconds.observe(time.monotonic() - started)
        log.info("adapter %s loaded on demand in %.2f s", name, time.monotonic() - started)

    # ------------------------------------------------------------------ loading
    def draft_loaded(self, name: str) -> bool:
        """Whether Adapter ``name``'s draft adapter is in the draft's pool (one lookup, not a
        listing of the pool: the catalog listing asks once per entry)."""
        pool = None if self.engine is None else self.engine.draft_pool
        if pool is None:
            return False
        try:
            pool.get(name)
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
        """Fetch, verify and load ``name`` (caller holds :meth:`lock`), evicting an idle
        on-demand adapter if the host cache is full, then its draft adapter (``draft``:
        source, sha256), all or nothing. Returns the engine's info."""
        engine = self._engine()
        try:
            local = await resolve_source(source, self.sources, sha256=sha256)
        except SourceError as exc:
            raise source_error(exc) from None
        while True:  # each pass either loads or evicts one idle adapter: it ends
            try:
                info = await asyncio.to_thread(engine.load_adapter, name, local, pinned=pinned)
                break
            except AdapterCapacityError as exc:
                if exc.field != "lora.max_loaded_loras":
                    raise adapter_error(exc) from None
                if not self._evict_one():
                    raise adapter_error(_full(exc, self.config)) from None
            except AdapterError as exc:
                raise adapter_error(exc) from None
            except EngineError as exc:
                raise ApiError.from_request_error(exc.error) from None
        if draft is not None:
            await self._load_draft(name, *draft)
        self.records[name] = AdapterRecord(name, source, sha256, str(local), pinned, int(time.time()), draft)
        self._failed.pop(name, None)
        self._used[name] = time.monotonic()
        self.set_warm(name, warm)
        return info

    async def _load_draft(self, name: str, source: str, sha256: str | None) -> None:
        """Load ``name``'s draft adapter; on failure unload ``name`` again (an Adapter is
        served with the draft adapter it declares, or not at all) and raise naming ``draft``."""
        engine = self._engine()
        try:
            local = await resolve_source(source, self.sources, sha256=sha256)
            await asyncio.to_thread(engine.load_draft_adapter, name, local)
        except (SourceError, AdapterError, EngineError) as exc:
            engine.unload_adapter(name)
            if isinstance(exc, SourceError):
                err = source_error(exc)
            elif isinstance(exc, AdapterError):
                err = adapter_error(exc)
            else:
                err = ApiError.from_request_error(exc.error)
            raise ApiError(
                err.status,
                f"draft adapter of {name!r}: {err.message}",
                param="draft" if err.param in (None, "draft") else f"draft.{err.param}",
                code=err.code,
                headers=err.headers,
            ) from None

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
            info.name
            for info in engine.list_adapters()
            if info.name in engine.adapter_names
            and info.name not in self.warm
            and not info.pinned
            and info.refcount == 0
            and not self._leases.get(info.name)
        ]
        if not idle:
            return False
        victim = min(idle, key=lambda n: self._used.get(n, 0.0))
        self._unload(victim)
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

    def forget(self, name: str) -> None:
        """An admin unload: the record and its warmth go; the catalog entry stays."""
        self.records.pop(name, None)
        self.warm.discard(name)
        self._failed.pop(name, None)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise ApiError(
                503,
                "the model is still loading: retry shortly",
                code="model_loading",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        return self.engine


def _check_declared_rank(supply: AdapterSupply, name: str, entry: CatalogEntry, info) -> None:
    """An Adapter that declares a rank must get a file of that rank: else unload and refuse."""
    rank = getattr(info, "rank", None)
    if entry.rank is None or rank is None or rank == entry.rank:
        return
    supply._unload(name)
    raise ApiError(
        400,
        f"adapter {name!r}: the Adapter declares rank {entry.rank} (spec.rank) but the file at "
        f"{entry.source!r} has rank {rank}; fix: declare {rank} or drop spec.rank",
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
