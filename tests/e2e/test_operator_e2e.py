"""End to end: the real operator (kopf) reconciling a stand-in cluster of real runtime processes.

There is no Kubernetes API server on these machines. kmock's KubernetesEmulator stands in
for it (with uid / generation / resourceVersion / 409 bookkeeping, ``apiserver.py``) and
``kubelet.py`` plays the Deployment controller, kubelet and garbage collector: for every
replica of a Deployment the operator writes it starts ``loraserve-runtime`` with the
pod's command line (tiny CPU model) on its own 127.x.y.z address and keeps a Pod object
with that IP and a Ready condition. The emulator validates no schema and calls no webhook.

The tests run in order on one cluster (module scope): each leaves it converged.
"""

from __future__ import annotations

import asyncio
import ssl
import sys

import aiohttp
import kubernetes_validate
import pytest

from loraserve.operator.config import OperatorConfig
from loraserve.operator.desired import CONFIG_HASH_ANNOTATION
from loraserve.operator.webhooks import WebhookServerConfig

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
assets = sys.modules["_loraserve_e2e_assets"]
wait_for = cluster_mod.wait_for
models = cluster_mod.pod_models
complete = cluster_mod.pod_complete

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

NS = "ml"
SERVE = "tiny"
SERVES = cluster_mod.SERVES.format(ns=NS)
ADAPTERS = cluster_mod.ADAPTERS.format(ns=NS)
BASE_ADAPTERS = ("alpha", "beta", "gamma")
TRIES = 5
TIMEOUT = 120.0


def operator_config() -> OperatorConfig:
    return OperatorConfig(
        webhook_enabled=False,
        adapter_max_tries=TRIES,
        adapter_backoff_base_s=0.05,
        adapter_backoff_cap_s=0.4,
        resync_interval_s=2.0,
        unload_max_tries=2,
        runtime_request_timeout_s=60,
    )


# --------------------------------------------------------------------------- helpers


async def adapter(cluster, name: str) -> dict | None:
    return await cluster.get(f"{ADAPTERS}/{name}")


async def serve(cluster) -> dict | None:
    return await cluster.get(f"{SERVES}/{SERVE}")


def pods(cluster) -> list:
    return cluster.kubelet.pods_of(NS, SERVE)


async def loaded_everywhere(cluster, names, *, count: int = 2) -> bool:
    """Every named Adapter is Ready, Loaded on exactly the current ready pods (``count`` of them)."""
    current = {p.name for p in pods(cluster) if p.ready}
    if len(current) != count:
        return False
    for name in names:
        body = await adapter(cluster, name)
        status = (body or {}).get("status") or {}
        states = {entry["pod"]: entry["state"] for entry in status.get("pods") or []}
        if status.get("phase") != "Ready" or states != {pod: "Loaded" for pod in current}:
            return False
    return True


async def describe(cluster, names) -> str:
    """Pods and the named Adapters' status, for an assertion's message."""
    lines = [f"pods: {[(p.name, p.ready, p.restarts) for p in pods(cluster)]}"]
    for name in names:
        status = ((await adapter(cluster, name)) or {}).get("status") or {}
        lines.append(f"{name}: {status.get('phase')} {[(e['pod'], e['state']) for e in status.get('pods') or []]}")
    return "\n".join(lines)


def operator_writes(cluster, since: int) -> list[str]:
    """Write requests the operator (its own client or kopf) sent after request number ``since``."""
    writes = []
    for request in list(cluster.emulator)[since:]:
        agent = request.headers.get("User-Agent", "")
        method = str(getattr(request.method, "value", request.method)).upper()
        if method in ("POST", "PATCH", "PUT", "DELETE") and (
            agent.startswith("kopf/") or agent == "loraserve-operator"
        ):
            writes.append(f"{method} {request.url.path}")
    return writes


def loads(cluster, adapter_name: str) -> dict[str, int]:
    counters = cluster.operator.context.counters.loads
    return {pod: n for (ns, pod, name), n in counters.items() if ns == NS and name == adapter_name}


# --------------------------------------------------------------------------- scenarios


