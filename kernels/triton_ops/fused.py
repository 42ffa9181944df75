"""Shrink and expand of one module in a single launch, joined by a grid-wide barrier.

At small batches a module's LoRA costs little more than its launches and the chains of
dependent memory round trips inside them; the two-kernel path pays two launches, and
its expand cannot start loading before the shrink has finished. Here every program
issues the loads of its first expand block (B and the base output, which do not depend
on the shrink), takes its share of the shrink items (tile × slice × K split, covering
the slot's own rank, writing float32 partial sums), meets every other program at a barrier, and
finishes the expand from the partial sums.

The work is shared out on the device from this batch's number of live tiles: the K
split is chosen so the shrink items fill the grid once, and the column blocks per
expand item so the expand items do. A CUDA graph captured for a large capacity thus
spreads a replay's real work over the whole grid instead of leaving it to the programs
that a full table would have given it to.

The barrier is the classic counter with a flip bit: each program adds 1 to a 32-bit
semaphore, program 0 adds ``2^31 - (programs - 1)``, so once all have arrived the top
bit has flipped and the low bits are back where they were: no reset, no second counter.
A barrier needs every program resident at once. Before a configuration's first launch
its compiled kernel's registers and shared memory give how many programs fit on an SM
(:func:`resident_per_sm`); a launch uses at most that many (and at most
``FUSED_PROGRAMS_PER_SM``) per SM, and a kernel that cannot be checked is not launched
this way (the backend then takes two launches). A wait that outlasts ``MAX_POLLS`` polls
sets a flag the host can read (:func:`barrier_timeouts`) and goes on rather than hang
the GPU; it never fires while every program is resident.

The Triton interpreter runs programs one after another, so a barrier would wait forever:
there the same kernel runs as two launches (shrink phase, expand phase).
"""

from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl

from ..metadata import LoRABatchInfo
from .configs import FUSED_MIN_K_BLOCKS_PER_SPLIT, FUSED_PROGRAMS_PER_SM, FusedConfig, cdiv, next_pow2
from .expand import MAX_SLICES_PER_LAUNCH, column_groups, expand_prefetch, expand_stream, locate_group
from .shrink import dot_precision, shrink_block, upcast_dot

MAX_POLLS = 1 << 22  # several seconds of polling: far beyond any wait of a resident grid

_SEMAPHORES: dict[torch.device, torch.Tensor] = {}
_RESIDENT: dict[tuple, int] = {}  # (device, kernel specialisation) -> programs per SM


@triton.jit
def grid_barrier(sem_ptr, MAX_POLLS: tl.constexpr):
    """Wait until every program of the grid has arrived; stores before it are visible after."""
    sem = sem_ptr.to(tl.pointer_type(tl.uint32))
    tl.debug_barrier()  # every thread's stores precede the arrival (release below)
    nprog = tl.num_programs(0).to(tl.uint32)
    flip = tl.full((), 0x80000000, tl.uint32)
    one = tl.full((), 1, tl.uint32)
    add = tl.where(tl.program_id(0) == 0, flip - (nprog - one), one)
    old = tl.atomic_add(sem, add, sem="release", scope="gpu")
    seen = tl.atomic_add(sem, one - one, sem="acquire", scope="gpu")
    polls = tl.program_id(0) * 0
    while (((old ^ seen) & flip) == 0) & (polls < MAX_POLLS):
        seen = tl.atomic_add(sem, one - one, sem="acquire", scope="gpu")
        polls += 1
    if ((old ^ seen) & flip) == 0:
        tl.atomic_xchg(sem + 1, one)  # timed out: tell the host
    tl.debug_barrier()


