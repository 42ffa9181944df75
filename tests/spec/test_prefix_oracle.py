"""Prefix caching changes no output: with the cache, every request gets the tokens it gets
without it, per adapter, in mixed concurrent batches, with and without each speculative
algorithm, under chunked prefill and under retraction; a prefix cached under one adapter
is never served to another adapter or the base; a reloaded adapter never sees its old
weights' KV.

The workload is the one the cache exists for: each adapter (and the base) has its own
system prompt, requests send it with different questions, in waves (a later wave finds the
earlier waves' KV cached), and a chat resends its history plus the answer each turn.
"""

from __future__ import annotations

import threading

import pytest
import torch

from loraserve.runtime.engine import Engine, EngineObserver, Request
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.speculative import build_decoder

ADAPTERS = (None, "attn-r8", "all-r16", "mlp-r4", "emb-head")


class Hits(EngineObserver):
    def __init__(self) -> None:
        self.by_rid: dict[str, int] = {}
        self.retractions = 0

    def on_prefix_lookup(self, request, hit_tokens, query_tokens):
        self.by_rid[request.rid] = self.by_rid.get(request.rid, 0) + hit_tokens

    def on_retract(self, request):
        self.retractions += 1


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=gen).tolist()


def _waves(seed: int = 0, *, system: int = 40, question: int = 8, per_adapter: int = 2, max_tokens: int = 10):
    """Wave 0 warms each adapter's system prompt; waves 1-2 reuse it (mixed adapters,
    concurrent); a chat of three turns per adapter resends its history."""
    gen = torch.Generator().manual_seed(seed)
    systems = {a: _tokens(gen, system) for a in ADAPTERS}
    waves: list[list[tuple[str, list[int], SamplingParams, str | None]]] = []
    for w in range(3):
        wave = []
        for i, adapter in enumerate(ADAPTERS):
            for j in range(1 if w == 0 else per_adapter):
                prompt = [*systems[adapter], *_tokens(gen, question + (i + j) % 3)]
                params = SamplingParams(max_tokens=max_tokens - (i + j) % 3, temperature=0.0, ignore_eos=True)
                wave.append((f"w{w}-{i}-{j}", prompt, params, adapter))
        waves.append(wave)
    return waves


def run_waves(config, waves, *, prefix_cache: bool, chat_turns: int = 0, seed: int = 1, runner=None):
    """Each wave runs to the end before the next; then ``chat_turns`` turns of one chat per
    adapter, each resending the previous prompt, its answer and a new message."""
    config = config.copy()
    config.scheduler.prefix_cache = prefix_cache
    hits = Hits()
    engine = Engine(config, runner or ModelRunner(config), observer=hits, decoder_factory=build_decoder)
    engine.start()
    outputs: dict[str, list[int]] = {}
    try:
        for wave in waves:
            outputs.update(_run_wave(engine, wave))
        gen = torch.Generator().manual_seed(seed)
        history = {a: _tokens(gen, 30) for a in ADAPTERS}
        for turn in range(chat_turns):
            wave = [
                (f"chat{turn}-{i}", [*history[a], *_tokens(gen, 5)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), a)
                for i, a in enumerate(ADAPTERS)
            ]
            got = _run_wave(engine, wave)
            outputs.update(got)
            for (rid, prompt, _, a) in wave:
                history[a] = [*prompt, *got[rid]]
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return outputs, hits, engine


def _run_wave(engine: Engine, wave) -> dict[str, list[int]]:
    done = threading.Event()
    pending = {rid for rid, *_ in wave}
    out: dict[str, list[int]] = {rid: [] for rid in pending}
    errors: list = []
    lock = threading.Lock()

    def sink_for(rid):
        def sink(o):
            with lock:
                out[rid].extend(o.token_ids)
                if o.error is not None:
                    errors.append((rid, o.error))
                if o.finished:
                    pending.discard(rid)
                    if not pending:
                        done.set()

        return sink

    for rid, prompt, params, adapter in wave:
        engine.submit(Request(rid=rid, prompt_ids=list(prompt), params=params, adapter=adapter, sink=sink_for(rid)))
    assert done.wait(120), f"pending: {sorted(pending)}"
    assert not errors, errors
    return out


