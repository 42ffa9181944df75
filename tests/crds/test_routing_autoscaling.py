"""spec.routing / spec.autoscaling: the webhook's refusals name the field and the fix."""

from __future__ import annotations

import pytest

from loraserve.operator import webhooks

KEDA = {"serverAddress": "http://prometheus.monitoring:9090"}


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
def test_refusals_name_field_and_fix(autoscaling, needles):
    """Webhook refusals name the field and the fix."""
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
