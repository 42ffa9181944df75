"""Tree drafts: growth and selection against a brute-force reference, ancestor masks, and
greedy tree acceptance against decoding one token at a time."""

from __future__ import annotations

import itertools

import pytest
import torch

from loraserve.runtime.speculative.tree import (
    DraftTree,
    ancestor_closure,
    expand_tree,
    greedy_tree_accept,
    select_tree,
    tree_attention_mask,
)

VOCAB = 11


def _random_parents(gen, bs: int, n: int) -> torch.Tensor:
    parents = torch.full((bs, n), -1, dtype=torch.long)
    for b in range(bs):
        for i in range(1, n):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
    return parents


def _depths(parents: torch.Tensor) -> torch.Tensor:
    depths = torch.zeros_like(parents)
    for b, i in itertools.product(range(parents.shape[0]), range(1, parents.shape[1])):
        depths[b, i] = depths[b, parents[b, i]] + 1
    return depths


def test_ancestor_closure():
    """Ancestor closure matches walking up the parents."""
    gen = torch.Generator().manual_seed(0)
    parents = _random_parents(gen, 4, 17)
    anc = ancestor_closure(parents, int(_depths(parents).max()))
    for b, n in itertools.product(range(4), range(17)):
        want = {n}
        node = n
        while parents[b, node] >= 0:
            node = int(parents[b, node])
            want.add(node)
        assert set(anc[b, n].nonzero().flatten().tolist()) == want


def _next_token(prefix: tuple[int, ...]) -> int:
    """The toy target's greedy choice after ``prefix`` (root token first)."""
    return (sum((i + 3) * t for i, t in enumerate(prefix)) * 7 + len(prefix)) % VOCAB


def _tree_from_paths(paths_per_request, max_depth):
    """A DraftTree holding, per request, the nodes of the given token paths (root token 0)."""
    bs = len(paths_per_request)
    nodes = [[(), *sorted({p[:i] for p in paths for i in range(1, len(p) + 1)}, key=lambda x: (len(x), x))]
             for paths in paths_per_request]  # fmt: skip
    n = max(len(x) for x in nodes)
    tokens = torch.full((bs, n), -1, dtype=torch.long)
    parents = torch.full((bs, n), -1, dtype=torch.long)
    for b, seqs in enumerate(nodes):
        seqs = seqs + [seqs[-1] + (VOCAB + j,) for j in range(n - len(seqs))]  # filler leaves
        for i, seq in enumerate(seqs):
            if i:
                tokens[b, i] = seq[-1]
                parents[b, i] = seqs.index(seq[:-1]) if seq[:-1] in seqs else 0
    depths = _depths(parents)
    return DraftTree(tokens, parents, depths, ancestor_closure(parents, max_depth), max_depth), nodes


def test_greedy_tree_accept_stepwise():
    """With target logits that pick ``_next_token`` of each node's path, the accepted tokens,
    their count and the path are exactly what one-at-a-time greedy decoding produces."""
    gen = torch.Generator().manual_seed(1)
    root = (5,)
    requests = []
    for _ in range(6):
        paths = []
        for _ in range(4):
            seq, prefix = [], root
            for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
                # follow the target for a while, then diverge now and then
                t = _next_token(prefix) if torch.rand(1, generator=gen) < 0.7 else int(torch.randint(0, VOCAB, (1,), generator=gen))
                seq.append(t)
                prefix = (*prefix, t)
            paths.append(tuple(seq))
        requests.append(paths)
    wrong = (_next_token(root) + 1) % VOCAB
    requests.append([(wrong, 1), (wrong, 2, 3)])  # the target rejects the first token
    tree, _nodes = _tree_from_paths(requests, max_depth=4)
    bs, n = tree.tokens.shape
    logits = torch.full((bs, n, VOCAB + 8), -5.0)
    for b in range(bs):
        for i in range(n):
            path = root + tuple(int(t) for t in tree.tokens[b][tree.ancestors[b, i]][1:])
            logits[b, i, _next_token(path)] = 5.0
    acc = greedy_tree_accept(tree, logits)
    lens, rows = acc.host()
    paths = acc.host_path()
    for b in range(bs):
        # decode greedily while the tree offers the target's token
        prefix, node, out, want_path = root, 0, [], [0]
        while True:
            t = _next_token(prefix)
            out.append(t)
            children = [c for c in range(1, n) if tree.parents[b, c] == node and tree.tokens[b, c] == t]
            if not children:
                break
            node = children[0]
            want_path.append(node)
            prefix = (*prefix, t)
        assert lens[b] == len(out) - 1
        assert rows[b][: lens[b] + 1] == out and all(x == -1 for x in rows[b][lens[b] + 1 :])
        assert paths[b][: len(want_path)] == want_path and all(x == -1 for x in paths[b][len(want_path) :])
    assert max(lens) >= 2 and min(lens) == 0  # the case exercises deep and empty paths


