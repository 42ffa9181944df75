"""Oracle: a 2-rank tensor-parallel runner gives the single-device runner's logits.

Rank 0 is this process, rank 1 a worker process the runtime's launcher starts; gloo on
the CPU carries every collective. Batches mix adapters (and the base model), cover every
forward mode, and change the KV cache and adapter slots between steps the way the
engine and the speculative decoder do, so the followers' mirrored state is exercised.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from loraserve.runtime.kv import KVCache
from loraserve.runtime.lora import AdapterCapacityError
from loraserve.runtime.model.layers import Linear
from loraserve.runtime.model.layers.parallel import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import Pair, adapter_delta, both, decode, every_mode, extend, greedy, tp_config, tp_group

START_ADAPTERS = ("attn-r8", "all-r16", "mlp-r4-rs", "emb-head")


@pytest.fixture(scope="module")
def pair(tp_assets):
    adapters = {n: tp_assets.adapters[n] for n in START_ADAPTERS}
    # 3 slots for 4 (later 5) adapters: batches force evictions and re-placements.
    with tp_group(tp_config(tp_assets.gqa, 2, adapters, max_loras_per_batch=3)) as (handle, runner):
        yield Pair(
            tp=runner,
            ref=ModelRunner(tp_config(tp_assets.gqa, 1, adapters, max_loras_per_batch=3)),
            handle=handle,
        )


def test_mixed_adapters_match_one_device(pair, tp_assets):
    """Every mode with mixed adapters matches one device."""
    # 3 adapters + base: fills every slot
    names = ["emb-head", None, "all-r16", "attn-r8"]
    out = every_mode(pair, names, (9, 4, 13, 6), (3, 0, 1, 2), hidden_layers=(0, 2, 3))
    assert out.logits.shape == (32, 512)


def test_adapters_change_tp_output(pair):
    """Guards the oracle: every adapter's logits differ from the base model's on two ranks."""
    prompt = torch.arange(5, 17)
    for name in START_ADAPTERS:
        assert adapter_delta(pair.tp, prompt, name) > 1e-2, name


@pytest.mark.parametrize("adapter", [None, "all-r16", "emb-head"])
def test_greedy_generation_matches_one_device(pair, adapter):
    prompt = torch.tensor([1, 306, 395, 347, 486, 10, 308, 334])
    tokens = {
        key: greedy(runner, f"g-{adapter}", prompt, adapter, n=20)
        for key, runner in (("tp", pair.tp), ("ref", pair.ref))
    }
    assert tokens["tp"] == tokens["ref"]


def test_adapter_churn_mirrored(pair, tp_assets):
    """Rank 0 loads, evicts, re-places and unloads adapters; rank 1 replays every change."""
    for runner in (pair.tp, pair.ref):
        runner.lora.load("late-r4", tp_assets.adapters["late-r4"])
    gen = torch.Generator().manual_seed(3)
    # Five adapters through three slots: every batch evicts someone the previous one used.
    rounds = [
        ["late-r4", "attn-r8", None],
        ["mlp-r4-rs", "all-r16", "late-r4"],
        ["emb-head", "attn-r8", "mlp-r4-rs"],
        ["late-r4", "emb-head", "all-r16"],
    ]
    for i, names in enumerate(rounds):
        rids = [f"c{i}-{j}" for j in range(3)]
        prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (5, 8, 3)]
        both(pair, extend, rids, prompts, names)
        both(pair, decode, rids, torch.randint(3, 512, (3,), generator=gen), names)
        for rid in rids:
            pair.tp.kv.free(rid)
            pair.ref.kv.free(rid)
    for runner in (pair.tp, pair.ref):
        runner.lora.unload("late-r4")
        assert "late-r4" not in runner.lora
    # After the unload the slot it held serves others, on both ranks alike.
    names = ["all-r16", "emb-head", "mlp-r4-rs"]
    both(pair, extend, ["u0", "u1", "u2"], [torch.arange(3, 9)] * 3, names)
    for rid in ("u0", "u1", "u2"):
        pair.tp.kv.free(rid)
        pair.ref.kv.free(rid)


def test_threaded_adapter_changes_agree(pair, tp_assets):
    """The server loads (pinned: placed at once), and unloads, adapters on its own thread
    while forwards run: each step's expected slot state is exactly what rank 1 replays."""
    stop, loads = threading.Event(), [0]

    def churn():
        while not stop.is_set():
            try:
                pair.tp.lora.load("late-r4", tp_assets.adapters["late-r4"], pinned=loads[0] % 2 == 0)
                loads[0] += 1
            except AdapterCapacityError:
                pass  # every free slot serves the running batch: the next one places it
            pair.tp.lora.unload("late-r4")
            time.sleep(0.002)  # leave the forward thread the interpreter now and then

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        gen = torch.Generator().manual_seed(11)
        for i in range(9):
            names = [("attn-r8", "emb-head", "mlp-r4-rs")[i % 3], None]
            extend(pair.tp, [f"t{i}", f"u{i}"], [torch.randint(3, 512, (5,), generator=gen)] * 2, names)
            decode(pair.tp, [f"t{i}", f"u{i}"], [7, 8], names)
            pair.tp.kv.free(f"t{i}")
            pair.tp.kv.free(f"u{i}")
    finally:
        stop.set()
        thread.join(timeout=30)
    assert loads[0] > 0 and pair.handle.health.failure is None
    names = ["all-r16", "emb-head", None]
    both(pair, extend, ["z0", "z1", "z2"], [torch.arange(3, 10)] * 3, names)
    for rid in ("z0", "z1", "z2"):
        pair.tp.kv.free(rid)
        pair.ref.kv.free(rid)


