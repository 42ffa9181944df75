"""Logit processing, structured-output masks, top logprobs and prompt logprobs.

Oracles: a float64 reference written from OpenAI's / vLLM's definitions for the
processing; a matcher walked one token at a time for the verify masks; a whole-prompt
forward of the real model for prompt logprobs gathered over chunked prefill.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.engine.engine import Engine
from loraserve.runtime.engine.errors import EngineError
from loraserve.runtime.engine.request import Request
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams, SamplingParamsError
from loraserve.runtime.sampling.params import StructuredOutput
from loraserve.runtime.sampling.processors import RowState, process_logits
from loraserve.runtime.sampling.structured import ConstraintCompiler
from loraserve.runtime.tokenizer import Tokenizer

# --------------------------------------------------------------------------- processing


def _reference(logits: torch.Tensor, state: RowState) -> torch.Tensor:
    """One row, float64, straight from the definitions."""
    p = state.params
    out = logits.double().clone()
    if state.allowed is not None:
        out[~state.allowed] = float("-inf")
    for token, bias in p.logit_bias:
        out[token] += bias
    seen = set(state.prompt_ids) | set(state.output_ids)
    for token in seen:
        if p.repetition_penalty != 1.0:
            out[token] = (
                out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
            )
    for token in set(state.output_ids):
        count = list(state.output_ids).count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_processing_matches_the_definitions():
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    states = []
    for i in range(12):
        params = SamplingParams(
            presence_penalty=[0.0, 1.5, -0.5][i % 3],
            frequency_penalty=[0.0, 0.7, 2.0, -1.0][i % 4],
            repetition_penalty=[1.0, 1.3, 0.8][i % 3],
            logit_bias=(((i * 7) % vocab, 5.0), (3, -100.0)) if i % 2 else (),
        )
        allowed = torch.rand(vocab, generator=gen) > 0.3 if i % 4 == 1 else None
        states.append(
            RowState(
                params,
                torch.randint(0, vocab, (6,), generator=gen).tolist(),
                torch.randint(0, vocab, (i,), generator=gen).tolist(),
                allowed,
            )
        )
    logits = torch.randn(len(states) + 1, vocab, generator=gen)
    out = process_logits(logits, [*states, None])
    for i, state in enumerate(states):
        assert torch.allclose(out[i].double(), _reference(logits[i], state), atol=1e-5), i
    assert torch.equal(out[-1], logits[-1])  # a row without processing is untouched


def test_validation_names_the_field():
    cases = {
        "presence_penalty": {"presence_penalty": 2.5},
        "frequency_penalty": {"frequency_penalty": float("nan")},
        "repetition_penalty": {"repetition_penalty": 0.0},
        "logit_bias": {"logit_bias": ((10**6, 1.0),)},
        "top_logprobs": {"top_logprobs": 3},  # without logprobs
        "prompt_logprobs": {"prompt_logprobs": 21},
    }
    for field, kwargs in cases.items():
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**kwargs).validate(vocab_size=1000)
        assert err.value.field == field, kwargs
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(logit_bias=((5, 101.0),)).validate(1000)
    assert "[-100, 100]" in str(err.value)


# --------------------------------------------------------------------------- engine on the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from loraserve.runtime.dev.devmodels import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("lp") / "m", num_layers=2, seed=5)


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return Tokenizer.load(tiny)


def _config(model, **sched) -> RuntimeConfig:
    config = RuntimeConfig()
    config.model.path = str(model)
    config.device = "cpu"
    config.scheduler.max_total_tokens = 4096
    config.scheduler.chunked_prefill_size = sched.get("chunk", 2048)
    config.lora.max_loras_per_batch = 1
    config.lora.max_loaded_loras = 1
    return config


def _run(config, tokenizer, requests):
    engine = Engine(config, ModelRunner(config), tokenizer=tokenizer)
    outs: dict[str, list] = {rid: [] for rid, *_ in requests}
    done = threading.Event()

    def sink_for(rid):
        def sink(out):
            outs[rid].append(out)
            if out.finished and all(o and o[-1].finished for o in outs.values()):
                done.set()

        return sink

    engine.start()
    try:
        for rid, prompt, params in requests:
            engine.submit(
                engine.prepare(Request(rid, list(prompt), params, sink=sink_for(rid))), prepared=True
            )
        assert done.wait(120)
    finally:
        engine.shutdown(drain_timeout_s=1.0)
    return outs


def test_logprobs_match_forward(tiny, tokenizer):
    """Prompt and top logprobs match a whole forward."""
    prompt = tokenizer.encode("def parse(text):\n    return [line.split() for line in text]")
    assert len(prompt) > 12
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3, prompt_logprobs=2)
    outs = _run(_config(tiny, chunk=5), tokenizer, [("p", prompt, params)])["p"]
    got = outs[0].prompt_logprobs
    assert got is not None and all(o.prompt_logprobs is None for o in outs[1:])  # first output only

    runner = ModelRunner(_config(tiny))
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        request_ids=["ref"],
        input_ids=torch.tensor(prompt),
        extend_lens=[len(prompt)],
        lora_names=[None],
        return_all_logits=True,
    )
    logp = torch.log_softmax(runner.forward(batch).logits.float(), dim=-1)
    assert got.logprobs[0] is None and got.top[0] == []
    assert len(got.logprobs) == len(prompt) == len(got.top)
    for i in range(1, len(prompt)):
        assert got.logprobs[i] == pytest.approx(logp[i - 1, prompt[i]].item(), abs=1e-4), i
        want = logp[i - 1].topk(2)
        assert [t for t, _ in got.top[i]] == want.indices.tolist(), i

    tokens = [t for o in outs for t in o.token_ids]
    tops = [t for o in outs for t in (o.top_logprobs or [])]
    chosen = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(tops) == len(tokens) == len(chosen) == 4
    for token, top, lp in zip(tokens, tops, chosen, strict=True):
        assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][0] == token and top[0][1] == pytest.approx(lp, abs=1e-5)  # greedy: the top-1


def test_bias_and_structured_one_batch(tiny, tokenizer):
    """Logit bias and structured output in one batch."""
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    forced = tokenizer.encode("x", add_special_tokens=False)[0]
    requests = [
        ("bias", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0, logit_bias=((forced, 100.0),))),
        (
            "json",
            [8, 9],
            SamplingParams(
                max_tokens=30, temperature=0.0, structured=StructuredOutput("json_schema", schema)
            ),
        ),
        ("plain", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0)),
    ]
    outs = _run(_config(tiny), tokenizer, requests)
    assert [t for o in outs["bias"] for t in o.token_ids] == [forced] * 5
    assert [t for o in outs["plain"] for t in o.token_ids] != [forced] * 5
    text = tokenizer.decode([t for o in outs["json"] for t in o.token_ids])
    assert outs["json"][-1].finish_reason.value == "stop" and isinstance(json.loads(text)["ok"], bool), text


def test_bad_schema_refused(tiny, tokenizer):
    """A bad schema is refused naming response format."""
    engine = Engine(_config(tiny), ModelRunner(_config(tiny)), tokenizer=tokenizer)
    bad = SamplingParams(
        max_tokens=3, structured=StructuredOutput("json_schema", '{"type": "object", "properties": 3}')
    )
    with pytest.raises(EngineError) as err:
        engine.prepare(Request("b", [5, 6], bad))
    assert err.value.error.param == "response_format" and err.value.error.status == 400
    assert "JSON schema" in err.value.error.message


def test_verify_masks_equal_a_token_by_token_walk(tokenizer):
    compiler = ConstraintCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
    spec = StructuredOutput("regex", r"(ab|cd)[0-9]{2,3}")
    drafts = tokenizer.encode("ab12", add_special_tokens=False)
    walker = compiler.constraint(spec)
    expected = [walker.allowed()]
    for token in drafts:
        assert walker.accept(token)
        expected.append(walker.allowed())
    constraint = compiler.constraint(spec)
    before = constraint.allowed()
    masks = constraint.verify_masks(drafts)
    assert torch.equal(masks, torch.stack(expected))
    assert torch.equal(constraint.allowed(), before)  # rolled back: nothing was committed
    # A draft the grammar refuses: its row stays the refusing row's mask, later rows copy it.
    refused = constraint.verify_masks(
        [drafts[0], tokenizer.encode("z", add_special_tokens=False)[0], drafts[1]]
    )
    assert torch.equal(refused[2], refused[1]) and torch.equal(refused[3], refused[1])


def test_no_xgrammar_gives_400(tiny, tokenizer, monkeypatch):
    """Without xgrammar a constraint is a 400 not a 500."""
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` now raises ImportError
    engine = Engine(_config(tiny), ModelRunner(_config(tiny)), tokenizer=tokenizer)
    with pytest.raises(EngineError) as err:
        engine.prepare(
            Request("x", [5, 6], SamplingParams(max_tokens=3, structured=StructuredOutput("json_object")))
        )
    assert err.value.error.status == 400 and err.value.error.param == "response_format"
    assert "xgrammar" in err.value.error.message
    engine.prepare(Request("y", [5, 6], SamplingParams(max_tokens=3)))  # everything else still served
