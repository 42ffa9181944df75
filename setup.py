"""Maps the top-level folders onto the ``loraserve.*`` import names.

A top-level ``operator`` package would shadow the standard library, so the folders
``operator/``, ``runtime/`` and ``kernels/`` install as ``loraserve.operator``,
``loraserve.runtime`` and ``loraserve.kernels`` (``loraserve`` itself is a namespace
package). Sub-packages are discovered, so adding one needs no change here.
"""

import os

from setuptools import setup

FOLDERS = {"operator": "loraserve.operator", "runtime": "loraserve.runtime", "kernels": "loraserve.kernels"}


def _packages() -> tuple[list[str], dict[str, str]]:
    here = os.path.dirname(os.path.abspath(__file__))
    packages: list[str] = []
    package_dir: dict[str, str] = {}
    for folder, name in FOLDERS.items():
        package_dir[name] = folder
        for root, dirs, files in os.walk(os.path.join(here, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            if "__init__.py" in files:
                rel = os.path.relpath(root, os.path.join(here, folder))
                packages.append(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir)
