"""The fused (Triton) MoE path through the model forward, in interpreter mode on the CPU:
the same logits as the torch MoE path and as transformers + peft, with adapters that have
LoRA on the experts, adapters that have none there, and base-model rows in one batch."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import moe as moe_kernels
from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_fused")
    model = build_tiny_model(
        root / "m", architecture="qwen3_moe", seed=41, num_layers=2, hidden_size=64, intermediate_size=96,
        head_dim=16, moe={"norm_topk_prob": True},
    )  # fmt: skip
    experts = build_adapter(root / "e", model, rank=4, alpha=8, seed=61, target_modules=(*ATTN, "gate_proj", "up_proj", "down_proj"))
    attn = build_adapter(root / "a", model, rank=4, alpha=8, seed=62, target_modules=ATTN)
    return model, experts, attn


@pytest.fixture
def path():
    """``path(name)`` sets the MoE path for the test; the switch goes back to ``auto`` after."""
    yield moe_kernels.set_path
    moe_kernels.set_path("auto")


def _both_paths(path, run):
    """``run(tag)`` on the torch path, then on the fused one (``tag`` keeps request ids apart)."""
    path("torch")
    ref = run("t")
    path("triton")
    return ref, run("f")


def test_fused_moe_extend_matches_torch_and_peft(assets, make_runner, hf_model, ops, path):
    model, experts, attn = assets
    runner = make_runner(model, adapters={"e": experts, "a": attn})
    prompts = [torch.arange(3, 10), torch.arange(20, 25), torch.arange(40, 46)]
    names = ["e", "a", None]
    with torch.no_grad():
        ref, out = _both_paths(path, lambda tag: ops.extend(runner, [tag + "0", tag + "1", tag + "2"], prompts, names=names, all_logits=True).logits)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
        lo = 0
        for prompt, adapter in zip(prompts, [experts, attn, None], strict=True):
            want = hf_model(model, adapter) if adapter is not None else hf_model(model)
            torch.testing.assert_close(out[lo : lo + len(prompt)], want(prompt[None]).logits[0], atol=2e-4, rtol=0)
            lo += len(prompt)
        base = hf_model(model)(prompts[0][None]).logits[0]
        assert (out[: len(prompts[0])] - base).abs().max() > 1e-3  # the expert adapter acts


def test_fused_moe_verify_matches_torch(assets, make_runner, ops, path):
    """Target-verify rows (requests x draft width) through the fused path equal the torch path's."""
    model, experts, attn = assets
    runner = make_runner(model, adapters={"e": experts, "a": attn})
    prompts = [torch.arange(3, 8), torch.arange(20, 24), torch.arange(40, 45)]
    blocks = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    names = ["e", None, "a"]

    def run(tag):
        rids = [tag + "0", tag + "1", tag + "2"]
        ops.extend(runner, rids, prompts, names=names)
        return ops.verify(runner, rids, blocks, names=names).logits

    with torch.no_grad():
        ref, out = _both_paths(path, run)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_verify_graph_token_sized_buffers(assets, make_runner, ops, path):
    """A verify of ``max_bs`` requests x 3 draft tokens through the CUDA-graph runner's static
    path (everything but the capture) on the fused MoE path equals the eager torch path; its
    MoE buffers are sized in token rows (a buffer sized in requests would refuse the batch)."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.cuda_graph import CudaGraphRunner

    model, experts, attn = assets
    eager = make_runner(model, adapters={"e": experts, "a": attn})
    graphed = make_runner(model, adapters={"e": experts, "a": attn})
    graphed.graphs = CudaGraphRunner(graphed, use_graphs=False, max_bs=2)
    prompts = [torch.arange(3, 8), torch.arange(20, 24)]
    blocks = [[11, 12, 13], [21, 22, 23]]
    names = ["e", "a"]
    with torch.no_grad():
        path("torch")
        ops.extend(eager, ["r0", "r1"], prompts, names=names)
        ref = ops.verify(eager, ["r0", "r1"], blocks, names=names).logits
        path("triton")
        ops.extend(graphed, ["r0", "r1"], prompts, names=names)
        out = ops.verify(graphed, ["r0", "r1"], blocks, names=names).logits
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    buffers = graphed.graphs._moe_buffers[(ForwardMode.TARGET_VERIFY, 3)]
    assert buffers.max_tokens == 2 * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_graphs_capture_and_replay(assets, make_config, ops):
    """On a GPU the MoE layers (fused path, adapters on the experts) are captured: decode and
    verify replays with adapters and base rows equal the eager forwards."""
    from loraserve.runtime.runner.model_runner import ModelRunner

    model, experts, attn = assets

    def build(graphs: bool) -> ModelRunner:
        config = make_config(model, backend="triton")
        config.device = "cuda"
        config.cuda_graph.enabled = graphs
        config.cuda_graph.max_bs = 4
        runner = ModelRunner(config)
        for name, adapter in (("e", experts), ("a", attn)):
            runner.lora.load(name, adapter)
        return runner

    eager, graphed = build(False), build(True)
    rids, names = ["r0", "r1", "r2"], ["e", None, "a"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=gen) for n in (9, 4, 6)]
    with torch.no_grad():
        for r in (eager, graphed):
            ops.extend(r, rids, prompts, names=names)
        for _ in range(2):
            tok = torch.randint(3, 100, (3,), generator=gen)
            torch.testing.assert_close(
                ops.decode(graphed, rids, tok, names=names).logits, ops.decode(eager, rids, tok, names=names).logits,
                atol=1e-4, rtol=0,
            )  # fmt: skip
        blocks = [torch.randint(3, 100, (4,), generator=gen) for _ in rids]
        torch.testing.assert_close(
            ops.verify(graphed, rids, blocks, names=names).logits, ops.verify(eager, rids, blocks, names=names).logits,
            atol=1e-4, rtol=0,
        )  # fmt: skip
    assert graphed.graphs.lora_in_graphs and graphed.graphs.num_graphs >= 2  # decode and verify captured
