"""The OpenAI API features clients rely on beyond the common path, against the real server
(tiny model, real HTTP, the real engine) and the official ``openai`` client.

Oracles: the engine's own runner driven directly (raw log-softmax for log-probabilities and
their top alternatives; greedy decoding with the penalties and biases applied by hand, as
OpenAI and vLLM define them), self-consistency (a prompt token's reported log-probability
equals the one reported when that token was generated), streams equal whole answers, and
constrained output that parses. Shapes are asserted with OpenAI's field names.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
import torch
from openai import AsyncOpenAI, NotFoundError

from loraserve.kernels import ForwardMode
from loraserve.runtime.runner.forward_batch import ForwardBatch

pytestmark = pytest.mark.asyncio(loop_scope="module")

BASE = "tiny-base"
ADAPTER = "sql-r8"
PROMPT = "def fibonacci(n):\n"
GREEDY = {"temperature": 0, "ignore_eos": True}


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def _sse(server, path: str, body: dict) -> list[dict]:
    """A stream's JSON events (the final ``[DONE]`` dropped, after checking it is there)."""
    async with server.session.post(server.url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.text()
    events = [line[len("data: ") :] for line in raw.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def _complete(server, body: dict) -> dict:
    status, out = await server.post("/v1/completions", body)
    assert status == 200, out
    return out


def _processed(
    logits: torch.Tensor,
    prompt: list[int],
    generated: list[int],
    *,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
) -> torch.Tensor:
    """OpenAI's presence / frequency penalties (over the generated tokens), vLLM's
    repetition penalty (over prompt and generated tokens) and ``logit_bias``, by hand."""
    out = logits.float().clone()
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(prompt + generated)))
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / repetition, vals * repetition)
    counts = torch.zeros_like(out)
    for t in generated:
        counts[t] += 1
    out -= frequency * counts + presence * (counts > 0).float()
    for token, b in (bias or {}).items():
        out[token] += b
    return out


async def _reference(server, prompt_ids: list[int], adapter: str | None, n: int, **processing):
    """Greedy tokens from the engine's runner driven directly (no scheduler, no sampler),
    with the logit processing applied by hand; also each step's raw log-softmax."""
    runner = server.engine.runner
    rid = f"feat-ref-{len(prompt_ids)}-{n}-{id(processing)}"

    def run() -> tuple[list[int], list[torch.Tensor]]:
        tokens: list[int] = []
        raw: list[torch.Tensor] = []
        try:
            batch = ForwardBatch(
                ForwardMode.EXTEND,
                [rid],
                torch.tensor(prompt_ids),
                extend_lens=[len(prompt_ids)],
                lora_names=[adapter],
            )
            for _ in range(n):
                logits = runner.forward(batch).logits[0]
                raw.append(torch.log_softmax(logits.float(), -1))
                tok = int(_processed(logits, prompt_ids, tokens, **processing).argmax())
                tokens.append(tok)
                batch = ForwardBatch(ForwardMode.DECODE, [rid], torch.tensor([tok]), lora_names=[adapter])
            return tokens, raw
        finally:
            runner.kv.free(rid)

    return await asyncio.wrap_future(server.engine.call(run))


def _text_of(server, token_id: int) -> str:
    return server.state.tokenizer.decode([token_id])


# ----------------------------------------------------------------------------- models
async def test_client_retrieves_models(server):
    """Client retrieves each model as listed and 404s unknown ones."""
    status, listing = await server.get("/v1/models")
    assert status == 200
    by_id = {m["id"]: m for m in listing["data"]}
    async with _client(server) as client:
        for model_id in (BASE, ADAPTER, "chat-r16"):
            got = await client.models.retrieve(model_id)
            assert got.id == model_id and got.object == "model"
            status, raw = await server.get(f"/v1/models/{model_id}")
            assert status == 200 and raw == by_id[model_id]
        with pytest.raises(NotFoundError) as info:
            await client.models.retrieve("no-such-model")
    status, raw = await server.get("/v1/models/no-such-model")
    assert status == 404
    assert raw["error"]["code"] == "model_not_found" and raw["error"]["param"] == "model"
    assert set(raw["error"]) == {"message", "type", "param", "code"}
    assert "no-such-model" in raw["error"]["message"] and info.value.status_code == 404


