"""CEL rules of the CRDs, each declared once beside the Python check it restates.

The API server evaluates a CRD's ``x-kubernetes-validations`` without the operator's
webhook, so a rule that must hold while the webhook is down is written in CEL as well.
A :class:`CelRule` is that CEL text with its message, declared either on an operator spec
model (its ``cel_rules``, or a field's type) with the Python ``check`` the model runs, or
beside a policy rule here, naming the policy rule it ``mirrors`` (the webhook runs that
one). ``loraserve.operator.crd`` writes them into the CRDs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry and the Python rule it restates."""

    rule: str
    """The CEL expression over ``self`` (the object or value it is attached to), true when valid;
    ``oldSelf`` makes it a transition rule (checked on updates only)."""
    message: str
    """What the API server answers when ``rule`` is false."""
    field_path: str | None = None
    """The field to blame, relative to ``self`` (``.minReplicas``)."""
    reason: str | None = None
    """The API server's reason (``FieldValueRequired``); unset: ``FieldValueInvalid``."""
    check: Callable[[Any], str | None] | None = None
    """The same rule in Python over what ``self`` is (a spec model or a value): the problem, in
    the webhook's words with the fix, or None."""
    mirrors: str | None = None
    """The policy rule (``Violation.rule``) that judges the same condition on the runtime
    configuration, for a rule without ``check``."""

    def to_schema(self) -> dict[str, str]:
        """The ``x-kubernetes-validations`` entry."""
        entry = {"rule": self.rule, "message": self.message}
        if self.field_path:
            entry["fieldPath"] = self.field_path
        if self.reason:
            entry["reason"] = self.reason
        return entry


def cel_list(values: Iterable[Any]) -> str:
    """``values`` as a CEL list literal of strings: ``['A', 'B']``."""
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


def words(values: Iterable[Any]) -> str:
    """``values`` as prose: ``A, B and C``."""
    names = [str(value) for value in values]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
