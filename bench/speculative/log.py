"""Timestamped progress lines on stdout."""

from __future__ import annotations

import time


def log(msg: str) -> None:
    """Print ``msg`` with the time of day, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
