"""``bench/speculative/phases/trace.py``: kernels charged to the phase that launched them, and the
synchronizing calls a step makes."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from bench.speculative.phases import trace as phase_trace


@pytest.fixture(scope="module")
def trace():
    return phase_trace


def _write(path, events):
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_kernels_go_to_the_innermost_range_around_their_launch(trace, tmp_path):
    """Nested ranges on two threads, launches inside and between them, a graph replay's
    several kernels on one correlation id, and a kernel whose launch was not traced."""
    events = [
        {"cat": "user_annotation", "name": "decoder.step", "tid": 1, "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "target.forward", "tid": 1, "ts": 10, "dur": 30},
        {"cat": "user_annotation", "name": "drafter.on_verify", "tid": 1, "ts": 50, "dur": 20},
        {"cat": "user_annotation", "name": "other thread", "tid": 2, "ts": 0, "dur": 1000},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 1, "ts": 20, "args": {"correlation": 7}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 45, "args": {"correlation": 8}},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "tid": 1, "ts": 60, "args": {"correlation": 9}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 150, "args": {"correlation": 10}},
        {"cat": "kernel", "name": "void gemv<float, 128>(float*)", "dur": 5, "args": {"correlation": 7}},
        {"cat": "kernel", "name": "void gemv<float, 128>(float*)", "dur": 6, "args": {"correlation": 7}},
        {"cat": "kernel", "name": "rms_norm_kernel", "dur": 2, "args": {"correlation": 7}},
        {"cat": "kernel", "name": "argmax", "dur": 3, "args": {"correlation": 8}},
        {"cat": "kernel", "name": "head_layer", "dur": 4, "args": {"correlation": 9}},
        {"cat": "kernel", "name": "after", "dur": 1, "args": {"correlation": 10}},
        {"cat": "kernel", "name": "orphan", "dur": 9, "args": {"correlation": 99}},
    ]
    table = trace.kernels_by_phase(_write(tmp_path / "t.json", events))
    assert table.phases["target.forward"] == {"gemv": (2, 11.0), "rms_norm_kernel": (1, 2.0)}
    assert table.phases["decoder.step"] == {"argmax": (1, 3.0)}  # between the inner ranges
    assert table.phases["drafter.on_verify"] == {"head_layer": (1, 4.0)}
    assert table.phases["(outside the timed calls)"] == {"after": (1, 1.0), "orphan": (1, 9.0)}
    assert table.total_us("target.forward") == 13.0
    text = trace.trace_markdown("spec", table, Counter({("target.forward", "a.py:1 f"): 4}), steps=2)
    assert "| **target.forward** | all (2 kinds) | 1.5 | **6.5** |" in text
    assert "| target.forward | `a.py:1 f` | 2.00 |" in text


def test_short_kernel_names_drop_templates_and_parameters(trace):
    assert trace.short_kernel_name(
        "void at::native::vectorized_elementwise_kernel<4, Foo<int>>(int, Foo)"
    ) == ("at::native::vectorized_elementwise_kernel")
    assert trace.short_kernel_name("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_trace_names_the_phase_and_the_call_site(trace):
    """A host read of a device value synchronizes; a queued kernel does not."""
    x = torch.ones(4, device="cuda")
    phase = ["verify"]
    with trace.SyncTrace(lambda: phase[0]) as syncs:
        y = x * 2  # queued, no wait
        phase[0] = "bookkeeping"
        value = y.sum().item()  # waits
    assert value == 8.0
    assert {p for p, _ in syncs.sites} == {"bookkeeping"}
    assert any("test_sync_trace_names_the_phase_and_the_call_site" in site for _, site in syncs.sites)
