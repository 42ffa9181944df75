"""The draft runs base weights only: an embedding/lm_head adapter in the target never
reaches it, and it shares the target's BASE embedding and output projection."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.runner.forward_batch import ForwardBatchError


def test_head_adapter_skips_draft(assets, make_runner, ops):
    """Embedding and lm head adapter changes target but not draft."""
    model_dir = assets.models["llama-gqa"]
    target = make_runner(model_dir)
    prompt = torch.arange(3, 17)

    draft = make_runner(model_dir, is_draft=True)
    assert draft.lora is None and draft.is_draft
    draft_before = ops.extend(draft, ["d0"], [prompt], all_logits=True).logits
    draft_dec_before = ops.decode(draft, ["d0"], [9]).logits

    base = ops.extend(target, ["base"], [prompt], all_logits=True).logits
    target.lora.load("emb", assets.adapters["emb-head"])
    assert set(target.lora.get("emb").target_modules) >= {"embed_tokens", "lm_head"}
    adapted = ops.extend(target, ["adapted"], [prompt], names=["emb"], all_logits=True).logits
    assert (adapted - base).abs().max() > 1e-2  # the adapter changes the target's output
    # and the base rows of the target are untouched by having the adapter loaded
    torch.testing.assert_close(ops.extend(target, ["base2"], [prompt], all_logits=True).logits, base, atol=0, rtol=0)

    draft_after = ops.extend(draft, ["d1"], [prompt], all_logits=True).logits
    assert torch.equal(draft_after, draft_before)  # bit-identical
    assert torch.equal(ops.decode(draft, ["d1"], [9]).logits, draft_dec_before)
    torch.testing.assert_close(draft_after, base, atol=0, rtol=0)  # same weights, base model

    # the shared modules are the base ones: the draft's output equals the target's base head
    assert torch.equal(target.embed_tokens.weight, draft.embed_tokens.weight)
    assert torch.equal(target.lm_head.weight, draft.lm_head.weight)
    hidden = torch.randn(3, target.hidden_size)
    torch.testing.assert_close(target.lm_head(hidden), draft.lm_head(hidden), atol=0, rtol=0)


def test_draft_refuses_adapter_names(assets, make_runner, ops):
    draft = make_runner(assets.models["llama-gqa"], is_draft=True)
    with pytest.raises(ForwardBatchError, match="draft runs base weights only"):
        ops.decode(draft, ["x"], [1], names=["emb"])
    assert "x" not in draft.kv


def test_draft_from_config_path(assets, make_config, tmp_path):
    """Draft from config path and shared tokenizer."""
    from transformers import AutoTokenizer

    from loraserve.runtime.dev.devmodels import build_draft_model, copy_model
    from loraserve.runtime.runner.model_runner import ModelRunner

    target_dir = assets.models["llama-gqa"]
    small = build_draft_model(tmp_path / "small", target_dir)
    same = copy_model(target_dir, tmp_path / "same")
    config = make_config(target_dir)
    config.speculative.draft_model_path = str(small)
    draft = ModelRunner(config, is_draft=True)
    assert draft.lora is None and draft.num_layers == 1 and draft.vocab_size == 512
    text = "def speculative(x): return x"
    assert AutoTokenizer.from_pretrained(small)(text)["input_ids"] == AutoTokenizer.from_pretrained(target_dir)(text)["input_ids"]
    identical = ModelRunner(config, is_draft=True, model_path=same)
    target = ModelRunner(config)
    for name, param in target.model.named_parameters():
        assert torch.equal(param, identical.model.get_parameter(name)), name
    config.speculative.draft_model_path = None
    with pytest.raises(ValueError, match=r"speculative\.draft_model_path is not set"):
        ModelRunner(config, is_draft=True)
