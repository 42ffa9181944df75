"""RMSNorm, computed the way Hugging Face Llama does (float32 statistics, cast back)."""

from __future__ import annotations

import torch
from torch import nn

from loraserve.kernels import model_ops


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; the normalisation runs in float32 whatever the model dtype.

    CUDA tensors take one fused kernel (``kernels.model_ops``); the CPU takes the torch
    definition, which is also the kernels' oracle.
    """

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return model_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, norm(x + delta))`` in one pass: the residual add before a norm."""
        return model_ops.add_rms_norm(x, delta, self.weight, self.eps)
