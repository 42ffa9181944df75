"""Probes and metrics: ``/health`` (process up), ``/ready`` (serving), ``/metrics``."""

from __future__ import annotations

from aiohttp import web

from ..distributed.health import failure_reason as tp_failure_reason
from .errors import ApiError
from .metrics import CONTENT_TYPE
from .state import STATE


async def health(request: web.Request) -> web.Response:
    """200 while the process runs, even while the model loads (a liveness probe)."""
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """200 once the model is loaded, the catalog read (and, with ``lora.catalog_confirm``,
    pushed by the operator since start-up) and requests are admitted; 503 before and while
    draining."""
    state = request.app[STATE]
    if state.ready:
        return web.json_response({"status": "ready", "model": state.served_name})
    if state.draining:
        raise ApiError(503, "shutting down", code="shutting_down")
    failure = tp_failure_reason()
    if failure is not None:
        raise ApiError(503, f"a tensor-parallel rank failed: {failure}", code="tensor_parallel_failed")
    if state.load_error:
        raise ApiError(503, f"the model failed to load: {state.load_error}", code="model_load_failed")
    if state.engine is not None and not state.supply.catalog_ready:
        reason = state.supply.catalog_error or "not read yet"
        raise ApiError(503, f"the adapter catalog is not loaded: {reason}", code="catalog_not_ready")
    if state.engine is not None and state.config.lora.catalog_confirm and not state.supply.confirmed:
        raise ApiError(
            503,
            "the adapter catalog has not been confirmed by the operator since start-up (lora.catalog_confirm): "
            "waiting for its push (PUT /v1/lora_catalog)",
            code="catalog_not_confirmed",
        )
    raise ApiError(503, "the model is still loading", code="model_loading")


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = state.metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
