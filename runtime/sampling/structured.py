"""Structured output: a request's text held to a JSON schema, a regex or a grammar.

Compiled with xgrammar (the library vLLM and SGLang use by default): a grammar is compiled
once against the tokenizer's vocabulary, in a worker process that is killed when the
compile runs past ``--structured-compile-timeout`` or its last client leaves
(:mod:`.grammar_workers`), and cached by constraint. Each request gets its own matcher,
which says after every committed token which tokens may come next (a bitmask over the
vocabulary). The engine advances the matcher as tokens are committed; a speculative verify
asks for the masks of every draft position at once (:meth:`Constraint.verify_masks`),
walking the drafts and rolling back, so the verify applies exactly the mask a plain step
would have applied at each position.

Before compiling, a constraint is checked against cheap bounds (:mod:`.structured_limits`):
its size, enum values, repetition counts; JSON schema numbers without bounds get some.

xgrammar is imported on first use: a runtime that never sees a constrained request never
loads it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..contract.config import ServerConfig
from .grammar_workers import (
    CompileCancelled,
    CompileFailed,
    CompileTimeout,
    GrammarWorkers,
    WorkersBusy,
    WorkerStartFailed,
)
from .params import SamplingParamsError, StructuredOutput
from .structured_limits import FIELD, bound_numbers, check_schema, check_spec, kind_name

_CACHE_SIZE = 64  # compiled grammars kept (by constraint); json_object is always one of them


class Constraint:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past a committed token; False if the grammar does not allow it."""
        if self._matcher.is_terminated():
            return True  # the stop token that ended it, or text after it (ignore_eos)
        return bool(self._matcher.accept_token(int(token_id)))

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab]``: the tokens that may come next."""
        return self.verify_masks([])[0]

    def verify_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Bool ``[len(drafts) + 1, vocab]``: row ``j`` allows the tokens that may follow the
        committed text plus ``drafts[:j]``. Rows after a draft the grammar refuses repeat the
        refusing row (that draft is rejected there, so later rows are never used); rows after
        the grammar has ended (its stop token was drafted) allow everything, unused likewise."""
        import xgrammar as xgr

        rows = len(drafts) + 1
        bitmask = xgr.allocate_token_bitmask(rows, self.vocab_size)
        accepted = 0
        for j in range(rows):
            if self._matcher.is_terminated():
                bitmask[j:] = -1
                break
            self._matcher.fill_next_token_bitmask(bitmask, j)
            if j == rows - 1 or not self._matcher.accept_token(int(drafts[j])):
                bitmask[j + 1 :] = bitmask[j]
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return _unpack(bitmask, self.vocab_size)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask ``[rows, ceil(vocab/32)]`` as bool ``[rows, vocab]``."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask[:, :, None] >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class ConstraintBusyError(SamplingParamsError):
    """No compile worker became free (or started) in time: the server's fault (a 503), not
    the request's."""


class ConstraintCancelled(SamplingParamsError):
    """Every client waiting for the compile left before it ended."""


@dataclass
class _Compile:
    """One compile of one constraint, shared by every request that waits for it."""

    future: concurrent.futures.Future
    cancel: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0


