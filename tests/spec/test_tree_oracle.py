"""Tree drafts through the real engine: greedy output with a draft tree = output without
speculation, token for token, for every EAGLE-family draft, adapters and the base mixed,
eagerly and with every draft and target forward on the graphs' padded static path."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.runner.cuda_graph import CudaGraphRunner
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.speculative.eagle.graphs import EagleGraphRunner

from .test_greedy_oracle import ADAPTERS, CASES, _check_same, _requests

TREE = {"top_k": 2, "num_steps": 3, "num_draft_tokens": 8}


def _tree_config(make_spec_config, case: str, **kw):
    algorithm, draft = CASES[case]
    config = make_spec_config(algorithm, draft, **kw)
    spec = config.speculative
    spec.top_k, spec.num_steps, spec.num_draft_tokens = TREE["top_k"], TREE["num_steps"], TREE["num_draft_tokens"]
    return config


@pytest.fixture(scope="module")
def baseline(make_spec_config, engine_run):
    requests = _requests(count=12, seed=5)
    run = engine_run(make_spec_config(), requests)
    return requests, {rid: run.outputs[rid].tokens for rid, *_ in requests}


@pytest.mark.parametrize("max_running", [1, 5, 12])
@pytest.mark.parametrize("case", ["eagle", "eagle3", "eagle3-d2t"])
def test_tree_drafts_are_lossless(make_spec_config, engine_run, baseline, case, max_running):
    requests, expected = baseline
    run = engine_run(_tree_config(make_spec_config, case, max_running_requests=max_running), requests)
    _check_same(run, requests, expected)
    nodes = TREE["num_draft_tokens"] - 1
    for rid, *_ in requests:
        stats = run.outputs[rid].spec
        assert stats is not None and stats.verify_steps >= 1
        assert stats.draft_tokens == nodes * stats.verify_steps  # every step verified a whole tree
        assert all(0 <= a <= TREE["num_steps"] for a in stats.accept_lens)
    snap = run.engine.decoder.metrics.snapshot()
    assert set(snap.per_adapter) == {"", *ADAPTERS}


@pytest.mark.parametrize("case", ["eagle", "eagle3"])
def test_static_tree_drafts_lossless(make_spec_config, engine_run, baseline, case):
    """The target's tree verifies and the draft's tree / feed-tree growth all on the padded
    static paths the CUDA graphs capture: lossless, and the growth ran ahead of the host."""
    requests, expected = baseline
    runners = []

    def static_paths(decoder):
        decoder.runner.graphs = CudaGraphRunner(decoder.runner, max_bs=8, use_graphs=False)
        draft = decoder.drafter.runner
        draft.graphs = EagleGraphRunner(draft, max_bs=8, use_graphs=False)
        runners.append((decoder.runner, draft))

    config = _tree_config(make_spec_config, case, max_running_requests=6)
    run = engine_run(config, requests, decoder_hook=static_paths)
    _check_same(run, requests, expected)
    target, draft = runners[0]
    assert any(key.tree for key in target.graphs._graphs), "no tree verify took the graph path"
    widths = {key.width for key in draft.graphs._trees}
    assert 0 in widths and TREE["num_steps"] + 1 in widths  # grown from tails, and fed-then-grown


def test_sampled_batch_verifies_chain(make_spec_config, engine_run, baseline):
    """Greedy requests stay exact when a sampled one shares their batch (the step verifies a
    chain, which rejection sampling needs); the sampled request finishes normally."""
    requests, expected = baseline
    sampled = ("s0", [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.8, seed=3), None)
    run = engine_run(_tree_config(make_spec_config, "eagle", max_running_requests=12), [*requests, sampled])
    _check_same(run, requests, expected)
    out = run.outputs["s0"]
    assert out.error is None and len(out.tokens) == 12
    chain_steps = [s for s in out.spec.accept_lens]
    assert chain_steps and out.spec.draft_tokens == TREE["num_steps"] * out.spec.verify_steps


def _steer(tree, requests, expected, step: int) -> int:
    """Rewrite each tree so that one branch, chosen away from node order's first children,
    spells the target's known continuation: the accepted paths are then long and not a
    prefix of the node order. Returns how many nodes were steered."""
    steered = 0
    for b, req in enumerate(requests):
        cont = expected[req.rid][len(req.output_ids) :]
        node = 0
        for depth, token in enumerate(cont[: tree.max_depth], start=1):
            children = [c for c in range(1, tree.num_nodes) if int(tree.parents[b, c]) == node]
            if not children:
                break
            pick = children[(step + depth + b) % len(children)] if depth > 1 else children[-1]
            for c in children:  # siblings never repeat the token: one path matches
                if int(tree.tokens[b, c]) == token:
                    tree.tokens[b, c] = -1
            tree.tokens[b, pick] = token
            node = pick
            steered += 1
    return steered


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static-graph-paths"])
@pytest.mark.parametrize("case", ["eagle", "eagle3-d2t"])
def test_long_off_order_paths_lossless(make_spec_config, engine_run, baseline, case, graphs):
    """The test drafts rarely agree with the target, so each tree is steered to hold the
    target's own continuation on a branch that is not the node order's first: verify accepts
    long paths through later nodes, whose cache entries must be moved into place and whose
    features feed the draft (checked against the target's features at the path's nodes).
    Output stays exactly the baseline's."""
    requests, expected = baseline
    steps = []
    want_fed: dict[str, list[torch.Tensor]] = {}
    fed: dict[str, list[torch.Tensor]] = {}

    def steer(decoder):
        drafter = decoder.drafter
        grow = drafter.propose_tree

        def steered(reqs, shape):
            tree = grow(reqs, shape)
            with torch.inference_mode():  # the trees are made under it
                steps.append(_steer(tree, reqs, expected, len(steps)))
            return tree

        drafter.propose_tree = steered
        verified, feed, feed_uniform = drafter.on_verify, drafter.runner.forward, drafter.runner.forward_uniform

        def on_verify(reqs, acceptance, output):
            feats = output.aux_hidden_states if drafter.hidden_layers else output.hidden_states
            nodes = feats.view(len(reqs), -1, feats.shape[-1])
            paths = zip(reqs, acceptance.path.tolist(), acceptance.accept_lens.tolist(), strict=True)
            for b, (req, path, a) in enumerate(paths):
                want_fed.setdefault(req.rid, []).append(nodes[b, path[: a + 1]].clone())
            return verified(reqs, acceptance, output)

        def spy(rids, ids, feats, lens, **kw):
            if kw.get("from_target"):
                for rid, f in zip(rids, feats.split(list(lens)), strict=True):
                    fed.setdefault(rid, []).append(f.clone())
            return feed(rids, ids, feats, lens, **kw)

        def spy_uniform(rids, ids, feats, width):
            for rid, f in zip(rids, feats.view(len(rids), width, -1).unbind(0), strict=True):
                fed.setdefault(rid, []).append(f.clone())
            return feed_uniform(rids, ids, feats, width)

        drafter.on_verify, drafter.runner.forward, drafter.runner.forward_uniform = on_verify, spy, spy_uniform
        if graphs:
            decoder.runner.graphs = CudaGraphRunner(decoder.runner, max_bs=8, use_graphs=False)
            drafter.runner.graphs = EagleGraphRunner(drafter.runner, max_bs=8, use_graphs=False)

    run = engine_run(_tree_config(make_spec_config, case, max_running_requests=5), requests, decoder_hook=steer)
    _check_same(run, requests, expected)
    lens = [a for rid, *_ in requests for a in run.outputs[rid].spec.accept_lens]
    assert sum(steps) > 0 and max(lens) == TREE["num_steps"] and sum(lens) / len(lens) > 1.5
    if not graphs:  # eager: each request's verified paths are its last feeds, in order
        assert want_fed.keys() <= fed.keys()
        for rid, wants in want_fed.items():
            gots = fed[rid][len(fed[rid]) - len(wants) :]
            assert len(gots) == len(wants)
            for got, want in zip(gots, wants, strict=True):
                torch.testing.assert_close(got[: len(want)], want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
@pytest.mark.parametrize("case", ["eagle", "eagle3"])
def test_tree_drafts_graphs_lossless(make_spec_config, engine_run, case, attention):
    """On a GPU with captured graphs (target tree verifies, the head's tree growth and
    feed-tree replays) and Triton LoRA kernels, on either attention backend: the same
    tokens as plain decoding on the same device."""
    requests = _requests(count=12, seed=5)

    def on_gpu(config):
        config.device = "cuda"
        config.cuda_graph.enabled = True
        config.cuda_graph.max_bs = 8
        # the Triton LoRA kernels: the torch reference's host-side segments keep adapter
        # batches out of graphs
        config.lora.backend, config.attention_backend = "triton", attention
        return config

    plain = engine_run(on_gpu(make_spec_config(max_running_requests=6)), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    seen = []
    run = engine_run(
        on_gpu(_tree_config(make_spec_config, case, max_running_requests=6)), requests, decoder_hook=seen.append
    )
    _check_same(run, requests, expected)
    decoder = seen[0]
    assert any(key.tree for key in decoder.runner.graphs._graphs), "no tree verify replayed a graph"
    assert decoder.drafter.runner.graphs._trees, "the head grew no tree from a graph"


def test_large_batches_verify_chains(make_spec_config, engine_run, baseline):
    """speculative.tree_max_batch_size 2: steps of one or two requests verify trees, larger
    ones chains of num_steps drafts; requests move between the two as the batch drains, with
    the drafter's state carried across, and output stays exact."""
    requests, expected = baseline
    config = _tree_config(make_spec_config, "eagle3", max_running_requests=5)
    config.speculative.tree_max_batch_size = 2
    run = engine_run(config, requests)
    _check_same(run, requests, expected)
    nodes, steps = TREE["num_draft_tokens"] - 1, TREE["num_steps"]
    trees = chains = 0
    for rid, *_ in requests:
        stats = run.outputs[rid].spec
        # draft_tokens = nodes * tree steps + steps * chain steps
        tree_steps, rest = divmod(stats.draft_tokens - steps * stats.verify_steps, nodes - steps)
        assert rest == 0 and 0 <= tree_steps <= stats.verify_steps
        trees += tree_steps
        chains += stats.verify_steps - tree_steps
    assert trees > 0 and chains > 0
