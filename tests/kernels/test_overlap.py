"""A module's LoRA beside its base GEMM (``loraserve.kernels.overlap``).

On the CPU both backends run the serial path and the split stages (``shrink_stage`` /
``expand_stage``) that the ``SHRINK`` join uses; the stream fork/join itself is tested on
a GPU in ``test_cuda_graphs.py``.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import (
    ForwardMode,
    OverlapMode,
    OverlapPolicy,
    build_batch_info,
    get_backend,
    linear_with_lora,
)
from loraserve.kernels.overlap import OVERLAP_ENV


@pytest.mark.parametrize(
    "raw,mode",
    [("", None), ("auto", None), ("delta", OverlapMode.DELTA), ("SHRINK", OverlapMode.SHRINK),
     ("serial", OverlapMode.SERIAL), ("off", OverlapMode.SERIAL)],
)  # fmt: skip
def test_policy_from_env(raw, mode, monkeypatch):
    monkeypatch.setenv(OVERLAP_ENV, raw)
    assert OverlapPolicy.from_env().mode is mode


def test_policy_rejects_unknown_mode(monkeypatch):
    """Policy rejects unknown mode naming the variable and values."""
    monkeypatch.setenv(OVERLAP_ENV, "sideways")
    with pytest.raises(ValueError, match=f"{OVERLAP_ENV}='sideways'.*auto, delta, shrink or serial"):
        OverlapPolicy.from_env()


def test_policy_overlaps_small_cuda_batches():
    """Policy joins by tiles and overlaps only small batches on CUDA."""
    auto = OverlapPolicy(max_tokens=64, delta_max_tiles=2)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto.mode_for(1, 1, cuda) is OverlapMode.DELTA
    assert auto.mode_for(12, 2, cuda) is OverlapMode.DELTA  # e.g. verify, 2 requests of 6
    assert auto.mode_for(8, 3, cuda) is OverlapMode.SHRINK
    assert auto.mode_for(65, 3, cuda) is OverlapMode.SERIAL  # prefill-sized: serial
    assert auto.mode_for(1, 1, cpu) is OverlapMode.SERIAL  # no second stream off CUDA
    pinned = OverlapPolicy(OverlapMode.SHRINK, max_tokens=64)
    assert pinned.mode_for(1, 1, cuda) is OverlapMode.SHRINK
    assert pinned.mode_for(65, 1, cuda) is OverlapMode.SERIAL


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND])
def test_split_stages_equal_apply(backend_name, mode, make_pool, gen):
    """``expand_stage(shrink_stage(x))`` adds exactly what ``apply`` adds (the SHRINK join's halves)."""
    pool = make_pool(in_dim=96, widths=(64, 16, 16), ranks=[8, 0, 16], max_rank=16)
    slots = [2, -1, 0, 1, 2]
    kwargs = {ForwardMode.TARGET_VERIFY: {"num_draft_tokens": 3}, ForwardMode.EXTEND: {"extend_lens": [5, 1, 7, 2, 3]}}
    info = build_batch_info(mode, slots, pool.ranks, pool.scalings, device=pool.device, **kwargs.get(mode, {}))
    backend = get_backend(backend_name)
    x, out0 = pool.inputs(gen, info.total_tokens)
    applied = out0.clone()
    backend.apply(x, pool.A, pool.B, info, applied, pool.offsets)
    staged = out0.clone()
    stage = backend.shrink_stage(x, pool.A, info, 3)
    backend.expand_stage(stage, pool.B, info, staged, pool.offsets)
    torch.testing.assert_close(staged, applied, rtol=1e-6, atol=1e-6)
    assert not torch.equal(applied, out0)  # the batch's adapters did add something


@pytest.mark.parametrize("mode", list(OverlapMode))
def test_linear_lora_no_stream_is_sum(mode, make_pool, gen, check_output):
    """Off CUDA every mode falls back to the GEMM then the delta, checked against float64."""
    pool = make_pool(in_dim=80, widths=(48, 24), ranks=[16, 4], max_rank=16)
    info = build_batch_info(ForwardMode.DECODE, [1, -1, 0, 0], pool.ranks, pool.scalings, device=pool.device)
    x, _ = pool.inputs(gen, info.total_tokens)
    W = torch.randn(pool.out_dim, 80, generator=gen).to(pool.device)
    calls = []

    def base():
        calls.append(1)
        return torch.nn.functional.linear(x, W)

    out = linear_with_lora(get_backend("torch"), x, pool.A, pool.B, info, pool.offsets, base, mode=mode, side=None)
    assert calls == [1]
    check_output(info, pool, x, torch.nn.functional.linear(x, W), out)
