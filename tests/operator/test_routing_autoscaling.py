"""spec.routing and spec.autoscaling: the objects built, checked against the upstream CRDs, and
the reconcile step that applies or deletes them, with and without their APIs.

There is no Kubernetes API server on these machines: kmock's KubernetesEmulator stands in for
it (with the bookkeeping of ``tests/e2e/apiserver.py``). It validates no schema, so the
objects the operator writes are validated here against the upstream CRDs vendored in
``tests/vendor`` (InferencePool, ScaledObject) and kubernetes-validate (the HPA). Resources
the emulator does not declare answer 404 on discovery, as on a cluster without those CRDs.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import kmock
import kubernetes_validate
import pytest

from loraserve.operator import autoscaling as asc
from loraserve.operator import desired as ds
from loraserve.operator import routing as rt
from loraserve.operator.reconcile import optional
from loraserve.operator.reconcile.kube import (
    DEPLOYMENTS,
    HPAS,
    INFERENCE_POOLS,
    LORASERVES,
    SCALED_OBJECTS,
    KubeClient,
    KubeError,
)
from loraserve.operator.specs import SpecError, parse_loraserve_spec

from .api_standin import (
    LORASERVE_API,
    NAME,
    NS,
    SETTINGS,
    api_client,
    apiserver,
    reconcile_pass,
    serve_body,
    writes,
)

HERE = Path(__file__).parent
IDENTITY = ds.ServeIdentity(name=NAME, namespace=NS, uid="0b8e6a1e-0000-4000-8000-000000000001")
KEDA = {"serverAddress": "http://prometheus-operated.monitoring:9090"}
ROUTING = {"endpointPicker": {"name": "llama-epp"}}


def _load(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def upstream():
    return _load("_loraserve_upstream_schema", HERE.parent / "vendor" / "upstream_schema.py")


def _spec(**extra):
    return parse_loraserve_spec({"model": {"source": "/models/m"}, **extra})


# --------------------------------------------------------------------------- the objects


def test_inference_pool_is_v1_shape() -> None:
    """Inference pool is the v1 shape the upstream CRD accepts."""
    pool = rt.inference_pool(IDENTITY, _spec(routing=ROUTING).routing, SETTINGS, target_port=8000)
    assert upstream().validate(pool) == []
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == ds.selector_labels(NAME)
    assert spec["targetPorts"] == [{"number": 8000}]
    assert spec["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pool["metadata"]["ownerReferences"] == [ds.owner_reference(IDENTITY)]
    assert pool["metadata"]["name"] == NAME


def test_pool_selects_deployment_pods() -> None:
    """The pool selects exactly the pods the deployment makes."""
    spec = _spec(routing=ROUTING)
    from loraserve.operator.translate import to_runtime_config

    config = to_runtime_config(spec)
    plan = ds.desired_serve(IDENTITY, spec, config, SETTINGS)
    pool = rt.inference_pool(IDENTITY, spec.routing, SETTINGS, target_port=config.server.port)
    pod_labels = plan.deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (container,) = plan.deployment["spec"]["template"]["spec"]["containers"]
    assert pool["spec"]["targetPorts"][0]["number"] in {p["containerPort"] for p in container["ports"]}


def test_upstream_check_refuses_pre_ga() -> None:
    """The upstream check refuses the pre ga shape and undeclared fields."""
    pool = rt.inference_pool(IDENTITY, _spec(routing=ROUTING).routing, SETTINGS)
    old = copy.deepcopy(pool)
    old["spec"]["extensionRef"] = old["spec"].pop("endpointPickerRef")  # v1alpha2's name
    assert any("endpointPickerRef" in p for p in upstream().validate(old))
    typo = copy.deepcopy(pool)
    typo["spec"]["targetPorts"] = [{"number": 8000, "name": "http"}]
    assert any("targetPorts[0].name" in p for p in upstream().validate(typo))
    no_port = copy.deepcopy(pool)
    del no_port["spec"]["endpointPickerRef"]["port"]
    assert any("port is required" in p for p in upstream().validate(no_port))


@pytest.mark.parametrize("version", ["1.28.0", kubernetes_validate.utils.latest_version()])
def test_hpa_is_valid_autoscaling_v2(version) -> None:
    """HPA is a valid autoscaling v2 object on the scale subresource."""
    auto = _spec(autoscaling={"minReplicas": 2, "maxReplicas": 6, "targetPerReplica": 3}).autoscaling
    hpa = asc.horizontal_pod_autoscaler(IDENTITY, auto, SETTINGS)
    kubernetes_validate.validate(hpa, version, strict=True)
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "LoRAServe",
        "name": NAME,
    }
    assert (spec["minReplicas"], spec["maxReplicas"]) == (2, 6)
    (metric,) = spec["metrics"]
    assert metric == {
        "type": "Pods",
        "pods": {
            "metric": {"name": "vllm_num_requests_waiting"},
            "target": {"type": "AverageValue", "averageValue": "3"},
        },
    }
    assert ":" not in metric["pods"]["metric"]["name"]
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300


@pytest.mark.parametrize(
    ("target", "stored"),
    [(1, "1"), (4, "4"), (999, "999"), (1000, "1k"), (1500, "1500"), (12000, "12k"), (2000000, "2M")],
)
def test_hpa_target_as_stored(target, stored) -> None:
    """HPA target is written as the API server stores it."""
    # The API server canonicalises Quantities ("1000" is stored as "1k"); another spelling
    # would differ from what is read back and be rewritten on every pass.
    auto = _spec(autoscaling={"maxReplicas": 2, "targetPerReplica": min(target, 100000)}).autoscaling
    assert asc.canonical_quantity(target) == stored
    if target <= 100000:
        hpa = asc.horizontal_pod_autoscaler(IDENTITY, auto, SETTINGS)
        assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == stored


def test_scaled_object_matches_keda() -> None:
    """Scaled object matches the KEDA CRD and queries only this serve."""
    auto = _spec(autoscaling={"mode": "KEDA", "minReplicas": 1, "maxReplicas": 5, "keda": KEDA}).autoscaling
    obj = asc.scaled_object(IDENTITY, auto, SETTINGS)
    assert upstream().validate(obj) == []
    spec = obj["spec"]
    assert spec["scaleTargetRef"]["kind"] == "LoRAServe" and spec["scaleTargetRef"]["name"] == NAME
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 5)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": KEDA["serverAddress"],
        "query": 'sum(vllm:num_requests_waiting{namespace="ml",loraserve_io_serve="llama"})',
        "threshold": "4",
    }
    broken = copy.deepcopy(obj)
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA's metadata values are strings
    assert upstream().validate(broken)


def test_scale_to_zero_wakes_on_the_wake_query() -> None:
    """At zero pods the serve's own series are gone: the wake trigger is what activates it."""
    wake = 'sum(envoy_cluster_upstream_rq_pending_active{envoy_cluster_name="llama"})'
    keda = {**KEDA, "wakeQuery": wake}
    auto = _spec(autoscaling={"mode": "KEDA", "minReplicas": 0, "maxReplicas": 5, "keda": keda}).autoscaling
    obj = asc.scaled_object(IDENTITY, auto, SETTINGS)
    assert upstream().validate(obj) == []
    assert obj["spec"]["minReplicaCount"] == 0
    own, woken = obj["spec"]["triggers"]
    assert "loraserve_io_serve" in own["metadata"]["query"] and "name" not in own
    assert woken["name"] == asc.WAKE_TRIGGER
    assert woken["metadata"] == {
        "serverAddress": KEDA["serverAddress"],
        "query": wake,
        "threshold": "4",
        "activationThreshold": "0",
    }
    with pytest.raises(SpecError, match="wakeQuery"):
        _spec(autoscaling={"mode": "KEDA", "minReplicas": 0, "maxReplicas": 5, "keda": KEDA})


