"""Fixtures of the cluster suite: a real control plane, the chart installed, the operator.

``control_plane``: etcd + kube-apiserver (RBAC, admission webhooks) + kube-controller-manager
built by ``make k8s`` (``controlplane.py``). A missing build fails every test here with the
command to run; it never skips.

``release``: ``helm install`` of ``charts/loraserve`` into ``loraserve-system``, as a user
installs it (CRDs, RBAC, webhook configurations and their generated TLS).

``operator``: the operator as a process (``python -m loraserve.operator``), configured as the
chart's Deployment configures its container (the same ``LORASERVE_*`` environment, the
webhook certificate from the chart's Secret) and logged in with a token of the chart's
ServiceAccount, so it has exactly the chart's RBAC. It serves its webhook on the webhook
Service's ClusterIP and port (ClusterIPs are loopback addresses here), so the API server
reaches it through the chart's own ``clientConfig.service``. The chart's operator pod
itself is never run (the test kubelet serves only the test namespaces).
"""

from __future__ import annotations

import base64
import importlib.util
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


def _load(name: str) -> Any:
    module_name = f"_loraserve_cluster_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


cp = _load("controlplane")
_load("kubelet")  # tests import these two as _loraserve_cluster_<name>
_load("metrics")
REPO = cp.REPO
RELEASE = "loraserve"
SYSTEM_NS = "loraserve-system"
TLS_DIR = "/etc/loraserve/webhook-tls"
"""Where the chart's Deployment mounts the webhook Secret (rewritten to a local directory)."""
FORBIDDEN = re.compile(r"APIForbiddenError|\b403 Forbidden\b|is forbidden: User ")
"""How a refused request shows in the operator's log: kopf's error, the operator's KubeError
(``<method> <path>: 403 Forbidden: ...``) or the API server's message itself."""


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory):
    plane = cp.ControlPlane(root=tmp_path_factory.mktemp("k8s"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()


@dataclass
class Release:
    """The installed chart: names the tests need."""

    name: str
    namespace: str
    service_account: str
    webhook_service: dict
    webhook_secret: dict
    deployment: dict


@pytest.fixture(scope="session")
def release(control_plane) -> Release:
    control_plane.helm(
        "install", RELEASE, str(REPO / "charts" / "loraserve"), "--namespace", SYSTEM_NS, "--create-namespace"
    )
    deployment = control_plane.get("deployment", RELEASE, "-n", SYSTEM_NS)
    pod_spec = deployment["spec"]["template"]["spec"]
    tls_volume = next(v for v in pod_spec["volumes"] if v["name"] == "webhook-tls")
    services = control_plane.get("services", "-n", SYSTEM_NS)["items"]
    (webhook_service,) = [s for s in services if s["metadata"]["name"].endswith("webhook")]
    return Release(
        name=RELEASE,
        namespace=SYSTEM_NS,
        service_account=pod_spec["serviceAccountName"],
        webhook_service=webhook_service,
        webhook_secret=control_plane.get("secret", tls_volume["secret"]["secretName"], "-n", SYSTEM_NS),
        deployment=deployment,
    )


@dataclass
class OperatorProcess:
    """The running operator; ``log_path`` is its log."""

    process: subprocess.Popen
    log_path: Path
    kubeconfig: Path
    user: str
    """The ServiceAccount's user name, as the API server's audit log records it."""
    env: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def forbidden(self) -> list[str]:
        """Every log line about a request the API server refused with 403 (missing RBAC)."""
        return [line for line in self.log().splitlines() if FORBIDDEN.search(line)]

    def pruned(self) -> list[str]:
        """kopf's warnings of a merge-patch the API server did not keep as sent (a field the
        CRD's schema prunes, a value it rewrites)."""
        return [line for line in self.log().splitlines() if "finished with inconsistencies" in line]


def operator_env(release: Release, tls_dir: Path, kubeconfig: Path, liveness_port: int) -> dict[str, str]:
    """The chart container's environment, as a kubelet would give it, for a local process."""
    (container,) = release.deployment["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORASERVE_") and k != "PYTHONPATH"}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"].replace(TLS_DIR, str(tls_dir))
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[item["name"]] = "loraserve-operator-test"
    service = release.webhook_service["spec"]
    env.update(
        KUBECONFIG=str(kubeconfig),
        PYTHONSAFEPATH="1",
        # No kube-proxy: the process listens where the Service is, its ClusterIP and port.
        LORASERVE_WEBHOOK_ADDR=service["clusterIP"],
        LORASERVE_WEBHOOK_PORT=str(service["ports"][0]["port"]),
        LORASERVE_LIVENESS_ENDPOINT=f"http://127.0.0.1:{liveness_port}/healthz",
    )
    return env


@pytest.fixture(scope="session")
def operator(control_plane, release: Release, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("operator")
    tls_dir = root / "webhook-tls"
    tls_dir.mkdir()
    for key, value in release.webhook_secret["data"].items():
        (tls_dir / key).write_bytes(base64.b64decode(value))
    kubeconfig = control_plane.service_account_kubeconfig(release.namespace, release.service_account)
    liveness = cp.free_port()
    env = operator_env(release, tls_dir, kubeconfig, liveness)
    log_path = root / "operator.log"
    with log_path.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "loraserve.operator"], env=env, cwd=root, stdout=handle, stderr=subprocess.STDOUT
        )
    user = f"system:serviceaccount:{release.namespace}:{release.service_account}"
    running = OperatorProcess(process, log_path, kubeconfig, user, env)
    try:
        _wait_operator(running, f"http://127.0.0.1:{liveness}/healthz", env, tls_dir / "ca.crt")
        yield running
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _wait_operator(running: OperatorProcess, health: str, env: dict[str, str], ca: Path) -> None:
    """Until kopf answers its liveness probe and the webhook answers TLS as the API server
    will reach it (the Service's DNS name, the chart's CA)."""
    host = env["LORASERVE_WEBHOOK_HOST"]
    context = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + 90
    last = ""
    while time.monotonic() < deadline:
        if running.process.poll() is not None:
            raise RuntimeError(f"the operator exited with {running.process.returncode}:\n{running.log()[-4000:]}")
        try:
            with urllib.request.urlopen(health, timeout=3) as answer:
                assert answer.status == 200
            addr = (env["LORASERVE_WEBHOOK_ADDR"], int(env["LORASERVE_WEBHOOK_PORT"]))
            with socket.create_connection(addr, timeout=3) as sock, context.wrap_socket(sock, server_hostname=host):
                return
        except (OSError, AssertionError) as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise RuntimeError(f"the operator was not ready within 90 s ({last}):\n{running.log()[-4000:]}")
