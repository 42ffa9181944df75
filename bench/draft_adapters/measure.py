"""Timed runs at one concurrency: every request kind (base, each task adapter) on its own
workload, without speculation, with the shared draft and with the draft adapters.

A kind's workload holds only that kind's requests (base requests on held-out standard
library prompts, an adapter's requests on its corpus's held-out files), so its tokens/s is
that kind's speedup; the same prompts run through the three decoders and the speculative
outputs are compared with the plain ones token for token. A last workload mixes every kind
in the same batches (``MIXED``), where the decoder's per-adapter metrics give each kind's
accept length beside the others'. Before the timed runs, each decoder serves warm-up
workloads of the timed runs' size at this concurrency: one of base requests alone and one
mixed. Both are needed because CUDA graphs are captured lazily per (batch bucket, context
bucket, LoRA or not): a batch of base requests alone replays graphs without the LoRA ops,
which a mixed workload never meets, and the decoder timed first would otherwise pay their
capture inside its timed run (the base rows' step time, not the others', would show it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..harness import log
from ..speculative.identity import gap_of, identity_by_kind
from ..speculative.measure import spec_summary
from ..speculative.serving import Serving
from ..speculative.workloads import RunResult, Workload, run_workload
from .decoders import SPEC_RUNS, Decoders

BASE = "base"
MIXED = "mixed"  # every kind in one workload, as a serve sees them: per-adapter accept lengths side by side


@dataclass(frozen=True)
class LevelOptions:
    """Workload sizes: ``c1_requests`` per kind at concurrency 1, else ``waves`` x c."""

    gen_tokens: int
    waves: int
    c1_requests: int

    def count(self, c: int) -> int:
        """Requests of one kind's workload at concurrency ``c``."""
        return self.c1_requests if c == 1 else self.waves * c


@dataclass
class Run:
    """One timed run of one kind's workload with one decoder."""

    tokens_per_s: float
    seconds: float
    generated: int
    steps: dict
    summary: dict | None = None  # speculative runs: acceptance (spec_summary)
    identity: dict | None = None  # speculative runs: against the plain run (identity_by_kind)

    @classmethod
    def of(cls, result: RunResult, **extra) -> Run:
        return cls(result.tokens_per_s, result.seconds, result.generated, result.steps, **extra)


@dataclass
class KindResult:
    """A request kind at one concurrency: its plain, shared-draft and draft-adapter runs."""

    concurrency: int
    kind: str  # BASE or a task adapter's name
    requests: int
    runs: dict[str, Run] = field(default_factory=dict)

    def speedup(self, name: str) -> float | None:
        """``name``'s tokens/s over the plain run's (None when either is missing)."""
        run, plain = self.runs.get(name), self.runs.get("plain")
        return run.tokens_per_s / plain.tokens_per_s if run and plain else None

    def accept(self, name: str) -> float | None:
        """Mean accepted drafts a step of ``name``'s run."""
        run = self.runs.get(name)
        return run.summary["mean_accept"] if run and run.summary else None

    def identical(self, name: str) -> tuple[int, int]:
        """(identical outputs, requests) of ``name``'s run against the plain run."""
        run = self.runs.get(name)
        if run is None or run.identity is None:
            return 0, 0
        kinds = run.identity.values()
        return sum(k["identical"] for k in kinds), sum(k["count"] for k in kinds)


def workload(
    kind: str, pools: dict[str, list[list[int]]], count: int, gen_tokens: int, offset: int = 0
) -> Workload:
    """``count`` requests of ``kind`` on prompts of its pool from ``offset``; ``MIXED``: request
    ``i`` of every kind in turn (base, then each adapter), each on a prompt of its own pool."""
    kinds = [k for k in pools if k != MIXED] if kind == MIXED else [kind]
    chosen = [kinds[i % len(kinds)] for i in range(count)]
    prompts = [pools[k][(offset + i // len(kinds)) % len(pools[k])] for i, k in enumerate(chosen)]
    return Workload(prompts, [None if k == BASE else k for k in chosen], gen_tokens)


def warm_up(
    c: int, pools: dict[str, list[list[int]]], serving: Serving, decoders: Decoders, opts: LevelOptions
) -> None:
    """Each decoder serves a base-only and a mixed workload at concurrency ``c``, each of the
    timed runs' size (not timed): every graph shape the timed runs meet is captured here."""
    count = max(opts.count(c), 2)
    for kind in (BASE, MIXED):
        work = workload(kind, pools, count, opts.gen_tokens, offset=100)
        run_workload(serving.config, serving.runner, decoders.plain, work, c, f"warm-plain-{kind}-{c}")
        for name in SPEC_RUNS:
            tag = f"warm-{name}-{kind}-{c}"
            run_workload(decoders.configs[name], serving.runner, decoders.spec[name], work, c, tag)


def measure_kind(
    c: int, kind: str, pools: dict[str, list[list[int]]], serving: Serving, decoders: Decoders,
    opts: LevelOptions, k: int,
) -> KindResult:  # fmt: skip
    """``kind``'s workload at concurrency ``c`` through the plain decoder, then each speculative one."""
    runner = serving.runner
    count = max(opts.count(c), len(pools)) if kind == MIXED else opts.count(c)  # every kind at least once
    work = workload(kind, pools, count, opts.gen_tokens)
    result = KindResult(c, kind, len(work.prompts))
    off = run_workload(serving.config, runner, decoders.plain, work, c, f"off-{kind}-{c}")
    result.runs["plain"] = Run.of(off)
    outs_off = [off.outputs[f"off-{kind}-{c}-{i}"] for i in range(len(work.prompts))]
    for name in SPEC_RUNS:
        decoder = decoders.spec[name]
        decoder.metrics = type(decoder.metrics)(decoder.metrics.algorithm, k)  # this run's steps only
        on = run_workload(decoders.configs[name], runner, decoder, work, c, f"{name}-{kind}-{c}")
        outs_on = [on.outputs[f"{name}-{kind}-{c}-{i}"] for i in range(len(work.prompts))]
        identity = identity_by_kind(work.adapters, outs_off, outs_on, gap_of(runner, work, outs_off, outs_on))
        result.runs[name] = Run.of(on, summary=spec_summary(decoder), identity=identity)
    log(
        f"concurrency {c} {kind}: plain {off.tokens_per_s:,.1f} tok/s; "
        + "; ".join(
            f"{name} {result.runs[name].tokens_per_s:,.1f} tok/s x{result.speedup(name):.2f},"
            f" accepted {result.accept(name)}/step, identical {'/'.join(map(str, result.identical(name)))}"
            for name in SPEC_RUNS
        )
    )
    return result
