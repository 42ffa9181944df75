"""Adapter errors: each names the field or tensor at fault and how to fix it.

``http_status`` lets the server map an error to a response without string matching.
"""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter could not be loaded or used; nothing the manager held was changed."""

    http_status = 400

    def __init__(self, message: str, *, field: str | None = None, adapter: str | None = None):
        super().__init__(message)
        self.field = field
        self.adapter = adapter


class AdapterNotFoundError(AdapterError):
    """The named adapter is not loaded (or is being unloaded)."""

    http_status = 404


class AdapterConflictError(AdapterError):
    """The name is already used by an adapter from a different path."""

    http_status = 409


class AdapterDrainingError(AdapterConflictError):
    """The name's previous adapter was unloaded but still serves its in-flight requests;
    a load from another path must wait until they finish. Transient (503): a retry once
    they end succeeds, so callers that give up on a 4xx (the operator, on-demand loads that
    remember failures) retry instead."""

    http_status = 503

    def __init__(
        self, message: str, *, field: str | None = None, adapter: str | None = None, in_flight: int = 0
    ):
        super().__init__(message, field=field, adapter=adapter)
        self.in_flight = in_flight


class AdapterCapacityError(AdapterError):
    """The adapter pool is full (loaded adapters, pinned slots, or distinct adapters per batch)."""

    http_status = 503
