"""A Kubernetes API stand-in for the end-to-end tests: kmock's emulator plus API-server bookkeeping.

No Kubernetes API server can run on these machines, so the tests use kmock's
``KubernetesEmulator`` (an in-memory API with discovery, list/watch, create/patch/delete,
finalizers and soft deletion). It stores objects as given, so this subclass adds what the
operator relies on from a real server:

* ``metadata.name`` from ``generateName``; ``metadata.uid``, ``creationTimestamp``, ``generation`` (1 on create, +1 when a write
  changes ``spec``) and a ``resourceVersion`` that changes on every write;
* optimistic concurrency: a merge patch carrying a stale ``metadata.resourceVersion``
  answers 409 Conflict; a JSON patch whose ``test`` op fails answers 422;
* ``labelSelector`` (equality terms) on list requests;
* a Secret's ``stringData`` stored base64-encoded in ``data``;
* no spec changes through the ``status`` subresource;
* the ``scale`` subresource of the LoRAServe CRD (``specReplicasPath: .spec.replicas``,
  ``statusReplicasPath: .status.replicas``, ``labelSelectorPath: .status.selector``): GET
  answers an ``autoscaling/v1`` Scale, PATCH/PUT of ``spec.replicas`` writes the object's
  ``spec.replicas`` (a spec change: generation +1, watchers see MODIFIED), as
  ``kubectl scale`` and the HPA do;
* graceful pod deletion: a DELETE of a Pod (``kubectl delete pod``, a ReplicaSet scaling
  down) does not remove it; it sets ``metadata.deletionTimestamp`` (now + grace) and
  ``deletionGracePeriodSeconds`` (``gracePeriodSeconds`` from the query or DeleteOptions
  body, else the pod's ``spec.terminationGracePeriodSeconds``, default 30) and the pod
  stays, terminating, until the kubelet has stopped its containers and deletes it with
  ``gracePeriodSeconds=0``. Writes to a terminating pod (its status) are kept.

It validates no schema and calls no webhook; garbage collection by owner and the
controllers behind Deployments are played by the test's kubelet stand-in.

kmock decides which reaction serves a request with ``request in reaction._source``, which
walks every request logged so far through the reaction's filters: each request costs
time in proportion to all before it (35 ms per GET after 2,000 requests, 250 ms after
1,500 under a profiler), and a stand-in cluster sends thousands a minute, so after a few
minutes the API starves everything sharing its event loop (probes time out, pods turn
unready). :func:`_fast_membership` answers the same question for a request without the
walk (filters are pure functions of the request; a request is in a filter's view when it
passes the filter and is in the filter's source); other views keep kmock's own check.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import itertools
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, dsl, enums, k8s, rendering

BACKBONE = (
    "v1/namespaces",
    "v1/events",
    "apiextensions.k8s.io/v1/customresourcedefinitions",
)
BUILTINS = {
    "v1/pods": "Pod",
    "v1/services": "Service",
    "v1/secrets": "Secret",
    "v1/configmaps": "ConfigMap",
    "apps/v1/deployments": "Deployment",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
SCALED = {"loraserves": (("spec", "replicas"), ("status", "replicas"), ("status", "selector"))}
"""Custom resources with a ``scale`` subresource: spec, status and selector paths (the CRD's)."""
DEFAULT_GRACE_S = 30


_KMOCK_CONTAINS = dsl.View.__contains__


def _fast_membership(self: dsl.View, item: object) -> bool:
    """``item in view`` for one request, as kmock's walk over the logged requests would answer."""
    if isinstance(item, rendering.Request):
        kind = type(self)
        if kind is dsl.Filter:
            return bool(self.criteria(item)) and item in self._source
        if kind is dsl.Priority:
            return item in self._source
        if isinstance(self, dsl.Root) and not isinstance(self, dsl.Chained):
            # kmock's Root yields nothing but its log; the newest requests are the likely ones.
            return any(request is item for request in reversed(self._requests))
    return _KMOCK_CONTAINS(self, item)


dsl.View.__contains__ = _fast_membership  # Filter, Priority and Root inherit it from View


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """kmock's emulator with uid / generation / resourceVersion bookkeeping and 409s."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def declare(self, crd_resources: dict[str, tuple[str, bool]]) -> None:
        """Declare the backbone kopf waits for, the built-ins, and ``{path: (kind, namespaced)}``."""
        for path in BACKBONE:
            kind = path.rsplit("/", 1)[1].rstrip("s").capitalize()
            self.resources[path] = kmock.ResourceInfo(kind=kind, namespaced=path == "v1/events", verbs=VERBS)
        self.resources["apiextensions.k8s.io/v1/customresourcedefinitions"].kind = "CustomResourceDefinition"
        for path, kind in BUILTINS.items():
            self.resources[path] = kmock.ResourceInfo(
                kind=kind, namespaced=True, verbs=VERBS, subresources={"status"}
            )
        for path, (kind, namespaced) in crd_resources.items():
            scaled = path.rsplit("/", 1)[1] in SCALED
            self.resources[path] = kmock.ResourceInfo(
                kind=kind,
                namespaced=namespaced,
                verbs=VERBS,
                subresources={"status", "scale"} if scaled else {"status"},
            )

    def _current(self, request: rendering.Request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else copy.deepcopy(dict(obj.raw))

    async def _handle(self, request: rendering.Request):  # type: ignore[override]
        if request.resource is not None and request.name and request.subresource == "scale":
            return await self._scale(request)
        if request.resource is not None and request.resource.plural == "pods" and request.name:
            answer = await self._pod_write(request)
            if answer is not None:
                return answer
        if request.resource is None or request.action not in (enums.action.CREATE, enums.action.UPDATE):
            return await super()._handle(request)
        async with self._write_lock:
            amended = self._bookkeep(request)
            if amended is not request:
                # kmock routes a request by its identity in the request log: swap it there.
                log = self._requests
                log[next(i for i in range(len(log) - 1, -1, -1) if log[i] is request)] = amended
            return await super()._handle(amended)

    # ------------------------------------------------------------------ the scale subresource

    async def _scale(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        """``.../<name>/scale``: an ``autoscaling/v1`` Scale view of the object's replicas."""
        paths = SCALED.get(request.resource.plural)
        if paths is None or request.action not in (enums.action.FETCH, enums.action.UPDATE):
            return _status_response(404, "NotFound", f"{request.resource.plural} has no scale subresource")
        spec_path, status_path, selector_path = paths
        if request.action == enums.action.UPDATE:
            body = request.data if isinstance(request.data, dict) else {}
            wanted = (body.get("spec") or {}).get("replicas")
            if not isinstance(wanted, int) or wanted < 0:
                return _status_response(422, "Invalid", "spec.replicas: must be a non-negative integer")
            # What the API server does for a CRD's scale: write specReplicasPath in the object.
            patch: dict = {}
            node = patch
            for key in spec_path[:-1]:
                node = node.setdefault(key, {})
            node[spec_path[-1]] = wanted
            inner = attrs.evolve(request, subresource=None, data=patch)
            self._requests[
                next(i for i in range(len(self._requests) - 1, -1, -1) if self._requests[i] is request)
            ] = inner
            response = await self._handle(inner)
            if response.status >= 300:
                return response
        current = self._current(attrs.evolve(request, subresource=None))
        if current is None:
            return _status_response(404, "NotFound", f'{request.resource.plural} "{request.name}" not found')

        def pick(path: tuple[str, ...]) -> Any:
            node: Any = current
            for key in path:
                node = (node or {}).get(key)
            return node

        meta = current["metadata"]
        scale = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: meta.get(k) for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            },
            "spec": {"replicas": pick(spec_path) or 0},
            "status": {"replicas": pick(status_path) or 0, "selector": pick(selector_path) or ""},
        }
        return aiohttp.web.json_response(scale)

    # ------------------------------------------------------------------ graceful pod deletion

    async def _pod_write(self, request: rendering.Request) -> aiohttp.web.StreamResponse | None:
        """Deletion and writes of a Pod that kmock would not do as an API server does; else None."""
        if request.action not in (enums.action.DELETE, enums.action.UPDATE):
            return None
        key = (request.resource, request.namespace, request.name)
        async with self._write_lock:
            current = self._current(request)
            if current is None:
                return None  # kmock answers 404
            meta = current["metadata"]
            terminating = bool(meta.get("deletionTimestamp"))
            if request.action == enums.action.UPDATE:
                if not terminating:
                    return None
                # kmock would drop an object with a deletionTimestamp and no finalizers on any
                # write; an API server keeps a terminating pod until it is deleted with grace 0.
                amended = self._bookkeep(request)
                async with self._lock:
                    obj = self.objects[key]
                    obj.patch(amended.data)
                    raw = obj.raw
                    await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
                return aiohttp.web.json_response(raw)
            grace = _grace_seconds(request, current)
            async with self._lock:
                obj = self.objects[key]
                if grace == 0:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[request.resource].put({"type": "DELETED", "object": raw})
                    return aiohttp.web.json_response(raw)
                if not terminating:
                    deadline = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=grace)
                    obj.patch(
                        {
                            "metadata": {
                                "deletionTimestamp": deadline.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                "deletionGracePeriodSeconds": grace,
                                "resourceVersion": str(next(self._versions)),
                            }
                        }
                    )
                    raw = obj.raw
                    await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
                return aiohttp.web.json_response(obj.raw)

    def _bookkeep(self, request: rendering.Request) -> rendering.Request:
        rv = str(next(self._versions))
        if request.action == enums.action.CREATE:
            data = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
            meta = data.setdefault("metadata", {})
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = rv
            meta["generation"] = 1
            meta.setdefault("creationTimestamp", _now())
            if request.resource.plural == "secrets" and "stringData" in data:
                # As the API server does: stringData is write-only, stored base64 in data.
                encoded = {
                    k: base64.b64encode(str(v).encode()).decode() for k, v in data.pop("stringData").items()
                }
                data["data"] = {**(data.get("data") or {}), **encoded}
            return attrs.evolve(request, data=data)

        current = self._current(request)
        if current is None:
            return request  # kmock answers 404
        status_only = request.subresource == "status"
        if isinstance(request.data, list):  # JSON patch
            try:
                patched = jsonpatch.apply_patch(copy.deepcopy(current), request.data)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise k8s.KubernetesError(
                    status=422, reason="Invalid", message=f"the test op failed: {exc}"
                ) from None
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise k8s.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
            ops = list(request.data)
            if status_only and patched.get("spec") != current.get("spec"):
                ops = [op for op in ops if not str(op.get("path", "")).startswith("/spec")]
                patched = jsonpatch.apply_patch(copy.deepcopy(current), ops)
            ops.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})
            if patched.get("spec") != current.get("spec"):
                ops.append(
                    {
                        "op": "add",
                        "path": "/metadata/generation",
                        "value": current["metadata"].get("generation", 1) + 1,
                    }
                )
            return attrs.evolve(request, data=ops)

        data = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        meta = data.get("metadata") or {}
        wanted = meta.get("resourceVersion")
        if wanted is not None and wanted != current["metadata"].get("resourceVersion"):
            raise k8s.KubernetesError(
                status=409,
                reason="Conflict",
                message=(
                    f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": the object has been '
                    "modified; please apply your changes to the latest version and try again"
                ),
            )
        if status_only:
            data.pop("spec", None)
        patched = dicts.merge_patch_dict(current, data)
        data.setdefault("metadata", {})["resourceVersion"] = rv
        if patched.get("spec") != current.get("spec"):
            data["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
        return attrs.evolve(request, data=data)

    async def _serve_list(self, request: rendering.Request):  # type: ignore[override]
        answer = await super()._serve_list(request)
        selector = (request.params or {}).get("labelSelector")
        if selector:
            terms = [term.split("=", 1) for term in selector.split(",") if "=" in term]
            answer["items"] = [
                item
                for item in answer["items"]
                if all(
                    (item.get("metadata", {}).get("labels") or {}).get(k.rstrip("=")) == v.lstrip("=")
                    for k, v in terms
                )
            ]
        answer["metadata"] = {"resourceVersion": str(next(self._versions))}
        return answer


def _grace_seconds(request: rendering.Request, pod: dict) -> int:
    """A pod deletion's grace period: the request's (query or DeleteOptions), else the pod's."""
    value = (request.params or {}).get("gracePeriodSeconds")
    if value is None and isinstance(request.data, dict):
        value = request.data.get("gracePeriodSeconds")
    if value is None:
        value = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
    return max(int(value), 0)


def _status_response(code: int, reason: str, message: str) -> aiohttp.web.Response:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return aiohttp.web.Response(status=code, text=json.dumps(body), content_type="application/json")
