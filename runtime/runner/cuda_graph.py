"""Decode, target-verify and one-request prefill through CUDA graphs, per shape bucket.

A decode or verify batch is padded to the smallest captured batch size that holds it
(padding requests use table row 0 and KV slot 0, the cache's padding row and slot) and
its context to a power-of-two bucket, then written into static input buffers and
replayed. An extend batch of one request (a prompt, or one chunk of it, of at most
``cuda_graph.max_prefill_tokens`` tokens, wanting only its last position's logits) is
padded the same way along its tokens, to a width bucket (:func:`prefill_widths`): padded
rows are token 0 written to KV slot 0 at the positions after the real ones, so causal
attention hides them from the real rows; the graph computes the logits of the last real
row only, picked by a static index. Graphs are captured lazily, the first time a (mode,
width, batch bucket, context bucket, LoRA, outputs) combination is seen, and share one
memory pool. :meth:`CudaGraphRunner.can_run` alone decides which batches replay.

LoRA inside a graph needs metadata in fixed buffers
(:class:`loraserve.kernels.graph_metadata.GraphLoRAMetadata`) and a backend whose
launches read only device tensors (Triton). With any other backend, batches that use an
adapter run eagerly and only all-base batches replay graphs. A prefill's decoder rows are
one uniform extend segment of its width; its lm_head sees the one last row, through a
one-request decode layout, as the eager extend's does.

Everything except capture itself also runs on the CPU (``use_graphs=False``): the same
static buffers and padding, executed eagerly, so the padding logic is testable there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch

from loraserve.kernels import ForwardMode

from ..model.layers import build_attention_metadata
from .forward_batch import ForwardBatch, ForwardOutput

T = TypeVar("T")
log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from loraserve.kernels.graph_metadata import GraphLoRAMetadata

    from ..kv import Allocation
    from .model_runner import ModelRunner

MIN_CONTEXT_BUCKET = 64


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


def fill_padded(dst: torch.Tensor, src: torch.Tensor, valid: int, padded: int) -> None:
    """``dst[:valid] = src`` and ``dst[valid:padded] = 0``: a static buffer for one replay.

    Zeros make padded rows use the KV cache's reserved row 0 and slot 0 and token id 0.
    """
    dst[:valid].copy_(src, non_blocking=True)
    dst[valid:padded].zero_()


def capture_graph(body: Callable[[], T], device: torch.device, pool, *, warmups: int = 1) -> tuple[torch.cuda.CUDAGraph, T]:
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


class GraphKey(NamedTuple):
    mode: ForwardMode
    width: int  # tokens per request
    batch_size: int  # padded
    context: int  # key columns
    lora: bool  # the graph contains the LoRA ops
    return_hidden: bool
    hidden_layers: tuple[int, ...]
    tree: bool = False  # a tree verify: positions and masks from the static tree buffers


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # int64 [max_bs * width]
    rows: torch.Tensor  # int64 [max_bs]
    prefix_lens: torch.Tensor  # int64 [max_bs]
    out_cache_loc: torch.Tensor  # int64 [max_bs * width]
    last: torch.Tensor  # int64 [1]: a prefill's last real row, the one its logits are of
    tree_depths: torch.Tensor | None = None  # int64 [max_bs, width]: a tree verify's node depths
    tree_ancestors: torch.Tensor | None = None  # bool [max_bs, width, width]

    def tree_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree buffers, made on first use (a verify width that never sees a tree has none)."""
        if self.tree_depths is None or self.tree_ancestors is None:
            reqs, width = self.rows.shape[0], self.input_ids.shape[0] // self.rows.shape[0]
            self.tree_depths = torch.zeros(reqs, width, dtype=torch.int64, device=self.rows.device)
            eye = torch.eye(width, dtype=torch.bool, device=self.rows.device)
            self.tree_ancestors = eye.repeat(reqs, 1, 1)
        return self.tree_depths, self.tree_ancestors


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor
    hidden: torch.Tensor | None
    aux: torch.Tensor | None


