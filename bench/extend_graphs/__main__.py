"""``python bench/extend_graphs ARGS``: the multi-request extend graph benchmark (the
package docstring says what it does)."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent


def import_package(folder: Path = HERE) -> types.ModuleType:
    """``folder`` imported as ``bench.<folder name>`` (``bench/bootstrap.py`` says how and why)."""
    spec = importlib.util.spec_from_file_location("bench_bootstrap", HERE.parent / "bootstrap.py")
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)
    return bootstrap.import_package(folder)


if __name__ == "__main__":
    import_package()
    from bench.extend_graphs.cli import main

    sys.exit(main())
