"""LoRA kernel benchmark on Llama-3-8B shapes: correctness first, then timings.

Phases, in one process:
  1. environment and the copy bandwidth of this GPU (device-to-device copy, read + write);
  2. correctness of every kernel path on the benchmark shapes against a float64
     reference (decode, verify, extend; mixed ranks; base-model rows; fp16/bf16/fp32;
     the public shrink with a poisoned output; a CUDA-graph capture replayed with new
     slots; the verify-width guard);
  3. the LoRA work of one whole layer (seven modules: four apply calls, each one launch
     or a shrink/expand pair) vs the layer's base GEMMs, each replayed from a graph over
     32 layers' weights (a whole Llama-3-8B step, so neither the base nor the adapter
     weights sit in L2), for the default choice and each path forced;
  4. per-module timings, Triton vs a straightforward torch baseline (gather each
     request's adapter weights, bmm), both replayed from CUDA graphs over rotating
     inputs so nothing is served from L2;
  5. a few alternative launch configurations on key shapes (tuning record).

Writes ``kernels.json`` and ``kernels.md`` under ``--out`` (default ``$OUT`` or
``bench/results``) and prints a short table last.

    python bench/kernels.py               # on a CUDA machine
    TRITON_INTERPRET=1 python bench/kernels.py --tiny   # CPU dry run of every code path
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback
import types
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels():
    """``loraserve.kernels`` installed, or loaded straight from this checkout."""
    try:
        import loraserve.kernels as kernels

        return kernels
    except ImportError:
        pass
    if "loraserve" not in sys.modules:
        namespace = types.ModuleType("loraserve")
        namespace.__path__ = []
        sys.modules["loraserve"] = namespace
    spec = importlib.util.spec_from_file_location(
        "loraserve.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["loraserve.kernels"] = module
    spec.loader.exec_module(module)
    return module


K = _import_kernels()
from loraserve.kernels.graph_metadata import GraphLoRAMetadata  # noqa: E402
from loraserve.kernels.overlap import OverlapMode, OverlapPolicy, linear_with_lora  # noqa: E402
from loraserve.kernels.triton_backend import TritonLoRABackend  # noqa: E402
from loraserve.kernels.triton_ops import ExpandConfig, ShrinkConfig, pick_expand, pick_shrink  # noqa: E402
from loraserve.kernels.triton_ops.configs import MAX_PARTIAL_COLUMNS, GemmConfig, gemm_config, rank_block  # noqa: E402
from loraserve.kernels.triton_ops.expand import launch_expand  # noqa: E402
from loraserve.kernels.triton_ops.fused import barrier_timeouts  # noqa: E402
from loraserve.kernels.triton_ops.gemm_expand import gemm_linear, launch_gemm_expand  # noqa: E402
from loraserve.kernels.triton_ops.pdl import pdl_supported  # noqa: E402
from loraserve.kernels.triton_ops.shrink import launch_shrink  # noqa: E402

ForwardMode = K.ForwardMode


# -- shapes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Module:
    name: str
    in_dim: int
    widths: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        offs = [0]
        for w in self.widths:
            offs.append(offs[-1] + w)
        return tuple(offs)

    @property
    def out_dim(self) -> int:
        return sum(self.widths)


def llama_modules(tiny: bool) -> dict[str, Module]:
    if tiny:
        h, kv, ff = 64, 16, 96
    else:
        h, kv, ff = 4096, 1024, 14336
    return {
        "qkv": Module("qkv", h, (h, kv, kv)),
        "o": Module("o", h, (h,)),
        "gate_up": Module("gate_up", h, (ff, ff)),
        "down": Module("down", ff, (h,)),
    }


@dataclass(frozen=True)
class Workload:
    mode: str  # decode | verify | extend
    bs: int  # requests (extend: segments)
    adapters: int
    rank: int
    width: int = 1  # rows per request: 1, k, or the extend segment length
    max_rank: int = 0  # pool rank (0: = rank)
    rank_major_b: bool = False  # B stored [slots, max_rank, out] and passed as a transposed view
    graph: bool = False  # metadata as the runtime's CUDA graphs see it: tile capacity for bs, live tiles fewer

    @property
    def tokens(self) -> int:
        return self.bs * self.width

    @property
    def pool_rank(self) -> int:
        return self.max_rank or self.rank

    def label(self) -> str:
        tag = {"decode": "dec", "verify": f"ver{self.width}", "extend": f"ext{self.width}"}[self.mode]
        pool = f"/R{self.max_rank}" if self.max_rank else ""
        layout = " Bᵀ" if self.rank_major_b else ""
        graph = " [graph]" if self.graph else ""
        return f"{tag} bs{self.bs} a{self.adapters} r{self.rank}{pool}{layout}{graph}"


def forward_mode(mode: str) -> ForwardMode:
    return {"decode": ForwardMode.DECODE, "verify": ForwardMode.TARGET_VERIFY, "extend": ForwardMode.EXTEND}[mode]


def request_slots(w: Workload, gen: torch.Generator) -> list[int]:
    """Adapters spread over requests in a shuffled order, so grouping has work to do."""
    slots = [i % w.adapters for i in range(w.bs)]
    order = torch.randperm(w.bs, generator=gen).tolist()
    return [slots[i] for i in order]


def batch_info(w: Workload, slots: list[int], ranks: list[int], scalings: list[float], device) -> K.LoRABatchInfo:
    mode = forward_mode(w.mode)
    if w.graph:
        k = w.width if mode is ForwardMode.TARGET_VERIFY else None
        meta = GraphLoRAMetadata(mode, w.bs, len(ranks), num_draft_tokens=k, device=device)
        meta.capture_info(w.bs)
        info = meta.update(slots, ranks, scalings, num_draft_tokens=k, batch_size=w.bs)
        info._meta = meta  # keep the buffers' owner alive with the info
        return info
    kwargs: dict = {}
    if mode is ForwardMode.TARGET_VERIFY:
        kwargs["num_draft_tokens"] = w.width
    if mode is ForwardMode.EXTEND:
        kwargs["extend_lens"] = [w.width] * w.bs
    return K.build_batch_info(mode, slots, ranks, scalings, device=device, **kwargs)


# -- timing ------------------------------------------------------------------------------


def time_replays(fns: list, device: torch.device, reps: int) -> float:
    """Median milliseconds per callable, all of ``fns`` replayed back to back from a graph."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t0) * 1e3 / len(fns)
    replay = captured(lambda: [fn() for fn in fns], device)
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return statistics.median(times)


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


# -- reference ---------------------------------------------------------------------------


def reference_delta(x, A, B, row_slots, ranks, scalings, offsets) -> torch.Tensor:
    """float64 LoRA delta per row, straight from the per-row slots (independent of the layout)."""
    T = x.shape[0]
    R = B.shape[2]
    delta = torch.zeros(T, offsets[-1], dtype=torch.float64, device=x.device)
    for slot in sorted(set(row_slots)):
        if slot < 0 or ranks[slot] == 0:
            continue
        rows = torch.tensor([i for i, s in enumerate(row_slots) if s == slot], device=x.device)
        r = ranks[slot]
        xs = x[rows].double()
        for s in range(len(offsets) - 1):
            a = A[slot, s * R : s * R + r].double()
            b = B[slot, offsets[s] : offsets[s + 1], :r].double()
            delta[rows, offsets[s] : offsets[s + 1]] = scalings[slot] * ((xs @ a.T) @ b.T)
    return delta


def make_b(slots: int, out_dim: int, rank: int, rank_major: bool, **kw) -> torch.Tensor:
    """B ``[slots, out, rank]``; rank-major storage is a transposed view of ``[slots, rank, out]``."""
    if rank_major:
        return torch.randn(slots, rank, out_dim, **kw).transpose(1, 2)
    return torch.randn(slots, out_dim, rank, **kw)


TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


@dataclass
class Check:
    name: str
    ok: bool
    error: float
    detail: str = ""


