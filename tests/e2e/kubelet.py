"""A stand-in for what a cluster runs behind the API: Deployment controller, kubelet, GC.

The end-to-end tests have no cluster, only an API stand-in (``apiserver.py``). This loop
plays the controllers the operator depends on, faithfully enough that the operator cannot
tell the difference through the API:

* **Deployment controller**: keeps ``spec.replicas`` pods of the current pod template;
  pods of an older template are replaced (a rollout); writes the Deployment's status
  (replicas, updatedReplicas, readyReplicas, conditions with the reasons Kubernetes uses).
* **kubelet**: for each pod starts the container's real command (``loraserve-runtime``
  with the args the operator wrote) as a local process on the pod's own loopback address
  (``127.a.b.n``), with Secret volumes written to files, emptyDirs as fresh directories and
  PersistentVolumeClaims as host directories; probes ``/ready`` and writes the pod's Ready
  condition; a process that exits is restarted in place (restartPolicy Always). A pod's
  ``initContainers`` run first, one at a time, each to completion, with the same command,
  environment and volume handling; one that fails is retried with the crash backoff and the
  pod stays Pending (``Init:Error``); they are not run again when the main container
  restarts, only for a new pod. The status carries ``initContainerStatuses``.
* **garbage collector**: objects whose controller owner is gone are deleted.

A process cannot get a private mount namespace here, so a claim's directory must be mounted
at its own host path (the tests point ``mountPath`` at it); other volumes are reached by
rewriting path prefixes in the command line. That is checked, not assumed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

log = logging.getLogger("e2e.kubelet")

OWNED = {
    "apps/v1/deployments": "/apis/apps/v1",
    "v1/services": "/api/v1",
    "v1/secrets": "/api/v1",
    "policy/v1/poddisruptionbudgets": "/apis/policy/v1",
}


def template_hash(template: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def crash_backoff(restarts: int) -> float:
    """Seconds before restarting a container that exited: CrashLoopBackOff, shortened (0.2 s doubling to 10 s)."""
    return min(0.2 * 2 ** min(restarts, 6), 10.0)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


TERMINATION_LOG_TAIL = 2048
"""Bytes of a failed container's log a kubelet copies into ``terminated.message`` under
``terminationMessagePolicy: FallbackToLogsOnError``."""


@dataclass
class InitContainer:
    """One of a pod's init containers: its command line and environment, and how its runs went."""

    name: str
    command: list[str]
    env: dict[str, str]
    # terminationMessagePolicy FallbackToLogsOnError: a failure's message is its log's tail
    # (the default policy, File, reads /dev/termination-log, which nothing here writes).
    message_from_log: bool = False
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: str = ""
    state: dict = field(default_factory=lambda: {"waiting": {"reason": "PodInitializing"}})
    last_state: dict = field(default_factory=dict)
    logs: list[Path] = field(default_factory=list)  # one per run, oldest first

    @property
    def completed(self) -> bool:
        return self.state.get("terminated", {}).get("exitCode") == 0

    def status(self) -> dict:
        """This container's entry of the pod's ``status.initContainerStatuses``."""
        return {
            "name": self.name,
            "ready": self.completed,
            "restartCount": self.restarts,
            "state": self.state,
            "lastState": self.last_state,
        }


@dataclass
class PodProc:
    """One pod: its API object's identity and its container process."""

    namespace: str
    name: str
    deployment: str
    template_hash: str
    ip: str
    port: int
    workdir: Path
    command: list[str]
    env: dict[str, str]
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    restarts: int = 0
    started_at: float = 0.0
    log_path: Path | None = None
    deleted: bool = False
    pending_status: bool = True
    restart_at: float | None = None
    # The readiness probe's timeoutSeconds and failureThreshold from the pod template: a
    # kubelet marks a ready pod unready only after that many failures in a row, so one slow
    # answer on a loaded machine does not take the pod out of service.
    probe_timeout_s: float = 1.0
    probe_failure_threshold: int = 3
    probe_failures: int = 0
    # Run in order before the main container; ``init_next`` is the one running or due.
    init: list[InitContainer] = field(default_factory=list)
    init_next: int = 0

    @property
    def initialized(self) -> bool:
        return self.init_next >= len(self.init)


