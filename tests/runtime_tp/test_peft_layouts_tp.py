"""peft's default layout under tensor parallelism: each rank holds only a shard of the
embedding / lm_head, so the full copies peft saves beside an adapter of those modules are
checked against the checkpoint's whole weight (tied: the embedding), then dropped. Output
equals one device; a copy that differs is refused on the group as on one device.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.lora import AdapterError
from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import tp_config, tp_group
from .test_layouts import TOL, _run_modes

EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"
HEAD_COPY = "base_model.model.lm_head.base_layer.weight"


def _save_peft_adapter(dest: Path, base_dir: Path, *, seed: int, target_modules) -> Path:
    """peft's files with its default save_embedding_layers ("auto"), random LoRA weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.requires_grad_(False)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=list(target_modules), lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(peft_model.named_parameters()):
                if ".lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        peft_model.save_pretrained(str(dest), safe_serialization=True)
    assert {EMBED_COPY, HEAD_COPY} <= set(load_file(str(dest / "adapter_model.safetensors")))
    return dest


def _perturbed(src: Path, dest: Path, tensor: str) -> Path:
    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "adapter_model.safetensors"))
    tensors[tensor] = tensors[tensor].clone()
    tensors[tensor][-1, 0] += 1e-3  # the last row: held by the last rank's shard
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return dest


@pytest.mark.parametrize("model", ["gqa", "replicated"])
def test_peft_layout_two_ranks_match(model, tp_assets, tmp_path):
    """gqa: untied, vocab 512. replicated: tied embeddings, vocab 509 (a padded shard)."""
    base = getattr(tp_assets, model)
    path = _save_peft_adapter(
        tmp_path / "emb-auto",
        base,
        seed=90,
        target_modules=("embed_tokens", "lm_head", "v_proj", "gate_proj"),
    )
    adapters = {"emb-auto": path}
    ref = ModelRunner(tp_config(base, 1, adapters))
    want = _run_modes(ref, ["emb-auto", None, "emb-auto"])
    base_only = _run_modes(ref, [None, None, None])
    assert (want - base_only).abs().max() > 1e-2, "the adapter must change the output"
    with tp_group(tp_config(base, 2, adapters)) as (_, runner):
        assert runner.shard is not None
        got = _run_modes(runner, ["emb-auto", None, "emb-auto"])
        for tensor in (EMBED_COPY, HEAD_COPY):
            bad = _perturbed(path, tmp_path / f"bad-{tensor.count('.')}", tensor)
            with pytest.raises(AdapterError, match="differ from the served model's") as err:
                runner.lora.load("bad", bad)
            assert err.value.field == tensor
            assert "bad" not in runner.lora
        # the group still serves, unchanged
        again = _run_modes(runner, ["emb-auto", None, "emb-auto"])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    torch.testing.assert_close(again, want, atol=TOL, rtol=0)
