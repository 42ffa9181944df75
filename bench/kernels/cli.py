"""The command line of the LoRA kernel benchmark."""

from __future__ import annotations

import argparse
import os

from ..harness import ARTIFACTS

DESCRIPTION = "LoRA kernel timings on Llama-3-8B shapes (correctness: tests/kernels)."


def build_parser() -> argparse.ArgumentParser:
    """Every option of the benchmark."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument(
        "--out", default=os.environ.get("OUT", str(ARTIFACTS / "kernels")), help="folder for kernels.md and .json"
    )
    parser.add_argument("--tiny", action="store_true", help="small shapes: a CPU dry run of every path")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new timings after this")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--skip", default="", help="comma list of phases to skip: bench,sweep,layer")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="before the layer phase, search launch configurations per module on the layer targets' shapes;"
        " the layer phase then also times those (variants tuned, tuned-shrink)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="layer phase: also write each case's kernel timeline (one replay of one layer) as CSV, with how much"
        " of the side stream's kernels overlapped the main stream's",
    )
    parser.add_argument(
        "--layer",
        choices=("all", "targets", "epilogue", "rank", "pipeline"),
        default="all",
        help="layer scenarios: all (every join and crossover shape), targets (the four targets, defaults vs tuned)"
        " or epilogue (the targets and batch 1 with the expand in a Triton base GEMM's epilogue; also times the"
        " Triton GEMM alone against cuBLAS per module) or rank (rank-64 pools with and without the small-rank"
        " step; the modules are those shapes) or pipeline (the expand's pipelined"
        " loop against the register prefetch; the modules are those shapes)",
    )
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line ``argv`` (``sys.argv[1:]`` when None)."""
    return build_parser().parse_args(argv)
