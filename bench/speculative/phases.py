"""``--phases``: where a decode step's time goes, call by call.

One more request per draft at concurrency 1 runs through the speculative decoder, then the
same request through the plain one, with the decoder's calls timed by wrapping bound
methods on the instances (:class:`PhaseRecorder`): host ``perf_counter`` around each call
(no synchronize: what the host spends issuing it, or waiting where the call itself waits)
and CUDA events just before and after it (the GPU span from the first to the last work it
queued, idle time inside included), read once after the run. ``(rest of the step)`` is the
step's time outside its timed calls (host work between them; on the GPU, work queued
outside them or idle time while the host works); ``between steps`` is the engine's time
from one step's end to the next one's start (gaps that hold an extend left out). Kernel
time by op family is ``bench/profile_step.py``'s.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..harness import environment, log, table
from .workloads import make_workload, run_workload

if TYPE_CHECKING:
    from .measure import MeasureOptions

PHASE_TOKENS = 96  # new tokens of the one request each decoder runs
WARMUP_STEPS = 3  # leading decode steps left out of the summary
DRAFT_RUNNER_METHODS = ("forward", "forward_uniform", "draft_chain", "feed_chain", "draft_tree", "feed_tree",
                        "compute_logits", "step")  # fmt: skip


@dataclass
class Call:
    """One timed call: its phase name, nesting depth (1: called by the step itself), host
    seconds and CUDA events (None off CUDA)."""

    name: str
    depth: int
    start: object = None
    end: object = None
    host_s: float = 0.0


@dataclass
class Step:
    """One ``decoder.step``: its host clock, events, generated tokens and calls in start order."""

    t0: float
    start: object
    t1: float = 0.0
    end: object = None
    tokens: int = 0
    calls: list[Call] = field(default_factory=list)


class PhaseRecorder:
    """Times a decoder's steps and the calls inside them; :meth:`restore` unwraps them.
    Calls outside ``decoder.step`` (prefill) are not recorded; extends are only noted."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.steps: list[Step] = []
        self.extends: list[tuple[float, float]] = []
        self._step: Step | None = None
        self._depth = 0
        self._saved: list[tuple[object, str, bool, object]] = []

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _patch(self, obj, attr: str, fn, restore: bool = True) -> None:
        if restore:
            own = vars(obj)
            self._saved.append((obj, attr, attr in own, own.get(attr)))
        setattr(obj, attr, fn)

    def wrap(self, obj, attr: str, name, *, after=None, restore: bool = True) -> None:
        """Time ``obj.attr`` as phase ``name`` (a string, or a function of the call's
        arguments returning one); ``after(result)`` runs outside the timing. Nothing when
        ``obj`` has no such method."""
        fn = getattr(obj, attr, None) if obj is not None else None
        if fn is None or not callable(fn) or getattr(obj, "__dict__", None) is None:
            return

        def timed(*args, **kwargs):
            if self._step is None:
                return fn(*args, **kwargs)
            self._depth += 1
            call = Call(name(*args, **kwargs) if callable(name) else name, self._depth, self._event())
            self._step.calls.append(call)  # at its start: the calls stay in start order
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                call.host_s, call.end = time.perf_counter() - t0, self._event()
                self._depth -= 1
            if after is not None:
                after(out)
            return out

        self._patch(obj, attr, timed, restore)

    def instrument(self, decoder) -> None:
        """The step and extend, the target's forwards (by mode), and for a speculative
        decoder the drafter's calls, the draft runner's and acceptance (``decoder._accept``;
        the wait for the device is its result's ``host()``)."""
        step_fn, extend_fn = decoder.step, decoder.extend

        def step(requests):
            self._step = Step(time.perf_counter(), self._event())
            try:
                outs = step_fn(requests)
            finally:
                record, self._step = self._step, None
                record.t1, record.end = time.perf_counter(), self._event()
                self.steps.append(record)
            record.tokens = sum(len(out.token_ids) for out in outs if out is not None)
            return outs

        def extend(chunks):
            t0 = time.perf_counter()
            try:
                return extend_fn(chunks)
            finally:
                self.extends.append((t0, time.perf_counter()))

        self._patch(decoder, "step", step)
        self._patch(decoder, "extend", extend)
        runner, drafter = getattr(decoder, "runner", None), getattr(decoder, "drafter", None)
        self.wrap(runner, "forward", _mode_label("target.forward"))
        if drafter is None:
            return
        for method in ("propose", "propose_tree", "on_verify", "on_decode"):
            self.wrap(drafter, method, f"drafter.{method}")
        self.wrap(getattr(runner, "kv", None), "keep", "target.kv.keep")  # a tree step keeps its path
        self.wrap(decoder, "_accept", "decoder._accept",
                  after=lambda acceptance: self.wrap(acceptance, "host", "acceptance.host", restore=False))  # fmt: skip
        draft_runner = getattr(drafter, "runner", None)
        if draft_runner is not None and draft_runner is not runner:
            for method in DRAFT_RUNNER_METHODS:
                self.wrap(draft_runner, method, _mode_label("draft.forward") if method == "forward" else f"draft.{method}")

    def restore(self) -> None:
        """Put every wrapped method back, then wait once for the device so every event reads."""
        while self._saved:
            obj, attr, had, old = self._saved.pop()
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        if self.cuda:
            torch.cuda.synchronize()


