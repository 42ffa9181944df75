"""The cluster-serving scenario: a serve under load while pods come and go.

Shared by ``test_cluster_serving_e2e.py`` (which asserts on the outcome) and
``bench/operator.py --scenario cluster`` (which reports it). It runs on the stand-in
cluster (``cluster.py``: kmock's emulator for the API, ``kubelet.py`` for the Deployment
controller / kubelet / garbage collector, real ``loraserve-runtime`` processes, the real
operator) with a Service stand-in (``service.py``) in front of the pods and a bounded
load generator (``traffic.py``) sending through it.

:meth:`Scenario.run_disturbances`, with traffic flowing, in sequence and each step waited
out until the cluster converged again:

a. one pod is deleted through the API (graceful deletion) and the Deployment controller
   replaces it;
b. the serve is scaled 3 -> 4 -> 2 through the LoRAServe's ``scale`` subresource (what
   ``kubectl scale`` and an HPA write: ``spec.replicas``);
c. a runtime setting changes (``spec.runtime.maxRunningRequests``: a new config hash), so
   the pods roll;
d. an Adapter is created (traffic for it starts at once) and another is deleted (traffic
   for it goes on, to see what its requests get).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
assets = cluster_mod.load_sibling("assets")
service_mod = cluster_mod.load_sibling("service")
traffic_mod = cluster_mod.load_sibling("traffic")
wait_for = cluster_mod.wait_for

STEP_TIMEOUT = 150.0
CONVERGED_STATES = {"Loaded", "Registered"}


@dataclass(frozen=True)
class AdapterPlan:
    name: str
    source: str  # one of assets.ADAPTERS, under the adapters claim
    replicas: int | None = None  # placement {mode: Replicas, replicas: N}; None: every pod

    def manifest(self, serve: str, namespace: str) -> dict:
        extra: dict[str, Any] = {}
        if self.replicas is not None:
            extra["placement"] = {"mode": "Replicas", "replicas": self.replicas}
        return assets.adapter_manifest(
            self.name, serve, f"pvc://adapters/{self.source}", namespace=namespace, **extra
        )


@dataclass
class Scenario:
    cluster: Any
    namespace: str
    serve: str
    say: Callable[[str], None] = print
    steps: list[tuple[str, float]] = field(default_factory=list)
    plans: dict[str, AdapterPlan] = field(default_factory=dict)
    proxy: Any = None
    traffic: Any = None

    @property
    def serves(self) -> str:
        return cluster_mod.SERVES.format(ns=self.namespace)

    @property
    def adapters(self) -> str:
        return cluster_mod.ADAPTERS.format(ns=self.namespace)

    def pods(self) -> list:
        return self.cluster.kubelet.pods_of(self.namespace, self.serve)

    def ready_pods(self) -> list:
        return [p for p in self.pods() if p.ready]

    def _log(self, text: str) -> None:
        at = f"+{self.traffic.now():6.1f}s " if self.traffic is not None and self.traffic.t0 else ""
        self.say(f"[scenario] {at}{text}")

    # ------------------------------------------------------------------ bring-up

    async def bring_up(self, replicas: int, plans: Iterable[AdapterPlan], **spec: object) -> None:
        started = time.monotonic()
        await self.cluster.create(
            self.serves,
            assets.serve_manifest(
                self.serve, self.cluster.claims, replicas=replicas, namespace=self.namespace, **spec
            ),
        )
        for plan in plans:
            await self.create_adapter(plan)
        await self.wait_converged(replicas, what=f"{replicas} pods up, adapters Ready")
        self.steps.append(("bring-up", time.monotonic() - started))
        self.proxy = service_mod.ServiceProxy(
            api=self.cluster.api, namespace=self.namespace, service=self.serve
        )
        await self.proxy.start()
        await self.wait_endpoints()

    async def create_adapter(self, plan: AdapterPlan) -> None:
        self.plans[plan.name] = plan
        await self.cluster.create(self.adapters, plan.manifest(self.serve, self.namespace))

    async def stop(self) -> None:
        if self.traffic is not None and not self.traffic._stop.is_set():
            await self.traffic.stop()
        if self.proxy is not None:
            await self.proxy.stop()

    # ------------------------------------------------------------------ convergence

    async def serve_problem(self, replicas: int) -> str | None:
        """Why the serve is not converged at ``replicas`` ready pods (None: it is)."""
        body = await self.cluster.get(f"{self.serves}/{self.serve}")
        status = (body or {}).get("status") or {}
        pods = self.pods()
        leaving = [
            p.name for p in self.cluster.kubelet.pods.values() if p.deployment == self.serve and p.terminating
        ]
        if status.get("phase") != "Running":
            return f"serve phase {status.get('phase')}"
        if (status.get("replicas"), status.get("readyReplicas")) != (replicas, replicas):
            return f"serve replicas {status.get('replicas')} ready {status.get('readyReplicas')}, want {replicas}"
        if status.get("observedGeneration") != body["metadata"].get("generation"):
            return "serve status not at the latest generation"
        if len(pods) != replicas or not all(p.ready for p in pods):
            return f"pods {[(p.name, p.ready) for p in pods]}"
        if leaving:
            return f"pods still terminating: {leaving}"
        return None

    async def adapter_problem(self, name: str, ready: set[str]) -> str | None:
        """Why Adapter ``name`` has not converged on the ``ready`` pods (None: it has).

        Converged: phase Ready; one ``pods[]`` entry per ready pod, each Loaded or
        Registered; Loaded on every pod, or on at least ``placement.replicas`` of them.
        """
        plan = self.plans[name]
        status = ((await self.cluster.get(f"{self.adapters}/{name}")) or {}).get("status") or {}
        states = {entry["pod"]: entry["state"] for entry in status.get("pods") or []}
        if status.get("phase") != "Ready":
            return f"{name}: phase {status.get('phase')} {states}"
        if set(states) != ready:
            return f"{name}: pods {sorted(states)} != ready pods {sorted(ready)}"
        if not set(states.values()) <= CONVERGED_STATES:
            return f"{name}: states {states}"
        loaded = sum(state == "Loaded" for state in states.values())
        want = len(ready) if plan.replicas is None else min(plan.replicas, len(ready))
        if loaded < want:
            return f"{name}: Loaded on {loaded} pods, want at least {want}: {states}"
        return None

    async def problem(self, replicas: int) -> str | None:
        problem = await self.serve_problem(replicas)
        if problem:
            return problem
        ready = {p.name for p in self.ready_pods()}
        for name in self.plans:
            problem = await self.adapter_problem(name, ready)
            if problem:
                return problem
        return None

    async def wait_converged(self, replicas: int, *, what: str, timeout: float = STEP_TIMEOUT) -> None:
        async def converged() -> bool:
            return await self.problem(replicas) is None

        try:
            await wait_for(converged, timeout=timeout, interval=0.25, what=what)
        except AssertionError:
            raise AssertionError(
                f"timed out after {timeout:g} s waiting for {what}: {await self.problem(replicas)}"
            ) from None

    async def wait_endpoints(self, timeout: float = 30.0) -> None:
        """The Service stand-in routes to exactly the ready pods."""

        async def same() -> bool:
            await self.proxy.refresh()
            return {e.pod for e in self.proxy.endpoints} == {p.name for p in self.ready_pods()}

        await wait_for(same, timeout=timeout, interval=0.2, what="Service endpoints = ready pods")

    # ------------------------------------------------------------------ direct pod access

    async def catalog(self, pod) -> dict[str, dict]:
        """``GET /v1/lora_catalog`` of one pod, by adapter name (with the admin token its volume holds)."""
        token = (pod.volumes["admin-token"][0] / "token").read_text().strip()
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                f"http://{pod.ip}:{pod.port}/v1/lora_catalog", headers={"Authorization": f"Bearer {token}"}
            ) as resp,
        ):
            assert resp.status == 200, f"{pod.name}: GET /v1/lora_catalog {resp.status} {await resp.text()}"
            return {entry["name"]: entry for entry in (await resp.json())["adapters"]}

    async def base_model(self) -> str:
        held = await cluster_mod.pod_models(self.pods()[0])
        return next(name for name, entry in held.items() if entry["parent"] is None)

    async def reference(self, pod, models: Iterable[str], prompts: Iterable[str], *, max_tokens: int) -> dict:
        """Greedy outputs from one pod alone, one request at a time: {(model, prompt, api): text}."""
        out: dict[tuple[str, str, str], str] = {}
        async with aiohttp.ClientSession() as http:
            for model in models:
                for prompt in prompts:
                    for api in traffic_mod.APIS:
                        record = traffic_mod.Record(0, 0, model, prompt, api, False, 0.0)
                        await traffic_mod.send(
                            http, f"http://{pod.ip}:{pod.port}", record, max_tokens=max_tokens, timeout_s=60
                        )
                        assert record.ok, f"reference on {pod.name}: {record.describe()}"
                        out[(model, prompt, api)] = record.text
        return out

    # ------------------------------------------------------------------ the disturbances

    async def _step(self, label: str, replicas: int, action) -> None:
        self._log(f"{label} ...")
        self.traffic.mark(f"{label}: start")
        started = time.monotonic()
        await action()
        await self.wait_converged(replicas, what=label)
        await self.wait_endpoints()
        took = time.monotonic() - started
        self.steps.append((label, took))
        self.traffic.mark(f"{label}: converged")
        self._log(f"{label}: converged in {took:.1f}s")

    async def delete_pod(self) -> None:
        victim = self.ready_pods()[0]

        async def act() -> None:
            assert await self.cluster.delete(f"/api/v1/namespaces/{self.namespace}/pods/{victim.name}") == 200

            async def replaced() -> bool:
                return victim.name not in {p.name for p in self.pods()}

            await wait_for(replaced, timeout=30, what=f"{victim.name} terminating")

        await self._step(f"(a) delete pod {victim.name}", len(self.pods()), act)

    async def scale(self, replicas: int) -> None:
        async def act() -> None:
            status, answer = await self.cluster.request(
                "PATCH", f"{self.serves}/{self.serve}/scale", {"spec": {"replicas": replicas}}, patch=True
            )
            assert status == 200 and answer["kind"] == "Scale", (status, answer)
            assert answer["spec"]["replicas"] == replicas

        await self._step(f"(b) scale to {replicas}", replicas, act)

    async def roll(self, max_running_requests: int) -> None:
        replicas = len(self.pods())
        before = {p.name for p in self.pods()}

        async def act() -> None:
            await self.cluster.patch(
                f"{self.serves}/{self.serve}",
                {"spec": {"runtime": {"maxRunningRequests": max_running_requests}}},
            )

            async def rolled() -> bool:
                current = self.pods()
                return not before & {p.name for p in current} and all(
                    p.command[p.command.index("--max-running-requests") + 1] == str(max_running_requests)
                    for p in current
                )

            await wait_for(rolled, timeout=STEP_TIMEOUT, interval=0.25, what="pods rolled")

        await self._step(f"(c) roll (maxRunningRequests {max_running_requests})", replicas, act)

    async def churn(self, create: AdapterPlan, delete: str) -> dict[str, float]:
        """Create ``create`` (traffic for it starts at once) and delete ``delete``.

        Returns traffic-relative moments: created, deleted (DELETE sent), gone (the Adapter
        object is no more), ready (the new one's status Ready).
        """
        replicas = len(self.pods())
        moments: dict[str, float] = {}

        async def act() -> None:
            await self.create_adapter(create)
            moments["created"] = self.traffic.mark(f"{create.name} created")
            self.traffic.models.append(create.name)
            assert await self.cluster.delete(f"{self.adapters}/{delete}") == 200
            moments["deleted"] = self.traffic.mark(f"{delete} DELETE sent")

            async def gone() -> bool:
                return await self.cluster.get(f"{self.adapters}/{delete}") is None

            await wait_for(gone, timeout=STEP_TIMEOUT, what=f"{delete} gone")
            moments["gone"] = self.traffic.mark(f"{delete} gone")
            self.plans.pop(delete)

            async def ready() -> bool:
                status = ((await self.cluster.get(f"{self.adapters}/{create.name}")) or {}).get(
                    "status"
                ) or {}
                return status.get("phase") == "Ready"

            await wait_for(ready, timeout=STEP_TIMEOUT, what=f"{create.name} Ready")
            moments["ready"] = self.traffic.mark(f"{create.name} Ready")

        await self._step(f"(d) create {create.name}, delete {delete}", replicas, act)
        return moments

    async def hold(self, seconds: float) -> None:
        """Let the traffic run on, with nothing happening, for ``seconds``."""
        self.traffic.mark(f"hold {seconds:g}s: start")
        await asyncio.sleep(seconds)
        self.traffic.mark(f"hold {seconds:g}s: converged")

    def start_traffic(self, models: list[str], **options: object) -> None:
        self.traffic = traffic_mod.Traffic(url=self.proxy.url, models=models, **options)
        self.traffic.start()

    # ------------------------------------------------------------------ reports

    def pod_log_tail(self, name: str, lines: int = 15) -> str:
        pod = self.cluster.kubelet.history.get(name)
        if pod is None or pod.log_path is None:
            return f"(no log for pod {name!r})"
        logs = sorted(pod.workdir.glob("runtime-*.log"))
        text = "\n".join(path.read_text(errors="replace") for path in logs)
        return f"{pod.workdir}: " + "\n".join(text.splitlines()[-lines:])

    def timeline(self) -> str:
        marks = "\n".join(f"  +{at:6.1f}s {label}" for at, label in self.traffic.marks)
        endpoints = "\n".join(
            f"  +{at - self.traffic.t0:6.1f}s {list(pods)}"
            for at, pods in self.proxy.endpoint_history
            if at >= self.traffic.t0
        )
        return f"marks:\n{marks}\nendpoints:\n{endpoints}"


@dataclass
class Outcome:
    """The scenario's requests, sorted by what they were for and when they were sent."""

    must_succeed: list = field(default_factory=list)  # base model, adapters Loaded before
    deleted_before: list = field(default_factory=list)  # the deleted adapter, sent before its DELETE
    deleted_window: list = field(default_factory=list)  # ... between its DELETE and its disappearance
    deleted_after: list = field(default_factory=list)  # ... after the Adapter was gone: 404 expected
    created_early: list = field(default_factory=list)  # the new adapter before its status said Ready
    created_ready: list = field(default_factory=list)  # ... after: must succeed

    def failed(self) -> list:
        """Requests that should have succeeded and did not."""
        return [r for r in self.must_succeed + self.deleted_before + self.created_ready if not r.ok]


def sort_records(records: Iterable, *, created: str | None, deleted: str | None, moments: dict) -> Outcome:
    outcome = Outcome()
    for record in records:
        if record.model == deleted:
            if record.sent_at < moments["deleted"]:
                outcome.deleted_before.append(record)
            elif record.sent_at < moments["gone"]:
                outcome.deleted_window.append(record)
            else:
                outcome.deleted_after.append(record)
        elif record.model == created:
            (outcome.created_ready if record.sent_at >= moments["ready"] else outcome.created_early).append(
                record
            )
        else:
            outcome.must_succeed.append(record)
    return outcome
