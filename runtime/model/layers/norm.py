"""RMSNorm, computed the way Hugging Face Llama does (float32 statistics, cast back)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``; the normalisation runs in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
