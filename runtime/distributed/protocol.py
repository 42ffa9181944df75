"""What rank 0 tells the other ranks each step, and how it travels.

One :class:`Message` per step (or per idle heartbeat) over the control group: the KV
cache changes and adapter-slot changes since the last message, in order, then the
forward to run, described exactly enough that every rank builds the same batch (same KV
slots, same adapter slots, same CUDA-graph choice, hence the same collectives).

Messages are JSON (never pickle: nothing received is executed). Token ids that live on
the host travel inside the message; ids already on the GPU follow as one broadcast over
the device group, so rank 0 never waits for the GPU to describe a step.
"""

from __future__ import annotations

import base64
import enum
import json
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .errors import TensorParallelError
from .group import TPGroup


class Kind(enum.IntEnum):
    NOOP = 0  # a heartbeat (may carry pending changes)
    FORWARD = 1  # run ``step``
    GATHER_VOCAB = 2  # join an all-gather of the base embedding / lm_head (a draft needs them whole)
    STOP = 3  # rank 0 is shutting down: exit cleanly


@dataclass(frozen=True)
class SlotEvent:
    """An adapter-slot change another rank must replay: ``load`` (name, path), ``place``
    (slot, name) or ``remove`` (name)."""

    kind: str
    name: str
    slot: int | None = None
    path: str | None = None


class KVOp(enum.IntEnum):
    FREE = 0
    TRUNCATE = 1
    # The prefix cache's slot-level steps (rank 0 keeps the tree; the others replay these):
    ADOPT = 2  # a request starts on a cached prefix: (op, request, n, slots)
    FORGET = 3  # a request's row goes, its slots stay (handed to the cache): (op, request, 0)
    RELEASE = 4  # slots go back to the free pool (eviction, duplicates): (op, 0, n, slots)
    SHARE = 5  # a running request's entries from ``start`` become cached slots: (op, request, start, slots)


@dataclass
class ForwardStep:
    """One forward, as every rank must run it.

    Requests are named by small integers rank 0 assigns (its own ids may be any
    hashable); ``slots`` are the adapter slots rank 0 chose. ``expect_*`` are rank 0's
    state after allocating this batch: a rank that disagrees has diverged.
    """

    mode: str
    request_ids: list[int]
    num_tokens: int
    slots: list[int]
    extend_lens: list[int] | None = None
    num_draft_tokens: int | None = None
    return_all_logits: bool = False
    return_hidden: bool = False
    hidden_layers: list[int] | None = None
    input_ids: str | None = None  # base64 of int64 ids; None: a device broadcast follows
    expect_free_tokens: int = -1
    expect_slot_ranks: list[int] | None = None

    @staticmethod
    def encode_ids(ids: torch.Tensor) -> str:
        return base64.b64encode(ids.to(torch.int64).contiguous().numpy().tobytes()).decode("ascii")

    def decode_ids(self) -> torch.Tensor:
        assert self.input_ids is not None
        raw = bytearray(base64.b64decode(self.input_ids))
        return torch.frombuffer(raw, dtype=torch.int64) if raw else torch.empty(0, dtype=torch.int64)


@dataclass
class Message:
    kind: Kind
    kv_ops: list[tuple] = field(default_factory=list)  # (KVOp, request, tokens[, slots])
    slot_events: list[SlotEvent] = field(default_factory=list)
    step: ForwardStep | None = None

    def encode(self) -> bytes:
        body = {
            "kind": int(self.kind),
            "kv_ops": [list(op) for op in self.kv_ops],
            "slot_events": [asdict(e) for e in self.slot_events],
            "step": None if self.step is None else asdict(self.step),
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Message:
        body = json.loads(data)
        step = body.get("step")
        return cls(
            kind=Kind(body["kind"]),
            kv_ops=[tuple(op) for op in body["kv_ops"]],
            slot_events=[SlotEvent(**e) for e in body["slot_events"]],
            step=None if step is None else ForwardStep(**step),
        )


HEADER_BYTES = 4096
"""Messages up to this size (less 8 bytes of length) take one broadcast; longer ones two."""


class ControlChannel:
    """Rank 0 broadcasts messages; every other rank receives them in order."""

    def __init__(self, group: TPGroup):
        self.group = group

    def send(self, message: Message) -> None:
        payload = message.encode()
        header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        header[:8] = torch.tensor([len(payload)], dtype=torch.int64).view(torch.uint8)
        inline = len(payload) <= HEADER_BYTES - 8
        if inline:
            header[8 : 8 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._broadcast(header)
        if not inline:
            self._broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def recv(self) -> Message:
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        self._broadcast(header)
        length = int(header[:8].view(torch.int64)[0])
        if length <= HEADER_BYTES - 8:
            payload = header[8 : 8 + length].numpy().tobytes()
        else:
            body = torch.empty(length, dtype=torch.uint8)
            self._broadcast(body)
            payload = body.numpy().tobytes()
        return Message.decode(payload)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        try:
            dist.broadcast(tensor, src=0, group=self.group.control_group)
        except RuntimeError as exc:  # gloo: a closed connection or a timeout
            raise TensorParallelError(
                f"tensor-parallel control channel failed on rank {self.group.rank}: {exc}"
            ) from exc
