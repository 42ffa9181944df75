"""The other ranks' side: replay rank 0's decisions and run the same forwards.

A follower holds its shard of the model, its own KV cache (its KV heads) and adapter
slots. It never schedules: it applies each message's KV and slot changes in order, then
runs the described forward, whose collectives pair with rank 0's. Adapters are read from
disk on a background thread as soon as rank 0 reports loading them, so a slot
placement rarely waits for a file.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from loraserve.kernels import ForwardMode

from ..distributed.errors import TensorParallelError
from ..distributed.group import TPGroup
from ..distributed.protocol import ControlChannel, ForwardStep, Kind, KVOp, Message, SlotEvent
from ..runner.forward_batch import ForwardBatch

log = logging.getLogger("loraserve.executor")


class Follower:
    """Runs ``runner`` (a tensor-parallel ``ModelRunner`` of rank > 0) as rank 0 directs."""

    def __init__(self, runner, group: TPGroup):
        if group.is_driver:
            raise ValueError("rank 0 drives; it does not follow")
        self.runner = runner
        self.group = group
        self.channel = ControlChannel(group)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-tp-adapters")
        self._loads: dict[str, Future] = {}
        self.steps = 0

    def run(self) -> None:
        """Follow until rank 0 says STOP; raises :class:`TensorParallelError` on any failure."""
        try:
            while True:
                try:
                    message = self.channel.recv()
                except TensorParallelError as exc:
                    raise TensorParallelError(
                        f"rank {self.group.rank} lost rank 0: no step or heartbeat arrived ({exc})"
                    ) from exc
                self.apply(message)
                if message.kind is Kind.STOP:
                    return
        finally:
            self._loader.shutdown(wait=False, cancel_futures=True)

    def apply(self, message: Message) -> None:
        """Replay one message: journal first, then its forward or command."""
        for op, rid, n, *payload in message.kv_ops:
            if op == KVOp.FREE:
                self.runner.kv.free(rid)
            elif op == KVOp.TRUNCATE:
                self.runner.kv.truncate(rid, n)
            elif op == KVOp.ADOPT:
                self.runner.kv.adopt(rid, torch.tensor(payload[0], dtype=torch.int64))
            elif op == KVOp.SHARE:
                self.runner.kv.share(rid, n, torch.tensor(payload[0], dtype=torch.int64))
            elif op == KVOp.FORGET:
                self.runner.kv.forget(rid)
            elif op == KVOp.RELEASE:
                self.runner.kv.release_slots(torch.tensor(payload[0], dtype=torch.int64))
            else:
                raise TensorParallelError(f"rank {self.group.rank}: unknown KV operation {op}")
        for event in message.slot_events:
            self._slot_event(event)
        if message.kind is Kind.FORWARD:
            assert message.step is not None
            self._forward(message.step)
            self.steps += 1
        elif message.kind is Kind.GATHER_VOCAB:
            self.runner.full_vocab_weights()

    # ------------------------------------------------------------------ internals
    def _slot_event(self, event: SlotEvent) -> None:
        lora = self.runner.lora
        if lora is None:
            raise TensorParallelError(
                f"rank {self.group.rank} has no adapter pool but rank 0 changed its adapters: "
                "the ranks were started with different lora settings"
            )
        if event.kind == "load":
            assert event.path is not None
            self._loads[event.name] = self._loader.submit(lora.mirror_load, event.name, event.path)
            return
        pending = self._loads.pop(event.name, None)
        if event.kind == "place":
            if pending is not None:
                try:
                    pending.result()
                except Exception as exc:
                    raise TensorParallelError(
                        f"rank {self.group.rank} could not load adapter {event.name!r}, which rank 0 loaded: {exc}"
                    ) from exc
            assert event.slot is not None
            lora.mirror_place(event.slot, event.name)
        elif event.kind == "remove":
            if pending is not None:
                pending.exception()  # wait; a failed load of a removed adapter does not matter
            lora.mirror_remove(event.name)
        else:
            raise TensorParallelError(f"rank {self.group.rank}: unknown adapter event {event.kind!r}")

    def _forward(self, step: ForwardStep) -> None:
        runner = self.runner
        if step.input_ids is not None:
            input_ids = step.decode_ids()
        else:
            input_ids = torch.empty(step.num_tokens, dtype=torch.int64, device=runner.device)
            self.group.broadcast_from_driver(input_ids)
        batch = ForwardBatch(
            mode=ForwardMode(step.mode),
            request_ids=step.request_ids,
            input_ids=input_ids,
            extend_lens=step.extend_lens,
            num_draft_tokens=step.num_draft_tokens,
            return_all_logits=step.return_all_logits,
            return_hidden=step.return_hidden,
            hidden_layers=step.hidden_layers,
        )
        runner.follow(
            batch,
            step.slots,
            expect_free_tokens=step.expect_free_tokens,
            expect_slot_ranks=step.expect_slot_ranks,
        )
