"""Calls captured in a CUDA graph, replayed with new slots and ranks against float64."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loraserve.kernels.graph_metadata import GraphLoRAMetadata
from loraserve.kernels.overlap import OverlapMode, linear_with_lora

from .reference import TOL, Check, make_b, reference_delta
from .shapes import Module, forward_mode
from .timing import captured


def random_batch(gen, bs: int, num_slots: int, max_rank: int) -> tuple[list[int], list[int], list[float]]:
    """Fresh per-request slots (-1: base model), per-slot ranks (0..max_rank) and scalings."""
    slots = [int(torch.randint(-1, num_slots, (1,), generator=gen)) for _ in range(bs)]
    ranks = [int(torch.randint(0, max_rank + 1, (1,), generator=gen)) for _ in range(num_slots)]
    scalings = [0.25 + torch.rand(1, generator=gen).item() for _ in range(num_slots)]
    return slots, ranks, scalings


def check_graph(
    backend, module: Module, device, gen, mode: str, max_bs: int, k: int, max_rank: int = 16
) -> list[Check]:
    """Capture one apply at max_bs, then replay with fresh slots/ranks (0..max_rank) each time."""
    checks = []
    dtype = torch.bfloat16
    num_slots, R = 6, max_rank
    meta, info = _graph_metadata(mode, max_bs, num_slots, k, device)
    T = info.total_tokens
    S = len(module.widths)
    x = torch.randn(T, module.in_dim, generator=gen).to(device, dtype)
    A = (torch.randn(num_slots, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(
        device, dtype
    )
    B = torch.randn(num_slots, module.out_dim, R, generator=gen).to(device, dtype)
    out = torch.zeros(T, module.out_dim, dtype=dtype, device=device)

    def step():
        backend.apply(x, A, B, info, out, module.offsets)

    replay = captured(step, device)
    for trial in range(3):
        real_bs, ranks, scalings = _new_batch(meta, gen, trial, max_bs, num_slots, R, mode, k)
        x.copy_(torch.randn(T, module.in_dim, generator=gen).to(device, dtype))
        out.copy_(torch.randn(T, module.out_dim, generator=gen).to(device, dtype))
        out0 = out.clone()
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize()
        err, active = _delta_error(out.double() - out0.double(), x, A, B, info, ranks, scalings, module)
        untouched = bool(torch.equal(out[~active], out0[~active]))
        name = f"graph {mode} {module.name} bs{real_bs}/{max_bs} k{k} trial{trial}"
        checks.append(Check(name, err < TOL[dtype] and untouched, err))
    if mode == "verify":
        checks.append(_width_guard(meta, R, num_slots, max_bs, k))
    return checks


def check_overlap(
    backend, module: Module, device, gen, overlap: OverlapMode, mode: str, max_bs: int, k: int
) -> list[Check]:
    """``linear_with_lora`` captured in a graph (base GEMM + LoRA on a side stream), replayed with new slots."""
    checks = []
    dtype = torch.bfloat16
    num_slots, R = 6, 16
    meta, info = _graph_metadata(mode, max_bs, num_slots, k, device)
    T = info.total_tokens
    S = len(module.widths)
    x = torch.randn(T, module.in_dim, generator=gen).to(device, dtype)
    W = (torch.randn(module.out_dim, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(
        device, dtype
    )
    A = (torch.randn(num_slots, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(
        device, dtype
    )
    B = make_b(num_slots, module.out_dim, R, True, generator=gen).to(device, dtype)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    result: dict[str, torch.Tensor] = {}

    def step():
        result["y"] = linear_with_lora(
            backend, x, A, B, info, module.offsets, lambda: F.linear(x, W), mode=overlap, side=side
        )

    replay = captured(step, device)
    for trial in range(3):
        real_bs, ranks, scalings = _new_batch(meta, gen, trial, max_bs, num_slots, R, mode, k)
        x.copy_(torch.randn(T, module.in_dim, generator=gen).to(device, dtype))
        if "y" in result:  # a graph's output buffer: poisoned, every row must be rewritten
            result["y"].fill_(float("nan"))
        replay()
        if device.type == "cuda":
            torch.cuda.synchronize()
        base = F.linear(x, W).double()
        got = result["y"].double() - base
        err, active = _delta_error(got, x, A, B, info, ranks, scalings, module)
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


def _graph_metadata(mode: str, max_bs: int, num_slots: int, k: int, device):
    """Graph metadata for ``max_bs`` requests, and the batch info a capture sees."""
    meta = GraphLoRAMetadata(
        forward_mode(mode), max_bs, num_slots, num_draft_tokens=k if mode == "verify" else None, device=device
    )
    return meta, meta.capture_info(max_bs)


def _new_batch(meta, gen, trial: int, max_bs: int, num_slots: int, R: int, mode: str, k: int):
    """Trial ``trial``'s batch (fewer live requests each trial) written into the graph's
    metadata: its size, per-slot ranks and scalings."""
    real_bs = max(1, max_bs - trial * (max_bs // 3))
    slots, ranks, scalings = random_batch(gen, real_bs, num_slots, R)
    meta.update(slots, ranks, scalings, num_draft_tokens=k if mode == "verify" else None, batch_size=max_bs)
    return real_bs, ranks, scalings


def _delta_error(got, x, A, B, info, ranks, scalings, module: Module) -> tuple[float, torch.Tensor]:
    """Relative error of the delta ``got`` against float64 (0 with no LoRA row), and the mask
    of LoRA rows."""
    row_slots = info.token_slots.tolist()
    delta = reference_delta(x, A, B, row_slots, ranks, scalings, module.offsets)
    active = torch.tensor([s >= 0 and ranks[s] > 0 for s in row_slots], device=x.device)
    err = ((got - delta).norm() / delta.norm().clamp_min(1e-30)).item() if bool(active.any()) else 0.0
    return err, active


def _width_guard(meta, R: int, num_slots: int, max_bs: int, k: int) -> Check:
    """A verify wider than the graph's ``k`` is refused, with both widths named."""
    try:
        meta.update([0], [R] * num_slots, [1.0] * num_slots, num_draft_tokens=k + 1, batch_size=max_bs)
        return Check("verify width guard", False, 0.0, "no error raised")
    except ValueError as exc:
        named = str(k) in str(exc) and str(k + 1) in str(exc)
        return Check("verify width guard", named, 0.0, str(exc)[:80])
