"""The Helm chart, through the real helm binary: lint, render, validate every object."""

from __future__ import annotations

import base64
import importlib.util
import subprocess
import sys
from pathlib import Path

import jsonschema
import kopf
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from cryptography import x509

from loraserve.operator import webhooks
from loraserve.operator.config import OperatorConfig
from loraserve.operator.reconcile.kube import HPAS, INFERENCE_POOLS, SCALED_OBJECTS

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "loraserve"
NS = "loraserve-system"
K8S_VERSIONS = ("1.28", kubernetes_validate.utils.latest_version())
"""The oldest Kubernetes the chart supports well, and the newest the validator knows."""

VALUES = {
    "default": [],
    "ha-clusterwide": ["--set", "replicaCount=2"],
    "ha-namespaced": ["--set", "replicaCount=3", "--set", "watch.namespaces={team-a,team-b}"],
    "cert-manager": ["--set", "webhook.certManager.enabled=true"],
    "cert-manager-issuer": [
        "--set",
        "webhook.certManager.enabled=true",
        "--set",
        "webhook.certManager.issuerRef.name=corp-ca",
        "--set",
        "webhook.certManager.issuerRef.kind=ClusterIssuer",
    ],
    "no-webhook": ["--set", "webhook.enabled=false"],
    "external-sa": [
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=ops",
        "--set",
        "rbac.create=false",
    ],
    "monitoring": [
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set",
        "monitoring.podMonitor.labels.release=prom",
    ],
    "monitoring-namespaced": [
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--set",
        "watch.namespaces={team-a,team-b}",
    ],
    "customised": [
        "--set",
        "image.tag=dev",
        "--set",
        "operator.runtimeImage=mirror.local/loraserve:1",
        "--set",
        "operator.extraLabels.team=ml",
        "--set",
        "operator.logLevel=debug",
        "--set",
        "nodeSelector.pool=system",
        "--set",
        "tolerations[0].key=dedicated",
        "--set",
        "tolerations[0].operator=Exists",
        "--set",
        "podAnnotations.example\\.com/owner=ml",
        "--set",
        "imagePullSecrets[0].name=regcred",
        "--set",
        "priorityClassName=system-cluster-critical",
    ],
}


MONITORING_API = ["--api-versions", "monitoring.coreos.com/v1"]
"""What `helm template` needs to see the Prometheus Operator's CRDs (`helm lint` has no such flag)."""
RENDER_FLAGS = {"monitoring": MONITORING_API, "monitoring-namespaced": MONITORING_API}


def _upstream():
    """tests/vendor/upstream_schema.py: validation against vendored upstream CRDs."""
    name = "_loraserve_upstream_schema"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "vendor" / "upstream_schema.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


def _crd_schema(objects: list[dict], kind: str) -> dict:
    crd = next(
        o for o in objects if o["kind"] == "CustomResourceDefinition" and o["spec"]["names"]["kind"] == kind
    )
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _operator_env(objects: list[dict]) -> dict[str, str]:
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_lint_strict(helm: Path, name: str) -> None:
    result = subprocess.run(
        [str(helm), "lint", "--strict", str(CHART), *VALUES[name]], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_rendered_object_is_valid(render, name: str) -> None:
    objects = render(*VALUES[name], *RENDER_FLAGS.get(name, []))
    kinds = _by_kind(objects)
    assert {"CustomResourceDefinition", "Deployment"} <= set(kinds)
    for obj in objects:
        group = obj["apiVersion"].split("/")[0]
        if group == "monitoring.coreos.com":
            # The Prometheus Operator's own CRD schema, vendored (tests/vendor/prometheus-operator).
            assert _upstream().validate(obj) == []
        elif group == "kopf.dev":
            # Custom resources: checked against the chart's own CRD schema.
            jsonschema.validate(obj, _crd_schema(objects, obj["kind"]))
        elif group == "cert-manager.io":
            # cert-manager's schemas are not available offline: check what the chart relies on.
            spec = obj["spec"]
            if obj["kind"] == "Certificate":
                assert (
                    spec["secretName"]
                    and spec["issuerRef"]["name"]
                    and spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
                )
            else:
                assert set(spec) & {"selfSigned", "ca"}
        else:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)


def test_webhook_configs_call_handlers(render) -> None:
    """Webhook configurations call the registered handlers."""
    objects = render()
    handlers = {
        h.id: h
        for h in kopf.get_default_registry()._webhooks.get_all_handlers()  # registered by the import above
    }
    expected = {
        "Validating": {webhooks.VALIDATE_LORASERVE: "loraserves", webhooks.VALIDATE_ADAPTER: "adapters"},
        "Mutating": {webhooks.MUTATE_LORASERVE: "loraserves", webhooks.MUTATE_ADAPTER: "adapters"},
    }
    for kind, paths in expected.items():
        config = next(o for o in objects if o["kind"] == f"{kind}WebhookConfiguration")
        seen = {}
        for hook in config["webhooks"]:
            service = hook["clientConfig"]["service"]
            assert service["namespace"] == NS and service["port"] == 443
            seen[service["path"].lstrip("/")] = hook["rules"][0]["resources"][0]
            assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
        assert seen == paths
        for handler_id in paths:
            assert handler_id in handlers, f"no kopf admission handler with id {handler_id!r}"


