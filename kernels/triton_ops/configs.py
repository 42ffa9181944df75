"""Launch configurations for the LoRA kernels, chosen by pure functions of the shapes.

Everything here depends only on values that are fixed for a CUDA-graph capture (tile
capacity, module sizes, pool rank, dtype, SM count), never on a batch's contents, so a
captured launch stays valid on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Tuned constants; bench/KERNELS-NOTES.md holds the sweeps behind each number.
MAX_SPLIT_K = 16
MAX_SPLIT_K_WIDE_TILES = 2  # extend: every split's partial is re-read by each column group
MIN_K_BLOCKS_PER_SPLIT = 2  # at least 2 steps (256 columns at block_k 128) per split
PROGRAMS_PER_SM = 2  # shrink programs (tiles x slices) aimed for per SM before splitting K
EXPAND_PIPELINE_STAGES = 3  # the expand's column loop: blocks in flight + 1
# Short-tile expands take 4 column blocks a program from this many blocks per SM, 2 below:
# longer programs pay only once the blocks fill every SM many times over; fewer blocks
# need the extra programs to keep enough loads in flight.
FOUR_COL_BLOCKS_PER_SM = 15
# The expand loads every split's partial tile at once (so they are in flight together):
# splits x rank block is capped so they fit in registers (16 splits at rank 16, 4 at 64).
MAX_PARTIAL_COLUMNS = 256

# Single-launch (fused) path: programs resident together (a grid barrier needs all of
# them at once; two per SM fit whatever the kernel uses). The automatic choice takes it
# only where a full tile table gives each program at most one column block and each
# shrink item at most four K steps, the only shapes where one launch beats two: longer K
# loops pipeline fewer stages in the fused kernel, and two programs per SM keep too few
# bytes in flight for many tiles.
FUSED_PROGRAMS_PER_SM = 2
FUSED_MAX_COL_BLOCKS = 1
FUSED_MAX_K_STEPS_PER_SPLIT = 4
FUSED_MAX_SPLIT_K = 32
FUSED_MIN_K_BLOCKS_PER_SPLIT = 2
FUSED_MAX_RANK = 64  # one rank block: above it the kernel needs far more registers and shared memory


@dataclass(frozen=True)
class ShrinkConfig:
    """Shrink tiles: ``block_n`` rank columns, ``block_k`` input columns a step, ``split_k`` ways."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandConfig:
    """Expand tiles: ``block_n`` output columns, ``block_r`` rank columns a step, and
    ``col_blocks`` column blocks streamed by each program."""

    block_n: int
    block_r: int
    col_blocks: int = 1
    num_warps: int = 4
    num_stages: int = 2
    # Decode/verify tiles whose slot has at most this rank take block_r = small_block_r in
    # the same launch (0: never): a rank-16 adapter in a rank-64 pool (the runtime's default
    # pool) then streams and multiplies 16-row B tiles, not 64-row ones mostly masked.
    small_block_r: int = 16
    # > 0: the column loop is left to Triton's software pipeliner with this many stages
    # (B and the base output copied to shared memory ahead, cp.async); 0: the loop
    # prefetches one block ahead in registers.
    pipeline_stages: int = 0


@dataclass(frozen=True)
class FusedConfig:
    """Single-launch shrink + expand: ``programs`` resident programs; the kernel shares out
    a batch's work over them, splitting K up to ``split_k`` ways (``block_k`` steps,
    ``shrink_block_r`` ranks an item) and giving each expand item as many ``block_n``-column
    blocks (``block_r`` ranks a step) as fill the grid once."""

    programs: int
    split_k: int
    block_k: int
    block_r: int
    block_n: int
    shrink_block_r: int = 16
    num_warps: int = 4
    num_stages: int = 2


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rank_block(max_rank: int) -> int:
    """Rank columns per step: the pool's rank rounded to a power of two, 16..64."""
    return min(64, max(16, next_pow2(max_rank)))


