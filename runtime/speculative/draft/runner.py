"""The parts every draft model runner beside the target shares.

A draft runner holds the draft's own paged KV cache (a :class:`~...kv.KVCache` sized like
the target's, so the draft never runs out before the target does), its weights (read from
the checkpoint or drawn at random, per ``speculative.draft_load_format``), the target's
dtype, device and attention backend, and the context buckets its forwards attend over (the
target's, so a new length each step is not a new shape). An algorithm's runner
(``eagle.runner``, ``dflash.runner``) subclasses it with its model and forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from ...kv import Allocation, KVCache
from ...model.arch import ModelConfigError
from ...model.layers import AttentionMetadata, build_attention_metadata
from ...runner.graph_runner import context_bucket
from .settings import DraftSettings

Tensors = dict[str, torch.Tensor]


class DraftRunner:
    """A draft model beside the target: settings, KV cache, weights, context buckets.

    Subclasses set ``config`` (with ``config.layer.num_heads`` / ``num_kv_heads``), call
    :meth:`load_tensors`, :meth:`install` and :meth:`allocate_kv`, and build their graph
    runner where :meth:`graphs_wanted` says so."""

    is_draft = True
    kind = "draft"
    """How messages name the draft (``an EAGLE draft``)."""

    def __init__(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.path = Path(settings.path)
        self.device = torch.device(settings.device)
        self.dtype = settings.dtype
        self.attention_backend = settings.attention_backend
        self.graphs = None
        self.kv: KVCache

    # ------------------------------------------------------------------ building
    def load_tensors(self, read: Callable[[], Tensors], draw: Callable[[int], Tensors]) -> Tensors:
        """The draft's weights per ``speculative.draft_load_format``: ``auto`` / ``safetensors``
        ``read`` the checkpoint; ``dummy`` ``draw``s random weights of the right shapes from
        the settings' seed (benchmarks of the machinery alone); ``pt`` pickles are refused,
        since loading one can run arbitrary code."""
        fmt = self.settings.load_format
        if fmt in ("auto", "safetensors"):
            return read()
        if fmt == "dummy":
            return draw(self.settings.seed)
        raise ModelConfigError(
            f"speculative.draft_load_format {fmt!r} cannot load {self.kind}: use 'auto' or 'safetensors' "
            "(pickle 'pt' weights are refused), or 'dummy' for random weights"
        )

    def install(self, model: nn.Module, tensors: Tensors) -> None:
        """Load ``tensors`` into ``model`` and keep it, in eval mode, as the runner's model."""
        model.load_weights(tensors)
        model.eval()
        self.model = model

    def allocate_kv(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """The draft's own paged KV cache, holding as many tokens and requests as the target's."""
        s = self.settings
        self.kv = KVCache(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=self.dtype,
            device=self.device,
            max_total_tokens=s.max_total_tokens,
            max_requests=s.max_requests,
            max_context_len=s.max_context_len,
        )

    def graphs_wanted(self) -> bool:
        """Whether uniform forwards should replay from CUDA graphs (asked for, and on a GPU)."""
        return self.settings.cuda_graph_max_bs > 0 and self.device.type == "cuda"

    # ------------------------------------------------------------------ running
    @property
    def attn_groups(self) -> int:
        """Query heads per KV head of the draft's layers."""
        layer = self.config.layer
        return layer.num_heads // layer.num_kv_heads

    def context(self, alloc: Allocation) -> int:
        """Key columns, bucketed as the target's contexts: a new length each step would be a new shape."""
        return context_bucket(max(alloc.seq_lens), self.kv.max_context_len)

    def attention(
        self,
        rows: torch.Tensor,
        prefix_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        width: int,
        context: int,
        **layout,
    ) -> AttentionMetadata:
        """Attention metadata of ``width`` rows per request over the draft's cache (``layout``:
        ragged ``q_lens``, or ``tree_depths`` / ``tree_ancestors``), on the target's backend."""
        return build_attention_metadata(
            req_to_token=self.kv.req_to_token,
            rows=rows,
            prefix_lens=prefix_lens,
            out_cache_loc=out_cache_loc,
            max_q=width,
            max_ctx=context,
            groups=self.attn_groups,
            backend=self.attention_backend,
            **layout,
        )

    def allocated(self, request_ids: Sequence[Hashable], rows: int) -> AbstractContextManager[Allocation]:
        """``rows`` new cache entries per request, rolled back if the body fails."""
        return self.kv.allocating(request_ids, [rows] * len(request_ids))

    def held(self, request_id: Hashable) -> int:
        """Cache entries the draft holds for a request (0 when it has none)."""
        return self.kv.seq_len(request_id) if request_id in self.kv else 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the target's vocabulary from the draft's final hidden rows."""
        return self.model.compute_logits(hidden)

    def release(self, request_id: Hashable) -> None:
        """Free a request's cache entries."""
        self.kv.free(request_id)
