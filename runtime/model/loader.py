"""Build a model and fill it from a local Hugging Face directory (safetensors only)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .arch import ModelArchConfig, ModelConfigError
from .layers.parallel import Collectives
from .llama import _STACKED, LlamaForCausalLM
from .moe import shard_moe_tensor

if TYPE_CHECKING:
    from ..distributed.sharding import ShardPlan

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


def read_checkpoint_tensor(model_dir: str | Path, name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint, on the host, or None when no file holds ``name``."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                return f.get_tensor(name)
    return None


def build_model(
    arch: ModelArchConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    model_dir: str | Path | None = None,
    random_init_std: float | None = None,
    seed: int = 0,
    shard: ShardPlan | None = None,
    group: Collectives | None = None,
) -> LlamaForCausalLM:
    """Build the model on ``device``; load ``model_dir`` or, for benchmarks, random weights.

    With ``shard``/``group`` only this rank's share is built and loaded; random weights
    are then drawn whole and sliced, so every size of group builds the same model.
    """
    model_cls = LlamaForCausalLM
    if arch.gemma is not None:
        from .gemma3 import Gemma3ForCausalLM as model_cls  # Gemma's layers in the Llama frame
    with torch.device(device):
        model = model_cls(
            arch, max_positions=max_positions, dtype=dtype, device=device, shard=shard, group=group
        )
    if random_init_std is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
        if shard is None:
            for name, param in model.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    param.data.fill_(1.0)
                else:
                    param.data.normal_(0.0, random_init_std, generator=generator)
        else:
            _random_fill_sharded(model, arch, shard, random_init_std, generator)
    elif model_dir is None:
        raise ValueError("build_model needs model_dir or random_init_std")
    else:
        model.load_weights(iter_checkpoint(model_dir, device=device))
    return model.eval()


def _random_fill_sharded(
    model: LlamaForCausalLM, arch: ModelArchConfig, shard: ShardPlan, std: float, generator: torch.Generator
) -> None:
    """Draw every parameter at its unsharded shape, in the unsharded order, then keep this
    rank's slice: the same random model as one device builds from the same seed."""
    with torch.device("meta"):
        whole = dict(LlamaForCausalLM(arch, max_positions=1, dtype=model.dtype, device="meta").named_parameters())
    parts_of: dict[str, list[str]] = {}
    for part, (fused, _) in sorted(_STACKED.items(), key=lambda kv: kv[1][1]):
        parts_of.setdefault(fused, []).append(part)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        full = torch.empty(whole[name].shape, dtype=param.dtype, device=param.device)
        full.normal_(0.0, std, generator=generator)
        module_name, kind = name.split(".")[-2:]
        shared = ".shared_expert." in name  # Qwen2-MoE's shared expert: cut by its own size
        experts = shard_moe_tensor(shard, name, full)  # fused expert weights
        if experts is not None:
            local = experts
        elif module_name in parts_of:
            pieces = full.split(_whole_sizes(arch, module_name, shared=shared), dim=0)
            local = torch.cat(
                [
                    shard.shard_module_tensor(part, kind, piece, shared=shared)
                    for part, piece in zip(parts_of[module_name], pieces, strict=True)
                ]
            )
        else:
            local = shard.shard_module_tensor(module_name, kind, full, shared=shared)
        param.data.copy_(local)


def _whole_sizes(arch: ModelArchConfig, fused: str, *, shared: bool = False) -> tuple[int, ...]:
    """The unsharded part sizes of a fused projection (``shared``: of Qwen2-MoE's shared expert)."""
    if fused == "qkv_proj":
        return (arch.q_size, arch.kv_size, arch.kv_size)
    if fused == "gate_up_proj":
        size = arch.intermediate_size
        if shared and arch.moe is not None:
            size = arch.moe.shared_intermediate_size
        return (size, size)
    raise KeyError(fused)
