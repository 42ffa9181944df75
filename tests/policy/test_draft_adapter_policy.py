"""The compatibility policy's draft adapter rules, each in both directions.

An Adapter's draft adapter (``AdapterDeclaration.draft``) against its serve's draft
(algorithm: a STANDALONE draft or an EAGLE / EAGLE3 head; pool, rank, modules), and the serve's draft adapter pool itself
(``speculative.draft_max_loras`` / ``draft_max_lora_rank``). Messages are checked as the
webhook renders them, in the user's field names, with the fix named.
"""

from __future__ import annotations

import pytest

from loraserve.operator import specs, translate
from loraserve.runtime.contract import policy
from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.contract.policy import AdapterDeclaration, DraftAdapterDeclaration, Kind

A = SpecAlgorithm
DRAFT = DraftAdapterDeclaration()


def serve(
    algorithm: SpecAlgorithm = A.STANDALONE, *, pool: int = 4, rank: int = 16, **changes
) -> RuntimeConfig:
    """A valid serve of ``algorithm`` with a draft adapter pool of ``pool`` slots."""
    c = RuntimeConfig()
    c.model.path = "/models/base"
    c.speculative.algorithm = algorithm
    if algorithm.needs_draft_model:
        c.speculative.draft_model_path = "/models/draft"
    c.speculative.draft_max_loras = pool
    c.speculative.draft_max_lora_rank = rank
    for key, value in changes.items():
        section, _, name = key.partition("__")
        setattr(getattr(c, section), name, value)
    return c


def judge(c: RuntimeConfig, draft: DraftAdapterDeclaration | None = DRAFT) -> policy.Report:
    return policy.check_adapter(c, AdapterDeclaration("sql", draft=draft))


def rendered(report: policy.Report) -> list[str]:
    """The violations as the webhook shows them (an Adapter's and a LoRAServe's fields)."""
    return [v.render(translate.crd_path) for v in report.violations]


# --------------------------------------------------------------------------- an Adapter's draft


def test_draft_adapter_fits_standalone_pool():
    """A draft adapter fits a standalone serve with a pool."""
    assert judge(serve()).ok
    assert judge(serve(), DraftAdapterDeclaration(rank=16, target_modules=DEFAULT_LORA_MODULES)).ok


def test_no_draft_adapter_needs_no_pool():
    """An adapter without a draft adapter needs no pool."""
    for algorithm in A:
        assert not {r for r in judge(serve(algorithm, pool=0), None).rules() if r.startswith("adapter-draft")}


def test_ngram_has_no_draft_model_to_adapt():
    report = judge(serve(A.NGRAM))
    assert report.rules() == {"adapter-draft-no-draft-model"}
    (message,) = rendered(report)
    assert message.startswith("spec.draft: NGRAM drafts from the prompt: there is no draft model to adapt")
    assert "fix: remove spec.draft" in message


def test_no_speculation_no_draft_model():
    """A serve without speculation has no draft model."""
    report = judge(serve(A.NONE))
    assert report.rules() == {"adapter-draft-no-draft-model"}
    assert "spec.speculative.algorithm NONE" in rendered(report)[0]


@pytest.mark.parametrize("algorithm", [A.EAGLE, A.EAGLE3, A.NEXTN])
def test_eagle_head_takes_draft_adapter(algorithm):
    """An EAGLE head takes a draft adapter on its own layers."""
    assert judge(serve(algorithm)).ok
    head = (*DEFAULT_LORA_MODULES, "fc")
    assert judge(serve(algorithm), DraftAdapterDeclaration(rank=16, target_modules=head)).ok
    report = judge(serve(algorithm, pool=0), DraftAdapterDeclaration(rank=32))
    assert report.rules() == {"adapter-draft-no-pool", "adapter-draft-rank-too-large"}


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_eagle_shared_embeddings_unadapted(module):
    """An EAGLE head shares the targets embeddings which stay unadapted."""
    report = judge(serve(A.EAGLE3), DraftAdapterDeclaration(target_modules=("fc", module)))
    assert report.rules() == {"adapter-draft-modules-not-served"}
    (message,) = rendered(report)
    assert message.startswith(
        f"spec.draft.targetModules: targets {module}, which an EAGLE3 head's draft adapter pool does not wrap"
    )
    assert "shares the target's base embed_tokens and lm_head" in message
    assert f"fix: retrain the draft adapter without {module}" in message


