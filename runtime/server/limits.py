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
- ``--max-connections`` (0: derived, :func:`derived_max_connections`): open client
  connections at most. Past it a connection is answered 503 ``server_busy`` with
  ``Retry-After`` and closed at once, except that up to :data:`PROBE_RESERVE` more are read
  for a ``GET /health`` or ``/ready`` (kubelet probes), which are served.
- ``--max-body-bytes`` (4 MiB): ``Expect: 100-continue`` with a larger ``Content-Length``
  gets 413 without ``100 Continue`` (:func:`expect_handler`).
- Accept errors (``EMFILE`` ...) are logged at most once per :data:`ACCEPT_LOG_INTERVAL_S`
  with a count (:class:`AcceptErrorLog`).
- When the drain timeout ends, requests still in flight that have sent nothing get 503
  ``shutting_down`` with ``Retry-After`` (:func:`cut_off`); started streams are cut.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass, field

from aiohttp import web

from ..contract.config import ServerConfig
from .errors import MAX_BODY_KEY, ApiError, _too_large
from .state import STATE

log = logging.getLogger("loraserve.server")

FD_RESERVE = 64
"""File descriptors the derived connection cap leaves to the process itself (model and
adapter files, logs, sockets to adapter sources and peers, the event loop's own)."""

PROBE_RESERVE = 8
"""Connections past the cap read for a probe (``GET /health`` or ``/ready``), which is served;
they count within :data:`FD_RESERVE`."""

PROBE_PATHS = (b"/health", b"/ready")

ACCEPT_LOG_INTERVAL_S = 10.0
"""Accept errors are logged at most once per this many seconds, with their count."""

BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` on a connection refused past the cap."""

_REQUEST_LINE_MAX = 8190  # aiohttp's own max_line_size: a longer first line is no probe


def derived_max_connections(soft_limit: int) -> int:
    """The connection cap for a process allowed ``soft_limit`` open files: that limit less
    :data:`FD_RESERVE` and at most 75 % of it (at least 1). An unlimited soft limit
    (``RLIM_INFINITY``) counts as 2**20."""
    if soft_limit < 0 or soft_limit == resource.RLIM_INFINITY:
        soft_limit = 1 << 20
    return max(1, min(soft_limit - FD_RESERVE, soft_limit * 3 // 4))


def connection_cap(requested: int, soft_limit: int | None = None) -> int:
    """``--max-connections`` resolved: 0 means derived from the file limit; a larger value
    than the derived one is lowered to it (past it accept() fails and the process runs out
    of files), with a warning."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    derived = derived_max_connections(soft_limit)
    if requested <= 0:
        return derived
    if requested > derived:
        log.warning(
            "--max-connections %d is above what the file limit (%d open files) allows: using %d "
            "(raise the limit, e.g. `ulimit -n`, to allow more)",
            requested,
            soft_limit,
            derived,
        )
        return derived
    return requested


@dataclass(frozen=True)
class Limits:
    """The front door's limits, resolved (``max_connections`` is never 0)."""

    header_timeout_s: float
    body_timeout_s: float
    write_timeout_s: float
    max_connections: int

    @classmethod
    def from_config(cls, server: ServerConfig, soft_limit: int | None = None) -> Limits:
        return cls(
            header_timeout_s=server.header_timeout_s,
            body_timeout_s=server.body_timeout_s,
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
            417, f"unsupported Expect: {expect[:64]!r}: send Expect: 100-continue or none",
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
    """The handlers in flight, and whether the drain's end has cancelled them."""

    tasks: set[asyncio.Task] = field(default_factory=set)
    cancelled: set[asyncio.Task] = field(default_factory=set)
    fired: bool = False


_CUTOFF = web.AppKey("loraserve_cutoff", _Cutoff)
_STARTED = "loraserve_response_started"


@web.middleware
async def cutoff_middleware(request: web.Request, handler):
    """A handler cancelled by :func:`cut_off` before its response started answers 503
    ``shutting_down`` (the drain's own answer) instead of leaving the client without one."""
    cutoff = request.app[_CUTOFF]
    me = asyncio.current_task()
    if me is None:
        return await handler(request)
    cutoff.tasks.add(me)
    try:
        return await handler(request)
    except asyncio.CancelledError:
        if me not in cutoff.cancelled or request.get(_STARTED):
            raise
        me.uncancel()
        return _shutting_down(request)
    finally:
        cutoff.tasks.discard(me)
        cutoff.cancelled.discard(me)


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
    request[_STARTED] = True


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
    cutoff.fired = True
    for task in list(cutoff.tasks):
        if not task.done():
            cutoff.cancelled.add(task)
            task.cancel()
    return len(cutoff.cancelled)
