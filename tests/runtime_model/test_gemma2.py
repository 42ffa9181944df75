"""Gemma 2 against transformers (+ peft) in float32 on tiny configs built from transformers'
own ``Gemma2Config``: extend, decode and verify rows over prompts longer than the sliding
window, sliding and global layers alternating on one rope base, no q/k head norms,
``(1 + w)`` norms (random weights), the embedding scale and ``query_pre_attn_scalar``;
attention scores soft-capped at 2.0 (so the cap bends them) on the SDPA path and in the paged
Triton kernel; a final logit cap; adapters on every linear module."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES, build_adapter, build_tiny_model
from loraserve.runtime.model import ModelConfigError, load_arch_config

from .test_model_parity import _check_modes

SMALL = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,  # every layer's base (a second rope at 10000 would not match)
    "initializer_range": 0.1,  # scores large enough for a cap of 2.0 to bend them
}
CAPS = {"query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2")
    # build_tiny_model passes Gemma's extra fields through its ``moe`` argument.
    model = build_tiny_model(root / "m", architecture="gemma2", seed=91, moe=CAPS, **SMALL)
    adapter = build_adapter(root / "a", model, rank=8, alpha=16, target_modules=ALL_LINEAR_MODULES, seed=93)
    return {"model": model, "adapter": adapter, "root": root}


def _with_config(src, dest, **change):
    shutil.copytree(src, dest)
    raw = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**raw, **change}))
    return dest


def test_config_is_read(gemma):
    arch = load_arch_config(gemma["model"])
    assert arch.family == "gemma2" and not arch.qk_norm and arch.tie_word_embeddings
    spec = arch.gemma
    assert spec.sliding_layers == (True, False, True, False) and spec.sliding_window == 4
    assert spec.local_rope_theta is None and not spec.head_norms and arch.rope.theta == 1e6
    assert spec.query_pre_attn_scalar == 24 and spec.attn_softcap == 2.0 and spec.final_logit_softcap == 3.0


def test_attention_cap_bends_the_reference(gemma, hf_model):
    """The fixture's cap changes transformers' logits well beyond the tolerance, so matching
    them below needs the cap (in each attention path)."""
    uncapped = _with_config(gemma["model"], gemma["root"] / "uncapped", attn_logit_softcapping=None)
    ids = torch.randint(3, 500, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf_model(gemma["model"])(ids).logits - hf_model(uncapped)(ids).logits).abs().max()
    assert diff > 0.05


def test_base_logits_match_transformers(gemma, make_runner, hf_model, ops):
    runner = make_runner(gemma["model"])
    assert all(not hasattr(layer.self_attn, "q_norm") for layer in runner.model.model.layers)
    with torch.no_grad():
        _check_modes(runner, hf_model(gemma["model"]), ops, seed=3)


def test_adapter_logits_match_peft(gemma, make_runner, hf_model, ops):
    runner = make_runner(gemma["model"], adapters={"a": gemma["adapter"]})
    with torch.no_grad():
        _check_modes(runner, hf_model(gemma["model"], gemma["adapter"]), ops, names=["a", "a"], seed=4)


def test_paged_attention_softcap(gemma, hf_model, ops):
    """The Triton paged kernel (decode and verify rows) caps the scores and takes each
    sliding layer's window; an adapter on every module."""
    from loraserve.runtime.runner.model_runner import ModelRunner

    from .conftest import runtime_config

    config = runtime_config(gemma["model"])
    config.attention_backend = "triton"
    runner = ModelRunner(config)
    runner.lora.load("a", gemma["adapter"])
    reference = hf_model(gemma["model"], gemma["adapter"])
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=["a", "a"], seed=5)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping"),
        ({"layer_types": ["sliding_attention"]}, "layer_types"),
        ({"sliding_window": None}, "sliding_window"),
    ],
)
def test_unserved_configs_are_refused(gemma, tmp_path, change, words):
    with pytest.raises(ModelConfigError, match=words):
        load_arch_config(_with_config(gemma["model"], tmp_path / "m", **change))


def test_policy_serves_gemma2():
    from loraserve.runtime.contract.policy import check_config

    config = RuntimeConfig()
    config.model.path = "/models/gemma-2"
    config.model.architecture = "Gemma2ForCausalLM"
    config.cuda_graph.enabled = False
    violations = check_config(config).violations
    assert not violations, [str(v) for v in violations]
