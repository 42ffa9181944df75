"""One extend step of ``B`` requests after a cached prefix, timed eagerly and replayed.

Every step's requests are new: each starts on its adapter's cached system prompt
(``KVCache.match_prefix``, as the engine admits a prefix-cache hit) and extends it by its
question; after the step they are freed, so every timed step sees the same cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.runner.cuda_graph import CudaGraphRunner, ExtendShape
from loraserve.runtime.runner.forward_batch import ForwardBatch, ForwardOutput
from loraserve.runtime.runner.model_runner import ModelRunner

from .. import harness


@dataclass
class Row:
    """One batch size's result (times in ms, medians over the timed steps)."""

    requests: int
    real_tokens: int
    shape: ExtendShape | None  # where the graph path padded it; None: it ran eagerly
    eager_ms: float
    graph_ms: float
    rel_err: float  # relative L2 of the last-row logits, graph path vs eager

    @property
    def padded_tokens(self) -> int:
        return self.real_tokens if self.shape is None else self.shape.width * self.shape.batch_size


def prefix_key(adapter: str | None) -> tuple[str, str | None]:
    """The prefix-cache key of an adapter's system prompt (any hashable; one per adapter)."""
    return ("bench", adapter)


def cache_system_prompts(
    runner: ModelRunner, adapters: list[str], prefix_len: int, seed: int
) -> dict[str, list[int]]:
    """Each adapter's system prompt prefilled once and left in the prefix cache."""
    gen = torch.Generator().manual_seed(seed)
    prompts = {}
    for name in adapters:
        prompt = torch.randint(3, runner.vocab_size, (prefix_len,), generator=gen)
        rid = f"system-{name}"
        batch = ForwardBatch(
            ForwardMode.EXTEND, [rid], prompt.to(runner.device), extend_lens=[prefix_len], lora_names=[name]
        )
        runner.forward(batch)
        runner.kv.cache_and_free(rid, prefix_key(name), prompt.tolist())
        prompts[name] = prompt.tolist()
    return prompts


class ExtendBench:
    """Extend steps over ``runner``'s cached system prompts, eager or through ``graphs``."""

    def __init__(
        self, runner: ModelRunner, graphs: CudaGraphRunner, systems: dict[str, list[int]], new_len: int
    ):
        self.runner = runner
        self.graphs = graphs
        self.systems = systems
        self.adapters = list(systems)
        self.new_len = new_len
        self.shapes: list[ExtendShape | None] = []
        self._steps = 0
        run = graphs.run

        def recording_run(batch, slots, alloc):
            self.shapes[-1] = graphs.extend_shape(batch, alloc)
            return run(batch, slots, alloc)

        graphs.run = recording_run

    def step(
        self, requests: int, *, graph: bool, seed: int
    ) -> tuple[float, ForwardOutput, ExtendShape | None]:
        """One extend of ``requests`` new requests: seconds, output, the graph shape (None: eager)."""
        runner = self.runner
        gen = torch.Generator().manual_seed(seed)
        self._steps += 1
        rids = [f"s{self._steps}-{i}" for i in range(requests)]
        names = [self.adapters[i % len(self.adapters)] for i in range(requests)]
        questions = [torch.randint(3, runner.vocab_size, (self.new_len,), generator=gen) for _ in rids]
        for rid, name, q in zip(rids, names, questions, strict=True):
            held = runner.kv.match_prefix(rid, prefix_key(name), self.systems[name] + q.tolist())
            assert held == len(self.systems[name]), f"{rid} reused {held} cached tokens"
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            rids,
            torch.cat(questions).to(runner.device),
            extend_lens=[self.new_len] * requests,
            lora_names=names,
        )
        runner.graphs = self.graphs if graph else None
        self.shapes.append(None)
        try:
            harness.sync(runner.device)
            start = time.perf_counter()
            out = runner.forward(batch)
            harness.sync(runner.device)
            seconds = time.perf_counter() - start
        finally:
            for rid in rids:
                runner.kv.free(rid)
        return seconds, out, self.shapes[-1]

    def timed(self, requests: int, *, graph: bool, warmup: int, repeats: int) -> float:
        """Median ms of ``repeats`` steps after ``warmup`` (kernels compiled, graph captured)."""
        for i in range(warmup):
            self.step(requests, graph=graph, seed=1000 + i)
        return 1e3 * statistics.median(
            self.step(requests, graph=graph, seed=2000 + i)[0] for i in range(repeats)
        )

    def measure(self, requests: int, *, warmup: int, repeats: int) -> Row:
        """Eager and graph times of ``requests`` requests, and the graph path's logits error."""
        _, want, _ = self.step(requests, graph=False, seed=requests)
        _, got, shape = self.step(requests, graph=True, seed=requests)
        err = float((got.logits.double() - want.logits.double()).norm() / want.logits.double().norm())
        return Row(
            requests=requests,
            real_tokens=requests * self.new_len,
            shape=shape,
            eager_ms=self.timed(requests, graph=False, warmup=warmup, repeats=repeats),
            graph_ms=self.timed(requests, graph=True, warmup=warmup, repeats=repeats),
            rel_err=err,
        )
