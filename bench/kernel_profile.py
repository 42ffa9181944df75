"""Hardware counters of the LoRA kernels on the layer targets' shapes, under Nsight Compute.

Runs each (workload, module) pair's shrink and expand once to compile and warm up, then
once more between ``cudaProfilerStart``/``Stop`` so that ``ncu --profile-from-start off``
records exactly those launches. Prints, per case, the launch configurations the backend
chose, so the report's rows can be matched to them.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --csv --page details \\
        python3 -P bench/kernel_profile.py > ncu.csv

``--cases`` picks workloads by label prefix (``dec bs64 a64``), ``--modules`` the modules.
"""

from __future__ import annotations

import argparse
import runpy
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _import_bench_kernels() -> None:
    """Make ``bench.kernels`` importable the way its ``__main__.py`` does (the repository
    root never goes on ``sys.path``: its ``operator/`` would shadow the standard library's)."""
    runpy.run_path(str(HERE / "bootstrap.py"))["import_package"](HERE / "kernels")


def main() -> int:
    """Run the chosen cases' launches once to warm up, then once more for the profiler."""
    _import_bench_kernels()
    from bench.kernels.module_bench import ModuleCase
    from bench.kernels.shapes import Workload, llama_modules
    from bench.kernels.variants import path_of
    from loraserve.kernels.triton_backend import TritonLoRABackend

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dec bs64 a64,dec bs32 a8,ver4 bs32 a32")
    parser.add_argument("--modules", default="qkv,o,gate_up,down")
    parser.add_argument("--pool-rank", type=int, default=0, help="pool rank (0: the adapters' rank)")
    parser.add_argument("--small-rank-block", type=int, default=None, help="the backend's, when set")
    args = parser.parse_args()
    device = torch.device("cuda")
    modules = llama_modules(tiny=False)
    workloads = [
        Workload("decode", 64, 64, 16, 1, args.pool_rank, rank_major_b=True),
        Workload("decode", 32, 8, 16, 1, args.pool_rank, rank_major_b=True),
        Workload("verify", 32, 32, 16, 4, args.pool_rank, rank_major_b=True),
    ]
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    extra = {} if args.small_rank_block is None else {"small_rank_block": args.small_rank_block}
    backend = TritonLoRABackend(fused=False, **extra)
    gen = torch.Generator().manual_seed(5)
    runs = []
    for w in workloads:
        if not any(w.label().startswith(c) for c in wanted):
            continue
        for name in args.modules.split(","):
            m = modules[name]
            case = ModuleCase(w, m, device, gen, l2_bytes=0, max_sets=2)
            fn = case.triton_fns(backend)[0]
            fn()
            print(
                f"case {w.label()} {name}: {path_of(backend, case.info, case.x[0], case.B[0], m.offsets)}",
                flush=True,
            )
            runs.append(fn)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in runs:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
