"""The prefix cache as a data structure (radix tree per adapter key: match, insert, split,
locks, LRU eviction, drop) and inside the KV pool (shared slots, caching on free,
eviction before the pool reports full)."""

from __future__ import annotations

import random

import pytest
import torch

from loraserve.runtime.kv import KVCache, KVCacheError, KVCacheFullError, PrefixCache

BASE = ("base", 0)
A = ("sql", 1)
B = ("chat", 1)


def _slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _seq(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


# ---------------------------------------------------------------------- the tree
def test_match_returns_longest_prefix():
    """Match returns longest cached prefix and its slots."""
    pc = PrefixCache()
    pc.insert(A, [1, 2, 3, 4], _slots(10, 11, 12, 13))
    m = pc.match(A, [1, 2, 3, 9, 9])
    assert m.length == 3
    assert m.slots.tolist() == [10, 11, 12]
    assert pc.match(A, [7, 1, 2]).length == 0
    assert pc.match(A, []).length == 0
    full = pc.match(A, [1, 2, 3, 4, 5])
    assert full.length == 4 and full.slots.tolist() == [10, 11, 12, 13]


def test_prefix_isolated_per_adapter():
    """Prefix under one adapter is never served to another or the base."""
    pc = PrefixCache()
    pc.insert(A, [5, 6, 7], _slots(1, 2, 3))
    assert pc.match(A, [5, 6, 7, 8]).length == 3
    assert pc.match(B, [5, 6, 7, 8]).length == 0
    assert pc.match(BASE, [5, 6, 7, 8]).length == 0
    # the same adapter name under a new load epoch is another key
    assert pc.match(("sql", 2), [5, 6, 7, 8]).length == 0


def test_insert_splits_edges():
    """Insert reports present tokens and splits edges."""
    pc = PrefixCache()
    assert pc.insert(A, [1, 2, 3, 4], _seq(10, 4)).present == 0
    # shares [1, 2], diverges: the edge splits, the new tail becomes a sibling leaf
    r = pc.insert(A, [1, 2, 8, 9], _slots(50, 51, 52, 53))
    assert r.present == 2
    assert pc.num_tokens == 6
    assert pc.match(A, [1, 2, 8, 9]).slots.tolist() == [10, 11, 52, 53]
    assert pc.match(A, [1, 2, 3, 4]).slots.tolist() == [10, 11, 12, 13]
    # everything present: nothing new
    r = pc.insert(A, [1, 2, 3], _slots(70, 71, 72))
    assert r.present == 3 and pc.num_tokens == 6
    # an extension of a leaf
    r = pc.insert(A, [1, 2, 3, 4, 5], _slots(0, 0, 0, 0, 99))
    assert r.present == 4 and pc.num_tokens == 7
    assert pc.match(A, [1, 2, 3, 4, 5, 6]).slots.tolist() == [10, 11, 12, 13, 99]


def test_partial_match_splits():
    """Partial match splits so a lock holds exactly the match."""
    pc = PrefixCache()
    pc.insert(A, [1, 2, 3, 4, 5, 6], _seq(20, 6))
    m = pc.match(A, [1, 2, 3, 7])
    assert m.length == 3 and len(m.node) == 3
    pc.lock(m.node)
    assert pc.num_evictable == 3  # [4, 5, 6] below the lock
    freed = pc.evict(100)
    assert sorted(freed.tolist()) == [23, 24, 25]
    assert pc.num_tokens == 3 and pc.num_evictable == 0
    assert pc.unlock(m.node).numel() == 0
    assert pc.num_evictable == 3


def test_peek_changes_nothing():
    pc = PrefixCache()
    pc.insert(A, [1, 2, 3, 4], _seq(0, 4))
    m = pc.match(A, [1, 2, 9], touch=False)
    assert m.length == 2 and m.evictable == 2 and m.slots.numel() == 0  # lengths only
    # no split happened: one edge of 4 tokens
    root = pc._trees[A].root
    assert len(root.children) == 1 and len(next(iter(root.children.values()))) == 4


def test_peek_counts_unlocked_only():
    """Peek counts only unlocked tokens as evictable."""
    pc = PrefixCache()
    pc.insert(A, [1, 2, 3, 4], _seq(0, 4))
    held = pc.match(A, [1, 2, 5])
    pc.lock(held.node)
    m = pc.match(A, [1, 2, 3, 4, 5], touch=False)
    assert m.length == 4 and m.evictable == 2


def test_eviction_is_lru_leaf_first():
    """Eviction is least recently used leaf first."""
    pc = PrefixCache()
    pc.insert(A, [1, 1, 1], _seq(0, 3))  # oldest
    pc.insert(B, [2, 2, 2], _seq(3, 3))
    pc.insert(BASE, [3, 3, 3], _seq(6, 3))
    pc.match(A, [1, 1, 1, 0])  # A used again: now the newest
    freed = pc.evict(3)
    assert sorted(freed.tolist()) == [3, 4, 5]  # B's
    freed = pc.evict(1)
    assert sorted(freed.tolist()) == [6, 7, 8]  # a whole leaf goes
    assert pc.match(A, [1, 1, 1, 0]).length == 3
    assert pc.num_tokens == pc.num_evictable == 3


def test_eviction_spares_locked_paths():
    """Eviction takes leaves before their parents and spares locked paths."""
    pc = PrefixCache()
    pc.insert(A, [1, 2, 3], _seq(0, 3))
    pc.insert(A, [1, 2, 4], _slots(9, 9, 5))  # splits: [1, 2] -> {[3], [4]}
    held = pc.match(A, [1, 2, 4, 0])
    pc.lock(held.node)
    freed = pc.evict(100)
    assert freed.tolist() == [2]  # only the unlocked leaf [3]; [1, 2] and [4] are held
    assert pc.unlock(held.node).numel() == 0
    freed = pc.evict(100)
    assert sorted(freed.tolist()) == [0, 1, 5]
    assert pc.num_tokens == 0 and pc.num_evictable == 0


def test_locks_count_requests():
    pc = PrefixCache()
    pc.insert(A, [1, 2], _seq(0, 2))
    m = pc.match(A, [1, 2, 3])
    pc.lock(m.node)
    pc.lock(m.node)
    pc.unlock(m.node)
    assert pc.evict(10).numel() == 0
    pc.unlock(m.node)
    with pytest.raises(RuntimeError):
        pc.unlock(m.node)
    assert pc.evict(10).numel() == 2


def test_drop_frees_and_refuses_key():
    """Drop frees unheld now and held when released and refuses the key."""
    pc = PrefixCache()
    pc.insert(A, [1, 2, 3], _seq(0, 3))
    pc.insert(A, [1, 2, 7, 8], _slots(0, 0, 3, 4))
    pc.insert(B, [1, 2, 3], _seq(10, 3))
    held = pc.match(A, [1, 2, 7, 0])
    pc.lock(held.node)
    freed = pc.drop(A)
    assert sorted(freed.tolist()) == [2, 4]  # the unheld branches: [3] and [8] past the held [7]
    assert pc.match(A, [1, 2, 3]).length == 0
    assert pc.insert(A, [1, 2, 3], _seq(40, 3)).node is None  # a dropped key caches nothing
    assert pc.match(B, [1, 2, 3, 0]).length == 3  # other keys untouched
    assert sorted(pc.unlock(held.node).tolist()) == [0, 1, 3]
    assert pc.num_tokens == 3 == pc.num_evictable


def test_random_ops_keep_counts():
    """Random operations keep the counts consistent."""
    rng = random.Random(7)
    pc = PrefixCache()
    next_slot = 0
    held = []
    for _ in range(400):
        op = rng.random()
        key = rng.choice([A, B, BASE])
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        if op < 0.4:
            pc.insert(key, tokens, _seq(next_slot, len(tokens)))
            next_slot += len(tokens)
        elif op < 0.6:
            m = pc.match(key, tokens)
            if m.node is not None:
                pc.lock(m.node)
                held.append(m.node)
        elif op < 0.8 and held:
            pc.unlock(held.pop(rng.randrange(len(held))))
        else:
            pc.evict(rng.randrange(1, 6))
        nodes = [n for k in pc.adapter_keys() for n in _nodes(pc, k)]
        assert pc.num_tokens == sum(len(n) for n in nodes)
        assert pc.num_evictable == sum(len(n) for n in nodes if n.lock == 0)
        for n in nodes:  # a node's lock counts at least its children's
            assert n.lock >= sum(c.lock for c in n.children.values())


def _nodes(pc: PrefixCache, key):
    root = pc._trees[key].root
    stack = list(root.children.values())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


# ---------------------------------------------------------------------- in the pool
def _kv(tokens: int = 64, rows: int = 8) -> KVCache:
    return KVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
        max_total_tokens=tokens,
        max_requests=rows,
        max_context_len=tokens,
        prefix_cache=True,
    )


