"""A stand-in for a serve's ClusterIP Service (kube-proxy): no real one exists here.

There is no Kubernetes network on these machines, so nothing routes the Service the
operator writes. :class:`ServiceProxy` plays what clients get from it: an HTTP endpoint on
127.0.0.1 (a free port) that forwards each incoming request to a random endpoint among the
Service's endpoints (kube-proxy's iptables mode; ``pick="round-robin"`` for IPVS's default),
streaming the response through (SSE included).

Endpoints are computed as the EndpointSlice controller does and read as kube-proxy does,
from the API stand-in, every ``refresh_s`` (0.1 s: a pod gets requests the moment it turns
Ready): the pods matching the Service's ``spec.selector`` that have a ``podIP`` and the
Ready condition True, at the port the Service's ``targetPort`` names in the pod's
container. A pod that turns terminating (a ``deletionTimestamp``) stays an endpoint for
``terminating_lag_s`` more (1 s: the time the change takes to reach every node's
kube-proxy), then leaves.

Like kube-proxy it does not retry: a connection the chosen pod refuses or drops is the
client's failure. kube-proxy forwards TCP connections, so a client would see a refused or
reset connection; this proxy speaks HTTP, so it answers ``502`` (with the header
``X-Service-Proxy-Error`` saying what happened) when it cannot connect or the pod's answer
breaks before its headers, and cuts the client's connection when the pod's answer breaks
mid-body. With no endpoint at all it answers ``503`` (kube-proxy rejects the connection).
Every answer names the pod that served it in ``X-Served-By`` (``X-Endpoint``: ip:port).
It opens a fresh connection to the pod for every request (no pooled keep-alive
connections a pod could close under it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

log = logging.getLogger("e2e.service")

SERVED_BY = "X-Served-By"
ENDPOINT = "X-Endpoint"
PROXY_ERROR = "X-Service-Proxy-Error"
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}


@dataclass(frozen=True)
class Endpoint:
    pod: str
    ip: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"


@dataclass
class ProxyFailure:
    """A request the proxy could not complete because of the pod (for the test's report)."""

    at: float
    endpoint: Endpoint
    path: str
    error: str


@dataclass
class ServiceProxy:
    """Start with :meth:`start`; ``url`` is the Service's address; :meth:`stop` when done."""

    api: str
    namespace: str
    service: str
    port_name: str = "http"
    refresh_s: float = 0.1
    terminating_lag_s: float = 1.0
    pick: str = "random"  # or "round-robin"
    endpoints: list[Endpoint] = field(default_factory=list)
    served: Counter = field(default_factory=Counter)
    served_terminating: int = 0  # requests sent to a pod already terminating (in its last second)
    failures: list[ProxyFailure] = field(default_factory=list)
    endpoint_history: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)
    url: str = ""
    _rr: itertools.count = field(default_factory=itertools.count)
    _terminating_since: dict[str, float] = field(default_factory=dict)
    _api_session: aiohttp.ClientSession | None = None
    _pod_session: aiohttp.ClientSession | None = None
    _runner: web.AppRunner | None = None
    _task: asyncio.Task | None = None

    async def start(self) -> None:
        self._api_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._pod_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,
        )
        await self.refresh()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        port = _free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        self._task = asyncio.create_task(self._follow(), name=f"service {self.service}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._runner is not None:
            await self._runner.cleanup()
        for session in (self._api_session, self._pod_session):
            if session is not None:
                await session.close()

    async def __aenter__(self) -> ServiceProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ endpoints

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the API stand-in is busy: keep the last endpoints
                log.exception("service %s: reading endpoints failed", self.service)

    async def refresh(self) -> None:
        """Read the Service and its pods from the API; keep the ready ones, a terminating one
        only for ``terminating_lag_s`` after this proxy first saw it terminating."""
        assert self._api_session is not None
        base = f"{self.api}/api/v1/namespaces/{self.namespace}"
        async with self._api_session.get(f"{base}/services/{self.service}") as resp:
            service = await resp.json() if resp.status == 200 else None
        if service is None:
            self._set([])
            return
        selector = service["spec"].get("selector") or {}
        port = next(
            (p for p in service["spec"].get("ports") or [] if p.get("name") == self.port_name),
            (service["spec"].get("ports") or [{}])[0],
        )
        target = port.get("targetPort", port.get("port"))
        query = ",".join(f"{k}={v}" for k, v in selector.items())
        async with self._api_session.get(f"{base}/pods", params={"labelSelector": query}) as resp:
            pods = (await resp.json()).get("items") or []
        endpoints = []
        now = time.monotonic()
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            labels = meta.get("labels") or {}
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            if not ready or not status.get("podIP") or self._gone(meta, now):
                continue
            number = _container_port(pod, target)
            if number is not None:
                endpoints.append(Endpoint(meta["name"], status["podIP"], number))
        self._set(sorted(endpoints, key=lambda e: e.pod))

    def _gone(self, meta: dict, now: float) -> bool:
        """Whether a pod's deletion has reached this proxy (``terminating_lag_s`` after it began)."""
        if not meta.get("deletionTimestamp"):
            return False
        since = self._terminating_since.setdefault(meta["name"], now)
        return now - since >= self.terminating_lag_s

    def _set(self, endpoints: list[Endpoint]) -> None:
        if endpoints != self.endpoints:
            self.endpoint_history.append((time.monotonic(), tuple(e.pod for e in endpoints)))
            log.info("service %s: endpoints %s", self.service, [e.pod for e in endpoints])
        self.endpoints = endpoints

    # ------------------------------------------------------------------ forwarding

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        endpoints = self.endpoints
        if not endpoints:
            return web.json_response(
                {"error": {"message": f"service {self.service} has no ready endpoints"}},
                status=503,
                headers={PROXY_ERROR: "no endpoints"},
            )
        if self.pick == "random":
            endpoint = random.choice(endpoints)
        else:
            endpoint = endpoints[next(self._rr) % len(endpoints)]
        self.served[endpoint.pod] += 1
        self.served_terminating += endpoint.pod in self._terminating_since
        marks = {SERVED_BY: endpoint.pod, ENDPOINT: endpoint.address}
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        url = f"http://{endpoint.address}{request.rel_url}"
        assert self._pod_session is not None
        try:
            upstream = await self._pod_session.request(request.method, url, data=body, headers=headers)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.failures.append(ProxyFailure(time.monotonic(), endpoint, request.path, error))
            return web.json_response(
                {"error": {"message": f"connecting to {endpoint.pod} ({endpoint.address}): {error}"}},
                status=502,
                headers={**marks, PROXY_ERROR: error[:200]},
            )
        async with upstream:
            answer = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    answer.headers.add(key, value)
            answer.headers.update(marks)
            await answer.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                # The pod's answer broke off: the client's connection is cut where it was.
                error = f"{type(exc).__name__}: {exc}"
                self.failures.append(ProxyFailure(time.monotonic(), endpoint, request.path, error))
                if request.transport is not None:
                    request.transport.close()
                return answer
            await answer.write_eof()
            return answer


def _container_port(pod: dict, target: int | str | None) -> int | None:
    """The pod port a Service's ``targetPort`` means (a number, or a container port's name)."""
    if isinstance(target, int):
        return target
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
