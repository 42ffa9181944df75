"""The algorithm registry: one entry per algorithm, the CRD's enum equal to its keys, and
the policy reading its traits."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from loraserve.runtime.contract.algorithms import ALGORITHMS, SpecAlgorithm, having
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.contract.policy import check_config

ROOT = Path(__file__).resolve().parents[2]
CRDS = [ROOT / "crds/loraserve.io_loraserves.yaml", ROOT / "charts/loraserve/crds/loraserve.io_loraserves.yaml"]


def _crd_algorithms(path: Path) -> list[str]:
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["speculative"]["properties"]["algorithm"]["enum"]


def test_every_algorithm():
    assert list(ALGORITHMS) == list(SpecAlgorithm)


@pytest.mark.parametrize("path", CRDS, ids=lambda p: p.parts[-3])
def test_crd_enum(path):
    assert _crd_algorithms(path) == [a.value for a in ALGORITHMS]


def test_resolution():
    for algorithm, traits in ALGORITHMS.items():
        if traits.resolves_to is not None:
            # One hop, to an algorithm judged as itself; what it implements is that one's.
            assert ALGORITHMS[traits.resolves_to].resolves_to is None, algorithm
            assert not traits.implemented and traits.unimplemented_reason is None, algorithm


def test_unimplemented_says_why():
    for algorithm, traits in ALGORITHMS.items():
        if traits.resolves_to is None:
            assert traits.implemented == (traits.unimplemented_reason is None), algorithm
        assert not traits.trees_implemented or traits.grows_trees, algorithm


@pytest.mark.parametrize("algorithm", sorted(having("unimplemented_reason")))
def test_unavailable_names_lack(algorithm):
    config = RuntimeConfig()
    config.speculative.algorithm = algorithm
    config.speculative.draft_model_path = "/models/draft"
    report = check_config(config)
    (finding,) = [v for v in report.violations if v.rule == "algorithm-unavailable"]
    assert ALGORITHMS[algorithm].unimplemented_reason in finding.reason


def test_lora_refusal_reason():
    config = RuntimeConfig()
    config.lora.enabled = True
    config.speculative.algorithm = SpecAlgorithm.NEXTN
    config.speculative.draft_model_architecture = "Gemma4AssistantForCausalLM"
    report = check_config(config)
    (finding,) = [v for v in report.violations if v.rule == "lora-algorithm"]
    assert ALGORITHMS[SpecAlgorithm.FROZEN_KV_MTP].lora_refusal in finding.reason


def test_packages_build_drafters():
    """The factory is a lookup: every implemented algorithm that drafts names a package
    with a ``build_drafter``; one the image does not run names none."""
    for algorithm, traits in ALGORITHMS.items():
        drafts = traits.implemented and algorithm is not SpecAlgorithm.NONE
        assert (traits.package is not None) == drafts, algorithm
        if drafts:
            assert callable(importlib.import_module(traits.package).build_drafter), algorithm
