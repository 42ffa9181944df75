"""A stand-in for what a cluster runs behind the API: Deployment controller, kubelet, GC.

The end-to-end tests have no cluster, only an API stand-in (``apiserver.py``). This loop
plays the controllers the operator depends on, faithfully enough that the operator cannot
tell the difference through the API:

* **Deployment controller** (with its ReplicaSets): keeps ``spec.replicas`` pods of the
  current pod template. Pods of an older template are replaced by a rolling update that
  honours ``strategy.rollingUpdate`` (``maxSurge`` / ``maxUnavailable``, ints or
  percentages, the Kubernetes defaults of 25%) as the Deployment controller computes it:
  new pods are added while the total stays within replicas + maxSurge, old ones are
  deleted only while the ready pods stay at least replicas - maxUnavailable (with maxSurge 1
  / maxUnavailable 0 a new pod is Ready before an old one goes); ``Recreate`` deletes the
  old pods first. Scaling down deletes not-ready pods first, then the newest, as a
  ReplicaSet ranks them. Every deletion goes through the API (``DELETE`` of the Pod, a
  graceful deletion, see below), as a ReplicaSet's does; a terminating pod no longer counts
  as a replica, so its replacement starts at once. Writes the Deployment's status
  (replicas, updatedReplicas, readyReplicas, conditions with the reasons Kubernetes uses).
* **kubelet**: for each pod starts the container's real command (``loraserve-runtime``
  with the args the operator wrote) as a local process on the pod's own loopback address
  (``127.a.b.n``), with Secret and ConfigMap volumes written to files (``items`` honoured),
  emptyDirs as fresh directories and PersistentVolumeClaims as host directories. A pod
  whose non-optional ConfigMap or Secret does not exist yet stays Pending (container
  waiting, reason ContainerCreating; a ``FailedMount`` event) until it does, as a kubelet
  retries the mount. Mounted ConfigMap and Secret files are refreshed when the object
  changes, atomically (a temporary file renamed over the old one), on the next tick (a real
  kubelet does it within its sync period, up to a minute or so later). Probes ``/ready``
  and writes the pod's Ready condition; a process that exits is restarted in place
  (restartPolicy Always). A pod's
  ``initContainers`` run first, one at a time, each to completion, with the same command,
  environment and volume handling; one that fails is retried with the crash backoff and the
  pod stays Pending (``Init:Error``); they are not run again when the main container
  restarts, only for a new pod. The status carries ``initContainerStatuses``.
* **graceful termination**: a pod deleted through the API (``kubectl delete pod``, a
  ReplicaSet scaling down or rolling out) gets a ``deletionTimestamp`` from the API
  stand-in and stays, terminating. Endpoints leave it at once (terminating pods are not
  ready endpoints, ``service.py``); the kubelet runs the container's ``lifecycle.preStop``
  hook (``sleep``, ``exec`` — run as a process with the container's environment — or
  ``httpGet``), then sends SIGTERM, then SIGKILL once ``terminationGracePeriodSeconds``
  (counted from the deletion, hook included) has passed, and finally deletes the Pod object
  with ``gracePeriodSeconds=0``. A terminating pod's container is not restarted; its
  readiness is still probed. A pod removed from the API outright (grace 0) is killed.
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
    "v1/configmaps": "/api/v1",
    "policy/v1/poddisruptionbudgets": "/apis/policy/v1",
}
DEFAULT_GRACE_S = 30
"""A pod's ``terminationGracePeriodSeconds`` when its spec has none (the Kubernetes default)."""
PRESTOP_OVERRUN_S = 2
"""A kubelet gives a preStop hook still running at the end of the grace period 2 s more."""


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
    created_at: float = field(default_factory=time.monotonic)
    # The main container's spec (lifecycle hooks) and the pod's volumes.
    container: dict = field(default_factory=dict)
    volume_specs: list[dict] = field(default_factory=list)
    volumes: dict[str, tuple[Path, bool]] = field(default_factory=dict)
    # ConfigMap / Secret volumes written (the pod waits in ContainerCreating until they are).
    mounted: bool = False
    mounted_files: dict[Path, bytes] = field(default_factory=dict)
    mount_failure: str = ""
    # Graceful termination: since when (monotonic), the grace period, how the container ended.
    terminating_since: float | None = None
    grace_s: float = DEFAULT_GRACE_S
    exit_code: int | None = None
    prestop_log: list[str] = field(default_factory=list)
    unready_log: list[str] = field(default_factory=list)  # why a Ready pod turned unready

    @property
    def initialized(self) -> bool:
        return self.init_next >= len(self.init)

    @property
    def terminating(self) -> bool:
        return self.terminating_since is not None


