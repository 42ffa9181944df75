"""``min_p`` and ``min_tokens``, as vLLM defines them, served and lossless under speculation.

Oracles: a float64 reference written from vLLM's definition of min_p (after temperature,
before top-k / top-p, against the most likely token's probability); chi-square fits of the
sampler and of speculative decoding against ``processed_probs`` (the law rejection
sampling preserves); the unspeculated engine for greedy outputs; vLLM's stop rules for
min_tokens (a stop token ends the request from the min_tokens-th output on, a stop string
only if it ends in a later token's text); the real aiohttp app for the API.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import Sampler, SamplingParams, SamplingParamsError, processed_probs
from loraserve.runtime.sampling.params import StructuredOutput
from loraserve.runtime.sampling.processors import RowState, process_logits
from tests.runtime_server.conftest import Assets, make_config, running_server
from tests.spec.conftest import chi_square_pvalue, run_engine
from tests.spec.joint_law import reference_law, sampled_counts

from .conftest import engine_config
from .test_sampling import _reference_probs

ALPHA = 1e-4  # false-failure rate of each chi-square assertion for a random seed (seeds are fixed)

# --------------------------------------------------------------------------- the definition


def _min_p_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, float64: min_p on the temperature-scaled softmax, then top-k / top-p."""
    x = logits.double()
    if p.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    probs = torch.softmax(x / p.temperature, dim=-1)
    x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return _reference_probs(x, p.temperature, p.top_k, p.top_p)


def _rows() -> tuple[torch.Tensor, list[SamplingParams]]:
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    params = [
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.7, min_p=0.3, top_k=8),
        SamplingParams(temperature=1.3, min_p=0.05, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.2, top_k=5, top_p=0.7),
        SamplingParams(temperature=0.5, min_p=0.6, top_k=20),  # top-k wider than min_p's cut
        SamplingParams(temperature=1.0, min_p=1.0),  # ties at the threshold: the tied maxima stay
        SamplingParams(temperature=0.8, min_p=0.4),  # tied tokens: kept or removed together
        SamplingParams(temperature=1.0, min_p=0.0, top_k=6),  # min_p off beside rows that set it
        SamplingParams(temperature=0.0, min_p=0.5),  # greedy: min_p changes nothing
    ]
    logits = torch.randn(len(params), vocab, generator=gen) * 2
    logits[5, [3, 17, 29]] = logits[5].max() + 0.5  # three tokens tie for the top
    logits[6, [4, 9]] = float(logits[6, 11])  # ties below the top
    return logits, params


def test_processed_probs_follow_the_definition():
    logits, params = _rows()
    got = processed_probs(logits, params)
    for i, p in enumerate(params):
        ref = _min_p_reference(logits[i], p)
        if p.min_p and not p.greedy:
            # The float32 threshold decides like the float64 one: no token sits near it
            # except exact ties (equal logits).
            probs = torch.softmax(logits[i].double() / p.temperature, dim=-1)
            thr = p.min_p * probs.max()
            near = ((probs - thr).abs() < 1e-4 * thr) & (probs != thr)
            assert not near.any(), f"row {i}: a token sits on the threshold; pick another seed"
        assert torch.equal(got[i] == 0, ref == 0), f"row {i}: a different support"
        torch.testing.assert_close(got[i].double(), ref, atol=1e-6, rtol=1e-5)
    # min_p really filtered, and the tie row is uniform over its three maxima.
    assert (got[0] > 0).sum() < (processed_probs(logits[:1], [replace(params[0], min_p=0.0)])[0] > 0).sum()
    assert torch.equal(got[5].nonzero().flatten(), torch.tensor([3, 17, 29]))
    torch.testing.assert_close(got[5][[3, 17, 29]], torch.full((3,), 1 / 3))
    assert got[8].argmax() == logits[8].argmax() and got[8].max() == 1.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, min_p=0.15),
        SamplingParams(temperature=0.6, min_p=0.05, top_k=7),
        SamplingParams(temperature=1.2, min_p=0.1, top_p=0.85),
    ],
    ids=["min_p", "min_p+top_k", "min_p+top_p"],
)
def test_sampler_law_with_min_p(params):
    """The sampler draws from ``processed_probs``: nothing outside it, chi-square fit."""
    gen = torch.Generator().manual_seed(17)
    logits = torch.randn(24, generator=gen) * 1.5
    draws = 6000
    out = Sampler(seed=3).sample(logits.expand(draws, -1).contiguous(), [params] * draws, [None] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=24).double()
    law = processed_probs(logits[None], [params])[0].double()
    assert (law == 0).any(), "min_p removed nothing: the case tests nothing"
    assert counts[law == 0].sum() == 0
    assert chi_square_pvalue(counts[law > 0], law[law > 0]) > ALPHA


