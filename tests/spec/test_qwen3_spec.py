"""Speculation on a Qwen3 target is lossless per adapter: greedy output with each algorithm
equals output without, for the base model and an adapter on every linear module, batched."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.sampling import SamplingParams

CASES = {
    "ngram": ("NGRAM", None),
    "standalone-qwen3": ("STANDALONE", "small"),
    "eagle3": ("EAGLE3", "eagle3"),
}


@pytest.fixture(scope="module")
def qwen3_assets(tmp_path_factory):
    from loraserve.runtime.dev.devmodels import (
        ALL_LINEAR_MODULES,
        build_adapter,
        build_draft_model,
        build_tiny_model,
    )
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    root = tmp_path_factory.mktemp("qwen3_spec")
    target = build_tiny_model(root / "target", architecture="qwen3", num_layers=3, head_dim=32, seed=41)
    return {
        "target": target,
        "adapter": build_adapter(
            root / "all", target, rank=8, alpha=16, target_modules=ALL_LINEAR_MODULES, seed=42
        ),
        "small": build_draft_model(root / "small", target, architecture="qwen3", seed=43),
        "eagle3": build_eagle_draft(
            root / "eagle3", target, version=3, aux_layer_ids=[1, 2, 3], seed=44, init_std=0.1
        ),
    }


def _config(assets, algorithm: str = "NONE", draft: str | None = None) -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = str(assets["target"])
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.max_running_requests = 6
    config.lora.max_rank = 8
    config.lora.target_modules = LORA_MODULES
    config.lora.backend = "torch"
    config.lora.adapters = {"all": str(assets["adapter"])}
    config.speculative.algorithm = SpecAlgorithm(algorithm)
    if algorithm != "NONE":
        config.speculative.num_steps, config.speculative.num_draft_tokens = 3, 4
        if draft is not None:
            config.speculative.draft_model_path = str(assets[draft])
    return config


def _requests():
    gen = torch.Generator().manual_seed(5)
    out = []
    for i in range(6):
        n = int(torch.randint(4, 30, (1,), generator=gen))
        unit = torch.randint(3, 500, (3,), generator=gen)
        prompt = unit.repeat(n)[:n].tolist() if i % 2 else torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append(
            (f"q{i}", prompt, SamplingParams(max_tokens=14, temperature=0.0), "all" if i % 3 else None)
        )
    return out


@pytest.fixture(scope="module")
def baseline(qwen3_assets, engine_run):
    requests = _requests()
    run = engine_run(_config(qwen3_assets), requests)
    return requests, {rid: run.outputs[rid].tokens for rid, *_ in requests}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen3_speculation_is_lossless(case, qwen3_assets, engine_run, baseline):
    requests, expected = baseline
    run = engine_run(_config(qwen3_assets, *CASES[case]), requests)
    for rid, *_ in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], rid
    assert any(len(tokens) == 14 for tokens in expected.values())


def test_qwen3_adapter_changes_output(baseline, qwen3_assets, engine_run):
    """The adapter matters on this target: the same prompt with and without it differs."""
    requests, _ = baseline
    _, prompt, params, _ = requests[0]
    run = engine_run(_config(qwen3_assets), [("base", prompt, params, None), ("lora", prompt, params, "all")])
    assert run.outputs["base"].tokens != run.outputs["lora"].tokens
