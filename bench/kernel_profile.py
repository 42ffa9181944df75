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
import importlib.util
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _bench_kernels():
    """bench/kernels.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_kernels", HERE / "kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    bk = _bench_kernels()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="dec bs64 a64,dec bs32 a8,ver4 bs32 a32")
    parser.add_argument("--modules", default="qkv,o,gate_up,down")
    parser.add_argument("--pool-rank", type=int, default=0, help="pool rank (0: the adapters' rank)")
    parser.add_argument("--small-rank-block", type=int, default=None, help="the backend's, when set")
    args = parser.parse_args()
    device = torch.device("cuda")
    modules = bk.llama_modules(tiny=False)
    workloads = [
        bk.Workload("decode", 64, 64, 16, 1, args.pool_rank, rank_major_b=True),
        bk.Workload("decode", 32, 8, 16, 1, args.pool_rank, rank_major_b=True),
        bk.Workload("verify", 32, 32, 16, 4, args.pool_rank, rank_major_b=True),
    ]
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    extra = {} if args.small_rank_block is None else {"small_rank_block": args.small_rank_block}
    backend = bk.TritonLoRABackend(fused=False, **extra)
    gen = torch.Generator().manual_seed(5)
    runs = []
    for w in workloads:
        if not any(w.label().startswith(c) for c in wanted):
            continue
        for name in args.modules.split(","):
            m = modules[name]
            case = bk.ModuleCase(w, m, device, gen, l2_bytes=0, max_sets=2)
            fn = case.triton_fns(backend)[0]
            fn()
            print(
                f"case {w.label()} {name}: {bk.path_of(backend, case.info, case.x[0], case.B[0], m.offsets)}",
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
