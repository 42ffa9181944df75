"""The float64 reference every kernel path is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def reference_delta(x, A, B, row_slots, ranks, scalings, offsets) -> torch.Tensor:
    """float64 LoRA delta per row, straight from the per-row slots (independent of the layout)."""
    T = x.shape[0]
    R = B.shape[2]
    delta = torch.zeros(T, offsets[-1], dtype=torch.float64, device=x.device)
    for slot in sorted(set(row_slots)):
        if slot < 0 or ranks[slot] == 0:
            continue
        rows = torch.tensor([i for i, s in enumerate(row_slots) if s == slot], device=x.device)
        r = ranks[slot]
        xs = x[rows].double()
        for s in range(len(offsets) - 1):
            a = A[slot, s * R : s * R + r].double()
            b = B[slot, offsets[s] : offsets[s + 1], :r].double()
            delta[rows, offsets[s] : offsets[s + 1]] = scalings[slot] * ((xs @ a.T) @ b.T)
    return delta


def make_b(slots: int, out_dim: int, rank: int, rank_major: bool, **kw) -> torch.Tensor:
    """B ``[slots, out, rank]``; rank-major storage is a transposed view of ``[slots, rank, out]``."""
    if rank_major:
        return torch.randn(slots, rank, out_dim, **kw).transpose(1, 2)
    return torch.randn(slots, out_dim, rank, **kw)


TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class Check:
    """One correctness check: passed, its relative error and what else it looked at."""

    name: str
    ok: bool
    error: float
    detail: str = ""
