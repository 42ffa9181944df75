"""Model directories: sharded checkpoints load; bad ones are refused with the fix named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.model import ModelConfigError, WeightLoadError
from loraserve.runtime.runner.model_runner import ModelRunner


def _clone(src, dest):
    shutil.copytree(src, dest)
    return dest


def test_sharded_checkpoint_loads_and_matches(assets, make_config, hf_model, ops, tmp_path):
    src = assets.models["qwen2-bias"]
    reference = hf_model(src)
    sharded = tmp_path / "sharded"
    reference.save_pretrained(str(sharded), max_shard_size="60KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    runner = ModelRunner(make_config(sharded))
    prompt = torch.arange(3, 15)
    out = ops.extend(runner, ["s"], [prompt], all_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, reference(prompt[None]).logits[0], atol=2e-4, rtol=0)


def test_pickle_only_model_is_refused(assets, make_config, tmp_path):
    d = _clone(assets.models["llama-gqa"], tmp_path / "pickle")
    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="pickle weights"):
        ModelRunner(make_config(d))


def test_bad_weights_refused(assets, make_config, tmp_path):
    """Incomplete or mismatched weights are refused."""
    d = _clone(assets.models["llama-gqa"], tmp_path / "missing")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        ModelRunner(make_config(d))

    d = _clone(assets.models["llama-gqa"], tmp_path / "shape")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"k_proj.weight' has shape \(48, 64\), the model expects \(32, 64\)"):
        ModelRunner(make_config(d))

    d = _clone(assets.models["llama-gqa"], tmp_path / "extra")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.5.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"layers.5.mlp.up_proj.weight' has no place"):
        ModelRunner(make_config(d))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope type 'dynamic'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_size": None}, "'hidden_size' must be a positive integer"),
    ],
)
def test_unsupported_configs_are_refused(assets, make_config, tmp_path, change, message):
    d = _clone(assets.models["llama-gqa"], tmp_path / "cfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelRunner(make_config(d))


def test_missing_directory_names_the_field(make_config, tmp_path):
    with pytest.raises(ModelConfigError, match=r"model\.path must be a local directory"):
        ModelRunner(make_config(tmp_path / "nowhere"))
