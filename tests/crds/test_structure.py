"""The CRDs are structural, installable, and their printer columns and rules point at real fields."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

KINDS = ["LoRAServe", "Adapter"]


@pytest.mark.parametrize("kind", KINDS)
def test_schema_is_structural(kit, kind):
    assert kit.structural_problems(kit.crd_schema(kit.load_crd(kind))) == []


@pytest.mark.parametrize("kind", KINDS)
def test_crd_manifest_is_a_valid_customresourcedefinition(kit, kind):
    # kubernetes-validate checks the manifest against the CustomResourceDefinition
    # OpenAPI schema of Kubernetes 1.31 offline (unknown fields are errors in strict mode).
    kubernetes_validate.validate(kit.load_crd(kind), "1.31.0", strict=True)


@pytest.mark.parametrize(
    ("kind", "group", "plural", "short", "category"),
    [
        ("LoRAServe", "loraserve.io", "loraserves", "lsv", "loraserve"),
        ("Adapter", "loraserve.io", "adapters", "lora", "loraserve"),
    ],
)
def test_names_and_subresources(kit, kind, group, plural, short, category):
    crd = kit.load_crd(kind)
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{plural}.{group}"
    assert (names["kind"], names["plural"], crd["spec"]["group"]) == (kind, plural, group)
    assert short in names["shortNames"] and category in names["categories"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert "status" in version["subresources"]


@pytest.mark.parametrize("kind", KINDS)
def test_printer_columns_and_scale_paths_resolve(kit, kind):
    crd = kit.load_crd(kind)
    (version,) = crd["spec"]["versions"]
    schema = kit.crd_schema(crd)
    json_types = {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean", "date": "string"}
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path == ".metadata.creationTimestamp":
            continue
        node = kit.schema_at(schema, path)
        assert node is not None, f"printer column {column['name']} points at missing {path}"
        assert node["type"] == json_types[column["type"]], column["name"]
    scale = version["subresources"].get("scale")
    if scale:
        for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
            assert kit.schema_at(schema, scale[key]) is not None, key


def test_loraserve_columns_show_phase_readiness_algorithm_adapters_age(kit):
    (version,) = kit.load_crd("LoRAServe")["spec"]["versions"]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Phase", "Ready", "Desired", "Algorithm", "Adapters", "Age"]


# The checker itself must catch what it claims to: each mutation breaks one structural rule.
def _break_type(s):
    del s["properties"]["spec"]["properties"]["replicas"]["type"]


def _break_ref(s):
    s["properties"]["spec"]["properties"]["lora"]["$ref"] = "#/definitions/x"


def _break_both(s):
    s["properties"]["spec"]["properties"]["scheduling"]["properties"]["nodeSelector"]["properties"] = {
        "a": {"type": "string"}
    }


def _break_anyof(s):
    s["properties"]["spec"]["properties"]["replicas"]["anyOf"] = [{"type": "integer", "minimum": 0}]


def _break_items(s):
    del s["properties"]["spec"]["properties"]["runtime"]["properties"]["extraArgs"]["items"]


def _break_default(s):
    s["properties"]["spec"]["properties"]["replicas"]["default"] = -1


def _break_rule(s):
    s["properties"]["spec"]["properties"]["lora"]["x-kubernetes-validations"][0]["rule"] = "self.maxRank >"


def _break_field_path(s):
    s["properties"]["spec"]["properties"]["lora"]["x-kubernetes-validations"][0]["fieldPath"] = ".nope"


def _break_bound(s):
    del s["properties"]["spec"]["properties"]["model"]["properties"]["source"]["maxLength"]


def _break_list_map(s):
    env = s["properties"]["spec"]["properties"]["runtime"]["properties"]["env"]
    env["items"]["required"] = []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_break_type, "no type"),
        (_break_ref, "forbidden keyword $ref"),
        (_break_both, "properties and additionalProperties together"),
        (_break_anyof, "type is not allowed inside anyOf"),
        (_break_items, "arrays need one items schema"),
        (_break_default, "default -1 is invalid"),
        (_break_rule, "does not compile"),
        (_break_field_path, "fieldPath .nope"),
        (_break_bound, "needs maxLength"),
        (_break_list_map, "list-type map needs list-map-keys"),
    ],
)
def test_checker_catches_non_structural_schemas(kit, mutate, expected):
    schema = copy.deepcopy(kit.crd_schema(kit.load_crd("LoRAServe")))
    mutate(schema)
    problems = kit.structural_problems(schema)
    assert any(expected in p for p in problems), problems
