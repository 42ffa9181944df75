"""The engine loop: continuous batching on a background thread.

Callers (the HTTP server, tests) use the thread-safe methods: :meth:`Engine.submit` a
:class:`Request` whose ``sink`` receives :class:`RequestOutput` increments,
:meth:`Engine.abort` it, load and unload adapters, or run a function between steps with
:meth:`Engine.call`. Everything that touches the model runner and the KV cache happens on
the engine thread, so neither needs locking; the adapter manager is thread-safe, so an
adapter loads (file I/O, validation) on the caller's thread while batches keep running.

A step: take new requests, aborts and commands from the inbox; ask the scheduler for a
plan; retract what it says; run the decoder's extend or decode; hand each request its new
tokens (detokenised, stop conditions applied); finish, free and release what is done.
An exception in a batch is retried request by request, so only the request that causes
it fails; the others continue.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..contract.config import RuntimeConfig
from ..contract.policy.draft_adapters import draft_pool_refusal
from ..lora.errors import AdapterError
from ..sampling import Sampler, SamplingParams, SamplingParamsError, make_generator
from ..sampling.structured import Constraint, ConstraintCompiler
from .decoder import Decoder, DecoderFactory, StepOutput, build_decoder
from .errors import EngineClosedError, EngineError
from .prefix import PrefixReuse
from .request import FinishReason, Request, RequestError, RequestOutput, RequestState
from .scheduler import Scheduler, SchedulerLimits, StepKind, StepPlan, fair_order
from .stats import EngineObserver, EngineSnapshot, StepTotals
from .text import TextStream

log = logging.getLogger("loraserve.engine")

_IDLE_WAIT_S = 0.5


class Engine:
    """Owns the running set and the queue; drives a decoder over a model runner."""

    def __init__(
        self,
        config: RuntimeConfig,
        runner,
        *,
        tokenizer=None,
        decoder: Decoder | None = None,
        decoder_factory: DecoderFactory | None = None,
        observer: EngineObserver | None = None,
        sampler: Sampler | None = None,
        max_admission_defer_steps: int | None = None,
    ) -> None:
        """``decoder``: the decoder to drive; without one the engine builds the standard decoder,
        or, when ``config.speculative.enabled``, the one ``decoder_factory`` builds (the
        speculative package's ``build_decoder``; :class:`DecoderUnavailableError` without it).
        ``max_admission_defer_steps``: how many decode steps admission may wait to batch
        prefills under a backlog (None: the configuration's ``scheduler.max_admission_defer_steps``;
        0: never)."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.sampler = sampler or Sampler(seed=config.seed)
        self.decoder: Decoder = decoder or build_decoder(config, runner, self.sampler, decoder_factory)
        self.observer = observer or EngineObserver()
        self.kv = runner.kv
        self.lora = getattr(runner, "lora", None)
        sched = config.scheduler
        max_running = min(
            sched.max_running_requests, getattr(self.kv, "max_requests", sched.max_running_requests)
        )
        self.limits = SchedulerLimits(
            max_running_requests=max_running,
            max_loras_per_batch=config.lora.max_loras_per_batch,
            chunked_prefill_size=sched.chunked_prefill_size,
            max_prefill_tokens=sched.max_prefill_tokens,
            decode_tokens_per_step=max(int(self.decoder.tokens_per_step), 1),
            max_head_bypass=max(max_running, 1),
            max_admission_defer_steps=(
                sched.max_admission_defer_steps if max_admission_defer_steps is None else max_admission_defer_steps
            ),
        )
        self.scheduler = Scheduler(self.limits)
        # Prefix caching lives in the target's KV pool (scheduler.prefix_cache); this is
        # the engine's side of it: keys, planning hints, reuse at admission, caching at the end.
        self.prefix = PrefixReuse(self.kv, peek_limit=2 * max_running + self.limits.max_head_bypass)
        self.model_context_len = self._model_context_len()
        # What one request can reach: the model's context, or the whole KV cache if smaller.
        self.context_len = min(self.model_context_len, int(getattr(self.kv, "max_context_len", 0) or 10**12))
        self.eos_token_ids: frozenset[int] = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        # Token ids are bounded by the model's embedding (it may be padded past the tokenizer).
        self.vocab_size: int | None = getattr(runner, "vocab_size", None) or getattr(
            tokenizer, "vocab_size", None
        )

        self._constraints: ConstraintCompiler | None = None  # built on the first structured request
        self._cv = threading.Condition()
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._live: dict[str, Request] = {}  # rid -> request, engine thread only
        self._adapter_lock = threading.Lock()
        self._adapter_names: frozenset[str] = frozenset()
        self._pinned: frozenset[str] = frozenset()
        self.refresh_adapters()
        self._steps = 0
        self._extend_totals = StepTotals()
        self._decode_totals = StepTotals()
        self._engine_seconds = 0.0
        self._extends_during_decode = 0
        self._deferred_steps = 0
        self.snapshot = EngineSnapshot(
            kv_total_tokens=self._kv_capacity(),
            kv_free_tokens=self._kv_free(),
            max_loras_per_batch=config.lora.max_loras_per_batch,
            max_running_requests=max_running,
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; requests are accepted from now on."""
        if self._thread is not None:
            return
        self._accepting = True
        self._thread = threading.Thread(target=self._loop, name="loraserve-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop_accepting(self) -> None:
        """Refuse new requests from now on; in-flight ones continue."""
        with self._cv:
            self._accepting = False

    def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to ``drain_timeout_s``,
        abort what is left, and stop the thread."""
        self.stop_accepting()
        deadline = time.monotonic() + drain_timeout_s
        while self.running and time.monotonic() < deadline:
            snap = self.snapshot
            if snap.num_running == 0 and snap.num_waiting == 0 and not self._inbox:
                break
            time.sleep(0.02)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=max(drain_timeout_s, 5.0))

    # ------------------------------------------------------------------ callers' API
    @property
    def adapter_names(self) -> frozenset[str]:
        """Adapters loaded and accepting requests (a snapshot; any thread)."""
        return self._adapter_names

    def prepare(self, request: Request, *, prompt_param: str = "prompt") -> Request:
        """Validate a request and resolve its limits; raise :class:`EngineError` if it
        can never run. Thread-safe and cheap: no model state is touched."""
        params = request.params
        try:
            params.validate(self.vocab_size)
            request.constraint = self._constraint(params)
            if params.min_tokens and self.eos_token_ids:
                # min_tokens masks the model's end-of-sequence ids: they travel in the params.
                request.params = params = replace(params, eos_token_ids=tuple(sorted(self.eos_token_ids)))
        except SamplingParamsError as exc:
            raise EngineError.invalid(str(exc), param=exc.field) from exc
        n = len(request.prompt_ids)
        if n == 0:
            raise EngineError.invalid(f"{prompt_param} is empty: send at least one token", param=prompt_param)
        if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in request.prompt_ids):
            raise EngineError.invalid(
                f"{prompt_param} holds token ids outside the vocabulary [0, {self.vocab_size})",
                param=prompt_param,
            )
        if request.adapter is not None and request.adapter not in self._adapter_names:
            raise EngineError.not_found(
                f"the model {request.adapter!r} does not exist: load the adapter first or pick one of "
                "GET /v1/models",
                param="model",
            )
        if request.adapter is not None and self._slots_pinned_against(request.adapter):
            raise EngineError(_slots_pinned_error(request.adapter, self.limits.max_loras_per_batch))
        # A decode step may append ``tokens_per_step`` tokens before the last is checked.
        slack = self.limits.decode_tokens_per_step - 1
        model_room = self.model_context_len - slack
        capacity = min(self._kv_capacity(), getattr(self.kv, "max_context_len", None) or self._kv_capacity())
        kv_room = capacity - slack
        if n >= model_room:
            raise EngineError.invalid(
                f"This model's maximum context length is {self.model_context_len} tokens, but the "
                f"{prompt_param} has {n} tokens and no room is left to generate: shorten it",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if n >= kv_room:
            raise EngineError.invalid(
                f"the {prompt_param} has {n} tokens but the KV cache holds only {capacity}, leaving no room "
                "to generate: shorten it, or raise --max-total-tokens",
                param=prompt_param,
                code="kv_cache_too_small",
            )
        if params.max_tokens is None:
            max_new = min(model_room, kv_room) - n
        else:
            max_new = params.max_tokens
            if n + max_new > model_room:
                raise EngineError.invalid(
                    f"This model's maximum context length is {self.model_context_len} tokens. However, you "
                    f"requested {n + max_new} tokens ({n} in the {prompt_param}, {max_new} in max_tokens): "
                    "lower max_tokens or shorten the prompt",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            if n + max_new > kv_room:
                raise EngineError.invalid(
                    f"the request needs {n + max_new + slack} KV cache tokens ({n} in the {prompt_param}, "
                    f"{max_new} in max_tokens) but the cache holds only {capacity}: lower max_tokens, or raise "
                    "--max-total-tokens",
                    param="max_tokens",
                    code="kv_cache_too_small",
                )
        request.max_new_tokens = max_new
        return request

    def submit(self, request: Request, *, prompt_param: str = "prompt", prepared: bool = False) -> None:
        """Queue a request; outputs go to ``request.sink``. ``prepared``: :meth:`prepare`
        already accepted it (the adapter is re-checked at intake either way)."""
        if not prepared:
            self.prepare(request, prompt_param=prompt_param)
        with self._cv:
            if not self._accepting:
                raise EngineClosedError()
            request.state = RequestState.QUEUED
            self._inbox.append(("submit", request))
            self._cv.notify()

    def abort(self, rid: str) -> None:
        """Abort a request wherever it is (idempotent; unknown ids are ignored)."""
        with self._cv:
            self._inbox.append(("abort", rid))
            self._cv.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn`` on the engine thread between steps; its result or error lands in the
        returned future. Adapter loads and unloads go through here."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping or self._thread is None:
                future.set_exception(EngineClosedError("the engine is not running"))
                return future
            self._inbox.append(("call", (fn, future)))
            self._cv.notify()
        return future

    def refresh_adapters(self) -> None:
        """Re-read which adapters take requests and which are pinned (any thread)."""
        if self.lora is None:
            return
        with self._adapter_lock:
            infos = self.lora.list()
            serving = [i for i in infos if _state(i) != "unloading"]
            self._adapter_names = frozenset(i.name for i in serving)
            self._pinned = frozenset(i.name for i in serving if getattr(i, "pinned", False))

    def load_adapter(self, name: str, path, *, pinned: bool = False):
        """Load an adapter (blocking: file I/O and validation; run it off the event loop).

        Batches keep running meanwhile; the manager is thread-safe. Returns its info.
        """
        if self.lora is None:
            raise EngineError.invalid(
                "LoRA is disabled on this server (lora.enabled=false)", param="lora_name"
            )
        # New weights may come under this name (a load of a name already serving is
        # idempotent: its cached prefixes stay); their requests get a new prefix-cache key.
        fresh = name not in self.lora
        try:
            if fresh:
                self.prefix.adapter_changed(name)
            return self.lora.load(name, path, pinned=pinned)
        finally:
            if fresh:
                self.prefix.adapter_changed(name)
            self.refresh_adapters()

    def reset_prefix_cache(self) -> concurrent.futures.Future:
        """Drop every cached prefix, between steps (vLLM's ``/reset_prefix_cache``); the
        future holds the KV tokens freed at once."""
        return self.call(self.prefix.reset)

    def forget_step_measurements(self) -> concurrent.futures.Future:
        """Drop what the engine learnt from the steps so far, between steps: the
        scheduler's step costs and the speculation switch's throughputs. Steps that were
        not serving (a warm-up's, which capture graphs) would bias both."""

        def forget() -> None:
            self.scheduler.costs.reset()
            switch = getattr(self.decoder, "switch", None)
            if switch is not None:
                switch.reset()

        return self.call(forget)

    def unpin_adapter(self, name: str) -> None:
        """Release ``name``'s GPU slot to the LRU again (it stays loaded)."""
        if self.lora is None:
            return
        try:
            self.lora.unpin(name)
        finally:
            self.refresh_adapters()

    def unload_adapter(self, name: str) -> None:
        """Stop admitting requests for ``name``; it is freed once its requests finish."""
        if self.lora is None:
            raise EngineError.invalid(
                "LoRA is disabled on this server (lora.enabled=false)", param="lora_name"
            )
        try:
            self.prefix.adapter_changed(name)
            self.lora.unload(name)
        finally:
            self.prefix.adapter_changed(name)
            self.refresh_adapters()

    def list_adapters(self) -> list:
        """The adapter manager's infos (name, path, rank, state, pinned...)."""
        return [] if self.lora is None else list(self.lora.list())

    def adapter_info(self, name: str):
        """The adapter manager's info on ``name`` (unloading ones too), or None."""
        return next((info for info in self.list_adapters() if info.name == name), None)

    # Draft adapters: the draft's own pool (speculative.draft_max_loras), keyed by the name of
    # the Adapter they serve. Output never depends on them (the target verifies), so they
    # need no admission bookkeeping: a request drafts with one if it is loaded when it starts.
    @property
    def draft_pool(self):
        """The draft's adapter pool, or None (no draft model, or no draft adapters)."""
        return getattr(getattr(self.decoder, "drafter", None), "lora", None)

    def load_draft_adapter(self, name: str, path):
        """Load the draft adapter of Adapter ``name`` (blocking, like :meth:`load_adapter`)."""
        pool = self.draft_pool
        if pool is None:
            raise EngineError.invalid(
                "this server has no draft adapter pool: draft adapters need a STANDALONE draft or an EAGLE / "
                "EAGLE3 head, and "
                "speculative.draft_max_loras > 0 (--draft-max-loras)",
                param="draft",
            )
        try:
            return pool.load(name, path)
        except AdapterError as exc:
            outside = getattr(exc, "outside", None)
            if not outside:
                raise
            raise AdapterError(draft_pool_refusal(outside, pool.modules), field=exc.field, adapter=exc.adapter) from None

    def unload_draft_adapter(self, name: str) -> None:
        """Drop Adapter ``name``'s draft adapter, if any (requests drafting with it finish first)."""
        pool = self.draft_pool
        if pool is not None:
            pool.unload(name)

    def list_draft_adapters(self) -> list:
        """The draft pool's infos ([] without one)."""
        pool = self.draft_pool
        return [] if pool is None else list(pool.list())

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._iterate()
            except Exception:  # a bookkeeping bug must never kill the thread silently
                log.exception("engine step failed; failing the requests in flight")
                for req in list(self._running) + list(self._waiting):
                    self._finish(req, FinishReason.ERROR, _internal_error("engine step failed"))
                self._publish()
        for req in list(self._running) + list(self._waiting):
            self._finish(req, FinishReason.ABORT)
        self._drain_inbox(closing=True)
        self._publish()

    def _iterate(self) -> None:
        """One pass: take the inbox, plan, and run one step (or wait for work)."""
        self._drain_inbox()
        if self._stopping:
            return
        began = time.perf_counter()
        if self._waiting and len(self._pinned) >= self.limits.max_loras_per_batch:
            self._fail_unschedulable()
        self.prefix.sweep()
        if self.prefix.enabled:
            # Looked up in admission order, as far as admission (and fair preemption) reach.
            reach = max(self.limits.max_running_requests - len(self._running), 1) + 8
            order = fair_order(self._waiting, self._running, limit=reach)
            self.prefix.plan_hints(order, self._running, reach=reach)
        plan = self.scheduler.plan(
            self._waiting,
            self._running,
            self._kv_free(),
            free_rows=getattr(self.kv, "num_free_rows", None),
            pinned=self._pinned,
        )
        for req in plan.retract:
            self._retract(req)
        if plan.kind is StepKind.IDLE:
            if not plan.retract:
                self._publish()
                with self._cv:
                    if not self._inbox and not self._stopping:
                        self._cv.wait(timeout=_IDLE_WAIT_S)
            return
        if plan.deferred:
            self._deferred_steps += 1
        decoder_seconds = self._execute(plan)
        self._steps += 1
        self._publish()
        self._engine_seconds += max(time.perf_counter() - began - decoder_seconds, 0.0)

    def _drain_inbox(self, closing: bool = False) -> None:
        while True:
            with self._cv:
                if not self._inbox:
                    return
                kind, item = self._inbox.popleft()
            if kind == "submit":
                if closing:
                    self._deliver_final(item, FinishReason.ABORT)
                else:
                    self._intake(item)
            elif kind == "abort":
                req = self._live.get(item)
                if req is not None:
                    self._finish(req, FinishReason.ABORT)
            elif kind == "call":
                fn, future = item
                if closing:
                    future.set_exception(EngineClosedError("the engine stopped"))
                    continue
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)
                finally:
                    self.refresh_adapters()

    def _intake(self, req: Request) -> None:
        if req.adapter is not None:
            if self.lora is None:
                self._deliver_final(
                    req,
                    FinishReason.ERROR,
                    RequestError("LoRA is disabled on this server", status=400, param="model"),
                )
                return
            try:
                self.lora.acquire(req.adapter)
            except Exception as exc:  # unknown or draining adapter
                self._deliver_final(
                    req,
                    FinishReason.ERROR,
                    RequestError(
                        f"adapter {req.adapter!r} cannot take requests: {exc}",
                        status=404,
                        type="not_found_error",
                        param="model",
                        code="model_not_found",
                    ),
                )
                return
            req.holds_adapter = True
        req.generator = make_generator(req.params.seed)
        if self.tokenizer is not None:
            req.text_stream = TextStream(
                self.tokenizer.detokenizer(req.prompt_ids),
                req.params.stop,
                req.params.include_stop_str_in_output,
            )
        req.state = RequestState.WAITING
        self._live[req.rid] = req
        self._enqueue(req)

    def constraint_compiler(self) -> ConstraintCompiler:
        """The structured-output compiler (built on first use, bounded by the server's
        structured_* settings); :class:`SamplingParamsError` when the model has no tokenizer."""
        if self._constraints is None:
            hf = getattr(self.tokenizer, "hf", None)
            if hf is None or self.vocab_size is None:
                raise SamplingParamsError("response_format", "structured output needs the model's tokenizer")
            with self._cv:  # one compiler (and one worker pool) per engine
                if self._constraints is None:
                    self._constraints = ConstraintCompiler(
                        hf,
                        self.vocab_size,
                        sorted(self.eos_token_ids),
                        max_bytes=self.config.server.structured_max_bytes,
                        timeout_s=self.config.server.structured_compile_timeout_s,
                    )
        return self._constraints

    def _constraint(self, params: SamplingParams) -> Constraint | None:
        """A fresh matcher for a structured-output request (compiled grammars are cached)."""
        if params.structured is None:
            return None
        return self.constraint_compiler().constraint(params.structured)

    def _slots_pinned_against(self, adapter: str) -> bool:
        """Pinned adapters hold every GPU slot, so ``adapter`` can never get one."""
        pinned = self._pinned
        return adapter not in pinned and len(pinned) >= self.limits.max_loras_per_batch

    def _fail_unschedulable(self) -> None:
        """Waiting requests whose adapter can never get a slot (pinning changed after they
        queued) fail rather than block the queue forever."""
        for req in list(self._waiting):
            if req.adapter is not None and self._slots_pinned_against(req.adapter):
                self._finish(
                    req, FinishReason.ERROR, _slots_pinned_error(req.adapter, self.limits.max_loras_per_batch)
                )

    def _enqueue(self, req: Request) -> None:
        """Into the queue in arrival order (a retracted request keeps its place)."""
        keys = [(r.arrival_time, r.rid) for r in self._waiting]
        self._waiting.insert(bisect.bisect_right(keys, (req.arrival_time, req.rid)), req)

    def _execute(self, plan: StepPlan) -> float:
        """Run the plan's step; returns the seconds spent inside the decoder."""
        start = time.monotonic()
        timer = _DecoderTimer()
        if plan.kind is StepKind.EXTEND:
            if any(not r.is_prefilling for r in self._running):
                self._extends_during_decode += 1
            for req in plan.admit:
                self._waiting.remove(req)
                self._running.append(req)
                req.state = RequestState.RUNNING
                req.admitted_time = time.monotonic()
                req.prefill_target = req.num_tokens
                if self.prefix.enabled:
                    req.num_cached = self.prefix.admit(req)
                    self._observe(self.observer.on_prefix_lookup, req, req.num_cached, req.num_tokens)
                self.decoder.on_add(req)
            outs = self._isolated(
                plan.extend,
                timer.wrap(self.decoder.extend),
                key=lambda c: c[0],
                expected_cached=lambda c: c[0].num_cached,
            )
            for (req, n), out in zip(plan.extend, outs, strict=True):
                if req.finished:
                    continue
                req.num_cached += n
                self.prefix.cache_running(req)  # later arrivals share this prompt at once
                if out is not None:
                    self._commit(req, out)
            prefilled = sum(n for _, n in plan.extend)
            self._extend_totals = self._extend_totals.add(len(plan.extend), prefilled, timer.seconds)
            self._observe(
                self.observer.on_step,
                "extend",
                len(plan.extend),
                prefilled,
                time.monotonic() - start,
            )
        else:
            outs = self._isolated(
                plan.decode,
                timer.wrap(self.decoder.step),
                key=lambda r: r,
                expected_cached=lambda r: r.num_cached,
            )
            generated = 0
            for req, out in zip(plan.decode, outs, strict=True):
                if not req.finished and out is not None:
                    before = len(req.output_ids)
                    self._commit(req, out)
                    generated += len(req.output_ids) - before  # what a stop condition kept
            self._decode_totals = self._decode_totals.add(len(plan.decode), generated, timer.seconds)
            self._observe(
                self.observer.on_step, "decode", len(plan.decode), len(plan.decode), time.monotonic() - start
            )
        self.scheduler.observe_step(plan.kind, timer.seconds, sum(n for _, n in plan.extend))
        return timer.seconds

    def _isolated(self, items: Sequence, run, *, key, expected_cached) -> list:
        """Run a batch; if it raises, run each item alone so only the culprit fails."""
        if not items:
            return []
        try:
            outs = list(run(items))
            if len(outs) != len(items):
                raise RuntimeError(f"decoder returned {len(outs)} outputs for {len(items)} requests")
            return outs
        except Exception as exc:
            if len(items) == 1:
                req = key(items[0])
                log.warning("request %s failed: %s", req.rid, exc)
                log.debug("%s", traceback.format_exc())
                self._finish(req, FinishReason.ERROR, _internal_error(f"generation failed: {exc}"))
                return [None]
            log.warning("a batch of %d failed (%s); retrying request by request", len(items), exc)
        results: list = []
        for item in items:
            req = key(item)
            self._restore_kv(req, expected_cached(item))
            results.extend(self._isolated([item], run, key=key, expected_cached=expected_cached))
        return results

    def _restore_kv(self, req: Request, cached: int) -> None:
        """Drop KV a failed forward may have left beyond what the request had."""
        try:
            held = self.kv.seq_len(req.rid)
            if held > cached:
                self.kv.truncate(req.rid, held - cached)
        except Exception:  # the cache refuses: start this request over
            self.kv.free(req.rid)
            self.prefix.forget(req)
            req.num_cached = 0

    def _commit(self, req: Request, out: StepOutput) -> None:
        now = time.monotonic()
        tokens = list(out.token_ids)
        if not tokens:
            return
        if out.num_draft_tokens:
            req.spec.verify_steps += 1
            req.spec.draft_tokens += out.num_draft_tokens
            req.spec.accepted_tokens += out.num_accepted
            req.spec.accept_lens.append(out.num_accepted)
        params = req.params
        new_ids: list[int] = []
        new_logprobs: list[float] = []
        new_tops: list = []
        text_parts: list[str] = []
        reason: FinishReason | None = None
        for i, tok in enumerate(tokens):
            tok = int(tok)
            req.output_ids.append(tok)
            new_ids.append(tok)
            if req.constraint is not None and not req.constraint.accept(tok):
                # Masked sampling never picks such a token; say so rather than go on off-grammar.
                log.error("request %s: token %d is outside its structured-output grammar", req.rid, tok)
            if out.logprobs is not None and i < len(out.logprobs):
                req.output_logprobs.append(float(out.logprobs[i]))
                new_logprobs.append(float(out.logprobs[i]))
            if out.top_logprobs is not None and i < len(out.top_logprobs):
                new_tops.append(out.top_logprobs[i])
            is_stop_token = tok in params.stop_token_ids or (
                not params.ignore_eos and tok in self.eos_token_ids
            )
            # min_tokens (vLLM's rule): a stop string ends the request only if it ends in the
            # text of a token after the min_tokens-th. Stop tokens need no check: min_tokens
            # masks them, so one comes earlier only when a complete structured-output
            # constraint allows nothing else, and then the constraint wins.
            hit = False
            if req.text_stream is not None:
                delta, hit = req.text_stream.push(
                    tok, emit_text=not is_stop_token, match_stops=len(req.output_ids) > params.min_tokens
                )
                text_parts.append(delta)
            if is_stop_token or hit:
                reason = FinishReason.STOP
            elif len(req.output_ids) >= req.max_new_tokens or req.num_tokens >= self.context_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if req.first_token_time is None:
            req.first_token_time = now
            self._observe(self.observer.on_first_token, req, now - req.arrival_time)
            if len(new_ids) > 1:
                self._observe(self.observer.on_tokens, req, len(new_ids) - 1, 0.0)
        else:
            self._observe(self.observer.on_tokens, req, len(new_ids), now - (req.last_token_time or now))
        req.last_token_time = now
        if reason is not None:
            if req.text_stream is not None:  # held-back text that did not become a stop string
                text_parts.append(req.text_stream.finish())
            self._finish(
                req,
                reason,
                text="".join(text_parts),
                token_ids=new_ids,
                logprobs=new_logprobs if params.logprobs else None,
                top_logprobs=new_tops if params.top_logprobs else None,
            )
            return
        req.num_cached = req.num_tokens - 1
        self._send(
            req,
            RequestOutput(
                rid=req.rid,
                token_ids=new_ids,
                text="".join(text_parts),
                logprobs=new_logprobs if params.logprobs else None,
                top_logprobs=new_tops if params.top_logprobs else None,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
            ),
        )

    def _retract(self, req: Request) -> None:
        """Evict a running request back to the queue, freeing its KV cache."""
        if req not in self._running:
            return
        self._running.remove(req)
        req.state = RequestState.WAITING
        self._call_hook(self.decoder.on_finish, req)
        # Its KV stays in the prefix cache (evictable like free tokens): it resumes from it.
        self.prefix.release(req, req.all_ids[: req.num_cached])
        req.num_cached = 0
        req.prefill_target = 0
        req.num_retractions += 1
        self._enqueue(req)
        self._observe(self.observer.on_retract, req)

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        error: RequestError | None = None,
        *,
        text: str = "",
        token_ids: list[int] | None = None,
        logprobs: list[float] | None = None,
        top_logprobs: list | None = None,
    ) -> None:
        if req.finished:
            return
        was_running = req in self._running
        if was_running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_time = time.monotonic()
        if was_running:
            self._call_hook(self.decoder.on_finish, req)
        # A failed request's KV may be incomplete: freed, never cached.
        self.prefix.release(req, None if reason is FinishReason.ERROR else req.all_ids)
        if req.holds_adapter and self.lora is not None:
            try:
                self.lora.release(req.adapter)
            except Exception:
                log.exception("releasing adapter %s failed", req.adapter)
            req.holds_adapter = False
        self._live.pop(req.rid, None)
        if reason is FinishReason.ABORT and req.text_stream is not None:
            text += req.text_stream.finish()
        # Metrics first: a client that reads /metrics after its answer sees itself counted.
        self._observe(self.observer.on_request_finished, req)
        self._publish()
        self._send(
            req,
            RequestOutput(
                rid=req.rid,
                token_ids=token_ids or [],
                text=text,
                logprobs=logprobs,
                top_logprobs=top_logprobs,
                finished=True,
                finish_reason=reason,
                error=error,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                spec=req.spec if req.spec.verify_steps else None,
            ),
        )

    def _deliver_final(self, req: Request, reason: FinishReason, error: RequestError | None = None) -> None:
        """Finish a request the engine never took in (no adapter hold, no KV)."""
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.error = error
        req.finished_time = time.monotonic()
        self._observe(self.observer.on_request_finished, req)
        self._send(
            req,
            RequestOutput(
                rid=req.rid,
                token_ids=[],
                text="",
                finished=True,
                finish_reason=reason,
                error=error,
                prompt_tokens=len(req.prompt_ids),
            ),
        )

    def _send(self, req: Request, out: RequestOutput) -> None:
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            out.prompt_logprobs = req.prompt_logprobs  # with the first output only
            req.prompt_logprobs_sent = True
        if req.sink is None:
            return
        try:
            req.sink(out)
        except Exception:  # a broken consumer aborts only its own request
            log.exception("output sink of %s failed", req.rid)
            if not out.finished:
                self._finish(req, FinishReason.ABORT)

    def _observe(self, hook, *args) -> None:
        try:
            hook(*args)
        except Exception:  # metrics must never break serving
            log.exception("engine observer %s failed", getattr(hook, "__name__", hook))

    def _call_hook(self, hook, req: Request) -> None:
        try:
            hook(req)
        except Exception:
            log.exception("decoder hook %s failed for %s", getattr(hook, "__name__", hook), req.rid)

    def _publish(self) -> None:
        running_adapters = sorted({r.adapter for r in self._running if r.adapter is not None})
        waiting_adapters = sorted({r.adapter for r in self._waiting if r.adapter is not None})
        with self._cv:
            queued = sum(1 for kind, _ in self._inbox if kind == "submit")
        graphs = getattr(self.runner, "graphs", None)  # a local runner's; remote ranks report none
        self.snapshot = EngineSnapshot(
            num_running=len(self._running),
            num_waiting=len(self._waiting) + queued,
            running_adapters=tuple(running_adapters),
            waiting_adapters=tuple(waiting_adapters),
            kv_total_tokens=self._kv_capacity(),
            kv_free_tokens=self._kv_free(),
            max_loras_per_batch=self.config.lora.max_loras_per_batch,
            last_batch_size=len(self._running),
            steps=self._steps,
            max_running_requests=self.limits.max_running_requests,
            extend=self._extend_totals,
            decode=self._decode_totals,
            engine_seconds=self._engine_seconds,
            extends_during_decode=self._extends_during_decode,
            deferred_admission_steps=self._deferred_steps,
            cuda_graphs=int(getattr(graphs, "num_graphs", 0)),
            cuda_graph_capture_failures=int(getattr(graphs, "capture_failures", 0)),
            prefix_cache_enabled=self.prefix.enabled,
            prefix_cached_tokens=int(getattr(self.kv, "num_cached_tokens", 0)),
            prefix_evictable_tokens=int(getattr(self.kv, "num_evictable_tokens", 0)),
            prefix_evicted_tokens=int(getattr(self.kv, "prefix_evicted_tokens", 0)),
        )

    # ------------------------------------------------------------------ runner facts
    def _kv_capacity(self) -> int:
        return int(getattr(self.kv, "capacity", 0))

    def _kv_free(self) -> int:
        return int(getattr(self.kv, "num_free_tokens", 0))

    def _model_context_len(self) -> int:
        known = [
            int(x) for x in (self.config.model.context_length, getattr(self.runner, "context_len", None)) if x
        ]
        if not known:
            raise ValueError("cannot tell the context length: set model.context_length")
        return min(known)


class _DecoderTimer:
    """Adds up the seconds spent inside decoder calls (a failed batch's retries included)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(items):
            began = time.perf_counter()
            try:
                return fn(items)
            finally:
                self.seconds += time.perf_counter() - began

        return timed


def _state(info) -> str:
    state = getattr(info, "state", "loaded")
    return str(getattr(state, "value", state)).lower()


def _slots_pinned_error(adapter: str, slots: int) -> RequestError:
    return RequestError(
        f"adapter {adapter!r} cannot be scheduled: pinned adapters hold all {slots} GPU slots "
        "(lora.max_loras_per_batch); unpin one (unload and load it again without pinned) or raise the limit",
        status=503,
        type="service_unavailable",
        param="model",
        code="adapter_slots_pinned",
    )


def _internal_error(message: str) -> RequestError:
    return RequestError(message, status=500, type="internal_error", code="internal_error")
