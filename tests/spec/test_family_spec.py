"""Speculation on every served model family is lossless per adapter: greedy output with each
algorithm equals output without, for the base model and an adapter on every module the
family has, batched.

- Qwen3 (per-head q/k norms): n-gram, a Qwen3 STANDALONE draft, EAGLE3.
- Gemma 3 (sliding and global layers, ``(1 + w)`` norms, the embedding scale, a final logit
  cap): n-gram, a Gemma 3 STANDALONE draft, EAGLE, EAGLE3 and DFLASH. The EAGLE/DFLASH drafts
  read the target's unscaled token embedding, as published EAGLE3 heads for Gemma do (vLLM's
  ``llama_eagle3.py`` embeds without Gemma's scale); that choice moves acceptance only.
- Gemma 2 (no head norms, one rope base, attention scores soft-capped at 2.0 so the cap bends
  them, sliding and global layers, a final logit cap): n-gram and EAGLE3.
- Qwen3-MoE: n-gram, a dense Qwen3 STANDALONE draft and an MoE one (the target itself), EAGLE,
  EAGLE3 and DFLASH (``policy.families.MOE_SPEC_ALGORITHMS``); Mixtral: n-gram and STANDALONE.
- Phi-4-mini-like Phi-3 (fused checkpoint tensors, three quarters of each head rotating, LongRoPE
  served with its long factors: the context exceeds the original maximum; an adapter on the
  fused qkv_proj / gate_up_proj; untied embeddings: a tiny random tied model repeats its input): n-gram, a Phi-3 STANDALONE draft, EAGLE3 and
  DFLASH. The EAGLE3 / DFLASH heads copy the target's rope (partial, LongRoPE), as their builders
  copy every target's.
- Qwen2-MoE (a gated shared expert beside the routed ones, q/k/v biases, a dense layer between
  sparse ones; the adapter on attention, the shared expert and its gate through peft's
  ``target_modules``, the routed experts and the router through ``target_parameters``): n-gram
  and EAGLE3.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES, PHI3_LINEAR_MODULES
from loraserve.runtime.sampling import SamplingParams

MAX_TOKENS = 14


@dataclass(frozen=True)
class Family:
    """A tiny target of one family, the modules its adapter targets, and its drafts' family."""

    model: dict
    modules: tuple[str, ...]
    draft_architecture: str
    parameters: tuple[str, ...] = ()  # peft target_parameters (an MoE model's fused experts)


GEMMA = {
    "architecture": "gemma3",
    "num_layers": 4,  # sliding, global, sliding, global
    "head_dim": 16,
    "intermediate_size": 96,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "moe": {"query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0},
}
GEMMA2 = {
    "architecture": "gemma2",
    "num_layers": 4,  # sliding, global, sliding, global; one rope base
    "head_dim": 16,
    "intermediate_size": 96,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,  # scores large enough for the cap to bend them
    "moe": {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0},
}
_FACTORS = torch.Generator().manual_seed(5)
PHI4 = {
    "architecture": "phi3",
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_scaling": {
        "rope_type": "longrope",
        "short_factor": (1 + torch.rand(6, generator=_FACTORS)).tolist(),  # 12 of 16 dims rotate: 6 pairs
        "long_factor": (1 + 8 * torch.rand(6, generator=_FACTORS)).tolist(),
    },
    "moe": {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128},
}
FAMILIES = {
    "qwen3": Family({"architecture": "qwen3", "head_dim": 32}, ALL_LINEAR_MODULES, "qwen3"),
    "gemma3": Family(GEMMA, ALL_LINEAR_MODULES, "gemma3"),
    "gemma2": Family(GEMMA2, ALL_LINEAR_MODULES, "gemma2"),
    "qwen3_moe": Family(
        {"architecture": "qwen3_moe", "head_dim": 16, "moe": {"norm_topk_prob": True}},
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"),
        "qwen3",
    ),
    "mixtral": Family(
        {"architecture": "mixtral", "intermediate_size": 48}, ("q_proj", "v_proj", "w1", "w2", "w3", "gate"), "llama"
    ),
    "phi3": Family(PHI4, PHI3_LINEAR_MODULES, "phi3"),
    "qwen2_moe": Family(
        {"architecture": "qwen2_moe", "moe": {"mlp_only_layers": [1]}},
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"),
        "qwen2",
        ("gate_up_proj", "down_proj", "gate.weight"),
    ),
}
CASES = [
    ("qwen3", "NGRAM", None),
    ("qwen3", "STANDALONE", "small"),
    ("qwen3", "EAGLE3", "eagle3"),
    ("gemma3", "NGRAM", None),
    ("gemma3", "STANDALONE", "small"),
    ("gemma3", "EAGLE", "eagle"),
    ("gemma3", "EAGLE3", "eagle3"),
    ("gemma3", "DFLASH", "dflash"),
    ("gemma2", "NGRAM", None),
    ("gemma2", "EAGLE3", "eagle3"),
    ("qwen3_moe", "NGRAM", None),
    ("qwen3_moe", "STANDALONE", "small"),
    ("qwen3_moe", "STANDALONE", "copy"),  # an MoE draft: the target itself, accepted where unadapted
    ("qwen3_moe", "EAGLE", "eagle"),
    ("qwen3_moe", "EAGLE3", "eagle3"),
    ("qwen3_moe", "DFLASH", "dflash"),
    ("mixtral", "NGRAM", None),
    ("mixtral", "STANDALONE", "small"),
    ("phi3", "NGRAM", None),
    ("phi3", "STANDALONE", "small"),
    ("phi3", "EAGLE3", "eagle3"),
    ("phi3", "DFLASH", "dflash"),
    ("qwen2_moe", "NGRAM", None),
    ("qwen2_moe", "EAGLE3", "eagle3"),
]