async def test_slash_named_adapter_retrieved(server, assets):
    """An adapter named with a slash is retrieved."""
    name = "org/extra-q"
    status, body = await server.post(
        "/v1/load_lora_adapter",
        {"lora_name": name, "lora_path": str(assets.extra_adapters["extra-0"])},
        headers=server.admin_headers(),
    )
    assert status == 200, body
    try:
        async with _client(server) as client:
            got = await client.models.retrieve(name)
        assert got.id == name and got.parent == BASE
        status, raw = await server.get(f"/v1/models/{name}")
        assert status == 200 and raw["lora"]["state"] == "loaded"
    finally:
        await server.post("/v1/unload_lora_adapter", {"lora_name": name}, headers=server.admin_headers())


async def test_unloaded_catalogued_retrieved(assets, tmp_path):
    """A catalogued adapter not yet loaded is retrieved as listed."""
    from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog

    from .conftest import make_config, running_server

    catalog = tmp_path / "catalog.json"
    catalog.write_text(encode_catalog([CatalogEntry(ADAPTER, str(assets.demo.adapters[ADAPTER]))]))
    config = make_config(assets, adapters={})
    config.lora.catalog = str(catalog)
    async with running_server(config, tmp_path) as srv:
        for headers in ({}, srv.admin_headers()):  # the admin token also sees lora.source
            status, listing = await srv.get("/v1/models", headers=headers)
            assert status == 200
            status, got = await srv.get(f"/v1/models/{ADAPTER}", headers=headers)
            assert status == 200
            assert got == next(m for m in listing["data"] if m["id"] == ADAPTER)
            assert got["lora"]["state"] == "registered" and ("source" in got["lora"]) == bool(headers)
        assert srv.engine.adapter_names == frozenset(), "retrieving a model does not load it"


# ----------------------------------------------------------------------------- logprobs
def _check_completion_logprobs_shape(lp: dict, n_tokens: int, alternatives: int) -> None:
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == n_tokens
    for i, (token, logprob, top) in enumerate(
        zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
    ):
        if logprob is None:
            assert top is None
            continue
        # OpenAI: the most likely `alternatives` tokens, and always the chosen one.
        # (Fewer when alternatives share a text, e.g. partial UTF-8 bytes shown as U+FFFD.)
        assert 1 <= len(top) <= alternatives + 1, (i, top)
        assert top[token] == pytest.approx(logprob)
        assert all(v <= 0 for v in top.values())
    for i in range(1, n_tokens):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])


async def test_completion_top_logprobs(server):
    """Completion logprobs report the top alternatives of the raw distribution."""
    n, k = 6, 3
    body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": n, "logprobs": k, **GREEDY}
    out = await _complete(server, body)
    lp = out["choices"][0]["logprobs"]
    _check_completion_logprobs_shape(lp, n, k)
    assert lp["text_offset"][0] == 0 and "".join(lp["tokens"]) == out["choices"][0]["text"]
    ids, raw = await _reference(server, server.state.tokenizer.encode(PROMPT), ADAPTER, n)
    for i in range(n):
        assert lp["tokens"][i] == _text_of(server, ids[i])
        assert lp["token_logprobs"][i] == pytest.approx(float(raw[i][ids[i]]), abs=1e-4)
        values, top_ids = raw[i].topk(k)
        expected = {_text_of(server, int(t)): float(v) for t, v in zip(top_ids, values, strict=True)}
        assert lp["top_logprobs"][i] == pytest.approx(expected, abs=1e-4)


