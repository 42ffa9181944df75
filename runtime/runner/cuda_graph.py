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

The buckets, static buffers, capture and replay are the shared
:class:`~.graph_runner.GraphRunner`'s; this module chooses the keys and writes the body.
Everything except capture itself also runs on the CPU (``use_graphs=False``): the same
static buffers and padding, executed eagerly, so the padding logic is testable there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from loraserve.kernels import ForwardMode

from ..model.layers import build_attention_metadata
from .forward_batch import ForwardBatch, ForwardOutput
from .graph_runner import GraphRunner, StaticRequests, fill_padded, padded_batch_size, prefill_widths

# Re-exported: the model runner and tests found these here before the shared runner existed.
from .graph_runner import context_bucket as context_bucket
from .graph_runner import graph_batch_sizes as graph_batch_sizes

if TYPE_CHECKING:
    from loraserve.kernels.graph_metadata import GraphLoRAMetadata

    from ..kv import Allocation
    from .model_runner import ModelRunner

_Outputs = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]  # logits, hidden, aux


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


class CudaGraphRunner(GraphRunner):
    """Pads decode / target-verify / one-request extend batches into static buffers and
    replays captured graphs.

    ``max_prefill_tokens``: the longest extend chunk that replays (0, the default here:
    every extend runs eagerly; the model runner passes ``cuda_graph.max_prefill_tokens``).
    """

    def __init__(
        self, runner: ModelRunner, *, max_bs: int, max_prefill_tokens: int = 0, use_graphs: bool | None = None
    ):
        super().__init__(runner, max_bs=max_bs, use_graphs=use_graphs, warmups=2, what="the forward")
        self.runner: ModelRunner = runner
        self.prefill_widths = prefill_widths(int(max_prefill_tokens))
        lora = runner.lora
        # Adapters inside graphs only with a backend that reads device tensors alone.
        self.lora_in_graphs = lora is not None and (not self.use_graphs or lora.backend.name == "triton")
        # Keyed by (mode, width): a prefill width may equal a verify width, and their
        # buffers differ (one request vs max_bs; an extend vs a verify LoRA layout).
        self._inputs: dict[tuple[ForwardMode, int], _StaticInputs] = {}
        self._lora_meta: dict[tuple[ForwardMode, int], GraphLoRAMetadata] = {}
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
        total, width = batch.token_counts()
        bs = batch.batch_size
        extend = batch.mode is ForwardMode.EXTEND
        if extend:  # one request, its chunk padded to a width bucket
            width, padded_bs = self._prefill_width(batch, alloc), 1
        else:
            padded_bs = self.padded(bs)
        assert width is not None
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
        self._fill(static, key, batch, alloc)
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
            hidden_states=hidden[:total].clone() if hidden is not None else None,
            aux_hidden_states=aux[:total].clone() if aux is not None else None,
        )

    # ------------------------------------------------------------------ internals
    def _fill(self, static: _StaticInputs, key: GraphKey, batch: ForwardBatch, alloc: Allocation) -> None:
        """Write this batch into ``static``, padded to ``key``'s batch size and width."""
        total, _ = batch.token_counts()
        if key.tree:
            # Padded requests keep depth 0 and see themselves only (their rows are dropped).
            depths, ancestors = static.tree_buffers()
            depths[: batch.batch_size].copy_(batch.tree_depths, non_blocking=True)
            ancestors[: batch.batch_size].copy_(batch.tree_ancestors, non_blocking=True)
        n = key.batch_size * key.width
        fill_padded(static.input_ids, batch.input_ids, total, n)
        static.fill_requests(alloc, key.batch_size)
        fill_padded(static.out_cache_loc, alloc.out_cache_loc, total, n)
        if key.mode is ForwardMode.EXTEND:
            static.last.fill_(total - 1)

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
                # The lm_head sees the last row only: a one-request decode's layout, as in
                # the eager extend. The decode graphs' metadata holds it (updated before
                # each of their replays, so sharing it is safe).
                logits_info = self._graph_lora_meta(ForwardMode.DECODE, 1).update(
                    list(slots), ranks, scalings, batch_size=1
                )
        lora.ctx.set(info, logits_info)

    def _capture_lora(self, key: GraphKey) -> None:
        """The capture-time LoRA layouts (the largest each buffer holds) for ``key``."""
        self._lora_meta[(key.mode, key.width)].capture_info(key.batch_size)
        if key.mode is ForwardMode.EXTEND:
            self._lora_meta[(ForwardMode.DECODE, 1)].capture_info(1)  # the lm_head's row

    def _max_requests(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.EXTEND else self.max_bs

    def _static_inputs(self, mode: ForwardMode, width: int) -> _StaticInputs:
        reqs = self._max_requests(mode)
        return self.cached(
            self._inputs,
            (mode, width),
            lambda: self.static_requests(
                _StaticInputs,
                reqs,
                input_ids=self.zeros(reqs * width),
                out_cache_loc=self.zeros(reqs * width),
                last=self.zeros(1),
            ),
        )

    def _graph_lora_meta(self, mode: ForwardMode, width: int) -> GraphLoRAMetadata:
        def make() -> GraphLoRAMetadata:
            from loraserve.kernels.graph_metadata import GraphLoRAMetadata

            return GraphLoRAMetadata(
                mode,
                self._max_requests(mode),
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
