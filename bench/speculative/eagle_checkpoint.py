"""An EAGLE head written as the runtime reads one: ``config.json`` and ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Keys an EAGLE config.json takes over from its target's (eagle_builder does the same).
EAGLE_COPIED_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling", "hidden_act", "bos_token_id",
    "eos_token_id", "pad_token_id",
)  # fmt: skip


def eagle_config(target_raw: dict, intermediate: int) -> dict:
    """config.json of an EAGLE head for the target whose config.json is ``target_raw``."""
    raw = {key: target_raw[key] for key in EAGLE_COPIED_KEYS if key in target_raw}
    raw.update(
        architectures=["LlamaForCausalLMEagle"],
        model_type="llama",
        num_hidden_layers=1,
        intermediate_size=intermediate,
        target_hidden_size=target_raw["hidden_size"],
        bias=False,
        tie_word_embeddings=False,
        # float32 on disk: the expansion's rescaled norm weights are not bfloat16 values;
        # the runtime casts to the serving dtype, as it does for the expanded target
        torch_dtype="float32",
    )
    return raw


def save_eagle_head(tensors: dict[str, torch.Tensor], raw: dict, dest: Path) -> Path:
    """Write an EAGLE draft directory (``eagle_format``): config.json + model.safetensors (float32)."""
    from safetensors.torch import save_file

    from loraserve.runtime.speculative.eagle_format import eagle_config_from_dict

    config = eagle_config_from_dict(raw)
    shapes = config.tensor_shapes()
    wrong = {n: tuple(t.shape) for n, t in tensors.items() if shapes.get(n) != tuple(t.shape)}
    if wrong or set(shapes) != set(tensors):
        raise ValueError(
            f"EAGLE head tensors do not fit their config: {wrong or sorted(set(shapes) ^ set(tensors))}"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=1))
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, str(dest / "model.safetensors"))
    return dest
