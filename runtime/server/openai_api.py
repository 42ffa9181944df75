"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``, streaming or not."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from aiohttp import web

from ..engine import RequestOutput
from ..engine.request import PromptLogprobs, TopLogprobs
from .adapter_supply import public_root, shown_name
from .auth import check_bearer
from .errors import ApiError
from .generation import ChoiceState, Generation
from .schemas import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from .state import STATE, ServerState

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer a stream
}


async def read_body(request: web.Request) -> dict:
    """The request's JSON body, whole within ``--body-timeout`` of the headers (a client that
    announces a body and trickles or withholds it would otherwise hold a handler and a drain)."""
    timeout = request.app[STATE].config.server.body_timeout_s
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout:g} s of the headers "
            f"(Content-Length {request.content_length}, --body-timeout): send the whole body at once",
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


# ------------------------------------------------------------------------------ logprobs
LOGPROB_FLOOR = -9999.0
"""JSON has no -infinity: a token the model cannot pick (or NaN) is reported at this floor,
as OpenAI and vLLM do."""


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return value if value > LOGPROB_FLOOR else LOGPROB_FLOOR


class TokenTexts:
    """Each token id's text, decoded once per API call (the alternatives at every position
    repeat the same ids). Special tokens decode to "" as they do in the choice's text (vLLM
    decodes logprob tokens with the request's ``skip_special_tokens``, true by default), so
    ``text_offset`` indexes the text returned: an echoed prompt's BOS takes no room."""

    def __init__(self, state: ServerState) -> None:
        self._tok = state.tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id]) if self._tok else str(token_id)
            self._cache[token_id] = text
        return text


@dataclass
class Position:
    """One reported token: its id, log-probability and the most likely alternatives there
    (``logprob`` None: the first prompt token, which has no context)."""

    token_id: int
    logprob: float | None
    top: TopLogprobs | None = None


def generated_positions(
    ids: list[int], logprobs: list[float] | None, top: list[TopLogprobs] | None
) -> list[Position]:
    logprobs = logprobs or []
    top = top or []
    return [
        Position(t, logprobs[i] if i < len(logprobs) else None, top[i] if i < len(top) else None)
        for i, t in enumerate(ids)
    ]


def prompt_positions(ids: list[int], prompt: PromptLogprobs | None) -> list[Position]:
    """The prompt's tokens for ``echo`` with ``logprobs`` (the first has no log-probability)."""
    if prompt is None:
        return [Position(t, None) for t in ids]
    return [
        Position(
            t,
            prompt.logprobs[i] if i < len(prompt.logprobs) else None,
            prompt.top[i] if i < len(prompt.top) else None,
        )
        for i, t in enumerate(ids)
    ]


def completion_logprobs(
    texts: TokenTexts, positions: list[Position], *, alternatives: int, offset: int = 0
) -> dict:
    """The completions API's ``logprobs`` object. ``top_logprobs[i]`` maps the ``alternatives``
    most likely tokens' texts, and always the chosen one's, to their log-probabilities (up
    to alternatives + 1 entries, as OpenAI documents; None where there is no logprob).
    ``text_offset[i]`` is where token i starts in the choice's text, counting from
    ``offset`` (what a stream already sent of it, as vLLM does)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    pos = offset
    for p in positions:
        text = texts(p.token_id)
        tokens.append(text)
        token_logprobs.append(_lp(p.logprob))
        offsets.append(pos)
        pos += len(text)
        if p.logprob is None:
            top_logprobs.append(None)
            continue
        top: dict[str, float | None] = {}
        for token_id, logprob in (p.top or [])[:alternatives]:
            top.setdefault(texts(token_id), _lp(logprob))
        top.setdefault(text, _lp(p.logprob))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _chat_entry(text: str, logprob: float | None) -> dict:
    return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(texts: TokenTexts, positions: list[Position], *, alternatives: int) -> dict:
    """The chat API's ``logprobs``: per token its text, log-probability, UTF-8 bytes and the
    ``top_logprobs`` most likely tokens at that position (most likely first)."""
    content = []
    for p in positions:
        entry = _chat_entry(texts(p.token_id), p.logprob)
        entry["top_logprobs"] = [_chat_entry(texts(t), lp) for t, lp in (p.top or [])[:alternatives]]
        content.append(entry)
    return {"content": content}


@contextlib.asynccontextmanager
async def _constraint_errors_named(req: GenerationRequest):
    """A constraint the engine cannot compile is reported on ``response_format``; name the
    field the client actually sent (``guided_regex``, ``structured_outputs.grammar``...)."""
    try:
        yield
    except ApiError as exc:
        if exc.param == "response_format" and req.constraint_field not in (None, "response_format"):
            exc.param = req.constraint_field
        raise


# ------------------------------------------------------------------------------ completions
async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.require_engine()
    req = parse_completion(await read_body(request))
    tok = state.tokenizer
    prompts = [await _encode(tok.encode, p) if isinstance(p, str) else list(p) for p in req.prompts]
    model = req.model or state.served_name
    async with (
        _constraint_errors_named(req),
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
        texts = TokenTexts(state)
        choices = []
        for c in gen.choices:
            prefix = echo[c.index // req.n] if echo else ""
            choices.append(
                {
                    "index": c.index,
                    "text": prefix + c.text,
                    "logprobs": _choice_completion_logprobs(texts, req, c, echoed=echo is not None)
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


def _choice_completion_logprobs(
    texts: TokenTexts, req: CompletionRequest, c: ChoiceState, *, echoed: bool
) -> dict:
    """A whole choice's logprobs; with ``echo`` the prompt's tokens come first (vLLM's shape)."""
    positions = generated_positions(c.token_ids, c.logprobs, c.top_logprobs)
    if echoed:
        positions = prompt_positions(c.prompt_ids, c.prompt_logprobs) + positions
    return completion_logprobs(texts, positions, alternatives=req.params.top_logprobs)


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
        _constraint_errors_named(req),
        state.use_model(req.model) as adapter,
        Generation(
            engine,
            [prompt],
            req.params,
            n=req.n,
            adapter=adapter,
            id_prefix="chatcmpl",
            prompt_param="messages",
            max_tokens_param=req.max_tokens_field,
        ) as gen,
    ):
        if req.stream:
            return await _stream(request, state, gen, req, model, chat=True, echo=None)
        await _collect(gen)
        texts = TokenTexts(state)
        choices = []
        for c in gen.choices:
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(
                        texts,
                        generated_positions(c.token_ids, c.logprobs, c.top_logprobs),
                        alternatives=req.params.top_logprobs,
                    )
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


