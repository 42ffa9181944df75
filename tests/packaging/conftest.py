"""A wheel built from the working tree, and a directory it is installed into.

The tree is copied first (only what the wheel is made from), so that building never
writes into the shared checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"operator": "loraserve.operator", "runtime": "loraserve.runtime", "kernels": "loraserve.kernels"}


def subpackages() -> set[str]:
    """Every package the checkout defines: folders with an ``__init__.py``."""
    names = set()
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(ROOT / folder)
            names.add(".".join([package, *relative.parts]))
    return names


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path_factory.mktemp("dist")
    # setuptools builds wheels itself (bdist_wheel); the separate `wheel` package that
    # pyproject's build requirements name is not needed for that, so its check is skipped.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(dist),
        ],
        cwd=source,
        check=True,
        capture_output=True,
        text=True,
    )
    (built,) = dist.glob("loraserve-*.whl")
    return built


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("target")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


@pytest.fixture(scope="session")
def checkout_packages() -> set[str]:
    return subpackages()