class CudaGraphRunner:
    """Pads decode / target-verify / one-request extend batches into static buffers and
    replays captured graphs.

    ``max_prefill_tokens``: the longest extend chunk that replays (0, the default here:
    every extend runs eagerly; the model runner passes ``cuda_graph.max_prefill_tokens``).
    """

    def __init__(
        self, runner: ModelRunner, *, max_bs: int, max_prefill_tokens: int = 0, use_graphs: bool | None = None
    ):
        self.runner = runner
        self.device = runner.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use use_graphs=False to run the static path eagerly")
        self.max_bs = int(max_bs)
        self.batch_sizes = graph_batch_sizes(self.max_bs)
        self.prefill_widths = prefill_widths(int(max_prefill_tokens))
        lora = runner.lora
        # Adapters inside graphs only with a backend that reads device tensors alone.
        self.lora_in_graphs = lora is not None and (not self.use_graphs or lora.backend.name == "triton")
        # Keyed by (mode, width): a prefill width may equal a verify width, and their
        # buffers differ (one request vs max_bs; an extend vs a verify LoRA layout).
        self._inputs: dict[tuple[ForwardMode, int], _StaticInputs] = {}
        self._lora_meta: dict[tuple[ForwardMode, int], GraphLoRAMetadata] = {}
        self._graphs: dict[GraphKey, _Graph] = {}
        self.capture_failures = 0
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def can_run(self, batch: ForwardBatch, slots: Sequence[int], alloc: Allocation) -> bool:
        """Whether this batch takes the graph path (else the runner runs it eagerly)."""
        if any(s >= 0 for s in slots) and not self.lora_in_graphs:
            return False
        if batch.mode is ForwardMode.EXTEND:
            return self._prefill_width(batch, alloc) is not None
        if batch.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return False
        return batch.batch_size <= self.max_bs

    def _prefill_width(self, batch: ForwardBatch, alloc: Allocation) -> int | None:
        """The width an extend batch is padded to, or None where it runs eagerly: more than
        one request (ragged rows), every position's logits wanted, or too many tokens."""
        if batch.batch_size != 1 or batch.return_all_logits:
            return None
        tokens, _ = batch.token_counts()
        width = padded_batch_size(self.prefill_widths, tokens)
        # Padded rows take the positions after the real ones: past the context length
        # they would index beyond the rotary table (a chunk at the very end of it).
        if width is None or alloc.prefix_lens[0] + width > self.runner.kv.max_context_len:
            return None
        return width

    # ------------------------------------------------------------------ run
    def run(self, batch: ForwardBatch, slots: Sequence[int], alloc: Allocation) -> ForwardOutput:
        runner = self.runner
        total, width = batch.token_counts()
        bs = batch.batch_size
        extend = batch.mode is ForwardMode.EXTEND
        if extend:  # one request, its chunk padded to a width bucket
            width, padded_bs = self._prefill_width(batch, alloc), 1
        else:
            padded_bs = padded_batch_size(self.batch_sizes, bs)
        assert width is not None and padded_bs is not None
        # The real rows' context: padded prefill rows attend to whatever the bucket holds.
        context = context_bucket(max(alloc.seq_lens), runner.kv.max_context_len)
        uses_lora = any(s >= 0 for s in slots)
        aux_layers = tuple(int(i) for i in batch.hidden_layers or ())
        tree = batch.tree_depths is not None
        key = GraphKey(batch.mode, width, padded_bs, context, uses_lora, batch.return_hidden, aux_layers, tree)

        static = self._static_inputs(batch.mode, width)
        if tree:
            # Padded requests keep depth 0 and see themselves only (their rows are dropped).
            depths, ancestors = static.tree_buffers()
            depths[:bs].copy_(batch.tree_depths, non_blocking=True)
            ancestors[:bs].copy_(batch.tree_ancestors, non_blocking=True)
        n = padded_bs * width
        fill_padded(static.input_ids, batch.input_ids, total, n)
        fill_padded(static.rows, alloc.rows, bs, padded_bs)
        fill_padded(static.prefix_lens, torch.tensor(alloc.prefix_lens, dtype=torch.int64), bs, padded_bs)
        fill_padded(static.out_cache_loc, alloc.out_cache_loc, total, n)
        if extend:
            static.last.fill_(total - 1)

        lora = runner.lora
        if lora is not None:
            info = logits_info = None
            if uses_lora:
                ranks, scalings = lora.slot_ranks(), lora.slot_scalings()
                meta = self._graph_lora_meta(batch.mode, width)
                info = logits_info = meta.update(
                    list(slots), ranks, scalings, num_draft_tokens=batch.num_draft_tokens, batch_size=padded_bs
                )
                if extend:
                    # The lm_head sees the last row only: a one-request decode's layout, as in
                    # the eager extend. The decode graphs' metadata holds it (updated before
                    # each of their replays, so sharing it is safe).
                    logits_info = self._graph_lora_meta(ForwardMode.DECODE, 1).update(
                        list(slots), ranks, scalings, batch_size=1
                    )
            lora.ctx.set(info, logits_info)
        try:
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(key, static)
                self._graphs[key] = graph
            elif graph.graph is not None:
                graph.graph.replay()
            else:
                graph = self._run_static(key, static)
        finally:
            if lora is not None:
                lora.ctx.clear()
        return ForwardOutput(
            # extend: one row of logits per request (its last), as the eager extend returns
            logits=graph.logits[: bs if extend else total].clone(),
            hidden_states=graph.hidden[:total].clone() if graph.hidden is not None else None,
            aux_hidden_states=graph.aux[:total].clone() if graph.aux is not None else None,
        )

    # ------------------------------------------------------------------ internals
    def _max_requests(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.EXTEND else self.max_bs

    def _static_inputs(self, mode: ForwardMode, width: int) -> _StaticInputs:
        static = self._inputs.get((mode, width))
        if static is None:
            reqs = self._max_requests(mode)
            z = lambda n: torch.zeros(n, dtype=torch.int64, device=self.device)  # noqa: E731
            static = _StaticInputs(z(reqs * width), z(reqs), z(reqs), z(reqs * width), z(1))
            self._inputs[(mode, width)] = static
        return static

    def _graph_lora_meta(self, mode: ForwardMode, width: int) -> GraphLoRAMetadata:
        meta = self._lora_meta.get((mode, width))
        if meta is None:
            from loraserve.kernels.graph_metadata import GraphLoRAMetadata

            meta = GraphLoRAMetadata(
                mode,
                self._max_requests(mode),
                self.runner.lora.num_slots,
                num_draft_tokens=width if mode is ForwardMode.TARGET_VERIFY else None,
                extend_len=width if mode is ForwardMode.EXTEND else None,
                device=self.device,
            )
            self._lora_meta[(mode, width)] = meta
        return meta

    def _body(self, key: GraphKey, static: _StaticInputs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        runner = self.runner
        n = key.batch_size * key.width
        meta = build_attention_metadata(
            req_to_token=runner.kv.req_to_token,
            rows=static.rows[: key.batch_size],
            prefix_lens=static.prefix_lens[: key.batch_size],
            out_cache_loc=static.out_cache_loc[:n],
            max_q=key.width,
            max_ctx=key.context,
            groups=runner.attn_groups,
            q_lens=None,
            sliding_window=runner.arch.sliding_window,
            backend=runner.attention_backend,
            tree_depths=static.tree_depths[: key.batch_size] if key.tree else None,
            tree_ancestors=static.tree_ancestors[: key.batch_size] if key.tree else None,
        )
        hidden, aux = runner.model(
            static.input_ids[:n], meta, runner.kv.k_buffers, runner.kv.v_buffers, key.hidden_layers
        )
        if key.mode is ForwardMode.EXTEND:
            # The last real row's logits only (the index is an input: one graph serves
            # every chunk length of the bucket), not a vocabulary row per padded token.
            logits = runner.model.compute_logits(hidden.index_select(0, static.last))
        else:
            logits = runner.model.compute_logits(hidden)
        return (
            logits,
            hidden if key.return_hidden else None,
            torch.cat(aux, dim=-1) if key.hidden_layers else None,
        )

    def _run_static(self, key: GraphKey, static: _StaticInputs) -> _Graph:
        logits, hidden, aux = self._body(key, static)
        return _Graph(None, logits, hidden, aux)

    def _capture(self, key: GraphKey, static: _StaticInputs) -> _Graph:
        if not self.use_graphs:
            return self._run_static(key, static)
        if key.lora:
            self._lora_meta[(key.mode, key.width)].capture_info(key.batch_size)
            if key.mode is ForwardMode.EXTEND:
                self._lora_meta[(ForwardMode.DECODE, 1)].capture_info(1)  # the lm_head's row
        graph, (logits, hidden, aux) = capture_or_eager(
            lambda: self._body(key, static), self.device, self._pool, what=f"the forward {key}", warmups=2
        )
        if graph is None:  # graphs captured before still replay
            self.use_graphs = False
            self.capture_failures += 1
        return _Graph(graph, logits, hidden, aux)