def check_apply(backend, w: Workload, module: Module, dtype, device, gen, ranks=None, base_requests=0) -> Check:
    """One apply against float64: relative error of the delta, every LoRA row written, base rows untouched."""
    R = w.pool_rank
    num_slots = w.adapters + 1
    ranks = ranks or [w.rank] * w.adapters + [0]  # the last slot is rank 0
    scalings = [0.5 + torch.rand(1, generator=gen).item() for _ in range(num_slots)]
    slots = request_slots(w, gen)
    slots = slots[: len(slots) - base_requests] + [-1] * base_requests
    if w.bs > 2:
        slots[1] = num_slots - 1  # one request on the rank-0 slot
    info = batch_info(w, slots, ranks, scalings, device)
    T = info.total_tokens
    S = len(module.widths)
    x = torch.randn(T, module.in_dim, generator=gen).to(device, dtype)
    A = (torch.randn(num_slots, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(device, dtype)
    B = make_b(num_slots, module.out_dim, R, w.rank_major_b, generator=gen).to(device, dtype)
    if w.rank_major_b:
        B = B.transpose(1, 2).contiguous().transpose(1, 2)  # same values, rank-major storage
    out0 = torch.randn(T, module.out_dim, generator=gen).to(device, dtype)
    out = out0.clone()
    backend.apply(x, A, B, info, out, module.offsets)
    row_slots = info.token_slots.tolist()
    delta = reference_delta(x, A, B, row_slots, ranks, scalings, module.offsets)
    got = out.double() - out0.double()
    active = torch.tensor([s >= 0 and ranks[s] > 0 for s in row_slots], device=device)
    err = ((got - delta).norm() / delta.norm().clamp_min(1e-30)).item()
    row_err = ((got - delta).norm(dim=1) / delta.norm(dim=1).clamp_min(1e-30))[active]
    worst_row = row_err.max().item() if row_err.numel() else 0.0
    untouched = bool(torch.equal(out[~active], out0[~active]))
    tol = TOL[dtype]
    ok = err < tol and worst_row < 4 * tol and untouched and math.isfinite(err)
    name = f"apply {module.name} {w.label()} {str(dtype)[6:]}"
    return Check(name, ok, err, f"worst row {worst_row:.1e}, base rows untouched={untouched}")


def check_epilogue(backend, w: Workload, module: Module, dtype, device, gen, base_requests=1) -> Check:
    """The base GEMM with the expand in its epilogue against float64: ``x Wᵀ + delta`` and the
    delta alone (what the output carries beyond the float64 base), base rows equal to the base."""
    R = w.pool_rank
    ranks = [w.rank] * w.adapters
    scalings = [0.5 + torch.rand(1, generator=gen).item() for _ in range(w.adapters)]
    slots = request_slots(w, gen)
    slots = slots[: len(slots) - base_requests] + [-1] * base_requests
    info = batch_info(w, slots, ranks, scalings, device)
    T = info.total_tokens
    S = len(module.widths)
    x = torch.randn(T, module.in_dim, generator=gen).to(device, dtype)
    W = (torch.randn(module.out_dim, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(
        device, dtype
    )
    A = (torch.randn(w.adapters, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(
        device, dtype
    )
    B = make_b(w.adapters, module.out_dim, R, w.rank_major_b, generator=gen).to(device, dtype)
    stage = backend.shrink_stage(x, A, info, S)
    cfg = gemm_config(T, module.out_dim, module.in_dim, dtype, num_sms(device))
    out = torch.full((T, module.out_dim), float("nan"), dtype=dtype, device=device)
    launch_gemm_expand(x, W, None, stage, B, info, module.offsets, cfg, out=out)
    row_slots = info.token_slots.tolist()
    base = x.double() @ W.double().T
    delta = reference_delta(x, A, B, row_slots, ranks, scalings, module.offsets)
    err = ((out.double() - base - delta).norm() / (base + delta).norm()).item()
    delta_err = ((out.double() - base - delta).norm() / delta.norm().clamp_min(1e-30)).item()
    active = torch.tensor([s >= 0 for s in row_slots], device=device)
    base_err = ((out.double()[~active] - base[~active]).norm() / base[~active].norm().clamp_min(1e-30)).item()
    tol = TOL[dtype]
    ok = all(math.isfinite(e) for e in (err, delta_err, base_err)) and err < tol and delta_err < 4 * tol
    ok = ok and (not base_requests or base_err < tol)
    name = f"gemm+expand {module.name} {w.label()} {str(dtype)[6:]}"
    return Check(
        name, ok, err, f"delta err {delta_err:.1e}, base rows err {base_err:.1e}, cfg {describe(cfg)}"
    )


def num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def check_public_shrink(backend, w: Workload, module: Module, dtype, device, gen) -> Check:
    """The public shrink into a NaN-poisoned buffer: every LoRA row and rank column written."""
    R = w.pool_rank
    S = len(module.widths)
    ranks = [max(1, w.rank // (i + 1)) for i in range(w.adapters)]
    slots = request_slots(w, gen)
    info = batch_info(w, slots, ranks, [1.0] * w.adapters, device)
    x = torch.randn(info.total_tokens, module.in_dim, generator=gen).to(device, dtype)
    A = torch.randn(w.adapters, S * R, module.in_dim, generator=gen).to(device, dtype)
    out = torch.full((info.total_tokens, S * R), float("nan"), dtype=dtype, device=device)
    backend.shrink(x, A, info, S, out=out)
    worst = 0.0
    written = True
    for t, slot in enumerate(info.token_slots.tolist()):
        r = ranks[slot]
        for s in range(S):
            got = out[t, s * R : s * R + r].double()
            ref = x[t].double() @ A[slot, s * R : s * R + r].double().T
            written &= bool(torch.isfinite(got).all())
            worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    ok = written and worst < 4 * TOL[dtype]
    return Check(f"shrink {module.name} {w.label()} {str(dtype)[6:]}", ok, worst, f"all written={written}")


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


def random_batch(gen, bs: int, num_slots: int, max_rank: int) -> tuple[list[int], list[int], list[float]]:
    """Fresh per-request slots (-1: base model), per-slot ranks (0..max_rank) and scalings."""
    slots = [int(torch.randint(-1, num_slots, (1,), generator=gen)) for _ in range(bs)]
    ranks = [int(torch.randint(0, max_rank + 1, (1,), generator=gen)) for _ in range(num_slots)]
    scalings = [0.25 + torch.rand(1, generator=gen).item() for _ in range(num_slots)]
    return slots, ranks, scalings


def check_graph(backend, module: Module, device, gen, mode: str, max_bs: int, k: int, max_rank: int = 16) -> list[Check]:
    """Capture one apply at max_bs, then replay with fresh slots/ranks (0..max_rank) each time."""
    checks = []
    dtype = torch.bfloat16
    num_slots, R = 6, max_rank
    fm = forward_mode(mode)
    meta = GraphLoRAMetadata(fm, max_bs, num_slots, num_draft_tokens=k if mode == "verify" else None, device=device)
    info = meta.capture_info(max_bs)
    T = info.total_tokens
    S = len(module.widths)
    x = torch.randn(T, module.in_dim, generator=gen).to(device, dtype)
    A = (torch.randn(num_slots, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(device, dtype)
    B = torch.randn(num_slots, module.out_dim, R, generator=gen).to(device, dtype)
    out = torch.zeros(T, module.out_dim, dtype=dtype, device=device)

    def step():
        backend.apply(x, A, B, info, out, module.offsets)

    replay = captured(step, device)
    for trial in range(3):
        real_bs = max(1, max_bs - trial * (max_bs // 3))
        slots, ranks, scalings = random_batch(gen, real_bs, num_slots, R)
        meta.update(slots, ranks, scalings, num_draft_tokens=k if mode == "verify" else None, batch_size=max_bs)
        x.copy_(torch.randn(T, module.in_dim, generator=gen).to(device, dtype))
        out.copy_(torch.randn(T, module.out_dim, generator=gen).to(device, dtype))
        out0 = out.clone()
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize()
        row_slots = info.token_slots.tolist()
        delta = reference_delta(x, A, B, row_slots, ranks, scalings, module.offsets)
        got = out.double() - out0.double()
        active = torch.tensor([s >= 0 and ranks[s] > 0 for s in row_slots], device=device)
        err = ((got - delta).norm() / delta.norm().clamp_min(1e-30)).item() if bool(active.any()) else 0.0
        untouched = bool(torch.equal(out[~active], out0[~active]))
        checks.append(
            Check(f"graph {mode} {module.name} bs{real_bs}/{max_bs} k{k} trial{trial}", err < TOL[dtype] and untouched, err)
        )
    if mode == "verify":
        try:
            meta.update([0], [R] * num_slots, [1.0] * num_slots, num_draft_tokens=k + 1, batch_size=max_bs)
            checks.append(Check("verify width guard", False, 0.0, "no error raised"))
        except ValueError as exc:
            named = str(k) in str(exc) and str(k + 1) in str(exc)
            checks.append(Check("verify width guard", named, 0.0, str(exc)[:80]))
    return checks


def check_overlap(backend, module: Module, device, gen, overlap: OverlapMode, mode: str, max_bs: int, k: int) -> list[Check]:
    """``linear_with_lora`` captured in a graph (base GEMM + LoRA on a side stream), replayed with new slots."""
    checks = []
    dtype = torch.bfloat16
    num_slots, R = 6, 16
    fm = forward_mode(mode)
    meta = GraphLoRAMetadata(fm, max_bs, num_slots, num_draft_tokens=k if mode == "verify" else None, device=device)
    info = meta.capture_info(max_bs)
    T = info.total_tokens
    S = len(module.widths)
    x = torch.randn(T, module.in_dim, generator=gen).to(device, dtype)
    W = (torch.randn(module.out_dim, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(device, dtype)
    A = (torch.randn(num_slots, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(device, dtype)
    B = make_b(num_slots, module.out_dim, R, True, generator=gen).to(device, dtype)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    result: dict[str, torch.Tensor] = {}

    def step():
        result["y"] = linear_with_lora(backend, x, A, B, info, module.offsets, lambda: F.linear(x, W), mode=overlap, side=side)

    replay = captured(step, device)
    for trial in range(3):
        real_bs = max(1, max_bs - trial * (max_bs // 3))
        slots, ranks, scalings = random_batch(gen, real_bs, num_slots, R)
        meta.update(slots, ranks, scalings, num_draft_tokens=k if mode == "verify" else None, batch_size=max_bs)
        x.copy_(torch.randn(T, module.in_dim, generator=gen).to(device, dtype))
        if "y" in result:  # a graph's output buffer: poisoned, every row must be rewritten
            result["y"].fill_(float("nan"))
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize()
        base = F.linear(x, W).double()
        row_slots = info.token_slots.tolist()
        delta = reference_delta(x, A, B, row_slots, ranks, scalings, module.offsets)
        got = result["y"].double() - base
        active = torch.tensor([s >= 0 and ranks[s] > 0 for s in row_slots], device=device)
        err = ((got - delta).norm() / delta.norm().clamp_min(1e-30)).item() if bool(active.any()) else 0.0
        # base rows: the GEMM's output (bf16) plus nothing
        base_ok = bool((got[~active].abs() <= 1e-2 * base[~active].abs() + 1e-3).all())
        finite = bool(torch.isfinite(result["y"]).all())
        checks.append(
            Check(
                f"overlap-{overlap.value} {mode} {module.name} bs{real_bs}/{max_bs} trial{trial}",
                err < TOL[dtype] and base_ok and finite,
                err,
                f"base rows = GEMM: {base_ok}, all written: {finite}",
            )
        )
    return checks


def rank_checks(device, modules, tiny: bool) -> list[Check]:
    """Rank-64 pools on decode/verify tiles (run 9): small- and full-rank steps in one launch, graphs."""
    gen = torch.Generator().manual_seed(99)
    checks: list[Check] = []
    works = [
        Workload("decode", 24 if not tiny else 6, 4, 16, 1, 64, rank_major_b=True),
        Workload("verify", 12 if not tiny else 3, 3, 16, 4, 64, rank_major_b=True),
        Workload("decode", 8 if not tiny else 4, 4, 64, 1, 64, rank_major_b=True),
    ]
    for tag, backend in (("", TritonLoRABackend()), ("[wide-rank] ", TritonLoRABackend(small_rank_block=0))):
        for module in modules.values():
            for w in works:
                c = check_apply(backend, w, module, torch.bfloat16, device, gen, base_requests=1)
                c.name = tag + c.name
                checks.append(c)
            mixed = check_apply(backend, works[0], module, torch.bfloat16, device, gen, ranks=[64, 16, 40, 7, 0])
            mixed.name = f"{tag}{mixed.name} ranks 64/16/40/7/0"
            checks.append(mixed)
    checks += check_graph(TritonLoRABackend(), modules["gate_up"], device, gen, "decode", 16, 1, max_rank=64)
    checks += check_graph(TritonLoRABackend(), modules["qkv"], device, gen, "verify", 8, 4, max_rank=64)
    return checks


def correctness(device, modules, tiny: bool, fast: bool = False) -> list[Check]:
    gen = torch.Generator().manual_seed(1234)
    backend = TritonLoRABackend()
    checks: list[Check] = []
    bs = 6 if tiny else 24
    works = [
        Workload("decode", bs, 4, 16, 1, 64 if not tiny else 0),
        Workload("verify", bs // 2, 3, 8, 4, 0),
        Workload("extend", 3, 3, 16, 7 if tiny else 37, 0),
    ]
    for module in modules.values():
        for w in works:
            checks.append(check_apply(backend, w, module, torch.bfloat16, device, gen, base_requests=1))
    qkv = modules["qkv"]
    for dtype in (torch.float16, torch.float32):
        checks.append(check_apply(backend, works[0], qkv, dtype, device, gen))
    # Mixed ranks in one pool (8, 16, 64 and 0), extend with uneven segments.
    mixed = Workload("extend", 4, 4, 64, 5 if tiny else 129, 0)
    checks.append(check_apply(backend, mixed, modules["gate_up"], torch.bfloat16, device, gen, ranks=[8, 16, 64, 0, 0]))
    # Forced split-K in both directions, and alternative tiles.
    for sc, ec in [
        (ShrinkConfig(16, 64, 1), ExpandConfig(64, 16)),
        (ShrinkConfig(16, 128, 8), ExpandConfig(256, 16, num_warps=8)),
    ]:
        forced = TritonLoRABackend(shrink_config=sc, expand_config=ec)
        checks.append(check_apply(forced, works[1], qkv, torch.bfloat16, device, gen))
    checks.append(check_public_shrink(backend, works[0], qkv, torch.bfloat16, device, gen))
    # The base GEMM with the expand in its epilogue (rank-major B, as the pool stores it).
    for module in modules.values():
        for w in works:
            checks.append(check_epilogue(backend, replace(w, rank_major_b=True), module, torch.bfloat16, device, gen))
    for dtype in (torch.float16, torch.float32):
        checks.append(check_epilogue(backend, works[1], qkv, dtype, device, gen))
    checks += check_graph(backend, qkv, device, gen, "verify", 8, 4)
    checks += check_graph(backend, modules["down"], device, gen, "decode", 16, 1)
    rank_major = Workload("decode", bs, 4, 16, 1, 64, rank_major_b=True)
    for module in (qkv, modules["gate_up"]):
        checks.append(check_apply(backend, rank_major, module, torch.bfloat16, device, gen, base_requests=1))
    # Each path forced: the single launch (grid barrier) and the two-launch pair.
    for tag, variant in (("fused", TritonLoRABackend(fused=True)), ("two-launch", TritonLoRABackend(fused=False))):
        for module in modules.values():
            for w in works[:2]:
                c = check_apply(variant, w, module, torch.bfloat16, device, gen, base_requests=1)
                c.name = f"[{tag}] {c.name}"
                checks.append(c)
            c = check_apply(variant, rank_major, module, torch.bfloat16, device, gen, base_requests=1)
            c.name = f"[{tag}] {c.name}"
            checks.append(c)
        for c in check_graph(variant, qkv, device, gen, "verify", 8, 4) + check_graph(
            variant, modules["gate_up"], device, gen, "decode", 16, 1
        ):
            c.name = f"[{tag}] {c.name}"
            checks.append(c)
    # Beside the base GEMM on a second stream, both joins, under graph capture.
    for overlap in (OverlapMode.DELTA, OverlapMode.SHRINK):
        checks += check_overlap(backend, qkv, device, gen, overlap, "verify", 8, 4)
        checks += check_overlap(backend, modules["gate_up"], device, gen, overlap, "decode", 16, 1)
    variants = [("pdl", TritonLoRABackend(pdl=True))] if pdl_supported(device) and not fast else []
    for tag, variant in variants:
        for w in works:
            c = check_apply(variant, w, modules["gate_up"], torch.bfloat16, device, gen, base_requests=1)
            c.name = f"[{tag}] {c.name}"
            checks.append(c)
        for c in check_graph(variant, qkv, device, gen, "verify", 8, 4)[:3]:
            c.name = f"[{tag}] {c.name}"
            checks.append(c)
    return checks


# -- per-module timings ------------------------------------------------------------------


@dataclass
class Row:
    module: str
    workload: str
    tokens: int
    bytes: int
    triton_us: float
    torch_us: float
    bw_frac: float  # achieved / copy bandwidth
    speedup: float
    weight_frac: float  # adapter weights' share of the bytes
    shrink: str = ""
    expand: str = ""
    extra: dict = field(default_factory=dict)
    variant: str = "default"


def moved_bytes(w: Workload, m: Module, elem: int = 2) -> tuple[int, int]:
    """(total, adapter-weight) bytes: x, the distinct adapters' A and B, out read + write."""
    S = len(m.widths)
    weights = w.adapters * (S * w.rank * m.in_dim + m.out_dim * w.rank) * elem
    total = w.tokens * m.in_dim * elem + weights + 2 * w.tokens * m.out_dim * elem
    return total, weights


class ModuleCase:
    """Rotating sets of inputs and adapter pools for one (workload, module)."""

    def __init__(self, w: Workload, m: Module, device, gen, l2_bytes: int, max_sets: int = 512):
        self.w, self.m = w, m
        S, R = len(m.widths), w.pool_rank
        self.slots = request_slots(w, gen)
        ranks = [w.rank] * w.adapters
        scalings = [1.0 / w.rank] * w.adapters
        self.info = batch_info(w, self.slots, ranks, scalings, device)
        self.scal = torch.tensor(scalings, device=device)
        per_set = (
            w.adapters * (S * R * m.in_dim + m.out_dim * R) + w.tokens * (m.in_dim + m.out_dim)
        ) * 2
        self.sets = max(2, min(max_sets, math.ceil(3 * l2_bytes / per_set)))
        T = w.tokens
        self.x, self.A, self.B, self.out = [], [], [], []
        for _ in range(self.sets):
            self.x.append(torch.randn(T, m.in_dim, device=device, dtype=torch.bfloat16))
            self.A.append(torch.randn(w.adapters, S * R, m.in_dim, device=device, dtype=torch.bfloat16) * 0.02)
            self.B.append(make_b(w.adapters, m.out_dim, R, w.rank_major_b, device=device, dtype=torch.bfloat16).mul_(0.02))
            self.out.append(torch.randn(T, m.out_dim, device=device, dtype=torch.bfloat16))
        self.req_slots = torch.tensor(self.slots, device=device, dtype=torch.long)

    def triton_fns(self, backend):
        return [
            (lambda i=i: backend.apply(self.x[i], self.A[i], self.B[i], self.info, self.out[i], self.m.offsets))
            for i in range(self.sets)
        ]

    def shrink_fns(self, partial, config: ShrinkConfig):
        """The shrink alone, into one shared partial-sum buffer."""
        S = len(self.m.widths)
        return [
            (lambda i=i: launch_shrink(self.x[i], self.A[i], partial, self.info, S, config)) for i in range(self.sets)
        ]

    def expand_fns(self, partial, config: ExpandConfig):
        """The expand alone, from one shared partial-sum buffer."""
        return [
            (lambda i=i: launch_expand(partial, self.B[i], self.out[i], self.info, self.m.offsets, config))
            for i in range(self.sets)
        ]

    def torch_fns(self):
        w, m = self.w, self.m
        R = w.pool_rank
        offs = m.offsets

        def baseline(i: int) -> None:
            x = self.x[i].view(w.bs, w.width, m.in_dim)
            out = self.out[i].view(w.bs, w.width, m.out_dim)
            a = self.A[i][self.req_slots]  # [bs, S*R, in]: each request's adapter, gathered
            b = self.B[i][self.req_slots]  # [bs, out, R]
            xa = torch.bmm(x, a.transpose(1, 2))
            scale = self.scal[self.req_slots].to(x.dtype)[:, None, None]
            for s in range(len(m.widths)):
                lo, hi = offs[s], offs[s + 1]
                out[:, :, lo:hi] += scale * torch.bmm(xa[:, :, s * R : (s + 1) * R], b[:, lo:hi].transpose(1, 2))

        return [(lambda i=i: baseline(i)) for i in range(self.sets)]


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
        e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    if not kernels:
        return {"kernels": 0}
    t0 = min(e.time_range.start for e in kernels)
    rows = sorted(
        ((getattr(e, "device_resource_id", 0), e.time_range.start - t0, e.time_range.elapsed_us(), e.name) for e in kernels),
        key=lambda r: r[1],
    )
    path.write_text("stream,start_us,dur_us,kernel\n" + "".join(f"{r[0]},{r[1]:.2f},{r[2]:.2f},{r[3][:90]!r}\n" for r in rows))
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


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted, or a dash where a variant has no such number."""
    return "-" if value is None else format(value, spec)


def describe(cfg) -> str:
    return ",".join(f"{k}={v}" for k, v in asdict(cfg).items())


# variant -> the join beside the base GEMM (None: the runtime's policy); default backend
OVERLAPS = {
    "overlap-auto": None,
    "overlap-delta": OverlapMode.DELTA,
    "overlap-shrink": OverlapMode.SHRINK,
    "overlap-mixed": "mixed",  # delta where the GEMM is long (gate_up, down), shrink elsewhere
    "overlap-auto-wide": None,  # the runtime's join with every tile at the pool's rank step (before run 9)
    "overlap-delta-carve16": OverlapMode.DELTA,  # cuBLAS told to leave 16 SMs to the side stream
    "overlap-delta-carve32": OverlapMode.DELTA,
    "overlap-shrink-carve16": OverlapMode.SHRINK,
    "tuned-shrink": OverlapMode.SHRINK,  # the tune phase's configurations, shrink join
}
# variants that take each module's configuration from the tune phase of the same run
TUNED = ("tuned", "tuned-shrink")
# variant -> SMs the base GEMMs leave free (torch's experimental cuBLAS SM carve-out); the
# base-only timing keeps every SM, so what the GEMMs lose shows in the increment
CARVEOUTS = {"overlap-delta-carve16": 16, "overlap-delta-carve32": 32, "overlap-shrink-carve16": 16}
MIXED_DELTA = ("gate_up", "down")

# variants whose base GEMM is the Triton kernel (triton_ops/gemm_expand.py) instead of cuBLAS:
# "gemm-only" without LoRA (the kernel's own cost against cuBLAS), "epilogue" the shrink then
# the GEMM with the expand in its epilogue, "epilogue-auto" the delta join at <= 2 tiles (the
# runtime's choice there) and the epilogue above
TRITON_GEMM = ("gemm-only", "epilogue", "epilogue-auto")
EPILOGUE = ("default", "overlap-auto", *TRITON_GEMM)

class TweakedBackend(TritonLoRABackend):
    """The default backend with fields of its chosen shrink/expand configurations replaced."""

    def __init__(self, shrink: dict | None = None, expand: dict | None = None) -> None:
        super().__init__()
        self.shrink_tweak, self.expand_tweak = shrink or {}, expand or {}

    def shrink_config(self, *args, **kwargs) -> ShrinkConfig:
        return replace(super().shrink_config(*args, **kwargs), **self.shrink_tweak)

    def expand_config(self, *args, **kwargs) -> ExpandConfig:
        return replace(super().expand_config(*args, **kwargs), **self.expand_tweak)


# The expand's column loop: the register prefetch of one block (reg, the default before run
# 10; still the single-launch kernel's loop) against Triton's pipeliner (cp.async, STAGES-1
# blocks ahead; the default since, extend tiles too since run 11), with other column groups
# or 256-wide blocks. Forced variants apply to every tile. Run 11 removed run 10's own
# choice (run10) and the CUDA-core expands for tiles of 1 / 4 live rows (row, row4): all
# three lost (bench/results/2026-12-06-kernels-h100-run11.md).
PIPELINED = {
    "reg": {"expand": {"pipeline_stages": 0}},
    "pipe2": {"expand": {"pipeline_stages": 2}},
    "pipe3": {"expand": {"pipeline_stages": 3}},
    "pipe4": {"expand": {"pipeline_stages": 4}},
    "pipe3-g1": {"expand": {"pipeline_stages": 3, "col_blocks": 1}},
    "pipe3-g4": {"expand": {"pipeline_stages": 3, "col_blocks": 4}},
    "pipe3-g8": {"expand": {"pipeline_stages": 3, "col_blocks": 8}},
    "pipe3-n256w8": {"expand": {"pipeline_stages": 3, "block_n": 256, "num_warps": 8}},
}


LAYER_PIPELINED = ("reg",)
OVERLAPS.update({f"overlap-auto-{name}": None for name in PIPELINED})

BACKENDS = {
    **{name: (lambda t=t: TweakedBackend(**t)) for name, t in PIPELINED.items()},
    **{f"overlap-auto-{name}": (lambda t=t: TweakedBackend(**t)) for name, t in PIPELINED.items()},
    "default": lambda: TritonLoRABackend(),
    "two-launch": lambda: TritonLoRABackend(fused=False),
    "fused": lambda: TritonLoRABackend(fused=True),
    "wide-rank": lambda: TritonLoRABackend(small_rank_block=0),  # every tile at the pool's rank step (before run 9)
    "overlap-auto-wide": lambda: TritonLoRABackend(small_rank_block=0),
}


def path_of(backend: TritonLoRABackend, info, x, B, offsets) -> str:
    """Which path ``apply`` takes for this module and batch: its configuration, described."""
    fc = backend.fused_config(info, x, B, offsets)
    if fc is not None:
        return "fused " + describe(fc)
    sc = backend.shrink_config(info, x, len(offsets) - 1, B.shape[2])
    ec = backend.expand_config(info, B, offsets)
    return f"two-launch shrink[{describe(sc)}] expand[{describe(ec)}]"


def bench_modules(device, modules, workloads, copy_bw, l2_bytes, reps, deadline) -> list[Row]:
    """``workloads``: (workload, module names, backend variants) triples."""
    gen = torch.Generator().manual_seed(7)
    rows: list[Row] = []
    for w, names, variants in workloads:
        for name in names:
            m = modules[name]
            if time.time() > deadline:
                print(f"[deadline] skipping {w.label()} {m.name}", flush=True)
                continue
            try:
                case = ModuleCase(w, m, device, gen, l2_bytes, max_sets=512 if device.type == "cuda" else 2)
                t_torch = time_replays(case.torch_fns(), device, reps)
                total, weights = moved_bytes(w, m)
                for variant in variants:
                    backend = BACKENDS[variant]()
                    t_triton = time_replays(case.triton_fns(backend), device, reps)
                    row = Row(
                        m.name,
                        w.label(),
                        w.tokens,
                        total,
                        t_triton * 1e3,
                        t_torch * 1e3,
                        total / (t_triton * 1e-3) / copy_bw,
                        t_torch / t_triton,
                        weights / total,
                        extra={
                            "sets": case.sets,
                            "tiles": case.info.num_tiles,
                            "path": path_of(backend, case.info, case.x[0], case.B[0], m.offsets),
                        },
                        variant=variant,
                    )
                    rows.append(row)
                    print(
                        f"{m.name:8s} {w.label():26s} {variant:10s} triton {row.triton_us:8.2f} us  torch "
                        f"{row.torch_us:8.2f} us  x{row.speedup:5.2f}  bw {100 * row.bw_frac:5.1f}%"
                        f"  w {100 * row.weight_frac:4.0f}%  [{row.extra['path']}]",
                        flush=True,
                    )
                del case
            except Exception:  # one broken shape must not lose the rest of the run
                traceback.print_exc()
    return rows


def sweep_variants(w: Workload, m: Module, info, sms: int) -> tuple[ShrinkConfig, ExpandConfig, list]:
    """The two-launch defaults for a shape and single-parameter variations around them."""
    S, R = len(m.widths), w.pool_rank
    sc0 = pick_shrink(num_tiles=info.num_tiles, tile_m=info.tile_m, num_slices=S, max_rank=R, in_dim=m.in_dim,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    ec0 = pick_expand(num_tiles=info.num_tiles, tile_m=info.tile_m, widths=m.widths, max_rank=R,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    two = lambda sc, ec: TritonLoRABackend(fused=False, shrink_config=sc, expand_config=ec)  # noqa: E731
    variants: list[tuple[str, TritonLoRABackend | str]] = [
        ("default", TritonLoRABackend()),
        ("two-launch", two(sc0, ec0)),
        ("fused", TritonLoRABackend(fused=True)),
        ("shrink only", "shrink"),
        ("expand only", "expand"),
    ]
    for split in sorted({max(1, sc0.split_k // 4), max(1, sc0.split_k // 2), sc0.split_k * 2} - {sc0.split_k}):
        variants.append((f"split{split}", two(ShrinkConfig(sc0.block_n, sc0.block_k, split), ec0)))
    if info.tile_m <= 16 and sc0.block_k < 256:
        variants.append(("shrink bk256", two(ShrinkConfig(sc0.block_n, 256, max(1, sc0.split_k // 2)), ec0)))
    for g in (1, 2, 4, 8, 16):
        if g != ec0.col_blocks:
            variants.append((f"expand g{g}", two(sc0, ExpandConfig(ec0.block_n, ec0.block_r, g, ec0.num_warps,
                                                                  ec0.num_stages))))  # fmt: skip
    for st in (1, 3):
        if st != ec0.num_stages:
            variants.append((f"expand st{st}", two(sc0, ExpandConfig(ec0.block_n, ec0.block_r, ec0.col_blocks,
                                                                    ec0.num_warps, st))))  # fmt: skip
    for bn, nw in ((256, 4), (256, 8)):
        variants.append((f"expand bn{bn} w{nw}", two(sc0, ExpandConfig(bn, ec0.block_r, ec0.col_blocks, nw,
                                                                        ec0.num_stages))))  # fmt: skip
    return sc0, ec0, variants


def sweep(device, modules, workloads, copy_bw, l2_bytes, reps, deadline) -> list[dict]:
    """Alternative launch configurations on a few shapes (the tuning record), and the
    two-launch default's time split into its shrink and its expand."""
    gen = torch.Generator().manual_seed(11)
    results = []
    sms = num_sms(device)
    for w, mname in workloads:
        m = modules[mname]
        if time.time() > deadline:
            break
        case = ModuleCase(w, m, device, gen, l2_bytes, max_sets=512 if device.type == "cuda" else 2)
        S, R = len(m.widths), w.pool_rank
        sc0, ec0, variants = sweep_variants(w, m, case.info, sms)
        total, _ = moved_bytes(w, m)
        partial = torch.randn(sc0.split_k, w.tokens, S * R, device=device, dtype=torch.float32) * 0.01
        for name, variant in variants:
            if time.time() > deadline:
                break
            try:
                if variant == "shrink":
                    fns = case.shrink_fns(partial, sc0)
                elif variant == "expand":
                    fns = case.expand_fns(partial, ec0)
                else:
                    fns = case.triton_fns(variant)
                t = time_replays(fns, device, reps)
                if isinstance(variant, TritonLoRABackend):
                    config = path_of(variant, case.info, case.x[0], case.B[0], m.offsets)
                else:
                    config = describe(sc0 if variant == "shrink" else ec0)
                results.append(
                    {
                        "module": m.name,
                        "workload": w.label(),
                        "variant": name,
                        "us": t * 1e3,
                        "bw_frac": total / (t * 1e-3) / copy_bw,
                        "config": config,
                    }
                )
                print(f"sweep {m.name:8s} {w.label():24s} {name:18s} {t * 1e3:8.2f} us  [{config}]", flush=True)
            except Exception:
                traceback.print_exc()
    return results


# -- whole layer -------------------------------------------------------------------------


def bench_layer(device, modules, scenarios, reps, layers: int, deadline, tuned=None, trace_dir=None) -> list[dict]:
    """LoRA of all seven modules (4 apply calls) vs the base GEMMs, over ``layers`` layers' weights."""
    gen = torch.Generator().manual_seed(3)
    dt = torch.bfloat16
    base = [
        {name: torch.randn(m.out_dim, m.in_dim, device=device, dtype=dt) * 0.02 for name, m in modules.items()}
        for _ in range(layers)
    ]
    results = []
    for w, variants in scenarios:
        for variant in variants:
            if time.time() > deadline:
                print(f"[deadline] skipping layer {w.label()} {variant}", flush=True)
                continue
            try:
                label = w.label().replace(" [graph]", "")
                res = layer_case(device, modules, base, w, gen, reps, variant, (tuned or {}).get(label), trace_dir)
                results.append(res)
                print(
                    f"layer {w.label():28s} {variant:17s} lora {fmt(res['lora_us'], '7.2f')} us  base {res['base_us']:7.2f} us"
                    f"  lora/base {fmt(res['lora_pct_of_base'], '5.1f')}%  in-situ +{res['increment_pct']:5.1f}%"
                    f"  paths {res['paths']}",
                    flush=True,
                )
            except Exception:
                traceback.print_exc()
    return results


def layer_case(
    device, modules, base, w: Workload, gen, reps, variant: str = "default", tuned=None, trace_dir: Path | None = None
) -> dict:
    """Three graphs over the same layers: LoRA only, base GEMMs only, both interleaved.

    ``tuned`` ({module: best of ``tune_module``}) gives each module its own two-launch
    configuration (the ``tuned*`` variants)."""
    dt = torch.bfloat16
    layers = len(base)
    overlapped = variant in OVERLAPS or variant in TRITON_GEMM
    backend = BACKENDS[variant]() if variant in BACKENDS else TritonLoRABackend(pdl=variant == "pdl")
    backends = {name: backend for name in modules}
    if variant in TUNED:
        if not tuned or set(tuned) != set(modules):
            raise RuntimeError(f"{variant}: no tuned configuration for every module of {w.label()}")
        backends = {
            name: TritonLoRABackend(fused=False, shrink_config=t["shrink"], expand_config=t["expand"])
            for name, t in tuned.items()
        }
    R = w.pool_rank
    slots = request_slots(w, gen)
    info = batch_info(w, slots, [w.rank] * w.adapters, [1.0 / w.rank] * w.adapters, device)
    T = info.total_tokens
    h = torch.randn(T, modules["qkv"].in_dim, device=device, dtype=dt)
    inputs = {
        "qkv": h,
        "o": torch.randn(T, modules["o"].in_dim, device=device, dtype=dt),
        "gate_up": h,
        "down": torch.randn(T, modules["down"].in_dim, device=device, dtype=dt),
    }
    outs = {name: torch.randn(T, m.out_dim, device=device, dtype=dt) for name, m in modules.items()}
    lora = [
        {
            name: (
                torch.randn(w.adapters, len(m.widths) * R, m.in_dim, device=device, dtype=dt) * 0.02,
                make_b(w.adapters, m.out_dim, R, w.rank_major_b, device=device, dtype=dt).mul_(0.02),
            )
            for name, m in modules.items()
        }
        for _ in range(layers)
    ]
    paths = {
        name: path_of(backends[name], info, inputs[name], lora[0][name][1], m.offsets).split(" ")[0]
        for name, m in modules.items()
    }

    def lora_layer(li: int) -> None:
        for name, m in modules.items():
            A, B = lora[li][name]
            backends[name].apply(inputs[name], A, B, info, outs[name], m.offsets)

    def base_layer(li: int) -> None:
        for name in modules:
            outs[name] = F.linear(inputs[name], base[li][name])

    side = torch.cuda.Stream(device) if overlapped and device.type == "cuda" else None
    overlap = OVERLAPS.get(variant) or OverlapPolicy().mode_for(T, info.num_tiles, torch.device("cuda"))
    modes = {
        name: (OverlapMode.DELTA if name in MIXED_DELTA else OverlapMode.SHRINK) if overlap == "mixed" else overlap
        for name in modules
    }
    gemm_cfgs: dict[str, GemmConfig] = {
        name: gemm_config(T, m.out_dim, m.in_dim, dt, num_sms(device)) for name, m in modules.items()
    }
    delta_join = variant == "epilogue-auto" and info.num_tiles <= OverlapPolicy().delta_max_tiles
    if variant in TRITON_GEMM:
        paths = {name: "delta" if delta_join else f"{variant}[{describe(gemm_cfgs[name])}]" for name in modules}
    elif overlapped:
        paths = {name: f"{p}+{modes[name].value}" for name, p in paths.items()}

    def triton_gemm(name: str, m: Module, li: int) -> torch.Tensor:
        A, B = lora[li][name]
        x, W = inputs[name], base[li][name]
        if variant == "gemm-only":
            return gemm_linear(x, W, None, gemm_cfgs[name])
        if delta_join:
            return linear_with_lora(
                backend, x, A, B, info, m.offsets, lambda: F.linear(x, W), mode=OverlapMode.DELTA, side=side
            )
        stage = backend.shrink_stage(x, A, info, len(m.widths))
        return launch_gemm_expand(x, W, None, stage, B, info, m.offsets, gemm_cfgs[name])

    def both_layer(li: int) -> None:
        for name, m in modules.items():
            A, B = lora[li][name]
            x, W = inputs[name], base[li][name]
            if variant in TRITON_GEMM:
                outs[name] = triton_gemm(name, m, li)
                continue
            if not overlapped:
                y = F.linear(x, W)
                backends[name].apply(x, A, B, info, y, m.offsets)
            else:
                y = linear_with_lora(
                    backends[name], x, A, B, info, m.offsets, lambda x=x, W=W: F.linear(x, W), mode=modes[name],
                    side=side,
                )  # fmt: skip
            outs[name] = y

    # The overlapped variants have no "LoRA alone": their cost is what they add to the layer.
    t_lora = None if overlapped else time_replays([lambda i=i: lora_layer(i) for i in range(layers)], device, reps)
    t_base = time_replays([lambda i=i: base_layer(i) for i in range(layers)], device, reps)
    with sm_carveout(CARVEOUTS.get(variant, 0)):
        t_both = time_replays([lambda i=i: both_layer(i) for i in range(layers)], device, reps)
    trace = None
    if trace_dir is not None and device.type == "cuda":
        name = f"trace-{w.label()}-{variant}".replace(" ", "_").replace("[", "").replace("]", "").replace("ᵀ", "T")
        trace = trace_replay([lambda: both_layer(0)], device, trace_dir / f"{name}.csv")
        print(f"trace {w.label()} {variant}: {trace}", flush=True)
    return {
        "trace": trace,
        "workload": w.label(),
        "variant": variant,
        "tokens": T,
        "lora_us": None if t_lora is None else t_lora * 1e3,
        "base_us": t_base * 1e3,
        "base_plus_lora_us": t_both * 1e3,
        "lora_pct_of_base": None if t_lora is None else 100 * t_lora / t_base,
        "increment_pct": 100 * (t_both - t_base) / t_base,
        "paths": ",".join(f"{k}:{v}" for k, v in paths.items()),
    }


def bench_gemm(device, modules, reps: int, deadline: float, sets: int = 8) -> list[dict]:
    """The Triton base GEMM (no LoRA) against cuBLAS per module and token count: the heuristic's
    configuration and a few alternatives, each replayed from a graph over ``sets`` weight copies
    (so W streams from memory, as in a model's step)."""
    dt = torch.bfloat16
    sms = num_sms(device)
    tiny = device.type != "cuda"
    results = []
    for name, m in modules.items():
        Ws = [
            torch.randn(m.out_dim, m.in_dim, device=device, dtype=dt) * 0.02
            for _ in range(2 if tiny else sets)
        ]
        for T in (1, 4) if tiny else (1, 32, 64, 128, 256):
            if time.time() > deadline:
                print(f"[deadline] skipping gemm {name} T={T}", flush=True)
                continue
            x = torch.randn(T, m.in_dim, device=device, dtype=dt)
            t_cublas = time_replays([lambda W=W, x=x: F.linear(x, W) for W in Ws], device, reps)
            heur = gemm_config(T, m.out_dim, m.in_dim, dt, sms)
            cands = [heur] + [
                GemmConfig(heur.block_m, bn, bk, 4, st)
                for bn, bk, st in ((32, 256, 4), (64, 128, 4), (64, 256, 3), (128, 128, 3))
                if (bn, bk, st) != (heur.block_n, heur.block_k, heur.num_stages)
            ]
            mb = m.out_dim * m.in_dim * 2 / 1e6
            for i, cfg in enumerate(cands[: 1 if tiny else None]):
                try:
                    t = time_replays(
                        [lambda W=W, x=x, cfg=cfg: gemm_linear(x, W, None, cfg) for W in Ws], device, reps
                    )
                except Exception as exc:  # a configuration that does not compile: recorded, not fatal
                    print(f"gemm {name} T={T} {describe(cfg)}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                row = {
                    "module": name, "tokens": T, "config": describe(cfg), "heuristic": i == 0,
                    "cublas_us": t_cublas * 1e3, "triton_us": t * 1e3, "ratio": t / t_cublas,
                    "cublas_tb_s": mb / (t_cublas * 1e3), "triton_tb_s": mb / (t * 1e3),
                }  # fmt: skip
                results.append(row)
                print(
                    f"gemm {name:7s} T={T:<4d} cuBLAS {row['cublas_us']:7.2f} us ({row['cublas_tb_s']:.2f} TB/s)"
                    f"  triton {row['triton_us']:7.2f} us ({row['triton_tb_s']:.2f} TB/s) x{row['ratio']:.3f}"
                    f"  {'*' if i == 0 else ' '}{describe(cfg)}",
                    flush=True,
                )
    return results


def tune_module(case: ModuleCase, w: Workload, m: Module, device, sms: int, reps: int) -> tuple[dict, list[dict]]:
    """Coordinate search around the two-launch defaults of one module and batch: the shrink
    (K split, K step) with the default expand, then the expand (column blocks, tile width)
    with the best shrink. Returns the best pair and every timing."""
    S, R = len(m.widths), w.pool_rank
    info = case.info
    sc0 = pick_shrink(num_tiles=info.num_tiles, tile_m=info.tile_m, num_slices=S, max_rank=R, in_dim=m.in_dim,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    ec0 = pick_expand(num_tiles=info.num_tiles, tile_m=info.tile_m, widths=m.widths, max_rank=R,
                      dtype=torch.bfloat16, num_sms=sms)  # fmt: skip
    tried: list[dict] = []

    def timed(sc: ShrinkConfig, ec: ExpandConfig) -> float:
        backend = TritonLoRABackend(fused=False, shrink_config=sc, expand_config=ec)
        t = time_replays(case.triton_fns(backend), device, reps) * 1e3
        tried.append({"module": m.name, "workload": w.label(), "us": t, "shrink": describe(sc), "expand": describe(ec)})
        return t

    best = {"shrink": sc0, "expand": ec0, "us": timed(sc0, ec0)}
    default_us = best["us"]
    partial_limit = max(1, MAX_PARTIAL_COLUMNS // rank_block(R))
    for split in sorted({sc0.split_k, 2 * sc0.split_k, 4 * sc0.split_k}):
        for bk in (128, 256):
            sc = ShrinkConfig(sc0.block_n, bk, split, sc0.num_warps, sc0.num_stages)
            if sc == sc0 or split > partial_limit or split > math.ceil(m.in_dim / bk):
                continue
            t = timed(sc, ec0)
            if t < best["us"]:
                best = {"shrink": sc, "expand": ec0, "us": t}
    sc = best["shrink"]
    expands = [ExpandConfig(ec0.block_n, ec0.block_r, g, ec0.num_warps, ec0.num_stages) for g in (1, 2, 4)]
    expands.append(ExpandConfig(256, ec0.block_r, ec0.col_blocks, 8, ec0.num_stages))
    for ec in expands:
        if ec == best["expand"]:
            continue
        t = timed(sc, ec)
        if t < best["us"]:
            best = {"shrink": sc, "expand": ec, "us": t}
    best["default_us"] = default_us
    return best, tried


def tune(device, modules, workloads, l2_bytes, reps, deadline) -> tuple[dict[str, dict], list[dict]]:
    """``tune_module`` for every module of each workload: {workload label: {module: best}}."""
    gen = torch.Generator().manual_seed(13)
    sms = num_sms(device)
    tuned: dict[str, dict] = {}
    record: list[dict] = []
    for w in workloads:
        for name, m in modules.items():
            if time.time() > deadline:
                print(f"[deadline] skipping tune {w.label()} {name}", flush=True)
                continue
            try:
                case = ModuleCase(w, m, device, gen, l2_bytes, max_sets=512 if device.type == "cuda" else 2)
                best, tried = tune_module(case, w, m, device, sms, reps)
            except Exception:
                traceback.print_exc()
                continue
            record += tried
            tuned.setdefault(w.label(), {})[name] = best
            print(
                f"tune {w.label():24s} {name:8s} default {best['default_us']:7.2f} us -> {best['us']:7.2f} us"
                f"  shrink[{describe(best['shrink'])}] expand[{describe(best['expand'])}]",
                flush=True,
            )
    return tuned, record


def tune_workloads(tiny: bool) -> list[Workload]:
    """The layer targets' shapes (non-graph metadata; the graph variant reuses the configs)."""
    if tiny:
        return [Workload("decode", 4, 2, 16, rank_major_b=True)]
    return [
        Workload("decode", 32, 8, 16, rank_major_b=True),
        Workload("decode", 64, 64, 16, rank_major_b=True),
        Workload("verify", 32, 32, 16, 4, rank_major_b=True),
    ]


# -- main --------------------------------------------------------------------------------


ALL = ("qkv", "o", "gate_up", "down")
PATHS3 = ("default", "two-launch", "fused")
# The layer targets: the default (two launches per module, serial) and each overlapped join.
LAYER = (
    "default",
    "overlap-auto",
    "overlap-delta",
    "overlap-shrink",
    "overlap-mixed",
    "overlap-delta-carve16",
    "overlap-delta-carve32",
    "overlap-shrink-carve16",
)
# where the two joins cross over: the joins alone
CROSSOVER = ("default", "overlap-auto", "overlap-delta", "overlap-shrink")


def module_workloads(tiny: bool) -> list[tuple[Workload, tuple[str, ...], tuple[str, ...]]]:
    """(workload, modules, variants): the shapes behind the targets, B rank-major as the pool stores it."""
    if tiny:
        return [
            (Workload("decode", 4, 2, 16, rank_major_b=True), ALL, PATHS3),
            (Workload("verify", 2, 2, 8, 4), ("qkv",), ("default",)),
            (Workload("extend", 2, 2, 16, 20), ("o",), ("default",)),
        ]
    return [
        (Workload("decode", 1, 1, 16, rank_major_b=True), ALL, ("default", "two-launch")),
        (Workload("decode", 32, 8, 16, rank_major_b=True), ALL, ("default", "two-launch", "fused")),
        (Workload("decode", 64, 64, 16, rank_major_b=True), ALL, ("default",)),
        (Workload("decode", 64, 64, 64, rank_major_b=True), ALL, ("default",)),
        (Workload("decode", 64, 64, 16, 1, 64), ("gate_up",), ("default",)),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), ALL, ("default",)),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), ALL, ("default",)),
        (Workload("verify", 64, 64, 16, 8, rank_major_b=True), ("gate_up",), ("default",)),
        (Workload("extend", 8, 8, 64, 512, rank_major_b=True), ("o", "down"), ("default",)),
        (Workload("extend", 4, 4, 16, 512, rank_major_b=True), ("o", "down"), ("default",)),
    ]


def sweep_workloads(tiny: bool) -> list[tuple[Workload, str]]:
    if tiny:
        return [(Workload("decode", 4, 2, 16), "qkv")]
    return [
        (Workload("decode", 1, 1, 16, rank_major_b=True), "gate_up"),
        (Workload("decode", 64, 64, 16, rank_major_b=True), "gate_up"),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), "qkv"),
        (Workload("extend", 8, 8, 64, 512, rank_major_b=True), "o"),
    ]


# The layer targets' shapes (and batch 1, and 8 adapters at batch 8 from graph metadata).
LAYER_SHAPES = (
    Workload("decode", 1, 1, 16, rank_major_b=True),
    Workload("decode", 32, 8, 16, rank_major_b=True),
    Workload("decode", 32, 8, 16, rank_major_b=True, graph=True),
    Workload("decode", 64, 64, 16, rank_major_b=True),
    Workload("verify", 32, 32, 16, 4, rank_major_b=True),
    Workload("decode", 8, 8, 16, rank_major_b=True, graph=True),
)


def layer_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    if tiny:
        return [(Workload("decode", 2, 1, 16, rank_major_b=True), (*PATHS3, *OVERLAPS))]
    return [
        *((w, LAYER) for w in LAYER_SHAPES),
        # where the two joins cross over (the policy's delta_max_tiles)
        (Workload("decode", 2, 2, 16, rank_major_b=True), CROSSOVER),
        (Workload("decode", 4, 4, 16, rank_major_b=True), CROSSOVER),
        (Workload("verify", 1, 1, 16, 6, rank_major_b=True), CROSSOVER),
    ]


def epilogue_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """The layer targets (and batch 1) with the expand in a Triton base GEMM's epilogue."""
    if tiny:
        return [(Workload("decode", 4, 2, 16, rank_major_b=True), EPILOGUE)]
    return [(w, EPILOGUE) for w in LAYER_SHAPES]


def rank_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """Rank-64 pools (the runtime's default): rank-16 adapters at the layer targets and batch 1,
    and rank-64 adapters, with the small-rank step for rank <= 16 (the default) and without."""
    variants = ("default", "overlap-auto", "wide-rank", "overlap-auto-wide")
    if tiny:
        return [(Workload("decode", 4, 4, 16, 1, 64, rank_major_b=True), variants)]
    return [
        (Workload("decode", 1, 1, 16, 1, 64, rank_major_b=True), variants),
        (Workload("decode", 32, 8, 16, 1, 64, rank_major_b=True, graph=True), variants),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), variants),
        (Workload("verify", 32, 32, 16, 4, 64, rank_major_b=True), variants),
        (Workload("decode", 1, 1, 64, 1, 64, rank_major_b=True), variants),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), variants),
    ]


def rank_module_workloads(tiny: bool) -> list[tuple[Workload, tuple[str, ...], tuple[str, ...]]]:
    if tiny:
        return [(Workload("decode", 4, 2, 16, 1, 64, rank_major_b=True), ("qkv",), ("default", "wide-rank"))]
    both = ("default", "wide-rank")
    return [
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), ALL, both),
        (Workload("verify", 32, 32, 16, 4, 64, rank_major_b=True), ALL, both),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), ALL, both),
        (Workload("decode", 1, 1, 64, 1, 64, rank_major_b=True), ("gate_up",), both),
    ]


def pipeline_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """The layer targets, batch 1 and rank-64 pools: the expand's register prefetch against
    the pipelined loop, all in the runtime's join."""
    variants = ("overlap-auto", *(f"overlap-auto-{name}" for name in LAYER_PIPELINED))
    if tiny:
        return [(Workload("decode", 4, 2, 16, rank_major_b=True), variants)]
    return [
        (Workload("decode", 1, 1, 16, rank_major_b=True), variants),
        (Workload("decode", 32, 8, 16, rank_major_b=True, graph=True), variants),
        (Workload("decode", 64, 64, 16, rank_major_b=True), variants),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), variants),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), variants),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), variants),
    ]


def pipeline_module_workloads(tiny: bool) -> list[tuple[Workload, tuple[str, ...], tuple[str, ...]]]:
    variants = ("default", "reg")
    if tiny:
        return [
            (Workload("decode", 4, 4, 16, rank_major_b=True), ("qkv",), variants),
            (Workload("extend", 2, 2, 16, 20, rank_major_b=True), ("o",), variants),
        ]
    return [
        (Workload("decode", 64, 64, 16, rank_major_b=True), ALL, variants),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), ALL, variants),
        (Workload("decode", 32, 8, 16, rank_major_b=True), ALL, variants),
        (Workload("decode", 64, 64, 16, 1, 64, rank_major_b=True), ALL, variants),
        (Workload("decode", 64, 64, 64, 1, 64, rank_major_b=True), ("gate_up",), variants),
        (Workload("extend", 8, 8, 64, 512, rank_major_b=True), ("o", "down"), variants),
        (Workload("extend", 4, 4, 16, 512, rank_major_b=True), ("o", "down"), variants),
    ]


