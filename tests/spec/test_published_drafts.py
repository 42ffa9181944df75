"""Draft checkpoints in the layouts they are published in: served lossless, or refused by name.

Where each layout comes from (the public sources read; the tests rebuild them at tiny sizes):

- EAGLE3 for Llama 3.1 8B (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, EAGLE's own training code):
  ``config.json`` is a Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``num_hidden_layers: 1``, ``draft_vocab_size: 32000``, ``torch_dtype: float16``, and no
  ``eagle_aux_hidden_state_layer_ids`` nor ``target_hidden_size`` (vLLM then takes the target's
  streams ``(2, L // 2, L - 3)``: ``get_eagle3_aux_hidden_state_layers`` in vLLM's llama.py, and
  ``fc`` is ``[H, 3 * H]``: llama_eagle3.py). The one layer is named ``midlayer.*`` (vLLM's
  ``load_weights`` renames ``midlayer.`` to ``layers.0.``), beside ``fc.weight``, ``norm.weight``,
  ``lm_head.weight [draft_vocab_size, H]``, ``d2t [draft_vocab_size]`` int64 (target id = draft
  id + d2t) and ``t2d [vocab_size]`` bool; it is published as ``pytorch_model.bin``.
- EAGLE3 for Qwen3 (``AngelSlim/Qwen3-8B_eagle3``, ``Tengyunw/qwen3_8b_eagle3``, trained with
  SpecForge): the same Llama-layer head (SpecForge's ``configs/qwen3-*-eagle3.json``:
  ``model_type: llama``, ``head_dim``, Qwen3's ``rope_theta`` and ``rms_norm_eps``), in
  bfloat16 safetensors; some copies carry the target's ``embed_tokens.weight`` (vLLM's loader
  accepts either: ``includes_embed_tokens``).
- DFlash for Qwen3 (``z-lab/Qwen3-8B-DFlash-b16``): SpecForge's ``configs/qwen3-8b-dflash.json``
  and ``qwen3-8b-dspark.json``: ``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3``,
  top-level ``block_size: 16``, ``dflash_config: {mask_token_id: 151669, target_layer_ids:
  [1, 9, 17, 25, 33]}``, ``num_target_layers``, ``layer_types`` all ``full_attention``,
  ``sliding_window: null``, ``use_sliding_window: false``, ``dtype: bfloat16``; tensors
  ``layers.N.*`` (with q/k norms), ``fc.weight [H, 5H]``, ``hidden_norm.weight``, ``norm.weight``.
  The Llama 3.1 DFlash drafts (``z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat``) use the same
  ``DFlashDraftModel`` schema at Llama's sizes (their config.json was not in the sources read).
- Refused: multi-layer EAGLE3 heads (vLLM's ``layer_idx > 0`` layers take ``H``, not ``2H``),
  SpecForge's ``DSparkDraftModel`` (``dflash_config.markov_rank``, ``enable_confidence_head``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.contract.config import LORA_MODULES, RuntimeConfig, SpecAlgorithm
from loraserve.runtime.model import ModelConfigError, build_model, load_arch_config
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.speculative.eagle.format import load_eagle_config

from .conftest import eagle_runner

TARGET_LAYERS = 8  # the default EAGLE3 streams (2, 4, 5) are distinct from 8 layers up


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    root = tmp_path_factory.mktemp("published")
    out = {}
    for family, seed, dtype in (("llama", 61, "float16"), ("qwen3", 62, "bfloat16")):
        target = build_tiny_model(
            root / family, architecture=family, num_layers=TARGET_LAYERS, head_dim=16, seed=seed
        )
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        keep = sorted(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed)).tolist()[: vocab // 2])
        canonical = build_eagle_draft(
            root / f"{family}-eagle3", target, version=3, seed=seed, init_std=0.1, dtype=dtype, draft_vocab=keep
        )
        out[family] = {
            "target": target,
            "canonical": canonical,
            "adapter": build_adapter(root / f"{family}-lora", target, rank=8, seed=seed),
            "dtype": getattr(torch, dtype),  # as published: EAGLE's float16, SpecForge's bfloat16
        }
    return out


def _published_eagle3(dest: Path, canonical: Path, target: Path, *, dtype: torch.dtype, embed: bool, pickle: bool):
    """``canonical``'s head rewritten as published (see the module docstring)."""
    raw = json.loads((canonical / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "target_hidden_size", "bias"):
        raw.pop(key)  # absent from the published configs: the defaults apply
    raw.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        torch_dtype=str(dtype).removeprefix("torch."),
        use_cache=True,
        hidden_act="silu",
    )
    tensors = load_file(str(canonical / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        name = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
        out[name] = t.to(dtype) if t.is_floating_point() else t
    vocab = raw["vocab_size"]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.arange(out["d2t"].numel()) + out["d2t"]] = True
    out["t2d"] = t2d
    if embed:
        out["embed_tokens.weight"] = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"].to(dtype)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    if pickle:
        torch.save(out, dest / "pytorch_model.bin")
    else:
        save_file(out, str(dest / "model.safetensors"))
    return dest


def _config(target: Path, adapter: Path, algorithm: str = "NONE", draft: Path | None = None, k: int = 4):
    config = RuntimeConfig()
    config.model.path = str(target)
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.max_running_requests = 6
    config.lora.max_rank = 8
    config.lora.target_modules = LORA_MODULES
    config.lora.backend = "torch"
    config.lora.adapters = {"a": str(adapter)}
    config.speculative.algorithm = SpecAlgorithm(algorithm)
    if algorithm != "NONE":
        config.speculative.draft_model_path = str(draft)
        if algorithm == "DFLASH":
            config.speculative.num_draft_tokens = k
        else:
            config.speculative.num_steps, config.speculative.num_draft_tokens = k - 1, k
    return config


def _requests():
    gen = torch.Generator().manual_seed(9)
    out = []
    for i in range(4):
        n = int(torch.randint(5, 24, (1,), generator=gen))
        unit = torch.randint(3, 500, (3,), generator=gen)
        prompt = unit.repeat(n)[:n].tolist() if i % 2 else torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append((f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0), "a" if i % 2 else None))
    return out


