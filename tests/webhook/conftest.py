"""A live admission stack for the webhook tests.

No Kubernetes API server exists on these machines: kmock's ``KubernetesEmulator`` stands
in for it (it stores objects and serves list/watch, but neither validates them against
the CRDs nor calls webhooks). kopf runs for real against it, with the LoRAServe webhooks
and indexes, behind kopf's own HTTPS webhook server; the tests post AdmissionReview v1
requests to it and store admitted objects in the emulator themselves, as the API server
would, so kopf's watch feeds the indexes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml

from loraserve.operator.dev.demo_admission import AdmissionLab

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def lab():
    async with AdmissionLab(namespace="tests") as running:
        yield running


@pytest.fixture
def manifest():
    """Load an example manifest, optionally into another namespace."""

    def load(relative: str, namespace: str | None = None) -> dict[str, Any]:
        obj = yaml.safe_load((EXAMPLES / relative).read_text())
        if namespace:
            obj["metadata"]["namespace"] = namespace
        return obj

    return load