def _mode_label(prefix: str):
    """A phase name for a forward: ``prefix[MODE]`` from its batch's ``mode`` when it has one."""

    def label(*args, **kwargs) -> str:
        mode = getattr(args[0] if args else kwargs.get("batch"), "mode", None)
        return f"{prefix}[{mode.name}]" if mode is not None else prefix

    return label


def _ms(a, b) -> float | None:
    """Milliseconds on the GPU from event ``a`` to event ``b`` (None without events)."""
    return None if a is None or b is None else float(a.elapsed_time(b))


def _stats(values: list[float | None]) -> list[float] | None:
    """``[mean, median]`` of the values that are there (None when none is)."""
    got = [v for v in values if v is not None]
    return [round(statistics.fmean(got), 4), round(statistics.median(got), 4)] if got else None


def summarize(steps: list[Step], extends: list[tuple[float, float]]) -> dict:
    """Per-step means and medians of every phase over the steps after the warm-up ones: its
    calls, host ms and GPU ms summed within a step; the step, its rest outside the calls
    made by the step itself, and the time between steps."""
    used = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps
    # a phase is a name at a depth, in first-seen order: the timeline's
    phases = list(dict.fromkeys((c.name, c.depth) for s in used for c in s.calls))
    cuda = any(s.start is not None for s in used)
    sums = [_sums(s, phases) for s in used]
    rows = [
        {"phase": name, "depth": depth, "calls": round(statistics.fmean(c[name, depth][0] for c in sums), 2),
         "host_ms": _stats([c[name, depth][1] for c in sums]),
         "gpu_ms": _stats([c[name, depth][2] if cuda else None for c in sums])}
        for name, depth in phases
    ]  # fmt: skip
    top = [phase for phase in phases if phase[1] == 1]
    rest_host = [1e3 * (s.t1 - s.t0) - sum(c[n][1] for n in top) for s, c in zip(used, sums, strict=True)]
    rest_gpu = [_ms(s.start, s.end) - sum(c[n][2] for n in top) if cuda else None for s, c in zip(used, sums, strict=True)]
    between = [(a, b) for a, b in itertools.pairwise(used) if not any(a.t1 <= t < b.t0 for t, _ in extends)]
    return {
        "steps": len(used), "tokens_per_step": round(sum(s.tokens for s in used) / max(len(used), 1), 3),
        "rows": rows, "rest_host_ms": _stats(rest_host), "rest_gpu_ms": _stats(rest_gpu),
        "step_host_ms": _stats([1e3 * (s.t1 - s.t0) for s in used]), "step_gpu_ms": _stats([_ms(s.start, s.end) for s in used]),
        "between_host_ms": _stats([1e3 * (b.t0 - a.t1) for a, b in between]),
        "between_gpu_ms": _stats([_ms(a.end, b.start) for a, b in between]),
    }  # fmt: skip


