"""The timeline of each recorded step, and per-step means and medians over a run."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .recorder import Span

PHASE_WARMUP_STEPS = 3  # leading decode steps left out of the summary


def _elapsed_ms(a, b) -> float | None:
    """Milliseconds on the GPU from event ``a`` to event ``b`` (None without events)."""
    return None if a is None or b is None else float(a.elapsed_time(b))


@dataclass
class PhaseRow:
    """One call (or gap) of one step's timeline (:func:`phase_rows`)."""

    key: str  # the path of names from the step down, " / "-separated
    parent: str  # the parent's key ("" for the step itself)
    label: str
    depth: int  # 1: called by the step itself
    index: int  # position among the parent's rows
    host_ms: float
    gpu_ms: float | None


def phase_rows(span: Span, elapsed=_elapsed_ms, depth: int = 1, parent: str = "") -> list[PhaseRow]:
    """The timeline of one step: a row per timed call inside ``span`` (pre-order), with a
    ``(gap) A → B`` row before, between and after the calls of every parent: host time not
    inside a timed call, and GPU time between one call's end event and the next one's
    start event (work queued outside the timed calls, or the GPU idle while the host
    works). A parent's children and gaps add up to the parent."""
    rows: list[PhaseRow] = []
    prefix = f"{parent} / " if parent else ""
    index = 0

    def add(label: str, host_s: float, start, end) -> str:
        nonlocal index
        key = f"{prefix}{label}"
        rows.append(PhaseRow(key, parent, label, depth, index, 1e3 * host_s, elapsed(start, end)))
        index += 1
        return key

    prev_name, prev_t, prev_event = "start", span.t0, span.start
    for child in span.children:
        add(f"(gap) {prev_name} → {child.name}", child.t0 - prev_t, prev_event, child.start)
        key = add(child.name, child.t1 - child.t0, child.start, child.end)
        rows += phase_rows(child, elapsed, depth + 1, key)
        prev_name, prev_t, prev_event = child.name, child.t1, child.end
    if span.children:
        add(f"(gap) {prev_name} → end", span.t1 - prev_t, prev_event, span.end)
    return rows


def _mean_median(values: list[float | None]) -> list[float] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    ordered = sorted(got)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return [round(sum(got) / len(got), 4), round(median, 4)]


def summarize_phases(
    steps: list[Span],
    extends: list[tuple[float, float]],
    *,
    skip: int = PHASE_WARMUP_STEPS,
    elapsed=_elapsed_ms,
) -> dict:
    """Per-step means and medians of every phase (``phase_rows``) over ``steps[skip:]``
    (all of them when there are no more), plus per-step totals: the step's host time and
    GPU span, and the engine's time between one step's end and the next one's start (host;
    on the GPU, end event to start event), gaps that hold an extend left out."""
    skip = skip if len(steps) > skip else 0
    used = steps[skip:]
    first, per_step = _per_step_sums(used, elapsed)
    timed = any(s.start is not None for s in used)  # CUDA events: a step without a phase spent 0 ms in it
    rows = []
    for key in _timeline_order(first):
        label, depth = first[key].label, first[key].depth
        cells = [s.get(key, (0, 0.0, 0.0 if timed else None)) for s in per_step]
        rows.append({
            "phase": key, "label": label, "depth": depth, "gap": label.startswith("(gap)"),
            "calls": round(sum(c[0] for c in cells) / max(len(cells), 1), 2),
            "host_ms": _mean_median([c[1] for c in cells]),
            "gpu_ms": _mean_median([c[2] for c in cells]),
        })  # fmt: skip
    between_host, between_gpu = [], []
    for a, b in itertools.pairwise(used):
        if any(a.t1 <= t0 < b.t0 for t0, _ in extends):
            continue
        between_host.append(1e3 * (b.t0 - a.t1))
        between_gpu.append(elapsed(a.end, b.start))
    tokens = sum(s.tokens for s in used)
    return {
        "steps": len(used),
        "skipped": skip,
        "tokens_per_step": round(tokens / max(len(used), 1), 3),
        "rows": rows,
        "step_host_ms": _mean_median([1e3 * (s.t1 - s.t0) for s in used]),
        "step_gpu_ms": _mean_median([elapsed(s.start, s.end) for s in used]),
        "between_host_ms": _mean_median(between_host),
        "between_gpu_ms": _mean_median(between_gpu),
        "timed_calls_per_step": round(sum(_count_spans(s) for s in used) / max(len(used), 1), 2),
    }


def _per_step_sums(used: list[Span], elapsed) -> tuple[dict[str, PhaseRow], list[dict[str, list]]]:
    """Each phase's row at its earliest place among its parent's rows, and per step, each
    phase's ``[calls, host ms, GPU ms or None]`` summed over its calls in that step."""
    first: dict[str, PhaseRow] = {}
    per_step: list[dict[str, list]] = []
    for span in used:
        sums: dict[str, list] = {}
        for row in phase_rows(span, elapsed):
            if row.key not in first or row.index < first[row.key].index:
                first[row.key] = row
            cell = sums.setdefault(row.key, [0, 0.0, None])
            cell[0] += 1
            cell[1] += row.host_ms
            if row.gpu_ms is not None:
                cell[2] = (cell[2] or 0.0) + row.gpu_ms
        per_step.append(sums)
    return first, per_step


def _timeline_order(first: dict[str, PhaseRow]) -> list[str]:
    """Phase keys in timeline order: each parent followed by its children, by position."""
    children: dict[str, list[PhaseRow]] = {}
    for row in first.values():  # dicts keep first-seen order: the tie-break
        children.setdefault(row.parent, []).append(row)
    order: list[str] = []

    def visit(parent: str) -> None:
        for row in sorted(children.get(parent, []), key=lambda r: r.index):
            order.append(row.key)
            visit(row.key)

    visit("")
    return order


def _count_spans(span: Span) -> int:
    return sum(1 + _count_spans(child) for child in span.children)
