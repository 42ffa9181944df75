"""Routing by adapter: the Inference Extension's endpoint picker on a LoRAServe's InferencePool.

``make k8s`` builds the picker (``sigs.k8s.io/gateway-api-inference-extension`` v1.0.0,
``cmd/epp``), copies its CRDs (InferencePool, InferenceObjective) and builds ``epp-pick``, a
small ext-proc client that asks the picker what Envoy asks it (one gRPC stream per request: headers, then the JSON body) and
prints the ``x-gateway-destination-endpoint`` it answers (``tools/epp``). A 3-pod serve with
``spec.routing`` gets its InferencePool from the operator; the picker, run against it,
scrapes the runtime pods' ``/metrics`` and must send an adapter's requests to the pod whose
``vllm:lora_requests_info`` lists that adapter as running.

The picker is optional (the only optional part of the cluster suite): when it could not be
built these tests skip with the build's reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

cp = sys.modules["_loraserve_cluster_controlplane"]
kubelet_mod = sys.modules["_loraserve_cluster_kubelet"]
assets = kubelet_mod._load_e2e("assets")
wait_for = kubelet_mod._load_e2e("cluster").wait_for

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
NS = "routed"
SERVE = "tiny"
ADAPTERS = ("alpha", "beta")
PICKER_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: lora-affinity-scorer
- type: queue-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: lora-affinity-scorer
    weight: 10
  - pluginRef: queue-scorer
    weight: 1
"""
"""The picker's LoRA affinity (vllm:lora_requests_info) ahead of its queue scorer."""