def test_min_tokens_mask_is_position_aware():
    """Stop and end-of-sequence ids are -inf exactly while fewer than min_tokens are out
    (ignore_eos too); a verify row j counts the drafts before it; other tokens untouched."""
    vocab = 30
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2)).expand(5, -1)
    params = SamplingParams(min_tokens=4, stop_token_ids=(7, 11), eos_token_ids=(2,), ignore_eos=True)
    base = RowState(params, [1, 5, 9], [3, 4])  # 2 outputs so far
    drafts = [6, 8, 10, 12]
    rows = [base.after(drafts[:j], None) for j in range(5)]
    out = process_logits(logits, rows)
    for j in range(5):
        masked = 2 + j < 4
        for t in (2, 7, 11):
            assert (out[j, t] == float("-inf")) == masked, (j, t)
        others = torch.ones(vocab, dtype=torch.bool)
        others[[2, 7, 11]] = False
        assert torch.equal(out[j, others], logits[j, others])
    # A complete structured-output constraint (only stopping allowed) keeps its stop tokens.
    only_stop = torch.zeros(vocab, dtype=torch.bool)
    only_stop[2] = True
    out = process_logits(logits[:1], [RowState(params, [1], [], only_stop)])
    assert out[0, 2] == logits[0, 2] and torch.isinf(out[0, torch.arange(vocab) != 2]).all()


def test_sampler_law_with_min_tokens():
    """Processed (min_tokens) logits sample from ``processed_probs`` with the stop ids at zero."""
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(1, 20, generator=gen) * 1.5
    top = logits[0].topk(2).indices.tolist()
    params = SamplingParams(
        temperature=1.0, min_p=0.1, min_tokens=3, stop_token_ids=(top[0],), eos_token_ids=(top[1],)
    )
    processed = process_logits(logits, [RowState(params, [1, 2], [4])])
    law = processed_probs(processed, [params])[0].double()
    assert law[top].sum() == 0 and processed_probs(logits, [params])[0][top].sum() > 0.2
    draws = 6000
    out = Sampler(seed=4).sample(processed.expand(draws, -1).contiguous(), [params] * draws, [None] * draws)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=20).double()
    assert counts[law == 0].sum() == 0
    assert chi_square_pvalue(counts[law > 0], law[law > 0]) > ALPHA


def test_validation_names_the_field():
    for bad, field in [
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2.0}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ]:
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**bad).validate()
        assert err.value.field == field, bad
    SamplingParams(min_p=1.0, min_tokens=8, max_tokens=8).validate()
    assert SamplingParams(min_tokens=1).processes_logits and not SamplingParams(min_p=0.5).processes_logits


def test_trees_return_once_min_tokens_are_out():
    """A greedy request verifies chains while its min_tokens mask can still apply (a tree
    node's processing would depend on its path), and trees again once min_tokens are out;
    any other processing keeps it on chains for good."""
    from types import SimpleNamespace

    from loraserve.runtime.engine.request import Request
    from loraserve.runtime.speculative.decoder import SpeculativeDecoder

    def fits(params: SamplingParams, out: int) -> bool:
        request = Request("r", [5, 6], params, output_ids=[7] * out)
        return SpeculativeDecoder._tree_fits(SimpleNamespace(tree_max_batch_size=0), [request])

    masked = SamplingParams(temperature=0.0, min_tokens=3)
    assert [fits(masked, n) for n in (0, 2, 3, 9)] == [False, False, True, True]
    biased = replace(masked, logit_bias=((4, 1.0),))
    assert not fits(biased, 9)
    assert fits(SamplingParams(temperature=0.0), 0)


# --------------------------------------------------------------------------- the engine

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: n-gram drafts match
EOS = 2  # the tiny model's


