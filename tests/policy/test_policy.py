"""The compatibility policy, rule by rule, in both directions.

Each rule is shown to fire on a configuration that breaks it and to stay quiet on the
nearest configuration that does not. Rules about what this image implements derive their
expectations from ``loraserve.runtime.contract.capabilities``, so flipping an entry there needs no
change here; the rule itself is tested with capabilities passed in explicitly.
"""

from __future__ import annotations

import dataclasses

import pytest

from loraserve.runtime.contract import capabilities as caps_module
from loraserve.runtime.contract import policy
from loraserve.runtime.contract.capabilities import CAPABILITIES, IMPLEMENTED_ALGORITHMS, Capabilities
from loraserve.runtime.contract.config import LORA_MODULES, RaggedVerify, RuntimeConfig, SpecAlgorithm

A = SpecAlgorithm
EVERYTHING = Capabilities(
    algorithms=frozenset(SpecAlgorithm),
    lora_graph_width_rebuild=False,
    tree_algorithms=frozenset(SpecAlgorithm),
    dynamic_ragged_verify=True,
)
"""An image that implements every algorithm and feature: isolates compatibility from availability."""

GEMMA4_ASSISTANT = "Gemma4AssistantForCausalLM"


def config(
    algorithm: SpecAlgorithm = A.NONE, *, lora: bool = True, draft: str | None = None, **changes
) -> RuntimeConfig:
    """A valid base configuration, then ``changes`` as ``section__field=value``."""
    c = RuntimeConfig()
    c.model.path = "/models/base"
    c.speculative.algorithm = algorithm
    c.lora.enabled = lora
    if draft is not None:
        c.speculative.draft_model_path = draft
    elif algorithm.needs_draft_model:
        c.speculative.draft_model_path = "/models/draft"
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            setattr(getattr(c, section), name, value)
        else:
            setattr(c, section, value)
    return c


def rules(c: RuntimeConfig, capabilities: Capabilities = EVERYTHING) -> set[str]:
    return policy.check_config(c, capabilities).rules()


def warning_rules(c: RuntimeConfig, capabilities: Capabilities = EVERYTHING) -> set[str]:
    return policy.check_config(c, capabilities).warning_rules()


# --------------------------------------------------------------------------- LoRA x algorithm

LORA_ALGORITHMS = {A.NONE, A.NGRAM, A.STANDALONE, A.EAGLE, A.EAGLE3, A.NEXTN, A.DFLASH, A.DSPARK}


@pytest.mark.parametrize("algorithm", list(SpecAlgorithm))
def test_lora_allowed_only_with_listed_algorithms(algorithm):
    with_lora = rules(config(algorithm, lora=True))
    without_lora = rules(config(algorithm, lora=False))
    assert ("lora-algorithm" in with_lora) == (algorithm not in LORA_ALGORITHMS)
    assert "lora-algorithm" not in without_lora


def test_lora_rejection_names_the_algorithm():
    report = policy.check_config(config(A.FROZEN_KV_MTP), EVERYTHING)
    (violation,) = [v for v in report.violations if v.rule == "lora-algorithm"]
    assert violation.field == "speculative.algorithm" and violation.kind is policy.Kind.INCOMPATIBLE
    assert "FROZEN_KV_MTP" in violation.render() and "lora.enabled" in violation.render()


@pytest.mark.parametrize("requested", [A.NEXTN, A.EAGLE])
def test_gemma4_draft_is_frozen_kv_mtp(requested):
    """Gemma4 assistant draft resolves to frozen KV MTP and is refused with LoRA."""
    c = config(requested, draft="/models/assistant", speculative__draft_model_architecture=GEMMA4_ASSISTANT)
    report = policy.check_config(c, EVERYTHING)
    assert report.effective.speculative.algorithm is A.FROZEN_KV_MTP
    assert report.requested is requested
    (violation,) = [v for v in report.violations if v.rule == "lora-algorithm"]
    assert (
        f"{requested.value} with the Gemma-4 assistant draft {GEMMA4_ASSISTANT} resolves to FROZEN_KV_MTP"
        in (violation.render())
    )
    # The same draft without LoRA is compatible (it only needs an image that runs it).
    assert "lora-algorithm" not in rules(
        dataclasses.replace(c, lora=dataclasses.replace(c.lora, enabled=False))
    )


def test_other_drafts_not_frozen_kv_mtp():
    """Other draft architectures do not resolve to frozen KV MTP."""
    c = config(A.EAGLE3, speculative__draft_model_architecture=GEMMA4_ASSISTANT)
    assert policy.check_config(c, EVERYTHING).effective.speculative.algorithm is A.EAGLE3
    c = config(A.EAGLE, speculative__draft_model_architecture="LlamaForCausalLMEagle")
    assert policy.check_config(c, EVERYTHING).effective.speculative.algorithm is A.EAGLE


