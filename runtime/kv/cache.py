"""A token-granular KV cache shared by many concurrent requests.

Storage: per layer, ``k`` and ``v`` pools of ``[capacity + 1, kv_heads, head_dim]``; slot 0
is a padding slot that is never handed out (padded rows of a CUDA-graph batch write
there). A request owns a row of the ``req_to_token`` table (row 0 is the padding row),
listing the pool slots of its tokens in order. Slots come from a host-side free stack,
so allocating, freeing and truncating are a few tensor slices, never per-token loops.

The owner of a request (the scheduler, through the model runner) decides when tokens
are appended (:meth:`KVCache.allocate`), dropped from the end (:meth:`KVCache.truncate`,
rejected draft tokens) or released (:meth:`KVCache.free`).

With a prefix cache (``prefix_cache=True``, :mod:`.prefix_cache`), slots may be shared: a
request that starts with a prefix cached under its adapter key begins holding the tree's
slots for it (:meth:`KVCache.match_prefix`, which locks them) and only appends the rest;
a running request's prefilled prompt joins the tree at once (:meth:`KVCache.cache_prefix`),
and a request that ends leaves its KV in the tree (:meth:`KVCache.cache_and_free`) instead
of freeing it. The leading ``shared`` slots of a request belong to the tree: truncating or
freeing the request never frees them. Every such change reaches the pool as one of four
slot-level steps (adopt, share, forget, release) that a tensor-parallel mirror replays
without a tree of its own. Cached tokens no request holds count as free
(:attr:`KVCache.num_free_tokens`): :meth:`KVCache.allocate` evicts them, least recently
used first, before it would ever report the pool full, so a scheduler that plans with the
free count retracts a running request only when the cache has nothing left to give.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from .prefix_cache import PrefixCache, PrefixMatch


class KVCacheError(ValueError):
    """Misuse of the cache (unknown request, over-long context, bad truncate)."""


class KVCacheFullError(RuntimeError):
    """Not enough free token slots or request rows; nothing was allocated."""


@dataclass
class Allocation:
    """Where one forward's new tokens go."""

    request_ids: list[Hashable]
    rows: torch.Tensor  # int64 [bs] on the cache's device: each request's table row
    prefix_lens: list[int]  # tokens cached before this forward
    new_lens: list[int]  # tokens appended by this forward
    out_cache_loc: torch.Tensor  # int64 [sum(new_lens)] on device: slot of each new token
    created: list[bool]  # the request had no entry before this allocation

    @property
    def seq_lens(self) -> list[int]:
        return [p + n for p, n in zip(self.prefix_lens, self.new_lens, strict=True)]


class _Request:
    __slots__ = ("length", "node", "row", "shared", "slots")

    def __init__(self, row: int, capacity: int):
        self.row = row
        self.length = 0
        self.slots = torch.empty(capacity, dtype=torch.int64)
        self.shared = 0  # leading slots owned by the prefix cache (never freed here)
        self.node = None  # the prefix-cache node this request locks, if any

    def reserve(self, needed: int) -> None:
        if needed > self.slots.numel():
            grown = torch.empty(max(needed, 2 * self.slots.numel()), dtype=torch.int64)
            grown[: self.length] = self.slots[: self.length]
            self.slots = grown


class KVCache:
    """Token pool + per-request token tables; all accounting is on the host."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_total_tokens: int,
        max_requests: int,
        max_context_len: int,
        prefix_cache: bool = False,
    ):
        """``prefix_cache``: keep ended requests' KV for reuse by later requests with the
        same prefix under the same adapter key (see the module docstring)."""
        if max_total_tokens < 1:
            raise KVCacheError(f"max_total_tokens must be >= 1, got {max_total_tokens}")
        if max_requests < 1:
            raise KVCacheError(f"max_requests must be >= 1, got {max_requests}")
        if max_context_len < 1:
            raise KVCacheError(f"max_context_len must be >= 1, got {max_context_len}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers = num_layers
        self.capacity = int(max_total_tokens)
        self.max_requests = int(max_requests)
        self.max_context_len = int(min(max_context_len, max_total_tokens))
        shape = (self.capacity + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.req_to_token = torch.zeros(
            self.max_requests + 1, self.max_context_len, dtype=torch.int64, device=self.device
        )
        # Free stack: the top ``_num_free`` entries are free; popping takes from the end.
        self._free_slots = torch.arange(self.capacity, 0, -1, dtype=torch.int64)
        self._num_free = self.capacity
        self._free_rows = list(range(self.max_requests, 0, -1))
        self._requests: dict[Hashable, _Request] = {}
        self.prefix: PrefixCache | None = PrefixCache() if prefix_cache else None
        self.prefix_evicted_tokens = 0  # cached tokens evicted to make room, since start
        self._evict_batch = max(1, self.capacity // 512)

    # ------------------------------------------------------------------ queries
    @property
    def num_free_tokens(self) -> int:
        """Token slots a request may claim: those nobody owns, plus cached prefixes no
        request holds (evicted on demand)."""
        return self._num_free + self.num_evictable_tokens

    @property
    def num_unused_tokens(self) -> int:
        """Token slots nobody owns, not even the prefix cache."""
        return self._num_free

    @property
    def num_cached_tokens(self) -> int:
        """Tokens the prefix cache holds (shared with running requests or not)."""
        return 0 if self.prefix is None else self.prefix.num_tokens

    @property
    def num_evictable_tokens(self) -> int:
        """Cached tokens no running request holds: the prefix cache gives them up on demand."""
        return 0 if self.prefix is None else self.prefix.num_evictable

    @property
    def num_used_tokens(self) -> int:
        return self.capacity - self._num_free

    @property
    def num_free_rows(self) -> int:
        """How many more requests can hold KV at once."""
        return len(self._free_rows)

    @property
    def bytes_per_token(self) -> int:
        k = self.k_buffers[0] if self.k_buffers else None
        if k is None:
            return 0
        return 2 * self.num_layers * k.shape[1] * k.shape[2] * k.element_size()

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def request_ids(self) -> list[Hashable]:
        return list(self._requests)

    def seq_len(self, request_id: Hashable) -> int:
        """Tokens cached for a request (0 for an unknown one)."""
        req = self._requests.get(request_id)
        return 0 if req is None else req.length

    def token_slots(self, request_id: Hashable) -> torch.Tensor:
        """Host copy of a request's slots, in token order."""
        req = self._require(request_id)
        return req.slots[: req.length].clone()

    def shared_len(self, request_id: Hashable) -> int:
        """Leading tokens a request shares with the prefix cache (0 for an unknown one)."""
        req = self._requests.get(request_id)
        return 0 if req is None else req.shared

    def can_allocate(self, num_tokens: int, num_new_requests: int = 0) -> bool:
        return num_tokens <= self.num_free_tokens and num_new_requests <= len(self._free_rows)

    # ------------------------------------------------------------------ prefix cache
    def peek_prefix(
        self, key: Hashable, token_ids: Sequence[int], *, max_len: int | None = None
    ) -> PrefixMatch:
        """The cached prefix :meth:`match_prefix` would reuse now, without touching the
        cache (for planning): its length and how many of its tokens are evictable (a
        request that locks them takes them out of :attr:`num_free_tokens`)."""
        if self.prefix is None:
            return PrefixMatch(0, torch.empty(0, dtype=torch.int64), None, 0)
        return self.prefix.match(key, _reusable(token_ids, max_len), touch=False)

    def match_prefix(
        self, request_id: Hashable, key: Hashable, token_ids: Sequence[int], *, max_len: int | None = None
    ) -> int:
        """Start a new request on the longest prefix of ``token_ids`` cached under ``key``
        (never the last token: its logits must be computed), at most ``max_len`` tokens.
        Returns how many tokens the request now holds (0: nothing was reused, and the
        request is not created). The reused slots are locked until the request ends."""
        if self.prefix is None:
            return 0
        if request_id in self._requests:
            raise KVCacheError(
                f"request {request_id!r} already holds KV: match a prefix before its first forward"
            )
        if not self._free_rows:
            return 0  # no row to hold it: the request waits as it would without the cache
        match = self.prefix.match(key, _reusable(token_ids, max_len))
        if match.length == 0:
            return 0
        self.prefix.lock(match.node)
        self.adopt(request_id, match.slots)
        self._requests[request_id].node = match.node
        return match.length

    def cache_and_free(self, request_id: Hashable, key: Hashable, token_ids: Sequence[int]) -> int:
        """End a request, leaving the KV of its leading ``token_ids`` (those its entries
        hold, in order) in the prefix cache under ``key``; everything else is freed as by
        :meth:`free`. Returns the tokens it added to the cache. Without a prefix cache this
        is :meth:`free`."""
        req = self._requests.get(request_id)
        if req is None or self.prefix is None:
            self.free(request_id)
            return 0
        n = min(len(token_ids), req.length)
        tokens = np.asarray(token_ids[:n], dtype=np.int64)
        result = self.prefix.insert(key, tokens, req.slots[:n])
        if result.node is None and n > 0 and result.present == 0:
            self.free(request_id)  # a retired key: cache nothing
            return 0
        # The tree kept its own slots for the first ``present`` tokens: this request's
        # copies past its shared prefix are duplicates, and its entries past ``n`` are
        # not cached at all.
        dup_lo, dup_hi = req.shared, max(req.shared, result.present)
        self.forget(request_id)
        self.release_slots(req.slots[dup_lo:dup_hi])
        self.release_slots(req.slots[max(n, req.shared) : req.length])
        self._release_node(req)
        return n - result.present

    def cache_prefix(self, request_id: Hashable, key: Hashable, token_ids: Sequence[int]) -> int:
        """Put a running request's leading ``token_ids`` (those its entries hold) in the
        prefix cache now, so requests admitted from now on share them (a prompt's chunks
        as they are prefilled); the request keeps them as its shared prefix. Where the
        cache already held some (another request computed them meanwhile) the request
        switches to the cache's copy and frees its own. Returns the tokens added."""
        req = self._requests.get(request_id)
        if req is None or self.prefix is None:
            return 0
        n = min(len(token_ids), req.length)
        if n <= req.shared:
            return 0
        result = self.prefix.insert(key, np.asarray(token_ids[:n], dtype=np.int64), req.slots[:n])
        if result.node is None or result.slots is None:
            return 0  # a retired key: the request keeps its own KV
        lo = req.shared
        own, theirs = req.slots[lo:n].clone(), result.slots[lo:n]
        self.release_slots(own[own != theirs])
        self.share(request_id, lo, theirs)
        self.prefix.lock(result.node)
        self._release_node(req)
        req.node = result.node
        return n - result.present

    def releasable_tokens(self, request_id: Hashable) -> int:
        """Tokens that would turn free or evictable if this request alone let go of its KV
        (its own entries, and the cached prefix no other request holds)."""
        req = self._requests.get(request_id)
        if req is None:
            return 0
        own = req.length - req.shared
        return own + (self.prefix.exclusive_tokens(req.node) if self.prefix is not None else 0)

    def drop_prefixes(self, predicate) -> int:
        """Forget the cached prefixes of every key for which ``predicate(key)`` holds (an
        adapter was unloaded or reloaded); returns the tokens freed now (prefixes still in
        use go when their requests end)."""
        if self.prefix is None:
            return 0
        freed = self.prefix.drop_where(predicate)
        self.release_slots(freed)
        return int(freed.numel())

    def evict_prefixes(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` unused cached tokens (LRU) into the free pool."""
        if self.prefix is None or num_tokens <= 0:
            return 0
        freed = self.prefix.evict(num_tokens)
        self.release_slots(freed)
        self.prefix_evicted_tokens += int(freed.numel())
        return int(freed.numel())

    # -------------------------------------------- slot-level steps (replayed by TP ranks)
    # Every change the prefix cache makes to the pool is one of these four, so a mirror
    # of this pool (another tensor-parallel rank) replays them without a tree of its own:
    # the journal hooks ``_journal_*`` are no-ops here and overridden by a mirroring pool.
    def adopt(self, request_id: Hashable, slots: torch.Tensor) -> None:
        """Create a request whose first entries are ``slots``, a prefix it shares (never
        freed through it)."""
        if request_id in self._requests:
            raise KVCacheError(f"request {request_id!r} already holds KV")
        if not self._free_rows:
            raise KVCacheFullError("no request row free")
        n = int(slots.numel())
        req = self._requests[request_id] = _Request(self._free_rows.pop(), max(n + 16, 16))
        with torch.inference_mode():
            req.slots[:n] = slots
            self.req_to_token[req.row, :n] = slots.to(self.device, non_blocking=True)
        req.length = req.shared = n
        self._journal_adopt(request_id, slots)

    def share(self, request_id: Hashable, start: int, slots: torch.Tensor) -> None:
        """A request's entries from ``start`` on become ``slots``, held by the prefix cache:
        its shared prefix grows to their end."""
        req = self._require(request_id)
        n = int(slots.numel())
        if start != req.shared or start + n > req.length:
            raise KVCacheError(f"request {request_id!r}: cannot share entries {start}..{start + n}")
        with torch.inference_mode():
            req.slots[start : start + n] = slots
            self.req_to_token[req.row, start : start + n] = slots.to(self.device, non_blocking=True)
        req.shared = start + n
        self._journal_share(request_id, start, slots)

    def forget(self, request_id: Hashable) -> None:
        """Drop a request's row without freeing any of its slots (the caller hands them on)."""
        req = self._require(request_id)
        self._journal_forget(request_id)
        del self._requests[request_id]
        self._free_rows.append(req.row)

    def release_slots(self, slots: torch.Tensor) -> None:
        """Return slots no request and no cached prefix holds to the free pool."""
        if slots.numel() == 0:
            return
        self._journal_release(slots)
        self._push_free(slots)

    def _journal_adopt(self, request_id: Hashable, slots: torch.Tensor) -> None:
        pass

    def _journal_forget(self, request_id: Hashable) -> None:
        pass

    def _journal_share(self, request_id: Hashable, start: int, slots: torch.Tensor) -> None:
        pass

    def _journal_release(self, slots: torch.Tensor) -> None:
        pass

    # ------------------------------------------------------------------ changes
    @contextmanager
    def allocating(self, request_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> Iterator[Allocation]:
        """:meth:`allocate` for the body of a ``with``, rolled back (:meth:`rollback`) if the
        body raises: a forward that fails leaves the cache as it was."""
        alloc = self.allocate(request_ids, num_tokens)
        try:
            yield alloc
        except BaseException:
            self.rollback(alloc)
            raise

    def allocate(self, request_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> Allocation:
        """Append ``num_tokens[i]`` slots to request i (creating it if new); all or nothing."""
        if len(request_ids) != len(num_tokens):
            raise KVCacheError(f"{len(request_ids)} request ids but {len(num_tokens)} token counts")
        counts = [int(n) for n in num_tokens]
        if any(n < 0 for n in counts):
            raise KVCacheError(f"token counts must be >= 0, got {counts}")
        created = [rid not in self._requests for rid in request_ids]
        prefix = [self.seq_len(rid) for rid in request_ids]
        for rid, p, n in zip(request_ids, prefix, counts, strict=True):
            if p + n > self.max_context_len:
                raise KVCacheError(
                    f"request {rid!r} would hold {p + n} tokens, over the context limit of "
                    f"{self.max_context_len}: shorten the prompt or max_tokens"
                )
        total = sum(counts)
        if total > self.num_free_tokens or sum(created) > len(self._free_rows):
            raise KVCacheFullError(
                f"KV cache full: need {total} tokens for {sum(created)} new requests, "
                f"{self.num_free_tokens} tokens and {len(self._free_rows)} request rows free"
            )
        if total > self._num_free:
            # A little more than needed: each eviction walks the tree, so under steady
            # pressure it runs every few hundred tokens rather than every step.
            self.evict_prefixes(max(total - self._num_free, self._evict_batch))
        slots = self._free_slots[self._num_free - total : self._num_free].flip(0).clone()
        self._num_free -= total
        rows: list[int] = []
        offset = 0
        for rid, is_new, n in zip(request_ids, created, counts, strict=True):
            if is_new:
                self._requests[rid] = _Request(self._free_rows.pop(), max(n, 16))
            req = self._requests[rid]
            req.reserve(req.length + n)
            req.slots[req.length : req.length + n] = slots[offset : offset + n]
            req.length += n
            offset += n
            rows.append(req.row)
        # Table coordinates of every new token: its request's row, and its prefix length
        # plus its index within the request. numpy: torch's CPU repeat_interleave is slow.
        counts_np = np.asarray(counts, dtype=np.int64)
        starts = np.cumsum(counts_np) - counts_np
        cols = np.arange(total, dtype=np.int64) + np.repeat(np.asarray(prefix, dtype=np.int64) - starts, counts_np)
        row_of_token = np.repeat(np.asarray(rows, dtype=np.int64), counts_np)
        coords = torch.from_numpy(np.stack([row_of_token, cols])).to(self.device, non_blocking=True)
        dev_slots = slots.to(self.device, non_blocking=True)
        self.req_to_token[coords[0], coords[1]] = dev_slots
        rows_t = torch.tensor(rows, dtype=torch.int64)
        return Allocation(
            request_ids=list(request_ids),
            rows=rows_t.to(self.device, non_blocking=True),
            prefix_lens=prefix,
            new_lens=counts,
            out_cache_loc=dev_slots,
            created=created,
        )

    def truncate(self, request_id: Hashable, num_tokens: int) -> None:
        """Drop a request's last ``num_tokens`` cached tokens (e.g. rejected draft tokens)."""
        req = self._require(request_id)
        if num_tokens < 0 or num_tokens > req.length:
            raise KVCacheError(
                f"cannot truncate {num_tokens} tokens from request {request_id!r}, which holds {req.length}"
            )
        if num_tokens == 0:
            return
        # Entries of the shared prefix belong to the tree: they leave the request only.
        self._push_free(req.slots[max(req.length - num_tokens, req.shared) : req.length])
        req.length -= num_tokens
        req.shared = min(req.shared, req.length)

    def keep(self, items: Sequence[tuple[Hashable, int, Sequence[int]]]) -> None:
        """For each ``(request, start, kept)``: of the request's entries from ``start`` on, keep
        those at offsets ``kept`` (distinct), moved to ``start, start + 1, ...`` in that order,
        and free the rest (a tree verify keeps its accepted path). The KV data stays in place;
        only the token table changes, with one device write for the whole batch."""
        with torch.inference_mode():  # the slot lists and the table are written under it elsewhere
            self._keep(items)

    def _keep(self, items: Sequence[tuple[Hashable, int, Sequence[int]]]) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[torch.Tensor] = []
        for rid, start, kept in items:
            req = self._require(rid)
            offsets = [int(i) for i in kept]
            tail = req.length - start
            if start < req.shared:
                raise KVCacheError(
                    f"cannot rearrange request {rid!r}'s entries from {start}: its first {req.shared} are a shared prefix"
                )
            if start < 0 or tail < 0 or any(not 0 <= i < tail for i in offsets) or len(set(offsets)) != len(offsets):
                raise KVCacheError(
                    f"cannot keep offsets {offsets} of the {max(tail, 0)} entries request {rid!r} holds after {start}"
                )
            if offsets == list(range(len(offsets))):
                self.truncate(rid, tail - len(offsets))
                continue
            old = req.slots[start : req.length].clone()
            chosen = old[offsets]
            dropped = torch.ones(tail, dtype=torch.bool)
            dropped[offsets] = False
            self._push_free(old[dropped])
            req.slots[start : start + len(offsets)] = chosen
            req.length = start + len(offsets)
            rows += [req.row] * len(offsets)
            cols += range(start, start + len(offsets))
            values.append(chosen)
        if values:
            coords = torch.tensor([rows, cols], dtype=torch.int64).to(self.device, non_blocking=True)
            self.req_to_token[coords[0], coords[1]] = torch.cat(values).to(self.device, non_blocking=True)

    def free(self, request_id: Hashable) -> None:
        """Release everything a request holds; unknown ids are ignored (idempotent)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._push_free(req.slots[req.shared : req.length])
        self._free_rows.append(req.row)
        self._release_node(req)

    def rollback(self, allocation: Allocation) -> None:
        """Undo an allocation whose forward failed: the cache is as it was before."""
        for rid, is_new, n in zip(allocation.request_ids, allocation.created, allocation.new_lens, strict=True):
            if rid not in self._requests:
                continue
            if is_new:
                self.free(rid)
            else:
                self.truncate(rid, min(n, self._requests[rid].length))

    def _release_node(self, req: _Request) -> None:
        """Unlock the prefix a request held (a dropped adapter's nodes are freed now)."""
        if req.node is not None and self.prefix is not None:
            node, req.node = req.node, None
            self.release_slots(self.prefix.unlock(node))

    def _push_free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        self._free_slots[self._num_free : self._num_free + n] = slots.flip(0)
        self._num_free += n

    def _require(self, request_id: Hashable) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise KVCacheError(f"request {request_id!r} holds no KV cache entries")
        return req


def _reusable(token_ids: Sequence[int], max_len: int | None) -> Sequence[int]:
    """The part of a prompt a cached prefix may cover: never the last token (its logits
    are the point of the prefill), at most ``max_len`` tokens."""
    limit = len(token_ids) - 1
    if max_len is not None:
        limit = min(limit, max_len)
    return token_ids[: max(limit, 0)]
