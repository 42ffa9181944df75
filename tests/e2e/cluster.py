"""A whole stand-in cluster for the end-to-end tests and the operator benchmark.

API stand-in (kmock's emulator with API-server bookkeeping, ``apiserver.py``), the
controllers and kubelet (``kubelet.py``) running real ``loraserve-runtime`` processes on a
tiny CPU model, and the real operator (kopf) started and stopped in-process. There is no
Kubernetes API server on these machines: kmock's KubernetesEmulator stands in for it and
neither validates schemas nor calls webhooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf

from loraserve.operator import main as operator_main
from loraserve.operator.config import OperatorConfig
from loraserve.operator.reconcile.context import OperatorContext

HERE = Path(__file__).parent
CRD_RESOURCES = {
    "loraserve.io/v1alpha1/loraserves": ("LoRAServe", True),
    "loraserve.io/v1alpha1/adapters": ("Adapter", True),
}
SERVES = "/apis/loraserve.io/v1alpha1/namespaces/{ns}/loraserves"
ADAPTERS = "/apis/loraserve.io/v1alpha1/namespaces/{ns}/adapters"


def load_sibling(name: str) -> Any:
    """Import ``tests/e2e/<name>.py`` under a private module name (no test packages here)."""
    module_name = f"_loraserve_e2e_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


apiserver = load_sibling("apiserver")
kubelet_mod = load_sibling("kubelet")


@dataclass
class RunningOperator:
    """The operator in its own thread and event loop.

    kopf, when it stops, cancels every task of its loop created after it started; it must
    not share a loop with the test (the API stand-in, the kubelet stand-in, the test itself).
    """

    thread: threading.Thread
    stop: threading.Event
    context: OperatorContext
    error: list[BaseException]


@dataclass
class Cluster:
    """Start with :meth:`start`, stop with :meth:`stop`; ``api`` is the API stand-in's URL."""

    root: Path
    claims_root: Path
    claims: Any = None
    api: str = ""
    emulator: Any = None
    kubelet: Any = None
    operator: RunningOperator | None = None
    session: aiohttp.ClientSession | None = None
    _stack: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)

    async def start(self) -> None:
        self.emulator = apiserver.ApiServer()
        self.emulator.declare(CRD_RESOURCES)
        await self._stack.enter_async_context(self.emulator)
        server = await self._stack.enter_async_context(kmock.Server(self.emulator))
        self.api = str(server.url).rstrip("/")
        self.session = aiohttp.ClientSession()
        self.kubelet = kubelet_mod.Kubelet(api=self.api, root=self.root, claims_root=self.claims_root)
        await self.kubelet.start()

    async def stop(self) -> None:
        await self.stop_operator()
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self.session is not None:
            await self.session.close()
        await self._stack.aclose()

    # ------------------------------------------------------------------ the operator

    async def start_operator(self, config: OperatorConfig, webhook: Any = None) -> RunningOperator:
        """Start the real operator (in its own thread) against the API stand-in.

        ``webhook`` (a ``WebhookServerConfig``) also serves the admission webhook.
        """
        stop, ready = threading.Event(), threading.Event()
        holder: list[OperatorContext] = []
        error: list[BaseException] = []

        def main() -> None:
            try:
                asyncio.run(
                    operator_main.run(
                        config,
                        connection=kopf.ConnectionInfo(server=self.api, insecure=True),
                        webhook=webhook,
                        stop_flag=stop,
                        ready_flag=ready,
                        context=holder,
                    )
                )
            except BaseException as exc:  # reported to the test by stop_operator()
                error.append(exc)
            finally:
                ready.set()

        thread = threading.Thread(target=main, name="operator", daemon=True)
        thread.start()
        if not await asyncio.to_thread(ready.wait, 60):
            raise TimeoutError("the operator did not become ready within 60 s")
        if error or not holder:
            raise RuntimeError(f"the operator stopped before it was ready: {error!r}")
        self.operator = RunningOperator(thread, stop, holder[0], error)
        return self.operator

    async def stop_operator(self) -> None:
        if self.operator is None:
            return
        running, self.operator = self.operator, None
        running.stop.set()
        await asyncio.to_thread(running.thread.join, 60)
        if running.thread.is_alive():
            raise TimeoutError("the operator did not stop within 60 s of its stop flag")
        if running.error and not isinstance(running.error[0], asyncio.CancelledError):
            raise running.error[0]

    # ------------------------------------------------------------------ API client

    async def request(
        self, method: str, path: str, body: object = None, *, patch: bool = False
    ) -> tuple[int, Any]:
        assert self.session is not None
        headers = {"Content-Type": "application/merge-patch+json"} if patch else {}
        async with self.session.request(method, self.api + path, json=body, headers=headers) as resp:
            text = await resp.text()
            return resp.status, (json.loads(text) if text else None)

    async def create(self, collection: str, body: dict) -> dict:
        status, data = await self.request("POST", collection, body)
        assert status < 300, f"create {collection}: {status} {data}"
        return data

    async def get(self, path: str) -> dict | None:
        status, data = await self.request("GET", path)
        return data if status == 200 else None

    async def patch(self, path: str, body: dict) -> dict:
        status, data = await self.request("PATCH", path, body, patch=True)
        assert status < 300, f"patch {path}: {status} {data}"
        return data

    async def delete(self, path: str) -> int:
        status, _ = await self.request("DELETE", path)
        return status

    async def events(self, namespace: str) -> list[dict]:
        _, data = await self.request("GET", f"/api/v1/namespaces/{namespace}/events")
        return list((data or {}).get("items") or [])


async def wait_for(
    probe: Callable[[], Awaitable[Any]],
    *,
    timeout: float = 60.0,
    interval: float = 0.1,
    what: str = "condition",
) -> Any:
    """Poll ``probe`` until it returns something truthy; fail with the last value after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}")


async def pod_models(pod, *, listed: bool = False) -> dict[str, dict]:
    """What a runtime pod holds, by model id (base and loaded adapters); ``listed``: also the
    catalogued adapters it would load on their first request."""
    async with aiohttp.ClientSession() as http, http.get(f"http://{pod.ip}:{pod.port}/v1/models") as resp:
        assert resp.status == 200
        entries = (await resp.json())["data"]
    return {
        e["id"]: e for e in entries if listed or (e.get("lora") or {}).get("state", "loaded") == "loaded"
    }


async def pod_complete(pod, model: str) -> tuple[int, dict]:
    """A short greedy completion from one runtime pod: (HTTP status, body)."""
    body = {"model": model, "prompt": "def main(", "max_tokens": 4, "temperature": 0}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://{pod.ip}:{pod.port}/v1/completions", json=body) as resp,
    ):
        return resp.status, await resp.json()


async def kill_and_wait_for_reload(kubelet, pod, adapters, *, timeout: float) -> None:
    """Kill ``pod``'s runtime process; return once it has restarted, is Ready again and
    serves every named adapter loaded after the kill (a fresh load, not a stale answer)."""
    restarts = pod.restarts
    killed_at = int(time.time())
    kubelet.kill(pod)

    async def reloaded() -> bool:
        if pod.restarts <= restarts or not pod.ready:
            return False
        held = await pod_models(pod)
        return all(name in held and held[name]["created"] >= killed_at for name in adapters)

    await wait_for(reloaded, timeout=timeout, what=f"{', '.join(adapters)} reloaded on restarted pod {pod.name}")
