"""Oracle: Gemma 3 on two tensor-parallel ranks gives the single-device runner's logits
(which tests/runtime_model/test_gemma3.py holds to transformers and peft).

The tiny Gemma has what the cut must respect: sliding and global layers (window 4, two rope
bases) over prompts longer than the window, ``head_dim`` (24) unlike ``hidden / heads`` (16),
per-head q/k norms and four ``(1 + w)`` norms per layer, ``query_pre_attn_scalar`` unlike
``head_dim``, the embedding scale, a final logit soft-cap, tied embeddings over a vocabulary
of 509 (rank 1's shard holds a padding row), and an adapter on every module, the embedding
and lm_head included. The group runs once with SDPA and once with the paged Triton kernel
(decode and verify rows; extend runs SDPA), against one device on SDPA each time.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import DENSE_LORA_MODULES
from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model
from loraserve.runtime.model.gemma3 import GemmaRMSNorm
from loraserve.runtime.model.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from loraserve.runtime.runner.model_runner import ModelRunner

from ..runtime_model.test_gemma3 import SMALL
from .conftest import Pair, adapter_delta, every_mode, greedy, tp_config, tp_group

VOCAB = 509
HEAD_DIM = 24  # q/k/v are 96 / 48 / 48 wide over a 64-wide residual stream
SOFTCAP = 2.0


@pytest.fixture(scope="module")
def gemma_tp(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gemma3_tp")
    model = build_tiny_model(
        root / "m",
        architecture="gemma3",
        seed=91,
        moe={"query_pre_attn_scalar": 20, "final_logit_softcapping": SOFTCAP},
        **{**SMALL, "head_dim": HEAD_DIM, "vocab_size": VOCAB},
    )
    adapter = build_adapter(root / "a", model, rank=8, alpha=16, target_modules=DENSE_LORA_MODULES, seed=92)
    return {"model": model, "adapter": adapter}


@pytest.fixture(scope="module", params=["sdpa", "triton"])
def pair(request, gemma_tp):
    """Two ranks on ``request.param``'s attention, one device on SDPA. Module-scoped and
    parametrized: pytest runs every test on one group, closes it, then starts the next (a
    process runs one tensor-parallel group at a time)."""
    adapters = {"all": gemma_tp["adapter"]}
    config = tp_config(gemma_tp["model"], 2, adapters, attention=request.param)
    with tp_group(config) as (handle, runner):
        assert runner.attention_backend == request.param
        ref = ModelRunner(tp_config(gemma_tp["model"], 1, adapters))
        assert ref.attention_backend == "sdpa"
        yield Pair(tp=runner, ref=ref, handle=handle)


def test_every_mode_matches_one_device(pair):
    """Extend (every position; the embedding stream and a sliding and a global layer's
    outputs), two decodes, a verify, a rejected-draft truncation and a decode after it, with
    the adapter and the base model in one batch."""
    out = every_mode(pair, ["all", None, "all"], (9, 3, 13), (2, 0, 3), vocab=VOCAB, hidden_layers=(0, 1, 2))
    assert out.logits.shape == (25, VOCAB)
    assert out.logits.abs().max() <= SOFTCAP  # capped once, after the gather


@pytest.mark.parametrize("adapter", [None, "all"])
def test_greedy_generation_matches_one_device(pair, adapter):
    """Greedy tokens on two ranks equal one device's, well past the sliding window."""
    prompt = torch.tensor([2, 306, 395, 347, 486, 10, 308, 334])
    tokens = {
        key: greedy(runner, f"greedy-{adapter}", prompt, adapter, n=16)
        for key, runner in (("tp", pair.tp), ("ref", pair.ref))
    }
    assert tokens["tp"] == tokens["ref"]
    assert len(set(tokens["tp"])) > 1  # not a degenerate repeat that any model would match


def test_adapter_changes_tp_output(pair):
    """Guards the oracle: the adapter moves the logits on two ranks."""
    prompt = torch.arange(5, 17)
    assert adapter_delta(pair.tp, prompt, "all") > 1e-2


def test_ranks_hold_shards(pair):
    """Heads, KV heads and MLP columns are halved; Gemma's norms are whole on each rank."""
    model = pair.tp.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv_proj.out_sizes == (2 * HEAD_DIM, HEAD_DIM, HEAD_DIM)  # 2 of 4 heads, 1 of 2 KV heads
        assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.in_features == 2 * HEAD_DIM
        assert mlp.gate_up_proj.out_sizes == (48, 48)  # half of intermediate_size 96
        assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.in_features == 48
        for norm in (attn.q_norm, attn.k_norm):
            assert isinstance(norm, GemmaRMSNorm) and norm.weight.shape == (HEAD_DIM,)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"):
            assert getattr(layer, name).weight.shape == (64,), name
        assert layer.post_feedforward_layernorm.weight.shape == (64,)
    windows = [layer.self_attn.window for layer in model.model.layers]
    assert windows == [4, None, 4, None]
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    assert model.model.embed_tokens.weight.shape == (255, 64)  # ceil(509 / 2)
    assert isinstance(model.lm_head, ParallelLMHead)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert pair.tp.kv.k_buffers[0].shape[1:] == (1, HEAD_DIM)
    hooks = pair.tp.lora.pool.hooks  # the adapter's slots, cut as the base is
    assert tuple(hooks[("qkv_proj", 0)].B.shape[1:]) == (4 * HEAD_DIM, 16)  # local q, k and v rows
    assert tuple(hooks[("o_proj", 0)].A.shape[1:]) == (16, 2 * HEAD_DIM)
    assert tuple(hooks[("embed_tokens", None)].A.shape[1:]) == (256, 16)  # 255 rows + the zero row
    assert tuple(hooks[("lm_head", None)].B.shape[1:]) == (255, 16)
    # The norms are the checkpoint's, not a fresh ``(1 + 0)``: equal to one device's.
    for got, want in zip(model.model.layers, pair.ref.model.model.layers, strict=True):
        assert torch.equal(got.self_attn.q_norm.weight, want.self_attn.q_norm.weight)
        assert torch.equal(got.post_feedforward_layernorm.weight, want.post_feedforward_layernorm.weight)