def _all_slots_accounted(kv: KVCache) -> None:
    """Every slot is exactly once free, cached, or owned by one request (past its shared prefix)."""
    free = kv._free_slots[: kv._num_free].tolist()
    cached = [s for k in kv.prefix.adapter_keys() for n in _nodes(kv.prefix, k) for s in n.slots.tolist()]
    owned = [s for r in kv._requests.values() for s in r.slots[r.shared : r.length].tolist()]
    everything = free + cached + owned
    assert sorted(everything) == list(range(1, kv.capacity + 1)), "a slot was lost or handed out twice"


def test_finished_request_kv_reused():
    """A finished request leaves its KV and the next reuses it."""
    kv = _kv()
    prompt = list(range(100, 110))
    kv.allocate(["r1"], [10])
    first_slots = kv.token_slots("r1")
    assert kv.cache_and_free("r1", A, prompt) == 10
    assert kv.num_cached_tokens == 10 and kv.num_free_tokens == 64
    _all_slots_accounted(kv)
    # same prompt + question: reuses all but... the whole prompt (the new token follows)
    assert kv.match_prefix("r2", A, [*prompt, 7]) == 10
    assert kv.token_slots("r2").tolist() == first_slots.tolist()
    assert kv.req_to_token[kv._requests["r2"].row, :10].tolist() == first_slots.tolist()
    assert kv.num_free_tokens == 54  # the held prefix is no longer evictable
    alloc = kv.allocate(["r2"], [1])
    assert alloc.prefix_lens == [10] and not alloc.created[0]
    _all_slots_accounted(kv)


