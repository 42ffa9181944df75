"""Cheap checks on a constraint before it is compiled, and the number bound a JSON schema gets.

Each limit is stated once here; the size and time bounds are the server's settings
(``--structured-max-bytes``, ``--structured-compile-timeout``), passed in by the caller.
"""

from __future__ import annotations

import re
from typing import Any

from .params import SamplingParamsError, StructuredOutput

FIELD = "response_format"
"""The field a constraint error names; the API layer renames it to the field the client sent."""

MAX_ENUM_VALUES = 1000
"""Enum values across one JSON schema, and choices of ``guided_choice`` (OpenAI's bound on
enum values in a structured-output schema)."""
MAX_REPEAT = 10_000
"""The largest count in a regex or grammar repetition ``{m}`` / ``{m,n}``, and in a schema's
minLength / maxLength / minItems / maxItems / minProperties / maxProperties."""
MAX_SCHEMA_DEPTH = 64
"""Nesting of objects and arrays in a JSON schema's text (OpenAI allows 10 levels of
nested schemas; each takes two or three here)."""
NUMBER_DIGITS = 15
"""Digits before the point of a JSON schema integer or number that has no bound of its own
(15: every such value is exact in a double and in JavaScript)."""

_KIND_NAMES = {
    "json_object": "JSON object",
    "json_schema": "JSON schema",
    "regex": "regex",
    "grammar": "grammar",
}
_REPEAT_RE = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
"""Keywords whose value maps names to schemas."""
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required"})
"""Keywords whose value is data, never a schema."""


def kind_name(spec: StructuredOutput) -> str:
    """How a message names the constraint: "JSON schema", "regex", "grammar"."""
    return _KIND_NAMES.get(spec.kind, spec.kind)


def check_spec(spec: StructuredOutput, max_bytes: int) -> None:
    """Refuse a constraint that is too large to compile in bounded time, before compiling:
    over ``max_bytes``, more than :data:`MAX_ENUM_VALUES` enum values, or a repetition count
    over :data:`MAX_REPEAT`. Raises :class:`SamplingParamsError` naming :data:`FIELD`."""
    size = len(spec.spec.encode("utf-8"))
    if size > max_bytes:
        raise SamplingParamsError(
            FIELD,
            f"the {kind_name(spec)} is {size} bytes, over this server's limit of {max_bytes} bytes: shorten it, "
            "or start the server with a larger --structured-max-bytes",
        )
    if spec.kind in ("regex", "grammar"):
        _check_repeats(spec.spec, f"the {kind_name(spec)}")


def _check_repeats(text: str, what: str) -> None:
    for match in _REPEAT_RE.finditer(text):
        counts = [int(c) for c in match.groups() if c]
        if counts and max(counts) > MAX_REPEAT:
            raise SamplingParamsError(
                FIELD,
                f"{what} repeats {match.group()} times; at most {MAX_REPEAT} per repetition: use a smaller count",
            )


def check_schema(schema: Any) -> None:
    """A JSON schema's nesting, enum values (all together) and counts (each) within their
    bounds."""
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise SamplingParamsError(
            FIELD,
            f"the JSON schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep: flatten it, "
            "or use $defs for repeated parts",
        )
    enums = 0
    for node in _schemas(schema):
        values = node.get("enum")
        if isinstance(values, list):
            enums += len(values)
            if enums > MAX_ENUM_VALUES:
                raise SamplingParamsError(
                    FIELD,
                    f"the JSON schema has more than {MAX_ENUM_VALUES} enum values: use fewer, or a string "
                    "with a pattern",
                )
        for key in _COUNT_KEYWORDS:
            count = node.get(key)
            if isinstance(count, int | float) and not isinstance(count, bool) and count > MAX_REPEAT:
                raise SamplingParamsError(
                    FIELD, f"the JSON schema's {key} is {count:g}; at most {MAX_REPEAT}: use a smaller one"
                )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            _check_repeats(pattern, "the JSON schema's pattern")


def _depth(value: Any) -> int:
    """How deep objects and arrays nest in ``value`` (iteratively: any depth is measured)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _schemas(schema: Any):
    """Every schema object within ``schema`` (itself included), depth first."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend(value.values())
            elif key not in _NOT_SCHEMAS:
                stack.append(value)


def bound_numbers(schema: Any) -> Any:
    """A copy of ``schema`` in which every integer or number missing a lower or upper bound
    gets one of :data:`NUMBER_DIGITS` digits (more if the other bound has more), so a model
    cannot emit digits until ``max_tokens``. xgrammar writes a bounded number with at most
    6 digits after the point and no exponent."""
    if isinstance(schema, list):
        return [bound_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: bound_numbers(s) for name, s in value.items()}
        elif key in _NOT_SCHEMAS:
            out[key] = value
        else:
            out[key] = bound_numbers(value)
    types = out.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "integer" in types or "number" in types:
        low = _bound(out, "minimum", "exclusiveMinimum")
        high = _bound(out, "maximum", "exclusiveMaximum")
        if low is None:
            out["minimum"] = -_nines(high)
        if high is None:
            out["maximum"] = _nines(low)
    return out


def _bound(schema: dict, inclusive: str, exclusive: str) -> float | None:
    for key in (inclusive, exclusive):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
    return None


def _nines(other: float | None) -> int:
    """The all-nines integer of NUMBER_DIGITS digits, or of as many as ``other`` has."""
    digits = len(str(int(abs(other)))) if other is not None else 0
    return 10 ** max(NUMBER_DIGITS, digits) - 1
