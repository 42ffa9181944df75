"""Target-verify of a draft tree: every node's logits equal those of a chain verify of its
root-to-node path, with adapters in the batch, on the eager path and on the graphs' padded
static path (SDPA or the paged kernel); after keeping the accepted path the cache is the chain's."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.runner.forward_batch import ForwardBatch, ForwardBatchError
from loraserve.runtime.speculative.tree import ancestor_closure

TOL = 1e-5
# Two trees of 7 nodes (node 0: the root), parents before children.
PARENTS = [[-1, 0, 0, 1, 1, 2, 4], [-1, 0, 1, 2, 0, 4, 3]]


def _tree(tokens_seed: int):
    parents = torch.tensor(PARENTS)
    depths = torch.zeros_like(parents)
    for b in range(2):
        for i in range(1, parents.shape[1]):
            depths[b, i] = depths[b, parents[b, i]] + 1
    ancestors = ancestor_closure(parents, int(depths.max()))
    gen = torch.Generator().manual_seed(tokens_seed)
    tokens = torch.randint(3, 500, parents.shape, generator=gen)
    return tokens, parents, depths, ancestors


def _path(parents, b, n):
    out = [n]
    while parents[b, out[-1]] > 0:
        out.append(int(parents[b, out[-1]]))
    return out[::-1]  # node ids from depth 1 to n


@pytest.fixture
def runners(static_graph_pair):
    return static_graph_pair(["attn-r8", "all-r16"], max_bs=4)


@pytest.mark.parametrize("path", ["eager", "static", "static-paged"])
def test_each_node_sees_exactly_its_path(runners, path):
    """``static-paged``: the tree runs through the Triton paged kernel (interpreted on the
    CPU); the chains it is compared with run on SDPA."""
    eager, graphed = runners
    runner = eager if path == "eager" else graphed
    if path == "static-paged":
        graphed.attention_backend = "triton"
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen) for n in (6, 11)]
    names = ["all-r16", None]
    tokens, parents, depths, ancestors = _tree(1)
    runner.forward(ForwardBatch(ForwardMode.EXTEND, ["t0", "t1"], torch.cat(prompts), extend_lens=[6, 11], lora_names=names))
    out = runner.forward(
        ForwardBatch(
            ForwardMode.TARGET_VERIFY, ["t0", "t1"], tokens.reshape(-1), num_draft_tokens=7, lora_names=names,
            tree_depths=depths, tree_ancestors=ancestors,
        )
    ).logits.view(2, 7, -1)  # fmt: skip
    for b in range(2):
        for n in range(7):
            rid = f"c{b}-{n}"
            ids = [int(tokens[b, 0]), *[int(tokens[b, m]) for m in _path(parents, b, n)][:int(depths[b, n])]]
            eager.forward(ForwardBatch(ForwardMode.EXTEND, [rid], prompts[b], extend_lens=[len(prompts[b])], lora_names=[names[b]]))
            chain = eager.forward(
                ForwardBatch(ForwardMode.TARGET_VERIFY, [rid], torch.tensor(ids), num_draft_tokens=len(ids), lora_names=[names[b]])
            ).logits  # fmt: skip
            torch.testing.assert_close(out[b, n], chain[-1], atol=TOL, rtol=0, msg=f"request {b} node {n}")
            eager.kv.free(rid)
    # Keep request 0's path to node 6 (0 -> 1 -> 4 -> 6): its cache is then the chain's.
    keep = [0, *_path(parents, 0, 6)]
    runner.kv.keep([("t0", 6, keep), ("t1", 11, [0])])
    nxt = torch.tensor([42, 43])
    after = runner.forward(ForwardBatch(ForwardMode.DECODE, ["t0", "t1"], nxt, lora_names=names)).logits
    ids = [int(tokens[0, m]) for m in keep]
    eager.forward(ForwardBatch(ForwardMode.EXTEND, ["ref"], torch.cat([prompts[0], torch.tensor(ids), nxt[:1]]),
                               extend_lens=[6 + len(ids) + 1], lora_names=["all-r16"]))  # fmt: skip
    eager.forward(ForwardBatch(ForwardMode.EXTEND, ["ref1"], torch.cat([prompts[1], tokens[1, :1], nxt[1:]]),
                               extend_lens=[11 + 2], lora_names=[None]))  # fmt: skip
    want = eager.forward(ForwardBatch(ForwardMode.DECODE, ["ref", "ref1"], torch.tensor([7, 7]), lora_names=names))
    got = runner.forward(ForwardBatch(ForwardMode.DECODE, ["t0", "t1"], torch.tensor([7, 7]), lora_names=names))
    torch.testing.assert_close(got.logits, want.logits, atol=TOL, rtol=0)
    assert after.shape == (2, want.logits.shape[1])


def test_malformed_tree_refused(runners):
    """A malformed tree is refused naming the field."""
    eager, _ = runners
    tokens, _, depths, ancestors = _tree(2)
    with pytest.raises(ForwardBatchError, match="tree_depths must be"):
        eager.forward(
            ForwardBatch(ForwardMode.TARGET_VERIFY, ["a", "b"], tokens.reshape(-1), num_draft_tokens=7,
                         tree_depths=depths[:, :5], tree_ancestors=ancestors)
        )
    with pytest.raises(ForwardBatchError, match="only verified in TARGET_VERIFY"):
        eager.forward(ForwardBatch(ForwardMode.DECODE, ["a", "b"], tokens[:, 0], tree_depths=depths, tree_ancestors=ancestors))
    assert eager.kv.seq_len("a") == 0  # nothing was allocated
