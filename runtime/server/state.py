"""What the HTTP handlers share: configuration, the engine once loaded, the adapter supply."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from ..contract.config import RuntimeConfig
from ..distributed.health import failure_reason as tp_failure_reason
from ..engine import Engine
from ..lora.sources import SourceSettings
from ..tokenizer import Tokenizer
from .adapter_supply import AdapterRecord, AdapterSupply, public_message
from .errors import ApiError
from .metrics import Metrics

__all__ = ["STATE", "AdapterRecord", "ServerState", "served_model_name"]

DRAIN_RETRY_AFTER_S = 1
"""``Retry-After`` on requests refused while draining: soon, and most likely elsewhere."""


def served_model_name(config: RuntimeConfig) -> str:
    """The ``model`` name clients use for the base model."""
    if config.model.served_name:
        return config.model.served_name
    path = config.model.path.rstrip("/")
    return Path(path).name or path or "base"


def draining_adapter(engine: Engine, name: str):
    """The engine's entry for ``name`` while it is unloaded but still serves requests."""
    info = engine.adapter_info(name)
    return info if info is not None and str(getattr(info, "state", "")) == "unloading" else None


class ServerState:
    """Shared by every handler of one app."""

    def __init__(
        self, config: RuntimeConfig, *, sources: SourceSettings, metrics: Metrics | None = None
    ) -> None:
        self.config = config
        self.served_name = served_model_name(config)
        self.base_names = {self.served_name, config.model.path} - {""}
        # The confinement (allowed local roots, remote hosts) is the configuration's.
        sources = sources.with_config(config.server)
        self.sources = sources
        self.metrics = metrics or Metrics(self.served_name)
        self.metrics.snapshot = lambda: self.engine.snapshot if self.engine is not None else None
        self.metrics.adapters_loaded = lambda: len(self.supply.loaded_names())
        self.engine: Engine | None = None
        self.tokenizer: Tokenizer | None = None
        self.load_error: str | None = None
        self.draining = False
        self.in_flight = 0
        """Requests being handled (probes aside); a drain waits for them."""
        self.started = int(time.time())
        self.supply = AdapterSupply(config, sources, self.metrics, reserved=frozenset(self.base_names))

    @property
    def adapters(self) -> dict[str, AdapterRecord]:
        """Where each loaded adapter came from."""
        return self.supply.records

    @property
    def admin_token(self) -> str | None:
        return self.config.server.admin_token

    @property
    def ready(self) -> bool:
        return (
            self.engine is not None
            and self.engine.running
            and not self.draining
            and self.supply.catalog_ready
            and (self.supply.confirmed or not self.config.lora.catalog_confirm)
            and tp_failure_reason() is None
        )

    def attach(self, engine: Engine, tokenizer: Tokenizer) -> None:
        """The model is loaded: serve it. Adapters loaded at start-up get their records."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.supply.attach(engine)

    def begin_drain(self) -> None:
        """Shutting down: refuse new work (``/ready`` and new requests 503), keep the old."""
        self.draining = True
        if self.engine is not None:
            self.engine.stop_accepting()

    def require_engine(self) -> Engine:
        """The engine, or 503 while loading, after a failed load, or while shutting down."""
        if self.draining:
            raise ApiError(
                503,
                "the server is shutting down and accepts no new requests: retry (another replica "
                "will answer)",
                code="shutting_down",
                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)},
            )
        failure = tp_failure_reason()
        if failure is not None:
            raise ApiError(503, f"a tensor-parallel rank failed: {failure}", code="tensor_parallel_failed")
        if self.engine is None or not self.engine.running:
            if self.load_error:
                raise ApiError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
            raise ApiError(
                503,
                "the model is still loading: retry shortly",
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        return self.engine

    @contextlib.asynccontextmanager
    async def use_model(self, model: str | None) -> AsyncIterator[str | None]:
        """The engine key of the adapter a ``model`` field names (None for the base model),
        held for the block: the version current when the request arrived, for its whole life.

        A catalogued adapter this pod does not hold is loaded first (the request waits up
        to ``lora.load_timeout_s``); a name in no catalog and not loaded is a 404 (after the
        catalog file is checked for it). Errors name the adapter, never its engine key.
        """
        if model is None or model in self.base_names:
            yield None
            return
        self.require_engine()
        async with self.supply.serve(model) as key:
            try:
                yield key
            except ApiError as exc:
                exc.message = public_message(exc.message, model)
                raise

    def adapter_lock(self, name: str):
        """Serialises admin calls and on-demand loads for one adapter name."""
        return self.supply.lock(name)


STATE = web.AppKey("loraserve_state", ServerState)
