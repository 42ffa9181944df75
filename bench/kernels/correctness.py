"""The correctness phase: which checks run on which shapes and paths."""

from __future__ import annotations

from dataclasses import replace

import torch

from loraserve.kernels.overlap import OverlapMode
from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops import ExpandConfig, ShrinkConfig
from loraserve.kernels.triton_ops.pdl import pdl_supported

from .checks import check_apply, check_epilogue, check_public_shrink
from .graph_checks import check_graph, check_overlap
from .reference import Check
from .shapes import Workload
from .variants import BACKENDS, LAYER_PIPELINED


def correctness(device, modules, tiny: bool, fast: bool = False) -> list[Check]:
    """Every kernel path on the benchmark shapes against float64 (``fast``: no PDL checks).

    One generator feeds every check in turn, so their order is part of what they test."""
    gen = torch.Generator().manual_seed(1234)
    backend = TritonLoRABackend()
    bs = 6 if tiny else 24
    works = [
        Workload("decode", bs, 4, 16, 1, 64 if not tiny else 0),
        Workload("verify", bs // 2, 3, 8, 4, 0),
        Workload("extend", 3, 3, 16, 7 if tiny else 37, 0),
    ]
    qkv = modules["qkv"]
    checks = _apply_checks(backend, works, modules, device, gen, tiny)
    checks += _epilogue_checks(backend, works, modules, device, gen)
    checks += check_graph(backend, qkv, device, gen, "verify", 8, 4)
    checks += check_graph(backend, modules["down"], device, gen, "decode", 16, 1)
    rank_major = Workload("decode", bs, 4, 16, 1, 64, rank_major_b=True)
    for module in (qkv, modules["gate_up"]):
        checks.append(check_apply(backend, rank_major, module, torch.bfloat16, device, gen, base_requests=1))
    checks += _forced_path_checks(works, rank_major, modules, device, gen)
    # Beside the base GEMM on a second stream, both joins, under graph capture.
    for overlap in (OverlapMode.DELTA, OverlapMode.SHRINK):
        checks += check_overlap(backend, qkv, device, gen, overlap, "verify", 8, 4)
        checks += check_overlap(backend, modules["gate_up"], device, gen, overlap, "decode", 16, 1)
    if pdl_supported(device) and not fast:
        variant = TritonLoRABackend(pdl=True)
        for w in works:
            checks += _tagged("pdl", [check_apply(variant, w, modules["gate_up"], torch.bfloat16, device, gen,
                                                  base_requests=1)])  # fmt: skip
        checks += _tagged("pdl", check_graph(variant, qkv, device, gen, "verify", 8, 4)[:3])
    return checks


def _tagged(tag: str, checks: list[Check]) -> list[Check]:
    """``checks`` with ``[tag] `` before their names: the backend variant they ran on."""
    for c in checks:
        c.name = f"[{tag}] {c.name}"
    return checks


def _apply_checks(backend, works: list[Workload], modules, device, gen, tiny: bool) -> list[Check]:
    """``apply`` on every module and workload (with base requests), other dtypes, mixed
    ranks, forced split-K and tiles, and the public shrink."""
    checks = []
    for module in modules.values():
        for w in works:
            checks.append(check_apply(backend, w, module, torch.bfloat16, device, gen, base_requests=1))
    qkv = modules["qkv"]
    for dtype in (torch.float16, torch.float32):
        checks.append(check_apply(backend, works[0], qkv, dtype, device, gen))
    # Mixed ranks in one pool (8, 16, 64 and 0), extend with uneven segments.
    mixed = Workload("extend", 4, 4, 64, 5 if tiny else 129, 0)
    checks.append(
        check_apply(backend, mixed, modules["gate_up"], torch.bfloat16, device, gen, ranks=[8, 16, 64, 0, 0])
    )
    # Forced split-K in both directions, and alternative tiles.
    for sc, ec in [
        (ShrinkConfig(16, 64, 1), ExpandConfig(64, 16)),
        (ShrinkConfig(16, 128, 8), ExpandConfig(256, 16, num_warps=8)),
    ]:
        forced = TritonLoRABackend(shrink_config=sc, expand_config=ec)
        checks.append(check_apply(forced, works[1], qkv, torch.bfloat16, device, gen))
    checks.append(check_public_shrink(backend, works[0], qkv, torch.bfloat16, device, gen))
    return checks


def _epilogue_checks(backend, works: list[Workload], modules, device, gen) -> list[Check]:
    """The base GEMM with the expand in its epilogue (rank-major B, as the pool stores it)."""
    checks = []
    for module in modules.values():
        for w in works:
            checks.append(
                check_epilogue(backend, replace(w, rank_major_b=True), module, torch.bfloat16, device, gen)
            )
    for dtype in (torch.float16, torch.float32):
        checks.append(check_epilogue(backend, works[1], modules["qkv"], dtype, device, gen))
    return checks


def _forced_path_checks(works: list[Workload], rank_major: Workload, modules, device, gen) -> list[Check]:
    """Each path forced: the single launch (grid barrier) and the two-launch pair."""
    checks = []
    for tag, variant in (
        ("fused", TritonLoRABackend(fused=True)),
        ("two-launch", TritonLoRABackend(fused=False)),
    ):
        for module in modules.values():
            for w in works[:2]:
                checks += _tagged(
                    tag, [check_apply(variant, w, module, torch.bfloat16, device, gen, base_requests=1)]
                )
            checks += _tagged(
                tag, [check_apply(variant, rank_major, module, torch.bfloat16, device, gen, base_requests=1)]
            )
        checks += _tagged(
            tag,
            check_graph(variant, modules["qkv"], device, gen, "verify", 8, 4)
            + check_graph(variant, modules["gate_up"], device, gen, "decode", 16, 1),
        )
    return checks


def rank_checks(device, modules, tiny: bool) -> list[Check]:
    """Rank-64 pools on decode/verify tiles (run 9): small- and full-rank steps in one launch, graphs."""
    gen = torch.Generator().manual_seed(99)
    checks: list[Check] = []
    works = [
        Workload("decode", 24 if not tiny else 6, 4, 16, 1, 64, rank_major_b=True),
        Workload("verify", 12 if not tiny else 3, 3, 16, 4, 64, rank_major_b=True),
        Workload("decode", 8 if not tiny else 4, 4, 64, 1, 64, rank_major_b=True),
    ]
    for tag, backend in (("", TritonLoRABackend()), ("[wide-rank] ", TritonLoRABackend(small_rank_block=0))):
        for module in modules.values():
            for w in works:
                c = check_apply(backend, w, module, torch.bfloat16, device, gen, base_requests=1)
                c.name = tag + c.name
                checks.append(c)
            mixed = check_apply(
                backend, works[0], module, torch.bfloat16, device, gen, ranks=[64, 16, 40, 7, 0]
            )
            mixed.name = f"{tag}{mixed.name} ranks 64/16/40/7/0"
            checks.append(mixed)
    checks += check_graph(TritonLoRABackend(), modules["gate_up"], device, gen, "decode", 16, 1, max_rank=64)
    checks += check_graph(TritonLoRABackend(), modules["qkv"], device, gen, "verify", 8, 4, max_rank=64)
    return checks


def pipeline_checks(device, modules, tiny: bool) -> list[Check]:
    """The default and the timed variants against float64 at the benchmark shapes
    (rank-16 and rank-64 pools, mixed ranks, base requests, extend), and under graph replay."""
    gen = torch.Generator().manual_seed(77)
    checks: list[Check] = []
    works = [
        Workload("decode", 64 if not tiny else 6, 64 if not tiny else 6, 16, rank_major_b=True),
        Workload("verify", 32 if not tiny else 3, 32 if not tiny else 3, 16, 4, rank_major_b=True),
        Workload("decode", 24 if not tiny else 6, 4, 16, 1, 64, rank_major_b=True),
        Workload("decode", 8 if not tiny else 4, 4, 64, 1, 64, rank_major_b=True),
        Workload(
            "extend",
            4 if not tiny else 2,
            4 if not tiny else 2,
            64,
            512 if not tiny else 20,
            rank_major_b=True,
        ),
    ]
    # The variants the pipeline phase times (run 10 checked the other stage counts and groups).
    backends = {"default": TritonLoRABackend(), **{name: BACKENDS[name]() for name in LAYER_PIPELINED}}
    for name, backend in backends.items():
        for module in modules.values():
            for w in works:
                c = check_apply(backend, w, module, torch.bfloat16, device, gen, base_requests=1)
                c.name = f"[{name}] {c.name}"
                checks.append(c)
            mixed = check_apply(
                backend, works[2], module, torch.bfloat16, device, gen, ranks=[64, 16, 40, 7, 0]
            )
            mixed.name = f"[{name}] {mixed.name} ranks 64/16/40/7/0"
            checks.append(mixed)
        for c in check_graph(backend, modules["gate_up"], device, gen, "decode", 16, 1, max_rank=64):
            c.name = f"[{name}] {c.name}"
            checks.append(c)
        for c in check_graph(backend, modules["qkv"], device, gen, "verify", 8, 4):
            c.name = f"[{name}] {c.name}"
            checks.append(c)
    return checks
