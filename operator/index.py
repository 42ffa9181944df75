"""In-memory indexes of LoRAServes and Adapters, kept current by kopf's watch streams.

Admission decisions read these instead of calling the API server per request. Any kopf
handler of the same registry receives an index as a keyword argument named after it
(``serve_specs``, ``adapters_by_serve``). Values are plain copies of the objects' specs:
they are parsed where used, so one malformed object cannot break indexing of the others.

:func:`register` adds the indexes to a registry; importing ``loraserve.operator.webhooks``
registers them (with the webhooks) in kopf's default registry.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from .specs import ADAPTER_PLURAL, GROUP, LORASERVE_PLURAL, VERSION


@dataclass(frozen=True)
class IndexedAdapter:
    """One Adapter as the index holds it."""

    name: str
    spec: dict[str, Any]
    deleting: bool = False
    """Marked for deletion (its finalizer still runs): out of the serve's catalog already."""


SERVE_INDEX = "serve_specs"
ADAPTER_INDEX = "adapters_by_serve"


def serve_specs(namespace: str, name: str, spec: Mapping[str, Any], **_: Any) -> dict:
    """``(namespace, name)`` -> the LoRAServe's spec."""
    return {(namespace, name): copy.deepcopy(dict(spec))}


def adapters_by_serve(
    namespace: str, name: str, spec: Mapping[str, Any], meta: Mapping[str, Any] | None = None, **_: Any
) -> dict | None:
    """``(namespace, serve name)`` -> the Adapters that reference that serve."""
    serve = spec.get("serve")
    if not isinstance(serve, str) or not serve:
        return None
    deleting = bool((meta or {}).get("deletionTimestamp"))
    return {(namespace, serve): IndexedAdapter(name=name, spec=copy.deepcopy(dict(spec)), deleting=deleting)}


def register(registry: kopf.OperatorRegistry) -> None:
    """Add both indexes to ``registry``."""
    kopf.index(GROUP, VERSION, LORASERVE_PLURAL, id=SERVE_INDEX, registry=registry)(serve_specs)
    kopf.index(GROUP, VERSION, ADAPTER_PLURAL, id=ADAPTER_INDEX, registry=registry)(adapters_by_serve)


def lookup_serve(index: Mapping[Any, Iterable[dict]], namespace: str, name: str) -> dict[str, Any] | None:
    """The spec of LoRAServe ``namespace/name`` from :func:`serve_specs`, or None."""
    store = index.get((namespace, name))
    if not store:
        return None
    for spec in store:  # one object per key
        return spec
    return None


def lookup_adapters(
    index: Mapping[Any, Iterable[IndexedAdapter]], namespace: str, serve: str
) -> list[IndexedAdapter]:
    """The Adapters that reference LoRAServe ``namespace/serve``, from :func:`adapters_by_serve`."""
    return sorted(index.get((namespace, serve), ()), key=lambda adapter: adapter.name)
