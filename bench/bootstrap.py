"""How a benchmark folder run by path (``python bench/<name> ARGS``) imports itself.

Run by path, a folder's ``__main__.py`` belongs to no package and the folder is
``sys.path[0]``. :func:`import_package` takes that entry off (the modules there are not
top-level names) and makes ``bench`` a namespace package over the ``bench/`` folder, so the
folder imports as ``bench.<name>``. The repository root never goes on ``sys.path``: its
``operator/`` would shadow the standard library's ``operator`` (and so would this folder's
``operator.py``). For the same reason this file is no importable module: each
``__main__.py`` loads it by its path (``runpy.run_path``) and calls :func:`main`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn


def import_package(folder: Path) -> types.ModuleType:
    """``folder``, a benchmark under ``bench/``, imported as the package ``bench.<folder name>``."""
    folder = folder.resolve()
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != folder]
    return import_module(folder.name)


def import_module(name: str) -> types.ModuleType:
    """``bench/<name>`` (a folder or a ``.py`` file) imported as ``bench.<name>``: also how a
    script under ``bench/`` run by path uses another one's code."""
    if "bench" not in sys.modules:
        spec = importlib.machinery.ModuleSpec("bench", None, is_package=True)
        spec.submodule_search_locations = [str(Path(__file__).resolve().parent)]
        sys.modules["bench"] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"bench.{name}")


def main(main_file: str, entry: str, env: Mapping[str, str] | None = None) -> NoReturn:
    """Run the benchmark whose ``__main__.py`` is ``main_file``: exit with ``main()`` of its
    module ``entry`` (``benchmark``, ``cli``). ``env`` holds defaults for environment
    variables, set before the package is imported, so a value the caller exported wins."""
    for name, value in (env or {}).items():
        os.environ.setdefault(name, value)
    package = import_package(Path(main_file).resolve().parent)
    module = importlib.import_module(f"{package.__name__}.{entry}")
    sys.exit(module.main())
