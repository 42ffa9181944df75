"""``loraserve-runtime`` as a real subprocess: started with flags, waited on until it serves,
and killed if a test leaves it running."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp


@contextlib.contextmanager
def runtime_process(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    """``python -m loraserve.runtime ARGS`` with its output in ``log``; killed on exit if still
    running (a test that passes waits for it to end on its own)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraserve.runtime", *args],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        # the repository root must not shadow the standard library's `operator`
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    """Poll ``url``'s ``/ready`` until it answers 200; fail, with the log's tail, if the
    process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)


async def ready_turns_503(session: aiohttp.ClientSession, url: str, tries: int) -> dict | None:
    """Poll ``url``'s ``/ready`` every 10 ms, ``tries`` times at most: the body of its first
    503 (a draining runtime's answer), or None if it never turned 503."""
    for _ in range(tries):
        async with session.get(url + "/ready") as r:
            if r.status == 503:
                return await r.json()
        await asyncio.sleep(0.01)
    return None
