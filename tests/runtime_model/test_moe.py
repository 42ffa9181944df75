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


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_ADAPTERS = {
    # name: (model, build_adapter kwargs); peft (transformers 5) turns expert targets into
    # target_parameters on the fused experts, gate_up_proj at double rank
    "qwen-attn": ("qwen3-moe", {"target_modules": ATTN, "seed": 51}),
    "qwen-all": ("qwen3-moe", {"target_modules": (*ATTN, "gate_proj", "up_proj", "down_proj", "gate"), "seed": 52}),
    "qwen-norm-experts": ("qwen3-moe-norm", {"target_modules": ("gate_proj", "up_proj", "down_proj"), "seed": 53}),
    "mixtral-all": ("mixtral", {"target_modules": ("q_proj", "v_proj", "w1", "w2", "w3", "gate"), "seed": 54}),
    # rsLoRA: the fused gate_up_proj's own scaling (2α/√(2r)) differs from the adapter's (α/√r)
    "qwen-rslora": ("qwen3-moe", {"target_modules": ("o_proj", "gate_proj", "up_proj", "down_proj"), "use_rslora": True, "seed": 55}),
}


@pytest.fixture(scope="module")
def moe_adapters(moe_models, tmp_path_factory):
    from loraserve.runtime.dev.devmodels import build_adapter

    root = tmp_path_factory.mktemp("moe_adapters")
    return {
        name: build_adapter(root / name, moe_models[model], rank=4, alpha=8, **kw)
        for name, (model, kw) in MOE_ADAPTERS.items()
    }


def test_peft_fused_experts_double_rank(moe_adapters):
    """What the installed peft saves, which the runtime reads."""
    from safetensors import safe_open

    raw = json.loads((moe_adapters["qwen-all"] / "adapter_config.json").read_text())
    assert sorted(raw["target_parameters"]) == ["down_proj", "gate.weight", "gate_up_proj"]
    assert raw["rank_pattern"] == {r".*\.gate_up_proj": 8} and raw["alpha_pattern"] == {r".*\.gate_up_proj": 16}
    with safe_open(str(moe_adapters["qwen-all"] / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"] == (8 * 4, 64)
    assert shapes["base_model.model.model.layers.0.mlp.gate.lora_B.weight"] == (4, 4)


@pytest.mark.parametrize("adapter", sorted(MOE_ADAPTERS))
def test_moe_adapter_matches_peft(adapter, moe_models, moe_adapters, make_runner, hf_model, ops):
    model_dir = moe_models[MOE_ADAPTERS[adapter][0]]
    runner = make_runner(model_dir, adapters={adapter: moe_adapters[adapter]})
    reference = hf_model(model_dir, moe_adapters[adapter])
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=[adapter, adapter], seed=5)
        # one batch, rows of the adapter and of the base model: each row its own experts' deltas
        prompts = [torch.arange(3, 14), torch.arange(20, 27)]
        out = ops.extend(runner, ["a", "b"], prompts, names=[adapter, None], all_logits=True)
        with_adapter, base = reference(prompts[0][None]).logits[0], hf_model(model_dir)(prompts[1][None]).logits[0]
        torch.testing.assert_close(out.logits[:11], with_adapter, atol=2e-4, rtol=0)
        torch.testing.assert_close(out.logits[11:], base, atol=2e-4, rtol=0)
        assert (with_adapter - hf_model(model_dir)(prompts[0][None]).logits[0]).abs().max() > 1e-2


def _per_expert_adapter(fused_dir, dest, arch_name: str):
    """The layout adapters saved before transformers 5 hold: one LoRA per expert module
    (``mlp.experts.N.gate_proj``, Mixtral's ``block_sparse_moe.experts.N.w1``), written from
    a fused peft adapter whose gate_up B is first made block-diagonal (gate rows read the
    first r ranks, up rows the last r: what two separate LoRAs compute). Returns the
    block-diagonal fused adapter (the oracle's) and the per-expert one."""
    import shutil

    from safetensors.torch import load_file, save_file

    oracle = dest / "fused-blockdiag"
    shutil.copytree(fused_dir, oracle)
    raw = json.loads((fused_dir / "adapter_config.json").read_text())
    tensors = load_file(str(fused_dir / "adapter_model.safetensors"))
    r, experts = raw["r"], 4
    mixtral = arch_name == "mixtral"
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else {}
    block = "block_sparse_moe" if mixtral else "mlp"
    fused_out, per_expert = {}, {}
    for name, t in tensors.items():
        if ".experts." not in name and not name.endswith(
            (".experts.lora_A.weight", ".experts.lora_B.weight")
        ) and ".experts.base_layer." not in name:
            fused_out[name] = per_expert[name.replace(".mlp.gate.", f".{block}.gate.")] = t
    layers = {n.split(".layers.")[1].split(".")[0] for n in tensors if ".experts" in n}
    for layer in sorted(layers, key=int):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for depth in ("", ".base_layer"):
            a, b = tensors[f"{prefix}{depth}.lora_A.weight"], tensors[f"{prefix}{depth}.lora_B.weight"]
            rank = a.shape[0] // experts
            a3 = a.reshape(experts, rank, -1)
            b3 = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1).clone()
            if rank == 2 * r:  # gate_up: keep the diagonal blocks only
                half = b3.shape[1] // 2
                b3[:, :half, r:] = 0
                b3[:, half:, :r] = 0
                parts = {"gate_proj": (a3[:, :r], b3[:, :half, :r]), "up_proj": (a3[:, r:], b3[:, half:, r:])}
            else:
                parts = {"down_proj": (a3, b3)}
            fused_out[f"{prefix}{depth}.lora_A.weight"] = a
            fused_out[f"{prefix}{depth}.lora_B.weight"] = b3.permute(1, 2, 0).reshape(b.shape[0], -1).contiguous()
            for module, (pa, pb) in parts.items():
                for e in range(experts):
                    stem = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{names.get(module, module)}"
                    per_expert[f"{stem}.lora_A.weight"] = pa[e].contiguous()
                    per_expert[f"{stem}.lora_B.weight"] = pb[e].contiguous()
    save_file(fused_out, str(oracle / "adapter_model.safetensors"))
    old = dest / "per-expert"
    old.mkdir()
    modules = [m for m in raw["target_modules"]] + [names.get(m, m) for m in ("gate_proj", "up_proj", "down_proj")]
    if "gate.weight" in raw["target_parameters"]:
        modules.append("gate")
    old_raw = {**raw, "target_modules": modules, "target_parameters": None, "rank_pattern": {}, "alpha_pattern": {}}
    (old / "adapter_config.json").write_text(json.dumps(old_raw))
    save_file(per_expert, str(old / "adapter_model.safetensors"))
    return oracle, old


