"""Routing by adapter: the InferencePool a LoRAServe owns when ``spec.routing`` is set (pure).

A cluster with an inference gateway (Gateway API Inference Extension) routes requests for an
``InferencePool`` through the pool's endpoint picker (EPP), which scrapes each pod's
``/metrics`` and prefers a pod whose ``vllm:lora_requests_info`` lists the request's adapter
as running or waiting, then the shortest ``vllm:num_requests_waiting`` and the lowest
``vllm:kv_cache_usage_perc``. The runtime exports those names (``runtime/server/metrics.py``);
this module only describes the pool: the serve's pods (the Deployment's selector labels) on
the runtime port, and the picker the user names. Routing by adapter is an optimisation: every
pod can answer every adapter of its serve, so a pool missing or a picker down (with
``failureMode: FailOpen``) costs adapter loads, never correctness.

Shape: ``inference.networking.k8s.io/v1`` as in the upstream CRD (tests/vendor/): spec.selector
.matchLabels, spec.targetPorts[{number}], spec.endpointPickerRef{group, kind, name, port
{number}, failureMode}.
"""

from __future__ import annotations

from .desired import (
    DesiredSettings,
    ServeIdentity,
    owned_metadata,
    selector_labels,
)
from .diff import with_desired_hash
from .specs import RoutingSpec
from .translate import RUNTIME_PORT

GROUP = "inference.networking.k8s.io"
API_VERSION = f"{GROUP}/v1"
KIND = "InferencePool"
PLURAL = "inferencepools"

INFERENCE_POOL_OWNED = ("spec.selector", "spec.targetPorts", "spec.endpointPickerRef", "spec.appProtocol")
"""The fields the operator sets, and undoes hand edits of; the gateway writes only status."""


def pool_name(serve_name: str) -> str:
    """The InferencePool's name: the serve's (what the EPP's ``--pool-name`` must say)."""
    return serve_name


def inference_pool(
    serve: ServeIdentity, routing: RoutingSpec, settings: DesiredSettings, *, target_port: int = RUNTIME_PORT
) -> dict:
    """The InferencePool selecting the serve's runtime pods on ``target_port`` (the container port)."""
    picker = routing.endpoint_picker
    pool = {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": owned_metadata(serve, pool_name(serve.name), settings),
        "spec": {
            "selector": {"matchLabels": selector_labels(serve.name)},
            "targetPorts": [{"number": target_port}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
    return with_desired_hash(pool)


def describe(pool: dict) -> str:
    """One line for the Routing condition."""
    spec = pool["spec"]
    ref = spec["endpointPickerRef"]
    return (
        f"InferencePool {pool['metadata']['name']} selects this serve's pods on port "
        f"{spec['targetPorts'][0]['number']}; endpoint picker Service {ref['name']}:{ref['port']['number']} "
        f"({ref['failureMode']})"
    )


def parents(observed: dict | None) -> str:
    """What the gateways say of the pool (its ``status.parents``), for the Routing condition."""
    accepted, refused = [], []
    for parent in ((observed or {}).get("status") or {}).get("parents") or ():
        ref = parent.get("parentRef") or {}
        where = f"{ref.get('kind', 'Gateway')} {ref.get('name', '?')}"
        verdict = next((c for c in parent.get("conditions") or () if c.get("type") == "Accepted"), {})
        if verdict.get("status") == "True":
            accepted.append(where)
        else:
            refused.append(f"{where} ({verdict.get('message') or 'not accepted yet'})")
    if not accepted and not refused:
        return "no gateway routes to it yet (an HTTPRoute needs a backendRef of kind InferencePool)"
    parts = ["accepted by " + ", ".join(accepted)] if accepted else []
    if refused:
        parts.append("not accepted by " + ", ".join(refused))
    return "; ".join(parts)
