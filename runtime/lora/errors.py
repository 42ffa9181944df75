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


class AdapterCapacityError(AdapterError):
    """The adapter pool is full (loaded adapters, pinned slots, or distinct adapters per batch)."""

    http_status = 503
