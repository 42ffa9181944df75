"""Logit processing under speculation stays lossless, per adapter.

Penalties, ``logit_bias`` and structured-output masks change the target's distribution at
every position; a verify must apply to draft position ``j`` exactly what a plain step would
apply after emitting the drafts before it. Oracles:

- greedy: output with each speculative algorithm = output without speculation, token for
  token, in one mixed batch of adapters, the base and processed / unprocessed requests;
  the processed requests differ from their unprocessed twins (processing really ran);
- sampling: the joint law of three sampled tokens of a penalised, biased request under
  speculation matches the target's own processed law (chi-square), as in
  ``test_sampling_oracle``;
- structured output: every algorithm gives the unspeculated output, which parses.
"""

from __future__ import annotations

import json

import pytest
import torch

from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.sampling.params import StructuredOutput

from .joint_law import reference_law, sampled_counts

CASES = {
    "ngram": ("NGRAM", None),
    "standalone-same": ("STANDALONE", "same"),
    "standalone-small": ("STANDALONE", "small"),
    "eagle": ("EAGLE", "eagle"),
    "eagle3": ("EAGLE3", "eagle3"),
}
ADAPTERS = (None, "attn-r8", "all-r16", "emb-head")
PROCESSING = (
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.8, "presence_penalty": -0.3},
    {"repetition_penalty": 1.6},
    {"logit_bias": ((48, 6.0), (64, -100.0), (7, 3.5))},
    {"frequency_penalty": 2.0, "logit_bias": ((11, 4.0),)},
)


def _requests(processed: bool):
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(12):
        unit = torch.randint(3, 500, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)
        prompt = unit.repeat(8)[: int(torch.randint(6, 30, (1,), generator=gen))].tolist()
        extra = PROCESSING[i % len(PROCESSING)] if processed and i % 6 != 5 else {}
        params = SamplingParams(max_tokens=16, temperature=0.0, **extra)
        out.append((f"r{i}", prompt, params, ADAPTERS[i % len(ADAPTERS)]))
    return out


@pytest.fixture(scope="module")
def baseline(make_spec_config, engine_run):
    requests = _requests(processed=True)
    run = engine_run(make_spec_config(), requests)
    plain = engine_run(make_spec_config(), _requests(processed=False))
    expected = {rid: run.outputs[rid].tokens for rid, *_ in requests}
    changed = [rid for rid, _, params, _ in requests if params.processes_logits]
    differ = [rid for rid in changed if plain.outputs[rid].tokens != expected[rid]]
    # The oracle means nothing if processing were a no-op.
    assert len(differ) >= len(changed) - 1, (differ, changed)
    return requests, expected


@pytest.mark.parametrize("case", list(CASES))
def test_processed_greedy_output_is_identical(make_spec_config, engine_run, baseline, case):
    requests, expected = baseline
    algorithm, draft = CASES[case]
    run = engine_run(make_spec_config(algorithm, draft, max_running_requests=8), requests)
    for rid, _, params, adapter in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}, {params}) diverged under {case}"
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.overall.verify_steps > 0


def test_processed_requests_use_chains(make_spec_config, engine_run, baseline):
    """Tree verify falls back to chains for processed requests."""
    requests, expected = baseline
    config = make_spec_config("EAGLE", "eagle", max_running_requests=8)
    config.speculative.top_k = 2
    config.speculative.num_draft_tokens = 6
    run = engine_run(config, requests)
    for rid, *_ in requests:
        assert run.outputs[rid].tokens == expected[rid], rid


# --------------------------------------------------------------------------- sampling law

ALPHA = 1e-3
NUM_REQUESTS = 3000
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=3,
        temperature=1.0,
        top_k=6,
        seed=seed,
        presence_penalty=1.2,
        frequency_penalty=0.7,
        logit_bias=((7, 2.5), (5, -1.5)),
    )


@pytest.mark.slow
# A draft equal to the target proposes from the unprocessed law: both acceptance and the
# residual resampling run (an n-gram draft repeats tokens the penalties push away: rarely
# accepted, so it would test the residual path alone).
@pytest.mark.parametrize("algorithm,draft,adapter", [("STANDALONE", "same", "attn-r8")])
def test_processed_joint_law(
    make_spec_config, engine_run, chi_square, algorithm, draft, adapter
):
    """Joint law of processed sampled tokens matches the target."""
    config = make_spec_config(algorithm, draft, max_running_requests=64)
    requests = [(f"s{i}", PROMPT, _sampled(2000 + i), adapter) for i in range(NUM_REQUESTS)]
    run = engine_run(config, requests, timeout_s=600)
    counts = sampled_counts(run, requests)
    assert run.engine.decoder.metrics.snapshot().overall.accepted_tokens > 0
    reference = reference_law(ModelRunner(make_spec_config()), adapter, PROMPT, _sampled(0))
    support = reference > 0
    assert counts[~support].sum() == 0
    assert chi_square(counts[support], reference[support]) > ALPHA


# --------------------------------------------------------------------------- structured output

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer"}},
    "required": ["color", "n"],
}
STRUCTURED = (
    ("json", "def main():", StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ("regex", "import os", StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")),
    ("object", "class A:", StructuredOutput("json_object")),
)


def _run_structured(engine_run, config, requests, tokenizer) -> dict[str, tuple]:
    """Each request's (tokens, finish reason, error); prompts are text."""
    encoded = [(rid, tokenizer.encode(prompt), params, adapter) for rid, prompt, params, adapter in requests]
    run = engine_run(config, encoded, tokenizer=tokenizer, timeout_s=120.0)
    return {rid: (out.tokens, out.reason, out.error) for rid, out in run.outputs.items()}


@pytest.fixture(scope="module")
def tokenizer(spec_assets):
    from loraserve.runtime.tokenizer import Tokenizer

    return Tokenizer.load(spec_assets.target)


def _structured_requests():
    return [
        (
            f"{name}-{adapter}",
            prompt,
            SamplingParams(max_tokens=40, temperature=0.0, structured=spec),
            adapter,
        )
        for name, prompt, spec in STRUCTURED
        for adapter in (None, "all-r16")
    ]


@pytest.fixture(scope="module")
def structured_baseline(make_spec_config, engine_run, tokenizer):
    requests = _structured_requests()
    results = _run_structured(engine_run, make_spec_config(), requests, tokenizer)
    for rid, (tokens, reason, error) in results.items():
        assert error is None, (rid, error)
        text = tokenizer.decode(tokens)
        if rid.startswith("json") and reason.value == "stop":
            value = json.loads(text)
            assert value["color"] in SCHEMA["properties"]["color"]["enum"] and isinstance(value["n"], int)
        if rid.startswith("regex"):
            assert reason.value == "stop"
            head, _, tail = text.partition("-")
            assert len(head) == 3 and head.isdigit() and 2 <= len(tail) <= 4 and tail.isalpha(), text
        if rid.startswith("object") and reason.value == "stop":
            assert isinstance(json.loads(text), dict)
    return requests, results


@pytest.mark.parametrize("case", ["ngram", "standalone-same", "eagle3"])
def test_structured_output_identical(
    make_spec_config, engine_run, tokenizer, structured_baseline, case
):
    """Structured output is identical under speculation."""
    requests, expected = structured_baseline
    algorithm, draft = CASES[case]
    results = _run_structured(engine_run, make_spec_config(algorithm, draft), requests, tokenizer)
    for rid, *_ in requests:
        assert results[rid][0] == expected[rid][0], rid
