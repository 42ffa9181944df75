"""What a caller hands the model runner for one forward, and what it gets back."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from loraserve.kernels import ForwardMode, token_counts


class ForwardBatchError(ValueError):
    """A malformed forward batch; the message names the field."""


@dataclass
class ForwardBatch:
    """One forward of the runner.

    ``request_ids`` own the KV cache entries the batch appends to (a new id starts an
    empty request). ``input_ids`` is the flat int64 token list in request order: one per
    request for decode, ``num_draft_tokens`` per request for target-verify, and
    ``extend_lens[i]`` for request i in extend. ``lora_names[i]`` is request i's adapter
    (None: the base model); None for the whole list means every request uses the base.
    """

    mode: ForwardMode
    request_ids: Sequence[Hashable]
    input_ids: torch.Tensor
    extend_lens: Sequence[int] | None = None  # EXTEND only
    num_draft_tokens: int | None = None  # TARGET_VERIFY only
    lora_names: Sequence[str | None] | None = None
    return_all_logits: bool = False  # EXTEND: logits for every position, not just the last
    return_hidden: bool = False  # final (normed) hidden state of every token row
    hidden_layers: Sequence[int] | None = None  # residual stream entering these layers (EAGLE3)
    # TARGET_VERIFY of a tree draft: each request's k tokens are tree nodes (node 0 the root),
    # node n at position prefix + tree_depths[b, n], seeing the nodes m with
    # tree_ancestors[b, n, m]. None: a chain (node n at prefix + n, seeing nodes 0..n).
    tree_depths: torch.Tensor | None = None  # int64 [bs, k]
    tree_ancestors: torch.Tensor | None = None  # bool [bs, k, k]

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def token_counts(self) -> tuple[int, int]:
        """``(total rows, max rows per request)`` from :func:`loraserve.kernels.token_counts`."""
        if self.mode is ForwardMode.EXTEND:
            return token_counts(self.mode, self.batch_size, extend_lens=self.extend_lens)
        if self.mode is ForwardMode.TARGET_VERIFY:
            return token_counts(self.mode, self.batch_size, num_draft_tokens=self.num_draft_tokens)
        return token_counts(self.mode, self.batch_size)

    def per_request_tokens(self) -> list[int]:
        """New tokens each request appends in this forward."""
        _, width = self.token_counts()
        if self.mode is ForwardMode.EXTEND:
            return [int(n) for n in self.extend_lens]  # type: ignore[union-attr]
        return [width] * self.batch_size

    def validate(self) -> None:
        """Raise :class:`ForwardBatchError` naming the field at fault."""
        if not isinstance(self.mode, ForwardMode):
            raise ForwardBatchError(f"mode must be a ForwardMode, got {self.mode!r}")
        if self.batch_size == 0:
            raise ForwardBatchError("request_ids is empty: a forward needs at least one request")
        if len(set(self.request_ids)) != self.batch_size:
            raise ForwardBatchError("request_ids has duplicates: each request appears once per batch")
        if self.mode is not ForwardMode.EXTEND and self.extend_lens is not None:
            raise ForwardBatchError(f"extend_lens is only for EXTEND batches, not {self.mode.value}")
        if self.mode is not ForwardMode.TARGET_VERIFY and self.num_draft_tokens is not None:
            raise ForwardBatchError(f"num_draft_tokens is only for TARGET_VERIFY batches, not {self.mode.value}")
        if self.mode is ForwardMode.EXTEND and self.extend_lens is not None:
            bad = [i for i, n in enumerate(self.extend_lens) if int(n) < 1]
            if bad:
                raise ForwardBatchError(f"extend_lens must be >= 1 for every request; requests {bad} have 0")
        if (self.tree_depths is None) != (self.tree_ancestors is None):
            raise ForwardBatchError("tree_depths and tree_ancestors come together (a tree verify) or not at all")
        if self.tree_depths is not None:
            if self.mode is not ForwardMode.TARGET_VERIFY:
                raise ForwardBatchError(f"a tree is only verified in TARGET_VERIFY, not {self.mode.value}")
            k = self.num_draft_tokens or 0
            if tuple(self.tree_depths.shape) != (self.batch_size, k) or tuple(self.tree_ancestors.shape) != (
                self.batch_size, k, k
            ):  # fmt: skip
                raise ForwardBatchError(
                    f"tree_depths must be [{self.batch_size}, {k}] and tree_ancestors [{self.batch_size}, {k}, {k}], "
                    f"got {tuple(self.tree_depths.shape)} and {tuple(self.tree_ancestors.shape)}"
                )
        if self.return_all_logits and self.mode is not ForwardMode.EXTEND:
            raise ForwardBatchError("return_all_logits is for EXTEND; decode and verify return every row")
        try:
            total, _ = self.token_counts()
        except ValueError as exc:
            raise ForwardBatchError(str(exc)) from exc
        if self.input_ids.dim() != 1:
            raise ForwardBatchError(f"input_ids must be flat [tokens], got shape {tuple(self.input_ids.shape)}")
        if self.input_ids.numel() != total:
            raise ForwardBatchError(
                f"input_ids has {self.input_ids.numel()} tokens but the {self.mode.value} batch describes {total}"
            )
        if self.lora_names is not None and len(self.lora_names) != self.batch_size:
            raise ForwardBatchError(f"lora_names has {len(self.lora_names)} entries for {self.batch_size} requests")


@dataclass
class ForwardOutput:
    """Logits (float32) and, when asked, hidden states of a forward.

    ``logits``: extend: ``[bs, V]`` (last position of each request) or ``[T, V]`` with
    ``return_all_logits``; decode ``[bs, V]``; target-verify ``[bs*k, V]``.
    ``hidden_states``: ``[T, H]`` final normed hidden state of every token row.
    ``aux_hidden_states``: ``[T, len(hidden_layers) * H]``, the residual stream entering
    each requested layer, concatenated in the order asked.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor | None = None
    aux_hidden_states: torch.Tensor | None = None

    def select_rows(self, rows: Sequence[int]) -> ForwardOutput:
        """The output of token rows ``rows`` only (a decode batch has one row per request)."""
        index = torch.tensor(list(rows), dtype=torch.int64, device=self.logits.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index.to(t.device))

        return ForwardOutput(pick(self.logits), pick(self.hidden_states), pick(self.aux_hidden_states))
