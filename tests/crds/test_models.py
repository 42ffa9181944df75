"""The pydantic models in ``loraserve.operator.specs`` mirror the CRDs field for field.

Walks each CRD schema beside the model's JSON schema: the same camelCase fields, the same
required fields, defaults, enums and numeric bounds. A field added to one side only, or a
default changed on one side only, fails here.
"""

from __future__ import annotations

import pytest

from loraserve.operator import specs


def _resolve(node: dict, defs: dict) -> dict:
    """Follow ``$ref`` and unwrap ``Optional`` (``anyOf [X, null]``), keeping the default."""
    default = node.get("default", ...)
    while True:
        if "$ref" in node:
            node = defs[node["$ref"].split("/")[-1]]
            continue
        branches = [b for b in node.get("anyOf", ()) if b.get("type") != "null"]
        if "anyOf" in node and len(branches) == 1:
            node = branches[0]
            continue
        break
    if default is not ...:
        node = {**node, "default": default}
    return node


def _enum(node: dict, defs: dict) -> set | None:
    node = _resolve(node, defs)
    if "enum" in node:
        return set(node["enum"])
    if "const" in node:
        return {node["const"]}
    return None


def _compare(crd: dict, model: dict, defs: dict, path: str, problems: list[str]) -> None:
    model = _resolve(model, defs)
    crd_enum, model_enum = crd.get("enum"), _enum(model, defs)
    if (crd_enum is not None or model_enum is not None) and set(crd_enum or ()) != (model_enum or set()):
        problems.append(f"{path}: enum {crd_enum} vs {model_enum}")
    if crd.get("exclusiveMinimum") is True:
        if model.get("exclusiveMinimum") != crd.get("minimum"):
            problems.append(
                f"{path}: exclusive minimum {crd.get('minimum')} vs {model.get('exclusiveMinimum')}"
            )
    elif crd.get("minimum") != model.get("minimum"):
        problems.append(f"{path}: minimum {crd.get('minimum')} vs {model.get('minimum')}")
    for bound in ("maximum", "minItems", "maxItems"):
        if crd.get(bound) != model.get(bound):
            problems.append(f"{path}: {bound} {crd.get(bound)} vs {model.get(bound)}")
    if "default" in crd and crd["default"] != {} and model.get("default", ...) != crd["default"]:
        problems.append(f"{path}: default {crd['default']!r} vs {model.get('default', 'none')!r}")
    if crd.get("type") == "object" and "properties" in crd:
        crd_props = crd["properties"]
        model_props = model.get("properties", {})
        if set(crd_props) != set(model_props):
            problems.append(f"{path}: fields {sorted(set(crd_props) ^ set(model_props))} on one side only")
        if set(crd.get("required", ())) != set(model.get("required", ())):
            problems.append(f"{path}: required {crd.get('required')} vs {model.get('required')}")
        for name in set(crd_props) & set(model_props):
            _compare(crd_props[name], model_props[name], defs, f"{path}.{name}", problems)
    if crd.get("type") == "array" and "items" in model:
        _compare(crd["items"], model["items"], defs, f"{path}[]", problems)


@pytest.mark.parametrize(
    ("kind", "part", "model"),
    [
        ("LoRAServe", "spec", specs.LoRAServeSpec),
        ("LoRAServe", "status", specs.LoRAServeStatus),
        ("Adapter", "spec", specs.AdapterSpec),
        ("Adapter", "status", specs.AdapterStatus),
    ],
)
def test_model_mirrors_crd(kit, kind, part, model):
    crd = kit.crd_schema(kit.load_crd(kind))["properties"][part]
    schema = model.model_json_schema(by_alias=True, mode="validation")
    problems: list[str] = []
    _compare(crd, schema, schema.get("$defs", {}), part, problems)
    assert problems == []


def test_comparison_notices_a_drifted_default(kit):
    crd = kit.crd_schema(kit.load_crd("LoRAServe"))["properties"]["spec"]
    crd["properties"]["lora"]["properties"]["maxRank"]["default"] = 128
    schema = specs.LoRAServeSpec.model_json_schema(by_alias=True, mode="validation")
    problems: list[str] = []
    _compare(crd, schema, schema["$defs"], "spec", problems)
    assert problems == ["spec.lora.maxRank: default 128 vs 64"]


def test_crd_defaults_equal_model_defaults(kit):
    minimal = {"apiVersion": specs.API_VERSION, "kind": "LoRAServe", "metadata": {"name": "m"}}
    minimal["spec"] = {"model": {"source": "/models/m"}}
    defaulted = kit.admit(minimal).object["spec"]
    parsed = specs.parse_loraserve_spec({"model": {"source": "/models/m"}}).to_dict()
    # The model also spells out empty lists the CRD leaves absent.
    parsed["runtime"].pop("env")
    parsed["runtime"].pop("extraArgs")
    parsed.pop("scheduling")
    defaulted.pop("scheduling")
    assert parsed == defaulted


