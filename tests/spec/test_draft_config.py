"""The draft's configuration is its own copy; bad speculative settings name their field."""

from __future__ import annotations

import dataclasses

import pytest

from loraserve.runtime.contract.capabilities import CAPABILITIES, Capabilities
from loraserve.runtime.contract.config import RaggedVerify, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.contract.policy import check_config, resolve_speculative
from loraserve.runtime.speculative.draft_config import (
    SpeculativeConfigError,
    build_draft_config,
    check_speculative,
)


def resolve_algorithm(requested, architecture=None):
    return resolve_speculative(requested, architecture)[0]


def _target() -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = "/models/target"
    config.model.served_name = "base"
    config.model.context_length = 4096
    config.lora.adapters = {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    config.lora.pinned = ("sql",)
    config.speculative.algorithm = SpecAlgorithm.EAGLE3
    config.speculative.draft_model_path = "/models/eagle3"
    config.speculative.draft_load_format = "dummy"
    return config


def test_target_is_unchanged_and_never_aliased():
    target = _target()
    before = target.to_dict()
    draft = build_draft_config(target)
    assert target.to_dict() == before
    # Mutating every nested part of the draft leaves the target alone.
    draft.lora.adapters["x"] = "/y"
    draft.speculative.num_steps = 9
    draft.scheduler.max_running_requests = 1
    draft.model.path = "/elsewhere"
    assert target.to_dict() == before
    for part in dataclasses.fields(RuntimeConfig):
        value = getattr(target, part.name)
        if dataclasses.is_dataclass(value):
            assert getattr(draft, part.name) is not value


def test_draft_own_model_no_adapters():
    """Draft takes its own model and no adapters."""
    target = _target()
    draft = build_draft_config(target, context_length=8192)
    assert draft.model.path == target.speculative.draft_model_path
    assert draft.model.served_name is None
    assert draft.model.context_length == 8192
    assert draft.model.dtype == target.model.dtype
    assert draft.lora.enabled is False and draft.lora.adapters == {} and draft.lora.pinned == ()
    assert target.lora.enabled is True
    if hasattr(draft.model, "load_format"):
        assert draft.model.load_format == "dummy"
        assert target.model.load_format != "dummy"


def test_context_length_follows_target():
    """Context length follows the target when not given."""
    target = _target()
    assert build_draft_config(target).model.context_length == target.model.context_length


def test_ngram_needs_no_draft_path():
    target = _target()
    target.speculative.algorithm = SpecAlgorithm.NGRAM
    target.speculative.draft_model_path = None
    assert check_speculative(target).speculative.algorithm is SpecAlgorithm.NGRAM


def test_nextn_resolves_to_eagle():
    assert resolve_algorithm(SpecAlgorithm.NEXTN) is SpecAlgorithm.EAGLE
    assert resolve_algorithm("EAGLE3") is SpecAlgorithm.EAGLE3


@pytest.mark.parametrize("requested", [SpecAlgorithm.NEXTN, SpecAlgorithm.EAGLE])
def test_gemma4_draft_resolves_as_policy(requested):
    """The decoder and the admission policy resolve alike: EAGLE/NEXTN with a Gemma-4
    assistant draft is FROZEN_KV_MTP, which this image does not run, and both say so."""
    target = _target()
    target.speculative.algorithm = requested
    target.speculative.draft_model_architecture = "Gemma4AssistantForCausalLM"
    assert resolve_algorithm(requested, "Gemma4AssistantForCausalLM") is SpecAlgorithm.FROZEN_KV_MTP
    with pytest.raises(SpeculativeConfigError, match="FROZEN_KV_MTP") as err:
        check_speculative(target)
    assert err.value.field == "speculative.algorithm"
    assert f"{requested.value} with the Gemma-4 assistant draft" in str(err.value)
    assert "algorithm-unavailable" in check_config(target).rules()


def test_runnable_algorithms_from_table():
    """Flipping an algorithm in the image's capabilities is what lets the decoder run it."""
    target = _target()
    assert check_speculative(target, CAPABILITIES).speculative.algorithm is SpecAlgorithm.EAGLE3
    without = Capabilities(algorithms=CAPABILITIES.algorithms - {SpecAlgorithm.EAGLE3})
    with pytest.raises(SpeculativeConfigError, match="algorithm EAGLE3; this image implements") as err:
        check_speculative(target, without)
    assert "EAGLE3" not in str(err.value).split("this image implements")[1]


@pytest.mark.parametrize(
    "change,field",
    [
        ({"top_k": 0}, "speculative.top_k"),
        ({"algorithm": SpecAlgorithm.NGRAM, "draft_model_path": None, "top_k": 2}, "speculative.top_k"),
        ({"draft_load_format": "pt"}, "speculative.draft_load_format"),
        ({"num_draft_tokens": 8}, "speculative.num_draft_tokens"),
        # top_k 2 over 3 steps offers 2 + 2 * 4 = 10 candidates: 11 verified tokens at most.
        ({"top_k": 2, "num_steps": 3, "num_draft_tokens": 12}, "speculative.num_draft_tokens"),
        ({"top_k": 2, "num_steps": 3, "num_draft_tokens": 1}, "speculative.num_draft_tokens"),
        ({"num_steps": 0, "num_draft_tokens": 1}, "speculative.num_steps"),
        ({"ragged_verify": RaggedVerify.DYNAMIC}, "speculative.ragged_verify"),
        ({"adaptive": True}, "speculative.adaptive"),
        ({"draft_model_path": None}, "speculative.draft_model_path"),
        ({"algorithm": SpecAlgorithm.DSPARK}, "speculative.algorithm"),
        ({"algorithm": SpecAlgorithm.NONE}, "speculative.algorithm"),
        ({"algorithm": SpecAlgorithm.NGRAM, "ngram_min": 3, "ngram_max": 2}, "speculative.ngram_min"),
    ],
)
def test_bad_settings_name_the_field(change, field):
    target = _target()
    before = target.to_dict()
    for key, value in change.items():
        setattr(target.speculative, key, value)
    with pytest.raises(SpeculativeConfigError, match=field.split(".")[1]) as err:
        build_draft_config(target)
    assert err.value.field == field
    # Nothing was half-applied: every field not changed above is as it was.
    after = target.to_dict()
    for key in change:
        after["speculative"][key] = before["speculative"][key]
    assert after == before


def test_tree_drafts_build_for_eagle_family_only():
    target = _target()
    target.speculative.top_k, target.speculative.num_steps, target.speculative.num_draft_tokens = 2, 3, 11
    draft = build_draft_config(target)
    assert (draft.speculative.top_k, draft.speculative.num_draft_tokens) == (2, 11)
    target.speculative.algorithm, target.speculative.draft_model_path = SpecAlgorithm.NGRAM, None
    with pytest.raises(SpeculativeConfigError, match="NGRAM drafts a chain, not a tree") as err:
        build_draft_config(target)
    assert err.value.field == "speculative.top_k"
