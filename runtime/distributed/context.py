"""The tensor-parallel context of this process, set once by the launcher (or a worker)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..executor.driver import Driver
    from .group import TPGroup
    from .health import TPHealth


@dataclass
class TPContext:
    """The group this process's target model is sharded over, and how it is driven.

    ``driver`` exists on rank 0 only: it describes every step to the other ranks.
    """

    group: TPGroup
    health: TPHealth
    driver: Driver | None = None


_CURRENT: TPContext | None = None


def set_current(context: TPContext | None) -> None:
    global _CURRENT
    _CURRENT = context


def current() -> TPContext | None:
    """The context the launcher set, or None (a single-process runtime)."""
    return _CURRENT
