"""Constraints over HTTP: bounded in size and compile time (a 400 naming the field), a slow
compile holds up no other request and stops when its client leaves, identical schemas
compile once; and three request fields named as the client sent them.

The real app on a real port, real worker processes; the compile bound is 1 s here.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from .conftest import Server, make_config, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 1.0
SLOW_SCHEMA = {"type": "object", "properties": {str(i): {} for i in range(1000)}}
"""1,000 optional properties: about 14 KB, and over 10 s to compile here."""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(assets, tmp_path_factory) -> AsyncIterator[Server]:
    config = make_config(assets)
    config.server.structured_compile_timeout_s = TIMEOUT_S
    async with running_server(config, tmp_path_factory.mktemp("structured")) as srv:
        # The worker pool's first start (the forkserver imports xgrammar) is not a compile:
        # two constraints at once leave two workers started and idle.
        # On a busy machine the first pair may run one after the other on one worker: new
        # pairs until two workers have started (each constraint new, so none is cached).
        for attempt in range(8):
            words = (f"a{attempt}", f"b{attempt}")
            answers = await asyncio.gather(*(srv.post("/v1/completions", _body(guided_regex=w)) for w in words))
            assert [status for status, _ in answers] == [200, 200], answers
            if len(srv.engine.constraint_compiler().workers.pids()) == 2:
                break
        assert len(srv.engine.constraint_compiler().workers.pids()) == 2
        yield srv


def _body(**fields) -> dict:
    return {"prompt": "x", "max_tokens": 4, "temperature": 0, **fields}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


BIG = "a" * 33_000


CASES = [
    (
        _schema({"type": "string", "description": BIG}),
        "response_format.json_schema.schema",
        ["bytes", "32768", "--structured-max-bytes"],
    ),
    ({"guided_regex": BIG}, "guided_regex", ["33000 bytes", "--structured-max-bytes"]),
    ({"structured_outputs": {"grammar": f'root ::= "{BIG}"'}}, "structured_outputs.grammar", ["32768"]),
    ({"guided_regex": "[0-9]{1000000}"}, "guided_regex", ["{1000000}", "10000"]),
    ({"guided_choice": [f"c{i}" for i in range(1001)]}, "guided_choice", ["1001 choices", "at most 1000"]),
    ({"guided_json": {"enum": list(range(1001))}}, "guided_json", ["1000 enum values"]),
    (_schema({"type": "array", "maxItems": 10**7}), "response_format.json_schema.schema", ["maxItems"]),
]


@pytest.mark.parametrize("fields, param, words", CASES)
async def test_oversized_constraints_are_a_400(server, fields, param, words):
    compiles = server.engine.constraint_compiler().compiles
    status, body = await server.post("/v1/completions", _body(**fields))
    assert status == 400, body
    assert body["error"]["param"] == param, body
    for word in words:
        assert word in body["error"]["message"], body
    assert server.engine.constraint_compiler().compiles == compiles  # refused before compiling


async def test_slow_schema_times_out(server):
    """Slow schema times out while another completes."""
    finished: dict[str, float] = {}

    async def post(name: str, body: dict) -> tuple[int, dict]:
        answer = await server.post("/v1/completions", body)
        finished[name] = time.monotonic()
        return answer

    start = time.monotonic()
    slow, quick = await asyncio.gather(
        post("slow", _body(**_schema(SLOW_SCHEMA))),
        post("quick", _body(guided_choice=["yes", "no"], max_tokens=8)),
    )
    assert slow[0] == 400, slow
    assert slow[1]["error"]["param"] == "response_format.json_schema.schema"
    message = slow[1]["error"]["message"]
    assert "took longer than 1 s to compile" in message and "--structured-compile-timeout" in message
    assert finished["slow"] - start < 8 * TIMEOUT_S  # about the bound; the compile alone takes > 10 s
    assert quick[0] == 200, quick
    assert quick[1]["choices"][0]["text"] in ("yes", "no")
    assert finished["quick"] < finished["slow"]


async def test_a_client_that_leaves_stops_its_compile(server):
    compiler = server.engine.constraint_compiler()
    workers = compiler.workers
    compiler.timeout_s = 120.0  # only the client's leaving can stop this one
    try:
        compiles, killed = compiler.compiles, workers.killed
        task = asyncio.create_task(
            server.post("/v1/completions", _body(**_schema({**SLOW_SCHEMA, "title": "gone"})))
        )
        deadline = time.monotonic() + 30
        while compiler.compiles == compiles or not (busy := set(workers.pids()) - _idle(workers)):
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)  # well into the compile
        task.cancel()  # the client closes its connection
        deadline = time.monotonic() + 5
        while workers.killed == killed or not all(_gone(pid) for pid in busy):
            assert time.monotonic() < deadline, "the compile went on after its client left"
            await asyncio.sleep(0.02)
    finally:
        compiler.timeout_s = TIMEOUT_S
    status, body = await server.post("/v1/completions", _body(guided_regex="after"))
    assert status == 200, body


def _idle(workers) -> set[int]:
    return {w.process.pid for w in workers._idle}


async def test_identical_schemas_compile_once(server):
    compiler = server.engine.constraint_compiler()
    compiles = compiler.compiles
    schema = _schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    answers = await asyncio.gather(
        *(server.post("/v1/completions", _body(max_tokens=20, **schema)) for _ in range(3))
    )
    assert [status for status, _ in answers] == [200, 200, 200], answers
    assert compiler.compiles == compiles + 1


async def test_an_integer_field_has_bounded_digits(server, assets):
    from loraserve.runtime.tokenizer import Tokenizer

    tok = Tokenizer.load(assets.model_dir)
    digits = {str(i): 100 for i in range(tok.vocab_size) if tok.decode([i]).strip().isdigit()}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    status, body = await server.post(
        "/v1/completions", _body(prompt="{", max_tokens=60, logit_bias=digits, **_schema(schema))
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert len(str(json.loads(choice["text"])["age"])) == 15, choice


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/a", "draft": {}},
            "draft.lora_path",
            ["required"],
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/a", "draft": {"lora_path": 5}},
            "draft.lora_path",
            ["draft.lora_path must be a string"],
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/a", "draft": {"lora_path": "/b", "sha256": 1}},
            "draft.sha256",
            ["draft.sha256 must be a string"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
            "max_completion_tokens",
            ["context length", "in max_completion_tokens"],
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000},
            "max_tokens",
            ["in max_tokens"],
        ),
    ],
)
async def test_fields_named_as_sent(server, path, body, param, words):
    status, out = await server.post(path, body, headers=server.admin_headers())
    assert status == 400, out
    assert out["error"]["param"] == param, out
    for word in words:
        assert word in out["error"]["message"], out


async def test_embedding_draft_refused_with_fix(assets, tmp_path):
    """An adapter of the target's embed_tokens / lm_head offered as its own draft adapter:
    the draft pool never wraps those modules, so the fix is another draft adapter, never a
    change to lora.target_modules."""
    from loraserve.runtime.contract.config import SpecAlgorithm
    from loraserve.runtime.dev.devmodels import build_adapter, copy_model

    from .conftest import draft_pool_config

    path = build_adapter(
        tmp_path / "emb", assets.model_dir, rank=4, target_modules=("q_proj", "lm_head"), seed=7
    )
    config = draft_pool_config(
        assets, SpecAlgorithm.STANDALONE, copy_model(assets.model_dir, tmp_path / "draft")
    )
    config.lora.target_modules = (*config.lora.target_modules, "lm_head")
    async with running_server(config, tmp_path / "spec") as srv:
        status, body = await srv.post(
            "/v1/load_lora_adapter",
            {"lora_name": "emb", "lora_path": str(path), "draft": {"lora_path": str(path)}},
            headers=srv.admin_headers(),
        )
        assert status == 400, body
        error = body["error"]
        assert error["param"] == "draft.target_modules", error
        assert "never wraps" in error["message"] and "use a draft adapter without lm_head" in error["message"]
        assert "add them to" not in error["message"] and "add lm_head to" not in error["message"]
        assert "emb" not in srv.engine.adapter_names  # all or nothing
        # The same adapter as the served one (not a draft) loads: its pool has lm_head.
        status, body = await srv.post(
            "/v1/load_lora_adapter", {"lora_name": "emb", "lora_path": str(path)}, headers=srv.admin_headers()
        )
        assert status == 200, body
