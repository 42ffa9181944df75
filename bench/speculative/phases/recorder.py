"""Timing of a decoder's calls by wrapping bound methods (host time and CUDA-event spans)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Span:
    """One timed call: host ``perf_counter`` at its start and end, CUDA events recorded on
    the current stream just before and just after it (None off CUDA), and the timed calls
    made inside it."""

    name: str
    start: object = None  # torch.cuda.Event (or anything with elapsed_time) | None
    end: object = None
    t0: float = 0.0
    t1: float = 0.0
    children: list[Span] = field(default_factory=list)
    tokens: int = 0  # a decoder step's generated tokens


class PhaseRecorder:
    """Times a decoder's steps and the calls inside them by wrapping bound methods on the
    instances (``obj.method = timed(obj.method)``); :meth:`restore` puts them back.

    Per call: host seconds around it (no synchronize: what the host spends issuing it, or
    waiting where the call itself waits) and a pair of CUDA events before and after it
    (the GPU span from the first to the last work the call queued, idle time inside
    included). Events are read after the run (:meth:`close`, one synchronize). Calls made
    outside ``decoder.step`` (prefill) are not recorded; extends are only noted, so a gap
    between two steps that holds one is left out of the between-steps time.
    """

    def __init__(self, cuda: bool, *, annotate: bool = False):
        self.cuda = cuda
        self.annotate = annotate  # also open a torch.profiler range named for each call
        self.steps: list[Span] = []
        self.extends: list[tuple[float, float]] = []
        self._stack: list[Span] = []
        self._saved: list[tuple[object, str, bool, object]] = []

    def current(self) -> str | None:
        """The innermost call being timed now (None outside a step)."""
        return self._stack[-1].name if self._stack else None

    def _range(self, name: str):
        return torch.profiler.record_function(name) if self.annotate else contextlib.nullcontext()

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, obj, attr: str, name, *, after=None, restore: bool = True) -> bool:
        """Time ``obj.attr`` as phase ``name`` (a string, or a function of the call's
        arguments returning one); ``after(result)`` runs outside the timing. False when
        ``obj`` has no such method."""
        fn = getattr(obj, attr, None) if obj is not None else None
        own = getattr(obj, "__dict__", None)
        if fn is None or not callable(fn) or own is None:
            return False
        if restore:
            self._saved.append((obj, attr, attr in own, own.get(attr)))
        recorder = self

        def timed(*args, **kwargs):
            if not recorder._stack:
                return fn(*args, **kwargs)
            span = Span(name(*args, **kwargs) if callable(name) else name, start=recorder._event())
            recorder._stack[-1].children.append(span)
            recorder._stack.append(span)
            span.t0 = time.perf_counter()
            try:
                with recorder._range(span.name):
                    out = fn(*args, **kwargs)
            finally:
                span.t1 = time.perf_counter()
                recorder._stack.pop()
                span.end = recorder._event()
            if after is not None:
                after(out)
            return out

        setattr(obj, attr, timed)
        return True

    def wrap_decoder(self, decoder) -> None:
        """``decoder.step`` (each call one recorded step) and ``decoder.extend`` (noted)."""
        step_fn, extend_fn = decoder.step, decoder.extend
        recorder = self

        def step(requests):
            span = Span("decoder.step", start=recorder._event())
            recorder._stack = [span]
            span.t0 = time.perf_counter()
            try:
                with recorder._range("decoder.step (own work)"):
                    outs = step_fn(requests)
            finally:
                span.t1 = time.perf_counter()
                recorder._stack = []
                span.end = recorder._event()
                recorder.steps.append(span)
            span.tokens = sum(len(out.token_ids) for out in outs if out is not None)
            return outs

        def extend(chunks):
            t0 = time.perf_counter()
            try:
                return extend_fn(chunks)
            finally:
                recorder.extends.append((t0, time.perf_counter()))

        for attr, fn in (("step", step), ("extend", extend)):
            self._saved.append((decoder, attr, attr in vars(decoder), vars(decoder).get(attr)))
            setattr(decoder, attr, fn)

    def instrument(self, decoder) -> None:
        """The phases of a step: the target's forwards (by mode), and for a speculative
        decoder the drafter's calls, the draft runner's (those it has) and acceptance
        (``decoder._accept``; the wait for the device is its result's ``host()``)."""
        self.wrap_decoder(decoder)
        runner = getattr(decoder, "runner", None)
        self.wrap(runner, "forward", _mode_label("target.forward"))
        drafter = getattr(decoder, "drafter", None)
        if drafter is None:
            return
        for method in ("propose", "propose_tree", "on_verify", "on_decode"):
            self.wrap(drafter, method, f"drafter.{method}")
        kv = getattr(runner, "kv", None)
        self.wrap(kv, "keep", "target.kv.keep")  # a tree step keeps its accepted path's entries
        self.wrap(
            decoder, "_accept", "decoder._accept",
            after=lambda acceptance: self.wrap(acceptance, "host", "acceptance.host", restore=False),
        )  # fmt: skip
        draft_runner = getattr(drafter, "runner", None)
        if draft_runner is not None and draft_runner is not runner:
            methods = ("forward", "forward_uniform", "draft_chain", "feed_chain", "draft_tree", "feed_tree",
                       "compute_logits", "step")  # fmt: skip
            for method in methods:
                label = _mode_label("draft.forward") if method == "forward" else f"draft.{method}"
                self.wrap(draft_runner, method, label)

    def restore(self) -> None:
        """Put every wrapped method back (instance attributes that were not there are removed)."""
        while self._saved:
            obj, attr, had, old = self._saved.pop()
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)

    def close(self) -> None:
        """Wait once for the device, so every recorded event can be read."""
        if self.cuda:
            torch.cuda.synchronize()

    def overhead_us(self, calls: int = 200) -> float:
        """Host microseconds one wrapped call adds (a no-op timed ``calls`` times, events
        included on CUDA) over calling it bare."""
        import types

        probe = types.SimpleNamespace(noop=lambda: None)
        bare = probe.noop
        t0 = time.perf_counter()
        for _ in range(calls):
            bare()
        bare_s = time.perf_counter() - t0
        saved, self._saved = self._saved, []
        self.wrap(probe, "noop", "noop")
        self._stack = [Span("probe")]
        t0 = time.perf_counter()
        for _ in range(calls):
            probe.noop()
        timed_s = time.perf_counter() - t0
        self._stack = []
        self.restore()
        self._saved = saved
        return max(timed_s - bare_s, 0.0) / calls * 1e6


def _mode_label(prefix: str):
    """A phase name for a forward: ``prefix[MODE]`` from its batch's ``mode`` when it has one."""

    def label(*args, **kwargs) -> str:
        batch = args[0] if args else kwargs.get("batch")
        mode = getattr(batch, "mode", None)
        return f"{prefix}[{mode.name}]" if mode is not None else prefix

    return label