def test_only_a_heads_pool_wraps_fc():
    report = judge(serve(), DraftAdapterDeclaration(target_modules=("q_proj", "fc")))
    assert report.rules() == {"adapter-draft-modules-not-served"}
    assert "targets fc, which the draft adapter pool does not wrap" in rendered(report)[0]


@pytest.mark.parametrize("algorithm", [A.DFLASH, A.DSPARK])
def test_block_drafts_take_no_adapters(algorithm):
    """Block drafts take no adapters in this version."""
    report = judge(serve(algorithm))
    assert report.rules() == {"adapter-draft-algorithm"}
    (violation,) = report.violations
    assert violation.kind is Kind.UNAVAILABLE  # a later version may serve them
    message = rendered(report)[0]
    assert "draft adapters serve STANDALONE drafts and EAGLE / EAGLE3 heads in this version" in message
    assert message.startswith("spec.draft: not available in this runtime:")
    assert "fix: remove spec.draft, or serve the adapter from a STANDALONE, EAGLE or EAGLE3 serve" in message


def test_standalone_without_pool_names_fix():
    """A standalone serve without a pool names the fix."""
    report = judge(serve(pool=0))
    assert report.rules() == {"adapter-draft-no-pool"}
    (message,) = rendered(report)
    assert "spec.speculative.draftLora.maxLoras is 0" in message
    assert "fix: set spec.speculative.draftLora.maxLoras to 1 or more" in message


def test_a_declared_draft_rank_fits_the_pool_rank():
    assert judge(serve(rank=32), DraftAdapterDeclaration(rank=32)).ok
    report = judge(serve(rank=16), DraftAdapterDeclaration(rank=32))
    assert report.rules() == {"adapter-draft-rank-too-large"}
    (message,) = rendered(report)
    assert message.startswith(
        "spec.draft.rank: draft rank 32 exceeds spec.speculative.draftLora.maxRank (16)"
    )
    assert "raise spec.speculative.draftLora.maxRank to at least 32" in message
    assert judge(serve(), DraftAdapterDeclaration(rank=0)).rules() == {"adapter-draft-rank"}


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_the_draft_pool_wraps_no_embeddings(module):
    report = judge(serve(), DraftAdapterDeclaration(target_modules=("q_proj", module)))
    assert report.rules() == {"adapter-draft-modules-not-served"}
    (message,) = rendered(report)
    assert message.startswith(f"spec.draft.targetModules: targets {module}, which the draft adapter pool")
    assert f"retrain the draft adapter without {module}" in message


def test_bad_draft_modules_refused():
    """Unknown or repeated draft modules are refused."""
    report = judge(serve(), DraftAdapterDeclaration(target_modules=("q_proj", "q_proj", "w_pack")))
    assert report.rules() == {"adapter-draft-modules"}


def test_every_misfit_is_collected():
    report = judge(serve(pool=0, rank=8), DraftAdapterDeclaration(rank=16, target_modules=("lm_head",)))
    assert report.rules() == {
        "adapter-draft-no-pool",
        "adapter-draft-rank-too-large",
        "adapter-draft-modules-not-served",
    }


def test_target_adapter_rules_still_apply():
    """The target adapters rules still apply beside the draft."""
    c = serve(A.NGRAM, lora__max_rank=8)
    report = policy.check_adapter(c, AdapterDeclaration("sql", rank=16, draft=DRAFT))
    assert report.rules() == {"adapter-rank-too-large", "adapter-draft-no-draft-model"}


# --------------------------------------------------------------------------- the serve's pool


def test_a_standalone_pool_is_servable():
    report = policy.check_config(serve())
    assert report.ok and not {w.rule for w in report.warnings if w.rule.startswith("draft-lora")}


@pytest.mark.parametrize("algorithm", [A.EAGLE, A.EAGLE3, A.NEXTN])
def test_a_pool_for_an_eagle_head_is_servable(algorithm):
    report = policy.check_config(serve(algorithm))
    assert report.ok, report.rules()


