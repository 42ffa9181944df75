"""spec.routing / spec.autoscaling: the CRD's CEL rules and the typed model agree, and the
webhook's refusals name the field and the fix."""

from __future__ import annotations

import pytest

from loraserve.operator import specs, webhooks


def _serve(**spec) -> dict:
    return {
        "apiVersion": specs.API_VERSION,
        "kind": "LoRAServe",
        "metadata": {"name": "s"},
        "spec": {"model": {"source": "/models/m"}, **spec},
    }


KEDA = {"serverAddress": "http://prometheus.monitoring:9090"}


@pytest.mark.parametrize(
    ("autoscaling", "ok"),
    [
        ({"maxReplicas": 4}, True),
        ({"minReplicas": 4, "maxReplicas": 4}, True),
        ({"minReplicas": 5, "maxReplicas": 4}, False),
        ({"minReplicas": 0, "maxReplicas": 4}, False),  # scale to zero needs KEDA
        ({"mode": "KEDA", "minReplicas": 0, "maxReplicas": 4, "keda": KEDA}, False),  # nothing would wake it
        ({"mode": "KEDA", "minReplicas": 0, "maxReplicas": 4, "keda": {**KEDA, "wakeQuery": "sum(gw_pending)"}}, True),
        ({"mode": "KEDA", "minReplicas": 1, "maxReplicas": 4, "keda": {**KEDA, "wakeQuery": "sum(gw_pending)"}}, True),
        ({"mode": "KEDA", "maxReplicas": 4}, False),
        ({"mode": "HPA", "maxReplicas": 4, "keda": KEDA}, False),
        ({"minReplicas": 1}, False),  # maxReplicas is required
        ({"maxReplicas": 0}, False),
        ({"maxReplicas": 4, "metricName": "vllm:num_requests_waiting"}, False),  # ':' not in custom metrics
        ({"maxReplicas": 4, "metricName": "loraserve_queue"}, True),
        ({"mode": "KEDA", "maxReplicas": 4, "keda": {"serverAddress": "prometheus:9090"}}, False),
        ({"mode": "KEDA", "maxReplicas": 4, "keda": {**KEDA, "metric": "vllm:num_requests_running"}}, True),
        ({"mode": "KEDA", "maxReplicas": 4, "keda": {**KEDA, "metric": "bad metric"}}, False),
        ({"mode": "Custom", "maxReplicas": 4}, False),
    ],
)
def test_autoscaling_rules_agree_between_cel_and_model(kit, autoscaling, ok):
    obj = _serve(autoscaling=autoscaling)
    admission = kit.admit(obj)
    try:
        specs.parse_loraserve_spec(obj["spec"])
        model_ok = True
    except specs.SpecError:
        model_ok = False
    assert (admission.valid, model_ok) == (ok, ok), admission.all()


@pytest.mark.parametrize(
    ("routing", "ok"),
    [
        ({"endpointPicker": {"name": "llama-epp"}}, True),
        ({"endpointPicker": {"name": "llama-epp", "port": 9002, "failureMode": "FailOpen"}}, True),
        ({}, False),
        ({"endpointPicker": {"name": "Llama_EPP"}}, False),
        ({"endpointPicker": {"name": "llama-epp", "port": 0}}, False),
        ({"endpointPicker": {"name": "llama-epp", "failureMode": "Ignore"}}, False),
    ],
)
def test_routing_rules_agree_between_cel_and_model(kit, routing, ok):
    obj = _serve(routing=routing)
    try:
        specs.parse_loraserve_spec(obj["spec"])
        model_ok = True
    except specs.SpecError:
        model_ok = False
    assert (kit.admit(obj).valid, model_ok) == (ok, ok)


def test_defaults_agree_between_crd_and_model(kit):
    spec = {
        "routing": {"endpointPicker": {"name": "e"}},
        "autoscaling": {"mode": "KEDA", "maxReplicas": 3, "keda": KEDA},
    }
    defaulted = kit.admit(_serve(**spec)).object["spec"]
    parsed = specs.parse_loraserve_spec(defaulted).to_dict()
    assert (
        parsed["routing"]
        == defaulted["routing"]
        == {"endpointPicker": {"name": "e", "port": 9002, "failureMode": "FailClose"}}
    )
    assert parsed["autoscaling"] == defaulted["autoscaling"]
    assert defaulted["autoscaling"]["keda"]["metric"] == "vllm:num_requests_waiting"
    assert defaulted["autoscaling"]["metricName"] == "vllm_num_requests_waiting"


@pytest.mark.parametrize(
    ("autoscaling", "needles"),
    [
        (
            {"minReplicas": 5, "maxReplicas": 2},
            ["spec.autoscaling", "minReplicas (5)", "maxReplicas (2)", "fix:"],
        ),
        ({"minReplicas": 0, "maxReplicas": 2}, ["spec.autoscaling", "mode KEDA", "fix:"]),
        ({"mode": "KEDA", "maxReplicas": 2}, ["spec.autoscaling.keda.serverAddress", "fix:"]),
        (
            {"mode": "KEDA", "minReplicas": 0, "maxReplicas": 2, "keda": KEDA},
            ["spec.autoscaling", "minReplicas 0", "fix:", "spec.autoscaling.keda.wakeQuery"],
        ),
        ({"maxReplicas": 2, "keda": KEDA}, ["spec.autoscaling.keda", "fix:"]),
        ({"maxReplicas": 2, "metricName": "vllm:x"}, ["spec.autoscaling.metricName"]),
    ],
)
def test_webhook_refusals_name_the_field_and_the_fix(autoscaling, needles):
    verdict = webhooks.judge_serve({"model": {"source": "/models/m"}, "autoscaling": autoscaling}, name="s")
    assert not verdict.allowed
    assert any(all(n in p for n in needles) for p in verdict.problems), verdict.problems


def test_webhook_admits_routing_and_autoscaling():
    spec = {
        "model": {"source": "/models/m"},
        "routing": {"endpointPicker": {"name": "s-epp"}},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
    }
    assert webhooks.judge_serve(spec, name="s").allowed
