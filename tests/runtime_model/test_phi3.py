"""Phi-3 / Phi-4-mini (``Phi3ForCausalLM``) against transformers (+ peft) in float32 on tiny
configs built from transformers' own ``Phi3Config``: fused ``qkv_proj`` / ``gate_up_proj``
checkpoint tensors, a sliding window shorter than the prompts (Phi-3-mini-4k's kind), and a
Phi-4-mini-like model (three quarters of each head rotating, LongRoPE with random short and
long factors, tied embeddings); adapters on the fused and unfused modules, as peft writes them
for Phi-3, in extend, decode and verify. LongRoPE's factor set is the served context's (see
``runtime.model.layers.rotary``): the oracle runs within the original maximum, where
transformers takes the short factors, and past it, where both take the long ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loraserve.runtime.dev.devmodels import PHI3_LINEAR_MODULES, build_adapter, build_tiny_model
from loraserve.runtime.model import ModelConfigError, load_arch_config
from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import runtime_config
from .test_model_parity import TOL, _check_modes

ORIGINAL = 64  # the Phi-4-mini-like model's original_max_position_embeddings
GEN = torch.Generator().manual_seed(91)
LONGROPE = {
    "rope_type": "longrope",
    # one factor per rotated pair: 16 * 0.75 = 12 dims rotate
    "short_factor": (1 + torch.rand(6, generator=GEN) * 3).tolist(),
    "long_factor": (1 + torch.rand(6, generator=GEN) * 30).tolist(),
}
MODELS = {
    # name: build_tiny_model kwargs
    "plain": {"seed": 92, "moe": {"sliding_window": 6}},
    "phi4": {
        "seed": 93,
        "head_dim": 16,
        "tie_word_embeddings": True,
        "max_position_embeddings": 4 * ORIGINAL,  # attention factor sqrt(1 + ln 4 / ln 64)
        "rope_scaling": LONGROPE,
        "moe": {"partial_rotary_factor": 0.75, "original_max_position_embeddings": ORIGINAL},
    },
}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    root = tmp_path_factory.mktemp("phi3")
    out = {}
    for i, (name, kwargs) in enumerate(MODELS.items()):
        model = build_tiny_model(root / name, architecture="phi3", num_layers=2, **kwargs)
        adapter = build_adapter(
            root / f"{name}-lora", model, rank=8, alpha=16, target_modules=PHI3_LINEAR_MODULES, seed=94 + i
        )
        out[name], out[f"{name}-lora"] = model, adapter
    return out


def _runner(model_dir, adapters=None, context_length: int | None = None, **lora) -> ModelRunner:
    config = runtime_config(model_dir, max_rank=8, **lora)
    config.model.context_length = context_length
    runner = ModelRunner(config)
    for name, path in (adapters or {}).items():
        runner.lora.load(name, path)
    return runner


# Within the original maximum: transformers' short factors (the runner serves 64 positions).
CONTEXT = {"plain": None, "phi4": ORIGINAL}


def test_config_is_read(phi3):
    plain, phi4 = load_arch_config(phi3["plain"]), load_arch_config(phi3["phi4"])
    assert (plain.family, plain.sliding_window, plain.rope.rope_type) == ("phi3", 6, "default")
    assert not (plain.attention_bias or plain.o_bias or plain.mlp_bias)
    assert phi4.rope.rotary_dim(phi4.head_dim) == 12 and phi4.tie_word_embeddings
    assert phi4.rope.rope_type == "longrope" and phi4.rope.original_max_position_embeddings == ORIGINAL
    assert phi4.rope.factor == 4.0 and phi4.rope.short_factor == tuple(LONGROPE["short_factor"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_base_logits_match_transformers(name, phi3, hf_model, ops):
    runner = _runner(phi3[name], context_length=CONTEXT[name])
    if name == "phi4":
        assert runner.model.model.rotary.cos.shape == (ORIGINAL, 12)
    with torch.no_grad():
        _check_modes(runner, hf_model(phi3[name]), ops, seed=5)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_attention_matches_transformers(name, phi3, hf_model, ops):
    """The paged Triton attention kernel (decode and verify rows; interpreted on the CPU) over
    partially rotated keys, and within Phi-3's sliding window."""
    config = runtime_config(phi3[name], max_rank=8)
    config.model.context_length = CONTEXT[name]
    config.attention_backend = "triton"
    runner = ModelRunner(config)
    assert runner.attention_backend == "triton"
    with torch.no_grad():
        _check_modes(runner, hf_model(phi3[name]), ops, seed=8)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_adapter_logits_match_peft(name, phi3, hf_model, ops):
    """peft's Phi-3 adapter (fused qkv_proj and gate_up_proj, o_proj, down_proj) split into the
    q/k/v and gate/up slots at its rank, against peft on the fused modules; lora.target_modules
    as a user writes them for Phi-3."""
    adapter = phi3[f"{name}-lora"]
    runner = _runner(phi3[name], {"a": adapter}, CONTEXT[name], target_modules=PHI3_LINEAR_MODULES)
    assert runner.lora.modules == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    reference = hf_model(phi3[name], adapter)
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=["a", "a"], seed=6)
        prompt = torch.arange(3, 12)[None]
        assert (reference(prompt).logits - hf_model(phi3[name])(prompt).logits).abs().max() > 1e-2


