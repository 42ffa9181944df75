"""The generic field rules every concern shares: a number within its bound, a value from a
list, a list of LoRA modules."""

from __future__ import annotations

import enum
from collections.abc import Iterable

from ..config import LORA_MODULES
from .bounds import MAXIMUM, MINIMUM
from .findings import Violation


def at_least(path: str, value: int | float | None, rule: str) -> Iterable[Violation]:
    """A violation when ``value`` is below the field's :data:`MINIMUM`."""
    minimum = MINIMUM[path]
    if value is not None and value < minimum:
        yield Violation(
            rule, path, f"must be at least {minimum}, got {value}", f"set {{{path}}} to {minimum} or more"
        )


def at_most(path: str, value: int | None, rule: str, why: str) -> Iterable[Violation]:
    """A violation when ``value`` is above the field's :data:`MAXIMUM`, saying ``why``."""
    maximum = MAXIMUM[path]
    if value is not None and value > maximum:
        yield Violation(
            rule,
            path,
            f"must be at most {maximum}, got {value} ({why})",
            f"set {{{path}}} to {maximum} or less",
        )


def one_of(path: str, value: object, allowed: tuple[str, ...], rule: str) -> Iterable[Violation]:
    """A violation when ``value`` (or an enum's value) is not one of ``allowed``."""
    plain = value.value if isinstance(value, enum.Enum) else value
    if plain not in allowed:
        yield Violation(rule, path, f"unknown value {plain!r}", f"use one of {', '.join(allowed)}")


def module_list(
    path: str, modules: Iterable[str], rule: str, *, known: tuple[str, ...] = LORA_MODULES
) -> list[Violation]:
    """Violations of a target module list: empty, naming an unknown module, or repeating one."""
    modules = tuple(modules)
    out: list[Violation] = []
    if not modules:
        out.append(Violation(rule, path, "no target modules", f"list at least one of {', '.join(known)}"))
    unknown = sorted(set(modules) - set(known))
    if unknown:
        out.append(
            Violation(
                rule,
                path,
                f"unknown modules {', '.join(unknown)}",
                f"use modules from {', '.join(known)}",
            )
        )
    if len(set(modules)) != len(modules):
        out.append(Violation(rule, path, "a module is listed twice", "list each module once"))
    return out
