"""Every CEL rule of the CRDs refuses a real object and admits its nearest fix, and judges it
as the Python rule it is declared beside: the model's ``check``, or the policy rule it
``mirrors`` (the webhook's)."""

from __future__ import annotations

import random
import typing
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel

from loraserve.operator import specs, translate
from loraserve.runtime.contract import policy
from loraserve.runtime.contract.capabilities import Capabilities
from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.contract.policy.cel import CelRule

EVERYTHING = Capabilities(
    algorithms=frozenset(SpecAlgorithm), tree_algorithms=frozenset(SpecAlgorithm), dynamic_ragged_verify=True
)
KEDA = {"serverAddress": "http://prometheus.monitoring:9090"}
EAGLE = {"algorithm": "EAGLE", "draftModel": {"source": "/models/draft"}}
PVC_MODELS = {"models": {"type": "PersistentVolumeClaim", "claimName": "models"}}


def _rules_of(annotation: Any, seen: set) -> typing.Iterator[CelRule]:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, specs.Cel):
            yield from arg.rules
        elif isinstance(arg, type) and issubclass(arg, BaseModel):
            yield from declared(arg, seen)
        elif arg is not annotation:
            yield from _rules_of(arg, seen)


def declared(model: type[BaseModel], seen: set | None = None) -> typing.Iterator[CelRule]:
    """Every CEL rule a model and the models under it declare."""
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    yield from getattr(model, "cel_rules", ())
    for info in model.model_fields.values():
        for item in info.metadata:
            yield from _rules_of(item, seen)
        yield from _rules_of(info.annotation, seen)


RULES = {r.message: r for m in (specs.LoRAServeSpec, specs.AdapterSpec) for r in declared(m)}


@dataclass(frozen=True)
class Case:
    message: str
    """A fragment of exactly one rule's message."""
    bad: dict
    good: dict
    kind: str = "LoRAServe"

    def rule(self) -> CelRule:
        (rule,) = [r for m, r in RULES.items() if self.message in m]
        return rule


def _obj(kind: str, spec: dict) -> dict:
    base = {"model": {"source": "/models/m"}} if kind == "LoRAServe" else {"serve": "s", "source": "/adapters/a"}
    return {"apiVersion": specs.API_VERSION, "kind": kind, "metadata": {"name": "x"}, "spec": {**base, **spec}}


