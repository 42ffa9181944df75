"""What the step-shape switch spends on measuring: exploration backs off when one shape leads
widely, new buckets start from their neighbours, hopeless shapes are not explored, and the
switch-over step is charged to no shape. A deterministic synthetic rate model drives it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loraserve.runtime.speculative.switch import SpeculationSwitch, StepShape

TREE, CHAIN, PLAIN = StepShape.TREE, StepShape.CHAIN, StepShape.PLAIN
ALL = (TREE, CHAIN, PLAIN)
Rates = Callable[[int, StepShape, int], float]  # (batch size, shape, step) -> tokens/s


def _jitter(step: int) -> float:
    """A fixed +-3% pattern: measurements are never quite equal."""
    return 1.0 + 0.03 * ((step * 7) % 5 - 2) / 2


def _drive(
    switch: SpeculationSwitch, bs: int, steps: int, rates: Rates, shapes: Sequence[StepShape] = ALL, start: int = 0
) -> list[StepShape]:
    chosen = []
    for step in range(start, start + steps):
        shape = switch.choose(bs, shapes)
        chosen.append(shape)
        tps = rates(bs, shape, step) * _jitter(step)
        switch.record(bs, shape, tokens=bs * 3, seconds=bs * 3 / tps)
    return chosen


def _fixed(table: dict[StepShape, float]) -> Rates:
    return lambda bs, shape, step: table[shape] * bs


def test_wide_lead_keeps_97_percent():
    """Once the best shape leads by more than 15%, it takes >= 97% of the steps."""
    switch = SpeculationSwitch()
    rates = _fixed({TREE: 300.0, CHAIN: 240.0, PLAIN: 100.0})  # chain 20% behind
    _drive(switch, 1, 6, rates)  # each shape measured once
    chosen = _drive(switch, 1, 2000, rates, start=6)
    assert chosen.count(TREE) / len(chosen) >= 0.97
    assert CHAIN in chosen and PLAIN in chosen  # still re-measured now and then


def test_close_shapes_keep_the_base_interval():
    """A shape within ``LEAD`` of the best is re-measured every ``explore_every`` steps."""
    switch = SpeculationSwitch(explore_every=20)
    rates = _fixed({TREE: 300.0, CHAIN: 296.0, PLAIN: 100.0})  # 1.3% apart: either may lead
    _drive(switch, 1, 6, rates)
    chosen = _drive(switch, 1, 400, rates, start=6)
    assert min(chosen.count(TREE), chosen.count(CHAIN)) >= 16  # the loser: >= 2 steps per 20 + 2
    assert chosen.count(PLAIN) <= 2 * 6  # plain backs off: 20, 40, 80, 160, 320


def test_faster_shape_found():
    """After a long stretch of one verdict, a shape that becomes the fastest takes over
    within ``max_explore_every`` plus one exploration round."""
    switch = SpeculationSwitch(explore_every=10, max_explore_every=80)
    before = {TREE: 100.0, CHAIN: 300.0, PLAIN: 120.0}
    _drive(switch, 4, 2000, _fixed(before))
    assert switch.verdict(4, ALL) is CHAIN
    after = {TREE: 600.0, CHAIN: 300.0, PLAIN: 120.0}
    chosen = _drive(switch, 4, 80 + 2 * 2 * len(ALL), _fixed(after), start=2000)
    assert switch.verdict(4, ALL) is TREE
    assert chosen[-1] is TREE


def test_a_slower_best_is_left_within_a_few_steps():
    """The best shape is measured on every step it runs: when it slows below another's
    rate, the verdict moves at once (no exploration needed)."""
    switch = SpeculationSwitch(explore_every=10, alpha=0.5)
    _drive(switch, 1, 500, _fixed({TREE: 300.0, CHAIN: 200.0, PLAIN: 100.0}))
    chosen = _drive(switch, 1, 10, _fixed({TREE: 90.0, CHAIN: 200.0, PLAIN: 100.0}), start=500)
    assert chosen[-1] is CHAIN


def test_new_bucket_between_measured_ones():
    """A bucket between two measured ones takes their verdict from its first step and
    explores each other shape at most once (one measured step after its switch-over)."""
    switch = SpeculationSwitch()
    rates = _fixed({TREE: 150.0, CHAIN: 200.0, PLAIN: 110.0})
    _drive(switch, 8, 400, rates)
    _drive(switch, 32, 400, rates, start=400)
    chosen = _drive(switch, 16, 300, rates, start=800)
    assert chosen[0] is CHAIN
    for shape in (TREE, PLAIN):
        assert chosen.count(shape) <= SpeculationSwitch.EXPLORE_STEPS
    assert switch.verdict(16, ALL) is CHAIN


def test_inherited_rates_take_the_bucket_scale():
    """Neighbours' rates are relative: the first own measurement sets the scale, so a
    bucket twice as large does not mistake its own shape for the fastest."""
    switch = SpeculationSwitch()
    _drive(switch, 8, 100, _fixed({TREE: 150.0, CHAIN: 200.0, PLAIN: 110.0}))
    _drive(switch, 16, 1, _fixed({TREE: 150.0, CHAIN: 200.0, PLAIN: 110.0}), start=100)
    rates = switch.rates(16)
    assert rates[CHAIN] == max(rates.values())
    assert abs(rates[TREE] / rates[CHAIN] - 0.75) < 0.05


def _serve(switch: SpeculationSwitch, bs: int, steps: int, rates: Rates, adapters: list[str]) -> list[StepShape]:
    chosen = []
    for step in range(steps):
        shape = switch.choose(bs, ALL, adapters=adapters)
        chosen.append(shape)
        switch.record(bs, shape, tokens=bs * 3, seconds=bs * 3 / (rates(bs, shape, step) * _jitter(step)))
    return chosen


def test_hopeless_shape_is_not_explored():
    """A shape that lost widely here and at both adjacent buckets is not explored again,
    until an adapter the bucket has not served restarts its exploration."""
    switch = SpeculationSwitch(explore_every=10)
    rates = _fixed({TREE: 300.0, CHAIN: 280.0, PLAIN: 100.0})
    for bs in (2, 8, 4):
        _serve(switch, bs, 50, rates, ["a"])
    chosen = _serve(switch, 4, 300, rates, ["a"])
    assert PLAIN not in chosen and CHAIN in chosen
    assert PLAIN in _serve(switch, 4, 30, rates, ["a", "b"])


def test_a_new_adapter_resets_the_back_off():
    switch = SpeculationSwitch(explore_every=10)
    rates = _fixed({TREE: 300.0, CHAIN: 200.0, PLAIN: 100.0})
    _serve(switch, 1, 600, rates, ["a"])
    assert _serve(switch, 1, 100, rates, ["a"]).count(CHAIN) <= 2  # backed off to 160 steps
    assert _serve(switch, 1, 100, rates, ["a", "b"]).count(CHAIN) >= 6  # at 10, 30, 70


def test_switch_over_step_is_charged_to_no_shape():
    """The first step after a change of shape is not measured, whatever bucket the previous
    step ran in."""
    switch = SpeculationSwitch()
    switch.record(1, CHAIN, tokens=1, seconds=1.0)  # the first step: a change from nothing
    assert switch.rates(1) == {}
    switch.record(1, CHAIN, tokens=10, seconds=1.0)
    switch.record(64, PLAIN, tokens=1000, seconds=1.0)  # changed shape: not charged
    assert switch.rates(64) == {}
    switch.record(1, PLAIN, tokens=5, seconds=1.0)  # same shape as the last step: charged
    assert switch.rates(1) == {CHAIN: 10.0, PLAIN: 5.0}


def test_alternating_buckets_still_measure():
    """Two buckets whose steps alternate, one of which cannot take a tree: every step follows
    a change of shape, yet each bucket measures all its shapes and settles (a bucket's step
    after its own step of the same shape is charged)."""
    switch = SpeculationSwitch(explore_every=10)
    rates = _fixed({TREE: 300.0, CHAIN: 200.0, PLAIN: 100.0})
    for step in range(200):
        bs, shapes = (30, ALL) if step % 2 else (40, (CHAIN, PLAIN))
        shape = switch.choose(bs, shapes)
        switch.record(bs, shape, tokens=bs * 3, seconds=bs * 3 / rates(bs, shape, step))
    assert switch.verdict(30, ALL) is TREE
    assert switch.verdict(40, [CHAIN, PLAIN]) is CHAIN
    assert set(switch.rates(30)) == set(ALL)