def test_query_label_is_prometheus_label() -> None:
    """The query label is the pod label as prometheus names it."""
    # The chart's PodMonitor copies the pod label loraserve.io/serve onto every series
    # (podTargetLabels), which Prometheus spells loraserve_io_serve; the value is the pod's.
    assert asc.prometheus_label(ds.SERVE_LABEL) == asc.PROMETHEUS_SERVE_LABEL == "loraserve_io_serve"
    long = ds.ServeIdentity(name="x" * 70, namespace='we"ird', uid="u")
    query = asc.serve_query(long, "vllm:num_requests_running")
    assert f'loraserve_io_serve="{ds.label_value(long.name)}"' in query
    assert 'namespace="we\\"ird"' in query
    assert query.startswith("sum(vllm:num_requests_running{")


def test_user_query_replaces_default() -> None:
    """A query of the users own replaces the default."""
    keda = {**KEDA, "query": "sum(rate(vllm:request_success_total[1m]))"}
    auto = _spec(autoscaling={"mode": "KEDA", "maxReplicas": 5, "keda": keda}).autoscaling
    trigger = asc.scaled_object(IDENTITY, auto, SETTINGS)["spec"]["triggers"][0]
    assert trigger["metadata"]["query"] == keda["query"]


# --------------------------------------------------------------------------- the reconcile step