def pick_shrink(
    *,
    num_tiles: int,
    tile_m: int,
    num_slices: int,
    max_rank: int,
    in_dim: int,
    dtype: torch.dtype,
    num_sms: int,
) -> ShrinkConfig:
    """Split the reduction over ``in_dim`` until the grid has a few programs per SM.

    At small batches the shrink is a handful of long dot products over ``in_dim``; one
    program each would stream an adapter's A through a single SM. Splitting K spreads the
    read over the chip; the partial sums are added by the expand as it loads them.
    """
    # Decode/verify tiles are short: 16-wide rank blocks, so a rank-16 adapter in a
    # rank-64 pool runs one program per slice and the others stop at once. Extend tiles
    # cover the whole rank at once so x is streamed once per slice.
    block_n = 16 if tile_m <= 16 else rank_block(max_rank)
    block_k = 128 if tile_m <= 32 else 64
    if dtype == torch.float32:
        block_k //= 2
    # Rank blocks past an adapter's rank stop at once, so they do not count: serving
    # ranks mostly fit one block.
    programs = max(1, num_tiles * num_slices)
    k_blocks = cdiv(in_dim, block_k)
    limit = min(
        MAX_SPLIT_K if tile_m <= 16 else MAX_SPLIT_K_WIDE_TILES,
        max(1, k_blocks // MIN_K_BLOCKS_PER_SPLIT),
        max(1, MAX_PARTIAL_COLUMNS // rank_block(max_rank)),
    )
    split = 1
    while split * 2 <= limit and programs * split < PROGRAMS_PER_SM * num_sms:
        split *= 2
    return ShrinkConfig(block_n=block_n, block_k=block_k, split_k=split)


def expand_blocks(num_tiles: int, widths: tuple[int, ...], block_n: int) -> int:
    """``block_n``-column blocks an expand launch covers over all its tiles and slices."""
    return max(1, num_tiles) * sum(cdiv(w, block_n) for w in widths)


def pick_expand(
    *,
    num_tiles: int,
    tile_m: int,
    widths: tuple[int, ...],
    max_rank: int,
    dtype: torch.dtype,
    num_sms: int,
) -> ExpandConfig:
    """Columns per program: 2-4 blocks of 128 for short tiles, 8 blocks of 64 for extend.

    Each program loads its tile's ``xa`` (all split-K partials) once; short tiles carry
    one or a few live rows, so that load is small and more programs win; extend tiles
    carry 64 rows, so each program must cover many columns to amortise it.
    """
    wide = tile_m > 16
    block_n = 64 if wide else 128
    if dtype == torch.float32:
        block_n //= 2
    blocks = expand_blocks(num_tiles, widths, block_n)
    if wide:
        col_blocks = 8
    elif blocks >= FOUR_COL_BLOCKS_PER_SM * num_sms:
        col_blocks = 4
    else:
        col_blocks = 2
    # The column loop goes to Triton's pipeliner, B and the base output copied to shared
    # memory two blocks ahead: fewer registers and shared-memory round trips than a
    # register prefetch, on every tile kind (bench/KERNELS-NOTES.md).
    return ExpandConfig(
        block_n=block_n, block_r=rank_block(max_rank), col_blocks=col_blocks, pipeline_stages=EXPAND_PIPELINE_STAGES
    )


def k_per_split(in_dim: int, block_k: int, split_k: int) -> int:
    """Input columns each split covers: whole ``block_k`` steps, so splits never overlap."""
    return cdiv(cdiv(in_dim, block_k), split_k) * block_k


def pick_fused(
    *,
    num_tiles: int,
    tile_m: int,
    widths: tuple[int, ...],
    max_rank: int,
    in_dim: int,
    dtype: torch.dtype,
    num_sms: int,
    max_col_blocks: int = FUSED_MAX_COL_BLOCKS,
) -> FusedConfig | None:
    """The single-launch configuration, or None where two launches serve better.

    It pays where launches and dependent round trips dominate: short tiles and little
    expand work. ``num_tiles`` is the table's capacity (what a CUDA graph may carry):
    when every tile is live, each program must stream at most ``max_col_blocks`` column
    blocks, and (by default) a shrink item at most ``FUSED_MAX_K_STEPS_PER_SPLIT`` K
    steps, otherwise None. The grid is as large as the work of a full table needs, up to
    what is resident at once; the kernel picks the K split and the blocks per item from
    the live tiles of each batch.
    """
    if not 1 <= len(widths) <= 3 or num_tiles < 1 or max_rank > FUSED_MAX_RANK:
        return None
    if tile_m > 16 and max_col_blocks <= FUSED_MAX_COL_BLOCKS:
        return None  # extend tiles: many rows, bandwidth-bound; two launches by default
    block_n = 64 if dtype == torch.float32 else 128
    block_k = 64 if dtype == torch.float32 else 128
    block_r = rank_block(max_rank)
    capacity = FUSED_PROGRAMS_PER_SM * num_sms
    blocks = num_tiles * sum(cdiv(w, block_n) for w in widths)
    if blocks > capacity * max_col_blocks:
        return None
    # Shrink items are (tile, slice, K split); each covers its slot's rank 16 at a time,
    # so its A tile stays small next to the expand's prefetched B tile.
    per_tile = len(widths)
    split_limit = min(
        FUSED_MAX_SPLIT_K,
        max(1, cdiv(in_dim, block_k) // FUSED_MIN_K_BLOCKS_PER_SPLIT),
        max(1, MAX_PARTIAL_COLUMNS // block_r),
    )
    if max_col_blocks <= FUSED_MAX_COL_BLOCKS and cdiv(cdiv(in_dim, block_k), split_limit) > FUSED_MAX_K_STEPS_PER_SPLIT:
        return None  # a long K loop per program: the two-launch shrink hides it better
    programs = max(1, min(capacity, max(blocks, per_tile * split_limit)))
    # The partial sums' buffer holds the most splits any batch may use: one live tile.
    split = max(1, min(split_limit, programs // per_tile))
    return FusedConfig(programs=programs, split_k=split, block_k=block_k, block_r=block_r, block_n=block_n)


# Base GEMM with the LoRA expand in its epilogue (triton_ops/gemm_expand.py). Untuned
# starting points: decode/verify GEMMs stream the weight once, so the choice aims at
# enough programs and enough weight bytes in flight per SM rather than at reuse.
GEMM_PROGRAMS_PER_SM = 2  # programs aimed for per SM before the column tile shrinks
GEMM_TILE_BYTES = 16 * 1024  # weight bytes one K step of a program loads
GEMM_SMEM_BYTES = 192 * 1024  # shared memory one program's pipeline buffers may take
GEMM_MAX_STAGES = 5


@dataclass(frozen=True)
class GemmConfig:
    """Base GEMM tiles: ``block_m`` token rows x ``block_n`` output columns per program,
    ``block_k`` input columns a step, ``num_stages`` steps of loads in flight."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def gemm_config(tokens: int, n: int, k: int, dtype: torch.dtype, num_sms: int) -> GemmConfig:
    """Tiles for ``[tokens, k] @ [n, k]ᵀ`` at decode/verify sizes (memory-bound: W streamed once).

    - ``block_m``: the token count rounded up to a power of two, 16 (``tl.dot``'s minimum)
      to 128; more tokens take several row tiles, which run next to each other and so
      read each weight tile from L2 after the first.
    - ``block_n``: the widest of 128/64/32/16 that still gives ``GEMM_PROGRAMS_PER_SM``
      programs per SM (N = 4096 at one row tile on 132 SMs: 16), so every SM streams part
      of W without splitting K; but at least half the tokens (up to 128), since every
      column tile re-reads its rows of x from L2: x's reads stay within twice W's bytes.
    - ``block_k``: about ``GEMM_TILE_BYTES`` of W per step (narrow column tiles take
      longer steps), 64..256, shorter where three steps of x and W would not fit
      ``GEMM_SMEM_BYTES``, and no longer than K needs.
    - ``num_stages``: as many steps in flight as ``GEMM_SMEM_BYTES`` holds, 2..5.
    """
    elem = 4 if dtype == torch.float32 else 2
    block_m = min(128, max(16, next_pow2(tokens)))
    m_tiles = cdiv(max(tokens, 1), block_m)
    min_block_n = max(16, min(128, next_pow2(tokens) // 2))
    block_n = min_block_n
    for cand in (128, 64, 32):
        if cand > min_block_n and m_tiles * cdiv(n, cand) >= GEMM_PROGRAMS_PER_SM * num_sms:
            block_n = cand
            break
    block_k = min(256, max(64, GEMM_TILE_BYTES // (block_n * elem)))
    while block_k > 32 and 3 * (block_n + block_m) * block_k * elem > GEMM_SMEM_BYTES:
        block_k //= 2
    block_k = max(16, min(block_k, next_pow2(k)))
    stage_bytes = (block_n + block_m) * block_k * elem
    num_stages = max(2, min(GEMM_MAX_STAGES, GEMM_SMEM_BYTES // stage_bytes))
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return GemmConfig(
        block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages
    )
