"""One CUDA-graph runner for every uniform forward of the engine core.

The target's decode, verify and prefill (:mod:`.cuda_graph`) and the EAGLE
head's draft steps (:mod:`loraserve.runtime.speculative.eagle.graphs`) replay the same way:

- a batch is padded to a captured batch size (:func:`graph_batch_sizes`), or along its
  tokens to a width bucket (:func:`prefill_widths`), and its context to a power-of-two
  bucket (:func:`context_bucket`), so a handful of shapes serve every batch;
- its inputs are written into static buffers made once per shape family
  (:func:`fill_padded`, :class:`StaticRequests`): padded rows read zeros, i.e. table row
  0, KV slot 0 and token 0, the cache's padding row and slot that it never hands out;
- the forward of a shape key is captured the first time the key is seen and replayed
  after that (:meth:`GraphRunner.replay`); every graph shares one memory pool.

What differs between the two users is only what a key is and what its forward (the
*body*, a function of the static buffers alone) computes: each subclass keeps one or
more tables of :class:`Captured` entries and passes its body to :meth:`GraphRunner.replay`.

``use_graphs=False`` runs the same padded static path eagerly, so everything but the
capture itself runs, and is tested, on the CPU. A capture that fails (logged) runs its
step eagerly and turns capture off for the runner: the failed capture leaves its pool
mid-recording, so every later capture in it would fail too. Graphs captured before keep
replaying.

Verify width: a graph's token layout is fixed at capture, so a key carries the width its
static buffers hold, and a replay of a graph with adapters refuses any other verify width
loudly (``GraphLoRAMetadata.update``'s ``num_draft_tokens`` check, which the target's
runner passes the batch's width to).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from ..kv import Allocation

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
S = TypeVar("S", bound="StaticRequests")
log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 64


# ---------------------------------------------------------------------- shape buckets
def graph_batch_sizes(max_bs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 up to ``max_bs`` (always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph.max_bs must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8)) + [max_bs]
    return sorted(set(sizes))


def prefill_widths(max_tokens: int) -> list[int]:
    """Captured prefill widths: 16, 32, 64, then 128, 192, 256, 384, 512, 768, ... (each
    power of two and 1.5 times it) below ``max_tokens``, and ``max_tokens`` itself.

    A chunk pads by at most 2x below 128 tokens, where its GPU work is small anyway, and
    by at most 1.5x above. ``max_tokens`` 0: no widths (every extend runs eagerly).
    """
    if max_tokens < 0:
        raise ValueError(
            f"cuda_graph.max_prefill_tokens must be >= 0 (0 runs every prefill eagerly), got {max_tokens}"
        )
    if max_tokens == 0:
        return []
    widths = [16, 32, 64]
    p = 128
    while p < max_tokens:
        widths += [p, p + p // 2]
        p *= 2
    return sorted({w for w in widths if w < max_tokens} | {max_tokens})


def padded_batch_size(sizes: Sequence[int], batch_size: int) -> int | None:
    """The smallest size in ``sizes`` that holds ``batch_size`` (requests, or a prefill's
    tokens in :func:`prefill_widths`), or None."""
    fits = [s for s in sizes if s >= batch_size]
    return min(fits) if fits else None


def context_bucket(max_ctx: int, limit: int) -> int:
    """Power-of-two key columns (at least :data:`MIN_CONTEXT_BUCKET`) covering ``max_ctx``."""
    if max_ctx > limit:
        raise ValueError(f"context {max_ctx} exceeds the cache's limit {limit}")
    bucket = MIN_CONTEXT_BUCKET
    while bucket < max_ctx:
        bucket *= 2
    return min(bucket, limit)


# ---------------------------------------------------------------------- static buffers
def fill_padded(dst: torch.Tensor, src: torch.Tensor, valid: int, padded: int) -> None:
    """``dst[:valid] = src`` and ``dst[valid:padded] = 0``: a static buffer for one replay.

    Zeros make padded rows use the KV cache's reserved row 0 and slot 0 and token id 0.
    """
    dst[:valid].copy_(src, non_blocking=True)
    dst[valid:padded].zero_()


@dataclass
class StaticRequests:
    """The per-request static inputs every graph reads; subclasses add their token rows."""

    rows: torch.Tensor  # int64 [max requests]: each request's row of the token table
    prefix_lens: torch.Tensor  # int64 [max requests]: entries cached before the forward

    def fill_requests(self, alloc: Allocation, padded: int) -> None:
        """The real requests of ``alloc`` first, then padding requests up to ``padded``."""
        bs = len(alloc.seq_lens)
        fill_padded(self.rows, alloc.rows, bs, padded)
        fill_padded(self.prefix_lens, torch.tensor(alloc.prefix_lens, dtype=torch.int64), bs, padded)


# ---------------------------------------------------------------------- capture
def capture_graph(
    body: Callable[[], T], device: torch.device, pool, *, warmups: int = 1
) -> tuple[torch.cuda.CUDAGraph, T]:
    """``body`` captured into a CUDA graph in ``pool``; returns the graph and its output tensors.

    Warm-up runs on a side stream first (kernel compilation, allocator). They compute this
    very step (KV writes are idempotent); the replay after capture produces the returned
    values.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            body()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = body()
    graph.replay()
    return graph, outputs