async def test_two_replicas_three_adapters(
    cluster, tmp_path_factory, unused_tcp_port_factory
) -> None:
    """Serve with two replicas and three adapters."""
    port = unused_tcp_port_factory()
    webhook = WebhookServerConfig(
        addr="127.0.0.1", port=port, cert_dir=str(tmp_path_factory.mktemp("webhook-tls"))
    )
    config = operator_config()
    cluster.webhook_port = port
    cluster.webhook_ca = webhook.cert_dir
    await cluster.start_operator(config, webhook)
    claims = cluster.claims
    await cluster.create(SERVES, assets.serve_manifest(SERVE, claims))
    await cluster.create(ADAPTERS, assets.adapter_manifest("alpha", SERVE, "pvc://adapters/alpha", rank=4))
    await cluster.create(
        ADAPTERS, assets.adapter_manifest("beta", SERVE, "pvc://adapters/beta", sha256=claims.digest("beta"))
    )
    # An absolute path inside the pod is a source too.
    await cluster.create(ADAPTERS, assets.adapter_manifest("gamma", SERVE, str(claims.adapters / "gamma")))

    await wait_for(
        lambda: loaded_everywhere(cluster, BASE_ADAPTERS), timeout=TIMEOUT, what="3 adapters on 2 pods"
    )

    for pod in pods(cluster):
        held = await models(pod)
        assert set(BASE_ADAPTERS) <= set(held), f"pod {pod.name} holds {sorted(held)}"
        base = next(name for name, entry in held.items() if entry["parent"] is None)
        outputs = {}
        for model in (base, *BASE_ADAPTERS):
            status, answer = await complete(pod, model)
            assert status == 200, answer
            outputs[model] = answer["choices"][0]["text"]
            assert answer["model"] == model
        assert len(outputs) == 4

    for name in BASE_ADAPTERS:
        status = (await adapter(cluster, name))["status"]
        rank, modules, _ = assets.ADAPTERS[name]
        assert status["rank"] == rank, "status.rank is the file's rank as the runtime read it"
        assert set(status["targetModules"]) == set(modules)
        assert status["loadedReplicas"] == 2
        assert status["observedGeneration"] == 1
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["Ready"]["status"] == "True" and conditions["Degraded"]["status"] == "False"

    # The serve's status follows the Deployment's, which follows the pods' (each a little
    # later, as in a cluster): adapters loaded from the catalog at start can be reported first.
    async def running() -> bool:
        return (((await serve(cluster)) or {}).get("status") or {}).get("phase") == "Running"

    await wait_for(running, timeout=30, what="serve Running")
    body = await serve(cluster)
    status = body["status"]
    assert status["phase"] == "Running"
    assert (status["replicas"], status["readyReplicas"], status["adapters"]) == (2, 2, 3)
    assert status["observedGeneration"] == body["metadata"]["generation"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "Compatible": "True",
        "Progressing": "False",
        "Available": "True",
        "Degraded": "False",
    }
    assert status["effective"]["algorithm"] == "NONE"

    uid = body["metadata"]["uid"]
    for path in (
        f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}",
        f"/api/v1/namespaces/{NS}/services/{SERVE}",
        f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{SERVE}",
        f"/api/v1/namespaces/{NS}/secrets/{SERVE}-admin-token",
    ):
        obj = await cluster.get(path)
        assert obj is not None, path
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid]
        written = {k: v for k, v in obj.items() if k != "status"}
        kubernetes_validate.validate(written, "1.28", strict=True)

    reasons = {(e["involvedObject"]["kind"], e["reason"]) for e in await cluster.events(NS)}
    assert {("LoRAServe", "Created"), ("Adapter", "Loaded")} <= reasons


async def test_one_process_serves_webhook(cluster) -> None:
    """The operator process serves the admission webhook next to the reconcile loops."""
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "e2e-1",
            "kind": {"group": "loraserve.io", "version": "v1alpha1", "kind": "LoRAServe"},
            "resource": {"group": "loraserve.io", "version": "v1alpha1", "resource": "loraserves"},
            "operation": "CREATE",
            "name": "broken",
            "namespace": NS,
            "userInfo": {"username": "e2e"},
            "object": assets.serve_manifest(
                "broken", cluster.claims, lora={"maxLorasPerBatch": 16, "maxLoadedLoras": 8}
            ),
        },
    }
    context = ssl.create_default_context(cafile=f"{cluster.webhook_ca}/ca.pem")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"https://127.0.0.1:{cluster.webhook_port}/validate-loraserve", json=review, ssl=context
        ) as resp,
    ):
        answer = await resp.json()
    assert answer["response"]["allowed"] is False
    assert "spec.lora.maxLorasPerBatch" in answer["response"]["status"]["message"]


