"""What every benchmark shares: its output arguments, the environment it ran in, timing, and
writing its report (markdown to ``--out``, the JSON artifact to ``--json``).

The markdown is what a study keeps under ``bench/results/``; the JSON is a run's raw record,
written beside ``--out`` (or under :data:`ARTIFACTS`, which git ignores) and never committed.
Packages import it as ``..harness``; a script run by path (``bench/runtime.py``) through
``bootstrap.import_module("harness")``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

ARTIFACTS = Path(__file__).resolve().parents[1] / ".cache" / "bench"


def log(msg: str) -> None:
    """Print ``msg`` with the time of day, flushed."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--out`` (the markdown report) and ``--json`` (the raw record; default: beside ``--out``)."""
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--json", default=None, help="write the raw JSON record here (default: beside --out)")


def json_path(out: str | Path | None, json_arg: str | Path | None, name: str) -> Path:
    """Where a run's JSON goes: ``--json``, else beside ``--out``, else ``ARTIFACTS/<name>.json``."""
    if json_arg:
        return Path(json_arg)
    return Path(out).with_suffix(".json") if out else ARTIFACTS / f"{name}.json"


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except ImportError:
        return "absent"


def environment(device: torch.device | str | None = None) -> dict[str, str]:
    """The device and software a run used: what each study's markdown records."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = f"cpu ({platform.processor() or 'unknown'})"
    return {
        "gpu": gpu, "torch": torch.__version__, "triton": _version("triton"),
        "transformers": _version("transformers"), "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }  # fmt: skip


def environment_line(env: dict[str, str]) -> str:
    """``Device: <gpu>; torch X; triton Y; transformers Z; Python W``, one line of a report."""
    return (
        f"Device: {env['gpu']}; torch {env['torch']}; triton {env['triton']}; "
        f"transformers {env['transformers']}; Python {env['python']}"
    )


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, its rule and one line per row (cells ``str``-ed)."""
    return [_table_line(header), "|" + "---|" * len(header), *map(_table_line, rows)]


def _table_line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def write_report(text: str, record: object, *, out: str | Path | None, json_to: str | Path | None, name: str) -> Path:
    """Write the markdown to ``out`` (when given) and the JSON record (always, see
    :func:`json_path`); returns the JSON's path."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    path = json_path(out, json_to, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str))
    return path


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU): every wall-clock timing needs it."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_times(fn: Callable[[], object], device: torch.device | str, *, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, timed by ``perf_counter`` with the
    device synchronized before the first and after each (so queued kernels count)."""
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], q: float) -> float:
    """Linearly interpolated percentile of ``values`` (``q`` in [0, 100])."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def median_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 1, repeats: int = 5) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        return statistics.median(wall_times(fn, device, repeats=repeats)) * 1e3
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)

