"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, streaming or not."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from ..engine import RequestOutput
from .adapter_supply import public_root
from .auth import check_bearer
from .errors import ApiError
from .generation import ChoiceState, Generation
from .schemas import ChatRequest, CompletionRequest, parse_chat, parse_completion, parse_json_body
from .state import STATE, ServerState

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer a stream
}


BODY_READ_TIMEOUT_S = 30.0
"""How long a request body may take to arrive once the headers are in: a client that
announces a body and trickles or withholds it would otherwise hold a handler (and a drain)."""


async def read_body(request: web.Request) -> dict:
    timeout = BODY_READ_TIMEOUT_S
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s of the headers "
            f"(Content-Length {request.content_length}): send the whole body at once",
            code="body_timeout",
        ) from None
    return parse_json_body(raw)


_INLINE_TOKENIZE_CHARS = 8192  # longer inputs are tokenised off the event loop


async def _encode(fn, value):
    """Tokenise; a long input runs on a worker thread so other streams keep flowing."""
    size = len(value) if isinstance(value, str) else sum(len(m.content) for m in value)
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(value)
    return await asyncio.to_thread(fn, value)


async def _encode_chat(state: ServerState, messages) -> list[int]:
    """The chat prompt's ids; a chat template that refuses the conversation (``raise_exception``
    in the template, e.g. roles that must alternate) is the request's fault: 400 on messages."""
    try:
        return await _encode(state.tokenizer.encode_chat, messages)
    except Exception as exc:
        if not type(exc).__module__.startswith("jinja2"):
            raise
        raise ApiError(
            400,
            f"this model's chat template refuses the messages: {exc}",
            param="messages",
            code="chat_template_error",
        ) from None


def _token_texts(state: ServerState, ids: list[int]) -> list[str]:
    tok = state.tokenizer
    return (
        [tok.decode([i], skip_special_tokens=False) for i in ids]
        if tok is not None
        else [str(i) for i in ids]
    )