def test_nextn_resolves_to_eagle():
    """NextN resolves to EAGLE reading the target checkpoint."""
    c = config(A.NEXTN)
    report = policy.check_config(c, EVERYTHING)
    assert report.ok, report.violations
    assert report.effective.speculative.algorithm is A.EAGLE
    assert report.effective.speculative.draft_model_path == c.model.path
    assert report.resolution == "NEXTN resolves to EAGLE"
    assert c.speculative.algorithm is A.NEXTN and c.speculative.draft_model_path is None  # input untouched


# --------------------------------------------------------------------------- LoRA x features


def test_dspark_lora_needs_static_ragged():
    """DSpark with LoRA needs static ragged verify."""
    dynamic = RaggedVerify.DYNAMIC
    assert "lora-dspark-ragged" in rules(config(A.DSPARK, speculative__ragged_verify=dynamic))
    assert "lora-dspark-ragged" not in rules(config(A.DSPARK, speculative__ragged_verify=RaggedVerify.STATIC))
    assert "lora-dspark-ragged" not in rules(config(A.DSPARK, lora=False, speculative__ragged_verify=dynamic))
    assert "lora-dspark-ragged" not in rules(config(A.DFLASH, speculative__ragged_verify=dynamic))


def test_adaptive_lora_follows_flag():
    """Adaptive with LoRA follows the one capability flag."""
    c = config(A.EAGLE, speculative__adaptive=True)
    assert "lora-adaptive" in rules(c, EVERYTHING)
    rebuilt = dataclasses.replace(EVERYTHING, lora_graph_width_rebuild=True)
    assert "lora-adaptive" not in rules(c, rebuilt)
    assert "lora-adaptive" not in rules(config(A.EAGLE, lora=False, speculative__adaptive=True), EVERYTHING)
    assert "lora-adaptive" not in rules(config(A.EAGLE, speculative__adaptive=False), EVERYTHING)
    # This image's flag decides the default.
    expected = not CAPABILITIES.lora_graph_width_rebuild
    assert ("lora-adaptive" in policy.check_config(c).rules()) == expected


def test_adaptive_needs_varying_width():
    """One rule for the webhook and the decoder: adaptive is refused with any algorithm, LoRA
    or not, until the image's flag says it runs; the fixes never lead to another refusal."""
    for lora in (True, False):
        c = config(A.EAGLE, lora=lora, speculative__adaptive=True)
        assert "adaptive-unavailable" in rules(c, EVERYTHING)
        assert "adaptive-unavailable" not in rules(c, dataclasses.replace(EVERYTHING, adaptive_speculation=True))
    assert "adaptive-unavailable" not in rules(config(A.NONE, speculative__adaptive=True), EVERYTHING)
    assert "adaptive-unavailable" not in rules(config(A.EAGLE, speculative__adaptive=False), EVERYTHING)
    both = config(A.NGRAM, speculative__adaptive=True, cuda_graph__enabled=True)
    fixes = {v.rule: v.fix for v in policy.check_config(both, EVERYTHING).violations}
    assert "lora.enabled" not in fixes["lora-adaptive"] and "cuda_graph.enabled" not in fixes["cuda-graph-adaptive"]
    varies = dataclasses.replace(EVERYTHING, adaptive_speculation=True)
    fixes = {v.rule: v.fix for v in policy.check_config(both, varies).violations}
    assert "lora.enabled" in fixes["lora-adaptive"] and "cuda_graph.enabled" in fixes["cuda-graph-adaptive"]


@pytest.mark.parametrize(
    ("rule", "field", "value"),
    [
        ("lora-overlap-schedule", "scheduler__overlap_schedule", True),
        ("lora-two-batch-overlap", "scheduler__two_batch_overlap", True),
        ("lora-overlap-loading", "lora__overlap_loading", True),
    ],
)
def test_overlap_features_are_refused_with_lora(rule, field, value):
    assert rule in rules(config(**{field: value}))
    assert rule not in rules(config(**{field: not value}))
    assert rule not in rules(config(lora=False, **{field: value}))


def test_overlap_without_lora_warns():
    """Overlap loading without LoRA is only a warning."""
    c = config(lora=False, lora__overlap_loading=True)
    assert policy.check_config(c, EVERYTHING).ok
    assert "overlap-loading-ignored" in warning_rules(c)