OPTIONAL_APIS = {
    "inference.networking.k8s.io/v1/inferencepools": ("InferencePool", True),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True),
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True),
}


@pytest.fixture
async def full():
    """An API that serves the InferencePool, HPA and KEDA APIs."""
    async with api_client({**LORASERVE_API, **OPTIONAL_APIS}) as api:
        yield api


@pytest.fixture
async def bare():
    """An API without the Inference Extension or KEDA CRDs (autoscaling/v2 is served)."""
    hpa = {"autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True)}
    async with api_client({**LORASERVE_API, **hpa}) as api:
        yield api


def _condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions", ()) if c["type"] == type_), None)


async def _set_spec(client: KubeClient, **changes) -> None:
    await client.patch(LORASERVES, NS, NAME, {"spec": changes})


async def test_routing_and_hpa_lifecycle(full) -> None:
    """Routing and HPA are created owned updated idempotent and deleted."""
    server, client = full
    await client.create(LORASERVES, NS, serve_body(routing=ROUTING, autoscaling={"maxReplicas": 4}))
    outcome = await reconcile_pass(client)
    made = {(a.verb, a.kind) for a in outcome.acts}
    assert {("Created", "InferencePool"), ("Created", "HorizontalPodAutoscaler")} <= made
    uid = (await client.get(LORASERVES, NS, NAME))["metadata"]["uid"]
    pool = await client.get(INFERENCE_POOLS, NS, NAME)
    hpa = await client.get(HPAS, NS, NAME)
    for obj in (pool, hpa):
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LoRAServe", NAME, uid, True)
    assert upstream().validate(pool) == []
    assert pool["spec"]["endpointPickerRef"]["name"] == "llama-epp"
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "LoRAServe" and hpa["spec"]["maxReplicas"] == 4
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    routing, scaling = _condition(status, "Routing"), _condition(status, "Autoscaling")
    assert (routing["status"], routing["reason"]) == ("True", "InferencePoolApplied")
    assert "llama-epp:9002" in routing["message"]
    assert (scaling["status"], scaling["reason"]) == ("True", "HorizontalPodAutoscalerApplied")
    assert "vllm_num_requests_waiting" in scaling["message"]

    since = len(list(server))
    again = await reconcile_pass(client)
    assert again.acts == [] and not again.status_written
    assert writes(server, since) == [], "a converged serve gets no write"

    # A spec change updates both, and rolls no pod (the config hash does not cover them).
    await _set_spec(
        client,
        routing={"endpointPicker": {"name": "llama-epp", "port": 9100, "failureMode": "FailOpen"}},
        autoscaling={"maxReplicas": 8, "targetPerReplica": 2},
    )
    changed = await reconcile_pass(client)
    assert {(a.verb, a.kind) for a in changed.acts} == {
        ("Updated", "InferencePool"),
        ("Updated", "HorizontalPodAutoscaler"),
    }
    assert changed.rolled_from is None
    pool = await client.get(INFERENCE_POOLS, NS, NAME)
    assert pool["spec"]["endpointPickerRef"]["port"] == {"number": 9100}
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    hpa = await client.get(HPAS, NS, NAME)
    assert hpa["spec"]["maxReplicas"] == 8
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "2"

    # A hand edit of an owned field is undone.
    await client.patch(HPAS, NS, NAME, {"spec": {"maxReplicas": 100}})
    await reconcile_pass(client)
    assert (await client.get(HPAS, NS, NAME))["spec"]["maxReplicas"] == 8

    # Removing the fields deletes what the operator made, and the conditions go.
    await client.patch(LORASERVES, NS, NAME, {"spec": {"routing": None, "autoscaling": None}})
    removed = await reconcile_pass(client)
    assert {(a.verb, a.kind) for a in removed.acts} == {
        ("Deleted", "InferencePool"),
        ("Deleted", "HorizontalPodAutoscaler"),
    }
    assert await client.get(INFERENCE_POOLS, NS, NAME) is None
    assert await client.get(HPAS, NS, NAME) is None
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    assert _condition(status, "Routing") is None and _condition(status, "Autoscaling") is None
    since = len(list(server))
    assert (await reconcile_pass(client)).acts == [] and writes(server, since) == []


async def test_keda_replaces_hpa(full) -> None:
    """Switching to KEDA replaces the HPA with a scaled object."""
    _, client = full
    await client.create(LORASERVES, NS, serve_body(autoscaling={"maxReplicas": 4}))
    await reconcile_pass(client)
    assert await client.get(HPAS, NS, NAME) is not None
    await _set_spec(client, autoscaling={"mode": "KEDA", "maxReplicas": 4, "keda": KEDA})
    outcome = await reconcile_pass(client)
    assert {(a.verb, a.kind) for a in outcome.acts} == {
        ("Deleted", "HorizontalPodAutoscaler"),
        ("Created", "ScaledObject"),
    }
    assert await client.get(HPAS, NS, NAME) is None
    scaled = await client.get(SCALED_OBJECTS, NS, NAME)
    assert upstream().validate(scaled) == []
    assert 'loraserve_io_serve="llama"' in scaled["spec"]["triggers"][0]["metadata"]["query"]
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    assert _condition(status, "Autoscaling")["reason"] == "ScaledObjectApplied"


async def test_absent_apis_keep_serving(bare) -> None:
    """Absent APIs leave the serve running and say why."""
    server, client = bare
    await client.create(
        LORASERVES,
        NS,
        serve_body(routing=ROUTING, autoscaling={"mode": "KEDA", "maxReplicas": 4, "keda": KEDA}),
    )
    outcome = await reconcile_pass(client)
    assert ("Created", "Deployment") in {(a.verb, a.kind) for a in outcome.acts}
    assert not {"InferencePool", "ScaledObject"} & {a.kind for a in outcome.acts}
    assert (await client.get(DEPLOYMENTS, NS, NAME))["spec"]["replicas"] == 2
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    routing, scaling = _condition(status, "Routing"), _condition(status, "Autoscaling")
    assert (routing["status"], routing["reason"]) == ("False", "InferencePoolCRDMissing")
    assert "inference.networking.k8s.io/v1" in routing["message"] and "fix:" in routing["message"]
    assert (scaling["status"], scaling["reason"]) == ("False", "KEDACRDMissing")
    assert "KEDA is not installed" in scaling["message"] and "spec.replicas (2)" in scaling["message"]
    assert status["phase"] != "Failed" and _condition(status, "Degraded")["status"] == "False"

    # Discovery's answer is remembered: the next pass asks nothing of it and writes nothing.
    since = len(list(server))
    again = await reconcile_pass(client)
    assert again.acts == [] and writes(server, since) == []
    asked = [r.url.path for r in list(server)[since:]]
    assert "/apis/keda.sh/v1alpha1" not in asked and "/apis/inference.networking.k8s.io/v1" not in asked

    # Once the CRDs are installed (and the cache expires), the objects come.
    for path, (kind, namespaced) in OPTIONAL_APIS.items():
        server.resources[path] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=apiserver().VERBS)
    optional.discovery(client).forget()
    later = await reconcile_pass(client)
    assert {("Created", "InferencePool"), ("Created", "ScaledObject")} <= {
        (a.verb, a.kind) for a in later.acts
    }
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    assert _condition(status, "Routing")["status"] == "True"
    assert _condition(status, "Autoscaling")["status"] == "True"


