"""What each phase times: workloads, modules and variants, full-size or ``--tiny``."""

from __future__ import annotations

from .shapes import Workload
from .variants import EPILOGUE, LAYER_PIPELINED, OVERLAPS

ALL = ("qkv", "o", "gate_up", "down")

PATHS3 = ("default", "two-launch", "fused")

# The layer targets: the default (two launches per module, serial) and each overlapped join.
LAYER = (
    "default",
    "overlap-auto",
    "overlap-delta",
    "overlap-shrink",
    "overlap-mixed",
    "overlap-delta-carve16",
    "overlap-delta-carve32",
    "overlap-shrink-carve16",
)

# where the two joins cross over: the joins alone
CROSSOVER = ("default", "overlap-auto", "overlap-delta", "overlap-shrink")

# The layer targets' shapes (and batch 1, and 8 adapters at batch 8 from graph metadata).
LAYER_SHAPES = (
    Workload("decode", 1, 1, 16, rank_major_b=True),
    Workload("decode", 32, 8, 16, rank_major_b=True),
    Workload("decode", 32, 8, 16, rank_major_b=True, graph=True),
    Workload("decode", 64, 64, 16, rank_major_b=True),
    Workload("verify", 32, 32, 16, 4, rank_major_b=True),
    Workload("decode", 8, 8, 16, rank_major_b=True, graph=True),
)


def module_workloads(tiny: bool) -> list[tuple[Workload, tuple[str, ...], tuple[str, ...]]]:
    """(workload, modules, variants): the shapes behind the targets, B rank-major as the pool stores it."""
    if tiny:
        return [
            (Workload("decode", 4, 2, 16, rank_major_b=True), ALL, PATHS3),
            (Workload("verify", 2, 2, 8, 4), ("qkv",), ("default",)),
            (Workload("extend", 2, 2, 16, 20), ("o",), ("default",)),
        ]
    return [
        (Workload("decode", 1, 1, 16, rank_major_b=True), ALL, ("default", "two-launch")),
        (Workload("decode", 32, 8, 16, rank_major_b=True), ALL, ("default", "two-launch", "fused")),
        (Workload("decode", 64, 64, 16, rank_major_b=True), ALL, ("default",)),
        (Workload("decode", 64, 64, 64, rank_major_b=True), ALL, ("default",)),
        (Workload("decode", 64, 64, 16, 1, 64), ("gate_up",), ("default",)),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), ALL, ("default",)),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), ALL, ("default",)),
        (Workload("verify", 64, 64, 16, 8, rank_major_b=True), ("gate_up",), ("default",)),
        (Workload("extend", 8, 8, 64, 512, rank_major_b=True), ("o", "down"), ("default",)),
        (Workload("extend", 4, 4, 16, 512, rank_major_b=True), ("o", "down"), ("default",)),
    ]


def sweep_workloads(tiny: bool) -> list[tuple[Workload, str]]:
    """(workload, module) pairs the launch-configuration sweep varies around."""
    if tiny:
        return [(Workload("decode", 4, 2, 16), "qkv")]
    return [
        (Workload("decode", 1, 1, 16, rank_major_b=True), "gate_up"),
        (Workload("decode", 64, 64, 16, rank_major_b=True), "gate_up"),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), "qkv"),
        (Workload("extend", 8, 8, 64, 512, rank_major_b=True), "o"),
    ]


def tune_workloads(tiny: bool) -> list[Workload]:
    """The layer targets' shapes (non-graph metadata; the graph variant reuses the configs)."""
    if tiny:
        return [Workload("decode", 4, 2, 16, rank_major_b=True)]
    return [
        Workload("decode", 32, 8, 16, rank_major_b=True),
        Workload("decode", 64, 64, 16, rank_major_b=True),
        Workload("verify", 32, 32, 16, 4, rank_major_b=True),
    ]


def layer_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """``--layer all``: the layer targets with every join, and where the two joins cross over."""
    if tiny:
        return [(Workload("decode", 2, 1, 16, rank_major_b=True), (*PATHS3, *OVERLAPS))]
    return [
        *((w, LAYER) for w in LAYER_SHAPES),
        # where the two joins cross over (the policy's delta_max_tiles)
        (Workload("decode", 2, 2, 16, rank_major_b=True), CROSSOVER),
        (Workload("decode", 4, 4, 16, rank_major_b=True), CROSSOVER),
        (Workload("verify", 1, 1, 16, 6, rank_major_b=True), CROSSOVER),
    ]


