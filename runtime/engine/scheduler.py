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

Prefix caching: the engine tells each waiting request how much of it a cached prefix
covers (``prefix_hit``) and how many of those cached tokens nobody holds now
(``prefix_claim``: free tokens that admitting it takes out of the free count by locking
them). Admission needs only the rest of the prompt plus that claim, and the request's
first chunk starts after the prefix. Free tokens count cached tokens nobody holds (the
pool evicts them on demand), so a running request is retracted only when evicting every
unused cached prefix would not make room. Requests that would compute the same uncached
tokens (one ``prefix_group``, set by the engine) are not prefilled side by side: while
one of them is admitted this step or is prefilling, the others wait and then reuse its
KV; later requests may pass them meanwhile.

Fair across API calls: an API call's choices (prompts × ``n``) share a ``group``, and the
queue is taken round-robin between calls, least-served first (fewest requests running,
then earliest arrival), so a small call beside a big one is admitted at the next free
slot instead of behind every choice of the big one (:func:`fair_order`). Requests of
calls of one choice each keep their arrival order. When every running slot is taken and
the next call in that order has nothing running, the newest request of a call holding
more than an even share of the slots is retracted (back to the queue, recomputed later,
output unchanged) so the new call starts at once (:func:`fair_preemption`).

FIFO without starvation: a head blocked by the KV budget or the running limit blocks
everyone (a smaller request never overtakes it). A head blocked only by the adapter limit
may be overtaken by requests that need no new adapter slot, at most ``max_head_bypass``
times; after that admission waits for the head.

Batched admission under a backlog: an extend step pauses every decoding request, and
much of its cost is fixed (it does not grow with the prompts it carries). When requests
are queued beyond what the free slots take, and none is mid-prefill, admission waits
while the decode output the free slots forgo stays below the fixed cost of one extend
step (both learnt from the steps run, :class:`~.costs.StepCosts`), and never more than
``max_admission_defer_steps`` decode steps; then everything admissible is prefilled in
one step. Slots keep freeing meanwhile, so one extend admits several requests. Without
a backlog (light load) a request is admitted at once.

