"""A sampling parameter the engine refuses is the client's fault wherever it is raised:
a 400 naming the field, and no choice of the call is left running.

The engine here is a stand-in that records submissions and aborts, so the refusal can be
placed on any choice (the real engine's refusals are covered end to end in
``test_openai_features.py``)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from loraserve.runtime.sampling import SamplingParams, SamplingParamsError
from loraserve.runtime.server.errors import ApiError, error_middleware
from loraserve.runtime.server.generation import Generation

pytestmark = pytest.mark.asyncio


class RefusingEngine:
    """Accepts requests until the ``refuse_at``-th submission, which raises."""

    context_len = 4096

    def __init__(self, refuse_at: int, *, in_prepare: bool = False) -> None:
        self.refuse_at = refuse_at
        self.in_prepare = in_prepare
        self.submitted: list[str] = []
        self.aborted: list[str] = []
        self._prepared = 0

    def prepare(self, request, *, prompt_param: str = "prompt"):
        self._prepared += 1
        if self.in_prepare and self._prepared == self.refuse_at:
            raise SamplingParamsError("logit_bias", "logit_bias keys must be token ids below 512")
        request.max_new_tokens = 4
        return request

    def submit(self, request, *, prompt_param: str = "prompt", prepared: bool = False) -> None:
        if not self.in_prepare and len(self.submitted) + 1 == self.refuse_at:
            raise SamplingParamsError("response_format", "the JSON schema cannot be used: bad type")
        self.submitted.append(request.rid)

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


async def _enter(engine: RefusingEngine) -> ApiError:
    gen = Generation(
        engine,
        [[1, 2, 3]],
        SamplingParams(max_tokens=4),
        n=3,
        adapter=None,
        id_prefix="t",
        prompt_param="prompt",
    )
    with pytest.raises(ApiError) as info:
        async with gen:
            pass
    return info.value


async def test_refusal_aborts_submitted():
    """A refusal at submission aborts the choices already submitted."""
    engine = RefusingEngine(refuse_at=3)
    err = await _enter(engine)
    assert (err.status, err.param) == (400, "response_format")
    assert len(engine.submitted) == 2 and sorted(engine.aborted) == sorted(engine.submitted)


async def test_a_refusal_at_preparation_submits_nothing():
    engine = RefusingEngine(refuse_at=2, in_prepare=True)
    err = await _enter(engine)
    assert (err.status, err.param) == (400, "logit_bias")
    assert engine.submitted == [] and engine.aborted == []


async def test_stray_params_error_is_400():
    """The middleware answers a stray sampling params error as a 400."""
    async def handler(request: web.Request) -> web.Response:
        raise SamplingParamsError("top_logprobs", "top_logprobs must be an integer in [0, 20]")

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/x", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/x")
        body = await resp.json()
    assert resp.status == 400
    assert body == {
        "error": {
            "message": "top_logprobs must be an integer in [0, 20]",
            "type": "invalid_request_error",
            "param": "top_logprobs",
            "code": "invalid_value",
        }
    }
