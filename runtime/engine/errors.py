"""Errors the engine raises to its callers, each carrying an OpenAI-style error body."""

from __future__ import annotations

from .request import RequestError


class EngineError(Exception):
    """A request or command the engine refuses; ``error`` is what the client sees."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: str | None = None) -> EngineError:
        return cls(RequestError(message, status=400, param=param, code=code))

    @classmethod
    def not_found(cls, message: str, param: str | None = None) -> EngineError:
        return cls(
            RequestError(message, status=404, type="not_found_error", param=param, code="model_not_found")
        )


class EngineClosedError(EngineError):
    """The engine is shutting down (or not started) and admits nothing new."""

    def __init__(self, message: str = "the server is shutting down and accepts no new requests") -> None:
        super().__init__(RequestError(message, status=503, type="service_unavailable", code="shutting_down"))
