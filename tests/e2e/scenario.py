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

:class:`Operations` runs what a user does to Adapters (issue 39), each phase with its own
traffic (long streams in flight) and each returning a :class:`PhaseResult` (the failed
requests and the problems seen): a version change in place, an Adapter created while new
pods load their model (a slow node), a scale down and up, pods fetching one remote adapter
into their shared cache at once (a local stand-in hub, :class:`Hub`), and a source that
hangs.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from loraserve.operator.config import OperatorConfig
from loraserve.runtime.lora.sources import ADAPTER_FILES

cluster_mod = sys.modules["_loraserve_e2e_cluster"]
assets = cluster_mod.load_sibling("assets")
service_mod = cluster_mod.load_sibling("service")
traffic_mod = cluster_mod.load_sibling("traffic")
wait_for = cluster_mod.wait_for

def operator_config() -> OperatorConfig:
    """The cluster scenario's operator settings (fast retries and resyncs), for its tests and
    ``bench/operator.py --scenario cluster`` alike."""
    return OperatorConfig(
        webhook_enabled=False,
        adapter_max_tries=5,
        adapter_backoff_base_s=0.05,
        adapter_backoff_cap_s=0.4,
        resync_interval_s=2.0,
        unload_max_tries=2,
        runtime_request_timeout_s=60,
    )


STEP_TIMEOUT = 150.0
CONVERGED_STATES = {"Loaded", "Registered"}


@dataclass(frozen=True)
class AdapterPlan:
    name: str
    source: str  # one of assets.ADAPTERS, under the adapters claim
    replicas: int | None = None  # placement {mode: Replicas, replicas: N}; None: every pod
    uri: str | None = None  # a source URI instead (a remote one); None: the claim's ``source``

    def manifest(self, serve: str, namespace: str) -> dict:
        extra: dict[str, Any] = {}
        if self.replicas is not None:
            extra["placement"] = {"mode": "Replicas", "replicas": self.replicas}
        return assets.adapter_manifest(self.name, serve, self.source_uri, namespace=namespace, **extra)

    @property
    def source_uri(self) -> str:
        return self.uri or f"pvc://adapters/{self.source}"


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


# ---------------------------------------------------------------------- operations (issue 39)

HUB_ORG = "org"
STREAM_LEAD_S = 2.0  # traffic runs this long before a phase acts: long streams are in flight
HOLD_S = 2.0  # ... and this long after it converged
STATUS_WITHIN_S = 10.0  # an Adapter's status says why a load is slow within this
LOAD_MARGIN_S = 3.0  # a 503 adapter_loading may come this much after loadTimeoutSeconds