class ConstraintCompiler:
    """Compiles constraints against one tokenizer, in worker processes, with a cache.

    Identical constraints share one compile (cached by spec text, bounded LRU); different
    ones compile at once, one per worker. A compile is bounded by ``timeout_s`` (its worker
    is killed past it) and stopped when its last waiter leaves (:meth:`compile_async`
    cancelled). ``max_bytes`` bounds a constraint's text. Both are the server's settings
    (``structured_max_bytes``, ``structured_compile_timeout_s``; None: their defaults).
    Thread-safe: the lock guards the cache and the waiter counts only, never a compile.
    """

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_bytes: int | None = None,
        timeout_s: float | None = None,
        max_workers: int | None = None,
    ) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop = sorted(int(t) for t in stop_token_ids)
        defaults = ServerConfig()
        self.max_bytes = defaults.structured_max_bytes if max_bytes is None else max_bytes
        self.timeout_s = defaults.structured_compile_timeout_s if timeout_s is None else timeout_s
        self._max_workers = max_workers
        self._info = None  # xgrammar TokenizerInfo, built on first use
        self._workers: GrammarWorkers | None = None
        self._cache: OrderedDict[StructuredOutput, _Compile] = OrderedDict()
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # builds the tokenizer tables and the pool, once
        # One thread per compile in flight (each waits on its worker); queued ones count
        # against their wait bound from submission.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=32, thread_name_prefix="loraserve-grammar"
        )
        self.compiles = 0
        """Compiles started (a cache hit starts none)."""

    @property
    def workers(self) -> GrammarWorkers:
        """The compile worker pool (started on first use)."""
        with self._start_lock:
            if self._workers is None:
                self._workers = GrammarWorkers(
                    self._tokenizer_info().serialize_json(), max_workers=self._max_workers
                )
                weakref.finalize(self, GrammarWorkers.close, self._workers)
            return self._workers

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher for ``spec`` (it rolls back any number of tokens, as a verify
        needs); blocks while ``spec`` compiles. :class:`SamplingParamsError` naming
        ``response_format`` when the schema, regex or grammar is refused or does not compile
        in time, or when xgrammar is not installed."""
        xgr = _xgrammar()
        entry = self._join(spec)
        try:
            compiled = entry.future.result()
        finally:
            self._leave(spec, entry)
        return Constraint(xgr.GrammarMatcher(compiled), self._vocab_size)

    async def compile_async(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` into the cache without blocking the event loop; cancelling the
        awaiting task (a client that left) stops the compile if no one else waits for it."""
        _xgrammar()
        entry = self._join(spec)
        try:
            await asyncio.wrap_future(entry.future)
        finally:
            self._leave(spec, entry)

    def close(self) -> None:
        """Stop the compile workers."""
        with self._start_lock:
            workers = self._workers
        if workers is not None:
            workers.close()

    def _join(self, spec: StructuredOutput) -> _Compile:
        """The compile of ``spec``: cached, in flight, or started now; the caller waits on it
        (and calls :meth:`_leave` after). A new constraint is checked first (cheap)."""
        with self._lock:
            entry = self._usable(spec)
            if entry is not None:
                entry.waiters += 1
                return entry
        job = _worker_job(spec, self.max_bytes)  # outside the lock: parses up to max_bytes
        with self._lock:
            entry = self._usable(spec)
            if entry is None:
                entry = _Compile(concurrent.futures.Future())
                # Running from the start: a waiter's cancel never cancels the shared future.
                entry.future.set_running_or_notify_cancel()
                self._cache[spec] = entry
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
                self.compiles += 1
                self._threads.submit(self._run, spec, job, entry, time.monotonic() + self.timeout_s)
            entry.waiters += 1
            return entry

    def _usable(self, spec: StructuredOutput) -> _Compile | None:
        """The cached compile of ``spec`` unless it failed or was abandoned (lock held)."""
        entry = self._cache.get(spec)
        if entry is None or entry.cancel.is_set() or _failed(entry.future):
            return None
        self._cache.move_to_end(spec)
        return entry

    def _leave(self, spec: StructuredOutput, entry: _Compile) -> None:
        """A waiter is done with ``entry``; the last one to leave an unfinished compile stops it."""
        with self._lock:
            entry.waiters -= 1
            if entry.waiters == 0 and not entry.future.done():
                entry.cancel.set()
                if self._cache.get(spec) is entry:
                    del self._cache[spec]

    def _run(self, spec: StructuredOutput, job: tuple[str, str], entry: _Compile, wait_until: float) -> None:
        """Compile ``spec`` on a worker (in a pool thread) and settle ``entry``; a failure
        leaves the cache so that the next request tries again."""
        try:
            entry.future.set_result(self._compile(spec, job, entry.cancel, wait_until))
        except BaseException as exc:
            with self._lock:
                if self._cache.get(spec) is entry:
                    del self._cache[spec]
            entry.future.set_exception(exc)

    def _compile(
        self, spec: StructuredOutput, job: tuple[str, str], cancel: threading.Event, wait_until: float
    ):
        xgr = _xgrammar()
        kind, text = job
        what = kind_name(spec)
        try:
            payload = self.workers.compile(
                kind, text, timeout_s=self.timeout_s, wait_until=wait_until, cancel=cancel
            )
        except CompileTimeout:
            raise SamplingParamsError(
                FIELD,
                f"the {what} took longer than {self.timeout_s:g} s to compile: simplify it, or start the server "
                "with a larger --structured-compile-timeout",
            ) from None
        except WorkersBusy:
            raise ConstraintBusyError(
                FIELD,
                f"every structured-output compiler stayed busy for {self.timeout_s:g} s: retry later",
            ) from None
        except WorkerStartFailed:
            raise ConstraintBusyError(
                FIELD, "structured output is unavailable: the grammar compiler did not start; retry later"
            ) from None
        except CompileCancelled:
            raise ConstraintCancelled(FIELD, "the request ended before its constraint compiled") from None
        except CompileFailed as exc:
            raise SamplingParamsError(FIELD, f"the {what} cannot be used: {exc}") from None
        return xgr.CompiledGrammar.deserialize_json(payload, self._tokenizer_info())

    def _tokenizer_info(self):
        if self._info is None:
            self._info = _xgrammar().TokenizerInfo.from_huggingface(
                self._hf, vocab_size=self._vocab_size, stop_token_ids=self._stop or None
            )
        return self._info


def _failed(future: concurrent.futures.Future) -> bool:
    return future.done() and future.exception() is not None


def _worker_job(spec: StructuredOutput, max_bytes: int) -> tuple[str, str]:
    """What a worker compiles for ``spec``: (kind, text), once ``spec`` passed the cheap
    checks; a schema gets its number bounds."""
    if spec.kind == "json_object":
        # OpenAI's json_object is an object (the builtin JSON grammar allows any value).
        return "json_schema", '{"type": "object"}'
    check_spec(spec, max_bytes)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as exc:
            raise SamplingParamsError(FIELD, f"the JSON schema is not valid JSON: {exc.msg}") from None
        if not isinstance(schema, dict):
            raise SamplingParamsError(FIELD, "the JSON schema cannot be used: a JSON schema is an object")
        check_schema(schema)
        return "json_schema", json.dumps(bound_numbers(schema))
    return spec.kind, spec.spec


def _xgrammar():
    """The xgrammar module, or a 400-worthy error naming what is missing (never a 500)."""
    try:
        import xgrammar
    except ImportError as exc:
        raise SamplingParamsError(
            FIELD,
            "structured output is not available on this server: the xgrammar package is not "
            f"installed ({exc}); install loraserve's dependencies, or send the request without a constraint",
        ) from exc
    return xgrammar
