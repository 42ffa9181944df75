"""The session's speculative features on a GPU, with captured graphs and the Triton LoRA
kernels: logit processing and draft adapters stay lossless against plain decoding on the
same device (skipped without CUDA; the CPU oracles are in test_processing_oracle.py and
test_draft_adapters.py)."""

from __future__ import annotations

import pytest
import torch

from .test_dflash import _requests as dflash_requests
from .test_dflash import accepting_draft, drafts  # noqa: F401 (fixture)
from .test_dflash_graphs import WIDTH, check_against_eager, dflash_pair
from .test_draft_adapters import ADAPTED
from .test_draft_adapters import _requests as draft_requests
from .test_draft_adapters_eagle import _head_config as head_config
from .test_draft_adapters_eagle import _loading as head_loading
from .test_draft_adapters_eagle import _requests as head_requests
from .test_draft_adapters_eagle import check_head_adapter_proposals, head_adapters, head_runners  # noqa: F401
from .test_processing_oracle import _requests as processed_requests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _on_gpu(config):
    config.device = "cuda"
    config.cuda_graph.enabled = True
    config.cuda_graph.max_bs = 8
    config.lora.backend = "triton"  # the torch reference keeps adapter batches out of graphs
    return config


def _check(run, requests, expected):
    for rid, *_ in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], rid


@pytest.mark.parametrize(("algorithm", "draft"), [("NGRAM", None), ("STANDALONE", "same"), ("EAGLE3", "eagle3")])
def test_processed_graphs_lossless(make_spec_config, engine_run, algorithm, draft):
    """Processed requests under CUDA graphs are lossless."""
    requests = processed_requests(processed=True)
    plain = engine_run(_on_gpu(make_spec_config(max_running_requests=8)), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    run = engine_run(_on_gpu(make_spec_config(algorithm, draft, max_running_requests=8)), requests)
    _check(run, requests, expected)
    assert run.engine.runner.graphs is not None and run.engine.runner.graphs._graphs


def test_draft_adapters_under_cuda_graphs(make_spec_config, engine_run, spec_assets):
    requests = draft_requests()
    plain = engine_run(_on_gpu(make_spec_config(max_running_requests=8)), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    config = _on_gpu(make_spec_config("STANDALONE", "same", max_running_requests=8))
    config.speculative.draft_max_loras = 2
    config.speculative.draft_max_lora_rank = 16

    def load(decoder):
        decoder.drafter.lora.load(ADAPTED, spec_assets.adapters[ADAPTED])

    run = engine_run(config, requests, decoder_hook=load)
    _check(run, requests, expected)
    stats = run.engine.decoder.metrics.snapshot().per_adapter[ADAPTED]
    # bf16 / tf32 kernels may split a near-tie differently from the target: nearly every draft
    assert stats.accepted_tokens / stats.draft_tokens > 0.9
    assert run.engine.decoder.drafter.runner.graphs is not None


# --------------------------------------------------------------------------- DFLASH under graphs


def test_dflash_graph_proposals_eager(spec_assets, drafts):  # noqa: F811
    """The DFLASH draft's block, append and fused append + block replayed from captured
    graphs (padded batches, two context buckets): the same proposals as eager forwards."""
    graphed, eager = dflash_pair(spec_assets, drafts["two"], "cuda", max_bs=4, use_graphs=True)
    check_against_eager(graphed, eager, "cuda", tol=1e-4)  # cuBLAS, too, picks kernels by rows
    assert graphed.graphs is not None and graphed.graphs.num_captured == graphed.graphs.num_shapes > 0


@pytest.mark.parametrize("which", ["two", "accepting"])
def test_dflash_graphs_greedy_lossless(
    spec_assets, make_spec_config, engine_run, drafts, tmp_path, which  # noqa: F811
):
    """Greedy DFLASH with the target's and the draft's graphs on: the tokens of plain
    decoding, per adapter, with the draft's block and appends replayed from graphs; with a
    random draft (every block rejected) and with one whose blocks are accepted."""
    requests = dflash_requests(count=10, seed=4)
    plain = engine_run(_on_gpu(make_spec_config(max_running_requests=8)), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    config = _on_gpu(make_spec_config("DFLASH", None, k=WIDTH, max_running_requests=8))
    draft = drafts["two"] if which == "two" else accepting_draft(tmp_path / "d", spec_assets.target, [*expected.values()])
    config.speculative.draft_model_path = str(draft)
    run = engine_run(config, requests)
    _check(run, requests, expected)
    graphs = run.engine.decoder.drafter.runner.graphs
    assert graphs is not None and graphs.num_captured > 0 and graphs._feeds
    if which == "accepting":
        assert run.engine.decoder.metrics.snapshot().overall.accepted_tokens > 0


# --------------------------------------------------------------------------- EAGLE head draft adapters


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_head_adapter_graph_proposals(spec_assets, head_adapters, head):  # noqa: F811
    """A head's draft adapter inside captured graphs (chains and trees; 3 requests padded to
    4, one of them without the adapter), on the Triton LoRA kernels: the proposals of eager
    forwards, and the unadapted request's those of the head without a pool."""
    plain, eager, graphed = head_runners(
        spec_assets, head, head_adapters[head]["attn-r8"], device="cuda", use_graphs=True, backend="triton"
    )
    check_head_adapter_proposals(plain, eager, graphed, "cuda", exact=False)
    assert graphed.graphs.num_captured == graphed.graphs.num_shapes > 0


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_head_adapter_graphs_lossless(
    make_spec_config,
    engine_run,
    head_adapters,  # noqa: F811
    head,
    shape,
):
    """Mixed batches (adapters with a head draft adapter, one without, the base model) with
    the target's and the head's graphs on: the tokens of plain decoding, per adapter."""
    requests = head_requests()
    plain = engine_run(_on_gpu(make_spec_config(max_running_requests=8)), requests)
    expected = {rid: plain.outputs[rid].tokens for rid, *_ in requests}
    config = _on_gpu(head_config(make_spec_config, head, tree=shape == "tree"))
    run = engine_run(config, requests, decoder_hook=head_loading(head_adapters[head]))
    _check(run, requests, expected)
    graphs = run.engine.decoder.drafter.runner.graphs
    assert graphs is not None and any(graphs._adapted.values())  # replays holding the head's LoRA ops