async def test_logprobs_zero_chosen_only(server):
    """Logprobs zero reports the chosen token only."""
    out = await _complete(server, {"prompt": PROMPT, "max_tokens": 4, "logprobs": 0, **GREEDY})
    lp = out["choices"][0]["logprobs"]
    _check_completion_logprobs_shape(lp, 4, 0)
    assert [list(t) for t in lp["top_logprobs"]] == [[tok] for tok in lp["tokens"]]


async def test_streamed_logprobs_equal_whole(server):
    """Streamed completion logprobs equal the whole ones with offsets per choice."""
    body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": 10, "logprobs": 2, **GREEDY}
    whole = (await _complete(server, body))["choices"][0]["logprobs"]
    events = await _sse(server, "/v1/completions", body)
    tokens, logprobs, tops, sent = [], [], [], 0
    for e in events:
        (c,) = e["choices"]
        lp = c["logprobs"]
        if lp is not None:
            # vLLM: a chunk's offsets continue from the text the choice already streamed.
            assert lp["text_offset"][0] == sent
            _check_completion_logprobs_shape(lp, len(lp["tokens"]), 2)
            tokens += lp["tokens"]
            logprobs += lp["token_logprobs"]
            tops += lp["top_logprobs"]
        sent += len(c["text"])
    assert tokens == whole["tokens"]
    assert logprobs == pytest.approx(whole["token_logprobs"], abs=1e-4)
    assert [list(t) for t in tops] == [list(t) for t in whole["top_logprobs"]]
    for got, expected in zip(tops, whole["top_logprobs"], strict=True):
        assert got == pytest.approx(expected, abs=1e-4)


async def test_echo_logprobs_prompt_first(server):
    """Echo with logprobs reports the prompt tokens first."""
    tok = server.state.tokenizer
    prompt_ids = tok.encode(PROMPT)
    k = 2
    gen = await _complete(
        server, {"model": ADAPTER, "prompt": prompt_ids, "max_tokens": 4, "logprobs": k, **GREEDY}
    )
    gen_lp = gen["choices"][0]["logprobs"]
    gen_ids, _ = await _reference(server, prompt_ids, ADAPTER, 4)
    # Echo the prompt and 3 generated tokens: those 3 prompt positions were scored when
    # they were generated, so they must report the same log-probabilities and alternatives.
    echo_prompt = prompt_ids + gen_ids[:3]
    body = {"model": ADAPTER, "prompt": echo_prompt, "max_tokens": 1, "logprobs": k, "echo": True, **GREEDY}
    out = await _complete(server, body)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(tok.decode(echo_prompt))
    _check_completion_logprobs_shape(lp, len(echo_prompt) + 1, k)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][: len(echo_prompt)] == [_text_of(server, t) for t in echo_prompt]
    # Offsets index the returned text: the BOS token takes no room in it.
    assert lp["tokens"][0] == "" and lp["text_offset"][:2] == [0, 0]
    for i in range(len(echo_prompt)):  # (an ASCII prompt: each token's text is a piece of it)
        assert choice["text"][lp["text_offset"][i] :].startswith(lp["tokens"][i])
    p = len(prompt_ids)
    assert lp["token_logprobs"][p : p + 4] == pytest.approx(gen_lp["token_logprobs"][:4], abs=1e-4)
    for i in range(4):
        assert lp["top_logprobs"][p + i] == pytest.approx(gen_lp["top_logprobs"][i], abs=1e-4)
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])

    events = await _sse(server, "/v1/completions", body)
    first = events[0]["choices"][0]
    assert first["text"].startswith(tok.decode(echo_prompt))
    streamed = [
        t for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]
    ]
    assert streamed == lp["tokens"]


def _assert_same_chat_logprobs(got: list[dict], expected: list[dict]) -> None:
    """Equal tokens and bytes; log-probabilities equal up to float noise (another batch
    shape sums in another order)."""

    def split(items: list[dict]) -> tuple[list, list[float]]:
        keys = [
            (i["token"], i["bytes"], [(t["token"], t["bytes"]) for t in i["top_logprobs"]]) for i in items
        ]
        values = [v for i in items for v in [i["logprob"], *(t["logprob"] for t in i["top_logprobs"])]]
        return keys, values

    got_keys, got_values = split(got)
    keys, values = split(expected)
    assert got_keys == keys
    assert got_values == pytest.approx(values, abs=1e-4)


