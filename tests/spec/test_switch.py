"""``speculative.auto_disable``: drafting per batch-size bucket, from measured throughput."""

from __future__ import annotations

import pytest

from loraserve.runtime.speculative.switch import SpeculationSwitch, batch_bucket

from .test_greedy_oracle import CASES, _check_same, _requests


def _drive(switch: SpeculationSwitch, bs: int, steps: int, draft_tps: float, plain_tps: float) -> list[bool]:
    """Run ``steps`` decisions, feeding each step the throughput of the kind chosen."""
    chosen = []
    for _ in range(steps):
        draft = switch.should_draft(bs)
        chosen.append(draft)
        tps = draft_tps if draft else plain_tps
        switch.record(bs, drafted=draft, tokens=bs * 2, seconds=bs * 2 / tps)
    return chosen


def test_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="batch_size"):
        batch_bucket(0)


def test_measures_both_kinds_then_keeps_the_faster_and_keeps_exploring():
    switch = SpeculationSwitch(explore_every=10)
    # drafting first (2 steps: the first after a change is not measured), then plain
    chosen = _drive(switch, 4, 4, draft_tps=100.0, plain_tps=300.0)
    assert chosen == [True, True, False, False]
    assert switch.drafting(4) is False
    chosen = _drive(switch, 4, 40, draft_tps=100.0, plain_tps=300.0)
    assert chosen.count(True) == 8  # 2 exploring steps per 10
    assert switch.drafting(4) is False


def test_follows_a_change_in_which_kind_is_faster():
    switch = SpeculationSwitch(explore_every=5, alpha=0.5)
    _drive(switch, 1, 20, draft_tps=50.0, plain_tps=100.0)
    assert switch.drafting(1) is False
    _drive(switch, 1, 40, draft_tps=400.0, plain_tps=100.0)  # e.g. an adapter mix that accepts more
    assert switch.drafting(1) is True


def test_buckets_decide_independently():
    switch = SpeculationSwitch(explore_every=10)
    _drive(switch, 1, 12, draft_tps=300.0, plain_tps=100.0)
    _drive(switch, 32, 12, draft_tps=100.0, plain_tps=300.0)
    assert (switch.drafting(1), switch.drafting(32), switch.drafting(30)) == (True, False, False)
    assert switch.drafting(8) is None  # never measured


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="explore_every"):
        SpeculationSwitch(explore_every=2)
    with pytest.raises(ValueError, match="alpha"):
        SpeculationSwitch(alpha=0.0)


@pytest.mark.parametrize("case", ["standalone-small", "eagle"])
def test_auto_disable_through_the_engine_is_lossless(make_spec_config, engine_run, case):
    """With the switch on, steps of both kinds happen (each bucket measures both) and the
    output is the plain decoder's, token for token."""
    requests = _requests(count=12, seed=9, max_tokens=24)
    plain = engine_run(make_spec_config(), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    algorithm, draft = CASES[case]
    config = make_spec_config(algorithm, draft, max_running_requests=5)
    config.speculative.auto_disable = True
    run = engine_run(config, requests)
    _check_same(run, requests, expected)
    decoder = run.engine.decoder
    snap = decoder.metrics.snapshot()
    assert decoder.switch is not None
    assert snap.undrafted_steps > 0 and snap.overall.verify_steps > 0
