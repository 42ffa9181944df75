"""Triton kernels of the fused ops: one program per token row, the row held in registers.

Each kernel reads its inputs once and writes its outputs once (the torch path makes five
passes for an RMSNorm and three for an add + norm). Rounding follows the reference: values
are rounded to the output dtype where torch's ops round them, so on the same inputs the
kernels match ``reference`` to within an ulp or two (the device's ``exp`` in SiLU, a product
and a sum contracted into one rounding in rotary, the order of a row's sum in the norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW = 65536
"""The widest row one program holds (hidden sizes and MLP widths are far below it)."""


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    width = x.shape[-1]
    if width > MAX_ROW:
        raise ValueError(f"a row of {width} elements is wider than the fused kernels hold ({MAX_ROW})")
    flat = x.reshape(-1, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, width


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _norm_row(s, w, mask, width, eps, OUT: tl.constexpr):
    """``w * (s / rms(s)).to(OUT)`` in float32, ``s`` already rounded to the model dtype."""
    var = tl.sum(tl.where(mask, s * s, 0.0), axis=0) / width
    h = (s * tl.rsqrt(var + eps)).to(OUT).to(tl.float32)
    return (w * h).to(OUT)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_stride, y_stride, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _norm_row(x, w, mask, width, eps, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * y_stride + cols, y, mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, s_ptr, y_ptr, x_stride, d_stride, out_stride, width, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * d_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + d).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * out_stride + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _norm_row(s.to(tl.float32), w, mask, width, eps, y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * out_stride + cols, y, mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, gu_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See :func:`loraserve.kernels.model_ops.rms_norm`."""
    flat, width = _rows(x)
    out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if flat.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(flat.shape[0],)](
            flat, weight, out, flat.stride(0), out.stride(0), width, eps, BLOCK=block, num_warps=_warps(block)
        )
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`loraserve.kernels.model_ops.add_rms_norm`."""
    if x.shape != delta.shape:
        raise ValueError(f"add_rms_norm: shapes differ ({tuple(x.shape)} vs {tuple(delta.shape)})")
    fx, width = _rows(x)
    fd, _ = _rows(delta)
    s = torch.empty(fx.shape, dtype=torch.promote_types(x.dtype, delta.dtype), device=x.device)
    y = torch.empty(fx.shape, dtype=torch.promote_types(weight.dtype, s.dtype), device=x.device)
    if fx.shape[0]:
        block = triton.next_power_of_2(width)
        _add_rms_norm_kernel[(fx.shape[0],)](
            fx, fd, weight, s, y, fx.stride(0), fd.stride(0), s.stride(0), width, eps,
            BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return s.view(x.shape), y.view(x.shape)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """See :func:`loraserve.kernels.model_ops.silu_mul`."""
    flat, both = _rows(gate_up)
    if both % 2:
        raise ValueError(f"silu_mul: the last dimension ({both}) must hold gate and up halves")
    width = both // 2
    out = torch.empty((flat.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if flat.shape[0]:
        block = min(triton.next_power_of_2(width), 2048)
        grid = (flat.shape[0], triton.cdiv(width, block))
        _silu_mul_kernel[grid](flat, out, flat.stride(0), out.stride(0), width, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], width)


@triton.jit
def _rope(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi, ty: tl.constexpr):
    """The two rotated halves in ``ty``: each product and the sum rounded to the dtype, as
    torch's ``x * cos + rotated * sin``."""
    out_lo = ((lo * cos_lo).to(ty).to(tl.float32) + (-hi * sin_lo).to(ty).to(tl.float32)).to(ty)
    out_hi = ((hi * cos_hi).to(ty).to(tl.float32) + (lo * sin_hi).to(ty).to(tl.float32)).to(ty)
    return out_lo, out_hi


@triton.jit
def _copy_tail(src, dst, START: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr):
    """``dst[START : START + PASS] = src[...]`` in ``dst``'s dtype: the dims partial rotary
    leaves unrotated (nothing when ``PASS`` is 0)."""
    if PASS > 0:
        cols = tl.arange(0, PASS_BLOCK)
        mask = cols < PASS
        x = tl.load(src + START + cols, mask=mask, other=0.0)
        tl.store(dst + START + cols, x.to(dst.dtype.element_ty), mask=mask)


def _pass_dims(dim: int, rotary_dim: int) -> dict:
    """The kernels' constexprs for the ``dim - rotary_dim`` trailing dims of a head that pass through."""
    rest = dim - rotary_dim
    return {"PASS": rest, "PASS_BLOCK": triton.next_power_of_2(max(rest, 1))}


