"""Attention over the paged KV cache with ``scaled_dot_product_attention``.

Every token's K/V is written to its cache slot first; then each request's whole context
is gathered by slot index into a padded ``[batch, context, kv_heads, head_dim]`` block and
attended with a boolean mask built on the device from positions. No per-token host loops:
the metadata below is computed once per forward and shared by every layer.

With ``backend="triton"``, decode and target-verify batches (every request carries the same
number of new tokens) skip the gather: :mod:`.paged_attention` reads the keys in place
through the token table. Extend batches (ragged) always take the SDPA path.

Grouped-query attention without copying K/V: the ``g = heads / kv_heads`` query heads
that share a KV head are folded into the query-length dimension, so SDPA sees
``[batch, kv_heads, g * q_len, head_dim]`` queries against ``[batch, kv_heads, ctx,
head_dim]`` keys and the mask is tiled ``g`` times.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:  # triton is an optional dependency: the kernel module loads on first use
    from .paged_attention import PagedAttentionInputs

# SDPA backends for every CUDA step, eager or captured: all but cuDNN's (see Attention.forward).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")


def resolve_attention_backend(backend: str, device: torch.device) -> str:
    """``auto``: the paged Triton kernel on CUDA when triton is installed (it reads the KV
    cache in place where SDPA copies each context; docs/runtime.md#attention), SDPA elsewhere
    (the interpreter is for tests, not serving). Other values are returned as given."""
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "sdpa"


def check_attention_backend(backend: str, device: torch.device, field: str = "attention_backend") -> None:
    """Raise ``ValueError`` naming ``field`` when ``backend`` is unknown or cannot run on ``device``."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{field} must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend != "triton":
        return
    if importlib.util.find_spec("triton") is None:
        raise ValueError(
            f"{field}=triton needs the triton package (pip install 'loraserve[triton]'): or use {field}=sdpa"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"{field}=triton needs a CUDA device (or TRITON_INTERPRET=1, for tests); this runtime is on "
            f"{device.type}: use {field}=sdpa"
        )


@dataclass
class AttentionMetadata:
    """Where a batch's tokens sit: shared by every attention layer of one forward."""

    batch_size: int
    max_q: int  # query rows per request after padding
    max_ctx: int  # key columns gathered per request
    positions: torch.Tensor  # int64 [T]: each token's position in its request
    out_cache_loc: torch.Tensor  # int64 [T]: the KV slot each token is written to
    kv_indices: torch.Tensor | None  # int64 [bs, max_ctx]: KV slots of each request's context
    mask: torch.Tensor | None  # bool [bs, 1, groups * max_q, max_ctx]: True = may attend
    q_dest: torch.Tensor | None  # int64 [T]: padded row of each token; None when uniform
    paged: PagedAttentionInputs | None = None  # set: the Triton kernel reads keys in place


def _paged_fits(groups: int, width: int) -> bool:
    """Whether the paged kernel takes a uniform batch this wide (loaded only for ``triton``)."""
    from .paged_attention import fits

    return fits(groups, width)


def build_attention_metadata(
    *,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_q: int,
    max_ctx: int,
    groups: int,
    q_lens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    backend: str = "sdpa",
    tree_depths: torch.Tensor | None = None,
    tree_ancestors: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Build the metadata on the device of ``req_to_token``.

    ``rows``: each request's row in the token table; ``prefix_lens``: tokens already cached
    before this batch; ``q_lens``: new tokens per request for ragged (extend) batches, or
    None when every request carries exactly ``max_q`` (decode, target-verify). With
    ``q_lens`` None the ops are shape-static and can be captured in a CUDA graph.
    ``backend="triton"`` gives uniform batches the paged kernel's inputs instead of a
    gathered context and mask. ``tree_depths`` / ``tree_ancestors`` (``[bs, max_q]`` /
    ``[bs, max_q, max_q]``): the new tokens are a draft tree's nodes, each at ``prefix +
    depth`` and seeing the cache and its own ancestors (the paged kernel with
    ``backend="triton"`` and no sliding window, else SDPA; see :mod:`..spec.tree`).
    """
    device = req_to_token.device
    bs = rows.shape[0]
    q_off = torch.arange(max_q, device=device)
    tree = tree_depths is not None
    if tree:
        assert tree_ancestors is not None and q_lens is None, "a tree verify is uniform"
    q_pos = prefix_lens[:, None] + (tree_depths if tree else q_off[None, :])  # [bs, max_q]
    # The paged kernel takes uniform batches of a few tokens per request (decode, verify,
    # trees); a prefill captured as a uniform batch, or a tree with a sliding window, stays on SDPA.
    if (
        backend == "triton"
        and q_lens is None
        and not (tree and sliding_window is not None)
        and _paged_fits(groups, max_q)
    ):
        from .paged_attention import PagedAttentionInputs

        paged = PagedAttentionInputs(
            req_to_token=req_to_token,
            rows=rows,
            prefix_lens=prefix_lens,
            width=max_q,
            max_context=max_ctx,
            sliding_window=sliding_window,
            tree_ancestors=tree_ancestors,
        )
        return AttentionMetadata(
            batch_size=bs,
            max_q=max_q,
            max_ctx=max_ctx,
            positions=q_pos.reshape(-1),
            out_cache_loc=out_cache_loc,
            kv_indices=None,
            mask=None,
            q_dest=None,
            paged=paged,
        )
    if tree:
        return _tree_metadata(
            req_to_token, rows, prefix_lens, out_cache_loc, max_q, max_ctx, groups, sliding_window,
            tree_depths, tree_ancestors,
        )  # fmt: skip
    if q_lens is None:
        positions = q_pos.reshape(-1)
        q_dest = None
    else:
        valid = q_off[None, :] < q_lens[:, None]
        q_dest = valid.reshape(-1).nonzero().squeeze(1)
        positions = q_pos.reshape(-1).index_select(0, q_dest)
    kv_indices = req_to_token.index_select(0, rows)[:, :max_ctx]
    key_pos = torch.arange(max_ctx, device=device)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]  # causal over the request's own context
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask[:, None, None].expand(bs, 1, groups, max_q, max_ctx).reshape(bs, 1, groups * max_q, max_ctx)
    return AttentionMetadata(
        batch_size=bs,
        max_q=max_q,
        max_ctx=max_ctx,
        positions=positions,
        out_cache_loc=out_cache_loc,
        kv_indices=kv_indices,
        mask=mask,
        q_dest=q_dest,
    )


def _tree_metadata(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    max_q: int,
    max_ctx: int,
    groups: int,
    sliding_window: int | None,
    depths: torch.Tensor,
    ancestors: torch.Tensor,
) -> AttentionMetadata:
    bs = rows.shape[0]
    q_pos = prefix_lens[:, None] + depths  # [bs, max_q]
    mask = tree_attention_mask(prefix_lens, ancestors, max_ctx, groups)
    if sliding_window is not None:
        # Cached keys sit at their index; the tree's own keys are ancestors, a few positions back.
        key = torch.arange(max_ctx, device=req_to_token.device)
        near = key[None, None, :] > q_pos[:, :, None] - sliding_window
        near = near | (key[None, None, :] >= prefix_lens[:, None, None])
        mask = mask & near[:, None, None].expand(bs, 1, groups, max_q, max_ctx).reshape(mask.shape)
    return AttentionMetadata(
        batch_size=bs,
        max_q=max_q,
        max_ctx=max_ctx,
        positions=q_pos.reshape(-1),
        out_cache_loc=out_cache_loc,
        kv_indices=req_to_token.index_select(0, rows)[:, :max_ctx],
        mask=mask,
        q_dest=None,
    )


class Attention(nn.Module):
    """Writes this layer's new K/V into the cache and attends over each request's context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        # Set: scaled scores are soft-capped, ``c * tanh(s / c)``, before the mask (Gemma 2).
        self.softcap: float | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """``kv_written``: ``k`` and ``v`` are already in the caches (the fused rotary write)."""
        tokens = q.shape[0]
        kvh, g, hd = self.num_kv_heads, self.groups, self.head_dim
        bs, max_q = meta.batch_size, meta.max_q
        if not kv_written:
            k_cache.index_copy_(0, meta.out_cache_loc, k.view(tokens, kvh, hd).to(k_cache.dtype))
            v_cache.index_copy_(0, meta.out_cache_loc, v.view(tokens, kvh, hd).to(v_cache.dtype))
        if meta.paged is not None:
            from .paged_attention import paged_attention

            q_heads = q.view(tokens, kvh * g, hd)
            return paged_attention(
                q_heads, k_cache, v_cache, meta.paged, scale=self.scale, softcap=self.softcap
            )
        assert meta.kv_indices is not None and meta.mask is not None
        keys = k_cache[meta.kv_indices].to(q.dtype).transpose(1, 2)  # [bs, kvh, ctx, hd]
        values = v_cache[meta.kv_indices].to(q.dtype).transpose(1, 2)
        qh = q.view(tokens, kvh, g, hd)
        if meta.q_dest is not None:
            padded = q.new_zeros(bs * max_q, kvh, g, hd)
            padded.index_copy_(0, meta.q_dest, qh)
            qh = padded
        qh = qh.view(bs, max_q, kvh, g, hd).permute(0, 2, 3, 1, 4).reshape(bs, kvh, g * max_q, hd)
        if self.softcap is not None:
            out = capped_attention(qh, keys, values, meta.mask, scale=self.scale, softcap=self.softcap)
        elif qh.is_cuda:
            # Never cuDNN attention: its per-call host planning dwarfs its device time in
            # eager steps, and a backend chosen only inside capture would build its plan
            # there, after warm-ups that ran another backend; that capture fails. One set of
            # backends for eager steps, warm-ups and captures.
            with sdpa_kernel(SDPA_BACKENDS):
                out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=meta.mask, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=meta.mask, scale=self.scale)
        out = out.view(bs, kvh, g, max_q, hd).permute(0, 3, 1, 2, 4).reshape(bs * max_q, kvh * g * hd)
        if meta.q_dest is not None:
            out = out.index_select(0, meta.q_dest)
        return out


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, scale: float, softcap: float
) -> torch.Tensor:
    """SDPA's attention with soft-capped scores, which SDPA has no option for: scores
    ``c * tanh(scale * q·k / c)``, then the mask, softmax in float32, and the values.
    ``q`` ``[bs, kvh, rows, hd]``, ``k``/``v`` ``[bs, kvh, ctx, hd]``, ``mask`` ``[bs, 1, rows,
    ctx]``; a row with no visible key gets zeros (SDPA's rows there are dropped anyway)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, v.float()).to(q.dtype)


def tree_attention_mask(
    prefix_lens: torch.Tensor, visible: torch.Tensor, max_ctx: int, groups: int
) -> torch.Tensor:
    """SDPA mask ``[bs, 1, groups * Q, max_ctx]`` for ``Q`` queries per request that see the
    request's first ``prefix_lens`` keys and, of the ``T`` keys after them, those marked in
    ``visible`` ``[bs, Q, T]``."""
    bs, q, t = visible.shape
    key = torch.arange(max_ctx, device=visible.device)
    rel = key[None, :] - prefix_lens[:, None]  # [bs, ctx]
    in_tail = (rel >= 0) & (rel < t)
    tail = visible.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(bs, q, max_ctx))
    mask = (rel < 0)[:, None, :] | (in_tail[:, None, :] & tail)
    return mask[:, None, None].expand(bs, 1, groups, q, max_ctx).reshape(bs, 1, groups * q, max_ctx)
