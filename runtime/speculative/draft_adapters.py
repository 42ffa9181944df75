"""Draft adapters: which of its own adapters the draft runs for each request.

An Adapter may name a draft adapter: a LoRA for the serve's draft, loaded into the draft's
own pool under the Adapter's name (never one of the target's adapters: those stay out of
the draft). A request whose adapter has a draft adapter drafts with it; every other
request drafts unadapted, in the same batch. The target still verifies with the request's
own adapter, so output is unchanged; only the accept rate moves.

The choice is made once per request, at its first draft forward, and held (a lease on the
pool's entry) until the drafter releases the request: the draft's KV of a request is then
computed under one adapter throughout, and an unload waits for the requests drafting with
it. A draft adapter loaded mid-request serves the requests that start after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.request import Request


class DraftAdapterLeases:
    """Per-request draft adapters over a draft runner's pool (None: no pool, all unadapted)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self._held: dict[str, str | None] = {}

    def name_for(self, req: Request) -> str | None:
        """The draft adapter ``req`` drafts with (None: the draft's base weights)."""
        if req.rid in self._held:
            return self._held[req.rid]
        name = req.adapter if self.pool is not None and req.adapter is not None else None
        if name is not None:
            try:
                self.pool.acquire(name)
            except Exception:  # not loaded, or unloading: this request drafts unadapted
                name = None
        self._held[req.rid] = name
        return name

    def names(self, requests: Sequence[Request]) -> list[str | None] | None:
        """``lora_names`` for a draft batch of ``requests`` (None when no pool exists)."""
        if self.pool is None:
            return None
        return [self.name_for(r) for r in requests]

    def release(self, req: Request) -> None:
        """End ``req``'s lease (its draft state is being dropped)."""
        name = self._held.pop(req.rid, None)
        if name is not None:
            self.pool.release(name)
