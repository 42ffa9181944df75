"""HTTP client for one runtime pod's admin API, as the operator uses it.

The operator never moves adapter bytes: it asks a pod to load an adapter from a source URI
(the runtime fetches and verifies it) and asks it what it holds. Every failure is raised
as :class:`RuntimeCallError` carrying whether it is the adapter's fault (the runtime
answered 4xx: bad rank, wrong shapes, checksum, missing file) or transient (connection
refused, timeout, 5xx, 429, not ready yet), because the two are retried differently.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loraserve.runtime.contract.catalog import CatalogEntry

# 4xx answers that describe the pod or the call, not the adapter: retrying may succeed.
_TRANSIENT_4XX = frozenset({401, 403, 408, 425, 429})
"""401/403: the token Secret and the pod disagree for a moment (a pod started before the
Secret was mounted). 408/425/429: slow down."""


class RuntimeCallError(Exception):
    """An admin call to a runtime pod failed."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        transient: bool,
        call: str = "",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(f"{call}: {message}" if call else message)
        self.message = message
        """The runtime's own words (or the transport error), without the call."""
        self.status = status
        self.transient = transient
        self.call = call
        self.param = param
        """The request field the runtime blamed (``draft``, ``draft.lora_path``...), if it said."""
        self.code = code
        """The runtime's error code (``adapter_conflict``...), if it said."""

    @property
    def draft_fault(self) -> bool:
        """The runtime refused the load because of the draft adapter (it loads both or neither)."""
        return self.param is not None and (self.param == "draft" or self.param.startswith("draft."))

    @property
    def adapter_fault(self) -> bool:
        """The runtime rejected the adapter itself: retrying the same spec cannot help."""
        return not self.transient


@dataclass(frozen=True)
class LoadedAdapter:
    """One adapter a pod knows, as ``GET /v1/models`` or a load answer describes it."""

    name: str
    source: str | None = None  # the lora_path it was loaded from, when the runtime says
    rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    sha256: str | None = None
    state: str = "loaded"
    """loaded | loading | failed | registered (in the pod's catalog, loaded on first request)."""
    warm: bool | None = None
    """Kept loaded (never evicted); None when the runtime does not say."""
    message: str | None = None
    warnings: tuple[str, ...] = ()
    draft_loaded: bool | None = None
    """A load answer's ``draft.loaded``: whether the pod holds the adapter's draft adapter
    (None: the answer names no draft adapter)."""

    @property
    def loaded(self) -> bool:
        return self.state == "loaded"


@dataclass(frozen=True)
class PodModels:
    """What one pod serves: the base model and every adapter it lists, by name."""

    base: str | None
    adapters: dict[str, LoadedAdapter]

    @property
    def loaded(self) -> dict[str, LoadedAdapter]:
        """The adapters the pod holds now (the others load on their first request)."""
        return {name: a for name, a in self.adapters.items() if a.loaded}


@dataclass(frozen=True)
class CatalogState:
    """One entry of a pod's ``GET /v1/lora_catalog`` listing: what the pod's catalog says of
    an adapter and its state there. Keys an older runtime does not send read as None / ()."""

    name: str
    state: str
    """loaded | loading | failed | registered."""
    draft_source: str | None = None
    draft_sha256: str | None = None
    draft_state: str | None = None
    """loaded | absent, for an entry with a draft adapter (None otherwise)."""
    source: str | None = None
    sha256: str | None = None
    version: str | None = None
    """The short id of this entry's identity (source, sha256, draft source and sha256)."""
    serving_versions: tuple[str, ...] = ()
    """Versions the pod serves: the one new requests get first, then old ones still draining."""
    loading_for_s: float | None = None
    waiting_on: str | None = None
    """While state is loading: how long the load has run and what it waits on."""
    message: str | None = None

    def identity(self) -> tuple[str | None, str | None, str | None, str | None]:
        """What the entry's version is computed from."""
        return (self.source, self.sha256, self.draft_source, self.draft_sha256)


