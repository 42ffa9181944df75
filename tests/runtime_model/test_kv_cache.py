"""The KV cache's accounting: allocation, truncation, freeing, limits and the budget."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.kv import (
    KVCache,
    KVCacheError,
    KVCacheFullError,
    derive_max_total_tokens,
    kv_bytes_per_token,
)


def _cache(tokens=64, requests=4, context=32):
    return KVCache(
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        device="cpu",
        max_total_tokens=tokens,
        max_requests=requests,
        max_context_len=context,
    )


def _table(cache, rid):
    """The device-side token table row of a request, up to its length."""
    req = cache._requests[rid]
    return cache.req_to_token[req.row, : req.length]


def test_allocate_distinct_slots():
    """Allocate maps every token to a distinct slot."""
    cache = _cache()
    a = cache.allocate(["x", "y"], [5, 3])
    assert a.prefix_lens == [0, 0] and a.new_lens == [5, 3] and a.created == [True, True]
    b = cache.allocate(["y", "x"], [2, 1])
    assert b.prefix_lens == [3, 5] and b.created == [False, False]
    slots = torch.cat([cache.token_slots("x"), cache.token_slots("y")])
    assert len(set(slots.tolist())) == 11 and 0 not in slots.tolist()  # slot 0 is padding
    assert cache.num_free_tokens == 64 - 11 and cache.num_used_tokens == 11
    # the device table agrees with the host copy, and out_cache_loc is in batch order
    assert torch.equal(_table(cache, "x"), cache.token_slots("x"))
    assert torch.equal(_table(cache, "y"), cache.token_slots("y"))
    assert b.out_cache_loc.tolist() == cache.token_slots("y")[3:].tolist() + cache.token_slots("x")[5:].tolist()


def test_truncate_and_free_return_slots_for_reuse():
    cache = _cache()
    cache.allocate(["x"], [10])
    tail = cache.token_slots("x")[6:].tolist()
    cache.truncate("x", 4)
    assert cache.seq_len("x") == 6 and cache.num_free_tokens == 64 - 6
    again = cache.allocate(["x"], [4]).out_cache_loc.tolist()
    assert sorted(again) == sorted(tail)  # the freed slots are reused first
    assert torch.equal(_table(cache, "x"), cache.token_slots("x"))
    cache.free("x")
    cache.free("x")
    assert cache.num_free_tokens == 64 and cache.num_free_rows == 4 and "x" not in cache
    with pytest.raises(KVCacheError, match="holds no KV"):
        cache.truncate("x", 1)
    cache.allocate(["z"], [1])
    with pytest.raises(KVCacheError, match="cannot truncate 2"):
        cache.truncate("z", 2)


def test_full_cache_refuses_atomically():
    cache = _cache(tokens=10, requests=2)
    cache.allocate(["a"], [6])
    with pytest.raises(KVCacheFullError, match="need 5 tokens"):
        cache.allocate(["a", "b"], [1, 4])  # 5 > 4 free
    assert cache.num_free_tokens == 4 and cache.seq_len("a") == 6 and "b" not in cache
    cache.allocate(["b"], [4])
    assert cache.num_free_tokens == 0
    with pytest.raises(KVCacheFullError, match="request rows"):
        cache.allocate(["c"], [0])
    assert cache.can_allocate(0, 0) and not cache.can_allocate(1) and not cache.can_allocate(0, 1)


def test_context_limit_names_the_request():
    cache = _cache(context=8)
    cache.allocate(["long"], [6])
    with pytest.raises(KVCacheError, match="'long' would hold 9 tokens"):
        cache.allocate(["long"], [3])
    assert cache.seq_len("long") == 6


def test_rollback_restores_the_previous_state():
    cache = _cache()
    cache.allocate(["old"], [4])
    before = (cache.num_free_tokens, cache.token_slots("old").tolist())
    alloc = cache.allocate(["old", "new"], [3, 5])
    cache.rollback(alloc)
    assert (cache.num_free_tokens, cache.token_slots("old").tolist()) == before
    assert "new" not in cache and cache.num_free_rows == 3


def test_allocating_rolls_back_on_raise():
    """Allocating rolls back when the body raises and keeps the entries otherwise."""
    cache = _cache()
    cache.allocate(["old"], [4])
    before = (cache.num_free_tokens, cache.token_slots("old").tolist())
    with pytest.raises(RuntimeError, match="forward failed"), cache.allocating(["old", "new"], [3, 5]):
        raise RuntimeError("forward failed")
    assert (cache.num_free_tokens, cache.token_slots("old").tolist()) == before
    assert "new" not in cache
    with cache.allocating(["old", "new"], [3, 5]) as alloc:
        assert alloc.new_lens == [3, 5]
    assert cache.seq_len("old") == 7 and cache.seq_len("new") == 5


def test_growing_request_keeps_its_slots_in_order():
    cache = _cache(tokens=200, context=200)
    pieces = []
    for n in (3, 17, 1, 40, 2):
        pieces += cache.allocate(["g"], [n]).out_cache_loc.tolist()
    assert cache.token_slots("g").tolist() == pieces
    assert _table(cache, "g").tolist() == pieces


def test_budget_from_config_or_memory():
    per_token = kv_bytes_per_token(32, 8, 128, torch.bfloat16)
    assert per_token == 2 * 32 * 8 * 128 * 2
    cpu = torch.device("cpu")
    assert derive_max_total_tokens(
        requested=1234, bytes_per_token=per_token, device=cpu, memory_fraction=0.5, max_requests=4, max_context_len=8
    ) == 1234
    derived = derive_max_total_tokens(
        requested=None, bytes_per_token=64, device=cpu, memory_fraction=0.5, max_requests=4, max_context_len=100
    )
    assert derived == 400  # capped: never more than the requests could occupy
    with pytest.raises(KVCacheError, match="kv_memory_fraction"):
        derive_max_total_tokens(
            requested=None, bytes_per_token=64, device=cpu, memory_fraction=1.5, max_requests=4, max_context_len=8
        )
    with pytest.raises(KVCacheError, match="max_total_tokens must be >= 1"):
        derive_max_total_tokens(
            requested=0, bytes_per_token=64, device=cpu, memory_fraction=0.5, max_requests=4, max_context_len=8
        )


def test_runner_budget_follows_scheduler_config(assets, make_config):
    from loraserve.runtime.runner.model_runner import ModelRunner

    config = make_config(assets.models["llama-gqa"])
    config.scheduler.max_total_tokens = 777
    runner = ModelRunner(config)
    assert runner.kv.capacity == 777 and runner.kv.num_free_tokens == 777
    assert runner.kv.max_requests == 2 * config.scheduler.max_running_requests


def test_keep_moves_tree_path():
    """Keep moves a tree path to the front and frees the rest."""
    cache = _cache()
    cache.allocate(["x", "y", "z"], [4, 2, 3])
    cache.allocate(["x", "y", "z"], [6, 5, 4])  # a verify block of each
    x, y, z = (cache.token_slots(r).tolist() for r in "xyz")
    free_before = cache.num_free_tokens
    cache.keep([("x", 4, [0, 3, 5]), ("y", 2, [0, 1]), ("z", 3, [0])])
    assert cache.token_slots("x").tolist() == [*x[:4], x[4], x[7], x[9]]
    assert cache.token_slots("y").tolist() == y[:4]  # a prefix: a plain truncate
    assert cache.token_slots("z").tolist() == z[:4]
    assert cache.num_free_tokens == free_before + 3 + 3 + 3
    for rid in "xyz":
        assert torch.equal(_table(cache, rid), cache.token_slots(rid))
    freed = set([*x[5:7], x[8], *y[4:], *z[4:]])
    again = cache.allocate(["w"], [9]).out_cache_loc.tolist()
    assert set(again) == freed  # exactly the dropped entries came back
    with pytest.raises(KVCacheError, match="cannot keep offsets"):
        cache.keep([("x", 4, [0, 0])])
    with pytest.raises(KVCacheError, match="cannot keep offsets"):
        cache.keep([("x", 4, [3])])
