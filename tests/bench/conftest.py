"""Shared set-up for the benchmarks' tests: ``bench.speculative`` importable by name.

``bench/`` is not an installed package and the repository root never goes on ``sys.path``
(its ``operator/`` would shadow the standard library's), so the package is imported the
way ``python bench/speculative`` imports it: by its ``__main__.py``'s ``import_package``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _import_speculative() -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_speculative_entry", REPO / "bench" / "speculative" / "__main__.py"
    )
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    entry.import_package()


_import_speculative()
