"""Qwen3 (dense): per-head q/k RMSNorm before rotary. Our runner against transformers + peft
on the same tiny random weights, with an adapter on every linear module, in every mode."""

from __future__ import annotations

import torch

from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES, build_adapter
from loraserve.runtime.model.arch import load_arch_config

from .test_model_parity import _check_modes


def test_qwen3_config_is_read(assets):
    arch = load_arch_config(assets.models["qwen3-qknorm"])
    assert (arch.family, arch.qk_norm, arch.head_dim) == ("qwen3", True, 32)
    assert not load_arch_config(assets.models["qwen2-bias"]).qk_norm


def test_qwen3_all_linear_matches_peft(assets, make_runner, hf_model, ops, tmp_path):
    """Qwen3 adapter on every linear module matches PEFT."""
    model_dir = assets.models["qwen3-qknorm"]
    adapter = build_adapter(
        tmp_path / "all", model_dir, rank=8, alpha=16, target_modules=ALL_LINEAR_MODULES, seed=21
    )
    runner = make_runner(model_dir, adapters={"all": adapter})
    reference = hf_model(model_dir, adapter)
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=["all", "all"], seed=3)


def test_qwen3_qk_norm_weights_are_loaded(assets, make_runner, hf_model):
    """The norms' weights differ from one (the builder randomises them) and reach the runner:
    zeroing them in the runner changes its logits."""
    runner = make_runner(assets.models["qwen3-qknorm"])
    attn = runner.model.model.layers[0].self_attn
    assert (attn.q_norm.weight - 1).abs().max() > 1e-2
    reference = hf_model(assets.models["qwen3-qknorm"])
    torch.testing.assert_close(attn.k_norm.weight, reference.model.layers[0].self_attn.k_norm.weight)
