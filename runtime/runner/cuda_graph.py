"""Decode, target-verify and extend (prefill) batches through CUDA graphs, per shape bucket.

A decode or verify batch is padded to the smallest captured batch size that holds it
(padding requests use table row 0 and KV slot 0, the cache's padding row and slot) and
its context to a power-of-two bucket, then written into static input buffers and
replayed. Graphs are captured lazily, the first time a (mode, width, batch bucket,
context bucket, LoRA, outputs) combination is seen, and share one memory pool; the
server's start-up warm-up (:mod:`loraserve.runtime.engine.warmup`) sees the decode and
verify ones first, before it turns ready.
:meth:`CudaGraphRunner.can_run` alone decides which batches replay.

Extend batches (prompts or chunks of them, wanting only each request's last logits)
replay in the layout of a target-verify batch of width ``W``: every request's chunk is
padded along its tokens to one common width bucket (:func:`prefill_widths`, ``W`` the
bucket of the longest chunk) and the batch to a captured batch size. Each request's
rows sit at the positions right after its own cached prefix (a prompt's earlier chunks,
or a prefix-cache hit), causal within the request, exactly as a verify's are; a padded
row is token 0 written to KV slot 0 at a position after its request's real ones, so
causal attention hides it from every real row; a padding request is all such rows on
table row 0. The graph computes the logits of each request's last real row only, picked
by a static gather index (``last``), and every hidden output is gathered back to the
ragged row order outside the graph. One request is the case ``B = 1``.

Which extends replay (:func:`extend_padding_ok`, :meth:`CudaGraphRunner.extend_shape`):
the padded tokens ``B_padded x W`` fit ``cuda_graph.max_prefill_tokens`` and are at most
:data:`EXTEND_PADDING_RATIO` times the real ones, or at most
:data:`EXTEND_PADDED_TOKENS_FREE` in all. Why: an eager extend step pays a launch floor
(tens of ms at 8B dims, whatever it carries: docs/runtime.md#cuda-graphs) that a replay
does not, and a replay pays the GPU time of its padded rows. Below a few hundred rows a
step's GEMMs are bound by reading the weights (a Hopper GPU's bf16 ridge point is near 300
rows), so padded rows there are nearly free; above it padding costs in proportion, and
bounding it at 2x keeps a replay's GPU time within twice the eager step's work, well
under the launch floor the eager step would add at these sizes, while batches that mix one
long chunk with several short ones (most of their rows padding) stay eager.

Why padded uniform batches and not the token-count buckets of SGLang's piecewise CUDA
graphs or vLLM's PIECEWISE mode (the model captured between attention calls, attention
run eagerly on the ragged batch): those need the forward split into per-layer pieces
and still launch every layer's attention from Python; here attention already has a
shape-static path for uniform batches (the verify layout), so the whole forward,
attention and LoRA included, is one graph, at the price of per-request padding, which
the policy above bounds.

LoRA inside a graph needs metadata in fixed buffers
(:class:`loraserve.kernels.graph_metadata.GraphLoRAMetadata`) and a backend whose
launches read only device tensors (Triton). With any other backend, batches that use an
adapter run eagerly and only all-base batches replay graphs. An extend's decoder rows
are one uniform extend segment of width ``W`` per request (its padded rows run its
adapter too and are dropped); its lm_head sees one row per request, in the decode
layout, as the eager extend's does.

The buckets, static buffers, capture and replay are the shared
:class:`~.graph_runner.GraphRunner`'s; this module chooses the keys and writes the body.
Everything except capture itself also runs on the CPU (``use_graphs=False``): the same
static buffers and padding, executed eagerly, so the padding logic is testable there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from loraserve.kernels import ForwardMode

from ..model.layers import build_attention_metadata
from ..model.moe import graph_buffers, using_buffers
from .forward_batch import ForwardBatch, ForwardOutput
from .graph_runner import GraphRunner, StaticRequests, fill_padded, padded_batch_size, prefill_widths

# Re-exported: the model runner and tests found these here before the shared runner existed.
from .graph_runner import context_bucket as context_bucket
from .graph_runner import graph_batch_sizes as graph_batch_sizes

if TYPE_CHECKING:
    from loraserve.kernels.graph_metadata import GraphLoRAMetadata
    from loraserve.kernels.moe import MoEBuffers

    from ..kv import Allocation
    from .model_runner import ModelRunner

_Outputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # logits, hidden, aux

EXTEND_PADDING_RATIO = 2
"""An extend replays only if its padded tokens are at most this many times its real ones..."""
EXTEND_PADDED_TOKENS_FREE = 256
"""...or at most this many in all: a step this small reads every weight once whatever it carries."""


def extend_padding_ok(real_tokens: int, padded_tokens: int) -> bool:
    """Whether an extend of ``real_tokens`` is worth padding to ``padded_tokens`` (the
    module docstring says why the bound is where it is)."""
    return padded_tokens <= max(EXTEND_PADDING_RATIO * real_tokens, EXTEND_PADDED_TOKENS_FREE)


def ragged_rows(lens: Sequence[int], width: int) -> torch.Tensor:
    """The padded row of every real token of requests ``lens`` laid out ``width`` apart
    (request ``b``'s tokens at ``b * width + 0 .. lens[b] - 1``), in the ragged order."""
    return torch.cat([torch.arange(n, dtype=torch.int64) + b * width for b, n in enumerate(lens)])


class ExtendShape(NamedTuple):
    """Where an extend batch replays: ``batch_size`` (padded) requests of ``width`` rows."""

    width: int
    batch_size: int


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
class _StaticInputs(StaticRequests):
    input_ids: torch.Tensor  # int64 [max_bs * width]
    out_cache_loc: torch.Tensor  # int64 [max_bs * width]
    last: torch.Tensor  # int64 [max requests]: an extend's last real row per request, its logits' row
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


class CudaGraphRunner(GraphRunner):
    """Pads decode / target-verify / extend batches into static buffers and replays
    captured graphs.

    ``max_prefill_tokens``: the most padded tokens (requests x width) an extend that
    replays carries (0, the default here: every extend runs eagerly; the model runner
    passes ``cuda_graph.max_prefill_tokens``).
    """

    def __init__(
        self, runner: ModelRunner, *, max_bs: int, max_prefill_tokens: int = 0, use_graphs: bool | None = None
    ):
        super().__init__(runner, max_bs=max_bs, use_graphs=use_graphs, warmups=2, what="the forward")
        self.runner: ModelRunner = runner
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.prefill_widths = prefill_widths(self.max_prefill_tokens)
        lora = runner.lora
        # Adapters inside graphs only with a backend that reads device tensors alone.
        self.lora_in_graphs = lora is not None and (not self.use_graphs or lora.backend.name == "triton")
        # Keyed by (mode, width): a prefill width may equal a verify width, and their
        # buffers differ (requests per width; an extend vs a verify LoRA layout).
        self._inputs: dict[tuple[ForwardMode, int], _StaticInputs] = {}
        self._lora_meta: dict[tuple[ForwardMode, int], GraphLoRAMetadata] = {}
        self._moe_buffers: dict[tuple[ForwardMode, int], MoEBuffers | None] = {}
        self._graphs = self.new_table()

    @property
    def num_graphs(self) -> int:
        """Shapes held: captured, or (``use_graphs=False``) run on the static path."""
        return self.num_shapes

    def can_run(self, batch: ForwardBatch, slots: Sequence[int], alloc: Allocation) -> bool:
        """Whether this batch takes the graph path (else the runner runs it eagerly)."""
        if any(s >= 0 for s in slots) and not self.lora_in_graphs:
            return False
        if batch.mode is ForwardMode.EXTEND:
            return self.extend_shape(batch, alloc) is not None
        if batch.mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return False
        return batch.batch_size <= self.max_bs

    def extend_shape(self, batch: ForwardBatch, alloc: Allocation) -> ExtendShape | None:
        """The width and padded batch size an extend replays at, or None where it runs
        eagerly: every position's logits wanted, a chunk or a batch beyond the widths and
        batch sizes, more padded tokens than ``max_prefill_tokens``, padding beyond
        :func:`extend_padding_ok`, or a padded row past the context length."""
        if batch.return_all_logits or not self.prefill_widths:
            return None
        lens = batch.per_request_tokens()
        width = padded_batch_size(self.prefill_widths, max(lens))
        padded_bs = padded_batch_size(self.batch_sizes, len(lens))
        if width is None or padded_bs is None:
            return None
        padded = width * padded_bs
        if padded > self.max_prefill_tokens or not extend_padding_ok(sum(lens), padded):
            return None
        # Padded rows take the positions after the real ones: past the context length
        # they would index beyond the rotary table (a chunk at the very end of it).
        if max(alloc.prefix_lens) + width > self.runner.kv.max_context_len:
            return None
        return ExtendShape(width, padded_bs)

    # ------------------------------------------------------------------ run
    def run(self, batch: ForwardBatch, slots: Sequence[int], alloc: Allocation) -> ForwardOutput:
        total, width = batch.token_counts()
        bs = batch.batch_size
        extend = batch.mode is ForwardMode.EXTEND
        if extend:  # every request's chunk padded to one width bucket
            shape = self.extend_shape(batch, alloc)
            assert shape is not None, "an extend that can_run refused"
            width, padded_bs = shape
        else:
            padded_bs = self.padded(bs)
        uses_lora = any(s >= 0 for s in slots)
        aux_layers = tuple(int(i) for i in batch.hidden_layers or ())
        tree = batch.tree_depths is not None
        # The real rows' context: padded prefill rows attend to whatever the bucket holds.
        key = GraphKey(
            batch.mode,
            width,
            padded_bs,
            self.context(alloc),
            uses_lora,
            batch.return_hidden,
            aux_layers,
            tree,
        )
        static = self._static_inputs(batch.mode, width)
        rows = self._fill(static, key, batch, alloc)
        lora = self.runner.lora
        if lora is not None:
            self._set_lora(key, slots, batch)
        try:
            logits, hidden, aux = self.replay(
                self._graphs,
                key,
                lambda: self._body(key, static),
                before_capture=(lambda: self._capture_lora(key)) if key.lora else None,
            )
        finally:
            if lora is not None:
                lora.ctx.clear()
        return ForwardOutput(
            # extend: one row of logits per request (its last), as the eager extend returns
            logits=logits[: bs if extend else total].clone(),
            hidden_states=_real_rows(hidden, rows, total),
            aux_hidden_states=_real_rows(aux, rows, total),
        )

    # ------------------------------------------------------------------ internals
    def _fill(
        self, static: _StaticInputs, key: GraphKey, batch: ForwardBatch, alloc: Allocation
    ) -> torch.Tensor | None:
        """Write this batch into ``static``, padded to ``key``'s batch size and width.

        Returns, for an extend of several requests, the padded row of each real token (on
        the device; the hidden outputs are gathered by it), else None (real rows first).
        """
        total, _ = batch.token_counts()
        if key.tree:
            # Padded requests keep depth 0 and see themselves only (their rows are dropped).
            depths, ancestors = static.tree_buffers()
            depths[: batch.batch_size].copy_(batch.tree_depths, non_blocking=True)
            ancestors[: batch.batch_size].copy_(batch.tree_ancestors, non_blocking=True)
        static.fill_requests(alloc, key.batch_size)
        n = key.batch_size * key.width
        if key.mode is not ForwardMode.EXTEND or batch.batch_size == 1:
            fill_padded(static.input_ids, batch.input_ids, total, n)
            fill_padded(static.out_cache_loc, alloc.out_cache_loc, total, n)
            if key.mode is ForwardMode.EXTEND:
                static.last[:1].fill_(total - 1)
            return None
        return self._fill_ragged(static, key, batch, alloc)

    def _fill_ragged(
        self, static: _StaticInputs, key: GraphKey, batch: ForwardBatch, alloc: Allocation
    ) -> torch.Tensor:
        """An extend of several requests: each one's tokens to its own ``width`` rows."""
        lens = batch.per_request_tokens()
        n = key.batch_size * key.width
        rows = ragged_rows(lens, key.width)
        last = torch.tensor([b * key.width + m - 1 for b, m in enumerate(lens)], dtype=torch.int64)
        rows = rows.to(self.device, non_blocking=True)
        for dst, src in ((static.input_ids, batch.input_ids), (static.out_cache_loc, alloc.out_cache_loc)):
            dst[:n].zero_()  # padded rows: token 0 to KV slot 0
            dst.index_copy_(0, rows, src.to(self.device, torch.int64, non_blocking=True))
        # Padding requests' logits come from their row 0, and are dropped.
        fill_padded(static.last, last, len(lens), key.batch_size)
        return rows

    def _set_lora(self, key: GraphKey, slots: Sequence[int], batch: ForwardBatch) -> None:
        """The adapters' layouts for this replay, in the fixed buffers the graph reads.

        ``num_draft_tokens`` is the batch's own verify width: the metadata refuses one that
        differs from the width it was captured for.
        """
        lora = self.runner.lora
        assert lora is not None
        info = logits_info = None
        if key.lora:
            ranks, scalings = lora.slot_ranks(), lora.slot_scalings()
            meta = self._graph_lora_meta(key.mode, key.width)
            info = logits_info = meta.update(
                list(slots),
                ranks,
                scalings,
                num_draft_tokens=batch.num_draft_tokens,
                batch_size=key.batch_size,
            )
            if key.mode is ForwardMode.EXTEND:
                # The lm_head sees each request's last row only: a decode batch's layout,
                # as in the eager extend. The decode graphs' metadata holds it (updated
                # before each of their replays, so sharing it is safe).
                logits_info = self._graph_lora_meta(ForwardMode.DECODE, 1).update(
                    list(slots), ranks, scalings, batch_size=key.batch_size
                )
        lora.ctx.set(info, logits_info)

    def _capture_lora(self, key: GraphKey) -> None:
        """The capture-time LoRA layouts (the largest each buffer holds) for ``key``."""
        self._lora_meta[(key.mode, key.width)].capture_info(key.batch_size)
        if key.mode is ForwardMode.EXTEND:
            self._lora_meta[(ForwardMode.DECODE, 1)].capture_info(key.batch_size)  # the lm_head's rows

    def _max_requests(self, mode: ForwardMode, width: int) -> int:
        """Requests a graph of ``mode`` and ``width`` holds: an extend's, as many as keep
        its padded tokens within ``max_prefill_tokens`` (at least one)."""
        if mode is not ForwardMode.EXTEND:
            return self.max_bs
        return max([1] + [b for b in self.batch_sizes if b * width <= self.max_prefill_tokens])

    def _static_inputs(self, mode: ForwardMode, width: int) -> _StaticInputs:
        reqs = self._max_requests(mode, width)
        return self.cached(
            self._inputs,
            (mode, width),
            lambda: self.static_requests(
                _StaticInputs,
                reqs,
                input_ids=self.zeros(reqs * width),
                out_cache_loc=self.zeros(reqs * width),
                last=self.zeros(reqs),
            ),
        )

    def _graph_lora_meta(self, mode: ForwardMode, width: int) -> GraphLoRAMetadata:
        def make() -> GraphLoRAMetadata:
            from loraserve.kernels.graph_metadata import GraphLoRAMetadata

            return GraphLoRAMetadata(
                mode,
                self._max_requests(mode, width),
                self.runner.lora.num_slots,
                num_draft_tokens=width if mode is ForwardMode.TARGET_VERIFY else None,
                extend_len=width if mode is ForwardMode.EXTEND else None,
                device=self.device,
            )

        return self.cached(self._lora_meta, (mode, width), make)

    def _body(self, key: GraphKey, static: _StaticInputs) -> _Outputs:
        """The forward of ``key`` on the static buffers: logits, hidden and aux outputs."""
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
        with self._moe_routing(key, static):
            hidden, aux = runner.model(
                static.input_ids[:n], meta, runner.kv.k_buffers, runner.kv.v_buffers, key.hidden_layers
            )
        if key.mode is ForwardMode.EXTEND:
            # Each request's last real row's logits only (the index is an input: one graph
            # serves every chunk length of the bucket), not a vocabulary row per padded token.
            logits = runner.model.compute_logits(hidden.index_select(0, static.last[: key.batch_size]))
        else:
            logits = runner.model.compute_logits(hidden)
        return (
            logits,
            hidden if key.return_hidden else None,
            torch.cat(aux, dim=-1) if key.hidden_layers else None,
        )

    def _moe_routing(self, key: GraphKey, static: _StaticInputs) -> contextlib.AbstractContextManager:
        """An MoE model's layers route into persistent buffers sized in token rows, as the
        static inputs are (requests x width, never requests alone: a verify feeds ``bs x width``)."""
        runner = self.runner
        if runner.arch.moe is None:
            return contextlib.nullcontext()
        slots = runner.lora.num_slots if runner.lora is not None else 0
        reqs = self._max_requests(key.mode, key.width)
        buffers = self.cached(
            self._moe_buffers, (key.mode, key.width), lambda: graph_buffers(runner.model, key.mode, reqs, key.width, slots)
        )
        return using_buffers(runner.model, buffers)


def _real_rows(out: torch.Tensor | None, rows: torch.Tensor | None, total: int) -> torch.Tensor | None:
    """A graph's per-row output (``[padded rows, ...]``) at the batch's real rows, copied
    out of the graph's buffer: ``rows`` (an extend of several requests) or the first ``total``."""
    if out is None:
        return None
    return out.index_select(0, rows) if rows is not None else out[:total].clone()
