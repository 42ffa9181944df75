"""The decoder's live metrics name adapters as clients do, never by an engine version key."""

from __future__ import annotations

from loraserve.runtime.contract.catalog import KEY_SEPARATOR
from loraserve.runtime.speculative.metrics import SpecMetrics


def test_per_adapter_stats_names():
    """Per adapter stats use public names and count shapes."""
    metrics = SpecMetrics("EAGLE", 4)
    key = f"sql{KEY_SEPARATOR}0123456789ab"
    metrics.record_step([key, None], [2, 1], 3, contexts=[10, 20], verify_seconds=0.01, step_seconds=0.02, shape="tree")
    metrics.record_undrafted(5)
    snap = metrics.snapshot()
    assert set(snap.per_adapter) == {"sql", ""}  # "" is the base model
    assert snap.per_adapter["sql"].accepted_tokens == 2
    assert snap.shape_steps == {("plain", 8): 1, ("tree", 2): 1}