@dataclass(frozen=True)
class PodCatalog:
    """A pod's adapter catalog as ``GET /v1/lora_catalog`` reports it."""

    digest: str | None
    ready: bool
    adapters: Mapping[str, CatalogState] = field(default_factory=dict)
    confirmed: bool | None = None
    """The operator's push has reached the pod since it started (or it does not need one);
    None from a runtime that does not say."""


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _texts(value: object) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def parse_catalog_listing(answer: Mapping) -> PodCatalog:
    """``GET /v1/lora_catalog``'s answer: the digest, readiness, confirmation and each entry's
    state and versions (keys of the wrong type read as absent)."""
    entries: dict[str, CatalogState] = {}
    for item in answer.get("adapters") or []:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        entries[item["name"]] = CatalogState(
            name=item["name"],
            state=_text(item.get("state")) or "registered",
            source=_text(item.get("source")),
            sha256=_text(item.get("sha256")),
            draft_source=_text(item.get("draft_source")),
            draft_sha256=_text(item.get("draft_sha256")),
            draft_state=_text(item.get("draft_state")),
            version=_text(item.get("version")),
            serving_versions=_texts(item.get("serving_versions")),
            loading_for_s=_seconds(item.get("loading_for_s")),
            waiting_on=_text(item.get("waiting_on")),
            message=_text(item.get("message")),
        )
    digest, confirmed = answer.get("digest"), answer.get("confirmed")
    return PodCatalog(
        digest=digest if isinstance(digest, str) else None,
        ready=bool(answer.get("ready")),
        adapters=entries,
        confirmed=confirmed if isinstance(confirmed, bool) else None,
    )


def classify_status(status: int) -> bool:
    """Whether an HTTP status from the admin API is transient (True) or the adapter's fault."""
    if status >= 500:
        return True
    if 400 <= status < 500:
        return status in _TRANSIENT_4XX
    return True


def error_fields(body: str) -> tuple[str | None, str | None]:
    """``param`` and ``code`` of an OpenAI-style error body (None where absent)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return None, None
    return _text(err.get("param")), _text(err.get("code"))


def error_message(status: int, body: str) -> str:
    """The runtime's own message from an OpenAI-style error body, else the raw text."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if data.get("message"):
            return str(data["message"])
    text = body.strip()
    return f"HTTP {status}: {text[:500]}" if text else f"HTTP {status}"


