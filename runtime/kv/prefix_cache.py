"""Prefix caching per adapter: a radix tree over token ids, one tree per adapter key.

A prompt's KV depends on every token before it *and* on the adapter (every layer's k/v
projection may be adapted), so a cached prefix is found by ``(adapter key, token ids)``:
each adapter key (the base model is a key of its own) owns a separate tree, and a lookup
never leaves its key's tree. The key is chosen by the engine and must change whenever the
weights behind a name change (it carries the adapter's load epoch), so a reloaded adapter
never sees the old weights' KV.

Why a radix tree (SGLang's RadixAttention) rather than hashed blocks (vLLM's automatic
prefix caching): the KV pool (:mod:`.cache`) is token-granular, a slot per token with no
pages, so a tree whose edges hold token runs and their slots reuses every cached token,
not just whole blocks, and splitting an edge is a slice. Hashed blocks exist to fit a
paged pool; here they would throw away up to a block per request (a chat turn's prefix
rarely ends on a block boundary) and need a hash per block to be chained over the whole
prefix for the adapter key anyway.

Nodes are reference-counted: a request reusing a prefix locks the path from its last
matched node to the root, so its slots can be neither evicted nor handed out. Unlocked
nodes are evictable, least-recently-used leaves first (a parent becomes a leaf once its
children are gone). The tree keeps no KV itself; it maps token runs to pool slots and
returns the slots it lets go, which the pool frees.

Time is a logical clock (a counter), not the wall clock: eviction order is then a pure
function of the calls made, the same on every run (and on every tensor-parallel rank).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)
class Node:
    """An edge of the tree: a run of tokens and the pool slots holding their KV."""

    tokens: np.ndarray  # int64 [n]
    slots: torch.Tensor  # int64 [n] on the host
    parent: Node | None = None
    children: dict[int, Node] = field(default_factory=dict)  # first token -> child
    lock: int = 0  # requests holding this node (or a descendant)
    last_access: int = 0
    tree: _Tree | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(eq=False)
class _Tree:
    key: Hashable
    root: Node
    retired: bool = False  # dropped: no lookups or inserts; nodes go as their locks end


@dataclass
class PrefixMatch:
    """The longest cached prefix of a query: its length, slots and last node (lock it)."""

    length: int
    slots: torch.Tensor  # int64 [length] on the host
    node: Node | None  # None when nothing matched
    evictable: int  # of the matched tokens, how many no request holds now


@dataclass
class InsertResult:
    """What inserting a request's tokens did: ``present`` leading tokens were already
    cached (the caller's own slots for them, past its shared prefix, are duplicates)."""

    present: int
    node: Node | None
    slots: torch.Tensor | None = None  # the cache's slots for every inserted token, after it


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading elements two int arrays share."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """Radix trees of cached token runs, one per adapter key, with locks and LRU eviction."""

    def __init__(self) -> None:
        self._trees: dict[Hashable, _Tree] = {}
        # Dropped keys stay refused: a request that began before the drop must not cache
        # its (stale) KV under the key afterwards. The engine moves on to a new key.
        self._retired: set[Hashable] = set()
        self._clock = 0
        self.num_tokens = 0  # tokens held by live and retired trees
        self.num_evictable = 0  # of those, tokens in nodes no request holds

    # ------------------------------------------------------------------ queries
    def adapter_keys(self) -> list[Hashable]:
        return list(self._trees)

    def tokens_of(self, key: Hashable) -> int:
        """Tokens cached under ``key``."""
        tree = self._trees.get(key)
        return 0 if tree is None else sum(len(n) for n in _walk(tree.root) if n is not tree.root)

    def match(self, key: Hashable, tokens: Sequence[int] | np.ndarray, *, touch: bool = True) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` under ``key``.

        An edge matched only in part is split, so the returned node ends exactly at the
        match (locking it then holds no token past it). ``touch``: count this as a use for
        LRU (a peek for planning passes False: it changes nothing, not even a split, and
        returns no slots)."""
        query = _as_array(tokens)
        tree = self._trees.get(key)
        if tree is None or tree.retired or query.shape[0] == 0:
            return PrefixMatch(0, torch.empty(0, dtype=torch.int64), None, 0)
        now = self._tick() if touch else 0
        node = tree.root
        pos = 0
        parts: list[torch.Tensor] = []
        evictable = 0
        while pos < query.shape[0]:
            child = node.children.get(int(query[pos]))
            if child is None:
                break
            n = common_prefix_len(child.tokens, query[pos:])
            if n < len(child):
                if not touch:  # count the partial edge without changing the tree
                    evictable += n if child.lock == 0 else 0
                    pos += n
                    break
                child = self._split(child, n)
            if touch:  # a peek reports lengths only: no slots gathered
                parts.append(child.slots)
            evictable += len(child) if child.lock == 0 else 0
            if touch:
                child.last_access = now
            node = child
            pos += n
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return PrefixMatch(pos, slots, None if node is tree.root else node, evictable)

    # ------------------------------------------------------------------ changes
    def insert(self, key: Hashable, tokens: Sequence[int] | np.ndarray, slots: torch.Tensor) -> InsertResult:
        """Cache ``tokens`` (whose KV is in ``slots``) under ``key``.

        Tokens already cached keep their existing slots: the result's ``present`` says how
        many leading tokens that was, and the caller frees its own slots for them (except
        those it shares with the tree). The new tail becomes one unlocked leaf. A retired
        key caches nothing (``present`` 0, ``node`` None): the caller frees everything."""
        query = _as_array(tokens)
        slots = slots.to(torch.int64).cpu()
        if slots.shape[0] != query.shape[0]:
            raise ValueError(f"{query.shape[0]} tokens but {slots.shape[0]} slots")
        if key in self._retired:
            return InsertResult(0, None)
        tree = self._trees.get(key)
        if tree is None:
            root = Node(np.empty(0, dtype=np.int64), torch.empty(0, dtype=torch.int64))
            tree = self._trees[key] = _Tree(key, root)
            tree.root.tree = tree
        now = self._tick()
        node = tree.root
        pos = 0
        parts: list[torch.Tensor] = []
        while pos < query.shape[0]:
            child = node.children.get(int(query[pos]))
            if child is None:
                break
            n = common_prefix_len(child.tokens, query[pos:])
            if n < len(child):
                child = self._split(child, n)
            child.last_access = now
            parts.append(child.slots)
            node = child
            pos += n
        present = pos
        if pos < query.shape[0]:
            leaf = Node(query[pos:].copy(), slots[pos:].clone(), parent=node, last_access=now, tree=tree)
            node.children[int(query[pos])] = leaf
            self.num_tokens += len(leaf)
            self.num_evictable += len(leaf)
            parts.append(leaf.slots)
            node = leaf
        cached = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return InsertResult(present, None if node is tree.root else node, cached)

    def exclusive_tokens(self, node: Node | None) -> int:
        """Tokens on ``node``'s path that only one request holds (freed to the evictable
        pool if that request let go)."""
        total = 0
        while node is not None and node.parent is not None and node.lock == 1:
            total += len(node)
            node = node.parent
        return total

    def lock(self, node: Node | None) -> None:
        """A request holds ``node`` and its ancestors: none of them may be evicted."""
        while node is not None and node.parent is not None:
            if node.lock == 0:
                self.num_evictable -= len(node)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node | None) -> torch.Tensor:
        """Undo one :meth:`lock`; returns slots to free (nodes of a retired tree that no
        request holds any more)."""
        top: Node | None = None
        while node is not None and node.parent is not None:
            if node.lock <= 0:
                raise RuntimeError("prefix cache: unlock without a matching lock")
            node.lock -= 1
            if node.lock == 0:
                self.num_evictable += len(node)
                top = node
            node = node.parent
        if top is not None and top.tree is not None and top.tree.retired:
            return self._remove_subtree(top)
        return torch.empty(0, dtype=torch.int64)

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least ``num_tokens`` tokens (or all that can be), least recently used
        unlocked leaves first; returns their slots."""
        if num_tokens <= 0 or self.num_evictable == 0:
            return torch.empty(0, dtype=torch.int64)
        heap = [(n.last_access, i, n) for i, n in enumerate(self._evictable_leaves())]
        heapq.heapify(heap)
        counter = len(heap)
        freed: list[torch.Tensor] = []
        total = 0
        while heap and total < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed.append(leaf.slots)
            total += len(leaf)
            self._detach(leaf)
            if parent is not None and parent.parent is not None and parent.is_leaf and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, counter, parent))
                counter += 1
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def drop(self, key: Hashable) -> torch.Tensor:
        """Forget everything cached under ``key`` (its adapter was unloaded or reloaded) and
        refuse the key from now on; returns the slots free now. Nodes still held by
        requests go when they release them."""
        self._retired.add(key)
        tree = self._trees.pop(key, None)
        if tree is None:
            return torch.empty(0, dtype=torch.int64)
        tree.retired = True
        freed: list[torch.Tensor] = []
        for child in list(tree.root.children.values()):
            if child.lock == 0:
                freed.append(self._remove_subtree(child))
            else:
                freed.append(self._prune_unlocked(child))
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def drop_where(self, predicate) -> torch.Tensor:
        """:meth:`drop` every key for which ``predicate(key)`` holds."""
        freed = [self.drop(key) for key in self.adapter_keys() if predicate(key)]
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def is_retired(self, key: Hashable) -> bool:
        return key in self._retired

    # ------------------------------------------------------------------ internals
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _split(self, node: Node, n: int) -> Node:
        """Cut ``node``'s edge after ``n`` tokens; returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < n < len(node)
        upper = Node(
            node.tokens[:n].copy(),
            node.slots[:n].clone(),
            parent=parent,
            lock=node.lock,
            last_access=node.last_access,
            tree=node.tree,
        )
        parent.children[int(upper.tokens[0])] = upper
        node.tokens = node.tokens[n:].copy()
        node.slots = node.slots[n:].clone()
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _evictable_leaves(self) -> list[Node]:
        return [
            n
            for tree in self._trees.values()
            for n in _walk(tree.root)
            if n is not tree.root and n.is_leaf and n.lock == 0
        ]

    def _detach(self, node: Node) -> None:
        """Remove an unlocked leaf."""
        parent = node.parent
        assert parent is not None and node.is_leaf and node.lock == 0
        del parent.children[int(node.tokens[0])]
        node.parent = None
        self.num_tokens -= len(node)
        self.num_evictable -= len(node)

    def _remove_subtree(self, top: Node) -> torch.Tensor:
        """Remove an unlocked node and everything below it; returns their slots."""
        nodes = list(_walk(top))
        if any(n.lock for n in nodes):
            raise RuntimeError("prefix cache: removing a subtree a request still holds")
        parent = top.parent
        if parent is not None and parent.children.get(int(top.tokens[0])) is top:
            del parent.children[int(top.tokens[0])]
        top.parent = None
        size = sum(len(n) for n in nodes)
        self.num_tokens -= size
        self.num_evictable -= size
        return torch.cat([n.slots for n in nodes])

    def _prune_unlocked(self, node: Node) -> torch.Tensor:
        """Below a held node: remove every unlocked subtree; returns their slots."""
        freed: list[torch.Tensor] = []
        for child in list(node.children.values()):
            if child.lock == 0:
                freed.append(self._remove_subtree(child))
            else:
                freed.append(self._prune_unlocked(child))
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)


def _walk(node: Node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


def _as_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)
