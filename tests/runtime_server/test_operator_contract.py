"""The operator's side of the catalog contract, against a real runtime server: it reads what
the runtime lists, pushes catalogs only where they differ, demotes warm adapters, waits for
a deleted adapter to leave every pod, and reads per-adapter accept lengths from /metrics.

Real parts only: the production runtime app on a real port, the operator's own client and
catalog pass over real HTTP, and the runtime's real Prometheus registry.
"""

from __future__ import annotations

import kopf
import pytest

from loraserve.operator.config import OperatorConfig
from loraserve.operator.reconcile.adapters import source_differs
from loraserve.operator.reconcile.catalog import pods_still_listing, sync_catalog
from loraserve.operator.reconcile.context import OperatorContext
from loraserve.operator.reconcile.kube import KubeClient
from loraserve.operator.reconcile.pods import PodView
from loraserve.operator.runtime_client import accept_stats
from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog
from loraserve.runtime.server.metrics import Metrics

from .conftest import ADMIN_TOKEN, make_config, running_server


def _pod(server) -> PodView:
    host, port = server.server.host, server.server.port
    return PodView(
        name="pod-0", namespace="ml", uid="u0", serve="tiny", ip=host, port=port, ready=True, terminating=False
    )


@pytest.mark.asyncio(loop_scope="module")
async def test_catalog_sync_lifecycle(assets, tmp_path):
    """Catalog sync listing demotion and deletion."""
    sql, chat = str(assets.demo.adapters["sql-r8"]), str(assets.demo.adapters["chat-r16"])
    config = make_config(assets, adapters={"chat": chat})
    config.lora.catalog = str(tmp_path / "catalog.json")
    (tmp_path / "catalog.json").write_text(encode_catalog([CatalogEntry("sql", sql)]))
    kube = KubeClient.from_info(kopf.ConnectionInfo(server="http://127.0.0.1:9"))  # never called here
    ctx = OperatorContext.from_config(OperatorConfig(webhook_enabled=False), kube)
    try:
        async with running_server(config, tmp_path / "srv") as server:
            pod = _pod(server)
            runtime = ctx.runtime(pod, ADMIN_TOKEN)
            models = await runtime.models()
            assert set(models.loaded) == {"chat"} and models.loaded["chat"].warm is True
            # The operator reads each adapter's real source (admin token), though /v1/models
            # shows no path of the pod to other clients; a changed Adapter source is still seen.
            assert models.loaded["chat"].source == chat and models.adapters["sql"].source == sql
            assert not source_differs(models.loaded["chat"], (chat, "pvc://adapters/chat"), None)
            assert source_differs(models.loaded["chat"], (sql, "pvc://adapters/sql"), None)
            public = await ctx.runtime(pod, None).models()
            assert public.loaded["chat"].source is None and public.adapters["sql"].source is None
            assert models.adapters["sql"].state == "registered" and not models.adapters["sql"].loaded

            entries = (CatalogEntry("extra", str(assets.extra_adapters["extra-0"])), CatalogEntry("sql", sql))
            first = await sync_catalog(ctx, [pod], ADMIN_TOKEN, entries)
            assert first.pushed == ["pod-0"] and not first.failed
            again = await sync_catalog(ctx, [pod], ADMIN_TOKEN, entries)
            assert again.current == ["pod-0"] and again.pushed == [], "an equal digest is not pushed again"
            assert set(server.state.supply.catalog) == {"extra", "sql"}
            wrong = await sync_catalog(ctx, [pod], "not-the-token", entries)
            assert "pod-0" in wrong.failed

            # The operator demotes a warm adapter when placement moves elsewhere.
            info = await runtime.load("chat", chat, warm=False)
            assert info.warm is False
            assert (await runtime.models()).loaded["chat"].warm is False

            # Deletion: the pod lists the adapter until the catalog push drops it.
            assert await pods_still_listing(ctx, [pod], ADMIN_TOKEN, "extra") == {
                "pod-0": "still lists 'extra' (registered)"
            }
            await sync_catalog(ctx, [pod], ADMIN_TOKEN, entries[1:])
            assert await pods_still_listing(ctx, [pod], ADMIN_TOKEN, "extra") == {}
    finally:
        await ctx.close()


def test_accept_length_per_adapter():
    """Accept length is read per adapter from the runtimes metrics."""
    metrics = Metrics("tiny-base")
    for model, accepted in (("sql", [3, 2, 4]), ("chat", [1]), ("tiny-base", [0, 0])):
        for value in accepted:
            metrics.accept_length.labels(model).observe(value)
    page = metrics.render().decode()
    assert accept_stats(page, "sql") == (9.0, 3.0)
    assert accept_stats(page, "chat") == (1.0, 1.0)
    assert accept_stats(page, "missing") == (0.0, 0.0)
