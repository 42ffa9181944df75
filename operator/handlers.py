"""kopf handlers of the operator: thin wiring from watch events to the reconcile loops.

Importing this module registers, on kopf's default registry:

* ``runtime_pods``: an index of the runtime pods, by (namespace, serve);
* event handlers on runtime Pods, runtime Deployments, LoRAServes and Adapters that only
  wake the loops concerned (many events coalesce into one pass);
* one daemon per LoRAServe and one per Adapter, each a loop of reconcile passes, woken by
  events and at least every ``resync_interval_s``;
* the Adapter deletion handler (behind kopf's finalizer) that unloads it from every pod.

All decisions live in ``loraserve.operator.reconcile``; the shared state (clients,
settings, wake-up flags) is the :class:`OperatorContext` in ``memo.ctx``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import kopf

from .desired import MANAGER, SERVE_NAME_ANNOTATION
from .index import lookup_adapters
from .reconcile import adapters as adapter_pass
from .reconcile import catalog as catalog_pass
from .reconcile import serve as serve_pass
from .reconcile.context import OperatorContext, adapter_key, serve_key
from .reconcile.kube import ADAPTERS, LORASERVES
from .reconcile.pods import PodView, pod_view
from .specs import ADAPTER_PLURAL, GROUP, LORASERVE_PLURAL, VERSION, parse_loraserve_spec
from .status import iso

logger = logging.getLogger(__name__)

MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
ERROR_BACKOFF_S = (1.0, 60.0)
CATALOG_RETRY_S = 2.0
"""A pod that did not take the catalog push (a starting pod still loading its model among
them) is tried again this soon: a new pod turns Ready within about this long of its load."""
CATALOG_WAIT_S, CATALOG_POLL_S = 10.0, 0.2
"""A deleted Adapter's finalizer first waits this long (polling) for its pods' catalogs to
drop it, so the usual deletion needs no retry (kopf logs each retry as an error)."""
CATALOG_WAIT_TRIES = 30
"""Then it retries this many times before giving up with a Warning Event."""
"""A pass that raised is tried again after 1 s, doubling up to 60 s."""


def _ctx(memo: Any) -> OperatorContext:
    return memo.ctx


# --------------------------------------------------------------------------- pods and events


@kopf.index("v1", "pods", labels=MANAGED)
def runtime_pods(body: kopf.Body, **_: Any) -> dict | None:
    """``(namespace, serve name)`` -> the serve's runtime pods, as :class:`PodView`."""
    view = pod_view(body)
    return {(view.namespace, view.serve): view} if view else None


def _wake_serve_and_adapters(
    ctx: OperatorContext, namespace: str, serve: str, adapters_by_serve: Any
) -> None:
    ctx.wakers.wake(serve_key(namespace, serve))
    for adapter in lookup_adapters(adapters_by_serve, namespace, serve):
        ctx.wakers.wake(adapter_key(namespace, adapter.name))


