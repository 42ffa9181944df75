"""End to end: an ``https://`` model source fetched by the pods' ``model-fetch`` init container.

The real operator writes the init container (``loraserve-fetch SOURCE DEST``), the kubelet
stand-in runs it to completion before the runtime, as a kubelet does, and the model comes
from a real local HTTPS server whose certificate a private CA (trustme) signed; the pods
trust that CA through ``SSL_CERT_FILE`` in ``spec.runtime.env``. This module has its own
stand-in cluster (the ``cluster`` fixture is module-scoped) and its tests run in order.
"""

from __future__ import annotations

import io
import ssl
import sys
import tarfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio
import trustme
from aiohttp import web

from loraserve.operator.config import OperatorConfig
from loraserve.runtime.tools.fetch import MARKER

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
assets = sys.modules["_loraserve_e2e_assets"]
wait_for = cluster_mod.wait_for
models = cluster_mod.pod_models
complete = cluster_mod.pod_complete

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(300)]

NS = "fetch"
SERVES = cluster_mod.SERVES.format(ns=NS)
ADAPTERS = cluster_mod.ADAPTERS.format(ns=NS)
FETCHED, MISSING = "fetched", "missing"
ARCHIVE = "/tiny.tar.gz"
MISSING_DRAFT = "/nope.tar.gz"
TIMEOUT = 90.0


@dataclass
class ModelServer:
    """A local HTTPS server holding the tiny model as a tar.gz; counts the requests per path."""

    port: int
    ca_file: Path
    requests: Counter = field(default_factory=Counter)

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"


