"""Admin routes: load and unload LoRA adapters, read and replace the adapter catalog
(bearer-token protected when configured).

Names and bodies follow the convention other servers use (``/v1/load_lora_adapter``
``{lora_name, lora_path}``), plus ``sha256``, ``pinned`` and ``warm`` (default true: kept
loaded; false: an idle adapter the pod may evict when it needs room for an on-demand
load). ``GET``/``PUT /v1/lora_catalog`` read and replace the serve's catalog on this pod
(``loraserve.runtime.contract.catalog``; the operator pushes it). Loading is idempotent: the
same name from the same source answers 200 without loading again; the same name from a
different source is a 409 until the old one is unloaded (its in-flight requests finish on
it while the new weights load under their own engine key). A catalogued name belongs to
the catalog: an admin load of it must name its entry's source (and sha256 and draft, when
given), else 409 ``adapter_conflict`` naming the catalog as the authority. Unloading is
idempotent too. ``POST /reset_prefix_cache`` drops the prefix cache.
The adapter's bytes are fetched and verified here (``loraserve.runtime.lora.sources``);
errors that are the adapter's fault answer 4xx, transient ones (a source unreachable,
the pool momentarily full) 5xx, so a caller knows whether retrying can help.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..contract.catalog import CatalogError, parse_catalog
from ..contract.policy import AdapterDeclaration, check_adapter, check_source_revision
from ..lora import AdapterError
from .adapter_supply import RETRY_AFTER_S, AdapterRecord, AdapterSupply, LoadSuperseded, adapter_error
from .auth import check_bearer
from .errors import ApiError, invalid
from .openai_api import read_body
from .schemas import parse_load_adapter, parse_unload_adapter
from .state import STATE, draining_adapter

log = logging.getLogger("loraserve.server")


def _policy_warnings(config, rec: AdapterRecord, info, other_pinned: int) -> list[str]:
    """The compatibility policy's warnings for this adapter on this serve (e.g. an adapter
    touching lm_head under an EAGLE-family draft loses accept rate)."""
    if info is None:
        return []
    declaration = AdapterDeclaration(
        name=rec.name,
        rank=getattr(info, "rank", None),
        target_modules=tuple(getattr(info, "target_modules", ()) or ()) or None,
        pinned=bool(getattr(info, "pinned", rec.pinned)),
    )
    return [w.render() for w in check_adapter(config, declaration, other_pinned=other_pinned).warnings]


def _info_body(
    status: str, rec: AdapterRecord, info, supply: AdapterSupply, warnings: list[str] | None = None
) -> dict:
    return {
        "status": status,
        "lora_name": rec.name,
        "lora_path": rec.source,
        "sha256": rec.sha256,
        "pinned": bool(getattr(info, "pinned", rec.pinned)),
        "warm": rec.name in supply.warm,
        "rank": getattr(info, "rank", None),
        "target_modules": list(getattr(info, "target_modules", ()) or ()),
        "warnings": warnings or [],
        "draft": None
        if rec.draft is None
        else {"lora_path": rec.draft[0], "sha256": rec.draft[1], "loaded": supply.draft_loaded(rec.name)},
    }


def _same_draft(held: tuple[str, str | None] | None, asked: tuple[str, str | None] | None) -> bool:
    """Whether a repeated load asks for the draft adapter already held (a sha256 left out
    matches any)."""
    if held is None or asked is None:
        return held is None and asked is None
    return held[0] == asked[0] and (asked[1] is None or asked[1] == held[1])


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    engine = state.require_engine()
    body = parse_load_adapter(await read_body(request))
    name = body.lora_name
    if name in state.base_names:
        raise invalid(f"lora_name {name!r} is the base model's name: choose another", param="lora_name")
    supply = state.supply
    draft = None if body.draft is None else (body.draft.lora_path, body.draft.sha256)
    async with state.adapter_lock(name):
        conflict = supply.catalog_conflict(name, body.lora_path, body.sha256, draft)
        if conflict is not None:
            raise conflict
        if name in supply.catalog:
            # The catalog's own weights: load its current version (idempotent), as asked.
            info, already = await supply.load_entry(
                name, body.lora_path, body.sha256, draft, pinned=body.pinned, warm=body.warm
            )
            rec = state.adapters[name]
            if already:
                _demote(engine, rec, body)
                return web.json_response(_info_body("already_loaded", rec, info, supply))
            return web.json_response(_loaded_body(state, engine, rec, info, body))
        rec = state.adapters.get(name)
        if rec is not None and supply.is_loaded(name):
            same = (
                rec.source == body.lora_path
                and (body.sha256 is None or body.sha256 == rec.sha256)
                and _same_draft(rec.draft, draft)
            )
            if not same:
                raise ApiError(
                    409,
                    f"adapter {name!r} is already loaded from {rec.source!r}"
                    + (f" (sha256 {rec.sha256})" if rec.sha256 else "")
                    + (
                        f" with the draft adapter {rec.draft[0]!r}"
                        if rec.draft
                        else " without a draft adapter"
                    )
                    + ": unload it first or choose another lora_name",
                    param="lora_name",
                    code="adapter_conflict",
                )
            info = None
            if body.pinned and not rec.pinned:
                try:
                    info = await asyncio.to_thread(engine.load_adapter, rec.key, rec.local_path, pinned=True)
                except AdapterError as exc:
                    raise adapter_error(exc, name) from None
                rec.pinned = True
            _demote(engine, rec, body)
            supply.set_warm(name, body.warm)
            return web.json_response(
                _info_body("already_loaded", rec, info or engine.adapter_info(rec.key), supply)
            )
        try:
            info = await supply.load(
                name, body.lora_path, sha256=body.sha256, pinned=body.pinned, warm=body.warm, draft=draft
            )
        except LoadSuperseded:
            raise supply.catalog_conflict(name, body.lora_path, body.sha256, draft) or ApiError(
                409,
                f"adapter {name!r} changed during the load: retry",
                param="lora_name",
                code="adapter_conflict",
            ) from None
        except ApiError as exc:
            raise _load_conflict(exc, engine, name) from None
        state.metrics.adapter_loads.labels("admin", "loaded").inc()
        return web.json_response(_loaded_body(state, engine, state.adapters[name], info, body))


def _demote(engine, rec: AdapterRecord, body) -> None:
    """``warm: false`` without ``pinned`` on a pinned adapter: it may leave its slot and the
    cache again."""
    if not body.warm and rec.pinned and not body.pinned:
        engine.unpin_adapter(rec.key)
        rec.pinned = False


def _loaded_body(state, engine, rec: AdapterRecord, info, body) -> dict:
    """The answer to a load that loaded: the adapter and the policy's warnings."""
    other_pinned = sum(1 for i in engine.list_adapters() if i.pinned and i.name != rec.key)
    warnings = _policy_warnings(state.config, rec, info, other_pinned)
    floating = check_source_revision("lora_path", body.lora_path, sha256=body.sha256)
    if floating is not None:
        warnings.append(floating.render())
    for w in warnings:
        log.warning("adapter %s: %s", rec.name, w)
    return _info_body("loaded", rec, info, state.supply, warnings)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    state.require_engine()
    name = parse_unload_adapter(await read_body(request))
    async with state.adapter_lock(name):
        # In-flight requests finish with the adapter; it is freed when the last one ends.
        # A catalogued adapter stays registered: the next request for it loads it again.
        loaded = state.supply.unload(name)
        return web.json_response({"status": "unloaded" if loaded else "not_loaded", "lora_name": name})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """``POST /reset_prefix_cache`` (vLLM's route): drop every cached prompt prefix, of every
    adapter and the base model; requests running now are unaffected."""
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    engine = state.require_engine()
    freed = await asyncio.wrap_future(engine.reset_prefix_cache())
    return web.json_response({"status": "reset", "freed_tokens": int(freed)})