@triton.jit
def _fused_item(
    item, tiles_ptr, rows_ptr, n_items, groups, group1, group2, off1, off2, off3, g,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Metadata of expand item ``item`` (tile-major over column groups of ``g`` blocks)."""
    valid = item < n_items
    tile = tl.where(valid, item // tl.maximum(groups, 1), 0)
    slot = tl.load(tiles_ptr + tile * 4)
    rank = tl.load(tiles_ptr + tile * 4 + 1)
    scale = tl.load(tiles_ptr + tile * 4 + 2).to(tl.float32, bitcast=True)
    rows = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    live = valid & (slot >= 0) & (rank > 0)
    slice_id, lo, hi, group = locate_group(item % tl.maximum(groups, 1), off1, off2, off3, group1, group2, NUM_SLICES)
    n_first = lo + group * g * BLOCK_N
    return slot, rank, scale, rows, live, slice_id, hi, n_first


@triton.jit
def _lora_fused_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    tiles_ptr,
    rows_ptr,
    live_ptr,
    sem_ptr,
    in_dim,
    max_rank,
    split_limit,
    off1,
    off2,
    off3,
    nb0,
    nb1,
    nb2,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ps,
    stride_pm,
    stride_pr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    NUM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,  # the partial-sum buffer's splits: the most a launch may use
    PHASE: tl.constexpr,  # 0: both with the barrier; 1: shrink only; 2: expand only
    MULTI_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    MAX_POLLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # expand: rank columns a step
    BLOCK_RS: tl.constexpr,  # shrink: rank columns an item (rank blocks past a slot's rank are skipped)
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    live_tiles = tl.load(live_ptr)
    # This batch's work, shared out over the grid: K splits so the shrink items fill it
    # once, column blocks per expand item so the expand items fill it once.
    split = tl.minimum(tl.maximum(nprog // tl.maximum(live_tiles * NUM_SLICES, 1), 1), split_limit)
    k_per_split = tl.cdiv(tl.cdiv(in_dim, BLOCK_K), split) * BLOCK_K
    g = tl.maximum(tl.cdiv(live_tiles * (nb0 + nb1 + nb2), nprog), 1)
    group1 = tl.cdiv(nb0, g)
    group2 = group1 + tl.cdiv(nb1, g)
    groups = group2 + tl.cdiv(nb2, g)
    n_expand = live_tiles * groups

    if PHASE != 1:
        # The first expand item's metadata, B and output loads go out first: they fly
        # while the shrink runs and wait for nothing the barrier guards.
        slot, rank, scale, rows, live, slice_id, hi, n_first = _fused_item(
            pid, tiles_ptr, rows_ptr, n_expand, groups, group1, group2, off1, off2, off3, g,
            NUM_SLICES, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        bt, base = expand_prefetch(
            b_ptr, out_ptr, slot, rank, rows, live, n_first, hi, stride_bs, stride_bn, stride_br, stride_om,
            stride_on, BLOCK_M, BLOCK_N, BLOCK_R,
        )  # fmt: skip

    if PHASE != 2:
        # Items: (tile, slice, K split); an item covers its slot's rank in BLOCK_RS steps,
        # so an adapter below the pool's rank reads only its own rows of A.
        per_tile = NUM_SLICES * split
        for item in range(pid, live_tiles * per_tile, nprog):
            # Own names: the first expand item's values above must survive this loop.
            s_tile = item // per_tile
            s_slice = (item % per_tile) // split
            s_split = item % split
            s_slot = tl.load(tiles_ptr + s_tile * 4)
            s_rank = tl.load(tiles_ptr + s_tile * 4 + 1)
            s_rows = tl.load(rows_ptr + s_tile * BLOCK_M + tl.arange(0, BLOCK_M))
            if s_slot >= 0:
                for s_start in range(0, s_rank, BLOCK_RS):
                    shrink_block(
                        x_ptr, a_ptr, part_ptr, s_slot, s_rank, s_rows, s_slice, s_start, s_split, in_dim,
                        max_rank, k_per_split, stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_ps,
                        stride_pm, stride_pr, DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_RS, BLOCK_K,
                    )  # fmt: skip

    if PHASE == 0:
        grid_barrier(sem_ptr, MAX_POLLS)

    if PHASE != 1:
        # Partial sums written by other programs of this launch: read them from L2.
        if live:
            expand_stream(
                part_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, g, bt, base,
                max_rank, 0, split, stride_ps, stride_pm, stride_pr, stride_bs, stride_bn, stride_br, stride_om,
                stride_on, SPLIT_K, MULTI_CHUNK, ".cg", DOT_PRECISION, UPCAST_DOT, BLOCK_M, BLOCK_N, BLOCK_R,
            )  # fmt: skip
        for item in range(pid + nprog, n_expand, nprog):
            slot, rank, scale, rows, live, slice_id, hi, n_first = _fused_item(
                item, tiles_ptr, rows_ptr, n_expand, groups, group1, group2, off1, off2, off3, g,
                NUM_SLICES, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            bt, base = expand_prefetch(
                b_ptr, out_ptr, slot, rank, rows, live, n_first, hi, stride_bs, stride_bn, stride_br, stride_om,
                stride_on, BLOCK_M, BLOCK_N, BLOCK_R,
            )  # fmt: skip
            if live:
                expand_stream(
                    part_ptr, b_ptr, out_ptr, slot, rank, scale, rows, slice_id, n_first, hi, g, bt, base,
                    max_rank, 0, split, stride_ps, stride_pm, stride_pr, stride_bs, stride_bn, stride_br,
                    stride_om, stride_on, SPLIT_K, MULTI_CHUNK, ".cg", DOT_PRECISION, UPCAST_DOT, BLOCK_M,
                    BLOCK_N, BLOCK_R,
                )  # fmt: skip


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def semaphore(device: torch.device) -> torch.Tensor | None:
    """The device's barrier semaphore (``[count, timeout flag]``), made on first use.

    None while a CUDA graph is being captured and none exists yet: allocating inside a
    capture would tie it to the graph's memory pool, so the caller takes the two-launch
    path for that capture (any eager call or warm-up before it creates the semaphore).
    Fused launches on one device share it, so they must not run concurrently on two
    streams (the runtime runs one forward at a time).
    """
    sem = _SEMAPHORES.get(device)
    if sem is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        sem = torch.zeros(4, dtype=torch.int32, device=device)
        _SEMAPHORES[device] = sem
    return sem


def barrier_timeouts(device: torch.device | str) -> bool:
    """True if a fused launch on ``device`` ever gave up waiting at its barrier (a health check)."""
    sem = _SEMAPHORES.get(torch.device(device))
    return bool(sem is not None and int(sem[1].item()) != 0)


def resident_per_sm(n_regs: int, shared_bytes: int, num_warps: int, props) -> int:
    """Programs of one kernel that fit on an SM together (registers, shared memory, threads).

    Registers are allocated per warp in units of 256; each block also reserves 1 KB of
    shared memory for the system.
    """
    threads = 32 * num_warps
    regs_per_warp = -(-max(n_regs, 1) * 32 // 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * num_warps)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    by_smem = smem // (shared_bytes + 1024)
    return max(0, min(by_regs, by_threads, by_smem, 32))


def _resident(device: torch.device, key: tuple, warm) -> int:
    """Cached :func:`resident_per_sm` of one specialisation; 0 if it cannot be known now."""
    full_key = (device, key)
    cached = _RESIDENT.get(full_key)
    if cached is not None:
        return cached
    if torch.cuda.is_current_stream_capturing():
        return 0  # compiling and loading a module inside a capture is not safe: two launches
    try:
        kernel = warm()
        kernel._init_handles()
        fits = resident_per_sm(
            int(kernel.n_regs), int(kernel.metadata.shared), int(kernel.metadata.num_warps),
            torch.cuda.get_device_properties(device),
        )  # fmt: skip
    except Exception:  # a Triton without these attributes: never risk a barrier
        fits = 0
    _RESIDENT[full_key] = fits
    return fits


def fused_supported(num_slices: int) -> bool:
    """The fused kernel takes up to three slices in one launch, like the expand."""
    return 1 <= num_slices <= MAX_SLICES_PER_LAUNCH


def launch_fused(
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor,
    partial: torch.Tensor,
    info: LoRABatchInfo,
    slice_offsets: tuple[int, ...],
    config: FusedConfig,
    sem: torch.Tensor,
    num_sms: int,
) -> bool:
    """Shrink and expand of one module into ``out`` in one launch (two under the interpreter).

    ``partial`` is ``[config.split_k, T, slices*max_rank]`` float32 scratch; ``sem`` the
    device's semaphore from :func:`semaphore`. Returns False, having launched nothing,
    when the grid's residency cannot be guaranteed (see :func:`resident_per_sm`).
    """
    num_slices = len(slice_offsets) - 1
    if not fused_supported(num_slices):
        raise ValueError(f"the fused LoRA kernel takes 1..{MAX_SLICES_PER_LAUNCH} slices, got {num_slices}")
    max_rank = B.shape[2]
    in_dim = x.shape[1]
    widths = [b - a for a, b in itertools.pairwise(slice_offsets)]
    blocks = column_groups(widths, config.block_n, 1) + [0] * (MAX_SLICES_PER_LAUNCH - num_slices)
    rel = list(slice_offsets[1:]) + [0] * (MAX_SLICES_PER_LAUNCH - num_slices)
    assert info.tiles is not None and info.tile_rows is not None and info.live_tiles is not None
    if partial.shape[0] != config.split_k:
        raise ValueError(f"partial holds {partial.shape[0]} splits but the configuration needs {config.split_k}")
    args = (
        x,
        A,
        B,
        out,
        partial,
        info.tiles,
        info.tile_rows,
        info.live_tiles,
        sem,
        in_dim,
        max_rank,
        max(1, min(config.split_k, cdiv(in_dim, config.block_k) // FUSED_MIN_K_BLOCKS_PER_SPLIT)),
        rel[0],
        rel[1],
        rel[2],
        blocks[0],
        blocks[1],
        blocks[2],
        x.stride(0),
        x.stride(1),
        *A.stride(),
        *partial.stride(),
        *B.stride(),
        out.stride(0),
        out.stride(1),
    )
    constants = dict(
        NUM_SLICES=num_slices,
        SPLIT_K=config.split_k,
        MULTI_CHUNK=config.block_r < next_pow2(max_rank),
        DOT_PRECISION=dot_precision(x.dtype),
        UPCAST_DOT=upcast_dot(x.dtype),
        MAX_POLLS=MAX_POLLS,
        BLOCK_M=info.tile_m,
        BLOCK_N=config.block_n,
        BLOCK_R=config.block_r,
        BLOCK_RS=config.shrink_block_r,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if interpreted():
        grid = (config.programs,)
        _lora_fused_kernel[grid](*args, PHASE=1, **constants)
        _lora_fused_kernel[grid](*args, PHASE=2, **constants)
        return True
    # Resources depend on the specialisation: constants, dtypes and which strides are 1.
    key = (x.dtype, B.dtype, out.dtype, tuple(a == 1 for a in args if isinstance(a, int)), tuple(sorted(constants.items())))
    fits = _resident(
        x.device, key, lambda: _lora_fused_kernel.warmup(*args, grid=(1,), PHASE=0, **constants)
    )  # fmt: skip
    per_sm = min(fits, FUSED_PROGRAMS_PER_SM)
    if per_sm < 1:
        return False
    grid = (max(1, min(config.programs, per_sm * num_sms)),)
    _lora_fused_kernel[grid](*args, PHASE=0, **constants)
    return True
