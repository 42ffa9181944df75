"""Fair admission across API calls: one call of many choices (prompts × n) does not hold
back a small call sent beside it. Counted in engine steps, never wall time."""

from __future__ import annotations

import itertools
import time

from loraserve.runtime.engine.request import Request, RequestState
from loraserve.runtime.engine.scheduler import fair_order
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


def test_fair_order_is_round_robin_between_calls_least_served_first():
    big = [_waiting("big") for _ in range(5)]
    small = _waiting("small")
    single = _waiting(None)
    queue = [*big, small, single]
    # Nothing running: calls take turns in order of their first waiting request.
    assert fair_order(queue, []) == [big[0], small, single, big[1], big[2], big[3], big[4]]
    # The big call already holds two running slots: the others go first.
    running = [_waiting("big"), _waiting("big")]
    assert fair_order(queue, running)[:3] == [small, single, big[0]]
    # Requests that are each their own call keep their arrival order.
    singles = [_waiting(None) for _ in range(4)]
    assert fair_order(singles, []) == singles
    assert fair_order(singles, [_waiting(None)]) == singles


def test_a_small_call_beside_a_big_one_finishes_within_a_bounded_number_of_steps(engine_assets, start_engine):
    """A big call (24 choices × 40 tokens on 4 running slots) is running when a small call
    (8 tokens) arrives: the small one runs at the first free slot and ends within one big
    choice's length plus its own, not after every queued choice of the big call (before:
    ~6 waves of 40 steps)."""
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
    # One big choice's decode (slots free when it ends), the extend steps that alternate with
    # decoding, the batched-admission wait (max_admission_defer_steps, 8) and the small
    # call's own tokens.
    bound = big_tokens + 8 + 2 * small_tokens + 4
    print(f"small call: {steps} engine steps (bound {bound})")
    assert steps <= bound, f"the small call took {steps} engine steps (bound {bound})"
    wait_all(big, timeout=300)
    assert all(c.finish_reason == "length" and len(c.token_ids) == big_tokens for c in big)
