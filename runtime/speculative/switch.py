"""Whether a decode step drafts: measured, per batch size, on the serve's own steps.

Speculation pays when a verify of ``bs × k`` rows costs little more than a decode of
``bs`` rows, which holds at small batches and stops holding as the batch grows (the
verify becomes compute-bound, the draft's own forwards grow). Where the crossover lies
depends on the model, the draft, the adapters' accept rates and the GPU, so instead of a
fixed threshold (``speculative.disable_batch_size``) the switch keeps, per power-of-two
batch-size bucket, a moving average of the tokens per second each kind of step
delivered, and drafts while drafting is ahead. Each bucket measures drafting first, then
plain decoding once, then keeps re-measuring the kind it is not using every
``explore_every`` steps, so a change in acceptance (another adapter mix) or in load is
noticed. Plain steps keep the drafter in sync (a STANDALONE draft catches up in one
extend when drafting resumes); the first step after a change of kind is not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    draft: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    steps: int = 0
    last: bool | None = None  # the kind of the last recorded step (True: drafted)


class SpeculationSwitch:
    """Chooses, per decode step, between drafting and plain decoding.

    ``explore_every``: every this many steps of a bucket, run the kind not in use for two
    steps, to refresh its measurement. ``alpha``: weight of a new measurement in the
    moving average. The first step after a change of kind is not measured: it carries the
    switch's own costs (a STANDALONE draft catching up, a CUDA-graph capture).
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

    def should_draft(self, batch_size: int) -> bool:
        """Whether the next step of ``batch_size`` requests drafts."""
        b = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        if b.draft.tokens_per_s is None:
            return True
        if b.plain.tokens_per_s is None:
            return False
        b.steps += 1
        better = self._draft_ahead(b)
        if b.steps % self.explore_every < self.EXPLORE_STEPS:
            return not better  # re-measure the other kind
        return better

    def record(self, batch_size: int, *, drafted: bool, tokens: int, seconds: float) -> None:
        """A finished step: ``tokens`` emitted for ``batch_size`` requests in ``seconds``."""
        b = self._buckets.setdefault(batch_bucket(batch_size), _Bucket())
        changed, b.last = b.last != drafted, drafted
        if changed or seconds <= 0:
            return
        (b.draft if drafted else b.plain).add(tokens / seconds, self.alpha)

    def drafting(self, batch_size: int) -> bool | None:
        """The current verdict for ``batch_size`` (None until both kinds are measured)."""
        b = self._buckets.get(batch_bucket(batch_size))
        if b is None or b.draft.tokens_per_s is None or b.plain.tokens_per_s is None:
            return None
        return self._draft_ahead(b)

    @staticmethod
    def _draft_ahead(b: _Bucket) -> bool:
        assert b.draft.tokens_per_s is not None and b.plain.tokens_per_s is not None
        return b.draft.tokens_per_s >= b.plain.tokens_per_s