# --------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize(
    ("rule", "field", "bad", "good"),
    [
        ("cuda-graph-ragged", "speculative__ragged_verify", RaggedVerify.DYNAMIC, RaggedVerify.STATIC),
        ("cuda-graph-adaptive", "speculative__adaptive", True, False),
    ],
)
def test_cuda_graphs_need_a_fixed_verify_width(rule, field, bad, good):
    on = {"cuda_graph__enabled": True}
    assert rule in rules(config(A.NGRAM, lora=False, **on, **{field: bad}))
    assert rule not in rules(config(A.NGRAM, lora=False, **on, **{field: good}))
    assert rule not in rules(config(A.NGRAM, lora=False, cuda_graph__enabled=False, **{field: bad}))
    assert rule not in rules(config(A.NONE, lora=False, **on, **{field: bad}))


def test_the_paged_attention_needs_a_gpu():
    """``triton`` on a CPU is refused, naming the field and both ways out; ``auto`` is not
    (it takes SDPA there)."""
    report = policy.check_config(config(attention_backend="triton", device="cpu", cuda_graph__enabled=False), EVERYTHING)
    assert "attention-triton-cpu" in report.rules()
    text = " ".join(v.render() for v in report.violations)
    assert "attention_backend" in text and "auto" in text
    assert "attention-triton-cpu" not in rules(config(attention_backend="triton", device="cuda"))
    assert "attention-triton-cpu" not in rules(config(attention_backend="auto", device="cpu", cuda_graph__enabled=False))


def test_sdpa_on_a_gpu_is_legal_but_warned():
    assert "attention-sdpa-gpu" in warning_rules(config(attention_backend="sdpa", device="cuda"))
    assert "attention-sdpa-gpu" not in rules(config(attention_backend="sdpa", device="cuda"))
    assert "attention-sdpa-gpu" not in warning_rules(config(attention_backend="auto", device="cuda"))
    assert "attention-sdpa-gpu" not in warning_rules(config(attention_backend="sdpa", device="cpu", cuda_graph__enabled=False))


def test_cuda_graphs_need_a_gpu():
    assert "cuda-graph-cpu" in rules(config(cuda_graph__enabled=True, device="cpu"))
    assert "cuda-graph-cpu" not in rules(config(cuda_graph__enabled=True, device="cuda"))
    assert "cuda-graph-cpu" not in rules(config(cuda_graph__enabled=False, device="cpu"))


# --------------------------------------------------------------------------- availability


@pytest.mark.parametrize("algorithm", [a for a in SpecAlgorithm if a is not A.NEXTN])
def test_algorithm_availability_follows_the_table(algorithm):
    report = policy.check_config(config(algorithm, lora=False))
    unavailable = {v.rule for v in report.unavailable}
    assert ("algorithm-unavailable" in unavailable) == (not IMPLEMENTED_ALGORITHMS[algorithm])
    for violation in report.unavailable:
        assert violation.kind is policy.Kind.UNAVAILABLE
        assert "not available in this runtime" in violation.render()


def test_nextn_availability_follows_target():
    """NextN is available exactly when what it resolves to is."""
    report = policy.check_config(config(A.NEXTN, lora=False))
    assert ("algorithm-unavailable" in report.rules()) == (not IMPLEMENTED_ALGORITHMS[A.EAGLE])


def test_one_table_entry_is_whole_change(monkeypatch):
    """Flipping one table entry is the whole change."""
    c = config(A.NGRAM, lora=False)
    off = Capabilities(algorithms=frozenset({A.NONE}))
    on = Capabilities(algorithms=frozenset({A.NONE, A.NGRAM}))
    assert "algorithm-unavailable" in rules(c, off)
    assert "algorithm-unavailable" not in rules(c, on)
    assert policy.check_config(c, on).ok
    # CAPABILITIES is built from the table alone.
    table = {**IMPLEMENTED_ALGORITHMS, A.NGRAM: True}
    built = frozenset(a for a, implemented in table.items() if implemented)
    assert built == caps_module.CAPABILITIES.algorithms | {A.NGRAM}


def test_unavailable_not_incompatible():
    """Unavailable is distinct from incompatible."""
    c = config(A.FROZEN_KV_MTP, draft="/models/assistant")
    report = policy.check_config(c, Capabilities(algorithms=frozenset({A.NONE})))
    assert {v.rule for v in report.incompatible} == {"lora-algorithm"}
    assert {v.rule for v in report.unavailable} == {"algorithm-unavailable"}


