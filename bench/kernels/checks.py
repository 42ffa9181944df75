"""One kernel call against the float64 reference: apply, the GEMM epilogue, the public shrink."""

from __future__ import annotations

import math

import torch

from loraserve.kernels.triton_ops.configs import gemm_config
from loraserve.kernels.triton_ops.gemm_expand import launch_gemm_expand

from .reference import TOL, Check, make_b, reference_delta
from .shapes import Module, Workload, batch_info, request_slots
from .timing import num_sms
from .variants import describe


def check_apply(
    backend, w: Workload, module: Module, dtype, device, gen, ranks=None, base_requests=0
) -> Check:
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
    A = (torch.randn(num_slots, S * R, module.in_dim, generator=gen) / math.sqrt(module.in_dim)).to(
        device, dtype
    )
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
