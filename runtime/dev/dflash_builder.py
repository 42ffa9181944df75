"""Tiny DFLASH draft checkpoints with random weights, for tests, demos and benchmarks.

The files follow :mod:`loraserve.runtime.speculative.dflash.format` exactly (z-lab's
``DFlashDraftModel`` layout), so loading them exercises the same path as a trained
draft. Shapes come from the target's config.json: the draft shares the target's hidden
size, heads and vocabulary (it uses the target's embedding and LM head).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..model.arch import DRAFT_SHAPE_KEYS, arch_from_dict, read_config_json
from ..speculative.dflash.format import dflash_config_from_dict

_UNSET = object()


def dflash_draft_config(
    target_dir: str | Path,
    *,
    num_layers: int = 1,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int | None = 4,
    mask_token_id: int | object | None = _UNSET,
    mask_token: str | None = None,
    intermediate_size: int | None = None,
    dtype: str = "float32",
) -> dict:
    """A DFLASH draft's config.json for ``target_dir`` (a dict).

    ``target_layer_ids`` None leaves the field out (the reader's default applies);
    ``mask_token_id`` defaults to the target's last token id, and None leaves it out (the
    reader then resolves it from a tokenizer); ``mask_token``: the mask token's text.
    """
    raw_target = read_config_json(target_dir, missing="target_dir must be a model directory")
    target = arch_from_dict(raw_target)
    raw = {key: raw_target[key] for key in DRAFT_SHAPE_KEYS if key in raw_target}
    nested: dict = {}
    if block_size is not None:
        nested["block_size"] = int(block_size)
    if target_layer_ids is not None:
        nested["target_layer_ids"] = [int(i) for i in target_layer_ids]
    if mask_token_id is _UNSET:
        mask_token_id = target.vocab_size - 1
    if mask_token_id is not None:
        nested["mask_token_id"] = int(mask_token_id)  # type: ignore[call-overload]
    if mask_token is not None:
        nested["mask_token"] = mask_token
    raw.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=int(num_layers),
        num_target_layers=target.num_layers,
        intermediate_size=int(intermediate_size or target.intermediate_size),
        head_dim=target.head_dim,
        attention_bias=False,
        layer_types=["full_attention"] * int(num_layers),
        torch_dtype=dtype,
        tie_word_embeddings=False,
        dflash_config=nested,
    )
    if block_size is not None:
        raw["block_size"] = int(block_size)  # the older top-level spelling, kept in step
    return raw


def write_dflash_draft(
    dest: str | Path, raw: Mapping, tensors: Mapping[str, torch.Tensor], *, dtype: str = "float32"
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a DFLASH draft."""
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(dict(raw), indent=2, sort_keys=True) + "\n")
    out = {name: t.detach().to(torch_dtype).contiguous() for name, t in tensors.items()}
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def build_dflash_draft(
    dest: str | Path,
    target_dir: str | Path,
    *,
    num_layers: int = 1,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int | None = 4,
    mask_token_id: int | object | None = _UNSET,
    mask_token: str | None = None,
    intermediate_size: int | None = None,
    seed: int = 0,
    init_std: float = 0.05,
    dtype: str = "float32",
) -> Path:
    """Write a DFLASH draft with random weights for ``target_dir`` (see :func:`dflash_draft_config`)."""
    raw = dflash_draft_config(
        target_dir,
        num_layers=num_layers,
        target_layer_ids=target_layer_ids,
        block_size=block_size,
        mask_token_id=mask_token_id,
        mask_token=mask_token,
        intermediate_size=intermediate_size,
        dtype=dtype,
    )
    target_layers = int(raw["num_target_layers"])
    config = dflash_config_from_dict(raw, target_num_layers=target_layers)
    config.check_target(
        arch_from_dict(read_config_json(target_dir, missing="target_dir must be a model directory"))
    )
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(config.tensor_shapes().items()):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * init_std
    return write_dflash_draft(dest, raw, tensors, dtype=dtype)
