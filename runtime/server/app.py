"""The aiohttp application: routes, middlewares and the engine's lifecycle.

The app answers ``/health`` from the first moment; the model loads in a worker thread
(``engine_factory``), the CUDA graphs are warmed up (:mod:`..engine.warmup`), and ``/ready``
turns 200 when it is serving. :func:`drain` (the CLI
calls it on SIGTERM, while the socket still listens) stops admitting: ``/ready`` answers
503 ``shutting_down``, new generation requests 503 with ``Retry-After``, and in-flight
requests run to their end or until the drain timeout. Shutdown then stops the engine,
aborting anything still running.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from aiohttp import web

from ..contract.catalog import CatalogError
from ..contract.config import RuntimeConfig
from ..engine import Engine
from ..engine.warmup import warm_up
from ..lora.sources import SourceSettings
from ..tokenizer import Tokenizer
from . import admin_api, health_api, limits, openai_api
from .errors import MAX_BODY_KEY, error_middleware, quiet_client_faults
from .metrics import Metrics
from .state import STATE, ServerState

log = logging.getLogger("loraserve.server")

EngineFactory = Callable[[Metrics], tuple[Engine, Tokenizer]]
"""Builds and returns (engine, tokenizer) on a worker thread; the engine must report to
the given metrics (``observer=``)."""

_LOAD_TASK = web.AppKey("loraserve_load_task", asyncio.Task)
_CATALOG_TASK = web.AppKey("loraserve_catalog_task", asyncio.Task)
CATALOG_RETRY_S = 2.0
_DRAIN_S = web.AppKey("loraserve_drain_s", float)


_PROBES = frozenset({"/health", "/ready", "/metrics"})


@web.middleware
async def in_flight_middleware(request: web.Request, handler):
    """Counts the requests being handled (probes aside), which a drain waits for."""
    if request.path in _PROBES:
        return await handler(request)
    state = request.app[STATE]
    state.in_flight += 1
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1


CLIENT_CLOSED = 499
"""The status counted for a request whose handler was cancelled: its client closed the
connection, or the server cut it (nginx's convention; no response is sent)."""


@web.middleware
async def http_metrics_middleware(request: web.Request, handler):
    state = request.app[STATE]
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unmatched"
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED  # the client left (or its connection was cut): not a server error
        raise
    finally:
        state.metrics.http_requests.labels(name, str(status)).inc()


def build_app(
    config: RuntimeConfig,
    engine_factory: EngineFactory,
    *,
    sources: SourceSettings | None = None,
    drain_timeout_s: float = 30.0,
    exit_on_load_failure: bool = False,
) -> web.Application:
    """The runtime's HTTP app; the model loads in the background once the app starts.

    ``exit_on_load_failure``: when the model cannot load, stop the process (SIGTERM to
    itself) instead of answering 503 forever, so an orchestrator sees the failure.
    """
    if sources is None:
        sources = SourceSettings(cache_dir=config.server.adapter_cache_dir)
    quiet_client_faults()
    state = ServerState(config, sources=sources)
    app = web.Application(
        client_max_size=config.server.max_body_bytes,
        middlewares=[in_flight_middleware, http_metrics_middleware, error_middleware],
    )
    app[STATE] = state
    app[MAX_BODY_KEY] = config.server.max_body_bytes
    app[_DRAIN_S] = drain_timeout_s
    limits.install(app)
    body = {"expect_handler": limits.expect_handler}  # routes that take a body
    app.router.add_get("/health", health_api.health)
    app.router.add_get("/ready", health_api.ready)
    app.router.add_get("/metrics", health_api.metrics)
    app.router.add_get("/v1/models", openai_api.list_models)
    # Adapter names may hold "/" (org/name), so the id is the rest of the path.
    app.router.add_get("/v1/models/{model_id:.+}", openai_api.retrieve_model)
    app.router.add_post("/v1/completions", openai_api.completions, **body)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions, **body)
    app.router.add_post("/v1/load_lora_adapter", admin_api.load_lora_adapter, **body)
    app.router.add_post("/v1/unload_lora_adapter", admin_api.unload_lora_adapter, **body)
    app.router.add_get("/v1/lora_catalog", admin_api.get_lora_catalog)
    app.router.add_put("/v1/lora_catalog", admin_api.put_lora_catalog, **body)
    app.router.add_post("/reset_prefix_cache", admin_api.reset_prefix_cache, **body)

    async def load_model() -> None:
        try:
            engine, tokenizer = await asyncio.to_thread(engine_factory, state.metrics)
        except Exception as exc:
            log.exception("loading the model failed")
            state.load_error = str(exc) or type(exc).__name__
            if exit_on_load_failure:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        _register_decoder_metrics(state, engine)
        engine.start()
        # Graphs captured now, not inside the first requests; /ready stays 503 meanwhile.
        try:
            report = await asyncio.to_thread(warm_up, engine)
        except asyncio.CancelledError:
            engine.shutdown(drain_timeout_s=0.0)
            raise
        except Exception as exc:
            # A forward that fails at a graph's shape would fail requests too: the load fails.
            log.exception("warming up the CUDA graphs failed")
            state.load_error = f"warming up the CUDA graphs failed: {str(exc) or type(exc).__name__}"
            await asyncio.to_thread(engine.shutdown, 0.0)
            if exit_on_load_failure:
                os.kill(os.getpid(), signal.SIGTERM)
            return
        if report is not None:
            state.metrics.warmup_seconds.labels(state.metrics.model_name).set(report.seconds)
        state.attach(engine, tokenizer)
        log.info("serving %s", state.served_name)

    async def on_startup(app: web.Application) -> None:
        app[_LOAD_TASK] = asyncio.create_task(load_model())
        if config.lora.catalog is not None:
            app[_CATALOG_TASK] = asyncio.create_task(_read_catalog(state, config.lora.catalog))

    async def on_shutdown(app: web.Application) -> None:
        # Before aiohttp waits for in-flight handlers: refuse new work, keep the old.
        state.begin_drain()

    async def on_cleanup(app: web.Application) -> None:
        for key in (_LOAD_TASK, _CATALOG_TASK):
            task = app.get(key)
            if task is not None and not task.done():
                task.cancel()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown, app[_DRAIN_S])

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    app.on_cleanup.append(on_cleanup)
    return app