def _check_tables(op: str, dim: int, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """The tables' rotary width: even, at most ``dim``, the same strides for cos and sin."""
    rot = cos.shape[-1]
    if dim % 2 or rot % 2 or not 0 < rot <= dim or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(
            f"{op}: head_dim {dim} and the tables' rotary width {cos.shape[-1]} must be even, the width at "
            "most head_dim"
        )
    return rot


@triton.jit
def _rotary_kernel(
    pos_ptr, src_ptr, dst_ptr, cos_ptr, sin_ptr, src_t, src_h, dst_t, dst_h, table_stride,
    HALF: tl.constexpr, BLOCK: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (token, head): dims ``[0, 2 * HALF)`` rotate, the ``PASS`` after them are copied."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    pos = tl.load(pos_ptr + token).to(tl.int64)
    src = src_ptr + token * src_t + head * src_h
    lo = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    row = pos * table_stride
    cos_lo = tl.load(cos_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    out_lo, out_hi = _rope(lo, hi, cos_lo, cos_hi, sin_lo, sin_hi, dst_ptr.dtype.element_ty)
    dst = dst_ptr + token * dst_t + head * dst_h
    tl.store(dst + cols, out_lo, mask=mask)
    tl.store(dst + HALF + cols, out_hi, mask=mask)
    _copy_tail(src, dst, 2 * HALF, PASS, PASS_BLOCK)


def _rotate(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if tokens and heads:
        half = cos.shape[-1] // 2
        _rotary_kernel[(tokens, heads)](
            positions, x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=half, BLOCK=triton.next_power_of_2(half), **_pass_dims(dim, 2 * half), num_warps=1,
        )  # fmt: skip
    return out


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`loraserve.kernels.model_ops.rotary`."""
    _check_tables("rotary", q.shape[-1], cos, sin)
    positions = positions.contiguous()
    return _rotate(positions, q, cos, sin), _rotate(positions, k, cos, sin)


@triton.jit
def _rotary_kv_write_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr,
    q_t, q_h, k_t, k_h, v_t, v_h, qo_t, qo_h, kc_s, kc_h, vc_s, vc_h, table_stride,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, PASS: tl.constexpr, PASS_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (token, head): heads below ``HEADS`` rotate a query head into ``qo``; the rest
    rotate key head ``head - HEADS`` into the key cache and copy its value head. Dims
    ``[0, 2 * HALF)`` of a head rotate, the ``PASS`` after them are copied as they are."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    row = tl.load(pos_ptr + token).to(tl.int64) * table_stride
    cos_lo = tl.load(cos_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + row + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    ty = qo_ptr.dtype.element_ty  # the rotation's dtype, as the reference computes it
    # The branches name their values apart: Triton merges a name bound in both branches of a
    # runtime ``if`` and needs one type for it (the key cache's dtype may differ from q's).
    if head < HEADS:
        q_src = q_ptr + token * q_t + head.to(tl.int64) * q_h
        q_lo = tl.load(q_src + cols, mask=mask, other=0.0).to(tl.float32)
        q_hi = tl.load(q_src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        q_out_lo, q_out_hi = _rope(q_lo, q_hi, cos_lo, cos_hi, sin_lo, sin_hi, ty)
        q_dst = qo_ptr + token * qo_t + head.to(tl.int64) * qo_h
        tl.store(q_dst + cols, q_out_lo, mask=mask)
        tl.store(q_dst + HALF + cols, q_out_hi, mask=mask)
        _copy_tail(q_src, q_dst, 2 * HALF, PASS, PASS_BLOCK)
    else:
        kv = (head - HEADS).to(tl.int64)
        slot = tl.load(slot_ptr + token).to(tl.int64)
        k_src = k_ptr + token * k_t + kv * k_h
        k_lo = tl.load(k_src + cols, mask=mask, other=0.0).to(tl.float32)
        k_hi = tl.load(k_src + HALF + cols, mask=mask, other=0.0).to(tl.float32)
        k_out_lo, k_out_hi = _rope(k_lo, k_hi, cos_lo, cos_hi, sin_lo, sin_hi, ty)
        k_dst = kc_ptr + slot * kc_s + kv * kc_h
        tl.store(k_dst + cols, k_out_lo.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF + cols, k_out_hi.to(kc_ptr.dtype.element_ty), mask=mask)
        _copy_tail(k_src, k_dst, 2 * HALF, PASS, PASS_BLOCK)
        v_src = v_ptr + token * v_t + kv * v_h
        v_dst = vc_ptr + slot * vc_s + kv * vc_h
        v_lo = tl.load(v_src + cols, mask=mask, other=0.0)
        v_hi = tl.load(v_src + HALF + cols, mask=mask, other=0.0)
        tl.store(v_dst + cols, v_lo.to(vc_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + HALF + cols, v_hi.to(vc_ptr.dtype.element_ty), mask=mask)
        _copy_tail(v_src, v_dst, 2 * HALF, PASS, PASS_BLOCK)


def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """See :func:`loraserve.kernels.model_ops.rotary_kv_write`."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    rot = _check_tables("rotary_kv_write", dim, cos, sin)
    if k_cache.shape[1:] != (kv_heads, dim) or v_cache.shape[1:] != (kv_heads, dim):
        raise ValueError(
            f"rotary_kv_write: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold "
            f"[slots, {kv_heads}, {dim}] rows"
        )
    v = v.reshape(tokens, kv_heads, dim)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rotary_kv_write: the caches' head_dim must be contiguous")
    out = torch.empty((tokens, heads, dim), dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    if tokens and heads + kv_heads:
        half = rot // 2
        _rotary_kv_write_kernel[(tokens, heads + kv_heads)](
            positions.contiguous(), slots.contiguous(), q, k, v, out, k_cache, v_cache, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), cos.stride(0),
            HEADS=heads, HALF=half, BLOCK=triton.next_power_of_2(half), **_pass_dims(dim, rot), num_warps=1,
        )  # fmt: skip
    return out