CASES = [
    Case("CUDA graphs need a GPU", {"gpus": 0, "runtime": {"cudaGraph": {"enabled": True}}}, {"gpus": 1, "runtime": {"cudaGraph": {"enabled": True}}}),
    Case("Triton attention needs a GPU", {"gpus": 0, "runtime": {"attentionBackend": "triton"}}, {"gpus": 0, "runtime": {"attentionBackend": "auto"}}),
    Case("resources.limits['nvidia.com/gpu']", {"resources": {"limits": {"nvidia.com/gpu": 1}}}, {"resources": {"limits": {"cpu": "4"}}}),
    Case("resources.requests['nvidia.com/gpu']", {"resources": {"requests": {"nvidia.com/gpu": 1}}}, {"resources": {"requests": {"memory": "8Gi"}}}),
    Case("pvc:// model source must name", {"model": {"source": "pvc://models/llama"}}, {"model": {"source": "pvc://models/llama"}, "storage": PVC_MODELS}),
    Case("pvc:// draft model source", {"speculative": {**EAGLE, "draftModel": {"source": "pvc://models/d"}}}, {"speculative": {**EAGLE, "draftModel": {"source": "pvc://models/d"}}, "storage": PVC_MODELS}),
    Case("set the revision once", {"model": {"source": "hf://org/llama@abc", "revision": "abc"}}, {"model": {"source": "hf://org/llama@abc"}}),
    Case("must be pvc://<claim>/<path>", {"source": "ftp://host/a"}, {"source": "https://host/a"}, "Adapter"),
    Case("must stay inside its volume", {"source": "/adapters/../etc"}, {"source": "/adapters/etc"}, "Adapter"),
    Case("speculative.draftModel is required", {"speculative": {"algorithm": "EAGLE3"}}, {"speculative": {**EAGLE, "algorithm": "EAGLE3"}}),
    Case("must equal numSteps + 1", {"speculative": {**EAGLE, "numDraftTokens": 5}}, {"speculative": {**EAGLE, "numDraftTokens": 4}}),
    Case("numDraftTokens is required when topK > 1", {"speculative": {**EAGLE, "topK": 2}}, {"speculative": {**EAGLE, "topK": 2, "numDraftTokens": 8}}),
    Case("must be at most 1 + topK", {"speculative": {**EAGLE, "topK": 2, "numSteps": 2, "numDraftTokens": 8}}, {"speculative": {**EAGLE, "topK": 2, "numSteps": 2, "numDraftTokens": 7}}),
    Case("topK > 1 (tree drafts) is only supported", {"speculative": {"algorithm": "NGRAM", "topK": 2, "numDraftTokens": 4}}, {"speculative": {"algorithm": "NEXTN", "topK": 2, "numDraftTokens": 4}}),
    Case("inside the draft model's source", {"speculative": {**EAGLE, "draftModel": {"source": "/d", "tokenMap": "maps/../x.pt"}}}, {"speculative": {**EAGLE, "draftModel": {"source": "/d", "tokenMap": "maps/x.pt"}}}),
    Case("ngram.minMatch must not exceed", {"speculative": {"ngram": {"minMatch": 5, "maxMatch": 3}}}, {"speculative": {"ngram": {"minMatch": 3, "maxMatch": 3}}}),
    Case("maxLorasPerBatch (GPU slots)", {"lora": {"maxLorasPerBatch": 16, "maxLoadedLoras": 8}}, {"lora": {"maxLorasPerBatch": 8, "maxLoadedLoras": 8}}),
    Case("claimName is required", {"storage": {"adapters": {"type": "PersistentVolumeClaim"}}}, {"storage": {"adapters": {"type": "PersistentVolumeClaim", "claimName": "a"}}}),
    Case("size is the sizeLimit", {"storage": {"models": {**PVC_MODELS["models"], "size": "1Gi"}}}, {"storage": {"models": {"size": "1Gi"}}}),
    Case("must be at most autoscaling.maxReplicas", {"autoscaling": {"minReplicas": 5, "maxReplicas": 4}}, {"autoscaling": {"minReplicas": 4, "maxReplicas": 4}}),
    Case("(scale to zero) needs mode KEDA", {"autoscaling": {"minReplicas": 0, "maxReplicas": 4}}, {"autoscaling": {"minReplicas": 1, "maxReplicas": 4}}),
    Case("mode KEDA needs keda.serverAddress", {"autoscaling": {"mode": "KEDA", "maxReplicas": 4}}, {"autoscaling": {"mode": "KEDA", "maxReplicas": 4, "keda": KEDA}}),
    Case("keda is read only with mode KEDA", {"autoscaling": {"maxReplicas": 4, "keda": KEDA}}, {"autoscaling": {"maxReplicas": 4}}),
    Case("needs keda.wakeQuery", {"autoscaling": {"mode": "KEDA", "minReplicas": 0, "maxReplicas": 4, "keda": KEDA}}, {"autoscaling": {"mode": "KEDA", "minReplicas": 0, "maxReplicas": 4, "keda": {**KEDA, "wakeQuery": "sum(gw_pending)"}}}),
    Case("64 lowercase hex", {"draft": {"source": "/adapters/d", "sha256": "AB" * 32}}, {"draft": {"source": "/adapters/d", "sha256": "ab" * 32}}, "Adapter"),
    Case("placement.replicas is required", {"placement": {"mode": "Replicas"}}, {"placement": {"mode": "Replicas", "replicas": 2}}, "Adapter"),
]  # fmt: skip


def test_every_rule_has_a_case():
    covered = {case.rule().message for case in CASES}
    transition = {m for m, r in RULES.items() if "oldSelf" in r.rule}  # test_serve_is_immutable_on_update
    assert set(RULES) - covered == transition


