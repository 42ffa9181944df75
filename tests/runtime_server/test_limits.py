"""The front door's rules in isolation: the derived connection cap, an explicit cap above the
file limit, what counts as a probe, and accept errors logged once per interval (through a
real event loop's exception handler, as asyncio reports them)."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource

import pytest

from loraserve.runtime.contract.config import ServerConfig
from loraserve.runtime.server.limits import (
    DERIVED_CEILING,
    FD_RESERVE,
    AcceptErrorLog,
    Limits,
    connection_cap,
    derived_max_connections,
    is_probe,
)


@pytest.mark.parametrize(
    ("soft", "cap"),
    [
        (1024, 768),  # 75 % binds
        (1 << 20, DERIVED_CEILING),
        (16000, 12000),
        (128, 128 - FD_RESERVE),  # the reserve binds
        (64, 1),
        (resource.RLIM_INFINITY, DERIVED_CEILING),
    ],
)
def test_derived_cap(soft, cap):
    assert derived_max_connections(soft) == cap


def test_cap_above_file_limit_lowered(caplog):
    assert connection_cap(0, 1024) == 768
    assert connection_cap(100, 1024) == 100
    assert connection_cap(100_000, 1 << 20) == 100_000  # above the derived ceiling: asked for
    with caplog.at_level(logging.WARNING, logger="loraserve.server"):
        assert connection_cap(5000, 1024) == 768
    assert "--max-connections 5000" in caplog.text and "ulimit -n" in caplog.text


def test_limits_from_defaults():
    limits = Limits.from_config(ServerConfig(), soft_limit=1024)
    assert limits == Limits(header_timeout_s=10.0, write_timeout_s=60.0, max_connections=768)


@pytest.mark.parametrize(
    ("line", "probe"),
    [
        (b"GET /health HTTP/1.1", True),
        (b"GET /ready?verbose=1 HTTP/1.1", True),
        (b"HEAD /ready HTTP/1.1", True),
        (b"POST /health HTTP/1.1", False),
        (b"GET /healthz HTTP/1.1", False),
        (b"GET /v1/models HTTP/1.1", False),
        (b"GET /health", False),
    ],
)
def test_probe_lines(line, probe):
    assert is_probe(line) is probe


def _accept_failed(loop: asyncio.AbstractEventLoop) -> None:
    """What asyncio's ``_accept_connection`` reports when accept() hits EMFILE."""
    loop.call_exception_handler(
        {
            "message": "socket.accept() out of system resource",
            "exception": OSError(errno.EMFILE, "Too many open files"),
        }
    )


async def test_accept_errors_once_per_interval(caplog):
    loop = asyncio.get_running_loop()
    others: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: others.append(context))
    accept_errors = AcceptErrorLog(loop, interval_s=0.3)
    try:
        with caplog.at_level(logging.ERROR, logger="loraserve.server"):
            for _ in range(500):
                _accept_failed(loop)
            assert len(caplog.records) == 1 and "1 time(s)" in caplog.text
            await asyncio.sleep(0.5)
            assert len(caplog.records) == 2, caplog.text
            assert "499 time(s) in the last 0.3 s (Too many open files)" in caplog.records[1].getMessage()
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
        assert [c["message"] for c in others] == ["something else"]
    finally:
        accept_errors.close()
    _accept_failed(loop)  # the previous handler is back
    assert len(others) == 2
    loop.set_exception_handler(None)