class _ToyDraft:
    """A deterministic draft: output features and log-probabilities from the parent's
    feature, the node's token and the tokens of the draft entries the node sees."""

    def __init__(self, gen, hidden: int, vocab: int, k: int, steps: int):
        self.emb = torch.randn(vocab, hidden, generator=gen)
        self.mix = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
        self.head = torch.randn(vocab, hidden, generator=gen)
        self.k = k
        self.entries = (steps - 1) * k

    def out(self, feat, token, seen_sum):
        h = torch.tanh(feat @ self.mix + self.emb[token] + 0.1 * seen_sum)
        return h, torch.log_softmax(h @ self.head.T, dim=-1)

    def batched_step(self, bs):
        entry_tokens = torch.zeros(bs, self.entries)

        def step(tokens, feats, d, visible):
            own = torch.nn.functional.one_hot((d - 1) * self.k + torch.arange(self.k), self.entries).bool()
            entry_tokens[:, (d - 1) * self.k : d * self.k] = tokens.float()
            seen = ((visible | own[None]) * entry_tokens[:, None, :]).sum(-1, keepdim=True)
            return self.out(feats, tokens, seen)

        return step


def _brute_force(draft: _ToyDraft, first_lp, tail, k, steps, num_nodes):
    """EAGLE-2 growth, one request, plain Python: returns the chosen token paths."""
    pen = 1e-4
    top = first_lp.topk(k)
    frontier = [(float(s) - pen, (int(t),), tail) for s, t in zip(top.values, top.indices, strict=True)]
    cands = [(s, p) for s, p, _ in frontier]
    for _ in range(1, steps):
        children = []
        for score, path, feat in frontier:
            h, lp = draft.out(feat, torch.tensor(path[-1]), torch.tensor([float(sum(path))]))
            best = lp.topk(k)
            children += [(score + float(s) - pen, (*path, int(t)), h) for s, t in zip(best.values, best.indices, strict=True)]
        cands += [(s, p) for s, p, _ in children]
        frontier = sorted(children, key=lambda c: -c[0])[:k]
    return {p for _, p in sorted(cands, key=lambda c: -c[0])[: num_nodes - 1]}


@pytest.mark.parametrize(("k", "steps", "num_nodes"), [(2, 3, 6), (3, 4, 12), (4, 2, 9), (2, 5, 10)])
def test_tree_growth_brute_force(k, steps, num_nodes):
    """Tree growth and selection match a brute force reference."""
    gen = torch.Generator().manual_seed(k * 10 + steps)
    bs, hidden, vocab = 3, 8, 23
    draft = _ToyDraft(gen, hidden, vocab, k, steps)
    tails = torch.randn(bs, hidden, generator=gen)
    first = torch.log_softmax(tails @ draft.head.T, dim=-1)
    tree = expand_tree(first, tails, draft.batched_step(bs), top_k=k, num_steps=steps, num_nodes=num_nodes)
    assert tree.tokens.shape == (bs, num_nodes) and tree.max_depth == steps
    for b in range(bs):
        parents, depths = tree.parents[b].tolist(), tree.depths[b].tolist()
        assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, num_nodes))  # parents first
        assert all(depths[i] == depths[parents[i]] + 1 for i in range(1, num_nodes))
        got = set()
        for i in range(1, num_nodes):
            got.add(tuple(int(t) for t in tree.tokens[b][tree.ancestors[b, i]][1:]))
        assert got == _brute_force(draft, first[b], tails[b], k, steps, num_nodes)


def test_select_tree_refuses_an_impossible_size():
    t = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"needs 1\.\.3 candidates"):
        select_tree(t, torch.zeros(1, 3), t - 1, t + 1, num_nodes=5, max_depth=1)


def test_tree_attention_mask():
    """Tree attention mask sees the prefix and the marked tail only."""
    prefix = torch.tensor([3, 0])
    visible = torch.tensor([[[1, 0, 0], [1, 1, 0]], [[0, 1, 0], [0, 0, 1]]], dtype=torch.bool)
    mask = tree_attention_mask(prefix, visible, max_ctx=8, groups=2)
    assert mask.shape == (2, 1, 4, 8)
    assert mask[0, 0, 0].tolist() == [True] * 3 + [True, False, False, False, False]
    assert mask[0, 0, 1].tolist() == [True] * 3 + [True, True, False, False, False]
    assert torch.equal(mask[0, 0, :2], mask[0, 0, 2:])  # both query heads of the group
    assert mask[1, 0, 0].tolist() == [False, True] + [False] * 6
    assert mask[1, 0, 1].tolist() == [False, False, True] + [False] * 5
