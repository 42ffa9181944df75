"""A real Kubernetes control plane for the tests: etcd, kube-apiserver, kube-controller-manager.

The binaries are built from the Go module proxy by ``scripts/build_k8s.sh`` (``make k8s``)
into ``.cache/k8s/bin``; a missing binary fails the tests loudly, never skips them. Every
component listens on loopback only, on free ports, with its data in a temporary directory.

The API server runs with RBAC, the default admission plugins (webhooks included) and
service-account tokens signed by a key made here; the controller manager runs only the
controllers the operator relies on (Deployments, ReplicaSets, garbage collection, the HPA,
ServiceAccounts, namespaces). No scheduler, kubelet or kube-proxy runs: the test kubelet
(``kubelet.py`` here) binds pods to its Node and runs them as processes.

Service ClusterIPs are allocated from a loopback range (``SERVICE_CIDR``), so a process
listening on a Service's ClusterIP and port is reached by the API server exactly as an
in-cluster Service is (its admission webhooks, aggregated APIs), without kube-proxy.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trustme
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = REPO / ".cache" / "k8s" / "bin"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
HELM = REPO / ".tools" / "helm"
SERVICE_CIDR = "127.200.0.0/24"
"""ClusterIPs come from this loopback range: reachable from the API server without kube-proxy."""
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "horizontal-pod-autoscaler-controller",
    "serviceaccount-controller",
    "namespace-controller",
    "root-ca-certificate-publisher-controller",
)
START_TIMEOUT_S = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def binaries() -> dict[str, Path]:
    """The built control-plane binaries; fails with the command that builds them."""
    found = {name: BIN_DIR / name for name in BINARIES}
    missing = [name for name, path in found.items() if not os.access(path, os.X_OK)]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not built in {BIN_DIR}: run `make k8s` (scripts/build_k8s.sh builds "
            "them from the Go module proxy)"
        )
    return found


@dataclass
class Identity:
    """A client certificate and key (files), as a kubeconfig user."""

    cert: Path
    key: Path


@dataclass
class ControlPlane:
    """Start with :meth:`start`, stop with :meth:`stop`. ``url`` is the API server's address."""

    root: Path
    url: str = ""
    ca_file: Path = Path()
    admin_kubeconfig: Path = Path()
    proxy_url: str = ""
    """``kubectl proxy`` with the admin's credentials: plain HTTP on loopback, for the test
    kubelet and Service stand-ins (they speak HTTP without client certificates)."""
    bins: dict[str, Path] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _ca: trustme.CA | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.bins = binaries()
        self.root.mkdir(parents=True, exist_ok=True)
        pki = self.root / "pki"
        pki.mkdir(exist_ok=True)
        self._ca = trustme.CA(organization_name="loraserve-test")
        self.ca_file = pki / "ca.crt"
        self._ca.cert_pem.write_to_path(str(self.ca_file))
        serving = self._issue(pki, "apiserver", "127.0.0.1", "localhost", "kubernetes.default.svc")
        admin = self._issue(pki, "admin", "admin", common_name="admin", organization="system:masters")
        sa_key, sa_pub = _service_account_keys(pki)
        etcd_url = self._start_etcd()
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        self.admin_kubeconfig = self.write_kubeconfig("admin", admin)
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.ca_file}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                f"--cert-dir={pki}",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                f"--audit-policy-file={self._audit_policy(pki)}",
                f"--audit-log-path={self.root / 'audit.log'}",
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
                "--v=1",
            ],
        )
        self._wait_ready("kube-apiserver", self.url + "/readyz", admin)
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={self.admin_kubeconfig}",
                f"--authentication-kubeconfig={self.admin_kubeconfig}",
                f"--authorization-kubeconfig={self.admin_kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--controllers={','.join(CONTROLLERS)}",
                "--leader-elect=false",
                "--use-service-account-credentials=false",
                f"--root-ca-file={self.ca_file}",
                f"--service-account-private-key-file={sa_key}",
                "--horizontal-pod-autoscaler-sync-period=2s",
                "--horizontal-pod-autoscaler-downscale-stabilization=5s",
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                "--v=1",
            ],
        )
        self.proxy_url = self._start_proxy()

    def stop(self) -> None:
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    # ------------------------------------------------------------------ clients

    def write_kubeconfig(self, user: str, identity: Identity | None = None, *, token: str = "") -> Path:
        """A kubeconfig for this API server as ``user``: a client certificate or a bearer token."""
        credentials: dict[str, str] = {"token": token}
        if identity is not None:
            credentials = {"client-certificate": str(identity.cert), "client-key": str(identity.key)}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": user, "user": credentials}],
            "contexts": [{"name": user, "context": {"cluster": "test", "user": user}}],
            "current-context": user,
        }
        path = self.root / f"{user.replace(':', '-')}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def kubectl(
        self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl (admin unless ``kubeconfig``); ``check``: fail with its stderr."""
        command = [str(self.bins["kubectl"]), f"--kubeconfig={kubeconfig or self.admin_kubeconfig}", *args]
        done = subprocess.run(command, input=stdin, capture_output=True, text=True, timeout=120)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def get(self, *args: str) -> dict[str, Any]:
        """``kubectl get ... -o json`` as a dict."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the project's helm (``make helm``) against this API server as the admin."""
        if not os.access(HELM, os.X_OK):
            raise RuntimeError(f"{HELM} is missing: run `make helm`")
        env = {**os.environ, "HELM_CACHE_HOME": str(self.root / "helm" / "cache")}
        env["HELM_CONFIG_HOME"] = str(self.root / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.root / "helm" / "data")
        command = [str(HELM), f"--kubeconfig={self.admin_kubeconfig}", *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def service_account_kubeconfig(self, namespace: str, name: str) -> Path:
        """A kubeconfig with a token of ServiceAccount ``namespace/name`` (the TokenRequest API)."""
        token = self.kubectl("create", "token", name, "-n", namespace, "--duration=2h").stdout.strip()
        return self.write_kubeconfig(f"system:serviceaccount:{namespace}:{name}", token=token)

    def log(self, component: str) -> str:
        return (self.root / f"{component}.log").read_text(errors="replace")

    def audit(self, user: str) -> list[dict[str, Any]]:
        """The API server's audit events of ``user`` (a ServiceAccount's full name), oldest first."""
        path = self.root / "audit.log"
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [e for e in map(json.loads, lines) if e.get("user", {}).get("username") == user]

    def refused(self, user: str) -> list[str]:
        """Every request of ``user`` the API server refused for want of RBAC (403)."""
        return [
            f"{e['verb']} {e['requestURI']}: {e['responseStatus'].get('message', '')}"
            for e in self.audit(user)
            if e.get("responseStatus", {}).get("code") == 403
        ]

    def dropped(self, user: str, group: str) -> list[str]:
        """Fields ``user`` wrote to ``group``'s objects (merge patches, creates, updates) that the
        stored object does not hold as sent: pruned by the CRD's schema or rewritten."""
        out = []
        for event in self.audit(user):
            sent, stored = event.get("requestObject"), event.get("responseObject")
            if event.get("objectRef", {}).get("apiGroup") != group or event.get("responseStatus", {}).get("code", 0) >= 300:
                continue
            if isinstance(sent, dict) and isinstance(stored, dict) and stored.get("kind") != "Status":
                sent = {k: v for k, v in sent.items() if k not in ("apiVersion", "kind")}
                out += [f"{event['verb']} {event['requestURI']}: {d}" for d in _dropped(sent, stored, "")]
        return out

    # ------------------------------------------------------------------ internals

    def _issue(
        self, pki: Path, name: str, *identities: str, common_name: str | None = None, organization: str | None = None
    ) -> Identity:
        assert self._ca is not None
        cert = self._ca.issue_cert(
            *identities,
            common_name=common_name,
            organization_name=organization,
            not_after=datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=2),
        )
        identity = Identity(pki / f"{name}.crt", pki / f"{name}.key")
        cert.cert_chain_pems[0].write_to_path(str(identity.cert))
        cert.private_key_pem.write_to_path(str(identity.key))
        return identity

    def _audit_policy(self, pki: Path) -> Path:
        """Writes of ServiceAccounts with their bodies (the operator's), other SA requests'
        metadata (their verdicts), nothing of anyone else."""
        policy = {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [
                {
                    "level": "RequestResponse",
                    "userGroups": ["system:serviceaccounts"],
                    "verbs": ["create", "update", "patch"],
                },
                {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                {"level": "None"},
            ],
        }
        path = pki / "audit-policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        return path

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        handle = (self.root / f"{name}.log").open("wb")
        process = subprocess.Popen([str(self.bins[name]), *args], stdout=handle, stderr=subprocess.STDOUT, cwd=self.root)
        handle.close()
        self.processes[name] = process
        return process

    def _start_etcd(self) -> str:
        client, peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                "--name=test",
                f"--data-dir={self.root / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=test=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        url = f"http://127.0.0.1:{client}"
        self._wait_ready("etcd", url + "/health", None)
        return url

    def _start_proxy(self) -> str:
        port = free_port()
        self._spawn_kubectl_proxy(port)
        self._wait_ready("kubectl-proxy", f"http://127.0.0.1:{port}/readyz", None)
        return f"http://127.0.0.1:{port}"

    def _spawn_kubectl_proxy(self, port: int) -> None:
        handle = (self.root / "kubectl-proxy.log").open("wb")
        self.processes["kubectl-proxy"] = subprocess.Popen(
            [
                str(self.bins["kubectl"]),
                f"--kubeconfig={self.admin_kubeconfig}",
                "proxy",
                "--address=127.0.0.1",
                f"--port={port}",
                "--accept-hosts=^(localhost|127\\.0\\.0\\.1)$",
            ],
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        handle.close()

    def _wait_ready(self, name: str, url: str, identity: Identity | None) -> None:
        context = None
        if url.startswith("https"):
            context = ssl.create_default_context(cafile=str(self.ca_file))
            if identity is not None:
                context.load_cert_chain(str(identity.cert), str(identity.key))
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            process = self.processes[name]
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{self.log(name)[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5, context=context) as answer:
                    if answer.status == 200:
                        return
            except OSError as exc:
                last = str(exc)
            time.sleep(0.25)
        raise RuntimeError(f"{name} not ready at {url} within {START_TIMEOUT_S:g} s ({last}):\n{self.log(name)[-3000:]}")


def _dropped(sent: Any, stored: Any, path: str) -> list[str]:
    """Leaves of ``sent`` (a merge patch or an object) that ``stored`` lacks or holds otherwise."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [f"{path or '.'}: sent an object, stored {stored!r}"]
        # null in a merge patch deletes the key; metadata the API server owns is its own.
        skip = ("resourceVersion", "managedFields", "generation", "uid", "creationTimestamp") if path == ".metadata" else ()
        return [
            d
            for key, value in sent.items()
            if value is not None and key not in skip
            for d in _dropped(value, stored.get(key), f"{path}.{key}")
        ]
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        return [d for i, (a, b) in enumerate(zip(sent, stored, strict=True)) for d in _dropped(a, b, f"{path}[{i}]")]
    return [] if sent == stored else [f"{path}: sent {sent!r}, stored {stored!r}"]


def _service_account_keys(pki: Path) -> tuple[Path, Path]:
    """An RSA key pair that signs and verifies service-account tokens."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = pki / "sa.key", pki / "sa.pub"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public

