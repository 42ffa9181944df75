"""What a policy check finds: violations, warnings, the report that holds them, its error.

Each finding names a configuration field path (``lora.max_rank``); texts refer to other
fields as ``{lora.max_rank}``. ``render(namer)`` passes every path through the caller's
namer (the webhook's ``spec.lora.maxRank``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass

from ..config import RuntimeConfig, SpecAlgorithm

_FIELD_REF = re.compile(r"\{([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)\}")


class Kind(enum.StrEnum):
    INCOMPATIBLE = "incompatible"
    UNAVAILABLE = "unavailable"


Namer = Callable[[str], str]


def _same(path: str) -> str:
    return path


def _fill(text: str, name: Namer) -> str:
    return _FIELD_REF.sub(lambda m: name(m.group(1)), text)


@dataclass(frozen=True)
class Violation:
    """A configuration the runtime refuses. ``field`` is the one to change; ``related``
    the other fields of the combination."""

    rule: str
    field: str
    reason: str
    fix: str
    kind: Kind = Kind.INCOMPATIBLE
    related: tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.field, *self.related)

    def render(self, name: Namer = _same) -> str:
        """``<field>: <reason>; fix: <fix>`` with every field path passed through ``name``."""
        prefix = "not available in this runtime: " if self.kind is Kind.UNAVAILABLE else ""
        return f"{name(self.field)}: {prefix}{_fill(self.reason, name)}; fix: {_fill(self.fix, name)}"

    def __str__(self) -> str:
        return self.render()


@dataclass(frozen=True)
class PolicyWarning:
    """A legal configuration with a cost worth knowing."""

    rule: str
    field: str
    reason: str

    def render(self, name: Namer = _same) -> str:
        return f"{name(self.field)}: {_fill(self.reason, name)}"

    def __str__(self) -> str:
        return self.render()


@dataclass(frozen=True)
class Report:
    """Every violation and warning of one check, and the configuration that would run."""

    violations: tuple[Violation, ...]
    warnings: tuple[PolicyWarning, ...]
    effective: RuntimeConfig | None = None
    """The configuration after resolution (NEXTN as EAGLE...); None for adapter checks."""
    resolution: str | None = None
    """How the requested algorithm resolved, when it did (e.g. ``NEXTN resolves to EAGLE``)."""
    requested: SpecAlgorithm | None = None
    """The algorithm as configured, before resolution; None for adapter checks."""

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def incompatible(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.kind is Kind.INCOMPATIBLE)

    @property
    def unavailable(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.kind is Kind.UNAVAILABLE)

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def warning_rules(self) -> set[str]:
        return {w.rule for w in self.warnings}

    def raise_for_violations(self) -> None:
        """Raise :class:`PolicyError` listing every violation, if there is any."""
        if self.violations:
            raise PolicyError(self)


class PolicyError(ValueError):
    """A configuration the policy refuses; the message lists every violation."""

    def __init__(self, report: Report) -> None:
        self.report = report
        super().__init__("; ".join(v.render() for v in report.violations))
