"""The API as a real API server serves it: CRDs, the chart, the examples, admission.

What the CRD harness of ``tests/crds`` emulates (structural schemas, CEL, defaulting,
pruning) and what the webhook tests call directly, here goes through kube-apiserver: a
rule the API server compiles differently, a field it prunes, a webhook configuration that
never reaches the webhook or a verb the chart's RBAC lacks fails here.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from loraserve.runtime.contract.capabilities import CAPABILITIES
from loraserve.runtime.contract.config import SpecAlgorithm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VALID = sorted(EXAMPLES.glob("*.yaml"))
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))
NAMESPACE = "examples"


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _expectation(path: Path) -> tuple[str, str]:
    found = dict(re.findall(r"^#\s*expect-(rejected-by|message):\s*(.+)$", path.read_text(), re.MULTILINE))
    return found["rejected-by"], str(yaml.safe_load(found["message"]))


def _unavailable(obj: dict) -> bool:
    """A LoRAServe whose algorithm this runtime does not implement (the webhook refuses it)."""
    algorithm = SpecAlgorithm((obj["spec"].get("speculative") or {}).get("algorithm", "NONE"))
    return obj["kind"] == "LoRAServe" and not CAPABILITIES.implements(algorithm)


def _subset(given, stored, where: str = "spec") -> list[str]:
    """Paths of ``given`` that ``stored`` lacks or changed (a pruned or rewritten field)."""
    if isinstance(given, dict) and isinstance(stored, dict):
        return [p for k, v in given.items() for p in _subset(v, stored.get(k), f"{where}.{k}")]
    if isinstance(given, list) and isinstance(stored, list) and len(given) == len(stored):
        return [p for i, (a, b) in enumerate(zip(given, stored, strict=True)) for p in _subset(a, b, f"{where}[{i}]")]
    return [] if given == stored else [f"{where}: {given!r} stored as {stored!r}"]


@pytest.fixture(scope="module")
def examples_ns(control_plane, operator) -> str:
    control_plane.kubectl("create", "namespace", NAMESPACE)
    return NAMESPACE


def test_crds_accepted(control_plane):
    # Server-side dry run: structural schema, CEL compilation and cost limits, as installed.
    done = control_plane.kubectl("apply", "--dry-run=server", "-f", str(REPO / "crds"))
    assert "loraserves.loraserve.io" in done.stdout and "adapters.loraserve.io" in done.stdout


def test_chart_installs(control_plane, release):
    crds = {c["metadata"]["name"]: c for c in control_plane.get("crd")["items"]}
    for name in ("loraserves.loraserve.io", "adapters.loraserve.io"):
        conditions = {c["type"]: c["status"] for c in crds[name]["status"]["conditions"]}
        assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions
        assert conditions.get("NonStructuralSchema") != "True", conditions
    status = json.loads(control_plane.helm("status", release.name, "-n", release.namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    for kind in ("validatingwebhookconfigurations", "mutatingwebhookconfigurations"):
        hooks = control_plane.get(kind, "-l", f"app.kubernetes.io/instance={release.name}")["items"]
        assert hooks and all(h["clientConfig"].get("caBundle") for c in hooks for h in c["webhooks"])


def test_operator_sa_is_not_admin(control_plane, operator):
    # The operator's token has the chart's rights, not more: it cannot read Secrets cluster-wide
    # in kube-system nor delete Pods.
    def can(*args: str) -> str:
        done = control_plane.kubectl("auth", "can-i", *args, kubeconfig=operator.kubeconfig, check=False)
        return done.stdout.strip()

    assert can("delete", "pods", "-n", "default") == "no"
    assert can("create", "clusterroles") == "no"
    assert can("watch", "loraserves.loraserve.io", "-A") == "yes"


@pytest.fixture(scope="module")
def applied(control_plane, examples_ns) -> dict[str, object]:
    """``kubectl apply`` of each valid example, in order: path name -> the run's result.

    A serve naming its own admin-token Secret gets it first, as its user would create it.
    """
    for obj in map(_load, VALID):
        secret = obj["spec"].get("adminTokenSecretName") if obj["kind"] == "LoRAServe" else None
        if secret:
            control_plane.kubectl("create", "secret", "generic", secret, "-n", examples_ns, "--from-literal=token=t0k3n")
    return {
        path.name: control_plane.kubectl("apply", "-n", examples_ns, "-f", str(path), check=False) for path in VALID
    }


def test_examples_accepted(control_plane, applied, examples_ns):
    refused = {}
    for path in VALID:
        obj, done = _load(path), applied[path.name]
        if _unavailable(obj):
            # The capability table decides: the webhook refuses only for that reason.
            assert done.returncode != 0 and "not available in this runtime" in done.stderr, done.stderr
            refused[path.name] = done.stderr
            continue
        assert done.returncode == 0, f"{path.name}: {done.stderr}"
        stored = control_plane.get(obj["kind"].lower() + ".loraserve.io", obj["metadata"]["name"], "-n", examples_ns)
        assert _subset(obj["spec"], stored["spec"]) == [], f"{path.name}: fields pruned or changed on write"
    assert len(refused) < len(VALID) // 2, refused


def test_examples_reconciled_without_forbidden(control_plane, operator, applied, examples_ns):
    # Every applied serve is judged compatible and gets its children, within the chart's RBAC.
    serves = [o["metadata"]["name"] for o in map(_load, VALID) if o["kind"] == "LoRAServe" and not _unavailable(o)]
    children = ("deployment", "service", "poddisruptionbudget", "configmap", "secret")
    deadline = time.monotonic() + 120
    missing: list[str] = []
    while time.monotonic() < deadline:
        stored = {s["metadata"]["name"]: s for s in control_plane.get("loraserves.loraserve.io", "-n", examples_ns)["items"]}
        owned = {
            (o["kind"], r["name"])
            for o in control_plane.get(",".join(children), "-n", examples_ns)["items"]
            for r in o["metadata"].get("ownerReferences") or []
        }
        missing = [
            f"{name}: {(stored[name].get('status') or {}).get('conditions')}"
            for name in serves
            if not _reconciled(stored[name]) or ("Deployment", name) not in owned or ("Service", name) not in owned
        ]
        if not missing:
            break
        time.sleep(1)
    assert operator.forbidden() == []
    assert not missing, "not reconciled:\n" + "\n".join(missing)
    assert operator.pruned() == []
    # The API server's own record: no request refused, no field of a LoRAServe/Adapter pruned.
    assert control_plane.refused(operator.user) == []
    writes = [e for e in control_plane.audit(operator.user) if e.get("objectRef", {}).get("subresource") == "status"]
    assert writes, "the audit log holds the operator's status writes"
    assert control_plane.dropped(operator.user, "loraserve.io") == []


def _reconciled(serve: dict) -> bool:
    """The operator judged this generation compatible and wrote its status."""
    status = serve.get("status") or {}
    compatible = {c["type"]: c["status"] for c in status.get("conditions") or []}.get("Compatible")
    return status.get("observedGeneration") == serve["metadata"]["generation"] and compatible == "True"


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_example_refused(control_plane, applied, examples_ns, path):
    rejected_by, message = _expectation(path)
    done = control_plane.kubectl("apply", "-n", examples_ns, "-f", str(path), check=False)
    assert done.returncode != 0, f"{path.name} was accepted"
    error = " ".join(done.stderr.split())
    assert " ".join(message.split()) in error, error
    by_webhook = "admission webhook" in error and "denied the request" in error
    assert by_webhook == (rejected_by == "webhook"), error
