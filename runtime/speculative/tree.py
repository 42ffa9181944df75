"""Tree drafts: expansion, selection, attention masks and greedy acceptance.

A tree draft (``top_k`` K > 1) offers the target several continuations at once. The
drafter grows it EAGLE-2 style: the K most likely first tokens form the frontier; each
of ``num_steps - 1`` steps runs the draft on the frontier, takes the K best children of
every frontier node (K² candidates, scored by the sum of their log-probabilities along
the path) and keeps the K best as the next frontier. Of all candidates, the
``num_draft_tokens - 1`` best by score become the tree's nodes, behind node 0, the
request's last committed token (the root). Scores fall strictly along a path, so the
chosen set holds every chosen node's parent; ordering nodes by candidate id puts every
parent before its children.

The target verifies all nodes in one forward: node ``n`` sits at position ``prefix +
depth[n]`` and attends to the request's cache and to its own ancestors among the nodes
(``ancestors[n, m]``). Greedy acceptance walks the tree: a node is accepted when its token
is the target's argmax at its parent and its parent is accepted. Siblings carry distinct
tokens, so the accepted nodes form one path; its tokens and the target's token at its end
are what decoding without speculation would have produced, token for token.

Everything here is tensor code on the device with static shapes: it runs inside the
draft's and the target's CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..model.layers.attention import tree_attention_mask  # noqa: F401  (the tree verify's mask, for the drafters)
from .acceptance import Acceptance

# Subtracted per level so a child's score is strictly below its parent's even when the
# draft gives the child probability 1: the best-scored set is then closed under parents.
_DEPTH_PENALTY = 1e-4


class TreeShape(NamedTuple):
    """How a tree grows: ``top_k`` children per expanded node, ``num_steps`` levels,
    ``num_nodes`` verified per request (the root included)."""

    top_k: int
    num_steps: int
    num_nodes: int

    @property
    def entries(self) -> int:
        """Draft cache entries the growth writes per request (the frontier of each step after the first)."""
        return (self.num_steps - 1) * self.top_k


@dataclass
class DraftTree:
    """One tree per request, ``N`` nodes each; node 0 is the root (the last committed token).

    ``tokens``: int64 ``[bs, N]`` (node 0's entry is not a draft and is replaced by the
    request's last token before verify); ``parents``: int64 ``[bs, N]``, -1 for the root;
    ``depths``: int64 ``[bs, N]``; ``ancestors``: bool ``[bs, N, N]``, ``ancestors[b, n, m]``
    when node m lies on the path from the root to node n (n itself included).
    ``max_depth``: the deepest a node of this shape of tree can be (the steps it grew over).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.parents, self.depths, self.ancestors

    def select(self, rows: torch.Tensor) -> DraftTree:
        """The trees of requests ``rows`` (a device index)."""
        return DraftTree(*(t.index_select(0, rows) for t in self.tensors()), self.max_depth)

    def with_root(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Verify input ids ``[bs, N]``: each request's last token, then the drafts. A node
        without a draft (-1, never accepted) goes in as token 0; its result is never used."""
        return torch.cat([last_tokens.reshape(-1, 1).to(self.tokens), self.tokens[:, 1:].clamp_min(0)], dim=1)


def ancestor_closure(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[bs, N, N]`` ancestor-or-self masks from parent indices (-1: root), by pointer
    doubling: each round adds the ancestors of every node's farthest known ancestor."""
    bs, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(bs, n, n)
    up = parents.clamp_min(0)
    anc = eye | torch.nn.functional.one_hot(up, n).bool() & (parents >= 0)[..., None]
    hop = up
    reach = 1
    while reach < max_depth:
        # anc[n] |= anc[hop[n]] where hop[n] is the ancestor ``reach`` levels up
        anc = anc | anc.gather(1, hop[..., None].expand(bs, n, n))
        hop = hop.gather(1, hop)
        reach *= 2
    return anc


def select_tree(
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_depths: torch.Tensor,
    num_nodes: int,
    max_depth: int,
) -> DraftTree:
    """The ``num_nodes - 1`` best candidates (``[bs, C]`` each; ``cand_parents`` are
    candidate ids, -1 for the root) as a :class:`DraftTree` in candidate-id order."""
    bs, count = cand_tokens.shape
    keep = num_nodes - 1
    if not 1 <= keep <= count:
        raise ValueError(f"a tree of {num_nodes} nodes needs 1..{count} candidates, got {keep}")
    chosen = cand_scores.topk(keep, dim=1).indices.sort(dim=1).values  # [bs, keep], parents first
    device = cand_tokens.device
    # candidate id -> node index (1..keep); the root (-1) -> 0
    node_of = torch.zeros(bs, count + 1, dtype=torch.long, device=device)
    node_of.scatter_(1, chosen + 1, torch.arange(1, keep + 1, device=device).expand(bs, keep))
    parents = node_of.gather(1, cand_parents.gather(1, chosen) + 1)
    root = torch.full((bs, 1), -1, dtype=torch.long, device=device)
    parents = torch.cat([root, parents], dim=1)
    tokens = torch.cat([root, cand_tokens.gather(1, chosen)], dim=1)
    depths = torch.cat([torch.zeros_like(root), cand_depths.gather(1, chosen)], dim=1)
    return DraftTree(tokens, parents, depths, ancestor_closure(parents, max_depth), max_depth)


StepFn = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``(tokens [bs, K], features [bs, K, H], step, visible [bs, K, (steps - 1) * K]) ->
(outputs [bs, K, H], log-probabilities [bs, K, V])``: one draft forward of the frontier at
step ``step`` (1-based), each node seeing the draft entries marked in ``visible`` (the
entries of its ancestors; its own, ``(step - 1) * K + i``, is added by the caller)."""


def expand_tree(
    first_logprobs: torch.Tensor,
    tails: torch.Tensor,
    step: StepFn,
    *,
    top_k: int,
    num_steps: int,
    num_nodes: int,
) -> DraftTree:
    """Grow and select a tree from each request's first distribution ``[bs, V]`` (log
    space) and the draft output it came from (``tails`` ``[bs, H]``)."""
    bs = first_logprobs.shape[0]
    device = first_logprobs.device
    k = top_k
    entries = (num_steps - 1) * k
    scores, tokens = first_logprobs.topk(k, dim=1)  # frontier at depth 1
    scores = scores - _DEPTH_PENALTY
    feats = tails[:, None, :].expand(bs, k, tails.shape[-1])
    ids = torch.arange(k, device=device).expand(bs, k)  # candidate ids of the frontier
    visible = torch.zeros(bs, k, entries, dtype=torch.bool, device=device)
    cand_tokens, cand_scores = [tokens], [scores]
    cand_parents = [torch.full((bs, k), -1, dtype=torch.long, device=device)]
    cand_depths = [torch.ones(bs, k, dtype=torch.long, device=device)]
    next_id = k
    for d in range(1, num_steps):
        outputs, logprobs = step(tokens, feats, d, visible)
        child_scores, child_tokens = logprobs.topk(k, dim=2)  # [bs, K (parent), K]
        child_scores = scores[:, :, None] + child_scores - _DEPTH_PENALTY
        flat_scores = child_scores.reshape(bs, k * k)
        cand_tokens.append(child_tokens.reshape(bs, k * k))
        cand_scores.append(flat_scores)
        cand_parents.append(ids[:, :, None].expand(bs, k, k).reshape(bs, k * k))
        cand_depths.append(torch.full((bs, k * k), d + 1, dtype=torch.long, device=device))
        if d == num_steps - 1:
            break
        # The next frontier: the K best children; each inherits its parent's visible
        # entries plus the parent's own (written at this step).
        scores, pick = flat_scores.topk(k, dim=1)
        parent = pick // k
        tokens = child_tokens.reshape(bs, k * k).gather(1, pick)
        feats = outputs.gather(1, parent[..., None].expand(bs, k, outputs.shape[-1]))
        own = torch.nn.functional.one_hot((d - 1) * k + parent, entries).bool()
        visible = visible.gather(1, parent[..., None].expand(bs, k, entries)) | own
        ids = next_id + pick
        next_id += k * k
    return select_tree(
        torch.cat(cand_tokens, 1),
        torch.cat(cand_scores, 1),
        torch.cat(cand_parents, 1),
        torch.cat(cand_depths, 1),
        num_nodes,
        num_steps,
    )


def greedy_tree_accept(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Accept the deepest tree path whose every token is the target's argmax at its parent,
    plus the target's token at its end. ``target_logits`` ``[bs, N, V]`` (row n: the
    target's distribution after node n). Returns an :class:`Acceptance` whose ``tokens``
    row holds the path's drafts then the bonus token (``[bs, depth + 1]``, -1 after) and
    whose ``path`` row holds the accepted nodes from the root (-1 after)."""
    bs, n, _ = target_logits.shape
    if tree.tokens.shape != (bs, n):
        raise ValueError(f"target logits {tuple(target_logits.shape)} do not fit a tree of {tuple(tree.tokens.shape)}")
    argmax = target_logits.argmax(dim=-1)  # [bs, N]
    at_parent = argmax.gather(1, tree.parents.clamp_min(0))
    match = (tree.tokens == at_parent) | (tree.parents < 0)
    accepted = ~(tree.ancestors & ~match[:, None, :]).any(dim=2)  # every ancestor matched
    depth = torch.where(accepted, tree.depths, -1)
    best = depth.argmax(dim=1)  # the unique deepest accepted node
    accept_lens = depth.gather(1, best[:, None]).squeeze(1)
    levels = torch.arange(tree.max_depth + 1, device=argmax.device)
    on_path = tree.ancestors.gather(1, best[:, None, None].expand(bs, 1, n)).squeeze(1)  # [bs, N]
    # the path's node at each level: among its nodes, the one of that depth
    at_level = on_path[:, None, :] & (tree.depths[:, None, :] == levels[None, :, None])  # [bs, W, N]
    path = torch.where(at_level.any(2), at_level.long().argmax(2), -1)
    # output i < accept_len is the token of the path's node at level i + 1; then the bonus
    following = tree.tokens.gather(1, path[:, 1:].clamp_min(0))
    following = torch.cat([following, torch.full_like(path[:, :1], -1)], dim=1)
    tokens = torch.where(levels[None, :] < accept_lens[:, None], following, -1)
    bonus = argmax.gather(1, best[:, None])
    tokens = tokens.scatter(1, accept_lens[:, None], bonus)
    return Acceptance(accept_lens=accept_lens, tokens=tokens, path=path)
