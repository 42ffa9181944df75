"""Random PEFT LoRA adapters for the serving target."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loraserve.runtime.contract.config import DEFAULT_LORA_MODULES


def write_adapter(dest: Path, raw_cfg: dict, *, rank: int, seed: int, b_std: float) -> Path:
    """A PEFT LoRA adapter (all linear modules) with random A and small random B."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    h, inter = raw_cfg["hidden_size"], raw_cfg["intermediate_size"]
    q = raw_cfg["num_attention_heads"] * raw_cfg["head_dim"]
    kv = raw_cfg["num_key_value_heads"] * raw_cfg["head_dim"]
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(raw_cfg["num_hidden_layers"]):
        for module in DEFAULT_LORA_MODULES:
            fan_in, fan_out = dims[module]
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).to(
                torch.bfloat16
            )
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * b_std).to(
                torch.bfloat16
            )
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(DEFAULT_LORA_MODULES),
           "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest
