"""What steps cost, learnt from the steps the engine runs: the input of admission batching.

An extend step pauses every decoding request. On a GPU most of its time is a fixed cost
(an eager forward's launches and weight reads, the draft's mirrored prefill) that does
not grow with the prompts it carries, so admitting requests one step at a time as slots
free pays that fixed cost once per request. :class:`StepCosts` keeps the two numbers the
scheduler weighs against each other: the seconds of a decode step, and the fixed part of
an extend step (the intercept of extend seconds over prefilled tokens).

Both are exponentially weighted, so they follow the load (batch sizes, prompt lengths)
rather than the engine's whole history.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Weighted:
    """Exponentially weighted sums for a least-squares line ``y = a + b x``."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = decay * self.w + 1.0
        self.x = decay * self.x + x
        self.y = decay * self.y + y
        self.xx = decay * self.xx + x * x
        self.xy = decay * self.xy + x * y


class StepCosts:
    """Running estimates of decode-step seconds and the fixed seconds of an extend step.

    ``decay`` weighs the newest observation against the older ones (0.9: about the last
    ten steps of each kind count).
    """

    # Below this relative spread of prefilled tokens the slope cannot be told apart from
    # noise; the whole mean then counts as fixed (an upper bound of the intercept).
    MIN_RELATIVE_SPREAD = 0.05

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self._decode_seconds: float | None = None
        self._extend = _Weighted()

    def reset(self) -> None:
        """Forget every observation (steps that were not serving, e.g. a warm-up's graph
        captures, would bias the estimates)."""
        self._decode_seconds = None
        self._extend = _Weighted()

    def observe_decode(self, seconds: float) -> None:
        """A decode step took ``seconds`` (model, drafting and sampling)."""
        if seconds < 0:
            return
        prev = self._decode_seconds
        self._decode_seconds = seconds if prev is None else self.decay * prev + (1 - self.decay) * seconds

    def observe_extend(self, seconds: float, tokens: int) -> None:
        """An extend step prefilled ``tokens`` prompt tokens in ``seconds``."""
        if seconds < 0 or tokens < 0:
            return
        self._extend.add(float(tokens), seconds, self.decay)

    @property
    def decode_seconds(self) -> float | None:
        """Seconds of one decode step, or None before the first."""
        return self._decode_seconds

    @property
    def extend_fixed_seconds(self) -> float | None:
        """Seconds an extend step costs whatever it prefills, or None before the first.

        The intercept of a weighted least-squares line through (tokens, seconds), kept
        within ``[0, mean seconds]``; with too little spread in the token counts to fit a
        slope, the mean itself.
        """
        e = self._extend
        if e.w <= 0:
            return None
        mean_x, mean_y = e.x / e.w, e.y / e.w
        var_x = max(e.xx / e.w - mean_x * mean_x, 0.0)
        if var_x <= (self.MIN_RELATIVE_SPREAD * mean_x) ** 2 or var_x == 0.0:
            return mean_y
        slope = max((e.xy / e.w - mean_x * mean_y) / var_x, 0.0)
        return min(max(mean_y - slope * mean_x, 0.0), mean_y)
