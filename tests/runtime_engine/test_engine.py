"""The engine with the real model runner: continuous batching changes nothing a request
gets (greedy), limits hold at every step, KV pressure waits or retracts, failures stay in
their request, aborts and shutdown release everything."""

from __future__ import annotations

import random
import time

import pytest

from loraserve.runtime.engine import Engine, EngineClosedError, EngineError, StandardDecoder
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import Sampler

from .conftest import StepRecorder, engine_config, make_request, wait_all

ADAPTERS = [None, "sql-r8", "chat-r16", "third"]


class RecordingDecoder(StandardDecoder):
    """The standard decoder, recording every batch it runs."""

    def __init__(self, runner, sampler):
        super().__init__(runner, sampler)
        self.batches: list[tuple[str, list[str | None], list[int]]] = []

    def extend(self, chunks):
        self.batches.append(("extend", [r.adapter for r, _ in chunks], [n for _, n in chunks]))
        return super().extend(chunks)

    def step(self, requests):
        self.batches.append(("decode", [r.adapter for r in requests], [1] * len(requests)))
        return super().step(requests)


def _workload(seed: int, n: int, vocab: int = 500) -> list[tuple[list[int], str | None, int]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 70))],
            ADAPTERS[i % len(ADAPTERS)],
            rng.randrange(4, 30),
        )
        for i in range(n)
    ]


def _alone(engine, work) -> list[list[int]]:
    out = []
    for prompt, adapter, max_tokens in work:
        r, c = make_request(prompt, adapter, max_tokens=max_tokens)
        engine.submit(r)
        wait_all([c])
        assert c.finish_reason == "length"
        out.append(c.token_ids)
    return out


def _together(engine, work, waves: int = 3) -> list:
    collected = []
    per_wave = (len(work) + waves - 1) // waves
    for w in range(waves):
        for prompt, adapter, max_tokens in work[w * per_wave : (w + 1) * per_wave]:
            r, c = make_request(prompt, adapter, max_tokens=max_tokens)
            engine.submit(r)
            collected.append(c)
        time.sleep(0.05)  # later waves join a running batch
    wait_all(collected)
    return collected


def test_batching_matches_alone(engine_assets):
    """Continuous batching gives each request what it gets alone."""
    cfg = engine_config(engine_assets, max_loras_per_batch=2, max_running_requests=6, chunked_prefill_size=16)
    runner = ModelRunner(cfg)
    decoder = RecordingDecoder(runner, Sampler())
    engine = Engine(cfg, runner, decoder=decoder)
    engine.start()
    try:
        work = _workload(1, 16)
        alone = _alone(engine, work)
        decoder.batches.clear()
        together = _together(engine, work)
        assert [c.token_ids for c in together] == alone
        assert all(c.finish_reason == "length" for c in together)
        for kind, adapters, sizes in decoder.batches:
            assert len({a for a in adapters if a is not None}) <= 2, (kind, adapters)
            assert len(adapters) <= 6
            if kind == "extend":
                assert sum(sizes) <= 16
        assert max(len(a) for k, a, _ in decoder.batches if k == "decode") > 1, "requests were batched"
        mixed = [a for k, a, _ in decoder.batches if k == "decode" and None in a and len(set(a)) > 1]
        assert mixed, "base and adapter requests shared a decode batch"
        assert engine.kv.num_free_tokens == engine.kv.capacity
    finally:
        engine.shutdown(2.0)


def test_chunk_size_does_not_change_outputs(engine_assets, start_engine):
    work = _workload(2, 6)
    big = start_engine(engine_config(engine_assets, chunked_prefill_size=4096))
    small = start_engine(engine_config(engine_assets, chunked_prefill_size=5, max_prefill_tokens=7))
    assert [c.token_ids for c in _together(small, work)] == _alone(big, work)


def test_kv_pressure_keeps_outputs(engine_assets, start_engine):
    """KV pressure waits and retracts without changing outputs."""
    work = [(p[:20] + [7] * max(0, 20 - len(p)), a, 40) for p, a, _ in _workload(3, 8)]
    reference = _alone(start_engine(engine_config(engine_assets)), work)
    recorder = StepRecorder()
    tight = start_engine(
        engine_config(engine_assets, max_total_tokens=160, max_running_requests=8), observer=recorder
    )
    together = _together(tight, work, waves=1)
    assert [c.token_ids for c in together] == reference
    assert recorder.retractions > 0, "the cache was too small for everyone: someone had to be retracted"
    assert tight.kv.num_free_tokens == tight.kv.capacity


