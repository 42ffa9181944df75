"""The HTTP front door's limits against slow and hostile clients.

Each limit and its default (the flags are the configuration's, ``ServerConfig``):

- ``--header-timeout`` (10 s): a connection must deliver a complete request head this long
  after it opens or after its previous response ends, else it is closed (aiohttp's
  keep-alive timer: idle keep-alive connections close after this long too, as uvicorn's
  5 s keep-alive does). Bytes trickled in do not extend it.
- ``--body-timeout`` (30 s): a request's whole body must arrive this long after its head,
  else 408 ``body_timeout`` and the connection closes (``openai_api.read_body``).
- ``--write-timeout`` (60 s): a connection whose unsent output makes no progress for this
  long (a client that stops reading) is aborted; its handler is cancelled, which aborts its
  engine requests and frees their batch slots.
- ``--max-connections`` (0: derived, :func:`derived_max_connections`: the open-file
  limit less 64 kept for the process, at most 75 % of it and at most 16,384; 768 for 1,024
  files): open client
  connections at most. At the cap a new connection takes the place of the one idle longest
  (no request in flight for :data:`EVICT_IDLE_S`: a slow-loris head, a parked keep-alive),
  else of the one whose request body has been arriving longest, which is closed; when every
  connection is busy with a whole request, up to :data:`PROBE_RESERVE` more are read
  for a ``GET /health`` or ``/ready`` (kubelet probes), which are served, and the rest are
  answered 503 ``server_busy`` with ``Retry-After`` and closed at once.
- ``--max-body-bytes`` (4 MiB): ``Expect: 100-continue`` with a larger ``Content-Length``
  gets 413 without ``100 Continue`` (:func:`expect_handler`).
- Accept errors (``EMFILE`` ...) are logged at most once per :data:`ACCEPT_LOG_INTERVAL_S`
  with a count (:class:`AcceptErrorLog`).
- When the drain timeout ends, requests still in flight that have sent nothing get 503
  ``shutting_down`` with ``Retry-After`` (:func:`cut_off`); started streams are cut.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import errno
import json
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiohttp import web

from ..contract.config import ServerConfig
from .errors import MAX_BODY_KEY, ApiError, _too_large
from .state import STATE

log = logging.getLogger("loraserve.server")

FD_RESERVE = 64
"""File descriptors the derived connection cap leaves to the process itself (model and
adapter files, logs, sockets to adapter sources and peers, the event loop's own)."""

DERIVED_CEILING = 16384
"""The derived cap's ceiling, whatever the file limit (containers often allow 2**20 files):
each open connection holds buffers, so memory, not files, bounds it there."""

PROBE_RESERVE = 8
"""Connections past the cap read for a probe (``GET /health`` or ``/ready``), which is served;
they count within :data:`FD_RESERVE`."""

PROBE_PATHS = (b"/health", b"/ready")

ACCEPT_LOG_INTERVAL_S = 10.0
"""Accept errors are logged at most once per this many seconds, with their count."""

EVICT_IDLE_S = 1.0
"""At the connection cap, a connection with no request in flight for this long may be closed
to admit a new one (a client sends its request head at once; a slow-loris does not)."""

BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` on a connection refused past the cap."""

LISTEN_BACKLOG = 128
"""The listeners' accept backlog (as the bound sockets' ``listen``)."""

_REQUEST_LINE_MAX = 8190  # aiohttp's own max_line_size: a longer first line is no probe


def _file_bound(soft_limit: int) -> int:
    """The most connections a process allowed ``soft_limit`` open files can hold: that limit
    less :data:`FD_RESERVE` and at most 75 % of it (at least 1); unlimited counts as 2**20."""
    if soft_limit < 0 or soft_limit == resource.RLIM_INFINITY:
        soft_limit = 1 << 20
    return max(1, min(soft_limit - FD_RESERVE, soft_limit * 3 // 4))


def derived_max_connections(soft_limit: int) -> int:
    """``--max-connections 0``: what the file limit allows (:func:`_file_bound`), and at most
    :data:`DERIVED_CEILING`."""
    return min(_file_bound(soft_limit), DERIVED_CEILING)


def connection_cap(requested: int, soft_limit: int | None = None) -> int:
    """``--max-connections`` resolved: 0 means derived (:func:`derived_max_connections`); a
    value above what the file limit allows is lowered to it (past it accept() fails and
    the process runs out of files), with a warning."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if requested <= 0:
        return derived_max_connections(soft_limit)
    bound = _file_bound(soft_limit)
    if requested > bound:
        log.warning(
            "--max-connections %d is above what the file limit (%d open files) allows: using %d "
            "(raise the limit, e.g. `ulimit -n`, to allow more)",
            requested,
            soft_limit,
            bound,
        )
        return bound
    return requested


@dataclass(frozen=True)
class Limits:
    """The front door's limits, resolved (``max_connections`` is never 0)."""

    header_timeout_s: float
    write_timeout_s: float
    max_connections: int

    @classmethod
    def from_config(cls, server: ServerConfig, soft_limit: int | None = None) -> Limits:
        return cls(
            header_timeout_s=server.header_timeout_s,
            write_timeout_s=server.write_timeout_s,
            max_connections=connection_cap(server.max_connections, soft_limit),
        )


# --- request level: installed on the app (build_app calls install) -------------------------


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: 413 (no ``100 Continue``) when the declared body is over
    ``--max-body-bytes``; any other expectation 417. A route's ``expect_handler``."""
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        resp = ApiError(
            417,
            f"unsupported Expect: {expect[:64]!r}: send Expect: 100-continue or none",
            code="expectation_failed",
        ).response()
        resp.force_close()
        return resp
    limit = request.app.get(MAX_BODY_KEY)
    if limit and request.content_length is not None and request.content_length > limit:
        return _too_large(limit, request.content_length)
    if request.version >= (1, 1):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
    return None


@dataclass
class _Cutoff:
    """The handlers in flight, whether the drain's end has cancelled them, and the gate
    that learns which connections are busy (set by :class:`FrontDoor`)."""

    tasks: set[asyncio.Task] = field(default_factory=set)
    cancelled: set[asyncio.Task] = field(default_factory=set)
    started: set[asyncio.Task] = field(default_factory=set)  # those whose response has begun
    gate: ConnectionGate | None = None


_CUTOFF = web.AppKey("loraserve_cutoff", _Cutoff)


@web.middleware
async def cutoff_middleware(request: web.Request, handler):
    """A handler cancelled by :func:`cut_off` before its response started answers 503
    ``shutting_down`` (the drain's own answer) instead of leaving the client without one.
    Its connection counts as busy meanwhile (never closed to admit another)."""
    cutoff = request.app[_CUTOFF]
    me = asyncio.current_task()
    if me is None:
        return await handler(request)
    cutoff.tasks.add(me)
    conn = cutoff.gate.busy(request) if cutoff.gate is not None else None
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if me not in cutoff.cancelled or me in cutoff.started:
            raise
        me.uncancel()
        return _shutting_down(request)
    except ConnectionResetError:
        if request.transport is not None and not request.transport.is_closing():
            raise
        # The client is gone (left, or its connection was closed to admit another) while its
        # body was read: aiohttp is cancelling this handler; without this it would log each
        # one as an error with a traceback, a way to flood the log.
        raise asyncio.CancelledError from None
    finally:
        cutoff.tasks.discard(me)
        cutoff.cancelled.discard(me)
        cutoff.started.discard(me)
        if conn is not None:
            conn.done()


def _shutting_down(request: web.Request) -> web.Response:
    """The drain's refusal (``ServerState.require_engine`` while draining)."""
    state = request.app[STATE]
    state.begin_drain()
    try:
        state.require_engine()
    except ApiError as exc:
        return exc.response()
    raise AssertionError("a draining state must refuse")  # pragma: no cover


async def _mark_started(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: runs in the handler's task, whose response has now begun."""
    cutoff = request.app[_CUTOFF]
    task = asyncio.current_task()
    if task in cutoff.tasks:
        cutoff.started.add(task)


def install(app: web.Application) -> None:
    """Add the drain's cut-off to ``app`` (before it starts). Routes taking a body get
    :func:`expect_handler` where they are added."""
    app[_CUTOFF] = _Cutoff()
    app.middlewares.append(cutoff_middleware)
    app.on_response_prepare.append(_mark_started)


def cut_off(app: web.Application) -> int:
    """The drain timeout has ended: cancel every handler still in flight (those that have not
    started their response answer 503 ``shutting_down``); returns how many."""
    cutoff = app[_CUTOFF]
    for task in list(cutoff.tasks):
        if not task.done():
            cutoff.cancelled.add(task)
            task.cancel()
    return len(cutoff.cancelled)


# --- connection level: the listeners (the CLI opens them with FrontDoor) --------------------


class ThrottledLog:
    """Counts events and logs them at most once per ``interval_s`` with their count: the
    first at once, the rest when the interval ends. ``emit(count)`` writes the line."""

    def __init__(self, emit: Callable[[int], None], interval_s: float = ACCEPT_LOG_INTERVAL_S) -> None:
        self._emit = emit
        self._interval_s = interval_s
        self._count = 0
        self._next_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    def hit(self) -> None:
        """One more event; call on the event loop."""
        self._count += 1
        loop = asyncio.get_running_loop()
        if loop.time() >= self._next_at:
            self.flush()
        elif self._timer is None:
            self._timer = loop.call_at(self._next_at, self.flush)

    def flush(self) -> None:
        """Log the events counted so far (if any); the next line waits an interval."""
        self._timer = None
        if self._count:
            count, self._count = self._count, 0
            self._emit(count)
            self._next_at = asyncio.get_running_loop().time() + self._interval_s

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptErrorLog:
    """The event loop's exception handler while serving: an ``accept()`` that fails for want
    of resources (asyncio reports each one, then retries a second later) is counted and
    logged by a :class:`ThrottledLog`; anything else goes to the previous handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval_s: float = ACCEPT_LOG_INTERVAL_S) -> None:
        self._loop = loop
        self._previous = loop.get_exception_handler()
        self._last: OSError | None = None
        self.log = ThrottledLog(self._emit, interval_s)
        loop.set_exception_handler(self)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if (
            isinstance(exc, OSError)
            and exc.errno in _ACCEPT_ERRNOS
            and "accept" in context.get("message", "")
        ):
            self._last = exc
            self.log.hit()
        elif self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)

    def _emit(self, count: int) -> None:
        log.error(
            "accept() failed %d time(s) in the last %g s (%s): new connections wait in the "
            "backlog; lower --max-connections or raise the open-file limit",
            count,
            self.log._interval_s,
            self._last.strerror if self._last is not None else "out of resources",
        )

    def close(self) -> None:
        """Put the previous handler back."""
        self.log.close()
        self._loop.set_exception_handler(self._previous)


_BUSY_BODY = json.dumps(
    ApiError(
        503,
        "the server has too many open connections (--max-connections): retry shortly",
        code="server_busy",
    ).body()
).encode()
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\nRetry-After: {BUSY_RETRY_AFTER_S}\r\n".encode()
    + b"Connection: close\r\n\r\n"
    + _BUSY_BODY
)
"""The answer to a connection past the cap (written whole, before the request is read)."""


def is_probe(request_line: bytes) -> bool:
    """``GET`` or ``HEAD`` of ``/health`` or ``/ready`` (a query allowed)."""
    parts = request_line.split()
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
        return False
    return parts[1].split(b"?", 1)[0] in PROBE_PATHS


class ConnectionGate:
    """The listeners' protocol factory. A connection within ``max_connections`` is served by
    aiohttp's handler (``server()``). At the cap, the connection idle longest (no request in
    flight for :data:`EVICT_IDLE_S` at least: a half-sent head, a parked keep-alive), else
    the one whose request body has trickled in longest, is closed to admit the new one, so
    slow clients cannot crowd out requests; failing that, up to :data:`PROBE_RESERVE` more are read for a probe and the rest answered
    :data:`BUSY_RESPONSE` and closed. Served connections whose output stalls for
    ``write_timeout_s`` are aborted."""

    def __init__(self, server: Callable[[], asyncio.Protocol], limits: Limits) -> None:
        self.server = server
        self.limits = limits
        self.served = 0
        self.probing = 0
        # Served connections with no request in flight, oldest first, and since when.
        self._idle: OrderedDict[_Connection, float] = OrderedDict()
        self._by_transport: dict[asyncio.BaseTransport, _Connection] = {}
        self._open: set[_Connection] = set()  # served or read for a probe
        self._sweep: asyncio.Task | None = None
        self.refused = ThrottledLog(self._emit_refused)
        self.evicted = ThrottledLog(self._emit_evicted)
        self.stalled = ThrottledLog(self._emit_stalled)

    def __call__(self) -> asyncio.Protocol:
        return _Connection(self)

    def admit(self, conn: _Connection) -> str:
        """``"served"``, ``"probe"`` or ``"refused"``: what a new connection gets."""
        if self.served >= self.limits.max_connections:
            self._evict_idle()
        if self.served < self.limits.max_connections:
            self.served += 1
            self._open.add(conn)
            return "served"
        if self.probing < PROBE_RESERVE:
            self.probing += 1
            self._open.add(conn)
            return "probe"
        self.refused.hit()
        return "refused"

    def _evict_idle(self) -> None:
        """Abort the connection idle longest (if for :data:`EVICT_IDLE_S` at least), else the
        one whose request body has been arriving longest: a slow-loris head, a parked
        keep-alive, a trickled body make way for a new connection."""
        horizon = asyncio.get_running_loop().time() - EVICT_IDLE_S
        conn = self._oldest_idle(horizon) or self._oldest_upload(horizon)
        if conn is None:
            return
        self._forget(conn)
        conn.kind = "evicted"  # no longer counted: the new connection takes its place
        self.served -= 1
        self.evicted.hit()
        conn.transport.abort()  # at once: its file descriptor is the new connection's

    def _oldest_idle(self, horizon: float) -> _Connection | None:
        """The longest idle since before ``horizon`` with nothing left to send (a slow reader
        still receiving its last answer is the write timeout's)."""
        for conn, since in self._idle.items():
            if since > horizon:
                return None  # the rest are younger
            if conn.transport is not None and conn.transport.get_write_buffer_size() == 0:
                return conn
        return None

    def _oldest_upload(self, horizon: float) -> _Connection | None:
        """The connection whose request body has been arriving longest, since before ``horizon``."""
        uploads = [
            conn
            for conn in self._by_transport.values()
            if conn.request is not None and not conn.request.content.is_eof() and conn.busy_since <= horizon
        ]
        return min(uploads, key=lambda conn: conn.busy_since, default=None)

    def start(self) -> None:
        """Check every open connection's output once per tick (the write timeout)."""
        self._sweep = asyncio.get_running_loop().create_task(self._check_outputs())

    async def _check_outputs(self) -> None:
        loop = asyncio.get_running_loop()
        tick = min(1.0, self.limits.write_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for conn in list(self._open):
                conn.check_output(now)

    def serving(self, conn: _Connection) -> None:
        """``conn`` is served and waits for its first request."""
        self._by_transport[conn.transport] = conn  # type: ignore[index]
        self._idle[conn] = asyncio.get_running_loop().time()

    def busy(self, request: web.BaseRequest) -> _Connection | None:
        """``request``'s handler runs on its connection: not idle until ``done``."""
        transport = request.transport
        conn = self._by_transport.get(transport) if transport is not None else None
        if conn is not None:
            conn.requests += 1
            conn.request, conn.busy_since = request, asyncio.get_running_loop().time()
            self._idle.pop(conn, None)
        return conn

    def done(self, conn: _Connection) -> None:
        conn.requests -= 1
        conn.request = None
        if conn.requests == 0 and conn.transport in self._by_transport:
            self._idle[conn] = asyncio.get_running_loop().time()

    def lost(self, conn: _Connection) -> None:
        """``conn`` has closed: its place is free."""
        if conn.kind == "served":
            self.served -= 1
        elif conn.kind == "probe":
            self.probing -= 1
        self._forget(conn)
        self._open.discard(conn)

    def _forget(self, conn: _Connection) -> None:
        self._idle.pop(conn, None)
        if self._by_transport.get(conn.transport) is conn:  # type: ignore[arg-type]
            del self._by_transport[conn.transport]  # type: ignore[arg-type]

    def _emit_refused(self, count: int) -> None:
        log.warning(
            "%d connection(s) refused (503 server_busy) in the last %g s: the cap of %d open "
            "connections (--max-connections) was reached",
            count,
            ACCEPT_LOG_INTERVAL_S,
            self.limits.max_connections,
        )

    def _emit_evicted(self, count: int) -> None:
        log.warning(
            "%d idle connection(s) closed in the last %g s to admit new ones: the cap of %d open "
            "connections (--max-connections) was reached",
            count,
            ACCEPT_LOG_INTERVAL_S,
            self.limits.max_connections,
        )

    def _emit_stalled(self, count: int) -> None:
        log.info(
            "%d connection(s) aborted: their client read nothing for %g s (--write-timeout)",
            count,
            self.limits.write_timeout_s,
        )

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        for throttled in (self.refused, self.evicted, self.stalled):
            throttled.close()


class _Connection(asyncio.Protocol):
    """One accepted connection, in front of aiohttp's protocol (``inner``) once served."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.kind = ""
        self.requests = 0  # handlers running on this connection
        self.request: web.BaseRequest | None = None  # the latest of them
        self.busy_since = 0.0
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport | None = None
        self._head = b""  # a probe candidate's first bytes
        self._timer: asyncio.TimerHandle | None = None
        self._unsent = 0  # output waiting in the transport at the last check
        self._stalled_since = 0.0  # since when it has not shrunk

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.kind = self.gate.admit(self)
        if self.kind == "served":
            self.gate.serving(self)
            self._serve(b"")
        elif self.kind == "probe":
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.gate.limits.header_timeout_s, transport.close)
        else:
            self._refuse()

    def done(self) -> None:
        """A request's handler on this connection has ended."""
        self.gate.done(self)

    def _serve(self, data: bytes) -> None:
        self.inner = self.gate.server()
        self.inner.connection_made(self.transport)
        if data:
            self.inner.data_received(data)

    def _refuse(self) -> None:
        assert self.transport is not None
        self.transport.write(BUSY_RESPONSE)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
        elif self.kind == "probe" and self.transport is not None and not self.transport.is_closing():
            self._head += data
            line, found, _ = self._head.partition(b"\n")
            if not found and len(self._head) <= _REQUEST_LINE_MAX:
                return
            self._cancel_timer()
            if found and is_probe(line.rstrip(b"\r")):
                self._serve(self._head)
            else:
                self._refuse()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.gate.lost(self)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self._unsent = 0  # the buffer drained below its low-water mark: progress
        if self.inner is not None:
            self.inner.resume_writing()

    def check_output(self, now: float) -> None:
        """Abort the connection when output has waited ``write_timeout_s`` in its buffer
        without any of it going out (the client reads nothing): whether its handler is
        blocked on the full buffer or has ended and the close waits for the flush."""
        if self.transport is None:
            return
        unsent = self.transport.get_write_buffer_size()
        if unsent == 0 or self._unsent == 0 or unsent < self._unsent:
            self._unsent, self._stalled_since = unsent, now  # idle, a new stall, or progress
            return
        self._unsent = unsent
        if now - self._stalled_since >= self.gate.limits.write_timeout_s:
            self.gate.stalled.hit()
            self.transport.abort()  # connection_lost cancels the handler, which aborts its requests

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


@dataclass
class FrontDoor:
    """The app served on already bound, listening sockets through a :class:`ConnectionGate`,
    with aiohttp's keep-alive timer as the header timeout and accept errors throttled."""

    runner: web.AppRunner
    gate: ConnectionGate
    servers: list[asyncio.base_events.Server]
    accept_errors: AcceptErrorLog

    @classmethod
    async def open(
        cls, app: web.Application, sockets: Sequence, limits: Limits, *, shutdown_timeout_s: float = 2.0
    ) -> FrontDoor:
        """Start ``app`` (its on_startup runs) and serve it on ``sockets``."""
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=shutdown_timeout_s,
            # Closes a connection that has no complete request head this long after it opened
            # or after its last response (aiohttp's idle timer; trickled bytes do not reset it).
            keepalive_timeout=limits.header_timeout_s,
        )
        await runner.setup()
        loop = asyncio.get_running_loop()
        gate = ConnectionGate(runner.server, limits)
        app[_CUTOFF].gate = gate  # handlers mark their connection busy
        gate.start()
        door = cls(runner=runner, gate=gate, servers=[], accept_errors=AcceptErrorLog(loop))
        try:
            for sock in sockets:
                door.servers.append(await loop.create_server(gate, sock=sock, backlog=LISTEN_BACKLOG))
        except BaseException:
            await door.close()
            raise
        return door

    async def close(self) -> None:
        """Stop listening, then stop the app (in-flight handlers get ``shutdown_timeout_s``)."""
        for server in self.servers:
            server.close()
        try:
            await self.runner.cleanup()
        finally:
            self.gate.close()
            self.accept_errors.close()