def capture_or_eager(
    body: Callable[[], T], device: torch.device, pool, *, what: object, warmups: int = 1
) -> tuple[torch.cuda.CUDAGraph | None, T]:
    """:func:`capture_graph`, or where the capture fails (logged) no graph and ``body``'s
    outputs computed eagerly. A failed capture leaves its pool mid-recording, so every
    later capture in it would fail too: a caller that gets no graph stops capturing."""
    try:
        return capture_graph(body, device, pool, warmups=warmups)
    except RuntimeError:
        log.exception("capturing %s failed; running uncaptured steps eagerly from now on", what)
        return None, body()


class Captured(NamedTuple, Generic[T]):
    """One shape's entry: its graph (None where the body runs eagerly) and the body's outputs."""

    graph: torch.cuda.CUDAGraph | None
    outputs: T


class _HasCache(Protocol):
    """What the graph runner needs of a model runner (target or draft)."""

    device: torch.device

    @property
    def kv(self): ...


class GraphRunner:
    """Pads uniform forwards of ``runner`` into static buffers and replays captured graphs.

    ``max_bs``: the most requests a graph holds. ``warmups``: eager runs before each capture.
    ``what``: names the forwards in a failed capture's log line.
    """

    def __init__(
        self,
        runner: _HasCache,
        *,
        max_bs: int,
        use_graphs: bool | None = None,
        warmups: int = 1,
        what: str = "the forward",
    ):
        self.runner = runner
        self.device = runner.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(
                "CUDA graphs need a CUDA device; use use_graphs=False to run the static path eagerly"
            )
        self.max_bs = int(max_bs)
        self.batch_sizes = graph_batch_sizes(self.max_bs)
        self.warmups = warmups
        self.what = what
        self.capture_failures = 0
        self._tables: list[dict] = []
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    # ------------------------------------------------------------------ shapes
    def new_table(self) -> dict:
        """An empty shape key -> :class:`Captured` table, counted by :attr:`num_shapes`."""
        table: dict = {}
        self._tables.append(table)
        return table

    @property
    def num_shapes(self) -> int:
        """Shapes seen: captured, or run on the static path."""
        return sum(len(table) for table in self._tables)

    @property
    def num_captured(self) -> int:
        """Shapes that replay a captured graph."""
        return sum(entry.graph is not None for table in self._tables for entry in table.values())

    @property
    def num_graphs(self) -> int:
        """The graphs a runner reports (metrics, benchmarks): captured ones, unless a
        subclass counts otherwise."""
        return self.num_captured

    def padded(self, batch_size: int) -> int:
        """The captured batch size that holds ``batch_size`` requests."""
        padded = padded_batch_size(self.batch_sizes, batch_size)
        assert padded is not None, f"batch of {batch_size} exceeds the graphs' {self.max_bs}"
        return padded

    def context(self, alloc: Allocation) -> int:
        """The key columns a forward over ``alloc`` reads: its longest request, bucketed."""
        return context_bucket(max(alloc.seq_lens), self.runner.kv.max_context_len)

    def shape(self, alloc: Allocation) -> tuple[int, int, int]:
        """``(requests, padded batch size, context bucket)`` of a forward over ``alloc``."""
        bs = len(alloc.seq_lens)
        return bs, self.padded(bs), self.context(alloc)

    # ------------------------------------------------------------------ buffers
    def zeros(self, *size: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A static buffer on the runner's device (int64 unless said otherwise)."""
        return torch.zeros(*size, dtype=dtype, device=self.device)

    def static_requests(self, cls: type[S], requests: int, **buffers: torch.Tensor) -> S:
        """``cls`` with zeroed per-request buffers for ``requests`` requests and ``buffers``."""
        return cls(rows=self.zeros(requests), prefix_lens=self.zeros(requests), **buffers)

    @staticmethod
    def cached(table: dict[K, V], key: K, make: Callable[[], V]) -> V:
        """``table[key]``, made by ``make`` on first use (static buffers, graph metadata)."""
        value = table.get(key)
        if value is None:
            value = table[key] = make()
        return value

    # ------------------------------------------------------------------ replay
    def replay(
        self,
        table: dict[K, Captured[T]],
        key: K,
        body: Callable[[], T],
        *,
        before_capture: Callable[[], None] | None = None,
    ) -> T:
        """``body``'s outputs for ``key``: its graph replayed, captured on first use, or run
        eagerly (the static path, or after a failed capture turned graphs off).

        ``body`` reads the static buffers only, which the caller has filled for this step.
        ``before_capture``: prepares what only a capture needs (LoRA capture layouts).
        """
        entry = table.get(key)
        if entry is None:
            entry = table[key] = self._capture(key, body, before_capture)
            return entry.outputs
        if entry.graph is None:
            return body()
        entry.graph.replay()
        return entry.outputs

    def _capture(
        self, key: Hashable, body: Callable[[], T], before_capture: Callable[[], None] | None
    ) -> Captured[T]:
        if not self.use_graphs:
            return Captured(None, body())
        if before_capture is not None:
            before_capture()
        graph, outputs = capture_or_eager(
            body, self.device, self._pool, what=f"{self.what} {key}", warmups=self.warmups
        )
        if graph is None:  # graphs captured before still replay
            self.use_graphs = False
            self.capture_failures += 1
        return Captured(graph, outputs)
