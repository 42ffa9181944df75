"""Build a model and fill it from a local Hugging Face directory (safetensors only)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from .arch import ModelArchConfig, ModelConfigError
from .llama import LlamaForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model directory (one file or a sharded index)."""
    model_dir = Path(model_dir)
    if (model_dir / INDEX_FILE).is_file():
        index = json.loads((model_dir / INDEX_FILE).read_text())
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise ModelConfigError(f"{model_dir / INDEX_FILE} has an empty weight_map")
        files = [model_dir / shard for shard in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelConfigError(f"shards named by {INDEX_FILE} are missing: {missing}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelConfigError(
            f"{model_dir} holds only pickle weights (*.bin/*.pt), which can run arbitrary code when loaded: "
            "convert them to safetensors (model.save_pretrained(dir, safe_serialization=True))"
        )
    raise ModelConfigError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}: model.path needs safetensors weights")


def iter_checkpoint(model_dir: str | Path, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, one file at a time."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


def build_model(
    arch: ModelArchConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    model_dir: str | Path | None = None,
    random_init_std: float | None = None,
    seed: int = 0,
) -> LlamaForCausalLM:
    """Build the model on ``device``; load ``model_dir`` or, for benchmarks, random weights."""
    with torch.device(device):
        model = LlamaForCausalLM(arch, max_positions=max_positions, dtype=dtype, device=device)
    if random_init_std is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, random_init_std, generator=generator)
    elif model_dir is None:
        raise ValueError("build_model needs model_dir or random_init_std")
    else:
        model.load_weights(iter_checkpoint(model_dir, device=device))
    return model.eval()
