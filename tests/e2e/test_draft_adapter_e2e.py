"""End to end: an Adapter with a draft adapter on a STANDALONE serve (real runtime processes).

The stand-in cluster of ``test_operator_e2e.py`` (kmock's KubernetesEmulator and the
kubelet stand-in running ``loraserve-runtime`` on the tiny CPU model). The serve drafts with
a copy of its own model and has a draft adapter pool; Adapter ``beta-drafted`` names beta's
files as its draft adapter too, so its drafts are what the adapted target would say: every
greedy draft is accepted. ``beta-plain`` (the same adapter, no draft adapter) answers the
same text: a draft adapter changes the accept rate, never the output.
"""

from __future__ import annotations

import sys

import aiohttp
import pytest

from loraserve.operator.config import OperatorConfig

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
assets = sys.modules["_loraserve_e2e_assets"]
wait_for = cluster_mod.wait_for

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

NS = "drafts"
SERVE = "drafted"
SERVES = cluster_mod.SERVES.format(ns=NS)
ADAPTERS = cluster_mod.ADAPTERS.format(ns=NS)
NUM_STEPS = 3


def operator_config() -> OperatorConfig:
    return OperatorConfig(
        webhook_enabled=False,
        adapter_max_tries=3,
        adapter_backoff_base_s=0.05,
        adapter_backoff_cap_s=0.2,
        resync_interval_s=2.0,
        unload_max_tries=2,
        runtime_request_timeout_s=60,
        adapter_metrics_interval_s=0.2,
    )


def serve_manifest(claims) -> dict:
    return assets.serve_manifest(
        SERVE,
        claims,
        replicas=1,
        namespace=NS,
        speculative={
            "algorithm": "STANDALONE",
            "draftModel": {"source": "pvc://models/tiny"},  # the target's own weights
            "numSteps": NUM_STEPS,
            "draftLora": {"maxLoras": 2, "maxRank": 16},
        },
    )


async def adapter_status(cluster, name: str) -> dict:
    return ((await cluster.get(f"{ADAPTERS}/{name}")) or {}).get("status") or {}


async def complete(pod, model: str) -> dict:
    body = {
        "model": model,
        "prompt": "def total(items):",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{pod.ip}:{pod.port}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_adapter_and_draft_adapter_together(cluster) -> None:
    """An adapter and its draft adapter load serve and leave together."""
    await cluster.start_operator(operator_config())
    try:
        claims = cluster.claims
        await cluster.create(SERVES, serve_manifest(claims))
        draft = {"source": "pvc://adapters/beta", "sha256": claims.digest("beta")}
        await cluster.create(
            ADAPTERS,
            assets.adapter_manifest("beta-drafted", SERVE, "pvc://adapters/beta", namespace=NS, draft=draft),
        )
        await cluster.create(
            ADAPTERS, assets.adapter_manifest("beta-plain", SERVE, "pvc://adapters/beta", namespace=NS)
        )

        async def ready() -> dict | None:
            status = await adapter_status(cluster, "beta-drafted")
            pods = status.get("pods") or []
            done = status.get("phase") == "Ready" and pods and all(p.get("draft") == "Loaded" for p in pods)
            return status if done else None

        status = await wait_for(ready, timeout=120, what="beta-drafted Ready with its draft adapter Loaded")
        assert len(status["pods"]) == 1
        plain = await wait_for(
            lambda: _ready_without_draft(cluster, "beta-plain"), timeout=60, what="beta-plain Ready"
        )
        assert all("draft" not in p for p in plain["pods"])

        (pod,) = [p for p in cluster.kubelet.pods_of(NS, SERVE) if p.ready]
        drafted, undrafted = await complete(pod, "beta-drafted"), await complete(pod, "beta-plain")
        assert drafted["choices"][0]["text"] == undrafted["choices"][0]["text"]  # output never changes
        stats, base = drafted["usage"]["speculative"], undrafted["usage"]["speculative"]
        assert (
            stats["accepted_tokens"] == stats["draft_tokens"] > 0
        )  # the adapted draft is the adapted target
        assert base["accepted_tokens"] <= stats["accepted_tokens"]

        # The per-adapter accept metric shows it: every verify step accepts all its numSteps drafts.
        async def accept_length() -> float | None:
            return (await adapter_status(cluster, "beta-drafted")).get("acceptLength")

        assert await wait_for(accept_length, timeout=30, what="beta-drafted acceptLength") == NUM_STEPS

        # Dropping the draft adapter reloads the adapter without it.
        await cluster.patch(f"{ADAPTERS}/beta-drafted", {"spec": {"draft": None}})
        await wait_for(
            lambda: _ready_without_draft(cluster, "beta-drafted"),
            timeout=60,
            what="beta-drafted without a draft",
        )
        after = await complete(pod, "beta-drafted")
        assert after["choices"][0]["text"] == drafted["choices"][0]["text"]
    finally:
        await cluster.stop_operator()


async def _ready_without_draft(cluster, name: str) -> dict | None:
    status = await adapter_status(cluster, name)
    pods = status.get("pods") or []
    done = status.get("phase") == "Ready" and pods and all("draft" not in p for p in pods)
    return status if done else None