def parse_models(data: object) -> PodModels:
    """Parse ``GET /v1/models`` (asked with the admin token): entries with a ``parent`` are
    adapters, the rest base models."""
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise RuntimeCallError("GET /v1/models answered without a 'data' list", transient=True)
    base: str | None = None
    adapters: dict[str, LoadedAdapter] = {}
    for entry in data["data"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        if entry.get("parent"):
            # The real source is ``lora.source``, listed for the admin token only; ``root`` is
            # what any client sees (a remote URI, or the adapter's name for a path in the pod).
            lora = entry.get("lora") if isinstance(entry.get("lora"), dict) else {}
            adapters[entry["id"]] = _adapter(entry["id"], lora.get("source"), lora)
        elif base is None:
            base = entry["id"]
    return PodModels(base=base, adapters=adapters)


def _adapter(name: str, source: object, info: dict) -> LoadedAdapter:
    rank = info.get("rank")
    modules = info.get("target_modules")
    sha = info.get("sha256")
    state, warm, message = info.get("state"), info.get("warm"), info.get("message")
    warnings = info.get("warnings")
    draft = info.get("draft")
    return LoadedAdapter(
        name=name,
        source=source if isinstance(source, str) else None,
        rank=rank if isinstance(rank, int) else None,
        target_modules=tuple(modules) if isinstance(modules, list) else None,
        sha256=sha if isinstance(sha, str) else None,
        state=state if isinstance(state, str) else "loaded",
        warm=warm if isinstance(warm, bool) else None,
        message=message if isinstance(message, str) else None,
        warnings=tuple(w for w in warnings if isinstance(w, str)) if isinstance(warnings, list) else (),
        draft_loaded=bool(draft.get("loaded")) if isinstance(draft, dict) else None,
    )


ACCEPT_LENGTH_METRIC = "loraserve:spec_accept_length"


def accept_stats(metrics_text: str, model: str) -> tuple[float, float]:
    """Sum and count of the per-model accept-length histogram in a Prometheus text page."""
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != ACCEPT_LENGTH_METRIC:
            continue
        for sample in family.samples:
            if sample.labels.get("model") != model:
                continue
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


class RuntimeClient:
    """Admin calls to one runtime pod at ``base_url`` (``http://<podIP>:<port>``)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str | None,
        *,
        request_timeout_s: float = 600.0,
        probe_timeout_s: float = 10.0,
    ) -> None:
        self._session = session
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._request_timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)

    async def _call(
        self, method: str, path: str, *, body: dict | None = None, timeout: aiohttp.ClientTimeout
    ) -> object:
        url = self.base_url + path
        try:
            async with self._session.request(
                method, url, json=body, headers=self._headers, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    param, code = error_fields(text)
                    raise RuntimeCallError(
                        error_message(resp.status, text),
                        status=resp.status,
                        transient=classify_status(resp.status),
                        call=f"{method} {url}",
                        param=param,
                        code=code,
                    )
                try:
                    return json.loads(text) if text else None
                except ValueError:
                    return text
        except RuntimeCallError:
            raise
        except TimeoutError:
            raise RuntimeCallError(
                f"no answer within {timeout.total:g} s", transient=True, call=f"{method} {url}"
            ) from None
        except aiohttp.ClientError as exc:
            raise RuntimeCallError(
                f"{exc.__class__.__name__}: {exc}", transient=True, call=f"{method} {url}"
            ) from None

    async def models(self) -> PodModels:
        """``GET /v1/models``: the base model and every adapter the pod holds."""
        return parse_models(await self._call("GET", "/v1/models", timeout=self._probe_timeout))

    async def load(
        self,
        name: str,
        source: str,
        *,
        sha256: str | None = None,
        pinned: bool = False,
        warm: bool = True,
        draft: tuple[str, str | None] | None = None,
    ) -> LoadedAdapter:
        """``POST /v1/load_lora_adapter``; the runtime fetches ``source`` and checks ``sha256``.

        ``warm``: kept loaded; False demotes an adapter the pod holds to evictable.
        ``draft``: its draft adapter's (source, sha256), loaded with it, all or nothing.
        Returns what the runtime read from the file (rank, target modules, warnings) and
        whether the draft adapter is loaded.
        """
        body: dict[str, object] = {"lora_name": name, "lora_path": source, "warm": warm}
        if sha256:
            body["sha256"] = sha256
        if pinned:
            body["pinned"] = True
        if draft is not None:
            body["draft"] = {"lora_path": draft[0], **({"sha256": draft[1]} if draft[1] else {})}
        answer = await self._call("POST", "/v1/load_lora_adapter", body=body, timeout=self._request_timeout)
        info = answer if isinstance(answer, dict) else {}
        return _adapter(name, info.get("lora_path", source), info)

    async def accept_stats(self, name: str) -> tuple[float, float]:
        """(accepted draft tokens, verify steps) of ``name``'s requests, from ``/metrics``."""
        text = await self._call("GET", "/metrics", timeout=self._probe_timeout)
        return accept_stats(text if isinstance(text, str) else "", name)

    async def catalog(self) -> PodCatalog:
        """``GET /v1/lora_catalog``: the digest of the catalog the pod holds, and each entry's state."""
        answer = await self._call("GET", "/v1/lora_catalog", timeout=self._probe_timeout)
        if not isinstance(answer, dict):
            raise RuntimeCallError("GET /v1/lora_catalog answered without an object", transient=True)
        return parse_catalog_listing(answer)

    async def put_catalog(self, entries: Sequence[CatalogEntry]) -> None:
        """``PUT /v1/lora_catalog``: replace the pod's catalog (idempotent)."""
        body = {"adapters": [e.to_dict() for e in entries]}
        await self._call("PUT", "/v1/lora_catalog", body=body, timeout=self._probe_timeout)

    async def unload(self, name: str) -> bool:
        """``POST /v1/unload_lora_adapter``; False when the pod did not hold it."""
        try:
            await self._call(
                "POST", "/v1/unload_lora_adapter", body={"lora_name": name}, timeout=self._probe_timeout
            )
        except RuntimeCallError as exc:
            if exc.status == 404:
                return False
            raise
        return True
