"""One generation request's state as the engine sees it, and what it reports back.

KV invariant: a request's cache holds every token of ``all_ids`` except, once it is
decoding, the last one (the token just sampled, which the next step feeds in). During
prefill ``num_cached`` grows chunk by chunk up to ``prefill_target``; a retracted request
(evicted under KV pressure) starts over with ``num_cached = 0`` and prefills its prompt
and outputs so far.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling import SamplingParams
from ..sampling.structured import Constraint

if TYPE_CHECKING:
    from .text import TextStream


class RequestState(enum.Enum):
    QUEUED = "queued"  # submitted, not yet seen by the engine thread
    WAITING = "waiting"  # accepted, waiting for admission to the running set
    RUNNING = "running"  # in the running set (prefilling or decoding)
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop string, stop token or end-of-sequence token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # the client went away or the server is shutting down
    ERROR = "error"  # this request failed; see RequestOutput.error


@dataclass
class RequestError:
    """Why a request failed, in the shape of an OpenAI error object."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


@dataclass
class SpecStats:
    """Speculative-decoding accounting for one request (zeros without speculation)."""

    verify_steps: int = 0
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # drafts accepted
    accept_lens: list[int] = field(default_factory=list)  # accepted drafts per verify step

    @property
    def mean_accept_len(self) -> float:
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0


TopLogprobs = list[tuple[int, float]]
"""The most likely tokens at one position: ``(token id, log-probability)``, most likely first."""


@dataclass
class PromptLogprobs:
    """Log-probabilities of a request's prompt tokens under the model (raw distribution).

    ``logprobs[i]`` is prompt token ``i``'s, given the tokens before it (``None`` for the
    first token, which has no context); ``top[i]`` the alternatives at that position
    (``[]`` for the first token, or when none were asked for).
    """

    logprobs: list[float | None]
    top: list[TopLogprobs]


@dataclass
class RequestOutput:
    """An increment of one request's output, delivered to its sink after each step."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    # Per new token: the ``params.top_logprobs`` most likely tokens (when asked for).
    top_logprobs: list[TopLogprobs] | None = None
    # On the request's first output only, when ``params.prompt_logprobs`` is set.
    prompt_logprobs: PromptLogprobs | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: RequestError | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec: SpecStats | None = None


OutputSink = Callable[[RequestOutput], None]


@dataclass(eq=False)
class Request:
    """A request inside the engine. Created by the server, owned by the engine thread."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None  # None: the base model
    max_new_tokens: int = 16  # resolved by the engine at submission
    sink: OutputSink | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    group: str | None = None
    """The API call this request is a choice of (admission is fair across calls); None:
    a call of its own."""

    state: RequestState = RequestState.QUEUED
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    num_cached: int = 0
    prefill_target: int = 0
    finish_reason: FinishReason | None = None
    error: RequestError | None = None
    generator: torch.Generator | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    admitted_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_retractions: int = 0
    # Prefix cache (runtime/engine/prefix.py): while waiting, the tokens a cached prefix
    # covers and how many of those nobody holds (the scheduler plans with both); once
    # admitted, the tokens it reused and the key its KV is cached under.
    prefix_hit: int = 0
    prefix_claim: int = 0
    prefix_key: object | None = None
    # Requests that would compute the same uncached tokens next share a group: one of them
    # is admitted (or is prefilling), the others wait a step and reuse its KV.
    prefix_group: Hashable | None = None
    # While running, with the cache on: the KV tokens retracting it would surely give back
    # (its own, and the cached prefix no other request holds); None: its num_cached.
    kv_releasable: int | None = None
    # Owned by the engine: text assembly (detokenizer + stop strings) and the adapter hold.
    text_stream: TextStream | None = None
    holds_adapter: bool = False
    # Free for a decoder to keep per-request state (e.g. a draft's cursor).
    decoder_state: object | None = None
    # Structured output: the request's place in its grammar (advanced at each commit).
    constraint: Constraint | None = None
    # params.prompt_logprobs: gathered chunk by chunk while the prompt is prefilled.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False

    @property
    def call(self) -> str:
        """The fairness key: the API call, or the request itself."""
        return self.group if self.group is not None else self.rid

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    @property
    def last_token(self) -> int:
        # Read every step for every request: no copy of the whole sequence.
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED
