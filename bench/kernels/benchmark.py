"""The benchmark's phases in order: environment, then the timed phases.

Layer first (the targets), then modules, then the sweep: a short budget cuts the tuning
record. Each phase gets its share of what is left when it starts, and the results so far
are written after each, so a run cut short keeps them.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.kernels.triton_ops.fused import barrier_timeouts

from ..harness import environment
from . import cli
from .gemm import bench_gemm
from .layer import bench_layer
from .module_bench import Row, bench_modules
from .report import print_summary, save
from .scenarios import (
    epilogue_scenarios,
    layer_scenarios,
    module_workloads,
    pipeline_module_workloads,
    pipeline_scenarios,
    rank_module_workloads,
    rank_scenarios,
    sweep_workloads,
    target_scenarios,
    tune_workloads,
)
from .shapes import Module, llama_modules
from .sweep import sweep
from .timing import copy_bandwidth, launch_floor
from .tune import tune
from .variants import TUNED


@dataclass
class Run:
    """What every phase shares: the options, the device and its measured limits, the clock."""

    args: argparse.Namespace
    t0: float  # time.time() at the start
    deadline: float  # time.time() after which no new timing starts
    skip: set[str]
    device: torch.device
    tiny: bool
    modules: dict[str, Module]
    env: dict
    l2_bytes: int
    copy_bw: float

    def share(self, fraction: float) -> float:
        """A phase's deadline: ``fraction`` of the time left from now."""
        return time.time() + fraction * max(0.0, self.deadline - time.time())

    def done(self, phase: str) -> None:
        """Say that ``phase`` finished, with the seconds since the start."""
        print(f"{phase} done ({time.time() - self.t0:.0f}s)", flush=True)


@dataclass
class Measured:
    """Everything measured so far, as :func:`save` writes it."""

    rows: list[Row] = field(default_factory=list)
    sweeps: list[dict] = field(default_factory=list)
    layer: list[dict] = field(default_factory=list)
    tuned: dict[str, dict] = field(default_factory=dict)
    tune_record: list[dict] = field(default_factory=list)

    def save(self, run: Run) -> None:
        """Write ``kernels.json`` and ``kernels.md`` under ``--out``."""
        save(Path(run.args.out), run.env, self.rows, self.sweeps, self.layer, self.tuned,
             self.tune_record)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run every phase ``argv`` asks for; 1 when a grid barrier timed out. Correctness is
    ``tests/kernels``' (float64 references), run on the same GPU before timing it."""
    run = start(cli.parse(argv))
    measured = Measured()
    measured.save(run)
    if run.args.tune:
        tune_phase(run, measured)
    layer_phase(run, measured)
    module_phase(run, measured)
    if "sweep" not in run.skip:
        measured.sweeps = sweep(run.device, run.modules, sweep_workloads(run.tiny), run.copy_bw, run.l2_bytes,
                                run.args.reps, run.deadline)  # fmt: skip
    run.done("sweep")
    run.env["barrier_timeouts"] = barrier_timeouts(run.device)
    measured.save(run)
    print_summary(measured.layer, measured.rows)
    timeouts = run.env["barrier_timeouts"]
    print(f"barrier timeouts: {timeouts}; total {time.time() - run.t0:.0f}s")
    return 1 if timeouts else 0


def start(args: argparse.Namespace) -> Run:
    """The device, the shapes, and the environment record: versions, L2 size, copy bandwidth
    and the launch floor (printed)."""
    t0 = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    env = {**environment(device), "command": " ".join([Path(sys.executable).name, *sys.argv])}
    l2_bytes = 60 * 2**20
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sms"] = props.multi_processor_count
        l2_bytes = getattr(props, "L2_cache_size", l2_bytes)
        env["l2_mb"] = round(l2_bytes / 2**20, 1)
    copy_bw = copy_bandwidth(device, 2**30) if device.type == "cuda" else 1e9
    env["copy_bw_tb_s"] = round(copy_bw / 1e12, 3)
    env["launch_floor_us"] = round(launch_floor(device), 2)
    print(env, flush=True)
    skip = set(filter(None, args.skip.split(",")))
    modules = llama_modules(tiny)
    return Run(args, t0, t0 + args.budget_s, skip, device, tiny, modules, env, l2_bytes, copy_bw)


def tune_phase(run: Run, measured: Measured) -> None:
    """``--tune``: half the time left searches launch configurations on the layer targets."""
    measured.tuned, measured.tune_record = tune(
        run.device, run.modules, tune_workloads(run.tiny), run.l2_bytes, run.args.reps, run.share(0.5)
    )
    run.done("tune")
    measured.save(run)


def layer_phase(run: Run, measured: Measured) -> None:
    """The ``--layer`` scenarios (and, for ``epilogue``, the Triton GEMM against cuBLAS first)."""
    args = run.args
    layer_deadline = run.share(0.45 if args.layer == "all" else 0.9)
    scenarios = {
        "targets": target_scenarios,
        "epilogue": epilogue_scenarios,
        "rank": rank_scenarios,
        "pipeline": pipeline_scenarios,
    }.get(args.layer, layer_scenarios)(run.tiny)
    if not args.tune:
        scenarios = [(w, tuple(v for v in vs if v not in TUNED)) for w, vs in scenarios]
    if args.layer == "epilogue" and "gemm" not in run.skip:
        run.env["gemm"] = bench_gemm(run.device, run.modules, args.reps, run.share(0.35))
        run.done("gemm")
    if "layer" not in run.skip:
        out_dir = Path(args.out)
        if args.trace:
            (out_dir / "traces").mkdir(parents=True, exist_ok=True)
        measured.layer = bench_layer(
            run.device, run.modules, scenarios, args.reps, 2 if run.tiny else 32, layer_deadline, measured.tuned,
            out_dir / "traces" if args.trace else None,
        )  # fmt: skip
    run.done("layer")
    measured.save(run)


def module_phase(run: Run, measured: Measured) -> None:
    """Per-module timings on the shapes ``--layer`` calls for, in 65% of the time left."""
    module_deadline = run.share(0.65)
    if "bench" not in run.skip:
        shapes = {"rank": rank_module_workloads, "pipeline": pipeline_module_workloads}.get(
            run.args.layer, module_workloads
        )(run.tiny)
        measured.rows = bench_modules(run.device, run.modules, shapes, run.copy_bw, run.l2_bytes, run.args.reps,
                                      module_deadline)  # fmt: skip
    run.done("modules")
    measured.save(run)