def pipeline_checks(device, modules, tiny: bool) -> list[Check]:
    """The default and the timed variants against float64 at the benchmark shapes
    (rank-16 and rank-64 pools, mixed ranks, base requests, extend), and under graph replay."""
    gen = torch.Generator().manual_seed(77)
    checks: list[Check] = []
    works = [
        Workload("decode", 64 if not tiny else 6, 64 if not tiny else 6, 16, rank_major_b=True),
        Workload("verify", 32 if not tiny else 3, 32 if not tiny else 3, 16, 4, rank_major_b=True),
        Workload("decode", 24 if not tiny else 6, 4, 16, 1, 64, rank_major_b=True),
        Workload("decode", 8 if not tiny else 4, 4, 64, 1, 64, rank_major_b=True),
        Workload("extend", 4 if not tiny else 2, 4 if not tiny else 2, 64, 512 if not tiny else 20, rank_major_b=True),
    ]
    # The variants the pipeline phase times (run 10 checked the other stage counts and groups).
    backends = {"default": TritonLoRABackend(), **{name: BACKENDS[name]() for name in LAYER_PIPELINED}}
    for name, backend in backends.items():
        for module in modules.values():
            for w in works:
                c = check_apply(backend, w, module, torch.bfloat16, device, gen, base_requests=1)
                c.name = f"[{name}] {c.name}"
                checks.append(c)
            mixed = check_apply(backend, works[2], module, torch.bfloat16, device, gen, ranks=[64, 16, 40, 7, 0])
            mixed.name = f"[{name}] {mixed.name} ranks 64/16/40/7/0"
            checks.append(mixed)
        for c in check_graph(backend, modules["gate_up"], device, gen, "decode", 16, 1, max_rank=64):
            c.name = f"[{name}] {c.name}"
            checks.append(c)
        for c in check_graph(backend, modules["qkv"], device, gen, "verify", 8, 4):
            c.name = f"[{name}] {c.name}"
            checks.append(c)
    return checks


