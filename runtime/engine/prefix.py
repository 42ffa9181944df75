"""The engine's side of prefix caching: which key a request's KV is cached under, how much
of a waiting request a cached prefix covers, and what a leaving request leaves behind.

Keys: ``(adapter name, load epoch, generation)``, the base model's name being None. The
epoch of a name moves on around every load that may bring new weights and every unload
(any thread), so KV computed with one set of weights is never served to a request running
another set under the same name; the engine thread then drops the old epochs' prefixes
(:meth:`PrefixReuse.sweep`). The generation moves on when the whole cache is reset
(:meth:`PrefixReuse.reset`, vLLM's ``/reset_prefix_cache``).
A request keeps the key it was admitted under: if its adapter is reloaded meanwhile, the
key is retired and what the request leaves is freed, not cached.

Not reused: a request asking for prompt logprobs (``params.prompt_logprobs``) prefills
its whole prompt, whose logits it needs, as vLLM does; its KV is still cached for others.

Speculative decoding: the target's KV is what is reused here. A STANDALONE draft without
draft adapters keeps a prefix cache of its own, under one key (its KV depends on the
tokens alone; ``loraserve.runtime.speculative.standalone``); with draft adapters it
catches up on the whole prompt in its first extend (the draft is small). An EAGLE head (and a DFLASH draft) is fed the target's features of the positions
the target computes, so after a hit it starts from the first uncached position: its cache
then holds the suffix only, at positions counted from there (rotary attention sees
relative positions), which can lower the first drafts' acceptance but never the output
(verify is exact).

Requests that arrive together with the same uncached prefix (a tenant's system prompt
the cache has not seen yet, sent by several users at once) would each compute it in the
same extend step. Each waiting request gets a group, its key and the next
:attr:`PrefixReuse.SHARED_RUN` tokens it would compute; a request whose group another
request is computing in this step (or is prefilling) waits a step and then finds that KV
cached, as SGLang's in-batch prefix caching does. The scheduler applies it
(``select_admissions``); requests alone in their group are unaffected.

The pool (:class:`loraserve.runtime.kv.KVCache`) does the rest: shared slots, LRU
eviction, counting unused cached tokens as free.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import numpy as np

from .request import Request


class PrefixReuse:
    """Keys, planning hints, matches at admission and caching at the end, for one engine."""

    # Uncached tokens two requests must share, right where their prefill would start, to
    # be grouped: fewer would delay a request a step to save less than the step costs.
    SHARED_RUN = 64

    def __init__(self, kv, *, peek_limit: int = 256) -> None:
        """``peek_limit``: waiting requests looked up per step (admission never reaches
        further; the others plan as if nothing were cached, which only over-reserves)."""
        self.kv = kv
        self.enabled = getattr(kv, "prefix", None) is not None
        self.peek_limit = peek_limit
        self._lock = threading.Lock()
        self._epochs: dict[str, int] = {}
        self._stale: set[str] = set()
        self._generation = 0
        self._queries: dict[str, np.ndarray] = {}  # waiting requests' tokens (engine thread)

    # ------------------------------------------------------------------ any thread
    def adapter_changed(self, name: str) -> None:
        """``name`` is being (or was) loaded or unloaded: its weights may change."""
        with self._lock:
            self._epochs[name] = self._epochs.get(name, 0) + 1
            self._stale.add(name)

    def key(self, adapter: str | None) -> Hashable:
        with self._lock:
            epoch = 0 if adapter is None else self._epochs.get(adapter, 0)
            return (adapter, epoch, self._generation)

    # ------------------------------------------------------------------ engine thread
    def reuses(self, req: Request) -> bool:
        """Whether a request may start on a cached prefix: not while its prompt logprobs
        are still to be computed (after a retraction they were sent already)."""
        return self.enabled and (getattr(req.params, "prompt_logprobs", None) is None or bool(req.output_ids))

    def sweep(self) -> int:
        """Drop the prefixes of adapters' past epochs; returns the tokens freed now."""
        if not self.enabled:
            return 0
        with self._lock:
            if not self._stale:
                return 0
            current = {name: self._epochs[name] for name in self._stale}
            self._stale.clear()
        return self.kv.drop_prefixes(
            lambda key: key[0] in current and key[1] < current[key[0]]  # type: ignore[index]
        )

    def reset(self) -> int:
        """Drop every cached prefix (engine thread); requests running now cache nothing
        when they end. Returns the tokens freed now."""
        if not self.enabled:
            return 0
        with self._lock:
            self._generation += 1
        return self.kv.drop_prefixes(lambda key: True)

    def plan_hints(
        self, waiting: Sequence[Request], running: Sequence[Request] = (), *, reach: int | None = None
    ) -> None:
        """Tell the scheduler how much of each waiting request is cached (and how much of
        that nobody holds, which admitting it takes out of the free count), and what
        retracting each running request would give back (shared prefixes stay held).

        Only the first ``reach`` waiting requests (in admission order: the caller passes
        them so) are looked up, at most ``peek_limit``: admission goes no further, and a
        lookup costs tens of microseconds on a long prompt. The others plan as if nothing
        were cached (their reserve is larger, never smaller, than what they will use)."""
        if not self.enabled:
            return
        for req in running:
            req.kv_releasable = self.kv.releasable_tokens(req.rid)
            req.prefix_group = (
                self._group(req.prefix_key, req.all_ids, req.num_cached)
                if req.is_prefilling and req.prefix_key is not None
                else None
            )
        limit = self.peek_limit if reach is None else min(reach, self.peek_limit)
        for i, req in enumerate(waiting):
            if i >= limit or not self.reuses(req):
                req.prefix_hit = req.prefix_claim = 0
                req.prefix_group = None
                continue
            key, query = self.key(req.adapter), self._query(req)
            match = self.kv.peek_prefix(key, query)
            req.prefix_hit, req.prefix_claim = match.length, match.evictable
            req.prefix_group = self._group(key, query, match.length)

    def _group(self, key: Hashable, tokens: Sequence[int] | np.ndarray, start: int) -> Hashable | None:
        """The group of a request whose prefill starts at ``start``: its key, ``start`` and
        the next :attr:`SHARED_RUN` tokens (None when fewer are left to compute)."""
        if len(tokens) - start <= self.SHARED_RUN:
            return None
        run = np.asarray(tokens[start : start + self.SHARED_RUN], dtype=np.int64)
        return (key, start, run.tobytes())

    def _query(self, req: Request) -> np.ndarray:
        """A waiting request's tokens as an array, converted once (its tokens do not change
        while it waits)."""
        cached = self._queries.get(req.rid)
        if cached is None or cached.shape[0] != req.num_tokens:
            cached = self._queries[req.rid] = np.asarray(req.all_ids, dtype=np.int64)
        return cached

    def admit(self, req: Request) -> int:
        """Start an admitted request on its cached prefix (at most what was planned);
        returns the tokens it need not prefill."""
        req.prefix_key = self.key(req.adapter) if self.enabled else None
        req.prefix_group = None
        self._queries.pop(req.rid, None)
        hit = 0
        if self.reuses(req) and req.prefix_hit > 0:
            hit = self.kv.match_prefix(req.rid, req.prefix_key, req.all_ids, max_len=req.prefix_hit)
        req.prefix_hit, req.prefix_claim = hit, 0
        return hit

    def cache_running(self, req: Request) -> None:
        """After a prefill chunk: its tokens are cached at once, so requests admitted from
        now on share them while this one still runs (as SGLang caches unfinished requests)."""
        if self.enabled and req.prefix_key is not None and not req.finished:
            self.kv.cache_prefix(req.rid, req.prefix_key, req.all_ids[: req.num_cached])

    def release(self, req: Request, tokens: Sequence[int] | None) -> None:
        """A request leaves the running set: cache the KV of its leading ``tokens`` (the
        pool caches only what it holds) or, with None, free everything."""
        key, req.prefix_key = req.prefix_key, None
        req.prefix_hit = req.prefix_claim = 0
        req.kv_releasable = req.prefix_group = None
        self._queries.pop(req.rid, None)
        if not self.enabled or key is None or tokens is None:
            self.kv.free(req.rid)
            return
        self.kv.cache_and_free(req.rid, key, tokens)

    def forget(self, req: Request) -> None:
        """The request's KV was freed outside :meth:`release` (it starts over)."""
        req.prefix_hit = req.prefix_claim = 0
        req.kv_releasable = req.prefix_group = None
