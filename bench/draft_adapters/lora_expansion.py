"""A task adapter of the small target placed in the 8B-shaped served target.

``bench/speculative/expansion.py`` puts every small weight in the top-left block of the big
one (the first ``Hs`` hidden dimensions, the first heads and KV heads, the first MLP units,
the first layers) and keeps everything else from writing into the residual stream. A LoRA
follows the same placement: ``A`` reads the small module's inputs (its first columns, zero
elsewhere), ``B`` writes the small module's outputs (its first rows, zero elsewhere). The
adapted big module then computes ``W_big x + s B_big A_big x``, whose small block is the
small adapted module's and whose other outputs get nothing from the adapter: the adapted
8B-shaped target computes what the adapted small target computes. Layers past the small
model's stay unadapted (the file has no tensors for them; the loader takes a subset).

An EAGLE head's draft adapter follows the head's expansion (``expand_eagle_head``) the same
way: its layer's projections as above, and the feature fc, whose input is ``[embedding,
feature]`` of width ``2 H``: ``A`` reads the small embedding half at columns ``0..Hs`` and the
small feature half at ``Hb..Hb+Hs``, ``B`` writes the first ``Hs`` outputs.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch

from ..speculative.shapes import SHAPES

_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_(A|B)\.weight$")
_FC = re.compile(r"(?:^|\.)fc\.lora_(A|B)\.weight$")


def module_dims(shape: str) -> dict[str, tuple[int, int]]:
    """(input, output) width of each LoRA module of a Llama of ``shape``."""
    hidden, _, heads, kv, head_dim, inter = SHAPES[shape]
    q, kvd = heads * head_dim, kv * head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kvd), "v_proj": (hidden, kvd), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }  # fmt: skip


def expand_lora_tensors(
    tensors: dict[str, torch.Tensor], small_shape: str, big_shape: str
) -> dict[str, torch.Tensor]:
    """The small adapter's tensors zero-padded to ``big_shape``: ``A`` by columns, ``B`` by rows."""
    big = module_dims(big_shape)
    out = {}
    for name, tensor in tensors.items():
        match = _NAME.search(name)
        if match is None:
            raise ValueError(f"{name}: not a LoRA tensor of a Llama linear module")
        _, module, which = match.groups()
        fan_in, fan_out = big[module]
        if which == "A":  # [r, in]: reads the small module's inputs only
            padded = tensor.new_zeros(tensor.shape[0], fan_in)
            padded[:, : tensor.shape[1]] = tensor
        else:  # [out, r]: writes the small module's outputs only
            padded = tensor.new_zeros(fan_out, tensor.shape[1])
            padded[: tensor.shape[0]] = tensor
        out[name] = padded
    return out


def expand_head_lora_tensors(
    tensors: dict[str, torch.Tensor], small_shape: str, big_shape: str
) -> dict[str, torch.Tensor]:
    """An EAGLE head draft adapter's tensors zero-padded to a head of ``big_shape``: the layer's
    projections as :func:`expand_lora_tensors` pads them, the fc's ``A`` by its two input halves."""
    hs, hb = SHAPES[small_shape][0], SHAPES[big_shape][0]
    layer = {n: t for n, t in tensors.items() if _FC.search(n) is None}
    out = expand_lora_tensors(layer, small_shape, big_shape)
    for name, tensor in tensors.items():
        match = _FC.search(name)
        if match is None:
            continue
        if match.group(1) == "A":  # [r, 2 Hs]: the embedding half, then the feature half
            padded = tensor.new_zeros(tensor.shape[0], 2 * hb)
            padded[:, :hs] = tensor[:, :hs]
            padded[:, hb : hb + hs] = tensor[:, hs:]
        else:  # [Hs, r]: writes the small head's residual stream only
            padded = tensor.new_zeros(hb, tensor.shape[1])
            padded[:hs] = tensor
        out[name] = padded
    return out


def expand_lora(src: Path, dest: Path, small_shape: str, big_shape: str, *, head: bool = False) -> Path:
    """The PEFT adapter folder ``src`` (for ``small_shape``) written to ``dest`` for ``big_shape``;
    ``head``: an EAGLE head's draft adapter (:func:`expand_head_lora_tensors`)."""
    from safetensors.torch import load_file, save_file

    if SHAPES[small_shape][4] != SHAPES[big_shape][4]:
        raise ValueError(f"{big_shape} must keep {small_shape}'s head_dim: heads are placed whole")
    dest.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    expand = expand_head_lora_tensors if head else expand_lora_tensors
    save_file(expand(tensors, small_shape, big_shape), str(dest / "adapter_model.safetensors"))
    shutil.copy2(src / "adapter_config.json", dest / "adapter_config.json")
    return dest
