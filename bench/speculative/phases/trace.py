"""Where a decode step's device time and host waits go: kernels and synchronizations by phase.

Used by ``--phases`` (``bench/speculative``) for one extra, untimed request per decoder:

- :class:`SyncTrace` records every synchronizing CUDA call (torch's sync debug mode) with
  its call site in the project and the phase it was made in;
- :func:`kernels_by_phase` reads a torch.profiler chrome trace and charges each GPU kernel
  (graph replays included: a replayed kernel carries the correlation id of the
  ``cudaGraphLaunch`` that queued it) to the innermost ``record_function`` range, on the
  launching thread, that encloses its launch.
"""

from __future__ import annotations

import bisect
import json
import re
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

_SYNC_MESSAGE = "called a synchronizing CUDA operation"
_PROJECT = re.compile(r"(loraserve|/runtime/|/kernels/|/operator/|bench/)")


class SyncTrace:
    """Counts synchronizing CUDA calls by (phase, call site) while active.

    ``phase_of()`` names the phase the caller is in (or None outside any). The site is
    the innermost three frames of project code on the caller's stack. Off CUDA nothing is
    recorded (the debug mode is a CUDA feature)."""

    def __init__(self, phase_of: Callable[[], str | None]):
        self.phase_of = phase_of
        self.sites: Counter[tuple[str, str]] = Counter()
        self._cuda = torch.cuda.is_available()
        self._guard: warnings.catch_warnings | None = None

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if _SYNC_MESSAGE not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if _PROJECT.search(f.filename)]
        site = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))
        self.sites[(self.phase_of() or "(outside a step)", site or f"{filename}:{lineno}")] += 1

    def __enter__(self) -> SyncTrace:
        if self._cuda:
            self._guard = warnings.catch_warnings()
            self._guard.__enter__()
            warnings.filterwarnings("always", message=f".*{_SYNC_MESSAGE}.*")
            warnings.showwarning = self._show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._cuda:
            torch.cuda.set_sync_debug_mode("default")
            assert self._guard is not None
            self._guard.__exit__(*exc)


@dataclass
class KernelTable:
    """GPU kernel time charged to each phase: ``{phase: {kernel: (count, microseconds)}}``."""

    phases: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)

    def total_us(self, phase: str) -> float:
        return sum(us for _, us in self.phases.get(phase, {}).values())


def short_kernel_name(name: str) -> str:
    """A kernel's name without template arguments and parameter lists, at most 70 characters."""
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(depth - 1, 0)
        elif depth == 0:
            out.append(ch)
    text = "".join(out).strip() or name
    text = text.removeprefix("void ").strip()
    return text[:70]


def kernels_by_phase(trace_file: Path) -> KernelTable:
    """Charge every kernel of a torch.profiler chrome trace to its innermost enclosing range."""
    events = json.loads(Path(trace_file).read_text()).get("traceEvents", [])
    ranges: dict[object, list[tuple[float, float, str]]] = defaultdict(list)
    launches: dict[object, tuple[object, float]] = {}
    kernels: list[tuple[object, str, float]] = []
    for ev in events:
        cat = ev.get("cat", "")
        args = ev.get("args") or {}
        if cat == "user_annotation":
            ranges[ev.get("tid")].append(
                (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), ev["name"])
            )
        elif cat == "cuda_runtime" and "correlation" in args:
            launches[args["correlation"]] = (ev.get("tid"), float(ev["ts"]))
        elif cat == "kernel" and "correlation" in args:
            kernels.append((args["correlation"], ev["name"], float(ev.get("dur", 0))))
    starts = {}
    for tid, spans in ranges.items():
        spans.sort()
        starts[tid] = [s for s, _, _ in spans]
    table: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for corr, name, dur in kernels:
        phase = "(outside the timed calls)"
        launch = launches.get(corr)
        if launch is not None and launch[0] in ranges:
            tid, ts = launch
            spans = ranges[tid]
            # Ranges nest (a stack per thread): the latest-starting one that still holds
            # the launch is the innermost.
            i = bisect.bisect_right(starts[tid], ts) - 1
            while i >= 0:
                _, end, label = spans[i]
                if end >= ts:
                    phase = label
                    break
                i -= 1
        cell = table[phase][short_kernel_name(name)]
        cell[0] += 1
        cell[1] += dur
    return KernelTable({p: {k: (int(c), us) for k, (c, us) in ks.items()} for p, ks in table.items()})


def trace_markdown(
    title: str, kernels: KernelTable, syncs: Counter[tuple[str, str]], steps: int, *, top: int = 12
) -> str:
    """Kernels by phase (per step) and synchronizations by site (per step)."""
    steps = max(steps, 1)
    lines = [
        f"### {title}: {steps} steps traced",
        "",
        "GPU kernel time charged to the innermost timed call that launched it (a graph replay's "
        "kernels to the call that replayed it), per step; within each phase the largest kernels.",
        "",
        "| phase | kernel | launches / step | µs / step |",
        "|---|---|---|---|",
    ]
    order = sorted(kernels.phases, key=lambda p: -kernels.total_us(p))
    for phase in order:
        rows = sorted(kernels.phases[phase].items(), key=lambda kv: -kv[1][1])
        n = sum(c for c, _ in kernels.phases[phase].values())
        lines.append(
            f"| **{phase}** | all ({len(rows)} kinds) | {n / steps:.1f} | **{kernels.total_us(phase) / steps:.1f}** |"
        )
        for name, (count, us) in rows[:top]:
            lines.append(f"| | `{name}` | {count / steps:.1f} | {us / steps:.1f} |")
    lines += [
        "",
        "Synchronizing CUDA calls (torch's sync debug mode), per step, by phase and call site:",
        "",
        "| phase | site (innermost first) | per step |",
        "|---|---|---|",
    ]
    if not syncs:
        lines.append("| (none recorded) | | |")
    for (phase, site), count in syncs.most_common():
        lines.append(f"| {phase} | `{site}` | {count / steps:.2f} |")
    return "\n".join(lines) + "\n"
