"""The Triton base GEMM (no LoRA) against cuBLAS."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from loraserve.kernels.triton_ops.configs import GemmConfig, gemm_config
from loraserve.kernels.triton_ops.gemm_expand import gemm_linear

from .timing import num_sms, time_replays
from .variants import describe


def bench_gemm(device, modules, reps: int, deadline: float, sets: int = 8) -> list[dict]:
    """The Triton base GEMM (no LoRA) against cuBLAS per module and token count: the heuristic's
    configuration and a few alternatives, each replayed from a graph over ``sets`` weight copies
    (so W streams from memory, as in a model's step)."""
    dt = torch.bfloat16
    sms = num_sms(device)
    tiny = device.type != "cuda"
    results = []
    for name, m in modules.items():
        Ws = [
            torch.randn(m.out_dim, m.in_dim, device=device, dtype=dt) * 0.02
            for _ in range(2 if tiny else sets)
        ]
        for T in (1, 4) if tiny else (1, 32, 64, 128, 256):
            if time.time() > deadline:
                print(f"[deadline] skipping gemm {name} T={T}", flush=True)
                continue
            x = torch.randn(T, m.in_dim, device=device, dtype=dt)
            t_cublas = time_replays([lambda W=W, x=x: F.linear(x, W) for W in Ws], device, reps)
            heur = gemm_config(T, m.out_dim, m.in_dim, dt, sms)
            cands = [heur] + [
                GemmConfig(heur.block_m, bn, bk, 4, st)
                for bn, bk, st in ((32, 256, 4), (64, 128, 4), (64, 256, 3), (128, 128, 3))
                if (bn, bk, st) != (heur.block_n, heur.block_k, heur.num_stages)
            ]
            mb = m.out_dim * m.in_dim * 2 / 1e6
            for i, cfg in enumerate(cands[: 1 if tiny else None]):
                try:
                    t = time_replays(
                        [lambda W=W, x=x, cfg=cfg: gemm_linear(x, W, None, cfg) for W in Ws], device, reps
                    )
                except Exception as exc:  # a configuration that does not compile: recorded, not fatal
                    print(f"gemm {name} T={T} {describe(cfg)}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                row = {
                    "module": name, "tokens": T, "config": describe(cfg), "heuristic": i == 0,
                    "cublas_us": t_cublas * 1e3, "triton_us": t * 1e3, "ratio": t / t_cublas,
                    "cublas_tb_s": mb / (t_cublas * 1e3), "triton_tb_s": mb / (t * 1e3),
                }  # fmt: skip
                results.append(row)
                print(
                    f"gemm {name:7s} T={T:<4d} cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_tb_s']:.2f} TB/s)"
                    f"  triton {row['triton_us']:7.2f} us ({row['triton_tb_s']:.2f} TB/s) x{row['ratio']:.3f}"
                    f"  {'*' if i == 0 else ' '}{describe(cfg)}",
                    flush=True,
                )
    return results
