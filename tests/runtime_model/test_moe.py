"""Mixture-of-experts bases (Qwen3-MoE, Mixtral): our torch MoE path against transformers
(+ peft) in float32 on tiny random configs, in extend, decode and verify; both checkpoint
layouts, both config spellings, and adapters on attention, experts and router in the
layouts peft writes."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.runtime.dev.devmodels import build_tiny_model
from loraserve.runtime.model.arch import load_arch_config

from .test_model_parity import _check_modes

SMALL = {"num_layers": 3, "hidden_size": 64, "intermediate_size": 96, "head_dim": 16}
MOE_MODELS = {
    # name: build_tiny_model kwargs
    "qwen3-moe": {"architecture": "qwen3_moe", "seed": 31, "moe": {"norm_topk_prob": False, "mlp_only_layers": [1]}},
    "qwen3-moe-norm": {"architecture": "qwen3_moe", "seed": 32, "moe": {"norm_topk_prob": True}},
    "mixtral": {"architecture": "mixtral", "seed": 33, "intermediate_size": 48},
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_models")
    return {name: build_tiny_model(root / name, **{**SMALL, **kw}) for name, kw in MOE_MODELS.items()}


def test_moe_configs_are_read(moe_models):
    qwen = load_arch_config(moe_models["qwen3-moe"])
    assert (qwen.family, qwen.qk_norm) == ("qwen3_moe", True)
    assert qwen.moe.sparse_layers == (0, 2) and qwen.moe.intermediate_size == 48
    assert (qwen.moe.num_experts, qwen.moe.top_k, qwen.moe.norm_topk_prob) == (4, 2, False)
    mixtral = load_arch_config(moe_models["mixtral"])
    assert mixtral.moe.sparse_layers == (0, 1, 2) and mixtral.moe.norm_topk_prob
    assert mixtral.moe.intermediate_size == 48 and not mixtral.qk_norm


@pytest.mark.parametrize("kind", sorted(MOE_MODELS))
def test_moe_logits_match_transformers(kind, moe_models, make_runner, hf_model, ops):
    runner = make_runner(moe_models[kind])
    with torch.no_grad():
        _check_modes(runner, hf_model(moe_models[kind]), ops, seed=2)


def _fuse_experts(src, dest):
    """Copy a per-expert checkpoint (as transformers saves it, as published) into the fused
    layout transformers 5 holds in memory: ``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows
    first), ``mlp.experts.down_proj [E, H, I]``, Mixtral's ``block_sparse_moe`` as ``mlp``."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    tensors = load_file(str(src / "model.safetensors"))
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m is None:
            out[name] = tensor
            continue
        proj = names.get(m.group(3), m.group(3))
        per_expert.setdefault(m.group(1), {}).setdefault(proj, {})[int(m.group(2))] = tensor
    for prefix, projs in per_expert.items():
        experts = sorted(projs["down_proj"])
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in experts]
        )
        out[f"{prefix}.down_proj"] = torch.stack([projs["down_proj"][e] for e in experts])
    save_file(out, str(dest / "model.safetensors"))
    return dest


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_fused_checkpoint_layout_loads_the_same(kind, moe_models, make_runner, tmp_path, ops):
    fused = _fuse_experts(moe_models[kind], tmp_path / "fused")
    per_expert, stacked = make_runner(moe_models[kind]), make_runner(fused)
    for a, b in zip(per_expert.model.parameters(), stacked.model.parameters(), strict=True):
        assert torch.equal(a, b)
    prompt = torch.arange(3, 20)
    with torch.no_grad():
        one = ops.extend(per_expert, ["r"], [prompt]).logits
        two = ops.extend(stacked, ["r"], [prompt]).logits
    torch.testing.assert_close(one, two, atol=0, rtol=0)


def test_hub_spelling_of_expert_count(moe_models, tmp_path):
    """Qwen3-MoE as published on the hub says ``num_experts``; transformers 5 writes
    ``num_local_experts``: both read alike."""
    raw = json.loads((moe_models["qwen3-moe"] / "config.json").read_text())
    assert "num_local_experts" in raw  # what the installed transformers writes
    raw["num_experts"] = raw.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_arch_config(tmp_path) == load_arch_config(moe_models["qwen3-moe"])


def test_incomplete_expert_checkpoint_is_named(moe_models, make_runner, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from loraserve.runtime.model.llama import WeightLoadError

    shutil.copytree(moe_models["mixtral"], tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        make_runner(tmp_path / "m")