async def test_a_converged_cluster_gets_no_writes(cluster) -> None:
    """Reconcile is idempotent: passes over a converged cluster (several resyncs) write nothing."""
    since = len(list(cluster.emulator))
    await asyncio.sleep(operator_config().resync_interval_s * 3)
    assert operator_writes(cluster, since) == []


async def test_killed_runtime_gets_adapters_again(cluster) -> None:
    """Killed runtime and replaced pod get all adapters again."""
    victim = pods(cluster)[0]
    await cluster_mod.kill_and_wait_for_reload(cluster.kubelet, victim, BASE_ADAPTERS, timeout=TIMEOUT)
    await wait_for(
        lambda: loaded_everywhere(cluster, BASE_ADAPTERS), timeout=TIMEOUT, what="status Ready again"
    )

    # A pod deleted through the API is replaced by a new one (new name, new IP).
    gone = pods(cluster)[1]
    assert await cluster.delete(f"/api/v1/namespaces/{NS}/pods/{gone.name}") == 200

    async def replaced() -> bool:
        return gone.name not in {p.name for p in pods(cluster)} and await loaded_everywhere(
            cluster, BASE_ADAPTERS
        )

    await wait_for(replaced, timeout=TIMEOUT, what="adapters on the new pod")
    names = {p.name for p in pods(cluster)}
    for name in BASE_ADAPTERS:
        listed = {entry["pod"] for entry in (await adapter(cluster, name))["status"]["pods"]}
        assert listed == names, "a pod that went away leaves the status"
    for pod in pods(cluster):
        assert set(BASE_ADAPTERS) <= set(await models(pod))


async def test_faulty_adapters_fail_with_reason(cluster) -> None:
    """Faulty adapters fail with the reason and others keep serving."""
    wrong_digest = "0" * 64
    bad = {
        "wide": (assets.adapter_manifest("wide", SERVE, "pvc://adapters/wide"), "rank"),
        "badsum": (
            assets.adapter_manifest("badsum", SERVE, "pvc://adapters/alpha", sha256=wrong_digest),
            "sha256",
        ),
        "missing": (assets.adapter_manifest("missing", SERVE, "pvc://adapters/nope"), "does not exist"),
        "unmounted": (assets.adapter_manifest("unmounted", SERVE, "pvc://elsewhere/x"), "not mounted"),
    }
    # Transient: the source's host does not resolve (.invalid never does; an internal address
    # would be refused at once, not retried); tried TRIES times, then Failed.
    offline = assets.adapter_manifest("offline", SERVE, "https://offline.invalid/adapter.tar.gz")
    for manifest, _ in bad.values():
        await cluster.create(ADAPTERS, manifest)
    await cluster.create(ADAPTERS, offline)

    async def failed(name: str) -> dict | None:
        status = ((await adapter(cluster, name)) or {}).get("status") or {}
        return status if status.get("phase") == "Failed" else None

    for name, (_, needle) in bad.items():
        status = await wait_for(lambda n=name: failed(n), timeout=TIMEOUT, what=f"{name} Failed")
        text = " ".join(
            [c.get("message", "") for c in status["conditions"]]
            + [p.get("message", "") for p in status["pods"]]
        )
        assert needle in text, f"{name}: {text}"
        if name != "unmounted":
            assert all(p["state"] == "Failed" for p in status["pods"]) and len(status["pods"]) == 2
            assert set(loads(cluster, name).values()) == {1}, "the adapter's fault is not retried"
    status = await wait_for(lambda: failed("offline"), timeout=TIMEOUT, what="offline Failed after retries")
    assert all(f"gave up after {TRIES} tries" in p["message"] for p in status["pods"])
    assert set(loads(cluster, "offline").values()) == {TRIES}

    # The serve and the good adapters were never disturbed.
    assert (await serve(cluster))["status"]["phase"] == "Running"
    assert await loaded_everywhere(cluster, BASE_ADAPTERS), await describe(cluster, BASE_ADAPTERS)
    for pod in pods(cluster):
        status_code, _ = await complete(pod, "alpha")
        assert status_code == 200
        assert not {"wide", "badsum", "missing", "offline"} & set(await models(pod))

    # A spec change tries a Failed adapter again: the right digest makes it load.
    await cluster.patch(f"{ADAPTERS}/badsum", {"spec": {"sha256": cluster.claims.digest("alpha")}})
    await wait_for(
        lambda: loaded_everywhere(cluster, ["badsum"]), timeout=TIMEOUT, what="badsum Ready after the fix"
    )

    for name in [*bad, "offline"]:
        assert await cluster.delete(f"{ADAPTERS}/{name}") == 200
    for name in [*bad, "offline"]:
        await wait_for(lambda n=name: _gone(cluster, n), timeout=TIMEOUT, what=f"{name} deleted")
    for pod in pods(cluster):
        assert "badsum" not in await models(pod)