def test_unfittable_request_refused(engine_assets, start_engine):
    """A request that can never fit is refused with the fix."""
    engine = start_engine(engine_config(engine_assets, max_total_tokens=160))
    r, _ = make_request(list(range(3, 103)), max_tokens=100)
    with pytest.raises(EngineError) as info:
        engine.submit(r)
    assert info.value.error.param == "max_tokens"
    assert "--max-total-tokens" in info.value.error.message
    # Without max_tokens the request is capped to what fits, and runs.
    r, c = make_request(list(range(3, 103)))
    engine.submit(r)
    wait_all([c])
    assert c.finish_reason == "length" and len(c.token_ids) == 160 - 100


def test_generation_stops_at_the_context_length(engine_assets, start_engine):
    engine = start_engine(engine_config(engine_assets))
    n = engine.context_len - 6
    r, c = make_request([5 + i % 400 for i in range(n)])
    engine.submit(r)
    wait_all([c])
    assert c.finish_reason == "length" and len(c.token_ids) == 6


class FaultyDecoder(StandardDecoder):
    """Fails any decode batch that holds the poisoned request after its third token."""

    poisoned: str | None = None

    def step(self, requests):
        if any(r.rid == self.poisoned and len(r.output_ids) >= 3 for r in requests):
            raise RuntimeError("injected fault")
        return super().step(requests)


def test_a_failing_request_fails_alone(engine_assets):
    cfg = engine_config(engine_assets)
    runner = ModelRunner(cfg)
    decoder = FaultyDecoder(runner, Sampler())
    engine = Engine(cfg, runner, decoder=decoder)
    engine.start()
    try:
        work = _workload(4, 6)
        reference = _alone(engine, work)
        collected, poisoned = [], None
        for i, (prompt, adapter, max_tokens) in enumerate(work):
            r, c = make_request(prompt, adapter, max_tokens=max_tokens)
            if i == 2:
                decoder.poisoned, poisoned = r.rid, c
            engine.submit(r)
            collected.append(c)
        wait_all(collected)
        assert poisoned.finish_reason == "error" and "injected fault" in poisoned.error.message
        assert poisoned.error.status == 500
        for i, c in enumerate(collected):
            if c is not poisoned:
                assert c.token_ids == reference[i] and c.finish_reason == "length"
        assert engine.kv.num_free_tokens == engine.kv.capacity
    finally:
        engine.shutdown(2.0)


def test_abort_releases_kv_and_the_adapter(engine_assets, start_engine):
    engine = start_engine(engine_config(engine_assets))
    r, c = make_request(list(range(3, 30)), "chat-r16", max_tokens=500)
    other, oc = make_request(list(range(3, 30)), "chat-r16", max_tokens=20)
    engine.submit(r)
    engine.submit(other)
    while len(c.token_ids) < 3:
        time.sleep(0.005)
    engine.abort(r.rid)
    wait_all([c, oc])
    assert c.finish_reason == "abort" and len(c.token_ids) < 500
    assert oc.finish_reason == "length" and len(oc.token_ids) == 20
    assert engine.kv.num_free_tokens == engine.kv.capacity
    info = next(i for i in engine.list_adapters() if i.name == "chat-r16")
    assert info.refcount == 0


def test_unloading_adapter_drains(engine_assets, start_engine):
    """Unloading adapter refuses new requests and finishes running ones."""
    engine = start_engine(engine_config(engine_assets))
    r, c = make_request(list(range(3, 20)), "sql-r8", max_tokens=60)
    engine.submit(r)
    while not c.token_ids:
        time.sleep(0.005)
    engine.unload_adapter("sql-r8")
    late, _ = make_request(list(range(3, 20)), "sql-r8", max_tokens=5)
    with pytest.raises(EngineError) as info:
        engine.submit(late)
    assert info.value.error.status == 404 and info.value.error.param == "model"
    wait_all([c])
    assert c.finish_reason == "length" and len(c.token_ids) == 60
    assert all(i.name != "sql-r8" for i in engine.list_adapters())


