"""Desired state of a LoRAServe (pure): valid objects, the pod's command line, the config hash."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from loraserve.operator import desired as ds
from loraserve.operator.specs import parse_loraserve_spec
from loraserve.operator.translate import to_runtime_config
from loraserve.runtime import cli

REPO = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.28", kubernetes_validate.utils.latest_version())
"""The oldest Kubernetes the chart supports well, and the newest the validator knows."""
IDENTITY = ds.ServeIdentity(name="llama", namespace="ml", uid="0b1c5b0e-5d1e-4a53-9a51-1f0c8d1c0a11")
SETTINGS = ds.DesiredSettings(image="registry.example/loraserve:1.2.3", extra_labels={"team": "ml"})

BASE = {
    "model": {"source": "pvc://models/llama-3-8b"},
    "storage": {"models": {"type": "PersistentVolumeClaim", "claimName": "models", "readOnly": True}},
    "replicas": 2,
    "gpus": 1,
}

SPECS = {
    "minimal": BASE,
    "remote-source-hosts": {**BASE, "runtime": {"remoteSourceHosts": ["artifacts.example.com", "*.hf.example"]}},
    "eagle3-hf": {
        "model": {"source": "hf://meta-llama/Llama-3.1-8B-Instruct@5206a32"},
        "speculative": {
            "algorithm": "EAGLE3",
            "draftModel": {"source": "hf://yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"},
            "numSteps": 3,
            "numDraftTokens": 4,
        },
        "runtime": {
            "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]
        },
        "gpus": 2,
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
        "scheduling": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"loraserve.io/serve": "llama"}},
                            },
                        }
                    ]
                }
            },
        },
        "storage": {"models": {"size": "200Gi"}, "adapters": {"size": "20Gi"}},
        "service": {"type": "LoadBalancer", "port": 443},
    },
    "eagle-token-map": {
        "model": {"source": "pvc://models/llama-3-8b"},
        "speculative": {
            "algorithm": "EAGLE",
            "draftModel": {"source": "pvc://models/eagle-llama-3-8b", "tokenMap": "freq_32768.pt"},
            "numSteps": 5,
        },
        "storage": {"models": {"type": "PersistentVolumeClaim", "claimName": "models", "readOnly": True}},
    },
    "eagle-tree-paged": {
        "model": {"source": "pvc://models/llama-3-8b"},
        "speculative": {
            "algorithm": "EAGLE",
            "draftModel": {"source": "pvc://models/eagle-llama-3-8b"},
            "numSteps": 5,
            "topK": 4,
            "numDraftTokens": 16,
            "treeMaxBatchSize": 4,
        },
        "runtime": {"attentionBackend": "triton"},
        "storage": {"models": {"type": "PersistentVolumeClaim", "claimName": "models", "readOnly": True}},
    },
    "remote-https-s3": {
        "model": {"source": "https://models.example.com/llama-3.1-8b/model.tar.gz"},
        "speculative": {
            "algorithm": "STANDALONE",
            "draftModel": {"source": "s3://acme-models/drafts/llama-3.2-1b/"},
            "numSteps": 3,
            "numDraftTokens": 4,
        },
        "runtime": {
            "env": [
                {"name": "AWS_ENDPOINT_URL", "value": "https://minio.storage.svc:9000"},
                {"name": "AWS_REGION", "value": "eu-central-1"},
                {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "id"}}},
                {
                    "name": "AWS_SECRET_ACCESS_KEY",
                    "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}},
                },
                {"name": "SSL_CERT_FILE", "value": "/etc/ssl/private-ca/ca.pem"},
            ]
        },
        "storage": {
            "models": {"type": "PersistentVolumeClaim", "claimName": "model-cache", "mountPath": "/data"}
        },
    },
    "ngram-cpu": {
        "model": {"source": "/opt/models/qwen"},
        "speculative": {
            "algorithm": "NGRAM",
            "numSteps": 4,
            "ngram": {"minMatch": 2, "maxMatch": 5},
            "disableBatchSize": 16,
            "autoDisable": True,
        },
        "gpus": 0,
        "replicas": 1,
        "adminTokenSecretName": "my-admin-token",
        "runtime": {
            "extraArgs": ["--log-level", "DEBUG"],
            "image": "mirror.local/ls:dev",
            "imagePullPolicy": "Always",
        },
    },
}


def _objects(spec_raw: dict) -> tuple[ds.DesiredServe, list[dict]]:
    spec = parse_loraserve_spec(copy.deepcopy(spec_raw))
    config = to_runtime_config(spec)
    assert ds.problems(spec, config) == []
    plan = ds.desired_serve(IDENTITY, spec, config, SETTINGS)
    objects = [plan.deployment, plan.service, plan.pdb]
    if plan.catalog is not None:
        objects.append(plan.catalog)
    if plan.token_secret_owned:
        objects.append(ds.admin_token_secret(IDENTITY, plan.token_secret_name, "s3cr3t", SETTINGS))
    return plan, objects


def _example_specs() -> list[tuple[str, dict]]:
    found = []
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "LoRAServe":
                found.append((path.name, doc["spec"]))
    return found


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_object_is_strictly_valid(name: str) -> None:
    _, objects = _objects(SPECS[name])
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("example,spec", _example_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_example_serves_give_valid_objects(example: str, spec: dict) -> None:
    _, objects = _objects(spec)
    for obj in objects:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def test_pod_is_locked_down_and_probed() -> None:
    plan, _ = _objects(SPECS["eagle3-hf"])
    pod = plan.deployment["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == ds.RUNTIME_UID
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for container in [*pod["containers"], *pod.get("initContainers", [])]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
    runtime = pod["containers"][0]
    assert runtime["command"] == ["loraserve-runtime"]
    assert runtime["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert runtime["livenessProbe"]["httpGet"]["path"] == "/health"
    assert runtime["startupProbe"]["httpGet"]["path"] == "/health"
    assert runtime["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert runtime["resources"]["requests"]["memory"] == "64Gi"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert volumes["admin-token"]["secret"]["secretName"] == "llama-admin-token"
    mounts = {m["mountPath"] for m in runtime["volumeMounts"]}
    assert {"/tmp", "/cache", "/dev/shm", ds.ADMIN_TOKEN_DIR, "/models", "/adapters"} <= mounts
    assert runtime["args"][runtime["args"].index("--admin-token-file") + 1] == ds.ADMIN_TOKEN_FILE
    # hf:// model and draft are fetched by init containers into the models volume.
    fetch = {c["name"]: c for c in pod["initContainers"]}
    assert set(fetch) == {"model-fetch", "draft-fetch"}
    assert fetch["model-fetch"]["command"][:3] == ["hf", "download", "meta-llama/Llama-3.1-8B-Instruct"]
    assert "5206a32" in fetch["model-fetch"]["command"]
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in fetch["model-fetch"]["env"]


def test_remote_models_fetched_by_init() -> None:
    """https:// and s3:// model and draft sources run `loraserve-fetch SOURCE DEST` before the
    runtime starts, with the user's env (secrets included) and the models volume writable;
    the runtime then reads the very directories the fetch wrote."""
    plan, _ = _objects(SPECS["remote-https-s3"])
    pod = plan.deployment["spec"]["template"]["spec"]
    fetch = {c["name"]: c for c in pod["initContainers"]}
    assert list(fetch) == ["model-fetch", "draft-fetch"]
    model_dest = "/data/https/models.example.com/llama-3.1-8b/model.tar.gz"
    draft_dest = "/data/s3/acme-models/drafts/llama-3.2-1b/"
    assert fetch["model-fetch"]["command"] == [
        "loraserve-fetch",
        "https://models.example.com/llama-3.1-8b/model.tar.gz",
        model_dest,
    ]
    assert fetch["draft-fetch"]["command"] == [
        "loraserve-fetch",
        "s3://acme-models/drafts/llama-3.2-1b/",
        draft_dest,
    ]
    user_env = SPECS["remote-https-s3"]["runtime"]["env"]
    runtime = pod["containers"][0]
    for container in fetch.values():
        assert container["env"] == user_env, "AWS_* and TLS settings reach the fetch, secrets by reference"
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError", "a failed fetch says why"
        assert container["image"] == SETTINGS.image
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["models"] == {"name": "models", "mountPath": "/data", "readOnly": False}
        assert {"tmp", "cache"} <= set(mounts)
    args = runtime["args"]
    assert args[args.index("--model") + 1] == model_dest
    assert args[args.index("--draft-model") + 1] == draft_dest
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": False}


def test_local_sources_need_no_init_container() -> None:
    plan, _ = _objects(SPECS["minimal"])
    assert "initContainers" not in plan.deployment["spec"]["template"]["spec"]


def test_owner_refs_and_labels() -> None:
    """Owner references and labels on everything."""
    plan, objects = _objects(SPECS["minimal"])
    for obj in objects:
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [ds.owner_reference(IDENTITY)]
        assert meta["ownerReferences"][0]["controller"] is True
        labels = meta["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "loraserve-operator"
        assert labels["app.kubernetes.io/instance"] == "llama" and labels["team"] == "ml"
    selector = plan.deployment["spec"]["selector"]["matchLabels"]
    template_labels = plan.deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert plan.service["spec"]["selector"] == selector == plan.pdb["spec"]["selector"]["matchLabels"]
    assert plan.selector == ",".join(f"{k}={v}" for k, v in selector.items())
    ports = {p["name"]: p for p in plan.service["spec"]["ports"]}
    assert set(ports) == {"http", "metrics"} and all(p["targetPort"] == "http" for p in ports.values())


def test_user_admin_secret_used() -> None:
    """User named admin secret is used not generated."""
    plan, _ = _objects(SPECS["ngram-cpu"])
    assert plan.token_secret_name == "my-admin-token" and not plan.token_secret_owned
    pod = plan.deployment["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(pod["containers"][0]["resources"])
    assert pod["containers"][0]["image"] == "mirror.local/ls:dev"
    assert pod["containers"][0]["args"][-2:] == ["--log-level", "DEBUG"], "extra args come last"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_command_line_round_trips(name: str) -> None:
    """The runtime's own parser reads the pod's flags back into exactly the translated config."""
    spec = parse_loraserve_spec(copy.deepcopy(SPECS[name]))
    config = to_runtime_config(spec)
    args = cli.build_parser().parse_args(ds.runtime_args(config))
    parsed = cli.config_from_args(args, env={})
    assert parsed.to_dict() == config.to_dict()


def test_runtime_flags_confine_pod() -> None:
    """The operator always passes the mounted volumes and the adapter cache as the runtime's
    allowed local roots, and the serve's remote source hosts."""
    config = to_runtime_config(parse_loraserve_spec(copy.deepcopy(SPECS["remote-source-hosts"])))
    args = ds.runtime_args(config)
    at = args.index("--allowed-local-roots")
    assert args[at + 1 : at + 3] == ["/models", "/adapters"] and config.server.adapter_cache_dir == "/adapters/.cache"
    at = args.index("--remote-source-hosts")
    assert args[at + 1 : at + 3] == ["artifacts.example.com", "*.hf.example"]