@dataclass
class Hub:
    """A stand-in Hugging Face hub on 127.0.0.1 for ``hf://org/<repo>`` Adapter sources.

    Answers ``GET /org/<repo>/resolve/main/<file>`` from an added adapter directory after
    ``delay_s``, in eight chunks ``chunk_s`` apart (a wide window for pods racing on one
    cache), counting answers per path in ``hits``. A repo in ``hung`` accepts and never
    answers (until :meth:`stop`); ``held`` counts those requests.
    """

    delay_s: float = 0.5
    chunk_s: float = 0.05
    files: dict[str, bytes] = field(default_factory=dict)
    hits: Counter = field(default_factory=Counter)
    hung: set[str] = field(default_factory=set)
    held: int = 0
    url: str = ""
    _release: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    def add(self, repo: str, directory) -> str:
        """Serve the adapter in ``directory`` as ``repo``; returns its ``hf://`` source."""
        for name in ADAPTER_FILES:
            self.files[self.path(repo, name)] = (directory / name).read_bytes()
        return self.source(repo)

    @staticmethod
    def path(repo: str, name: str) -> str:
        return f"/{HUB_ORG}/{repo}/resolve/main/{name}"

    @staticmethod
    def source(repo: str) -> str:
        return f"hf://{HUB_ORG}/{repo}"

    def downloads(self, repo: str) -> dict[str, int]:
        """How many times each of ``repo``'s files was sent."""
        return {name: self.hits[self.path(repo, name)] for name in ADAPTER_FILES}

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        parts = request.path.split("/")
        if len(parts) > 2 and parts[2] in self.hung:
            self.held += 1
            await self._release.wait()  # accepted, never answered
            return web.Response(status=503)
        body = self.files.get(request.path)
        if body is None:
            return web.Response(status=404)
        self.hits[request.path] += 1
        await asyncio.sleep(self.delay_s)
        resp = web.StreamResponse()
        resp.content_length = len(body)
        await resp.prepare(request)
        step = max(1, -(-len(body) // 8))
        for at in range(0, len(body), step):
            await resp.write(body[at : at + step])
            await asyncio.sleep(self.chunk_s)
        await resp.write_eof()
        return resp


@dataclass
class PhaseResult:
    """One operation's outcome: its requests, the ones allowed to fail and why, the problems."""

    name: str
    records: list = field(default_factory=list)  # through the Service
    probes: list = field(default_factory=list)  # straight to pods
    excused: list = field(default_factory=list)  # (record, why): may fail
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def failed(self) -> list:
        """Requests that should have succeeded and did not."""
        excused = {id(record) for record, _ in self.excused}
        return [r for r in [*self.records, *self.probes] if not r.ok and id(r) not in excused]

    def excuse(self, record, why: str) -> None:
        self.excused.append((record, why))

    def report(self, limit: int = 12) -> str:
        """The failures and problems, for an assertion message."""
        failed = self.failed()
        lines = [f"{self.name}: {len(failed)} of {len(self.records) + len(self.probes)} requests failed"]
        lines += [f"  {r.describe()}" for r in failed[:limit]]
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)


OPS_PLANS = (AdapterPlan("alpha", "alpha"), AdapterPlan("beta", "beta"))
OPS_REPLICAS = 3
OPS_LOAD_TIMEOUT_S = 6  # the serve's loadTimeoutSeconds: small, for the hung source
OPS_SLOW_LOAD_S = 8.0  # how much longer a new pod's model load takes in phase (b)


@dataclass
class Operations:
    """What users do to Adapters, with traffic running (issue 39); one method per phase.

    ``models``: the steady traffic's models (the base model and Ready adapters). Each phase
    starts its own :class:`traffic_mod.Traffic` through the Service and stops it at its end.
    """

    scn: Scenario
    hub: Hub
    models: list[str]
    max_tokens: int = 120  # streams of ~1 s here: old-version streams are in flight at a change
    workers: int = 4
    results: list[PhaseResult] = field(default_factory=list)

    @staticmethod
    def serve_spec(hub: Hub, load_timeout_s: int) -> dict:
        """The serve's spec fields these phases need: the hub as HF endpoint, allowed as a
        remote host; a short ``loadTimeoutSeconds``."""
        return {
            "lora": {"maxRank": assets.MAX_RANK, "maxLorasPerBatch": 4, "maxLoadedLoras": 8,
                     "loadTimeoutSeconds": load_timeout_s},
            "runtime": {
                "maxRunningRequests": 8,
                "maxTotalTokens": 4096,
                "remoteSourceHosts": ["127.0.0.1"],
                "env": [
                    {"name": "OMP_NUM_THREADS", "value": "1"},
                    {"name": "MKL_NUM_THREADS", "value": "1"},
                    {"name": "HF_ENDPOINT", "value": hub.url},
                ],
            },
        }  # fmt: skip

    @classmethod
    async def open(
        cls, cluster, namespace: str, serve: str, say: Callable[[str], None], **options: Any
    ) -> Operations:
        """Start a hub and bring up a serve of :data:`OPS_REPLICAS` pods with :data:`OPS_PLANS`
        (the operator must run); ``options``: ``max_tokens``, ``workers``."""
        hub = Hub()
        await hub.start()
        scn = Scenario(cluster, namespace, serve, say=say)
        ops = cls(scn, hub, [], **options)
        try:
            await scn.bring_up(OPS_REPLICAS, OPS_PLANS, **cls.serve_spec(hub, OPS_LOAD_TIMEOUT_S))
            ops.models = [await scn.base_model(), *(p.name for p in OPS_PLANS)]
        except BaseException:
            await ops.close()
            raise
        return ops

    async def close(self) -> None:
        await self.scn.stop()
        await self.hub.stop()

    async def run_all(self) -> list[PhaseResult]:
        """Every phase, in the order the end-to-end test runs them."""
        await self.version_change()
        await self.scale(1)
        await self.create_while_loading()
        await self.shared_fetch()
        await self.hung_source()
        return self.results

    # ------------------------------------------------------------------ helpers

    def _start(self, models: list[str]) -> None:
        self.scn.start_traffic(
            list(models), workers=self.workers, max_tokens=self.max_tokens, timeout_s=120, deadline_s=900
        )

    async def _finish(self, result: PhaseResult, started: float) -> PhaseResult:
        await asyncio.sleep(HOLD_S)
        result.records = await self.scn.traffic.stop()
        result.seconds = time.monotonic() - started
        self.results.append(result)
        self.scn._log(f"{result.name}: {len(result.records)} requests")
        return result

    async def _status(self, name: str) -> dict:
        return ((await self.scn.cluster.get(f"{self.scn.adapters}/{name}")) or {}).get("status") or {}

    async def _listed_everywhere(self, name: str, pods: list) -> None:
        """Until every pod's catalog lists ``name`` (the operator pushed it)."""

        async def listed() -> bool:
            for pod in pods:
                if name not in await self.scn.catalog(pod):
                    return False
            return True

        await wait_for(listed, timeout=60, interval=0.05, what=f"{name} in every pod's catalog")

    async def _probe(self, pod, model: str, n: int) -> Any:
        """One greedy completion for ``model`` straight to ``pod``, as a traffic record."""
        record = traffic_mod.Record(n, -1, model, traffic_mod.PROMPTS[0], "completions", False,
                                    sent_at=self.scn.traffic.now())  # fmt: skip
        async with aiohttp.ClientSession() as http:
            await traffic_mod.send(http, f"http://{pod.ip}:{pod.port}", record, max_tokens=4, timeout_s=60)
        record.pod = record.pod or pod.name
        return record

    # ------------------------------------------------------------------ (a) version change

    async def version_change(self, name: str = "alpha", new: AdapterPlan = OPS_PLANS[1]) -> PhaseResult:
        """Patch ``name``'s source to ``new``'s files while streams for it run.

        Every answer for ``name`` is the old version's or the new one's reference text (the
        new one's is ``new.name``'s, an Adapter with those files); then the status shows the
        new version on every pod, none draining.
        """
        result, started = PhaseResult(f"(a) version change: {name} -> {new.source}'s files"), time.monotonic()
        pod = self.scn.ready_pods()[0]
        reference = await self.scn.reference(
            pod, [name, new.name], traffic_mod.PROMPTS, max_tokens=self.max_tokens
        )
        old_version = (await self._status(name)).get("version")
        self._start([name, name, name, *self.models])  # most streams are for the changed one
        await asyncio.sleep(STREAM_LEAD_S)
        patched = self.scn.traffic.mark(f"{name}: source -> {new.source}")
        await self.scn.cluster.patch(f"{self.scn.adapters}/{name}", {"spec": {"source": new.source_uri}})
        self.scn.plans[name] = AdapterPlan(name, new.source, self.scn.plans[name].replicas)
        reasons: set[str] = set()

        async def converged() -> bool:
            status = await self._status(name)
            ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
            reasons.add(str(ready.get("reason")))
            pods = status.get("pods") or []
            return (
                status.get("phase") == "Ready"
                and status.get("version") not in (None, old_version)
                and len(pods) == len(self.scn.ready_pods())
                and all(e.get("version") == status["version"] and not e.get("drainingVersions") for e in pods)
            )

        try:
            await wait_for(converged, timeout=STEP_TIMEOUT, interval=0.1, what=f"{name} at its new version")
            took = self.scn.traffic.mark(f"{name}: new version on every pod") - patched
            result.notes.append(
                f"new version on every pod {took:.1f} s after the patch; reasons seen {sorted(reasons)}"
            )
        except AssertionError as exc:
            result.problems.append(f"status: {exc}; last {await self._status(name)}")
        await self._finish(result, started)
        old = new_count = 0
        for r in result.records:
            if not r.ok or r.model != name:
                continue
            texts = (reference[(name, r.prompt, r.api)], reference[(new.name, r.prompt, r.api)])
            if r.text not in texts:
                result.problems.append(f"neither version's text: {r.describe()} want one of {texts!r}")
            old += r.text == texts[0] != texts[1]
            new_count += r.text == texts[1] != texts[0]
        result.notes.append(f"{name}: {old} answers from the old version, {new_count} from the new")
        if not new_count or not old:
            result.problems.append(
                f"{name}: {old} old-version and {new_count} new-version answers; want both"
            )
        return result

    # ------------------------------------------------------------------ (c) scale

    async def scale(self, replicas: int) -> PhaseResult:
        """Scale the serve to ``replicas`` under load (the Service keeps terminating pods ~1 s)."""
        label = f"(c) scale {len(self.scn.pods())} -> {replicas}"
        result, started = PhaseResult(label), time.monotonic()
        self._start(self.models)
        await asyncio.sleep(STREAM_LEAD_S)
        before = self.scn.proxy.served_terminating
        await self.scn.scale(replicas)
        result.notes.append(f"{self.scn.proxy.served_terminating - before} requests sent to terminating pods")
        return await self._finish(result, started)

    # ------------------------------------------------------------------ (b) created during a load

    async def create_while_loading(
        self,
        plan: AdapterPlan = AdapterPlan("omega", "gamma"),
        replicas: int = OPS_REPLICAS,
        delay_s: float = OPS_SLOW_LOAD_S,
    ) -> PhaseResult:
        """Scale up on a slow node (each new pod's model load takes ``delay_s`` more, its
        ConfigMap volume refreshed only every minute), create ``plan`` while the new pods load,
        and ask each new pod for it the moment the kubelet sees it Ready: never a 404."""
        result = PhaseResult(f"(b) scale to {replicas}, {plan.name} created while new pods load")
        started = time.monotonic()
        kubelet = self.scn.cluster.kubelet
        before = {p.name for p in self.scn.pods()}
        kubelet.model_load_delay_s, kubelet.configmap_sync_s = delay_s, 60.0
        self._start(self.models)
        try:
            await asyncio.sleep(STREAM_LEAD_S)
            await self.scn.cluster.patch(
                f"{self.scn.serves}/{self.scn.serve}/scale", {"spec": {"replicas": replicas}}
            )
            new = await self._new_pods_listening(before, replicas - len(before))
            await self.scn.create_adapter(plan)
            created = self.scn.traffic.mark(f"{plan.name} created")
            early = [p.name for p in new if p.ready]
            if early:
                result.problems.append(
                    f"pods {early} were Ready before {plan.name} was created: no race tested"
                )
            self.scn.traffic.models.append(plan.name)
            probes = [
                asyncio.create_task(self._probe_when_ready(pod, plan.name, n)) for n, pod in enumerate(new)
            ]
            await self.scn.wait_converged(replicas, what=f"{replicas} pods, {plan.name} Ready")
            ready = self.scn.traffic.mark(f"{plan.name} Ready on {replicas} pods")
            result.probes = list(await asyncio.gather(*probes))
            result.notes.append(f"{plan.name} converged {ready - created:.1f} s after its creation")
        finally:
            kubelet.model_load_delay_s, kubelet.configmap_sync_s = 0.0, 0.0
        await self._finish(result, started)
        for r in result.records:
            if r.model == plan.name and r.sent_at < ready and r.status == 404:
                result.excuse(r, "sent before the operator pushed the new Adapter to the pod")
        return result

    async def _new_pods_listening(self, before: set[str], count: int) -> list:
        """The ``count`` new pods, once each one's server answers (its model still loading)."""

        async def listening() -> list | None:
            new = [p for p in self.scn.pods() if p.name not in before]
            if len(new) < count:
                return None
            for pod in new:
                try:
                    async with (
                        aiohttp.ClientSession() as http,
                        http.get(
                            f"http://{pod.ip}:{pod.port}/health", timeout=aiohttp.ClientTimeout(total=1)
                        ),
                    ):
                        pass
                except (aiohttp.ClientError, OSError, TimeoutError):
                    return None
            return new

        return await wait_for(listening, timeout=STEP_TIMEOUT, interval=0.1, what="new pods listening")

    async def _probe_when_ready(self, pod, model: str, n: int) -> Any:
        while not pod.ready:
            await asyncio.sleep(0.01)
        return await self._probe(pod, model, n)

    # ------------------------------------------------------------------ (d) shared cache

    async def shared_fetch(self, name: str = "remote", files: str = "delta") -> PhaseResult:
        """Create ``plan`` (a hub source), and once every pod lists it, ask every pod for it
        at once: all 200, and the hub sent each file once (one shared cache). The hub serves
        the adapters claim's ``files`` adapter as ``name``."""
        plan = AdapterPlan(name, files, uri=self.hub.add(name, self.scn.cluster.claims.adapters / files))
        result, started = (
            PhaseResult(f"(d) {len(self.scn.pods())} pods fetch {plan.uri} into one cache"),
            time.monotonic(),
        )
        pods = self.scn.ready_pods()
        self._start(self.models)
        await asyncio.sleep(STREAM_LEAD_S)
        await self.scn.create_adapter(plan)
        created = self.scn.traffic.mark(f"{plan.name} created")
        self.scn.traffic.models.append(plan.name)
        await self._listed_everywhere(plan.name, pods)
        listed = self.scn.traffic.mark(f"{plan.name} listed by every pod")
        result.probes = list(
            await asyncio.gather(*(self._probe(pod, plan.name, n) for n, pod in enumerate(pods * 2)))
        )
        await self.scn.wait_converged(len(pods), what=f"{plan.name} Loaded everywhere", timeout=60)
        result.notes.append(f"Ready {self.scn.traffic.now() - created:.1f} s after its creation")
        await self._finish(result, started)
        for r in result.records:
            if r.model == plan.name and r.sent_at < listed and r.status == 404:
                result.excuse(r, "sent before the operator pushed the new Adapter to the pod")
        result.notes.append(f"the hub sent {self.hub.downloads(name)} (files: times)")
        if set(self.hub.downloads(name).values()) != {1}:
            result.problems.append(f"the hub sent {self.hub.downloads(name)}: want each file once")
        return result

    # ------------------------------------------------------------------ (e) a hung source

    async def hung_source(
        self,
        name: str = "stuck",
        repo: str = "stuck",
        load_timeout_s: float = OPS_LOAD_TIMEOUT_S,
        requests: int = 4,
    ) -> PhaseResult:
        """An Adapter whose source accepts and never answers: its requests get 503
        ``adapter_loading`` within ``load_timeout_s``; the other adapters' do not fail; its
        status names the pod, the source and what the load waits on within seconds. Then it
        is deleted (its requests after that may fail)."""
        result, started = PhaseResult(f"(e) {name}: its source hangs"), time.monotonic()
        self.hub.hung.add(repo)
        pods = self.scn.ready_pods()
        self._start(self.models)
        await asyncio.sleep(STREAM_LEAD_S)
        await self.scn.cluster.create(self.scn.adapters, AdapterPlan(name, "", uri=self.hub.source(repo)).manifest(
            self.scn.serve, self.scn.namespace))  # fmt: skip
        created = time.monotonic()
        self.scn.traffic.mark(f"{name} created")
        await self._listed_everywhere(name, pods)
        said = asyncio.create_task(self._status_says_why(name, repo, created))
        asked = [traffic_mod.Record(n, -1, name, traffic_mod.PROMPTS[0], "completions", False, self.scn.traffic.now())
                 for n in range(requests)]  # fmt: skip
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(traffic_mod.send(http, self.scn.proxy.url, r, max_tokens=4, timeout_s=120)
                                   for r in asked))  # fmt: skip
        for r in asked:
            result.excuse(r, "its source hangs: 503 adapter_loading expected")
            if (
                r.status != 503
                or "adapter_loading" not in r.error
                or r.latency > load_timeout_s + LOAD_MARGIN_S
            ):
                result.problems.append(
                    f"want 503 adapter_loading within {load_timeout_s:g} s: {r.describe()}"
                )
        result.probes = asked
        waits = sorted(f"{r.latency:.1f}" for r in asked)
        result.notes.append(
            f"{name}: {len(asked)} requests answered {sorted({r.status for r in asked}, key=str)} after {waits} s"
        )
        message = await said
        if message.startswith("problem: "):
            result.problems.append(message.removeprefix("problem: "))
        else:
            result.notes.append(message)
        assert await self.scn.cluster.delete(f"{self.scn.adapters}/{name}") == 200

        async def gone() -> bool:
            return await self.scn.cluster.get(f"{self.scn.adapters}/{name}") is None

        try:
            await wait_for(gone, timeout=60, interval=0.2, what=f"{name} gone")
        except AssertionError as exc:
            result.problems.append(str(exc))
        self.hub.hung.discard(repo)
        return await self._finish(result, started)

    async def _status_says_why(self, name: str, repo: str, since: float) -> str:
        """The Adapter status line naming a pod, the hung source and what it waits on (or
        ``problem: ...`` after :data:`STATUS_WITHIN_S`)."""
        pods = {p.name for p in self.scn.ready_pods()}
        last: dict = {}
        while time.monotonic() - since < STATUS_WITHIN_S:
            last = await self._status(name)
            for entry in last.get("pods") or []:
                text = entry.get("message") or ""
                if (
                    entry["pod"] in pods
                    and f"/{HUB_ORG}/{repo}" in text  # hf://org/<repo> or its URL
                    and any(word in text for word in ("connecting", "downloading", "waiting"))
                ):
                    ready = next((c for c in last.get("conditions") or [] if c["type"] == "Ready"), {})
                    if entry["pod"] in str(ready.get("message")):
                        return f"after {time.monotonic() - since:.1f} s: {entry['pod']}: {text}"
            await asyncio.sleep(0.2)
        return (
            f"problem: {STATUS_WITHIN_S:g} s after its creation the status of {name} does not say why: {last}"
        )
