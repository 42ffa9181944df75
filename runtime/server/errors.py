"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

Handlers raise :class:`ApiError`; the middleware turns it, aiohttp's own HTTP errors (an
oversized body, an unknown route, a wrong method) and unexpected exceptions into that
shape, so a client never sees an HTML error page or a bare stack trace.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..engine.request import RequestError
from ..sampling.params import SamplingParamsError

log = logging.getLogger("loraserve.server")


class ClientFaultLogFilter(logging.Filter):
    """aiohttp logs a request it cannot parse (a line over 8190 bytes, too many headers, a bad
    Content-Length) at ERROR with a traceback: the client's fault, answered 400, and a way
    for anyone to flood the log. Keep it as one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500:
            detail = (str(exc.message).strip().splitlines() or [""])[0][:200]
            record.msg = f"{record.getMessage()}: HTTP {exc.code} {detail}"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_client_faults(logger: logging.Logger | None = None) -> None:
    """Install :class:`ClientFaultLogFilter` on aiohttp's server logger (once)."""
    logger = logger or logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientFaultLogFilter) for f in logger.filters):
        logger.addFilter(ClientFaultLogFilter())


MAX_BODY_KEY = web.AppKey("max_body_bytes", int)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error response; ``param`` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, err: RequestError) -> ApiError:
        return cls(err.status, err.message, param=err.param, code=err.code, type=err.type)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _too_large(limit: int | None, declared: int | None = None) -> web.Response:
    what = f"Content-Length {declared}" if declared is not None else "the request body"
    resp = ApiError(
        413,
        f"{what} exceeds the {limit}-byte limit on request bodies (--max-body-bytes): send a smaller body"
        if limit
        else "request body too large",
        code="body_too_large",
    ).response()
    resp.force_close()  # the unread body is not worth waiting for
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Render every failure as an OpenAI error object.

    A declared ``Content-Length`` over the limit is refused from the header, before any
    body is read (a client announcing a huge body and sending none would otherwise hold
    the connection until it leaves).
    """
    limit = request.app.get(MAX_BODY_KEY)
    if limit and request.content_length is not None and request.content_length > limit:
        return _too_large(limit, request.content_length)
    try:
        return await handler(request)
    except ApiError as exc:
        resp = exc.response()
        if exc.status == 408:
            resp.force_close()  # the rest of the body may still arrive: do not read it as a request
        return resp
    except SamplingParamsError as exc:
        # A parameter the engine refused wherever it was checked: the client's fault, never a 500.
        return ApiError(400, str(exc), param=exc.field, code="invalid_value").response()
    except web.HTTPRequestEntityTooLarge:
        return _too_large(limit)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} is not allowed on {request.path}",
        }.get(exc.status, exc.reason or "error")
        return ApiError(
            exc.status, message, headers={k: v for k, v in exc.headers.items() if k == "Allow"}
        ).response()
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal server error; see the server log", code="internal_error").response()
