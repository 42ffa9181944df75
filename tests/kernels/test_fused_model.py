"""The fused decoder kernels inside a model: every ``model_ops`` call of a tiny model taken
through the Triton kernels (the interpreter on the CPU) gives the torch path's logits and
KV cache, in prefill, decode and verify."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode, model_ops
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.dev.devmodels import build_tiny_model
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner


def _runner(model_dir, device: torch.device) -> ModelRunner:
    config = RuntimeConfig()
    config.model.path = str(model_dir)
    config.device = device.type
    config.scheduler.max_total_tokens = 256
    config.scheduler.max_running_requests = 4
    config.cuda_graph.enabled = False
    return ModelRunner(config)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (5, 9)]
    rids = ["a", "b"]
    dev = runner.device
    out = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, rids, torch.cat(prompts).to(dev), extend_lens=[5, 9])
    ).logits
    logits = [out]
    step = torch.randint(3, 512, (2,), generator=gen).to(dev)
    logits.append(runner.forward(ForwardBatch(ForwardMode.DECODE, rids, step)).logits)
    block = torch.randint(3, 512, (6,), generator=gen).to(dev)
    logits.append(runner.forward(ForwardBatch(ForwardMode.TARGET_VERIFY, rids, block, num_draft_tokens=3)).logits)
    slots = torch.cat([runner.kv.token_slots(r) for r in rids]).to(dev)
    logits += [runner.kv.k_buffers[0][slots], runner.kv.v_buffers[-1][slots]]
    return logits


@pytest.mark.parametrize("kind", [{}, {"architecture": "qwen3", "head_dim": 32, "seed": 5}])
def test_fused_kernels_in_the_model(tmp_path, device, monkeypatch, kind):
    model_dir = build_tiny_model(tmp_path / "m", **kind)
    model_ops.set_fused(False)  # the torch path, on a GPU too
    try:
        reference = _steps(_runner(model_dir, device))
    finally:
        model_ops.set_fused(True)
    monkeypatch.setattr(model_ops, "_use_triton", lambda *tensors: True)  # the kernels, on the CPU too
    fused = _steps(_runner(model_dir, device))
    # float32 throughout; a GPU contracts products and sums into one rounding where torch rounds twice
    tol = 1e-4 if device.type == "cuda" else 1e-5
    for out, ref in zip(fused, reference, strict=True):
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
