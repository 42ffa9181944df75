"""Timed runs at one concurrency: the no-spec baseline, then each draft against it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.runtime.runner.model_runner import ModelRunner

from ..harness import log
from .identity import gap_of, identity_by_kind
from .phases import phases_run
from .profiling import profile_run
from .settings import Settings
from .workloads import RunResult, Workload, make_workload, run_workload, warmup_workload


@dataclass
class MeasureOptions:
    """How the timed runs go: verify width, workload size, admission, deadline, extras at c=1."""

    k: int
    gen_tokens: int
    waves: int
    defer_steps: int | None = None  # admission batching limit (None: the engine's default)
    ab_defer: frozenset[int] = frozenset()  # concurrencies also timed with admission batching off (0)
    deadline: float = float("inf")  # time.monotonic() after which optional runs are skipped
    profile: Path | None = None  # where to write operator profiles of one request per draft at c=1
    phases: Path | None = None  # where to write per-phase timings of one request per draft at c=1
    c1_requests: int = 10  # requests concurrency 1 runs, one after another

    @classmethod
    def from_settings(cls, s: Settings, started: float) -> MeasureOptions:
        """The options of a run that started at ``time.monotonic() == started``."""
        args = s.args
        return cls(
            k=s.k,
            gen_tokens=s.gen_tokens,
            waves=s.waves,
            defer_steps=args.defer_steps,
            ab_defer=frozenset(int(c) for c in args.ab_defer.split(",") if c.strip()),
            deadline=started + args.deadline_s if args.deadline_s else float("inf"),
            profile=Path(args.profile) if args.profile else None,
            phases=Path(args.phases) if args.phases else None,
            c1_requests=args.c1_requests,
        )


@dataclass
class Row:
    """One (concurrency, draft) result against the no-spec run at that concurrency."""

    concurrency: int
    draft: str
    off_tps: float
    on_tps: float
    speedup: float
    summary: dict
    same: int
    count: int
    identity: dict = field(default_factory=dict)  # identity_by_kind: spec vs plain at this concurrency


def spec_summary(decoder) -> dict:
    """The speculative decoder's acceptance and timing metrics since they were last reset."""
    snap = decoder.metrics.snapshot()
    per = {name or "base": round(s.mean_accept_len, 2) for name, s in sorted(snap.per_adapter.items())}
    hist = snap.overall.histogram
    steps = max(sum(hist), 1)
    return {
        "mean_accept": round(snap.overall.mean_accept_len, 2),
        # P(draft j of a step is accepted) = share of steps accepting at least j drafts
        "per_position": [round(sum(hist[j:]) / steps, 3) for j in range(1, len(hist))],
        "accept_rate": round(snap.overall.accept_rate, 3),
        "per_adapter_mean_accept": per,
        # [mean accepted, verify steps] by the request's context length: does the draft hold up
        # past the sequences it was trained on?
        "per_context": {b: [round(c.mean_accept_len, 2), c.verify_steps] for b, c in snap.per_context.items()},
        "histogram": snap.overall.histogram,
        "verify_ms": round(1e3 * snap.verify_seconds.total / max(snap.verify_seconds.count, 1), 2),
        "step_ms": round(1e3 * snap.step_seconds.total / max(snap.step_seconds.count, 1), 2),
        "undrafted_steps": snap.undrafted_steps,
    }


def _request_count(c: int, waves: int, c1_requests: int) -> int:
    """Requests of a workload: ``c1_requests`` at concurrency 1 (one after another, so the
    sample of accept lengths comes from that many prompts), else ``waves * c``."""
    return c1_requests if c == 1 else waves * c


def measure_plain(config, runner, plain, pool, c, opts: MeasureOptions) -> tuple[Workload, RunResult]:
    """The no-spec baseline at concurrency ``c``: a warm-up, then the timed workload.

    ``waves * c`` requests keep ``c`` running as earlier ones finish, so speculative
    requests finishing at different steps do not leave the batch draining (concurrency 1
    runs ``--c1-requests`` requests, one after another, cycling through base and each adapter).
    """
    count = _request_count(c, opts.waves, opts.c1_requests)
    bench = make_workload(pool, count, opts.gen_tokens, offset=0)
    run_workload(config, runner, plain, warmup_workload(pool, bench, c), c, f"warm-off-{c}")
    return bench, run_workload(config, runner, plain, bench, c, f"off-{c}")