def _spec(cfg: RuntimeConfig, algorithm: str, draft_dir: Path) -> RuntimeConfig:
    """``cfg`` speculating with ``algorithm`` (3 steps, 4 draft tokens; STANDALONE: ``draft_dir``)."""
    cfg.speculative.algorithm = SpecAlgorithm(algorithm)
    cfg.speculative.num_steps = 3
    cfg.speculative.num_draft_tokens = 4
    if algorithm == "STANDALONE":
        cfg.speculative.draft_model_path = str(draft_dir)
    return cfg


def _greedy(forced: int = EOS, **kw) -> SamplingParams:
    # ``forced`` wins every position: without min_tokens a request that stops on it stops at once.
    return SamplingParams(max_tokens=12, temperature=0.0, logit_bias=((forced, 100.0),), **kw)


def test_greedy_min_tokens_spec_on_equals_off(engine_assets, tokenizer):
    requests = [
        ("eos-off", PROMPT, _greedy(), None),
        ("eos-5", PROMPT, _greedy(min_tokens=5), None),
        ("eos-5-adapter", PROMPT, _greedy(min_tokens=5), "third"),
        ("eos-max", [9, 8, 7], _greedy(min_tokens=12), None),
        ("stop-3", PROMPT, _greedy(44, min_tokens=3, stop_token_ids=(44,)), None),
        ("ignore-eos-4", PROMPT, _greedy(min_tokens=4, ignore_eos=True), None),
    ]
    plain = run_engine(engine_config(engine_assets), requests, tokenizer=tokenizer, timeout_s=120)
    got = {rid: (o.tokens, o.reason.value) for rid, o in plain.outputs.items()}
    assert got["eos-off"] == ([EOS], "stop")
    for rid, n in (("eos-5", 5), ("eos-5-adapter", 5)):
        tokens, reason = got[rid]
        assert reason == "stop" and len(tokens) == n + 1 and tokens[-1] == EOS and EOS not in tokens[:-1], rid
    assert got["eos-max"][1] == "length" and len(got["eos-max"][0]) == 12 and EOS not in got["eos-max"][0]
    tokens, reason = got["stop-3"]
    assert reason == "stop" and len(tokens) == 4 and tokens[-1] == 44 and 44 not in tokens[:-1]
    # ignore_eos: EOS is masked while min_tokens runs, then simply generated (it ends nothing).
    tokens, reason = got["ignore-eos-4"]
    assert reason == "length" and EOS not in tokens[:4] and tokens[4:] == [EOS] * 8
    for algorithm in ("NGRAM", "STANDALONE"):
        cfg = _spec(engine_config(engine_assets), algorithm, engine_assets.demo.draft_dir)
        run = run_engine(cfg, requests, tokenizer=tokenizer, timeout_s=120)
        for rid, *_ in requests:
            assert (run.outputs[rid].tokens, run.outputs[rid].reason.value) == got[rid], (algorithm, rid)
        assert run.engine.decoder.metrics.snapshot().overall.verify_steps > 0


def test_stop_strings_wait_for_min_tokens(engine_assets, tokenizer):
    """A stop string ends the request only if it ends in the text of a token after the
    min_tokens-th (vLLM's detokenizer rule); before that it is ordinary text."""
    unstopped = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    run = run_engine(engine_config(engine_assets), [("free", PROMPT, unstopped, None)], tokenizer=tokenizer)
    free = run.outputs["free"].tokens
    texts = [tokenizer.decode(free[:n]) for n in range(len(free) + 1)]
    # The last character of the first token's text and the first of the second's.
    stop = texts[2][len(texts[1]) - 1 : len(texts[1]) + 1]
    assert len(stop) == 2 and stop.strip() and texts[1].find(stop) == -1, texts

    def expected(min_tokens: int) -> int:
        """Tokens out when the request stops: the first n > min_tokens whose text completes
        the stop string in its own token's text (else all 12)."""
        for n in range(min_tokens + 1, len(free) + 1):
            if texts[n].find(stop, max(len(texts[n - 1]) - len(stop) + 1, 0)) != -1:
                return n
        return len(free)

    requests = [
        (
            f"m{m}",
            PROMPT,
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,), min_tokens=m),
            None,
        )
        for m in (0, 1, 2, 5)
    ]
    run = run_engine(engine_config(engine_assets), requests, tokenizer=tokenizer)
    for m in (0, 1, 2, 5):
        out = run.outputs[f"m{m}"]
        assert out.tokens == free[: expected(m)], (m, stop, texts)
    # min_tokens 1: the stop string starts inside the first token's text and still ends it.
    assert expected(0) == expected(1) == 2 < expected(2)