def target_scenarios(tiny: bool) -> list[tuple[Workload, tuple[str, ...]]]:
    """The layer targets only: the defaults against the tune phase's configurations."""
    variants = ("default", "overlap-auto", "tuned", "tuned-shrink")
    if tiny:
        return [(Workload("decode", 4, 2, 16, rank_major_b=True), variants)]
    return [
        (Workload("decode", 32, 8, 16, rank_major_b=True), variants),
        (Workload("decode", 32, 8, 16, rank_major_b=True, graph=True), variants),
        (Workload("decode", 64, 64, 16, rank_major_b=True), variants),
        (Workload("verify", 32, 32, 16, 4, rank_major_b=True), variants),
    ]


def markdown(env, checks, rows, sweeps, layer, tuned=None) -> str:
    lines = ["# LoRA kernels", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if k != "gemm"]
    if env.get("gemm"):
        lines += ["", "## Triton base GEMM (no LoRA) vs cuBLAS (graph replay, 8 weight copies rotating; * = heuristic)",
                  "", "| module | tokens | cuBLAS µs | TB/s | Triton µs | TB/s | Triton / cuBLAS | configuration |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {g['module']} | {g['tokens']} | {g['cublas_us']:.2f} | {g['cublas_tb_s']:.2f} | {g['triton_us']:.2f} "
            f"| {g['triton_tb_s']:.2f} | {g['ratio']:.3f} | {'*' if g['heuristic'] else ''}{g['config']} |"
            for g in env["gemm"]
        ]
    lines += ["", "## Correctness (float64 reference)", "", "| check | ok | rel. error | detail |", "|---|---|---|---|"]
    lines += [f"| {c.name} | {'yes' if c.ok else 'NO'} | {c.error:.2e} | {c.detail} |" for c in checks]
    lines += [
        "",
        "## Per module (median per call, graph replay, rotating inputs)",
        "",
        "| module | workload | variant | tokens | MB moved | Triton µs | torch µs | speed-up | % copy BW | weights % | path |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.module} | {r.workload} | {r.variant} | {r.tokens} | {r.bytes / 1e6:.2f} | {r.triton_us:.2f} "
            f"| {r.torch_us:.2f} | {r.speedup:.2f} | {100 * r.bw_frac:.1f} | {100 * r.weight_frac:.0f} "
            f"| {r.extra.get('path', '')} |"
        )
    lines += ["", "## Launch-configuration sweep", "", "| module | workload | variant | µs | % copy BW | configuration |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {s['module']} | {s['workload']} | {s['variant']} | {s['us']:.2f} | {100 * s['bw_frac']:.1f} | {s['config']} |"
        for s in sweeps
    ]
    lines += [
        "",
        "## One Llama-3-8B layer (7 modules; base = 4 bf16 F.linear: fused qkv, o, fused gate/up, down)",
        "",
        "| workload | variant | tokens | LoRA µs | base µs | LoRA % of base | base+LoRA µs | in-situ increment % | paths |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {x['workload']} | {x['variant']} | {x['tokens']} | {fmt(x['lora_us'], '.2f')} | {x['base_us']:.2f} | {fmt(x['lora_pct_of_base'], '.1f')} "
        f"| {x['base_plus_lora_us']:.2f} | {x['increment_pct']:.1f} | {x['paths']} |"
        for x in layer
    ]
    if tuned:
        lines += [
            "",
            "## Tune phase (two launches; best per module and workload)",
            "",
            "| workload | module | default µs | best µs | shrink | expand |",
            "|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {label} | {name} | {b['default_us']:.2f} | {b['us']:.2f} | {describe(b['shrink'])} | {describe(b['expand'])} |"
            for label, per in tuned.items()
            for name, b in per.items()
        ]
    return "\n".join(lines) + "\n"


