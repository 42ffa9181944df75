"""The benchmark from start to end: train, serve, check, time every level, report."""

from __future__ import annotations

import time

from ..harness import log
from . import cli
from .checks import check_notes, check_serving
from .concurrency import Results, measure_level
from .decoders import build_decoders
from .measure import MeasureOptions
from .models import train_models
from .report import write_run_report
from .serving import build_serving
from .settings import Settings
from .workloads import prompt_pool


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark on ``argv``; 1 when a run failed or was skipped, a served draft
    failed its check or, in a ``--smoke`` run, an output differs (:func:`verdict`). The
    report is written either way."""
    s = cli.parse(argv)
    started = time.monotonic()
    trained = train_models(s)
    serving = build_serving(s, trained)
    pool = prompt_pool(trained.held_ids, s.prompt_len)
    check = check_serving(s, trained, serving, pool)
    decoders = build_decoders(s, serving, trained.draft_dir)
    opts = MeasureOptions.from_settings(s, started)
    results = Results()
    results.notes += check_notes(trained.infos, smoke=s.smoke)  # in the report, and a smoke's verdict
    for note in results.notes:
        log(f"CHECK FAILED: {note}")
    for c in s.concurrency:
        if measure_level(c, s.k_sweep, serving, decoders, pool, opts, results):
            write_run_report(s, trained, serving.target_params, check, results)
    print(write_run_report(s, trained, serving.target_params, check, results))
    log(f"total {time.monotonic() - started:.0f} s")
    return verdict(s, results)


def verdict(s: Settings, results: Results) -> int:
    """1 when the report has notes (a run failed or was skipped; a served draft failed its
    check, :func:`.checks.check_notes`, so its numbers do not measure the draft that was
    trained), or in a ``--smoke`` run when a speculative output differs from the plain one
    (on a GPU, bf16 batching may change an output legitimately); else 0."""
    bad = [(r.concurrency, r.draft) for r in results.rows if r.same != r.count] if s.smoke else []
    if bad or results.notes:
        print(f"FAILED: outputs differ: {bad}; notes: {results.notes}")
        return 1
    return 0
