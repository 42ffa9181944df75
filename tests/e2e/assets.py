"""Files the end-to-end tests and the operator benchmark serve: a tiny model and adapters.

Built once with ``loraserve.runtime.dev.devmodels`` (random weights, local tokenizer, PEFT
adapters) into a cache directory, then copied into per-run "volume claims" (host
directories a LoRAServe mounts at their own paths, see ``kubelet.py``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from loraserve.runtime.dev.devmodels import _build_once, build_adapter, build_tiny_model
from loraserve.runtime.lora.sources import adapter_digest

MAX_RANK = 16
ADAPTERS = {
    # name: (rank, target modules, seed)
    "alpha": (4, ("q_proj", "v_proj"), 1),
    "beta": (8, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
    "gamma": (8, ("gate_proj", "up_proj", "down_proj"), 3),
    "delta": (4, ("o_proj",), 4),
    "wide": (32, ("q_proj", "v_proj"), 5),  # rank over the serve's MAX_RANK
}


@dataclass(frozen=True)
class Claims:
    """Host directories standing in for two PersistentVolumeClaims."""

    root: Path
    models: Path  # claim "models": the base model under tiny/
    adapters: Path  # claim "adapters": one directory per adapter

    def digest(self, adapter: str) -> str:
        """The runtime's canonical sha256 of an adapter (what an Adapter's spec.sha256 holds)."""
        return adapter_digest(self.adapters / adapter)


def ensure_assets(cache: Path) -> Path:
    """Build the model and adapters under ``cache`` unless already there; returns ``cache``."""
    model = cache / "models" / "tiny"
    _build_once(model, lambda d: build_tiny_model(d, seed=0))
    for name, (rank, modules, seed) in ADAPTERS.items():
        _build_once(
            cache / "adapters" / name,
            lambda d, r=rank, m=modules, s=seed: build_adapter(
                d, model, rank=r, alpha=2 * r, target_modules=m, seed=s
            ),
        )
    return cache


def install_claims(cache: Path, root: Path) -> Claims:
    """Copy the built files into fresh claim directories under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for claim in ("models", "adapters"):
        shutil.copytree(
            cache / claim, root / claim, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete")
        )
    return Claims(root=root, models=root / "models", adapters=root / "adapters")


def serve_manifest(
    name: str, claims: Claims, *, replicas: int = 2, namespace: str = "ml", **spec: object
) -> dict:
    """A LoRAServe of the tiny model on CPU, with the two claims mounted at their own paths."""
    body = {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "LoRAServe",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"source": "pvc://models/tiny", "dtype": "float32"},
            "replicas": replicas,
            "gpus": 0,
            "lora": {"maxRank": MAX_RANK, "maxLorasPerBatch": 4, "maxLoadedLoras": 8},
            "runtime": {
                "maxRunningRequests": 8,
                "maxTotalTokens": 4096,
                # One thread per process: several runtimes share two cores.
                "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "MKL_NUM_THREADS", "value": "1"}],
            },
            "storage": {
                "models": {
                    "type": "PersistentVolumeClaim",
                    "claimName": "models",
                    "mountPath": str(claims.models),
                    "readOnly": True,
                },
                "adapters": {
                    "type": "PersistentVolumeClaim",
                    "claimName": "adapters",
                    "mountPath": str(claims.adapters),
                },
            },
        },
    }
    body["spec"].update(spec)
    return body


def adapter_manifest(name: str, serve: str, source: str, *, namespace: str = "ml", **spec: object) -> dict:
    return {
        "apiVersion": "loraserve.io/v1alpha1",
        "kind": "Adapter",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"serve": serve, "source": source, **spec},
    }