def test_cel_rules_restate_python_rules():
    """Every rule restates a python rule or is the API servers own."""
    mirrored = {r.mirrors for r in RULES.values() if r.mirrors}
    assert all(not (r.check and r.mirrors) for r in RULES.values())
    # The operator words these its own way (it fills a chain's width in, names an unmounted
    # claim with the volumes a serve mounts, reads claimName for a claim only), or cannot see
    # them (updates): the API server's alone.
    own = sorted(m[:30] for m, r in RULES.items() if not (r.check or r.mirrors))
    assert own == [
        "a pvc:// draft model source mu",
        "a pvc:// model source must nam",
        "claimName is required for type",
        "numDraftTokens is required whe",
        "serve is immutable: create a n",
    ]
    assert mirrored == {
        "draft-required", "chain-draft-tokens", "tree-draft-tokens", "tree-algorithm", "ngram-window",
        "lora-slots-cache", "cuda-graph-cpu", "attention-triton-cpu",
    }  # fmt: skip


def _parses(kind: str, spec: dict) -> bool:
    parse = specs.parse_loraserve_spec if kind == "LoRAServe" else specs.parse_adapter_spec
    try:
        parse(spec)
    except specs.SpecError:
        return False
    return True


def _policy_rules(spec: dict) -> set[str]:
    config = translate.to_runtime_config(specs.parse_loraserve_spec(spec))
    return policy.check_config(config, EVERYTHING).rules()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.message)
def test_rule_refuses_the_bad_and_admits_the_fix(kit, case):
    rule = case.rule()
    bad, good = _obj(case.kind, case.bad), _obj(case.kind, case.good)
    refused = kit.admit(bad)
    assert refused.schema == [] and len(refused.cel) == 1, refused.all()
    assert rule.message in refused.cel[0]
    assert kit.admit(good).valid, kit.admit(good).all()
    if rule.check:  # the model runs the same rule
        assert not _parses(case.kind, bad["spec"]) and _parses(case.kind, good["spec"])
    if rule.mirrors:  # the webhook's policy judges the same condition
        assert rule.mirrors in _policy_rules(bad["spec"])
        assert rule.mirrors not in _policy_rules(good["spec"])


def test_model_checks_name_the_field_and_the_fix():
    problems = []
    for spec in ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, {"model": {"source": "/m/../etc"}}):
        with pytest.raises(specs.SpecError) as caught:
            specs.parse_loraserve_spec({"model": {"source": "/models/m"}, **spec})
        problems += caught.value.problems
    assert problems[0].startswith("spec.autoscaling: minReplicas (5) is above maxReplicas (2); fix:")
    assert problems[1].startswith("spec.model.source: '/m/../etc' has a '..' segment; fix:")


def test_serve_is_immutable_on_update(kit):
    old = _obj("Adapter", {})
    assert kit.admit(old, old=old).valid
    moved = _obj("Adapter", {"serve": "other"})
    assert any("serve is immutable" in m for m in kit.admit(moved, old=old).cel)
    assert kit.admit(moved).valid  # a create has no old object


def _random_spec(rng: random.Random) -> dict:
    speculative = {
        "algorithm": rng.choice(list(SpecAlgorithm)).value,
        "numSteps": rng.randint(1, 4),
        "topK": rng.randint(1, 3),
        "ngram": {"minMatch": rng.randint(1, 4), "maxMatch": rng.randint(1, 4)},
    }
    if rng.random() < 0.5:
        speculative["draftModel"] = {"source": "/models/draft"}
    if rng.random() < 0.7:
        speculative["numDraftTokens"] = rng.randint(2, 40)
    return {
        "model": {"source": "/models/base"},
        "speculative": speculative,
        "lora": {"maxLorasPerBatch": rng.choice([4, 8, 16]), "maxLoadedLoras": rng.choice([4, 8, 16])},
        "gpus": rng.randint(0, 1),
        "runtime": {
            "cudaGraph": {"enabled": rng.random() < 0.5},
            "attentionBackend": rng.choice(["auto", "sdpa", "triton"]),
        },
    }


def test_mirrored_rules_agree_on_random_specs(kit):
    """Mirrored rules agree with the policy on random specs."""
    twins = {r.message: r.mirrors for r in RULES.values() if r.mirrors}
    rng = random.Random(20261202)
    seen: set[str] = set()
    for _ in range(300):
        spec = _random_spec(rng)
        admission = kit.admit(_obj("LoRAServe", spec))
        assert not admission.schema, admission.schema
        by_cel = {rule for message, rule in twins.items() if any(message in m for m in admission.cel)}
        assert by_cel == _policy_rules(spec) & set(twins.values()), spec
        seen |= by_cel
    assert seen == set(twins.values()), "the sample never exercised some rules"