async def test_chat_top_logprobs_shape(server):
    """Chat top logprobs in OpenAI shape streamed and not."""
    k = 4
    body = {
        "model": ADAPTER,
        "messages": [{"role": "user", "content": "Name a color."}],
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": k,
        **GREEDY,
    }
    status, whole = await server.post("/v1/chat/completions", body)
    assert status == 200, whole
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode("utf-8"))
        top = item["top_logprobs"]
        assert len(top) == k and all(set(t) == {"token", "logprob", "bytes"} for t in top)
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert top[0]["token"] == item["token"] and top[0]["logprob"] == pytest.approx(item["logprob"])
    events = await _sse(server, "/v1/chat/completions", body)
    streamed = [x for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]]
    _assert_same_chat_logprobs(streamed, content)

    async with _client(server) as client:
        out = await client.chat.completions.create(
            model=ADAPTER,
            messages=body["messages"],
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=k,
            extra_body={"ignore_eos": True},
        )
    parsed = out.choices[0].logprobs.content
    assert [(c.token, len(c.top_logprobs)) for c in parsed] == [(c["token"], k) for c in content]


async def test_client_reads_completion_top_logprobs(server):
    async with _client(server) as client:
        out = await client.completions.create(
            model=BASE,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            logprobs=5,
            extra_body={"ignore_eos": True},
        )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 3
    assert all(5 <= len(top) <= 6 for top in lp.top_logprobs)


# ----------------------------------------------------------------------------- unknown fields, model
async def test_unknown_fields_ignored(
    server, caplog
):
    """Unknown fields are ignored and logged once and a request without model uses the base."""
    body = {"prompt": PROMPT, "max_tokens": 5, **GREEDY}
    with caplog.at_level(logging.WARNING, logger="loraserve.server"):
        out = await _complete(server, {**body, "frobnicate": 1, "zzz_extra": [1], "user": "alice"})
    ignored = [r for r in caplog.records if "present in the request but ignored" in r.getMessage()]
    assert len(ignored) == 1
    message = ignored[0].getMessage()
    assert "frobnicate" in message and "zzz_extra" in message and "user" not in message
    assert out["model"] == BASE
    with_model = await _complete(server, {**body, "model": BASE})
    assert out["choices"][0]["text"] == with_model["choices"][0]["text"]


# ----------------------------------------------------------------------------- logit processing
async def test_logit_bias_steers_greedy(server):
    """Logit bias steers greedy decoding and leaves batch neighbours alone."""
    tok = server.state.tokenizer
    prompt_ids = tok.encode(PROMPT)
    plain_ids, _ = await _reference(server, prompt_ids, None, 6)
    forced = next(t for t in range(3, 500) if t not in plain_ids)
    banned = plain_ids[0]
    bodies = [
        {"prompt": prompt_ids, "max_tokens": 6, "logprobs": 0, **GREEDY, "logit_bias": {str(forced): 100}},
        {"prompt": prompt_ids, "max_tokens": 6, "logprobs": 0, **GREEDY, "logit_bias": {str(banned): -100}},
        {"prompt": prompt_ids, "max_tokens": 6, "logprobs": 0, **GREEDY},
    ]
    alone = [await _complete(server, b) for b in bodies]
    together = await asyncio.gather(*[_complete(server, b) for b in bodies])
    for a, t in zip(alone, together, strict=True):
        assert a["choices"][0]["text"] == t["choices"][0]["text"]
    assert alone[0]["choices"][0]["logprobs"]["tokens"] == [_text_of(server, forced)] * 6
    banned_ids, _ = await _reference(server, prompt_ids, None, 6, bias={banned: -100.0})
    assert alone[1]["choices"][0]["text"] == tok.decode(banned_ids)
    assert banned_ids[0] != banned
    assert alone[2]["choices"][0]["text"] == tok.decode(plain_ids)
    # Log-probabilities stay those of the model's raw distribution (vLLM's default).
    assert alone[0]["choices"][0]["logprobs"]["token_logprobs"][0] < 0


