"""Fixtures for the LoRA kernel tests.

Without a GPU the Triton kernels run under the Triton interpreter: ``TRITON_INTERPRET``
must be set before triton (and so any kernel module) is imported, which is why it is set
here, at the top, before anything from ``loraserve.kernels`` is loaded. On a CUDA machine
the real compiled kernels run (unless the variable is already set).
"""

from __future__ import annotations

import os
import zlib

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

# Relative error bounds against float64, by dtype: fp32 is exact up to summation order;
# the half types round x·A to their own precision before the expand, and the output.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded per test case: fresh inputs in every case, reproducible runs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def tolerance():
    return TOLERANCE


def lora_delta(x, A, B, row_slots, ranks, scalings, offsets) -> torch.Tensor:
    """float64 LoRA delta computed row by row from each row's slot alone.

    Independent of segments, permutations and tiles: the oracle every backend is judged by.
    """
    T = x.shape[0]
    R = B.shape[2]
    delta = torch.zeros(T, offsets[-1], dtype=torch.float64)
    xd, Ad, Bd = x.double().cpu(), A.double().cpu(), B.double().cpu()
    for t, slot in enumerate(row_slots):
        if slot < 0 or ranks[slot] == 0:
            continue
        r = ranks[slot]
        for s in range(len(offsets) - 1):
            xa = xd[t] @ Ad[slot, s * R : s * R + r].T
            delta[t, offsets[s] : offsets[s + 1]] = scalings[slot] * (xa @ Bd[slot, offsets[s] : offsets[s + 1], :r].T)
    return delta


@pytest.fixture
def oracle():
    return lora_delta


class Pool:
    """A random adapter pool for one module: A ``[slots, S*R, in]``, B ``[slots, out, R]``."""

    def __init__(self, gen, *, in_dim, widths, ranks, max_rank, dtype, device, scalings=None):
        self.in_dim = in_dim
        self.offsets = tuple([0, *torch.tensor(widths).cumsum(0).tolist()])
        self.ranks = list(ranks)
        self.max_rank = max_rank
        S = len(widths)
        n = len(ranks)
        self.scalings = scalings or [0.25 + torch.rand(1, generator=gen).item() for _ in range(n)]
        self.A = (torch.randn(n, S * max_rank, in_dim, generator=gen) / in_dim**0.5).to(device, dtype)
        self.B = torch.randn(n, self.offsets[-1], max_rank, generator=gen).to(device, dtype)
        self.dtype = dtype
        self.device = device

    @property
    def out_dim(self) -> int:
        return self.offsets[-1]

    def inputs(self, gen, tokens: int):
        x = torch.randn(tokens, self.in_dim, generator=gen).to(self.device, self.dtype)
        out = torch.randn(tokens, self.out_dim, generator=gen).to(self.device, self.dtype)
        return x, out


@pytest.fixture
def make_pool(gen, device):
    def make(*, in_dim, widths, ranks, max_rank, dtype=torch.float32, scalings=None):
        return Pool(
            gen, in_dim=in_dim, widths=widths, ranks=ranks, max_rank=max_rank, dtype=dtype, device=device,
            scalings=scalings,
        )

    return make


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def rel():
    return rel_error


def verify_output(info, pool: Pool, x, out0, out, *, tol=None) -> None:
    """Check ``out`` (``out0`` after one LoRA apply) against the float64 oracle.

    Checks the whole delta's relative error, each LoRA row's own error (so a row that was
    never written fails even when the rest is right), and that rows of base-model
    requests and rank-0 slots are bit-for-bit untouched.
    """
    tol = tol or TOLERANCE[pool.dtype]
    row_slots = info.token_slots.tolist()
    delta = lora_delta(x, pool.A, pool.B, row_slots, pool.ranks, pool.scalings, pool.offsets)
    got = out.double().cpu() - out0.double().cpu()
    active = torch.tensor([s >= 0 and pool.ranks[s] > 0 for s in row_slots], dtype=torch.bool)
    assert torch.isfinite(got).all()
    if bool(active.any()):
        assert rel_error(got[active], delta[active]) < tol
        row_err = (got - delta).norm(dim=1) / delta.norm(dim=1).clamp_min(1e-30)
        worst = row_err[active].max().item()
        assert worst < 4 * tol, f"a LoRA row is wrong or unwritten (row error {worst:.2e})"
    assert torch.equal(out.cpu()[~active], out0.cpu()[~active]), "rows without LoRA work were modified"


def run_and_check(backend, info, pool: Pool, x, out0, *, tol=None) -> torch.Tensor:
    """Apply ``backend`` to a copy of ``out0`` and :func:`verify_output` the result."""
    out = out0.clone()
    backend.apply(x, pool.A, pool.B, info, out, pool.offsets)
    verify_output(info, pool, x, out0, out, tol=tol)
    return out


@pytest.fixture
def check_apply():
    return run_and_check


@pytest.fixture
def check_output():
    return verify_output
