"""Fixtures of the end-to-end operator tests: tiny model files and a stand-in cluster.

No Kubernetes API server exists on these machines: kmock's KubernetesEmulator (with the
bookkeeping in ``apiserver.py``) stands in for it, and ``kubelet.py`` plays the Deployment
controller, kubelet and garbage collector, running real ``loraserve-runtime`` processes.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import pytest_asyncio

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _load(name: str):
    module_name = f"_loraserve_e2e_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


cluster_mod = _load("cluster")
assets_mod = _load("assets")


@pytest.fixture(scope="session")
def e2e_cache() -> Path:
    """Model and adapters, built once and kept under .cache/ between runs."""
    return assets_mod.ensure_assets(REPO / ".cache" / "operator-e2e")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(e2e_cache: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cluster")
    claims = assets_mod.install_claims(e2e_cache, root / "claims")
    stand_in = cluster_mod.Cluster(root=root, claims_root=claims.root)
    stand_in.claims = claims
    await stand_in.start()
    try:
        yield stand_in
    finally:
        await stand_in.stop()
