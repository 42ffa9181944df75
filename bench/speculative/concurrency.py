"""One concurrency level: the baseline, the batch-shape floor, each draft run and the k sweep."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from loraserve.runtime.speculative import build_decoder

from ..harness import log
from .decoders import Decoders
from .measure import MeasureOptions, Row, measure_plain, measure_spec, plain_floor
from .serving import Serving
from .workloads import RunResult, Workload


@dataclass
class Results:
    """What the timed runs have measured so far; the report is written from it."""

    rows: list[Row] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # per concurrency: the baseline, floor and runs (the JSON)
    notes: list[str] = field(default_factory=list)  # what failed or was skipped
    plain_runs: dict[int, tuple[Workload, RunResult]] = field(default_factory=dict)

    def note(self, message: str) -> None:
        """Record ``message`` for the report, and log it."""
        self.notes.append(message)
        log(message)


def measure_level(
    c: int,
    k_widths: list[int],
    serving: Serving,
    decoders: Decoders,
    pool,
    opts: MeasureOptions,
    results: Results,
) -> bool:
    """Every run at concurrency ``c`` into ``results``; False when the baseline failed (the
    drafts then have nothing to be measured against, and the level is left out)."""
    runner = serving.runner
    try:
        bench, off = measure_plain(serving.config, runner, decoders.plain, pool, c, opts)
    except Exception as exc:  # keep what was measured; say what failed
        results.note(f"concurrency {c} failed without speculation: {type(exc).__name__}: {exc}")
        return False
    details = results.details[c] = {"off_s": off.seconds, "off_steps": off.steps, "spec": {}}
    results.plain_runs[c] = (bench, off)
    if c != min(
        results.plain_runs
    ):  # the batch-shape floor: the same prompts, plain, at the lowest concurrency
        details["floor"] = plain_floor(runner, results.plain_runs, min(results.plain_runs), c)
    order = decoders.order()
    for i, name in enumerate(order):
        last = details["spec"].get(order[0], {}).get("on_s", 0.0)
        if i > 0 and time.monotonic() + 2.5 * last > opts.deadline:
            results.note(f"concurrency {c}: {name} skipped, the --deadline-s budget is spent")
            continue
        try:
            results.rows.append(
                measure_spec(decoders.configs[name], runner, decoders.spec[name], name, pool, c, opts, off, bench,
                             details["spec"], plain=(serving.config, decoders.plain))
            )  # fmt: skip
        except Exception as exc:
            results.note(f"concurrency {c} {name} failed: {type(exc).__name__}: {exc}")
    if c == 1 and k_widths:
        k_sweep(k_widths, order[0], decoders, runner, pool, opts, (off, bench), details["spec"], results)
    return True


def k_sweep(ks, name: str, decoders: Decoders, runner, pool, opts: MeasureOptions,
            baseline: tuple[RunResult, Workload], details: dict, results: Results) -> None:  # fmt: skip
    """``name``'s draft at concurrency 1 with each other verify width in ``ks``: a decoder of
    its own per width (its draft runner and graphs), the same workload and baseline."""
    off, bench = baseline
    for width in ks:
        if width == opts.k:
            continue
        last = details.get(name, {}).get("on_s", 0.0)
        if time.monotonic() + 2.5 * last > opts.deadline:
            results.note(f"--k-sweep: k = {width} and later skipped, the --deadline-s budget is spent")
            return
        config = decoders.configs[name].copy()
        config.speculative.num_steps = width - 1
        config.speculative.num_draft_tokens = width
        decoder = build_decoder(config=config, runner=runner, sampler=decoders.sampler)
        try:
            sweep_opts = replace(opts, k=width, profile=None, phases=None)
            results.rows.append(
                measure_spec(
                    config, runner, decoder, f"{name}-k{width}", pool, 1, sweep_opts, off, bench, details
                )
            )
        except Exception as exc:
            results.note(f"--k-sweep k = {width} failed: {type(exc).__name__}: {exc}")
        finally:
            del decoder
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
