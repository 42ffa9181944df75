"""Triton shrink/expand kernels against the float64 oracle (interpreter on CPU, GPU if present).

Shapes are small on purpose (the interpreter runs every program in Python) but odd:
input and output widths that no block divides, ranks below the pool rank, rank-0 slots,
base-model requests, empty extend segments, and non-contiguous views.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, build_batch_info, get_backend
from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops import ExpandConfig, FusedConfig, ShrinkConfig

# Both code paths of apply: one launch (shrink, grid barrier, expand; two launches of the
# same kernel under the interpreter) and the shrink + expand pair.
PATHS = {
    "fused": TritonLoRABackend(fused=True),
    "two-launch": TritonLoRABackend(fused=False),
    "register-prefetch": TritonLoRABackend(fused=False, expand_pipeline=0),
}

QKV = (20, 6, 6)  # GQA-shaped: q wider than k and v

MODES = [
    (ForwardMode.DECODE, {}),
    (ForwardMode.TARGET_VERIFY, {"num_draft_tokens": 3}),
    (ForwardMode.EXTEND, {"extend_lens": [7, 0, 19, 1, 3]}),
]
SLOTS = [1, -1, 0, 3, 2]  # slot 2 has rank 0, request 1 is the base model


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode,kwargs", MODES, ids=["decode", "verify", "extend"])
def test_apply_matches_float64(mode, kwargs, dtype, path, make_pool, gen, check_apply, device):
    pool = make_pool(in_dim=37, widths=QKV, ranks=[16, 5, 0, 9], max_rank=16, dtype=dtype)
    info = build_batch_info(mode, SLOTS, pool.ranks, pool.scalings, device=device, **kwargs)
    x, out0 = pool.inputs(gen, info.total_tokens)
    check_apply(PATHS[path], info, pool, x, out0)


@pytest.mark.parametrize(
    "config",
    [
        FusedConfig(programs=3, split_k=4, block_k=16, block_r=16, block_n=16),
        FusedConfig(programs=5, split_k=2, block_k=32, block_r=64, block_n=32),
        FusedConfig(programs=64, split_k=8, block_k=16, block_r=32, block_n=16),
    ],
    ids=["few-programs", "rank64", "many-programs"],
)
def test_fused_configs_match_float64(config, make_pool, gen, check_apply, device):
    """Few programs (each takes several shrink items and several column blocks per expand
    item, one K split), rank blocks wider than the ranks (rank 40 in a rank-64 pool),
    column groups that end inside a slice, and more programs than work (K split several
    ways, most programs idle at the barrier) all compute the same function."""
    pool = make_pool(in_dim=45, widths=QKV, ranks=[40, 7, 16], max_rank=config.block_r, dtype=torch.bfloat16)
    pool.ranks = [min(r, config.block_r) for r in pool.ranks]
    info = build_batch_info(ForwardMode.TARGET_VERIFY, [0, 1, 2, 0, -1], pool.ranks, pool.scalings,
                            num_draft_tokens=2, device=device)
    x, out0 = pool.inputs(gen, info.total_tokens)
    check_apply(TritonLoRABackend(fused=True, fused_config=config), info, pool, x, out0)


def test_fused_stops_at_the_live_tiles(make_pool, gen, check_apply, device):
    """Tiles past the live count are never read: poison them with a real slot and rows."""
    pool = make_pool(in_dim=20, widths=(12, 12), ranks=[8, 8], max_rank=8)
    info = build_batch_info(ForwardMode.DECODE, [1, 0, -1], pool.ranks, pool.scalings, device=device)
    assert info.num_tiles == 2 and int(info.live_tiles.item()) == 2
    padded = torch.cat([info.tiles, info.tiles[:1]])  # a third tile repeating the first's work
    padded_rows = torch.cat([info.tile_rows, info.tile_rows[:1]])
    info.tiles, info.tile_rows, info.num_tiles = padded, padded_rows, 3
    x, out0 = pool.inputs(gen, info.total_tokens)
    # Read as live, the third tile would add slot 1's delta twice to its rows.
    check_apply(TritonLoRABackend(fused=True), info, pool, x, out0)


@pytest.mark.parametrize(
    "shrink,expand",
    [
        (ShrinkConfig(block_n=16, block_k=16, split_k=4), ExpandConfig(block_n=16, block_r=16, col_blocks=3)),
        (ShrinkConfig(block_n=32, block_k=32, split_k=2), ExpandConfig(block_n=32, block_r=16, col_blocks=1)),
        (
            ShrinkConfig(block_n=16, block_k=16, split_k=4),
            ExpandConfig(block_n=16, block_r=16, col_blocks=3, pipeline_stages=3),
        ),
        (
            ShrinkConfig(block_n=32, block_k=32, split_k=2),
            ExpandConfig(block_n=32, block_r=16, col_blocks=2, pipeline_stages=2),
        ),
    ],
    ids=["split4-groups3", "split2-rank-chunks", "pipelined-groups3", "pipelined-rank-chunks"],
)
def test_forced_configs_match_float64(shrink, expand, make_pool, gen, check_apply, device):
    """Split-K partial sums, several column blocks per program, and rank chunks (rank 40
    in a 64 pool with 16-wide chunks) all compute the same function."""
    pool = make_pool(in_dim=45, widths=QKV, ranks=[40, 7, 16], max_rank=64)
    info = build_batch_info(ForwardMode.TARGET_VERIFY, [0, 1, 2, 0, -1], pool.ranks, pool.scalings,
                            num_draft_tokens=2, device=device)
    x, out0 = pool.inputs(gen, info.total_tokens)
    check_apply(TritonLoRABackend(shrink_config=shrink, expand_config=expand), info, pool, x, out0)


def test_grouped_routing_equals_unsorted(make_pool, gen, device):
    pool = make_pool(in_dim=29, widths=(12, 12), ranks=[8, 4, 8], max_rank=8)
    slots = [2, 0, 2, 1, -1, 0, 2]
    x, out0 = pool.inputs(gen, len(slots))
    outs = []
    for grouped in (True, False):
        info = build_batch_info(ForwardMode.DECODE, slots, pool.ranks, pool.scalings, group_by_slot=grouped,
                                device=device)
        out = out0.clone()
        get_backend("triton", str(device)).apply(x, pool.A, pool.B, info, out, pool.offsets)
        outs.append(out)
    assert outs[0].ne(out0).any()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_non_contiguous_views(make_pool, gen, check_output, device):
    """x sliced from a wider activation, out a column slice of a fused output, B rank-major."""
    pool = make_pool(in_dim=21, widths=(10, 6), ranks=[6, 3], max_rank=8)
    pool.B = pool.B.transpose(1, 2).contiguous().transpose(1, 2)  # rank-major storage, same values
    info = build_batch_info(ForwardMode.EXTEND, [0, 1], pool.ranks, pool.scalings, extend_lens=[5, 4], device=device)
    wide_x = torch.randn(9, 30, generator=gen).to(device)
    x = wide_x[:, 4:25]
    fused = torch.randn(9, 40, generator=gen).to(device)
    out = fused[:, 7:23]
    assert not x.is_contiguous() and not out.is_contiguous() and not pool.B.is_contiguous()
    out0 = out.clone()
    untouched = fused.clone()
    get_backend("triton", str(device)).apply(x, pool.A, pool.B, info, out, pool.offsets)
    check_output(info, pool, x, out0, out)
    outside = torch.ones_like(fused, dtype=torch.bool)
    outside[:, 7:23] = False
    assert torch.equal(fused[outside], untouched[outside])  # neighbouring columns untouched


@pytest.mark.parametrize("path", sorted(PATHS))
def test_more_than_three_slices_launch_in_groups(path, make_pool, gen, check_apply, device):
    """Five slices: the expand launches in groups of three; the fused path declines them."""
    pool = make_pool(in_dim=18, widths=(5, 7, 3, 9, 4), ranks=[4, 2], max_rank=4)
    info = build_batch_info(ForwardMode.DECODE, [1, 0, 1], pool.ranks, pool.scalings, device=device)
    x, out0 = pool.inputs(gen, 3)
    check_apply(PATHS[path], info, pool, x, out0)


def test_shrink_writes_live_entries_only(make_pool, gen, device):
    """Poison the output: every LoRA row's rank columns are written, base rows keep the poison."""
    pool = make_pool(in_dim=40, widths=(8, 8, 8), ranks=[16, 5], max_rank=16)
    info = build_batch_info(ForwardMode.DECODE, [1, -1, 0, 1], pool.ranks, pool.scalings, device=device)
    x, _ = pool.inputs(gen, 4)
    for split in (1, 4):
        backend = TritonLoRABackend(shrink_config=ShrinkConfig(block_n=16, block_k=16, split_k=split))
        out = torch.full((4, 48), float("nan"), device=device)
        backend.shrink(x, pool.A, info, num_slices=3, out=out)
        for row, slot in enumerate([1, -1, 0, 1]):
            if slot < 0:
                assert torch.isnan(out[row]).all()
                continue
            r = pool.ranks[slot]
            for s in range(3):
                got = out[row, s * 16 : s * 16 + r].double().cpu()
                ref = x[row].double().cpu() @ pool.A[slot, s * 16 : s * 16 + r].double().cpu().T
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_expand_ignores_what_it_must_not_read(make_pool, gen, check_output, device):
    """NaN in xa columns past each rank and in base-model rows never reaches the output."""
    pool = make_pool(in_dim=12, widths=(9, 5), ranks=[3, 8], max_rank=8)
    info = build_batch_info(ForwardMode.DECODE, [0, -1, 1], pool.ranks, pool.scalings, device=device)
    x, out0 = pool.inputs(gen, 3)
    xa = get_backend("torch").shrink(x, pool.A, info, num_slices=2)
    xa[1] = float("nan")  # base-model row
    xa[0, 3:8] = float("nan")  # past slot 0's rank, slice 0
    xa[0, 11:16] = float("nan")  # past slot 0's rank, slice 1
    out = out0.clone()
    get_backend("triton", str(device)).expand(xa, pool.B, info, out, pool.offsets)
    check_output(info, pool, x, out0, out)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_empty_batches_change_nothing(path, make_pool, gen, device):
    pool = make_pool(in_dim=10, widths=(6,), ranks=[4], max_rank=4)
    backend = PATHS[path]
    for slots, kwargs, mode in [
        ([], {}, ForwardMode.DECODE),
        ([-1, -1], {}, ForwardMode.DECODE),
        ([0, 0], {"extend_lens": [0, 0]}, ForwardMode.EXTEND),
    ]:
        info = build_batch_info(mode, slots, pool.ranks, pool.scalings, device=device, **kwargs)
        x, out0 = pool.inputs(gen, info.total_tokens)
        out = out0.clone()
        backend.apply(x, pool.A, pool.B, info, out, pool.offsets)
        assert torch.equal(out, out0)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_rank_above_pool_rejected(path, make_pool, gen, device):
    """Rank above pool rank is rejected before any write."""
    pool = make_pool(in_dim=10, widths=(6,), ranks=[4, 4], max_rank=4)
    info = build_batch_info(ForwardMode.DECODE, [0, 1], [4, 8], pool.scalings, device=device)
    x, out = pool.inputs(gen, 2)
    before = out.clone()
    with pytest.raises(ValueError, match="slot 1 has rank 8 but the weight buffer's max_rank is 4"):
        PATHS[path].apply(x, pool.A, pool.B, info, out, pool.offsets)
    assert torch.equal(out, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU guard")
def test_cpu_without_interpreter_errors(make_pool, gen, monkeypatch):
    """CPU without interpreter gets a clear error."""
    pool = make_pool(in_dim=10, widths=(6,), ranks=[4], max_rank=4)
    info = build_batch_info(ForwardMode.DECODE, [0], pool.ranks, pool.scalings)
    x, out = pool.inputs(gen, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"runs on CUDA tensors .* get_backend\('torch'\)"):
        get_backend("triton").apply(x, pool.A, pool.B, info, out, pool.offsets)


def test_single_launch_is_opt_in(make_pool, gen, monkeypatch, check_apply, device):
    """The default backend takes two launches; ``LORASERVE_LORA_FUSED=1`` lets the heuristic fuse."""
    pool = make_pool(in_dim=16, widths=(8,), ranks=[4], max_rank=4)
    info = build_batch_info(ForwardMode.DECODE, [0], pool.ranks, pool.scalings, device=device)
    x, out0 = pool.inputs(gen, 1)
    monkeypatch.setenv("LORASERVE_LORA_FUSED", "1")
    assert TritonLoRABackend().fused_config(info, x, pool.B, pool.offsets) is not None
    monkeypatch.delenv("LORASERVE_LORA_FUSED")
    backend = TritonLoRABackend()
    assert backend.fused_config(info, x, pool.B, pool.offsets) is None
    assert TritonLoRABackend(fused=True).fused_config(info, x, pool.B, pool.offsets) is not None  # explicit wins
    check_apply(backend, info, pool, x, out0)


@pytest.mark.parametrize("mode,kwargs", MODES[:2], ids=["decode", "verify"])
def test_small_and_large_ranks_share_a_launch(mode, kwargs, make_pool, gen, check_apply, device):
    """A rank-64 pool holding adapters of rank 64, 40, 16, 7 and 0: tiles of the rank-16 and
    rank-7 slots take 16-row B tiles, the others the pool's 64, in one launch; both agree
    with float64, as does every tile at the pool's step."""
    pool = make_pool(in_dim=37, widths=QKV, ranks=[64, 40, 16, 7, 0], max_rank=64, dtype=torch.bfloat16)
    slots = [0, 1, 2, 3, 4, -1, 0, 2]
    info = build_batch_info(mode, slots, pool.ranks, pool.scalings, device=device, **kwargs)
    x, out0 = pool.inputs(gen, info.total_tokens)
    for backend in (
        TritonLoRABackend(fused=False),
        TritonLoRABackend(fused=False, small_rank_block=0),
        TritonLoRABackend(fused=False, expand_pipeline=0),
    ):
        check_apply(backend, info, pool, x, out0)
    config = TritonLoRABackend().expand_config(info, pool.B, pool.offsets)
    assert (config.block_r, config.small_block_r) == (64, 16)