@pytest.mark.parametrize(
    "processing",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1.8},
        {"presence_penalty": -0.5, "frequency_penalty": 0.7, "logit_bias": {"40": 3.5}},
    ],
)
async def test_penalties_match_definition(server, processing):
    """Penalties equal their definition on the raw model."""
    tok = server.state.tokenizer
    prompt_ids = tok.encode("x = x + 1\ny = y + 1\nx = x + 1\n")
    n = 24
    plain_ids, _ = await _reference(server, prompt_ids, ADAPTER, n)
    assert len(set(plain_ids)) < n, "the model repeats itself (the penalties have something to change)"
    kwargs = {
        "presence": processing.get("presence_penalty", 0.0),
        "frequency": processing.get("frequency_penalty", 0.0),
        "repetition": processing.get("repetition_penalty", 1.0),
        "bias": {int(k): float(v) for k, v in processing.get("logit_bias", {}).items()},
    }
    expected, _ = await _reference(server, prompt_ids, ADAPTER, n, **kwargs)
    assert expected != plain_ids, "the processing changes the greedy output"
    out = await _complete(
        server, {"model": ADAPTER, "prompt": prompt_ids, "max_tokens": n, **GREEDY, **processing}
    )
    assert out["choices"][0]["text"] == tok.decode(expected)


# ----------------------------------------------------------------------------- structured output
async def test_guided_choice_and_regex(server):
    """Guided choice and regex constrain the output."""
    choices = ["yes", "no", "maybe (not sure)"]
    for model in (BASE, ADAPTER):
        out = await _complete(
            server,
            {"model": model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "guided_choice": choices},
        )
        assert out["choices"][0]["text"] in choices and out["choices"][0]["finish_reason"] == "stop"
    out = await _complete(
        server,
        {
            "prompt": PROMPT,
            "max_tokens": 20,
            "temperature": 0.8,
            "seed": 5,
            "guided_regex": "[0-9]{3}-[a-c]+",
        },
    )
    text = out["choices"][0]["text"]
    assert re.fullmatch("[0-9]{3}-[a-c]+", text) or (
        out["choices"][0]["finish_reason"] == "length" and re.fullmatch("[0-9]{0,3}(-[a-c]*)?", text)
    ), text


SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}