def test_tree_and_dynamic_verify_features():
    """Tree drafts and dynamic verify are features of the image."""
    tree = config(A.EAGLE, speculative__top_k=4, speculative__num_draft_tokens=8)
    assert "tree-unavailable" in rules(tree, dataclasses.replace(EVERYTHING, tree_algorithms=frozenset()))
    assert "tree-unavailable" not in rules(tree, EVERYTHING)
    # this image grows trees for the EAGLE family only
    assert "tree-unavailable" not in rules(tree, CAPABILITIES)
    standalone = config(A.STANDALONE, speculative__top_k=2, speculative__num_draft_tokens=6)
    assert "tree-unavailable" in rules(standalone, CAPABILITIES)
    assert "tree-tensor-parallel" in rules(config(A.EAGLE3, speculative__top_k=2, speculative__num_draft_tokens=6,
                                                  parallel__tensor_parallel_size=2), CAPABILITIES)  # fmt: skip
    ragged = config(A.DFLASH, lora=False, speculative__ragged_verify=RaggedVerify.DYNAMIC)
    assert "ragged-unavailable" in rules(ragged, dataclasses.replace(EVERYTHING, dynamic_ragged_verify=False))
    assert "ragged-unavailable" not in rules(ragged, EVERYTHING)


# --------------------------------------------------------------------------- sanity


@pytest.mark.parametrize("algorithm", [a for a in SpecAlgorithm if a.needs_draft_model])
def test_draft_model_required(algorithm):
    assert "draft-required" in rules(config(algorithm, draft=""))
    assert "draft-required" not in rules(config(algorithm, draft="/models/draft"))


@pytest.mark.parametrize("algorithm", [a for a in SpecAlgorithm if not a.needs_draft_model])
def test_draft_model_not_required(algorithm):
    assert "draft-required" not in rules(config(algorithm, lora=False, draft=""))


@pytest.mark.parametrize("fmt", ["auto", "safetensors", "dummy"])
def test_pickle_drafts_refused(fmt):
    """Pickle draft checkpoints are refused and safe formats pass."""
    assert "draft-load-format-pickle" in rules(config(A.STANDALONE, speculative__draft_load_format="pt"))
    assert "draft-load-format-pickle" not in rules(config(A.STANDALONE, speculative__draft_load_format=fmt))
    report = policy.check_config(config(A.STANDALONE, speculative__draft_load_format="pt"), EVERYTHING)
    (finding,) = [v for v in report.violations if v.rule == "draft-load-format-pickle"]
    assert finding.field == "speculative.draft_load_format" and "safetensors" in finding.fix


@pytest.mark.parametrize("algorithm", list(SpecAlgorithm))
def test_token_map_needs_head_draft(algorithm):
    """A token map picks rows of the target's lm_head: EAGLE-family drafts only (NEXTN runs as
    EAGLE); elsewhere refused, naming the field; without speculation only a warning."""
    c = config(algorithm, lora=False, speculative__token_map="freq_32768.pt")
    refused = "token-map-algorithm" in rules(c)
    assert refused == (algorithm is not A.NONE and not algorithm.is_eagle_family)
    assert ("token-map-ignored" in warning_rules(c)) == (algorithm is A.NONE)
    assert not {"token-map-algorithm"} & rules(config(algorithm, lora=False))
    if refused:
        (finding,) = [
            v for v in policy.check_config(c, EVERYTHING).violations if v.rule == "token-map-algorithm"
        ]
        assert finding.field == "speculative.token_map" and "EAGLE" in finding.fix


def test_chain_drafts_verify_num_steps_plus_one():
    assert "chain-draft-tokens" in rules(
        config(A.EAGLE, speculative__num_steps=5, speculative__num_draft_tokens=4)
    )
    assert "chain-draft-tokens" not in rules(
        config(A.EAGLE, speculative__num_steps=5, speculative__num_draft_tokens=6)
    )
    # Without speculation the fields are not used.
    assert "chain-draft-tokens" not in rules(config(A.NONE, speculative__num_draft_tokens=9))


def test_tree_draft_token_bound():
    # top_k 4, num_steps 3: 4 + 2 * 16 = 36 candidates, at most 37 verified tokens.
    tree = {"speculative__top_k": 4, "speculative__num_steps": 3}
    assert "tree-draft-tokens" not in rules(config(A.EAGLE, speculative__num_draft_tokens=37, **tree))
    assert "tree-draft-tokens" in rules(config(A.EAGLE, speculative__num_draft_tokens=38, **tree))


def test_top_k_above_one_needs_tree():
    """Only tree capable algorithms take top k above one."""
    tree = {"speculative__top_k": 2, "speculative__num_draft_tokens": 4}
    assert "tree-algorithm" in rules(config(A.NGRAM, lora=False, **tree))
    assert "tree-algorithm" in rules(config(A.DFLASH, lora=False, **tree))
    for algorithm in (A.STANDALONE, A.EAGLE, A.EAGLE3, A.NEXTN):
        assert "tree-algorithm" not in rules(config(algorithm, **tree))