def _draft(kind: str, here, target, family: Family, seed: int):
    """Build the draft ``kind`` names for ``target`` under ``here``."""
    from loraserve.runtime.dev.devmodels import build_draft_model, copy_model
    from loraserve.runtime.dev.dflash_builder import build_dflash_draft
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    if kind == "small":
        return build_draft_model(here / kind, target, architecture=family.draft_architecture, seed=seed)
    if kind == "copy":
        return copy_model(target, here / kind)
    if kind == "eagle":
        return build_eagle_draft(here / kind, target, version=1, seed=seed, init_std=0.1)
    if kind == "eagle3":
        return build_eagle_draft(here / kind, target, version=3, aux_layer_ids=[1, 2, 3], seed=seed, init_std=0.1)
    assert kind == "dflash", kind
    return build_dflash_draft(here / kind, target, target_layer_ids=[0, 1], block_size=4, seed=seed, init_std=0.1)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Per family: the target, an adapter on its modules, and the drafts its cases name."""
    from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model

    root = tmp_path_factory.mktemp("family_spec")
    out = {}
    for i, (name, family) in enumerate(FAMILIES.items()):
        seed, here = 61 + 10 * i, root / name
        target = build_tiny_model(here / "target", **{"num_layers": 3, "seed": seed, **family.model})
        adapter = build_adapter(
            here / "all",
            target,
            rank=4,
            alpha=8,
            target_modules=family.modules,
            target_parameters=family.parameters,
            seed=seed + 1,
        )
        drafts = sorted({d for f, _, d in CASES if f == name and d})
        out[name] = {
            "target": target,
            "adapter": adapter,
            **{d: _draft(d, here, target, family, seed + 2 + j) for j, d in enumerate(drafts)},
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
    """Six prompts of 4..29 tokens, half of them repeating (n-gram drafts get accepted), two
    thirds under the adapter."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(6):
        n = int(torch.randint(4, 30, (1,), generator=gen))
        unit = torch.randint(3, 500, (3,), generator=gen)
        prompt = unit.repeat(n)[:n].tolist() if i % 2 else torch.randint(3, 500, (n,), generator=gen).tolist()
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        out.append((f"q{i}", prompt, params, "all" if i % 3 else None))
    return out


@pytest.fixture(scope="module")
def baselines(assets, engine_run):
    requests = _requests()
    out = {}
    for name, family_assets in assets.items():
        run = engine_run(_config(family_assets), requests)
        out[name] = {rid: run.outputs[rid].tokens for rid, *_ in requests}
    return requests, out


@pytest.mark.parametrize(("family", "algorithm", "draft"), CASES)
def test_speculation_is_lossless(family, algorithm, draft, assets, engine_run, baselines):
    requests, expected = baselines
    run = engine_run(_config(assets[family], algorithm, draft), requests)
    for rid, *_ in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[family][rid], rid
        assert out.spec is not None and out.spec.verify_steps >= 1, rid
    assert any(len(tokens) == MAX_TOKENS for tokens in expected[family].values())
    if draft == "copy":  # the MoE draft is the base target: its unadapted drafts are accepted
        assert run.engine.decoder.metrics.snapshot().per_adapter[""].accept_rate > 0.9


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adapter_changes_output(family, baselines, assets, engine_run):
    """The adapter matters on every target: the same prompt with and without it differs."""
    requests, _ = baselines
    _, prompt, params, _ = requests[1]
    run = engine_run(_config(assets[family]), [("base", prompt, params, None), ("lora", prompt, params, "all")])
    assert run.outputs["base"].tokens != run.outputs["lora"].tokens
