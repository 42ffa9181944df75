"""Oracle: Phi-4-mini-like Phi-3 models on two tensor-parallel ranks give the single-device
runner's logits (which tests/runtime_model/test_phi3.py holds to transformers and peft).

What the cut must respect: the checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` tensors
(split into q/k/v and gate/up rows before each rank takes its heads and columns), three
quarters of each head rotating with LongRoPE's factors and attention factor, and an adapter
in peft's Phi-3 layout (one A and one B over the fused modules, split into the slots, then
cut as any column-parallel adapter). Base and adapter rows share every batch.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.dev.devmodels import PHI3_LINEAR_MODULES, build_adapter, build_tiny_model
from loraserve.runtime.runner.model_runner import ModelRunner

from ..runtime_model.test_phi3 import MODELS, ORIGINAL
from .conftest import Pair, adapter_delta, every_mode, tp_config, tp_group


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3_tp")
    model = build_tiny_model(root / "m", architecture="phi3", num_layers=2, **MODELS["phi4"])
    adapter = build_adapter(root / "a", model, rank=8, alpha=16, target_modules=PHI3_LINEAR_MODULES, seed=95)
    adapters = {"all": adapter}
    config = tp_config(model, 2, adapters)
    config.model.context_length = ORIGINAL
    with tp_group(config) as (handle, runner):
        ref_config = tp_config(model, 1, adapters)
        ref_config.model.context_length = ORIGINAL
        yield Pair(tp=runner, ref=ModelRunner(ref_config), handle=handle)


def test_every_mode_matches_one_device(pair):
    """Extend (every position), two decodes, a verify, a rejected-draft truncation and a decode
    after it, the adapter and the base model in one batch."""
    out = every_mode(pair, ["all", None, "all"], (9, 3, 13), (2, 0, 3), vocab=500, hidden_layers=(0, 1))
    assert out.logits.shape[0] == 25


def test_adapter_changes_tp_output(pair):
    """Guards the oracle: the fused-layout adapter moves the logits on two ranks."""
    prompt = torch.arange(5, 17)
    assert adapter_delta(pair.tp, prompt, "all") > 1e-2


def test_ranks_hold_halves(pair):
    """Each rank holds half the heads and half the MLP columns of the split fused tensors."""
    whole = pair.ref.model.model.layers[0]
    half = pair.tp.model.model.layers[0]
    assert [2 * n for n in half.self_attn.qkv_proj.out_sizes] == list(whole.self_attn.qkv_proj.out_sizes)
    assert [2 * n for n in half.mlp.gate_up_proj.out_sizes] == list(whole.mlp.gate_up_proj.out_sizes)
