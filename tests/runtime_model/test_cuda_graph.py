"""CUDA-graph batching: bucket choice, and the padded static path equals the eager path.

On the CPU the graph runner executes its static, padded buffers eagerly
(``use_graphs=False``): everything but the capture itself. On a GPU the same oracle
runs with real graphs.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.runner.cuda_graph import (
    CudaGraphRunner,
    context_bucket,
    graph_batch_sizes,
    padded_batch_size,
)

TOL = 1e-5


def test_buckets():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(20)
    assert sizes == [1, 2, 4, 8, 16, 20]
    assert [padded_batch_size(sizes, b) for b in (1, 3, 8, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    assert [context_bucket(n, 1024) for n in (1, 64, 65, 300, 1024)] == [64, 64, 128, 512, 1024]
    assert context_bucket(70, 80) == 80
    with pytest.raises(ValueError):
        context_bucket(2000, 1024)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_static_padded_path_equals_eager(static_graph_pair, ops):
    eager, graphed = static_graph_pair(("attn-r8", "all-r16", "emb-head"), max_bs=8)
    gen = torch.Generator().manual_seed(0)
    rids = ["a", "b", "c"]  # 3 requests: padded to 4
    lora = ["all-r16", None, "emb-head"]
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (9, 4, 70)]  # 70+: context bucket 128
    for r in (eager, graphed):
        ops.extend(r, rids, prompts, names=lora)
    for _ in range(3):
        tok = torch.randint(3, 512, (3,), generator=gen)
        want = ops.decode(eager, rids, tok, names=lora, return_hidden=True, hidden_layers=(1,))
        got = ops.decode(graphed, rids, tok, names=lora, return_hidden=True, hidden_layers=(1,))
        torch.testing.assert_close(got.logits, want.logits, atol=TOL, rtol=0)
        torch.testing.assert_close(got.hidden_states, want.hidden_states, atol=TOL, rtol=0)
        torch.testing.assert_close(got.aux_hidden_states, want.aux_hidden_states, atol=TOL, rtol=0)
    blocks = [torch.randint(3, 512, (3,), generator=gen) for _ in rids]
    torch.testing.assert_close(
        ops.verify(graphed, rids, blocks, names=lora).logits,
        ops.verify(eager, rids, blocks, names=lora).logits,
        atol=TOL,
        rtol=0,
    )
    # all-base batch of a different size, then one request alone
    tok = torch.tensor([5, 6])
    torch.testing.assert_close(
        ops.decode(graphed, ["a", "b"], tok).logits, ops.decode(eager, ["a", "b"], tok).logits, atol=TOL, rtol=0
    )
    # LoRA decode with hidden outputs, LoRA verify, base-only decode: one graph each
    assert graphed.graphs.num_graphs == 3
    # padding never leaked into real requests' cache: an eager step still agrees
    for r in (eager, graphed):
        r.graphs = None
    torch.testing.assert_close(
        ops.decode(graphed, rids, [7, 8, 9], names=lora).logits,
        ops.decode(eager, rids, [7, 8, 9], names=lora).logits,
        atol=TOL,
        rtol=0,
    )
    assert graphed.kv.num_free_tokens == eager.kv.num_free_tokens


def test_failed_capture_stays_eager(static_graph_pair, ops, monkeypatch):
    """A capture that fails (as a CUDA capture does when an op inside it is illegal) costs
    that step nothing: it runs eagerly, and the runner stops capturing, since the failed
    capture's pool would fail every later one. Capture itself needs a GPU; the failure is
    injected where the runner calls it."""
    import loraserve.runtime.runner.graph_runner as cuda_graph

    calls = []

    def failing_capture(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("operation failed due to a previous error during capture")

    eager, graphed = static_graph_pair(("all-r16",), max_bs=8)
    graphed.graphs.use_graphs = True  # as on a GPU, up to the capture
    monkeypatch.setattr(cuda_graph, "capture_graph", failing_capture)
    gen = torch.Generator().manual_seed(3)
    rids, lora = ["a", "b"], ["all-r16", None]
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (5, 11)]
    for r in (eager, graphed):
        ops.extend(r, rids, prompts, names=lora)
    for _ in range(2):
        tok = torch.randint(3, 512, (2,), generator=gen)
        torch.testing.assert_close(
            ops.decode(graphed, rids, tok, names=lora).logits,
            ops.decode(eager, rids, tok, names=lora).logits,
            atol=TOL,
            rtol=0,
        )
    tok = torch.randint(3, 512, (1,), generator=gen)  # another bucket: no second capture attempt
    torch.testing.assert_close(
        ops.decode(graphed, ["a"], tok).logits, ops.decode(eager, ["a"], tok).logits, atol=TOL, rtol=0
    )
    assert len(calls) == 1
    assert graphed.graphs.capture_failures == 1 and not graphed.graphs.use_graphs


def test_extend_and_large_batches_bypass_graphs(assets, make_runner, ops):
    runner = make_runner(assets.models["llama-gqa"])
    runner.graphs = CudaGraphRunner(runner, max_bs=2, use_graphs=False)
    ops.extend(runner, ["x", "y", "z"], [torch.tensor([3, 4]), torch.tensor([5]), torch.tensor([6])])
    assert runner.graphs.num_graphs == 0  # extend runs eagerly
    ops.decode(runner, ["x", "y", "z"], [1, 2, 3])
    assert runner.graphs.num_graphs == 0  # 3 > max_bs runs eagerly
    ops.decode(runner, ["x", "y"], [1, 2])
    assert runner.graphs.num_graphs == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("overlap", ["delta", "shrink"])
def test_cuda_graph_replay_equals_eager_on_gpu(assets, make_config, ops, backend, overlap, monkeypatch):
    """Graphs with each module's LoRA beside its GEMM on a second stream (``overlap``)
    against eager forwards that run them one after the other."""
    from loraserve.kernels.overlap import OVERLAP_ENV
    from loraserve.runtime.runner.model_runner import ModelRunner

    def build(graphs: bool):
        monkeypatch.setenv(OVERLAP_ENV, overlap if graphs else "serial")
        config = make_config(assets.models["llama-gqa"], backend=backend)
        config.device = "cuda"
        config.cuda_graph.enabled = graphs
        config.cuda_graph.max_bs = 8
        runner = ModelRunner(config)
        for n in ("attn-r8", "all-r16"):
            runner.lora.load(n, assets.adapters[n])
        return runner

    eager, graphed = build(False), build(True)
    rids = ["a", "b", "c"]
    lora = ["all-r16", None, "attn-r8"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (9, 4, 30)]
    for r in (eager, graphed):
        ops.extend(r, rids, prompts, names=lora)
    for _ in range(3):
        tok = torch.randint(3, 512, (3,), generator=gen)
        for names in (lora, [None] * 3):
            torch.testing.assert_close(
                ops.decode(graphed, rids, tok, names=names).logits,
                ops.decode(eager, rids, tok, names=names).logits,
                atol=1e-4,
                rtol=0,
            )
    blocks = [torch.randint(3, 512, (4,), generator=gen) for _ in rids]
    torch.testing.assert_close(
        ops.verify(graphed, rids, blocks, names=lora).logits,
        ops.verify(eager, rids, blocks, names=lora).logits,
        atol=1e-4,
        rtol=0,
    )
    # Triton: the three-request LoRA extend, LoRA decode, base decode and LoRA verify each replay a
    # graph; torch reference: LoRA batches run eagerly (its host-side segment loops cannot be
    # captured), base batches replay.
    assert graphed.graphs.num_graphs == (4 if backend == "triton" else 1)  # extend, decode x2, verify
    assert graphed.graphs.lora_in_graphs == (backend == "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_captures_after_warmups(tmp_path, make_config, ops):
    """bf16 with 128-wide heads, the shape where SDPA would pick cuDNN attention: every graph
    capture (after its eager warm-ups) succeeds and replays what eager forwards compute.

    Regression: eager steps once excluded cuDNN while captures did not, so cuDNN's first
    call (its plan build) happened inside a capture, which failed the serve's first decode.
    """
    from loraserve.runtime.dev.devmodels import build_tiny_model
    from loraserve.runtime.runner.model_runner import ModelRunner

    model = build_tiny_model(
        tmp_path / "bf16", hidden_size=512, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=1024,
        dtype="bfloat16", seed=5,
    )  # fmt: skip

    def build(graphs: bool) -> ModelRunner:
        config = make_config(model, backend="triton")
        config.device = "cuda"
        config.model.dtype = "bfloat16"
        config.cuda_graph.enabled = graphs
        config.cuda_graph.max_bs = 8
        return ModelRunner(config)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:  # bf16: padded batches may pick other GEMM kernels
        return float((a.float() - b.float()).norm() / b.float().norm())

    eager, graphed = build(False), build(True)
    rids = ["a", "b", "c"]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (40, 7, 129)]
    for r in (eager, graphed):
        ops.extend(r, rids, prompts)
    for _ in range(4):
        tok = torch.randint(3, 512, (3,), generator=gen)
        assert rel(ops.decode(graphed, rids, tok).logits, ops.decode(eager, rids, tok).logits) < 1e-2
    blocks = [torch.randint(3, 512, (4,), generator=gen) for _ in rids]
    assert rel(ops.verify(graphed, rids, blocks).logits, ops.verify(eager, rids, blocks).logits) < 1e-2
    assert graphed.graphs.num_graphs >= 2  # decode and verify replayed from captures
