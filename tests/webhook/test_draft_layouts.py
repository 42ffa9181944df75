"""Draft layouts at admission: a draft architecture the runtime does not serve is refused by
the webhook with the reason (the same rule the runtime's start-up runs), and the published
layouts it serves are admitted. A multi-layer EAGLE head cannot be told from its architecture:
the start-up check refuses it from its config.json (tests/spec/test_published_drafts.py)."""

from __future__ import annotations

import pytest

from loraserve.operator import webhooks

PINNED = "0123456789abcdef0123456789abcdef01234567"


def _serve(algorithm: str, draft: str, architecture: str | None, **speculative) -> dict:
    model = {"source": f"hf://{draft}@{PINNED}"}
    if architecture:
        model["architecture"] = architecture
    return {
        "model": {"source": f"hf://meta-llama/Llama-3.1-8B-Instruct@{PINNED}"},
        "speculative": {"algorithm": algorithm, "draftModel": model, **speculative},
    }


@pytest.mark.parametrize(
    "algorithm,draft,architecture",
    [
        ("EAGLE3", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "LlamaForCausalLMEagle3"),
        ("EAGLE3", "AngelSlim/Qwen3-8B_eagle3", None),
        ("EAGLE3", "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", "Eagle3Speculator"),
        ("DFLASH", "z-lab/Qwen3-8B-DFlash-b16", "DFlashDraftModel"),
    ],
)
def test_published_layouts_are_admitted(algorithm, draft, architecture):
    extra = {"numDraftTokens": 16} if algorithm == "DFLASH" else {}
    verdict = webhooks.judge_serve(_serve(algorithm, draft, architecture, **extra), name="s")
    assert verdict.allowed, verdict.problems


@pytest.mark.parametrize(
    "algorithm,architecture,words",
    [
        ("NEXTN", "DeepSeekMTPModel", ["multi-token-prediction", "single-layer"]),
        ("DFLASH", "DSparkDraftModel", ["Markov head", "confidence head"]),
        ("DFLASH", "DFlash2DraftModel", ["DFlash2"]),
        ("EAGLE3", "DFlashDraftModel", ["loaded by DFLASH, not by EAGLE3"]),
    ],
)
def test_unserved_layouts_refused(algorithm, architecture, words):
    """Unserved layouts are refused with the reason."""
    extra = {"numDraftTokens": 16} if algorithm == "DFLASH" else {}
    verdict = webhooks.judge_serve(_serve(algorithm, "acme/draft", architecture, **extra), name="s")
    assert not verdict.allowed
    problem = next((p for p in verdict.problems if architecture in p), None)
    assert problem is not None, verdict.problems
    assert "spec.speculative.draftModel.architecture" in problem, problem
    assert all(w in problem for w in words), problem


def test_dspark_refusal_names_lack():
    """DSpark refusal names what the runtime lacks."""
    verdict = webhooks.judge_serve(_serve("DSPARK", "acme/qwen3-8b-dspark", None), name="s")
    problem = next((p for p in verdict.problems if "spec.speculative.algorithm" in p), None)
    assert problem is not None, verdict.problems
    for need in ("Markov head", "markov_w1", "confidence head", "dynamic ragged verify", "uniform width k"):
        assert need in problem, problem
