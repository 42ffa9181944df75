"""Structured-output compiles: bounded in size and time, stopped when their clients leave,
shared between identical constraints, concurrent between different ones.

Real xgrammar compiles in real worker processes against the tiny model's tokenizer; the
engine test runs the real engine thread and model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time

import pytest
import torch

from loraserve.runtime.sampling.params import SamplingParamsError, StructuredOutput
from loraserve.runtime.sampling.structured import ConstraintCompiler
from loraserve.runtime.sampling.structured_limits import MAX_REPEAT, NUMBER_DIGITS, bound_numbers

from .conftest import engine_config, make_request, wait_all

SLOW = StructuredOutput(
    "json_schema", json.dumps({"type": "object", "properties": {str(i): {} for i in range(1000)}})
)
"""1,000 optional properties: about 14 KB, and over 10 s to compile here (xgrammar's
expansion of optional properties grows faster than their square)."""
SIMPLE = StructuredOutput(
    "json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}})
)
NINES = 10**NUMBER_DIGITS - 1


def _compiler(tokenizer, **kwargs) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids), **kwargs)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    "spec, words",
    [
        (
            StructuredOutput("regex", "a" * 5000),
            ["5000 bytes", "limit of 4096 bytes", "--structured-max-bytes"],
        ),
        (StructuredOutput("regex", "a{1000000}"), ["{1000000}", str(MAX_REPEAT)]),
        (StructuredOutput("grammar", 'root ::= "a"{0,99999}'), ["{0,99999}"]),
        (StructuredOutput("json_schema", '{"type": "string"'), ["not valid JSON"]),
        (StructuredOutput("json_schema", '{"type": "string", "maxLength": 1e9}'), ["maxLength", "1e+09"]),
        (
            StructuredOutput("json_schema", '{"type": "string", "pattern": "x{50000}"}'),
            ["pattern", "{50000}"],
        ),
        (StructuredOutput("json_schema", '{"items": ' * 90 + "{}" + "}" * 90), ["more than 64 deep"]),
    ],
)
def test_refused_before_compiling(tokenizer, spec, words):
    compiler = _compiler(tokenizer, max_bytes=4096)
    with pytest.raises(SamplingParamsError) as err:
        compiler.constraint(spec)
    assert err.value.field == "response_format"
    for word in words:
        assert word in str(err.value)
    assert compiler.compiles == 0 and compiler._workers is None  # no worker was ever started for it


def test_enum_values_are_bounded(tokenizer):
    compiler = _compiler(tokenizer)
    schema = {
        "type": "object",
        "properties": {"a": {"enum": list(range(600))}, "b": {"enum": list(range(401))}},
    }
    with pytest.raises(SamplingParamsError, match="more than 1000 enum values"):
        compiler.constraint(StructuredOutput("json_schema", json.dumps(schema)))
    schema["properties"]["b"]["enum"] = list(range(400))
    assert compiler.constraint(StructuredOutput("json_schema", json.dumps(schema))) is not None


def test_identical_constraints_share_one_compile(tokenizer):
    import xgrammar as xgr

    compiler = _compiler(tokenizer)
    first = compiler.constraint(SIMPLE)
    again = compiler.constraint(SIMPLE)
    assert compiler.compiles == 1
    compiler.constraint(StructuredOutput("regex", "[ab]+"))
    assert compiler.compiles == 2
    # What came back from the worker masks exactly as an in-process compile does.
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer.hf, vocab_size=tokenizer.vocab_size, stop_token_ids=sorted(tokenizer.eos_token_ids)
    )
    local = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(bound_numbers(json.loads(SIMPLE.spec))), any_whitespace=False
    )
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    xgr.GrammarMatcher(local).fill_next_token_bitmask(bitmask)
    expected = ((bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[
        : tokenizer.vocab_size
    ]
    assert first.allowed().tolist() == expected.bool().tolist() == again.allowed().tolist()
    assert 0 < int(expected.sum()) < tokenizer.vocab_size


def test_slow_compile_times_out(tokenizer):
    """A slow compile times out and its worker dies."""
    compiler = _compiler(tokenizer, timeout_s=1.0)
    compiler.constraint(SIMPLE)  # the worker pool is up (its first start is not a compile)
    (pid,) = compiler.workers.pids()
    start = time.monotonic()
    with pytest.raises(SamplingParamsError) as err:
        compiler.constraint(SLOW)
    took = time.monotonic() - start
    assert "took longer than 1 s to compile" in str(err.value) and "--structured-compile-timeout" in str(
        err.value
    )
    assert took < 6.0, took  # bounded by the timeout, far below the compile's own time
    assert compiler.workers.killed == 1 and _gone(pid)
    assert compiler.constraint(SIMPLE) is not None  # a new worker serves the next one


async def test_slow_compile_blocks_nothing(tokenizer):
    """Slow compile blocks nothing and stops when its clients leave."""
    compiler = _compiler(tokenizer, timeout_s=120.0)
    await compiler.compile_async(SIMPLE)
    slow = [asyncio.create_task(compiler.compile_async(SLOW)) for _ in range(2)]
    await _until(
        lambda: compiler.compiles == 2 and len(compiler.workers.pids()) == 1 and not compiler.workers._idle
    )
    (pid,) = compiler.workers.pids()
    # A different constraint compiles while the slow one holds its worker.
    other = StructuredOutput("regex", "(yes|no)")
    await asyncio.wait_for(compiler.compile_async(other), timeout=60)
    assert not any(t.done() for t in slow)
    # One of two clients leaves: the compile goes on for the other.
    slow[0].cancel()
    await asyncio.sleep(0.5)
    assert compiler.workers.killed == 0 and not _gone(pid)
    # The last one leaves: its worker is killed.
    slow[1].cancel()
    await _until(lambda: compiler.workers.killed == 1, timeout=5.0)
    await _until(lambda: _gone(pid), timeout=5.0)
    for task in slow:
        with pytest.raises(asyncio.CancelledError):
            await task
    assert SLOW not in compiler._cache  # a later request compiles it afresh


def test_numbers_without_bounds_get_them():
    schema = {
        "type": "object",
        "properties": {
            "age": {"type": "integer"},
            "low": {"type": "integer", "minimum": 0},
            "high": {"type": ["number", "null"], "exclusiveMaximum": 5},
            "huge": {"type": "integer", "minimum": 10**20},
            "type": {"type": "string"},
            "list": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"$ref": "#/$defs/n"}]}},
        },
        "$defs": {"n": {"type": "integer", "minimum": -3, "maximum": 3}},
        "enum": [{"type": "integer"}],
    }
    out = bound_numbers(schema)
    props = out["properties"]
    assert props["age"] == {"type": "integer", "minimum": -NINES, "maximum": NINES}
    assert props["low"] == {"type": "integer", "minimum": 0, "maximum": NINES}
    assert props["high"] == {"type": ["number", "null"], "exclusiveMaximum": 5, "minimum": -NINES}
    assert props["huge"]["maximum"] == 10**21 - 1  # never below the schema's own bound
    assert props["type"] == {"type": "string"}
    assert out["properties"]["list"]["items"]["anyOf"][0] == {
        "type": "number",
        "minimum": -NINES,
        "maximum": NINES,
    }
    assert out["$defs"]["n"] == schema["$defs"]["n"] and out["enum"] == schema["enum"]  # data stays data
    assert schema["properties"]["age"] == {"type": "integer"}  # the caller's schema is untouched


def test_an_integer_field_ends_in_bounded_json(engine_assets, tokenizer, start_engine):
    """A model that would write digits for ever (every digit token pushed to the top) ends
    the number after NUMBER_DIGITS digits and closes the object."""
    engine = start_engine(engine_config(engine_assets), tokenizer)
    digits = [i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip().isdigit()]
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}, "score": {"type": "number"}},
        "required": ["age", "score"],
    }
    req, col = make_request(
        tokenizer.encode("{", add_special_tokens=False),
        max_tokens=120,
        ignore_eos=False,
        logit_bias=tuple((t, 100.0) for t in digits),
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )
    engine.submit(req)
    wait_all([col])
    assert col.error is None and col.finish_reason == "stop", col.text
    value = json.loads(col.text)
    assert len(str(abs(value["age"]))) == NUMBER_DIGITS, col.text
    assert abs(value["score"]) <= NINES, col.text


def test_dead_worker_fails_own_compile(tokenizer):
    """A worker that dies fails only its compile."""
    compiler = _compiler(tokenizer, timeout_s=120.0)
    compiler.constraint(SIMPLE)
    (pid,) = compiler.workers.pids()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(compiler.constraint, SLOW)
        deadline = time.monotonic() + 30
        while compiler.workers._idle:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)  # as a crash inside xgrammar would end it
        with pytest.raises(SamplingParamsError, match="crashed"):
            slow.result(timeout=30)
    assert compiler.constraint(StructuredOutput("regex", "(ok)")) is not None  # a new worker
    assert compiler.workers.started == 2
