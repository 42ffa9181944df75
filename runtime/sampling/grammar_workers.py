"""Grammar compiles in worker processes that can be stopped.

xgrammar compiles in C++ and cannot be interrupted from Python: a compile that runs past its
bound, or whose clients have all gone, is stopped by killing the process doing it. Workers
are forked from a forkserver that imported xgrammar once, so replacing a killed one costs
milliseconds, not an interpreter start. A worker compiles one grammar at a time and sends it
back serialized (``CompiledGrammar.serialize_json``); the server deserializes it against its
own ``TokenizerInfo``. A worker that crashes on a grammar takes only itself down.

Invariants: a worker is either idle (in the pool) or held by exactly one compile; a worker
that was killed or died is never returned to the pool; at most ``max_workers`` are alive.
This module imports nothing heavy at its top: the forkserver preloads it.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

WORKER_START_TIMEOUT_S = 120.0
"""Longest wait for a worker to start: the first one starts the forkserver, which imports
xgrammar (and torch) once; later ones are forks and take milliseconds."""
_POLL_S = 0.02  # how often a waiting compile checks its deadline and its cancel event


class CompileTimeout(Exception):
    """The compile ran past its time bound; its worker was killed."""


class CompileCancelled(Exception):
    """Every client waiting for the compile left; its worker (if any) was killed."""


class CompileFailed(Exception):
    """The grammar does not compile (xgrammar's message), or the worker died on it."""


class WorkersBusy(Exception):
    """No worker became free within the wait bound (other compiles hold them all)."""


class WorkerStartFailed(Exception):
    """A worker process did not start (the server's fault, not the grammar's)."""


def default_workers() -> int:
    """Worker processes at most: half the cores, between 2 (a slow compile never blocks a
    second one) and 8 (compiles never take most of a large host)."""
    return max(2, min(8, (os.cpu_count() or 1) // 2))


def _die_with_parent() -> None:
    """Linux: the worker is killed when the process that forked it (the forkserver) exits;
    the forkserver exits when the server does, so no compile outlives the server."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _compile(compiler, kind: str, text: str):
    """One compile; ``kind`` is json_schema (JSON text), regex or grammar (EBNF)."""
    if kind == "json_schema":
        # No free whitespace: a weak model cannot pad to max_tokens with blanks.
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (xgrammar's messages run to many lines), capped."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _worker_main(conn: Connection, tokenizer_info_json: str) -> None:
    """A worker: build the compiler once, then compile what arrives until the pipe closes."""
    _die_with_parent()
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", _compile(compiler, kind, text).serialize_json()))
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / TypeError
            conn.send(("error", first_line(exc)))


class _Worker:
    """One worker process and the server's end of its pipe."""

    def __init__(self, ctx, tokenizer_info_json: str) -> None:
        parent, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_worker_main, args=(child, tokenizer_info_json), name="loraserve-grammar", daemon=True
        )
        self.process.start()
        child.close()
        self.conn = parent
        self.alive = True

    def wait_ready(self, cancel: threading.Event) -> None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        try:
            status, _ = self._answer(deadline, cancel, on_timeout=WorkerStartFailed())
        except CompileFailed:  # it died while starting
            raise WorkerStartFailed() from None
        if status != "ready":
            self.kill()
            raise WorkerStartFailed()

    def run(self, kind: str, text: str, timeout_s: float, cancel: threading.Event) -> str:
        """The serialized compiled grammar; raises CompileTimeout / CompileCancelled
        (the worker killed) or CompileFailed."""
        self.conn.send((kind, text))
        status, payload = self._answer(time.monotonic() + timeout_s, cancel, on_timeout=CompileTimeout())
        if status != "ok":
            raise CompileFailed(payload)
        return payload

    def _answer(self, deadline: float, cancel: threading.Event, *, on_timeout: Exception) -> tuple[str, str]:
        """The worker's next message, or the worker killed once ``deadline`` passes or
        ``cancel`` is set."""
        while not self.conn.poll(_POLL_S):
            if cancel.is_set():
                self.kill()
                raise CompileCancelled()
            if time.monotonic() >= deadline:
                self.kill()
                raise on_timeout
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise CompileFailed("the grammar compiler stopped on it (crashed)") from None

    def kill(self) -> None:
        """Stop the process now (SIGKILL: a C++ compile ignores anything gentler)."""
        self.alive = False
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class GrammarWorkers:
    """A small pool of compile worker processes for one tokenizer. Thread-safe: each compile
    runs in its caller's thread, holding one worker; no lock is held across a compile."""

    def __init__(self, tokenizer_info_json: str, *, max_workers: int | None = None) -> None:
        self._info = tokenizer_info_json
        self.max_workers = max_workers or default_workers()
        self._ctx = multiprocessing.get_context("forkserver")
        # The forkserver (started by the first worker) imports these once; every worker is
        # then a fork with xgrammar loaded. The main module is among them so that a fork
        # finds it imported and does not import it again (so it must guard its entry point,
        # as loraserve-runtime and python -m do). Nothing else in the runtime uses the
        # forkserver.
        self._ctx.set_forkserver_preload(["__main__", __name__, "xgrammar"])
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()  # idle and busy
        self._live = 0
        self._closed = False
        self._cv = threading.Condition()
        self.started = 0
        """Workers started so far (a killed worker is replaced by a new one)."""
        self.killed = 0
        """Workers killed so far (timeouts and cancellations)."""

    def compile(
        self, kind: str, text: str, *, timeout_s: float, wait_until: float, cancel: threading.Event
    ) -> str:
        """Compile on a free worker; wait for one until ``wait_until`` (monotonic), then
        :class:`WorkersBusy`. The compile itself is bounded by ``timeout_s``."""
        worker = self._acquire(wait_until, cancel)
        try:
            return worker.run(kind, text, timeout_s, cancel)
        finally:
            self._release(worker)

    def pids(self) -> list[int]:
        """Process ids of the live workers, idle and busy (for tests and diagnostics)."""
        with self._cv:
            return [w.process.pid for w in self._all if w.process.pid is not None]

    def close(self) -> None:
        """Kill the idle workers; busy ones are killed when their compile returns."""
        with self._cv:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._all.difference_update(idle)
        for worker in idle:
            worker.kill()

    def _acquire(self, wait_until: float, cancel: threading.Event) -> _Worker:
        with self._cv:
            while True:
                if cancel.is_set():
                    raise CompileCancelled()
                if self._closed:
                    raise CompileFailed("the server is shutting down")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_workers:
                    self._live += 1
                    self.started += 1
                    break
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    raise WorkersBusy()
                self._cv.wait(min(remaining, _POLL_S * 5))
        try:  # outside the lock: the first start takes seconds
            worker = _Worker(self._ctx, self._info)
            try:
                worker.wait_ready(cancel)
            except BaseException:
                worker.kill()
                raise
        except BaseException:
            with self._cv:
                self._live -= 1
                self._cv.notify()
            raise
        with self._cv:
            self._all.add(worker)
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._cv:
            if worker.alive and not self._closed:
                self._idle.append(worker)
            else:
                self._all.discard(worker)
                self._live -= 1
                if not worker.alive:
                    self.killed += 1
            self._cv.notify()
        if worker.alive and self._closed:
            worker.kill()