async def test_json_schema_output_matches(server):
    """JSON schema output parses and matches the schema."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True},
    }
    status, out = await server.post(
        "/v1/chat/completions",
        {
            "model": ADAPTER,
            "messages": [{"role": "user", "content": "Pick a color."}],
            "max_tokens": 200,
            "temperature": 0,
            "response_format": response_format,
        },
    )
    assert status == 200, out
    value = json.loads(out["choices"][0]["message"]["content"])
    assert set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue")
    assert isinstance(value["ok"], bool)
    assert out["choices"][0]["finish_reason"] == "stop"
    async with _client(server) as client:
        streamed = await client.chat.completions.create(
            model=ADAPTER,
            messages=[{"role": "user", "content": "Pick a color."}],
            max_tokens=200,
            temperature=0,
            response_format=response_format,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
    assert text == out["choices"][0]["message"]["content"]


async def test_client_parses_into_pydantic(server):
    """Client parses structured output into a pydantic model."""
    from typing import Literal

    from pydantic import BaseModel

    class Pick(BaseModel):
        color: Literal["red", "green", "blue"]
        ok: bool  # (not an int: a random model may write digits until max_tokens)

    async with _client(server) as client:
        out = await client.chat.completions.parse(
            model="chat-r16",
            messages=[{"role": "user", "content": "Pick a color."}],
            response_format=Pick,
            max_tokens=60,
            temperature=0,
        )
    assert out.choices[0].finish_reason == "stop"
    picked = out.choices[0].message.parsed
    assert isinstance(picked, Pick) and picked.color in ("red", "green", "blue")


async def test_json_object_output_is_a_json_object(server):
    out = await _complete(
        server,
        {"prompt": "{", "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_object"}},
    )
    choice = out["choices"][0]
    text = choice["text"].strip()
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


async def test_uncompilable_schema_is_400(server):
    """A schema that does not compile is a 400 naming response format."""
    status, out = await server.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 5,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}},
            },
        },
    )
    assert status == 400, out
    assert out["error"]["param"] == "response_format.json_schema.schema"
    status, out = await server.post(
        "/v1/completions", {"prompt": "x", "max_tokens": 5, "guided_regex": "([unclosed"}
    )
    assert status == 400, out
    assert out["error"]["param"] == "guided_regex"
    status, out = await server.post(
        "/v1/completions",
        {"prompt": "x", "max_tokens": 5, "structured_outputs": {"grammar": "root ::= undefined_rule"}},
    )
    assert status == 400, out
    assert out["error"]["param"] == "structured_outputs.grammar"


# ----------------------------------------------------------------------------- speculation
PROCESSED_BODIES = [
    {"model": ADAPTER, "logit_bias": {"40": 4.0, "41": -100}},
    {"model": BASE, "presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"model": ADAPTER, "repetition_penalty": 1.3},
    {"model": "chat-r16", "guided_choice": ["alpha", "beta", "gamma delta"]},
    {
        "model": BASE,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    },
    {"model": ADAPTER, "logprobs": 3},
    {"model": BASE, "logprobs": 2, "echo": True, "presence_penalty": 1.0},
]


async def _processed_answers(server, *, together: bool = True) -> list[tuple[str, dict | None]]:
    """Greedy answers to every processed body, sent together (one mixed batch) or alone."""
    prompt = "for item in items:\n    total += item\nfor item in items:\n    total"
    bodies = [{"prompt": prompt, "max_tokens": 30, "temperature": 0, **b} for b in PROCESSED_BODIES]
    if together:
        outs = await asyncio.gather(*[_complete(server, b) for b in bodies])
    else:
        outs = [await _complete(server, b) for b in bodies]
    return [(o["choices"][0]["text"], o["choices"][0]["logprobs"]) for o in outs]


def _assert_same_answers(
    got: list[tuple[str, dict | None]], reference: list[tuple[str, dict | None]]
) -> None:
    for (ref_text, ref_lp), (text, lp) in zip(reference, got, strict=True):
        assert text == ref_text
        if ref_lp is not None:
            assert lp["tokens"] == ref_lp["tokens"] and lp["text_offset"] == ref_lp["text_offset"]
            assert lp["token_logprobs"] == pytest.approx(ref_lp["token_logprobs"], abs=1e-4)
            for top, ref_top in zip(lp["top_logprobs"], ref_lp["top_logprobs"], strict=True):
                assert top == ref_top if ref_top is None else top == pytest.approx(ref_top, abs=1e-4)


async def test_mixed_batch_matches_alone(server):
    """Processed requests in one mixed batch answer as they do alone."""
    _assert_same_answers(await _processed_answers(server), await _processed_answers(server, together=False))


async def test_speculation_lossless_processed(server, assets, tmp_path):
    """Speculative decoding stays lossless with logit processing."""
    from loraserve.runtime.contract.capabilities import CAPABILITIES
    from loraserve.runtime.contract.config import SpecAlgorithm

    from .conftest import make_config, running_server

    if not CAPABILITIES.implements(SpecAlgorithm.NGRAM):
        pytest.skip("this image does not implement NGRAM speculation")
    reference = await _processed_answers(server)
    cfg = make_config(assets)
    cfg.speculative.algorithm = SpecAlgorithm.NGRAM
    cfg.speculative.num_steps = 3
    cfg.speculative.num_draft_tokens = 4
    async with running_server(cfg, tmp_path / "spec") as spec:
        got = await _processed_answers(spec)
    _assert_same_answers(got, reference)
