"""Greedy speculation is lossless: output with speculation = output without, token for token.

Every algorithm runs through the real engine on the tiny target with four adapters
(attention, all-linear, MLP-only, embeddings + lm_head) and the base model mixed in one
batch, prompts of different lengths, and the running set capped at 1, 5 and 16.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.sampling import SamplingParams

CASES = {
    # id: (algorithm, draft)
    "ngram": ("NGRAM", None),
    "standalone-small": ("STANDALONE", "small"),
    "standalone-same": ("STANDALONE", "same"),
    "eagle": ("EAGLE", "eagle"),
    "eagle3": ("EAGLE3", "eagle3"),
    "eagle3-d2t": ("EAGLE3", "eagle3-d2t"),  # its own LM head over half the vocabulary
    "eagle-token-map": ("EAGLE", "eagle-token-map"),  # rows of the target's head (FR-Spec)
    "nextn": ("NEXTN", "eagle"),
}


ADAPTERS = ("attn-r8", "all-r16", "mlp-r4", "emb-head")


def _requests(count: int = 16, seed: int = 0, max_tokens: int = 18):
    """Mixed adapters + base, prompt lengths 3..40, some prompts repetitive (n-grams hit)."""
    gen = torch.Generator().manual_seed(seed)
    names = [None, *ADAPTERS]
    out = []
    for i in range(count):
        n = int(torch.randint(3, 41, (1,), generator=gen))
        if i % 3 == 0:
            unit = torch.randint(3, 500, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)
            prompt = unit.repeat(n // unit.numel() + 1)[:n].tolist()
        else:
            prompt = torch.randint(3, 500, (n,), generator=gen).tolist()
        params = SamplingParams(max_tokens=max_tokens - (i % 4), temperature=0.0)
        out.append((f"r{i}", prompt, params, names[i % len(names)]))
    return out


@pytest.fixture(scope="module")
def baseline(make_spec_config, engine_run, adapter_names):
    assert set(adapter_names) == set(ADAPTERS)
    requests = _requests()
    run = engine_run(make_spec_config(), requests)
    for rid, *_ in requests:
        assert run.outputs[rid].error is None
    return requests, {rid: run.outputs[rid].tokens for rid, *_ in requests}


def _check_same(run, requests, expected):
    for rid, _, params, adapter in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}) diverged"
        assert len(out.tokens) == params.max_tokens


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("max_running", [1, 5, 16])
def test_greedy_output_is_identical(make_spec_config, engine_run, baseline, case, max_running):
    requests, expected = baseline
    algorithm, draft = CASES[case]
    run = engine_run(make_spec_config(algorithm, draft, max_running_requests=max_running), requests)
    _check_same(run, requests, expected)
    snap = run.engine.decoder.metrics.snapshot()
    # Every request speculated, every adapter (and the base) shows up in the per-adapter stats.
    assert set(snap.per_adapter) == {"", *ADAPTERS}
    for rid, *_ in requests:
        stats = run.outputs[rid].spec
        assert stats is not None and stats.verify_steps >= 1
        assert stats.draft_tokens == 3 * stats.verify_steps
    if case == "standalone-same":
        assert snap.per_adapter[""].accept_rate > 0.9  # the draft is the base model itself


@pytest.mark.parametrize("k", [2, 3, 6])
@pytest.mark.parametrize("case", ["ngram", "standalone-same", "eagle3"])
def test_other_verify_widths(make_spec_config, engine_run, baseline, case, k):
    requests, expected = baseline
    algorithm, draft = CASES[case]
    run = engine_run(make_spec_config(algorithm, draft, k=k), requests)
    _check_same(run, requests, expected)
    for rid, *_ in requests:
        stats = run.outputs[rid].spec
        assert stats.draft_tokens == (k - 1) * stats.verify_steps
        assert all(0 <= a <= k - 1 for a in stats.accept_lens)


@pytest.mark.parametrize("case", ["standalone-small", "eagle", "eagle3"])
def test_chunked_prefill_feeds_draft(make_spec_config, engine_run, baseline, case):
    """Prompts longer than the chunk size: the draft mirrors the target's prefill chunks."""
    requests, expected = baseline
    algorithm, draft = CASES[case]
    run = engine_run(make_spec_config(algorithm, draft, chunked_prefill_size=7), requests)
    _check_same(run, requests, expected)


@pytest.mark.parametrize("case", ["standalone-same", "eagle", "ngram"])
def test_retraction_stays_lossless(make_spec_config, engine_run, case):
    """A KV budget too small for the whole batch forces retractions; outputs do not change."""
    requests = _requests(count=10, seed=3, max_tokens=30)
    base = engine_run(make_spec_config(max_total_tokens=260), requests)
    algorithm, draft = CASES[case]
    run = engine_run(make_spec_config(algorithm, draft, max_total_tokens=260), requests)
    _check_same(run, requests, {rid: base.outputs[rid].tokens for rid, *_ in requests})
    assert sum(req.num_retractions for req in run.requests.values()) > 0


@pytest.mark.parametrize("case", ["ngram", "standalone-same", "standalone-small", "eagle", "eagle3"])
def test_large_batches_skip_drafting(make_spec_config, engine_run, baseline, case):
    """``speculative.disable_batch_size`` 4 with 5 running: steps of 4-5 requests decode one
    token each without drafting, later steps (fewer requests left) speculate again. Output
    is unchanged, both kinds of step happen, and the drafter stays in sync across the switch:
    before every proposal an EAGLE draft holds exactly one (feature, next token) pair per
    committed position, and the STANDALONE draft that is the base model itself still
    accepts nearly every draft for base requests."""
    requests, expected = baseline
    algorithm, draft = CASES[case]
    config = make_spec_config(algorithm, draft, max_running_requests=5)
    config.speculative.disable_batch_size = 4
    out_of_sync: list[tuple[str, int, int]] = []
    proposals = []

    def spy(decoder):
        drafter = decoder.drafter
        propose = drafter.propose

        def checked(reqs, n):
            proposals.append(len(reqs))
            assert len(reqs) < 4, "a batch at disable_batch_size was drafted for"
            states = getattr(drafter, "_states", None)
            if states is not None:  # EAGLE: pairs for positions 0 .. num_tokens - 2
                for r in reqs:
                    held = states[r.rid].committed
                    if held != r.num_tokens - 1:
                        out_of_sync.append((r.rid, held, r.num_tokens - 1))
            return propose(reqs, n)

        drafter.propose = checked

    run = engine_run(config, requests, decoder_hook=spy)
    _check_same(run, requests, expected)
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.undrafted_steps > 0 and snap.undrafted_requests >= 4 * snap.undrafted_steps
    assert proposals and snap.overall.verify_steps > 0
    assert not out_of_sync, out_of_sync[:5]
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(run.engine.decoder.metrics.collector())
    text = generate_latest(registry).decode()
    assert f"loraserve:spec_undrafted_steps_total {float(snap.undrafted_steps)}" in text
    assert f"loraserve:spec_undrafted_request_steps_total {float(snap.undrafted_requests)}" in text
    if case == "standalone-same":
        assert snap.per_adapter[""].accept_rate > 0.9
