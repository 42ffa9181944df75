"""``python bench/draft_adapters ARGS``: the draft-adapter benchmark (the package docstring says what it does)."""

from __future__ import annotations

import importlib.util
import os
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
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import_package()
    from bench.draft_adapters.benchmark import main

    sys.exit(main())
