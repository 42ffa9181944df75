"""A bounded load generator for the cluster-serving scenario (and ``bench/operator.py``).

``workers`` concurrent clients send short greedy requests (temperature 0, ``max_tokens``
tokens) through a Service address: ``/v1/completions`` and ``/v1/chat/completions``,
streamed (SSE) and not, cycling over the models in :attr:`Traffic.models` (adapter names
and the base model; the list may change while it runs) and the prompts. Each request has
its own timeout; the run stops when told (:meth:`Traffic.stop`), at a hard deadline or
after ``max_requests``. Every request is recorded (:class:`Record`): what was asked, when,
the HTTP status or the error, the text, the latency and the pod that served it (the
Service stand-in's ``X-Served-By`` header).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

APIS = ("completions", "chat")
PROMPTS = ("def main(", "The quick brown fox", "SELECT name FROM", "Once upon a time")


@dataclass
class Record:
    """One request through the Service."""

    n: int
    worker: int
    model: str
    prompt: str
    api: str  # "completions" or "chat"
    stream: bool
    sent_at: float  # seconds after the traffic started
    latency: float = 0.0
    status: int | None = None  # None: no HTTP answer (connection failed, timed out)
    error: str = ""
    text: str = ""
    pod: str = ""
    proxy_error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    def describe(self) -> str:
        return (
            f"#{self.n} {self.model} {self.api}{' stream' if self.stream else ''} {self.prompt!r} "
            f"at +{self.sent_at:.2f}s via {self.pod or '?'}: {self.status} {self.error or self.text!r} "
            f"({self.latency:.2f}s)"
        )


def request_body(api: str, model: str, prompt: str, *, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """(path, JSON body) of one greedy request."""
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def send(
    http: aiohttp.ClientSession,
    base_url: str,
    record: Record,
    *,
    max_tokens: int,
    timeout_s: float,
) -> Record:
    """Send ``record``'s request to ``base_url`` and fill in the answer."""
    path, body = request_body(
        record.api, record.model, record.prompt, max_tokens=max_tokens, stream=record.stream
    )
    started = time.monotonic()
    try:
        async with http.post(
            base_url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            record.status = resp.status
            record.pod = resp.headers.get("X-Served-By", "")
            record.proxy_error = resp.headers.get("X-Service-Proxy-Error", "")
            if resp.status != 200:
                record.error = (await resp.text())[:500]
            elif record.stream:
                record.text, record.error = await _read_stream(resp, record.api)
            else:
                answer = await resp.json()
                record.text = _choice_text(answer["choices"][0], record.api)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.latency = time.monotonic() - started
    return record


def _choice_text(choice: dict, api: str) -> str:
    if api == "chat":
        return (choice.get("message") or {}).get("content") or ""
    return choice.get("text") or ""


async def _read_stream(resp: aiohttp.ClientResponse, api: str) -> tuple[str, str]:
    """Concatenate an SSE stream's deltas; (text, error) where error says how it ended badly."""
    parts: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            return "".join(parts), f"error event: {json.dumps(event['error'])[:300]}"
        for choice in event.get("choices") or []:
            if api == "chat":
                parts.append((choice.get("delta") or {}).get("content") or "")
            else:
                parts.append(choice.get("text") or "")
    return "".join(parts), "" if done else "stream ended without [DONE]"


@dataclass
class Traffic:
    """Start with :meth:`start`; :meth:`stop` ends it and returns the records."""

    url: str
    models: list[str]
    prompts: Sequence[str] = PROMPTS
    workers: int = 4
    max_tokens: int = 6
    timeout_s: float = 30.0
    deadline_s: float = 600.0
    max_requests: int = 20_000
    pause_s: float = 0.0
    records: list[Record] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)
    t0: float = 0.0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _counter: itertools.count = field(default_factory=itertools.count)
    _http: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._http = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(self._worker(i), name=f"traffic-{i}") for i in range(self.workers)]

    def mark(self, label: str) -> float:
        """Note a moment of the scenario (its time is returned, relative to the start)."""
        at = time.monotonic() - self.t0
        self.marks.append((at, label))
        return at

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def stop(self) -> list[Record]:
        self._stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks)
        if self._http is not None:
            await self._http.close()
        return self.records

    def _next(self, n: int, worker: int) -> Record:
        """The n-th request: models vary fastest, then API and streaming, then prompts."""
        models = list(self.models)
        model = models[n % len(models)]
        rest = n // len(models)
        api = APIS[rest % 2]
        stream = bool((rest // 2) % 2)
        prompt = self.prompts[(rest // 4) % len(self.prompts)]
        return Record(n, worker, model, prompt, api, stream, sent_at=self.now())

    async def _worker(self, worker: int) -> None:
        assert self._http is not None
        while not self._stop.is_set() and self.now() < self.deadline_s:
            n = next(self._counter)
            if n >= self.max_requests:
                return
            record = self._next(n, worker)
            self.records.append(record)
            await send(self._http, self.url, record, max_tokens=self.max_tokens, timeout_s=self.timeout_s)
            if self.pause_s:
                await asyncio.sleep(self.pause_s)
