"""The fused decoder ops (``kernels.model_ops``): each Triton kernel against the torch
definition (bit for bit where the rounding is the same) and against float64."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import model_ops
from loraserve.kernels.model_ops import reference, triton_ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Row widths: a power of two, an odd width (masked tail), a width past one silu block.
WIDTHS = [64, 45, 2304]


def _close(dtype: torch.dtype) -> dict:
    """Against the torch path: float32 up to summation order; the half types within two units
    in the last place (the normalised row and the product are each rounded once)."""
    return {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm(device, dtype, width):
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(7, width, generator=gen) * 3).to(device, dtype)
    w = (torch.rand(width, generator=gen) + 0.5).to(device, dtype)
    out = triton_ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, reference.rms_norm(x, w, 1e-6), **_close(dtype))
    assert _rel(out, _rms64(x, w, 1e-6)) < {torch.float32: 1e-6}.get(dtype, 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm(device, dtype, width):
    gen = torch.Generator().manual_seed(width + 1)
    x = torch.randn(5, 3, width, generator=gen).to(device, dtype)
    d = torch.randn(5, 3, width, generator=gen).to(device, dtype)
    w = (torch.rand(width, generator=gen) + 0.5).to(device, dtype)
    s, y = triton_ops.add_rms_norm(x, d, w, 1e-5)
    s_ref, y_ref = reference.add_rms_norm(x, d, w, 1e-5)
    assert s.shape == y.shape == x.shape
    # One rounding, as torch; Triton's CPU interpreter truncates to bfloat16 instead of rounding.
    exact = dtype != torch.bfloat16 or torch.cuda.is_available()
    torch.testing.assert_close(s, s_ref, **({"rtol": 0, "atol": 0} if exact else {}))
    torch.testing.assert_close(y, reference.rms_norm(s, w, 1e-5), **_close(dtype))
    if exact:
        torch.testing.assert_close(y, y_ref, **_close(dtype))
    assert _rel(y, _rms64(x.double() + d.double(), w, 1e-5)) < {torch.float32: 1e-6}.get(dtype, 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_mul(device, dtype, width):
    gen = torch.Generator().manual_seed(width + 2)
    gate_up = (torch.randn(6, 2 * width, generator=gen) * 4).to(device, dtype)
    out = triton_ops.silu_mul(gate_up)
    ref = reference.silu_mul(gate_up)
    assert out.shape == (6, width)
    torch.testing.assert_close(out, ref, **_close(dtype))
    g, u = gate_up.double().chunk(2, dim=-1)
    assert _rel(out, g * torch.sigmoid(g) * u) < {torch.float32: 1e-6}.get(dtype, 1e-2)


def test_empty_and_strided_rows(device):
    w = torch.ones(32, device=device)
    assert triton_ops.rms_norm(torch.empty(0, 32, device=device), w, 1e-6).shape == (0, 32)
    wide = torch.randn(4, 64, device=device)
    view = wide[:, :32]  # rows 64 apart: not contiguous
    torch.testing.assert_close(triton_ops.rms_norm(view, w, 1e-6), reference.rms_norm(view, w, 1e-6))
    with pytest.raises(ValueError, match="gate and up halves"):
        triton_ops.silu_mul(torch.randn(2, 5, device=device))


def test_dispatch_keeps_cpu_and_autograd_on_torch(monkeypatch):
    """CPU tensors, and tensors that need a gradient, never reach a kernel (none has a backward)."""

    def boom(*args, **kwargs):
        raise AssertionError("the Triton path was taken")

    monkeypatch.setattr(triton_ops, "rms_norm", boom)
    x, w = torch.randn(3, 8), torch.ones(8)
    torch.testing.assert_close(model_ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    model_ops.set_fused(False)
    try:
        assert not model_ops.fused_enabled()
    finally:
        model_ops.set_fused(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 12])
def test_rotary(device, dtype, head_dim):
    """Queries and keys as views of one fused projection (strided rows), positions in any order."""
    gen = torch.Generator().manual_seed(head_dim)
    tokens, heads, kv_heads, table = 9, 4, 2, 50
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(tokens, kv_heads, head_dim)
    angles = torch.rand(table, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(device, dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(device, dtype)
    positions = torch.randint(0, table, (tokens,), generator=gen).to(device)
    q_out, k_out = triton_ops.rotary(positions, q, k, cos, sin)
    q_ref, k_ref = reference.rotary(positions, q, k, cos, sin)
    # Within two units in the last place of the largest value: the device may contract a product
    # and a sum into one rounding where torch rounds twice; the interpreter truncates bfloat16.
    for out, ref in ((q_out, q_ref), (k_out, k_ref)):
        ulp = torch.finfo(dtype).eps * ref.abs().max().item()
        assert (out.float() - ref.float()).abs().max().item() <= 2 * ulp
    torch.testing.assert_close(q_out, q_ref, rtol=0.05, atol=0.05)
    c64 = torch.cat([angles.cos()] * 2, dim=-1).double().to(device)[positions].unsqueeze(1)
    s64 = torch.cat([angles.sin()] * 2, dim=-1).double().to(device)[positions].unsqueeze(1)
    half = head_dim // 2
    k64 = k.double()
    ref64 = k64 * c64 + torch.cat((-k64[..., half:], k64[..., :half]), dim=-1) * s64
    assert _rel(k_out, ref64) < {torch.float32: 1e-6}.get(dtype, 2e-2)


def _rope64(x: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE in float64 of ``[T, heads, D]`` rows (half-split layout)."""
    c = torch.cat([angles.cos()] * 2, dim=-1).double().to(x.device)[positions].unsqueeze(1)
    s = torch.cat([angles.sin()] * 2, dim=-1).double().to(x.device)[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    x = x.double()
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def _rope64_partial(x: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE in float64 on the leading ``2 * angles.shape[-1]`` dims of each head (half-split
    within them, transformers' Phi-3 layout for a partial rotary); the rest stay as they are."""
    rot = 2 * angles.shape[-1]
    return torch.cat((_rope64(x[..., :rot], angles, positions), x[..., rot:].double()), dim=-1)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (12, 12), (64, 48), (12, 8), (16, 2)])
def test_rotary_kv_write(device, dtype, cache_dtype, head_dim, rotary_dim):
    """Rotated queries returned, rotated keys and values written at the slots (views of one
    fused projection, slots in any order), every other cache row untouched. A partial rotary
    (Phi-4-mini's 0.75 of a head, and narrower): the tables are ``rotary_dim`` wide, the
    leading dims rotate, the trailing dims of queries and keys reach the output and the key
    cache unchanged; and the plain rotary op agrees with the fused write."""
    gen = torch.Generator().manual_seed(head_dim + 7 if rotary_dim == head_dim else head_dim + rotary_dim)
    tokens, heads, kv_heads, table, capacity = 9, 4, 2, 50, 20
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    angles = torch.rand(table, rotary_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(device, dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(device, dtype)
    positions = torch.randint(0, table, (tokens,), generator=gen).to(device)
    slots = (torch.randperm(capacity - 1, generator=gen)[:tokens] + 1).to(device)
    caches = torch.randn(2, capacity, kv_heads, head_dim, generator=gen).to(device, cache_dtype)
    k_cache, v_cache = caches[0].clone(), caches[1].clone()
    k_ref, v_ref = caches[0].clone(), caches[1].clone()
    q_out = triton_ops.rotary_kv_write(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
    q_ref = reference.rotary_kv_write(positions, q, k, v, cos, sin, k_ref, v_ref, slots)
    for out, ref in ((q_out, q_ref), (k_cache, k_ref)):
        ulp = torch.finfo(dtype).eps * ref.abs().max().item()
        assert (out.float() - ref.float()).abs().max().item() <= 2 * ulp
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)
    v_rows = v.reshape(tokens, kv_heads, head_dim).to(cache_dtype)
    torch.testing.assert_close(v_cache[slots], v_rows, rtol=0, atol=0)
    # the unrotated dims are copies
    torch.testing.assert_close(q_out[..., rotary_dim:], q[..., rotary_dim:].to(q_out.dtype), rtol=0, atol=0)
    k_pass = k[..., rotary_dim:].to(cache_dtype)
    torch.testing.assert_close(k_cache[slots][..., rotary_dim:], k_pass, rtol=0, atol=0)
    others = torch.ones(capacity, dtype=torch.bool, device=device)
    others[slots] = False
    torch.testing.assert_close(k_cache[others], caches[0][others], rtol=0, atol=0)
    tol = {torch.float32: 1e-6}.get(dtype, 2e-2)
    assert _rel(q_out, _rope64_partial(q, angles, positions)) < tol
    assert _rel(k_cache[slots], _rope64_partial(k, angles, positions)) < tol
    q_rot, k_rot = triton_ops.rotary(positions, q, k, cos, sin)
    torch.testing.assert_close(q_rot, q_out, rtol=0, atol=0)
    assert _rel(k_rot, _rope64_partial(k, angles, positions)) < tol


def test_rotary_tables_wider_than_a_head_are_refused(device):
    q, k = torch.randn(2, 4, 8, device=device), torch.randn(2, 2, 8, device=device)
    wide = torch.randn(10, 12, device=device)
    with pytest.raises(ValueError, match="at most head_dim"):
        triton_ops.rotary(torch.zeros(2, dtype=torch.int64, device=device), q, k, wide, wide)


def test_rotary_kv_write_checks_the_caches(device):
    q, k = torch.randn(2, 4, 8, device=device), torch.randn(2, 2, 8, device=device)
    table = torch.randn(10, 8, device=device)
    slots = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match="do not hold"):
        triton_ops.rotary_kv_write(
            torch.zeros(2, dtype=torch.int64, device=device), q, k, k, table, table,
            torch.zeros(5, 4, 8, device=device), torch.zeros(5, 4, 8, device=device), slots,
        )  # fmt: skip


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraserve.kernels.model_ops.triton_ops import _rotary_kv_write_kernel as k
ptrs = dict(pos_ptr="*i64", slot_ptr="*i64", q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qo_ptr="*bf16",
            kc_ptr="*fp32", vc_ptr="*fp32", cos_ptr="*bf16", sin_ptr="*bf16")
consts = dict(HEADS=8, HALF=48, BLOCK=64, PASS=32, PASS_BLOCK=32)  # partial rotary: 96 of 128 dims
sig = {n: ptrs.get(n, "constexpr" if n in consts else "i64") for n in k.arg_names}
src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()})
triton.compile(src, target=GPUTarget("cuda", 90, 32))
"""


def test_rotary_kv_write_compiles_for_hopper():
    """The fused rotary write compiles for an H100 (no GPU needed) with a key cache of another
    dtype than q, rotating part of each head: the interpreter runs code the compiler refuses
    (one name, two types)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=240)
    if "ptxas" in done.stderr and done.returncode:
        pytest.skip("no ptxas for this Triton build")
    assert done.returncode == 0, done.stderr[-2000:]
