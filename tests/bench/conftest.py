"""Shared fixtures for the benchmark scripts' tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def bench():
    """``bench/spec.py`` loaded as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location("spec_bench_under_test", REPO / "bench" / "spec.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
