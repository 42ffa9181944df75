"""The shape of each decode step, measured per batch size on the serve's own steps.

A step can verify a tree of drafts, a chain of drafts, or draft nothing (plain decoding).
Which delivers the most tokens per second depends on the batch size (a verify of ``bs × k``
rows costs little more than a decode of ``bs`` rows at small batches, and stops doing so as
the batch grows; a tree's wider verify pays at ``bs`` 1 and not at 32), on the model, the
draft, the adapters' accept rates and the GPU. So instead of fixed thresholds
(``speculative.disable_batch_size``, ``speculative.tree_max_batch_size``) the switch keeps,
per power-of-two batch-size bucket, a moving average of the tokens per second each shape
delivered, and runs the best. Each bucket measures every shape it may use once (in the order
given: the configured one first), then keeps re-measuring the others in turn every
``explore_every`` steps, so a change in acceptance (another adapter mix) or in load is
noticed. The first step after a change of shape is not measured: it carries the switch's own
costs (a STANDALONE draft catching up, a CUDA-graph capture). Every shape is lossless, so the
choice changes speed only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field


class StepShape(enum.StrEnum):
    """What one decode step verifies."""

    TREE = "tree"
    CHAIN = "chain"
    PLAIN = "plain"


def batch_bucket(batch_size: int) -> int:
    """The power of two at or above ``batch_size`` (1, 2, 4, 8, ...)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return 1 << (batch_size - 1).bit_length()


@dataclass
class _Rate:
    tokens_per_s: float | None = None  # None until measured
    samples: int = 0

    def add(self, value: float, alpha: float) -> None:
        self.samples += 1
        self.tokens_per_s = value if self.tokens_per_s is None else (1 - alpha) * self.tokens_per_s + alpha * value


@dataclass
class _Bucket:
    rates: dict[StepShape, _Rate] = field(default_factory=dict)
    steps: int = 0
    explored: int = 0  # explorations so far: which other shape is next
    last: StepShape | None = None  # the shape of the last recorded step

    def rate(self, shape: StepShape) -> float | None:
        r = self.rates.get(shape)
        return None if r is None else r.tokens_per_s


class SpeculationSwitch:
    """Chooses, per decode step, the shape with the best measured throughput.

    ``explore_every``: every this many steps of a bucket, run one of the shapes not in use
    for two steps, to refresh its measurement. ``alpha``: weight of a new measurement in the
    moving average.
    """

    EXPLORE_STEPS = 2

    def __init__(self, *, explore_every: int = 50, alpha: float = 0.2):
        if explore_every <= self.EXPLORE_STEPS:
            raise ValueError(f"explore_every must be > {self.EXPLORE_STEPS}, got {explore_every}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.explore_every = explore_every
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}

    def reset(self) -> None:
        """Forget every measurement (steps that were not serving, e.g. a warm-up's graph
        captures, would bias the verdicts)."""
        self._buckets.clear()

    def choose(self, batch_size: int, shapes: Sequence[StepShape]) -> StepShape:
        """The shape of the next step of ``batch_size`` requests, among the ``shapes`` this
        batch may use (most preferred first)."""
        if not shapes:
            raise ValueError("choose needs at least one shape")
        b = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        unmeasured = [s for s in shapes if b.rate(s) is None]
        if unmeasured:
            return unmeasured[0]
        b.steps += 1
        best = self._best(b, shapes)
        others = [s for s in shapes if s is not best]
        if others and b.steps % self.explore_every < self.EXPLORE_STEPS:
            if b.steps % self.explore_every == 0:
                b.explored += 1
            return others[b.explored % len(others)]  # re-measure another shape
        return best

    def record(self, batch_size: int, shape: StepShape, *, tokens: int, seconds: float) -> None:
        """A finished step of ``shape``: ``tokens`` emitted for ``batch_size`` requests in ``seconds``."""
        b = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        changed, b.last = b.last is not shape, shape
        if changed or seconds <= 0:
            return
        b.rates.setdefault(shape, _Rate()).add(tokens / seconds, self.alpha)

    def verdict(self, batch_size: int, shapes: Sequence[StepShape]) -> StepShape | None:
        """The current choice for ``batch_size`` among ``shapes`` (None until each is measured)."""
        b = self._buckets.get(batch_bucket(batch_size))
        if b is None or any(b.rate(s) is None for s in shapes):
            return None
        return self._best(b, shapes)

    def rates(self, batch_size: int) -> dict[StepShape, float]:
        """The measured tokens per second of each shape at ``batch_size``'s bucket."""
        b = self._buckets.get(batch_bucket(batch_size))
        if b is None:
            return {}
        return {s: r.tokens_per_s for s, r in b.rates.items() if r.tokens_per_s is not None}

    @staticmethod
    def _best(b: _Bucket, shapes: Sequence[StepShape]) -> StepShape:
        # Ties go to the earlier (preferred) shape.
        return max(shapes, key=lambda s: (b.rate(s) or 0.0, -shapes.index(s)))