# ------------------------------------------------------------------------------ completions
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.require_engine()
    req = parse_completion(await read_body(request))
    tok = state.tokenizer
    prompts = [await _encode(tok.encode, p) if isinstance(p, str) else list(p) for p in req.prompts]
    model = req.model or state.served_name
    async with (
        state.use_model(req.model) as adapter,
        Generation(
            engine, prompts, req.params, n=req.n, adapter=adapter, id_prefix="cmpl", prompt_param="prompt"
        ) as gen,
    ):
        echo = (
            [_prompt_text(state, p, raw) for p, raw in zip(prompts, req.prompts, strict=True)]
            if req.echo
            else None
        )
        if req.stream:
            return await _stream(request, state, gen, req, model, chat=False, echo=echo)
        await _collect(gen)
        choices = []
        for c in gen.choices:
            text = (echo[c.index // req.n] if echo else "") + c.text
            choices.append(
                {
                    "index": c.index,
                    "text": text,
                    "logprobs": _completion_logprobs(
                        state, c.token_ids, c.logprobs, len(echo[c.index // req.n]) if echo else 0
                    )
                    if req.params.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
            )
        return web.json_response(
            {
                "id": gen.id,
                "object": "text_completion",
                "created": gen.created,
                "model": model,
                "choices": choices,
                "usage": gen.usage(),
            }
        )


def _prompt_text(state: ServerState, ids: list[int], raw: str | list[int]) -> str:
    if isinstance(raw, str):
        return raw
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


def _completion_logprobs(state: ServerState, ids: list[int], logprobs: list[float], offset: int) -> dict:
    texts = _token_texts(state, ids)
    offsets, pos = [], offset
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": list(logprobs[: len(ids)]),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def _chat_logprobs(state: ServerState, ids: list[int], logprobs: list[float]) -> dict:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, lp in zip(_token_texts(state, ids), logprobs, strict=False)
        ]
    }


async def _collect(gen: Generation) -> None:
    """Run every choice to its end; the first failure becomes the response."""
    failure = None
    async for _, out in gen.events():
        if out.error is not None and failure is None:
            failure = out.error
    if failure is not None:
        raise ApiError.from_request_error(failure)


# ------------------------------------------------------------------------------ chat
async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.require_engine()
    req = parse_chat(await read_body(request))
    prompt = await _encode_chat(state, req.messages)
    model = req.model or state.served_name
    async with (
        state.use_model(req.model) as adapter,
        Generation(
            engine, [prompt], req.params, n=req.n, adapter=adapter, id_prefix="chatcmpl", prompt_param="messages"
        ) as gen,
    ):
        if req.stream:
            return await _stream(request, state, gen, req, model, chat=True, echo=None)
        await _collect(gen)
        choices = []
        for c in gen.choices:
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(state, c.token_ids, c.logprobs)
                    if req.params.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
            )
        return web.json_response(
            {
                "id": gen.id,
                "object": "chat.completion",
                "created": gen.created,
                "model": model,
                "choices": choices,
                "usage": gen.usage(),
            }
        )


# ------------------------------------------------------------------------------ streaming
def _sse(payload: dict | str) -> bytes:
    data = (
        payload
        if isinstance(payload, str)
        else json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    )
    return f"data: {data}\n\n".encode()


async def _stream(
    request: web.Request,
    state: ServerState,
    gen: Generation,
    req: CompletionRequest | ChatRequest,
    model: str,
    *,
    chat: bool,
    echo: list[str] | None,
) -> web.StreamResponse:
    """Server-sent events; headers go out only once the first increment is known good."""
    first = await gen.next_event()
    if first is not None and first[1].error is not None:
        raise ApiError.from_request_error(first[1].error)
    resp = web.StreamResponse(status=200, headers=SSE_HEADERS)
    await resp.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        body: dict = {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return _sse(body)

    if chat:
        await resp.write(
            chunk(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in gen.choices
                ]
            )
        )
    elif echo:
        await resp.write(
            chunk(
                [
                    {
                        "index": c.index,
                        "text": echo[c.index // req.n],
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for c in gen.choices
                ]
            )
        )

    async def send(choice: ChoiceState, out: RequestOutput) -> None:
        if out.error is not None:
            await resp.write(_sse(ApiError.from_request_error(out.error).body()))
            return
        if not out.finished and not out.text and not (req.params.logprobs and out.logprobs):
            return  # text held back (a partial character or a possible stop string)
        finish = out.finish_reason.value if out.finished and out.finish_reason else None
        logprobs = None
        if req.params.logprobs and out.logprobs:
            logprobs = (
                _chat_logprobs(state, out.token_ids, out.logprobs)
                if chat
                else _completion_logprobs(state, out.token_ids, out.logprobs, 0)
            )
        if chat:
            entry = {
                "index": choice.index,
                "delta": {"content": out.text} if out.text else {},
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            entry = {"index": choice.index, "text": out.text, "logprobs": logprobs, "finish_reason": finish}
        await resp.write(chunk([entry]))

    if first is not None:
        await send(*first)
    async for choice, out in gen.events():
        await send(choice, out)
    if req.include_usage:
        await resp.write(chunk([], usage=gen.usage()))
    await resp.write(_sse("[DONE]"))
    await resp.write_eof()
    return resp


# ------------------------------------------------------------------------------ models
def _adapter_model(
    state, name: str, *, created: int, source: str, lora: dict, context_len: int, admin: bool
) -> dict:
    # ``root`` never shows the pod's file layout; the real source (what the operator compares
    # with what it asked for) goes to callers holding the admin token only.
    if admin:
        lora = {**lora, "source": source}
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "loraserve",
        "root": public_root(name, source),
        "parent": state.served_name,
        "max_model_len": context_len,
        "lora": lora,
    }


def _is_admin(request: web.Request, token: str | None) -> bool:
    """The request carries the configured admin token (never true when none is configured)."""
    if not token:
        return False
    try:
        check_bearer(request, token)
    except ApiError:
        return False
    return True


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.require_engine()
    admin = _is_admin(request, state.admin_token)
    data = [
        {
            "id": state.served_name,
            "object": "model",
            "created": state.started,
            "owned_by": "loraserve",
            "root": state.served_name,
            "parent": None,
            "max_model_len": engine.context_len,
        }
    ]
    listed = set()
    for info in engine.list_adapters():
        if info.name not in engine.adapter_names:
            continue  # being unloaded
        rec = state.adapters.get(info.name)
        listed.add(info.name)
        data.append(
            _adapter_model(
                state,
                info.name,
                created=rec.loaded_at if rec else state.started,
                source=rec.source if rec else info.name,
                lora={
                    "state": "loaded",
                    "rank": info.rank,
                    "target_modules": list(info.target_modules),
                    "pinned": info.pinned,
                    "warm": info.name in state.supply.warm,
                    "sha256": rec.sha256 if rec else None,
                },
                context_len=engine.context_len,
                admin=admin,
            )
        )
    # Catalogued adapters this pod does not hold yet: usable, loaded on their first request.
    for entry in state.supply.catalog.values():
        if entry.name in listed:
            continue
        lifecycle, message = state.supply.state_of(entry.name)
        lora = {"state": lifecycle, "rank": entry.rank, "pinned": entry.pinned, "sha256": entry.sha256}
        if message:
            lora["message"] = message
        data.append(
            _adapter_model(
                state,
                entry.name,
                created=state.started,
                source=entry.source,
                lora=lora,
                context_len=engine.context_len,
                admin=admin,
            )
        )
    return web.json_response({"object": "list", "data": data})