async def test_placement_replica_count(cluster) -> None:
    """Placement loads on the requested number of replicas."""
    await cluster.create(
        ADAPTERS,
        assets.adapter_manifest(
            "solo", SERVE, "pvc://adapters/delta", placement={"mode": "Replicas", "replicas": 1}
        ),
    )

    async def placed(other: str) -> dict | None:
        status = ((await adapter(cluster, "solo")) or {}).get("status") or {}
        states = sorted(p["state"] for p in status.get("pods") or [])
        return status if status.get("phase") == "Ready" and states == sorted(["Loaded", other]) else None

    # One pod keeps it warm; the other has it registered and loads it on demand.
    status = await wait_for(lambda: placed("Registered"), timeout=TIMEOUT, what="solo Ready, one pod Registered")
    assert status["loadedReplicas"] == 1 and status["registeredReplicas"] == 1
    warm = next(p["pod"] for p in status["pods"] if p["state"] == "Loaded")
    holders = [pod.name for pod in pods(cluster) if "solo" in await models(pod)]
    assert holders == [warm]
    other = next(pod for pod in pods(cluster) if pod.name != warm)
    code, body = await complete(other, "solo")
    assert code == 200, body
    assert (await models(other))["solo"]["lora"]["warm"] is False, "an on-demand copy is evictable"
    status = await wait_for(lambda: placed("Loaded"), timeout=TIMEOUT, what="the on-demand copy reported")
    assert status["loadedReplicas"] == 2 and status["registeredReplicas"] == 0
    # Growing the placement adds a pod, keeping the one that holds it.
    await cluster.patch(f"{ADAPTERS}/solo", {"spec": {"placement": {"replicas": 2}}})
    await wait_for(lambda: loaded_everywhere(cluster, ["solo"]), timeout=TIMEOUT, what="solo on both pods")
    assert await cluster.delete(f"{ADAPTERS}/solo") == 200
    await wait_for(lambda: _gone(cluster, "solo"), timeout=TIMEOUT, what="solo deleted")


async def _gone(cluster, name: str) -> bool:
    return await adapter(cluster, name) is None


async def test_delete_adapter_unloads_first(cluster) -> None:
    """Deleting an adapter unloads it before it disappears."""
    body = await adapter(cluster, "gamma")
    assert "loraserve.io/finalizer" in body["metadata"]["finalizers"]
    assert await cluster.delete(f"{ADAPTERS}/gamma") == 200
    await wait_for(lambda: _gone(cluster, "gamma"), timeout=TIMEOUT, what="gamma deleted")
    for pod in pods(cluster):
        held = await models(pod)
        assert "gamma" not in held and {"alpha", "beta"} <= set(held)
    assert await loaded_everywhere(cluster, ("alpha", "beta"))


async def test_spec_change_rolls_pods(cluster) -> None:
    """Spec change rolls the pods and adapters follow."""
    deployment = await cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}")
    old_hash = deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    old_pods = {p.name for p in pods(cluster)}

    # Scaling is not a runtime change: same config hash.
    await cluster.patch(f"{SERVES}/{SERVE}", {"spec": {"replicas": 2, "service": {"port": 8080}}})
    await wait_for(lambda: _service_port(cluster, 8080), timeout=TIMEOUT, what="Service port updated")
    deployment = await cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}")
    assert deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == old_hash

    await cluster.patch(f"{SERVES}/{SERVE}", {"spec": {"runtime": {"maxRunningRequests": 6}}})

    async def rolled() -> bool:
        d = await cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}")
        new_hash = d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        current = {p.name for p in pods(cluster)}
        return (
            new_hash != old_hash
            and not current & old_pods
            and await loaded_everywhere(cluster, ("alpha", "beta"))
        )

    await wait_for(rolled, timeout=TIMEOUT, what="pods rolled and adapters reloaded")
    for pod in pods(cluster):
        assert "--max-running-requests" in pod.command
        assert pod.command[pod.command.index("--max-running-requests") + 1] == "6"

    async def running() -> bool:
        body = await serve(cluster)
        status = body.get("status") or {}
        return (
            status.get("phase") == "Running"
            and status.get("observedGeneration") == body["metadata"]["generation"]
        )

    await wait_for(running, timeout=TIMEOUT, what="serve Running at the new generation")
    reasons = {e["reason"] for e in await cluster.events(NS) if e["involvedObject"]["kind"] == "LoRAServe"}
    assert "RollingUpdate" in reasons


