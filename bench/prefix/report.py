"""The markdown report: one row per workload and cache setting."""

from __future__ import annotations

from .driver import RunResult

HEADER = [
    "| workload | prefix cache | requests | TTFT p50 ms | TTFT p99 ms | output tok/s | hit rate | evicted tokens | same tokens as off |",
    "|---|---|---|---|---|---|---|---|---|",
]  # fmt: skip


def workload_label(name: str, think_s: float) -> str:
    """A workload's row name: users who think say how long."""
    return name if think_s <= 0 else f"{name}, think {think_s:g} s"


def same_tokens(a: RunResult, b: RunResult) -> str:
    """Requests whose outputs agree between two runs (greedy: they should, up to rounding)."""
    agree = sum(1 for rid, toks in a.outputs.items() if b.outputs.get(rid) == toks)
    return f"{agree}/{len(a.outputs)}"


def row(workload: str, cache: bool, result: RunResult, baseline: RunResult | None) -> str:
    same = "-" if baseline is None else same_tokens(result, baseline)
    return (
        f"| {workload} | {'on' if cache else 'off'} | {len(result.outputs)} | {result.ttft_ms(0.5):.1f} | "
        f"{result.ttft_ms(0.99):.1f} | {result.tok_s:.1f} | {result.hit_rate:.3f} | {result.evicted_tokens} | {same} |"
    )


def summary(workload: str, off: RunResult, on: RunResult) -> dict:
    """Machine-readable: what the test and a results table read."""
    return {
        "workload": workload,
        "ttft_p50_ms": [round(off.ttft_ms(0.5), 2), round(on.ttft_ms(0.5), 2)],
        "ttft_p99_ms": [round(off.ttft_ms(0.99), 2), round(on.ttft_ms(0.99), 2)],
        "tok_s": [round(off.tok_s, 1), round(on.tok_s, 1)],
        "hit_rate": round(on.hit_rate, 4),
        "off_hit_rate": round(off.hit_rate, 4),
        "requests": len(on.outputs),
        "same_tokens": same_tokens(on, off),
    }
