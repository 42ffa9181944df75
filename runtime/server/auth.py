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
    try:
        # aiohttp keeps undecodable header bytes as lone surrogates (surrogateescape).
        given_bytes = given.strip().encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            401,
            "the Authorization header is not valid UTF-8: send 'Authorization: Bearer <token>' with the "
            "token as configured (--admin-token-file)",
            code="invalid_token",
            headers=_CHALLENGE,
        ) from None
    if not hmac.compare_digest(given_bytes, token.encode()):
        raise ApiError(
            401,
            "the admin bearer token in the Authorization header is not valid",
            code="invalid_token",
            headers=_CHALLENGE,
        )