def test_ngram_window():
    assert "ngram-window" in rules(config(A.NGRAM, speculative__ngram_min=5, speculative__ngram_max=3))
    assert "ngram-window" not in rules(config(A.NGRAM, speculative__ngram_min=3, speculative__ngram_max=3))


@pytest.mark.parametrize(
    ("rule", "bad", "good"),
    [
        (
            "lora-slots-cache",
            {"lora__max_loras_per_batch": 9, "lora__max_loaded_loras": 8},
            {"lora__max_loaded_loras": 9},
        ),
        ("lora-slots", {"lora__max_loras_per_batch": 0}, {"lora__max_loras_per_batch": 1}),
        ("lora-rank", {"lora__max_rank": 0}, {"lora__max_rank": 1}),
        (
            "lora-modules",
            {"lora__target_modules": ("q_proj", "w_pack")},
            {"lora__target_modules": ("q_proj",)},
        ),
        ("lora-modules", {"lora__target_modules": ()}, {"lora__target_modules": LORA_MODULES}),
        (
            "lora-modules",
            {"lora__target_modules": ("q_proj", "q_proj")},
            {"lora__target_modules": ("q_proj",)},
        ),
        ("lora-backend", {"lora__backend": "cutlass"}, {"lora__backend": "triton"}),
        ("tensor-parallel", {"parallel__tensor_parallel_size": 0}, {"parallel__tensor_parallel_size": 2}),
        ("device", {"device": "tpu"}, {"device": "cuda"}),
        ("model-dtype", {"model__dtype": "int4"}, {"model__dtype": "bfloat16"}),
        ("model-required", {"model__path": ""}, {"model__path": "/m"}),
        ("context-length", {"model__context_length": 0}, {"model__context_length": 4096}),
        ("kv-fraction", {"scheduler__kv_memory_fraction": 1.5}, {"scheduler__kv_memory_fraction": 1.0}),
        ("max-running", {"scheduler__max_running_requests": 0}, {"scheduler__max_running_requests": 1}),
        (
            "speculative-disable-batch-size",
            {"speculative__disable_batch_size": -1},
            {"speculative__disable_batch_size": 0},
        ),
        (
            "speculative-tree-max-batch-size",
            {"speculative__tree_max_batch_size": -1},
            {"speculative__tree_max_batch_size": 0},
        ),
        ("port", {"server__port": 70000}, {"server__port": 8080}),
        ("cuda-graph-bs", {"cuda_graph__max_bs": 0}, {"cuda_graph__max_bs": 8}),
        ("cuda-graph-prefill", {"cuda_graph__max_prefill_tokens": -1}, {"cuda_graph__max_prefill_tokens": 0}),
        ("cuda-graph-warmup", {"cuda_graph__warmup_context": -1}, {"cuda_graph__warmup_context": 0}),
        (
            "lora-pinned-unknown",
            {"lora__pinned": ("a",)},
            {"lora__pinned": ("a",), "lora__adapters": {"a": "/a"}},
        ),
        (
            "lora-pinned-slots",
            {
                "lora__max_loras_per_batch": 1,
                "lora__pinned": ("a", "b"),
                "lora__adapters": {"a": "/a", "b": "/b"},
            },
            {
                "lora__max_loras_per_batch": 3,
                "lora__pinned": ("a", "b"),
                "lora__adapters": {"a": "/a", "b": "/b"},
            },
        ),
        (
            "lora-preload-cache",
            {"lora__max_loaded_loras": 8, "lora__adapters": {f"a{i}": "/a" for i in range(9)}},
            {"lora__max_loaded_loras": 9, "lora__adapters": {f"a{i}": "/a" for i in range(9)}},
        ),
    ],
)
def test_basic_sanity(rule, bad, good):
    assert rule in rules(config(**bad))
    assert rule not in rules(config(**{**bad, **good}))


def test_disable_batch_size_bound():
    """Disable batch size bound names field and fix and any algorithm may set it."""
    (violation,) = policy.check_config(config(speculative__disable_batch_size=-1), EVERYTHING).violations
    assert violation.render() == (
        "speculative.disable_batch_size: must be at least 0, got -1; "
        "fix: set speculative.disable_batch_size to 0 or more"
    )
    for algorithm in (A.NONE, A.NGRAM, A.EAGLE):
        assert policy.check_config(config(algorithm, speculative__disable_batch_size=32), EVERYTHING).ok


