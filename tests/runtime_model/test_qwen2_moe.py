"""Qwen2-MoE bases: routed experts plus a shared expert scaled by ``sigmoid(shared_expert_gate)``,
q/k/v biases, a dense layer between sparse ones. Our torch MoE path against transformers (+ peft)
in float32 on a tiny random config, in extend, decode and verify; adapters on attention, the
shared expert (and its gate) and the routed experts, as peft writes them."""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model
from loraserve.runtime.model.arch import load_arch_config

from .test_model_parity import _check_modes
from .test_moe import SMALL, _load

QWEN2_MOE = {
    "architecture": "qwen2_moe",
    "seed": 41,
    "moe": {"mlp_only_layers": [1], "shared_expert_intermediate_size": 80},
}


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen2_moe") / "m", **{**SMALL, **QWEN2_MOE})


def test_qwen2_moe_config_is_read(qwen2_moe):
    arch = load_arch_config(qwen2_moe)
    assert (arch.family, arch.attention_bias, arch.o_bias, arch.qk_norm) == ("qwen2_moe", True, False, False)
    spec = arch.moe
    assert spec.sparse_layers == (0, 2) and (spec.intermediate_size, spec.shared_intermediate_size) == (
        48,
        80,
    )
    assert spec.shared_gated and not spec.norm_topk_prob and (spec.num_experts, spec.top_k) == (4, 2)


def test_qwen2_moe_logits_match_transformers(qwen2_moe, make_runner, hf_model, ops):
    runner = make_runner(qwen2_moe)
    with torch.no_grad():
        _check_modes(runner, hf_model(qwen2_moe), ops, seed=2)


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
SHARED = ("gate_proj", "up_proj", "down_proj", "shared_expert_gate")
ADAPTERS = {
    # name: build_adapter kwargs. With transformers 5 peft's target_modules gate_proj / up_proj /
    # down_proj reach the shared expert's Linear layers (and layer 1's dense MLP);
    # target_parameters reach the fused routed experts and the router.
    "shared": {"target_modules": ("q_proj", "v_proj", *SHARED), "seed": 61},
    "routed": {"target_modules": ("o_proj",), "target_parameters": ("gate_up_proj", "down_proj"), "seed": 62},
    "all": {
        "target_modules": (*ATTN, *SHARED),
        "target_parameters": ("gate_up_proj", "down_proj", "gate.weight"),
        "seed": 63,
    },
}


