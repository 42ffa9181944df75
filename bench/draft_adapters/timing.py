"""Wall time per phase of a run, logged as each ends and kept for the report, so the time
budgets of a one-call GPU run can be tuned from the last run's numbers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..harness import log


class PhaseClock:
    """Seconds per named phase since ``started`` (``time.monotonic()``)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the ``with`` block as phase ``name`` (repeated names add up)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - t0
            self.phases[name] = self.phases.get(name, 0.0) + seconds
            log(f"phase {name}: {seconds:.1f} s (total {self.elapsed():.0f} s)")

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.monotonic() - self.started

    def record(self) -> dict[str, float]:
        """Seconds per phase, rounded, with the total."""
        return {**{k: round(v, 1) for k, v in self.phases.items()}, "total": round(self.elapsed(), 1)}
