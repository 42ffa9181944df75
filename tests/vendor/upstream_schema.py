"""Validate an object against a vendored upstream CRD (see README.md here).

``validate(obj)`` picks the CRD by the object's apiVersion/kind, applies the schema's defaults
as the API server would, validates with jsonschema (Draft 4, as Kubernetes' structural schemas)
and, because the API server prunes unknown fields instead of refusing them, also reports every
field the object sets that the schema does not declare. CEL rules (x-kubernetes-validations)
are evaluated with cel-python. Returns a list of problems (empty when valid).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

HERE = Path(__file__).resolve().parent
FILES = {
    ("inference.networking.k8s.io", "InferencePool"): HERE
    / "gateway-api-inference-extension/inferencepools.yaml",
    ("keda.sh", "ScaledObject"): HERE / "keda/scaledobjects.yaml",
    ("monitoring.coreos.com", "PodMonitor"): HERE / "prometheus-operator/podmonitors.yaml",
}
_CEL = celpy.Environment()


@functools.cache
def crd(group: str, kind: str) -> dict[str, Any]:
    return yaml.safe_load(FILES[(group, kind)].read_text())


def schema_for(api_version: str, kind: str) -> dict[str, Any]:
    group, _, version = api_version.rpartition("/")
    manifest = crd(group, kind)
    for entry in manifest["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{api_version} {kind}: the vendored CRD serves no version {version}")


def _defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for name, sub in (schema.get("properties") or {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = _defaults(sub, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_defaults(schema["items"], v) for v in value]
    return value


def _undeclared(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub_value in value.items():
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                out += _undeclared(props[key], sub_value, where)
            elif isinstance(extra, dict):
                out += _undeclared(extra, sub_value, where)
            elif props is not None or extra is False:
                out.append(f"{where}: field not declared by the schema (the API server would drop it)")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _undeclared(schema["items"], item, f"{path}[{i}]")
    return out


def _cel(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    out: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or ():
        program = _CEL.program(_CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, Exception) or not bool(result):
            out.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                out += _cel(sub, value[key], f"{path}.{key}" if path else key)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += _cel(schema["items"], item, f"{path}[{i}]")
    return out


def validate(obj: dict[str, Any]) -> list[str]:
    """Problems the upstream API server would report (or silently prune) for ``obj``."""
    schema = schema_for(obj["apiVersion"], obj["kind"])
    defaulted = _defaults(schema, copy.deepcopy(obj))
    problems = [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in jsonschema.Draft4Validator(schema).iter_errors(defaulted)
    ]
    problems += _undeclared(schema, {k: v for k, v in defaulted.items() if k != "metadata"}, "")
    if not problems:
        problems += _cel(schema, defaulted, "")
    return sorted(problems)
