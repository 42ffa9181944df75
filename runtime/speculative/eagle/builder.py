"""Tiny EAGLE / EAGLE3 draft checkpoints with random weights, for tests and demos.

The files follow :mod:`.format` exactly, so loading them exercises the same path
as a trained draft. Shapes come from the target's config.json (the draft must share
the target's hidden size and vocabulary).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ...model.arch import DRAFT_SHAPE_KEYS, arch_from_dict, read_config_json
from .format import EAGLE_ARCHITECTURES, INPUT_NORM, default_aux_layers, eagle_config_from_dict
from .lora import HEAD_LORA_MODULES


def build_eagle_draft(
    dest: str | Path,
    target_dir: str | Path,
    *,
    version: int = 1,
    aux_layer_ids: Sequence[int] | None = None,
    intermediate_size: int | None = None,
    input_norm: bool = True,
    fc_bias: bool = False,
    seed: int = 0,
    init_std: float = 0.05,
    dtype: str = "float32",
    draft_vocab: Sequence[int] | None = None,
) -> Path:
    """Write an EAGLE (``version=1``) or EAGLE3 (``version=3``) draft for ``target_dir``.

    ``aux_layer_ids``: EAGLE3 feature streams (default: low, middle and high layers).
    ``input_norm``: EAGLE only; False writes the original layout without the layer's
    input norm. ``draft_vocab``: target token ids; the draft gets its own LM head over
    these tokens (``draft_vocab_size`` and a ``d2t`` map, as EAGLE3 training writes them).
    """
    architecture = {v: k for k, v in EAGLE_ARCHITECTURES.items()}.get(version)
    if architecture is None:
        raise ValueError(f"version must be 1 (EAGLE) or 3 (EAGLE3), got {version}")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    target_dir = Path(target_dir)
    raw_target = read_config_json(target_dir, missing="target_dir must be a model directory")
    target = arch_from_dict(raw_target)
    raw = {key: raw_target[key] for key in DRAFT_SHAPE_KEYS if key in raw_target}
    raw.update(
        architectures=[architecture],
        model_type="llama",
        num_hidden_layers=1,
        intermediate_size=int(intermediate_size or target.intermediate_size),
        head_dim=target.head_dim,
        target_hidden_size=target.hidden_size,
        bias=fc_bias,
        torch_dtype=dtype,
        tie_word_embeddings=False,
    )
    if version == 3:
        ids = (
            list(aux_layer_ids) if aux_layer_ids is not None else list(default_aux_layers(target.num_layers))
        )
        raw["eagle_aux_hidden_state_layer_ids"] = ids
    if draft_vocab is not None:
        raw["draft_vocab_size"] = len(draft_vocab)
    config = eagle_config_from_dict(raw)
    config.check_target(target)

    shapes = config.tensor_shapes()
    if version == 1 and not input_norm:
        del shapes[INPUT_NORM]
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    if draft_vocab is not None:
        # draft row i predicts target token draft_vocab[i] = i + d2t[i]
        shapes.pop("d2t", None)
        tensors["d2t"] = torch.tensor(list(draft_vocab), dtype=torch.int64) - torch.arange(len(draft_vocab))
    for name, shape in sorted(shapes.items()):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        else:
            tensor = torch.randn(shape, generator=generator) * init_std
        tensors[name] = tensor.to(torch_dtype).contiguous()

    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def build_eagle_draft_adapter(
    dest: str | Path,
    draft_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: Sequence[str] = HEAD_LORA_MODULES,
    seed: int = 0,
    init_std: float = 0.05,
) -> Path:
    """Write a random draft adapter for the EAGLE head at ``draft_dir``, as peft names a
    LoRA of the head's modules (``base_model.model.fc...``, ``base_model.model.layers.0...``).

    Both ``lora_A`` and ``lora_B`` are random (peft starts ``lora_B`` at zero), so the
    adapter moves the head's proposals: tests use it to tell adapted rows from base ones.
    """
    from safetensors.torch import save_file

    from .format import load_eagle_config

    unknown = sorted(set(target_modules) - set(HEAD_LORA_MODULES))
    if unknown:
        raise ValueError(f"target_modules {unknown} are not head modules: use {HEAD_LORA_MODULES}")
    shapes = load_eagle_config(draft_dir).tensor_shapes()
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for module in target_modules:
        if module == "fc":
            name = "fc"
        else:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"layers.0.{block}.{module}"
        out_dim, in_dim = shapes[f"{name}.weight"]
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_dim, generator=generator) * init_std
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_dim, rank, generator=generator) * init_std
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(target_modules),
        "bias": "none",
        "lora_dropout": 0.0,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    return dest
