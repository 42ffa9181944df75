"""What the engine reports about itself: per-event hooks and a per-step snapshot.

The engine calls an :class:`EngineObserver` on its own thread as events happen (the
server's Prometheus metrics implement it) and publishes an immutable
:class:`EngineSnapshot` after every step, which any thread may read without a lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .request import Request


class EngineObserver:
    """No-op hooks; subclass and override what you need. Called on the engine thread."""

    def on_first_token(self, request: Request, ttft_s: float) -> None:
        """The first output token of a request exists (``ttft_s`` since arrival)."""

    def on_tokens(self, request: Request, num_tokens: int, gap_s: float) -> None:
        """``num_tokens`` more output tokens arrived ``gap_s`` after the previous ones."""

    def on_request_finished(self, request: Request) -> None:
        """A request left the engine for good (finished, aborted or failed)."""

    def on_step(self, kind: str, batch_size: int, num_tokens: int, seconds: float) -> None:
        """One extend or decode step ran (``seconds``: the whole step, outputs included)."""

    def on_retract(self, request: Request) -> None:
        """A running request was evicted back to the queue to free KV cache."""

    def on_prefix_lookup(self, request: Request, hit_tokens: int, query_tokens: int) -> None:
        """A request was admitted with the prefix cache on: ``hit_tokens`` of its
        ``query_tokens`` (prompt, and outputs so far after a retraction) were cached."""


@dataclass(frozen=True)
class StepTotals:
    """Cumulative work of one step kind (extend or decode) since the engine started."""

    steps: int = 0
    requests: int = 0  # request-steps: the sum of the batch sizes
    tokens: int = 0  # extend: prompt tokens prefilled; decode: tokens generated
    seconds: float = 0.0  # inside the decoder: model forwards, drafting, sampling

    @property
    def mean_batch(self) -> float:
        """Requests per step."""
        return self.requests / self.steps if self.steps else 0.0

    def add(self, requests: int, tokens: int, seconds: float) -> StepTotals:
        return StepTotals(
            self.steps + 1, self.requests + requests, self.tokens + tokens, self.seconds + seconds
        )


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after a step."""

    num_running: int = 0
    num_waiting: int = 0
    running_adapters: tuple[str, ...] = ()  # distinct adapters in the running set, sorted
    waiting_adapters: tuple[str, ...] = ()  # distinct adapters in the queue, sorted
    kv_total_tokens: int = 0
    kv_free_tokens: int = 0
    max_loras_per_batch: int = 0
    last_batch_size: int = 0
    steps: int = 0
    time: float = field(default_factory=time.time)
    max_running_requests: int = 0
    extend: StepTotals = StepTotals()
    decode: StepTotals = StepTotals()
    # Seconds the engine thread spent on steps outside the decoder (scheduling, outputs,
    # detokenisation, stop checks): host work every step pays on top of the model.
    engine_seconds: float = 0.0
    # Extend steps that ran while requests were decoding (each one pauses every decode).
    extends_during_decode: int = 0
    # Decode steps that ran with free running slots while requests waited (deferred admission).
    deferred_admission_steps: int = 0
    # CUDA graphs the target's runner holds, and captures that failed (each failure turns
    # the runner's capturing off: uncaptured steps then run eagerly, which a serve should see).
    cuda_graphs: int = 0
    cuda_graph_capture_failures: int = 0
    # Prefix cache: tokens it holds (part of the pool), of those held by no request
    # (counted free: evicted on demand), and tokens evicted since start.
    prefix_cache_enabled: bool = False
    prefix_cached_tokens: int = 0
    prefix_evictable_tokens: int = 0
    prefix_evicted_tokens: int = 0

    @property
    def decode_occupancy(self) -> float:
        """Mean decode batch over ``max_running_requests`` (1.0: the batch was always full)."""
        if not self.decode.steps or not self.max_running_requests:
            return 0.0
        return self.decode.mean_batch / self.max_running_requests

    @property
    def prefix_cache_share(self) -> float:
        """The prefix cache's share of the KV pool (0..1)."""
        if not self.kv_total_tokens:
            return 0.0
        return self.prefix_cached_tokens / self.kv_total_tokens

    @property
    def kv_usage(self) -> float:
        if not self.kv_total_tokens:
            return 0.0
        return 1.0 - self.kv_free_tokens / self.kv_total_tokens
