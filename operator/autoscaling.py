"""Scaling with load: the HorizontalPodAutoscaler or KEDA ScaledObject of a LoRAServe (pure).

Both target the LoRAServe itself through its scale subresource (``specReplicasPath:
.spec.replicas``, ``statusReplicasPath: .status.replicas``, ``labelSelectorPath:
.status.selector``): the autoscaler writes ``spec.replicas`` and the operator copies it into
the Deployment, as it does any spec change, so the two never fight. (Pointing the
autoscaler at the Deployment instead would have the operator undo every scale.)

The signal is the runtime's queue, exported with vLLM's names (``runtime/server/metrics.py``):

* mode HPA: an ``autoscaling/v2`` ``Pods`` metric, averaged over the pods the scale
  subresource's selector picks. Custom-metrics names cannot hold ':', so the metric is
  ``spec.autoscaling.metricName`` (default ``vllm_num_requests_waiting``), which a
  prometheus-adapter rule serves from ``vllm:num_requests_waiting`` (README).
* mode KEDA: a ``prometheus`` trigger whose query sums the series over this serve's pods,
  ``sum(vllm:num_requests_waiting{namespace="<ns>",loraserve_io_serve="<serve>"})``, with
  ``metricType: AverageValue`` so the HPA KEDA makes divides it by the replica count. The
  ``loraserve_io_serve`` label is the pod label ``loraserve.io/serve`` that the chart's
  PodMonitor copies onto every series (``podTargetLabels``); ``namespace`` is set by the
  Prometheus Operator on every target.

  Those series exist only while a pod of the serve runs, so at zero replicas nothing would
  wake the serve: ``minReplicas: 0`` needs ``keda.wakeQuery`` (the spec model and the CRD
  refuse it otherwise), a second trigger on a signal outside the serve's pods.
"""

from __future__ import annotations

from .desired import (
    SERVE_LABEL,
    DesiredSettings,
    ServeIdentity,
    label_value,
    owned_metadata,
)
from .diff import with_desired_hash
from .specs import API_VERSION as LORASERVE_API_VERSION
from .specs import LORASERVE_KIND, AutoscalingSpec

HPA_API_VERSION = "autoscaling/v2"
HPA_KIND = "HorizontalPodAutoscaler"
HPA_PLURAL = "horizontalpodautoscalers"
KEDA_GROUP = "keda.sh"
KEDA_API_VERSION = f"{KEDA_GROUP}/v1alpha1"
KEDA_KIND = "ScaledObject"
KEDA_PLURAL = "scaledobjects"

HPA_OWNED = ("spec.scaleTargetRef", "spec.minReplicas", "spec.maxReplicas", "spec.metrics", "spec.behavior")
SCALED_OBJECT_OWNED = (
    "spec.scaleTargetRef",
    "spec.minReplicaCount",
    "spec.maxReplicaCount",
    "spec.pollingInterval",
    "spec.cooldownPeriod",
    "spec.advanced",
    "spec.triggers",
)


def prometheus_label(label: str) -> str:
    """A Kubernetes label key as the Prometheus Operator's podTargetLabels names it."""
    return "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in label)


PROMETHEUS_SERVE_LABEL = prometheus_label(SERVE_LABEL)
"""``loraserve.io/serve`` as a Prometheus label: ``loraserve_io_serve``."""


def canonical_quantity(value: int) -> str:
    """A whole number as the API server writes it back as a Quantity (1000 -> "1k", 1500 -> "1500").

    The HPA's target is a Quantity, which the API server stores in canonical form; writing
    any other spelling would look like drift on every pass.
    """
    suffixes = ("", "k", "M", "G", "T", "P", "E")
    index = 0
    while value and value % 1000 == 0 and index < len(suffixes) - 1:
        value //= 1000
        index += 1
    return f"{value}{suffixes[index]}"


def _promql_string(value: str) -> str:
    """A PromQL double-quoted string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def serve_query(serve: ServeIdentity, metric: str) -> str:
    """PromQL: ``metric`` summed over the serve's runtime pods (all of its pods, none of others')."""
    matchers = (
        f"namespace={_promql_string(serve.namespace)},"
        f"{PROMETHEUS_SERVE_LABEL}={_promql_string(label_value(serve.name))}"
    )
    return f"sum({metric}{{{matchers}}})"


def object_name(serve_name: str) -> str:
    """The HPA's or ScaledObject's name: the serve's."""
    return serve_name


def _target_ref(serve: ServeIdentity) -> dict:
    return {"apiVersion": LORASERVE_API_VERSION, "kind": LORASERVE_KIND, "name": serve.name}


def _behavior(spec: AutoscalingSpec) -> dict:
    return {"scaleDown": {"stabilizationWindowSeconds": spec.scale_down_stabilization_seconds}}


def horizontal_pod_autoscaler(serve: ServeIdentity, spec: AutoscalingSpec, settings: DesiredSettings) -> dict:
    """An autoscaling/v2 HPA scaling the LoRAServe on a per-pod custom metric."""
    hpa = {
        "apiVersion": HPA_API_VERSION,
        "kind": HPA_KIND,
        "metadata": owned_metadata(serve, object_name(serve.name), settings),
        "spec": {
            "scaleTargetRef": _target_ref(serve),
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": spec.metric_name},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": canonical_quantity(spec.target_per_replica),
                        },
                    },
                }
            ],
            "behavior": _behavior(spec),
        },
    }
    return with_desired_hash(hpa)


def scaled_object(serve: ServeIdentity, spec: AutoscalingSpec, settings: DesiredSettings) -> dict:
    """A KEDA ScaledObject scaling the LoRAServe on a Prometheus query over its pods."""
    keda = spec.keda
    if keda is None:  # the model refuses mode KEDA without it
        raise ValueError("spec.autoscaling.keda is required with mode KEDA")
    query = keda.query or serve_query(serve, keda.metric)
    obj = {
        "apiVersion": KEDA_API_VERSION,
        "kind": KEDA_KIND,
        "metadata": owned_metadata(serve, object_name(serve.name), settings),
        "spec": {
            "scaleTargetRef": _target_ref(serve),
            "minReplicaCount": spec.min_replicas,
            "maxReplicaCount": spec.max_replicas,
            "pollingInterval": keda.polling_interval_seconds,
            "cooldownPeriod": keda.cooldown_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": [_trigger(keda.server_address, query, spec.target_per_replica)]
            + (
                [_trigger(keda.server_address, keda.wake_query, spec.target_per_replica, WAKE_TRIGGER)]
                if keda.wake_query
                else []
            ),
        },
    }
    return with_desired_hash(obj)


WAKE_TRIGGER = "wake"
"""The name of the trigger on ``keda.wakeQuery``: the one signal that exists at zero pods."""


def _trigger(server: str, query: str, target: int, name: str | None = None) -> dict:
    """A prometheus trigger averaging ``query`` over the replicas against ``target``; KEDA
    activates a serve at zero replicas when a trigger's query is above 0."""
    trigger = {
        "type": "prometheus",
        "metricType": "AverageValue",
        "metadata": {"serverAddress": server, "query": query, "threshold": str(target)},
    }
    if name is not None:
        trigger["name"] = name
        trigger["metadata"]["activationThreshold"] = "0"
    return trigger


def describe(obj: dict) -> str:
    """One line for the Autoscaling condition."""
    spec = obj["spec"]
    name = obj["metadata"]["name"]
    if obj["kind"] == HPA_KIND:
        metric = spec["metrics"][0]["pods"]
        return (
            f"HorizontalPodAutoscaler {name} scales spec.replicas within {spec['minReplicas']}.."
            f"{spec['maxReplicas']} on the Pods metric {metric['metric']['name']} "
            f"(target {metric['target']['averageValue']} per replica)"
        )
    trigger = spec["triggers"][0]["metadata"]
    return (
        f"ScaledObject {name} scales spec.replicas within {spec['minReplicaCount']}..{spec['maxReplicaCount']} "
        f"on {trigger['query']} (target {trigger['threshold']} per replica)"
    )
