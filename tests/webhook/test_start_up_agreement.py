"""One policy, two callers: whatever the webhook admits, the runtime starts, and back.

Every combination of speculative algorithm, adaptive, autoDisable, lora.enabled and CUDA
graphs goes through the webhook's decision (the mutating defaults, then ``judge_serve`` on
the CRD-shaped spec) and through the runtime's start-up as a pod runs it: the flags the
operator writes for the translated configuration, parsed by the runtime's own parser,
``config_from_args`` and ``cli.check`` (no model is loaded), then the decoder's own check
(``check_speculative``, run when the drafter is built after the model loads). Admitted
must equal "starts and builds its drafter". Model directories hold only a config.json.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from loraserve.operator import webhooks
from loraserve.operator.desired import runtime_args
from loraserve.operator.specs import parse_loraserve_spec
from loraserve.operator.translate import to_runtime_config
from loraserve.runtime import cli
from loraserve.runtime.speculative.draft_config import SpeculativeConfigError, check_speculative

ALGORITHMS = ("NONE", "NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "DFLASH")
SWITCHES = ("adaptive", "autoDisable", "lora", "cudaGraphs")
COMBINATIONS = [
    (algorithm, *flags) for algorithm in ALGORITHMS for flags in itertools.product((False, True), repeat=4)
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A target and a draft directory, each with the config.json start-up reads."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, config in (
        ("base", {"architectures": ["LlamaForCausalLM"]}),
        ("draft", {"architectures": ["LlamaForCausalLM"], "block_size": 8}),
    ):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        dirs[name] = root / name
    return dirs


def serve_spec(models, algorithm: str, adaptive: bool, auto_disable: bool, lora: bool, graphs: bool) -> dict:
    """The LoRAServe spec a user would write for one combination (one GPU, local models)."""
    speculative: dict = {"algorithm": algorithm, "adaptive": adaptive, "autoDisable": auto_disable}
    if algorithm in ("STANDALONE", "EAGLE", "EAGLE3", "DFLASH"):
        speculative["draftModel"] = {"source": str(models["draft"])}
    return {
        "model": {"source": str(models["base"])},
        "speculative": speculative,
        "lora": {"enabled": lora},
        "runtime": {"cudaGraph": {"enabled": graphs}},
        "gpus": 1,
    }


def defaulted(spec: dict) -> dict:
    """``spec`` with the mutating webhook's patch merged in, as the API server stores it."""
    patch = webhooks.derived_defaults(spec)
    return {**spec, **{k: {**spec.get(k, {}), **v} for k, v in patch.items()}}


def admitted(spec: dict) -> webhooks.Verdict:
    """The webhook's decision: the mutating webhook's defaults, then the validating judge."""
    return webhooks.judge_serve(defaulted(spec), name="walk")


def starts(spec: dict) -> list[str]:
    """Why the runtime refuses to start (or to build its drafter) with the pod's flags; [] if it runs."""
    config = to_runtime_config(parse_loraserve_spec(defaulted(spec)))
    args = cli.build_parser().parse_args(runtime_args(config))
    effective, reasons, _ = cli.check(cli.config_from_args(args, env={}))
    if reasons:
        return reasons
    if effective.speculative.enabled:
        try:
            check_speculative(effective)
        except SpeculativeConfigError as exc:
            return [f"drafter: {exc}"]
    return []


@pytest.mark.parametrize(
    "combination", COMBINATIONS, ids=lambda c: "-".join([c[0], *(n for n, on in zip(SWITCHES, c[1:], strict=True) if on)])
)
def test_admitted_iff_starts(models, combination):
    spec = serve_spec(models, *combination)
    verdict = admitted(spec)
    refusals = starts(spec)
    assert verdict.allowed == (not refusals), (verdict.problems, refusals)


def test_walk_covers_both_outcomes(models):
    """The walk is not vacuous: some combinations start, some are refused by both."""
    outcomes = {admitted(serve_spec(models, *c)).allowed for c in COMBINATIONS}
    assert outcomes == {True, False}


def test_eagle_adaptive_no_lora_refused(models):
    """The issue's case: EAGLE, adaptive, LoRA off was admitted and then crash-looped."""
    verdict = admitted(serve_spec(models, "EAGLE", True, False, False, False))
    assert not verdict.allowed
    assert any(p.startswith("spec.speculative.adaptive:") for p in verdict.problems), verdict.problems


def test_lora_adaptive_fix_is_accepted(models):
    """The fix text of the LoRA-on case names only a change that makes the serve start."""
    verdict = admitted(serve_spec(models, "EAGLE", True, False, True, False))
    assert not verdict.allowed
    assert not any("spec.lora.enabled to false" in p for p in verdict.problems), verdict.problems
    assert not any("spec.runtime.cudaGraph.enabled to false" in p for p in verdict.problems)