def test_the_last_prompt_token_is_always_computed():
    kv = _kv()
    kv.allocate(["r1"], [5])
    kv.cache_and_free("r1", A, [1, 2, 3, 4, 5])
    assert kv.match_prefix("r2", A, [1, 2, 3, 4, 5]) == 4
    assert kv.peek_prefix(A, [1, 2, 3, 4, 5]).length == 4
    assert kv.match_prefix("r3", A, [1, 2, 3, 4, 5], max_len=2) == 2


def test_other_adapter_gets_nothing():
    """Another adapter gets nothing from the pool."""
    kv = _kv()
    kv.allocate(["r1"], [6])
    kv.cache_and_free("r1", A, [1, 2, 3, 4, 5, 6])
    assert kv.match_prefix("r2", B, [1, 2, 3, 4, 5, 6, 7]) == 0
    assert "r2" not in kv
    assert kv.match_prefix("r3", BASE, [1, 2, 3, 4, 5, 6, 7]) == 0


def test_duplicate_kv_freed():
    """Duplicate KV is freed when a second request caches the same tokens."""
    kv = _kv()
    kv.allocate(["r1", "r2"], [4, 4])  # computed the same prompt concurrently
    kv.cache_and_free("r1", A, [1, 2, 3, 4])
    assert kv.cache_and_free("r2", A, [1, 2, 3, 4]) == 0
    assert kv.num_cached_tokens == 4 and kv._num_free == 60
    _all_slots_accounted(kv)