def _lossless(engine_run, target, adapter, algorithm, draft, **kw):
    requests = _requests()
    base = engine_run(_config(target, adapter), requests)
    spec = engine_run(_config(target, adapter, algorithm, draft, **kw), requests)
    for rid, *_ in requests:
        assert spec.outputs[rid].error is None, (rid, spec.outputs[rid].error)
        assert spec.outputs[rid].tokens == base.outputs[rid].tokens, rid
    assert all(len(base.outputs[rid].tokens) == 12 for rid, *_ in requests)
    # The draft ran (it proposed every step); a random head's proposals are mostly rejected,
    # which exercises the correction path: the loading itself is pinned by the same-head tests.
    assert all(spec.outputs[rid].spec.draft_tokens > 0 for rid, *_ in requests)


# --------------------------------------------------------------------------- EAGLE3


@pytest.mark.parametrize("family,embed", [("llama", False), ("qwen3", True)])
def test_published_eagle3_is_the_same_head(assets, tmp_path, family, embed):
    """The published layout loads into exactly the head its canonical form does: same
    streams (the default triple), same vocabulary map, same weights, same proposals."""
    a = assets[family]
    published = _published_eagle3(tmp_path / "pub", a["canonical"], a["target"], dtype=a["dtype"], embed=embed, pickle=False)
    arch = load_arch_config(a["target"])
    model = build_model(arch, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, model_dir=a["target"])
    mine, theirs = eagle_runner(a["canonical"], arch, model), eagle_runner(published, arch, model)
    assert theirs.aux_layer_ids == (2, 4, 5) == mine.aux_layer_ids
    assert torch.equal(theirs.vocab.to_target, mine.vocab.to_target)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, arch.vocab_size, (7,), generator=gen)
    feats = torch.randn(7, theirs.model.feature_size, generator=gen)
    out_mine, out_theirs = mine.forward(["x"], ids, feats, [7]), theirs.forward(["x"], ids, feats, [7])
    assert torch.equal(out_mine, out_theirs) and out_theirs.abs().sum() > 0
    assert torch.equal(mine.model.greedy_tokens(out_mine), theirs.model.greedy_tokens(out_theirs))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_published_eagle3_is_lossless(assets, tmp_path, engine_run, family):
    a = assets[family]
    published = _published_eagle3(tmp_path / "pub", a["canonical"], a["target"], dtype=a["dtype"], embed=False, pickle=False)
    _lossless(engine_run, a["target"], a["adapter"], "EAGLE3", published)


def test_pickle_head_refused(assets, tmp_path):
    """yuhuili's heads are pytorch_model.bin: refused by name, and the fix the message gives works."""
    from loraserve.runtime.speculative.eagle.format import load_eagle_tensors

    a = assets["llama"]
    published = _published_eagle3(tmp_path / "pub", a["canonical"], a["target"], dtype=torch.float16, embed=False, pickle=True)
    config = load_eagle_config(published, target_num_layers=TARGET_LAYERS)
    with pytest.raises(ModelConfigError, match=r"pytorch_model\.bin.*safetensors\.torch\.save_file"):
        load_eagle_tensors(published, config)
    save_file(torch.load(published / "pytorch_model.bin", weights_only=True), str(published / "model.safetensors"))
    assert set(load_eagle_tensors(published, config)) == set(config.tensor_shapes())


