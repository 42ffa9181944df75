"""The serve's adapter catalog: which adapters every pod of a serve can answer for.

Part of the contract between the operator and the runtime (no torch here). The operator
writes the catalog of a LoRAServe (one entry per Adapter) into a ConfigMap that every
runtime pod mounts and reads at start-up, and pushes later versions to running pods over
the admin API (``PUT /v1/lora_catalog``). A pod loads a catalogued adapter on its first
request; the adapters placed on it are also loaded ahead of time and kept warm.

The file and the push carry the same JSON::

    {"adapters": [{"name": "sql", "source": "/adapters/sql-r16", "sha256": "…",
                   "rank": 16, "pinned": false}, …]}

Registered is not loaded: an entry costs nothing until a request names it.

An entry's identity (source, sha256, draft_source, draft_sha256) gives its *version*
(:func:`adapter_version`); a pod holds each loaded version under an engine key
``name@version`` (:func:`engine_key`) that clients never see: ``@`` is not allowed in
adapter names, so :func:`public_name` recovers the name from any key.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

ADAPTER_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:]{0,252}$")
"""Adapter names: what clients send as ``model``; Kubernetes object names always match."""
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_ENTRIES = 4096
MAX_SOURCE = 4096
VERSION_HEX = 12
"""Hex digits of an entry's version id (a prefix of the sha256 of its identity)."""
KEY_SEPARATOR = "@"
"""Between an adapter's name and its version in an engine key (never in a name)."""
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def adapter_version(
    source: str, sha256: str | None = None, draft_source: str | None = None, draft_sha256: str | None = None
) -> str:
    """The short id of what an adapter loads: equal identities, equal ids."""
    canonical = json.dumps([source, sha256, draft_source, draft_sha256], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:VERSION_HEX]


def engine_key(name: str, version: str) -> str:
    """The engine's internal key for ``version`` of adapter ``name``."""
    return f"{name}{KEY_SEPARATOR}{version}"


def public_name(key: str) -> str:
    """The adapter name clients use for an engine key (a plain name is its own key)."""
    return key.partition(KEY_SEPARATOR)[0]


class CatalogError(ValueError):
    """A catalog that cannot be used; ``field`` names the entry and key at fault."""

    def __init__(self, message: str, *, field: str = "adapters") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class CatalogEntry:
    """One adapter of the serve, as its Adapter object declares it."""

    name: str
    source: str
    sha256: str | None = None
    rank: int | None = None
    pinned: bool = False
    # The Adapter's draft adapter (a LoRA for the serve's draft), loaded with it.
    draft_source: str | None = None
    draft_sha256: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def version(self) -> str:
        """The short id of this entry's identity (see :func:`adapter_version`)."""
        return adapter_version(self.source, self.sha256, self.draft_source, self.draft_sha256)

    @property
    def key(self) -> str:
        """The engine key this entry's weights are loaded under."""
        return engine_key(self.name, self.version)


def _no_control(value: str, field: str) -> None:
    """Refuse a control character (NUL, newline...) where a string becomes a path or URL."""
    found = _CONTROL_RE.search(value)
    if found is not None:
        raise CatalogError(
            f"{field} contains the control character {found.group()!r} at position {found.start()}: remove it",
            field=field,
        )


