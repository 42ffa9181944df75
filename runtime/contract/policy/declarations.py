"""What an adapter declares before (or after) its file is read: its rank, its target
modules, whether it is pinned, and its draft adapter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftAdapterDeclaration:
    """An adapter's draft adapter (a LoRA for the serve's draft), as far as it is known."""

    rank: int | None = None
    target_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AdapterDeclaration:
    """What is known of an adapter before (or after) its file is read."""

    name: str
    rank: int | None = None
    target_modules: tuple[str, ...] | None = None
    pinned: bool = False
    draft: DraftAdapterDeclaration | None = None
    """Its draft adapter, when it names one (None: requests draft unadapted)."""
