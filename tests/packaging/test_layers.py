"""The package layers hold (docs/development.md#layers).

``lint-imports`` keeps every contract of ``[tool.importlinter]`` (function-level imports
count), the runtime's and the operator's layers name every package of theirs, so a new
one cannot sit outside them, and the engine reaches speculative decoding only through
the factory it is given.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from loraserve.runtime.builder import speculative_decoder_factory
from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm
from loraserve.runtime.engine import DecoderUnavailableError, build_decoder
from loraserve.runtime.speculative import build_decoder as build_speculative_decoder

from .conftest import ROOT


def _contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_contracts_kept():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONSAFEPATH"] = "1"
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in report, report


@pytest.mark.parametrize("package", ["runtime", "operator"])
def test_layers_name_every_package(package):
    container = [f"loraserve.{package}"]
    (layers,) = [c for c in _contracts() if c["type"] == "layers" and c["containers"] == container]
    named = {name.strip() for layer in layers["layers"] for name in re.split(r"[|:]", layer)}
    folder = ROOT / package
    children = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    children |= {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    assert named == children


def test_engine_speculates_only_with_a_factory():
    config = RuntimeConfig()
    config.speculative.algorithm = SpecAlgorithm.NGRAM
    with pytest.raises(DecoderUnavailableError, match=r"decoder_factory=loraserve\.runtime\.speculative"):
        build_decoder(config, runner=None, sampler=None)
    assert speculative_decoder_factory(config) is build_speculative_decoder
    assert speculative_decoder_factory(RuntimeConfig()) is None
