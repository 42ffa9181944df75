"""``phases-<draft>.md`` and the one-line log of a phases run."""

from __future__ import annotations

from .summary import PHASE_WARMUP_STEPS


def _ms(cell: list[float] | None, i: int) -> str:
    return "–" if cell is None else f"{cell[i]:.3f}"


def phases_markdown(name: str, runs: dict[str, dict], meta: dict) -> str:
    """``phases-<draft>.md``: a table per decoder from :func:`summarize_phases`."""
    lines = [
        f"# Phases of one request at concurrency 1: {name} ({meta['device']})",
        "",
        f"One request ({meta['prompt_tokens']}-token held-out prompt, adapter {meta['adapter'] or 'base'},"
        f" {meta['new_tokens']} new tokens, greedy) through each decoder; the first {PHASE_WARMUP_STEPS}"
        " decode steps are left out. Host ms: `perf_counter` around the call, no synchronize (issuing it, or"
        " waiting where the call itself waits). GPU span ms: CUDA events recorded before and after the call"
        " on the current stream, read after the run (from the first to the last work it queued, idle time"
        " inside included). Indented rows are calls made inside the row above them; `(gap) A → B` rows are"
        " what lies between two timed calls of the same parent: host work that is not timed (tensor"
        " building, cache truncation, a sampler's wait for the device) and on the GPU either work queued"
        " there or idle time while the host works. Within a parent, children and gaps add up to it.",
        f"Instrumentation: about {meta['overhead_us']:.1f} µs of host time per timed call (measured on a"
        " no-op), included in the gaps.",
    ]
    for kind, s in runs.items():
        lines += [
            "",
            f"## {kind}: {s['steps']} steps timed ({s['skipped']} skipped), {s['tokens_per_step']} tokens / step,"
            f" {s['timed_calls_per_step']} timed calls / step; run {s['generated']} tokens in {s['seconds']:.3f} s,"
            f" graphs captured during it {s['graphs_captured']}",
            "",
            "| phase | calls / step | host ms / step (mean) | host ms (median) | GPU span ms / step (mean)"
            " | GPU span ms (median) |",
            "|---|---|---|---|---|---|",
        ]
        for row in s["rows"]:
            indent = "· " * (row["depth"] - 1)
            label = row["label"] if row["gap"] else f"`{row['label']}`"
            lines.append(
                f"| {indent}{label} | {row['calls']:g} | {_ms(row['host_ms'], 0)} | {_ms(row['host_ms'], 1)} |"
                f" {_ms(row['gpu_ms'], 0)} | {_ms(row['gpu_ms'], 1)} |"
            )
        lines += [
            f"| **step** (`decoder.step`, start to end) | 1 | {_ms(s['step_host_ms'], 0)} |"
            f" {_ms(s['step_host_ms'], 1)} | {_ms(s['step_gpu_ms'], 0)} | {_ms(s['step_gpu_ms'], 1)} |",
            f"| **between steps** (engine: one step's end to the next one's start) | 1 |"
            f" {_ms(s['between_host_ms'], 0)} | {_ms(s['between_host_ms'], 1)} | {_ms(s['between_gpu_ms'], 0)} |"
            f" {_ms(s['between_gpu_ms'], 1)} |",
        ]
    return "\n".join(lines) + "\n"


def phases_one_line(runs: dict[str, dict]) -> str:
    """A phases run summed up in one log line per decoder."""
    parts = []
    for kind, s in runs.items():
        top = ", ".join(
            f"{r['label']} {_ms(r['host_ms'], 0)}/{_ms(r['gpu_ms'], 0)}"
            for r in s["rows"]
            if r["depth"] == 1 and not r["gap"]
        )
        parts.append(
            f"{kind}: step host {_ms(s['step_host_ms'], 0)} ms, GPU span {_ms(s['step_gpu_ms'], 0)} ms,"
            f" between steps {_ms(s['between_host_ms'], 0)} ms, {s['tokens_per_step']} tokens/step"
            f" (host/GPU ms: {top})"
        )
    return "; ".join(parts)
