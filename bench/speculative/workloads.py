"""Workloads and one timed run of a workload through the real engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.engine.engine import Engine
from loraserve.runtime.engine.request import Request
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams


@dataclass
class Workload:
    """Greedy requests: prompt ``i`` with adapter ``i`` (None: the base model)."""

    prompts: list[list[int]]
    adapters: list[str | None]
    gen_tokens: int


@dataclass
class RunResult:
    """One timed run: throughput, each request's tokens and the engine's step counters."""

    tokens_per_s: float
    seconds: float
    generated: int
    outputs: dict[str, list[int]] = field(default_factory=dict)
    spec: dict | None = None
    steps: dict = field(default_factory=dict)


def prompt_pool(held_ids, prompt_len: int) -> list[list[int]]:
    """Prompts of ``prompt_len`` tokens cut from the held-out files' tokens, 499 tokens apart."""
    return [held_ids[i : i + prompt_len].tolist() for i in range(0, held_ids.numel() - prompt_len, 499)]


def make_workload(pool: list[list[int]], count: int, gen_tokens: int, offset: int) -> Workload:
    """``count`` requests from ``pool`` starting at ``offset``; request ``i`` uses base or adapter ``i % 5``."""
    names: list[str | None] = [None, "ad0", "ad1", "ad2", "ad3"]
    prompts = [pool[(offset + i) % len(pool)] for i in range(count)]
    return Workload(prompts, [names[(offset + i) % len(names)] for i in range(count)], gen_tokens)


def warmup_workload(pool: list[list[int]], bench: Workload, c: int) -> Workload:
    """What runs untimed before ``bench`` at concurrency ``c``. Above 1, ``bench`` itself:
    greedy requests on the same prompts pass through the same batch and context buckets, so
    the timed run replays CUDA graphs the warm-up captured. Other prompts (as before) left
    3-5 first-time captures inside the timed runs at 8 and 32 (H100 runs 4 and 6), up to a
    third of a row's time, and which buckets they missed differed between drafts and runs.
    At 1 every step is a batch of one: two other prompts meet its buckets."""
    if c > 1:
        return bench
    return make_workload(pool, 2, bench.gen_tokens, offset=100)


def graph_count(runner) -> int:
    """CUDA graphs ``runner`` holds (0 for none, or no runner)."""
    graphs = getattr(runner, "graphs", None)
    return graphs.num_graphs if graphs is not None else 0


def step_breakdown(engine: Engine, seconds: float, graphs_captured: int) -> dict:
    """Where a run's wall time went, from the engine's counters."""
    snap = engine.snapshot
    ext, dec = snap.extend, snap.decode
    return {
        "extend_steps": ext.steps,
        "extend_requests": ext.requests,
        "extend_s": round(ext.seconds, 3),
        "extend_ms_per_step": round(1e3 * ext.seconds / max(ext.steps, 1), 2),
        "extends_during_decode": snap.extends_during_decode,
        "decode_steps": dec.steps,
        "decode_s": round(dec.seconds, 3),
        "decode_ms_per_step": round(1e3 * dec.seconds / max(dec.steps, 1), 2),
        "mean_decode_batch": round(dec.mean_batch, 2),
        "decode_occupancy": round(snap.decode_occupancy, 3),
        "tokens_per_decode_step": round(dec.tokens / max(dec.steps, 1), 2),
        "engine_s": round(snap.engine_seconds, 3),
        "other_s": round(seconds - ext.seconds - dec.seconds - snap.engine_seconds, 3),
        "deferred_admission_steps": snap.deferred_admission_steps,
        "graphs_captured": graphs_captured,
    }


def run_workload(
    config: RuntimeConfig,
    runner: ModelRunner,
    decoder,
    work: Workload,
    concurrency: int,
    tag: str,
    *,
    defer_steps: int | None = None,
    profiler=None,
) -> RunResult:
    """All requests submitted at once; the engine runs ``concurrency`` at a time.

    ``profiler``: a ``torch.profiler.profile`` started and stopped on the engine's own
    thread (the profiler records the thread that starts it)."""
    config = config.copy()
    config.scheduler.max_running_requests = concurrency
    engine = Engine(config, runner, decoder=decoder, max_admission_defer_steps=defer_steps)
    drafter_runner = getattr(getattr(decoder, "drafter", None), "runner", None)
    graphs_before = graph_count(runner) + graph_count(drafter_runner)
    engine.refresh_adapters()
    collector = _Collector()
    reqs = [
        Request(rid=rid, prompt_ids=prompt, adapter=adapter, sink=collector.sink_for(rid),
                params=SamplingParams(max_tokens=work.gen_tokens, temperature=0.0, ignore_eos=True))
        for rid, prompt, adapter in collector.expect(tag, work)
    ]  # fmt: skip
    engine.start()
    if profiler is not None:
        engine.call(profiler.start).result()
    start = time.perf_counter()
    for req in reqs:
        engine.submit(req)
    if not collector.done.wait(600):
        raise RuntimeError(f"{tag}: timed out")
    seconds = time.perf_counter() - start
    if profiler is not None:
        engine.call(profiler.stop).result()
    engine.shutdown(drain_timeout_s=1.0)
    if collector.errors:
        raise RuntimeError(f"{tag}: {collector.errors[:3]}")
    outputs = collector.outputs
    generated = sum(len(v) for v in outputs.values())
    captured = graph_count(runner) + graph_count(drafter_runner) - graphs_before
    return RunResult(
        generated / seconds, seconds, generated, outputs, steps=step_breakdown(engine, seconds, captured)
    )


class _Collector:
    """The requests' streamed tokens, gathered on the engine's thread; ``done`` is set when
    the last expected request has finished."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.outputs: dict[str, list[int]] = {}
        self.errors: list[str] = []
        self.pending: set[str] = set()
        self.lock = threading.Lock()

    def expect(self, tag: str, work: Workload) -> list[tuple[str, list[int], str | None]]:
        """``(request id, prompt, adapter)`` of each request of ``work``, now awaited."""
        reqs = []
        for i, (prompt, adapter) in enumerate(zip(work.prompts, work.adapters, strict=True)):
            rid = f"{tag}-{i}"
            self.pending.add(rid)
            reqs.append((rid, prompt, adapter))
        return reqs

    def sink_for(self, rid: str):
        """The output sink of request ``rid``."""

        def sink(out):
            with self.lock:
                self.outputs.setdefault(rid, []).extend(out.token_ids)
                if out.error is not None:
                    self.errors.append(f"{rid}: {out.error.message}")
                if out.finished:
                    self.pending.discard(rid)
                    if not self.pending:
                        self.done.set()

        return sink
