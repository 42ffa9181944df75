"""Per-request sampling parameters, validated once at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``field`` names it as the API spells it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    ``temperature == 0`` (or ``top_k == 1``) is greedy. ``top_k <= 0`` and ``top_p == 1``
    disable those filters. ``seed`` makes a sampled request reproducible: its random draws
    come from its own generator, so the batch it shares never changes them. ``max_tokens``
    of ``None`` means "until the context is full". ``logprobs`` asks for the log-probability
    of each chosen token under the model's (unscaled) distribution.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    include_stop_str_in_output: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise :class:`SamplingParamsError` naming the first bad field; return self."""
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _finite(self.temperature) or self.temperature < 0:
            raise SamplingParamsError(
                "temperature", f"temperature must be a number >= 0 (0 is greedy), got {self.temperature!r}"
            )
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(
                "top_k", f"top_k must be an integer >= 1, or 0 / -1 to disable it, got {self.top_k!r}"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingParamsError("seed", f"seed must be an integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingParamsError(
                    "stop", f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"
                )
        for t in self.stop_token_ids:
            if (
                isinstance(t, bool)
                or not isinstance(t, int)
                or t < 0
                or (vocab_size is not None and t >= vocab_size)
            ):
                bound = f" and < {vocab_size}" if vocab_size is not None else ""
                raise SamplingParamsError(
                    "stop_token_ids", f"stop_token_ids must be integers >= 0{bound}, got {t!r}"
                )
        return self


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
