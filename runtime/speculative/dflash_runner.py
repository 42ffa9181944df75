"""Runs a DFLASH draft next to its target, with the draft's own KV cache.

The draft's KV of projected context features is a separate
:class:`~loraserve.runtime.kv.KVCache` with one layer per draft layer, sized like the
target's (so the draft can never run out before the target does). It is the same paged
pool the target and the EAGLE head use rather than per-request tensors: appends are O(new
rows), dropping a request returns its slots at once, and the block forward attends through
the same attention layer (SDPA or the paged Triton kernel) the target uses.

Entry ``i`` of a request holds every draft layer's K/V of the target's features at the
``i``-th position the draft has seen. Positions are the draft's own (its entry index): a
request whose draft state was lost starts again at 0 and keeps the right relative
distances (rotary attention depends on nothing else). Outside :meth:`draft_block` the
cache holds context entries only; a block's entries are dropped as soon as it has run.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path

import numpy as np
import torch

from ..kv import Allocation, KVCache
from ..model.arch import ModelArchConfig, ModelConfigError
from ..model.layers import build_attention_metadata
from ..runner.graph_runner import context_bucket
from .dflash_format import (
    DFlashDraftConfig,
    load_dflash_config,
    load_dflash_tensors,
    random_dflash_tensors,
    resolve_mask_token_id,
)
from .dflash_model import DFlashDraftModel


class DFlashDraftRunner:
    """Loads a DFLASH draft next to its target; appends context and drafts blocks."""

    is_draft = True
    lora = None  # drafts never carry adapters

    def __init__(
        self,
        path: str | Path,
        *,
        target_arch: ModelArchConfig,
        target_dir: str | Path,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device | str,
        max_total_tokens: int,
        max_requests: int,
        max_context_len: int,
        architecture: str | None = None,
        load_format: str = "auto",
        seed: int = 0,
        attention_backend: str = "sdpa",
    ):
        """``embed_weight`` / ``lm_head_weight``: the target's BASE weights (unwrapped from
        any adapter wrapper by the caller); ``attention_backend``: the target's."""
        self.path = Path(path)
        self.config: DFlashDraftConfig = load_dflash_config(
            path, target_num_layers=target_arch.num_layers, architecture_override=architecture
        )
        self.config.check_target(target_arch)
        self.mask_token_id, self.mask_source = resolve_mask_token_id(
            self.config, draft_dir=path, target_dir=target_dir, vocab_size=target_arch.vocab_size
        )
        if load_format in ("auto", "safetensors"):
            tensors = load_dflash_tensors(path, self.config)
        elif load_format == "dummy":
            tensors = random_dflash_tensors(self.config, seed=seed)
        else:
            raise ModelConfigError(
                f"speculative.draft_load_format {load_format!r} cannot load a DFLASH draft: use 'auto' or "
                "'safetensors' (pickle 'pt' weights are refused), or 'dummy' for random weights"
            )
        self.device = torch.device(device)
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.model = DFlashDraftModel(
            self.config,
            embed_weight=embed_weight,
            lm_head_weight=lm_head_weight,
            max_positions=max_context_len,
            dtype=dtype,
            device=self.device,
        )
        self.model.load_weights(tensors)
        self.model.eval()
        layer = self.config.layer
        self.kv = KVCache(
            num_layers=layer.num_layers,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            dtype=dtype,
            device=self.device,
            max_total_tokens=max_total_tokens,
            max_requests=max_requests,
            max_context_len=max_context_len,
        )

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target's residual streams the draft reads (``ForwardBatch.hidden_layers``)."""
        return self.config.capture_layers

    @property
    def attn_groups(self) -> int:
        return self.config.layer.num_heads // self.config.layer.num_kv_heads

    def held(self, request_id: Hashable) -> int:
        """Context entries the draft holds for a request (0 when it has none)."""
        return self.kv.seq_len(request_id) if request_id in self.kv else 0

    @torch.inference_mode()
    def append_context(
        self, request_ids: Sequence[Hashable], features: torch.Tensor, lens: Sequence[int]
    ) -> None:
        """Append ``lens[i]`` context rows for request ``i`` from the target's captured
        features (flat ``[sum(lens), K * H]`` in request order). All or nothing."""
        counts = [int(n) for n in lens]
        if features.shape[0] != sum(counts):
            raise ValueError(f"{features.shape[0]} feature rows for lens summing to {sum(counts)}")
        keep = [i for i, n in enumerate(counts) if n > 0]
        if not keep:
            return
        if len(keep) < len(counts):
            request_ids = [request_ids[i] for i in keep]
            counts = [counts[i] for i in keep]
        alloc = self.kv.allocate(request_ids, counts)
        try:
            starts = np.repeat(np.asarray(alloc.prefix_lens, dtype=np.int64), counts)
            within = np.arange(sum(counts), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
            positions = torch.from_numpy(starts + within).to(self.device, non_blocking=True)
            self.model.write_context(
                features.to(device=self.device, dtype=self.dtype),
                positions,
                alloc.out_cache_loc,
                self.kv.k_buffers,
                self.kv.v_buffers,
            )
        except BaseException:
            self.kv.rollback(alloc)
            raise

    @torch.inference_mode()
    def draft_block(
        self, request_ids: Sequence[Hashable], first_tokens: torch.Tensor, width: int
    ) -> torch.Tensor:
        """Draft one block per request: ``[first_tokens[i], mask × (width - 1)]`` after the
        request's context, every block row seeing the whole context and the whole block.
        Returns the draft's logits (float32) at block rows ``1 .. width - 1``:
        ``[bs, width - 1, vocab]``. The block's cache entries are dropped before returning."""
        bs = len(request_ids)
        ids = torch.full((bs, width), self.mask_token_id, dtype=torch.int64, device=self.device)
        ids[:, 0] = first_tokens.to(self.device)
        alloc = self.kv.allocate(request_ids, [width] * bs)
        try:
            hidden = self._block(alloc, ids.reshape(-1), width)
        finally:
            for rid in request_ids:
                self.kv.truncate(rid, width)
        hidden = hidden.view(bs, width, -1)[:, 1:]
        return self.model.compute_logits(hidden.reshape(bs * (width - 1), -1)).view(bs, width - 1, -1)

    def _block(self, alloc: Allocation, input_ids: torch.Tensor, width: int) -> torch.Tensor:
        bs = len(alloc.request_ids)
        # The block as a "tree" whose nodes are all ancestors of each other: node n sits at
        # prefix + n and sees the whole context and every node (non-causal in the block).
        depths = torch.arange(width, device=self.device).expand(bs, width)
        visible = torch.ones(bs, width, width, dtype=torch.bool, device=self.device)
        meta = build_attention_metadata(
            req_to_token=self.kv.req_to_token,
            rows=alloc.rows,
            prefix_lens=torch.tensor(alloc.prefix_lens, dtype=torch.int64).to(self.device, non_blocking=True),
            out_cache_loc=alloc.out_cache_loc,
            max_q=width,
            max_ctx=context_bucket(max(alloc.seq_lens), self.kv.max_context_len),
            groups=self.attn_groups,
            backend=self.attention_backend,
            tree_depths=depths,
            tree_ancestors=visible,
        )
        return self.model(input_ids, meta, self.kv.k_buffers, self.kv.v_buffers)

    def release(self, request_id: Hashable) -> None:
        self.kv.free(request_id)