@pytest.mark.parametrize(
    "source",
    [
        "pvc://model-cache/llama/8b",
        "/models/llama",
        "https://example.com/a.tar.gz",
        "s3://bucket/key/x.tgz",
        "hf://org/repo",
        "hf://org/repo@abc123",
        "pvc://Bad_Claim/x",
        "pvc://claim",
        "ftp://x/y",
        "models/relative",
        "s3://bucket-only",
        "hf://org/repo@a@b",
        "https://",
        "/with space",
    ],
)
def test_source_rule_agrees_between_cel_and_model(kit, source):
    obj = {
        "apiVersion": specs.API_VERSION,
        "kind": "Adapter",
        "metadata": {"name": "a"},
        "spec": {"serve": "s", "source": source},
    }
    cel_ok = kit.admit(obj).valid
    try:
        specs.parse_adapter_spec(obj["spec"])
        model_ok = True
    except specs.SpecError:
        model_ok = False
    assert cel_ok == model_ok
    assert cel_ok == (
        source
        in {
            "pvc://model-cache/llama/8b",
            "/models/llama",
            "https://example.com/a.tar.gz",
            "s3://bucket/key/x.tgz",
            "hf://org/repo",
            "hf://org/repo@abc123",
        }
    )


TRAVERSING_SOURCES = [
    "pvc://adapters/../../etc",
    "pvc://adapters//etc/shadow",
    "pvc://adapters/team//sql",
    "pvc://adapters/team/../../sql",
    "pvc://adapters/..",
    "/models/../etc/shadow",
]
CONFINED_SOURCES = ["pvc://adapters/team/sql", "pvc://adapters/sql/", "pvc://adapters/..sql", "/models/a..b"]


@pytest.mark.parametrize("source", TRAVERSING_SOURCES + CONFINED_SOURCES)
def test_sources_stay_inside_their_volume_in_cel_and_model(kit, source):
    """Every source field of both CRDs refuses a path that leaves its volume ('..', '//', an
    absolute tail after the claim), and so does the operator's model, naming the field and the fix."""
    bad = source in TRAVERSING_SOURCES
    objects = [
        ("spec.source", {"kind": "Adapter", "spec": {"serve": "s", "source": source}}),
        ("spec.model.source", {"kind": "LoRAServe", "spec": {"model": {"source": source}}}),
        (
            "spec.speculative.draftModel.source",
            {
                "kind": "LoRAServe",
                "spec": {
                    "model": {"source": "/models/m"},
                    "speculative": {"algorithm": "EAGLE", "draftModel": {"source": source}},
                },
            },
        ),
    ]
    if source.startswith("pvc://"):
        claim = {"type": "PersistentVolumeClaim", "claimName": "adapters"}
        for _, obj in objects[1:]:
            obj["spec"]["storage"] = {"models": claim}
    for field, obj in objects:
        obj.update(apiVersion=specs.API_VERSION, metadata={"name": "a"})
        admission = kit.admit(obj)
        assert admission.valid is not bad, (field, admission.all())
        if bad:
            assert any("must stay inside its volume" in m for m in admission.all()), admission.all()
        parse = specs.parse_adapter_spec if obj["kind"] == "Adapter" else specs.parse_loraserve_spec
        if not bad:
            parse(obj["spec"])
            continue
        with pytest.raises(specs.SpecError) as caught:
            parse(obj["spec"])
        assert any(p.startswith(f"{field}: ") and "fix:" in p for p in caught.value.problems), caught.value


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("artifacts.example.com", True),
        ("*.s3.example.com", True),
        ("10.0.0.5", True),
        ("https://artifacts.example.com", False),
        ("a b", False),
        ("*", False),
        ("host/path", False),
    ],
)
def test_remote_source_hosts_agree_between_crd_and_model(kit, host, ok):
    spec = {"model": {"source": "/models/m"}, "runtime": {"remoteSourceHosts": [host]}}
    obj = {"apiVersion": specs.API_VERSION, "kind": "LoRAServe", "metadata": {"name": "a"}, "spec": spec}
    assert kit.admit(obj).valid is ok
    if ok:
        assert specs.parse_loraserve_spec(spec).runtime.remote_source_hosts == [host]
    else:
        with pytest.raises(specs.SpecError, match=r"spec\.runtime\.remoteSourceHosts\[0\]"):
            specs.parse_loraserve_spec(spec)


def test_spec_errors_name_the_users_fields():
    with pytest.raises(specs.SpecError) as caught:
        specs.parse_loraserve_spec({"model": {"source": "/m"}, "lora": {"maxRank": 0}, "replicas": "x"})
    problems = caught.value.problems
    assert any(p.startswith("spec.lora.maxRank:") for p in problems)
    assert any(p.startswith("spec.replicas:") for p in problems)
    with pytest.raises(specs.SpecError) as caught:
        specs.parse_loraserve_spec({})
    assert caught.value.problems == ["spec.model: Field required"]


@pytest.mark.parametrize(
    "token_map,ok",
    [
        ("freq_32768.pt", True),
        ("maps/hot.safetensors", True),
        ("hot.json", True),
        ("/abs/hot.json", False),
        ("../outside.json", False),
        ("maps/../../x.pt", False),
        ("hot.bin", False),
        ("with space.json", False),
    ],
)
def test_token_map_rule_agrees_between_cel_and_model(kit, token_map, ok):
    """``spec.speculative.draftModel.tokenMap``: a relative file of the draft's source."""
    spec = {
        "model": {"source": "/models/m"},
        "speculative": {"algorithm": "EAGLE", "draftModel": {"source": "/models/d", "tokenMap": token_map}},
    }
    obj = {"apiVersion": specs.API_VERSION, "kind": "LoRAServe", "metadata": {"name": "m"}, "spec": spec}
    cel_ok = kit.admit(obj).valid
    try:
        specs.parse_loraserve_spec(spec)
        model_ok = True
    except specs.SpecError:
        model_ok = False
    assert (cel_ok, model_ok) == (ok, ok)
