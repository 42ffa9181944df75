"""The engine with extends of several requests on the CUDA-graph runner's padded static
path (``use_graphs=False``: everything but the capture, on the CPU) gives every request
the greedy tokens it gets from the eager runner, with the prefix cache on: arrivals that
are prefilled together after their adapters' cached system prompts replay as one padded
batch."""

from __future__ import annotations

import random
import threading

from loraserve.kernels import ForwardMode
from loraserve.runtime.engine import Engine
from loraserve.runtime.runner.cuda_graph import CudaGraphRunner
from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import engine_config, make_request, wait_all

ADAPTERS = [None, "sql-r8", "chat-r16", "third"]


def _workload(seed: int) -> tuple[list, list]:
    """A system prompt per adapter (first wave), then arrivals of a question after it, and
    one request that shares nothing (second wave, submitted together)."""
    rng = random.Random(seed)
    systems = {a: [rng.randrange(3, 500) for _ in range(40)] for a in ADAPTERS}
    first = [(systems[a] + [rng.randrange(3, 500) for _ in range(5)], a) for a in ADAPTERS]
    second = [
        (systems[a] + [rng.randrange(3, 500) for _ in range(rng.randrange(6, 14))], a)
        for a in (ADAPTERS * 2)[:6]
    ]
    second.insert(3, ([rng.randrange(3, 500) for _ in range(20)], "sql-r8"))
    return first, second


def _run(engine_assets, graphs: bool, work) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """Every request's tokens, and (with graphs) the extends that took the graph path as
    (requests, cached prefix per request)."""
    cfg = engine_config(engine_assets)
    cfg.scheduler.prefix_cache = True
    runner = ModelRunner(cfg)
    replayed: list[tuple[int, list[int]]] = []
    if graphs:
        runner.graphs = CudaGraphRunner(runner, max_bs=8, max_prefill_tokens=256, use_graphs=False)
        run = runner.graphs.run

        def spy(batch, slots, alloc):
            if batch.mode is ForwardMode.EXTEND:
                replayed.append((batch.batch_size, list(alloc.prefix_lens)))
            return run(batch, slots, alloc)

        runner.graphs.run = spy
    engine = Engine(cfg, runner)
    engine.start()
    try:
        tokens = []
        for wave in work:
            gate = threading.Event()
            engine.call(gate.wait)  # holds the engine between steps: the wave arrives at once
            collected = []
            for prompt, adapter in wave:
                r, c = make_request(prompt, adapter, max_tokens=6)
                engine.submit(r)
                collected.append(c)
            gate.set()
            wait_all(collected)
            tokens += [c.token_ids for c in collected]
    finally:
        engine.shutdown(drain_timeout_s=2.0)
    return tokens, replayed


def test_extend_graphs_keep_output(engine_assets):
    """Engine output is unchanged with multi request extend graphs."""
    work = _workload(5)
    want, _ = _run(engine_assets, False, work)
    got, replayed = _run(engine_assets, True, work)
    assert got == want
    assert all(len(t) == 6 for t in got)
    # Both waves were prefilled as padded batches of several requests (4 of width 64; 7,
    # padded to 8, of width 32); the second after the cached system prompts (the request
    # that shares nothing has no prefix).
    assert [n for n, _ in replayed] == [4, 7], replayed
    prefixes = replayed[1][1]
    assert sum(p >= 40 for p in prefixes) == 6 and prefixes[3] == 0, prefixes
