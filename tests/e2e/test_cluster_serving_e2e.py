"""End to end: every pod of a serve answers every Adapter while pods come and go (issue 19).

There is no Kubernetes API server on these machines. kmock's KubernetesEmulator stands in
for it (``apiserver.py``: bookkeeping, graceful pod deletion, the scale subresource) and
``kubelet.py`` plays the Deployment controller (rolling updates by maxSurge /
maxUnavailable), the kubelet (ConfigMap volumes, probes, preStop / SIGTERM / SIGKILL) and
the garbage collector, running real ``loraserve-runtime`` processes (tiny CPU model). No
real Service exists either: ``service.py`` stands in for the serve's ClusterIP Service (a
random Ready pod per request, a terminating pod for 1 s more, no retries, as kube-proxy),
and ``traffic.py`` sends a bounded load through it. The scenario itself is
``scenario.py`` (shared with ``bench/operator.py --scenario cluster``).

The tests run in order on one cluster (module scope, its own namespace and serve).
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import pytest_asyncio

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
scenario_mod = cluster_mod.load_sibling("scenario")
traffic_mod = cluster_mod.load_sibling("traffic")
Plan = scenario_mod.AdapterPlan

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(720)]

NS = "fleet"
SERVE = "fleet"
PLANS = (
    Plan("alpha", "alpha"),
    Plan("beta", "beta"),
    Plan("gamma", "gamma"),
    Plan("delta", "delta", replicas=1),
)
PLACED = "delta"
CREATED = Plan("omega", "alpha")  # alpha's files under another name: alpha's outputs
DELETED = "gamma"
CATALOG_DIR = "/etc/loraserve/catalog"
MAX_TOKENS = 6
WORKERS = 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scn(cluster):
    await cluster.start_operator(scenario_mod.operator_config())
    scenario = scenario_mod.Scenario(cluster, NS, SERVE, say=lambda line: print(line, flush=True))
    try:
        yield scenario
    finally:
        await scenario.stop()
        await cluster.stop_operator()


async def _deployment(scn) -> dict:
    return await scn.cluster.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{SERVE}")


async def test_serve_comes_up_with_its_catalog_mounted(scn) -> None:
    await scn.bring_up(3, PLANS)
    serve = await scn.cluster.get(f"{scn.serves}/{SERVE}")

    configmap = await scn.cluster.get(f"/api/v1/namespaces/{NS}/configmaps/{SERVE}-adapters")
    assert configmap is not None, "the operator keeps the serve's catalog in <serve>-adapters"
    assert [r["uid"] for r in configmap["metadata"]["ownerReferences"]] == [serve["metadata"]["uid"]]
    catalogued = json.loads(configmap["data"]["catalog.json"])
    entries = catalogued["adapters"] if isinstance(catalogued, dict) else catalogued
    assert sorted(e["name"] for e in entries) == sorted(p.name for p in PLANS)

    template = (await _deployment(scn))["spec"]["template"]
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "catalog")
    assert volume["configMap"]["name"] == f"{SERVE}-adapters"
    assert volume["configMap"]["items"] == [{"key": "catalog.json", "path": "catalog.json"}]
    assert not volume["configMap"].get("optional")
    container = template["spec"]["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "catalog")
    assert mount["mountPath"] == CATALOG_DIR
    args = container["args"]
    assert args[args.index("--adapter-catalog") + 1] == f"{CATALOG_DIR}/catalog.json"
    assert container.get("lifecycle", {}).get("preStop"), "runtime pods need a preStop delay before SIGTERM"

    for pod in scn.pods():
        mounted = pod.volumes["catalog"][0] / "catalog.json"
        assert mounted.read_text() == configmap["data"]["catalog.json"], pod.name
        catalog = await scn.catalog(pod)
        assert set(catalog) == {p.name for p in PLANS}, (pod.name, catalog)
    warm = [pod.name for pod in scn.pods() if (await scn.catalog(pod))[PLACED]["warm"]]
    assert len(warm) == 1, f"{PLACED} (placement 1) is kept warm on {warm}"


async def test_adapter_loaded_on_first_request(scn) -> None:
    """The placement-1 adapter, asked straight from a pod that does not hold it: 200, then loaded there."""
    pods = scn.pods()
    catalogs = {pod.name: await scn.catalog(pod) for pod in pods}
    cold = [pod for pod in pods if catalogs[pod.name][PLACED]["state"] != "loaded"]
    assert len(cold) == len(pods) - 1, {name: c[PLACED] for name, c in catalogs.items()}
    status, answer = await cluster_mod.pod_complete(cold[0], PLACED)
    assert status == 200, answer
    assert answer["model"] == PLACED
    after = (await scn.catalog(cold[0]))[PLACED]
    assert after["state"] == "loaded", after
    scn.on_demand_pod = cold[0]


async def test_no_failures_while_pods_churn(scn) -> None:
    """Requests never fail while pods come and go."""
    base = await scn.base_model()
    models = [base, *(p.name for p in PLANS)]
    reference = await scn.reference(scn.on_demand_pod, models, traffic_mod.PROMPTS, max_tokens=MAX_TOKENS)
    for api in traffic_mod.APIS:
        for prompt in traffic_mod.PROMPTS:
            reference[(CREATED.name, prompt, api)] = reference[(CREATED.source, prompt, api)]

    scn.start_traffic(models, workers=WORKERS, max_tokens=MAX_TOKENS, timeout_s=60, deadline_s=480)
    await scn.delete_pod()
    await scn.scale(4)
    await scn.scale(2)
    await scn.roll(6)
    moments = await scn.churn(CREATED, DELETED)
    await scn.hold(10)  # requests for the new and the deleted adapter after the change
    records = await scn.traffic.stop()
    print(scn.timeline())
    outcome = scenario_mod.sort_records(records, created=CREATED.name, deleted=DELETED, moments=moments)

    def report(bad: list) -> str:
        lines = [r.describe() for r in bad[:15]]
        for pod in sorted({r.pod for r in bad if r.pod})[:3]:
            lines.append(scn.pod_log_tail(pod))
        failures = [f"{f.endpoint.pod} {f.path}: {f.error}" for f in scn.proxy.failures[:10]]
        return "\n".join([*lines, "proxy failures:", *failures, scn.timeline()])

    print(
        f"{len(records)} requests; served by {dict(Counter(r.pod for r in records))}; "
        f"{DELETED}: {len(outcome.deleted_before)} before its DELETE, {len(outcome.deleted_window)} until gone "
        f"{dict(Counter(r.status for r in outcome.deleted_window))}, {len(outcome.deleted_after)} after "
        f"{dict(Counter(r.status for r in outcome.deleted_after))}; {CREATED.name}: {len(outcome.created_early)} "
        f"before Ready {dict(Counter(r.status for r in outcome.created_early))}, {len(outcome.created_ready)} after"
    )
    failed = outcome.failed()
    assert not failed, f"{len(failed)} of {len(records)} requests failed:\n{report(failed)}"
    wrong = [r for r in records if r.ok and r.text != reference[(r.model, r.prompt, r.api)]]
    assert not wrong, "greedy outputs differ from one pod's alone:\n" + "\n".join(
        f"{r.describe()} want {reference[(r.model, r.prompt, r.api)]!r}" for r in wrong[:15]
    )
    assert outcome.deleted_after, "no request for the deleted adapter after it was gone"
    not_404 = [r for r in outcome.deleted_after if r.status != 404]
    assert not not_404, f"after {DELETED} was gone its requests must get 404:\n{report(not_404)}"
    odd = [r for r in outcome.deleted_window + outcome.created_early if r.status not in (200, 404)]
    assert not odd, f"while {DELETED} went away / {CREATED.name} came: only 200 or 404:\n{report(odd)}"
    assert outcome.created_ready, f"no request for {CREATED.name} after it was Ready"

    # Traffic flowed through every pod disturbance, and reached the first pods and the last.
    marks = {label: at for at, label in scn.traffic.marks}
    for label in (m for m in marks if m.startswith(("(a)", "(b)", "(c)", "hold")) and m.endswith(": start")):
        step = label[: -len(": start")]
        start, end = marks[label], marks[f"{step}: converged"]
        assert sum(start <= r.sent_at < end for r in records) >= 10, f"little traffic during {step}"
    served = {r.pod for r in records if r.ok}
    assert {p.name for p in scn.pods()} <= served and len(served) >= 5, sorted(served)


async def test_statuses_converge_after_the_disturbances(scn) -> None:
    await scn.wait_converged(2, what="converged after the scenario")
    serve = await scn.cluster.get(f"{scn.serves}/{SERVE}")
    assert serve["status"]["phase"] == "Running"
    assert (serve["status"]["replicas"], serve["status"]["readyReplicas"]) == (2, 2)
    assert serve["spec"]["replicas"] == 2
    assert await scn.cluster.get(f"{scn.adapters}/{DELETED}") is None

    configmap = await scn.cluster.get(f"/api/v1/namespaces/{NS}/configmaps/{SERVE}-adapters")
    names = {p.name for p in PLANS} - {DELETED} | {CREATED.name}
    for pod in scn.pods():
        catalog = await scn.catalog(pod)
        assert set(catalog) == names, (pod.name, sorted(catalog))
        mounted = pod.volumes["catalog"][0] / "catalog.json"
        assert mounted.read_text() == configmap["data"]["catalog.json"], (
            f"{pod.name}: the kubelet refreshed it"
        )
    warm = [pod.name for pod in scn.pods() if (await scn.catalog(pod))[PLACED]["warm"]]
    assert len(warm) == 1, f"{PLACED} (placement 1) is kept warm on {warm}"
    for name in names:
        status = (await scn.cluster.get(f"{scn.adapters}/{name}"))["status"]
        states = {entry["pod"]: entry["state"] for entry in status["pods"]}
        assert set(states) == {p.name for p in scn.pods()}, (name, states)
        if name != PLACED:
            assert set(states.values()) == {"Loaded"}, (name, states)
            assert status["loadedReplicas"] == 2, (name, status)
        else:
            assert set(states.values()) <= {"Loaded", "Registered"} and "Loaded" in states.values(), states
