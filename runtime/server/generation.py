"""The bridge between one API call and the engine: fan out, stream back, clean up.

An API call becomes one engine request per (prompt, sample) choice. All of them are
validated before any is submitted, so a bad choice rejects the call without starting
work. Outputs from the engine thread land in one asyncio queue (``call_soon_threadsafe``)
tagged with their choice index. Leaving the ``async with`` block aborts whatever is still
running: a client that disconnects (or a handler that fails) never leaves work behind.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from ..engine import Engine, EngineError, Request, RequestOutput, SpecStats
from ..engine.request import PromptLogprobs, TopLogprobs
from ..sampling import SamplingParams, SamplingParamsError
from ..sampling.structured import ConstraintBusyError
from .errors import ApiError
from .schemas import MAX_REQUEST_TOKENS

_counter = itertools.count()


def _params_error(exc: SamplingParamsError) -> ApiError:
    """A sampling parameter the engine refused (a schema that does not compile, a token id
    outside the vocabulary): the request's fault, named by its field."""
    return ApiError(400, str(exc), param=exc.field, code="invalid_value")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:20]}{next(_counter):x}"


@dataclass
class ChoiceState:
    """Accumulated output of one choice."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per generated token, its most likely alternatives (when ``top_logprobs`` > 0)."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt tokens' log-probabilities (``echo`` with ``logprobs``), from the first output."""
    finish_reason: str | None = None
    completion_tokens: int = 0
    spec: SpecStats | None = None


class Generation:
    """One API call's engine requests. Use as ``async with Generation(...) as gen:``."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        *,
        n: int,
        adapter: str | None,
        id_prefix: str,
        prompt_param: str,
        max_tokens_param: str = "max_tokens",
    ) -> None:
        """``prompt_param`` / ``max_tokens_param``: the fields errors about the prompt and
        the token limit name (as the client sent them)."""
        self.engine = engine
        self.id = new_request_id(id_prefix)
        self.created = int(time.time())
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._requests: list[Request] = []
        self._open: set[int] = set()
        self.choices: list[ChoiceState] = []
        self.prompt_param = prompt_param
        self.max_tokens_param = max_tokens_param
        self.n = n
        index = 0
        for prompt in prompts:
            for j in range(n):
                p = copy.copy(params)
                if p.seed is not None and j:
                    p.seed = p.seed + j  # n samples of one prompt must differ, reproducibly
                self._requests.append(
                    Request(
                        rid=f"{self.id}-{index}",
                        prompt_ids=list(prompt),
                        params=p,
                        adapter=adapter,
                        sink=self._sink_for(index),
                        group=self.id,
                    )
                )
                self.choices.append(ChoiceState(index=index, prompt_ids=list(prompt)))
                index += 1

    def _sink_for(self, index: int):
        loop, queue = self._loop, self._queue

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (index, out))

        return sink

    async def __aenter__(self) -> Generation:
        try:
            await self._compile_constraint()
            for req in self._requests:
                if req.params.structured is not None:
                    # Compiled above (a cache hit now), but a matcher is still built: off the loop.
                    await asyncio.to_thread(self.engine.prepare, req, prompt_param=self.prompt_param)
                else:
                    self.engine.prepare(req, prompt_param=self.prompt_param)
        except EngineError as exc:
            raise self._named(ApiError.from_request_error(exc.error)) from None
        except SamplingParamsError as exc:
            raise _params_error(exc) from None
        self._check_total_tokens()
        try:
            for index, req in enumerate(self._requests):
                self.engine.submit(req, prompt_param=self.prompt_param, prepared=True)
                self._open.add(index)
        except BaseException as exc:
            # A later choice refused (or anything failing) must not leave the earlier ones
            # running: __aexit__ does not run when __aenter__ raises.
            self._abort_open()
            if isinstance(exc, EngineError):
                raise self._named(ApiError.from_request_error(exc.error)) from None
            if isinstance(exc, SamplingParamsError):
                raise _params_error(exc) from None
            raise
        return self

    async def _compile_constraint(self) -> None:
        """Compile the call's constraint (one for all its choices) in a worker process,
        bounded in size and time; a client that leaves cancels this wait, and with it the
        compile unless another request waits for the same one."""
        spec = self._requests[0].params.structured if self._requests else None
        compiler = getattr(self.engine, "constraint_compiler", None)
        if spec is None or compiler is None:
            return
        try:
            await compiler().compile_async(spec)
        except ConstraintBusyError as exc:
            raise ApiError(
                503, str(exc), param=exc.field, code="server_busy", headers={"Retry-After": "1"}
            ) from None

    def _check_total_tokens(self) -> None:
        """Prompts × n × max_tokens (as resolved: a chat without max_tokens may run to the
        context length) is bounded per call; one choice may always use the whole context."""
        total = sum(r.max_new_tokens for r in self._requests)
        bound = max(MAX_REQUEST_TOKENS, int(getattr(self.engine, "context_len", 0) or 0))
        if total > bound:
            choices = len(self._requests)
            per = max(r.max_new_tokens for r in self._requests)
            raise self._named(
                ApiError(
                    400,
                    f"prompts × n × max_tokens asks for {total} tokens ({choices} choices × up to {per} tokens): at "
                    f"most {bound} per request; lower max_tokens or n, or split the prompts across requests",
                    param="max_tokens",
                    code="too_many_tokens",
                )
            )

    def _named(self, err: ApiError) -> ApiError:
        """``err`` naming the token-limit field the client sent (``max_completion_tokens``)."""
        if err.param == "max_tokens" and self.max_tokens_param != "max_tokens":
            err.param = self.max_tokens_param
            err.message = err.message.replace("max_tokens", self.max_tokens_param)
        return err

    async def __aexit__(self, *exc_info) -> None:
        self._abort_open()

    def _abort_open(self) -> None:
        for index in list(self._open):
            self.engine.abort(self._requests[index].rid)
        self._open.clear()

    @property
    def max_new_tokens(self) -> list[int]:
        return [r.max_new_tokens for r in self._requests]

    async def next_event(self) -> tuple[ChoiceState, RequestOutput] | None:
        """The next ``(choice, increment)``; None once every choice has finished."""
        if not self._open:
            return None
        index, out = await self._queue.get()
        choice = self.choices[index]
        choice.text += out.text
        choice.token_ids.extend(out.token_ids)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        if out.top_logprobs:
            choice.top_logprobs.extend(out.top_logprobs)
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        choice.completion_tokens = out.completion_tokens
        if out.finished:
            self._open.discard(index)
            choice.finish_reason = out.finish_reason.value if out.finish_reason else None
            choice.spec = out.spec
        return choice, out

    async def events(self) -> AsyncIterator[tuple[ChoiceState, RequestOutput]]:
        """Yield ``(choice, increment)`` until every choice has finished."""
        while (event := await self.next_event()) is not None:
            yield event

    def usage(self) -> dict:
        """OpenAI usage; prompt tokens count once per prompt, whatever ``n`` is."""
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.index % self.n == 0)
        completion = sum(c.completion_tokens for c in self.choices)
        usage: dict = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        specs = [c.spec for c in self.choices if c.spec is not None]
        if specs:
            steps = sum(s.verify_steps for s in specs)
            accepted = sum(s.accepted_tokens for s in specs)
            usage["speculative"] = {
                "verify_steps": steps,
                "draft_tokens": sum(s.draft_tokens for s in specs),
                "accepted_tokens": accepted,
                "mean_accept_length": accepted / steps if steps else 0.0,
            }
        return usage
