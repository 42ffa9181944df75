"""A small asynchronous Kubernetes API client over aiohttp.

kopf watches and dispatches; the reconcile passes need plain reads and writes of the
objects a LoRAServe owns. This client builds its session from the same
:class:`kopf.ConnectionInfo` the operator logs in with, re-logs in once on 401 (projected
service-account tokens rotate), and raises :class:`KubeError` with the API's own reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import aiohttp
import kopf

logger = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"

T = TypeVar("T")


class KubeError(Exception):
    """The API server refused a request."""

    def __init__(self, status: int, reason: str, message: str, *, method: str = "", path: str = "") -> None:
        super().__init__(f"{method} {path}: {status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


@dataclass(frozen=True)
class Resource:
    """A resource type: where its objects live in the API."""

    api_version: str  # "v1", "apps/v1", "loraserve.io/v1alpha1"
    plural: str
    kind: str
    namespaced: bool = True

    def path(
        self, namespace: str | None = None, name: str | None = None, subresource: str | None = None
    ) -> str:
        """The URL path of the collection, an object, or an object's subresource."""
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [prefix]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{quote(namespace, safe='')}")
        parts.append(self.plural)
        if name is not None:
            parts.append(quote(name, safe=""))
        if subresource is not None:
            parts.append(subresource)
        return "/".join(parts)


DEPLOYMENTS = Resource("apps/v1", "deployments", "Deployment")
SERVICES = Resource("v1", "services", "Service")
SECRETS = Resource("v1", "secrets", "Secret")
CONFIGMAPS = Resource("v1", "configmaps", "ConfigMap")
PODS = Resource("v1", "pods", "Pod")
PDBS = Resource("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget")
LORASERVES = Resource("loraserve.io/v1alpha1", "loraserves", "LoRAServe")
ADAPTERS = Resource("loraserve.io/v1alpha1", "adapters", "Adapter")
INFERENCE_POOLS = Resource("inference.networking.k8s.io/v1", "inferencepools", "InferencePool")
HPAS = Resource("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")
SCALED_OBJECTS = Resource("keda.sh/v1alpha1", "scaledobjects", "ScaledObject")


LoginFn = Callable[[], Awaitable[kopf.ConnectionInfo]]


class KubeClient:
    """Reads and writes objects; one aiohttp session, re-created on a fresh login."""

    def __init__(self, login: LoginFn, *, timeout_s: float = 30.0) -> None:
        self._login = login
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._lock = asyncio.Lock()

    @classmethod
    def from_info(cls, info: kopf.ConnectionInfo, **kwargs: Any) -> KubeClient:
        """A client with fixed credentials (tests, or a kubeconfig with a long-lived token)."""

        async def login() -> kopf.ConnectionInfo:
            return info

        return cls(login, **kwargs)

    async def _ensure(self, *, fresh: bool = False) -> aiohttp.ClientSession:
        async with self._lock:
            if self._session is not None and not fresh:
                return self._session
            if self._session is not None:
                await self._session.close()
            info = await self._login()
            self._server = info.server.rstrip("/")
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                headers={**info.as_http_headers(), "User-Agent": "loraserve-operator"},
                timeout=self._timeout,
            )
            return self._session

    async def close(self) -> None:
        """Close the session; the client may be used again afterwards (it logs in anew)."""
        async with self._lock:
            if self._session is not None:
                await self._session.close()
                self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: object = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> Any:
        """Send one request and return the decoded JSON answer; raise :class:`KubeError`."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        query = f"?{urlencode(params)}" if params else ""
        for attempt in (0, 1):
            session = await self._ensure(fresh=attempt == 1)
            async with session.request(
                method, self._server + path + query, data=data, headers=headers
            ) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0:
                    continue  # the token may have rotated: log in again once
                if resp.status >= 400:
                    reason, message = _status_text(resp.status, text)
                    raise KubeError(resp.status, reason, message, method=method, path=path)
                return json.loads(text) if text else None
        raise AssertionError("unreachable")  # the loop returns or raises

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", res.path(namespace, name))
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    async def list(
        self, res: Resource, namespace: str | None, *, label_selector: str | None = None
    ) -> list[dict]:
        """Objects of one type in a namespace (or everywhere when namespace is None)."""
        params = {"labelSelector": label_selector} if label_selector else None
        answer = await self.request("GET", res.path(namespace), params=params)
        return list((answer or {}).get("items") or [])

    async def create(self, res: Resource, namespace: str | None, body: dict) -> dict:
        """Create an object; 409 raises :class:`KubeError` with ``conflict`` set."""
        return await self.request("POST", res.path(namespace), body=body)

    async def patch(
        self,
        res: Resource,
        namespace: str | None,
        name: str,
        body: object,
        *,
        subresource: str | None = None,
        content_type: str = MERGE_PATCH,
    ) -> dict:
        """Patch an object (merge patch unless told otherwise)."""
        return await self.request(
            "PATCH", res.path(namespace, name, subresource), body=body, content_type=content_type
        )

    async def delete(self, res: Resource, namespace: str | None, name: str) -> bool:
        """Delete an object; False when it was already gone."""
        try:
            await self.request("DELETE", res.path(namespace, name))
        except KubeError as exc:
            if exc.not_found:
                return False
            raise
        return True


def _status_text(status: int, text: str) -> tuple[str, str]:
    try:
        data = json.loads(text)
    except ValueError:
        return str(status), text[:500]
    if isinstance(data, dict):
        return str(data.get("reason") or status), str(data.get("message") or text[:500])
    return str(status), text[:500]


async def retry_on_conflict(
    action: Callable[[], Awaitable[T]], *, retries: int = 5, delay_s: float = 0.1
) -> T:
    """Run ``action`` (which must re-observe before writing) again when the API answers 409.

    The API answers 409 when an object changed since it was read (stale resourceVersion) or
    when a create raced another writer; both are resolved by observing again.
    """
    for attempt in range(retries + 1):
        try:
            return await action()
        except KubeError as exc:
            if not exc.conflict or attempt == retries:
                raise
            logger.info("conflict (%s), observing again (%d/%d)", exc.message, attempt + 1, retries)
            await asyncio.sleep(delay_s * (2**attempt))
    raise AssertionError("unreachable")