@pytest.mark.parametrize("adapter", ["qwen-all", "mixtral-all"])
def test_per_expert_layout_matches_peft(adapter, moe_models, moe_adapters, make_runner, hf_model, ops, tmp_path):
    model = MOE_ADAPTERS[adapter][0]
    oracle, old = _per_expert_adapter(moe_adapters[adapter], tmp_path, load_arch_config(moe_models[model]).family)
    runner = make_runner(moe_models[model], adapters={"old": old})
    with torch.no_grad():
        _check_modes(runner, hf_model(moe_models[model], oracle), ops, names=["old", "old"], seed=6)


def _edit_adapter(src, dest, *, config=None, tensors=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    raw = json.loads((src / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    weights = load_file(str(src / "adapter_model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(dest / "adapter_model.safetensors"))
    return dest


def _load(model_dir, adapter, max_rank=16, pool=None):
    from loraserve.runtime.contract.config import LORA_MODULES
    from loraserve.runtime.lora.adapter import load_adapter

    return load_adapter(
        adapter, arch=load_arch_config(model_dir), max_rank=max_rank, pool_modules=pool or LORA_MODULES,
        dtype=torch.float32,
    )


def test_unserved_moe_layouts_are_refused_by_name(moe_models, moe_adapters, tmp_path):
    from loraserve.runtime.lora.errors import AdapterError

    model, src = moe_models["qwen3-moe"], moe_adapters["qwen-all"]
    params = ["mlp.experts.gate_up_proj", "mlp.shared_expert_gate.weight"]
    bad_param = _edit_adapter(src, tmp_path / "p", config={"target_parameters": params})
    with pytest.raises(AdapterError, match=r"shared_expert_gate\.weight.*not served") as err:
        _load(model, bad_param)
    assert err.value.field == "target_parameters"
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    bad_shape = _edit_adapter(src, tmp_path / "s", tensors=lambda w: {**w, key: w[key][:, :40].contiguous()})
    with pytest.raises(AdapterError, match="fits neither fused expert parameter") as err:
        _load(model, bad_shape)
    assert err.value.field == key
    dense = "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"
    on_moe_layer = _edit_adapter(src, tmp_path / "d", tensors=lambda w: {**w, dense: torch.zeros(4, 64)})
    with pytest.raises(AdapterError, match="layer 0 of this Qwen3MoeForCausalLM is a mixture of experts"):
        _load(model, on_moe_layer)
    with pytest.raises(AdapterError, match=r"gate_up_proj has rank 8.*lora\.max_rank=4"):
        _load(model, src, max_rank=4)
    with pytest.raises(AdapterError, match=r"\['down_proj', 'gate_proj', 'up_proj'\] are not in lora\.target_modules"):
        _load(model, src, pool=ATTN)
    with pytest.raises(AdapterError, match="target_parameters") as err:
        _load_dense_with_params(tmp_path, src)
    assert err.value.field == "target_parameters"


def _load_dense_with_params(tmp_path, src):
    """An expert adapter on a dense model is refused before its tensors are read."""
    dense = build_tiny_model(tmp_path / "dense", architecture="qwen3", num_layers=1, head_dim=16)
    return _load(dense, src)


def test_moe_adapter_slot_rank_and_scaling(moe_models, moe_adapters):
    weights = _load(moe_models["qwen3-moe"], moe_adapters["qwen-all"])
    assert (weights.rank, weights.declared_rank, weights.scaling) == (8, 4, 2.0)
    a, b = weights.weights[("gate_proj", 0)]
    assert a.shape == (4, 8, 64) and b.shape == (4, 48, 8)
    assert ("gate", 2) in weights.weights  # the router of a sparse layer
    # Layer 1 is dense: its MLP's LoRA is served exactly when the file has one (peft 0.22 adapts
    # a dense layer's gate_proj under the same target_modules; 0.21 did not).
    from safetensors import safe_open

    with safe_open(str(moe_adapters["qwen-all"] / "adapter_model.safetensors"), "pt") as f:
        dense = any("layers.1.mlp.gate_proj" in key for key in f.keys())  # noqa: SIM118
    assert (("gate_proj", 1) in weights.weights) == dense


def _rules(config) -> set[str]:
    from loraserve.runtime.contract.policy import check_config

    return {v.rule for v in check_config(config).violations}


def test_policy_refuses_unserved_moe(make_config, moe_models):
    """The policy refuses the MoE features this image does not serve, naming each."""
    from loraserve.runtime.contract.config import SpecAlgorithm

    config = make_config(moe_models["mixtral"])
    config.model.architecture = "MixtralForCausalLM"
    assert not _rules(config) & {"moe-cuda-graph", "moe-speculative", "model-architecture"}
    config.device, config.cuda_graph.enabled, config.parallel.tensor_parallel_size = "cuda", True, 2
    config.speculative.algorithm = SpecAlgorithm.NEXTN
    assert {"moe-cuda-graph", "moe-speculative"} <= _rules(config)  # tensor parallelism is served
    config.model.architecture = "LlamaForCausalLM"  # the same fields on a dense target
    assert not _rules(config) & {"moe-cuda-graph", "moe-speculative"}
    config.speculative.algorithm = SpecAlgorithm.STANDALONE
    config.speculative.draft_model_path = str(moe_models["qwen3-moe"])
    config.speculative.draft_model_architecture = "Qwen3MoeForCausalLM"
    assert "moe-draft-cuda-graph" in _rules(config)
    config.model.architecture = "DeepseekV3ForCausalLM"  # a family not served
    assert "model-architecture" in _rules(config)


def test_missing_experts_read_as_zero(moe_models, moe_adapters, tmp_path):
    """A per-expert adapter that adapts only some experts: the others contribute nothing."""
    from safetensors.torch import load_file, save_file

    _, old = _per_expert_adapter(moe_adapters["qwen-all"], tmp_path, "qwen3_moe")
    tensors = load_file(str(old / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if ".experts.3." not in k}
    save_file(kept, str(old / "adapter_model.safetensors"))
    a, b = _load(moe_models["qwen3-moe"], old).weights[("down_proj", 0)]
    stem = "base_model.model.model.layers.0.mlp.experts"
    assert torch.equal(b[3], torch.zeros_like(b[3])) and torch.equal(a[3], torch.zeros_like(a[3]))
    assert torch.equal(a[1], tensors[f"{stem}.1.down_proj.lora_A.weight"])


def test_startup_refuses_cuda_graphs_on_moe(moe_models, capsys):
    """The runtime's start-up reads the architecture from config.json and refuses, with the
    reason, before any weight loads."""
    from loraserve.runtime.cli import EXIT_CONFIG, main

    code = main(["--model", str(moe_models["qwen3-moe"]), "--device", "cuda", "--cuda-graph", "--check-config"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG
    assert "CUDA graphs are not served with the mixture-of-experts layers" in err and "cuda" in err


def test_moe_adapter_on_triton_backend(moe_models, moe_adapters, make_runner, hf_model, ops):
    """With the Triton LoRA backend (attention and router through its kernels, experts on the
    torch path) the output still equals peft's."""
    model_dir = moe_models["mixtral"]
    runner = make_runner(model_dir, adapters={"a": moe_adapters["mixtral-all"]}, backend="triton")
    prompts = [torch.arange(3, 12), torch.arange(30, 35)]
    with torch.no_grad():
        out = ops.extend(runner, ["a", "b"], prompts, names=["a", None], all_logits=True)
        torch.testing.assert_close(
            out.logits[:9], hf_model(model_dir, moe_adapters["mixtral-all"])(prompts[0][None]).logits[0], atol=2e-4, rtol=0
        )
        torch.testing.assert_close(out.logits[9:], hf_model(model_dir)(prompts[1][None]).logits[0], atol=2e-4, rtol=0)
