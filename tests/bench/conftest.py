"""``bench.speculative`` importable by name, as ``python bench/speculative`` imports it.

``bench/`` is not an installed package and the repository root never goes on ``sys.path``
(its ``operator/`` would shadow the standard library's), so the package is imported by
``bench/bootstrap.py``'s ``import_package``.
"""

from __future__ import annotations

import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

runpy.run_path(str(BENCH / "bootstrap.py"))["import_package"](BENCH / "speculative")
