"""Every example is accepted by its CRD; every negative example fails where and how it says.

Negative examples carry ``# expect-rejected-by: schema|cel|webhook`` and
``# expect-message: ...``. Those rejected by the webhook must pass the CRD (so the API
server hands them to the webhook) and are judged with the LoRAServes of ``examples/``
as the webhook's index holds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.operator import webhooks
from loraserve.operator.index import IndexedAdapter

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
VALID = sorted(EXAMPLES.glob("*.yaml"))
INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))


def test_examples_cover_the_documented_cases(example_objects):
    serves = {o["metadata"]["name"]: o["spec"] for o in example_objects if o["kind"] == "LoRAServe"}
    algorithms = {s.get("speculative", {}).get("algorithm", "NONE") for s in serves.values()}
    assert {"EAGLE3", "NGRAM", "NONE"} <= algorithms
    sources = {o["spec"]["source"].split("://")[0] for o in example_objects if o["kind"] == "Adapter"}
    assert {"pvc", "hf", "s3", "https"} <= sources
    assert {Path(p).name for p in INVALID} and len(INVALID) >= 15


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_example_passes_schema_and_cel(kit, path):
    admission = kit.admit(kit.load_yaml(path))
    assert admission.valid, admission.all()


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_example_parses_into_the_typed_model(kit, path):
    from loraserve.operator.specs import parse_adapter_spec, parse_loraserve_spec

    obj = kit.admit(kit.load_yaml(path)).object
    parse = parse_loraserve_spec if obj["kind"] == "LoRAServe" else parse_adapter_spec
    parsed = parse(obj["spec"])
    # The typed model keeps every value the (defaulted) object holds.
    assert _without_empty(parsed.to_dict()) == _without_empty(obj["spec"])


def _without_empty(value):
    if isinstance(value, dict):
        pruned = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


def _judge(obj, example_objects):
    name = obj["metadata"]["name"]
    serves = {o["metadata"]["name"]: o["spec"] for o in example_objects if o["kind"] == "LoRAServe"}
    adapters = [
        IndexedAdapter(o["metadata"]["name"], o["spec"]) for o in example_objects if o["kind"] == "Adapter"
    ]
    if obj["kind"] == "LoRAServe":
        return webhooks.judge_serve(
            obj["spec"], name=name, adapters=[a for a in adapters if a.spec["serve"] == name]
        )
    serve = obj["spec"].get("serve")
    return webhooks.judge_adapter(
        obj["spec"],
        name=name,
        namespace="examples",
        serve_spec=serves.get(serve),
        siblings=[a for a in adapters if a.spec["serve"] == serve],
    )


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_negative_example_fails_where_annotated(kit, path, example_objects):
    expect = kit.expectation(path)
    obj = kit.load_yaml(path)
    admission = kit.admit(obj)
    if expect.rejected_by == "schema":
        assert admission.schema, "the schema accepted it"
        assert any(expect.message in m for m in admission.schema), admission.schema
    elif expect.rejected_by == "cel":
        assert not admission.schema, admission.schema
        assert any(expect.message in m for m in admission.cel), admission.cel
    else:
        assert admission.valid, f"the CRD already refuses it: {admission.all()}"
        verdict = _judge(admission.object, example_objects)
        assert not verdict.allowed
        assert any(expect.message in p for p in verdict.problems + verdict.warnings), verdict.problems


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_example_passes_webhook(kit, path, example_objects):
    """Valid example passes the webhook except unavailable algorithms."""
    from loraserve.runtime.contract.capabilities import CAPABILITIES
    from loraserve.runtime.contract.config import SpecAlgorithm

    obj = kit.admit(kit.load_yaml(path)).object
    verdict = _judge(obj, example_objects)
    algorithm = SpecAlgorithm(obj["spec"].get("speculative", {}).get("algorithm", "NONE"))
    if obj["kind"] == "LoRAServe" and not CAPABILITIES.implements(algorithm):
        # The table decides: once the algorithm is implemented this example is admitted.
        assert verdict.problems and all("not available in this runtime" in p for p in verdict.problems)
    else:
        assert verdict.allowed, verdict.problems
