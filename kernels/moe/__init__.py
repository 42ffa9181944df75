"""The fused mixture-of-experts MLP with per-row LoRA deltas on the experts.

One interface, two implementations: ``reference`` (torch float64: the kernels' oracle) and
``triton_ops`` (routing metadata on the device, grouped expert GEMMs, LoRA shrink/expand per
(expert, adapter slot) block; CUDA-graph capturable). The model's torch path (gather per
expert, ``index_add``) stays the CPU path; :func:`use_triton` is the switch, following the
decoder's fused ops (``loraserve.kernels.model_ops``): CUDA tensors take the kernels unless
the fused ops are turned off, and :func:`set_path` forces either side (tests run the kernels
on the CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from .. import model_ops
from .routing import BlockLayout, MoEBuffers, RoutingBuffers, align_block_size, capacity, lora_groups
from .types import ExpertLoRA, MoELoRA

__all__ = [
    "BlockLayout",
    "ExpertLoRA",
    "MoEBuffers",
    "MoELoRA",
    "RoutingBuffers",
    "align_block_size",
    "capacity",
    "fused_moe",
    "lora_groups",
    "set_path",
    "use_triton",
]

_PATHS = ("auto", "triton", "torch")
_PATH = "auto"


def set_path(path: str) -> None:
    """``auto`` (Triton for CUDA tensors when the fused ops are on), ``triton`` or ``torch``."""
    global _PATH
    if path not in _PATHS:
        raise ValueError(f"MoE path {path!r}: use one of {', '.join(_PATHS)}")
    _PATH = path


def use_triton(x: torch.Tensor) -> bool:
    """Whether the MoE layer on ``x`` runs the Triton kernels (never under autograd)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if _PATH != "auto":
        return _PATH == "triton"
    return x.is_cuda and model_ops.fused_enabled()


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    lora: MoELoRA | None = None,
    buffers: MoEBuffers | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for rows ``x [T, H]`` with the
    experts' ``gate_up [E, 2I, H]`` (gate rows first) and ``down [E, H, I]``, each pair with
    the LoRA delta of its row's adapter for that expert (``lora``; None: base model).
    ``buffers`` (:class:`MoEBuffers`): persistent routing buffers for CUDA graphs."""
    from . import triton_ops

    return triton_ops.fused_moe(x, gate_up, down, weights, ids, lora, buffers)
