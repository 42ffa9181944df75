"""CUDA graphs for the EAGLE head's one-token draft steps.

After the first proposal (which reads the target's features), every further draft step
of a request is one row: the previous draft token and the head's own output feature.
Those steps are uniform, so like the target's decode they are padded to a batch-size
bucket and a power-of-two context, and replayed from a graph per (batch, context) pair.
Eager, each such step is a few dozen small launches plus attention metadata built on
the host; at batch 1 that host work, not the GPU, set the EAGLE step's cost
(``bench/results/2026-12-03-spec-h200.md``).

Padded rows use KV row 0 and slot 0, which the cache never hands out. The ragged steps
(feeding the target's features after prefill and verify) stay eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cuda_graph import context_bucket, graph_batch_sizes, padded_batch_size
from ..kv import Allocation
from ..model.layers import build_attention_metadata

if TYPE_CHECKING:
    from .eagle_runner import EagleDraftRunner

log = logging.getLogger("loraserve.spec")


@dataclass
class _Static:
    input_ids: torch.Tensor  # int64 [max_bs]
    features: torch.Tensor  # [max_bs, hidden]: the head's previous output
    rows: torch.Tensor  # int64 [max_bs]
    prefix_lens: torch.Tensor  # int64 [max_bs]
    out_cache_loc: torch.Tensor  # int64 [max_bs]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    hidden: torch.Tensor
    logits: torch.Tensor


class EagleGraphRunner:
    """Pads single-row EAGLE draft steps into static buffers and replays captured graphs.

    ``use_graphs=False`` runs the same padded static path eagerly (the CPU tests use it).
    A capture that fails turns graphs off for this runner (logged); steps then run eagerly.
    """

    def __init__(self, runner: EagleDraftRunner, *, max_bs: int, use_graphs: bool | None = None):
        self.runner = runner
        self.device = runner.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use use_graphs=False to run the static path eagerly")
        self.max_bs = int(max_bs)
        self.batch_sizes = graph_batch_sizes(self.max_bs)
        self.disabled = False
        z = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=self.device)  # noqa: E731
        hidden = runner.model.hidden_size
        self._static = _Static(
            z(), torch.zeros(self.max_bs, hidden, dtype=runner.dtype, device=self.device), z(), z(), z()
        )
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def num_graphs(self) -> int:
        return sum(g.graph is not None for g in self._graphs.values())

    def can_run(self, batch_size: int) -> bool:
        return not self.disabled and 0 < batch_size <= self.max_bs

    def run(self, alloc: Allocation, input_ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step for ``alloc``'s requests (one new row each, already allocated);
        returns ``(output features [bs, hidden], logits [bs, vocab] float32)``."""
        bs = len(alloc.seq_lens)
        padded = padded_batch_size(self.batch_sizes, bs)
        assert padded is not None, f"batch of {bs} exceeds the graphs' {self.max_bs}"
        context = context_bucket(max(alloc.seq_lens), self.runner.kv.max_context_len)
        s = self._static
        s.input_ids[:bs].copy_(input_ids, non_blocking=True)
        s.input_ids[bs:padded].zero_()
        s.features[:bs].copy_(features)
        s.features[bs:padded].zero_()
        s.rows[:bs].copy_(alloc.rows)
        s.rows[bs:padded].zero_()
        s.prefix_lens[:bs].copy_(torch.tensor(alloc.prefix_lens, dtype=torch.int64), non_blocking=True)
        s.prefix_lens[bs:padded].zero_()
        s.out_cache_loc[:bs].copy_(alloc.out_cache_loc)
        s.out_cache_loc[bs:padded].zero_()
        key = (padded, context)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key)
            self._graphs[key] = graph
        elif graph.graph is not None:
            graph.graph.replay()
        else:
            graph = self._run_static(key)
        return graph.hidden[:bs].clone(), graph.logits[:bs].clone()

    def _body(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        padded, context = key
        s, runner = self._static, self.runner
        layer = runner.config.layer
        meta = build_attention_metadata(
            req_to_token=runner.kv.req_to_token,
            rows=s.rows[:padded],
            prefix_lens=s.prefix_lens[:padded],
            out_cache_loc=s.out_cache_loc[:padded],
            max_q=1,
            max_ctx=context,
            groups=layer.num_heads // layer.num_kv_heads,
            q_lens=None,
        )
        hidden = runner.model(
            s.input_ids[:padded],
            s.features[:padded],
            meta,
            runner.kv.k_buffers[0],
            runner.kv.v_buffers[0],
            from_target=False,
        )
        return hidden, runner.model.compute_logits(hidden)

    def _run_static(self, key: tuple[int, int]) -> _Graph:
        hidden, logits = self._body(key)
        return _Graph(None, hidden, logits)

    def _capture(self, key: tuple[int, int]) -> _Graph:
        if not self.use_graphs or self.disabled:
            return self._run_static(key)
        try:
            # Warm-up on a side stream (compilation, allocator), then capture; the KV
            # writes of this step are idempotent, the replay below produces the result.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._body(key)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden, logits = self._body(key)
            graph.replay()
            return _Graph(graph, hidden, logits)
        except RuntimeError:
            log.exception("capturing the EAGLE draft step (batch %d, context %d) failed; drafting eagerly", *key)
            self.disabled = True
            return self._run_static(key)