@dataclass
class Kubelet:
    """Runs the loop; ``pods`` is visible to tests (to kill a process, read a log)."""

    api: str
    root: Path
    claims_root: Path
    tick_s: float = 0.2
    model_load_delay_s: float = 0.0
    """A slow node: runtime pods created while this is positive spend this long more loading
    their model (``slowload/sitecustomize.py``, after the server listens and has read its
    catalog file, as a large model read from a network volume would). 0: no delay."""
    configmap_sync_s: float = 0.0
    """How often mounted ConfigMap / Secret files follow their object (a real kubelet: up to
    a minute or so). 0: every tick."""
    pods: dict[tuple[str, str], PodProc] = field(default_factory=dict)
    history: dict[str, PodProc] = field(default_factory=dict)  # every pod ever made, by name (logs)
    _session: aiohttp.ClientSession | None = None
    _task: asyncio.Task | None = None
    _net: tuple[int, int] = field(default_factory=lambda: (random.randint(2, 250), random.randint(2, 250)))
    _next_host: int = 10
    _deploy_status: dict[tuple[str, str], dict] = field(default_factory=dict)
    _completed: dict[tuple[str, str], str] = field(default_factory=dict)
    _reaping: set[asyncio.Task] = field(default_factory=set)
    _volumes_synced: float = 0.0

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
        listed = await self._collect_garbage()
        deployments = await self._list("/apis/apps/v1", "deployments")
        live = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in deployments}
        api_pods = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p
            for p in await self._list("/api/v1", "pods")
        }
        for key, pod in list(self.pods.items()):
            body = api_pods.get(key)
            if body is None:
                if not pod.pending_status and not pod.terminating:
                    # Removed from the API outright (a forced deletion, grace 0): killed.
                    pod.deleted = True
                    self._reap(pod)
            elif body["metadata"].get("deletionTimestamp"):
                # Deleted through the API (by a test, as `kubectl delete pod` would): terminate gracefully.
                self._begin_termination(pod, body)
        for pod in list(self.pods.values()):
            if not pod.deleted and (pod.namespace, pod.deployment) not in live:
                await self._delete_pod(pod)
        for deployment in deployments:
            await self._sync_deployment(deployment)
        await self._refresh_volumes(listed)
        await self._probe_all()

    async def _collect_garbage(self) -> dict[str, list[dict]]:
        """Delete objects whose controller (a LoRAServe) is gone; returns what it listed, by resource."""
        serves = await self._list("/apis/loraserve.io/v1alpha1", "loraserves")
        uids = {s["metadata"].get("uid") for s in serves}
        listed: dict[str, list[dict]] = {}
        for resource, prefix in OWNED.items():
            plural = resource.rsplit("/", 1)[1]
            listed[resource] = await self._list(prefix, plural)
            for obj in listed[resource]:
                refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")]
                if refs and all(r.get("kind") == "LoRAServe" and r.get("uid") not in uids for r in refs):
                    meta = obj["metadata"]
                    await self._req(
                        "DELETE",
                        f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}",
                        ok404=True,
                    )
        return listed

    async def _sync_deployment(self, deployment: dict) -> None:
        meta, spec = deployment["metadata"], deployment["spec"]
        namespace, name = meta["namespace"], meta["name"]
        template = spec["template"]
        current = template_hash(template)
        want = int(spec.get("replicas", 1))
        # Terminating pods are no replicas any more (a ReplicaSet replaces them at once).
        mine = [
            p
            for p in self.pods.values()
            if p.namespace == namespace and p.deployment == name and not p.deleted
        ]
        new = [p for p in mine if p.template_hash == current]
        old = [p for p in mine if p.template_hash != current]
        strategy = spec.get("strategy") or {}
        if strategy.get("type") == "Recreate":
            surge, unavailable = 0, want
        else:
            rolling = strategy.get("rollingUpdate") or {}
            surge = _int_or_percent(rolling.get("maxSurge", "25%"), want, round_up=True)
            unavailable = _int_or_percent(rolling.get("maxUnavailable", "25%"), want, round_up=False)
            if surge == 0 and unavailable == 0:
                unavailable = 1  # as the Deployment controller does
        if not old:
            # No rollout: the ReplicaSet of the current template is scaled to spec.replicas.
            while len(new) < want:
                new.append(await self._create_pod(namespace, name, template, current, deployment))
            for pod in _deletion_order(new)[: max(len(new) - want, 0)]:
                await self._delete_pod(pod)
                new.remove(pod)
        elif strategy.get("type") == "Recreate":
            for pod in old:
                await self._delete_pod(pod)
            old = []
        else:
            # A rolling update, as the Deployment controller computes it each sync.
            for pod in _deletion_order(new)[: max(len(new) - want, 0)]:
                await self._delete_pod(pod)
                new.remove(pod)
            scale_up = want + surge - (len(new) + len(old))
            target = min(len(new) + max(scale_up, 0), want)
            while len(new) < target:
                new.append(await self._create_pod(namespace, name, template, current, deployment))
            min_available = want - unavailable
            new_unavailable = sum(not p.ready for p in new)
            # First old pods that are not ready (they serve nothing), within the budget ...
            budget = len(new) + len(old) - min_available - new_unavailable
            for pod in [p for p in _deletion_order(old) if not p.ready][: max(budget, 0)]:
                await self._delete_pod(pod)
                old.remove(pod)
            # ... then ready old pods, while the ready pods stay at least replicas - maxUnavailable.
            scale_down = sum(p.ready for p in new + old) - min_available
            for pod in _deletion_order(old)[: max(scale_down, 0)]:
                await self._delete_pod(pod)
                old.remove(pod)
        if strategy.get("type") == "Recreate" and not old:
            leaving = any(
                p.namespace == namespace and p.deployment == name and p.terminating
                for p in self.pods.values()
            )
            while not leaving and len(new) < want:
                new.append(await self._create_pod(namespace, name, template, current, deployment))
        mine = new + old
        ready = sum(p.ready for p in mine)
        if not old and len(new) == want and sum(p.ready for p in new) >= want:
            self._completed[(namespace, name)] = current
        # As Kubernetes does: NewReplicaSetAvailable once this template's rollout completed,
        # kept while replicas come and go; ReplicaSetUpdated while a rollout is under way.
        done = self._completed.get((namespace, name)) == current
        status = {
            "observedGeneration": meta.get("generation", 1),
            "replicas": len(mine),
            "updatedReplicas": len(new),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready >= max(want - unavailable, 1) or want == 0 else "False",
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
        volumes = self._volume_paths(pod_spec, workdir)
        command = self._command(container, volumes, ip)
        env = await self._env(namespace, name, container)
        if self.model_load_delay_s > 0:
            env = {**env, **slow_load_env(self.model_load_delay_s, env)}
        pod = PodProc(namespace, name, deployment, thash, ip, port, workdir, command, env)
        pod.started_at = time.monotonic()  # the pod's age until its main container starts
        pod.container, pod.volumes = container, volumes
        pod.volume_specs = list(pod_spec.get("volumes", []))
        pod.grace_s = float(pod_spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
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
        self.history[name] = pod
        if await self._mount(pod):
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

    def _volume_paths(self, pod_spec: dict, workdir: Path) -> dict[str, tuple[Path, bool]]:
        """Volume name -> (host directory, mounted at its own path); directories are made here."""
        out: dict[str, tuple[Path, bool]] = {}
        for volume in pod_spec.get("volumes", []):
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                out[name] = (self.claims_root / volume["persistentVolumeClaim"]["claimName"], True)
            else:
                directory = workdir / "volumes" / name
                directory.mkdir(parents=True, exist_ok=True)
                out[name] = (directory, False)
        return out

    async def _mount(self, pod: PodProc, listed: dict[str, list[dict]] | None = None) -> bool:
        """Write the pod's ConfigMap and Secret volumes; False while a non-optional one is missing.

        A kubelet does not start a pod's containers until every volume is set up: the pod
        stays Pending (waiting, ContainerCreating) and the mount is retried (here: each tick).
        ``listed``: this tick's ConfigMaps and Secrets (read from the API when not given).
        """
        files: dict[Path, bytes] = {}
        missing: list[str] = []
        for volume in pod.volume_specs:
            found = await self._volume_files(pod, volume, listed)
            if isinstance(found, str):
                missing.append(found)
            elif found is not None:
                files.update(found)
        if missing:
            message = "; ".join(missing)
            if message != pod.mount_failure:
                pod.mount_failure = message
                log.info("pod %s: waiting for volumes: %s", pod.name, message)
                await self._event(pod, "FailedMount", message)
            return False
        for path, data in files.items():
            _write_atomic(path, data)
        pod.mounted_files = files
        pod.mounted = True
        pod.mount_failure = ""
        return True

    async def _volume_files(
        self, pod: PodProc, volume: dict, listed: dict[str, list[dict]] | None
    ) -> dict[Path, bytes] | str | None:
        """A ConfigMap or Secret volume's files (host path -> bytes), a reason it cannot be
        mounted yet, or None for other kinds of volume."""
        if "configMap" in volume:
            source, resource, kind = volume["configMap"], "v1/configmaps", "configmap"
            object_name = source.get("name", "")
        elif "secret" in volume:
            source, resource, kind = volume["secret"], "v1/secrets", "secret"
            object_name = source.get("secretName", "")
        else:
            return None
        plural = resource.rsplit("/", 1)[1]
        if listed is not None and resource in listed:
            obj = next(
                (
                    o
                    for o in listed[resource]
                    if o["metadata"].get("namespace") == pod.namespace
                    and o["metadata"].get("name") == object_name
                ),
                None,
            )
        else:
            obj = await self._req(
                "GET", f"/api/v1/namespaces/{pod.namespace}/{plural}/{object_name}", ok404=True
            )
        optional = bool(source.get("optional"))
        if obj is None:
            if optional:
                return {}
            return (
                f'MountVolume.SetUp failed for volume "{volume["name"]}" : {kind} "{object_name}" not found'
            )
        if kind == "configmap":
            data = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        else:
            data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
        directory = pod.volumes[volume["name"]][0]
        out: dict[Path, bytes] = {}
        for item in items:
            if item["key"] not in data:
                if optional:
                    continue
                return (
                    f'MountVolume.SetUp failed for volume "{volume["name"]}" : {kind} "{object_name}" has no key '
                    f'"{item["key"]}"'
                )
            out[directory / item["path"]] = data[item["key"]]
        return out

    async def _refresh_volumes(self, listed: dict[str, list[dict]]) -> None:
        """Mounted ConfigMap / Secret files follow their object's changes (atomic replacement).

        A deleted object leaves the last files in place, as a kubelet does. With
        ``configmap_sync_s`` set, files are refreshed only that often.
        """
        now = time.monotonic()
        if self.configmap_sync_s and now - self._volumes_synced < self.configmap_sync_s:
            return
        self._volumes_synced = now
        for pod in list(self.pods.values()):
            if not pod.mounted or pod.terminating:
                continue
            for volume in pod.volume_specs:
                found = await self._volume_files(pod, volume, listed)
                if not isinstance(found, dict):
                    continue
                directory = pod.volumes[volume["name"]][0]
                for path, data in found.items():
                    if pod.mounted_files.get(path) != data:
                        _write_atomic(path, data)
                        pod.mounted_files[path] = data
                for path in [p for p in pod.mounted_files if p.parent == directory and p not in found]:
                    path.unlink(missing_ok=True)  # a key the object no longer has
                    del pod.mounted_files[path]

    async def _event(self, pod: PodProc, reason: str, message: str) -> None:
        """A Warning event on the pod, as the kubelet records one."""
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{pod.name}.", "namespace": pod.namespace},
            "involvedObject": {
                "kind": "Pod",
                "name": pod.name,
                "namespace": pod.namespace,
                "apiVersion": "v1",
            },
            "reason": reason,
            "message": message,
            "type": "Warning",
            "source": {"component": "kubelet"},
            "firstTimestamp": _now(),
            "lastTimestamp": _now(),
            "count": 1,
        }
        with contextlib.suppress(RuntimeError, aiohttp.ClientError):
            await self._req("POST", f"/api/v1/namespaces/{pod.namespace}/events", body)

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
        if pod.exit_code is not None:
            main_state: dict = {
                "terminated": {
                    "exitCode": pod.exit_code,
                    "reason": "Completed" if pod.exit_code == 0 else "Error",
                }
            }
        elif pod.process is not None:
            main_state = {"running": {}}
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
        await asyncio.gather(
            *(self._probe(p) for p in list(self.pods.values()) if not p.deleted or p.terminating)
        )

    async def _probe(self, pod: PodProc) -> None:
        assert self._session is not None
        if pod.terminating:
            # Still probed (the runtime answers 503 once it drains); never restarted.
            if pod.process is None or pod.process.returncode is not None or pod.exit_code is not None:
                return
        elif not pod.mounted:
            if await self._mount(pod):
                await self._advance(pod)
            return
        elif not pod.initialized:
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
        ok, why = False, ""
        try:
            async with self._session.get(
                f"http://{pod.ip}:{pod.port}/ready", timeout=aiohttp.ClientTimeout(total=pod.probe_timeout_s)
            ) as resp:
                ok = resp.status == 200
                why = "" if ok else f"{resp.status} {(await resp.text())[:200]}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        pod.probe_failures = 0 if ok else pod.probe_failures + 1
        if ok and not pod.ready:
            log.info("pod %s: ready", pod.name)
            await self._set_ready(pod, True)  # successThreshold 1
        elif pod.ready and pod.probe_failures >= pod.probe_failure_threshold:
            log.warning("pod %s: not ready after %d failed probes (%s)", pod.name, pod.probe_failures, why)
            pod.unready_log.append(f"{_now()} {why}")
            await self._set_ready(pod, False)

    async def _delete_pod(self, pod: PodProc) -> None:
        """Delete a pod through the API, as a ReplicaSet does: gracefully (see ``_terminate_gracefully``)."""
        pod.deleted = True
        body = await self._req("DELETE", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}", ok404=True)
        if body is None or not (body.get("metadata") or {}).get("deletionTimestamp"):
            self._reap(pod)  # gone at once (forced): nothing to wait for
        else:
            self._begin_termination(pod, body)

    def _begin_termination(self, pod: PodProc, body: dict) -> None:
        """The pod got a deletionTimestamp: stop it gracefully, once."""
        if pod.terminating:
            return
        pod.deleted = True
        pod.terminating_since = time.monotonic()
        grace = body["metadata"].get("deletionGracePeriodSeconds")
        if grace is not None:
            pod.grace_s = float(grace)
        log.info("pod %s: terminating (grace %gs)", pod.name, pod.grace_s)
        task = asyncio.create_task(self._terminate_gracefully(pod), name=f"terminate {pod.name}")
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _terminate_gracefully(self, pod: PodProc) -> None:
        """preStop hook, SIGTERM, SIGKILL at the end of the grace period; then the Pod object goes."""
        assert pod.terminating_since is not None
        deadline = pod.terminating_since + pod.grace_s
        try:
            running = pod.process is not None and pod.process.returncode is None
            if running and pod.initialized:
                await self._pre_stop(pod, deadline)
            # The remaining grace period, at least 2 s, as a kubelet gives after the hook.
            remaining = max(deadline - time.monotonic(), 2.0)
            await asyncio.gather(
                *(self._stop_process(c.process, remaining) for c in pod.init if c.process is not None),
                self._stop_process(pod.process, remaining),
            )
            if pod.process is not None:
                pod.exit_code = pod.process.returncode
                log.info(
                    "pod %s: runtime exited with %s, %.1fs after the deletion",
                    pod.name,
                    pod.exit_code,
                    time.monotonic() - pod.terminating_since,
                )
            pod.ready = False
            await self._patch_status(pod)
        finally:
            self.pods.pop((pod.namespace, pod.name), None)
            with contextlib.suppress(RuntimeError, aiohttp.ClientError):
                await self._req(
                    "DELETE",
                    f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}?gracePeriodSeconds=0",
                    ok404=True,
                )

    async def _pre_stop(self, pod: PodProc, deadline: float) -> None:
        """Run the container's ``lifecycle.preStop`` hook within the grace period (+2 s)."""
        hook = (pod.container.get("lifecycle") or {}).get("preStop") or {}
        if not hook:
            return
        budget = max(deadline - time.monotonic(), 0.0) + PRESTOP_OVERRUN_S
        started = time.monotonic()
        try:
            if "sleep" in hook:
                await asyncio.wait_for(asyncio.sleep(float(hook["sleep"]["seconds"])), budget)
            elif "exec" in hook:
                hook_container = {
                    "command": hook["exec"]["command"],
                    "volumeMounts": pod.container.get("volumeMounts", []),
                }
                command = self._command(hook_container, pod.volumes, pod.ip)
                log_path = pod.workdir / "prestop.log"
                process = await self._spawn(command, pod.env, pod.workdir, log_path)
                try:
                    await asyncio.wait_for(process.wait(), budget)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()
                    raise
                if process.returncode != 0:
                    raise RuntimeError(f"exited with {process.returncode}: {_log_tail(log_path, 500)}")
            elif "httpGet" in hook:
                get = hook["httpGet"]
                port = get.get("port", pod.port)
                if isinstance(port, str):
                    port = next(
                        (c["containerPort"] for c in pod.container.get("ports", []) if c.get("name") == port),
                        pod.port,
                    )
                url = f"http://{get.get('host') or pod.ip}:{port}{get.get('path', '/')}"
                assert self._session is not None
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=budget)) as resp:
                    await resp.read()
            pod.prestop_log.append(f"preStop {sorted(hook)} done in {time.monotonic() - started:.1f}s")
        except Exception as exc:  # a failed hook is reported, and termination goes on
            pod.prestop_log.append(f"preStop {sorted(hook)} failed: {exc!r}")
            await self._event(pod, "FailedPreStopHook", f"PreStopHook failed: {exc!r}")

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
    async def _stop_process(process: asyncio.subprocess.Process | None, grace_s: float = 15) -> None:
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=grace_s)
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