def picker_binaries() -> dict[str, Path]:
    """The built picker, client and CRDs; skips with the build's reason when there are none."""
    found = {
        "epp": cp.BIN_DIR / "epp",
        "pick": cp.BIN_DIR / "epp-pick",
        "crds": cp.BIN_DIR / "epp-crds",
    }
    if all(path.exists() for path in found.values()):
        return found
    note = cp.BIN_DIR / "epp.unavailable"
    reason = note.read_text().strip() if note.exists() else "not built: run `make k8s`"
    pytest.skip(f"the endpoint picker is unavailable: {reason}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def routed(control_plane, operator, tmp_path_factory):
    """A 3-pod serve with spec.routing, its InferencePool, and the picker running against it."""
    bins = picker_binaries()
    root = tmp_path_factory.mktemp("routed")
    claims = assets.install_claims(assets.ensure_assets(REPO / ".cache" / "operator-e2e"), root / "claims")
    control_plane.kubectl("apply", "--server-side", "-f", str(bins["crds"]))
    control_plane.kubectl("create", "namespace", NS)
    kubelet = kubelet_mod.NodeKubelet(
        api=control_plane.proxy_url, root=root, claims_root=claims.root, namespaces=(NS,), _net=kubelet_mod.fresh_net()
    )
    await kubelet.start()
    picker = None
    try:
        routing = {"endpointPicker": {"name": f"{SERVE}-epp", "port": 9002, "failureMode": "FailOpen"}}
        serve = assets.serve_manifest(SERVE, claims, replicas=3, namespace=NS, routing=routing)
        await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-", stdin=json.dumps(serve))
        for name in ADAPTERS:
            adapter = assets.adapter_manifest(name, SERVE, f"pvc://adapters/{name}", namespace=NS)
            await asyncio.to_thread(control_plane.kubectl, "apply", "-f", "-", stdin=json.dumps(adapter))

        def pool() -> bool:
            done = control_plane.kubectl("get", "inferencepool", SERVE, "-n", NS, check=False)
            return done.returncode == 0

        # The operator notices the newly served API on its next resync.
        await wait_for(lambda: asyncio.to_thread(pool), timeout=150, interval=2, what="the operator's InferencePool")
        await wait_for(
            lambda: _ready(kubelet, 3), timeout=180, interval=0.5, what="3 ready pods of the routed serve"
        )
        grpc_port = cp.free_port()
        log = (root / "epp.log").open("wb")
        picker = subprocess.Popen(
            [
                str(bins["epp"]),
                f"--pool-name={SERVE}",
                f"--pool-namespace={NS}",
                "--pool-group=inference.networking.k8s.io",
                f"--grpc-port={grpc_port}",
                f"--grpc-health-port={cp.free_port()}",
                f"--metrics-port={cp.free_port()}",
                "--secure-serving=false",
                "--refresh-metrics-interval=50ms",
                "--kv-cache-usage-percentage-metric=vllm:kv_cache_usage_perc",
                f"--config-text={PICKER_CONFIG}",
            ],
            env={**os.environ, "KUBECONFIG": str(control_plane.admin_kubeconfig)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        yield Routed(control_plane, operator, kubelet, bins["pick"], f"127.0.0.1:{grpc_port}", root / "epp.log")
    finally:
        if picker is not None:
            picker.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                picker.wait(10)
        await kubelet.stop()


async def _ready(kubelet, count: int) -> bool:
    return len([p for p in kubelet.pods_of(NS, SERVE) if p.ready]) == count


class Routed:
    """The routed serve's kubelet, the picker's address and log, and its client."""

    def __init__(self, control_plane, operator, kubelet, pick: Path, addr: str, log: Path) -> None:
        self.cp, self.operator, self.kubelet = control_plane, operator, kubelet
        self.pick_bin, self.addr, self.log = pick, addr, log

    async def pick(self, model: str, n: int, *, check: bool = True) -> list[str]:
        """The endpoints the picker chooses for ``n`` requests of ``model`` (``[]`` on failure
        unless ``check``)."""
        done = await asyncio.to_thread(
            subprocess.run,
            [str(self.pick_bin), f"-addr={self.addr}", f"-model={model}", f"-n={n}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0 and not check:
            return []
        assert done.returncode == 0, f"{done.stderr}\n{self.log.read_text(errors='replace')[-3000:]}"
        return done.stdout.split()


async def _keep_busy(pod, model: str, stop: asyncio.Event) -> None:
    """Requests for ``model`` to one pod, back to back, until ``stop``."""
    body = {"model": model, "prompt": "def main(", "max_tokens": 256, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError):
                async with http.post(f"http://{pod.ip}:{pod.port}/v1/completions", json=body) as resp:
                    await resp.read()


async def _running(pod, model: str) -> bool:
    async with aiohttp.ClientSession() as http, http.get(f"http://{pod.ip}:{pod.port}/metrics") as resp:
        text = await resp.text()
    return any(
        line.startswith("vllm:lora_requests_info") and f'running_lora_adapters="{model}"' in line
        for line in text.splitlines()
    )


async def test_picker_routes_to_adapter_pod(routed):
    """Picker routes each adapter to the pod running it."""
    # Before any load the picker answers with one of the pool's pods.
    pods = sorted((p for p in routed.kubelet.pods_of(NS, SERVE) if p.ready), key=lambda p: p.name)
    addresses = {f"{p.ip}:{p.port}" for p in pods}
    await wait_for(lambda: routed.pick("alpha", 1, check=False), timeout=60, interval=1, what="the picker answering")
    assert set(await routed.pick("alpha", 3)) <= addresses

    busy = {"alpha": pods[0], "beta": pods[1]}
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_keep_busy(pod, model, stop)) for model, pod in busy.items() for _ in range(2)]
    try:
        for model, pod in busy.items():
            await wait_for(lambda m=model, p=pod: _running(p, m), timeout=30, what=f"{model} running on {pod.name}")
        for model, pod in busy.items():
            chosen = await routed.pick(model, 5)
            assert chosen == [f"{pod.ip}:{pod.port}"] * 5, (model, chosen, pod.name)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_serve_owns_its_pool(routed):
    pool = json.loads(routed.cp.kubectl("get", "inferencepool", SERVE, "-n", NS, "-o", "json").stdout)
    serve = json.loads(routed.cp.kubectl("get", f"loraserve.loraserve.io/{SERVE}", "-n", NS, "-o", "json").stdout)
    assert [r["uid"] for r in pool["metadata"]["ownerReferences"]] == [serve["metadata"]["uid"]]
    assert pool["spec"]["targetPorts"] == [{"number": routed.kubelet.pods_of(NS, SERVE)[0].port}]
    assert routed.operator.forbidden() == []
