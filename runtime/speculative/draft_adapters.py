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
        """``lora_names`` for a draft batch of ``requests`` (None when no pool exists), fitted
        to the pool's slots (:func:`fit_slots`)."""
        if self.pool is None:
            return None
        return fit_slots([self.name_for(r) for r in requests], self.pool.num_slots)

    def release(self, req: Request) -> None:
        """End ``req``'s lease (its draft state is being dropped)."""
        name = self._held.pop(req.rid, None)
        if name is not None:
            self.pool.release(name)


def fit_slots(names: Sequence[str | None], slots: int) -> list[str | None]:
    """``names`` with at most ``slots`` distinct draft adapters: the first ``slots`` (in batch
    order) keep theirs and the other requests draft this forward unadapted.

    A draft batch may hold more Adapters with draft adapters than the draft pool has slots
    (``speculative.draft_max_loras`` below the target's ``lora.max_loras_per_batch``). Their
    proposals only get worse for that forward, and output never changes; refusing the
    forward instead would fail the step and retry the batch request by request.
    """
    distinct = list(dict.fromkeys(n for n in names if n is not None))
    if len(distinct) <= slots:
        return list(names)
    kept = set(distinct[:slots])
    return [n if n in kept else None for n in names]
