"""Continuous batching policy: which requests run in the next step.

Each step is either an extend step (prefill chunks: requests still prefilling continue,
then new requests are admitted from the head of the FIFO queue) or a decode step (every
running request that has finished prefilling). When both kinds of work exist they
alternate, so a stream of long prompts never stalls decoding and decoding never starves
admission.

Admission limits, checked for every candidate:

- ``max_running_requests``;
- at most ``max_loras_per_batch`` distinct adapters in the running set (base-model
  requests need no adapter slot), because every decode batch holds the whole running set;
  pinned adapters keep their slots whether or not they run, so they count too;
- KV: the free tokens must cover the running set's outstanding prefill, a reserve of
  ``new_token_ratio`` of every request's remaining ``max_new_tokens``, and the candidate's
  own prompt plus its reserve. The reserve is an estimate; when a decode step finds the
  cache short anyway, the newest-admitted requests are retracted (their KV freed, back to
  the queue in arrival order) until the step fits.

FIFO without starvation: a head blocked by the KV budget or the running limit blocks
everyone (a smaller request never overtakes it). A head blocked only by the adapter limit
may be overtaken by requests that need no new adapter slot, at most ``max_head_bypass``
times; after that admission waits for the head.

Everything here is pure over the given views, except two counters the ``Scheduler``
keeps between steps (the last step's kind, and how often the head was overtaken).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .request import Request


class StepKind(enum.Enum):
    IDLE = "idle"
    EXTEND = "extend"
    DECODE = "decode"


class BlockReason(enum.Enum):
    NONE = "none"
    MAX_RUNNING = "max_running_requests"
    ADAPTERS = "max_loras_per_batch"
    KV = "kv_cache"
    CHUNK = "chunk_budget"


@dataclass(frozen=True)
class SchedulerLimits:
    max_running_requests: int
    max_loras_per_batch: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    decode_tokens_per_step: int = 1  # KV tokens one decode step appends per request
    new_token_ratio: float = 0.3
    max_head_bypass: int = 64

    def __post_init__(self) -> None:
        for name in (
            "max_running_requests",
            "max_loras_per_batch",
            "chunked_prefill_size",
            "max_prefill_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"scheduler limit {name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.new_token_ratio <= 1:
            raise ValueError(f"new_token_ratio must be in [0, 1], got {self.new_token_ratio}")

    @property
    def chunk_budget(self) -> int:
        return min(self.chunked_prefill_size, self.max_prefill_tokens)


@dataclass
class StepPlan:
    """What the engine runs next; the scheduler mutates no request."""

    kind: StepKind = StepKind.IDLE
    admit: list[Request] = field(default_factory=list)  # waiting -> running, in order
    extend: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decode: list[Request] = field(default_factory=list)
    retract: list[Request] = field(default_factory=list)  # running -> waiting, before the step
    head_blocked: BlockReason = BlockReason.NONE


def reserve_tokens(req: Request, ratio: float) -> int:
    """Decode tokens held in reserve for a request (an estimate of what it will still use)."""
    return math.ceil(ratio * req.remaining_new_tokens)


def outstanding_tokens(running: Sequence[Request], ratio: float) -> int:
    """KV tokens the running set is expected to claim beyond what it holds now."""
    return sum(max(r.prefill_target - r.num_cached, 0) + reserve_tokens(r, ratio) for r in running)


def admission_need(req: Request, ratio: float) -> int:
    """KV tokens a waiting request claims at admission: all of its prefill plus its reserve."""
    return req.num_tokens + reserve_tokens(req, ratio)


def active_adapters(running: Sequence[Request]) -> set[str]:
    return {r.adapter for r in running if r.adapter is not None}


def select_admissions(
    waiting: Sequence[Request],
    running: Sequence[Request],
    free_tokens: int,
    limits: SchedulerLimits,
    chunk_budget: int,
    bypass_used: int,
    *,
    free_rows: int | None = None,
    pinned: frozenset[str] = frozenset(),
) -> tuple[list[Request], BlockReason, int]:
    """Pick waiting requests to admit this extend step.

    Returns ``(admitted, why the head is blocked, overtakes used)``. ``chunk_budget`` is
    the prefill tokens still available this step; an admitted request gets at least one.
    ``free_rows`` caps how many more requests the KV cache can hold; ``pinned`` adapters
    occupy slots whether they run or not.
    """
    admitted: list[Request] = []
    adapters = active_adapters(running) | set(pinned)
    budget = free_tokens - outstanding_tokens(running, limits.new_token_ratio)
    slots = limits.max_running_requests - len(running)
    if free_rows is not None:
        slots = min(slots, free_rows)
    head_reason = BlockReason.NONE
    head_pending = False  # the queue's head was skipped over, so later admissions overtake it
    for req in waiting:
        if chunk_budget <= 0:
            if not head_pending:
                head_reason = BlockReason.CHUNK
            break
        if slots <= 0:
            if not head_pending:
                head_reason = BlockReason.MAX_RUNNING
            break
        need = admission_need(req, limits.new_token_ratio)
        if need > budget:
            if not head_pending:
                head_reason = BlockReason.KV
            break
        needs_slot = req.adapter is not None and req.adapter not in adapters
        if needs_slot and len(adapters) >= limits.max_loras_per_batch:
            if not head_pending:
                head_pending, head_reason = True, BlockReason.ADAPTERS
            continue  # later requests sharing an active adapter (or base) may overtake
        if head_pending:
            if bypass_used >= limits.max_head_bypass:
                break
            bypass_used += 1
        admitted.append(req)
        adapters |= {req.adapter} if req.adapter is not None else set()
        budget -= need
        slots -= 1
        chunk_budget -= min(req.num_tokens, chunk_budget)
    return admitted, head_reason, bypass_used


def plan_extend(
    running: Sequence[Request], admitted: Sequence[Request], chunk_budget: int, free_tokens: int
) -> list[tuple[Request, int]]:
    """Prefill chunks: requests already prefilling first (admission order), then new ones."""
    chunks: list[tuple[Request, int]] = []
    budget = min(chunk_budget, free_tokens)
    for req in [*(r for r in running if r.is_prefilling), *admitted]:
        if budget <= 0:
            break
        remaining = (req.prefill_target or req.num_tokens) - req.num_cached
        n = min(remaining, budget)
        if n > 0:
            chunks.append((req, n))
            budget -= n
    return chunks


def plan_retractions(running: Sequence[Request], free_tokens: int, tokens_per_request: int) -> list[Request]:
    """Newest-admitted requests to evict so one decode step fits in the free KV tokens.

    Never evicts the last remaining request: admission guarantees one request alone fits.
    """
    decoding = [r for r in running if not r.is_prefilling]
    need = tokens_per_request * len(decoding)
    if need <= free_tokens:
        return []
    victims: list[Request] = []
    order = sorted(running, key=lambda r: (r.admitted_time or 0.0, r.arrival_time), reverse=True)
    for req in order:
        if need <= free_tokens or len(running) - len(victims) <= 1:
            break
        victims.append(req)
        free_tokens += req.num_cached
        if not req.is_prefilling:
            need -= tokens_per_request
    return victims


class Scheduler:
    """Plans steps; keeps only the alternation and head-overtake counters."""

    def __init__(self, limits: SchedulerLimits) -> None:
        self.limits = limits
        self._last_kind = StepKind.IDLE
        self._bypass_used = 0
        self._head: Request | None = None

    def plan(
        self,
        waiting: Sequence[Request],
        running: Sequence[Request],
        free_tokens: int,
        *,
        free_rows: int | None = None,
        pinned: frozenset[str] = frozenset(),
    ) -> StepPlan:
        """The next step's plan for the given queue, running set and free KV tokens."""
        limits = self.limits
        if waiting and waiting[0] is not self._head:
            self._head, self._bypass_used = waiting[0], 0
        decoding = [r for r in running if not r.is_prefilling]
        prefilling = [r for r in running if r.is_prefilling]

        prefer_decode = bool(decoding) and self._last_kind is StepKind.EXTEND
        if not prefer_decode:
            admitted, reason, bypass = select_admissions(
                waiting,
                running,
                free_tokens,
                limits,
                limits.chunk_budget,
                self._bypass_used,
                free_rows=free_rows,
                pinned=pinned,
            )
            chunks = plan_extend(running, admitted, limits.chunk_budget, free_tokens)
            admitted = [r for r in admitted if any(c[0] is r for c in chunks)]
            if chunks:
                self._bypass_used = bypass
                self._last_kind = StepKind.EXTEND
                return StepPlan(StepKind.EXTEND, admit=admitted, extend=chunks, head_blocked=reason)
            if not decoding and prefilling and free_tokens <= 0 and len(running) > 1:
                # Prefill cannot proceed and nothing decodes: free the newest request's KV.
                newest = max(running, key=lambda r: (r.admitted_time or 0.0, r.arrival_time))
                return StepPlan(StepKind.IDLE, retract=[newest], head_blocked=reason)
        if decoding:
            victims = plan_retractions(running, free_tokens, limits.decode_tokens_per_step)
            batch = [r for r in decoding if all(r is not v for v in victims)]
            if not batch:  # only prefilling requests remain: they continue next step
                return StepPlan(StepKind.IDLE, retract=victims)
            self._last_kind = StepKind.DECODE
            return StepPlan(StepKind.DECODE, decode=batch, retract=victims)
        self._last_kind = StepKind.IDLE
        return StepPlan(StepKind.IDLE)
