"""Launch-configuration choices: pure functions of capture-time shapes.

The single-launch kernel's grid barrier is only safe when every program is resident at
once, so the program counts and the residency arithmetic are checked against the limits
they must respect, over a spread of shapes rather than a few hand-picked answers.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from loraserve.kernels.triton_ops import pick_expand, pick_fused, pick_shrink
from loraserve.kernels.triton_ops.configs import (
    FUSED_MAX_COL_BLOCKS,
    FUSED_MAX_K_STEPS_PER_SPLIT,
    FUSED_MAX_RANK,
    FUSED_MAX_SPLIT_K,
    FUSED_PROGRAMS_PER_SM,
    cdiv,
)
from loraserve.kernels.triton_ops.fused import resident_per_sm

LLAMA_8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
            "down": (14336, (4096,))}  # fmt: skip


@pytest.mark.parametrize("module", sorted(LLAMA_8B))
@pytest.mark.parametrize("num_tiles", [1, 2, 8, 32, 64])
@pytest.mark.parametrize("max_rank", [8, 16, 64])
def test_fused_grid_fits_resident_limit(module, num_tiles, max_rank):
    """Fused grid fits the resident limit and bounds the work."""
    in_dim, widths = LLAMA_8B[module]
    sms = 132
    cfg = pick_fused(num_tiles=num_tiles, tile_m=16, widths=widths, max_rank=max_rank, in_dim=in_dim,
                     dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    blocks = num_tiles * sum(cdiv(w, 128) for w in widths)
    k_steps = cdiv(in_dim, 128)
    if cfg is None:
        # Declined only where a full table would leave programs more blocks than allowed,
        # or a shrink item a longer K loop than allowed even at the widest split.
        widest = min(FUSED_MAX_SPLIT_K, k_steps // 2, 256 // max(16, max_rank))
        assert (
            blocks > FUSED_PROGRAMS_PER_SM * sms * FUSED_MAX_COL_BLOCKS
            or cdiv(k_steps, widest) > FUSED_MAX_K_STEPS_PER_SPLIT
        )
        return
    assert 1 <= cfg.programs <= FUSED_PROGRAMS_PER_SM * sms
    assert cdiv(blocks, cfg.programs) <= FUSED_MAX_COL_BLOCKS
    # The grid is no larger than the work of a full table needs (blocks or shrink items).
    per_tile = len(widths) * cdiv(max_rank, cfg.block_r)
    assert cfg.programs <= max(blocks, per_tile * cfg.split_k, per_tile * 32)
    # The partial sums hold the most splits one tile may use, each at least two K steps.
    assert cfg.split_k == 1 or cdiv(in_dim, cfg.block_k) // cfg.split_k >= 2
    assert cdiv(cdiv(in_dim, cfg.block_k), cfg.split_k) <= FUSED_MAX_K_STEPS_PER_SPLIT
    assert cfg.split_k * per_tile <= max(cfg.programs, per_tile)
    assert cfg.block_r >= min(max_rank, 64)


def test_fused_declines_what_it_does_not_cover():
    kw = dict(num_tiles=1, in_dim=4096, dtype=torch.bfloat16, num_sms=132)
    assert pick_fused(tile_m=16, widths=(4096,), max_rank=FUSED_MAX_RANK * 2, **kw) is None  # rank chunks
    assert pick_fused(tile_m=16, widths=(64,) * 4, max_rank=16, **kw) is None  # four slices
    assert pick_fused(tile_m=64, widths=(4096,), max_rank=16, **kw) is None  # extend tiles, by default
    assert pick_fused(tile_m=64, widths=(4096,), max_rank=16, max_col_blocks=1 << 30, **kw) is not None  # forced
    # A full table too large for the grid to stream within the bound: two launches.
    big = dict(kw, num_tiles=64)
    assert pick_fused(tile_m=16, widths=(14336, 14336), max_rank=16, **big) is None


@pytest.mark.parametrize("num_tiles,tile_m", [(1, 16), (8, 16), (64, 16), (32, 16), (24, 64)])
def test_two_launch_configs_divide_the_work(num_tiles, tile_m):
    for module, (in_dim, widths) in LLAMA_8B.items():
        sc = pick_shrink(num_tiles=num_tiles, tile_m=tile_m, num_slices=len(widths), max_rank=16, in_dim=in_dim,
                         dtype=torch.bfloat16, num_sms=132)  # fmt: skip
        # Every split covers whole K steps and at least one of them.
        assert sc.split_k >= 1 and cdiv(in_dim, sc.block_k) >= sc.split_k, module
        ec = pick_expand(num_tiles=num_tiles, tile_m=tile_m, widths=widths, max_rank=16, dtype=torch.bfloat16,
                         num_sms=132)  # fmt: skip
        assert ec.block_r >= 16 and ec.col_blocks >= 1


def _fits(count: int, n_regs: int, shared: int, warps: int, props) -> bool:
    regs = count * warps * (-(-n_regs * 32 // 256) * 256)
    return (
        regs <= props.regs_per_multiprocessor
        and count * 32 * warps <= props.max_threads_per_multi_processor
        and count * (shared + 1024) <= props.shared_memory_per_multiprocessor
    )


@pytest.mark.parametrize(
    "n_regs,shared,warps",
    list(itertools.product([32, 64, 90, 128, 168, 255], [0, 8192, 20480, 51200, 163840], [4, 8])),
)
def test_residency_is_the_largest_count_that_fits(n_regs, shared, warps):
    props = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=233472)  # fmt: skip
    count = resident_per_sm(n_regs, shared, warps, props)
    assert count == 0 or _fits(count, n_regs, shared, warps, props)
    assert count == 32 or not _fits(count + 1, n_regs, shared, warps, props)


def test_small_ranks_take_narrow_step():
    """Decode/verify tiles of a slot with rank <= 16 take 16-row B tiles in a rank-64 pool;
    extend tiles, pools of rank 16 and a disabled small step keep the pool's one step."""
    from loraserve.kernels.triton_ops.expand import small_rank_block

    kw = dict(num_tiles=8, widths=(4096, 1024, 1024), dtype=torch.bfloat16, num_sms=132)
    wide = pick_expand(tile_m=16, max_rank=64, **kw)
    assert wide.block_r == 64 and small_rank_block(wide, 16) == 16
    assert small_rank_block(wide, 64) == 0  # extend tiles
    assert small_rank_block(pick_expand(tile_m=16, max_rank=16, **kw), 16) == 0  # nothing narrower
    assert small_rank_block(replace(wide, small_block_r=0), 16) == 0


def test_expand_groups_follow_blocks():
    """Four column blocks a program once a launch has about 15 blocks per SM (64 decode
    tiles of o or down), two below (32 verify tiles of qkv, 8 decode tiles), eight for
    extend tiles; every tile's column loop pipelined."""
    kw = dict(max_rank=16, dtype=torch.bfloat16, num_sms=132)
    o, qkv = LLAMA_8B["o"][1], LLAMA_8B["qkv"][1]
    assert pick_expand(num_tiles=64, tile_m=16, widths=o, **kw).col_blocks == 4
    assert pick_expand(num_tiles=32, tile_m=16, widths=qkv, **kw).col_blocks == 2
    assert pick_expand(num_tiles=8, tile_m=16, widths=qkv, **kw).col_blocks == 2
    extend = pick_expand(num_tiles=8, tile_m=64, widths=o, **kw)
    assert extend.col_blocks == 8
    assert extend.pipeline_stages == pick_expand(num_tiles=64, tile_m=16, widths=o, **kw).pipeline_stages > 0