RELEVANT = {
    "lora.maxRank": lambda s: s.setdefault("lora", {}).update(maxRank=128),
    "speculative.algorithm": lambda s: s.setdefault("speculative", {}).update(algorithm="NGRAM"),
    "speculative.disableBatchSize": lambda s: s.setdefault("speculative", {}).update(disableBatchSize=16),
    "speculative.autoDisable": lambda s: s.setdefault("speculative", {}).update(autoDisable=True),
    "speculative.treeMaxBatchSize": lambda s: s.setdefault("speculative", {}).update(treeMaxBatchSize=2),
    "runtime.attentionBackend": lambda s: s.setdefault("runtime", {}).update(attentionBackend="triton"),
    "model.source": lambda s: s["model"].update(source="pvc://models/llama-3-70b"),
    "model.dtype": lambda s: s["model"].update(dtype="float16"),
    "runtime.maxRunningRequests": lambda s: s.setdefault("runtime", {}).update(maxRunningRequests=7),
    "runtime.image": lambda s: s.setdefault("runtime", {}).update(image="other:1"),
    "runtime.env": lambda s: s.setdefault("runtime", {}).update(env=[{"name": "X", "value": "1"}]),
    "runtime.extraArgs": lambda s: s.setdefault("runtime", {}).update(extraArgs=["--log-level", "DEBUG"]),
    "gpus": lambda s: s.update(gpus=4),
    "resources": lambda s: s.update(resources={"limits": {"memory": "10Gi"}}),
    "storage.adapters": lambda s: s.setdefault("storage", {}).update(adapters={"size": "5Gi"}),
    "adminTokenSecretName": lambda s: s.update(adminTokenSecretName="t"),
}
IRRELEVANT = {
    "replicas": lambda s: s.update(replicas=9),
    "service": lambda s: s.update(service={"type": "NodePort", "port": 9000}),
    "scheduling.nodeSelector": lambda s: s.update(scheduling={"nodeSelector": {"pool": "a"}}),
    "scheduling.tolerations": lambda s: s.update(
        scheduling={"tolerations": [{"key": "k", "operator": "Exists"}]}
    ),
}


