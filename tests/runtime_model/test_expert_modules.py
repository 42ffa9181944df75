"""Router and expert names in ``lora.target_modules``: a pool declared with Mixtral's w1 / w3 /
w2 and the router (or the fused ``gate_up_proj``) holds the expert slots those names stand for,
and serves peft's adapters equal to transformers + peft in float32."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import DENSE_LORA_MODULES, LORA_MODULES, pool_modules
from loraserve.runtime.dev.devmodels import build_tiny_model

from .test_model_parity import _check_modes

SMALL = {"num_layers": 2, "hidden_size": 64, "intermediate_size": 48, "head_dim": 16}


def test_pool_modules():
    assert pool_modules(["q_proj", "w1", "w3", "w2", "gate"]) == ("q_proj", "gate_proj", "up_proj", "down_proj")
    assert pool_modules(["gate_up_proj"]) == ("gate_proj", "up_proj")
    assert pool_modules(["gate"]) == ()  # the router: every MoE layer's router always has its slot
    assert pool_modules(LORA_MODULES) == DENSE_LORA_MODULES


CASES = {
    # name: (architecture, the adapter's peft target_modules, the serve's lora.target_modules)
    "mixtral": ("mixtral", ("q_proj", "w1", "w2", "w3", "gate"), ("q_proj", "w1", "w3", "w2", "gate")),
    "qwen3-moe": ("qwen3_moe", ("v_proj", "gate_proj", "up_proj", "down_proj", "gate"), ("v_proj", "gate_up_proj", "down_proj", "gate")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_names_serve_peft_adapters(case, tmp_path, make_runner, hf_model, ops):
    from loraserve.runtime.dev.devmodels import build_adapter

    architecture, adapter_modules, pool = CASES[case]
    model_dir = build_tiny_model(tmp_path / "m", architecture=architecture, seed=71, **SMALL)
    adapter = build_adapter(tmp_path / "a", model_dir, rank=4, alpha=8, target_modules=adapter_modules, seed=72)
    runner = make_runner(model_dir, adapters={"a": adapter}, target_modules=pool)
    assert runner.lora.modules == pool_modules(pool)
    with torch.no_grad():
        _check_modes(runner, hf_model(model_dir, adapter), ops, names=["a", "a"], seed=5)