@pytest.fixture(scope="module")
def qwen2_moe_adapters(qwen2_moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_moe_adapters")
    return {
        name: build_adapter(root / name, qwen2_moe, rank=4, alpha=8, **kw) for name, kw in ADAPTERS.items()
    }


def test_peft_keys_of_a_qwen2_moe_adapter(qwen2_moe, qwen2_moe_adapters):
    """What the installed peft saves for Qwen2-MoE, and where the runtime puts each part."""
    from safetensors import safe_open

    with safe_open(str(qwen2_moe_adapters["all"] / "adapter_model.safetensors"), "pt") as f:
        keys = {k.removeprefix("base_model.model.model.layers.") for k in f.keys()}  # noqa: SIM118
    assert {
        "0.mlp.shared_expert.gate_proj.lora_A.weight",
        "0.mlp.shared_expert.down_proj.lora_B.weight",
        "0.mlp.shared_expert_gate.lora_B.weight",
        "0.mlp.experts.lora_A.weight",
        "0.mlp.experts.base_layer.lora_A.weight",
        "0.mlp.gate.lora_A.weight",
        "1.mlp.gate_proj.lora_A.weight",  # the dense layer's MLP
    } <= keys
    weights = _load(qwen2_moe, qwen2_moe_adapters["all"]).weights
    assert weights[("shared_expert.gate_proj", 0)][0].shape == (4, 64)
    assert weights[("shared_expert.down_proj", 2)][0].shape == (4, 80)
    assert weights[("shared_expert_gate", 0)][1].shape == (1, 4)
    # The routed experts, stacked. Whether peft also remaps target_modules gate_proj / up_proj
    # onto the fused gate_up_proj (at double rank, with a rank_pattern) depends on transformers'
    # checkpoint-conversion registry in the process that saved it: both files exist, both load.
    raw = json.loads((qwen2_moe_adapters["all"] / "adapter_config.json").read_text())
    routed_rank = raw["rank_pattern"].get(r".*\.gate_up_proj", 4)
    assert routed_rank in (4, 8)
    assert weights[("gate_proj", 0)][0].shape == (4, routed_rank, 64)
    assert weights[("gate_proj", 1)][1].shape == (96, 4)  # the dense layer's
    assert ("gate", 2) in weights


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_qwen2_moe_adapter_matches_peft(adapter, qwen2_moe, qwen2_moe_adapters, make_runner, hf_model, ops):
    runner = make_runner(qwen2_moe, adapters={adapter: qwen2_moe_adapters[adapter]})
    reference = hf_model(qwen2_moe, qwen2_moe_adapters[adapter])
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=[adapter, adapter], seed=5)
        # one batch, rows of the adapter and of the base model
        prompts = [torch.arange(3, 14), torch.arange(20, 27)]
        out = ops.extend(runner, ["a", "b"], prompts, names=[adapter, None], all_logits=True)
        with_adapter, base = (
            reference(prompts[0][None]).logits[0],
            hf_model(qwen2_moe)(prompts[1][None]).logits[0],
        )
        torch.testing.assert_close(out.logits[:11], with_adapter, atol=2e-4, rtol=0)
        torch.testing.assert_close(out.logits[11:], base, atol=2e-4, rtol=0)
        assert (with_adapter - hf_model(qwen2_moe)(prompts[0][None]).logits[0]).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("use_sliding_window", True, "use_sliding_window=True is not served for Qwen2-MoE"),
        ("mlp_bias", True, "mlp_bias=True is not served for Qwen2-MoE"),
        (
            "shared_expert_intermediate_size",
            -8,
            "'shared_expert_intermediate_size' must be a non-negative integer",
        ),
    ],
)
def test_unserved_config_is_refused_by_name(qwen2_moe, tmp_path, field, value, match):
    from loraserve.runtime.contract.errors import ModelConfigError

    raw = json.loads((qwen2_moe / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(ModelConfigError, match=match):
        load_arch_config(tmp_path)


def test_without_a_shared_expert(qwen2_moe, tmp_path):
    """``shared_expert_intermediate_size`` 0: no shared expert and no gate (the MoE of Qwen3)."""
    raw = json.loads((qwen2_moe / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "shared_expert_intermediate_size": 0}))
    spec = load_arch_config(tmp_path).moe
    assert (spec.shared_intermediate_size, spec.shared_gated) == (0, False)


def test_shared_expert_adapters_refused_where_unserved(
    qwen2_moe, qwen2_moe_adapters, moe_models_qwen3, tmp_path
):
    """A shared expert's LoRA needs its gate/up/down slots, a layer with a shared expert, and a
    model that has one; each refusal names the tensor or the slots."""
    import shutil

    from safetensors.torch import load_file, save_file

    from loraserve.runtime.lora.errors import AdapterError

    src = qwen2_moe_adapters["shared"]
    with pytest.raises(
        AdapterError, match=r"\['down_proj', 'gate_proj', 'up_proj'\] are not in lora\.target_modules"
    ):
        _load(qwen2_moe, src, pool=ATTN)
    assert ("shared_expert_gate", 0) in _load(
        qwen2_moe, src, pool=(*ATTN, "gate_proj", "up_proj", "down_proj")
    ).weights
    shutil.copytree(src, tmp_path / "dense")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.shared_expert.up_proj.lora_A.weight"
    save_file({**tensors, key: torch.zeros(4, 64)}, str(tmp_path / "dense" / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"layers\.1\.mlp\.shared_expert\.up_proj.*adapts a shared expert"):
        _load(qwen2_moe, tmp_path / "dense")
    qwen3 = {k: v for k, v in tensors.items() if ".layers.1." not in k}  # layer 1 is sparse in Qwen3-MoE
    shutil.copytree(src, tmp_path / "qwen3")
    save_file(qwen3, str(tmp_path / "qwen3" / "adapter_model.safetensors"))
    with pytest.raises(
        AdapterError, match="adapts a shared expert, which layer 0 of this Qwen3MoeForCausalLM"
    ):
        _load(moe_models_qwen3, tmp_path / "qwen3")


@pytest.fixture(scope="module")
def moe_models_qwen3(tmp_path_factory):
    from .test_moe import MOE_MODELS

    return build_tiny_model(
        tmp_path_factory.mktemp("qwen3_moe") / "m", **{**SMALL, **MOE_MODELS["qwen3-moe"]}
    )


def test_qwen2_moe_adapter_on_triton_backend(qwen2_moe, qwen2_moe_adapters, make_runner, hf_model, ops):
    """With the Triton LoRA backend (attention, the shared expert, its one-wide gate and the
    router through its kernels) the output still equals peft's."""
    runner = make_runner(qwen2_moe, adapters={"a": qwen2_moe_adapters["all"]}, backend="triton")
    prompts = [torch.arange(3, 12), torch.arange(30, 35)]
    with torch.no_grad():
        out = ops.extend(runner, ["a", "b"], prompts, names=["a", None], all_logits=True)
        want = hf_model(qwen2_moe, qwen2_moe_adapters["all"])(prompts[0][None]).logits[0]
        torch.testing.assert_close(out.logits[:9], want, atol=2e-4, rtol=0)
        torch.testing.assert_close(
            out.logits[9:], hf_model(qwen2_moe)(prompts[1][None]).logits[0], atol=2e-4, rtol=0
        )
