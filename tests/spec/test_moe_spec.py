"""Speculation on mixture-of-experts targets is lossless per adapter: greedy output with
each algorithm equals output without, for the base model and an adapter on attention,
experts and router, batched. Qwen3-MoE with n-gram, a dense Qwen3 STANDALONE draft and
EAGLE, EAGLE3 and DFLASH (the algorithms the policy serves on MoE targets,
``policy.families.MOE_SPEC_ALGORITHMS``); Mixtral with n-gram and a STANDALONE draft."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.sampling import SamplingParams

EXPERTS_AND_ROUTER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate")
TARGETS = {
    # name: (build_tiny_model kwargs, adapter target modules, draft architecture)
    "qwen3_moe": ({"architecture": "qwen3_moe", "head_dim": 16, "moe": {"norm_topk_prob": True}}, EXPERTS_AND_ROUTER, "qwen3"),
    "mixtral": ({"architecture": "mixtral", "intermediate_size": 48}, ("q_proj", "v_proj", "w1", "w2", "w3", "gate"), "llama"),
}
CASES = [
    ("qwen3_moe", "NGRAM", None),
    ("qwen3_moe", "STANDALONE", "small"),
    ("qwen3_moe", "STANDALONE", "copy"),  # an MoE draft: the target itself, accepted where unadapted
    ("qwen3_moe", "EAGLE", "eagle"),
    ("qwen3_moe", "EAGLE3", "eagle3"),
    ("qwen3_moe", "DFLASH", "dflash"),
    ("mixtral", "NGRAM", None),
    ("mixtral", "STANDALONE", "small"),
]


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory):
    from loraserve.runtime.dev.devmodels import build_adapter, build_draft_model, build_tiny_model, copy_model
    from loraserve.runtime.dev.dflash_builder import build_dflash_draft
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    root = tmp_path_factory.mktemp("moe_spec")
    out = {}
    for i, (name, (kwargs, modules, draft_arch)) in enumerate(TARGETS.items()):
        target = build_tiny_model(root / name / "target", num_layers=3, seed=61 + i, **kwargs)
        out[name] = {
            "target": target,
            "adapter": build_adapter(root / name / "all", target, rank=4, alpha=8, target_modules=modules, seed=62 + i),
            "small": build_draft_model(root / name / "small", target, architecture=draft_arch, seed=63 + i),
            "copy": copy_model(target, root / name / "copy"),
            "eagle": build_eagle_draft(root / name / "eagle", target, version=1, seed=65 + i, init_std=0.1),
            "dflash": build_dflash_draft(
                root / name / "dflash", target, target_layer_ids=[0, 1], block_size=4, seed=66 + i, init_std=0.1
            ),
            "eagle3": build_eagle_draft(
                root / name / "eagle3", target, version=3, aux_layer_ids=[1, 2, 3], seed=64 + i, init_std=0.1
            ),
        }
    return out


def _config(assets, algorithm: str = "NONE", draft: str | None = None) -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = str(assets["target"])
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.max_running_requests = 6
    config.lora.max_rank = 8  # peft's fused gate_up_proj holds twice r=4
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
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(6):
        n = int(torch.randint(4, 30, (1,), generator=gen))
        unit = torch.randint(3, 500, (3,), generator=gen)
        prompt = unit.repeat(n)[:n].tolist() if i % 2 else torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append((f"q{i}", prompt, SamplingParams(max_tokens=14, temperature=0.0), "all" if i % 3 else None))
    return out


@pytest.fixture(scope="module")
def baselines(moe_assets, engine_run):
    requests = _requests()
    out = {}
    for name, assets in moe_assets.items():
        run = engine_run(_config(assets), requests)
        out[name] = {rid: run.outputs[rid].tokens for rid, *_ in requests}
    return requests, out


@pytest.mark.parametrize(("target", "algorithm", "draft"), CASES)
def test_moe_speculation_is_lossless(target, algorithm, draft, moe_assets, engine_run, baselines):
    requests, expected = baselines
    run = engine_run(_config(moe_assets[target], algorithm, draft), requests)
    for rid, *_ in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[target][rid], rid
    assert any(len(tokens) == 14 for tokens in expected[target].values())
    for rid, *_ in requests:
        assert run.outputs[rid].spec is not None and run.outputs[rid].spec.verify_steps >= 1, rid
    if draft == "copy":  # the MoE draft is the base target: its unadapted drafts are accepted
        assert run.engine.decoder.metrics.snapshot().per_adapter[""].accept_rate > 0.9


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_moe_adapter_changes_output(target, baselines, moe_assets, engine_run):
    """The adapter matters on these targets: every adapted request differs from the same
    prompt without it somewhere in its output."""
    requests, _ = baselines
    _, prompt, params, _ = requests[1]
    run = engine_run(_config(moe_assets[target]), [("base", prompt, params, None), ("lora", prompt, params, "all")])
    assert run.outputs["base"].tokens != run.outputs["lora"].tokens