def test_long_context_takes_the_long_factors(phi3, hf_model, ops):
    """A served context past the original maximum rotates with the long factors at every
    position: a prompt longer than the original maximum equals transformers' (which switches
    the whole sequence to the long factors there), adapter included."""
    runner = _runner(phi3["phi4"], {"a": phi3["phi4-lora"]})
    assert runner.context_len == 4 * ORIGINAL
    prompt = torch.randint(3, 512, (ORIGINAL + 6,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        for names, reference in (
            (None, hf_model(phi3["phi4"])),
            (["a"], hf_model(phi3["phi4"], phi3["phi4-lora"])),
        ):
            rid = "long" if names is None else "long-a"
            out = ops.extend(runner, [rid], [prompt], names=names, all_logits=True)
            torch.testing.assert_close(out.logits, reference(prompt[None]).logits[0], atol=TOL, rtol=0)


def test_longrope_frequencies_match_transformers(phi3):
    """Per-dim inverse frequencies and the attention factor against transformers' rope init
    function, for the short set (within the original maximum) and the long one (past it), with
    the derived attention factor and with config.json's own ``factor`` / ``attention_factor``."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from loraserve.runtime.model.arch import arch_from_dict
    from loraserve.runtime.model.layers import inverse_frequencies

    raw = json.loads((phi3["phi4"] / "config.json").read_text())
    given = dict(raw, rope_parameters={**raw["rope_parameters"], "factor": 2.5, "attention_factor": 1.3})
    for config_json in (raw, given):
        arch = arch_from_dict(config_json)
        hf = AutoConfig.for_model(**config_json)
        for served, seq_len in ((ORIGINAL, None), (ORIGINAL + 1, ORIGINAL + 1)):
            ours, scale = inverse_frequencies(
                arch.rope, arch.head_dim, arch.max_position_embeddings, max_positions=served
            )
            theirs, hf_scale = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq_len)
            assert ours.shape == (6,)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
            assert scale == pytest.approx(hf_scale, rel=1e-12)
    assert scale == 1.3
    short, _ = inverse_frequencies(
        arch.rope, arch.head_dim, arch.max_position_embeddings, max_positions=ORIGINAL
    )
    assert not torch.equal(short, ours)  # the two sets differ


def test_adapter_keeps_its_rank(phi3):
    """A fused B ``[q + k + v, r]`` keeps rank r in the slots (not 3r): every part shares the one A
    and takes its rows of B; lora.max_rank = r serves it."""
    from safetensors.torch import load_file

    from loraserve.runtime.lora.adapter import load_adapter

    runner = _runner(phi3["phi4"], {"a": phi3["phi4-lora"]}, context_length=ORIGINAL)
    arch = runner.arch
    loaded = load_adapter(
        phi3["phi4-lora"], arch=arch, max_rank=8, pool_modules=runner.lora.modules, dtype=torch.float32
    )
    assert loaded.rank == 8 and loaded.declared_rank is None
    assert set(loaded.target_modules) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    saved = load_file(str(phi3["phi4-lora"] / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1."
    a, b = (
        saved[prefix + "self_attn.qkv_proj.lora_A.weight"],
        saved[prefix + "self_attn.qkv_proj.lora_B.weight"],
    )
    q, kv = arch.q_size, arch.kv_size
    for part, rows in (("q_proj", b[:q]), ("k_proj", b[q : q + kv]), ("v_proj", b[q + kv :])):
        torch.testing.assert_close(loaded.weights[(part, 1)][0], a, rtol=0, atol=0)
        torch.testing.assert_close(loaded.weights[(part, 1)][1], rows, rtol=0, atol=0)
    gu = saved[prefix + "mlp.gate_up_proj.lora_B.weight"]
    torch.testing.assert_close(
        loaded.weights[("up_proj", 1)][1], gu[arch.intermediate_size :], rtol=0, atol=0
    )


def test_adapter_outside_the_pool_is_refused(phi3):
    """lora.target_modules without k_proj cannot serve a qkv_proj adapter: refused naming k_proj."""
    from loraserve.runtime.lora.adapter import load_adapter
    from loraserve.runtime.lora.errors import AdapterError

    arch = load_arch_config(phi3["plain"])
    pool = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with pytest.raises(AdapterError, match="k_proj"):
        load_adapter(phi3["plain-lora"], arch=arch, max_rank=8, pool_modules=pool, dtype=torch.float32)


@pytest.mark.parametrize(
    "change,words",
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'dynamic'",
        ),
        (
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'linear'",
        ),
        ({"rope_parameters": {**LONGROPE, "short_factor": [1.0] * 5}}, "short_factor has 5 entries"),
        ({"rope_parameters": {**LONGROPE, "long_factor": None}}, "long_factor"),
        (
            {"original_max_position_embeddings": None, "rope_parameters": LONGROPE},
            "original_max_position_embeddings",
        ),
        ({"partial_rotary_factor": 0.7, "rope_parameters": {"rope_theta": 1e4}}, "partial_rotary_factor"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu_new"}, "hidden_act"),
    ],
)
def test_unserved_configs_are_refused(phi3, tmp_path, change, words):
    shutil.copytree(phi3["phi4"], tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    raw = {**raw, **change}
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match=words):
        load_arch_config(tmp_path / "m")


def test_hub_spelling_is_read(phi3, tmp_path):
    """Phi-3 configs as the hub holds them: ``rope_scaling`` of type ``su`` (LongRoPE's first
    name) beside top-level ``rope_theta``, ``partial_rotary_factor`` and the original maximum."""
    raw = json.loads((phi3["phi4"] / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw.update(
        rope_theta=params["rope_theta"],
        rope_scaling={
            "type": "su",
            "short_factor": params["short_factor"],
            "long_factor": params["long_factor"],
        },
    )
    from loraserve.runtime.model.arch import arch_from_dict

    arch, want = arch_from_dict(raw), load_arch_config(phi3["phi4"])
    assert arch.rope == want.rope


def test_policy_takes_phi3_module_names():
    """``lora.target_modules`` takes the names Phi-3 adapters declare, on Phi-3 only."""
    from loraserve.runtime.contract.config import RuntimeConfig
    from loraserve.runtime.contract.policy import check_config

    config = RuntimeConfig()
    config.model.path = "/models/phi-4-mini"
    config.cuda_graph.enabled = False
    config.lora.target_modules = PHI3_LINEAR_MODULES
    config.model.architecture = "Phi3ForCausalLM"
    assert not check_config(config).violations
    config.model.architecture = "LlamaForCausalLM"
    refused = [v for v in check_config(config).violations if v.rule == "lora-modules-family"]
    assert refused and "qkv_proj" in str(refused[0])
