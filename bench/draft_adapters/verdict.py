"""Issue 25's targets, per task adapter, from the measured runs.

- Recovery: adapted requests lose accept length against base requests with the shared
  draft (``lost = base - shared``, accepted drafts a step); the draft adapter must win back
  at least half of it (``(adapted - shared) / lost >= 0.5``). Accept lengths are the mean
  over the concurrency levels measured (each level's own runs; acceptance does not depend on
  the batch, so the levels are more samples of it).
- Concurrency 1: the speedup with the draft adapter at least 10% above the speedup with the
  shared draft (both against the same plain run).
- The highest concurrency (32 on the GPU): no loss, the draft adapter's tokens/s at least
  the shared draft's, within ``tolerance`` (run-to-run noise of timed runs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .measure import BASE, KindResult

RECOVERY_TARGET = 0.5
C1_GAIN_TARGET = 0.10


@dataclass
class AdapterVerdict:
    """One task adapter against the targets (None: not measured, or nothing to recover)."""

    name: str
    base_accept: float | None  # base requests, shared draft
    shared_accept: float | None  # this adapter's requests, shared draft
    adapted_accept: float | None  # this adapter's requests, its draft adapter
    recovered: float | None  # share of the lost accept length won back
    c1: int | None  # the lowest concurrency measured
    c1_speedups: tuple[float, float] | None  # (shared, adapted)
    top: int | None  # the highest concurrency measured
    top_ratio: float | None  # adapted tokens/s over shared tokens/s at ``top``
    tolerance: float

    @property
    def lost(self) -> float | None:
        if self.base_accept is None or self.shared_accept is None:
            return None
        return self.base_accept - self.shared_accept

    @property
    def c1_gain(self) -> float | None:
        return None if self.c1_speedups is None else self.c1_speedups[1] / self.c1_speedups[0] - 1

    def met(self) -> dict[str, bool | None]:
        """Each target: met, missed, or None (not measured / no loss to recover)."""
        gain = self.c1_gain
        return {
            "recovery": None if self.recovered is None else self.recovered >= RECOVERY_TARGET,
            "c1_gain": None if gain is None else gain >= C1_GAIN_TARGET,
            "no_loss_top": None if self.top_ratio is None else self.top_ratio >= 1 - self.tolerance,
        }


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def verdicts(results: list[KindResult], adapters: list[str], tolerance: float) -> list[AdapterVerdict]:
    """One verdict per task adapter in ``adapters``."""
    levels = sorted({r.concurrency for r in results})
    by = {(r.concurrency, r.kind): r for r in results}
    base = _mean([by[c, BASE].accept("shared") for c in levels if (c, BASE) in by])
    out = []
    for name in adapters:
        mine = [by[c, name] for c in levels if (c, name) in by]
        shared = _mean([r.accept("shared") for r in mine])
        adapted = _mean([r.accept("adapted") for r in mine])
        recovered = None
        if base is not None and shared is not None and adapted is not None and base - shared > 0.02:
            recovered = (adapted - shared) / (base - shared)
        low = mine[0] if mine else None
        speedups = None
        if low is not None and low.speedup("shared") and low.speedup("adapted"):
            speedups = (low.speedup("shared"), low.speedup("adapted"))
        high = mine[-1] if len(mine) > 1 else None
        ratio = None
        if high is not None and "shared" in high.runs and "adapted" in high.runs:
            ratio = high.runs["adapted"].tokens_per_s / high.runs["shared"].tokens_per_s
        verdict = AdapterVerdict(
            name, base, shared, adapted, recovered, low.concurrency if low else None, speedups,
            high.concurrency if high else None, ratio, tolerance,
        )  # fmt: skip
        out.append(verdict)
    return out
