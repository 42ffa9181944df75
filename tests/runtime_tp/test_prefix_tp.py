"""Prefix caching on a 2-rank target: rank 0 keeps the tree and the other rank replays its
slot-level journal (adopt, share, forget, release), so both hold the same KV for every
request; tokens equal one device without the cache, per adapter, through hits, sharing of
running prompts and evictions (any divergence stops the group, which the fixture checks)."""

from __future__ import annotations

import threading

import torch

from loraserve.runtime.engine import Engine, EngineObserver, Request
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.speculative import build_decoder

from .conftest import tp_config, tp_group

ADAPTERS = (None, "attn-r8", "all-r16")


class _Hits(EngineObserver):
    def __init__(self) -> None:
        self.hit = 0

    def on_prefix_lookup(self, request, hit_tokens, query_tokens):
        self.hit += hit_tokens


def _waves():
    gen = torch.Generator().manual_seed(3)
    systems = {a: torch.randint(3, 500, (40,), generator=gen).tolist() for a in ADAPTERS}
    waves = []
    for w, per in enumerate((1, 2, 2)):
        wave = []
        for i, a in enumerate(ADAPTERS):
            for j in range(per):
                question = torch.randint(3, 500, (6 + j,), generator=gen).tolist()
                params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                wave.append((f"w{w}-{i}-{j}", [*systems[a], *question], params, a))
        waves.append(wave)
    return waves


def _serve(config, runner, waves) -> tuple[dict[str, list[int]], int]:
    hits = _Hits()
    engine = Engine(config, runner, observer=hits, decoder_factory=build_decoder)
    engine.start()
    out: dict[str, list[int]] = {}
    try:
        for wave in waves:
            _run_wave(engine, wave, out)
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return out, hits.hit


def _run_wave(engine, wave, out: dict[str, list[int]]) -> None:
    done, lock = threading.Event(), threading.Lock()
    pending = {rid for rid, *_ in wave}
    errors = []

    def sink_for(rid):
        def sink(o):
            with lock:
                if o.error is not None:
                    errors.append(o.error)
                out.setdefault(rid, []).extend(o.token_ids)
                if o.finished:
                    pending.discard(rid)
                    if not pending:
                        done.set()

        return sink

    for rid, prompt, params, adapter in wave:
        engine.submit(Request(rid=rid, prompt_ids=prompt, params=params, adapter=adapter, sink=sink_for(rid)))
    assert done.wait(300), sorted(pending)
    assert not errors, errors


def test_prefix_two_ranks_match_one(tp_assets):
    """Two ranks with the prefix cache answer like one device without."""
    adapters = {n: tp_assets.adapters[n] for n in ADAPTERS if n is not None}
    waves = _waves()
    one = tp_config(tp_assets.gqa, 1, adapters, max_total_tokens=4096)
    one.scheduler.prefix_cache = False
    expected, _ = _serve(one, ModelRunner(one), waves)
    # A pool too small to keep every prefix: evictions travel to the other rank too.
    config = tp_config(tp_assets.gqa, 2, adapters, max_total_tokens=220, max_running_requests=6)
    config.scheduler.prefix_cache = True
    with tp_group(config) as (_, runner):
        got, hit = _serve(config, runner, waves)
        assert runner.kv.prefix is not None and hit > 0
        assert runner.kv.prefix_evicted_tokens > 0
    assert got == expected
