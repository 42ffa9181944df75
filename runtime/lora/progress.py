"""What an adapter load is doing now: shown in a 503 to waiting clients and in the catalog
listing, so an operator sees which source a slow load waits on and for how long."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LoadProgress:
    """Updated by the source resolver and the loader while one load runs (one event loop)."""

    phase: str = "queued"
    """``queued`` | ``connecting`` | ``downloading`` | ``waiting`` (on another process's download
    of the same source into a shared cache) | ``verifying`` | ``reading`` | ``loading``."""
    target: str = ""
    """What the phase waits on, safe to show a caller without the token (no credentials,
    no server path): a public URL, or the adapter's name."""
    received_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)

    def enter(self, phase: str, target: str | None = None) -> None:
        """Start ``phase`` (waiting on ``target`` when given)."""
        self.phase = phase
        if target is not None:
            self.target = target
        self.last_activity = time.monotonic()

    def received(self, count: int) -> None:
        """``count`` more bytes arrived."""
        self.received_bytes += count
        self.last_activity = time.monotonic()

    def describe(self, now: float | None = None) -> str:
        """One line: the phase, its target, bytes so far, time since the load began and since
        the last sign of life."""
        now = time.monotonic() if now is None else now
        parts = [self.phase]
        if self.target:
            parts.append(self.target)
        if self.received_bytes:
            parts.append(f"{self.received_bytes} bytes received")
        idle = now - self.last_activity
        text = f"{' '.join(parts[:2])}{': ' + parts[2] if len(parts) > 2 else ''}"
        text += f", {now - self.started:.1f} s since the load began"
        if idle >= 1.0:
            text += f", no progress for {idle:.1f} s"
        return text