@pytest.fixture(scope="module")
def waves():
    return _waves()


@pytest.fixture(scope="module")
def baseline(make_spec_config, waves):
    """No speculation, no prefix cache: the tokens every configuration must reproduce."""
    outputs, hits, _ = run_waves(make_spec_config(), waves, prefix_cache=False, chat_turns=3)
    assert not any(hits.by_rid.values())
    return outputs


def _check(outputs, expected, hits, waves):
    assert outputs.keys() == expected.keys()
    for rid in expected:
        assert outputs[rid] == expected[rid], f"{rid} diverged with the prefix cache"
    # The cache was used: every request of waves 1-2 found its adapter's system prompt.
    for wave in waves[1:]:
        for rid, *_ in wave:
            assert hits.by_rid.get(rid, 0) >= 40, (rid, hits.by_rid.get(rid))
    for turn in (1, 2):
        for i in range(len(ADAPTERS)):
            assert hits.by_rid.get(f"chat{turn}-{i}", 0) >= 30


CASES = {
    "plain": ("NONE", None, {}),
    "plain-chunked": ("NONE", None, {"chunked_prefill_size": 16, "max_running_requests": 3}),
    "ngram": ("NGRAM", None, {"max_running_requests": 5}),
    "standalone": ("STANDALONE", "small", {"chunked_prefill_size": 16}),
    "eagle": ("EAGLE", "eagle", {}),
    "eagle3": ("EAGLE3", "eagle3", {"chunked_prefill_size": 16, "max_running_requests": 4}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cache_keeps_output(make_spec_config, waves, baseline, case):
    """Output with the cache equals output without."""
    algorithm, draft, sched = CASES[case]
    outputs, hits, engine = run_waves(make_spec_config(algorithm, draft, **sched), waves, prefix_cache=True, chat_turns=3)
    _check(outputs, baseline, hits, waves)
    if algorithm == "STANDALONE":  # the draft (no draft adapters) keeps a prefix cache of its own
        assert engine.decoder.drafter.runner.kv.num_cached_tokens > 0


def test_retraction_with_cache(make_spec_config):
    """A pool too small for the running set: requests are retracted (their KV cached) and
    resume from it; cached prefixes are evicted to make room."""
    waves = _waves(3, system=24, question=4, max_tokens=20)
    expected, _, _ = run_waves(make_spec_config(), waves, prefix_cache=False)
    config = make_spec_config(max_total_tokens=150, max_running_requests=10, chunked_prefill_size=32)
    outputs, hits, engine = run_waves(config, waves, prefix_cache=True)
    assert outputs == expected
    assert hits.retractions > 0
    assert engine.kv.prefix_evicted_tokens > 0
    assert sum(hits.by_rid.values()) > 0


def test_sampled_requests_get_the_same_tokens(make_spec_config):
    """Seeded sampling draws the same numbers with or without the cache."""
    gen = torch.Generator().manual_seed(5)
    system = _tokens(gen, 30)
    waves = [
        [
            (f"s{w}-{i}", [*system, *_tokens(gen, 6)], SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=10 * w + i), a)
            for i, a in enumerate(ADAPTERS)
        ]
        for w in range(2)
    ]
    off, _, _ = run_waves(make_spec_config(), waves, prefix_cache=False)
    on, hits, _ = run_waves(make_spec_config(), waves, prefix_cache=True)
    assert on == off
    assert all(hits.by_rid[rid] >= 30 for rid, *_ in waves[1])


def test_prefix_isolated_per_adapter(make_spec_config):
    """The same prompt under every adapter and the base, one after another: nothing hits
    (each key's tree is its own), and each output equals what it is without the cache.
    Fails if the key ignored the adapter: the later requests would reuse the first's KV."""
    gen = torch.Generator().manual_seed(9)
    prompt = _tokens(gen, 48)
    waves = [
        [(f"x{i}", [*prompt, *_tokens(gen, 4)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), a)]
        for i, a in enumerate(ADAPTERS)
    ]
    off, _, _ = run_waves(make_spec_config(), waves, prefix_cache=False)
    on, hits, _ = run_waves(make_spec_config(), waves, prefix_cache=True)
    assert all(hits.by_rid.get(f"x{i}", 0) == 0 for i in range(len(ADAPTERS))), hits.by_rid
    assert on == off
    # ... while the same adapter does hit its own prefix
    again = [[(f"y{i}", [*prompt, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), a)] for i, a in enumerate(ADAPTERS)]
    _, hits2, _ = run_waves(make_spec_config(), [*waves, *again], prefix_cache=True)
    assert all(hits2.by_rid[f"y{i}"] == 48 for i in range(len(ADAPTERS)))


def test_reloaded_adapter_drops_old_kv(make_spec_config, spec_assets):
    """``tenant`` is loaded from one adapter, serves a prompt (cached; a repeated load of
    the same adapter keeps it), is unloaded and loaded again from other weights under the
    same name: the next request misses and gets what the new weights give without any
    cache, and the one after hits the new weights' KV."""
    config = make_spec_config()
    config.scheduler.prefix_cache = True
    config.lora.max_loaded_loras = len(config.lora.adapters) + 1
    gen = torch.Generator().manual_seed(13)
    prompt = _tokens(gen, 40)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    hits = Hits()
    engine = Engine(config, ModelRunner(config), observer=hits, decoder_factory=build_decoder)
    engine.start()
    try:
        engine.load_adapter("tenant", spec_assets.adapters["all-r16"])
        engine.refresh_adapters()
        _run_wave(engine, [("old", [*prompt, 1], params, "tenant")])
        assert engine.kv.num_cached_tokens > 0
        _run_wave(engine, [("old-again", [*prompt, 2], params, "tenant")])
        assert hits.by_rid["old-again"] == 40
        engine.load_adapter("tenant", spec_assets.adapters["all-r16"])  # idempotent: same weights
        _run_wave(engine, [("old-third", [*prompt, 5], params, "tenant")])
        assert hits.by_rid["old-third"] == 40
        engine.unload_adapter("tenant")
        engine.load_adapter("tenant", spec_assets.adapters["attn-r8"])
        new = _run_wave(engine, [("new", [*prompt, 3], params, "tenant")])
        assert hits.by_rid.get("new", 0) == 0
        # the new weights' KV is cached in turn
        again = _run_wave(engine, [("new-again", [*prompt, 4], params, "tenant")])
        assert hits.by_rid["new-again"] == 40
        expected = _run_wave(engine, [("ref", [*prompt, 3], params, "attn-r8"), ("ref2", [*prompt, 4], params, "attn-r8")])
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    assert new["new"] == expected["ref"]
    assert again["new-again"] == expected["ref2"]


def test_prompt_logprobs_full_prefill(make_spec_config):
    """A request asking for prompt logprobs gets them for every position, as without the
    cache: it reuses nothing (its KV is still cached for the next request)."""
    gen = torch.Generator().manual_seed(17)
    prompt = _tokens(gen, 30)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with_logprobs = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    waves = [
        [("warm", [*prompt, 1], greedy, "all-r16")],
        [("lp", [*prompt, 2], with_logprobs, "all-r16")],
        [("after", [*prompt, 2, 5], greedy, "all-r16")],
    ]
    off, _, _ = run_waves(make_spec_config(), waves, prefix_cache=False)
    on, hits, _ = run_waves(make_spec_config(), waves, prefix_cache=True)
    assert on == off
    assert hits.by_rid["lp"] == 0
    assert hits.by_rid["after"] == 31


def test_metrics_report_hits(make_spec_config):
    """``/metrics``: vLLM's prefix_cache_queries / prefix_cache_hits, per-model hit and query
    tokens, and the cache's place in the pool."""
    from loraserve.runtime.server.metrics import Metrics

    config = make_spec_config()
    config.scheduler.prefix_cache = True
    gen = torch.Generator().manual_seed(21)
    system = _tokens(gen, 30)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    holder: dict = {}
    metrics = Metrics("tiny", snapshot=lambda: holder["engine"].snapshot)
    engine = holder["engine"] = Engine(config, ModelRunner(config), observer=metrics, decoder_factory=build_decoder)
    engine.start()
    try:
        _run_wave(engine, [("a", [*system, 1], params, "all-r16")])
        _run_wave(engine, [("b", [*system, 2], params, "all-r16"), ("c", [*system, 3], params, None)])
        text = metrics.render().decode()
    finally:
        engine.shutdown(drain_timeout_s=1.0)

    def value(line_start: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(line_start))
        return float(line.rsplit(" ", 1)[1])

    assert value('vllm:prefix_cache_queries_total{model_name="tiny"}') == 3 * 31
    assert value('vllm:prefix_cache_hits_total{model_name="tiny"}') == 30
    assert value('loraserve:prefix_cache_hit_tokens_total{model="all-r16"}') == 30
    assert value('loraserve:prefix_cache_query_tokens_total{model="tiny"}') == 31  # the base model's
    assert value('loraserve:prefix_cache_hit_requests_total{model="all-r16"}') == 1
    cached = value('loraserve:prefix_cache_tokens{model_name="tiny"}')
    assert cached >= 2 * 31
    assert value('loraserve:prefix_cache_evictable_tokens{model_name="tiny"}') == cached  # nothing runs
    assert value('loraserve:prefix_cache_usage_perc{model_name="tiny"}') == cached / engine.kv.capacity


def _submit_together(config, wave, *, prefix_cache: bool):
    """Every request of ``wave`` reaches the engine before it plans a step (its thread is
    held in a call meanwhile), as requests arriving in the same instant do."""
    config = config.copy()
    config.scheduler.prefix_cache = prefix_cache
    hits = Hits()
    engine = Engine(config, ModelRunner(config), observer=hits, decoder_factory=build_decoder)
    engine.start()
    gate = threading.Event()
    held = engine.call(gate.wait)
    try:
        outputs = {}
        runner = threading.Thread(target=lambda: outputs.update(_run_wave(engine, wave)))
        runner.start()
        while len(engine._inbox) < len(wave):  # the submits are queued behind the held call
            threading.Event().wait(0.01)
        gate.set()
        held.result(timeout=30)
        runner.join(timeout=120)
    finally:
        gate.set()
        engine.shutdown(drain_timeout_s=1.0)
    return outputs, hits


def test_shared_prefix_computed_once(make_spec_config):
    """Three users per adapter send its (uncached) system prompt at the same instant: one
    computes it, the others reuse its KV a step later, never across adapters, and every
    output equals the cache-off output."""
    gen = torch.Generator().manual_seed(5)
    system = {a: _tokens(gen, 90) for a in ADAPTERS}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    wave = [
        (f"{i}-{j}", [*system[a], *_tokens(gen, 6)], params, a)
        for i, a in enumerate(ADAPTERS)
        for j in range(3)
    ]
    config = make_spec_config(max_running_requests=16, chunked_prefill_size=4096)
    expected, _ = _submit_together(config, wave, prefix_cache=False)
    outputs, hits = _submit_together(config, wave, prefix_cache=True)
    assert len(expected) == len(wave) and all(len(v) == 6 for v in expected.values())
    assert outputs == expected
    for i in range(len(ADAPTERS)):
        got = sorted(hits.by_rid.get(f"{i}-{j}", 0) for j in range(3))
        assert got[0] == 0 and got[1] >= 90 and got[2] >= 90, (ADAPTERS[i], got)