class _StreamedChoices:
    """Per choice, what a stream has sent: the echo (it rides on the choice's first chunk,
    with the prompt's logprobs, as vLLM sends it) and the characters so far (where the next
    chunk's ``text_offset`` starts)."""

    def __init__(self, echo: list[str] | None, n: int) -> None:
        self.echo = echo
        self.n = n
        self.echoed: set[int] = set()
        self.sent_chars: dict[int, int] = {}

    def pending_echo(self, index: int) -> str | None:
        if self.echo is None or index in self.echoed:
            return None
        return self.echo[index // self.n]


def _chat_chunk_choice(
    texts: TokenTexts, req: GenerationRequest, choice: ChoiceState, out: RequestOutput, finish: str | None
) -> dict:
    """One choice's entry of a chat chunk: the text delta and its tokens' logprobs."""
    positions = generated_positions(out.token_ids, out.logprobs, out.top_logprobs)
    logprobs = (
        chat_logprobs(texts, positions, alternatives=req.params.top_logprobs)
        if req.params.logprobs and positions
        else None
    )
    return {
        "index": choice.index,
        "delta": {"content": out.text} if out.text else {},
        "logprobs": logprobs,
        "finish_reason": finish,
    }


def _completion_chunk_choice(
    texts: TokenTexts,
    req: GenerationRequest,
    sent: _StreamedChoices,
    choice: ChoiceState,
    out: RequestOutput,
    finish: str | None,
) -> dict:
    """One choice's entry of a completions chunk; the choice's first carries its echo."""
    text = out.text
    positions = generated_positions(out.token_ids, out.logprobs, out.top_logprobs)
    prefix = sent.pending_echo(choice.index)
    if prefix is not None:
        sent.echoed.add(choice.index)
        text = prefix + text
        positions = prompt_positions(choice.prompt_ids, out.prompt_logprobs) + positions
    offset = sent.sent_chars.get(choice.index, 0)
    sent.sent_chars[choice.index] = offset + len(text)
    logprobs = (
        completion_logprobs(texts, positions, alternatives=req.params.top_logprobs, offset=offset)
        if req.params.logprobs and positions
        else None
    )
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}


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
    texts = TokenTexts(state)
    sent = _StreamedChoices(echo, req.n)

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

    async def send(choice: ChoiceState, out: RequestOutput) -> None:
        if out.error is not None:
            await resp.write(_sse(ApiError.from_request_error(out.error).body()))
            return
        if (
            sent.pending_echo(choice.index) is None
            and not out.finished
            and not out.text
            and not (req.params.logprobs and out.token_ids)
        ):
            return  # text held back (a partial character or a possible stop string)
        finish = out.finish_reason.value if out.finished and out.finish_reason else None
        entry = (
            _chat_chunk_choice(texts, req, choice, out, finish)
            if chat
            else _completion_chunk_choice(texts, req, sent, choice, out, finish)
        )
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


def _model_entries(request: web.Request) -> list[dict]:
    """The model objects of ``GET /v1/models``: the base, then loaded adapters, then the
    catalogued ones this pod has not loaded yet."""
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
    # Each adapter once, under its public name: the version new requests get (versions
    # still finishing older requests are not listed).
    for name, rec in sorted(state.adapters.items()):
        info = engine.adapter_info(rec.key)
        if info is None or rec.key not in engine.adapter_names:
            continue
        listed.add(name)
        data.append(
            _adapter_model(
                state,
                name,
                created=rec.loaded_at,
                source=rec.source,
                lora={
                    "state": "loaded",
                    "rank": info.rank,
                    "target_modules": list(info.target_modules),
                    "pinned": info.pinned,
                    "warm": name in state.supply.warm,
                    "sha256": rec.sha256,
                    "version": rec.version,
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
        lora = {
            "state": lifecycle,
            "rank": entry.rank,
            "pinned": entry.pinned,
            "sha256": entry.sha256,
            "version": entry.version,
        }
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
    return data


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _model_entries(request)})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the client's ``models.retrieve``): the same object as the
    model's entry in the list; 404 ``model_not_found`` for a name this pod cannot serve."""
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    entries = _model_entries(request)
    wanted = state.served_name if model_id in state.base_names else model_id
    for entry in entries:
        if entry["id"] == wanted:
            return web.json_response(entry)
    if state.supply.refresh_from_file():  # a catalog file newer than the pod's copy may name it
        for entry in _model_entries(request):
            if entry["id"] == wanted:
                return web.json_response(entry)
    raise ApiError(
        404,
        f"the model {shown_name(model_id)} does not exist on this serve (GET /v1/models lists the models)",
        param="model",
        code="model_not_found",
    )
