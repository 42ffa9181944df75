"""Admin routes: load and unload LoRA adapters (bearer-token protected when configured).

Names and bodies follow the convention other servers use (``/v1/load_lora_adapter``
``{lora_name, lora_path}``), plus ``sha256`` and ``pinned``. Loading is idempotent: the
same name from the same source answers 200 without loading again; the same name from a
different source is a 409 until the old one is unloaded. Unloading is idempotent too.
The adapter's bytes are fetched and verified here (``loraserve.runtime.lora.sources``);
errors that are the adapter's fault answer 4xx, transient ones (a source unreachable,
the pool momentarily full) 5xx, so a caller knows whether retrying can help.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from ..engine import EngineError
from ..lora import AdapterError
from ..lora.sources import SourceError, resolve_source
from ..policy import AdapterDeclaration, check_adapter
from .auth import check_bearer
from .errors import ApiError, invalid
from .openai_api import read_body
from .schemas import parse_load_adapter, parse_unload_adapter
from .state import STATE, AdapterRecord

log = logging.getLogger("loraserve.server")


def _adapter_error(exc: AdapterError) -> ApiError:
    status = int(getattr(exc, "http_status", 400))
    code = {404: "adapter_not_found", 409: "adapter_conflict", 503: "adapter_capacity"}.get(
        status, "invalid_adapter"
    )
    return ApiError(status, str(exc), param=exc.field or "lora_path", code=code)


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


def _info_body(status: str, rec: AdapterRecord, info, warnings: list[str] | None = None) -> dict:
    return {
        "status": status,
        "lora_name": rec.name,
        "lora_path": rec.source,
        "sha256": rec.sha256,
        "pinned": bool(getattr(info, "pinned", rec.pinned)),
        "rank": getattr(info, "rank", None),
        "target_modules": list(getattr(info, "target_modules", ()) or ()),
        "warnings": warnings or [],
    }


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    engine = state.require_engine()
    body = parse_load_adapter(await read_body(request))
    name = body.lora_name
    if name in state.base_names:
        raise invalid(f"lora_name {name!r} is the base model's name: choose another", param="lora_name")
    async with state.adapter_lock(name):
        rec = state.adapters.get(name)
        if rec is not None and name in engine.adapter_names:
            same = rec.source == body.lora_path and (body.sha256 is None or body.sha256 == rec.sha256)
            if not same:
                raise ApiError(
                    409,
                    f"adapter {name!r} is already loaded from {rec.source!r}"
                    + (f" (sha256 {rec.sha256})" if rec.sha256 else "")
                    + ": unload it first or choose another lora_name",
                    param="lora_name",
                    code="adapter_conflict",
                )
            info = None
            if body.pinned and not rec.pinned:
                try:
                    info = await asyncio.to_thread(engine.load_adapter, name, rec.local_path, pinned=True)
                except AdapterError as exc:
                    raise _adapter_error(exc) from None
                rec.pinned = True
            return web.json_response(_info_body("already_loaded", rec, info or _find(engine, name)))
        try:
            local = await resolve_source(body.lora_path, state.sources, sha256=body.sha256)
        except SourceError as exc:
            status = 502 if exc.transient else 400
            raise ApiError(
                status,
                str(exc),
                param=exc.field,
                code="source_unavailable" if exc.transient else "invalid_source",
            ) from None
        try:
            info = await asyncio.to_thread(engine.load_adapter, name, local, pinned=body.pinned)
        except AdapterError as exc:
            raise _adapter_error(exc) from None
        except EngineError as exc:
            raise ApiError.from_request_error(exc.error) from None
        rec = AdapterRecord(name, body.lora_path, body.sha256, str(local), body.pinned, int(time.time()))
        state.adapters[name] = rec
        other_pinned = sum(1 for i in engine.list_adapters() if i.pinned and i.name != name)
        warnings = _policy_warnings(state.config, rec, info, other_pinned)
        for w in warnings:
            log.warning("adapter %s: %s", name, w)
        return web.json_response(_info_body("loaded", rec, info, warnings))


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    check_bearer(request, state.admin_token)
    engine = state.require_engine()
    name = parse_unload_adapter(await read_body(request))
    async with state.adapter_lock(name):
        if name not in engine.adapter_names:
            state.adapters.pop(name, None)
            return web.json_response({"status": "not_loaded", "lora_name": name})
        try:
            await asyncio.to_thread(engine.unload_adapter, name)
        except AdapterError as exc:
            raise _adapter_error(exc) from None
        state.adapters.pop(name, None)
        # In-flight requests finish with the adapter; it is freed when the last one ends.
        return web.json_response({"status": "unloaded", "lora_name": name})


def _find(engine, name: str):
    for info in engine.list_adapters():
        if info.name == name:
            return info
    return None