@kopf.on.event("v1", "pods", labels=MANAGED)
def pod_changed(body: kopf.Body, memo: kopf.Memo, adapters_by_serve: kopf.Index, **_: Any) -> None:
    """A runtime pod appeared, changed readiness or left: its serve and adapters take a pass."""
    view = pod_view(body)
    if view is not None:
        _wake_serve_and_adapters(_ctx(memo), view.namespace, view.serve, adapters_by_serve)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def deployment_changed(meta: kopf.Meta, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    """A runtime Deployment changed (rollout progress, replicas): its serve reports it."""
    serve = (meta.get("annotations") or {}).get(SERVE_NAME_ANNOTATION)
    if serve:
        _ctx(memo).wakers.wake(serve_key(namespace, serve))


@kopf.on.event(GROUP, VERSION, LORASERVE_PLURAL)
def serve_changed(
    event: Mapping,
    meta: kopf.Meta,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    adapters_by_serve: kopf.Index,
    **_: Any,
) -> None:
    """A LoRAServe's spec changed, or it came or went: it and its adapters take a pass."""
    ctx = _ctx(memo)
    key = serve_key(namespace, name)
    if event.get("type") in ("ADDED", "DELETED", None) or ctx.synced_generation.get(key) != meta.get(
        "generation"
    ):
        _wake_serve_and_adapters(ctx, namespace, name, adapters_by_serve)


@kopf.on.event(GROUP, VERSION, ADAPTER_PLURAL)
def adapter_changed(
    event: Mapping, meta: kopf.Meta, spec: kopf.Spec, name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """An Adapter's spec changed: it takes a pass, and its serve updates its pods' catalog."""
    ctx = _ctx(memo)
    key = adapter_key(namespace, name)
    if ctx.synced_generation.get(key) != meta.get("generation") or meta.get("deletionTimestamp"):
        ctx.wakers.wake(key)
    serve = spec.get("serve")
    # The serve keeps its pods' adapter catalog: it recounts and pushes on every change.
    changed = ctx.synced_generation.get(key) != meta.get("generation") or meta.get("deletionTimestamp")
    if (event.get("type") in ("ADDED", "DELETED") or changed) and isinstance(serve, str):
        ctx.wakers.wake(serve_key(namespace, serve))


# --------------------------------------------------------------------------- the loops


async def _sleep(flag: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    """Wait for a wake-up, the daemon's stop, or the timeout, whichever comes first."""
    waiters = [asyncio.ensure_future(flag.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=max(timeout, 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def _loop(
    stopped: kopf.DaemonStopped,
    ctx: OperatorContext,
    key: tuple,
    one_pass: Callable[[], Awaitable[float | None]],
    log: logging.Logger | logging.LoggerAdapter,
) -> None:
    """Run passes until stopped: after each, sleep until woken or the next due time."""
    flag = ctx.wakers.flag(key)
    failures = 0
    while not stopped:
        flag.clear()
        try:
            wake_in = await one_pass()
            failures = 0
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            failures += 1
            wake_in = min(ERROR_BACKOFF_S[0] * 2 ** (failures - 1), ERROR_BACKOFF_S[1])
            log.warning("reconcile pass failed (%s); again in %.0f s", exc, wake_in, exc_info=failures == 1)
        if wake_in is None:
            wake_in = ctx.config.resync_interval_s
        await _sleep(flag, stopped, min(wake_in, ctx.config.resync_interval_s))


def _post(body: Mapping, type_: str, reason: str, message: str) -> None:
    try:
        kopf.event(dict(body), type=type_, reason=reason, message=message)
    except Exception as exc:  # an Event is a report: never let it fail a pass
        logger.debug("could not post event %s: %s", reason, exc)


@kopf.daemon(GROUP, VERSION, LORASERVE_PLURAL, id="reconcile", cancellation_timeout=30.0)
async def serve_daemon(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    logger: kopf.Logger,
    adapters_by_serve: kopf.Index,
    runtime_pods: kopf.Index,
    **_: Any,
) -> None:
    """The LoRAServe's reconcile loop: owned objects, status and the pods' catalog follow the spec."""
    ctx = _ctx(memo)
    key = serve_key(namespace, name)

    async def one_pass() -> float | None:
        body = await ctx.kube.get(LORASERVES, namespace, name)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None
        generation = body["metadata"].get("generation")
        adapters = lookup_adapters(adapters_by_serve, namespace, name)
        outcome = await serve_pass.reconcile_serve(
            ctx.kube,
            body,
            ctx.settings,
            adapters=len(adapters),
            now=iso(time.time()),
            catalog=[(a.name, a.spec) for a in adapters if not a.deleting],
        )
        wake_in = None
        if outcome.catalog is not None:
            sync = await _push_catalog(ctx, body, _serve_pods(runtime_pods, namespace, name), outcome.catalog)
        changed_spec = ctx.synced_generation.get(key) != generation
        ctx.synced_generation[key] = generation
        for act in outcome.acts:
            _post(
                body,
                "Normal",
                act.verb,
                f"{act.verb} {act.kind} {act.name}" + (f" ({act.detail})" if act.detail else ""),
            )
        if outcome.rolled_from:
            _post(
                body,
                "Normal",
                "RollingUpdate",
                f"pods roll: config {outcome.rolled_from} -> {outcome.config_hash}",
            )
        if outcome.rejected and changed_spec:
            _post(body, "Warning", "SpecRejected", "; ".join(outcome.rejected))
        if changed_spec or outcome.acts or (outcome.catalog is not None and sync.pushed):
            for adapter in adapters:
                ctx.wakers.wake(adapter_key(namespace, adapter.name))
        if outcome.catalog is not None and sync.again_soon:
            wake_in = await _push_until_taken(
                ctx, key, stopped, body, lambda: _serve_pods(runtime_pods, namespace, name), outcome.catalog
            )
        return wake_in

    try:
        await _loop(stopped, ctx, key, one_pass, logger)
    finally:
        ctx.wakers.drop(key)
        ctx.synced_generation.pop(key, None)
        # Adapters of a serve that goes away become Pending.
        for adapter in lookup_adapters(adapters_by_serve, namespace, name):
            ctx.wakers.wake(adapter_key(namespace, adapter.name))


async def _none() -> None:
    return None


async def _push_catalog(
    ctx: OperatorContext, body: Mapping, pods: list[PodView], entries: tuple
) -> catalog_pass.CatalogSync:
    meta = body.get("metadata") or {}
    spec = parse_loraserve_spec(dict(body.get("spec") or {}))  # parsed already by the pass
    token = await adapter_pass.read_token(ctx, meta["namespace"], meta["name"], spec)
    return await catalog_pass.sync_catalog(ctx, pods, token, entries)


async def _push_until_taken(
    ctx: OperatorContext,
    key: tuple,
    stopped: kopf.DaemonStopped,
    body: Mapping,
    pods: Callable[[], list[PodView]],
    entries: tuple,
) -> float | None:
    """Push the catalog again every :data:`CATALOG_RETRY_S` while a pod has not taken it (a
    starting pod loading its model): only the push, not the whole serve pass. Ends when every
    pod took it (None: sleep until the next event or resync), when an event wakes the serve
    (its full pass comes next), or after one resync interval (0: a full pass now)."""
    flag, deadline = ctx.wakers.flag(key), time.monotonic() + ctx.config.resync_interval_s
    while not stopped and not flag.is_set():
        if time.monotonic() >= deadline:
            return 0.0
        await _sleep(flag, stopped, CATALOG_RETRY_S)
        if flag.is_set() or stopped:
            break
        if not (await _push_catalog(ctx, body, pods(), entries)).again_soon:
            return None
    return None


def _serve_pods(runtime_pods: kopf.Index, namespace: str, serve: object) -> list[PodView]:
    if not isinstance(serve, str):
        return []
    return list(runtime_pods.get((namespace, serve), ()))


@kopf.daemon(GROUP, VERSION, ADAPTER_PLURAL, id="reconcile", cancellation_timeout=30.0)
async def adapter_daemon(
    stopped: kopf.DaemonStopped,
    name: str,
    namespace: str,
    spec: kopf.Spec,
    memo: kopf.Memo,
    logger: kopf.Logger,
    runtime_pods: kopf.Index,
    **_: Any,
) -> None:
    """The Adapter's reconcile loop: loaded in every targeted ready pod of its serve."""
    ctx = _ctx(memo)
    key = adapter_key(namespace, name)
    memory = adapter_pass.AdapterMemory()

    async def one_pass() -> float | None:
        async with ctx.adapter_lock(key):
            if stopped:
                return None
            # The serve is immutable in an Adapter's spec: both reads go out together.
            serve_name = spec.get("serve")
            body, serve_body = await asyncio.gather(
                ctx.kube.get(ADAPTERS, namespace, name),
                ctx.kube.get(LORASERVES, namespace, serve_name) if isinstance(serve_name, str) else _none(),
            )
            if body is None or body.get("metadata", {}).get("deletionTimestamp"):
                return None
            ctx.synced_generation[key] = body["metadata"].get("generation")
            pods = _serve_pods(runtime_pods, namespace, (body.get("spec") or {}).get("serve"))
            outcome = await adapter_pass.reconcile_adapter(
                ctx, body, memory, pods, serve_body=serve_body, stopping=lambda: bool(stopped)
            )
        for note in outcome.notes:
            _post(body, note.type, note.reason, note.message)
        return outcome.wake_in

    try:
        await _loop(stopped, ctx, key, one_pass, logger)
    finally:
        ctx.wakers.drop(key)
        ctx.synced_generation.pop(key, None)
        lock = ctx.adapter_locks.get(key)
        if lock is not None and not lock.locked():
            ctx.adapter_locks.pop(key, None)


async def _wait_for_catalogs(
    ctx: OperatorContext, serve: tuple, pods: list[PodView], token: str | None, name: str
) -> dict[str, str]:
    """Pods that still list ``name`` after the serve's pass had a few seconds to push."""
    deadline = time.monotonic() + CATALOG_WAIT_S
    while True:
        listing = await catalog_pass.pods_still_listing(ctx, pods, token, name)
        if not listing or time.monotonic() >= deadline:
            return listing
        ctx.wakers.wake(serve)
        await asyncio.sleep(CATALOG_POLL_S)


@kopf.on.delete(GROUP, VERSION, ADAPTER_PLURAL, id="unload")
async def adapter_deleted(
    body: kopf.Body,
    name: str,
    namespace: str,
    memo: kopf.Memo,
    retry: int,
    logger: kopf.Logger,
    runtime_pods: kopf.Index,
    **_: Any,
) -> None:
    """Take a deleted Adapter out of every pod before kopf releases its finalizer.

    The serve's pass drops it from the catalog (ConfigMap and every pod's copy, which
    unloads it; requests in flight finish); this handler unloads it wherever it is still
    loaded and waits until no ready pod lists it. Pods that do not answer are tried again
    with backoff; after the last try they are given up on with a Warning Event (a pod that
    cannot be reached loses its adapters when it restarts anyway).
    """
    ctx = _ctx(memo)
    serve = (body.get("spec") or {}).get("serve")
    if isinstance(serve, str):
        ctx.wakers.wake(serve_key(namespace, serve))
    async with ctx.adapter_lock(adapter_key(namespace, name)):
        pods = _serve_pods(runtime_pods, namespace, serve)
        done, failed = await adapter_pass.unload_everywhere(ctx, body, pods)
        listing: dict[str, str] = {}
        if not failed and isinstance(serve, str):
            token = await adapter_pass.serve_token(ctx, namespace, serve)
            listing = await _wait_for_catalogs(ctx, serve_key(namespace, serve), pods, token, name)
    for pod in done:
        logger.info("unloaded from pod %s", pod)
    if failed:
        summary = "; ".join(f"{pod}: {why}" for pod, why in sorted(failed.items()))
        if retry + 1 < ctx.config.unload_max_tries:
            raise kopf.TemporaryError(f"unload failed on {summary}", delay=ctx.retry.delay_after(retry + 1))
        _post(body, "Warning", "UnloadAbandoned", f"gave up unloading after {retry + 1} tries: {summary}")
    elif listing:
        summary = "; ".join(f"{pod}: {why}" for pod, why in sorted(listing.items()))
        if retry + 1 < CATALOG_WAIT_TRIES:
            raise kopf.TemporaryError(f"waiting for the catalog push: {summary}", delay=CATALOG_RETRY_S)
        _post(
            body, "Warning", "CatalogPushAbandoned", f"pods still list it after {retry + 1} tries: {summary}"
        )
