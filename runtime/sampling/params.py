"""Per-request sampling parameters, validated once at admission."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for top_logprobs (and vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
LOGIT_BIAS_RANGE = 100.0  # |bias| <= 100, as OpenAI
PENALTY_RANGE = 2.0  # presence / frequency penalties in [-2, 2], as OpenAI

StructuredKind = Literal["json_object", "json_schema", "regex", "grammar"]
STRUCTURED_KINDS: tuple[str, ...] = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, enforced token by token.

    ``json_object``: any JSON object (``spec`` unused); ``json_schema``: JSON matching the
    schema in ``spec`` (JSON text); ``regex``: text matching ``spec``; ``grammar``: an EBNF
    grammar in ``spec`` (the GBNF dialect). The API layer maps ``response_format`` (and
    vLLM's ``guided_*`` fields) onto this; the engine compiles it against the tokenizer.
    """

    kind: StructuredKind
    spec: str = ""


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``field`` names it as the API spells it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    ``temperature == 0`` (or ``top_k == 1``) is greedy. ``top_k <= 0``, ``top_p == 1`` and
    ``min_p == 0`` disable those filters. ``seed`` makes a sampled request reproducible: its
    random draws come from its own generator, so the batch it shares never changes them.
    ``max_tokens`` of ``None`` means "until the context is full". ``logprobs`` asks for the
    log-probability of each chosen token under the model's (unscaled) distribution.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # vLLM's min_p: after temperature and before top-k / top-p, tokens whose probability is
    # below ``min_p`` × the most likely token's are removed.
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # vLLM's min_tokens: until this many tokens are out, the stop tokens and end-of-sequence
    # tokens are masked (-inf) and no stop string ends the request.
    min_tokens: int = 0
    # The model's end-of-sequence ids, set by the engine at admission (not an API field):
    # min_tokens masks them beside ``stop_token_ids``, with ``ignore_eos`` too (as vLLM).
    eos_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    include_stop_str_in_output: bool = False
    # The alternatives reported beside each generated token's log-probability (0..20).
    top_logprobs: int = 0
    # Log-probabilities of the prompt's tokens (``echo`` with ``logprobs``): None for none,
    # else the number of alternatives per prompt token (0..20).
    prompt_logprobs: int | None = None
    # Logit processing, applied before temperature / top-k / top-p, in every step and in
    # every speculative verify position alike (see ``sampling.processors``).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before sampling (penalties, biases, a constraint,
        a ``min_tokens`` stop mask)."""
        return bool(self.min_tokens) or self._processes_every_position

    def processes_logits_after(self, num_output: int) -> bool:
        """Whether the logits of any position after ``num_output`` generated tokens are
        changed: the ``min_tokens`` mask no longer applies once that many are out."""
        return self.stops_masked(num_output) or self._processes_every_position

    def stops_masked(self, num_output: int) -> bool:
        """Whether the ``min_tokens`` mask holds the stop and end-of-sequence tokens back at
        the position after ``num_output`` generated tokens."""
        return num_output < self.min_tokens

    @property
    def _processes_every_position(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.structured is not None
        )

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
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
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
        self._validate_min_tokens()
        self._validate_logprobs()
        self._validate_processing(vocab_size)
        return self

    def _validate_min_tokens(self) -> None:
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )

    def _validate_logprobs(self) -> None:
        if not _count(self.top_logprobs, MAX_TOP_LOGPROBS):
            raise SamplingParamsError(
                "top_logprobs", f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}"
            )
        if self.top_logprobs and not self.logprobs:
            raise SamplingParamsError("top_logprobs", "top_logprobs needs logprobs: true")
        if self.prompt_logprobs is not None and not _count(self.prompt_logprobs, MAX_TOP_LOGPROBS):
            raise SamplingParamsError(
                "prompt_logprobs",
                f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}",
            )

    def _validate_processing(self, vocab_size: int | None) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or abs(value) > PENALTY_RANGE:
                raise SamplingParamsError(name, f"{name} must be a number in [-2, 2], got {value!r}")
        if not _finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            raise SamplingParamsError(
                "repetition_penalty",
                f"repetition_penalty must be in (0, 10] (1 disables it), got {self.repetition_penalty!r}",
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}"
            )
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (
                vocab_size is not None and token >= vocab_size
            ):
                bound = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
                raise SamplingParamsError("logit_bias", f"logit_bias keys must be token ids >= 0{bound}, got {token!r}")
            if not _finite(bias) or abs(bias) > LOGIT_BIAS_RANGE:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}"
                )
        if self.structured is not None and self.structured.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(
                "response_format",
                f"unknown constraint {self.structured.kind!r}: use one of {', '.join(STRUCTURED_KINDS)}",
            )


def _count(value: object, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= maximum


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
