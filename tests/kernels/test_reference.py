"""The torch reference backend against the float64 oracle, and the shared input checks."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, build_batch_info, get_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "mode,kwargs",
    [
        (ForwardMode.DECODE, {}),
        (ForwardMode.TARGET_VERIFY, {"num_draft_tokens": 3}),
        (ForwardMode.EXTEND, {"extend_lens": [4, 0, 9, 1, 2]}),
    ],
)
def test_reference_matches_float64(mode, kwargs, dtype, make_pool, gen, check_apply):
    pool = make_pool(in_dim=33, widths=(20, 6, 6), ranks=[8, 3, 0, 5], max_rank=8, dtype=dtype)
    info = build_batch_info(mode, [1, -1, 0, 3, 2], pool.ranks, pool.scalings, **kwargs)
    x, out0 = pool.inputs(gen, info.total_tokens)
    check_apply(get_backend("torch"), info, pool, x, out0)


def test_reference_shrink_leaves_base_rows_zero(make_pool, gen):
    pool = make_pool(in_dim=16, widths=(8,), ranks=[4], max_rank=4)
    info = build_batch_info(ForwardMode.DECODE, [0, -1, 0], pool.ranks, pool.scalings, device=pool.device)
    x, _ = pool.inputs(gen, 3)
    xa = get_backend("torch").shrink(x, pool.A, info)
    assert torch.equal(xa[1], torch.zeros(4, device=xa.device))
    torch.testing.assert_close(xa[0], x[0] @ pool.A[0].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_embedding_lora_matches_float64(backend_name, gen, device):
    """Embedding LoRA gathers A rows by token id and reuses the backend's expand."""
    vocab, dim, rank = 50, 24, 4
    ranks, scalings = [4, 2], [0.5, 2.0]
    A_emb = torch.randn(2, vocab, rank, generator=gen).to(device)
    B_emb = torch.randn(2, dim, rank, generator=gen).to(device)
    info = build_batch_info(ForwardMode.EXTEND, [1, -1, 0], ranks, scalings, extend_lens=[3, 2, 4], device=device)
    ids = torch.randint(0, vocab, (9,), generator=gen).to(device)
    out0 = torch.randn(9, dim, generator=gen).to(device)
    out = out0.clone()
    get_backend(backend_name).embedding(ids, A_emb, B_emb, info, out)
    ref = out0.double().clone()
    for row, slot in enumerate(info.token_slots.tolist()):
        if slot < 0:
            continue
        r = ranks[slot]
        ref[row] += scalings[slot] * (A_emb[slot, ids[row], :r].double() @ B_emb[slot, :, :r].double().T)
    assert ((out.double() - ref).norm() / (ref - out0.double()).norm()).item() < 1e-5
    assert torch.equal(out[3:5], out0[3:5])  # the base-model request


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_bad_shapes_name_the_field(backend_name, make_pool, gen):
    backend = get_backend(backend_name)
    pool = make_pool(in_dim=16, widths=(8, 8), ranks=[4], max_rank=4)
    info = build_batch_info(ForwardMode.DECODE, [0, 0], pool.ranks, pool.scalings)
    x, out = pool.inputs(gen, 2)
    with pytest.raises(ValueError, match="x has 3 rows but the batch info describes 2"):
        backend.apply(torch.randn(3, 16), pool.A, pool.B, info, out, pool.offsets)
    with pytest.raises(ValueError, match=r"A must be \[slots, slices\*rank, 15\]"):
        backend.apply(torch.randn(2, 15), pool.A, pool.B, info, out, pool.offsets)
    with pytest.raises(ValueError, match="do not match slices"):
        backend.apply(x, pool.A, pool.B, info, out, (0, 8, 9))
    before = out.clone()
    with pytest.raises(ValueError):
        backend.apply(x, pool.A, pool.B, info, out[:, :8], pool.offsets)
    assert torch.equal(out, before)  # a rejected call changes nothing
