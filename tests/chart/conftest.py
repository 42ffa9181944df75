"""Fixtures of the Helm chart tests: the real helm binary and a renderer."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "loraserve"
HELM = REPO / ".tools" / "helm"


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm v3 (the Makefile extracts it before tests; extracted here when missing)."""
    if not HELM.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "get_helm.py"), str(HELM)], check=True)
    return HELM


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., list[dict]]:
    """``render(*helm-template-flags)`` -> the rendered objects (CRDs included): helm runs once
    per set of flags in a session, and each call gets its own copy to change."""
    rendered: dict[tuple[str, ...], list[dict]] = {}

    def run(*flags: str) -> list[dict]:
        if flags not in rendered:
            rendered[flags] = template(*flags)
        return copy.deepcopy(rendered[flags])

    def template(*flags: str) -> list[dict]:
        result = subprocess.run(
            [
                str(helm),
                "template",
                "ls",
                str(CHART),
                "--namespace",
                "loraserve-system",
                "--include-crds",
                *flags,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    return run
