"""``bench/speculative``'s agreement report: the first token where two outputs differ, and the
split of identical outputs into base-model and adapter requests that the batch-shape floor
and each draft's run are read by."""

from __future__ import annotations

import pytest
import torch

from bench.speculative.identity import first_difference_gap, first_divergence, identity_by_kind
from bench.speculative.measure import Row
from bench.speculative.report import identity_table


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([5], [6]) == 0
    # One output stopping early differs where the shorter one ends.
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_identity_by_kind_splits_base_and_adapter_requests():
    adapters = [None, "ad0", "ad1", None, "ad0"]
    a = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    b = [[1, 2, 3], [1, 0, 3], [4, 5, 6], [7, 8, 0], [0, 1, 1]]
    got = identity_by_kind(adapters, a, b)
    assert got == {
        "adapter": {"identical": 1, "count": 3, "mean_first_divergence": 0.5, "max_gap": None},  # diffs at 1, 0
        "base": {"identical": 1, "count": 2, "mean_first_divergence": 2.0, "max_gap": None},
    }
    # gap(i, at) is asked for every differing request, by its index and first difference
    asked = []
    gapped = identity_by_kind(adapters, a, b, lambda i, at: asked.append((i, at)) or float(i))
    assert asked == [(1, 1), (3, 2), (4, 0)]
    assert gapped["adapter"]["max_gap"] == 4.0 and gapped["base"]["max_gap"] == 3.0
    same = identity_by_kind(adapters, a, a)
    assert all(v["identical"] == v["count"] and v["mean_first_divergence"] is None for v in same.values())
    with pytest.raises(ValueError):
        identity_by_kind(adapters, a, b[:-1])


def test_identity_table_reports_floor_and_drafts():
    identity = {"base": {"identical": 2, "count": 2, "mean_first_divergence": None},
                "adapter": {"identical": 5, "count": 8, "mean_first_divergence": 40.3}}  # fmt: skip
    row = Row(8, "eagle", 1.0, 2.0, 2.0, {}, 7, 10, identity)
    floor = {"base": {"identical": 1, "count": 2, "mean_first_divergence": 12.0},
             "adapter": {"identical": 6, "count": 8, "mean_first_divergence": 55.0}, "against": 1}  # fmt: skip
    lines = identity_table([row], {8: {"floor": floor}})
    assert (
        "| 8 | plain c=1 vs plain c=8 (floor) | 1/2 (first diff at 12.0) | 6/8 (first diff at 55.0) |"
        in lines
    )
    assert "| 8 | eagle vs plain | 2/2 | 5/8 (first diff at 40.3) |" in lines
    identity["adapter"]["max_gap"] = 0.125
    lines = identity_table([row], {8: {}})
    assert "| 8 | eagle vs plain | 2/2 | 5/8 (first diff at 40.3; gap ≤ 0.125) |" in lines


def test_first_difference_gap_is_the_targets_logit_difference(tmp_path):
    """On a real (tiny) runner: two continuations that share a prefix and then take the
    target's top-1 and top-2 tokens differ by exactly the logit gap the target gives them
    after that prefix; one output ending first has no gap."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.contract.config import RuntimeConfig
    from loraserve.runtime.dev.devmodels import build_tiny_model
    from loraserve.runtime.runner.forward_batch import ForwardBatch
    from loraserve.runtime.runner.model_runner import ModelRunner

    config = RuntimeConfig()
    config.model.path = str(build_tiny_model(tmp_path / "m", seed=3))
    config.device, config.model.dtype = "cpu", "float32"
    config.scheduler.max_total_tokens = 256
    runner = ModelRunner(config)
    prompt, shared = [5, 9, 17, 33], [40, 41]
    ids = torch.tensor(prompt + shared)
    logits = runner.forward(ForwardBatch(ForwardMode.EXTEND, ["r"], ids, extend_lens=[len(ids)])).logits[-1]
    runner.kv.free("r")
    top = logits.topk(2)
    first, second = (int(t) for t in top.indices)
    a, b = [*shared, first, 1], [*shared, second, 2]
    gap = first_difference_gap(runner, prompt, None, a, b, 2)
    assert gap == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5) and gap > 0
    assert first_difference_gap(runner, prompt, None, shared, [*shared, first], 2) is None
