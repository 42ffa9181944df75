"""``speculative.auto_disable``: the step shape (tree, chain, plain) per batch-size bucket,
from measured throughput."""

from __future__ import annotations

import pytest

from loraserve.runtime.speculative.switch import SpeculationSwitch, StepShape, batch_bucket

from .test_greedy_oracle import CASES, _check_same, _requests

TREE, CHAIN, PLAIN = StepShape.TREE, StepShape.CHAIN, StepShape.PLAIN


def _drive(switch: SpeculationSwitch, bs: int, steps: int, tps: dict, shapes=(CHAIN, PLAIN)) -> list[StepShape]:
    """Run ``steps`` decisions, feeding each step the throughput ``tps[shape]`` of the shape chosen."""
    chosen = []
    for _ in range(steps):
        shape = switch.choose(bs, list(shapes))
        chosen.append(shape)
        switch.record(bs, shape, tokens=bs * 2, seconds=bs * 2 / tps[shape])
    return chosen


def test_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]
    with pytest.raises(ValueError, match="batch_size"):
        batch_bucket(0)


def test_keeps_faster_and_explores():
    """Measures both kinds then keeps the faster and keeps exploring."""
    switch = SpeculationSwitch(explore_every=10)
    # drafting first (2 steps: the first after a change is not measured), then plain
    chosen = _drive(switch, 4, 4, {CHAIN: 100.0, PLAIN: 300.0})
    assert chosen == [CHAIN, CHAIN, PLAIN, PLAIN]
    assert switch.verdict(4, [CHAIN, PLAIN]) is PLAIN
    chosen = _drive(switch, 4, 40, {CHAIN: 100.0, PLAIN: 300.0})
    # 2 exploring steps at the 10th decision, then (a wide loss backs off) at the 30th
    assert [i for i, s in enumerate(chosen) if s is CHAIN] == [9, 10, 29, 30]
    assert switch.verdict(4, [CHAIN, PLAIN]) is PLAIN


def test_follows_a_change_in_which_kind_is_faster():
    switch = SpeculationSwitch(explore_every=5, alpha=0.5)
    _drive(switch, 1, 20, {CHAIN: 50.0, PLAIN: 100.0})
    assert switch.verdict(1, [CHAIN, PLAIN]) is PLAIN
    _drive(switch, 1, 40, {CHAIN: 400.0, PLAIN: 100.0})  # e.g. an adapter mix that accepts more
    assert switch.verdict(1, [CHAIN, PLAIN]) is CHAIN


def test_buckets_decide_independently():
    switch = SpeculationSwitch(explore_every=10)
    _drive(switch, 1, 12, {CHAIN: 300.0, PLAIN: 100.0})
    _drive(switch, 32, 12, {CHAIN: 100.0, PLAIN: 300.0})
    verdicts = [switch.verdict(bs, [CHAIN, PLAIN]) for bs in (1, 32, 30)]
    assert verdicts == [CHAIN, PLAIN, PLAIN]
    assert switch.verdict(8, [CHAIN, PLAIN]) is None  # never measured


def test_each_bucket_takes_fastest():
    """Tree at small batches, chain at middle ones, plain at large ones, as measured."""
    switch = SpeculationSwitch(explore_every=10)
    shapes = (TREE, CHAIN, PLAIN)
    first = _drive(switch, 1, 30, {TREE: 300.0, CHAIN: 250.0, PLAIN: 100.0}, shapes)
    _drive(switch, 8, 40, {TREE: 900.0, CHAIN: 1100.0, PLAIN: 800.0}, shapes)
    chosen = _drive(switch, 32, 60, {TREE: 1500.0, CHAIN: 2000.0, PLAIN: 2600.0}, shapes)
    assert [switch.verdict(bs, list(shapes)) for bs in (1, 8, 32)] == [TREE, CHAIN, PLAIN]
    # with nothing measured, each shape once (2 steps each), then mostly the fastest
    assert first[:6] == [TREE, TREE, CHAIN, CHAIN, PLAIN, PLAIN]
    # bucket 32 starts from bucket 8's verdict (chain), then finds plain and keeps it
    assert chosen[0] is CHAIN
    later = chosen[30:]
    assert later.count(PLAIN) >= 0.7 * len(later) and TREE in later and CHAIN in later


def test_treeless_batch_chooses_rest():
    """A batch that cannot take a tree chooses among the rest."""
    switch = SpeculationSwitch(explore_every=10)
    _drive(switch, 2, 30, {TREE: 900.0, CHAIN: 300.0, PLAIN: 100.0}, (TREE, CHAIN, PLAIN))
    assert switch.verdict(2, [TREE, CHAIN, PLAIN]) is TREE
    assert switch.choose(2, [CHAIN, PLAIN]) in (CHAIN, PLAIN)
    assert switch.verdict(2, [CHAIN, PLAIN]) is CHAIN


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="explore_every"):
        SpeculationSwitch(explore_every=2)
    with pytest.raises(ValueError, match="alpha"):
        SpeculationSwitch(alpha=0.0)
    with pytest.raises(ValueError, match="at least one shape"):
        SpeculationSwitch().choose(1, [])


@pytest.mark.parametrize("case", ["standalone-small", "eagle"])
def test_auto_disable_lossless(make_spec_config, engine_run, case):
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


def test_bucket_choice_lossless(make_spec_config, engine_run):
    """An EAGLE tree with the switch on: every bucket measures all three shapes, each of them
    runs, and the output is the plain decoder's, token for token; the metrics say which shape
    served at which batch size."""
    requests = _requests(count=12, seed=11, max_tokens=24)
    plain = engine_run(make_spec_config(), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    config = make_spec_config("EAGLE", "eagle", max_running_requests=5)
    spec = config.speculative
    spec.top_k, spec.num_steps, spec.num_draft_tokens, spec.auto_disable = 2, 3, 8, True
    run = engine_run(config, requests)
    _check_same(run, requests, expected)
    snap = run.engine.decoder.metrics.snapshot()
    assert {shape for shape, _ in snap.shape_steps} == {"tree", "chain", "plain"}
    assert sum(v for (shape, _), v in snap.shape_steps.items() if shape == "plain") == snap.undrafted_steps
