"""The continuous-batching policy, as pure functions over request views."""

from __future__ import annotations

import itertools
import random

import pytest

from loraserve.runtime.engine.costs import StepCosts
from loraserve.runtime.engine.request import Request, RequestState
from loraserve.runtime.engine.scheduler import (
    BlockReason,
    Scheduler,
    SchedulerLimits,
    StepKind,
    plan_retractions,
    select_admissions,
    should_defer_admission,
)
from loraserve.runtime.sampling import SamplingParams

_clock = itertools.count()


def req(prompt_len: int = 8, adapter: str | None = None, max_new: int = 8) -> Request:
    r = Request(
        rid=f"r{next(_clock)}",
        prompt_ids=[1] * prompt_len,
        params=SamplingParams(),
        adapter=adapter,
        max_new_tokens=max_new,
        arrival_time=float(next(_clock)),
    )
    r.state = RequestState.WAITING
    return r


def running(r: Request, *, decoding: bool = True, t: float | None = None) -> Request:
    r.state = RequestState.RUNNING
    r.admitted_time = t if t is not None else float(next(_clock))
    r.prefill_target = r.num_tokens
    if decoding:
        r.output_ids.append(2)
        r.num_cached = r.num_tokens - 1
    return r


def limits(**kw) -> SchedulerLimits:
    base = dict(
        max_running_requests=8,
        max_loras_per_batch=2,
        chunked_prefill_size=64,
        max_prefill_tokens=64,
        new_token_ratio=0.0,
    )
    base.update(kw)
    return SchedulerLimits(**base)


def test_fifo_stops_at_unfit_head():
    """Fifo admission stops at a head that does not fit the KV budget."""
    waiting = [req(10), req(100), req(5)]
    admitted, reason, _ = select_admissions(
        waiting, [], free_tokens=60, limits=limits(), chunk_budget=64, bypass_used=0
    )
    assert admitted == waiting[:1]
    assert reason is BlockReason.KV  # the small third request does not overtake the second


def test_running_and_rows_cap_admission():
    """Max running requests and free rows cap admission."""
    waiting = [req(4) for _ in range(6)]
    admitted, reason, _ = select_admissions(
        waiting, [running(req(4))], 10_000, limits(max_running_requests=3), 64, 0
    )
    assert len(admitted) == 2 and reason is BlockReason.MAX_RUNNING
    admitted, _, _ = select_admissions(waiting, [], 10_000, limits(), 64, 0, free_rows=1)
    assert len(admitted) == 1


def test_adapter_limit_counts_pinned():
    """Adapter limit counts running and pinned adapters."""
    run = [running(req(4, "a")), running(req(4, "b"))]
    waiting = [req(4, "c"), req(4, "a"), req(4, None), req(4, "d")]
    admitted, reason, used = select_admissions(waiting, run, 10_000, limits(), 64, 0)
    # c needs a third slot: blocked; a (active) and base (no slot) overtake it; d is blocked too.
    assert admitted == [waiting[1], waiting[2]]
    assert reason is BlockReason.ADAPTERS and used == 2
    # A pinned adapter holds a slot although nothing runs on it.
    admitted, reason, _ = select_admissions(
        [req(4, "x"), req(4, "y")], [], 10_000, limits(), 64, 0, pinned=frozenset({"p"})
    )
    assert [r.adapter for r in admitted] == ["x"] and reason is BlockReason.ADAPTERS


def test_blocked_head_overtaken_bounded():
    """A blocked head is overtaken a bounded number of times."""
    lim = limits(max_head_bypass=3, max_running_requests=64)
    sched = Scheduler(lim)
    run = [running(req(4, "a")), running(req(4, "b"))]
    head = req(4, "c")
    waiting = [head] + [req(4, "a") for _ in range(10)]
    plan = sched.plan(waiting, run, free_tokens=10_000)
    assert plan.kind is StepKind.EXTEND and len(plan.admit) == 3
    admitted_total = 3
    for r in plan.admit:
        waiting.remove(r)
        run.append(running(r))
    for _ in range(4):  # later steps admit nothing more past the head
        plan = sched.plan(waiting, run, free_tokens=10_000)
        admitted_total += len(plan.admit)
    assert admitted_total == 3
    # Once an adapter's requests finish, the head goes first.
    run = [r for r in run if r.adapter != "b"]
    plan = sched.plan(waiting, run, free_tokens=10_000)
    assert plan.admit[0] is head


def test_chunked_prefill_budget():
    """Chunked prefill respects the budget and continues first."""
    sched = Scheduler(limits(chunked_prefill_size=16, max_prefill_tokens=64))
    long = req(40)
    short = req(5)
    plan = sched.plan([long, short], [], free_tokens=10_000)
    assert plan.extend == [(long, 16)] and plan.admit == [long]
    long.state = RequestState.RUNNING
    long.prefill_target = long.num_tokens
    long.num_cached = 16
    plan = sched.plan([short], [long], free_tokens=10_000)
    assert plan.extend == [(long, 16)] and plan.admit == []
    long.num_cached = 32
    plan = sched.plan([short], [long], free_tokens=10_000)
    assert plan.extend == [(long, 8), (short, 5)] and plan.admit == [short]