@dataclass
class Kubelet:
    """Runs the loop; ``pods`` is visible to tests (to kill a process, read a log)."""

    api: str
    root: Path
    claims_root: Path
    tick_s: float = 0.2
    pods: dict[tuple[str, str], PodProc] = field(default_factory=dict)
    _session: aiohttp.ClientSession | None = None
    _task: asyncio.Task | None = None
    _net: tuple[int, int] = field(default_factory=lambda: (random.randint(2, 250), random.randint(2, 250)))
    _next_host: int = 10
    _deploy_status: dict[tuple[str, str], dict] = field(default_factory=dict)
    _completed: dict[tuple[str, str], str] = field(default_factory=dict)
    _reaping: set[asyncio.Task] = field(default_factory=set)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20))
        self._task = asyncio.create_task(self._run(), name="kubelet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await asyncio.gather(*(self._terminate(p) for p in list(self.pods.values())), return_exceptions=True)
        await asyncio.gather(*self._reaping, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("kubelet tick failed")
            await asyncio.sleep(self.tick_s)

    # ------------------------------------------------------------------ API helpers

    async def _req(self, method: str, path: str, body: object = None, *, ok404: bool = False) -> dict | None:
        assert self._session is not None
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self._session.request(method, self.api + path, json=body, headers=headers) as resp:
            if resp.status == 404 and ok404:
                return None
            text = await resp.text()
            if resp.status >= 400:
                raise RuntimeError(f"{method} {path}: {resp.status} {text[:300]}")
            return json.loads(text) if text else None

    async def _list(self, prefix: str, plural: str) -> list[dict]:
        answer = await self._req("GET", f"{prefix}/{plural}")
        return list((answer or {}).get("items") or [])

    # ------------------------------------------------------------------ the loop

    async def _tick(self) -> None:
        await self._collect_garbage()
        deployments = await self._list("/apis/apps/v1", "deployments")
        live = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in deployments}
        api_pods = {
            (p["metadata"]["namespace"], p["metadata"]["name"]) for p in await self._list("/api/v1", "pods")
        }
        for key, pod in list(self.pods.items()):
            if key not in api_pods and not pod.pending_status:
                # Deleted through the API (by a test, as `kubectl delete pod` would).
                pod.deleted = True
                self._reap(pod)
        for pod in list(self.pods.values()):
            if (pod.namespace, pod.deployment) not in live:
                await self._delete_pod(pod)
        for deployment in deployments:
            await self._sync_deployment(deployment)
        await self._probe_all()

    async def _collect_garbage(self) -> None:
        serves = await self._list("/apis/loraserve.io/v1alpha1", "loraserves")
        uids = {s["metadata"].get("uid") for s in serves}
        for resource, prefix in OWNED.items():
            plural = resource.rsplit("/", 1)[1]
            for obj in await self._list(prefix, plural):
                refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
                if refs and all(r.get("kind") == "LoRAServe" and r.get("uid") not in uids for r in refs):
                    meta = obj["metadata"]
                    await self._req(
                        "DELETE",
                        f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}",
                        ok404=True,
                    )

    async def _sync_deployment(self, deployment: dict) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        namespace, name = meta["namespace"], meta["name"]
        template = spec["template"]
        current = template_hash(template)
        mine = [
            p
            for p in self.pods.values()
            if p.namespace == namespace and p.deployment == name and not p.deleted
        ]
        # Rollout: replace the pods of an older template.
        for pod in [p for p in mine if p.template_hash != current]:
            await self._delete_pod(pod)
        mine = [p for p in mine if p.template_hash == current]
        want = int(spec.get("replicas", 1))
        while len(mine) < want:
            mine.append(await self._create_pod(namespace, name, template, current, deployment))
        for pod in sorted(mine, key=lambda p: p.started_at, reverse=True)[: max(len(mine) - want, 0)]:
            await self._delete_pod(pod)
            mine.remove(pod)
        ready = sum(p.ready for p in mine)
        if len(mine) == want and ready >= want:
            self._completed[(namespace, name)] = current
        # As Kubernetes does: NewReplicaSetAvailable once this template's rollout completed,
        # kept while replicas come and go; ReplicaSetUpdated while a rollout is under way.
        done = self._completed.get((namespace, name)) == current
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len(mine),
            "updatedReplicas": len(mine),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready >= max(want - 1, 1) or want == 0 else "False",
                    "reason": "MinimumReplicasAvailable" if ready else "MinimumReplicasUnavailable",
                },
                {
                    "type": "Progressing",
                    "status": "True",
                    "reason": "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                },
            ],
        }
        if self._deploy_status.get((namespace, name)) != status:
            self._deploy_status[(namespace, name)] = status
            await self._req(
                "PATCH",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/status",
                {"status": status},
                ok404=True,
            )

    # ------------------------------------------------------------------ pods

    def _address(self) -> str:
        a, b = self._net
        self._next_host += 1
        return f"127.{a}.{b}.{self._next_host}"

    async def _create_pod(
        self, namespace: str, deployment: str, template: dict, thash: str, owner: dict
    ) -> PodProc:
        ip = self._address()
        suffix = "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        name = f"{deployment}-{thash[:8]}-{suffix}"
        workdir = self.root / "pods" / name
        workdir.mkdir(parents=True, exist_ok=True)
        pod_spec = json.loads(json.dumps(template["spec"]))
        container = pod_spec["containers"][0]
        port = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == "http"), 8000)
        volumes = await self._volumes(namespace, pod_spec, workdir)
        command = self._command(container, volumes, ip)
        env = await self._env(namespace, name, container)
        pod = PodProc(namespace, name, deployment, thash, ip, port, workdir, command, env)
        pod.started_at = time.monotonic()  # the pod's age until its main container starts
        pod.init = [
            InitContainer(
                name=spec["name"],
                command=self._command(spec, volumes, ip),
                env=await self._env(namespace, name, spec),
                message_from_log=spec.get("terminationMessagePolicy") == "FallbackToLogsOnError",
            )
            for spec in pod_spec.get("initContainers", [])
        ]
        probe = container.get("readinessProbe") or {}
        pod.probe_timeout_s = float(probe.get("timeoutSeconds", 1))
        pod.probe_failure_threshold = int(probe.get("failureThreshold", 3))
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {**template["metadata"].get("labels", {}), "pod-template-hash": thash[:10]},
                "annotations": dict(template["metadata"].get("annotations", {})),
                "ownerReferences": [
                    {
                        "apiVersion": "apps/v1",
                        "kind": "Deployment",
                        "name": deployment,
                        "uid": owner["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {**pod_spec, "nodeName": "stand-in"},
            "status": self._status(pod),
        }
        await self._req("POST", f"/api/v1/namespaces/{namespace}/pods", body)
        pod.pending_status = False
        self.pods[(namespace, name)] = pod
        await self._advance(pod)
        return pod

    def _command(self, container: dict, volumes: dict[str, tuple[Path, bool]], ip: str) -> list[str]:
        """A container's command line as this machine runs it: program resolved, volume paths rewritten."""
        program, *args = [*container.get("command", []), *container.get("args", [])]
        # The program is the image's own binary (here: this venv's script), never a path
        # inside a pod volume, wherever the checkout lives (under /tmp, say).
        command = [self._resolve(program), *(self._rewrite(arg, container, volumes) for arg in args)]
        return [
            ip if prev == "--host" else arg for prev, arg in zip(["", *command[:-1]], command, strict=True)
        ]

    def _resolve(self, arg: str) -> str:
        if arg.startswith("loraserve-"):
            found = shutil.which(arg, path=str(Path(sys.executable).parent))
            return found or arg
        return arg

    async def _volumes(self, namespace: str, pod_spec: dict, workdir: Path) -> dict[str, tuple[Path, bool]]:
        """Volume name -> (host directory, mounted at its own path)."""
        out: dict[str, tuple[Path, bool]] = {}
        for volume in pod_spec.get("volumes", []):
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                out[name] = (self.claims_root / volume["persistentVolumeClaim"]["claimName"], True)
            elif "secret" in volume:
                secret = await self._req(
                    "GET",
                    f"/api/v1/namespaces/{namespace}/secrets/{volume['secret']['secretName']}",
                    ok404=True,
                )
                directory = workdir / "volumes" / name
                directory.mkdir(parents=True, exist_ok=True)
                data = (secret or {}).get("data") or {}
                for item in volume["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    if item["key"] in data:
                        (directory / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
                out[name] = (directory, False)
            else:
                directory = workdir / "volumes" / name
                directory.mkdir(parents=True, exist_ok=True)
                out[name] = (directory, False)
        return out

    @staticmethod
    def _rewrite(arg: str, container: dict, volumes: dict[str, tuple[Path, bool]]) -> str:
        mounts = sorted(container.get("volumeMounts", []), key=lambda m: len(m["mountPath"]), reverse=True)
        for mount in mounts:
            host, in_place = volumes[mount["name"]]
            path = mount["mountPath"].rstrip("/")
            under = arg == path or arg.startswith(path + "/")
            if in_place:
                if Path(path) != host:
                    raise RuntimeError(
                        f"claim volume {mount['name']!r} is mounted at {path}, but this stand-in can only mount a "
                        f"claim at its own host directory {host}: point the spec's mountPath there"
                    )
                if under:
                    return arg
                continue
            if under:
                return str(host) + arg[len(path) :]
        return arg

    async def _env(self, namespace: str, pod: str, container: dict) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env["PYTHONSAFEPATH"] = "1"
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = str(item["value"])
                continue
            source = item.get("valueFrom") or {}
            if "fieldRef" in source:
                field_path = source["fieldRef"]["fieldPath"]
                env[item["name"]] = {"metadata.name": pod, "metadata.namespace": namespace}.get(
                    field_path, ""
                )
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                secret = await self._req(
                    "GET", f"/api/v1/namespaces/{namespace}/secrets/{ref['name']}", ok404=True
                )
                value = ((secret or {}).get("data") or {}).get(ref["key"])
                if value is not None:
                    env[item["name"]] = base64.b64decode(value).decode()
        return env

    @staticmethod
    async def _spawn(
        command: list[str], env: dict[str, str], cwd: Path, log_path: Path
    ) -> asyncio.subprocess.Process:
        handle = log_path.open("wb")
        try:
            return await asyncio.create_subprocess_exec(
                *command, env=env, cwd=cwd, stdout=handle, stderr=asyncio.subprocess.STDOUT
            )
        finally:
            handle.close()

    async def _start(self, pod: PodProc) -> None:
        if not _port_free(pod.ip, pod.port):
            raise RuntimeError(f"{pod.ip}:{pod.port} is taken on this machine; the pod cannot bind it")
        pod.log_path = pod.workdir / f"runtime-{pod.restarts}.log"
        pod.process = await self._spawn(pod.command, pod.env, pod.workdir, pod.log_path)
        pod.started_at = time.monotonic()
        pod.ready = False
        pod.probe_failures = 0

    async def _advance(self, pod: PodProc) -> None:
        """Start the pod's next init container, or its main container once all of them completed."""
        if pod.initialized:
            await self._start(pod)
        else:
            await self._start_init(pod, pod.init[pod.init_next])
        await self._patch_status(pod)

    async def _start_init(self, pod: PodProc, init: InitContainer) -> None:
        log_path = pod.workdir / f"init-{init.name}-{init.restarts}.log"  # names are unique in a pod
        init.logs.append(log_path)
        init.started_at = _now()
        try:
            init.process = await self._spawn(init.command, init.env, pod.workdir, log_path)
        except OSError as exc:
            # The program is missing or not executable: a kubelet reports StartError (128).
            await self._init_failed(pod, init, 128, "StartError", f"starting {init.command[0]!r}: {exc}")
            return
        init.state = {"running": {"startedAt": init.started_at}}

    async def _step_init(self, pod: PodProc) -> None:
        """Follow the running init container: on to the next when it succeeds, retry when it fails."""
        init = pod.init[pod.init_next]
        if init.process is None:
            # Failed, waiting out the backoff (restartPolicy Always retries init containers).
            if pod.restart_at is not None and time.monotonic() >= pod.restart_at:
                pod.restart_at = None
                init.restarts += 1
                await self._start_init(pod, init)
                await self._patch_status(pod)
            return
        code = init.process.returncode
        if code is None:
            return
        init.process = None
        if code == 0:
            init.state = {"terminated": self._terminated(init, 0, "Completed")}
            pod.init_next += 1
            await self._advance(pod)
            return
        message = _log_tail(init.logs[-1]) if init.message_from_log else ""
        await self._init_failed(pod, init, code, "Error", message)

    async def _init_failed(
        self, pod: PodProc, init: InitContainer, code: int, reason: str, message: str
    ) -> None:
        """Record a failed run of ``init`` and schedule its retry after the crash backoff."""
        log.info("pod %s: init container %s failed (%s %s), retrying", pod.name, init.name, reason, code)
        # Init:Error until the backoff passes; lastState keeps the failure while it runs again.
        init.state = init.last_state = {"terminated": self._terminated(init, code, reason, message)}
        pod.restart_at = time.monotonic() + crash_backoff(init.restarts)
        await self._patch_status(pod)

    @staticmethod
    def _terminated(init: InitContainer, code: int, reason: str, message: str = "") -> dict:
        terminated = {"exitCode": code, "reason": reason, "startedAt": init.started_at, "finishedAt": _now()}
        if message:
            terminated["message"] = message
        return terminated

    def _status(self, pod: PodProc) -> dict:
        """The pod's ``status`` as a kubelet reports it."""
        initialized = pod.initialized
        if pod.process is not None:
            main_state: dict = {"running": {}}
        else:
            main_state = {"waiting": {"reason": "ContainerCreating" if initialized else "PodInitializing"}}
        status: dict = {
            "phase": "Running" if pod.process is not None else "Pending",
            "podIP": pod.ip,
            "conditions": [
                {"type": "Initialized", "status": "True" if initialized else "False"},
                {"type": "Ready", "status": "True" if pod.ready else "False"},
            ],
            "containerStatuses": [
                {"name": "runtime", "ready": pod.ready, "restartCount": pod.restarts, "state": main_state}
            ],
        }
        if pod.init:
            status["initContainerStatuses"] = [init.status() for init in pod.init]
        return status

    async def _patch_status(self, pod: PodProc) -> None:
        await self._req(
            "PATCH",
            f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
            {"status": self._status(pod)},
            ok404=True,
        )

    async def _set_ready(self, pod: PodProc, ready: bool) -> None:
        pod.ready = ready
        await self._patch_status(pod)

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(p) for p in list(self.pods.values()) if not p.deleted))

    async def _probe(self, pod: PodProc) -> None:
        assert self._session is not None
        if not pod.initialized:
            await self._step_init(pod)
            return
        if pod.process is not None and pod.process.returncode is not None:
            # The container exited: not ready, restarted in place (restartPolicy Always); the
            # init containers stay completed (a kubelet re-runs them only for a new sandbox).
            log.info("pod %s: runtime exited with %s, restarting", pod.name, pod.process.returncode)
            if pod.ready:
                await self._set_ready(pod, False)
            if pod.restart_at is None:
                pod.restart_at = time.monotonic() + crash_backoff(pod.restarts)
            if time.monotonic() >= pod.restart_at:
                pod.restarts += 1
                pod.restart_at = None
                await self._start(pod)
            return
        ok = False
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
            async with self._session.get(
                f"http://{pod.ip}:{pod.port}/ready", timeout=aiohttp.ClientTimeout(total=pod.probe_timeout_s)
            ) as resp:
                ok = resp.status == 200
        pod.probe_failures = 0 if ok else pod.probe_failures + 1
        if ok and not pod.ready:
            await self._set_ready(pod, True)  # successThreshold 1
        elif pod.ready and pod.probe_failures >= pod.probe_failure_threshold:
            await self._set_ready(pod, False)

    async def _delete_pod(self, pod: PodProc) -> None:
        pod.deleted = True
        await self._req("DELETE", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}", ok404=True)
        self._reap(pod)

    def _reap(self, pod: PodProc) -> None:
        self.pods.pop((pod.namespace, pod.name), None)
        task = asyncio.create_task(self._terminate(pod))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    @staticmethod
    async def _terminate(pod: PodProc) -> None:
        await asyncio.gather(
            *(Kubelet._stop_process(c.process) for c in pod.init if c.process is not None),
            Kubelet._stop_process(pod.process),
        )

    @staticmethod
    async def _stop_process(process: asyncio.subprocess.Process | None) -> None:
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=15)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    # ------------------------------------------------------------------ test hooks

    def pods_of(self, namespace: str, deployment: str) -> list[PodProc]:
        return sorted(
            (
                p
                for p in self.pods.values()
                if p.namespace == namespace and p.deployment == deployment and not p.deleted
            ),
            key=lambda p: p.name,
        )

    def kill(self, pod: PodProc) -> None:
        """Kill a pod's runtime process (SIGKILL), as an OOM kill or a crash would."""
        assert pod.process is not None
        pod.process.kill()

    @staticmethod
    def init_logs(pod: PodProc, name: str) -> list[str]:
        """Every run's log of the pod's init container ``name``, oldest first (``kubectl logs -c``, all runs)."""
        init = next((c for c in pod.init if c.name == name), None)
        if init is None:
            raise KeyError(f"pod {pod.name} has no init container {name!r}: {[c.name for c in pod.init]}")
        return [path.read_text(errors="replace") for path in init.logs if path.exists()]


def _log_tail(path: Path, limit: int = TERMINATION_LOG_TAIL) -> str:
    data = path.read_bytes()
    return data[-limit:].decode("utf-8", "replace").strip()


def _port_free(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True