async def test_discovery_is_cached_for_its_ttl(bare) -> None:
    server, client = bare
    seen = optional.ApiDiscovery(ttl_s=3600)
    assert not await seen.serves(client, INFERENCE_POOLS)
    assert await seen.serves(client, HPAS)
    since = len(list(server))
    assert not await seen.serves(client, INFERENCE_POOLS) and await seen.serves(client, HPAS)
    assert len(list(server)) == since, "answered from the cache"
    expired = optional.ApiDiscovery(ttl_s=0)
    await expired.serves(client, INFERENCE_POOLS)
    await expired.serves(client, INFERENCE_POOLS)
    assert len(list(server)) == since + 2


async def test_foreign_object_left_alone(full) -> None:
    """An object of the same name not ours is left alone."""
    _, client = full
    theirs = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other"},
            "maxReplicas": 3,
        },
    }
    await client.create(HPAS, NS, theirs)
    await client.create(LORASERVES, NS, serve_body(autoscaling={"maxReplicas": 4}))
    outcome = await reconcile_pass(client)
    assert "HorizontalPodAutoscaler" not in {a.kind for a in outcome.acts}
    kept = await client.get(HPAS, NS, NAME)
    assert kept["spec"]["scaleTargetRef"]["name"] == "other" and "ownerReferences" not in kept["metadata"]
    scaling = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Autoscaling")
    assert (scaling["status"], scaling["reason"]) == ("False", "NameTaken")
    # ...and removing spec.autoscaling does not delete it either.
    await client.patch(LORASERVES, NS, NAME, {"spec": {"autoscaling": None}})
    await reconcile_pass(client)
    assert await client.get(HPAS, NS, NAME) is not None