def _entry(raw: object, index: int, reserved: frozenset[str]) -> CatalogEntry:
    where = f"adapters[{index}]"
    if not isinstance(raw, Mapping):
        raise CatalogError(f"{where} must be an object with name and source", field=where)
    name, source = raw.get("name"), raw.get("source")
    if not isinstance(name, str) or not ADAPTER_NAME_RE.fullmatch(name):
        shown = repr(name)[:100] if isinstance(name, str) else type(name).__name__
        raise CatalogError(
            f"{where}.name {shown} is not an adapter name: 1-253 letters, digits and . _ - / :",
            field=f"{where}.name",
        )
    if name in reserved:
        raise CatalogError(
            f"{where}.name {name!r} is the base model's name: choose another", field=f"{where}.name"
        )
    if not isinstance(source, str) or not source.strip() or len(source) > MAX_SOURCE:
        raise CatalogError(
            f"{where}.source must be a non-empty string of at most {MAX_SOURCE} characters",
            field=f"{where}.source",
        )
    _no_control(source.strip(), f"{where}.source")
    sha = raw.get("sha256")
    if sha is not None and (not isinstance(sha, str) or not SHA256_RE.fullmatch(sha.lower())):
        raise CatalogError(f"{where}.sha256 must be 64 hexadecimal characters", field=f"{where}.sha256")
    rank = raw.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise CatalogError(f"{where}.rank must be a positive integer", field=f"{where}.rank")
    pinned = raw.get("pinned", False)
    if not isinstance(pinned, bool):
        raise CatalogError(f"{where}.pinned must be true or false", field=f"{where}.pinned")
    draft, draft_sha = raw.get("draft_source"), raw.get("draft_sha256")
    if draft is not None and (not isinstance(draft, str) or not draft.strip() or len(draft) > MAX_SOURCE):
        raise CatalogError(
            f"{where}.draft_source must be a non-empty string of at most {MAX_SOURCE} characters",
            field=f"{where}.draft_source",
        )
    if draft is not None:
        _no_control(draft.strip(), f"{where}.draft_source")
    if draft_sha is not None and (
        draft is None or not isinstance(draft_sha, str) or not SHA256_RE.fullmatch(draft_sha.lower())
    ):
        raise CatalogError(
            f"{where}.draft_sha256 must be 64 hexadecimal characters, beside a draft_source",
            field=f"{where}.draft_sha256",
        )
    return CatalogEntry(
        name,
        source.strip(),
        sha.lower() if sha else None,
        rank,
        pinned,
        draft.strip() if draft else None,
        draft_sha.lower() if draft_sha else None,
    )


def parse_catalog(data: object, *, reserved: Iterable[str] = ()) -> tuple[CatalogEntry, ...]:
    """Validate a decoded catalog; entries come back sorted by name. ``reserved``: names an
    adapter may not take (the base model's)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("adapters"), list):
        raise CatalogError('the catalog must be a JSON object with an "adapters" list')
    raw = data["adapters"]
    if len(raw) > MAX_ENTRIES:
        raise CatalogError(f"the catalog has {len(raw)} adapters; at most {MAX_ENTRIES} are accepted")
    taken = frozenset(reserved)
    entries = [_entry(item, i, taken) for i, item in enumerate(raw)]
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise CatalogError(f"adapter {entry.name!r} appears twice in the catalog: one entry per name")
        seen.add(entry.name)
    return tuple(sorted(entries, key=lambda e: e.name))


def encode_catalog(entries: Iterable[CatalogEntry]) -> str:
    """The canonical JSON text of a catalog (sorted, stable): what the operator writes."""
    ordered = sorted(entries, key=lambda e: e.name)
    return json.dumps({"adapters": [e.to_dict() for e in ordered]}, sort_keys=True, separators=(",", ":"))


def catalog_digest(entries: Iterable[CatalogEntry]) -> str:
    """A short digest of a catalog's content: equal digests, equal catalogs."""
    return hashlib.sha256(encode_catalog(entries).encode()).hexdigest()[:16]


def read_catalog_file(path: str | Path, *, reserved: Iterable[str] = ()) -> tuple[CatalogEntry, ...]:
    """Read and validate a catalog file; :class:`CatalogError` names the file and the fault."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"--adapter-catalog {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise CatalogError(f"--adapter-catalog {path}: not UTF-8 text") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"--adapter-catalog {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        return parse_catalog(data, reserved=reserved)
    except CatalogError as exc:
        raise CatalogError(f"--adapter-catalog {path}: {exc}", field=exc.field) from None