def test_prefill_graph_bound_names_field_and_fix():
    (violation,) = policy.check_config(config(cuda_graph__max_prefill_tokens=-8), EVERYTHING).violations
    assert violation.render() == (
        "cuda_graph.max_prefill_tokens: must be at least 0, got -8; fix: set cuda_graph.max_prefill_tokens "
        "to 0 (prefills run eagerly) or to the longest single prefill chunk to replay from CUDA graphs, such as 512"
    )


def test_warmup_context_bound_names_field_and_fix():
    (violation,) = policy.check_config(config(cuda_graph__warmup_context=-1), EVERYTHING).violations
    assert violation.render() == (
        "cuda_graph.warmup_context: must be at least 0, got -1; fix: set cuda_graph.warmup_context "
        "to 0 (graphs are captured on first use) or to the longest context to capture at start-up, such as 1024"
    )


def test_unknown_enum_is_violation():
    """Unknown enum strings are violations not crashes."""
    c = config()
    c.speculative.algorithm = "MEDUSA"
    c.speculative.ragged_verify = "sometimes"
    report = policy.check_config(c, EVERYTHING)
    assert {"algorithm", "ragged"} <= report.rules()
    ok = config()
    ok.speculative.algorithm = "NGRAM"  # plain strings from flags are fine
    assert policy.check_config(ok, EVERYTHING).ok


# --------------------------------------------------------------------------- warnings


def test_embedding_modules_warn():
    """Embedding modules under EAGLE family and DFlash warn."""
    modules = {"lora__target_modules": (*LORA_MODULES[:7], "lm_head")}
    for algorithm in (A.EAGLE, A.EAGLE3, A.NEXTN, A.DFLASH):  # DFLASH too takes the base embeddings and head
        report = policy.check_config(config(algorithm, **modules), EVERYTHING)
        assert report.ok and "eagle-embeddings" in report.warning_rules()
        assert "accept rate" in next(w.render() for w in report.warnings if w.rule == "eagle-embeddings")
    assert "eagle-embeddings" not in warning_rules(config(A.NGRAM, **modules))
    assert "eagle-embeddings" not in warning_rules(config(A.EAGLE))


@pytest.mark.parametrize(
    ("rule", "warned", "quiet"),
    [
        ("large-rank", {"lora__max_rank": policy.LARGE_RANK + 1}, {"lora__max_rank": policy.LARGE_RANK}),
        ("draft-ignored", {"speculative__draft_model_path": "/d"}, {"speculative__draft_model_path": None}),
        ("adaptive-ignored", {"speculative__adaptive": True}, {"speculative__adaptive": False}),
        ("spec-switch-ignored", {"speculative__auto_disable": True}, {"speculative__auto_disable": False}),
        (
            "spec-switch-ignored",
            {"speculative__disable_batch_size": 8},
            {"speculative__disable_batch_size": 0},
        ),
        (
            "cuda-graph-partial",
            {"cuda_graph__enabled": True, "cuda_graph__max_bs": 8},
            {"cuda_graph__enabled": True, "cuda_graph__max_bs": 64},
        ),
    ],
)
def test_costly_settings_warn(rule, warned, quiet):
    assert rule in warning_rules(config(**warned))
    assert rule not in warning_rules(config(**quiet))
    assert policy.check_config(config(**warned), EVERYTHING).ok  # warnings never refuse


def test_unreachable_disable_size_warns():
    """A disable batch size no step reaches warns."""
    running = {"scheduler__max_running_requests": 32}
    warned = config(A.NGRAM, speculative__disable_batch_size=33, **running)
    report = policy.check_config(warned, EVERYTHING)
    assert report.ok and "disable-batch-size-unreachable" in report.warning_rules()
    text = next(w.render() for w in report.warnings if w.rule == "disable-batch-size-unreachable")
    assert "speculative.disable_batch_size" in text and "32" in text and "every step drafts" in text
    for value in (0, 32):
        quiet = config(A.NGRAM, speculative__disable_batch_size=value, **running)
        assert "disable-batch-size-unreachable" not in warning_rules(quiet)


# --------------------------------------------------------------------------- the report


def test_every_violation_is_reported_at_once():
    c = config(
        A.FROZEN_KV_MTP,
        draft="/models/assistant",
        scheduler__overlap_schedule=True,
        scheduler__two_batch_overlap=True,
        lora__overlap_loading=True,
        lora__max_rank=0,
        parallel__tensor_parallel_size=0,
    )
    report = policy.check_config(c, Capabilities(algorithms=frozenset({A.NONE})))
    assert {
        "lora-algorithm",
        "lora-overlap-schedule",
        "lora-two-batch-overlap",
        "lora-overlap-loading",
        "lora-rank",
        "tensor-parallel",
        "algorithm-unavailable",
    } <= report.rules()
    with pytest.raises(policy.PolicyError) as caught:
        report.raise_for_violations()
    assert str(caught.value).count("fix:") == len(report.violations)


