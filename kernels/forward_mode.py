"""The batch shapes a forward runs, and the one function that counts their token rows.

Shared vocabulary of the runtime (which builds batches of these shapes) and the kernels
(whose metadata is laid out per shape): a small module both import, depending on nothing.
Decode, target-verify and extend token counts come from :func:`token_counts` only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence


class ForwardMode(enum.Enum):
    """The batch shapes the target model runs."""

    EXTEND = "extend"  # prefill / chunked prefill: ragged per-request lengths
    DECODE = "decode"  # one token per request
    TARGET_VERIFY = "target_verify"  # exactly k draft tokens per request


def token_counts(
    mode: ForwardMode,
    batch_size: int,
    *,
    extend_lens: Sequence[int] | None = None,
    num_draft_tokens: int | None = None,
) -> tuple[int, int]:
    """Return ``(total token rows, max rows per request)`` for a batch.

    decode: ``(bs, 1)``; target-verify: ``(bs * k, k)``; extend: ``(sum, max)`` of the
    host-side extend lengths. Target-verify has no extend lengths: they are never read
    there, so a stale list from an earlier extend cannot leak into the layout.
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    if mode is ForwardMode.DECODE:
        return batch_size, 1 if batch_size else 0
    if mode is ForwardMode.TARGET_VERIFY:
        if num_draft_tokens is None or num_draft_tokens < 1:
            raise ValueError(f"target-verify needs num_draft_tokens >= 1, got {num_draft_tokens}")
        return batch_size * num_draft_tokens, num_draft_tokens if batch_size else 0
    if mode is ForwardMode.EXTEND:
        if extend_lens is None:
            raise ValueError("extend needs the host-side extend_lens")
        if len(extend_lens) != batch_size:
            raise ValueError(f"extend_lens has {len(extend_lens)} entries for batch_size {batch_size}")
        lens = [int(n) for n in extend_lens]
        if any(n < 0 for n in lens):
            raise ValueError(f"extend_lens must be >= 0, got {lens}")
        return sum(lens), max(lens, default=0)
    raise ValueError(f"unknown forward mode {mode!r}")