def test_extend_and_decode_alternate():
    """Extend and decode alternate when both have work."""
    sched = Scheduler(limits())
    dec = running(req(4))
    kinds = []
    waiting = [req(4) for _ in range(3)]
    for _ in range(6):
        plan = sched.plan(waiting, [dec], free_tokens=10_000)
        kinds.append(plan.kind)
        if plan.kind is StepKind.EXTEND:
            waiting = [w for w in waiting if w not in plan.admit][:]
            # keep one new arrival pending so extend work never runs out
            waiting.append(req(4))
    assert kinds == [StepKind.EXTEND, StepKind.DECODE] * 3


def test_decode_retracts_newest_first():
    """Decode retracts newest first and never the last request."""
    old, mid, new = (running(req(10), t=float(i)) for i in (1, 2, 3))
    # Each holds 10 tokens; a step of 8 tokens per request needs 24, 0 are free.
    victims = plan_retractions([old, mid, new], free_tokens=0, tokens_per_request=8)
    assert victims == [new, mid]
    assert plan_retractions([old, mid, new], free_tokens=1, tokens_per_request=1) == [new]
    assert plan_retractions([old], free_tokens=0, tokens_per_request=1) == []
    assert plan_retractions([old, mid], free_tokens=2, tokens_per_request=1) == []


def test_kv_reserve_counts_growth():
    """KV reserve counts running requests expected growth."""
    run = [running(req(4, max_new=100))]
    waiting = [req(4, max_new=100)]
    lim = limits(new_token_ratio=0.5)
    # The running request reserves ceil(0.5 * 99) = 50; the candidate needs 4 + 50.
    assert select_admissions(waiting, run, 103, lim, 64, 0)[0] == []
    assert select_admissions(waiting, run, 104, lim, 64, 0)[0] == waiting


@pytest.mark.parametrize("field", ["max_running_requests", "max_loras_per_batch", "chunked_prefill_size"])
def test_limits_reject_nonsense(field):
    with pytest.raises(ValueError, match=field):
        limits(**{field: 0})


def test_empty_decode_is_idle():
    """A decode step with nothing left to decode is idle."""
    sched = Scheduler(limits())
    old_prefill = running(req(30), decoding=False, t=1.0)
    old_prefill.num_cached = 10
    new_decode = running(req(10), t=2.0)
    assert sched.plan([req(4)], [new_decode], free_tokens=100).kind is StepKind.EXTEND  # decode is due next
    plan = sched.plan([], [old_prefill, new_decode], free_tokens=0)
    assert plan.kind is StepKind.IDLE and plan.retract == [new_decode]


# --------------------------------------------------------------------------- batched admission


def gpu_like_costs(decode_s: float = 0.02, fixed_s: float = 0.1, per_token_s: float = 1e-5) -> StepCosts:
    """Step costs as learnt from extends whose time is mostly fixed (an eager forward on a GPU)."""
    costs = StepCosts()
    for tokens in (128, 4096, 256, 128, 384):
        costs.observe_extend(fixed_s + per_token_s * tokens, tokens)
    for _ in range(5):
        costs.observe_decode(decode_s)
    return costs


def test_step_costs_fixed_part():
    """Step costs recover the fixed part of an extend."""
    costs = StepCosts()
    assert costs.decode_seconds is None and costs.extend_fixed_seconds is None
    rng = random.Random(0)
    for _ in range(200):
        tokens = rng.randrange(16, 4096)
        costs.observe_extend(0.09 + 2e-5 * tokens + rng.uniform(-1e-3, 1e-3), tokens)
        costs.observe_decode(0.02 + rng.uniform(-1e-3, 1e-3))
    assert costs.extend_fixed_seconds == pytest.approx(0.09, abs=0.01)
    assert costs.decode_seconds == pytest.approx(0.02, abs=0.002)
    # Extends that all carry the same tokens cannot separate fixed from per-token cost:
    # the mean counts as fixed (an upper bound).
    same = StepCosts()
    for _ in range(10):
        same.observe_extend(0.3, 512)
    assert same.extend_fixed_seconds == pytest.approx(0.3)
    # Compute-bound extends (time proportional to tokens) have no fixed part to save.
    linear = StepCosts()
    for tokens in (100, 1000, 3000, 500, 2000):
        linear.observe_extend(1e-4 * tokens, tokens)
    assert linear.extend_fixed_seconds == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="decay"):
        StepCosts(decay=1.0)


def _defer(**kw) -> bool:
    args = dict(
        num_admissible=2,
        num_waiting=10,
        num_decoding=30,
        prefilling=False,
        deferred_steps=0,
        deferred_loss=0.0,
        costs=gpu_like_costs(),
        max_defer_steps=8,
    )
    args.update(kw)
    return should_defer_admission(**args)


