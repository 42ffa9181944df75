"""``bench/spec.py``'s agreement report: the first token where two outputs differ, and the
split of identical outputs into base-model and adapter requests that the batch-shape floor
and each draft's run are read by."""

from __future__ import annotations

import pytest


def test_first_divergence(bench):
    assert bench.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert bench.first_divergence([5], [6]) == 0
    # One output stopping early differs where the shorter one ends.
    assert bench.first_divergence([1, 2], [1, 2, 3]) == 2
    assert bench.first_divergence([1, 2, 3], [1, 2]) == 2


def test_identity_by_kind_splits_base_and_adapter_requests(bench):
    adapters = [None, "ad0", "ad1", None, "ad0"]
    a = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    b = [[1, 2, 3], [1, 0, 3], [4, 5, 6], [7, 8, 0], [0, 1, 1]]
    got = bench.identity_by_kind(adapters, a, b)
    assert got == {
        "adapter": {"identical": 1, "count": 3, "mean_first_divergence": 0.5},  # diffs at 1 and 0
        "base": {"identical": 1, "count": 2, "mean_first_divergence": 2.0},
    }
    same = bench.identity_by_kind(adapters, a, a)
    assert all(v["identical"] == v["count"] and v["mean_first_divergence"] is None for v in same.values())
    with pytest.raises(ValueError):
        bench.identity_by_kind(adapters, a, b[:-1])


def test_identity_table_reports_floor_and_drafts(bench):
    identity = {"base": {"identical": 2, "count": 2, "mean_first_divergence": None},
                "adapter": {"identical": 5, "count": 8, "mean_first_divergence": 40.3}}  # fmt: skip
    row = bench.Row(8, "eagle", 1.0, 2.0, 2.0, {}, 7, 10, identity)
    floor = {"base": {"identical": 1, "count": 2, "mean_first_divergence": 12.0},
             "adapter": {"identical": 6, "count": 8, "mean_first_divergence": 55.0}, "against": 1}  # fmt: skip
    lines = bench._identity_table([row], {8: {"floor": floor}})
    assert (
        "| 8 | plain c=1 vs plain c=8 (floor) | 1/2 (first diff at 12.0) | 6/8 (first diff at 55.0) |"
        in lines
    )
    assert "| 8 | eagle vs plain | 2/2 | 5/8 (first diff at 40.3) |" in lines
