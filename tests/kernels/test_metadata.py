"""Batch metadata: token counts, segment layout, grouping permutation and the tile table."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, build_batch_info, token_counts
from loraserve.kernels.metadata import default_tile_m, max_tiles


def test_token_counts_per_mode():
    assert token_counts(ForwardMode.DECODE, 5) == (5, 1)
    assert token_counts(ForwardMode.DECODE, 0) == (0, 0)
    assert token_counts(ForwardMode.TARGET_VERIFY, 3, num_draft_tokens=4) == (12, 4)
    assert token_counts(ForwardMode.EXTEND, 3, extend_lens=[7, 0, 2]) == (9, 7)
    # Verify never reads extend lengths, so a stale list cannot leak into its layout.
    assert token_counts(ForwardMode.TARGET_VERIFY, 2, extend_lens=[100, 100], num_draft_tokens=3) == (6, 3)


@pytest.mark.parametrize(
    "mode,kwargs,match",
    [
        (ForwardMode.TARGET_VERIFY, {}, "num_draft_tokens"),
        (ForwardMode.TARGET_VERIFY, {"num_draft_tokens": 0}, "num_draft_tokens"),
        (ForwardMode.EXTEND, {}, "extend_lens"),
        (ForwardMode.EXTEND, {"extend_lens": [1]}, "extend_lens has 1 entries"),
        (ForwardMode.EXTEND, {"extend_lens": [1, -2]}, ">= 0"),
    ],
)
def test_token_counts_rejects_bad_input(mode, kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_counts(mode, 2, **kwargs)


def test_bad_slot_names_request_and_fix():
    with pytest.raises(ValueError, match=r"request 1 names slot 3, but the pool has 2 slots \(use -1"):
        build_batch_info(ForwardMode.DECODE, [0, 3], [8, 8], [1.0, 1.0])
    with pytest.raises(ValueError, match="one scaling per pool slot"):
        build_batch_info(ForwardMode.DECODE, [0], [8, 8], [1.0])
    with pytest.raises(ValueError, match="tile_m must be one of"):
        build_batch_info(ForwardMode.DECODE, [0], [8], [1.0], tile_m=8)


def _covered_rows(info) -> list[int]:
    rows = info.tile_rows.reshape(-1).tolist()
    return sorted(r for r in rows if r >= 0)


@pytest.mark.parametrize("k", [1, 3])
def test_decode_and_verify_group_requests_by_slot(k, gen):
    num_slots = 5
    slots = torch.randint(-1, num_slots, (23,), generator=gen).tolist()
    ranks = [8, 0, 16, 4, 8]
    mode = ForwardMode.DECODE if k == 1 else ForwardMode.TARGET_VERIFY
    info = build_batch_info(mode, slots, ranks, [1.0] * num_slots, num_draft_tokens=k if k > 1 else None)
    assert info.total_tokens == 23 * k
    perm = info.permutation_cpu
    assert sorted(perm) == list(range(23 * k))
    # One segment per distinct slot, in slot order; every row of a segment has its slot.
    assert info.weight_indices_cpu == sorted(set(slots))
    for seg, slot in enumerate(info.weight_indices_cpu):
        assert all(info.token_slots.tolist()[r] == slot for r in info.rows(seg))
    # Tiles cover exactly the rows of LoRA work (no base-model, no rank-0 row), once each.
    expected = sorted(r for r, s in enumerate(info.token_slots.tolist()) if s >= 0 and ranks[s] > 0)
    assert _covered_rows(info) == expected
    table = info.tiles.tolist()
    for tile, (slot, rank, _, _) in enumerate(table):
        assert rank == ranks[slot] > 0
        rows = [r for r in info.tile_rows[tile].tolist() if r >= 0]
        assert 1 <= len(rows) <= info.tile_m
        assert {info.token_slots.tolist()[r] for r in rows} == {slot}  # a tile carries one adapter
    assert info.num_tiles <= max_tiles(info.total_tokens, len(info.weight_indices_cpu), info.tile_m)
    assert int(info.live_tiles.item()) == info.num_tiles  # an eager table holds live tiles only


def test_ungrouped_decode_segments():
    """Ungrouped decode keeps one segment per request."""
    info = build_batch_info(ForwardMode.DECODE, [1, 0, 1], [4, 4], [1.0, 2.0], group_by_slot=False)
    assert info.permutation is None
    assert info.weight_indices_cpu == [1, 0, 1]
    assert info.num_tiles == 3


def test_extend_segments_skip_empty():
    """Extend segments skip empty requests and size tiles."""
    lens = [5, 0, 40, 3]
    info = build_batch_info(ForwardMode.EXTEND, [0, 1, -1, 1], [8, 8], [1.0, 1.0], extend_lens=lens)
    assert info.permutation is None
    assert info.seg_indptr_cpu == [0, 5, 45, 48]  # the empty request has no segment
    assert info.weight_indices_cpu == [0, -1, 1]
    assert info.tile_m == default_tile_m(ForwardMode.EXTEND, 40) == 64
    assert _covered_rows(info) == [*range(5), *range(45, 48)]  # base-model rows get no tile


def test_tile_table_holds_scaling_and_rank():
    """Scaling and rank travel in the tile table."""
    info = build_batch_info(ForwardMode.DECODE, [1, 0], [4, 12], [0.5, 2.25])
    table = {row[0]: row for row in info.tiles.tolist()}
    assert table[1][1] == 12 and table[0][1] == 4
    bits = torch.tensor([table[1][2]], dtype=torch.int32).view(torch.float32).item()
    assert bits == 2.25
    assert info.scalings.tolist() == [0.5, 2.25]


def test_device_views_share_one_buffer():
    """Every metadata tensor is a view into one packed buffer: a single host-to-device copy."""
    info = build_batch_info(ForwardMode.TARGET_VERIFY, [0, 1, 0], [4, 4], [1.0, 1.0], num_draft_tokens=2)
    storages = {
        t.untyped_storage().data_ptr()
        for t in (info.seg_indptr, info.weight_indices, info.permutation, info.token_slots, info.lora_ranks,
                  info.scalings, info.tiles, info.tile_rows, info.live_tiles)
    }
    assert len(storages) == 1
    for t in (info.seg_indptr, info.permutation, info.tiles, info.tile_rows, info.scalings):
        assert t.data_ptr() % 16 == 0  # aligned sections: no alignment-dependent recompiles


def test_empty_and_all_base_batches_have_no_tiles():
    for slots, ranks in (([], [8]), ([-1, -1], [8]), ([0, 0], [0])):  # the last: a rank-0 slot
        info = build_batch_info(ForwardMode.DECODE, slots, ranks, [1.0])
        assert info.num_tiles == 0 and int(info.live_tiles.item()) == 0
