"""Rank 0's side of tensor parallelism: describe every step to the other ranks.

Rank 0 runs the whole runtime (HTTP, scheduler, drafts, sampling); its target runner
shards the model like every other rank's. Before each forward the runner hands the batch
to :meth:`Driver.publish`; in between, every change to rank 0's KV cache
(:class:`MirroredKVCache`) and adapter slots (the LoRA manager's listener) is journalled
and travels, in order, with the next message. While no forward runs, a heartbeat thread
sends an empty message every ``heartbeat_s`` (once every rank has loaded its weights), so
a follower that hears nothing for the control timeout knows rank 0 is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from ..distributed.errors import TensorParallelError
from ..distributed.group import TPGroup
from ..distributed.health import TPHealth
from ..distributed.protocol import ControlChannel, ForwardStep, Kind, KVOp, Message, SlotEvent
from ..kv import KVCache
from ..lora.manager import LoRAManager

if TYPE_CHECKING:
    from ..kv import Allocation
    from ..runner.forward_batch import ForwardBatch


class Driver:
    """Journals rank 0's state changes and sends them, with each step, to the other ranks."""

    def __init__(self, group: TPGroup, health: TPHealth, *, heartbeat_s: float):
        if not group.is_driver:
            raise ValueError("only rank 0 drives a tensor-parallel group")
        self.group = group
        self.health = health
        self.channel = ControlChannel(group)
        self.heartbeat_s = float(heartbeat_s)
        self._send_lock = threading.Lock()  # one message at a time, journal drained with it
        self._journal_lock = threading.Lock()
        self._kv_ops: list[tuple] = []
        self._slot_events: list[SlotEvent] = []
        self._ids: dict[Hashable, int] = {}  # rank 0's request ids -> the ids followers use
        self._next_id = 1
        self._busy = 0  # forwards in flight: followers are computing, no heartbeat now
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self.messages_sent = 0
        self._heartbeat: threading.Thread | None = None
        self._lora: LoRAManager | None = None

    def start_heartbeats(self) -> None:
        """Begin idle heartbeats; called once every rank has loaded its shard.

        Not before: a heartbeat waits for the followers to receive it, and a follower
        still loading weights would make that wait look like a dead rank.
        """
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(
                target=self._heartbeat_loop, name="loraserve-tp-heartbeat", daemon=True
            )
            self._heartbeat.start()

    # ------------------------------------------------------------------ journal
    def kv_free(self, request_id: Hashable) -> None:
        with self._journal_lock:
            rid = self._ids.pop(request_id, None)
            if rid is not None:
                self._kv_ops.append((KVOp.FREE, rid, 0))

    def kv_truncate(self, request_id: Hashable, num_tokens: int) -> None:
        with self._journal_lock:
            rid = self._ids.get(request_id)
            if rid is not None and num_tokens:
                self._kv_ops.append((KVOp.TRUNCATE, rid, int(num_tokens)))

    def kv_adopt(self, request_id: Hashable, slots: torch.Tensor) -> None:
        with self._journal_lock:
            rid = self._ids.get(request_id)
            if rid is None:
                rid = self._ids[request_id] = self._next_id
                self._next_id += 1
            self._kv_ops.append((KVOp.ADOPT, rid, int(slots.numel()), slots.tolist()))

    def kv_forget(self, request_id: Hashable) -> None:
        with self._journal_lock:
            rid = self._ids.pop(request_id, None)
            if rid is not None:
                self._kv_ops.append((KVOp.FORGET, rid, 0))

    def kv_share(self, request_id: Hashable, start: int, slots: torch.Tensor) -> None:
        with self._journal_lock:
            rid = self._ids.get(request_id)
            if rid is not None:
                self._kv_ops.append((KVOp.SHARE, rid, int(start), slots.tolist()))

    def kv_release(self, slots: torch.Tensor) -> None:
        with self._journal_lock:
            self._kv_ops.append((KVOp.RELEASE, 0, int(slots.numel()), slots.tolist()))

    def kv_cache(self, **kwargs) -> MirroredKVCache:
        """Rank 0's KV cache (``kwargs`` as :class:`KVCache`'s), its changes journalled here."""
        return MirroredKVCache(driver=self, **kwargs)

    def attach_lora(self, manager: LoRAManager) -> None:
        """Journal every change of rank 0's adapter slots for the other ranks."""
        self._lora = manager
        manager.add_listener(self._slot_event)

    def _slot_event(self, event: SlotEvent) -> None:
        # The manager's listener, called with its lock held: only appends.
        with self._journal_lock:
            self._slot_events.append(event)

    def _intern(self, request_ids: Sequence[Hashable]) -> list[int]:
        with self._journal_lock:
            out = []
            for rid in request_ids:
                num = self._ids.get(rid)
                if num is None:
                    num = self._ids[rid] = self._next_id
                    self._next_id += 1
                out.append(num)
            return out

    # ------------------------------------------------------------------ steps
    @contextmanager
    def forward_scope(self):
        """Marks a forward in flight (the followers are busy: no heartbeat meanwhile)."""
        with self._journal_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._journal_lock:
                self._busy -= 1

    def publish(self, batch: ForwardBatch, slots: Sequence[int], alloc: Allocation, *, free_tokens: int) -> None:
        """Describe ``batch`` (already allocated on rank 0) to every other rank."""
        total, _ = batch.token_counts()
        input_ids = batch.input_ids
        on_host = input_ids.device.type == "cpu"
        step = ForwardStep(
            mode=batch.mode.value,
            request_ids=self._intern(batch.request_ids),
            num_tokens=int(total),
            slots=[int(s) for s in slots],
            extend_lens=None if batch.extend_lens is None else [int(n) for n in alloc.new_lens],
            num_draft_tokens=batch.num_draft_tokens,
            return_all_logits=bool(batch.return_all_logits),
            return_hidden=bool(batch.return_hidden),
            hidden_layers=None if batch.hidden_layers is None else [int(i) for i in batch.hidden_layers],
            input_ids=ForwardStep.encode_ids(input_ids) if on_host else None,
            expect_free_tokens=int(free_tokens),
        )
        self._send(Message(Kind.FORWARD, step=step))
        if not on_host:
            # The GPU's copy of the ids, without waiting for the GPU (same order on every rank).
            self.group.broadcast_from_driver(input_ids.to(torch.int64).contiguous())

    def command(self, kind: Kind) -> None:
        """Ask every rank to join a collective outside a forward (e.g. ``GATHER_VOCAB``)."""
        self._send(Message(kind))

    def stop(self) -> None:
        """Tell the other ranks to exit cleanly (best effort); no message is sent after this."""
        if self._closed.is_set():
            return
        try:
            if self.health.failure is None:
                self._send(Message(Kind.STOP))
        except TensorParallelError:
            pass
        finally:
            self._closed.set()

    def fail(self, reason: str) -> TensorParallelError:
        """Record that the group can no longer serve; returns the error to raise."""
        self.health.report_failure(reason)
        return TensorParallelError(f"tensor parallelism failed: {self.health.failure}")

    def check(self) -> None:
        """Raise at once when the group has failed (no step is sent to dead ranks)."""
        if self.health.failure is not None:
            raise TensorParallelError(f"tensor parallelism failed: {self.health.failure}")

    # ------------------------------------------------------------------ internals
    def _send(self, message: Message, *, only_if_idle: bool = False) -> bool:
        with self._send_lock:
            if self._closed.is_set():
                raise TensorParallelError("the tensor-parallel group was shut down")
            self.check()
            if only_if_idle and not self._idle():
                return False
            if self._lora is None:
                self._drain(message)
            else:
                # The slot ranks a forward expects must be the state after exactly the
                # events it carries: no adapter change may slip between drain and read.
                with self._lora.frozen():
                    self._drain(message)
                    if message.step is not None:
                        message.step.expect_slot_ranks = self._lora.slot_ranks()
            try:
                self.channel.send(message)
            except TensorParallelError as exc:
                raise self.fail(f"rank 0 could not reach the other ranks: {exc}") from exc
            self._last_send = time.monotonic()
            self.messages_sent += 1
            return True

    def _idle(self) -> bool:
        with self._journal_lock:
            return not self._busy and time.monotonic() - self._last_send >= self.heartbeat_s

    def _drain(self, message: Message) -> None:
        with self._journal_lock:
            message.kv_ops, self._kv_ops = self._kv_ops, []
            message.slot_events, self._slot_events = self._slot_events, []

    def _heartbeat_loop(self) -> None:
        period = max(min(self.heartbeat_s / 4, 1.0), 0.01)
        while not self._closed.wait(period):
            if self.health.failure is not None:
                return
            try:
                self._send(Message(Kind.NOOP), only_if_idle=True)
            except TensorParallelError:
                return


