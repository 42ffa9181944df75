"""The contract package and the whole operator import in a process without torch.

The operator's image has no torch; it imports ``loraserve.runtime.contract`` (the typed
configuration, the flags, the capability table, the policy, the catalog). A module of
either that imports torch, however indirectly, would break the operator on start-up: here
a meta-path finder makes every ``import torch`` fail, in a fresh interpreter, and every
module must still import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loraserve.runtime.contract import policy

POLICY_DIR = Path(policy.__file__).parent

BLOCK_TORCH_AND_IMPORT = """
import importlib, importlib.abc, json, pkgutil, sys


class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"no torch in the operator's image (import {name})")
        return None


sys.meta_path.insert(0, NoTorch())
failed, imported = {}, []
for package in json.loads(sys.argv[1]):
    try:
        root = importlib.import_module(package)
    except Exception as error:
        failed[package] = repr(error)
        continue
    names = [package, *(m.name for m in pkgutil.walk_packages(root.__path__, package + "."))]
    for name in names:
        if name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs the program; its imports are main's, imported here anyway
        try:
            importlib.import_module(name)
            imported.append(name)
        except Exception as error:
            failed[name] = repr(error)
print(json.dumps({"imported": imported, "failed": failed, "torch": "torch" in sys.modules}))
"""


def _import_without_torch(*packages: str, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONSAFEPATH"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH_AND_IMPORT, json.dumps(packages)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_operator_imports_without_torch(tmp_path):
    """The contract and every operator module import without torch."""
    result = _import_without_torch("loraserve.runtime.contract", "loraserve.operator", cwd=tmp_path)
    assert result["failed"] == {}
    assert result["torch"] is False
    imported = set(result["imported"])
    for name in ("config", "flags", "capabilities", "policy", "catalog"):
        assert f"loraserve.runtime.contract.{name}" in imported
    policy_modules = sorted(p.stem for p in POLICY_DIR.glob("*.py") if p.stem != "__init__")
    assert policy_modules, POLICY_DIR
    for name in policy_modules:
        assert f"loraserve.runtime.contract.policy.{name}" in imported
    for name in ("specs", "translate", "desired", "webhooks", "handlers", "main", "reconcile.serve"):
        assert f"loraserve.operator.{name}" in imported


def test_the_blocker_does_stop_torch(tmp_path):
    """The check above is only as good as its blocker: a module that needs torch fails."""
    result = _import_without_torch("loraserve.runtime.engine", cwd=tmp_path)
    assert "loraserve.runtime.engine" in result["failed"]
    assert "no torch in the operator's image" in result["failed"]["loraserve.runtime.engine"]