def test_only_held_tokens_cached():
    """Only tokens the request holds are cached and the rest is freed."""
    kv = _kv()
    kv.allocate(["r1"], [6])
    assert kv.cache_and_free("r1", A, [1, 2, 3]) == 3  # its last 3 entries are not cached
    assert kv.num_cached_tokens == 3 and kv._num_free == 61
    kv.allocate(["r2"], [2])
    assert kv.cache_and_free("r2", A, [1, 2, 3, 4, 5]) == 0  # holds 2: both present already
    _all_slots_accounted(kv)


def test_allocation_evicts_before_full():
    """Allocation evicts unused prefixes before reporting full."""
    kv = _kv(tokens=16)
    kv.allocate(["r1"], [10])
    kv.cache_and_free("r1", A, list(range(10)))
    assert kv.num_free_tokens == 16 and kv.num_unused_tokens == 6
    kv.allocate(["r2"], [12])  # needs 6 of the cached tokens
    assert kv.num_cached_tokens == 0  # one leaf: evicted whole
    assert kv.num_free_tokens == 4
    _all_slots_accounted(kv)
    with pytest.raises(KVCacheFullError):
        kv.allocate(["r3"], [5])


def test_a_held_prefix_is_never_evicted():
    kv = _kv(tokens=16)
    kv.allocate(["r1"], [8])
    kv.cache_and_free("r1", A, list(range(8)))
    assert kv.match_prefix("r2", A, [*range(8), 99]) == 8
    assert kv.num_free_tokens == 8
    with pytest.raises(KVCacheFullError):
        kv.allocate(["r3"], [9])
    kv.allocate(["r3"], [8])
    assert kv.token_slots("r2").tolist() == kv.prefix.match(A, list(range(8))).slots.tolist()
    _all_slots_accounted(kv)


def test_truncate_keeps_shared_slots():
    """Truncating into a shared prefix never frees the trees slots."""
    kv = _kv()
    kv.allocate(["r1"], [6])
    kv.cache_and_free("r1", A, list(range(6)))
    kv.match_prefix("r2", A, [*range(6), 9])
    kv.allocate(["r2"], [3])
    kv.truncate("r2", 5)  # 3 own + 2 of the shared prefix
    assert kv.seq_len("r2") == 4 and kv.shared_len("r2") == 4
    _all_slots_accounted(kv)
    with pytest.raises(KVCacheError):
        kv.keep([("r2", 2, [1])])
    kv.free("r2")
    assert kv.num_cached_tokens == 6 and kv.num_free_tokens == 64
    _all_slots_accounted(kv)


def test_rollback_keeps_prefix():
    """Rollback of a first forward after a match keeps the prefix."""
    kv = _kv()
    kv.allocate(["r1"], [6])
    kv.cache_and_free("r1", A, list(range(6)))
    kv.match_prefix("r2", A, [*range(6), 9, 9])
    alloc = kv.allocate(["r2"], [2])
    kv.rollback(alloc)
    assert kv.seq_len("r2") == 6 and kv.shared_len("r2") == 6
    _all_slots_accounted(kv)


def test_retraction_resumes_from_kv():
    """Retraction caches then the request resumes from its own KV."""
    kv = _kv()
    prompt = list(range(20, 32))
    kv.allocate(["r1"], [12])
    kv.allocate(["r1"], [3])  # decoded 3 tokens (fed back)
    ids = [*prompt, 5, 6, 7, 8]  # 4 outputs, the last not yet fed
    slots = kv.token_slots("r1")
    kv.cache_and_free("r1", A, ids[:15])
    assert kv.match_prefix("r1", A, ids) == 15
    assert kv.token_slots("r1").tolist() == slots.tolist()
    _all_slots_accounted(kv)