def test_generated_cert_valid_for_service(render) -> None:
    """Generated certificate is valid for the webhook service."""
    objects = render()
    secret = next(o for o in objects if o["kind"] == "Secret" and o["type"] == "kubernetes.io/tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    service = next(o for o in objects if o["kind"] == "Service")
    names = set(
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName
        )
    )
    assert f"{service['metadata']['name']}.{NS}.svc" in names
    cert.verify_directly_issued_by(ca)
    for config in (o for o in objects if o["kind"].endswith("WebhookConfiguration")):
        for hook in config["webhooks"]:
            assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    mounted = {
        v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v
    }
    assert secret["metadata"]["name"] in mounted


def test_cert_manager_issues_and_injects_ca(render) -> None:
    """Cert manager issues the mounted certificate and injects the CA."""
    objects = render(*VALUES["cert-manager"])
    certificate = next(o for o in objects if o["kind"] == "Certificate" and not o["spec"].get("isCA"))
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    mounted = {
        v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"] if "secret" in v
    }
    assert certificate["spec"]["secretName"] in mounted
    issuers = {o["metadata"]["name"] for o in objects if o["kind"] == "Issuer"}
    assert certificate["spec"]["issuerRef"]["name"] in issuers
    for config in (o for o in objects if o["kind"].endswith("WebhookConfiguration")):
        assert (
            config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
            == f"{NS}/{certificate['metadata']['name']}"
        )
        assert all("caBundle" not in hook["clientConfig"] for hook in config["webhooks"])
    assert not any(o["kind"] == "Secret" for o in objects), "cert-manager writes the Secret"
    given = render(*VALUES["cert-manager-issuer"])
    certificate = next(o for o in given if o["kind"] == "Certificate")
    assert certificate["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert not any(o["kind"] == "Issuer" for o in given)


@pytest.mark.parametrize("name", sorted(VALUES))
def test_chart_operator_settings_understood(render, name: str) -> None:
    """Operator settings in the chart are understood by the operator."""
    env = _operator_env(render(*VALUES[name]))
    config = OperatorConfig.from_env(env)  # raises, naming the variable, on anything it cannot read
    assert config.adapter_max_tries == 5 and config.adapter_backoff_base_s == 5.0
    assert config.liveness_endpoint == "http://0.0.0.0:8080/healthz"
    if config.webhook_enabled:
        server = webhooks.WebhookServerConfig.from_env(env)
        assert (
            server.port == 9443 and server.certfile.endswith("tls.crt") and server.keyfile.endswith("tls.key")
        )
    if name == "customised":
        assert config.runtime_image == "mirror.local/loraserve:1" and dict(config.extra_labels) == {
            "team": "ml"
        }
        assert config.log_level == "debug"


def test_peering_follows_replicas_and_scope(render) -> None:
    assert not [o for o in render() if o["apiVersion"].startswith("kopf.dev")]
    clusterwide = render(*VALUES["ha-clusterwide"])
    peering = [o for o in clusterwide if o["apiVersion"] == "kopf.dev/v1"]
    env = _operator_env(clusterwide)
    assert [(o["kind"], o["metadata"]["name"]) for o in peering] == [
        ("ClusterKopfPeering", env["LORASERVE_PEERING_NAME"])
    ]
    assert env["LORASERVE_PEERING_CLUSTERWIDE"] == "true"
    assert any(o["kind"] == "PodDisruptionBudget" for o in clusterwide)
    namespaced = render(*VALUES["ha-namespaced"])
    peering = [o for o in namespaced if o["apiVersion"] == "kopf.dev/v1"]
    assert sorted((o["kind"], o["metadata"]["namespace"]) for o in peering) == [
        ("KopfPeering", "team-a"),
        ("KopfPeering", "team-b"),
    ]
    assert OperatorConfig.from_env(_operator_env(namespaced)).namespaces == ("team-a", "team-b")


def _rules(obj: dict) -> list[tuple[str, str, frozenset[str]]]:
    return [
        (group, resource, frozenset(rule["verbs"]))
        for rule in obj["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    ]


@pytest.mark.parametrize("name", ["default", "ha-namespaced", "ha-clusterwide"])
def test_rbac_is_least_privilege(render, name: str) -> None:
    objects = render(*VALUES[name])
    roles = [o for o in objects if o["kind"] in ("Role", "ClusterRole")]
    assert roles
    for role in roles:
        for group, resource, verbs in _rules(role):
            assert "*" not in verbs and resource != "*" and group != "*"
            assert "deletecollection" not in verbs
            if resource not in DELETED_WHILE_THE_SERVE_LIVES:
                assert "delete" not in verbs, f"{resource}: owners are garbage-collected"
            if resource == "secrets":
                assert verbs == {"get", "create"}
            if resource == "pods":
                assert verbs <= {"get", "list", "watch"}
    cluster_role = next(o for o in roles if o["kind"] == "ClusterRole")
    granted = {(g, r) for g, r, _ in _rules(cluster_role)}
    if name == "ha-namespaced":
        assert ("loraserve.io", "loraserves") not in granted, (
            "namespaced mode grants nothing cluster-wide on serves"
        )
        assert sorted(o["metadata"]["namespace"] for o in roles if o["kind"] == "Role") == [
            "team-a",
            "team-b",
        ]
    else:
        assert ("loraserve.io", "loraserves") in granted and ("", "pods") in granted
    needed = {
        ("loraserve.io", "adapters/status"),
        ("apps", "deployments"),
        ("policy", "poddisruptionbudgets"),
        ("", "events"),
        ("", "configmaps"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("keda.sh", "scaledobjects"),
    }
    assert needed <= {(g, r) for role in roles for g, r, _ in _rules(role)}
    granted_verbs = {(g, r): v for role in roles for g, r, v in _rules(role)}
    for group, resource, plural in (
        ("inference.networking.k8s.io", "inferencepools", INFERENCE_POOLS),
        ("autoscaling", "horizontalpodautoscalers", HPAS),
        ("keda.sh", "scaledobjects", SCALED_OBJECTS),
    ):
        # What operator/reconcile/optional.py does with them: read, create, patch, delete.
        assert plural.api_version.split("/")[0] == group and plural.plural == resource
        assert granted_verbs[(group, resource)] == {"get", "create", "patch", "delete"}
    assert granted_verbs[("", "configmaps")] == {
        "get",
        "list",
        "watch",
        "create",
        "patch",
        "update",
        "delete",
    }


DELETED_WHILE_THE_SERVE_LIVES = {"configmaps", "inferencepools", "horizontalpodautoscalers", "scaledobjects"}
"""Owned objects the operator removes itself (the spec stopped asking for them); the rest are
garbage-collected with their LoRAServe."""


def _pod_monitors(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "PodMonitor"]


def test_pod_monitor_needs_switch_and_api(render) -> None:
    """Pod monitor needs the switch and the prometheus operator API."""
    assert _pod_monitors(render(*MONITORING_API)) == [], "off by default"
    assert _pod_monitors(render(*VALUES["monitoring"])) == [], "nothing without monitoring.coreos.com/v1"
    (monitor,) = _pod_monitors(render(*VALUES["monitoring"], *MONITORING_API))
    assert monitor["metadata"]["namespace"] == NS and monitor["metadata"]["labels"]["release"] == "prom"
    assert _upstream().validate(monitor) == []
    broken = {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [{"port": "http", "intervall": "1m"}]}}
    assert any("intervall" in p for p in _upstream().validate(broken)), "the check sees a mistyped field"


def test_pod_monitor_scrapes_runtime_pods(render) -> None:
    """Pod monitor scrapes the runtime pods the operator makes."""
    from loraserve.operator import autoscaling as asc
    from loraserve.operator import desired as ds
    from loraserve.operator.specs import parse_loraserve_spec
    from loraserve.operator.translate import to_runtime_config

    (monitor,) = _pod_monitors(render(*VALUES["monitoring"], *MONITORING_API))
    spec = parse_loraserve_spec({"model": {"source": "/models/m"}})
    serve = ds.ServeIdentity(name="llama", namespace="ml", uid="u")
    settings = ds.DesiredSettings(image="i", extra_labels={"team": "ml"})
    template = ds.desired_serve(serve, spec, to_runtime_config(spec), settings).deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (container,) = template["spec"]["containers"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]} and endpoint["path"] == "/metrics"
    # The label the KEDA query and the adapter rule select one serve by.
    assert monitor["spec"]["podTargetLabels"] == [ds.SERVE_LABEL]
    assert asc.prometheus_label(ds.SERVE_LABEL) == asc.PROMETHEUS_SERVE_LABEL
    assert labels[ds.SERVE_LABEL] == "llama"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (scoped,) = _pod_monitors(render(*VALUES["monitoring-namespaced"], *MONITORING_API))
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_operator_pod_is_locked_down(render) -> None:
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--set", "replicaCount=0"], "replicaCount"),
        (["--set", "webhook.failurePolicy=Sometimes"], "failurePolicy"),
        (["--set", "operator.adapterLoad.maxTries=0"], "maxTries"),
        (["--set", "watch.namespaces={Bad_Name}"], "namespaces"),
        (["--set", "surprise=1"], "surprise"),
        (["--set", "monitoring.podMonitor.interval=soon"], "interval"),
    ],
)
def test_bad_values_are_refused_naming_the_key(helm: Path, flags: list[str], needle: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "ls", str(CHART), *flags], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr


def test_values_file_documents_every_key() -> None:
    """Values file documents every top level key."""
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    assert set(values) == set(schema["properties"]), "values.yaml and values.schema.json list the same keys"
    lines = text.splitlines()
    for key in values:
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        start = index
        while start > 0 and lines[start - 1].startswith("#"):
            start -= 1
        assert start < index and lines[start].startswith("# --"), (
            f"values.yaml: document {key!r} in a '# --' comment"
        )
