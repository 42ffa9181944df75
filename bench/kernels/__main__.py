"""``python bench/kernels ARGS``: the LoRA kernel benchmark (the package docstring says what it does)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent


def import_package(folder: Path = HERE) -> types.ModuleType:
    """``folder``, a benchmark under ``bench/``, imported as the package ``bench.<folder name>``.

    Run by path, this file belongs to no package and its folder is ``sys.path[0]``: that
    entry comes off (the modules here are not top-level names), and ``bench`` becomes a
    namespace package over the ``bench/`` folder. The repository root never goes on
    ``sys.path``: its ``operator/`` would shadow the standard library's ``operator``.
    """
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != folder]
    if "bench" not in sys.modules:
        spec = importlib.machinery.ModuleSpec("bench", None, is_package=True)
        spec.submodule_search_locations = [str(folder.parent)]
        sys.modules["bench"] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"bench.{folder.name}")


if __name__ == "__main__":
    import_package()
    from bench.kernels.benchmark import main

    sys.exit(main())
