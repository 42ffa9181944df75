"""The tune phase: a coordinate search of launch configurations per module."""

from __future__ import annotations

import math
import time
import traceback

import torch

from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops import ExpandConfig, ShrinkConfig, pick_expand, pick_shrink
from loraserve.kernels.triton_ops.configs import MAX_PARTIAL_COLUMNS, rank_block

from .module_bench import ModuleCase
from .shapes import Module, Workload
from .timing import num_sms, time_replays
from .variants import describe


def tune_module(
    case: ModuleCase, w: Workload, m: Module, device, sms: int, reps: int
) -> tuple[dict, list[dict]]:
    """Coordinate search around the two-launch defaults of one module and batch: the shrink
    (K split, K step) with the default expand, then the expand (column blocks, tile width)
    with the best shrink. Returns the best pair and every timing."""
    S, R = len(m.widths), w.pool_rank
    info = case.info
    sc0 = pick_shrink(num_tiles=info.num_tiles, tile_m=info.tile_m, num_slices=S, max_rank=R, in_dim=m.in_dim,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    ec0 = pick_expand(num_tiles=info.num_tiles, tile_m=info.tile_m, widths=m.widths, max_rank=R,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    tried: list[dict] = []

    def timed(sc: ShrinkConfig, ec: ExpandConfig) -> float:
        backend = TritonLoRABackend(fused=False, shrink_config=sc, expand_config=ec)
        t = time_replays(case.triton_fns(backend), device, reps) * 1e3
        tried.append(
            {"module": m.name, "workload": w.label(), "us": t, "shrink": describe(sc), "expand": describe(ec)}
        )
        return t

    best = {"shrink": sc0, "expand": ec0, "us": timed(sc0, ec0)}
    default_us = best["us"]
    partial_limit = max(1, MAX_PARTIAL_COLUMNS // rank_block(R))
    for split in sorted({sc0.split_k, 2 * sc0.split_k, 4 * sc0.split_k}):
        for bk in (128, 256):
            sc = ShrinkConfig(sc0.block_n, bk, split, sc0.num_warps, sc0.num_stages)
            if sc == sc0 or split > partial_limit or split > math.ceil(m.in_dim / bk):
                continue
            t = timed(sc, ec0)
            if t < best["us"]:
                best = {"shrink": sc, "expand": ec0, "us": t}
    sc = best["shrink"]
    expands = [ExpandConfig(ec0.block_n, ec0.block_r, g, ec0.num_warps, ec0.num_stages) for g in (1, 2, 4)]
    expands.append(ExpandConfig(256, ec0.block_r, ec0.col_blocks, 8, ec0.num_stages))
    for ec in expands:
        if ec == best["expand"]:
            continue
        t = timed(sc, ec)
        if t < best["us"]:
            best = {"shrink": sc, "expand": ec, "us": t}
    best["default_us"] = default_us
    return best, tried


def tune(device, modules, workloads, l2_bytes, reps, deadline) -> tuple[dict[str, dict], list[dict]]:
    """``tune_module`` for every module of each workload: {workload label: {module: best}}."""
    gen = torch.Generator().manual_seed(13)
    sms = num_sms(device)
    tuned: dict[str, dict] = {}
    record: list[dict] = []
    for w in workloads:
        for name, m in modules.items():
            if time.time() > deadline:
                print(f"[deadline] skipping tune {w.label()} {name}", flush=True)
                continue
            try:
                case = ModuleCase(w, m, device, gen, l2_bytes, max_sets=512 if device.type == "cuda" else 2)
                best, tried = tune_module(case, w, m, device, sms, reps)
            except Exception:
                traceback.print_exc()
                continue
            record += tried
            tuned.setdefault(w.label(), {})[name] = best
            print(
                f"tune {w.label():24s} {name:8s} default {best['default_us']:7.2f} us -> {best['us']:7.2f} us"
                f"  shrink[{describe(best['shrink'])}] expand[{describe(best['expand'])}]",
                flush=True,
            )
    return tuned, record