async def get_lora_catalog(request: web.Request) -> web.Response:
    """``GET /v1/lora_catalog``: the pod's catalog, its digest, whether the operator has
    pushed it since start (``confirmed``) and each adapter's state here: its ``version``,
    the ``serving_versions`` still loaded (the current one first) and, while it loads, for
    how long (``loading_for_s``) and on what (``waiting_on``)."""
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    supply = state.supply
    return web.json_response(
        {
            "digest": supply.digest,
            "ready": supply.catalog_ready,
            "confirmed": supply.confirmed,
            "error": supply.catalog_error,
            "adapters": supply.listing(),
        }
    )


async def put_lora_catalog(request: web.Request) -> web.Response:
    """``PUT /v1/lora_catalog``: replace the catalog (the operator's push); idempotent.
    Taken while the model still loads too, so a new pod is confirmed by the time it serves."""
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    if state.engine is not None or state.load_error or state.draining:
        state.require_engine()  # a pod that failed or shuts down takes no catalog
    try:
        entries = parse_catalog(await read_body(request), reserved=state.base_names)
    except CatalogError as exc:
        raise invalid(str(exc), param=exc.field) from None
    change = state.supply.replace_catalog(entries, pushed=True)
    if change.added or change.removed or change.changed:
        log.info(
            "adapter catalog %s: added %s, removed %s, changed %s, unloaded %s",
            state.supply.digest,
            list(change.added),
            list(change.removed),
            list(change.changed),
            list(change.unloaded),
        )
    return web.json_response(
        {
            "digest": state.supply.digest,
            "added": list(change.added),
            "removed": list(change.removed),
            "changed": list(change.changed),
            "unloaded": list(change.unloaded),
        }
    )


def _load_conflict(exc: ApiError, engine, name: str) -> ApiError:
    """The engine names its own field ``name``; this API's is ``lora_name``. A name whose
    previous adapter still finishes in-flight requests answers 503 ``adapter_draining``
    with ``Retry-After`` (the load succeeds once they end; a 409 would read as final)."""
    if exc.param != "name":
        return exc
    exc.param = "lora_name"
    if exc.status == 503 and draining_adapter(engine, name) is not None:
        exc.code = "adapter_draining"
        exc.headers = {**exc.headers, "Retry-After": str(RETRY_AFTER_S)}
    return exc
