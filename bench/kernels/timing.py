"""Timing on the GPU: graph replays, copy bandwidth, launch floor, kernel timelines."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path

import torch

from ..harness import median_ms


def time_replays(fns: list, device: torch.device, reps: int) -> float:
    """Median milliseconds per callable, all of ``fns`` replayed back to back from a graph."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) * 1e3 / len(fns)
    replay = captured(lambda: [fn() for fn in fns], device)
    return median_ms(replay, device, warmup=1, repeats=reps) / len(fns)


def captured(step, device):
    """``step`` captured in a CUDA graph (warmed up on a side stream first: compiles, and keeps
    allocations out of the capture); returns its replay. Off CUDA, ``step`` itself."""
    if device.type != "cuda":
        return step
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    if device.type != "cuda":
        return float("nan")
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def launch_floor(device: torch.device, launches: int = 64) -> float:
    """Microseconds per launch of a one-program Triton kernel, replayed from a graph.

    The floor under any kernel here: what a launch costs before it moves a byte.
    """
    if device.type != "cuda":
        return float("nan")
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(ptr):
        tl.store(ptr + tl.program_id(0), tl.load(ptr + tl.program_id(0)) + 1.0)

    buf = torch.zeros(1, device=device)
    return 1e3 * time_replays([lambda: _touch[(1,)](buf)] * launches, device, 20)


def num_sms(device) -> int:
    """Streaming multiprocessors of ``device`` (4 off CUDA, for the heuristics)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@contextlib.contextmanager
def sm_carveout(sms: int):
    """Ask cuBLAS to leave ``sms`` SMs unused (torch's experimental carve-out; kernels
    chosen at capture keep it in the graph). Raises if this torch has no such knob."""
    if not sms:
        yield
        return
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if setter is None or getter is None:
        raise RuntimeError(f"torch {torch.__version__} has no cuBLAS SM carve-out")
    before = getter()
    setter(sms)
    try:
        yield
    finally:
        setter(before)


def trace_replay(fns: list, device: torch.device, path: Path) -> dict:
    """Kernel timeline of one graph replay of ``fns``: every kernel's stream, start and
    duration (µs from the first kernel), written to ``path`` as CSV; returns a summary:
    base-GEMM, shrink and expand kernel time, and how much LoRA kernel time ran while a
    base kernel was running."""
    from torch.profiler import ProfilerActivity, profile

    replay = captured(lambda: [fn() for fn in fns], device)
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    if not kernels:
        return {"kernels": 0}
    t0 = min(e.time_range.start for e in kernels)
    rows = sorted(
        (
            (getattr(e, "device_resource_id", 0), e.time_range.start - t0, e.time_range.elapsed_us(), e.name)
            for e in kernels
        ),
        key=lambda r: r[1],
    )
    path.write_text(
        "stream,start_us,dur_us,kernel\n"
        + "".join(f"{r[0]},{r[1]:.2f},{r[2]:.2f},{r[3][:90]!r}\n" for r in rows)
    )
    # A replayed graph runs its branches on streams of its own, so overlap is read from
    # kernel names: LoRA kernels against the base GEMMs (and cuBLAS's split-K reductions).
    lora = [(start, start + dur, name) for _, start, dur, name in rows if "_lora_" in name]
    base = [(start, start + dur) for _, start, dur, name in rows if "_lora_" not in name]

    def total(kind: str) -> float:
        return round(sum(b - a for a, b, name in lora if kind in name), 2)

    return {
        "kernels": len(rows),
        "base_us": round(sum(b - a for a, b in base), 2),
        "shrink_us": total("shrink"),
        "expand_us": total("expand"),
        "lora_beside_base_us": round(
            sum(max(0.0, min(b, d) - max(a, c)) for a, b, _ in lora for c, d in base), 2
        ),
    }