def test_eagle3_without_streams_needs_the_target(assets):
    raw = json.loads((assets["llama"]["canonical"] / "config.json").read_text())
    del raw["eagle_aux_hidden_state_layer_ids"]
    from loraserve.runtime.speculative.eagle.format import eagle_config_from_dict

    with pytest.raises(ModelConfigError, match="eagle_aux_hidden_state_layer_ids"):
        eagle_config_from_dict(raw)
    assert eagle_config_from_dict(raw, target_num_layers=32).aux_layer_ids == (2, 16, 29)  # Llama 3.1 8B's
    assert eagle_config_from_dict(raw, target_num_layers=36).aux_layer_ids == (2, 18, 33)  # Qwen3-8B's


# --------------------------------------------------------------------------- refused layouts


def _multi_layer_head(dest: Path, canonical: Path) -> Path:
    """vLLM's multi-layer EAGLE3 layout: layers.0 reads [embedding, feature] (2H), layers.1 H."""
    raw = json.loads((canonical / "config.json").read_text())
    raw["num_hidden_layers"] = 2
    tensors = load_file(str(canonical / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("layers.0.") and "hidden_norm" not in n]:
        t = tensors[name]
        second = t[:, : t.shape[1] // 2] if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) else t
        tensors["layers.1." + name.removeprefix("layers.0.")] = second.clone()
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def test_multi_layer_eagle_refused(assets, tmp_path):
    """At start-up (the CLI's checks, before any weight loads) and by the loader, with the reason."""
    from loraserve.runtime import cli

    a = assets["llama"]
    head = _multi_layer_head(tmp_path / "two", a["canonical"])
    with pytest.raises(ModelConfigError, match=r"num_hidden_layers 2.*not served"):
        load_eagle_config(head, target_num_layers=TARGET_LAYERS)
    config = _config(a["target"], a["adapter"], "EAGLE3", head)
    config.speculative.draft_model_architecture = "LlamaForCausalLMEagle3"
    _, reasons, _ = cli.check(config)
    assert any("num_hidden_layers 2" in r and "single-layer" in r for r in reasons), reasons
    config.speculative.draft_model_path = str(a["canonical"])
    _, reasons, _ = cli.check(config)
    assert not any("num_hidden_layers" in r for r in reasons), reasons


def test_dspark_under_dflash_refused(assets, tmp_path):
    """DSpark checkpoint under DFlash is refused."""
    from loraserve.runtime import cli
    from loraserve.runtime.speculative.dflash.format import dflash_config_from_dict

    a = assets["qwen3"]
    raw = _zlab_config(a["target"])
    raw["dflash_config"].update(projector_type="dspark", markov_rank=4, enable_confidence_head=True)
    with pytest.raises(ModelConfigError, match="Markov head"):
        dflash_config_from_dict(raw, target_num_layers=TARGET_LAYERS)
    with pytest.raises(ModelConfigError, match="DSPARK draft"):
        dflash_config_from_dict(dict(raw, architectures=["DSparkDraftModel"]), target_num_layers=TARGET_LAYERS)
    draft = tmp_path / "dspark"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(raw))
    config = _config(a["target"], a["adapter"], "DFLASH", draft)
    _, reasons, _ = cli.check(config)
    assert any("markov_rank" in r and "confidence head" in r for r in reasons), reasons


# --------------------------------------------------------------------------- DFlash


def _zlab_config(target: Path) -> dict:
    """z-lab's DFlashDraftModel config.json fields (module docstring), at the target's sizes."""
    t = json.loads((target / "config.json").read_text())
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 4,
        "dflash_config": {"mask_token_id": t["vocab_size"] - 1, "target_layer_ids": [1, 3, 5]},
        "dtype": "bfloat16",
        "head_dim": t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"],
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": t["intermediate_size"],
        "layer_types": ["full_attention"] * 2,
        "max_position_embeddings": t["max_position_embeddings"],
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": t["num_attention_heads"],
        "num_hidden_layers": 2,
        "num_key_value_heads": t["num_key_value_heads"],
        "num_target_layers": t["num_hidden_layers"],
        "rms_norm_eps": t["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": (t.get("rope_parameters") or t)["rope_theta"],  # transformers 5 nests it
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": t["vocab_size"],
    }


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_zlab_dflash_is_lossless(assets, tmp_path, engine_run, family):
    from loraserve.runtime.speculative.dflash.format import dflash_config_from_dict, random_dflash_tensors

    a = assets[family]
    raw = _zlab_config(a["target"])
    config = dflash_config_from_dict(raw, target_num_layers=TARGET_LAYERS)
    assert config.block_size == 4 and config.target_layer_ids == (1, 3, 5)
    tensors = {k: v.to(torch.bfloat16) for k, v in random_dflash_tensors(config, seed=5, std=0.1).items()}
    draft = tmp_path / "dflash"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(draft / "model.safetensors"))
    _lossless(engine_run, a["target"], a["adapter"], "DFLASH", draft, k=4)
