"""Per-module timings: Triton against a gather-and-bmm torch baseline, rotating inputs."""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field

import torch

from loraserve.kernels.triton_ops import ExpandConfig, ShrinkConfig
from loraserve.kernels.triton_ops.expand import launch_expand
from loraserve.kernels.triton_ops.shrink import launch_shrink

from .shapes import Module, Workload, batch_info, make_b, request_slots
from .timing import time_replays
from .variants import BACKENDS, path_of


@dataclass
class Row:
    """One (module, workload, variant) timing against the torch baseline."""

    module: str
    workload: str
    tokens: int
    bytes: int
    triton_us: float
    torch_us: float
    bw_frac: float  # achieved / copy bandwidth
    speedup: float
    weight_frac: float  # adapter weights' share of the bytes
    shrink: str = ""
    expand: str = ""
    extra: dict = field(default_factory=dict)
    variant: str = "default"


def moved_bytes(w: Workload, m: Module, elem: int = 2) -> tuple[int, int]:
    """(total, adapter-weight) bytes: x, the distinct adapters' A and B, out read + write."""
    S = len(m.widths)
    weights = w.adapters * (S * w.rank * m.in_dim + m.out_dim * w.rank) * elem
    total = w.tokens * m.in_dim * elem + weights + 2 * w.tokens * m.out_dim * elem
    return total, weights


class ModuleCase:
    """Rotating sets of inputs and adapter pools for one (workload, module)."""

    def __init__(self, w: Workload, m: Module, device, gen, l2_bytes: int, max_sets: int = 512):
        self.w, self.m = w, m
        S, R = len(m.widths), w.pool_rank
        self.slots = request_slots(w, gen)
        ranks = [w.rank] * w.adapters
        scalings = [1.0 / w.rank] * w.adapters
        self.info = batch_info(w, self.slots, ranks, scalings, device)
        self.scal = torch.tensor(scalings, device=device)
        per_set = (w.adapters * (S * R * m.in_dim + m.out_dim * R) + w.tokens * (m.in_dim + m.out_dim)) * 2
        self.sets = max(2, min(max_sets, math.ceil(3 * l2_bytes / per_set)))
        T = w.tokens
        self.x, self.A, self.B, self.out = [], [], [], []
        for _ in range(self.sets):
            self.x.append(torch.randn(T, m.in_dim, device=device, dtype=torch.bfloat16))
            self.A.append(
                torch.randn(w.adapters, S * R, m.in_dim, device=device, dtype=torch.bfloat16) * 0.02
            )
            self.B.append(
                make_b(w.adapters, m.out_dim, R, w.rank_major_b, device=device, dtype=torch.bfloat16).mul_(
                    0.02
                )
            )
            self.out.append(torch.randn(T, m.out_dim, device=device, dtype=torch.bfloat16))
        self.req_slots = torch.tensor(self.slots, device=device, dtype=torch.long)

    def triton_fns(self, backend):
        """One ``backend.apply`` per input set."""
        return [
            (
                lambda i=i: backend.apply(
                    self.x[i], self.A[i], self.B[i], self.info, self.out[i], self.m.offsets
                )
            )
            for i in range(self.sets)
        ]

    def shrink_fns(self, partial, config: ShrinkConfig):
        """The shrink alone, into one shared partial-sum buffer."""
        S = len(self.m.widths)
        return [
            (lambda i=i: launch_shrink(self.x[i], self.A[i], partial, self.info, S, config))
            for i in range(self.sets)
        ]

    def expand_fns(self, partial, config: ExpandConfig):
        """The expand alone, from one shared partial-sum buffer."""
        return [
            (lambda i=i: launch_expand(partial, self.B[i], self.out[i], self.info, self.m.offsets, config))
            for i in range(self.sets)
        ]

    def torch_fns(self):
        """The torch baseline per input set: gather each request's adapter weights, then bmm."""
        w, m = self.w, self.m
        R = w.pool_rank
        offs = m.offsets

        def baseline(i: int) -> None:
            x = self.x[i].view(w.bs, w.width, m.in_dim)
            out = self.out[i].view(w.bs, w.width, m.out_dim)
            a = self.A[i][self.req_slots]  # [bs, S*R, in]: each request's adapter, gathered
            b = self.B[i][self.req_slots]  # [bs, out, R]
            xa = torch.bmm(x, a.transpose(1, 2))
            scale = self.scal[self.req_slots].to(x.dtype)[:, None, None]
            for s in range(len(m.widths)):
                lo, hi = offs[s], offs[s + 1]
                out[:, :, lo:hi] += scale * torch.bmm(
                    xa[:, :, s * R : (s + 1) * R], b[:, lo:hi].transpose(1, 2)
                )

        return [(lambda i=i: baseline(i)) for i in range(self.sets)]


def bench_modules(device, modules, workloads, copy_bw, l2_bytes, reps, deadline) -> list[Row]:
    """``workloads``: (workload, module names, backend variants) triples."""
    gen = torch.Generator().manual_seed(7)
    rows: list[Row] = []
    for w, names, variants in workloads:
        for name in names:
            m = modules[name]
            if time.time() > deadline:
                print(f"[deadline] skipping {w.label()} {m.name}", flush=True)
                continue
            try:
                case = ModuleCase(w, m, device, gen, l2_bytes, max_sets=512 if device.type == "cuda" else 2)
                t_torch = time_replays(case.torch_fns(), device, reps)
                total, weights = moved_bytes(w, m)
                for variant in variants:
                    backend = BACKENDS[variant]()
                    t_triton = time_replays(case.triton_fns(backend), device, reps)
                    row = Row(
                        m.name,
                        w.label(),
                        w.tokens,
                        total,
                        t_triton * 1e3,
                        t_torch * 1e3,
                        total / (t_triton * 1e-3) / copy_bw,
                        t_torch / t_triton,
                        weights / total,
                        extra={
                            "sets": case.sets,
                            "tiles": case.info.num_tiles,
                            "path": path_of(backend, case.info, case.x[0], case.B[0], m.offsets),
                        },
                        variant=variant,
                    )
                    rows.append(row)
                    print(
                        f"{m.name:8s} {w.label():26s} {variant:10s} triton {row.triton_us:8.2f} us  torch "
                        f"{row.torch_us:8.2f} us  x{row.speedup:5.2f}  bw {100 * row.bw_frac:5.1f}%"
                        f"  w {100 * row.weight_frac:4.0f}%  [{row.extra['path']}]",
                        flush=True,
                    )
                del case
            except Exception:  # one broken shape must not lose the rest of the run
                traceback.print_exc()
    return rows