def test_findings_name_field_and_fix():
    """Findings name field reason and fix and render through a namer."""
    report = policy.check_config(config(lora__max_loras_per_batch=64, lora__max_loaded_loras=8), EVERYTHING)
    (violation,) = report.violations
    assert violation.field == "lora.max_loras_per_batch" and violation.reason and violation.fix
    rendered = violation.render(lambda path: path.upper())
    assert rendered.startswith("LORA.MAX_LORAS_PER_BATCH: ")
    assert "{" not in rendered and "LORA.MAX_LOADED_LORAS" in rendered


def test_check_does_not_mutate_its_input():
    c = config(A.NEXTN, lora__overlap_loading=True)
    before = c.to_dict()
    policy.check_config(c)
    assert c.to_dict() == before


def test_clean_configuration_passes():
    """Clean configuration passes under this image."""
    report = policy.check_config(config())
    assert report.ok and report.warnings == () and report.effective.speculative.algorithm is A.NONE


# --------------------------------------------------------------------------- adapters


def adapter(**kw) -> policy.AdapterDeclaration:
    return policy.AdapterDeclaration(name=kw.pop("name", "sql"), **kw)


def adapter_rules(c: RuntimeConfig, a: policy.AdapterDeclaration, other_pinned: int = 0) -> set[str]:
    return policy.check_adapter(c, a, other_pinned=other_pinned).rules()


def test_adapter_rank_within_max_rank():
    c = config(lora__max_rank=32)
    assert "adapter-rank-too-large" in adapter_rules(c, adapter(rank=33))
    assert "adapter-rank-too-large" not in adapter_rules(c, adapter(rank=32))
    assert "adapter-rank" in adapter_rules(c, adapter(rank=0))
    assert adapter_rules(c, adapter()) == set()  # undeclared rank: checked against the file later


def test_adapter_modules_within_serve_modules():
    c = config(lora__target_modules=("q_proj", "v_proj"))
    report = policy.check_adapter(c, adapter(target_modules=("q_proj", "o_proj")))
    (violation,) = report.violations
    assert violation.rule == "adapter-modules-not-served" and "o_proj" in violation.render()
    assert adapter_rules(c, adapter(target_modules=("v_proj",))) == set()
    assert "adapter-modules" in adapter_rules(c, adapter(target_modules=("q_proj", "bogus")))


def test_adapter_embeddings_warn():
    """Adapter embeddings under EAGLE family and DFlash warn."""
    for algorithm in (A.EAGLE3, A.DFLASH):
        c = config(algorithm, lora__target_modules=LORA_MODULES)
        report = policy.check_adapter(c, adapter(target_modules=("q_proj", "embed_tokens")))
        assert report.ok and report.warning_rules() == {"adapter-eagle-embeddings"}, algorithm
    assert (
        policy.check_adapter(
            config(A.NGRAM, lora__target_modules=LORA_MODULES), adapter(target_modules=("embed_tokens",))
        ).warnings
        == ()
    )


def test_pinned_adapters_leave_one_gpu_slot():
    """As the runtime's pool does: a pin that would take the last slot is refused."""
    c = config(lora__max_loras_per_batch=4)
    assert "adapter-pinned-slots" in adapter_rules(c, adapter(pinned=True), other_pinned=3)
    report = policy.check_adapter(c, adapter(pinned=True), other_pinned=2)
    assert report.ok and report.warning_rules() == {"adapter-pinned-all-slots"}
    assert policy.check_adapter(c, adapter(pinned=True), other_pinned=1).warnings == ()
    assert "adapter-pinned-slots" in adapter_rules(config(lora__max_loras_per_batch=1), adapter(pinned=True))
    assert adapter_rules(c, adapter(pinned=False), other_pinned=9) == set()


def test_adapter_needs_lora_and_a_name_of_its_own():
    assert "adapter-lora-disabled" in adapter_rules(config(lora=False), adapter())
    c = config(model__served_name="llama")
    assert "adapter-name-clash" in adapter_rules(c, adapter(name="llama"))
    assert "adapter-name-clash" not in adapter_rules(c, adapter(name="llama-sql"))