def test_seeded_sampling_batch_free(engine_assets, start_engine):
    """Seeded sampling in the engine does not depend on the batch."""
    engine = start_engine(engine_config(engine_assets))
    prompt = list(range(10, 40))

    def sampled(seed):
        r, c = make_request(prompt, "third", max_tokens=24, temperature=0.9, top_k=50, seed=seed)
        return r, c

    r, alone = sampled(42)
    engine.submit(r)
    wait_all([alone])
    noise = []
    for i in range(5):
        nr, nc = make_request(list(range(20 + i, 50)), ADAPTERS[i % 4], max_tokens=30, temperature=1.0)
        engine.submit(nr)
        noise.append(nc)
    r, batched = sampled(42)
    engine.submit(r)
    r2, other_seed = sampled(7)
    engine.submit(r2)
    wait_all([batched, other_seed, *noise])
    assert batched.token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids


def test_stop_tokens_end_with_reason_stop(engine_assets, start_engine, tokenizer):
    engine = start_engine(engine_config(engine_assets), tokenizer=tokenizer)
    prompt = tokenizer.encode("def main():")
    r, ref = make_request(prompt, max_tokens=12)
    engine.submit(r)
    wait_all([ref])
    stop_id = ref.token_ids[4]
    r, c = make_request(prompt, max_tokens=12, stop_token_ids=(stop_id,))
    engine.submit(r)
    wait_all([c])
    cut = ref.token_ids.index(stop_id)
    assert c.finish_reason == "stop"
    assert c.token_ids == ref.token_ids[: cut + 1]
    assert c.text == tokenizer.decode(ref.token_ids[:cut])


def test_shutdown_drains_then_aborts(engine_assets, start_engine):
    """Shutdown drains then aborts and refuses new work."""
    engine = start_engine(engine_config(engine_assets))
    short, sc = make_request(list(range(3, 10)), max_tokens=5)
    engine.submit(short)
    # Eight requests to the context's end: thousands of steps, never done within the drain.
    longs = [make_request(list(range(3 + i, 10 + i)), max_tokens=1000) for i in range(8)]
    for req, _ in longs:
        engine.submit(req)
    engine.shutdown(drain_timeout_s=0.3)
    wait_all([sc, *(c for _, c in longs)], timeout=10)
    assert sc.finish_reason == "length"
    assert [c.finish_reason for _, c in longs] == ["abort"] * len(longs)
    late, _ = make_request([3, 4, 5], max_tokens=2)
    with pytest.raises(EngineClosedError):
        engine.submit(late)


def _backlog(engine, work) -> list:
    collected = []
    for prompt, adapter, max_tokens in work:
        r, c = make_request(prompt, adapter, max_tokens=max_tokens)
        engine.submit(r)
        collected.append(c)
    wait_all(collected)
    return [c.token_ids for c in collected]


def test_batched_admission_saves_extends(engine_assets, start_engine):
    """With extends made expensive in the engine's learnt costs (as an eager forward is on
    a GPU), a backlog is admitted in batches: fewer extend steps interrupt decoding, every
    output stays the same, and the counters in the snapshot add up."""
    work = [(p, a, 4 + (7 * i) % 27) for i, (p, a, _) in enumerate(_workload(7, 14))]  # staggered ends
    cfg = engine_config(engine_assets, max_running_requests=4)
    eager_cfg = engine_config(engine_assets, max_running_requests=4)
    eager_cfg.scheduler.max_admission_defer_steps = 0  # from the configuration (--max-admission-defer-steps)
    eager = start_engine(eager_cfg)
    batched = start_engine(cfg, max_admission_defer_steps=3)  # an explicit override
    assert (eager.limits.max_admission_defer_steps, batched.limits.max_admission_defer_steps) == (0, 3)
    for tokens in (16, 256):
        batched.scheduler.costs.observe_extend(10.0, tokens)  # seconds: far above any decode step
    want = _backlog(eager, work)
    assert _backlog(batched, work) == want

    a, b = eager.snapshot, batched.snapshot
    assert a.deferred_admission_steps == 0 and b.deferred_admission_steps > 0
    assert b.extends_during_decode < a.extends_during_decode
    for snap in (a, b):
        generated = sum(len(t) for t in want)
        # Every request's first token comes from its prefill, the rest from decode steps.
        assert snap.decode.tokens == generated - len(work)
        assert snap.extend.tokens == sum(len(p) for p, _, _ in work)
        assert snap.extend.requests == len(work) and snap.extend.steps <= len(work)
        assert snap.max_running_requests == 4 and 0 < snap.decode_occupancy <= 1
        assert snap.decode.mean_batch == pytest.approx(snap.decode.requests / snap.decode.steps)
        assert snap.decode.seconds > 0 and snap.extend.seconds > 0 and snap.engine_seconds > 0
        assert snap.steps == snap.extend.steps + snap.decode.steps
