"""A LoRAServe of the tiny model on the real control plane, as a user drives it with kubectl.

The operator runs with the chart's ServiceAccount (``conftest.py``); the real Deployment and
ReplicaSet controllers make the pods, the test kubelet (``kubelet.py``) binds and runs them
as ``loraserve-runtime`` processes, the real garbage collector deletes what a deleted
LoRAServe owned and the real HPA controller scales through the LoRAServe's scale
subresource. Stand-ins: the Service's routing (``tests/e2e/service.py``, kube-proxy's part)
and the custom-metrics adapter (``metrics.py``, prometheus-adapter's part).

The tests run in order on one serve (module scope); each leaves it converged.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

kubelet_mod = sys.modules["_loraserve_cluster_kubelet"]  # loaded by conftest.py
assets = kubelet_mod._load_e2e("assets")
cluster_e2e = kubelet_mod._load_e2e("cluster")
service_mod = kubelet_mod._load_e2e("service")
metrics_mod = sys.modules["_loraserve_cluster_metrics"]  # loaded by conftest.py
wait_for = cluster_e2e.wait_for

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
NS = "ml"
SERVE = "tiny"
ADAPTERS = ("alpha", "beta")
TIMEOUT = 180.0
METRIC = "vllm_num_requests_waiting"
METRICS_IP = "127.200.0.10"  # the static band (the lowest 16 of a /24): never handed out dynamically
"""The stand-in metrics adapter's ClusterIP (in controlplane.SERVICE_CIDR)."""


