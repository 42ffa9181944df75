"""The decoder's edges: draft state after verify, the context limit, failures, metrics, bad settings."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.engine.decoder import StandardDecoder
from loraserve.runtime.engine.request import Request
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import Sampler, SamplingParams
from loraserve.runtime.speculative import build_decoder
from loraserve.runtime.speculative.acceptance import Acceptance
from loraserve.runtime.speculative.draft_config import SpeculativeConfigError
from loraserve.runtime.speculative.eagle.drafter import EagleDrafter
from loraserve.runtime.speculative.eagle.graphs import EagleGraphRunner
from loraserve.runtime.speculative.metrics import SpecMetrics

from .conftest import eagle_runner, tiny_target


def _greedy_requests(count, seed, max_tokens=16, adapters=(None,)):
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            f"q{i}",
            torch.randint(3, 500, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist(),
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            adapters[i % len(adapters)],
        )
        for i in range(count)
    ]


@pytest.mark.parametrize(
    "graphs", [None, "ahead", "feed-then-propose"], ids=["eager", "static-propose-ahead", "static-feed-then-propose"]
)
@pytest.mark.parametrize("version", [1, 3])
def test_eagle_state_equals_replay(spec_assets, version, graphs):
    """After steps with every accept length, the draft's last output equals that of a
    drafter fed the same committed (feature, token) pairs in one go. With graphs the
    verified positions go in through the padded static path: with the next proposal in
    the same replay (``ahead``: the cache then also holds that proposal's entries past the
    committed ones), or as one uniform k-row forward, then truncated, and a chain."""
    arch, target = tiny_target(spec_assets)

    def make() -> EagleDrafter:
        path = spec_assets.eagle if version == 1 else spec_assets.eagle3
        runner = eagle_runner(path, arch, target, max_requests=4)
        return EagleDrafter(runner, Sampler(0), arch.vocab_size)

    drafter = make()
    if graphs:
        drafter.runner.graphs = EagleGraphRunner(drafter.runner, max_bs=2, use_graphs=False)
    if graphs == "feed-then-propose":
        drafter._can_propose_ahead = lambda requests, width: False
    width = drafter.runner.model.feature_size
    gen = torch.Generator().manual_seed(version)
    k = 4
    req = Request(
        rid="r",
        prompt_ids=torch.randint(3, 500, (9,), generator=gen).tolist(),
        params=SamplingParams(temperature=0.0),
    )
    req.prefill_target = len(req.prompt_ids)
    first = 17
    pairs_ids = [*req.prompt_ids[1:], first]
    pairs_feats = [torch.randn(len(req.prompt_ids), width, generator=gen)]

    class Out:  # the two fields of a ForwardOutput the drafter reads
        def __init__(self, feats):
            self.hidden_states = feats if version == 1 else None
            self.aux_hidden_states = feats if version == 3 else None

    drafter.on_extend([(req, len(req.prompt_ids))], Out(pairs_feats[0]), [first])
    req.output_ids.append(first)
    for accepted in (0, 3, 1, 2, 3, 0):
        proposal = drafter.propose([req], k - 1)
        assert proposal.tokens.shape == (1, k - 1)
        tokens = torch.randint(3, 500, (1, k), generator=gen)
        tokens[0, accepted + 1 :] = -1
        feats = torch.randn(k, width, generator=gen)
        drafter.on_verify([req], Acceptance(torch.tensor([accepted]), tokens), Out(feats))
        new = tokens[0, : accepted + 1].tolist()
        pairs_ids.extend(new)
        pairs_feats.append(feats[: accepted + 1])
        req.output_ids.extend(new)
        assert drafter._states["r"].committed == len(pairs_ids)
        ahead = k - 1 - 1 + k - (accepted + 1) if graphs == "ahead" else 0  # chain rows, rejected rows
        assert drafter.runner.kv.seq_len("r") == len(pairs_ids) + ahead

    fresh = make()
    out = fresh.runner.forward(["r"], torch.tensor(pairs_ids), torch.cat(pairs_feats), [len(pairs_ids)])
    torch.testing.assert_close(drafter._states["r"].tail, out[-1], rtol=1e-5, atol=1e-5)
    if graphs:  # the verified positions and the greedy proposals' chains took the static path
        static = drafter.runner.graphs
        assert {key.steps for key in static._chains} == {k - 2}  # the first proposal, after the prefill
        if graphs == "ahead":
            assert {(key.width, key.steps) for key in static._feed_chains} == {(k, k - 2)} and not static._graphs
        else:
            assert {(key.width, key.from_target) for key in static._graphs} == {(k, True)} and not static._feed_chains
    drafter.release(req)
    assert "r" not in drafter.runner.kv


def test_standalone_state_equals_catch_up(make_spec_config):
    """After steps with every accept length (all accepted included), the incremental
    draft proposes exactly what a draft that re-reads the committed tokens in one extend
    proposes, and each step costs one draft forward per draft token (none to cache the
    last draft)."""
    config = make_spec_config("STANDALONE", "small")
    runner = ModelRunner(config)
    drafter = build_decoder(config=config, runner=runner, sampler=Sampler(0)).drafter
    fresh = build_decoder(config=config, runner=runner, sampler=Sampler(0)).drafter
    calls = {"n": 0}
    forward = drafter.runner.forward

    def counted(batch):
        calls["n"] += 1
        return forward(batch)

    drafter.runner.forward = counted
    gen = torch.Generator().manual_seed(3)
    n = 3
    req = Request(
        rid="s",
        prompt_ids=torch.randint(3, 500, (11,), generator=gen).tolist(),
        params=SamplingParams(temperature=0.0),
    )
    req.prefill_target = req.num_tokens
    drafter.on_extend([(req, req.num_tokens)], None, [None])
    req.output_ids.append(42)
    for accepted in (0, n, n, 1, n, 2, 0, n):
        calls["n"] = 0
        proposal = drafter.propose([req], n)
        assert calls["n"] == n
        fresh.release(req)
        assert proposal.tokens.tolist() == fresh.propose([req], n).tokens.tolist()
        tokens = torch.full((1, n + 1), -1, dtype=torch.int64)
        tokens[0, :accepted] = proposal.tokens[0, :accepted]
        tokens[0, accepted] = int(torch.randint(3, 500, (1,), generator=gen))
        before = req.num_tokens
        drafter.on_verify([req], Acceptance(torch.tensor([accepted]), tokens), None)
        req.output_ids.extend(tokens[0, : accepted + 1].tolist())
        # Every committed token but the newest is cached; after a full accept the last draft is not.
        expected = before + accepted - (1 if accepted == n else 0)
        assert drafter.runner.kv.seq_len("s") == expected
    drafter.release(req)
    assert "s" not in drafter.runner.kv


def test_context_limit_skips_drafting(make_spec_config):
    """Requests at the context limit decode one token without drafting."""
    config = make_spec_config("STANDALONE", "same", context_length=32)
    runner = ModelRunner(config)
    decoder = build_decoder(config=config, runner=runner, sampler=Sampler(0))
    plain_runner = ModelRunner(make_spec_config(context_length=32))
    plain = StandardDecoder(plain_runner, Sampler(0))
    near = Request(
        rid="near", prompt_ids=list(range(10, 40)), params=SamplingParams(temperature=0.0)
    )  # 30 tokens
    far = Request(rid="far", prompt_ids=list(range(10, 20)), params=SamplingParams(temperature=0.0))
    for dec in (decoder, plain):
        reqs = [Request(rid=r.rid, prompt_ids=list(r.prompt_ids), params=r.params) for r in (near, far)]
        for r in reqs:
            r.prefill_target = r.num_tokens
        firsts = dec.extend([(r, r.num_tokens) for r in reqs])
        for r, out in zip(reqs, firsts, strict=True):
            r.output_ids.extend(out.token_ids)
            r.num_cached = r.num_tokens - 1
        outs = dec.step(reqs)
        if dec is decoder:
            spec_out = outs
        else:
            plain_out = outs
    assert len(spec_out[0].token_ids) == 1 and spec_out[0].num_draft_tokens == 0  # no room to verify 4
    assert spec_out[0].token_ids == plain_out[0].token_ids
    assert spec_out[1].num_draft_tokens == 3
    assert spec_out[1].token_ids[0] == plain_out[1].token_ids[0]


@pytest.mark.parametrize("case", [("STANDALONE", "small"), ("EAGLE", "eagle"), ("NGRAM", None)])
def test_a_failing_draft_step_loses_nothing(make_spec_config, engine_run, case):
    """A drafter that fails once: the engine retries request by request and outputs stay exact."""
    requests = _greedy_requests(6, seed=5, adapters=(None, "attn-r8", "emb-head"))
    base = engine_run(make_spec_config(), requests)
    failures = {"left": 1}

    def flaky(decoder):
        propose = decoder.drafter.propose

        def sometimes_failing(reqs, n):
            if len(reqs) > 1 and failures["left"] and decoder.metrics.snapshot().overall.verify_steps > 4:
                failures["left"] -= 1
                raise RuntimeError("injected draft failure")
            return propose(reqs, n)

        decoder.drafter.propose = sometimes_failing

    run = engine_run(make_spec_config(*case), requests, decoder_hook=flaky)
    assert failures["left"] == 0
    for rid, *_ in requests:
        assert run.outputs[rid].error is None
        assert run.outputs[rid].tokens == base.outputs[rid].tokens


def test_failed_draft_update_loses_nothing(make_spec_config, engine_run):
    """The drafter fails while taking in a step decoded without drafting (batch at
    disable_batch_size): the target's tokens stand, those drafts start over, outputs stay exact."""
    requests = _greedy_requests(6, seed=7, adapters=(None, "attn-r8", "emb-head"))
    base = engine_run(make_spec_config(), requests)
    failures = {"left": 1}

    def flaky(decoder):
        on_decode = decoder.drafter.on_decode

        def failing_once(reqs, tokens, output):
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("injected draft failure")
            return on_decode(reqs, tokens, output)

        decoder.drafter.on_decode = failing_once

    config = make_spec_config("EAGLE", "eagle", max_running_requests=4)
    config.speculative.disable_batch_size = 3
    run = engine_run(config, requests, decoder_hook=flaky)
    assert failures["left"] == 0
    for rid, *_ in requests:
        assert run.outputs[rid].error is None
        assert run.outputs[rid].tokens == base.outputs[rid].tokens
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.undrafted_steps > 1 and snap.overall.verify_steps > 0


