"""``python bench/prefix ARGS``: the prefix-cache benchmark (the package docstring says what it does)."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent


def import_package(folder: Path = HERE) -> types.ModuleType:
    """This folder imported as the package ``bench.prefix`` (as ``bench/speculative`` does):
    its own folder comes off ``sys.path`` and ``bench`` becomes a namespace package over
    ``bench/``; the repository root never goes on ``sys.path`` (its ``operator/`` would
    shadow the standard library's)."""
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != folder]
    if "bench" not in sys.modules:
        spec = importlib.machinery.ModuleSpec("bench", None, is_package=True)
        spec.submodule_search_locations = [str(folder.parent)]
        sys.modules["bench"] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"bench.{folder.name}")


if __name__ == "__main__":
    import_package()
    from bench.prefix.cli import main

    sys.exit(main())
