"""The EAGLE head's single-row draft steps replayed from padded static buffers / CUDA graphs.

On the CPU the graph runner executes its static, padded path eagerly (``use_graphs=False``):
everything but the capture itself, against the eager ragged forward. On a GPU the same
oracle runs with real graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraserve.runtime.speculative.eagle.graphs import EagleGraphRunner
from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner

from .conftest import eagle_runner, tiny_target
from .test_greedy_oracle import CASES, _check_same, _requests

DRAFTS = ("eagle", "eagle3", "eagle3-d2t")


def _pair(spec_assets, draft: str, device: str, max_bs: int, use_graphs: bool, attention: str = "sdpa"):
    """Two runners of one draft: the first steps through the graph runner (on ``attention``),
    the second eagerly (on SDPA)."""
    path = {"eagle": spec_assets.eagle, "eagle3": spec_assets.eagle3, "eagle3-d2t": spec_assets.eagle3_d2t}[
        draft
    ]
    arch, target = tiny_target(spec_assets, device)

    def make(attention: str = "sdpa") -> EagleDraftRunner:
        return eagle_runner(path, arch, target, device, attention_backend=attention)

    graphed, eager = make(attention), make()
    graphed.graphs = EagleGraphRunner(graphed, max_bs=max_bs, use_graphs=use_graphs)
    return graphed, eager


def _check_steps(graphed: EagleDraftRunner, eager: EagleDraftRunner, device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    feature = graphed.model.feature_size
    lengths = {"a": 9, "b": 4, "c": 30, "d": 2, "e": 7}
    rids = list(lengths)
    ids = torch.cat([torch.randint(3, 500, (n,), generator=gen) for n in lengths.values()]).to(device)
    feats = torch.randn(sum(lengths.values()), feature, generator=gen).to(device)
    outs = {}
    for name, runner in (("graphed", graphed), ("eager", eager)):  # the same ragged history
        outs[name] = runner.forward(rids, ids, feats, list(lengths.values()))
    torch.testing.assert_close(outs["graphed"], outs["eager"], rtol=0, atol=0)
    ends = torch.tensor(list(lengths.values())).cumsum(0) - 1
    hidden = {name: out[ends.to(out.device)] for name, out in outs.items()}
    # 3 requests padded to a bucket of 4, then all 5 (> max_bs: eager), then 2 again.
    for step, batch in enumerate((["a", "b", "c"], rids, ["c", "e"], ["a", "b", "c"])):
        rows = torch.tensor([rids.index(r) for r in batch], device=device)
        tokens = torch.randint(3, 500, (len(batch),), generator=gen).to(device)
        got = graphed.step(batch, tokens, hidden["graphed"][rows])
        want = eager.step(batch, tokens, hidden["eager"][rows])
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5, msg=f"features, step {step}")
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5, msg=f"logits, step {step}")
        for name, (h, _) in (("graphed", got), ("eager", want)):
            hidden[name] = hidden[name].index_copy(0, rows, h)
    # The verified positions of 3 requests as one uniform k-row forward, then truncated.
    k, batch, keep = 4, ["a", "c", "e"], [1, 4, 2]
    tokens = torch.randint(3, 500, (len(batch) * k,), generator=gen).to(device)
    target_feats = torch.randn(len(batch) * k, feature, generator=gen).to(device)
    got = graphed.forward_uniform(batch, tokens, target_feats, k)
    want = eager.forward(batch, tokens, target_feats, [k] * len(batch), from_target=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for runner in (graphed, eager):
        for r, n in zip(batch, keep, strict=True):
            runner.kv.truncate(r, k - n)
    for r in rids:
        assert graphed.kv.seq_len(r) == eager.kv.seq_len(r)
    # Same cache contents everywhere but the padding slot 0 that padded rows write.
    for buffers in ("k_buffers", "v_buffers"):
        a, b = getattr(graphed.kv, buffers)[0], getattr(eager.kv, buffers)[0]
        torch.testing.assert_close(a[1:], b[1:], rtol=1e-5, atol=1e-5)


def _check_chain(graphed: EagleDraftRunner, eager: EagleDraftRunner, device: str) -> None:
    """A greedy chain of draft steps in one replay against the same steps one at a time."""
    gen = torch.Generator().manual_seed(6)
    feature = graphed.model.feature_size
    lengths = {"a": 9, "b": 4, "c": 30, "d": 61}  # "d" crosses a context bucket mid-chain
    rids = list(lengths)
    ids = torch.cat([torch.randint(3, 500, (n,), generator=gen) for n in lengths.values()]).to(device)
    feats = torch.randn(sum(lengths.values()), feature, generator=gen).to(device)
    ends = torch.tensor(list(lengths.values())).cumsum(0) - 1
    tails = {}
    for name, runner in (("graphed", graphed), ("eager", eager)):
        tails[name] = runner.forward(rids, ids, feats, list(lengths.values()))[ends.to(device)]
    steps = 4
    for batch in (["a", "b", "c"], ["d"], rids):
        rows = torch.tensor([rids.index(r) for r in batch], device=device)
        chained = graphed.draft_chain(batch, tails["graphed"][rows], steps + 1)
        hidden = tails["eager"][rows]
        tokens = eager.compute_logits(hidden).argmax(-1)
        want = [tokens]
        for _ in range(steps):
            hidden, logits = eager.step(batch, tokens, hidden)
            tokens = logits.argmax(-1)
            want.append(tokens)
        assert torch.equal(chained, torch.stack(want, 1)), batch
        # the chain wrote the same draft entries: the next forward over them agrees
        probe_ids = torch.randint(3, 500, (len(batch),), generator=gen).to(device)
        probe = torch.randn(len(batch), feature, generator=gen).to(device)
        got = graphed.forward(batch, probe_ids, probe, [1] * len(batch))
        ref = eager.forward(batch, probe_ids, probe, [1] * len(batch))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for runner in (graphed, eager):
            for r in batch:
                runner.kv.truncate(r, steps + 1)
        assert [graphed.kv.seq_len(r) for r in rids] == [eager.kv.seq_len(r) for r in rids]


def _check_feed_chain(graphed: EagleDraftRunner, eager: EagleDraftRunner, device: str) -> None:
    """Feeding k verified pairs and the next greedy proposal as one replay, with the accepted
    counts on the device, against the same work done eagerly with the counts on the host:
    feed, truncate the rejected entries, argmax of the tail, single steps."""
    gen = torch.Generator().manual_seed(7)
    feature = graphed.model.feature_size
    lengths = {"a": 9, "b": 4, "c": 30, "d": 58}  # "d" needs 64 columns, then 128
    rids = list(lengths)
    ids = torch.cat([torch.randint(3, 500, (n,), generator=gen) for n in lengths.values()]).to(device)
    feats = torch.randn(sum(lengths.values()), feature, generator=gen).to(device)
    for runner in (graphed, eager):
        runner.forward(rids, ids, feats, list(lengths.values()))
    k, num_tokens = 4, 3
    # every accepted count 0..k-1 appears, in batches the graphs pad (3 -> 4) and hold exactly
    for batch, accepted in ((["a", "b", "c"], [0, 3, 1]), (rids, [2, 0, 3, 1]), (["d"], [3])):
        bs = len(batch)
        tokens = torch.randint(3, 500, (bs * k,), generator=gen).to(device)
        target_feats = torch.randn(bs * k, feature, generator=gen).to(device)
        accept = torch.tensor(accepted, device=device)
        before = [graphed.kv.seq_len(r) for r in batch]
        drafts, tails = graphed.feed_chain(batch, tokens, target_feats, accept, k, num_tokens)
        assert [graphed.kv.seq_len(r) for r in batch] == [n + k + num_tokens - 1 for n in before]

        out = eager.forward(batch, tokens, target_feats, [k] * bs, from_target=True).view(bs, k, -1)
        for r, a in zip(batch, accepted, strict=True):
            eager.kv.truncate(r, k - (a + 1))
        hidden = out[torch.arange(bs, device=device), accept]
        torch.testing.assert_close(tails, hidden, rtol=1e-5, atol=1e-5)
        step_tokens = eager.compute_logits(hidden).argmax(-1)
        want = [step_tokens]
        for _ in range(num_tokens - 1):
            hidden, logits = eager.step(batch, step_tokens, hidden)
            step_tokens = logits.argmax(-1)
            want.append(step_tokens)
        assert torch.equal(drafts, torch.stack(want, 1)), (batch, accepted)

        # The kept pairs and the chain's entries sit at the same positions in both caches:
        # drop the graphed cache's extra rows and a forward over the rest agrees.
        for r, a in zip(batch, accepted, strict=True):
            graphed.kv.truncate(r, k - (a + 1))
        assert [graphed.kv.seq_len(r) for r in rids] == [eager.kv.seq_len(r) for r in rids]
        probe_ids = torch.randint(3, 500, (bs,), generator=gen).to(device)
        probe = torch.randn(bs, feature, generator=gen).to(device)
        got = graphed.forward(batch, probe_ids, probe, [1] * bs)
        ref = eager.forward(batch, probe_ids, probe, [1] * bs)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        for runner in (graphed, eager):  # back to the committed pairs, as the drafter does
            for r in batch:
                runner.kv.truncate(r, num_tokens)


@pytest.mark.parametrize("draft", DRAFTS)
def test_static_feed_chain_equals_eager(spec_assets, draft):
    """Static feed chain equals eager feed then steps."""
    graphed, eager = _pair(spec_assets, draft, "cpu", max_bs=4, use_graphs=False)
    eager.graphs = None
    _check_feed_chain(graphed, eager, "cpu")
    assert sorted(graphed.graphs._feed_chains) == [(4, 2, 1, 128), (4, 2, 4, 64)]


@pytest.mark.parametrize("draft", DRAFTS)
def test_static_chain_equals_single_steps(spec_assets, draft):
    graphed, eager = _pair(spec_assets, draft, "cpu", max_bs=4, use_graphs=False)
    eager.graphs = None
    _check_chain(graphed, eager, "cpu")
    assert sorted(graphed.graphs._chains) == [(4, 1, 128), (4, 4, 64), (4, 4, 128)]


@pytest.mark.parametrize("draft", DRAFTS)
def test_static_padded_steps_equal_eager(spec_assets, draft):
    graphed, eager = _pair(spec_assets, draft, "cpu", max_bs=4, use_graphs=False)
    _check_steps(graphed, eager, "cpu")
    shapes = sorted(
        (key.width, key.from_target, key.batch_size, key.context) for key in graphed.graphs._graphs
    )
    assert shapes == [(1, False, 2, 64), (1, False, 4, 64), (4, True, 4, 64)]


@pytest.mark.parametrize(
    "ahead,case",
    [(True, "eagle"), (False, "eagle"), (True, "eagle3-d2t")],
    ids=["propose-ahead", "feed-then-propose", "propose-ahead-d2t"],
)
def test_static_drafting_lossless(make_spec_config, engine_run, spec_assets, ahead, case):
    """EAGLE through the engine with every draft forward on the padded static path: with the
    next proposal queued behind each verify (the greedy default), and with the feed and the
    proposal as separate forwards (what sampled batches and batches near the limits take);
    and an EAGLE3 draft with its own reduced-vocabulary head (the chain maps its argmax to
    target ids)."""
    requests = _requests(count=10, seed=4)
    expected = engine_run(make_spec_config(), requests)
    algorithm, draft = CASES[case]
    runners = []

    def use_static_graphs(decoder):
        runner = decoder.drafter.runner
        runner.graphs = EagleGraphRunner(runner, max_bs=4, use_graphs=False)
        runners.append(runner)
        if not ahead:
            decoder.drafter._can_propose_ahead = lambda requests, width: False

    run = engine_run(
        make_spec_config(algorithm, draft, max_running_requests=6), requests, decoder_hook=use_static_graphs
    )
    _check_same(run, requests, {rid: expected.outputs[rid].tokens for rid, *_ in requests})
    graphs = runners[0].graphs
    assert graphs._chains  # proposals after a prefill (and without propose-ahead) ran as chains
    if ahead:
        assert graphs._feed_chains and not graphs._graphs  # every verify fed and proposed at once
    else:
        assert graphs._graphs and not graphs._feed_chains  # uniform feeds, then chains


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the paged kernel needs CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
@pytest.mark.parametrize("draft", ("eagle", "eagle3"))
def test_paged_chains_equal_sdpa(spec_assets, draft):
    """The chain and the feed-chain with the draft's attention on the Triton paged kernel
    give the tokens and cache entries of eager SDPA steps."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for check in (_check_chain, _check_feed_chain):
        graphed, eager = _pair(spec_assets, draft, device, max_bs=4, use_graphs=False, attention="triton")
        eager.graphs = None
        check(graphed, eager, device)