Everything here is pure over the given views, except what the ``Scheduler`` keeps between
steps: the last step's kind, how often the head was overtaken, the step costs and how
long admission has been deferred.
"""

from __future__ import annotations

import collections
import enum
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .costs import StepCosts
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
    # Decode steps admission may wait to batch prefills under a backlog (0: never waits).
    max_admission_defer_steps: int = 8

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
        if self.max_admission_defer_steps < 0:
            raise ValueError(
                f"scheduler limit max_admission_defer_steps must be >= 0, got {self.max_admission_defer_steps}"
            )

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
    deferred: bool = False  # a decode step chosen while admissible requests wait (batched admission)


def reserve_tokens(req: Request, ratio: float) -> int:
    """Decode tokens held in reserve for a request (an estimate of what it will still use)."""
    return math.ceil(ratio * req.remaining_new_tokens)


def outstanding_tokens(running: Sequence[Request], ratio: float) -> int:
    """KV tokens the running set is expected to claim beyond what it holds now."""
    return sum(max(r.prefill_target - r.num_cached, 0) + reserve_tokens(r, ratio) for r in running)


def admission_need(req: Request, ratio: float) -> int:
    """KV tokens a waiting request claims at admission: its prefill past a cached prefix,
    the cached tokens it takes out of the free count, and its reserve."""
    return req.num_tokens - req.prefix_hit + req.prefix_claim + reserve_tokens(req, ratio)


def freed_by_retraction(req: Request) -> int:
    """KV tokens retracting a running request surely frees: its own and the cached prefix
    nobody else holds (as the engine measured it), else all but the prefix it reused; its
    KV stays cached, evictable like free tokens."""
    if req.kv_releasable is not None:
        return req.kv_releasable
    return max(req.num_cached - req.prefix_hit, 0)


def prefill_left(req: Request) -> int:
    """Tokens a request still has to prefill (a waiting one starts after its cached prefix)."""
    if req.prefill_target:
        return req.prefill_target - req.num_cached
    return req.num_tokens - max(req.num_cached, req.prefix_hit)


def active_adapters(running: Sequence[Request]) -> set[str]:
    return {r.adapter for r in running if r.adapter is not None}


def fair_order(
    waiting: Sequence[Request], running: Sequence[Request], limit: int | None = None
) -> list[Request]:
    """The waiting queue in admission order: round-robin between API calls, the call with
    the fewest requests running (then the earliest waiting) first; arrival order within a
    call. With one request per call this is the arrival order. Only the first ``limit``
    places are interleaved (admission never reaches much further); the rest keep their
    arrival order."""
    calls: dict[str, list[Request]] = {}
    for r in waiting:
        calls.setdefault(r.call, []).append(r)
    if len(calls) <= 1:
        return list(waiting)
    held = collections.Counter(r.call for r in running)
    if len(calls) == len(waiting) and not any(held[key] for key in calls):
        return list(waiting)  # one request per call, none of them running: arrival order
    heap = [(held[key], first, key) for first, key in enumerate(calls)]
    heapq.heapify(heap)
    taken = dict.fromkeys(calls, 0)
    order: list[Request] = []
    budget = len(waiting) if limit is None else min(limit, len(waiting))
    while heap and len(order) < budget:
        served, first, key = heapq.heappop(heap)
        order.append(calls[key][taken[key]])
        taken[key] += 1
        if taken[key] < len(calls[key]):
            heapq.heappush(heap, (served + 1, first, key))
    if len(order) < len(waiting):
        placed = {id(r) for r in order}
        order.extend(r for r in waiting if id(r) not in placed)
    return order


def fair_preemption(
    waiting: Sequence[Request],
    running: Sequence[Request],
    limits: SchedulerLimits,
    free_tokens: int,
    *,
    free_rows: int | None = None,
    pinned: frozenset[str] = frozenset(),
) -> Request | None:
    """A running request to give back its slot so the next call in fair order can start.

    Only when the running slots are full, that call has nothing running, another call
    holds more than ``max_running_requests`` split evenly between the calls with work, and
    the waiting request would be admitted once the slot is free (its KV and adapter fit):
    the newest-admitted request of the call holding the most. Calls of one request each
    never preempt one another.
    """
    if not waiting or len(running) < 2:
        return None
    if len(running) < limits.max_running_requests and (free_rows is None or free_rows > 0):
        return None  # a slot is free: nothing to give back
    head = waiting[0]
    held = collections.Counter(r.call for r in running)
    if held[head.call]:
        return None
    calls = set(held) | {r.call for r in waiting}
    share = max(1, limits.max_running_requests // len(calls))
    biggest, count = held.most_common(1)[0]
    if count <= share:
        return None
    victim = max(
        (r for r in running if r.call == biggest), key=lambda r: (r.admitted_time or 0.0, r.arrival_time)
    )
    rest = [r for r in running if r is not victim]
    fits, _, _ = select_admissions(
        [head],
        rest,
        free_tokens + freed_by_retraction(victim),
        limits,
        limits.chunk_budget,
        0,
        free_rows=None if free_rows is None else free_rows + 1,
        pinned=pinned,
    )
    return victim if fits else None


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
    # Uncached prefixes being computed now (by running prefills and by this step's admissions).
    computing = {r.prefix_group for r in running if r.prefix_group is not None}
    for req in waiting:
        if req.prefix_group is not None and req.prefix_group in computing:
            continue  # another request computes this prefix now: reuse it from the next step
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
        if req.prefix_group is not None:
            computing.add(req.prefix_group)
        adapters |= {req.adapter} if req.adapter is not None else set()
        budget -= need
        slots -= 1
        chunk_budget -= min(prefill_left(req), chunk_budget)
    return admitted, head_reason, bypass_used


def waiting_on_shared_prefix(
    waiting: Sequence[Request], running: Sequence[Request], admitted: Sequence[Request]
) -> int:
    """Waiting requests held back only because another request computes their uncached
    prefix now: they are admitted next step, so they are no backlog to batch for."""
    computing = {r.prefix_group for r in (*running, *admitted) if r.prefix_group is not None}
    if not computing:
        return 0
    taken = {id(r) for r in admitted}
    return sum(1 for r in waiting if r.prefix_group in computing and id(r) not in taken)


def plan_extend(
    running: Sequence[Request], admitted: Sequence[Request], chunk_budget: int, free_tokens: int
) -> list[tuple[Request, int]]:
    """Prefill chunks: requests already prefilling first (admission order), then new ones."""
    chunks: list[tuple[Request, int]] = []
    budget = min(chunk_budget, free_tokens)
    for req in [*(r for r in running if r.is_prefilling), *admitted]:
        if budget <= 0:
            break
        n = min(prefill_left(req), budget)
        if n > 0:
            chunks.append((req, n))
            budget -= n
    return chunks


def admission_loss(num_admissible: int, num_decoding: int, decode_seconds: float) -> float:
    """Decode output one step forgoes by leaving ``num_admissible`` requests waiting, in
    seconds of a decode step: their share of the batch they would have joined."""
    if num_admissible <= 0:
        return 0.0
    return decode_seconds * num_admissible / (num_decoding + num_admissible)


def should_defer_admission(
    *,
    num_admissible: int,
    num_waiting: int,
    num_decoding: int,
    prefilling: bool,
    deferred_steps: int,
    deferred_loss: float,
    costs: StepCosts,
    max_defer_steps: int,
) -> bool:
    """Whether to run a decode step now and admit later, in one batched extend.

    Only under a backlog (more waiting than can be admitted now), with requests decoding
    and none mid-prefill, once both step costs are known; while the forgone decode output
    (``deferred_loss`` so far plus this step's) stays below one extend step's fixed cost,
    for at most ``max_defer_steps`` steps in a row.
    """
    if num_admissible <= 0 or num_decoding <= 0 or prefilling:
        return False
    if num_waiting <= num_admissible or deferred_steps >= max_defer_steps:
        return False
    decode_s, fixed_s = costs.decode_seconds, costs.extend_fixed_seconds
    if decode_s is None or fixed_s is None:
        return False
    return deferred_loss + admission_loss(num_admissible, num_decoding, decode_s) < fixed_s


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
        free_tokens += freed_by_retraction(req)
        if not req.is_prefilling:
            need -= tokens_per_request
    return victims


class Scheduler:
    """Plans steps; keeps only the alternation and head-overtake counters."""

    def __init__(self, limits: SchedulerLimits, costs: StepCosts | None = None) -> None:
        self.limits = limits
        self.costs = costs or StepCosts()
        self._last_kind = StepKind.IDLE
        self._bypass_used = 0
        self._head: Request | None = None
        self._deferred_steps = 0
        self._deferred_loss = 0.0

    def observe_step(self, kind: StepKind, seconds: float, prefilled_tokens: int = 0) -> None:
        """What a step of the last plan cost (decoder seconds); feeds :attr:`costs`."""
        if kind is StepKind.DECODE:
            self.costs.observe_decode(seconds)
        elif kind is StepKind.EXTEND:
            self.costs.observe_extend(seconds, prefilled_tokens)

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
        decoding = [r for r in running if not r.is_prefilling]
        prefilling = [r for r in running if r.is_prefilling]

        prefer_decode = bool(decoding) and self._last_kind is StepKind.EXTEND
        if not prefer_decode:
            # Admission order, fair across API calls; the head's place is tracked in it.
            waiting = fair_order(waiting, running, limit=limits.max_running_requests + limits.max_head_bypass)
            if waiting and waiting[0] is not self._head:
                self._head, self._bypass_used = waiting[0], 0
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
            if not admitted and reason is BlockReason.MAX_RUNNING:
                victim = fair_preemption(
                    waiting, running, limits, free_tokens, free_rows=free_rows, pinned=pinned
                )
                if victim is not None:
                    return StepPlan(StepKind.IDLE, retract=[victim], head_blocked=reason)
            chunks = plan_extend(running, admitted, limits.chunk_budget, free_tokens)
            admitted = [r for r in admitted if any(c[0] is r for c in chunks)]
            defer = should_defer_admission(
                num_admissible=len(admitted),
                num_waiting=len(waiting) - waiting_on_shared_prefix(waiting, running, admitted),
                num_decoding=len(decoding),
                prefilling=bool(prefilling),
                deferred_steps=self._deferred_steps,
                deferred_loss=self._deferred_loss,
                costs=self.costs,
                max_defer_steps=limits.max_admission_defer_steps,
            )
            if chunks and not defer:
                self._bypass_used = bypass
                self._last_kind = StepKind.EXTEND
                self._deferred_steps, self._deferred_loss = 0, 0.0
                return StepPlan(StepKind.EXTEND, admit=admitted, extend=chunks, head_blocked=reason)
            if not defer:  # nothing admissible: a later wait starts afresh
                self._deferred_steps, self._deferred_loss = 0, 0.0
            else:
                plan = self._decode_plan(running, decoding, free_tokens)
                if plan.kind is StepKind.DECODE:
                    self._deferred_steps += 1
                    self._deferred_loss += admission_loss(
                        len(admitted), len(plan.decode), self.costs.decode_seconds or 0.0
                    )
                    plan.deferred = True
                    plan.head_blocked = reason
                return plan
            if not decoding and prefilling and free_tokens <= 0 and len(running) > 1:
                # Prefill cannot proceed and nothing decodes: free the newest request's KV.
                newest = max(running, key=lambda r: (r.admitted_time or 0.0, r.arrival_time))
                return StepPlan(StepKind.IDLE, retract=[newest], head_blocked=reason)
        if decoding:
            return self._decode_plan(running, decoding, free_tokens)
        self._last_kind = StepKind.IDLE
        return StepPlan(StepKind.IDLE)

    def _decode_plan(
        self, running: Sequence[Request], decoding: Sequence[Request], free_tokens: int
    ) -> StepPlan:
        victims = plan_retractions(running, free_tokens, self.limits.decode_tokens_per_step)
        batch = [r for r in decoding if all(r is not v for v in victims)]
        if not batch:  # only prefilling requests remain: they continue next step
            return StepPlan(StepKind.IDLE, retract=victims)
        self._last_kind = StepKind.DECODE
        return StepPlan(StepKind.DECODE, decode=batch, retract=victims)
