"""LoRAServe spec -> RuntimeConfig, and the policy's field paths back to the user's fields."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from loraserve.operator import specs, translate
from loraserve.runtime.contract import policy
from loraserve.runtime.contract.capabilities import Capabilities
from loraserve.runtime.contract.config import RaggedVerify, SpecAlgorithm

POLICY_SOURCE = "\n".join(p.read_text() for p in sorted(Path(policy.__file__).parent.glob("*.py")))
EVERYTHING = Capabilities(algorithms=frozenset(SpecAlgorithm), tree_algorithms=frozenset(SpecAlgorithm), dynamic_ragged_verify=True)
CONFIG_PATH = re.compile(
    r"\b(?:model|speculative|lora|scheduler|cuda_graph|server|parallel)\.[a-z_]+\b|\bdevice\b"
)


def _spec(**overrides) -> specs.LoRAServeSpec:
    raw = {"model": {"source": "/models/base"}}
    for dotted, value in overrides.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return specs.parse_loraserve_spec(raw)


def test_every_mapped_field_exists_in_the_crd(kit):
    schema = kit.crd_schema(kit.load_crd("LoRAServe"))
    for config_path, crd_path in translate.FIELD_PATHS.items():
        if not crd_path.startswith("spec."):
            continue  # fields of Adapters, named in words
        assert kit.schema_at(schema, crd_path) is not None, (config_path, crd_path)
    adapter_schema = kit.crd_schema(kit.load_crd("Adapter"))
    for crd_path in translate.ADAPTER_FIELD_PATHS.values():
        if crd_path != "metadata.name":
            assert kit.schema_at(adapter_schema, crd_path) is not None, crd_path


def test_policy_fields_map_to_user_fields():
    """Every field the policy names maps to a user field."""
    named = set(
        re.findall(
            r'"((?:model|speculative|lora|scheduler|cuda_graph|server|parallel)\.[a-z_]+|device)"',
            POLICY_SOURCE,
        )
    )
    named |= set(
        re.findall(
            r"\{((?:model|speculative|lora|scheduler|cuda_graph|server|parallel)\.[a-z_]+)\}", POLICY_SOURCE
        )
    )
    assert named, "the policy's field paths were not found"
    unmapped = sorted(p for p in named if p not in translate.FIELD_PATHS and p not in translate.FIXED_IN_POD)
    assert unmapped == []


# Each row: a spec field set to a non-default value, and the runtime field it must drive.
PERTURBATIONS = [
    ("model.dtype", "float16", "model.dtype", "float16"),
    ("model.contextLength", 4096, "model.context_length", 4096),
    ("model.servedName", "my-base", "model.served_name", "my-base"),
    ("model.architecture", "MistralForCausalLM", "model.architecture", "MistralForCausalLM"),
    ("model.revision", "v2", "model.revision", "v2"),
    ("speculative.algorithm", "NGRAM", "speculative.algorithm", SpecAlgorithm.NGRAM),
    ("speculative.numSteps", 6, "speculative.num_steps", 6),
    ("speculative.topK", 3, "speculative.top_k", 3),
    ("speculative.numDraftTokens", 9, "speculative.num_draft_tokens", 9),
    ("speculative.adaptive", True, "speculative.adaptive", True),
    ("speculative.raggedVerify", "dynamic", "speculative.ragged_verify", RaggedVerify.DYNAMIC),
    ("speculative.draftLoadFormat", "safetensors", "speculative.draft_load_format", "safetensors"),
    ("speculative.ngram.minMatch", 2, "speculative.ngram_min", 2),
    ("speculative.ngram.maxMatch", 7, "speculative.ngram_max", 7),
    ("speculative.disableBatchSize", 32, "speculative.disable_batch_size", 32),
    ("speculative.treeMaxBatchSize", 4, "speculative.tree_max_batch_size", 4),
    ("speculative.autoDisable", True, "speculative.auto_disable", True),
    ("speculative.draftLora.maxLoras", 4, "speculative.draft_max_loras", 4),
    ("speculative.draftLora.maxRank", 32, "speculative.draft_max_lora_rank", 32),
    ("lora.enabled", False, "lora.enabled", False),
    ("lora.maxLorasPerBatch", 3, "lora.max_loras_per_batch", 3),
    ("lora.maxLoadedLoras", 5, "lora.max_loaded_loras", 5),
    ("lora.maxRank", 128, "lora.max_rank", 128),
    ("lora.targetModules", ["q_proj", "lm_head"], "lora.target_modules", ("q_proj", "lm_head")),
    ("lora.backend", "torch", "lora.backend", "torch"),
    ("lora.overlapLoading", True, "lora.overlap_loading", True),
    ("lora.loadTimeoutSeconds", 5, "lora.load_timeout_s", 5.0),
    ("runtime.maxRunningRequests", 7, "scheduler.max_running_requests", 7),
    ("runtime.maxTotalTokens", 100000, "scheduler.max_total_tokens", 100000),
    ("runtime.chunkedPrefillSize", 512, "scheduler.chunked_prefill_size", 512),
    ("runtime.maxAdmissionDeferSteps", 0, "scheduler.max_admission_defer_steps", 0),
    ("runtime.maxPrefillTokens", 1024, "scheduler.max_prefill_tokens", 1024),
    ("runtime.overlapSchedule", True, "scheduler.overlap_schedule", True),
    ("runtime.twoBatchOverlap", True, "scheduler.two_batch_overlap", True),
    ("runtime.kvMemoryFraction", 0.5, "scheduler.kv_memory_fraction", 0.5),
    ("runtime.prefixCache", False, "scheduler.prefix_cache", False),
    ("runtime.attentionBackend", "triton", "attention_backend", "triton"),
    ("runtime.cudaGraph.enabled", True, "cuda_graph.enabled", True),
    ("runtime.cudaGraph.maxBatchSize", 16, "cuda_graph.max_bs", 16),
    ("runtime.cudaGraph.maxPrefillTokens", 128, "cuda_graph.max_prefill_tokens", 128),
    ("runtime.cudaGraph.warmupContext", 256, "cuda_graph.warmup_context", 256),
    ("gpus", 4, "parallel.tensor_parallel_size", 4),
    (
        "runtime.remoteSourceHosts",
        ["models.example.com", "*.s3.example.com"],
        "server.remote_source_hosts",
        ("models.example.com", "*.s3.example.com"),
    ),
]


@pytest.mark.parametrize(("spec_path", "value", "config_path", "expected"), PERTURBATIONS)
def test_spec_field_drives_its_runtime_field(spec_path, value, config_path, expected):
    def read(config):  # a section's field, or a top-level one (attention_backend)
        return functools.reduce(getattr, config_path.split("."), config)

    before = translate.to_runtime_config(_spec())
    after = translate.to_runtime_config(_spec(**{spec_path: value}))
    assert read(after) == expected
    assert read(before) != expected, "pick a value that differs from the default"
    assert translate.crd_path(config_path) == "spec." + spec_path


def test_every_mapped_spec_field_is_perturbed():
    perturbed = {config for _, _, config, _ in PERTURBATIONS}
    mapped = {
        c for c, crd in translate.FIELD_PATHS.items() if crd.startswith("spec.") and "Secret" not in crd
    }
    # model.path is the source (tested below); the draft's fields need a draft model (tested
    # below); device follows gpus; the admin token comes from a Secret.
    assert mapped - perturbed == {
        "model.path",
        "speculative.draft_model_path",
        "speculative.draft_model_architecture",
        "speculative.token_map",
        "device",
    }


def test_draft_model_fields_drive_settings():
    """The draft model fields drive the draft settings."""
    draft = {"source": "/models/eagle", "architecture": "LlamaForCausalLMEagle", "tokenMap": "maps/hot.json"}
    config = translate.to_runtime_config(
        _spec(**{"speculative.algorithm": "EAGLE", "speculative.draftModel": draft})
    )
    s = config.speculative
    assert (s.draft_model_path, s.draft_model_architecture, s.token_map) == (
        "/models/eagle",
        "LlamaForCausalLMEagle",
        "maps/hot.json",  # relative: the runtime reads it from the draft's directory
    )
    assert translate.to_runtime_config(_spec()).speculative.token_map is None
    assert translate.crd_path("speculative.token_map") == "spec.speculative.draftModel.tokenMap"


def test_gpus_pick_the_device():
    assert translate.to_runtime_config(_spec(gpus=0)).device == "cpu"
    assert translate.to_runtime_config(_spec(gpus=0)).parallel.tensor_parallel_size == 1
    assert translate.to_runtime_config(_spec(gpus=2)).device == "cuda"


def test_chain_draft_tokens_derived():
    """Chain num draft tokens derived when unset."""
    config = translate.to_runtime_config(
        _spec(**{"speculative.algorithm": "NGRAM", "speculative.numSteps": 5})
    )
    assert config.speculative.num_draft_tokens == 6


@pytest.mark.parametrize(
    ("source", "storage", "expected"),
    [
        ("/models/llama", {}, "/models/llama"),
        (
            "pvc://cache/llama/8b",
            {"models": {"type": "PersistentVolumeClaim", "claimName": "cache"}},
            "/models/llama/8b",
        ),
        (
            "pvc://lora/sql",
            {"adapters": {"type": "PersistentVolumeClaim", "claimName": "lora", "mountPath": "/a"}},
            "/a/sql",
        ),
        ("pvc://other/x", {"models": {"type": "PersistentVolumeClaim", "claimName": "cache"}}, None),
        ("hf://org/repo@abc", {}, "/models/hf/org/repo/abc"),
        ("hf://org/repo", {"models": {"mountPath": "/m"}}, "/m/hf/org/repo/main"),
        ("s3://bucket/key/a.tgz", {}, "/models/s3/bucket/key/a.tgz"),
        ("https://host.example/x/y.tar", {}, "/models/https/host.example/x/y.tar"),
    ],
)
def test_pod_paths(source, storage, expected):
    storage_spec = specs.StorageSpec.model_validate(storage)
    assert translate.pod_path(source, storage_spec) == expected


@pytest.mark.parametrize(
    "source",
    ["pvc://lora/../../etc", "pvc://lora//etc/shadow", "pvc://lora/a//b", "pvc://lora/a/../../b", "pvc://lora/.."],
)
def test_pvc_paths_never_leave_the_mount(source):
    """The path mapping itself never yields a path outside the claim's mount (posixpath.join
    with an absolute tail drops the mount; '..' climbs out): None, and every caller says why."""
    from loraserve.operator import desired

    claim = {"type": "PersistentVolumeClaim", "claimName": "lora"}
    storage = specs.StorageSpec.model_validate({"models": {**claim, "mountPath": "/m"}})
    assert translate.pod_path(source, storage) is None
    assert desired.adapter_pod_path(source, storage) is None
    # A spec that skipped the webhook (model_construct: no validation) is still reported.
    spec = _spec(**{"storage.models": {**claim, "mountPath": "/m"}})
    spec.model = specs.ModelSpec.model_construct(source=source, dtype="auto")
    config = translate.to_runtime_config(spec)
    assert not config.model.path.startswith("/m") and not config.model.path.startswith("/etc")
    for found in (translate.unmounted_sources(spec), desired.problems(spec, config)):
        assert any(p.startswith("spec.model.source: ") and "leaves the claim's mount" in p for p in found), found
    entries = desired.catalog_entries(storage, [("bad", {"serve": "s", "source": source})])
    assert entries == ()


def test_pods_confined_to_volumes():
    """The runtime may read local files from the model and adapter volumes and the adapter
    cache only; a model or draft given as an absolute path elsewhere (in the image) is added."""
    claim = {"type": "PersistentVolumeClaim", "claimName": "lora", "mountPath": "/lora/"}
    config = translate.to_runtime_config(_spec(**{"storage.adapters": claim}))
    assert config.server.allowed_local_roots == ("/models", "/lora")
    assert config.server.adapter_cache_dir == "/lora/.cache"
    config = translate.to_runtime_config(
        _spec(**{"storage.adapters": {**claim, "readOnly": True}, "model.source": "/opt/base"})
    )
    assert config.server.allowed_local_roots == ("/models", "/lora", "/tmp/loraserve-adapters", "/opt/base")
    config = translate.to_runtime_config(
        _spec(**{"speculative.algorithm": "EAGLE", "speculative.draftModel.source": "pvc://lora/eagle"})
    )
    assert config.server.allowed_local_roots == ("/models", "/adapters")


def test_model_revision_applies_to_hf():
    """Model revision field applies to HF sources."""
    spec = _spec(**{"model.source": "hf://org/repo", "model.revision": "v1"})
    assert translate.to_runtime_config(spec).model.path == "/models/hf/org/repo/v1"


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("hf://meta-llama/Llama-3.1-8B-Instruct@abc", "meta-llama/Llama-3.1-8B-Instruct"),
        ("/models/Llama-3.2-1B-Instruct/", "Llama-3.2-1B-Instruct"),
        ("pvc://cache/qwen2.5-7b", "qwen2.5-7b"),
        ("s3://bucket/models/mistral-7b.tar.gz", "mistral-7b.tar.gz"),
    ],
)
def test_served_name_derived_from_source(source, name):
    assert translate.served_name(_spec(**{"model.source": source})) == name
    assert translate.served_name(_spec(**{"model.source": source, "model.servedName": "x"})) == "x"


def test_unmounted_model_claim_is_named():
    spec = _spec(**{"model.source": "pvc://cache/llama"})
    (problem,) = translate.unmounted_sources(spec)
    assert problem.startswith("spec.model.source: claim 'cache' is not mounted")
    mounted = _spec(
        **{
            "model.source": "pvc://cache/llama",
            "storage.models.type": "PersistentVolumeClaim",
            "storage.models.claimName": "cache",
        }
    )
    assert translate.unmounted_sources(mounted) == []


def test_messages_speak_only_in_crd_field_names():
    spec = _spec(
        **{
            "speculative.algorithm": "FROZEN_KV_MTP",
            "speculative.draftModel.source": "/models/assistant",
            "runtime.overlapSchedule": True,
            "runtime.cudaGraph.enabled": True,
            "runtime.cudaGraph.maxBatchSize": 8,
            "speculative.adaptive": True,
            "lora.overlapLoading": True,
            "lora.maxRank": 512,
        }
    )
    report = policy.check_config(translate.to_runtime_config(spec), Capabilities(algorithms=frozenset()))
    problems, warnings = translate.serve_messages(report)
    assert len(problems) >= 6 and warnings
    for message in problems + warnings:
        assert "{" not in message
        leaked = [m for m in CONFIG_PATH.findall(message) if not message[: message.find(m)].endswith("spec.")]
        assert leaked == [], message
        assert message.startswith("spec."), message


def test_effective_status_reports_the_resolution():
    spec = _spec(**{"speculative.algorithm": "NEXTN", "lora.enabled": False})
    report = policy.check_config(translate.to_runtime_config(spec), EVERYTHING)
    status = translate.effective_status(report).to_dict()
    assert status["algorithm"] == "EAGLE" and status["requestedAlgorithm"] == "NEXTN"
    plain = policy.check_config(translate.to_runtime_config(_spec()), EVERYTHING)
    assert "requestedAlgorithm" not in translate.effective_status(plain).to_dict()


def test_spec_errors_name_the_users_fields():
    with pytest.raises(specs.SpecError) as caught:
        specs.parse_loraserve_spec(
            {
                "model": {"source": "/m"},
                "lora": {"maxRank": 2**40},
                "replicas": "x",
                "speculative": {"algorithm": "NGRAM", "numSteps": 1_000_000, "numDraftTokens": 1_000_001},
            }
        )
    problems = caught.value.problems
    for name in ("spec.lora.maxRank:", "spec.replicas:", "spec.speculative.numSteps:", "spec.speculative.numDraftTokens:"):
        assert any(p.startswith(name) for p in problems), problems
    with pytest.raises(specs.SpecError) as caught:
        specs.parse_loraserve_spec({})
    assert caught.value.problems == ["spec.model: Field required"]


def test_lora_serves_wait_for_catalog():
    """--catalog-confirm with LoRA on: a pod is not Ready until the operator pushed its
    catalog (the ConfigMap volume lags behind Adapters created while it started)."""
    from loraserve.operator.desired import runtime_args

    def args(enabled: bool) -> list[str]:
        spec = specs.parse_loraserve_spec({"model": {"source": "/m"}, "lora": {"enabled": enabled}})
        return runtime_args(translate.to_runtime_config(spec))

    assert "--catalog-confirm" in args(True)
    assert not any("catalog" in a for a in args(False))
