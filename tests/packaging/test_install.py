"""The project imports as ``loraserve.operator``, ``loraserve.runtime`` and
``loraserve.kernels`` both from the editable install and from a built wheel.

Each import runs in a fresh interpreter whose working directory is outside the
checkout, so the top-level ``operator/`` folder can neither shadow the standard library
nor stand in for the installed package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = {"loraserve.operator": "operator", "loraserve.runtime": "runtime", "loraserve.kernels": "kernels"}
OWN_MODULES = (
    "loraserve.runtime.contract.config",
    "loraserve.runtime.contract.policy",
    "loraserve.runtime.contract.capabilities",
    "loraserve.kernels.metadata",
    "loraserve.operator.specs",
    "loraserve.operator.translate",
    "loraserve.operator.webhooks",
)

IMPORT_ALL = """
import importlib, json, sys
names = json.loads(sys.argv[1])
files = {name: importlib.import_module(name).__file__ for name in names}
import loraserve
print(json.dumps({"files": files, "namespace": list(loraserve.__path__), "init": getattr(loraserve, "__file__", None)}))
"""


def _python(code: str, *args: str, cwd: Path, isolated_site: list[str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; with ``isolated_site``, without ``site`` (so no
    .pth file, hence no editable install) and with exactly those directories added."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONSAFEPATH"] = "1"
    command = [sys.executable]
    if isolated_site is not None:
        command.append("-S")
        code = f"import sys; sys.path[:0] = {isolated_site!r}\n" + code
    done = subprocess.run([*command, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_editable_install_uses_checkout(tmp_path, checkout_packages):
    """Editable install imports from the checkout."""
    names = sorted(checkout_packages | set(OWN_MODULES))
    result = _python(IMPORT_ALL, json.dumps(names), cwd=tmp_path)
    for name, path in result["files"].items():
        folder = TOP[".".join(name.split(".")[:2])]
        assert Path(path).is_relative_to(ROOT / folder), (name, path)
    assert result["init"] is None  # loraserve is a namespace package


def test_wheel_holds_every_package(wheel, checkout_packages):
    """Wheel holds every package and no loraserve init."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
    packaged = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packaged == checkout_packages
    assert "loraserve/__init__.py" not in names
    assert not any("__pycache__" in n or n.startswith(("tests/", "operator/", "runtime/")) for n in names)
    assert "loraserve-runtime = loraserve.runtime.__main__:main" in scripts
    assert "loraserve-operator = loraserve.operator.__main__:main" in scripts
    assert "loraserve-fetch = loraserve.runtime.tools.fetch:main" in scripts
    assert "loraserve-token-map = loraserve.runtime.tools.token_map:main" in scripts


def test_built_wheel_imports_without_the_checkout(installed, tmp_path, checkout_packages):
    site_packages = sysconfig.get_paths()["purelib"]  # the dependencies, without their .pth files
    names = sorted(checkout_packages | set(OWN_MODULES))
    result = _python(
        IMPORT_ALL, json.dumps(names), cwd=tmp_path, isolated_site=[str(installed), site_packages]
    )
    for name, path in result["files"].items():
        assert Path(path).is_relative_to(installed / "loraserve"), (name, path)
    assert result["namespace"] == [str(installed / "loraserve")]


def test_policy_needs_no_operator_deps(installed, tmp_path):
    """The contract needs none of the operator's dependencies (pydantic, kopf, jsonschema, yaml)."""
    blocker = """
import importlib.abc, json, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "pydantic_core", "kopf", "jsonschema", "yaml"):
            raise ImportError(f"{name} is not in the serving image")
sys.meta_path.insert(0, Block())
from loraserve.runtime.contract import capabilities, config, policy
report = policy.check_config(config.RuntimeConfig(model=config.ModelConfig(path="/m")))
print(json.dumps({"ok": report.ok, "pydantic": "pydantic" in sys.modules}))
"""
    site_packages = sysconfig.get_paths()["purelib"]
    result = _python(blocker, cwd=tmp_path, isolated_site=[str(installed), site_packages])
    assert result == {"ok": True, "pydantic": False}
