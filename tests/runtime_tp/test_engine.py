"""The serving engine over a 2-rank target: same tokens as one device, with and without speculation.

The draft runs on rank 0 only (it is small, has no adapters, and its proposals reach the
other ranks inside the target-verify step they must receive anyway). Greedy output with
speculation equals output without it, per adapter, on two ranks as on one.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams

from .conftest import run_engine, tp_config, tp_group

ADAPTERS = ("attn-r8", "all-r16", "mlp-r4-rs", "emb-head")


def _requests(count: int = 10, seed: int = 0, max_tokens: int = 14, temperature: float = 0.0):
    """Mixed adapters and the base model; every third prompt repeats a short unit (n-grams hit)."""
    gen = torch.Generator().manual_seed(seed)
    names = [None, *ADAPTERS]
    out = []
    for i in range(count):
        n = int(torch.randint(3, 30, (1,), generator=gen))
        if i % 3 == 0:
            unit = torch.randint(3, 500, (3,), generator=gen)
            prompt = unit.repeat(n // 3 + 1)[:n].tolist()
        else:
            prompt = torch.randint(3, 500, (n,), generator=gen).tolist()
        params = SamplingParams(max_tokens=max_tokens - i % 3, temperature=temperature, seed=100 + i)
        out.append((f"r{i}", prompt, params, names[i % len(names)]))
    return out


def _speculative(config, algorithm: str, draft=None):
    config = config.copy()
    config.speculative.algorithm = SpecAlgorithm(algorithm)
    config.speculative.num_steps = 3
    config.speculative.num_draft_tokens = 4
    config.speculative.draft_model_path = None if draft is None else str(draft)
    return config


@pytest.fixture(scope="module")
def adapters(tp_assets):
    return {n: tp_assets.adapters[n] for n in ADAPTERS}


@pytest.fixture(scope="module")
def group(tp_assets, adapters):
    config = tp_config(tp_assets.gqa, 2, adapters)
    with tp_group(config) as (handle, runner):
        yield config, runner, handle


@pytest.fixture(scope="module")
def baseline(tp_assets, adapters):
    """One device, plain decoding: the tokens every configuration below must reproduce."""
    config = tp_config(tp_assets.gqa, 1, adapters)
    requests = _requests()
    outputs, _ = run_engine(config, ModelRunner(config), requests)
    assert all(o.error is None for o in outputs.values())
    return requests, {rid: out.tokens for rid, out in outputs.items()}


def _check_same(outputs, requests, expected):
    for rid, _, params, adapter in requests:
        out = outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}) diverged on two ranks"
        assert len(out.tokens) == params.max_tokens


def test_plain_decoding_matches_one_device(group, baseline):
    config, runner, _ = group
    requests, expected = baseline
    outputs, _ = run_engine(config, runner, requests)
    _check_same(outputs, requests, expected)


@pytest.mark.parametrize(("algorithm", "draft"), [("NGRAM", None), ("STANDALONE", "draft"), ("EAGLE", "eagle")])
def test_greedy_spec_lossless_two_ranks(group, baseline, tp_assets, algorithm, draft):
    """Greedy speculation is lossless on two ranks."""
    config, runner, handle = group
    requests, expected = baseline
    spec_config = _speculative(config, algorithm, getattr(tp_assets, draft) if draft else None)
    outputs, engine = run_engine(spec_config, runner, requests)
    _check_same(outputs, requests, expected)
    assert engine.decoder.drafter.lora is None  # the draft never sees an adapter
    draft_runner = getattr(engine.decoder.drafter, "runner", None)
    if draft_runner is not None:
        assert getattr(draft_runner, "tp", None) is None  # whole, on rank 0 only
    for rid, *_ in requests:
        stats = outputs[rid].spec
        assert stats is not None and stats.verify_steps >= 1
    assert handle.health.failure is None


def test_sampled_speculation_matches_one_device(group, tp_assets, adapters):
    """Rejection sampling with per-request seeds draws the same tokens on two ranks as on one."""
    config, runner, _ = group
    requests = _requests(count=6, seed=5, temperature=0.8)
    two, _ = run_engine(_speculative(config, "STANDALONE", tp_assets.draft), runner, requests)
    single_config = tp_config(tp_assets.gqa, 1, adapters)
    one, _ = run_engine(_speculative(single_config, "STANDALONE", tp_assets.draft), ModelRunner(single_config), requests)
    for rid, *_ in requests:
        assert two[rid].error is None and one[rid].error is None
        assert two[rid].tokens == one[rid].tokens, rid
