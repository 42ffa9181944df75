"""The CRDs, generated from the operator's typed spec model (as controller-gen does from Go types).

``python -m loraserve.operator.crd`` (``make crds``) writes ``crds/`` and the chart's copy
in ``charts/loraserve/crds/``; ``--check`` exits 1 with a diff where the committed files
differ. Pure: models in, dicts and YAML out.
"""

from __future__ import annotations

from pathlib import Path

from loraserve.operator.crd.manifest import crd, file_name, render, root_schema
from loraserve.operator.specs import CUSTOM_RESOURCES

OUTPUT_DIRS = ("crds", "charts/loraserve/crds")
"""Where the CRDs go, relative to the repository root: the API, and the Helm chart's copy."""


def outputs(root: Path) -> dict[Path, str]:
    """Every generated file under ``root`` and its text."""
    return {
        root / folder / file_name(resource): render(resource)
        for folder in OUTPUT_DIRS
        for resource in CUSTOM_RESOURCES
    }


__all__ = ["OUTPUT_DIRS", "crd", "file_name", "outputs", "render", "root_schema"]
