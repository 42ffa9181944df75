"""Alternative launch configurations on a few shapes: the tuning record."""

from __future__ import annotations

import time
import traceback

import torch

from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops import ExpandConfig, ShrinkConfig, pick_expand, pick_shrink

from .module_bench import ModuleCase, moved_bytes
from .shapes import Module, Workload
from .timing import num_sms, time_replays
from .variants import describe, path_of


def sweep_variants(w: Workload, m: Module, info, sms: int) -> tuple[ShrinkConfig, ExpandConfig, list]:
    """The two-launch defaults for a shape and single-parameter variations around them."""
    S, R = len(m.widths), w.pool_rank
    sc0 = pick_shrink(num_tiles=info.num_tiles, tile_m=info.tile_m, num_slices=S, max_rank=R, in_dim=m.in_dim,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    ec0 = pick_expand(num_tiles=info.num_tiles, tile_m=info.tile_m, widths=m.widths, max_rank=R,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    two = lambda sc, ec: TritonLoRABackend(fused=False, shrink_config=sc, expand_config=ec)  # noqa: E731
    variants: list[tuple[str, TritonLoRABackend | str]] = [
        ("default", TritonLoRABackend()),
        ("two-launch", two(sc0, ec0)),
        ("fused", TritonLoRABackend(fused=True)),
        ("shrink only", "shrink"),
        ("expand only", "expand"),
    ]
    for split in sorted(
        {max(1, sc0.split_k // 4), max(1, sc0.split_k // 2), sc0.split_k * 2} - {sc0.split_k}
    ):
        variants.append((f"split{split}", two(ShrinkConfig(sc0.block_n, sc0.block_k, split), ec0)))
    if info.tile_m <= 16 and sc0.block_k < 256:
        variants.append(("shrink bk256", two(ShrinkConfig(sc0.block_n, 256, max(1, sc0.split_k // 2)), ec0)))
    for g in (1, 2, 4, 8, 16):
        if g != ec0.col_blocks:
            variants.append((f"expand g{g}", two(sc0, ExpandConfig(ec0.block_n, ec0.block_r, g, ec0.num_warps,
                                                                  ec0.num_stages))))  # fmt: skip
    for st in (1, 3):
        if st != ec0.num_stages:
            variants.append((f"expand st{st}", two(sc0, ExpandConfig(ec0.block_n, ec0.block_r, ec0.col_blocks,
                                                                    ec0.num_warps, st))))  # fmt: skip
    for bn, nw in ((256, 4), (256, 8)):
        variants.append((f"expand bn{bn} w{nw}", two(sc0, ExpandConfig(bn, ec0.block_r, ec0.col_blocks, nw,
                                                                        ec0.num_stages))))  # fmt: skip
    return sc0, ec0, variants


def sweep(device, modules, workloads, copy_bw, l2_bytes, reps, deadline) -> list[dict]:
    """Alternative launch configurations on a few shapes (the tuning record), and the
    two-launch default's time split into its shrink and its expand."""
    gen = torch.Generator().manual_seed(11)
    results = []
    sms = num_sms(device)
    for w, mname in workloads:
        m = modules[mname]
        if time.time() > deadline:
            break
        case = ModuleCase(w, m, device, gen, l2_bytes, max_sets=512 if device.type == "cuda" else 2)
        S, R = len(m.widths), w.pool_rank
        sc0, ec0, variants = sweep_variants(w, m, case.info, sms)
        total, _ = moved_bytes(w, m)
        partial = torch.randn(sc0.split_k, w.tokens, S * R, device=device, dtype=torch.float32) * 0.01
        for name, variant in variants:
            if time.time() > deadline:
                break
            try:
                if variant == "shrink":
                    fns = case.shrink_fns(partial, sc0)
                elif variant == "expand":
                    fns = case.expand_fns(partial, ec0)
                else:
                    fns = case.triton_fns(variant)
                t = time_replays(fns, device, reps)
                if isinstance(variant, TritonLoRABackend):
                    config = path_of(variant, case.info, case.x[0], case.B[0], m.offsets)
                else:
                    config = describe(sc0 if variant == "shrink" else ec0)
                results.append(
                    {
                        "module": m.name,
                        "workload": w.label(),
                        "variant": name,
                        "us": t * 1e3,
                        "bw_frac": total / (t * 1e-3) / copy_bw,
                        "config": config,
                    }
                )
                print(
                    f"sweep {m.name:8s} {w.label():24s} {name:18s} {t * 1e3:8.2f} us  [{config}]", flush=True
                )
            except Exception:
                traceback.print_exc()
    return results
