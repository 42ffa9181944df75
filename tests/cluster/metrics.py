"""A stand-in custom-metrics adapter (prometheus-adapter's part) behind a real APIService.

The HorizontalPodAutoscaler a LoRAServe asks for reads a ``Pods`` metric from
``custom.metrics.k8s.io``. In a cluster prometheus-adapter serves it from Prometheus; here
this server does, registered with the API server's aggregator as an ``APIService`` whose
Service's ClusterIP (a loopback address, see ``controlplane.py``) it listens on with TLS
the APIService's ``caBundle`` trusts. The real HPA controller then reads it through the
aggregator as it would read prometheus-adapter. The value every pod reports is set by the
test (``value``): the stand-in is the metric source, not the runtime's queue.
"""

from __future__ import annotations

import base64
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import trustme
from aiohttp import web

GROUP = "custom.metrics.k8s.io"
VERSION = "v1beta1"
NAMESPACE = "custom-metrics"
SERVICE = "custom-metrics"


def manifests(cluster_ip: str, ca_pem: bytes) -> list[dict]:
    """The Service (fixed ClusterIP), its endpoints and the APIService of the stand-in."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {"clusterIP": cluster_ip, "ports": [{"name": "https", "port": 443, "targetPort": 6443}]},
    }
    # No endpoint controller runs: the aggregator's availability check reads these. The
    # address is never dialled (the API server dials the ClusterIP), so any routable one does.
    endpoints = {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "subsets": [{"addresses": [{"ip": "10.10.10.10"}], "ports": [{"name": "https", "port": 6443}]}],
    }
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": SERVICE,
            "namespace": NAMESPACE,
            "labels": {"kubernetes.io/service-name": SERVICE},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.10.10.10"], "conditions": {"ready": True}}],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
    }
    api_service = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": f"{VERSION}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "version": VERSION,
            "service": {"name": SERVICE, "namespace": NAMESPACE, "port": 443},
            "caBundle": base64.b64encode(ca_pem).decode(),
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    }
    return [service, endpoints, slice_, api_service]


@dataclass
class MetricsAdapter:
    """Serves ``pods/<metric>`` for every pod a selector picks, at ``value`` each."""

    api: str
    """The API (``kubectl proxy``) where pods are listed."""
    host: str
    metric: str
    value: int = 0
    requests: list[str] = field(default_factory=list)
    ca: trustme.CA = field(default_factory=trustme.CA)
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert(f"{SERVICE}.{NAMESPACE}.svc", self.host).configure_cert(context)
        app = web.Application()
        app.router.add_get(f"/apis/{GROUP}/{VERSION}", self._discovery)
        app.router.add_get(f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/pods/{{name}}/{{metric}}", self._pods)
        app.router.add_get("/{tail:.*}", self._other)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, 443, ssl_context=context).start()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _discovery(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{GROUP}/{VERSION}",
                "resources": [
                    {
                        "name": f"pods/{self.metric}",
                        "singularName": "",
                        "namespaced": True,
                        "kind": "MetricValueList",
                        "verbs": ["get"],
                    }
                ],
            }
        )

    async def _pods(self, request: web.Request) -> web.Response:
        ns, metric = request.match_info["ns"], request.match_info["metric"]
        self.requests.append(str(request.rel_url))
        if metric != self.metric:
            return web.json_response({"kind": "Status", "status": "Failure", "code": 404}, status=404)
        assert self._session is not None
        params = {"labelSelector": request.query.get("labelSelector", "")}
        async with self._session.get(f"{self.api}/api/v1/namespaces/{ns}/pods", params=params) as resp:
            pods: list[dict[str, Any]] = (await resp.json()).get("items") or []
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        items = [
            {
                "describedObject": {"kind": "Pod", "namespace": ns, "name": p["metadata"]["name"], "apiVersion": "/v1"},
                "metricName": metric,
                "timestamp": now,
                "value": str(self.value),
            }
            for p in pods
            if request.match_info["name"] in ("*", p["metadata"]["name"])
        ]
        return web.json_response(
            {"kind": "MetricValueList", "apiVersion": f"{GROUP}/{VERSION}", "metadata": {}, "items": items}
        )

    async def _other(self, request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "status": "Failure", "code": 404}, status=404)