def test_a_complete_constraint_ends_before_min_tokens(engine_assets, tokenizer):
    """min_tokens never pushes a structured output past its grammar: once the constraint
    allows nothing but stopping, the stop token stays and ends the request (the JSON stays
    whole), with speculation or without."""
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    structured = StructuredOutput("json_schema", schema)
    params = SamplingParams(max_tokens=30, temperature=0.0, min_tokens=30, structured=structured)
    requests = [("json", [8, 9], params, None)]
    out = run_engine(engine_config(engine_assets), requests, tokenizer=tokenizer).outputs["json"]
    assert out.error is None and out.reason.value == "stop" and out.tokens[-1] == EOS, out
    assert len(out.tokens) < 30 and isinstance(json.loads(tokenizer.decode(out.tokens))["ok"], bool)
    spec = _spec(engine_config(engine_assets), "NGRAM", engine_assets.demo.draft_dir)
    assert run_engine(spec, requests, tokenizer=tokenizer).outputs["json"].tokens == out.tokens


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_sampled_law_under_speculation(engine_assets, tokenizer, algorithm):
    """Three sampled tokens with min_p and min_tokens = 2 (EOS biased to be likely, masked at
    positions 1-2, allowed at 3): their joint law under speculation is the target's. The
    STANDALONE draft (the target's own weights, unprocessed) proposes from the law without
    the EOS bias and mask: accepted at positions 1-2, corrected by the residual at 3."""
    params = SamplingParams(
        max_tokens=3, temperature=0.1, min_p=0.3, top_k=6, min_tokens=2, logit_bias=((EOS, 1.65),)
    )
    cfg = engine_config(engine_assets)
    reference = reference_law(ModelRunner(cfg), None, PROMPT, replace(params, eos_token_ids=(EOS,)))
    assert 0.05 < reference[:, :, EOS].sum() < 0.95, "EOS must be a real option at position 3"
    assert reference[:, EOS].sum() == 0 and reference[EOS].sum() == 0
    n = 500
    requests = [(f"s{i}", PROMPT, replace(params, seed=500 + i), None) for i in range(n)]
    spec = _spec(
        engine_config(engine_assets, max_running_requests=128), algorithm, engine_assets.demo.model_dir
    )
    run = run_engine(spec, requests, tokenizer=tokenizer, timeout_s=300)
    counts = sampled_counts(run, requests)
    snap = run.engine.decoder.metrics.snapshot().overall
    assert snap.verify_steps >= n and snap.accepted_tokens > 0
    support = reference > 0
    assert counts[~support].sum() == 0
    assert chi_square_pvalue(counts[support], reference[support]) > ALPHA


# --------------------------------------------------------------------------- the API


async def test_http_accepts_and_refuses(engine_assets, tmp_path):
    cfg = make_config(Assets(demo=engine_assets.demo, extra_adapters={}))
    async with running_server(cfg, tmp_path) as server:
        forced = {"temperature": 0, "logit_bias": {str(EOS): 100}, "max_tokens": 8}
        status, body = await server.post("/v1/completions", {"prompt": "hello", **forced})
        assert status == 200 and body["usage"]["completion_tokens"] == 1, body
        status, body = await server.post(
            "/v1/completions", {"prompt": "hello", **forced, "min_tokens": 5, "min_p": 0.1}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 6, body
        assert body["choices"][0]["finish_reason"] == "stop"
        status, body = await server.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], **forced, "min_tokens": 3, "min_p": 0.5},
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
        bad = [
            ("/v1/completions", {"min_p": 2}, "min_p"),
            ("/v1/completions", {"min_p": "high"}, "min_p"),
            ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
            ("/v1/completions", {"min_tokens": 1.5}, "min_tokens"),
            ("/v1/completions", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
            ("/v1/completions", {"min_tokens": 17}, "min_tokens"),  # completions' default max_tokens is 16
            ("/v1/chat/completions", {"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens"),
            ("/v1/chat/completions", {"min_p": -0.5}, "min_p"),
        ]
        for path, fields, param in bad:
            base = (
                {"prompt": "hello"}
                if path == "/v1/completions"
                else {"messages": [{"role": "user", "content": "x"}]}
            )
            status, body = await server.post(path, {**base, **fields})
            assert status == 400 and body["error"]["param"] == param, (fields, body)