def _archive(model: Path) -> bytes:
    """The model directory as ``tiny/...`` in a gzipped tarball, as a model would be published."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(model, arcname="tiny")
    return buffer.getvalue()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model_server(
    e2e_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ModelServer]:
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca_file = tmp_path_factory.mktemp("model-server-ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    body = _archive(e2e_cache / "models" / "tiny")
    server = ModelServer(port=0, ca_file=ca_file)

    async def handle(request: web.Request) -> web.StreamResponse:
        server.requests[request.path] += 1
        if request.path == ARCHIVE:
            return web.Response(body=body, content_type="application/gzip")
        return web.Response(status=404, text="no such object")

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    server.port = runner.addresses[0][1]
    try:
        yield server
    finally:
        await runner.cleanup()


def operator_config() -> OperatorConfig:
    return OperatorConfig(
        webhook_enabled=False,
        adapter_backoff_base_s=0.05,
        adapter_backoff_cap_s=0.4,
        resync_interval_s=2.0,
        runtime_request_timeout_s=60,
    )


def fetch_manifest(name: str, cluster, server: ModelServer, path: str, *, replicas: int) -> dict:
    """A serve of ``path`` on the model server, downloaded into the (writable) models claim."""
    body = assets.serve_manifest(name, cluster.claims, replicas=replicas, namespace=NS)
    spec = body["spec"]
    spec["model"]["source"] = server.url(path)
    spec["storage"]["models"]["readOnly"] = False  # the fetch writes into it
    spec["runtime"]["env"].append({"name": "SSL_CERT_FILE", "value": str(server.ca_file)})
    return body


def pods(cluster, serve: str) -> list:
    return cluster.kubelet.pods_of(NS, serve)


async def api_pod(cluster, pod) -> dict:
    body = await cluster.get(f"/api/v1/namespaces/{NS}/pods/{pod.name}")
    assert body is not None, f"pod {pod.name} is not in the API"
    return body


async def alpha_loaded(cluster, count: int) -> bool:
    """Adapter alpha is Ready and Loaded on exactly the ``count`` ready pods of the fetched serve."""
    ready = {p.name for p in pods(cluster, FETCHED) if p.ready}
    status = ((await cluster.get(f"{ADAPTERS}/alpha")) or {}).get("status") or {}
    states = {entry["pod"]: entry["state"] for entry in status.get("pods") or []}
    return len(ready) == count and status.get("phase") == "Ready" and states == dict.fromkeys(ready, "Loaded")


# --------------------------------------------------------------------------- scenarios


async def test_https_model_fetched_and_served(cluster, model_server) -> None:
    """HTTPS model is fetched before the runtime and served."""
    await cluster.start_operator(operator_config(), None)
    await cluster.create(SERVES, fetch_manifest(FETCHED, cluster, model_server, ARCHIVE, replicas=2))
    await cluster.create(
        ADAPTERS, assets.adapter_manifest("alpha", FETCHED, "pvc://adapters/alpha", namespace=NS)
    )
    await wait_for(lambda: alpha_loaded(cluster, 2), timeout=TIMEOUT, what="alpha Loaded on 2 fetched pods")

    # The model directory the operator chose, under the models volume, named after the source.
    dest = cluster.claims.models / "https" / f"127.0.0.1:{model_server.port}" / "tiny.tar.gz"
    assert (dest / "config.json").is_file() and (dest / "model.safetensors").is_file()
    assert (dest / MARKER).is_file(), "the fetch marks a complete model"
    # Two pods share the claim: each may download (the loser of the rename keeps the
    # winner's copy), never more than once each.
    assert 1 <= model_server.requests[ARCHIVE] <= 2, model_server.requests

    for pod in pods(cluster, FETCHED):
        assert pod.command[pod.command.index("--model") + 1] == str(dest)
        [fetch] = pod.init
        assert fetch.name == "model-fetch" and fetch.command[1:] == [model_server.url(ARCHIVE), str(dest)]
        assert fetch.env["SSL_CERT_FILE"] == str(model_server.ca_file)
        status = (await api_pod(cluster, pod))["status"]
        assert status["phase"] == "Running"
        assert {c["type"]: c["status"] for c in status["conditions"]} == {
            "Initialized": "True",
            "Ready": "True",
        }
        [init_status] = status["initContainerStatuses"]
        assert init_status["name"] == "model-fetch" and init_status["restartCount"] == 0
        assert init_status["state"]["terminated"]["exitCode"] == 0
        assert init_status["state"]["terminated"]["reason"] == "Completed"
        assert "loraserve-fetch:" in cluster.kubelet.init_logs(pod, "model-fetch")[0]
        base = next(name for name, entry in (await models(pod)).items() if entry["parent"] is None)
        for model in (base, "alpha"):
            code, answer = await complete(pod, model)
            assert code == 200, answer
            assert answer["model"] == model and answer["choices"][0]["text"]

    # The serve's status follows the Deployment's, which follows the pods' (each a little
    # later, as in a cluster): adapters loaded from the catalog at start can be reported first.
    async def running() -> dict | None:
        status = ((await cluster.get(f"{SERVES}/{FETCHED}")) or {}).get("status") or {}
        return status if status.get("phase") == "Running" and status.get("readyReplicas") == 2 else None

    await wait_for(running, timeout=30, what="serve Running with 2 ready replicas")


async def test_a_restarted_runtime_does_not_fetch_again(cluster, model_server) -> None:
    fetched = dict(model_server.requests)
    victim = pods(cluster, FETCHED)[0]
    restarts = victim.restarts
    await cluster_mod.kill_and_wait_for_reload(cluster.kubelet, victim, ["alpha"], timeout=TIMEOUT)
    await wait_for(lambda: alpha_loaded(cluster, 2), timeout=TIMEOUT, what="alpha Loaded on both pods again")
    assert dict(model_server.requests) == fetched, "a restarted runtime downloads nothing"
    assert len(cluster.kubelet.init_logs(victim, "model-fetch")) == 1, "the init container did not run again"
    status = (await api_pod(cluster, victim))["status"]
    assert status["containerStatuses"][0]["restartCount"] == victim.restarts > restarts
    assert status["initContainerStatuses"][0]["restartCount"] == 0
    assert (await complete(victim, "alpha"))[0] == 200


async def test_missing_draft_keeps_pod_initializing(cluster, model_server) -> None:
    """Two init containers in order: model-fetch completes (the model is already there), then
    draft-fetch gets a 404 and is retried alone; the runtime never starts."""
    fetched = model_server.requests[ARCHIVE]
    manifest = fetch_manifest(MISSING, cluster, model_server, ARCHIVE, replicas=1)
    manifest["spec"]["speculative"] = {
        "algorithm": "STANDALONE",
        "draftModel": {"source": model_server.url(MISSING_DRAFT)},
        "numSteps": 2,
    }
    await cluster.create(SERVES, manifest)

    async def retried() -> dict | None:
        stuck = pods(cluster, MISSING)
        if len(stuck) != 1:
            return None
        status = (await api_pod(cluster, stuck[0])).get("status") or {}
        inits = status.get("initContainerStatuses") or []
        # Failed once, run again after the backoff, failed again: retried, not given up.
        if len(inits) == 2 and inits[1]["restartCount"] >= 1 and inits[1]["state"].get("terminated"):
            return status
        return None

    status = await wait_for(retried, timeout=TIMEOUT, what="draft-fetch failed and retried")
    [stuck] = pods(cluster, MISSING)
    assert status["phase"] == "Pending" and not stuck.ready and stuck.process is None, (
        "the runtime never started"
    )
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Initialized": "False",
        "Ready": "False",
    }
    model_fetch, draft_fetch = status["initContainerStatuses"]
    assert (model_fetch["name"], draft_fetch["name"]) == ("model-fetch", "draft-fetch")

    # model-fetch ran once, before draft-fetch, and found the model the first serve fetched.
    assert model_fetch["state"]["terminated"]["exitCode"] == 0 and model_fetch["restartCount"] == 0
    [model_log] = cluster.kubelet.init_logs(stuck, "model-fetch")
    assert "already present" in model_log
    assert (
        model_fetch["state"]["terminated"]["finishedAt"]
        <= draft_fetch["lastState"]["terminated"]["startedAt"]
    )
    assert model_server.requests[ARCHIVE] == fetched, "a model already fetched is not downloaded again"

    # draft-fetch: Init:Error, the fetcher's message in its log, retried with the backoff.
    terminated = draft_fetch["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (2, "Error"), "a 404 is a bad source (exit 2)"
    assert draft_fetch["state"] == {"terminated": terminated}
    # Read after the status: a further run may have started since (its log may still be empty).
    logs = cluster.kubelet.init_logs(stuck, "draft-fetch")
    assert len(logs) >= draft_fetch["restartCount"] + 1 >= 2
    url = model_server.url(MISSING_DRAFT)
    assert all(f"GET {url} answered 404 (check the path and revision)" in text for text in logs[:2]), logs
    assert 2 <= model_server.requests[MISSING_DRAFT] <= len(logs), "a bad source is not retried within a run"
    assert not (cluster.claims.models / "https" / f"127.0.0.1:{model_server.port}" / "nope.tar.gz").exists()

    serve = (await cluster.get(f"{SERVES}/{MISSING}"))["status"]
    assert serve["phase"] != "Running" and serve.get("readyReplicas", 0) == 0

    # The first serve never noticed.
    assert (await cluster.get(f"{SERVES}/{FETCHED}"))["status"]["phase"] == "Running"
    assert await alpha_loaded(cluster, 2)
    for pod in pods(cluster, FETCHED):
        assert (await complete(pod, "alpha"))[0] == 200