async def test_hpa_metric_failure_reported(full) -> None:
    """An HPA that cannot read its metric is reported."""
    _, client = full
    await client.create(LORASERVES, NS, serve_body(autoscaling={"maxReplicas": 4}))
    await reconcile_pass(client)
    failed = {
        "type": "ScalingActive",
        "status": "False",
        "reason": "FailedGetPodsMetric",
        "message": "unable to get metric vllm_num_requests_waiting: no custom metrics API (custom.metrics.k8s.io) registered",
    }
    await client.patch(HPAS, NS, NAME, {"status": {"conditions": [failed]}}, subresource="status")
    await reconcile_pass(client)
    scaling = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Autoscaling")
    assert (scaling["status"], scaling["reason"]) == ("False", "MetricUnavailable")
    assert "custom.metrics.k8s.io" in scaling["message"] and "prometheus-adapter" in scaling["message"]


async def test_rejected_spec_keeps_objects(full) -> None:
    """A rejected spec keeps the objects and the conditions."""
    _, client = full
    await client.create(LORASERVES, NS, serve_body(routing=ROUTING))
    await reconcile_pass(client)
    before = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Routing")
    await _set_spec(client, routing=None, lora={"maxLorasPerBatch": 16, "maxLoadedLoras": 8})
    outcome = await reconcile_pass(client)
    assert outcome.rejected and outcome.acts == []
    assert await client.get(INFERENCE_POOLS, NS, NAME) is not None, "a refused spec changes nothing that runs"
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    assert _condition(status, "Routing") == before


