"""The test kubelet of ``tests/e2e/kubelet.py``, as a Node of a real API server.

On the real control plane the Deployment and ReplicaSet controllers make the pods and the
garbage collector deletes orphans; what is left for this kubelet is a kubelet's own part:

* it registers a Node (Ready) and, since no scheduler runs, binds each unscheduled pod of
  the namespaces it serves to that Node through the ``binding`` subresource, as a
  scheduler does;
* it runs every pod bound to it as local processes, as the e2e kubelet does (volumes,
  init containers, probes, restarts), and writes the pod's status (``podIP`` on a loopback
  address of its own, ``hostIP``, conditions, container statuses named after the spec);
* it honours graceful deletion (preStop, SIGTERM, the grace period, then the final
  ``gracePeriodSeconds=0`` delete) for pods deleted by anyone: a test, a ReplicaSet
  scaling down, the garbage collector.

It talks to the API through ``kubectl proxy`` (plain HTTP on loopback, the admin's rights),
as the e2e kubelet talks to its stand-in.
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

E2E = Path(__file__).resolve().parents[1] / "e2e"


def _load_e2e(name: str) -> Any:
    """Import ``tests/e2e/<name>.py`` under the private name tests/e2e gives it."""
    module_name = f"_loraserve_e2e_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, E2E / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


base = _load_e2e("kubelet")
NODE = "stand-in"


@dataclass
class NodeKubelet(base.Kubelet):
    """Runs the pods of ``namespaces`` on the Node ``node``; start with :meth:`start`."""

    namespaces: tuple[str, ...] = ()
    node: str = NODE
    bound: list[str] = field(default_factory=list)  # pods this kubelet bound, in order
    start_times: dict[str, str] = field(default_factory=dict)  # status.startTime, by pod

    async def start(self) -> None:
        await super().start()
        await self._register_node()

    async def _register_node(self) -> None:
        existing = await self._req("GET", f"/api/v1/nodes/{self.node}", ok404=True)
        if existing is None:
            await self._req(
                "POST",
                "/api/v1/nodes",
                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node}}},
            )
        capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}
        status = {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.node}],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "test kubelet is posting ready status",
                    "lastHeartbeatTime": base._now(),
                    "lastTransitionTime": base._now(),
                }
            ],
        }
        await self._req("PATCH", f"/api/v1/nodes/{self.node}/status", {"status": status})

    # ------------------------------------------------------------------ the loop

    async def _tick(self) -> None:
        api_pods = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): p
            for ns in self.namespaces
            for p in await self._list(f"/api/v1/namespaces/{ns}", "pods")
        }
        for key, pod in list(self.pods.items()):
            body = api_pods.get(key)
            if body is None:
                if not pod.terminating:
                    pod.deleted = True  # removed outright (grace 0): killed
                    self._reap(pod)
            elif body["metadata"].get("deletionTimestamp"):
                self._begin_termination(pod, body)
        for key, body in api_pods.items():
            if key in self.pods or body["metadata"].get("deletionTimestamp"):
                continue
            node = body["spec"].get("nodeName")
            if node and node != self.node:
                continue
            if body["metadata"]["name"] in self.history:
                continue  # ran here and ended (its object is on its way out)
            if not node:
                await self._bind(body)
            await self._adopt(body)
        listed = {
            resource: [o for ns in self.namespaces for o in await self._list(f"/api/v1/namespaces/{ns}", resource.split("/")[1])]
            for resource in ("v1/secrets", "v1/configmaps")
        }
        await self._refresh_volumes(listed)
        await self._probe_all()

    async def _bind(self, body: dict) -> None:
        meta = body["metadata"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
        }
        await self._req("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding", binding)
        self.bound.append(meta["name"])

    async def _adopt(self, body: dict) -> base.PodProc:
        """Start running a pod the ReplicaSet controller made (the e2e kubelet's ``_create_pod``
        less the pod's creation)."""
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        labels = meta.get("labels") or {}
        thash = labels.get("pod-template-hash", "")
        owner = next((r["name"] for r in meta.get("ownerReferences") or [] if r.get("controller")), name)
        deployment = owner[: -len(thash) - 1] if thash and owner.endswith("-" + thash) else owner
        ip = self._address()
        workdir = self.root / "pods" / name
        workdir.mkdir(parents=True, exist_ok=True)
        pod_spec = json.loads(json.dumps(body["spec"]))
        container = pod_spec["containers"][0]
        port = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == "http"), 8000)
        volumes = self._volume_paths(pod_spec, workdir)
        command = self._command(container, volumes, ip)
        env = await self._env(namespace, name, container)
        pod = base.PodProc(namespace, name, deployment, thash, ip, port, workdir, command, env)
        pod.started_at = time.monotonic()
        pod.container, pod.volumes = container, volumes
        pod.volume_specs = list(pod_spec.get("volumes", []))
        pod.grace_s = float(pod_spec.get("terminationGracePeriodSeconds", base.DEFAULT_GRACE_S))
        pod.init = [
            base.InitContainer(
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
        pod.pending_status = False
        self.pods[(namespace, name)] = pod
        self.history[name] = pod
        await self._patch_status(pod)
        if await self._mount(pod):
            await self._advance(pod)
        return pod

    def _status(self, pod: base.PodProc) -> dict:
        """The e2e kubelet's status, plus what a real API server and its clients expect."""
        status = super()._status(pod)
        status["hostIP"] = "127.0.0.1"
        status["hostIPs"] = [{"ip": "127.0.0.1"}]
        status["podIPs"] = [{"ip": pod.ip}]
        status["startTime"] = self.start_times.setdefault(pod.name, base._now())
        for entry in status["containerStatuses"]:
            entry["name"] = pod.container.get("name", entry["name"])
            entry["image"] = pod.container.get("image", "")
            entry["imageID"] = ""
            entry["started"] = pod.process is not None
        for condition in status["conditions"]:
            condition.setdefault("lastTransitionTime", base._now())
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")["status"]
        status["conditions"].append({"type": "ContainersReady", "status": ready, "lastTransitionTime": base._now()})
        status["conditions"].append({"type": "PodScheduled", "status": "True", "lastTransitionTime": base._now()})
        return status


def fresh_net() -> tuple[int, int]:
    """A random 127.a.b.0/24 for one kubelet's pod addresses (clear of the Service range)."""
    return random.randint(2, 199), random.randint(2, 250)