def epilogue_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """The layer targets (and batch 1) with the expand in a Triton base GEMM's epilogue."""
    if tiny:
        return [(Workload("decode", 4, 2, 16, rank_major_b=True), EPILOGUE)]
    return [(w, EPILOGUE) for w in LAYER_SHAPES]


def rank_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """Rank-64 pools (the runtime's default): rank-16 adapters at the layer targets and batch 1,
    and rank-64 adapters, with the small-rank step for rank <= 16 (the default) and without."""
    variants = ("default", "overlap-auto", "wide-rank", "overlap-auto-wide")
    if tiny:
        return [(Workload("decode", 4, 4, 16, 1, 64, rank_major_b=True), variants)]
    return [
        (Workload("decode", 1, 1, 16, 1, 64, rank_major_b=True), variants),
        (Workload("decode", 32, 8, 16, 1, 64, rank_major_b=True, graph=True), variants),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), variants),
        (Workload("verify", 32, 32, 16, 4, 64, rank_major_b=True), variants),
        (Workload("decode", 1, 1, 64, 1, 64, rank_major_b=True), variants),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), variants),
    ]


def rank_module_workloads(tiny: bool) -> list[tuple[Workload, tuple[str, ...], tuple[str, ...]]]:
    """``--layer rank``'s per-module shapes: rank-16 and rank-64 adapters in rank-64 pools."""
    if tiny:
        return [(Workload("decode", 4, 2, 16, 1, 64, rank_major_b=True), ("qkv",), ("default", "wide-rank"))]
    both = ("default", "wide-rank")
    return [
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), ALL, both),
        (Workload("verify", 32, 32, 16, 4, 64, rank_major_b=True), ALL, both),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), ALL, both),
        (Workload("decode", 1, 1, 64, 1, 64, rank_major_b=True), ("gate_up",), both),
    ]


def pipeline_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """The layer targets, batch 1 and rank-64 pools: the expand's register prefetch against
    the pipelined loop, all in the runtime's join."""
    variants = ("overlap-auto", *(f"overlap-auto-{name}" for name in LAYER_PIPELINED))
    if tiny:
        return [(Workload("decode", 4, 2, 16, rank_major_b=True), variants)]
    return [
        (Workload("decode", 1, 1, 16, rank_major_b=True), variants),
        (Workload("decode", 32, 8, 16, rank_major_b=True, graph=True), variants),
        (Workload("decode", 64, 64, 16, rank_major_b=True), variants),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), variants),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), variants),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), variants),
    ]


def pipeline_module_workloads(tiny: bool) -> list[tuple[Workload, tuple[str, ...], tuple[str, ...]]]:
    """``--layer pipeline``'s per-module shapes: the default against the register prefetch."""
    variants = ("default", "reg")
    if tiny:
        return [
            (Workload("decode", 4, 4, 16, rank_major_b=True), ("qkv",), variants),
            (Workload("extend", 2, 2, 16, 20, rank_major_b=True), ("o",), variants),
        ]
    return [
        (Workload("decode", 64, 64, 16, rank_major_b=True), ALL, variants),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), ALL, variants),
        (Workload("decode", 32, 8, 16, rank_major_b=True), ALL, variants),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), ALL, variants),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), ("gate_up",), variants),
        (Workload("extend", 8, 8, 64, 512, rank_major_b=True), ("o", "down"), variants),
        (Workload("extend", 4, 4, 16, 512, rank_major_b=True), ("o", "down"), variants),
    ]


def target_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """The layer targets only: the defaults against the tune phase's configurations."""
    variants = ("default", "overlap-auto", "tuned", "tuned-shrink")
    if tiny:
        return [(Workload("decode", 4, 2, 16, rank_major_b=True), variants)]
    return [
        (Workload("decode", 32, 8, 16, rank_major_b=True), variants),
        (Workload("decode", 32, 8, 16, rank_major_b=True, graph=True), variants),
        (Workload("decode", 64, 64, 16, rank_major_b=True), variants),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), variants),
    ]
