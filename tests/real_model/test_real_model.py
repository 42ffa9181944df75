"""The runtime on real weights: SmolLM2-135M-Instruct and two adapters trained on it with peft.

Greedy output of the runtime (a real server, the real engine) equals transformers + peft in
float32 for plain prompts, chat prompts (the model's own chat template) and each adapter, all
in one concurrent batch; and it is unchanged with NGRAM and STANDALONE speculation (the model
itself as draft), per adapter. The adapters learnt what they were trained on (a JSON answer,
pirate talk), so a batch that mixed them up would not match.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from loraserve.runtime.contract.capabilities import CAPABILITIES
from loraserve.runtime.contract.config import SpecAlgorithm

from .conftest import SERVED, real_config, real_server

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of Germany?"  # not in the training text
PLAIN_PROMPTS = [
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
]
REPEATING = "one two three four, one two three four, one two three four, one two"
MAX_TOKENS = 24


def _requests(adapters) -> list[tuple[str, str, object]]:
    """(model, kind, prompt): the base on plain and chat prompts, every adapter on chat."""
    out: list[tuple[str, str, object]] = [(SERVED, "prompt", p) for p in [*PLAIN_PROMPTS, REPEATING]]
    out.append((SERVED, "chat", QUESTION))
    for name in adapters:
        out.append((name, "chat", QUESTION))
        out.append((name, "prompt", REPEATING))
    return out


async def _one(server, model: str, kind: str, prompt) -> dict:
    if kind == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}]}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "prompt": prompt}
        path = "/v1/completions"
    body.update(max_tokens=MAX_TOKENS, temperature=0)
    status, out = await server.post(path, body)
    assert status == 200, out
    choice = out["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return {"text": text, "finish": choice["finish_reason"], "usage": out["usage"]}


async def _batch(server, requests) -> list[dict]:
    return await asyncio.gather(*(_one(server, m, k, p) for m, k, p in requests))


def _expected(reference, model: str, kind: str, prompt) -> dict:
    ids = reference.chat_ids(prompt) if kind == "chat" else reference.prompt_ids(prompt)
    out = reference.generate(None if model == SERVED else model, ids, MAX_TOKENS)
    eos = out and out[-1] == reference.tokenizer.eos_token_id
    return {
        "text": reference.text(out),
        "finish": "stop" if eos else "length",
        "prompt_tokens": len(ids),
        "completion_tokens": len(out),
    }


@pytest.fixture(scope="module")
def plain_answers(real_assets, reference, tmp_path_factory):
    """One server without speculation, every request in one concurrent batch."""
    requests = _requests(real_assets.adapters)

    async def run():
        async with real_server(real_config(real_assets), tmp_path_factory.mktemp("plain")) as server:
            return await _batch(server, requests)

    return requests, asyncio.run(run())


def test_real_model_matches_peft(plain_answers, reference):
    """Real model matches transformers and PEFT in one batch."""
    requests, got = plain_answers
    for (model, kind, prompt), answer in zip(requests, got, strict=True):
        want = _expected(reference, model, kind, prompt)
        where = f"{model} {kind} {prompt!r}"
        assert answer["text"] == want["text"], where
        assert answer["finish"] == want["finish"], where
        # The chat template round trip: the server rendered and tokenized the chat exactly as
        # transformers does, so both saw the same prompt ids.
        assert answer["usage"]["prompt_tokens"] == want["prompt_tokens"], where
        assert answer["usage"]["completion_tokens"] == want["completion_tokens"], where


def test_adapters_answer_in_own_styles(plain_answers):
    """Trained adapters answer in their own styles."""
    requests, got = plain_answers
    chat = {model: a["text"] for (model, kind, _), a in zip(requests, got, strict=True) if kind == "chat"}
    base = chat.pop(SERVED)
    assert "Berlin" in base, base  # a real model knows it
    assert not base.lstrip().startswith(("{", "Arr")), base
    parsed = json.loads(chat["json-answer"])
    assert set(parsed) == {"answer", "sure"}, parsed
    assert chat["pirate"].startswith("Arr, matey!"), chat["pirate"]
    assert len({base, *chat.values()}) == 1 + len(chat), "every adapter changes the answer"


def _spec_settings():
    out = []
    if CAPABILITIES.implements(SpecAlgorithm.NGRAM):
        out.append(("NGRAM", dict(algorithm=SpecAlgorithm.NGRAM, num_steps=3, num_draft_tokens=4)))
    if CAPABILITIES.implements(SpecAlgorithm.STANDALONE):
        out.append(("STANDALONE", dict(algorithm=SpecAlgorithm.STANDALONE, num_steps=3, num_draft_tokens=4)))
    return out


@pytest.mark.parametrize("name,spec", _spec_settings(), ids=[n for n, _ in _spec_settings()])
def test_speculation_lossless_real_weights(
    name, spec, real_assets, plain_answers, tmp_path
):
    """Speculation is lossless per adapter on real weights."""
    requests, plain = plain_answers
    if name == "STANDALONE":
        spec = {**spec, "draft_model_path": str(real_assets.model_dir)}  # the model itself as draft

    async def run():
        async with real_server(real_config(real_assets, **spec), tmp_path) as server:
            assert type(server.engine.decoder).__name__ == "SpeculativeDecoder"
            return await _batch(server, requests)

    got = asyncio.run(run())
    for (model, kind, prompt), a, b in zip(requests, got, plain, strict=True):
        assert (a["text"], a["finish"]) == (b["text"], b["finish"]), f"{name} {model} {kind} {prompt!r}"
    stats = {
        (model, kind, str(prompt)): a["usage"]["speculative"]
        for (model, kind, prompt), a in zip(requests, got, strict=True)
    }
    assert all(s["verify_steps"] >= 1 for s in stats.values())
    # A prompt that repeats itself lets drafts be accepted (an adapter may steer away from
    # the repetition, so only the base's is required to accept some).
    assert stats[(SERVED, "prompt", REPEATING)]["accepted_tokens"] > 0, stats
    if name == "STANDALONE":
        base = [s for (m, _, _), s in stats.items() if m == SERVED]
        # The draft is the base model: it proposes exactly what the base verifies.
        assert all(s["accepted_tokens"] == s["draft_tokens"] for s in base if s["draft_tokens"]), base