async def drain(
    app: web.Application, timeout_s: float | None = None, *, hurry: asyncio.Event | None = None
) -> bool:
    """Stop admitting and wait until the requests in flight are done; the listener stays
    open meanwhile, so probes and new requests get an answer (503) instead of a refused
    connection. Waits at most ``timeout_s`` (default: the app's drain timeout) or until
    ``hurry`` is set; True when nothing was left in flight."""
    state = app[STATE]
    state.begin_drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (app[_DRAIN_S] if timeout_s is None else timeout_s)
    if state.in_flight:
        log.info("draining %d in-flight request(s), at most %.0f s", state.in_flight, deadline - loop.time())
    while state.in_flight > 0 and loop.time() < deadline and not (hurry is not None and hurry.is_set()):
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.warning("drain ended with %d request(s) still in flight; they are aborted", state.in_flight)
    return state.in_flight == 0


async def _read_catalog(state: ServerState, path: str) -> None:
    """Read the catalog file before the pod turns ready; retry until it can be read (a
    ConfigMap not yet projected) or the operator pushes one. Later, a request for a name
    in no catalog rereads the file if it changed (``AdapterSupply.refresh_from_file``)."""
    while not state.supply.catalog_ready:
        try:
            entries = state.supply.read_file(path)
        except CatalogError as exc:
            if state.supply.catalog_error != str(exc):
                log.warning("%s; not ready until it can be read (retrying every %g s)", exc, CATALOG_RETRY_S)
            state.supply.catalog_error = str(exc)
            await asyncio.sleep(CATALOG_RETRY_S)
            continue
        if not state.supply.catalog_ready:  # a push may have come first: it is newer
            state.supply.replace_catalog(entries)
            log.info("adapter catalog %s: %d adapters", state.supply.digest, len(entries))


def _register_decoder_metrics(state: ServerState, engine: Engine) -> None:
    """A decoder with its own live counters (speculation) exposes them on /metrics too."""
    metrics = getattr(engine.decoder, "metrics", None)
    collector = getattr(metrics, "collector", None)
    if collector is None:
        return
    try:
        state.metrics.registry.register(collector())
    except ValueError:  # a name clash must not stop serving
        log.exception("the decoder's metrics could not be registered")


async def wait_until_ready(app: web.Application, timeout_s: float = 120.0) -> None:
    """Wait for the background model load (tests, the demo); raises if it failed."""
    state = app[STATE]
    task = app.get(_LOAD_TASK)
    if task is not None:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
    if state.load_error:
        raise RuntimeError(f"the model failed to load: {state.load_error}")
    if not state.ready:
        raise RuntimeError("the server is not ready")