async def test_routing_condition_gateway_use(full) -> None:
    """The routing condition tells whether a gateway uses the pool."""
    _, client = full
    await client.create(LORASERVES, NS, serve_body(routing=ROUTING))
    await reconcile_pass(client)
    routing = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Routing")
    assert "no gateway routes to it yet" in routing["message"]
    parents = [
        {
            "parentRef": {"kind": "Gateway", "name": "inference-gw"},
            "conditions": [
                {
                    "type": "Accepted",
                    "status": "True",
                    "reason": "Accepted",
                    "message": "",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ],
        }
    ]
    await client.patch(INFERENCE_POOLS, NS, NAME, {"status": {"parents": parents}}, subresource="status")
    outcome = await reconcile_pass(client)
    assert outcome.acts == [], "the gateway's status is not drift"
    routing = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Routing")
    assert routing["status"] == "True" and routing["message"].endswith("; accepted by Gateway inference-gw")
    parents[0]["conditions"][0].update(
        status="False", reason="NotSupportedByGateway", message="no EPP support"
    )
    await client.patch(INFERENCE_POOLS, NS, NAME, {"status": {"parents": parents}}, subresource="status")
    await reconcile_pass(client)
    routing = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Routing")
    assert routing["message"].endswith("; not accepted by Gateway inference-gw (no EPP support)")


async def test_removed_crd_reported(full, monkeypatch) -> None:
    """A CRD removed after discovery answered is reported not raised."""
    server, client = full
    await client.create(LORASERVES, NS, serve_body(routing=ROUTING))
    optional.discovery(client).forget()
    assert await optional.discovery(client).serves(client, INFERENCE_POOLS)  # cached: served
    # The CRD is deleted. (kmock accepts writes to undeclared resources, so the API server's
    # answer to a write of a resource it no longer serves, 404, is played here.)
    del server.resources["inference.networking.k8s.io/v1/inferencepools"]
    create = client.create

    async def create_or_404(res, namespace, body):
        if res == INFERENCE_POOLS:
            raise KubeError(404, "NotFound", "the server could not find the requested resource")
        return await create(res, namespace, body)

    monkeypatch.setattr(client, "create", create_or_404)
    outcome = await reconcile_pass(client)
    assert "InferencePool" not in {a.kind for a in outcome.acts}
    assert ("Created", "Deployment") in {(a.verb, a.kind) for a in outcome.acts}
    routing = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Routing")
    assert (routing["status"], routing["reason"]) == ("False", "InferencePoolCRDMissing")
    since = len(list(server))
    await reconcile_pass(client)
    asked = [r.url.path for r in list(server)[since:]]
    assert "/apis/inference.networking.k8s.io/v1" in asked, "the stale answer was forgotten"


async def test_autoscaler_replicas_reach_deploy(full) -> None:
    """The autoscalers replicas reach the deployment and nothing fights them."""
    # What the HPA controller (or KEDA's) does: read the LoRAServe's scale subresource (its
    # selector picks the pods whose metric is averaged) and write spec.replicas through it.
    server, client = full
    await client.create(LORASERVES, NS, serve_body(routing=ROUTING, autoscaling={"maxReplicas": 6}))
    first = await reconcile_pass(client)
    scale_path = LORASERVES.path(NS, NAME, "scale")
    scale = await client.request("GET", scale_path)
    selector = dict(term.split("=", 1) for term in scale["status"]["selector"].split(","))
    assert selector == ds.selector_labels(NAME)
    assert selector == (await client.get(INFERENCE_POOLS, NS, NAME))["spec"]["selector"]["matchLabels"]

    # (The HPA controller PUTs the Scale; the stand-in takes the write as a merge patch.)
    await client.patch(LORASERVES, NS, NAME, {"spec": {"replicas": 5}}, subresource="scale")
    outcome = await reconcile_pass(client)
    assert [(a.verb, a.kind) for a in outcome.acts] == [("Updated", "Deployment")]
    assert outcome.rolled_from is None and outcome.config_hash == first.config_hash, "scaling rolls no pod"
    assert (await client.get(DEPLOYMENTS, NS, NAME))["spec"]["replicas"] == 5
    assert (await client.get(LORASERVES, NS, NAME))["spec"]["replicas"] == 5, "the operator keeps it"
    since = len(list(server))
    assert (await reconcile_pass(client)).acts == [] and writes(server, since) == []


async def test_refused_write_is_condition(full, monkeypatch) -> None:
    """A refused write is a condition not a failed pass."""
    # E.g. an operator installed with an older chart, without RBAC for HPAs: the API answers 403.
    _, client = full
    await client.create(LORASERVES, NS, serve_body(autoscaling={"maxReplicas": 4}))
    create = client.create

    async def forbidden(res, namespace, body):
        if res == HPAS:
            raise KubeError(403, "Forbidden", 'cannot create resource "horizontalpodautoscalers"')
        return await create(res, namespace, body)

    monkeypatch.setattr(client, "create", forbidden)
    outcome = await reconcile_pass(client)
    assert ("Created", "Deployment") in {(a.verb, a.kind) for a in outcome.acts}
    scaling = _condition((await client.get(LORASERVES, NS, NAME))["status"], "Autoscaling")
    assert (scaling["status"], scaling["reason"]) == ("False", "ApplyFailed")
    assert "403 Forbidden" in scaling["message"] and "HorizontalPodAutoscaler" in scaling["message"]
