"""The local model/tokenizer/adapter builders everyone's tests and the demo rely on."""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load_file

from loraserve.runtime.dev.devmodels import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_adapter,
    build_tiny_model,
    copy_model,
    ensure_demo_assets,
)


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=7)
    b = build_tiny_model(tmp_path / "b", seed=7)
    c = build_tiny_model(tmp_path / "c", seed=8)
    assert _digest(a / "model.safetensors") == _digest(b / "model.safetensors")
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")
    assert _digest(a / "tokenizer.json") == _digest(c / "tokenizer.json")
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    assert (a / "generation_config.json").is_file()


def test_tokenizer_round_trips(assets):
    """Tokenizer round trips and has a chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.models["llama-gqa"])
    assert tok.bos_token == BOS_TOKEN and tok.eos_token == EOS_TOKEN and tok.pad_token_id == 0
    assert len(tok) <= 512
    text = "Hello, world! def f(x): return x * 2  # ünïcode"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.startswith(BOS_TOKEN) and "hi" in chat and chat.endswith("<|assistant|>\n")


def test_adapter_weights_random(assets):
    """Adapter weights are random and saved by PEFT."""
    path = assets.adapters["emb-head"]
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and set(cfg["target_modules"]) == {"embed_tokens", "lm_head", "v_proj"}
    tensors = load_file(str(path / "adapter_model.safetensors"))
    assert not (path / "adapter_model.bin").exists()
    b_mats = [t for k, t in tensors.items() if "lora_B" in k or "lora_embedding_B" in k]
    assert b_mats and all(t.abs().sum() > 0 for t in b_mats)  # PEFT's zero init would be a no-op
    assert not any(k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight") for k in tensors)


def test_adapter_is_deterministic_per_seed(assets, tmp_path):
    base = assets.models["llama-gqa"]
    a = build_adapter(tmp_path / "a", base, seed=3)
    b = build_adapter(tmp_path / "b", base, seed=3)
    c = build_adapter(tmp_path / "c", base, seed=4)
    ta, tb, tc = (load_file(str(p / "adapter_model.safetensors")) for p in (a, b, c))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert any(not torch.equal(ta[k], tc[k]) for k in ta)


def test_demo_assets_build_once_and_are_reused(tmp_path):
    first = ensure_demo_assets(tmp_path / "demo")
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "demo").rglob("*") if p.is_file()}
    second = ensure_demo_assets(tmp_path / "demo")
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "demo").rglob("*") if p.is_file()} == stamps
    assert len(first.adapters) == 2
    ranks = {json.loads((p / "adapter_config.json").read_text())["r"] for p in first.adapters.values()}
    assert len(ranks) == 2  # two adapters of different ranks
    assert _digest(first.draft_dir / "tokenizer.json") == _digest(first.model_dir / "tokenizer.json")
    # a half-built directory (no completion marker) is rebuilt
    (first.draft_dir / ".complete").unlink()
    (first.draft_dir / "model.safetensors").unlink()
    ensure_demo_assets(tmp_path / "demo")
    assert (first.draft_dir / "model.safetensors").is_file()


def test_copy_model_is_identical(assets, tmp_path):
    src = assets.models["qwen2-bias"]
    dest = copy_model(src, tmp_path / "copy")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert _digest(src / name) == _digest(dest / name)
