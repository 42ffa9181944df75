"""CRD checks without an API server: defaulting, schema validation and CEL rules.

``tests/cluster`` applies the CRDs to a real kube-apiserver (minutes); this harness does
what the API server does with a custom resource in milliseconds, in the same order: apply the schema's defaults
(including nested defaults under a defaulted ``{}``), validate against the
openAPIV3Schema (jsonschema, Draft 4 semantics as Kubernetes uses), then evaluate every
``x-kubernetes-validations`` CEL rule with ``cel-python`` on the defaulted object
(transition rules only when an old object is given). Messages follow the API server's
wording for the parts the examples' annotations quote.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "crds"
EXAMPLES = ROOT / "examples"
CRD_FILES = {
    "LoRAServe": CRD_DIR / "loraserve.io_loraserves.yaml",
    "Adapter": CRD_DIR / "loraserve.io_adapters.yaml",
}

_CEL = celpy.Environment()


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@functools.cache
def _crd(kind: str) -> dict[str, Any]:
    return load_yaml(CRD_FILES[kind])


def load_crd(kind: str) -> dict[str, Any]:
    """A fresh copy of the CRD manifest (callers may change it)."""
    return copy.deepcopy(_crd(kind))


def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return version["schema"]["openAPIV3Schema"]


# --------------------------------------------------------------------------- defaulting


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """The object with the schema's defaults filled in, as the API server does on decode."""
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for name, sub in (schema.get("properties") or {}).items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = apply_defaults(sub, out[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            known = set(schema.get("properties") or {})
            for name in out:
                if name not in known:
                    out[name] = apply_defaults(extra, out[name])
        return out
    if isinstance(value, list) and schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in value]
    return value


# --------------------------------------------------------------------------- schema


def _path(parts) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _k8s_message(error: jsonschema.ValidationError) -> str:
    path = _path(error.absolute_path)
    value = json.dumps(error.instance)
    kind = error.validator
    if kind == "required":
        missing = re.search(r"'([^']+)' is a required property", error.message)
        name = missing.group(1) if missing else "?"
        return f"{path + '.' if path else ''}{name}: Required value"
    if kind == "enum":
        allowed = ", ".join(json.dumps(v) for v in error.validator_value)
        return f"{path}: Unsupported value: {value}: supported values: {allowed}"
    if kind == "minimum":
        return f"{path}: Invalid value: {value}: {path} in body should be greater than or equal to {error.validator_value}"
    if kind == "maximum":
        return f"{path}: Invalid value: {value}: {path} in body should be less than or equal to {error.validator_value}"
    if kind == "exclusiveMinimum":
        return f"{path}: Invalid value: {value}: {path} in body should be greater than {error.schema.get('minimum')}"
    if kind == "type":
        return f"{path}: Invalid value: {value}: must be of type {error.validator_value}"
    if kind == "pattern":
        return f"{path}: Invalid value: {value}: {path} in body should match '{error.validator_value}'"
    if kind == "maxLength":
        return f"{path}: Too long: may not be more than {error.validator_value} bytes"
    if kind == "minLength":
        return f"{path}: Invalid value: {value}: {path} in body should be at least {error.validator_value} chars long"
    if kind == "maxItems":
        return f"{path}: Too many: must have at most {error.validator_value} items"
    if kind == "minItems":
        return f"{path}: Invalid value: {value}: should have at least {error.validator_value} items"
    return f"{path}: {error.message}"


def schema_errors(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(schema)
    return sorted(_k8s_message(e) for e in validator.iter_errors(obj))


# --------------------------------------------------------------------------- CEL


@functools.cache
def compile_rule(rule: str):
    return _CEL.program(_CEL.compile(rule))


def _has_old_self(rule: str) -> bool:
    return re.search(r"\boldSelf\b", rule) is not None


def cel_errors(schema: dict[str, Any], obj: Any, old: Any = None, path: str = "") -> list[str]:
    """Evaluate every CEL rule on ``obj`` (defaulted); messages ``<path>: Invalid value: <message>``."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or ():
        if _has_old_self(rule["rule"]) and old is None:
            continue  # transition rules run on updates only
        activation = {"self": celpy.json_to_cel(obj)}
        if old is not None:
            activation["oldSelf"] = celpy.json_to_cel(old)
        try:
            result = compile_rule(rule["rule"]).evaluate(activation)
        except Exception as error:  # a rule that cannot evaluate is a CRD bug: surface it
            errors.append(f"{path}: rule {rule['rule']!r} failed to evaluate: {error}")
            continue
        if isinstance(result, Exception) or not bool(result):
            where = path + rule.get("fieldPath", "")
            errors.append(f"{where}: Invalid value: {rule.get('message', rule['rule'])}")
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        extra = (
            schema.get("additionalProperties")
            if isinstance(schema.get("additionalProperties"), dict)
            else None
        )
        for name, value in obj.items():
            sub = props.get(name, extra)
            if sub is None:
                continue
            old_value = old.get(name) if isinstance(old, dict) else None
            errors += cel_errors(sub, value, old_value, f"{path}.{name}" if path else name)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, value in enumerate(obj):
            errors += cel_errors(schema["items"], value, None, f"{path}[{i}]")
    return errors


@dataclass
class Admission:
    """What the API server's CRD handling says about one object."""

    object: dict[str, Any]
    schema: list[str] = field(default_factory=list)
    cel: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.schema and not self.cel

    def all(self) -> list[str]:
        return self.schema + self.cel


def admit(obj: dict[str, Any], old: dict[str, Any] | None = None) -> Admission:
    """Default, schema-validate and CEL-check ``obj`` (and ``old`` for transition rules)."""
    schema = crd_schema(_crd(obj["kind"]))  # read-only here
    defaulted = apply_defaults(schema, copy.deepcopy(obj))
    result = Admission(defaulted, schema_errors(schema, defaulted))
    old_defaulted = apply_defaults(schema, copy.deepcopy(old)) if old is not None else None
    if not result.schema:
        result.cel = cel_errors(schema, defaulted, old_defaulted)
    return result


# --------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class Expectation:
    path: Path
    rejected_by: str  # schema | cel | webhook
    message: str


def expectation(path: Path) -> Expectation:
    """The ``# expect-rejected-by:`` / ``# expect-message:`` annotations of a negative example."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^#\s*expect-(rejected-by|message):\s*(.+)$", line)
        if match:
            found[match.group(1)] = str(yaml.safe_load(match.group(2)))
    assert set(found) == {"rejected-by", "message"}, f"{path.name} lacks its expect-* annotations"
    assert found["rejected-by"] in ("schema", "cel", "webhook"), path.name
    return Expectation(path, found["rejected-by"], found["message"])


def valid_examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def invalid_examples() -> list[Path]:
    return sorted((EXAMPLES / "invalid").glob("*.yaml"))


@pytest.fixture(scope="session")
def example_objects() -> list[dict[str, Any]]:
    return [load_yaml(path) for path in valid_examples()]


# --------------------------------------------------------------------------- lookup


def schema_at(schema: dict[str, Any], dotted: str) -> dict[str, Any] | None:
    """The schema node of a ``.spec.x.y`` path, or None."""
    node: dict[str, Any] | None = schema
    for part in dotted.strip(".").split("."):
        if node is None:
            return None
        node = (node.get("properties") or {}).get(part)
    return node


@pytest.fixture(scope="session")
def kit():
    """The harness's functions, for test modules (conftest is not importable under importlib mode)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        admit=admit,
        apply_defaults=apply_defaults,
        cel_errors=cel_errors,
        crd_schema=crd_schema,
        expectation=expectation,
        load_crd=load_crd,
        load_yaml=load_yaml,
        schema_at=schema_at,
        schema_errors=schema_errors,
        compile_rule=compile_rule,
    )
