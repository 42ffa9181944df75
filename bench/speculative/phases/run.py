"""``--phases``: one more request per decoder, timed call by call, then traced."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...harness import environment, log
from ..workloads import make_workload, run_workload
from . import trace
from .recorder import PhaseRecorder
from .report import phases_markdown, phases_one_line
from .summary import summarize_phases

if TYPE_CHECKING:
    from ..measure import MeasureOptions


PHASE_TOKENS = 96  # new tokens of the one request each decoder runs under --phases


def phases_run(spec_config, runner, decoder, name: str, pool, opts: MeasureOptions, plain) -> dict:
    """One request through the speculative decoder, then (``plain``: ``(config, decoder)``)
    the same request through the plain one, each with its phases timed
    (:class:`PhaseRecorder`); writes ``phases-<name>.md`` to ``opts.phases`` and returns the
    summaries for the details JSON."""
    assert opts.phases is not None
    opts.phases.mkdir(parents=True, exist_ok=True)
    work = make_workload(pool, 1, min(opts.gen_tokens, PHASE_TOKENS), offset=300)
    cuda = torch.device(runner.device).type == "cuda"
    runs = [("spec", spec_config, decoder)] + ([("plain", *plain)] if plain is not None else [])
    overhead = PhaseRecorder(cuda).overhead_us()
    results, outputs = _timed_runs(runs, runner, work, name, cuda)
    meta = {
        "device": environment(runner.device)["gpu"],
        "prompt_tokens": len(work.prompts[0]), "adapter": work.adapters[0], "new_tokens": work.gen_tokens,
        "overhead_us": overhead,
    }  # fmt: skip
    text = phases_markdown(name, results, meta)
    if "plain" in outputs:
        same = outputs["spec"] == outputs["plain"]
        text += f"\nOutputs of the two runs identical: {'yes' if same else 'NO'}.\n"
        results["identical_outputs"] = same
    results["overhead_us_per_call"] = round(overhead, 2)
    text += (
        "\n## Kernels and synchronizations\n\nOne more run of the same request per decoder, "
        "untimed, under torch.profiler and torch's CUDA sync debug mode.\n\n"
    )
    (opts.phases / f"phases-{name}.md").write_text(text)  # kept if a traced run fails
    for kind, config, dec in runs:
        try:
            text += _traced_phases(config, runner, dec, work, name, kind, cuda) + "\n"
        except Exception as exc:  # the timed tables above stand without it
            log(f"trace {name} {kind} failed: {exc!r}")
            text += f"### {kind}: the traced run failed: `{exc!r}`\n\n"
    (opts.phases / f"phases-{name}.md").write_text(text)
    log(f"phases {name}: {phases_one_line({k: v for k, v in results.items() if isinstance(v, dict)})}")
    return results


def _timed_runs(runs, runner, work, name: str, cuda: bool) -> tuple[dict[str, dict], dict[str, list[int]]]:
    """Each ``(kind, config, decoder)`` of ``runs`` through ``work`` with its phases timed:
    the per-kind summaries and output tokens."""
    results: dict[str, dict] = {}
    outputs = {}
    for kind, config, dec in runs:
        recorder = PhaseRecorder(cuda)
        recorder.instrument(dec)
        try:
            result = run_workload(config, runner, dec, work, 1, f"phases-{name}-{kind}")
        finally:
            recorder.restore()
        recorder.close()
        summary = summarize_phases(recorder.steps, recorder.extends)
        summary.update(
            generated=result.generated, seconds=round(result.seconds, 4),
            graphs_captured=result.steps.get("graphs_captured", 0),
        )  # fmt: skip
        results[kind] = summary
        outputs[kind] = next(iter(result.outputs.values()), [])
    return results, outputs


def _traced_phases(config, runner, decoder, work, name: str, kind: str, cuda: bool) -> str:
    """One request through ``decoder`` under torch.profiler and the sync debug mode: GPU
    kernel time and synchronizing calls charged to the phase that caused them (markdown)."""
    from torch.profiler import ProfilerActivity, profile

    recorder = PhaseRecorder(cuda, annotate=True)
    recorder.instrument(decoder)
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    syncs = trace.SyncTrace(recorder.current)
    try:
        with syncs:
            run_workload(config, runner, decoder, work, 1, f"trace-{name}-{kind}", profiler=prof)
    finally:
        recorder.restore()
    recorder.close()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        table = trace.kernels_by_phase(path)
    log(f"trace {name} {kind}: {sum(syncs.sites.values())} synchronizing calls, {len(recorder.steps)} steps")
    return trace.trace_markdown(kind, table, syncs.sites, len(recorder.steps))