def save(out_dir: Path, env, checks, rows, sweeps, layer, tuned=None, tune_record=()) -> None:
    """Write ``kernels.json`` and ``kernels.md`` with what has been measured so far."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "env": env,
        "checks": [asdict(c) for c in checks],
        "modules": [asdict(r) for r in rows],
        "sweep": sweeps,
        "layer": layer,
        "tuned": {
            label: {name: {**b, "shrink": asdict(b["shrink"]), "expand": asdict(b["expand"])} for name, b in per.items()}
            for label, per in (tuned or {}).items()
        },
        "tune_record": list(tune_record),
    }
    (out_dir / "kernels.json").write_text(json.dumps(payload, indent=1, default=str))
    (out_dir / "kernels.md").write_text(markdown(env, checks, rows, sweeps, layer, tuned))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    parser.add_argument("--tiny", action="store_true", help="small shapes: a CPU dry run of every path")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new timings after this")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--skip", default="", help="comma list of phases to skip: bench,sweep,layer,pdl")
    parser.add_argument(
        "--tune",
        action="store_true",
        help="before the layer phase, search launch configurations per module on the layer targets' shapes;"
        " the layer phase then also times those (variants tuned, tuned-shrink)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="layer phase: also write each case's kernel timeline (one replay of one layer) as CSV, with how much"
        " of the side stream's kernels overlapped the main stream's",
    )
    parser.add_argument(
        "--layer",
        choices=("all", "targets", "epilogue", "rank", "pipeline"),
        default="all",
        help="layer scenarios: all (every join and crossover shape), targets (the four targets, defaults vs tuned)"
        " or epilogue (the targets and batch 1 with the expand in a Triton base GEMM's epilogue; also times the"
        " Triton GEMM alone against cuBLAS per module) or rank (rank-64 pools with and without the small-rank"
        " step; only the rank checks run, and the modules are those shapes) or pipeline (the expand's pipelined"
        " loop against the register prefetch; only the pipeline checks run, and the modules are those shapes)",
    )
    args = parser.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget_s
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    modules = llama_modules(tiny)
    import triton

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    l2_bytes = 60 * 2**20
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sms"] = props.multi_processor_count
        l2_bytes = getattr(props, "L2_cache_size", l2_bytes)
        env["l2_mb"] = round(l2_bytes / 2**20, 1)
    copy_bw = copy_bandwidth(device, 2**30) if device.type == "cuda" else 1e9
    env["copy_bw_tb_s"] = round(copy_bw / 1e12, 3)
    env["launch_floor_us"] = round(launch_floor(device), 2)
    print(env, flush=True)

    if args.layer == "rank":
        checks = rank_checks(device, modules, tiny)
    elif args.layer == "pipeline":
        checks = pipeline_checks(device, modules, tiny)
    else:
        checks = correctness(device, modules, tiny, fast="pdl" in skip)
    for c in checks:
        print(f"{'ok  ' if c.ok else 'FAIL'} {c.name:50s} {c.error:.2e} {c.detail}", flush=True)
    env["correctness"] = f"{sum(c.ok for c in checks)}/{len(checks)} passed"
    print(f"correctness: {env['correctness']} ({time.time() - t0:.0f}s)", flush=True)

    # Layer first (the targets), then modules, then the sweep: a short budget cuts the
    # tuning record. Each phase gets its share of what is left when it starts, and the
    # results so far are written after each, so a run cut short keeps them.
    out_dir = Path(args.out)
    rows: list[Row] = []
    sweeps: list[dict] = []
    layer: list[dict] = []
    save(out_dir, env, checks, rows, sweeps, layer)
    tuned: dict[str, dict] = {}
    tune_record: list[dict] = []
    if args.tune:
        tune_deadline = time.time() + 0.5 * max(0.0, deadline - time.time())
        tuned, tune_record = tune(device, modules, tune_workloads(tiny), l2_bytes, args.reps, tune_deadline)
        print(f"tune done ({time.time() - t0:.0f}s)", flush=True)
        save(out_dir, env, checks, rows, sweeps, layer, tuned, tune_record)
    layer_deadline = time.time() + (0.45 if args.layer == "all" else 0.9) * max(0.0, deadline - time.time())
    scenarios = {
        "targets": target_scenarios,
        "epilogue": epilogue_scenarios,
        "rank": rank_scenarios,
        "pipeline": pipeline_scenarios,
    }.get(
        args.layer, layer_scenarios
    )(tiny)
    if not args.tune:
        scenarios = [(w, tuple(v for v in vs if v not in TUNED)) for w, vs in scenarios]
    if args.layer == "epilogue" and "gemm" not in skip:
        gemm_deadline = time.time() + 0.35 * max(0.0, deadline - time.time())
        env["gemm"] = bench_gemm(device, modules, args.reps, gemm_deadline)
        print(f"gemm done ({time.time() - t0:.0f}s)", flush=True)
    if "layer" not in skip:
        if args.trace:
            (out_dir / "traces").mkdir(parents=True, exist_ok=True)
        layer = bench_layer(
            device, modules, scenarios, args.reps, 2 if tiny else 32, layer_deadline, tuned,
            out_dir / "traces" if args.trace else None,
        )  # fmt: skip
    print(f"layer done ({time.time() - t0:.0f}s)", flush=True)
    save(out_dir, env, checks, rows, sweeps, layer, tuned, tune_record)
    module_deadline = time.time() + 0.65 * max(0.0, deadline - time.time())
    if "bench" not in skip:
        shapes = {"rank": rank_module_workloads, "pipeline": pipeline_module_workloads}.get(
            args.layer, module_workloads
        )(tiny)
        rows = bench_modules(device, modules, shapes, copy_bw, l2_bytes, args.reps, module_deadline)
    print(f"modules done ({time.time() - t0:.0f}s)", flush=True)
    save(out_dir, env, checks, rows, sweeps, layer, tuned, tune_record)
    if "sweep" not in skip:
        sweeps = sweep(device, modules, sweep_workloads(tiny), copy_bw, l2_bytes, args.reps, deadline)
    print(f"sweep done ({time.time() - t0:.0f}s)", flush=True)
    env["barrier_timeouts"] = barrier_timeouts(device)

    save(Path(args.out), env, checks, rows, sweeps, layer, tuned, tune_record)

    # Short table last: what the reply shows.
    print("\n== layer: LoRA vs base GEMMs ==")
    for x in layer:
        print(
            f"{x['workload']:28s} {x['variant']:17s} lora {fmt(x['lora_us'], '7.2f')}us base {x['base_us']:7.2f}us "
            f"{fmt(x['lora_pct_of_base'], '5.1f')}%  in-situ +{x['increment_pct']:4.1f}%"
        )
    print("== modules: triton us / torch us / %copyBW ==")
    for r in rows:
        print(f"{r.module:7s} {r.workload:26s} {r.variant:10s} {r.triton_us:7.2f} {r.torch_us:8.2f} {100 * r.bw_frac:5.1f}%")
    failed = [c.name for c in checks if not c.ok] + (["barrier timed out"] if env["barrier_timeouts"] else [])
    print(f"correctness {env['correctness']}; failed: {failed}; total {time.time() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
