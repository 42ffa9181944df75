"""The OpenAPI v3 structural schema of a spec model, as a CRD's ``openAPIV3Schema`` holds it.

Walks the pydantic models of ``loraserve.operator.specs`` field by field (never pydantic's
JSON schema, which has ``$ref`` and ``anyOf``-null): an optional field is its type (absent,
never null), a nested model an object with its properties, ``dict[str, Any]`` an object
kept as written, ``int | str`` an int-or-string. Names are the fields' camelCase aliases,
descriptions their docstrings, and CEL rules the :class:`~loraserve.operator.specs.Cel`
metadata of a field's type and the ``cel_rules`` of a model.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from loraserve.operator.specs import Cel
from loraserve.runtime.contract.policy.cel import CelRule

_SCALARS: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
_BOUNDS = (
    ("ge", "minimum"),
    ("gt", "minimum"),
    ("le", "maximum"),
    ("pattern", "pattern"),
)
# The order of a node's keys in the YAML: what it is, its bounds, its default and words, its parts.
_KEY_ORDER = (
    "type",
    "format",
    "enum",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "default",
    "description",
    "required",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
    "anyOf",
    "properties",
    "additionalProperties",
    "items",
)


@dataclass
class _Facts:
    """What the metadata of one type says beside the type itself."""

    bounds: dict[str, Any] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    description: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    rules: list[CelRule] = field(default_factory=list)

    def add(self, item: Any) -> None:
        if isinstance(item, FieldInfo):
            for inner in item.metadata:
                self.add(inner)
            # The outermost description wins: a field's docstring over its type's words.
            self.description = self.description or item.description
            if isinstance(item.json_schema_extra, dict):
                self.extra.update(item.json_schema_extra)
            return
        if isinstance(item, Cel):
            self.rules.extend(item.rules)
            return
        for attr, key in _BOUNDS:
            value = getattr(item, attr, None)
            if value is not None:
                self.bounds[key] = value
                if attr == "gt":
                    self.bounds["exclusiveMinimum"] = True
        for attr in ("min_length", "max_length"):
            value = getattr(item, attr, None)
            if value is not None:
                self.lengths[attr] = value


def _unwrap(annotation: Any, facts: _Facts) -> Any:
    """The type under ``Optional`` and ``Annotated``, its metadata added to ``facts``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            base, *metadata = typing.get_args(annotation)
            for item in metadata:
                facts.add(item)
            annotation = base
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation  # a real union: int | str
            annotation = args[0]
        else:
            return annotation


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    unknown = set(node) - set(_KEY_ORDER)
    assert not unknown, f"no place in the key order for {sorted(unknown)}"
    return {key: node[key] for key in _KEY_ORDER if key in node}


def _default(info: FieldInfo) -> Any:
    """The field's default on the wire, or PydanticUndefined when the CRD states none."""
    if info.default_factory is not None:
        made = info.default_factory()  # type: ignore[call-arg]
        return {} if isinstance(made, BaseModel) else PydanticUndefined  # empty lists stay absent
    if info.default in (PydanticUndefined, None):
        return PydanticUndefined
    value = info.default
    if isinstance(value, enum.Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def type_schema(annotation: Any, facts: _Facts | None = None) -> dict[str, Any]:
    """The schema node of ``annotation`` with what ``facts`` (and its own metadata) add."""
    facts = facts or _Facts()
    base = _unwrap(annotation, facts)
    node = _base_schema(base)
    node.update(facts.bounds)
    lengths = ("minItems", "maxItems") if node.get("type") == "array" else ("minLength", "maxLength")
    for attr, key in zip(("min_length", "max_length"), lengths, strict=True):
        if attr in facts.lengths:
            node[key] = facts.lengths[attr]
    node.update(facts.extra)
    if facts.description:
        node["description"] = " ".join(facts.description.split())
    if facts.rules:
        node["x-kubernetes-validations"] = [rule.to_schema() for rule in facts.rules]
    return _ordered(node)


def _base_schema(base: Any) -> dict[str, Any]:
    origin, args = typing.get_origin(base), typing.get_args(base)
    if isinstance(base, type) and issubclass(base, BaseModel):
        return object_schema(base)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return {"type": "string", "enum": [member.value for member in base]}
    if base in _SCALARS:
        return {"type": _SCALARS[base]}
    if origin is typing.Literal:
        return {"type": "string", "enum": list(args)}
    if origin is list:
        return {"type": "array", "items": type_schema(args[0])}
    if origin is dict:
        if args[1] is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": type_schema(args[1])}
    if origin in (typing.Union, types.UnionType) and set(args) == {int, str}:
        return {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    raise TypeError(f"no CRD schema for {base!r}")


def field_schema(info: FieldInfo) -> dict[str, Any]:
    """The schema node of one model field."""
    facts = _Facts()
    facts.add(info)
    node = type_schema(info.annotation, facts)
    default = _default(info)
    if default is not PydanticUndefined:
        node["default"] = default
    return _ordered(node)


def object_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The schema node of a spec model: its fields as properties, its ``cel_rules``."""
    properties = {}
    required = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        properties[key] = field_schema(info)
        if info.is_required():
            required.append(key)
    node: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        node["required"] = required
    rules = getattr(model, "cel_rules", ())
    if rules:
        node["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]
    return _ordered(node)
