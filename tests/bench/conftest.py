"""Shared set-up for the benchmarks' tests: ``bench.speculative`` importable by name, and the
small frozen target the drafts' training tests train over.

``bench/`` is not an installed package and the repository root never goes on ``sys.path``
(its ``operator/`` would shadow the standard library's), so the package is imported the
way ``python bench/speculative`` imports it: by ``bench/bootstrap.py``'s ``import_package``.
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"

runpy.run_path(str(BENCH / "bootstrap.py"))["import_package"](BENCH / "speculative")


@pytest.fixture(scope="module")
def target():
    """The ``smoke-small`` Llama (vocabulary 64, seed 0) in eval mode, on the CPU."""
    from bench.speculative.training import new_llama

    return new_llama("smoke-small", 64, seed=0, device=torch.device("cpu")).eval()
