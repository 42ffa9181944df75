"""The Kubernetes API stand-in the reconcile tests run against, and what they read off it.

There is no Kubernetes API server on these machines: kmock's KubernetesEmulator stands in
for it, with the uid / generation / resourceVersion / 409 bookkeeping of
``tests/e2e/apiserver.py``. It validates no schema and runs no controllers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kopf

from loraserve.operator import desired as ds
from loraserve.operator.reconcile.kube import LORASERVES, KubeClient
from loraserve.operator.reconcile.serve import reconcile_serve

E2E = Path(__file__).resolve().parent.parent / "e2e"
SETTINGS = ds.DesiredSettings(image="registry.example/loraserve:1")
NS, NAME = "ml", "llama"
LORASERVE_API = {"loraserve.io/v1alpha1/loraserves": ("LoRAServe", True)}


def apiserver() -> types.ModuleType:
    """``tests/e2e/apiserver.py``, loaded once by its path (``tests/e2e`` is no package)."""
    name = "_loraserve_e2e_apiserver"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, E2E / "apiserver.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@contextlib.asynccontextmanager
async def api_client(declared: dict[str, tuple[str, bool]]) -> AsyncIterator[tuple[Any, KubeClient]]:
    """A running stand-in serving the ``declared`` resources, and the operator's client of it."""
    server = apiserver().ApiServer()
    server.declare(declared)
    async with server, kmock.Server(server) as endpoint:
        client = KubeClient.from_info(
            kopf.ConnectionInfo(server=str(endpoint.url).rstrip("/"), insecure=True)
        )
        try:
            yield server, client
        finally:
            await client.close()


def serve_body(**spec) -> dict:
    """The LoRAServe ``NS/NAME``: a PVC model, 2 replicas, and ``spec``'s fields on top."""
    return {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "LoRAServe",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"source": "pvc://models/llama"},
            "storage": {"models": {"type": "PersistentVolumeClaim", "claimName": "models"}},
            "replicas": 2,
            **spec,
        },
    }


def writes(server, since: int) -> list[str]:
    """``METHOD path`` of each write the stand-in received after its first ``since`` requests."""
    out = []
    for request in list(server)[since:]:
        method = str(getattr(request.method, "value", request.method)).upper()
        if method in ("POST", "PATCH", "PUT", "DELETE"):
            out.append(f"{method} {request.url.path}")
    return out


async def reconcile_pass(client: KubeClient):
    """One reconcile pass of the LoRAServe ``NS/NAME`` as it stands in the API."""
    body = await client.get(LORASERVES, NS, NAME)
    return await reconcile_serve(client, body, SETTINGS, adapters=0, now="2026-01-01T00:00:00Z")