class MirroredKVCache(KVCache):
    """Rank 0's KV cache: every truncate and free is journalled for the other ranks, and
    so are the prefix cache's slot-level steps (adopt, share, forget, release): rank 0 alone
    keeps the tree, the others replay what it did to the pool.

    Allocation needs no journal: it happens inside a forward, which every rank runs (the
    evictions it makes are journalled as releases, which travel ahead of the forward).
    """

    def __init__(self, *, driver: Driver, **kwargs):
        super().__init__(**kwargs)
        self._driver = driver

    def truncate(self, request_id: Hashable, num_tokens: int) -> None:
        super().truncate(request_id, num_tokens)
        self._driver.kv_truncate(request_id, num_tokens)

    def free(self, request_id: Hashable) -> None:
        # Journalled first: freeing may release a dropped adapter's cached prefix, which
        # the other ranks must replay after the free, in the order rank 0 did them.
        if request_id in self:
            self._driver.kv_free(request_id)
        super().free(request_id)

    def _journal_adopt(self, request_id: Hashable, slots: torch.Tensor) -> None:
        self._driver.kv_adopt(request_id, slots)

    def _journal_forget(self, request_id: Hashable) -> None:
        self._driver.kv_forget(request_id)

    def _journal_release(self, slots: torch.Tensor) -> None:
        self._driver.kv_release(slots)

    def _journal_share(self, request_id: Hashable, start: int, slots: torch.Tensor) -> None:
        self._driver.kv_share(request_id, start, slots)