@pytest.mark.parametrize("algorithm", [A.DFLASH])
def test_pool_for_adapterless_draft_unavailable(algorithm):
    """A pool for a draft that takes no adapters is unavailable."""
    report = policy.check_config(serve(algorithm))
    assert "draft-lora-algorithm" in report.rules()
    (violation,) = [v for v in report.violations if v.rule == "draft-lora-algorithm"]
    assert violation.kind is Kind.UNAVAILABLE
    message = violation.render(translate.crd_path)
    assert "draft adapters serve STANDALONE drafts and EAGLE / EAGLE3 heads in this version" in message
    assert "draft-lora-algorithm" not in policy.check_config(serve(algorithm, pool=0)).rules()


@pytest.mark.parametrize("algorithm", [A.NONE, A.NGRAM])
def test_pool_without_draft_model_warns(algorithm):
    """A pool without a draft model is ignored with a warning."""
    # Harmless (no pool is built for a draft that does not exist), so warned, as a draft model
    # named for NGRAM is, rather than refused.
    report = policy.check_config(serve(algorithm))
    assert report.ok
    assert "draft-lora-ignored" in report.warning_rules()
    assert "draft-lora-ignored" not in policy.check_config(serve(algorithm, pool=0)).warning_rules()
    if algorithm is A.NGRAM:
        (warning,) = [w for w in report.warnings if w.rule == "draft-lora-ignored"]
        assert "NGRAM drafts from the prompt: there is no draft model to adapt" in warning.render()


def test_pool_with_lora_off_warns():
    """A pool with LoRA off is ignored with a warning."""
    report = policy.check_config(serve(lora__enabled=False))
    assert report.ok and "draft-lora-ignored" in report.warning_rules()


def test_pool_bounds_are_the_policys():
    assert policy.MINIMUM["speculative.draft_max_loras"] == 0
    assert policy.MAXIMUM["speculative.draft_max_loras"] == policy.MAX_DRAFT_LORAS
    assert "draft-lora-slots-max" in policy.check_config(serve(pool=policy.MAX_DRAFT_LORAS + 1)).rules()
    assert "draft-lora-slots" in policy.check_config(serve(pool=-1)).rules()
    assert "draft-lora-rank" in policy.check_config(serve(rank=0)).rules()
    assert "draft-lora-rank-max" in policy.check_config(serve(rank=policy.MAX_LORA_RANK + 1)).rules()


def test_draft_slots_fit_the_host_cache():
    assert "draft-lora-slots-cache" in policy.check_config(serve(pool=8, lora__max_loaded_loras=4)).rules()
    assert policy.check_config(serve(pool=4, lora__max_loaded_loras=4, lora__max_loras_per_batch=4)).ok


def test_spec_model_defaults_and_bounds():
    """The spec model takes its defaults and bounds from the config and policy."""
    spec = specs.parse_loraserve_spec({"model": {"source": "/m"}})
    assert (spec.speculative.draft_lora.max_loras, spec.speculative.draft_lora.max_rank) == (0, 16)
    with pytest.raises(specs.SpecError, match=r"spec\.speculative\.draftLora\.maxLoras"):
        specs.parse_loraserve_spec(
            {"model": {"source": "/m"}, "speculative": {"draftLora": {"maxLoras": 65}}}
        )
    config = translate.to_runtime_config(
        specs.parse_loraserve_spec(
            {"model": {"source": "/m"}, "speculative": {"draftLora": {"maxLoras": 3, "maxRank": 32}}}
        )
    )
    assert (config.speculative.draft_max_loras, config.speculative.draft_max_lora_rank) == (3, 32)


def test_adapter_declaration_carries_draft():
    """The adapter declaration carries the draft."""
    spec = specs.parse_adapter_spec(
        {
            "serve": "s",
            "source": "/adapters/sql",
            "draft": {"source": "/adapters/sql-draft", "rank": 8, "targetModules": ["q_proj", "v_proj", "fc"]},
        }
    )
    declaration = translate.adapter_declaration("sql", spec)
    assert declaration.draft == DraftAdapterDeclaration(rank=8, target_modules=("q_proj", "v_proj", "fc"))
    assert translate.adapter_declaration("sql", spec.model_copy(update={"draft": None})).draft is None