class Stage:
    """What the tests share: the control plane, the kubelet, the claims."""

    def __init__(self, control_plane, operator, kubelet, claims) -> None:
        self.cp, self.operator, self.kubelet, self.claims = control_plane, operator, kubelet, claims

    async def kubectl(self, *args: str, stdin: str | None = None, check: bool = True):
        return await asyncio.to_thread(self.cp.kubectl, *args, stdin=stdin, check=check)

    async def get(self, *args: str) -> dict | None:
        done = await self.kubectl("get", *args, "-n", NS, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    async def apply(self, obj: dict) -> None:
        await self.kubectl("apply", "-n", NS, "-f", "-", stdin=json.dumps(obj))

    def ready_pods(self) -> list:
        return [p for p in self.kubelet.pods_of(NS, SERVE) if p.ready and not p.terminating]

    async def adapters_loaded(self, count: int, names=ADAPTERS) -> bool:
        """Each named Adapter Ready and Loaded on exactly the ``count`` ready pods."""
        current = {p.name for p in self.ready_pods()}
        if len(current) != count:
            return False
        for name in names:
            status = ((await self.get("adapter.loraserve.io", name)) or {}).get("status") or {}
            states = {e["pod"]: e["state"] for e in status.get("pods") or []}
            if status.get("phase") != "Ready" or states != dict.fromkeys(current, "Loaded"):
                return False
        return True


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stage(control_plane, operator, tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    cache = assets.ensure_assets(REPO / ".cache" / "operator-e2e")
    claims = assets.install_claims(cache, root / "claims")
    control_plane.kubectl("create", "namespace", NS)
    kubelet = kubelet_mod.NodeKubelet(
        api=control_plane.proxy_url, root=root, claims_root=claims.root, namespaces=(NS,), _net=kubelet_mod.fresh_net()
    )
    await kubelet.start()
    try:
        yield Stage(control_plane, operator, kubelet, claims)
    finally:
        await kubelet.stop()


async def test_serve_reconciles_to_ready_pods(stage):
    await stage.apply(assets.serve_manifest(SERVE, stage.claims, replicas=2, namespace=NS))
    for name in ADAPTERS:
        await stage.apply(assets.adapter_manifest(name, SERVE, f"pvc://adapters/{name}", namespace=NS))
    await wait_for(lambda: stage.adapters_loaded(2), timeout=TIMEOUT, what="2 adapters on 2 pods")

    serve = await stage.get("loraserve.loraserve.io", SERVE)
    deployment = await stage.get("deployment", SERVE)
    assert [r["uid"] for r in deployment["metadata"]["ownerReferences"]] == [serve["metadata"]["uid"]]
    # The real controllers made the pods: Deployment -> ReplicaSet -> Pod, bound by the kubelet.
    (replicaset,) = (await stage.get("replicasets", "-l", f"loraserve.io/serve={SERVE}"))["items"]
    assert replicaset["metadata"]["ownerReferences"][0]["uid"] == deployment["metadata"]["uid"]
    pods = (await stage.get("pods", "-l", f"loraserve.io/serve={SERVE}"))["items"]
    assert {p["spec"]["nodeName"] for p in pods} == {stage.kubelet.node}
    assert {p["metadata"]["ownerReferences"][0]["uid"] for p in pods} == {replicaset["metadata"]["uid"]}

    async def running() -> bool:
        status = ((await stage.get("loraserve.loraserve.io", SERVE)) or {}).get("status") or {}
        return status.get("phase") == "Running" and status.get("readyReplicas") == 2

    await wait_for(running, timeout=60, what="serve Running with 2 ready replicas")
    assert stage.operator.forbidden() == []


async def test_requests_through_the_service(stage):
    async with service_mod.ServiceProxy(api=stage.cp.proxy_url, namespace=NS, service=SERVE) as proxy:
        assert len(proxy.endpoints) == 2
        async with aiohttp.ClientSession() as http:
            for _ in range(4):
                for model in ADAPTERS:
                    body = {"model": model, "prompt": "def main(", "max_tokens": 4, "temperature": 0}
                    async with http.post(f"{proxy.url}/v1/completions", json=body) as resp:
                        answer = await resp.json()
                        assert resp.status == 200, answer
                        assert answer["model"] == model
    assert set(proxy.served) == {p.name for p in stage.ready_pods()}


async def test_kubectl_scale(stage):
    await stage.kubectl("scale", "-n", NS, f"loraserve.loraserve.io/{SERVE}", "--replicas=3")
    await wait_for(lambda: stage.adapters_loaded(3), timeout=TIMEOUT, what="adapters on 3 pods after scale")
    deployment = await stage.get("deployment", SERVE)
    assert deployment["spec"]["replicas"] == 3
    await stage.kubectl("scale", "-n", NS, f"loraserve.loraserve.io/{SERVE}", "--replicas=2")
    await wait_for(lambda: stage.adapters_loaded(2), timeout=TIMEOUT, what="adapters on 2 pods after scale down")
    assert stage.operator.forbidden() == []


async def test_hpa_scales_the_serve(stage):
    # A real HPA (the operator's, from spec.autoscaling) run by the real HPA controller, on a
    # Pods metric from a stand-in adapter behind a real APIService (metrics.py).
    adapter = metrics_mod.MetricsAdapter(api=stage.cp.proxy_url, host=METRICS_IP, metric=METRIC)
    await adapter.start()
    try:
        await stage.kubectl("create", "namespace", metrics_mod.NAMESPACE)
        for obj in metrics_mod.manifests(METRICS_IP, adapter.ca.cert_pem.bytes()):
            await stage.kubectl("apply", "-f", "-", stdin=json.dumps(obj))
        await stage.kubectl(
            "wait", "--for=condition=Available", f"apiservice/{metrics_mod.VERSION}.{metrics_mod.GROUP}", "--timeout=60s"
        )
        autoscaling = {"mode": "HPA", "minReplicas": 1, "maxReplicas": 3, "targetPerReplica": 4}
        autoscaling["scaleDownStabilizationSeconds"] = 0
        adapter.value = 8  # 8 waiting per pod against a target of 4: double, capped at 3
        patch = json.dumps({"spec": {"autoscaling": autoscaling}})
        await stage.kubectl("patch", "-n", NS, f"loraserve.loraserve.io/{SERVE}", "--type=merge", "-p", patch)
        await wait_for(lambda: stage.adapters_loaded(3), timeout=TIMEOUT, what="the HPA scaling the serve to 3")
        hpa = await stage.get("hpa", SERVE)
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "LoRAServe"
        assert hpa["status"]["desiredReplicas"] == 3
        assert any(METRIC in r for r in adapter.requests)

        adapter.value = 0
        await wait_for(lambda: stage.adapters_loaded(1), timeout=TIMEOUT, what="the HPA scaling the serve to 1")
        patch = json.dumps({"spec": {"autoscaling": None, "replicas": 2}})
        await stage.kubectl("patch", "-n", NS, f"loraserve.loraserve.io/{SERVE}", "--type=merge", "-p", patch)

        async def hpa_gone() -> bool:
            return await stage.get("hpa", SERVE) is None

        await wait_for(hpa_gone, timeout=60, what="the operator deleting the HPA")
        await wait_for(lambda: stage.adapters_loaded(2), timeout=TIMEOUT, what="back to 2 pods")
    finally:
        # An APIService left without its server breaks discovery for every later client.
        await stage.kubectl("delete", "apiservice", f"{metrics_mod.VERSION}.{metrics_mod.GROUP}", check=False)
        await adapter.stop()
    assert stage.operator.forbidden() == []


async def test_pod_deletion_is_replaced(stage):
    victim = stage.ready_pods()[0]
    await stage.kubectl("delete", "pod", "-n", NS, victim.name, "--wait=false")

    async def replaced() -> bool:
        # The kubelet removes the object once the container has stopped (grace period honoured).
        gone = await stage.get("pod", victim.name) is None
        return gone and await stage.adapters_loaded(2)

    await wait_for(replaced, timeout=TIMEOUT, what=f"{victim.name} gone, replaced, adapters loaded")
    assert victim.exit_code is not None, "the deleted pod's runtime was stopped before its object went"
    assert victim.name not in {p.name for p in stage.ready_pods()}


async def test_adapter_deletion_releases_its_finalizer(stage):
    adapter = await stage.get("adapter.loraserve.io", "beta")
    assert "loraserve.io/finalizer" in adapter["metadata"]["finalizers"]
    await stage.kubectl("delete", "adapter.loraserve.io", "beta", "-n", NS, "--timeout=120s")
    assert await stage.get("adapter.loraserve.io", "beta") is None
    for pod in stage.ready_pods():
        assert "beta" not in await cluster_e2e.pod_models(pod)
    assert stage.operator.forbidden() == []


async def test_deleting_the_serve_collects_its_children(stage):
    children = [("deployment", SERVE), ("service", SERVE), ("poddisruptionbudget", SERVE)]
    for kind, name in children:
        assert await stage.get(kind, name) is not None, kind
    await stage.kubectl("delete", "loraserve.loraserve.io", SERVE, "-n", NS, "--timeout=120s")

    async def collected() -> bool:
        for kind in ("deployments", "replicasets", "pods", "services", "poddisruptionbudgets"):
            if ((await stage.get(kind)) or {}).get("items"):
                return False
        return not stage.kubelet.pods_of(NS, SERVE)

    await wait_for(collected, timeout=TIMEOUT, what="the serve's children garbage-collected")
    secrets = (await stage.get("secrets"))["items"]
    assert [s["metadata"]["name"] for s in secrets if s["metadata"].get("ownerReferences")] == []
    assert stage.operator.forbidden() == []
    assert stage.operator.pruned() == []
    assert stage.cp.refused(stage.operator.user) == []
    assert stage.cp.dropped(stage.operator.user, "loraserve.io") == []