def test_admission_waits_under_backlog():
    """Admission waits only under a backlog while cheaper than an extend."""
    assert _defer()
    assert not _defer(num_waiting=2), "no backlog: admit at once (light load keeps its latency)"
    assert not _defer(num_decoding=0), "nothing decodes: an extend costs nobody anything"
    assert not _defer(prefilling=True), "a prefill is under way: new requests ride along"
    assert not _defer(num_admissible=0)
    assert not _defer(deferred_steps=8), "bounded wait"
    assert not _defer(costs=StepCosts()), "costs unknown yet"
    # The forgone output reached one extend's fixed cost: admit now.
    assert not _defer(deferred_loss=0.1)
    # Many free slots forgo more output per step than the fixed cost: no point waiting.
    assert not _defer(num_admissible=30, num_decoding=1, costs=gpu_like_costs(decode_s=0.2, fixed_s=0.1))
    # Compute-bound extends have no fixed part: never worth waiting for.
    assert not _defer(costs=gpu_like_costs(fixed_s=0.0, per_token_s=1e-4))


def test_batched_admission_one_extend():
    """Batched admission admits everything freed in one extend within the limit."""
    lim = limits(max_running_requests=8, max_loras_per_batch=4, max_admission_defer_steps=4)
    sched = Scheduler(lim, costs=gpu_like_costs())
    run = [running(req(4)) for _ in range(8)]
    waiting = [req(4) for _ in range(12)]
    queue = list(waiting)
    plan = sched.plan(waiting, run, free_tokens=10_000)
    assert plan.kind is StepKind.DECODE and not plan.deferred  # full: nothing to admit
    kinds = []
    for _ in range(6):
        run.pop(0)  # one request finishes per step
        plan = sched.plan(waiting, run, free_tokens=10_000)
        kinds.append((plan.kind, plan.deferred, len(plan.admit)))
        if plan.kind is StepKind.EXTEND:
            for r in plan.admit:
                waiting.remove(r)
                run.append(running(r))
            break
    # Waits while slots free up (never past the limit), then admits all of them at once.
    assert kinds[:-1] == [(StepKind.DECODE, True, 0)] * (len(kinds) - 1)
    assert len(kinds) - 1 <= 4
    assert kinds[-1][0] is StepKind.EXTEND and kinds[-1][2] == len(kinds) >= 2
    assert plan.admit == queue[: len(plan.admit)]  # the queue's oldest, in order


def test_batched_admission_off():
    """Batched admission off admits each freed slot at once."""
    sched = Scheduler(limits(max_admission_defer_steps=0), costs=gpu_like_costs())
    run = [running(req(4)) for _ in range(7)]
    plan = sched.plan([req(4) for _ in range(5)], run, free_tokens=10_000)
    assert plan.kind is StepKind.EXTEND and len(plan.admit) == 1


def test_defer_steps_not_negative():
    """Max admission defer steps must not be negative."""
    with pytest.raises(ValueError, match="max_admission_defer_steps"):
        limits(max_admission_defer_steps=-1)


# ------------------------------------------------------------------ shared uncached prefixes
def test_shared_prefix_not_prefilled_twice():
    """One request of a prefix group is admitted; the others of its group wait for its KV
    while requests outside the group (no group, another group) are admitted past them."""
    waiting = [req(8, "a"), req(8, "a"), req(8, None), req(8, "a"), req(8, "b")]
    for r in (waiting[0], waiting[1], waiting[3]):
        r.prefix_group = ("a", 0, b"system")
    waiting[4].prefix_group = ("b", 0, b"system")
    admitted, reason, used = select_admissions(waiting, [], 10_000, limits(), 64, 0)
    assert admitted == [waiting[0], waiting[2], waiting[4]]
    assert reason is BlockReason.NONE and used == 0
    # A running request still prefilling the prefix holds its group back too.
    leader = running(req(8, "a"), decoding=False)
    leader.prefix_group = ("a", 0, b"system")
    admitted, _, _ = select_admissions(waiting[1:], [leader], 10_000, limits(), 64, 0)
    assert admitted == [waiting[2], waiting[4]]


def test_prefix_waiters_not_backlog():
    """Seven followers of an admissible leader would look like a backlog and make admission
    wait for slots; they are admitted next step, so the leader goes now."""
    sched = Scheduler(limits(max_running_requests=64), costs=gpu_like_costs())
    run = [running(req(4)) for _ in range(30)]
    waiting = [req(8, "a") for _ in range(8)]
    for r in waiting:
        r.prefix_group = ("a", 0, b"system")
    plan = sched.plan(waiting, run, free_tokens=10_000)
    assert plan.kind is StepKind.EXTEND and plan.admit == waiting[:1]
    # Without groups the eight are all admissible: no backlog either, all admitted.
    for r in waiting:
        r.prefix_group = None
    plan = Scheduler(limits(max_running_requests=64), costs=gpu_like_costs()).plan(waiting, run, 10_000)
    assert plan.admit == waiting
