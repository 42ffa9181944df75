"""EAGLE3 heads in vLLM's speculators format: the same head as the EAGLE3 layout, the
``norm_before_residual`` equation, lossless serving, and the policy's verdicts.

Where each field and name comes from (public sources read; rebuilt here at tiny size):

- config.json: ``vllm-project/speculators`` ``src/speculators/models/eagle3/config.py``
  (``Eagle3SpeculatorConfig``): ``speculators_model_type: "eagle3"``, ``architectures:
  ["Eagle3Speculator"]`` (the saved class; newer releases save ``Eagle3DraftModel``,
  ``src/speculators/models/eagle3/core.py``), ``transformer_layer_config`` (the layer's
  ``LlamaConfig``, ``num_hidden_layers: 1``, ``vocab_size`` the target's), top-level
  ``draft_vocab_size``, ``norm_before_residual`` (default false), ``target_hidden_size``
  (null: the layer's hidden size), ``eagle_aux_hidden_state_layer_ids`` (absent or null:
  ``[2, L // 2, L - 3]``, ``resolve_target_layer_ids`` in ``src/speculators/models/utils.py``),
  and ``speculators_config`` (``algorithm``, ``proposal_methods[0].speculative_tokens``,
  ``default_proposal_method``, ``verifier.name_or_path`` / ``architectures``): the field
  list vLLM checks in ``vllm/transformers_utils/configs/speculators/base.py``
  (``validate_speculators_config``) and flattens in ``.../speculators/algos.py``
  (``update_eagle3``). The Qwen3 head's layer is a Llama layer with Qwen3's ``head_dim``,
  ``rope_theta`` and ``rms_norm_eps``, as in the ``Eagle3Speculator`` config for
  ``Qwen/Qwen3-32B`` that a unit test of sgl-project/sglang's config loading holds
  (``transformer_layer_config.model_type: "llama"``, ``torch_dtype: bfloat16``,
  ``norm_before_residual: true``; read through the code search, its path not recorded).
- tensors: speculators' ``Eagle3Speculator`` / ``Eagle3DraftModel`` state dict
  (``src/speculators/convert/eagle/eagle3_legacy_model.py``; the converter
  ``src/speculators/convert/eagle/eagle3_converter.py`` renames ``midlayer.*`` to
  ``layers.0.*`` and adds the verifier's ``embed_tokens.weight``): ``embed_tokens.weight``,
  ``fc.weight [H, 3H]`` (no bias), ``layers.0.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight``, ``layers.0.self_attn.{q,k,v}_proj.weight [.., 2H]``,
  ``layers.0.self_attn.o_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight [draft_vocab_size, H]``, ``d2t [draft_vocab_size]``
  int64 and ``t2d [vocab_size]`` bool, in the config's dtype.
- ``norm_before_residual``: ``vllm-project/vllm`` ``vllm/model_executor/models/llama_eagle3.py``
  (``_norm_before_residual``: the residual is ``hidden_norm(feature)``) and speculators'
  ``Eagle3FirstLayerMixin`` (``src/speculators/models/eagle3/model_definitions.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.contract.policy import check_config
from loraserve.runtime.contract.policy.drafts import draft_config_problems
from loraserve.runtime.model import ModelConfigError, build_model, load_arch_config
from loraserve.runtime.speculative.eagle.format import load_eagle_config

from . import test_published_drafts as published
from .conftest import eagle_runner
from .test_published_drafts import TARGET_LAYERS, _config, _lossless

assets = published.assets  # the tiny Llama and Qwen3 targets with their canonical EAGLE3 heads (a fixture)

EAGLE_ONLY = (
    "architectures",
    "eagle_aux_hidden_state_layer_ids",
    "target_hidden_size",
    "bias",
    "draft_vocab_size",
)


def _speculators_eagle3(
    dest: Path,
    canonical: Path,
    target: Path,
    *,
    dtype: torch.dtype,
    norm_before_residual: bool,
    architecture: str = "Eagle3Speculator",
) -> Path:
    """``canonical``'s head (EAGLE3 layout, default streams) written in the speculators format."""
    flat = json.loads((canonical / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    layer = {k: v for k, v in flat.items() if k not in EAGLE_ONLY}
    layer.update(model_type="llama", num_hidden_layers=1, torch_dtype=dtype_name, use_cache=True)
    verifier = json.loads((target / "config.json").read_text())
    raw = {
        "architectures": [architecture],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": flat["draft_vocab_size"],
        "has_no_defaults_at_init": False,
        "norm_before_residual": norm_before_residual,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": verifier["architectures"], "name_or_path": str(target)},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0",
        "target_hidden_size": None,
        "torch_dtype": dtype_name,
        "transformer_layer_config": layer,
        "transformers_version": "4.53.2",
    }
    out = {
        name: t.to(dtype) if t.is_floating_point() else t
        for name, t in load_file(str(canonical / "model.safetensors")).items()
    }
    t2d = torch.zeros(flat["vocab_size"], dtype=torch.bool)
    t2d[torch.arange(out["d2t"].numel()) + out["d2t"]] = True
    out["t2d"] = t2d
    out["embed_tokens.weight"] = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"].to(
        dtype
    )
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(out, str(dest / "model.safetensors"))
    return dest


def _target(a: dict):
    arch = load_arch_config(a["target"])
    model = build_model(
        arch, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, model_dir=a["target"]
    )
    return arch, model


def _inputs(arch, runner, n: int = 7, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, arch.vocab_size, (n,), generator=gen)
    return ids, torch.randn(n, runner.model.feature_size, generator=gen)


# --------------------------------------------------------------------------- the same head


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculators_head_is_the_canonical_head(assets, tmp_path, family):
    """Same weights, same streams, same vocabulary map: the same outputs and proposals."""
    a = assets[family]
    spec = _speculators_eagle3(
        tmp_path / "spec", a["canonical"], a["target"], dtype=a["dtype"], norm_before_residual=False
    )
    config = load_eagle_config(spec, target_num_layers=TARGET_LAYERS)
    assert config.version == 3 and not config.norm_before_residual and config.own_lm_head
    arch, model = _target(a)
    mine, theirs = eagle_runner(a["canonical"], arch, model), eagle_runner(spec, arch, model)
    assert theirs.aux_layer_ids == (2, 4, 5) == mine.aux_layer_ids
    assert torch.equal(theirs.vocab.to_target, mine.vocab.to_target)
    ids, feats = _inputs(arch, theirs)
    out_mine, out_theirs = mine.forward(["x"], ids, feats, [7]), theirs.forward(["x"], ids, feats, [7])
    assert torch.equal(out_mine, out_theirs) and out_theirs.abs().sum() > 0
    assert torch.equal(mine.model.compute_logits(out_mine), theirs.model.compute_logits(out_theirs))


def test_eagle3_draft_model_name_reads_alike(assets, tmp_path):
    """Newer speculators releases save the class name ``Eagle3DraftModel``: the same reading."""
    a = assets["llama"]
    spec = _speculators_eagle3(
        tmp_path / "spec",
        a["canonical"],
        a["target"],
        dtype=a["dtype"],
        norm_before_residual=True,
        architecture="Eagle3DraftModel",
    )
    config = load_eagle_config(spec, target_num_layers=TARGET_LAYERS)
    assert config.norm_before_residual and config.aux_layer_ids == (2, 4, 5)
    assert config == load_eagle_config(
        spec, architecture_override="Eagle3Speculator", target_num_layers=TARGET_LAYERS
    )


# --------------------------------------------------------------------------- norm_before_residual


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (halves rotated) at positions 0..T-1 of ``x [T, heads, d]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.arange(x.shape[0], dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _oracle(
    path: Path, embed: torch.Tensor, ids: torch.Tensor, feats: torch.Tensor, nbr: bool
) -> torch.Tensor:
    """The EAGLE3 layer of one fresh request, in plain torch from the checkpoint's tensors and
    config.json: ``f = fc(feats)``, ``x = [rms(embed(ids)), rms_hidden(f)]``, causal GQA
    attention over ``x``, residual ``rms_hidden(f)`` if ``nbr`` else ``f``, then the MLP block."""
    raw = json.loads((path / "config.json").read_text())
    layer = raw["transformer_layer_config"]
    t = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items() if v.is_floating_point()}
    eps, heads, kv_heads, d = (
        layer["rms_norm_eps"],
        layer["num_attention_heads"],
        layer["num_key_value_heads"],
        layer["head_dim"],
    )
    theta = (layer.get("rope_parameters") or layer)["rope_theta"]
    p = "layers.0."
    f = feats @ t["fc.weight"].T
    normed = _rms(f, t[p + "hidden_norm.weight"], eps)
    x = torch.cat([_rms(embed[ids], t[p + "input_layernorm.weight"], eps), normed], -1)
    n = x.shape[0]
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(n, heads, d), theta)
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, d), theta)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    h = (normed if nbr else f) + attn @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(h, t[p + "post_attention_layernorm.weight"], eps)
    mlp = (F.silu(m @ t[p + "mlp.gate_proj.weight"].T) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[
        p + "mlp.down_proj.weight"
    ].T
    return h + mlp


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_norm_before_residual_is_the_equation(assets, tmp_path, family):
    """``norm_before_residual: true`` changes the head exactly as the equation says (the
    plain-torch oracle above, checked against today's head with false first)."""
    a = assets[family]
    arch, model = _target(a)
    embed = model.embed_tokens.weight.detach().float()
    outs = {}
    for nbr in (False, True):
        spec = _speculators_eagle3(
            tmp_path / f"nbr-{nbr}",
            a["canonical"],
            a["target"],
            dtype=torch.float32,
            norm_before_residual=nbr,
        )
        runner = eagle_runner(spec, arch, model)
        assert runner.config.norm_before_residual is nbr
        ids, feats = _inputs(arch, runner)
        outs[nbr] = runner.forward(["x"], ids, feats, [7])
        expected = _oracle(spec, embed, ids, feats, nbr)
        torch.testing.assert_close(outs[nbr], expected, rtol=1e-4, atol=1e-4)
        # the other equation is not what the head computes
        assert not torch.allclose(outs[nbr], _oracle(spec, embed, ids, feats, not nbr), rtol=1e-3, atol=1e-3)
    # false is today's head: the canonical checkpoint (its float32 weights) gives the same rows
    canonical = eagle_runner(a["canonical"], arch, model)
    ids, feats = _inputs(arch, canonical)
    torch.testing.assert_close(canonical.forward(["x"], ids, feats, [7]), outs[False], rtol=1e-3, atol=1e-3)


def test_norm_before_residual_in_the_eagle3_layout(assets, tmp_path):
    """The flag at the top of an EAGLE3-layout config.json is served too (vLLM reads it there)."""
    a = assets["llama"]
    head = tmp_path / "head"
    head.mkdir()
    raw = json.loads((a["canonical"] / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(dict(raw, norm_before_residual=True)))
    (head / "model.safetensors").symlink_to(a["canonical"] / "model.safetensors")
    assert draft_config_problems("EAGLE3", dict(raw, norm_before_residual=True)) == []
    assert load_eagle_config(head).norm_before_residual
    assert not load_eagle_config(a["canonical"]).norm_before_residual


# --------------------------------------------------------------------------- served lossless


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculators_head_is_lossless(assets, tmp_path, engine_run, family):
    """Greedy spec-on = spec-off, LoRA on half the requests, with a norm_before_residual head."""
    a = assets[family]
    spec = _speculators_eagle3(
        tmp_path / "spec", a["canonical"], a["target"], dtype=a["dtype"], norm_before_residual=True
    )
    _lossless(engine_run, a["target"], a["adapter"], "EAGLE3", spec)


# --------------------------------------------------------------------------- the policy


def _policy_config(a: dict, algorithm: str, architecture: str):
    config = _config(a["target"], a["adapter"], algorithm, a["canonical"])
    config.speculative.draft_model_architecture = architecture
    return config


@pytest.mark.parametrize("architecture", ["Eagle3Speculator", "Eagle3DraftModel"])
def test_policy_serves_speculators_under_eagle3_only(assets, architecture):
    a = assets["llama"]
    served = check_config(_policy_config(a, "EAGLE3", architecture))
    assert not [v for v in served.violations if v.rule.startswith("draft-layout")], served.violations
    refused = check_config(_policy_config(a, "DFLASH", architecture))
    assert "draft-layout-algorithm" in refused.rules(), refused.violations


def test_start_up_check_admits_a_speculators_head(assets, tmp_path):
    """The runtime's start-up check (config.json read before any weight) admits the head."""
    from loraserve.runtime import cli

    a = assets["llama"]
    spec = _speculators_eagle3(
        tmp_path / "spec", a["canonical"], a["target"], dtype=a["dtype"], norm_before_residual=True
    )
    config = _config(a["target"], a["adapter"], "EAGLE3", spec)
    config.speculative.draft_model_architecture = "Eagle3Speculator"
    _, reasons, _ = cli.check(config)
    assert not any("draft" in r.lower() for r in reasons), reasons


@pytest.mark.parametrize(
    "change,words",
    [
        ({"speculators_model_type": "eagle"}, ["speculators_model_type 'eagle'", "eagle3"]),
        ({"layer": {"num_hidden_layers": 2}}, ["num_hidden_layers 2", "not served"]),
        ({"layer": {"model_type": "qwen3"}}, ["model_type is 'qwen3'", "q/k norms"]),
        ({"norm_before_fc": True}, ["norm_before_fc", "input_norm"]),
        ({"layer": {"layer_types": ["sliding_attention"]}}, ["sliding window"]),
        ({"transformer_layer_config": None}, ["without a transformer_layer_config"]),
    ],
)
def test_unserved_speculators_heads_refused_by_name(assets, tmp_path, change, words):
    """What the speculators format can say beyond one Llama EAGLE3 layer: refused with the
    reason by the policy (the start-up check's text) and by the loader, before any weight."""
    a = assets["llama"]
    spec = _speculators_eagle3(
        tmp_path / "spec", a["canonical"], a["target"], dtype=a["dtype"], norm_before_residual=True
    )
    raw = json.loads((spec / "config.json").read_text())
    change = dict(change)
    layer = change.pop("layer", None)
    if layer:
        raw["transformer_layer_config"].update(layer)
    raw.update(change)
    (spec / "config.json").write_text(json.dumps(raw))
    problems = draft_config_problems(SpecAlgorithm.EAGLE3, raw)
    assert len(problems) == 1 and all(w in problems[0] for w in words), problems
    with pytest.raises(ModelConfigError) as err:
        load_eagle_config(spec, target_num_layers=TARGET_LAYERS)
    assert all(w in str(err.value) for w in words), err.value