SLOW_LOAD_DIR = Path(__file__).parent / "slowload"
SLOW_LOAD_VAR = "LORASERVE_E2E_MODEL_LOAD_DELAY_S"


def slow_load_env(delay_s: float, env: dict[str, str]) -> dict[str, str]:
    """Environment that makes a runtime process's model load take ``delay_s`` more seconds
    (a test-only ``sitecustomize`` on ``PYTHONPATH``; see ``slowload/sitecustomize.py``)."""
    path = os.pathsep.join(p for p in (str(SLOW_LOAD_DIR), env.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, SLOW_LOAD_VAR: f"{delay_s:g}"}


def _int_or_percent(value: int | str, total: int, *, round_up: bool) -> int:
    """A rolling update's maxSurge / maxUnavailable: an int, or a percentage of replicas."""
    if isinstance(value, str) and value.endswith("%"):
        scaled = int(value[:-1]) * total / 100
        return int(-(-scaled // 1)) if round_up else int(scaled)
    return int(value)


def _deletion_order(pods: list[PodProc]) -> list[PodProc]:
    """Which pods a ReplicaSet deletes first when it scales down: not ready ones, then the newest."""
    return sorted(pods, key=lambda p: (p.ready, -p.created_at))


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace a mounted file in one step (readers see the old or the new content, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


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