def test_metrics_agree_with_stats(make_spec_config, engine_run):
    """Metrics agree with request stats and render."""
    from prometheus_client import CollectorRegistry, generate_latest

    requests = _greedy_requests(8, seed=6, adapters=(None, "attn-r8", "mlp-r4"))
    run = engine_run(make_spec_config("STANDALONE", "same"), requests)
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.overall.accepted_tokens == sum(run.outputs[r].spec.accepted_tokens for r, *_ in requests)
    assert snap.overall.verify_steps == sum(run.outputs[r].spec.verify_steps for r, *_ in requests)
    assert sum(snap.overall.histogram) == snap.overall.verify_steps
    for name in ("", "attn-r8", "mlp-r4"):
        mine = [r for r, *_, a in requests if (a or "") == name]
        assert snap.per_adapter[name].accepted_tokens == sum(
            run.outputs[r].spec.accepted_tokens for r in mine
        )
    assert snap.step_seconds.count == snap.verify_seconds.count > 0
    # by context length: every verify step in one bucket; prompts of 3-19 tokens and 16 new
    # tokens never reach 128
    assert list(snap.per_context) == ["0-127"]
    assert snap.per_context["0-127"].accepted_tokens == snap.overall.accepted_tokens

    registry = CollectorRegistry()
    registry.register(run.engine.decoder.metrics.collector())
    text = generate_latest(registry).decode()
    assert 'loraserve:spec_info{algorithm="STANDALONE",num_draft_tokens="4"} 1.0' in text
    accepted = snap.per_adapter["attn-r8"].accepted_tokens
    assert f'loraserve:spec_step_accepted_tokens_total{{adapter="attn-r8"}} {float(accepted)}' in text
    steps = float(snap.per_adapter["attn-r8"].verify_steps)
    assert f'loraserve:spec_step_accept_length_count{{adapter="attn-r8"}} {steps}' in text
    assert "loraserve:spec_verify_seconds_bucket" in text
    assert "loraserve:spec_undrafted_steps_total 0.0" in text  # disable_batch_size off: every step drafted

    # Next to the server's own registry (per-request counters): no name clashes.
    from loraserve.runtime.server.metrics import Metrics

    server = Metrics("base")
    server.registry.register(run.engine.decoder.metrics.collector())
    assert "loraserve:spec_verify_seconds_count" in server.render().decode()


