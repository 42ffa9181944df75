"""Triton LoRA kernels on a real GPU: compiled kernels and CUDA-graph capture/replay.

Skipped where there is no CUDA device (CI); run on a GPU machine with
``pytest -m gpu tests/kernels``. The interpreter tests cover the same kernels on CPU.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, OverlapMode, build_batch_info, get_backend, linear_with_lora
from loraserve.kernels.graph_metadata import GraphLoRAMetadata
from loraserve.kernels.triton_backend import TritonLoRABackend
from loraserve.kernels.triton_ops.fused import barrier_timeouts

PATHS = {"auto": lambda: get_backend("triton", "cuda"), "fused": lambda: TritonLoRABackend(fused=True),
         "two-launch": lambda: TritonLoRABackend(fused=False)}  # fmt: skip

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def capture(step) -> torch.cuda.CUDAGraph:
    """``step`` warmed up on a side stream (compiles, allocates), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mode", ["decode", "verify", "extend"])
def test_compiled_kernels_match_float64(mode, dtype, path, make_pool, gen, check_apply):
    """Mixed ranks (16, 8, 0 in a rank-32 pool), GQA-shaped slices, base-model requests;
    B stored rank-major (as the runtime's pool stores it)."""
    pool = make_pool(in_dim=1000, widths=(512, 128, 128), ranks=[16, 8, 0, 32], max_rank=32, dtype=dtype)
    slots = [1, -1, 0, 3, 1, 2, 0, -1, 3]
    kwargs = {
        "decode": {},
        "verify": {"num_draft_tokens": 4},
        "extend": {"extend_lens": [37, 0, 5, 130, 1, 9, 64, 3, 2]},
    }[mode]
    fmode = {"decode": ForwardMode.DECODE, "verify": ForwardMode.TARGET_VERIFY, "extend": ForwardMode.EXTEND}[mode]
    info = build_batch_info(fmode, slots, pool.ranks, pool.scalings, device="cuda", **kwargs)
    pool.B = pool.B.transpose(1, 2).contiguous().transpose(1, 2)
    x, out0 = pool.inputs(gen, info.total_tokens)
    check_apply(PATHS[path](), info, pool, x, out0)
    assert not barrier_timeouts("cuda")


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("mode,k", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 4)])
def test_graph_replays_new_batches(mode, k, path, make_pool, gen, check_output):
    """One capture, replayed with different slots, ranks, scalings and batch sizes."""
    pool = make_pool(in_dim=512, widths=(256, 64, 64), ranks=[16] * 5, max_rank=16, dtype=torch.bfloat16)
    backend = PATHS[path]()
    meta = GraphLoRAMetadata(mode, 16, 5, num_draft_tokens=k if k > 1 else None, device="cuda")
    info = meta.capture_info(16)
    x, out = pool.inputs(gen, info.total_tokens)
    graph = capture(lambda: backend.apply(x, pool.A, pool.B, info, out, pool.offsets))
    for real_bs in (16, 11, 3):
        slots = torch.randint(-1, 5, (real_bs,), generator=gen).tolist()
        pool.ranks = torch.randint(0, 17, (5,), generator=gen).tolist()
        pool.scalings = (torch.rand(5, generator=gen) + 0.25).tolist()
        meta.update(slots, pool.ranks, pool.scalings, num_draft_tokens=k if k > 1 else None, batch_size=16)
        x_new, out_new = pool.inputs(gen, info.total_tokens)
        x.copy_(x_new)
        out.copy_(out_new)
        graph.replay()
        torch.cuda.synchronize()
        check_output(info, pool, x, out_new, out)
    assert not barrier_timeouts("cuda")


def test_fused_barrier_holds_over_many_launches(make_pool, gen):
    """Hundreds of single-launch applies back to back, graph-replayed: a barrier that let
    one program read partial sums before every program had written them, or a semaphore
    left out of phase by one launch, would show up as a wrong sum."""
    pool = make_pool(in_dim=4096, widths=(4096, 1024, 1024), ranks=[16, 16, 16], max_rank=16, dtype=torch.float32)
    backend = TritonLoRABackend(fused=True)
    info = build_batch_info(ForwardMode.DECODE, [0, 1, 2, 1], pool.ranks, pool.scalings, device="cuda")
    assert backend.fused_config(info, torch.empty(4, 4096, device="cuda"), pool.B, pool.offsets) is not None
    x, _ = pool.inputs(gen, info.total_tokens)
    once = torch.zeros(info.total_tokens, pool.out_dim, device="cuda")
    backend.apply(x, pool.A, pool.B, info, once, pool.offsets)
    out = torch.zeros_like(once)
    launches = 64
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.apply(x, pool.A, pool.B, info, out, pool.offsets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            backend.apply(x, pool.A, pool.B, info, out, pool.offsets)
    out.zero_()
    for _ in range(4):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, once * (4 * launches), rtol=1e-4, atol=1e-3)
    assert not barrier_timeouts("cuda")


@pytest.mark.parametrize("overlap", [OverlapMode.DELTA, OverlapMode.SHRINK])
@pytest.mark.parametrize("mode,k", [(ForwardMode.DECODE, 1), (ForwardMode.TARGET_VERIFY, 4)])
def test_overlapped_linear_replays_new_batches(mode, k, overlap, make_pool, gen, check_output):
    """The base GEMM and the LoRA on a second stream, captured as a fork/join and replayed
    with new slots: the output equals the GEMM plus the float64 delta, base rows equal the
    GEMM bit for bit, and every row of the graph's (poisoned) output is rewritten."""
    pool = make_pool(in_dim=512, widths=(256, 64, 64), ranks=[16] * 5, max_rank=16, dtype=torch.bfloat16)
    backend = get_backend("triton", "cuda")
    meta = GraphLoRAMetadata(mode, 16, 5, num_draft_tokens=k if k > 1 else None, device="cuda")
    info = meta.capture_info(16)
    x, _ = pool.inputs(gen, info.total_tokens)
    W = (torch.randn(pool.out_dim, 512, generator=gen) / 512**0.5).to("cuda", torch.bfloat16)
    side = torch.cuda.Stream()
    held = {}

    def step():
        held["y"] = linear_with_lora(
            backend, x, pool.A, pool.B, info, pool.offsets, lambda: torch.nn.functional.linear(x, W), mode=overlap,
            side=side,
        )

    graph = capture(step)
    for real_bs in (16, 11, 3):
        slots = torch.randint(-1, 5, (real_bs,), generator=gen).tolist()
        pool.ranks = torch.randint(0, 17, (5,), generator=gen).tolist()
        pool.scalings = (torch.rand(5, generator=gen) + 0.25).tolist()
        meta.update(slots, pool.ranks, pool.scalings, num_draft_tokens=k if k > 1 else None, batch_size=16)
        x.copy_(pool.inputs(gen, info.total_tokens)[0])
        held["y"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        base = torch.nn.functional.linear(x, W)
        if overlap is OverlapMode.SHRINK:  # the expand adds into the GEMM's own output
            check_output(info, pool, x, base, held["y"])
        else:  # GEMM + bf16 delta: base rows get + 0, LoRA rows one extra rounding
            check_output(info, pool, x, base, held["y"], tol=4e-2)
