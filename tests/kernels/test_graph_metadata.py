"""CUDA-graph metadata: persistent buffers updated in place, capture maxima, width guard.

On the CPU there is no graph to capture; these tests check what capture relies on: the
info a graph is recorded with keeps its tensors (same storage, same pointers) and its
launch sizes across updates, and replaying the recorded launches after an update computes
the new batch. The real capture/replay runs in ``test_cuda_graphs.py`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, build_batch_info, get_backend
from loraserve.kernels.graph_metadata import GraphLoRAMetadata
from loraserve.kernels.triton_backend import TritonLoRABackend


def test_extend_needs_a_fixed_length_with_the_fix():
    with pytest.raises(ValueError, match=r"extend graphs need extend_len >= 1.*run ragged extend batches eagerly"):
        GraphLoRAMetadata(ForwardMode.EXTEND, 4, 2, device="cpu")


@pytest.mark.parametrize("width,tile_m,tiles", [(16, 16, 1), (40, 64, 1), (128, 64, 2), (192, 64, 3)])
def test_extend_layout_matches_eager(width, tile_m, tiles):
    """A padded extend (one request, as the runtime's prefill graphs use it): one segment
    in request order, the tile height extend picks for that length, and the same segments,
    rows and tiles build_batch_info gives an eager extend of that length. The capacity is
    the exact tile count, so launch-size choices made from it match the eager extend's."""
    meta = GraphLoRAMetadata(ForwardMode.EXTEND, 1, 3, extend_len=width, device="cpu")
    assert (meta.width, meta.max_tokens, meta.tile_m) == (width, width, tile_m)
    info = meta.capture_info(1)
    assert (info.total_tokens, info.max_tokens_per_request, info.max_segment_len) == (width, width, width)
    assert info.num_tiles == meta.capacity(1) == meta.tile_capacity == tiles
    ranks, scalings = [8, 0, 4], [2.0, 1.0, 0.5]
    for slot in (2, 1, -1, 0):
        got = meta.update([slot], ranks, scalings, batch_size=1)
        want = build_batch_info(ForwardMode.EXTEND, [slot], ranks, scalings, extend_lens=[width], device="cpu")
        assert got is info and got.tile_m == want.tile_m
        assert got.seg_indptr_cpu == want.seg_indptr_cpu and got.weight_indices_cpu == want.weight_indices_cpu
        assert got.permutation_cpu == list(range(width)) and want.permutation_cpu is None
        assert got.token_slots.tolist() == want.token_slots.tolist()
        n_live = int(got.live_tiles.item())
        assert n_live == want.num_tiles == (tiles if slot in (0, 2) else 0)  # base and rank-0 slots: none
        assert torch.equal(got.tiles[:n_live], want.tiles) and torch.equal(got.tile_rows[:n_live], want.tile_rows)
        assert bool((got.tiles[n_live:, 0] == -1).all())


def test_extend_counts_come_from_token_counts(monkeypatch):
    """The graph metadata asks token_counts for its rows, as every other batch does."""
    import loraserve.kernels.graph_metadata as graph_metadata

    calls = []
    real = graph_metadata.token_counts

    def counting(mode, batch_size, **kw):
        calls.append((mode, batch_size, kw))
        return real(mode, batch_size, **kw)

    monkeypatch.setattr(graph_metadata, "token_counts", counting)
    meta = GraphLoRAMetadata(ForwardMode.EXTEND, 2, 2, extend_len=24, device="cpu")
    assert meta.max_tokens == 48 and meta.capture_info(2).total_tokens == 48
    assert (ForwardMode.EXTEND, 2, {"extend_lens": [24, 24], "num_draft_tokens": None}) in calls


def test_verify_buffers_are_sized_in_tokens():
    meta = GraphLoRAMetadata(ForwardMode.TARGET_VERIFY, 8, 3, num_draft_tokens=4, device="cpu")
    assert meta.max_tokens == 32
    info = meta.capture_info(8)
    assert info.total_tokens == 32 and info.permutation.numel() == 32 and info.token_slots.numel() == 32
    assert info.num_tiles == meta.capacity(8) >= 8


def test_width_guard_names_both_widths():
    meta = GraphLoRAMetadata(ForwardMode.TARGET_VERIFY, 4, 2, num_draft_tokens=4, device="cpu")
    meta.capture_info(4)
    with pytest.raises(ValueError, match=r"verifies 3 tokens per request but the CUDA graph was captured for 4"):
        meta.update([0, 1], [8, 8], [1.0, 1.0], num_draft_tokens=3)


def test_update_needs_a_captured_size():
    meta = GraphLoRAMetadata(ForwardMode.DECODE, 8, 2, device="cpu")
    meta.capture_info(2)
    with pytest.raises(ValueError, match=r"no captured batch size holds 3 requests \(captured: \[2\]\)"):
        meta.update([0, 1, 0], [8, 8], [1.0, 1.0])


def test_update_keeps_pointers_and_launch_sizes(gen):
    meta = GraphLoRAMetadata(ForwardMode.TARGET_VERIFY, 8, 4, num_draft_tokens=2, device="cpu")
    info4, info8 = meta.capture_info(4), meta.capture_info(8)
    ptrs = [t.data_ptr() for t in (info8.tiles, info8.tile_rows, info8.permutation, info8.lora_ranks)]
    sizes = (info8.num_tiles, info8.total_tokens, info8.tile_m)
    for real in (8, 5, 1):
        slots = torch.randint(-1, 4, (real,), generator=gen).tolist()
        got = meta.update(slots, [8, 16, 0, 4], [1.0, 0.5, 1.0, 2.0], num_draft_tokens=2, batch_size=8)
        assert got is info8
        assert [t.data_ptr() for t in (got.tiles, got.tile_rows, got.permutation, got.lora_ranks)] == ptrs
        assert (got.num_tiles, got.total_tokens, got.tile_m) == sizes
        # Padding requests are base-model rows; unused tile entries are slot -1.
        assert got.token_slots.tolist()[2 * real :] == [-1] * (2 * (8 - real))
        live = got.tiles[:, 0] >= 0
        assert bool((got.tiles[~live, 0] == -1).all())
        # The live count names exactly the leading entries that carry work.
        n_live = int(got.live_tiles.item())
        assert n_live == int(live.sum()) and bool(live[:n_live].all())
    # The smaller capture is served by default for a small batch.
    assert meta.update([1], [8, 16, 0, 4], [1.0] * 4, num_draft_tokens=2) is info4


def test_an_unchanged_layout_is_not_written_again(gen):
    """Steps of one running batch repeat their layout: the second update writes nothing,
    and any change (a slot, a rank, a scaling, the batch size) writes the new layout."""
    meta = GraphLoRAMetadata(ForwardMode.TARGET_VERIFY, 8, 4, num_draft_tokens=2, device="cpu")
    meta.capture_info(4), meta.capture_info(8)
    writes = []
    write = meta._write
    meta._write = lambda *args: writes.append(args) or write(*args)
    ranks, scalings = [8, 16, 0, 4], [1.0, 0.5, 1.0, 2.0]
    first = meta.update([0, 1, 1], ranks, scalings)
    snapshot = (first.token_slots.tolist(), first.tiles.tolist(), first.seg_indptr_cpu, first.permutation_cpu)
    assert meta.update([0, 1, 1], ranks, scalings) is first and len(writes) == 1
    assert (first.token_slots.tolist(), first.tiles.tolist(), first.seg_indptr_cpu, first.permutation_cpu) == snapshot
    for args in (  # each differs from the one before in one field: each is written
        ([0, 1, 3], ranks, scalings, 4),
        ([0, 1, 3], [8, 16, 0, 8], scalings, 4),
        ([0, 1, 3], [8, 16, 0, 8], [1.0, 0.5, 1.0, 1.0], 4),
        ([0, 1, 3], [8, 16, 0, 8], [1.0, 0.5, 1.0, 1.0], 8),
    ):
        info = meta.update(args[0], args[1], args[2], batch_size=args[3])
        assert writes[-1][0] == args[0] and writes[-1][3] == args[3]
        assert info.token_slots.tolist()[:6] == [s for s in sorted(args[0]) for _ in range(2)]
    assert len(writes) == 5
    # the layout back to the first: written again (the buffers held the last one)
    assert meta.update([0, 1, 1], ranks, scalings).token_slots.tolist()[:6] == snapshot[0][:6]
    assert len(writes) == 6


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-launch"])
@pytest.mark.parametrize(
    "mode,k", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3), (ForwardMode.EXTEND, 20)]
)
def test_recorded_launches_compute_each_new_batch(mode, k, fused, make_pool, gen, check_apply, device):
    """Launch with the capture-time info after every update, as a graph replay does (on the
    pool's device: on a CUDA machine the kernels refuse host metadata)."""
    pool = make_pool(in_dim=24, widths=(16, 8, 8), ranks=[8, 8, 8, 8], max_rank=8)
    lens = {"extend_len": k} if mode is ForwardMode.EXTEND else {"num_draft_tokens": k if k > 1 else None}
    meta = GraphLoRAMetadata(mode, 6, 4, device=device, **lens)
    info = meta.capture_info(6)
    backend = TritonLoRABackend(fused=fused)
    for real in (6, 4):
        slots = torch.randint(-1, 4, (real,), generator=gen).tolist()
        pool.ranks = torch.randint(0, 9, (4,), generator=gen).tolist()
        pool.scalings = (torch.rand(4, generator=gen) + 0.25).tolist()
        updated = meta.update(slots, pool.ranks, pool.scalings, num_draft_tokens=lens.get("num_draft_tokens"), batch_size=6)
        assert updated is info
        x, out0 = pool.inputs(gen, info.total_tokens)
        check_apply(backend, info, pool, x, out0)
        check_apply(get_backend("torch"), info, pool, x, out0)  # host copies follow the update too
