"""Bearer-token protection for the admin routes."""

from __future__ import annotations

import hmac

from aiohttp import web

from .errors import ApiError

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="loraserve-admin"'}


def check_bearer(request: web.Request, token: str | None) -> None:
    """Raise 401 unless ``Authorization: Bearer <token>`` matches; open when no token is set.

    The comparison is constant-time, so the token cannot be guessed byte by byte.
    """
    if not token:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise ApiError(
            401,
            "this admin route needs an 'Authorization: Bearer <token>' header",
            code="missing_token",
            headers=_CHALLENGE,
        )
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise ApiError(401, "the admin bearer token is not valid", code="invalid_token", headers=_CHALLENGE)