def test_ranks_hold_shards(pair):
    """TP=2 holds half of every sharded tensor; TP=1 has no parallel layer, group or journal."""
    tp, ref = pair.tp, pair.ref
    attn, mlp = tp.model.model.layers[0].self_attn, tp.model.model.layers[0].mlp
    assert attn.qkv_proj.out_sizes == (32, 16, 16)  # 2 of 4 query heads, 1 of 2 KV heads, head_dim 16
    assert isinstance(attn.o_proj, RowParallelLinear) and attn.o_proj.in_features == 32
    assert isinstance(mlp.down_proj, RowParallelLinear) and mlp.down_proj.in_features == 64
    assert isinstance(tp.model.model.embed_tokens, VocabParallelEmbedding)
    assert tuple(tp.model.lm_head.weight.shape) == (256, 64)
    assert isinstance(tp.model.lm_head, ParallelLMHead)
    assert tp.kv.k_buffers[0].shape[1] == 1  # one KV head per rank
    hooks = tp.lora.pool.hooks
    assert tuple(hooks[("qkv_proj", 0)].B.shape[1:]) == (64, 16)  # B cut by output rows
    assert tuple(hooks[("o_proj", 0)].A.shape[1:]) == (16, 32)  # A cut by input columns
    assert tuple(hooks[("embed_tokens", None)].A.shape[1:]) == (257, 16)  # 256 rows + the zero row
    assert tuple(hooks[("lm_head", None)].B.shape[1:]) == (256, 16)

    assert ref.tp is None and ref.shard is None and ref.model.group is None
    assert type(ref.kv) is KVCache  # no journal
    for layer in ref.model.model.layers:
        assert type(layer.self_attn.o_proj) is Linear and type(layer.mlp.down_proj) is Linear
    assert ref.model.model.embed_tokens.weight.shape[0] == 512


def test_vocab_weights_gathered_for_drafts(pair):
    """Whole vocabulary weights are gathered for drafts."""
    embed, head = pair.tp.full_vocab_weights()
    torch.testing.assert_close(embed, pair.ref.model.embed_tokens.weight, atol=0, rtol=0)
    torch.testing.assert_close(head, pair.ref.model.lm_head.weight, atol=0, rtol=0)
    assert pair.tp.embed_tokens.weight.shape == (512, 64)
    assert pair.tp.lm_head.weight.shape == (512, 64)


def test_followers_kept_up(pair):
    """Rank 1 received every step (messages flowed) and the group is healthy."""
    assert pair.handle.driver.messages_sent > 20
    assert pair.handle.health.failure is None
    assert all(p.poll() is None for p in pair.handle.workers)
