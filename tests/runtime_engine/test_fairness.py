"""Fair admission across API calls: one call of many choices (prompts × n) does not hold
back a small call sent beside it. Counted in engine steps, never wall time."""

from __future__ import annotations

import itertools
import time

from loraserve.runtime.engine.request import Request, RequestState
from loraserve.runtime.engine.scheduler import SchedulerLimits, fair_order, fair_preemption
from loraserve.runtime.sampling import SamplingParams

from .conftest import StepRecorder, engine_config, make_request, wait_all

_clock = itertools.count()


def _waiting(group: str | None) -> Request:
    r = Request(
        rid=f"f{next(_clock)}",
        prompt_ids=[1, 2, 3],
        params=SamplingParams(),
        max_new_tokens=4,
        arrival_time=float(next(_clock)),
        group=group,
    )
    r.state = RequestState.WAITING
    return r


def test_fair_order_round_robin():
    """Fair order is round robin between calls least served first."""
    big = [_waiting("big") for _ in range(5)]
    small = _waiting("small")
    single = _waiting(None)
    queue = [*big, small, single]
    # Nothing running: calls take turns in order of their first waiting request.
    assert fair_order(queue, []) == [big[0], small, single, big[1], big[2], big[3], big[4]]
    # The big call already holds two running slots: the others go first.
    running = [_waiting("big"), _waiting("big")]
    assert fair_order(queue, running)[:3] == [small, single, big[0]]
    # Only the first places are interleaved; the rest keep their arrival order.
    assert fair_order(queue, [], limit=3) == [big[0], small, single, big[1], big[2], big[3], big[4]]
    assert fair_order(queue, running, limit=1) == [small, *big, single]
    # Requests that are each their own call keep their arrival order.
    singles = [_waiting(None) for _ in range(4)]
    assert fair_order(singles, []) == singles
    assert fair_order(singles, [_waiting(None)]) == singles


def _running(group: str | None, t: float, adapter: str | None = None) -> Request:
    r = _waiting(group)
    r.adapter = adapter
    r.state = RequestState.RUNNING
    r.admitted_time = t
    r.prefill_target = r.num_tokens
    r.num_cached = r.num_tokens
    return r


def test_fair_preemption_no_thrash():
    """Fair preemption frees one slot of the call over its share and never thrashes."""
    limits = SchedulerLimits(
        max_running_requests=4, max_loras_per_batch=1, chunked_prefill_size=64, max_prefill_tokens=64
    )
    big = [_running("big", float(t)) for t in range(4)]
    small = _waiting("small")
    # The newest request of the call over its share (4 > 4 // 2) gives back its slot.
    assert fair_preemption([small], big, limits, free_tokens=1000) is big[-1]
    # Not while a slot is free, nor for a call that already runs something.
    assert fair_preemption([small], big[:3], limits, free_tokens=1000) is None
    assert fair_preemption([_waiting("big")], big, limits, free_tokens=1000) is None
    # Calls of one request each never preempt one another.
    singles = [_running(None, float(t)) for t in range(4)]
    assert fair_preemption([_waiting(None)], singles, limits, free_tokens=1000) is None
    # Not when the waiting request could not start anyway (its adapter needs a slot that a
    # running adapter holds, or the KV cache is short): that would only churn.
    with_adapter = [_running("big", float(t), adapter="a") for t in range(4)]
    other = _waiting("small")
    other.adapter = "b"
    assert fair_preemption([other], with_adapter, limits, free_tokens=1000) is None
    assert fair_preemption([small], big, limits, free_tokens=-1000) is None


def test_small_call_finishes_bounded(engine_assets, start_engine):
    """A big call (24 choices × 40 tokens on 4 running slots) is running when a small call
    (8 tokens) arrives: one of the big call's requests gives back its slot, so the small one
    starts at once and ends within about its own length (measured: 16 steps; round-robin
    alone, waiting for a big choice to end: 45; before, behind every queued choice of the
    big call: 245). The retracted choice is recomputed: every big output is unchanged."""
    recorder = StepRecorder()
    engine = start_engine(engine_config(engine_assets, max_running_requests=4), observer=recorder)
    big_tokens, small_tokens = 40, 8
    big = []
    for _ in range(24):
        r, c = make_request(list(range(3, 10)), max_tokens=big_tokens)
        r.group = "cmpl-big"
        engine.submit(r)
        big.append(c)
    while not any(len(c.token_ids) >= 2 for c in big):  # the big call is decoding
        time.sleep(0.001)
    small, done = make_request(list(range(20, 27)), max_tokens=small_tokens)
    small.group = "cmpl-small"
    at_finish: list[int] = []
    inner = done.sink

    def sink(out, _inner=inner):
        if out.finished:
            at_finish.append(len(recorder.steps))
        _inner(out)

    small.sink = sink
    submitted_at = len(recorder.steps)
    engine.submit(small)
    wait_all([done], timeout=300)
    assert done.finish_reason == "length" and len(done.token_ids) == small_tokens
    steps = at_finish[0] - submitted_at
    # The small call's own tokens, the extend steps that may alternate with its decoding,
    # the batched-admission wait (max_admission_defer_steps, 8) and a step of slack.
    bound = 2 * small_tokens + 8 + 4
    print(f"small call: {steps} engine steps (bound {bound})")
    assert steps <= bound, f"the small call took {steps} engine steps (bound {bound})"
    wait_all(big, timeout=300)
    assert all(c.finish_reason == "length" and len(c.token_ids) == big_tokens for c in big)
    assert recorder.retractions >= 1, "a big choice gave back its slot"
    assert all(c.token_ids == big[0].token_ids for c in big), (
        "same prompt, greedy: same output, retracted or not"
    )
