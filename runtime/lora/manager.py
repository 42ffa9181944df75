"""The adapter registry: host cache, device slots, pinning, reference counts.

States: an adapter is ``loaded`` (validated, weights on the host), ``active`` (also in a
device slot) or ``unloading`` (refusing new requests, removed once its in-flight count
reaches zero). Slots are reassigned least-recently-used first, never taking a pinned
adapter's slot nor one the current batch uses. Every public method is thread-safe (the
server may load/unload while the engine prepares batches); a failed call changes nothing.

Tensor parallelism: every rank holds a manager over its own shard of the slot buffers
and keeps its own share of each adapter (``shard``). Rank 0 decides everything; a
listener (:meth:`LoRAManager.add_listener`) receives each change as a
:class:`SlotEvent`, and the other ranks replay those events with the ``mirror_*``
methods, so every rank holds the same adapter in the same slot.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from loraserve.kernels import ForwardMode, LoRABackend, LoRABatchInfo, build_batch_info

from ..contract.config import LORA_MODULES, LoRAConfig, pool_modules
from ..contract.policy.bounds import pinned_slot_limit
from ..distributed.protocol import SlotEvent
from ..model.llama import LlamaForCausalLM
from .adapter import AdapterWeights, load_adapter
from .errors import (
    AdapterCapacityError,
    AdapterConflictError,
    AdapterDrainingError,
    AdapterError,
    AdapterNotFoundError,
)
from .pool import LoRAContext, SlotPool
from .sharding import shard_adapter

if TYPE_CHECKING:
    from ..distributed.sharding import ShardPlan


class AdapterState(enum.StrEnum):
    LOADED = "loaded"  # on the host, no device slot
    ACTIVE = "active"  # in a device slot
    UNLOADING = "unloading"  # refuses new requests; removed when in-flight requests finish


@dataclass(frozen=True)
class AdapterInfo:
    """A snapshot of one adapter, for listings and the admin API."""

    name: str
    path: str
    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    state: AdapterState
    pinned: bool
    slot: int | None
    refcount: int


class _Entry:
    __slots__ = ("name", "pinned", "refcount", "unloading", "weights")

    def __init__(self, name: str, weights: AdapterWeights, pinned: bool):
        self.name = name
        self.weights = weights
        self.pinned = pinned
        self.refcount = 0
        self.unloading = False


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > 320:
        raise AdapterError(f"adapter name must be a non-empty string of at most 320 characters, got {name!r}", field="name")
    if any(c.isspace() or not c.isprintable() for c in name):
        raise AdapterError(f"adapter name {name!r} contains whitespace or control characters", field="name")
    return name


def validate_lora_config(config: LoRAConfig) -> None:
    """Reject an unusable ``lora`` section with the field and the fix."""
    if config.max_loras_per_batch < 1:
        raise AdapterError(f"lora.max_loras_per_batch must be >= 1, got {config.max_loras_per_batch}", field="lora.max_loras_per_batch")
    if config.max_loaded_loras < 1:
        raise AdapterError(f"lora.max_loaded_loras must be >= 1, got {config.max_loaded_loras}", field="lora.max_loaded_loras")
    if config.max_rank < 1:
        raise AdapterError(f"lora.max_rank must be >= 1, got {config.max_rank}", field="lora.max_rank")
    unknown = sorted(set(config.target_modules) - set(LORA_MODULES))
    if unknown:
        raise AdapterError(
            f"lora.target_modules has {unknown}: choose from {list(LORA_MODULES)}", field="lora.target_modules"
        )
    if not config.target_modules:
        raise AdapterError("lora.target_modules is empty: name at least one module", field="lora.target_modules")


class LoRAManager:
    """Loads adapters, places them in device slots per batch, and tracks their use."""

    def __init__(
        self,
        config: LoRAConfig,
        model: LlamaForCausalLM,
        *,
        backend: LoRABackend,
        device: torch.device,
        dtype: torch.dtype,
        shard: ShardPlan | None = None,
        base_tensor: Callable[[str], torch.Tensor | None] | None = None,
    ):
        """``shard``: this rank's share of a tensor-parallel model; adapters are cut to it.
        ``base_tensor(module)``: the whole base ``embed_tokens``/``lm_head`` weight, for
        checking copies of it inside adapters (default: the model's own, unsharded, weight)."""
        validate_lora_config(config)
        self.config = config
        self.arch = model.arch
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.modules = pool_modules(config.target_modules)  # router / expert names -> their slots
        self.ctx = LoRAContext(backend)
        self.pool = SlotPool(
            model,
            modules=self.modules,
            num_slots=config.max_loras_per_batch,
            max_rank=config.max_rank,
            dtype=dtype,
            device=device,
            ctx=self.ctx,
        )
        self._model = model
        self._shard = shard
        self._base_tensor_fn = base_tensor
        self._listeners: list[Callable[[SlotEvent], None]] = []
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        # slot -> adapter name or None; the OrderedDict keeps slot use order (LRU first)
        self._slot_owner: list[str | None] = [None] * config.max_loras_per_batch
        self._slot_of: dict[str, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(config.max_loras_per_batch))
        self._ranks = [0] * config.max_loras_per_batch
        self._scalings = [0.0] * config.max_loras_per_batch
        self._batch: set[str] = set()

    # ------------------------------------------------------------------ registry
    @property
    def num_slots(self) -> int:
        return self.config.max_loras_per_batch

    def load(self, name: str, path: str | Path, pinned: bool = False) -> AdapterInfo:
        """Load an adapter under ``name``; idempotent for the same name and path."""
        name = _check_name(name)
        resolved = Path(path).resolve()
        with self._lock:
            existing = self._entries.get(name)
            if existing is not None:
                if existing.weights.path != resolved:
                    raise self._conflict(existing, resolved)
                if pinned and not existing.pinned:
                    self._check_pin_capacity(name)
                existing.unloading = False
                if pinned and not existing.pinned:
                    existing.pinned = True
                    self._place_pinned(name)
                return self._info(existing)
            if len(self._entries) >= self.config.max_loaded_loras:
                raise AdapterCapacityError(
                    f"lora.max_loaded_loras={self.config.max_loaded_loras} adapters are already loaded: "
                    "unload one or raise lora.max_loaded_loras",
                    field="lora.max_loaded_loras",
                    adapter=name,
                )
            if pinned:
                self._check_pin_capacity(name)
        # File I/O and validation outside the lock: batches keep flowing meanwhile.
        try:
            weights = self.read_adapter(resolved)
        except AdapterError as exc:
            exc.adapter = name
            raise
        if self._shard is not None:
            weights = shard_adapter(weights, self._shard)
        if self.device.type == "cuda":
            weights.weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in weights.weights.items()}
        with self._lock:
            if name in self._entries:  # a concurrent load of the same name won the race
                if self._entries[name].weights.path != resolved:
                    raise self._conflict(self._entries[name], resolved)
                return self._info(self._entries[name])
            if len(self._entries) >= self.config.max_loaded_loras:
                raise AdapterCapacityError(
                    f"lora.max_loaded_loras={self.config.max_loaded_loras} adapters are already loaded",
                    field="lora.max_loaded_loras",
                    adapter=name,
                )
            if pinned:
                self._check_pin_capacity(name)
            entry = _Entry(name, weights, pinned)
            self._entries[name] = entry
            self._emit(SlotEvent("load", name, path=str(resolved)))
            if pinned:
                self._place_pinned(name)
            return self._info(entry)

    @staticmethod
    def _conflict(existing: _Entry, resolved: Path) -> AdapterConflictError:
        """The error for a load of ``existing.name`` from another path."""
        name = existing.name
        if existing.unloading:
            return AdapterDrainingError(
                f"adapter name {name!r} is still draining: its previous adapter (from {existing.weights.path}) "
                f"was unloaded and finishes {existing.refcount} in-flight request(s) first; retry the load "
                "when they end (each runs to its max_tokens at most), or load the new weights under another name",
                field="name",
                adapter=name,
                in_flight=existing.refcount,
            )
        return AdapterConflictError(
            f"adapter name {name!r} is already loaded from {existing.weights.path}: "
            f"unload it first or choose another name for {resolved}",
            field="name",
            adapter=name,
        )

    def unpin(self, name: str) -> None:
        """Let ``name`` leave its slot again when another adapter needs it (idempotent)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None:
                entry.pinned = False

    def unload(self, name: str) -> None:
        """Stop serving ``name``: refuse new acquires now, free it once in-flight use ends."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.unloading = True
            if entry.refcount == 0:
                self._remove(name)

    def acquire(self, name: str) -> AdapterInfo:
        """Count one request that will use ``name``; refused for unknown or unloading adapters."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise AdapterNotFoundError(
                    f"adapter {name!r} is not loaded: load it first (loaded: {sorted(self._entries)})",
                    field="model",
                    adapter=name,
                )
            if entry.unloading:
                raise AdapterNotFoundError(
                    f"adapter {name!r} is being unloaded and accepts no new requests", field="model", adapter=name
                )
            entry.refcount += 1
            return self._info(entry)

    def release(self, name: str) -> None:
        """End one request's use of ``name``; completes a pending unload at zero."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.refcount == 0:
                raise AdapterError(f"release({name!r}) without a matching acquire", field="name", adapter=name)
            entry.refcount -= 1
            if entry.unloading and entry.refcount == 0:
                self._remove(name)

    def get(self, name: str) -> AdapterInfo:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded", field="name", adapter=name)
            return self._info(entry)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries and not self._entries[name].unloading  # type: ignore[index]

    def list(self) -> list[AdapterInfo]:
        """Every adapter the manager holds, sorted by name."""
        with self._lock:
            return [self._info(self._entries[n]) for n in sorted(self._entries)]

    # ------------------------------------------------------------------ batches
    def prepare_batch(self, names: Sequence[str | None]) -> list[int]:
        """Make every adapter of a batch resident; returns each request's slot (-1: base).

        Called by the one thread that runs forwards: the returned slots stay valid until
        its next call, since loads and unloads from other threads never take them.

        Raises :class:`AdapterCapacityError` when the batch needs more distinct adapters
        than there are slots not held by pinned adapters outside the batch, and
        :class:`AdapterNotFoundError` for a name the manager does not hold.
        """
        with self._lock:
            distinct = list(dict.fromkeys(n for n in names if n is not None))
            for name in distinct:
                if name not in self._entries:
                    raise AdapterNotFoundError(f"adapter {name!r} is not loaded", field="lora_names", adapter=name)
            pinned_elsewhere = sum(1 for e in self._entries.values() if e.pinned and e.name not in distinct)
            available = self.num_slots - pinned_elsewhere
            if len(distinct) > available:
                raise AdapterCapacityError(
                    f"the batch uses {len(distinct)} distinct adapters but only {available} of "
                    f"lora.max_loras_per_batch={self.num_slots} slots are free of pinned adapters: "
                    "split the batch or raise lora.max_loras_per_batch",
                    field="lora.max_loras_per_batch",
                )
            protected = set(distinct)
            for name in distinct:
                if name not in self._slot_of:
                    self._place(name, protected)
            for name in distinct:
                self._lru.move_to_end(self._slot_of[name])
            for entry in self._entries.values():  # pinned adapters whose placement was deferred
                if entry.pinned and entry.name not in self._slot_of:
                    with contextlib.suppress(AdapterCapacityError):
                        self._place(entry.name, protected)
            self._batch = protected
            return [-1 if n is None else self._slot_of[n] for n in names]

    def slot_ranks(self) -> list[int]:
        with self._lock:
            return list(self._ranks)

    def slot_scalings(self) -> list[float]:
        with self._lock:
            return list(self._scalings)

    def batch_info(
        self,
        mode: ForwardMode,
        slots: Sequence[int],
        *,
        extend_lens: Sequence[int] | None = None,
        num_draft_tokens: int | None = None,
    ) -> LoRABatchInfo | None:
        """The kernels' segment layout for a batch, or None when no request uses an adapter."""
        if all(s < 0 for s in slots):
            return None
        with self._lock:
            ranks, scalings = list(self._ranks), list(self._scalings)
        return build_batch_info(
            mode,
            slots,
            ranks,
            scalings,
            extend_lens=extend_lens,
            num_draft_tokens=num_draft_tokens,
            device=self.device,
        )

    # ------------------------------------------------------------------ tensor parallelism
    def add_listener(self, listener: Callable[[SlotEvent], None]) -> None:
        """Call ``listener(event)`` for every load, slot placement and removal, in order.

        Called with the manager's lock held: it must be quick and must not call back.
        """
        with self._lock:
            self._listeners.append(listener)

    @contextlib.contextmanager
    def frozen(self):
        """Hold off every adapter change (loads, placements, removals) for the block."""
        with self._lock:
            yield self

    def mirror_load(self, name: str, path: str | Path) -> None:
        """Replay another rank's ``load``: read and cut the adapter; no capacity or pin policy."""
        resolved = Path(path).resolve()
        weights = self.read_adapter(resolved)
        if self._shard is not None:
            weights = shard_adapter(weights, self._shard)
        if self.device.type == "cuda":
            weights.weights = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in weights.weights.items()}
        with self._lock:
            if name in self._entries:
                self._remove(name)
            self._entries[name] = _Entry(name, weights, pinned=False)

    def mirror_place(self, slot: int, name: str) -> None:
        """Replay another rank's ``place``: ``name`` into ``slot``, evicting its owner."""
        with self._lock:
            if name not in self._entries:
                raise AdapterNotFoundError(
                    f"cannot mirror placing {name!r} in slot {slot}: it was never loaded here", adapter=name
                )
            old = self._slot_of.get(name)
            if old is not None and old != slot:
                self._evict(old)
            self._evict(slot)
            self._write_slot(slot, name)

    def mirror_remove(self, name: str) -> None:
        """Replay another rank's ``remove``."""
        with self._lock:
            self._remove(name)

    def _emit(self, event: SlotEvent) -> None:
        for listener in self._listeners:
            listener(event)

    # ------------------------------------------------------------------ internals
    def read_adapter(self, path: Path) -> AdapterWeights:
        """Read and validate the adapter at ``path`` for this pool (a subclass for another
        model's layout, such as a draft head's, reads its own module names here)."""
        return load_adapter(
            path,
            arch=self.arch,
            max_rank=self.config.max_rank,
            pool_modules=self.modules,
            dtype=self.dtype,
            base_tensor=self._base_tensor,
        )

    def _base_tensor(self, module: str) -> torch.Tensor | None:
        if self._base_tensor_fn is not None:
            return self._base_tensor_fn(module)
        if self._shard is not None:
            return None  # this rank holds only a shard: no whole weight to compare with
        if module == "embed_tokens":
            return self._model.embed_tokens.weight
        if module == "lm_head":
            return self._model.lm_head.weight
        return None

    def _check_pin_capacity(self, name: str) -> None:
        pinned = sum(1 for e in self._entries.values() if e.pinned and e.name != name)
        if pinned + 1 > pinned_slot_limit(self.num_slots):
            raise AdapterCapacityError(
                f"pinning {name!r} would leave no slot for unpinned adapters ({pinned} pinned, "
                f"lora.max_loras_per_batch={self.num_slots}): raise lora.max_loras_per_batch or pin fewer",
                field="pinned",
                adapter=name,
            )

    def _place_pinned(self, name: str) -> None:
        if name in self._slot_of:
            return
        # When every free slot serves the running batch, the next prepare_batch places it.
        with contextlib.suppress(AdapterCapacityError):
            self._place(name, self._batch)

    def _place(self, name: str, protected: set[str]) -> None:
        self._write_slot(self._free_slot(protected), name)

    def _write_slot(self, slot: int, name: str) -> None:
        entry = self._entries[name]
        self.pool.write(slot, entry.weights)
        self._slot_owner[slot] = name
        self._slot_of[name] = slot
        self._ranks[slot] = entry.weights.rank
        self._scalings[slot] = float(entry.weights.scaling)
        self._lru.move_to_end(slot)
        self._emit(SlotEvent("place", name, slot=slot))

    def _free_slot(self, protected: set[str]) -> int:
        for slot in self._lru:  # least recently used first
            if self._slot_owner[slot] is None:
                return slot
        for slot in self._lru:
            owner = self._slot_owner[slot]
            if owner is not None and owner not in protected and not self._entries[owner].pinned:
                self._evict(slot)
                return slot
        raise AdapterCapacityError(
            "no adapter slot can be freed: every slot is pinned or used by the current batch",
            field="lora.max_loras_per_batch",
        )

    def _evict(self, slot: int) -> None:
        owner = self._slot_owner[slot]
        if owner is not None:
            del self._slot_of[owner]
        self._slot_owner[slot] = None
        self._ranks[slot] = 0
        self._scalings[slot] = 0.0

    def _remove(self, name: str) -> None:
        slot = self._slot_of.get(name)
        if slot is not None:
            self._evict(slot)
        self._entries.pop(name, None)
        self._batch.discard(name)
        self._emit(SlotEvent("remove", name))

    def _info(self, entry: _Entry) -> AdapterInfo:
        slot = self._slot_of.get(entry.name)
        if entry.unloading:
            state = AdapterState.UNLOADING
        elif slot is not None:
            state = AdapterState.ACTIVE
        else:
            state = AdapterState.LOADED
        w = entry.weights
        return AdapterInfo(
            name=entry.name,
            path=str(w.path),
            rank=w.rank,
            alpha=w.alpha,
            scaling=float(w.scaling) if math.isfinite(w.scaling) else 0.0,
            target_modules=w.target_modules,
            state=state,
            pinned=entry.pinned,
            slot=slot,
            refcount=entry.refcount,
        )
