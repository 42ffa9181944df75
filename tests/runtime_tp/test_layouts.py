"""Layouts that cut differently: replicated KV heads, a padded vocabulary shard, tied
embeddings, q/k/v biases, row-parallel biases, random weights, the Triton LoRA kernels.

Each test starts its own 2-rank group and compares with one device.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import decode, extend, tp_config, tp_group, verify

TOL = 1e-4


def _run_modes(runner, names, seed=0):
    """Extend (every position), two decodes and a verify; returns every logit row."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    rids = [f"l{i}" for i in range(len(names))]
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (7, 11, 4)[: len(names)]]
    rows = [extend(runner, rids, prompts, names, return_all_logits=True).logits]
    for _ in range(2):
        rows.append(decode(runner, rids, torch.randint(3, vocab, (len(rids),), generator=gen), names).logits)
    blocks = [torch.randint(3, vocab, (3,), generator=gen) for _ in rids]
    rows.append(verify(runner, rids, blocks, names).logits)
    for rid in rids:
        runner.kv.free(rid)
    return torch.cat(rows)


def test_replicated_kv_padded_vocab_tied(tp_assets):
    """1 KV head on 2 ranks (each holds it), vocab 509 (rank 1's shard has a padding row),
    tied embedding / lm_head, Qwen2 q/k/v biases, an adapter on every module."""
    adapters = {"rep-all": tp_assets.replicated_adapter}
    ref = ModelRunner(tp_config(tp_assets.replicated, 1, adapters))
    want = _run_modes(ref, ["rep-all", None, "rep-all"])
    with tp_group(tp_config(tp_assets.replicated, 2, adapters)) as (_, runner):
        assert runner.shard.local_kv_heads == 1 and runner.shard.kv_head_start == 0
        assert runner.model.model.embed_tokens.weight.shape[0] == 255  # ceil(509 / 2)
        assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
        got = _run_modes(runner, ["rep-all", None, "rep-all"])
    assert got.shape == want.shape == (22 + 3 + 3 + 9, 509)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_random_weights_with_row_parallel_biases(tp_assets):
    """Random weights are drawn whole and cut, so two ranks build the one-device model;
    o_proj / down_proj biases are added once (by rank 0) before the all-reduce."""
    config1, config2 = tp_config(tp_assets.biased, 1), tp_config(tp_assets.biased, 2)
    ref = ModelRunner(config1, random_weights=True)
    assert ref.model.model.layers[0].self_attn.o_proj.bias.abs().sum() > 0
    want = _run_modes(ref, [None, None])
    with tp_group(config2, random_weights=True) as (_, runner):
        got = _run_modes(runner, [None, None])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1")
def test_triton_lora_kernels_on_two_ranks(tp_assets):
    """The Triton kernels (interpreted on the CPU) over sharded A/B buffers."""
    names = ["emb-head", None, "all-r16"]
    adapters = {n: tp_assets.adapters[n] for n in names if n}
    ref = ModelRunner(tp_config(tp_assets.gqa, 1, adapters, backend="triton"))
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (6, 9, 4)]
    step = torch.randint(3, 512, (3,), generator=gen)
    with tp_group(tp_config(tp_assets.gqa, 2, adapters, backend="triton")) as (_, runner):
        assert runner.lora.backend.name == "triton"
        for r in (ref, runner):
            out = extend(r, ["t0", "t1", "t2"], prompts, names).logits
            dec = decode(r, ["t0", "t1", "t2"], step, names).logits
            if r is ref:
                want = torch.cat([out, dec])
            else:
                torch.testing.assert_close(torch.cat([out, dec]), want, atol=TOL, rtol=0)
