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
* no spec changes through the ``status`` subresource.

It validates no schema and calls no webhook; garbage collection by owner and the
controllers behind Deployments are played by the test's kubelet stand-in.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import itertools
import uuid
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, enums, k8s, rendering

BACKBONE = (
    "v1/namespaces",
    "v1/events",
    "apiextensions.k8s.io/v1/customresourcedefinitions",
)
BUILTINS = {
    "v1/pods": "Pod",
    "v1/services": "Service",
    "v1/secrets": "Secret",
    "apps/v1/deployments": "Deployment",
    "policy/v1/poddisruptionbudgets": "PodDisruptionBudget",
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}


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
            self.resources[path] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=VERBS, subresources={"status"}
            )

    def _current(self, request: rendering.Request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects:
            return None
        obj = self.objects[key]
        return None if obj.deleted else copy.deepcopy(dict(obj.raw))

    async def _handle(self, request: rendering.Request):  # type: ignore[override]
        if request.resource is None or request.action not in (enums.action.CREATE, enums.action.UPDATE):
            return await super()._handle(request)
        async with self._write_lock:
            amended = self._bookkeep(request)
            if amended is not request:
                # kmock routes a request by its identity in the request log: swap it there.
                log = self._requests
                log[next(i for i in range(len(log) - 1, -1, -1) if log[i] is request)] = amended
            return await super()._handle(amended)

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