def _sums(step: Step, phases: list[tuple[str, int]]) -> dict[tuple[str, int], list[float]]:
    """Per phase in ``step``: ``[calls, host ms, GPU ms]`` summed over its calls."""
    sums = {phase: [0, 0.0, 0.0] for phase in phases}
    for call in step.calls:
        cell = sums[call.name, call.depth]
        cell[0] += 1
        cell[1] += 1e3 * call.host_s
        cell[2] += _ms(call.start, call.end) or 0.0
    return sums


def _pair(stats: list[float] | None) -> list[str]:
    return ["–", "–"] if stats is None else [f"{stats[0]:.3f}", f"{stats[1]:.3f}"]


HEADER = ["phase", "calls / step", "host ms / step (mean)", "(median)", "GPU span ms / step (mean)", "(median)"]


def markdown(name: str, runs: dict[str, dict], meta: dict) -> str:
    """``phases-<draft>.md``: a table per decoder from :func:`summarize`."""
    lines = [
        f"# Phases of one request at concurrency 1: {name} ({meta['device']})",
        "",
        f"One request ({meta['prompt_tokens']}-token held-out prompt, adapter {meta['adapter'] or 'base'},"
        f" {meta['new_tokens']} new tokens, greedy) through each decoder; the first {WARMUP_STEPS} decode steps"
        " are left out. Indented rows are calls made inside the row above them (`bench/speculative/phases.py`"
        " says what each column measures).",
    ]
    for kind, s in runs.items():
        rows = [[f"{'· ' * (r['depth'] - 1)}`{r['phase']}`", f"{r['calls']:g}", *_pair(r["host_ms"]),
                 *_pair(r["gpu_ms"])] for r in s["rows"]]  # fmt: skip
        rows += [
            [label, calls, *_pair(s[f"{key}_host_ms"]), *_pair(s[f"{key}_gpu_ms"])]
            for label, calls, key in (("(rest of the step)", "", "rest"), ("**step** (`decoder.step`)", 1, "step"),
                                      ("**between steps** (engine)", 1, "between"))
        ]  # fmt: skip
        lines += ["", f"## {kind}: {s['steps']} steps, {s['tokens_per_step']} tokens / step; {s['generated']} tokens"
                  f" in {s['seconds']:.3f} s", "", *table(HEADER, rows)]  # fmt: skip
    return "\n".join(lines) + "\n"


def phases_run(spec_config, runner, decoder, name: str, pool, opts: MeasureOptions, plain) -> dict:
    """One request through the speculative decoder, then (``plain``: ``(config, decoder)``)
    the same request through the plain one, each with its phases timed; writes
    ``phases-<name>.md`` to ``opts.phases`` and returns the summaries for the details JSON."""
    assert opts.phases is not None
    opts.phases.mkdir(parents=True, exist_ok=True)
    work = make_workload(pool, 1, min(opts.gen_tokens, PHASE_TOKENS), offset=300)
    cuda = torch.device(runner.device).type == "cuda"
    results: dict = {}
    outputs = {}
    for kind, config, dec in [("spec", spec_config, decoder)] + ([("plain", *plain)] if plain is not None else []):
        recorder = PhaseRecorder(cuda)
        recorder.instrument(dec)
        try:
            result = run_workload(config, runner, dec, work, 1, f"phases-{name}-{kind}")
        finally:
            recorder.restore()
        results[kind] = {**summarize(recorder.steps, recorder.extends), "generated": result.generated,
                         "seconds": round(result.seconds, 4)}  # fmt: skip
        outputs[kind] = next(iter(result.outputs.values()), [])
    meta = {"device": environment(runner.device)["gpu"], "prompt_tokens": len(work.prompts[0]),
            "adapter": work.adapters[0], "new_tokens": work.gen_tokens}  # fmt: skip
    text = markdown(name, results, meta)
    if "plain" in outputs:
        results["identical_outputs"] = outputs["spec"] == outputs["plain"]
        text += f"\nOutputs of the two runs identical: {'yes' if results['identical_outputs'] else 'NO'}.\n"
    Path(opts.phases / f"phases-{name}.md").write_text(text)
    step = {k: v["step_host_ms"] for k, v in results.items() if isinstance(v, dict)}
    log(f"phases {name}: step host ms (mean, median) {step}")
    return results
