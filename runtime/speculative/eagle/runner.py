"""Runs an EAGLE / EAGLE3 draft head with its own single-layer KV cache.

The draft's cache mirrors the target's token positions: entry ``i`` of a request holds
the draft layer's K/V for the pair (feature of position ``i``, token ``i + 1``). It is a
separate :class:`~loraserve.runtime.kv.KVCache` of one layer (:class:`~..draft.runner.DraftRunner`'s,
sized to hold as many tokens as the target's, so the draft can never run out before the
target does).

Draft adapters (``draft_lora``: the serve's draft adapter pool, :mod:`.lora`): every
public call takes ``lora_names``, each request's draft adapter (None: the base head), and
runs the head's linears with them, eagerly or inside the graphs. The target's adapters
never reach this runner.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from ...contract.config import LoRAConfig
from ..draft.runner import DraftRunner
from ..draft.settings import DraftSettings
from ..draft_vocab import (
    DraftVocab,
    TokenMapError,
    load_token_map,
    own_head_vocab,
    resolve_token_map,
    target_head_vocab,
)
from ..tree import DraftTree, TreeShape
from .format import INPUT_NORM, EagleDraftConfig, load_eagle_config, load_eagle_tensors
from .graphs import EagleGraphRunner, grow_tree
from .lora import HeadAdapterBatch, HeadLoRAManager
from .model import EagleDraftModel


class EagleDraftRunner(DraftRunner):
    """Loads a draft head next to its target and runs ragged or uniform batches of it."""

    kind = "an EAGLE draft"

    def __init__(self, settings: DraftSettings):
        """``settings.cuda_graph_max_bs``: replay single-row draft steps of up to this many
        requests from CUDA graphs (:mod:`.graphs`; 0: always eager). ``settings.token_map``:
        a file of token ids the draft predicts over, through those rows of the target's LM
        head (:func:`..draft_vocab.load_token_map`; relative paths are files of the draft's
        directory). ``settings.draft_lora``: the draft adapter pool (None: every request
        drafts with the base head)."""
        super().__init__(settings)
        path = str(settings.path)
        self.config: EagleDraftConfig = load_eagle_config(
            path, architecture_override=settings.architecture, target_num_layers=settings.target_arch.num_layers
        )
        self.config.check_target(settings.target_arch)
        map_file = resolve_token_map(settings.token_map, path) if settings.token_map else None
        exclude = (map_file,) if map_file else ()
        tensors = self.load_tensors(
            lambda: load_eagle_tensors(path, self.config, exclude=exclude),
            lambda seed: _random_tensors(self.config, seed),
        )
        self.vocab = _draft_vocab(
            self.config, tensors, settings.lm_head_weight, map_file, path, dtype=self.dtype, device=self.device
        )
        model = EagleDraftModel(
            self.config,
            embed_weight=settings.embed_weight,
            vocab=self.vocab,
            max_positions=settings.max_context_len,
            dtype=self.dtype,
            device=self.device,
            has_input_norm=INPUT_NORM in tensors,
        )
        self.install(model, tensors)
        self.lora: HeadLoRAManager | None = _draft_pool(settings.draft_lora, model, self.device, self.dtype)
        self._adapters: HeadAdapterBatch | None = None  # the call in progress's draft adapters
        layer = self.config.layer
        self.allocate_kv(1, layer.num_kv_heads, layer.head_dim)
        self.graphs: EagleGraphRunner | None = None
        # Draft adapters inside graphs need kernels that read device tensors alone (Triton),
        # as the target's do; with another LoRA backend the head runs eagerly.
        capturable = self.lora is None or self.lora.backend.name == "triton"
        if self.graphs_wanted() and capturable:
            self.graphs = EagleGraphRunner(self, max_bs=settings.cuda_graph_max_bs)

    @property
    def version(self) -> int:
        return self.config.version

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.config.aux_layer_ids

    @torch.inference_mode()
    def forward(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        new_lens: Sequence[int],
        *,
        from_target: bool = True,
        lora_names: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """Append ``new_lens[i]`` pairs for request ``i``; returns the output features ``[T, H]``.

        ``input_ids`` / ``features`` are flat in request order; ``from_target``: the
        features are the target's (else the draft's own outputs). ``lora_names``: each
        request's draft adapter (None: the base head). On failure the cache is left as it was.
        """
        with self._adapting(lora_names):
            return self._forward(request_ids, input_ids, features, new_lens, from_target=from_target)

    def _forward(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        new_lens: Sequence[int],
        *,
        from_target: bool,
    ) -> torch.Tensor:
        lens = [int(n) for n in new_lens]
        if input_ids.numel() != sum(lens) or features.shape[0] != sum(lens):
            raise ValueError(
                f"{input_ids.numel()} tokens and {features.shape[0]} features for new_lens summing to {sum(lens)}"
            )
        with self.kv.allocating(request_ids, lens) as alloc:
            uniform = len(set(lens)) == 1
            return self.head(
                alloc.rows,
                torch.tensor(alloc.prefix_lens, dtype=torch.int64, device=self.device),
                alloc.out_cache_loc,
                max(lens),
                self.context(alloc),
                input_ids.to(self.device),
                features.to(device=self.device, dtype=self.dtype),
                from_target=from_target,
                q_lens=None if uniform else torch.tensor(lens, dtype=torch.int64, device=self.device),
                ragged_lens=None if uniform else lens,
            )

    def head(
        self,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        width: int,
        context: int,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        *,
        from_target: bool,
        q_lens: torch.Tensor | None = None,
        ragged_lens: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """One forward of the head over rows already allocated: ``width`` rows per request
        (``q_lens``: each request's own count, a ragged batch, ``ragged_lens`` on the host),
        attending over ``context`` key columns. Uniform calls use device tensors only, so
        the graph runner captures them."""
        meta = self.attention(rows, prefix_lens, out_cache_loc, width, context, q_lens=q_lens)
        self.apply_adapters(width, ragged_lens)
        return self.model(
            input_ids, features, meta, self.kv.k_buffers[0], self.kv.v_buffers[0], from_target=from_target
        )

    def apply_adapters(self, width: int, ragged_lens: Sequence[int] | None = None) -> None:
        """Lay out the call's draft adapters for the next head forward (``width`` rows per
        request, or ``ragged_lens``); nothing when no request of the call has one."""
        if self._adapters is not None:
            self._adapters.apply(width, ragged_lens)

    @torch.inference_mode()
    def forward_uniform(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        width: int,
        *,
        lora_names: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """Append ``width`` of the target's (feature, next token) pairs for every request;
        returns the output features ``[bs * width, H]``. Replayed from a CUDA graph where one
        is available. On failure the cache is left as it was."""
        bs = len(request_ids)
        with self._adapting(lora_names, graphed=self._graphable(bs)) as slots:
            if not self._graphable(bs):
                return self._forward(request_ids, input_ids, features, [width] * bs, from_target=True)
            hidden, _ = self._replay(request_ids, input_ids, features, width, from_target=True, slots=slots)
            return hidden

    @torch.inference_mode()
    def step(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        *,
        lora_names: Sequence[str | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: a row per request from its previous draft token and the head's own
        output feature; returns ``(output features [bs, H], logits [bs, vocab])``. Replayed
        from a CUDA graph where one is available, else eager. On failure the cache is left
        as it was."""
        bs = len(request_ids)
        with self._adapting(lora_names, graphed=self._graphable(bs)) as slots:
            if not self._graphable(bs):
                hidden = self._forward(request_ids, input_ids, features, [1] * bs, from_target=False)
                return hidden, self.compute_logits(hidden)
            hidden, logits = self._replay(request_ids, input_ids, features, 1, from_target=False, slots=slots)
            assert logits is not None
            return hidden, logits

    def can_chain(self, batch_size: int) -> bool:
        """Whether greedy draft steps of this batch run as one graph chain (:meth:`draft_chain`)."""
        return self._graphable(batch_size)

    def _graphable(self, batch_size: int) -> bool:
        return self.graphs is not None and self.graphs.can_run(batch_size)

    @torch.inference_mode()
    def draft_chain(
        self,
        request_ids: Sequence[Hashable],
        hidden: torch.Tensor,
        num_tokens: int,
        *,
        lora_names: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """``num_tokens`` greedy draft tokens per request, as one replay: the first from the head
        output ``hidden`` (the LM head's argmax), each later one from a draft step fed the
        previous token; returns ``[bs, num_tokens]``. The same tokens and cache entries as
        :meth:`compute_logits` then ``num_tokens - 1`` calls of :meth:`step` with the argmax
        fed back. On failure the cache is left as it was."""
        assert self.graphs is not None
        if num_tokens < 1:
            raise ValueError(f"a draft chain proposes at least one token, got num_tokens={num_tokens}")
        steps = num_tokens - 1
        with self._adapting(lora_names, graphed=True) as slots, self.allocated(request_ids, steps) as alloc:
            return self.graphs.run_chain(alloc, hidden.to(self.device, self.dtype), steps, slots=slots)

    @torch.inference_mode()
    def feed_chain(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        accept_lens: torch.Tensor,
        width: int,
        num_tokens: int,
        *,
        lora_names: Sequence[str | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """After a greedy verify, in one replay: append ``width`` of the target's (feature,
        next token) pairs per request, and propose ``num_tokens`` greedy drafts from the pair
        at ``accept_lens[i]`` (a device tensor: the host need not have read it). Returns the
        drafts ``[bs, num_tokens]`` and the tails ``[bs, H]``.

        The cache gains ``width + num_tokens - 1`` entries per request; the caller keeps the
        first ``accept_lens[i] + 1`` (the rest are the rejected positions and the proposal's
        own entries, which the next update truncates). On failure the cache is left as it was.
        """
        assert self.graphs is not None
        if num_tokens < 1:
            raise ValueError(f"a draft chain proposes at least one token, got num_tokens={num_tokens}")
        steps = num_tokens - 1
        with (
            self._adapting(lora_names, graphed=True) as slots,
            self.allocated(request_ids, width + steps) as alloc,
        ):
            return self.graphs.run_feed_chain(
                alloc,
                input_ids.to(self.device),
                features.to(self.device, self.dtype),
                accept_lens.to(self.device, torch.int64),
                width=width,
                steps=steps,
                slots=slots,
            )

    @torch.inference_mode()
    def draft_tree(
        self,
        request_ids: Sequence[Hashable],
        hidden: torch.Tensor,
        shape: TreeShape,
        *,
        lora_names: Sequence[str | None] | None = None,
    ) -> DraftTree:
        """Grow a greedy draft tree per request from the head output ``hidden`` (its tail):
        one replay where the graphs hold the batch, else the same work eagerly. The cache
        gains ``shape.entries`` entries per request (truncated by the next update)."""
        hidden = hidden.to(self.device, self.dtype)
        graphed = self._graphable(len(request_ids))
        with (
            self._adapting(lora_names, graphed=graphed) as slots,
            self.allocated(request_ids, shape.entries) as alloc,
        ):
            if graphed:
                return self.graphs.run_tree(alloc, hidden, shape, slots=slots)  # type: ignore[union-attr]
            prefix = torch.tensor(alloc.prefix_lens, dtype=torch.int64, device=self.device)
            locs = alloc.out_cache_loc.view(len(request_ids), shape.entries)
            return grow_tree(self, alloc.rows, prefix, locs, self.context(alloc), hidden, shape)

    @torch.inference_mode()
    def feed_tree(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        accept_lens: torch.Tensor,
        width: int,
        shape: TreeShape,
        *,
        lora_names: Sequence[str | None] | None = None,
    ) -> tuple[DraftTree, torch.Tensor]:
        """After a tree verify: append ``width`` pairs of each request's accepted path (the
        target's features at the path's nodes, each with the token that followed), then grow
        the next tree from the pair at ``accept_lens[i]``. As :meth:`feed_chain`, the caller
        keeps the first ``accept_lens[i] + 1`` entries. Returns the trees and the tails."""
        input_ids = input_ids.to(self.device)
        features = features.to(self.device, self.dtype)
        accept = accept_lens.to(self.device, torch.int64)
        bs = len(request_ids)
        graphed = self._graphable(bs)
        with (
            self._adapting(lora_names, graphed=graphed) as slots,
            self.allocated(request_ids, width + shape.entries) as alloc,
        ):
            if graphed:
                return self.graphs.run_feed_tree(  # type: ignore[union-attr]
                    alloc, input_ids, features, accept, width=width, shape=shape, slots=slots
                )
            locs = alloc.out_cache_loc.view(bs, width + shape.entries)
            prefix = torch.tensor(alloc.prefix_lens, dtype=torch.int64, device=self.device)
            context = self.context(alloc)
            hidden = self.head(
                alloc.rows, prefix, locs[:, :width].reshape(-1), width, context, input_ids, features,
                from_target=True,
            )  # fmt: skip
            tails = hidden.view(bs, width, -1)[torch.arange(bs, device=self.device), accept]
            offsets = accept[:, None] + 1 + torch.arange(shape.entries, device=self.device)[None, :]
            tree = grow_tree(
                self, alloc.rows, prefix + accept + 1, locs.gather(1, offsets), context, tails, shape
            )
            return tree, tails

    def _replay(
        self,
        request_ids: Sequence[Hashable],
        input_ids: torch.Tensor,
        features: torch.Tensor,
        width: int,
        *,
        from_target: bool,
        slots: Sequence[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Allocate ``width`` rows per request and run them through the graph runner; on
        failure the allocation is rolled back."""
        assert self.graphs is not None
        with self.allocated(request_ids, width) as alloc:
            return self.graphs.run(
                alloc,
                input_ids.to(self.device),
                features.to(self.device, self.dtype),
                width=width,
                from_target=from_target,
                slots=slots,
            )

    @contextmanager
    def _adapting(
        self, lora_names: Sequence[str | None] | None, *, graphed: bool = False
    ) -> Iterator[list[int] | None]:
        """Place the call's draft adapters in the pool's slots; yields each request's slot,
        or None when no request has one (the base head, with no LoRA work at all). Eager
        calls get their layouts here; graph calls from the graph runner (:mod:`.graphs`)."""
        if self.lora is None or lora_names is None or all(n is None for n in lora_names):
            yield None
            return
        slots = self.lora.prepare_batch(list(lora_names))
        if not graphed:
            self._adapters = HeadAdapterBatch(self.lora, slots)
        try:
            yield slots
        finally:
            self._adapters = None
            self.lora.ctx.clear()

    @contextmanager
    def adapters_for_replay(self, batch: HeadAdapterBatch | None) -> Iterator[None]:
        """The graph runner's layouts for one replay's body (``None``: no adapters)."""
        self._adapters = batch
        try:
            yield
        finally:
            self._adapters = None


def _draft_pool(
    config: LoRAConfig | None, model: EagleDraftModel, device: torch.device, dtype: torch.dtype
) -> HeadLoRAManager | None:
    """The head's draft adapter pool (None: no draft adapters). Never the target's adapters:
    the pool is built from the draft settings and starts empty."""
    if config is None or not config.enabled:
        return None
    from loraserve.kernels import get_backend

    return HeadLoRAManager(
        config, model, backend=get_backend(config.backend, str(device)), device=device, dtype=dtype
    )


def _draft_vocab(
    config: EagleDraftConfig,
    tensors: dict[str, torch.Tensor],
    target_lm_head: torch.Tensor,
    token_map: Path | None,
    path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> DraftVocab:
    """The draft's LM head and vocabulary; takes ``lm_head.weight`` and ``d2t`` out of ``tensors``."""
    vocab_size = int(target_lm_head.shape[0])
    if config.own_lm_head:
        if token_map:
            raise TokenMapError(
                f"speculative.token_map is set, but the EAGLE draft {path} has its own lm_head "
                f"({config.draft_vocab_size} tokens, draft_vocab_size in its config.json): a token map "
                "selects rows of the target's lm_head; unset speculative.token_map"
            )
        head = tensors.pop("lm_head.weight").to(device=device, dtype=dtype)
        return own_head_vocab(head, tensors.pop("d2t", None), vocab_size)
    if token_map is None:
        return target_head_vocab(target_lm_head, None, "the target's base lm_head")
    return target_head_vocab(
        target_lm_head,
        load_token_map(token_map, vocab_size),
        f"the target's base lm_head, token map {token_map}",
    )


def _random_tensors(config: EagleDraftConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the head's shapes (``dummy``): unit norms, small projections, and a
    ``d2t`` that maps the draft vocabulary onto the target's first tokens."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.02
        for name, shape in config.tensor_shapes().items()
        if name != "d2t"
    }
    if "d2t" in config.tensor_shapes():
        tensors["d2t"] = torch.zeros(config.draft_vocab_size or 0, dtype=torch.int64)  # the first tokens
    return tensors