async def _service_port(cluster, port: int) -> bool:
    service = await cluster.get(f"/api/v1/namespaces/{NS}/services/{SERVE}")
    return bool(service) and service["spec"]["ports"][0]["port"] == port


async def test_incompatible_change_loses_nothing(cluster) -> None:
    """Incompatible change is reported and nothing running is lost."""
    deployment = await cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}")
    before = deployment["metadata"]["resourceVersion"], {p.name for p in pods(cluster)}
    await cluster.patch(f"{SERVES}/{SERVE}", {"spec": {"lora": {"maxLorasPerBatch": 16}}})

    async def rejected() -> dict | None:
        status = ((await serve(cluster)) or {}).get("status") or {}
        compatible = next((c for c in status.get("conditions", []) if c["type"] == "Compatible"), {})
        return status if compatible.get("status") == "False" else None

    status = await wait_for(rejected, timeout=TIMEOUT, what="Compatible=False")
    compatible = next(c for c in status["conditions"] if c["type"] == "Compatible")
    assert compatible["reason"] == "PolicyViolation"
    assert "spec.lora.maxLorasPerBatch" in compatible["message"] and "fix:" in compatible["message"]
    assert status["phase"] == "Degraded", "still serving the previous spec"
    deployment = await cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}")
    assert (deployment["metadata"]["resourceVersion"], {p.name for p in pods(cluster)}) == before
    for pod in pods(cluster):
        assert (await complete(pod, "alpha"))[0] == 200

    await cluster.patch(f"{SERVES}/{SERVE}", {"spec": {"lora": {"maxLorasPerBatch": 4}}})

    async def recovered() -> bool:
        status = ((await serve(cluster)) or {}).get("status") or {}
        return status.get("phase") == "Running"

    await wait_for(recovered, timeout=TIMEOUT, what="Running again")


async def test_restart_no_duplicate_loads(cluster) -> None:
    """Operator restart converges without duplicate loads."""
    created = {pod.name: {n: e["created"] for n, e in (await models(pod)).items()} for pod in pods(cluster)}
    await cluster.stop_operator()
    # While no operator runs: a new Adapter appears.
    await cluster.create(ADAPTERS, assets.adapter_manifest("delta", SERVE, "pvc://adapters/delta"))
    await cluster.start_operator(operator_config(), None)
    await wait_for(
        lambda: loaded_everywhere(cluster, ("alpha", "beta", "delta")), timeout=TIMEOUT, what="delta loaded"
    )
    await asyncio.sleep(operator_config().resync_interval_s * 2)  # a few more passes
    assert loads(cluster, "alpha") == {} and loads(cluster, "beta") == {}, "already loaded: never asked again"
    assert set(loads(cluster, "delta").values()) == {1}
    for pod in pods(cluster):
        held = await models(pod)
        for name in ("alpha", "beta"):
            assert held[name]["created"] == created[pod.name][name], f"{name} was reloaded on {pod.name}"


async def test_delete_serve_leaves_pending(cluster) -> None:
    """Deleting the serve leaves its adapters pending."""
    assert await cluster.delete(f"{SERVES}/{SERVE}") == 200

    async def pending() -> bool:
        for name in ("alpha", "beta", "delta"):
            status = ((await adapter(cluster, name)) or {}).get("status") or {}
            if status.get("phase") != "Pending" or status.get("pods"):
                return False
        return await serve(cluster) is None and not pods(cluster)

    await wait_for(pending, timeout=TIMEOUT, what="adapters Pending, serve and pods gone")
    status = (await adapter(cluster, "alpha"))["status"]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "ServeNotFound"
    await cluster.stop_operator()
