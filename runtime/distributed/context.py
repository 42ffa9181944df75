"""The tensor-parallel context of this process, set once by the launcher (or a worker)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .group import TPGroup
    from .health import TPHealth
    from .protocol import Kind


class RankDriver(Protocol):
    """What rank 0's runner asks of the driver that describes its steps to the other ranks.

    The executor's ``Driver`` is the one implementation; the runner sees only this, so the
    layers below the executor never import it.
    """

    def kv_cache(self, **kwargs: Any) -> Any:
        """A KV cache whose changes the other ranks replay."""

    def attach_lora(self, manager: Any) -> None:
        """Journal every change of this rank's adapter slots."""

    def start_heartbeats(self) -> None:
        """Start telling idle ranks that rank 0 is alive."""

    def forward_scope(self) -> AbstractContextManager[None]:
        """Mark a forward in flight."""

    def publish(self, batch: Any, slots: Sequence[int], alloc: Any, *, free_tokens: int) -> None:
        """Describe one forward to every other rank."""

    def command(self, kind: Kind) -> None:
        """Send a step without a batch (``Kind.GATHER_VOCAB``)."""

    def check(self) -> None:
        """Raise if the group has failed."""

    def fail(self, reason: str) -> Exception:
        """Fail the group; the error to raise."""


@dataclass
class TPContext:
    """The group this process's target model is sharded over, and how it is driven.

    ``driver`` exists on rank 0 only: it describes every step to the other ranks.
    """

    group: TPGroup
    health: TPHealth
    driver: RankDriver | None = None


_CURRENT: TPContext | None = None


def set_current(context: TPContext | None) -> None:
    global _CURRENT
    _CURRENT = context


def current() -> TPContext | None:
    """The context the launcher set, or None (a single-process runtime)."""
    return _CURRENT
