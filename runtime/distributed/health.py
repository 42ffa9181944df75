"""Whether this process's tensor-parallel group can still serve, and what happens when not.

A group that lost a rank (it exited, a collective failed or timed out, ranks diverged)
cannot be repaired in place: the pod must restart. :func:`report_failure` records the
first reason, tells whoever registered (the HTTP server turns ``/ready`` to 503 and
fails requests), and, after a short grace period for that, ends the process with
:data:`EXIT_TP_FAILURE`, so the orchestrator restarts the pod.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("loraserve.distributed")

EXIT_TP_FAILURE = 75
"""Exit status of a process whose tensor-parallel group failed."""


class TPHealth:
    """The failure state of one process; thread-safe."""

    def __init__(self, *, exit_on_failure: bool = True, grace_s: float = 2.0):
        self.exit_on_failure = exit_on_failure
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._callbacks: list[Callable[[str], None]] = []

    @property
    def failure(self) -> str | None:
        """The first failure's description, or None while the group is healthy."""
        return self._reason

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once when the group fails (at once if it already has)."""
        with self._lock:
            reason = self._reason
            if reason is None:
                self._callbacks.append(callback)
                return
        callback(reason)

    def report_failure(self, reason: str) -> None:
        """Record ``reason`` (the first one wins), notify, and schedule the exit."""
        with self._lock:
            if self._reason is not None:
                log.error("tensor-parallel group: also %s", reason)  # what else broke, for the log
                return
            self._reason = reason
            callbacks = list(self._callbacks)
        log.error("tensor-parallel group failed: %s", reason)
        print(f"loraserve-runtime: tensor-parallel group failed: {reason}", file=sys.stderr, flush=True)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("a tensor-parallel failure callback raised")
        if self.exit_on_failure:
            timer = threading.Timer(self.grace_s, _exit_now)
            timer.daemon = True
            timer.start()


def _exit_now() -> None:
    # No clean-up: other threads may be blocked in collectives that will never complete.
    sys.stderr.flush()
    os._exit(EXIT_TP_FAILURE)


_HEALTH = TPHealth()


def health() -> TPHealth:
    """This process's tensor-parallel health (one per process)."""
    return _HEALTH


def failure_reason() -> str | None:
    """Why this process's tensor-parallel group failed, or None (also for a single GPU)."""
    return _HEALTH.failure


def reset_health(*, exit_on_failure: bool = True, grace_s: float = 2.0) -> TPHealth:
    """A fresh health state (the launcher calls this when it starts a group)."""
    global _HEALTH
    _HEALTH = TPHealth(exit_on_failure=exit_on_failure, grace_s=grace_s)
    return _HEALTH
