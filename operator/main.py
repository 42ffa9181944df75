"""The operator process: kopf with LoRAServe/Adapter reconcile and the admission webhook.

:func:`run` starts one operator in the running event loop (tests and the benchmark call it
directly); :func:`main` is the ``loraserve-operator`` command.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

import kopf

from . import handlers as _handlers  # noqa: F401  (importing registers the kopf handlers)
from . import webhooks
from .config import ConfigError, OperatorConfig
from .reconcile.context import OperatorContext
from .reconcile.kube import KubeClient

logger = logging.getLogger("loraserve.operator")

PREFIX = "loraserve.io"
FINALIZER = f"{PREFIX}/finalizer"


def build_settings(config: OperatorConfig) -> kopf.OperatorSettings:
    """kopf settings: our own finalizer and annotations, peering, quiet posting."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    # Handler progress and the last-handled spec go to annotations: the CRDs' status schemas
    # would prune kopf's own status fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # Events are posted by the handlers themselves
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if config.peering_name:
        settings.peering.name = config.peering_name
        settings.peering.mandatory = True
        settings.peering.clusterwide = config.peering_clusterwide
        settings.peering.lifetime = config.peering_lifetime_s
    else:
        settings.peering.standalone = True
    return settings


def operator_registry(*, webhooks_enabled: bool) -> kopf.OperatorRegistry:
    """The handlers to run: all registered ones, less the admission handlers when the
    webhook is off (kopf refuses admission handlers without a server)."""
    default = kopf.get_default_registry()
    if webhooks_enabled:
        return default
    registry = kopf.OperatorRegistry()
    for part in ("_activities", "_indexing", "_watching", "_spawning", "_changing"):
        for handler in getattr(default, part).get_all_handlers():
            getattr(registry, part).append(handler)
    return registry


async def _login(settings: kopf.OperatorSettings, fixed: kopf.ConnectionInfo | None) -> kopf.ConnectionInfo:
    if fixed is not None:
        return fixed
    try:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
    except (OSError, ValueError, KeyError) as exc:
        raise kopf.PermanentError(
            f"cannot read the credentials (KUBECONFIG or the service account): {exc}"
        ) from exc
    if info is None:
        raise kopf.PermanentError("no in-cluster service account and no kubeconfig (set KUBECONFIG)")
    return info


@kopf.on.login()
async def login(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """The API credentials: fixed ones from :func:`run`, else in-cluster, else kubeconfig."""
    return await _login(settings, getattr(memo, "connection", None))


async def run(
    config: OperatorConfig,
    *,
    connection: kopf.ConnectionInfo | None = None,
    webhook: webhooks.WebhookServerConfig | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    context: list[OperatorContext] | None = None,
) -> None:
    """Run one operator until ``stop_flag`` is set (or a signal, in the main thread).

    ``connection`` fixes the API endpoint (otherwise in-cluster or kubeconfig credentials);
    ``webhook`` configures the admission server (otherwise from ``LORASERVE_WEBHOOK_*``
    when ``config.webhook_enabled``). ``context``, when given, receives the operator's
    :class:`OperatorContext` (its counters are read by tests and the benchmark).
    """
    settings = build_settings(config)
    serve_webhooks = config.webhook_enabled or webhook is not None
    if serve_webhooks:
        webhooks.configure_webhook_server(settings, webhook)
    kube = KubeClient(lambda: _login(settings, connection))
    ctx = OperatorContext.from_config(config, kube)
    if context is not None:
        context.append(ctx)
    memo = kopf.Memo(ctx=ctx, connection=connection)
    try:
        await kopf.operator(
            registry=operator_registry(webhooks_enabled=serve_webhooks),
            settings=settings,
            memo=memo,
            clusterwide=not config.namespaces,
            namespaces=list(config.namespaces),
            standalone=not config.peering_name,
            peering_name=config.peering_name,
            liveness_endpoint=config.liveness_endpoint,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        await ctx.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve-operator",
        description=(
            "Reconcile LoRAServe and Adapter objects and serve their admission webhook. Settings come "
            "from LORASERVE_* environment variables (see loraserve.operator.config); flags override them."
        ),
    )
    parser.add_argument(
        "--namespace", action="append", default=None, help="watch this namespace (repeatable)"
    )
    parser.add_argument("--peering", default=None, help="kopf peering name (for more than one replica)")
    parser.add_argument("--no-webhook", action="store_true", help="do not serve the admission webhook")
    parser.add_argument("--liveness", default=None, help="health endpoint, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--log-level", choices=("debug", "info", "warning"), default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``loraserve-operator`` command."""
    args = _parser().parse_args(argv)
    try:
        config = OperatorConfig.from_env()
        overrides: dict[str, Any] = {}
        if args.namespace:
            overrides["namespaces"] = tuple(args.namespace)
        if args.peering:
            overrides["peering_name"] = args.peering
        if args.no_webhook:
            overrides["webhook_enabled"] = False
        if args.liveness:
            overrides["liveness_endpoint"] = args.liveness
        if args.log_level:
            overrides["log_level"] = args.log_level
        if overrides:
            config = dataclasses.replace(config, **overrides)
    except ConfigError as exc:
        print(f"loraserve-operator: {exc}", file=sys.stderr)
        return 2
    level = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}[config.log_level]
    kopf.configure(verbose=level == logging.DEBUG, quiet=level == logging.WARNING)
    logging.getLogger().setLevel(level)
    try:
        # Fail fast with the reason: kopf would keep waiting for credentials that never come.
        asyncio.run(_login(build_settings(config), None))
    except kopf.PermanentError as exc:
        print(f"loraserve-operator: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run(config))
    except ValueError as exc:  # e.g. unreadable webhook certificate files, named in the message
        print(f"loraserve-operator: {exc}", file=sys.stderr)
        return 2
    return 0