def test_metrics_histogram_buckets_are_cumulative():
    metrics = SpecMetrics("NGRAM", 4)
    metrics.record_step(
        ["a", None, "a"], [0, 3, 2], 3, contexts=[10, 20, 30], verify_seconds=0.002, step_seconds=0.004
    )
    snap = metrics.snapshot()
    assert snap.per_adapter["a"].histogram == [1, 0, 1, 0]
    assert snap.per_adapter[""].histogram == [0, 0, 0, 1]
    assert snap.overall.mean_accept_len == pytest.approx(5 / 3)
    assert snap.verify_seconds.counts[0] == 0 and snap.verify_seconds.counts[1] == 1


def test_acceptance_is_counted_by_context_length():
    """Each request-step lands in the bucket of the tokens its request held before the step;
    the snapshot lists buckets shortest first, and the collector renders them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from loraserve.runtime.speculative.metrics import context_bucket

    assert [context_bucket(n) for n in (0, 127, 128, 255, 256, 40_000)] == [
        "0-127", "0-127", "128-255", "128-255", "256-511", "32768+",
    ]  # fmt: skip
    metrics = SpecMetrics("DFLASH", 7)
    metrics.record_step([None, "a"], [5, 1], 7, contexts=[300, 100], verify_seconds=0.002, step_seconds=0.003)
    metrics.record_step([None, "a"], [2, 0], 7, contexts=[306, 128], verify_seconds=0.002, step_seconds=0.003)
    snap = metrics.snapshot()
    assert list(snap.per_context) == ["0-127", "128-255", "256-511"]
    assert [(c.verify_steps, c.accepted_tokens) for c in snap.per_context.values()] == [(1, 1), (1, 0), (2, 7)]
    assert snap.per_context["256-511"].histogram == [0, 0, 1, 0, 0, 1, 0]
    registry = CollectorRegistry()
    registry.register(metrics.collector())
    text = generate_latest(registry).decode()
    assert 'loraserve:spec_context_verifies_total{context="256-511"} 2.0' in text
    assert 'loraserve:spec_context_accepted_tokens_total{context="0-127"} 1.0' in text
    with pytest.raises(ValueError, match="one adapter, context and accept length per request"):
        metrics.record_step([None, "a"], [1, 1], 7, contexts=[10], verify_seconds=0.0, step_seconds=0.0)
    assert metrics.snapshot().overall.verify_steps == 4  # the refused step counted nothing


def test_bucket_crossing_counted_in_both(make_spec_config, engine_run):
    """The decoder passes each request's length before the step: a 120-token prompt decoding
    24 tokens verifies in the 0-127 bucket first, then in 128-255, and every step is in one."""
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, 500, (120,), generator=gen).tolist()
    requests = [("long", prompt, SamplingParams(max_tokens=24, temperature=0.0), None)]
    run = engine_run(make_spec_config("STANDALONE", "same"), requests)
    snap = run.engine.decoder.metrics.snapshot()
    assert list(snap.per_context) == ["0-127", "128-255"]
    assert sum(c.verify_steps for c in snap.per_context.values()) == snap.overall.verify_steps


def test_draft_build_keeps_target_config(make_spec_config):
    """Target configuration is unchanged by building the draft."""
    config = make_spec_config("STANDALONE", "small")
    before = config.to_dict()
    runner = ModelRunner(config)
    decoder = build_decoder(config=config, runner=runner, sampler=Sampler(0))
    assert config.to_dict() == before
    assert decoder.drafter.runner.config.lora.enabled is False
    assert decoder.drafter.runner.config is not config
    assert runner.lora is not None and decoder.drafter.lora is None


@pytest.mark.parametrize(
    "algorithm,draft,change,field,message",
    [
        ("EAGLE", "eagle3", {}, "speculative.algorithm", "is an EAGLE3 draft"),
        ("EAGLE3", "eagle", {}, "speculative.algorithm", "is an EAGLE draft"),
        ("STANDALONE", "small", {"draft_load_format": "pt"}, "speculative.draft_load_format", "pickle"),
        ("NEXTN", None, {}, "speculative.draft_model_path", "draft_model_path"),
        ("EAGLE", "small", {}, "speculative.draft_model_path", "not an EAGLE draft"),
        ("STANDALONE", "small", {"adaptive": True}, "speculative.adaptive", "adaptive"),
    ],
)
def test_bad_draft_settings_name_the_field(make_spec_config, algorithm, draft, change, field, message):
    config = make_spec_config(algorithm, draft)
    for key, value in change.items():
        setattr(config.speculative, key, value)
    runner = ModelRunner(make_spec_config())
    with pytest.raises(SpeculativeConfigError, match=message) as err:
        build_decoder(config=config, runner=runner, sampler=Sampler(0))
    assert err.value.field == field


def test_standalone_other_tokenizer(spec_assets, make_spec_config, tmp_path):
    """Standalone draft with another tokenizer is refused."""
    from loraserve.runtime.dev.devmodels import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=600, hidden_size=32, num_layers=1, seed=9)
    config = make_spec_config("STANDALONE")
    config.speculative.draft_model_path = str(other)
    with pytest.raises(SpeculativeConfigError, match="different tokenizer") as err:
        build_decoder(config=config, runner=ModelRunner(make_spec_config()), sampler=Sampler(0))
    assert err.value.field == "speculative.draft_model_path"


@pytest.mark.parametrize("case", [("STANDALONE", "small"), ("EAGLE3", "eagle3")])
def test_dummy_draft_weights_still_lossless(make_spec_config, engine_run, case):
    requests = _greedy_requests(4, seed=8, adapters=(None, "all-r16"))
    base = engine_run(make_spec_config(), requests)
    config = make_spec_config(*case)
    config.speculative.draft_load_format = "dummy"
    run = engine_run(config, requests)
    assert run.engine.decoder.algorithm is SpecAlgorithm(case[0])
    for rid, *_ in requests:
        assert run.outputs[rid].tokens == base.outputs[rid].tokens


@pytest.mark.parametrize("case", [("STANDALONE", "same"), ("NGRAM", None)])
def test_logprobs_and_stops_match_plain(make_spec_config, engine_run, case):
    """Accepted drafts carry the target's log-probabilities, and a stop token inside an
    accepted run ends the request exactly where plain decoding ends it."""
    probe = _greedy_requests(4, seed=9, max_tokens=20, adapters=(None, "mlp-r4"))
    first = engine_run(make_spec_config(), probe)
    requests = []
    for rid, prompt, params, adapter in probe:
        stop = first.outputs[rid].tokens[12]  # a token the plain run emits mid-way
        params = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True, stop_token_ids=(stop,))
        requests.append((rid, prompt, params, adapter))
    base = engine_run(make_spec_config(), requests)
    run = engine_run(make_spec_config(*case), requests)
    for rid, *_ in requests:
        want, got = base.outputs[rid], run.outputs[rid]
        assert got.tokens == want.tokens and len(got.tokens) <= 13
        assert got.reason == want.reason
        assert len(got.logprobs) == len(got.tokens)
        torch.testing.assert_close(
            torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=1e-4, atol=1e-4
        )