def _hash(spec_raw: dict) -> str:
    plan, _ = _objects(spec_raw)
    template_hash = plan.deployment["spec"]["template"]["metadata"]["annotations"][ds.CONFIG_HASH_ANNOTATION]
    assert template_hash == plan.config_hash
    return plan.config_hash


@pytest.mark.parametrize("field", sorted(RELEVANT))
def test_config_hash_tracks_runtime_fields(field: str) -> None:
    """Config hash changes with runtime relevant fields."""
    changed = copy.deepcopy(BASE)
    RELEVANT[field](changed)
    assert _hash(changed) != _hash(BASE)


@pytest.mark.parametrize("field", sorted(IRRELEVANT))
def test_config_hash_ignores_other_fields(field: str) -> None:
    changed = copy.deepcopy(BASE)
    IRRELEVANT[field](changed)
    assert _hash(changed) == _hash(BASE)


def test_desired_state_is_a_pure_function() -> None:
    first, _ = _objects(SPECS["eagle3-hf"])
    second, _ = _objects(SPECS["eagle3-hf"])
    assert first.deployment == second.deployment and first.service == second.service


@pytest.mark.parametrize(
    "patch,needle",
    [
        (
            {"model": {"source": "pvc://elsewhere/llama"}},
            "spec.model.source: claim 'elsewhere' is not mounted",
        ),
        (
            {"model": {"source": "https://models.example/llama.tar"}},
            "spec.model.source: an https:// model is downloaded into the models volume, which is read-only",
        ),
        (
            {"model": {"source": "s3://bucket/llama"}},
            "spec.model.source: an s3:// model is downloaded into the models volume, which is read-only",
        ),
        (
            {
                "speculative": {
                    "algorithm": "STANDALONE",
                    "draftModel": {"source": "s3://bucket/draft"},
                    "numSteps": 3,
                    "numDraftTokens": 4,
                }
            },
            "spec.speculative.draftModel.source: an s3:// model is downloaded into the models volume",
        ),
        (
            {"model": {"source": "hf://org/m"}, "storage": {"models": {"readOnly": True}}},
            "the models volume, which is read-only",
        ),
        (
            {
                "storage": {
                    "models": {"type": "EmptyDir", "mountPath": "/data"},
                    "adapters": {"mountPath": "/data"},
                }
            },
            "the same path",
        ),
        (
            {"storage": {"models": {"type": "EmptyDir", "mountPath": "/tmp"}}},
            "spec.storage.models.mountPath: /tmp is used",
        ),
    ],
)
def test_unbuildable_specs_are_named_with_a_fix(patch: dict, needle: str) -> None:
    raw = copy.deepcopy(BASE)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            for sub, subvalue in value.items():
                if isinstance(subvalue, dict) and isinstance(raw[key].get(sub), dict):
                    raw[key][sub] = {**raw[key][sub], **subvalue}
                else:
                    raw[key][sub] = subvalue
        else:
            raw[key] = value
    spec = parse_loraserve_spec(raw)
    found = ds.problems(spec, to_runtime_config(spec))
    assert any(needle in p and "fix:" in p for p in found), found


