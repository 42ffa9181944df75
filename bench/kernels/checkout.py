"""``loraserve.kernels`` for the benchmark: installed, or loaded straight from this checkout."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository


def import_kernels() -> types.ModuleType:
    """``loraserve.kernels`` installed, or loaded straight from this checkout."""
    try:
        import loraserve.kernels as kernels

        return kernels
    except ImportError:
        pass
    if "loraserve" not in sys.modules:
        namespace = types.ModuleType("loraserve")
        namespace.__path__ = []
        sys.modules["loraserve"] = namespace
    spec = importlib.util.spec_from_file_location(
        "loraserve.kernels",
        ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["loraserve.kernels"] = module
    spec.loader.exec_module(module)
    return module