def test_graphs_are_only_built_on_cuda(spec_assets):
    with pytest.raises(ValueError, match="use_graphs=False"):
        _pair(spec_assets, "eagle", "cpu", max_bs=4, use_graphs=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("draft", DRAFTS)
def test_captured_steps_equal_eager_on_gpu(spec_assets, draft):
    graphed, eager = _pair(spec_assets, draft, "cuda", max_bs=4, use_graphs=True)
    _check_steps(graphed, eager, "cuda")
    assert graphed.graphs.num_graphs == 3 and not graphed.graphs.disabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("draft", DRAFTS)
def test_captured_chain_equals_steps(spec_assets, draft):
    """Captured chain equals single steps on GPU."""
    graphed, eager = _pair(spec_assets, draft, "cuda", max_bs=4, use_graphs=True)
    eager.graphs = None
    _check_chain(graphed, eager, "cuda")
    assert graphed.graphs.num_graphs == 3 and not graphed.graphs.disabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("draft", DRAFTS)
def test_captured_feed_chain_equals_eager_on_gpu(spec_assets, draft):
    graphed, eager = _pair(spec_assets, draft, "cuda", max_bs=4, use_graphs=True)
    eager.graphs = None
    _check_feed_chain(graphed, eager, "cuda")
    assert graphed.graphs.num_graphs == 2 and not graphed.graphs.disabled  # as the static test's keys


def _grow_by_single_steps(eager: EagleDraftRunner, rid: str, tail: torch.Tensor, shape) -> set[tuple[int, ...]]:
    """EAGLE-2 growth for one request where every node's output comes from single draft
    steps along its own path (the semantics a tree's masks must reproduce)."""
    pen = 1e-4

    def run_path(path: tuple[tuple[int, torch.Tensor], ...]):
        hidden = logits = None
        for tok, feat in path:
            hidden, logits = eager.step([rid], torch.tensor([tok]), feat[None])
        eager.kv.truncate(rid, len(path))
        return hidden[0], torch.log_softmax(logits[0], -1)

    first = torch.log_softmax(eager.compute_logits(tail[None])[0], -1).topk(shape.top_k)
    frontier = [(float(s) - pen, ((int(t), tail),)) for s, t in zip(first.values, first.indices, strict=True)]
    cands = [(s, tuple(t for t, _ in p)) for s, p in frontier]
    for _ in range(1, shape.num_steps):
        children = []
        for score, path in frontier:
            out, lp = run_path(path)
            best = lp.topk(shape.top_k)
            children += [(score + float(s) - pen, (*path, (int(t), out))) for s, t in zip(best.values, best.indices, strict=True)]
        cands += [(s, tuple(t for t, _ in p)) for s, p in children]
        frontier = sorted(children, key=lambda c: -c[0])[: shape.top_k]
    return {p for _, p in sorted(cands, key=lambda c: -c[0])[: shape.num_nodes - 1]}


def _tree_paths(tree, b: int) -> set[tuple[int, ...]]:
    return {tuple(int(t) for t in tree.tokens[b][tree.ancestors[b, n]][1:]) for n in range(1, tree.num_nodes)}


@pytest.mark.parametrize(
    "shape", [(2, 4, 15), (3, 3, 9)], ids=["every-candidate", "best-of-21"]
)  # (top_k, num_steps, num_nodes); 15 nodes keep every candidate, so the deepest are judged too
@pytest.mark.parametrize("graphs", [True, False], ids=["static-graph-path", "eager"])
@pytest.mark.parametrize("draft", ("eagle", "eagle3"))
def test_grown_tree_equals_steps(spec_assets, draft, graphs, shape):
    """Every node of a tree grown in one forward per level sees exactly its own path: the
    tree equals EAGLE-2 growth where each node's output comes from single steps along its
    path. Then feeding an accepted path and growing the next tree in one go equals a feed,
    a truncation and a fresh growth."""
    from loraserve.runtime.speculative.tree import TreeShape

    shape = TreeShape(*shape)
    grown, eager = _pair(spec_assets, draft, "cpu", max_bs=4, use_graphs=False)
    if not graphs:
        grown.graphs = None
    eager.graphs = None
    gen = torch.Generator().manual_seed(8)
    feature = grown.model.feature_size
    lengths = {"a": 9, "b": 30, "c": 4}
    rids = list(lengths)
    ids = torch.cat([torch.randint(3, 500, (n,), generator=gen) for n in lengths.values()])
    feats = torch.randn(sum(lengths.values()), feature, generator=gen)
    ends = torch.tensor(list(lengths.values())).cumsum(0) - 1
    tails = grown.forward(rids, ids, feats, list(lengths.values()))[ends]
    eager.forward(rids, ids, feats, list(lengths.values()))
    tree = grown.draft_tree(rids, tails, shape)
    assert [grown.kv.seq_len(r) for r in rids] == [n + shape.entries for n in lengths.values()]
    for b, rid in enumerate(rids):
        assert _tree_paths(tree, b) == _grow_by_single_steps(eager, rid, tails[b], shape), rid

    # feed a 3-wide path per request, accepting 0, 2 and 1 of its drafts
    for r in rids:
        grown.kv.truncate(r, shape.entries)
    width, accept = 3, torch.tensor([0, 2, 1])
    path_ids = torch.randint(3, 500, (3 * width,), generator=gen)
    path_feats = torch.randn(3 * width, feature, generator=gen)
    fed, fed_tails = grown.feed_tree(rids, path_ids, path_feats, accept, width, shape)
    out = eager.forward(rids, path_ids, path_feats, [width] * 3, from_target=True).view(3, width, -1)
    for r, a in zip(rids, accept.tolist(), strict=True):
        eager.kv.truncate(r, width - a - 1)
    want_tails = out[torch.arange(3), accept]
    torch.testing.assert_close(fed_tails, want_tails, rtol=1e-5, atol=1e-5)
    want = eager.draft_tree(rids, want_tails, shape)
    for b in range(3):
        assert _tree_paths(fed, b) == _tree_paths(want, b)
