"""The shape of each decode step, measured per batch size on the serve's own steps.

A step can verify a tree of drafts, a chain of drafts, or draft nothing (plain decoding).
Which delivers the most tokens per second depends on the batch size (a verify of ``bs × k``
rows costs little more than a decode of ``bs`` rows at small batches, and stops doing so as
the batch grows; a tree's wider verify pays at ``bs`` 1 and not at 32), on the model, the
draft, the adapters' accept rates and the GPU. So instead of fixed thresholds
(``speculative.disable_batch_size``, ``speculative.tree_max_batch_size``) the switch keeps,
per power-of-two batch-size bucket, a moving average of the tokens per second each shape
delivered, and runs the best.

What the measuring costs, and how it is kept small:

- A new bucket starts from its nearest measured neighbours' verdict: their rates, relative
  to their best shape, scaled by this bucket's first own measurement (of the inherited best),
  and their exploration intervals (halved per doubling of batch size past the first). Only
  a bucket with no measured neighbour measures every shape it may use once (in the order
  given: the configured one first).
- Exploration re-measures each other shape every ``explore_every`` steps while it is close
  (within ``LEAD``); one that lost by more backs off geometrically (``explore_every``, then
  twice that, ... up to ``max_explore_every``). A change of the verdict, or an adapter the
  bucket has not served before (a new mix, new accept rates), resets the intervals.
- A shape that lost by ``WIDE`` or more at this bucket (measured here since the last reset)
  and at each adjacent bucket (half and twice the size, where that is a batch size) is not
  explored at all.
- The first step after a change of shape (the previous step, in whatever bucket, and this
  bucket's previous step were of another shape) is charged to no shape: it carries the
  switch's own costs (a STANDALONE draft catching up, an EAGLE head re-fed, a CUDA-graph
  replay of another width).

Every shape is lossless, so the choice changes speed only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable, Iterable, Sequence
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
    tokens_per_s: float | None = None  # None until measured or inherited
    samples: int = 0  # this bucket's own measurements (0 with a value: inherited, relative)
    at: int = 0  # the bucket's step of the last measurement

    def add(self, value: float, alpha: float, step: int, stale: int) -> None:
        # An inherited value is a prior, and a value older than ``stale`` steps (a shape not
        # in use, re-measured by exploration) is out of date: the new measurement replaces
        # either, so a shape that became the fastest wins on its first exploration.
        fresh = self.samples and step - self.at <= stale
        self.samples += 1
        self.at = step
        self.tokens_per_s = (1 - alpha) * self.tokens_per_s + alpha * value if fresh else value  # type: ignore[operator]


@dataclass
class _Bucket:
    rates: dict[StepShape, _Rate] = field(default_factory=dict)
    steps: int = 0  # decisions taken on measured rates (exploration clock)
    interval: dict[StepShape, int] = field(default_factory=dict)  # steps between explorations
    due: dict[StepShape, int] = field(default_factory=dict)  # step of the next exploration
    exploring: StepShape | None = None
    explore_left: int = 0  # further steps ``exploring`` may take until one of them is measured
    verdict: StepShape | None = None
    adapters: set[Hashable] = field(default_factory=set)  # served since the bucket began
    fresh: set[StepShape] = field(default_factory=set)  # measured here since the last reset
    last: StepShape | None = None  # the shape of this bucket's last recorded step

    def rate(self, shape: StepShape) -> float | None:
        r = self.rates.get(shape)
        return None if r is None else r.tokens_per_s

    def own(self, shape: StepShape) -> float | None:
        """The rate measured in this bucket (None while only inherited)."""
        r = self.rates.get(shape)
        return r.tokens_per_s if r is not None and r.samples else None

    def reset_exploration(self) -> None:
        self.interval.clear()
        self.due.clear()
        self.fresh.clear()


class SpeculationSwitch:
    """Chooses, per decode step, the shape with the best measured throughput.

    ``explore_every``: the base number of a bucket's steps between two re-measurements of a
    shape not in use (each runs it until one step is measured: ``EXPLORE_STEPS``, the
    switch-over and the measured step, where nothing interleaves; at most
    ``MAX_EXPLORE_STEPS``). ``max_explore_every``: the longest back-off (default 16 × ``explore_every``),
    which bounds how long a shape that became the fastest goes unnoticed. ``alpha``: weight of
    a new measurement in the moving average.
    """

    EXPLORE_STEPS = 2
    MAX_EXPLORE_STEPS = 4  # an exploration ends at its first measured step, or after this many
    LEAD = 0.03  # a shape slower than the best by more than this backs off
    WIDE = 0.30  # ... and by this much here and at the adjacent buckets: not explored

    def __init__(self, *, explore_every: int = 50, alpha: float = 0.2, max_explore_every: int | None = None):
        if explore_every <= self.EXPLORE_STEPS:
            raise ValueError(f"explore_every must be > {self.EXPLORE_STEPS}, got {explore_every}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        longest = 16 * explore_every if max_explore_every is None else max_explore_every
        if longest < explore_every:
            raise ValueError(f"max_explore_every must be >= explore_every ({explore_every}), got {longest}")
        self.explore_every = explore_every
        self.max_explore_every = longest
        self.alpha = alpha
        self._buckets: dict[int, _Bucket] = {}
        self._last: StepShape | None = None  # the shape of the last recorded step, any bucket

    def reset(self) -> None:
        """Forget every measurement (steps that were not serving, e.g. a warm-up's graph
        captures, would bias the verdicts)."""
        self._buckets.clear()
        self._last = None

    # ------------------------------------------------------------------ decisions
    def choose(
        self, batch_size: int, shapes: Sequence[StepShape], adapters: Iterable[Hashable] = ()
    ) -> StepShape:
        """The shape of the next step of ``batch_size`` requests, among the ``shapes`` this
        batch may use (most preferred first); ``adapters``: the batch's adapters (one the
        bucket has not served before restarts its exploration)."""
        if not shapes:
            raise ValueError("choose needs at least one shape")
        bucket = batch_bucket(batch_size)
        b = self._buckets.setdefault(bucket, _Bucket())
        if not any(r.samples for r in b.rates.values()):
            self._inherit(b, bucket, shapes)  # until it measures, a bucket follows its neighbours
        new = set(adapters) - b.adapters
        if new:
            if b.adapters:  # not the bucket's first batch: the mix changed
                b.reset_exploration()
            b.adapters |= new
        unmeasured = [s for s in shapes if b.rate(s) is None]
        if unmeasured:
            return unmeasured[0]
        b.steps += 1
        if b.exploring is not None and b.explore_left > 0 and b.exploring in shapes:
            b.explore_left -= 1
            return b.exploring
        b.exploring = None
        best = self._best(b, shapes)
        if best is not b.verdict:
            if b.verdict is not None:
                b.reset_exploration()
            b.verdict = best
        shape = self._explore(b, bucket, best, shapes)
        return best if shape is None else shape

    def _explore(self, b: _Bucket, bucket: int, best: StepShape, shapes: Sequence[StepShape]) -> StepShape | None:
        """The shape to re-measure now (None: keep the best), scheduling its next time."""
        for s in shapes:
            if s is best:
                continue
            b.due.setdefault(s, b.steps - 1 + b.interval.setdefault(s, self.explore_every))
            if b.steps < b.due[s] or self._hopeless(bucket, s, shapes):
                continue
            lost = (b.rate(s) or 0.0) < (1 - self.LEAD) * (b.rate(best) or 0.0)
            if lost and s in b.fresh:
                b.interval[s] = min(2 * b.interval[s], self.max_explore_every)
            elif not lost:
                b.interval[s] = self.explore_every
            b.due[s] = b.steps + b.interval[s]
            b.exploring, b.explore_left = s, self.MAX_EXPLORE_STEPS - 1
            return s
        return None

    def _hopeless(self, bucket: int, shape: StepShape, shapes: Sequence[StepShape]) -> bool:
        """Whether ``shape`` lost widely here (measured since the last reset) and at each
        adjacent bucket."""
        here = self._buckets[bucket]
        if shape not in here.fresh or not self._lost_widely(here, shape, shapes):
            return False
        for n in (bucket // 2, 2 * bucket):
            if n >= 1 and n != bucket:
                other = self._buckets.get(n)
                if other is None or other.own(shape) is None or not self._lost_widely(other, shape, shapes):
                    return False
        return True

    def _lost_widely(self, b: _Bucket, shape: StepShape, shapes: Sequence[StepShape]) -> bool:
        best = max((b.own(s) or 0.0) for s in shapes)
        mine = b.own(shape)
        return mine is not None and mine < (1 - self.WIDE) * best

    # ------------------------------------------------------------------ buckets
    def _inherit(self, b: _Bucket, bucket: int, shapes: Sequence[StepShape]) -> None:
        """Give an unmeasured bucket its nearest measured neighbours' relative rates and
        back-off for the shapes it has no rate for."""
        distance, neighbours = self._nearest_measured(bucket, shapes)
        if not neighbours:
            return
        for s in shapes:
            if b.rate(s) is not None:
                continue
            rel = [n.rate(s) / max(n.rate(x) for x in shapes) for n in neighbours]  # type: ignore[operator]
            b.rates[s] = _Rate(tokens_per_s=sum(rel) / len(rel))
            # The neighbours' back-off, halved for each doubling of batch size beyond the first.
            longest = min(n.interval.get(s, self.explore_every) for n in neighbours)
            b.interval[s] = max(self.explore_every, longest >> max(0, int(distance) - 1))

    def _nearest_measured(self, bucket: int, shapes: Sequence[StepShape]) -> tuple[float, list[_Bucket]]:
        """The buckets with a rate for each of ``shapes`` (at least one measured there) at the
        least distance in doublings, and that distance."""
        measured = [
            (abs(math.log2(k) - math.log2(bucket)), b)
            for k, b in self._buckets.items()
            if k != bucket and all(b.rate(s) for s in shapes) and any(r.samples for r in b.rates.values())
        ]
        if not measured:
            return math.inf, []
        nearest = min(d for d, _ in measured)
        return nearest, [b for d, b in measured if d == nearest]

    # ------------------------------------------------------------------ measurements
    def record(self, batch_size: int, shape: StepShape, *, tokens: int, seconds: float) -> None:
        """A finished step of ``shape``: ``tokens`` emitted for ``batch_size`` requests in ``seconds``."""
        b = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        # A switch-over: the step before it, and this bucket's step before it, were of other
        # shapes. (Where two buckets alternate with different shapes every step follows a
        # change; each is then charged its share of that ongoing cost.)
        switched = self._last is not shape and b.last is not shape
        self._last = b.last = shape
        if switched or seconds <= 0:
            return
        if b.exploring is shape:  # measured: the exploration is done
            b.exploring, b.explore_left = None, 0
        value = tokens / seconds
        if not any(r.samples for r in b.rates.values()):
            # The first own measurement: inherited (relative) rates take this bucket's scale.
            prior = b.rate(shape)
            if prior:
                for s, r in b.rates.items():
                    if s is not shape and r.tokens_per_s is not None:
                        r.tokens_per_s *= value / prior
        b.rates.setdefault(shape, _Rate()).add(value, self.alpha, b.steps, self.MAX_EXPLORE_STEPS + 2)
        b.fresh.add(shape)

    def verdict(self, batch_size: int, shapes: Sequence[StepShape]) -> StepShape | None:
        """The current choice for ``batch_size`` among ``shapes`` (None until each is measured)."""
        b = self._buckets.get(batch_bucket(batch_size))
        if b is None or any(b.rate(s) is None for s in shapes):
            return None
        return self._best(b, shapes)

    def rates(self, batch_size: int) -> dict[StepShape, float]:
        """The tokens per second of each shape at ``batch_size``'s bucket (measured there, or
        inherited from its neighbours and scaled by its first measurement)."""
        b = self._buckets.get(batch_bucket(batch_size))
        if b is None:
            return {}
        return {s: r.tokens_per_s for s, r in b.rates.items() if r.tokens_per_s is not None}

    @staticmethod
    def _best(b: _Bucket, shapes: Sequence[StepShape]) -> StepShape:
        # Ties go to the earlier (preferred) shape.
        return max(shapes, key=lambda s: (b.rate(s) or 0.0, -shapes.index(s)))
