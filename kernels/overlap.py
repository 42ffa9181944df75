"""A linear layer's LoRA delta computed beside its base GEMM, on a second CUDA stream.

At decode and verify batch sizes the base GEMM is bandwidth-bound and lasts tens of µs,
while a module's LoRA is two latency-bound kernels of a few µs each (see
``bench/KERNELS-NOTES.md``). Issued one after the other their times add up; issued on a
second stream the LoRA kernels run in the SM slots the GEMM leaves free. Two joins:

- ``DELTA``: the side stream zeroes a delta buffer and runs shrink + expand into it while
  the main stream runs the GEMM; the main stream then waits and adds the delta. Only one
  elementwise add stays on the critical path, at the price of writing and reading the
  delta (``tokens × out`` elements), which is why it is meant for small token counts.
- ``SHRINK``: only the shrink runs beside the GEMM; the expand adds into the GEMM's
  output after it, on the main stream. No extra buffer; the expand stays on the path.

CUDA graphs capture either as a fork and a join (the side stream first waits for the
main stream's work, and the main stream waits for the side stream before it reads the
result), so replays keep the overlap. Off CUDA, or with ``SERIAL``, the delta is added
after the GEMM exactly as :meth:`LoRABackend.apply` does.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backend import LoRABackend
from .metadata import LoRABatchInfo

OVERLAP_ENV = "LORASERVE_LORA_OVERLAP"


class OverlapMode(enum.Enum):
    SERIAL = "serial"
    DELTA = "delta"
    SHRINK = "shrink"


@dataclass(frozen=True)
class OverlapPolicy:
    """When a module's LoRA runs beside its base GEMM, and with which join.

    ``mode`` None picks by size (bench/KERNELS-NOTES.md holds the measurements): ``DELTA``
    for batches of at most ``delta_max_tiles`` LoRA tiles, where the whole delta fits
    beside the GEMM; ``SHRINK`` above, where the side stream's expand would compete with
    the GEMM for SMs and bandwidth and finish after it. ``max_tokens``: larger batches run
    serially (at prefill sizes the GEMM is compute-bound and fills the GPU).
    """

    mode: OverlapMode | None = None
    max_tokens: int = 512
    delta_max_tiles: int = 2

    @classmethod
    def from_env(cls, value: str | None = None) -> OverlapPolicy:
        """``LORASERVE_LORA_OVERLAP``: ``auto`` (default), ``delta``, ``shrink`` or ``serial``/``off``."""
        raw = (os.environ.get(OVERLAP_ENV, "") if value is None else value).strip().lower()
        if raw in ("", "auto"):
            return cls()
        if raw in ("off", "0", "false", "no"):
            return cls(OverlapMode.SERIAL)
        try:
            return cls(OverlapMode(raw))
        except ValueError:
            raise ValueError(
                f"{OVERLAP_ENV}={raw!r} is not a LoRA overlap mode: use auto, delta, shrink or serial"
            ) from None

    def mode_for(self, tokens: int, tiles: int, device: torch.device) -> OverlapMode:
        """The mode for one module call over ``tokens`` rows in ``tiles`` LoRA tiles on ``device``.

        ``tiles`` is the batch info's tile count (for a CUDA graph, the capture's
        capacity), fixed for a capture like every other launch decision.
        """
        if device.type != "cuda" or tokens > self.max_tokens:
            return OverlapMode.SERIAL
        if self.mode is not None:
            return self.mode
        return OverlapMode.DELTA if tiles <= self.delta_max_tiles else OverlapMode.SHRINK


def linear_with_lora(
    backend: LoRABackend,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    info: LoRABatchInfo,
    slice_offsets: tuple[int, ...],
    base: Callable[[], torch.Tensor],
    *,
    mode: OverlapMode = OverlapMode.SERIAL,
    side: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """``base() + LoRA delta of x``: the base GEMM and the batch's adapters for one module.

    ``base`` computes the layer's base output from ``x`` (it is called once, on the
    current stream). ``side``: the second stream for the overlapped modes; without one
    the call runs serially.
    """
    if mode is OverlapMode.SERIAL or side is None or info.num_segments == 0 or x.shape[0] == 0:
        out = base()
        backend.apply(x, A, B, info, out, slice_offsets)
        return out
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)  # x (and whatever wrote it) is ready for the side stream
    if mode is OverlapMode.DELTA:
        # Allocated on the main stream, which frees it after its own add: the side
        # stream's writes are ordered before that add by the join below.
        delta = torch.empty(x.shape[0], slice_offsets[-1], dtype=x.dtype, device=x.device)
        with torch.cuda.stream(side):
            delta.zero_()
            backend.apply(x, A, B, info, delta, slice_offsets)
        out = base()
        main.wait_stream(side)
        out.add_(delta)
        return out
    with torch.cuda.stream(side):
        stage = backend.shrink_stage(x, A, info, len(slice_offsets) - 1)
    # Allocated on the side stream but last read by the main stream's expand: without
    # this the allocator could hand it to the next side-stream shrink too early.
    stage.record_stream(main)
    out = base()
    main.wait_stream(side)
    backend.expand_stage(stage, B, info, out, slice_offsets)
    return out