@pytest.mark.parametrize("name", ["a" * 63, "b" * 64, "x" * 200, "9lives", "with.dots.in.it"])
def test_odd_names_give_valid_labels(name: str) -> None:
    """Long or odd names give valid labels and service names."""
    value = ds.label_value(name)
    assert len(value) <= 63 and value[-1].isalnum()
    service = ds.service_name(name)
    assert len(service) <= 63 and service[0].isalpha() and all(c.isalnum() or c == "-" for c in service)
    assert ds.label_value(name) == ds.label_value(name), "stable"
    assert len(ds.admin_secret_name(name, parse_loraserve_spec(BASE))) <= 253


def test_pods_mount_catalog_and_drain() -> None:
    """Pods mount the catalog and keep serving while endpoints drop them."""
    spec = parse_loraserve_spec(copy.deepcopy(SPECS["eagle3-hf"]))
    entries = ds.catalog_entries(
        spec.storage,
        [
            ("b", {"serve": "llama", "source": "s3://bucket/b", "sha256": "cd" * 32}),
            ("a", {"serve": "llama", "source": "https://host/a.tar.gz", "rank": 8, "pinned": True}),
            ("bad", {"serve": "llama", "source": "ftp://x"}),
        ],
    )
    assert [e.name for e in entries] == ["a", "b"]
    plan = ds.desired_serve(IDENTITY, spec, to_runtime_config(spec), SETTINGS, entries)
    assert json.loads(plan.catalog["data"]["catalog.json"]) == {
        "adapters": [
            {"name": "a", "source": "https://host/a.tar.gz", "rank": 8, "pinned": True},
            {"name": "b", "source": "s3://bucket/b", "sha256": "cd" * 32, "pinned": False},
        ]
    }
    pod = plan.deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "catalog")
    volume = next(v for v in pod["volumes"] if v["name"] == "catalog")
    assert volume["configMap"]["name"] == plan.catalog["metadata"]["name"] == "llama-adapters"
    catalog_file = container["args"][container["args"].index("--adapter-catalog") + 1]
    assert catalog_file == f"{mount['mountPath']}/{volume['configMap']['items'][0]['path']}"
    sleep = container["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and 0 < int(sleep[1]) < pod["terminationGracePeriodSeconds"]
    # The catalog's content is not part of the pod template: a new Adapter rolls nothing.
    other = ds.desired_serve(IDENTITY, spec, to_runtime_config(spec), SETTINGS, entries[:1])
    assert other.deployment == plan.deployment and other.catalog != plan.catalog


def test_runtime_port_comes_from_the_pod() -> None:
    plan, _ = _objects(BASE)
    pod = {"spec": plan.deployment["spec"]["template"]["spec"]}
    assert ds.runtime_port(pod) == plan.config.server.port
    pod["spec"]["containers"][0]["ports"][0]["containerPort"] = 18000
    assert ds.runtime_port(pod) == 18000