def plain_floor(
    runner: ModelRunner, plain_runs: dict[int, tuple[Workload, RunResult]], lo: int, c: int
) -> dict:
    """Plain decoding at concurrency ``lo`` against concurrency ``c`` on the prompts both ran
    (the workloads share their first prompts): divergence from batch shape alone."""
    (work_lo, run_lo), (work_c, run_c) = plain_runs[lo], plain_runs[c]
    n = min(len(work_lo.prompts), len(work_c.prompts))
    outs_lo = [run_lo.outputs[f"off-{lo}-{i}"] for i in range(n)]
    outs_c = [run_c.outputs[f"off-{c}-{i}"] for i in range(n)]
    return identity_by_kind(
        work_lo.adapters[:n], outs_lo, outs_c, gap_of(runner, work_lo, outs_lo, outs_c)
    ) | {"against": lo}


def measure_spec(spec_config, runner, decoder, name, pool, c, opts: MeasureOptions, off: RunResult, bench,
                  details: dict, *, plain: tuple | None = None) -> Row:  # fmt: skip
    """One draft at concurrency ``c``: a warm-up (captures the CUDA graphs for the batch and
    context buckets the timed run meets: :func:`warmup_workload`), then the same workload as
    the baseline.

    Speculative requests finish at different steps, so their batch sizes and context
    lengths mix in ways the plain run never meets; the graphs the timed run still had to
    capture are reported.
    ``plain``: ``(config, decoder)`` of the no-spec baseline, timed beside the draft by
    ``--phases``.
    """
    k, count = getattr(decoder, "width", opts.k), len(bench.prompts)  # a DFLASH block may differ from k
    warm_spec = warmup_workload(pool, bench, c)
    run_workload(spec_config, runner, decoder, warm_spec, c, f"warm-{name}-{c}", defer_steps=opts.defer_steps)
    decoder.metrics = type(decoder.metrics)(decoder.metrics.algorithm, k)
    on = run_workload(spec_config, runner, decoder, bench, c, f"{name}-{c}", defer_steps=opts.defer_steps)
    summary = spec_summary(decoder)
    outs_off = [off.outputs[f"off-{c}-{i}"] for i in range(count)]
    outs_on = [on.outputs[f"{name}-{c}-{i}"] for i in range(count)]
    identity = identity_by_kind(bench.adapters, outs_off, outs_on, gap_of(runner, bench, outs_off, outs_on))
    same = sum(kind["identical"] for kind in identity.values())
    speedup = on.tokens_per_s / off.tokens_per_s
    details[name] = {
        "on_s": on.seconds, "generated": on.generated, **summary, "on_steps": on.steps, "identity": identity,
    }  # fmt: skip
    log(
        f"concurrency {c} {name}: off {off.tokens_per_s:,.1f} tok/s, spec {on.tokens_per_s:,.1f} tok/s,"
        f" x{speedup:.2f}; {summary}; identical outputs {same}/{count}"
    )
    log(f"concurrency {c} {name} steps: off {off.steps}; spec {on.steps}")
    _extra_runs(spec_config, runner, decoder, name, pool, c, opts, (on, off), bench, details[name], plain)
    return Row(c, name, off.tokens_per_s, on.tokens_per_s, speedup, summary, same, count, identity)


def _extra_runs(spec_config, runner, decoder, name: str, pool, c: int, opts: MeasureOptions,
                on_off: tuple[RunResult, RunResult], bench: Workload, details: dict, plain) -> None:  # fmt: skip
    """What the options add after a draft's timed run: at concurrency 1 a profile
    (``--profile``) and a phases run (``--phases``); at ``--ab-defer`` levels the same
    workload without admission batching, when the deadline leaves time for it."""
    on, off = on_off
    if opts.profile is not None and c == 1:
        profile_run(spec_config, runner, decoder, name, pool, opts)
    if opts.phases is not None and c == 1:
        details["phases"] = phases_run(spec_config, runner, decoder, name, pool, opts, plain)
    if c not in opts.ab_defer:
        return
    if time.monotonic() + 1.5 * on.seconds > opts.deadline:
        log(f"concurrency {c} {name}: no time left for the run without admission batching")
        return
    plain_sched = run_workload(spec_config, runner, decoder, bench, c, f"nodefer-{name}-{c}", defer_steps=0)
    details["on_nodefer_s"] = plain_sched.seconds
    details["on_nodefer_steps"] = plain_sched.steps
    log(
        f"concurrency {c} {name}: spec without admission batching {plain_sched.tokens_per_s:,.1f} tok/s"
        f" (x{plain_sched.tokens_per_s / off.tokens_per_s:.2f}); steps {plain_sched.steps}"
    )