def test_running_prompt_shared():
    """A running prompt is shared before the request ends."""
    kv = _kv()
    prompt = list(range(40, 50))
    kv.allocate(["r1", "r2"], [10, 10])  # both prefilled the same prompt in one step
    r2_own = kv.token_slots("r2")
    assert kv.cache_prefix("r1", A, prompt) == 10
    assert kv.shared_len("r1") == 10 and kv.num_evictable_tokens == 0  # held by r1
    assert kv.cache_prefix("r2", A, prompt) == 0  # already there: r2 switches to r1's copy
    assert kv.token_slots("r2").tolist() == kv.token_slots("r1").tolist()
    row = kv._requests["r2"].row
    assert kv.req_to_token[row, :10].tolist() == kv.token_slots("r1").tolist()
    assert kv._num_free == 64 - 10 and not set(r2_own.tolist()) & set(kv.token_slots("r1").tolist())
    _all_slots_accounted(kv)
    # a third request arriving now reuses it while both still run
    assert kv.match_prefix("r3", A, [*prompt, 1]) == 10
    kv.allocate(["r1", "r2"], [2, 2])  # decoding goes on past the shared prefix
    assert kv.releasable_tokens("r1") == 2  # the prompt is held by r2 and r3 too
    kv.free("r2")
    kv.free("r3")
    assert kv.releasable_tokens("r1") == 12
    kv.cache_and_free("r1", A, [*prompt, 3, 4])
    assert kv.num_cached_tokens == 12 and kv.num_evictable_tokens == 12
    _all_slots_accounted(kv)


def test_drop_prefixes_of_an_unloaded_adapter():
    kv = _kv()
    kv.allocate(["r1", "r2"], [4, 4])
    kv.cache_and_free("r1", A, [1, 2, 3, 4])
    kv.cache_and_free("r2", B, [1, 2, 3, 4])
    kv.match_prefix("r3", A, [1, 2, 3, 4, 5])  # running on A's prefix
    assert kv.drop_prefixes(lambda key: key[0] == "sql") == 0  # held: freed when r3 ends
    assert kv.match_prefix("r4", A, [1, 2, 3, 4, 5]) == 0
    kv.allocate(["r3"], [1])
    assert kv.cache_and_free("r3", A, [1, 2, 3, 4, 5]) == 0  # the key is refused now
    assert kv.num_cached_tokens == 4  # B's only
    assert kv.match_prefix("r5", B, [1, 2, 3, 4, 5]) == 4
    _all_slots_accounted(kv)


def test_no_row_free_means_no_match():
    kv = _kv(rows=1)
    kv.allocate(["r1"], [4])
    kv.cache_and_free("r1", A, [1, 2, 3, 4])
    kv.allocate(["busy"], [1])
    assert kv.match_prefix("r2", A, [1, 2, 3, 4, 5]) == 0


def test_without_a_prefix_cache_nothing_changes():
    kv = KVCache(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
        max_total_tokens=16,
        max_requests=2,
        max_context_len=16,
    )
    kv.allocate(["r1"], [4])
    assert kv.cache_and_free("r1", A, [1, 2, 3, 4]) == 0
    assert kv.num_free_tokens == 16 and kv.num_cached_tokens == 0
    assert kv.match_prefix("r2", A, [1, 2, 3, 4, 5]) == 0
    assert kv.peek_prefix(A, [1, 2, 3, 4, 5]).length == 0


