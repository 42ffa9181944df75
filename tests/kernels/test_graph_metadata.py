"""CUDA-graph metadata: persistent buffers updated in place, capture maxima, width guard.

On the CPU there is no graph to capture; these tests check what capture relies on: the
info a graph is recorded with keeps its tensors (same storage, same pointers) and its
launch sizes across updates, and replaying the recorded launches after an update computes
the new batch. The real capture/replay runs in ``test_cuda_graphs.py`` on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, get_backend
from loraserve.kernels.graph_metadata import GraphLoRAMetadata
from loraserve.kernels.triton_backend import TritonLoRABackend


def test_extend_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="run extend batches eagerly"):
        GraphLoRAMetadata(ForwardMode.EXTEND, 4, 2, device="cpu")


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


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "two-launch"])
@pytest.mark.parametrize("mode,k", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 3)])
def test_recorded_launches_compute_each_new_batch(mode, k, fused, make_pool, gen, check_apply):
    """Launch with the capture-time info after every update, as a graph replay does."""
    pool = make_pool(in_dim=24, widths=(16, 8, 8), ranks=[8, 8, 8, 8], max_rank=8)
    meta = GraphLoRAMetadata(mode, 6, 4, num_draft_tokens=k if k > 1 else None, device="cpu")
    info = meta.capture_info(6)
    backend = TritonLoRABackend(fused=fused)
    for real in (6, 4):
        slots = torch.randint(-1, 4, (real,), generator=gen).tolist()
        pool.ranks = torch.randint(0, 9, (4,), generator=gen).tolist()
        pool.scalings = (torch.rand(4, generator=gen) + 0.25).tolist()
        updated = meta.update(slots, pool.ranks, pool.scalings, num_draft_tokens=k if k > 1 else None, batch_size=6)
        assert updated is info
        x, out0 = pool.inputs(gen, info.total_tokens)
        check_apply(backend, info, pool, x, out0)
        check_apply(get_backend("torch"), info, pool, x, out0)  # host copies follow the update too
