"""Triton LoRA backend: segmented shrink and fused sliced expand over a tile table.

``apply`` is the fast path: one or two launches per module whatever the number of
slices (QKV, gate/up) or adapters. Small batches (few tiles, so launches and round trips
dominate) take the single-launch kernel: shrink, grid barrier, expand. Larger ones take
two: the shrink writes split-K partial sums in float32 and the expand adds them while
loading. Launch grids and the choice between the paths come from host values that are
fixed for a CUDA-graph capture (tile capacity, shapes); everything that changes between
replays (slots, ranks, scalings, rows, live tiles) is read from device tensors.

Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os

import torch

from .backend import LoRABackend, output_slices
from .checks import check_expand_shapes, check_shapes, check_triton_device
from .metadata import LoRABatchInfo, ensure_tiles
from .triton_ops import (
    ExpandConfig,
    FusedConfig,
    ShrinkConfig,
    launch_expand,
    launch_fused,
    launch_shrink,
    pick_expand,
    pick_fused,
    pick_shrink,
)
from .triton_ops.configs import FUSED_MAX_COL_BLOCKS
from .triton_ops.fused import semaphore
from .triton_ops.pdl import pdl_supported

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# "1": let the shape heuristic take the single-launch path. Off by default: its grid barrier
# needs every program resident, which a shared GPU (MPS with an SM limit) can break, and a
# barrier that gives up leaves that batch's LoRA delta wrong. It saves about one launch per
# module at batch 1-2 only (bench/KERNELS-NOTES.md).
FUSED_ENV = "LORASERVE_LORA_FUSED"
_INTERPRETER_SMS = 4  # the interpreter runs programs one by one: keep grids small
DEFAULT_PDL = False


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return _INTERPRETER_SMS


def _check_runtime(*tensors: torch.Tensor) -> None:
    check_triton_device(tensors, "LoRA backend", "use get_backend('torch') or set TRITON_INTERPRET=1")
    for t in tensors:
        if t.is_floating_point() and t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {t.dtype}: use one of float16, bfloat16, float32")


def _check_ranks(info: LoRABatchInfo, num_pool_slots: int, max_rank: int) -> None:
    if len(info.lora_ranks_cpu) > num_pool_slots:
        raise ValueError(
            f"the batch info describes {len(info.lora_ranks_cpu)} slots but the weight buffer holds "
            f"{num_pool_slots}: size the buffers for the whole pool"
        )
    for slot, rank in enumerate(info.lora_ranks_cpu):
        if rank > max_rank:
            raise ValueError(
                f"slot {slot} has rank {rank} but the weight buffer's max_rank is {max_rank}: "
                "raise lora.max_rank or load the adapter into a larger pool"
            )


class TritonLoRABackend(LoRABackend):
    """Multi-adapter LoRA through Triton kernels.

    ``shrink_config`` / ``expand_config`` pin the launch configuration (benchmarks and
    tests); by default :func:`pick_shrink` / :func:`pick_expand` choose from the shapes.
    ``pdl`` launches the kernels with programmatic dependent launch where the GPU and
    Triton support it (Hopper+), so each launch overlaps the previous kernel's tail.
    ``fused``: None reads ``LORASERVE_LORA_FUSED``: ``1`` chooses the single-launch path by
    shape (:func:`pick_fused`), anything else never takes it (the default: its grid barrier
    relies on every program being resident, which a GPU shared through MPS with an SM
    limit can break). True takes it wherever the module allows (up to three slices), False
    never; ``fused_config`` pins its configuration. PDL and pinned shrink/expand
    configurations use two launches. ``small_rank_block`` overrides the expand
    configurations' ``small_block_r`` (0: every tile at the pool's rank block);
    ``expand_pipeline`` their ``pipeline_stages`` (0: the register-prefetch loop).
    """

    name = "triton"

    def __init__(
        self,
        *,
        shrink_config: ShrinkConfig | None = None,
        expand_config: ExpandConfig | None = None,
        pdl: bool = DEFAULT_PDL,
        fused: bool | None = None,
        fused_config: FusedConfig | None = None,
        small_rank_block: int | None = None,
        expand_pipeline: int | None = None,
    ) -> None:
        self.small_rank_block = small_rank_block
        self.expand_pipeline = expand_pipeline
        self.shrink_config_override = shrink_config
        self.expand_config_override = expand_config
        self.pdl = pdl
        if fused is None and os.environ.get(FUSED_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
            fused = False
        self.fused = fused
        self.fused_config_override = fused_config

    def _pdl(self, device: torch.device) -> bool:
        return self.pdl and pdl_supported(device)

    # -- configuration -------------------------------------------------------------------

    def shrink_config(self, info: LoRABatchInfo, x: torch.Tensor, num_slices: int, max_rank: int) -> ShrinkConfig:
        """The shrink's launch configuration for this module and batch capacity."""
        if self.shrink_config_override is not None:
            return self.shrink_config_override
        return pick_shrink(
            num_tiles=info.num_tiles,
            tile_m=info.tile_m,
            num_slices=num_slices,
            max_rank=max_rank,
            in_dim=x.shape[1],
            dtype=x.dtype,
            num_sms=_sm_count(x.device),
        )

    def expand_config(self, info: LoRABatchInfo, B: torch.Tensor, slice_offsets: tuple[int, ...]) -> ExpandConfig:
        """The expand's launch configuration."""
        config = self.expand_config_override or pick_expand(
            num_tiles=info.num_tiles,
            tile_m=info.tile_m,
            widths=tuple(b - a for a, b in itertools.pairwise(slice_offsets)),
            max_rank=B.shape[2],
            dtype=B.dtype,
            num_sms=_sm_count(B.device),
        )
        if self.small_rank_block is not None:
            config = dataclasses.replace(config, small_block_r=self.small_rank_block)
        if self.expand_pipeline is not None:
            config = dataclasses.replace(config, pipeline_stages=self.expand_pipeline)
        return config

    def fused_config(
        self, info: LoRABatchInfo, x: torch.Tensor, B: torch.Tensor, slice_offsets: tuple[int, ...]
    ) -> FusedConfig | None:
        """The single-launch configuration for this module and batch capacity, or None."""
        if self.fused is False or self.pdl or len(slice_offsets) - 1 > 3:
            return None
        if self.fused is None and (self.shrink_config_override or self.expand_config_override):
            return None
        if self.fused_config_override is not None:
            return self.fused_config_override
        return pick_fused(
            num_tiles=info.num_tiles,
            tile_m=info.tile_m,
            widths=tuple(b - a for a, b in itertools.pairwise(slice_offsets)),
            max_rank=B.shape[2],
            in_dim=x.shape[1],
            dtype=x.dtype,
            num_sms=_sm_count(x.device),
            max_col_blocks=1 << 30 if self.fused else FUSED_MAX_COL_BLOCKS,
        )

    # -- ops -----------------------------------------------------------------------------

    def shrink(
        self,
        x: torch.Tensor,
        A: torch.Tensor,
        info: LoRABatchInfo,
        num_slices: int = 1,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``xa = x @ A[slot]ᵀ`` per segment into ``out`` (``[T, slices*max_rank]``, x's dtype).

        Rows of base-model requests keep ``out``'s values (zeros in a fresh one); columns
        past a slot's rank are unspecified. ``apply`` is the fast path: it keeps the
        split-K partial sums in float32 and lets the expand add them.
        """
        max_rank, _ = check_shapes(x, A, info, num_slices)
        width = num_slices * max_rank
        if out is None:
            out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
        elif out.shape != (x.shape[0], width):
            raise ValueError(f"out must be [{x.shape[0]}, {width}], got shape {tuple(out.shape)}")
        _check_runtime(x, A, out)
        _check_ranks(info, A.shape[0], max_rank)
        if x.shape[0] == 0:
            return out
        info = ensure_tiles(info)
        if info.num_tiles == 0:
            return out
        config = self.shrink_config(info, x, num_slices, max_rank)
        pdl = self._pdl(x.device)
        if config.split_k == 1:
            launch_shrink(x, A, out, info, num_slices, config, pdl=pdl)
            return out
        partial = torch.zeros(config.split_k, x.shape[0], width, dtype=torch.float32, device=x.device)
        launch_shrink(x, A, partial, info, num_slices, config, pdl=pdl)
        summed = partial.sum(0)
        active = info.token_slots >= 0  # rows the kernel wrote; others keep out's values
        out.copy_(torch.where(active[:, None], summed.to(out.dtype), out))
        return out

    def expand(
        self,
        xa: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...],
    ) -> None:
        check_expand_shapes(xa, B, info, out, slice_offsets)
        _check_runtime(xa, B, out)
        _check_ranks(info, B.shape[0], B.shape[2])
        if out.shape[0] == 0:
            return
        info = ensure_tiles(info)
        if info.num_tiles == 0:
            return
        slice_offsets = tuple(slice_offsets)
        config = self.expand_config(info, B, slice_offsets)
        launch_expand(xa, B, out, info, slice_offsets, config, pdl=self._pdl(out.device))

    def apply(
        self,
        x: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...] | None = None,
    ) -> None:
        """Shrink then expand into ``out``: one launch (small batches) or two for the whole module."""
        slice_offsets = output_slices(out, slice_offsets)
        num_slices = len(slice_offsets) - 1
        max_rank, _ = check_shapes(x, A, info, num_slices)
        if B.dim() != 3 or B.shape[2] != max_rank:
            raise ValueError(f"B must be [slots, out_total, {max_rank}] to match A, got {tuple(B.shape)}")
        if A.shape[0] != B.shape[0]:
            raise ValueError(f"A has {A.shape[0]} slots but B has {B.shape[0]}: they must describe one pool")
        width = num_slices * max_rank
        check_expand_shapes((x.shape[0], width), B, info, out, slice_offsets)
        _check_runtime(x, A, B, out)
        _check_ranks(info, A.shape[0], max_rank)
        if x.shape[0] == 0:
            return
        info = ensure_tiles(info)
        if info.num_tiles == 0:
            return
        fused = self.fused_config(info, x, B, slice_offsets)
        sem = semaphore(x.device) if fused is not None else None
        if fused is not None and sem is not None:
            partial = torch.empty(fused.split_k, x.shape[0], width, dtype=torch.float32, device=x.device)
            if launch_fused(x, A, B, out, partial, info, slice_offsets, fused, sem, _sm_count(x.device)):
                return
        partial = self._shrink_partials(x, A, info, num_slices, max_rank)
        launch_expand(
            partial, B, out, info, slice_offsets, self.expand_config(info, B, slice_offsets), pdl=self._pdl(x.device)
        )

    def _shrink_partials(
        self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, num_slices: int, max_rank: int
    ) -> torch.Tensor:
        config = self.shrink_config(info, x, num_slices, max_rank)
        partial = torch.empty(config.split_k, x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
        launch_shrink(x, A, partial, info, num_slices, config, pdl=self._pdl(x.device))
        return partial

    def shrink_stage(self, x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, num_slices: int) -> torch.Tensor:
        """Split-K partial sums ``[split, T, slices*max_rank]`` (float32) for :meth:`expand_stage`."""
        max_rank, _ = check_shapes(x, A, info, num_slices)
        _check_runtime(x, A)
        _check_ranks(info, A.shape[0], max_rank)
        info = ensure_tiles(info)
        if x.shape[0] == 0 or info.num_tiles == 0:  # nothing to shrink; expand_stage skips too
            return torch.empty(1, x.shape[0], num_slices * max_rank, dtype=torch.float32, device=x.device)
        return self._shrink_partials(x, A, info, num_slices, max_rank)

    def expand_stage(
        self,
        stage: torch.Tensor,
        B: torch.Tensor,
        info: LoRABatchInfo,
        out: torch.Tensor,
        slice_offsets: tuple[int, ...],
    ) -> None:
        """Add the delta from :meth:`shrink_stage`'s partial sums into ``out``."""
        slice_offsets = tuple(slice_offsets)
        if stage.dim() != 3:
            raise ValueError(f"expand_stage takes shrink_stage's [split, T, width] partials, got {tuple(stage.shape)}")
        check_expand_shapes(stage.shape[1:], B, info, out, slice_offsets)
        _check_runtime(stage, B, out)
        _check_ranks(info, B.shape[0], B.shape[2])
        info = ensure_tiles(info)
        if out.shape[0] == 0 or info.num_tiles == 0:
            return
        launch_expand(
            stage, B, out, info, slice_offsets, self.expand_config(info, B, slice_offsets), pdl=self._pdl(out.device)
        )