def test_a_tree_batch_size_without_a_tree_warns():
    """speculative.tree_max_batch_size only switches tree drafts to chains: with top_k 1 it
    does nothing, which the policy says instead of refusing."""
    tree = {"speculative__top_k": 2, "speculative__num_steps": 3, "speculative__num_draft_tokens": 8}
    chain = config(A.EAGLE, speculative__tree_max_batch_size=4)
    report = policy.check_config(chain, EVERYTHING)
    assert report.ok and "tree-batch-size-ignored" in report.warning_rules()
    text = next(w.render() for w in report.warnings if w.rule == "tree-batch-size-ignored")
    assert "speculative.tree_max_batch_size" in text and "speculative.top_k" in text
    trees = config(A.EAGLE, speculative__tree_max_batch_size=4, **tree)
    assert policy.check_config(trees, EVERYTHING).ok
    assert "tree-batch-size-ignored" not in warning_rules(trees)


def test_trees_in_large_batches_warn():
    """Legal but costly: trees in steps of TREE_COSTLY_BATCH requests or more."""
    tree = {"speculative__top_k": 4, "speculative__num_steps": 5, "speculative__num_draft_tokens": 16}
    big = config(A.EAGLE, scheduler__max_running_requests=32, **tree)
    report = policy.check_config(big, EVERYTHING)
    assert report.ok and "tree-large-batches" in report.warning_rules()
    text = next(w.render() for w in report.warnings if w.rule == "tree-large-batches")
    assert "speculative.tree_max_batch_size" in text and "16" in text and "32 requests" in text
    small = policy.TREE_COSTLY_BATCH - 1
    assert "tree-large-batches" not in warning_rules(
        config(A.EAGLE, scheduler__max_running_requests=32, speculative__tree_max_batch_size=small, **tree)
    )
    assert "tree-large-batches" not in warning_rules(config(A.EAGLE, scheduler__max_running_requests=small, **tree))
    assert "tree-large-batches" not in warning_rules(config(A.EAGLE, scheduler__max_running_requests=32))


@pytest.mark.parametrize(
    ("rule", "field", "bad", "good"),
    [
        (
            "num-steps-max",
            "speculative.num_steps",
            {"speculative__num_steps": 1_000_000, "speculative__num_draft_tokens": 1_000_001},
            {"speculative__num_steps": 32, "speculative__num_draft_tokens": 33},
        ),
        (
            "num-steps-max",
            "speculative.num_steps",
            {"speculative__num_steps": 33, "speculative__num_draft_tokens": 34},
            {"speculative__num_steps": 32, "speculative__num_draft_tokens": 33},
        ),
        (
            "num-draft-tokens-max",
            "speculative.num_draft_tokens",
            {"speculative__top_k": 16, "speculative__num_steps": 5, "speculative__num_draft_tokens": 1_000_001},
            {"speculative__top_k": 16, "speculative__num_steps": 5, "speculative__num_draft_tokens": 256},
        ),
        (
            "top-k-max",
            "speculative.top_k",
            {"speculative__top_k": 17, "speculative__num_steps": 2, "speculative__num_draft_tokens": 64},
            {"speculative__top_k": 16, "speculative__num_steps": 2, "speculative__num_draft_tokens": 64},
        ),
        ("lora-rank-max", "lora.max_rank", {"lora__max_rank": 2**40}, {"lora__max_rank": 512}),
    ],
)
def test_upper_bounds_name_field_and_fix(rule, field, bad, good):
    """1,000,001 draft tokens or a rank of 2^40 used to pass the policy and fail at run time."""
    report = policy.check_config(config(A.EAGLE3, **bad), EVERYTHING)
    found = [v for v in report.violations if v.rule == rule]
    assert len(found) == 1, report.violations
    assert found[0].field == field
    maximum = {
        "num-steps-max": policy.MAX_NUM_STEPS,
        "num-draft-tokens-max": policy.MAX_NUM_DRAFT_TOKENS,
        "top-k-max": policy.MAX_TOP_K,
        "lora-rank-max": policy.MAX_LORA_RANK,
    }[rule]
    assert f"must be at most {maximum}" in found[0].reason
    assert found[0].render().endswith(f"fix: set {field} to {maximum} or less")
    assert rule not in rules(config(A.EAGLE3, **{**bad, **good}))


def test_start_up_refuses_over_maximum(tmp_path, capsys):
    """Start up refuses values over the maximum naming the fix."""
    from loraserve.runtime.cli import main

    code = main(
        [
            *("--model", str(tmp_path), "--device", "cpu", "--speculative-algorithm", "NGRAM"),
            *("--num-steps", "1000000", "--num-draft-tokens", "1000001", "--max-lora-rank", str(2**40)),
            "--check-config",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "speculative.num_steps: must be at most 32, got 1000000" in err
    assert "set speculative.num_steps to 32 or less" in err
    assert "speculative.num_draft_tokens: must be at most 256, got 1000001" in err
    assert f"lora.max_rank: must be at most 512, got {2**40}" in err