def test_random_pool_keeps_slots():
    """Random pool workload never loses or double hands a slot."""
    rng = random.Random(3)
    kv = _kv(tokens=48, rows=4)
    live: dict[str, tuple] = {}
    n = 0
    for _ in range(300):
        if live and (rng.random() < 0.4 or len(live) == 4):
            rid = rng.choice(sorted(live))
            key, ids = live.pop(rid)
            held = kv.seq_len(rid)
            if rng.random() < 0.2:
                kv.free(rid)
            else:
                kv.cache_and_free(rid, key, ids[:held])
        else:
            rid = f"r{n}"
            n += 1
            key = rng.choice([A, B])
            ids = [rng.randrange(2) for _ in range(rng.randrange(2, 12))]
            got = kv.match_prefix(rid, key, ids)
            try:
                kv.allocate([rid], [len(ids) - got])
            except KVCacheFullError:
                kv.free(rid)
                continue
            if rng.random() < 0.3 and kv.seq_len(rid) - kv.shared_len(rid) > 0:
                kv.truncate(rid, 1)
            if rng.random() < 0.4:
                kv.cache_prefix(rid, key, ids[: rng.randrange(1, len(ids) + 1)])
            live[rid] = (key, ids)
        _all_slots_accounted(kv)
        assert kv.num_evictable_tokens <= kv.num_cached_tokens


class _Journalled(KVCache):
    """A pool that records, in order, what another rank must replay (as a TP mirror does)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[tuple] = []

    def allocate(self, request_ids, num_tokens):
        alloc = super().allocate(request_ids, num_tokens)
        self.log.append(("allocate", list(request_ids), list(num_tokens)))
        return alloc

    def truncate(self, request_id, num_tokens):
        super().truncate(request_id, num_tokens)
        self.log.append(("truncate", request_id, num_tokens))

    def free(self, request_id):
        if request_id in self:
            self.log.append(("free", request_id))
        super().free(request_id)

    def _journal_adopt(self, request_id, slots):
        self.log.append(("adopt", request_id, slots.clone()))

    def _journal_forget(self, request_id):
        self.log.append(("forget", request_id))

    def _journal_release(self, slots):
        self.log.append(("release", slots.clone()))

    def _journal_share(self, request_id, start, slots):
        self.log.append(("share", request_id, start, slots.clone()))


def test_treeless_pool_replays_state():
    """What a tensor-parallel follower needs: adopt / forget / release (plus the usual
    allocate / truncate / free) reproduce rank 0's slots, rows and free stack exactly."""
    args = dict(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu",
                max_total_tokens=40, max_requests=4, max_context_len=40)  # fmt: skip
    primary = _Journalled(**args, prefix_cache=True)
    mirror = KVCache(**args)
    rng = random.Random(11)
    live: dict[str, tuple] = {}
    for step in range(250):
        if live and (rng.random() < 0.45 or len(live) == 4):
            rid = rng.choice(sorted(live))
            key, ids = live.pop(rid)
            if rng.random() < 0.2:
                primary.free(rid)
            else:
                primary.cache_and_free(rid, key, ids[: primary.seq_len(rid)])
        elif rng.random() < 0.05:
            primary.drop_prefixes(lambda key: key == A)
        else:
            rid = f"r{step}"
            key = rng.choice([A, B, ("sql", 2)])
            ids = [rng.randrange(2) for _ in range(rng.randrange(2, 12))]
            got = primary.match_prefix(rid, key, ids)
            try:
                primary.allocate([rid], [len(ids) - got])
            except KVCacheFullError:
                primary.free(rid)
                continue
            if rng.random() < 0.5:  # its prompt is cached while it runs
                primary.cache_prefix(rid, key, ids[: rng.randrange(1, len(ids) + 1)])
            live[rid] = (key, ids)
        for op, *rest in primary.log:
            if op == "allocate":
                mirror.allocate(*rest)
            elif op == "release":
                mirror.release_slots(*rest)
            else:
                getattr(mirror, op)(*rest)
        primary.log.clear()
        assert mirror._num_free == primary._num_free
        assert torch.equal(mirror._free_slots[: mirror._num_free], primary._free_slots[: primary._num_free])
        assert mirror._free_rows == primary._free_rows
        assert torch.equal(mirror.req_to_token, primary.req_to_token)
        for rid in primary.request_ids():
            assert torch.equal(mirror.token_slots(rid), primary.token_slots(rid))
