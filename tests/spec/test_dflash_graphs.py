"""The DFLASH draft's uniform forwards replayed from padded static buffers / CUDA graphs.

On the CPU the graph runner executes its static, padded path eagerly (``use_graphs=False``):
everything but the capture itself (batch-size and context buckets, padding requests on
row 0 / slot 0, the fused append + block after a verify), against the eager ragged
forwards. tests/spec/test_cuda_features.py runs the same oracles with real graphs.
"""

from __future__ import annotations

import os

import pytest
import torch

from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.speculative.dflash.graphs import DFlashGraphRunner
from loraserve.runtime.speculative.dflash.runner import DFlashDraftRunner
from loraserve.runtime.speculative.draft.settings import DraftSettings

from .conftest import tiny_target
from .test_dflash import _config, _requests, baseline, drafts  # noqa: F401 (fixtures)

WIDTH = 4


def dflash_pair(
    spec_assets,
    draft,
    device: str,
    *,
    max_bs: int,
    use_graphs: bool,
    width: int = WIDTH,
    attention: str = "sdpa",
) -> tuple[DFlashDraftRunner, DFlashDraftRunner]:
    """Two runners of one draft beside one target: the first runs its uniform forwards
    through the graph runner (on ``attention``), the second eagerly (on SDPA)."""
    arch, target = tiny_target(spec_assets, device)

    def make(attention: str = "sdpa") -> DFlashDraftRunner:
        return DFlashDraftRunner(DraftSettings(
            draft, target_arch=arch, target_dir=spec_assets.target, embed_weight=target.embed_tokens.weight,
            lm_head_weight=target.lm_head.weight, dtype=torch.float32, device=device, max_total_tokens=2048,
            max_requests=8, max_context_len=256, attention_backend=attention,
        ))  # fmt: skip

    graphed, eager = make(attention), make()
    graphed.graphs = DFlashGraphRunner(graphed, max_bs=max_bs, width=width, use_graphs=use_graphs)
    return graphed, eager


def check_against_eager(
    graphed: DFlashDraftRunner, eager: DFlashDraftRunner, device: str, *, tol: float = 1e-5
) -> None:
    """Mixed batches of different context lengths and sizes (padded to a bucket, or too
    large for the graphs): every proposal of the graphed runner equals the eager one's, bit
    for bit, and so does what it leaves in the cache up to rounding (a GEMM over a padded
    batch may round differently from one over the real rows: BLAS picks kernels by rows)."""
    w = WIDTH
    gen = torch.Generator().manual_seed(7)
    feature = graphed.feature_size
    # "e" crosses the 64-column context bucket once a block sits after it
    lengths = {"a": 9, "b": 4, "c": 30, "d": 2, "e": 61, "f": 7}
    rids = list(lengths)
    feats = torch.randn(sum(lengths.values()), feature, generator=gen).to(device)
    for runner in (graphed, eager):  # the same ragged prefill: eager on both
        runner.append_context(rids, feats, list(lengths.values()))

    def same_state() -> None:
        # Every request's context entries (freed slots hold whatever was written last).
        for r in rids:
            assert graphed.held(r) == eager.held(r), r
            mine, theirs = graphed.kv.token_slots(r), eager.kv.token_slots(r)
            for a, b in zip(
                graphed.kv.k_buffers + graphed.kv.v_buffers,
                eager.kv.k_buffers + eager.kv.v_buffers,
                strict=True,
            ):
                torch.testing.assert_close(a[mine], b[theirs], rtol=tol, atol=tol)

    def blocks(batch: list[str]) -> None:
        first = torch.randint(3, 500, (len(batch),), generator=gen).to(device)
        got, want = graphed.draft(batch, first, w), eager.draft(batch, first, w)
        assert torch.equal(got[0], want[0]), batch  # the proposals
        # the hidden rows a sampling batch's logits come from
        torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol)
        assert got[0].shape == (len(batch), w - 1)

    # 3 requests padded to 4; 2 of them one past the smallest context bucket; 1; all 6 (> max_bs: eager)
    for batch in (["a", "b", "c"], ["c", "e"], ["d"], rids):
        blocks(batch)
    same_state()
    assert graphed.graphs is not None and len(graphed.graphs._blocks) == 3  # (4, 64), (2, 128), (1, 64)

    # A step without drafting: one row per request (graph append) against the eager append.
    batch = ["b", "d", "f"]
    rows = torch.randn(len(batch), feature, generator=gen).to(device)
    graphed.append_context(batch, rows, [1] * len(batch))
    eager.append_context(batch, rows, [1] * len(batch))
    same_state()

    # A verify: all w rows per request in one uniform append, then the rejected ones dropped,
    # against the eager append of the kept rows only.
    batch, keep = ["a", "c", "e"], [1, 4, 2]
    rows = torch.randn(len(batch) * w, feature, generator=gen).to(device)
    graphed.append_context(batch, rows, [w] * len(batch))
    graphed.keep_context(batch, w, keep)
    kept = torch.cat([rows.view(len(batch), w, -1)[i, :n] for i, n in enumerate(keep)])
    eager.append_context(batch, kept, keep)
    same_state()
    blocks(batch)

    # The fused append + next block after a greedy verify, the accepted counts on the device,
    # against the eager append of the kept rows, then a block from the target's next token.
    for batch, accept in ((["b", "d", "f"], [0, 3, 1]), (["e"], [2]), (["a", "b", "c", "d"], [3, 0, 2, 1])):
        bs = len(batch)
        rows = torch.randn(bs * w, feature, generator=gen).to(device)
        tokens = torch.randint(3, 500, (bs, w), generator=gen)
        for i, a in enumerate(accept):
            tokens[i, a + 1 :] = -1  # the acceptance's layout: -1 past the target's token
        assert graphed.can_feed_block(batch, w)
        ahead = graphed.feed_block(batch, rows, tokens.to(device), torch.tensor(accept).to(device), w)
        graphed.keep_context(batch, 2 * w, [a + 1 for a in accept])
        kept = torch.cat([rows.view(bs, w, -1)[i, : a + 1] for i, a in enumerate(accept)])
        eager.append_context(batch, kept, [a + 1 for a in accept])
        want, _ = eager.draft(batch, tokens[torch.arange(bs), torch.tensor(accept)].to(device), w)
        assert torch.equal(ahead, want), batch
        same_state()
    assert {tuple(key) for key in graphed.graphs._feeds} == {(4, 64), (1, 128)}  # 3 and 4 share a bucket
    assert {tuple(key) for key in graphed.graphs._appends} == {(1, 4), (WIDTH, 4)}


@pytest.mark.parametrize("which", ["one", "two"])
def test_static_proposals_equal_eager(spec_assets, drafts, which):  # noqa: F811
    """Static path proposals are bit identical to eager."""
    graphed, eager = dflash_pair(spec_assets, drafts[which], "cpu", max_bs=4, use_graphs=False)
    check_against_eager(graphed, eager, "cpu")
    # What the engine's metrics and the benchmarks read: shapes held on the static path are
    # not captured graphs.
    assert graphed.graphs.num_shapes > 0 and graphed.graphs.num_graphs == graphed.graphs.num_captured == 0


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the paged kernel needs CUDA or TRITON_INTERPRET=1 (make test sets it)",
)
def test_static_paged_equals_eager_sdpa(spec_assets, drafts):  # noqa: F811
    """The block through the paged Triton kernel (the target's backend on a GPU; padded
    requests read table row 0): the proposals of eager SDPA, the rest equal up to the two
    kernels' rounding."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graphed, eager = dflash_pair(
        spec_assets, drafts["two"], device, max_bs=4, use_graphs=False, attention="triton"
    )
    check_against_eager(graphed, eager, device, tol=1e-4)


def test_other_width_block_refused(spec_assets, drafts):  # noqa: F811
    """A block of another width is refused and leaves the cache."""
    graphed, _ = dflash_pair(spec_assets, drafts["two"], "cpu", max_bs=4, use_graphs=False)
    graphed.append_context(["a"], torch.randn(5, graphed.feature_size), [5])
    with pytest.raises(ValueError, match="width 4, got 5"):
        graphed.draft(["a"], torch.tensor([9]), WIDTH + 1)
    assert graphed.held("a") == 5 and not graphed.can_feed_block(["a"], WIDTH + 1)
    with torch.inference_mode(), pytest.raises(ValueError, match="append 1 or 4 rows"):
        graphed.graphs.run_append(graphed.kv.allocate(["a"], [2]), torch.zeros(2, graphed.feature_size), 2)


def _with_static_graphs(max_bs: int, width: int):
    """A decoder hook that gives the DFLASH draft runner a graph runner on its static path."""

    def hook(decoder):
        runner = decoder.drafter.runner
        runner.graphs = DFlashGraphRunner(runner, max_bs=max_bs, width=width, use_graphs=False)

    return hook


def test_static_greedy_per_adapter(
    make_spec_config,
    engine_run,
    baseline,  # noqa: F811
    drafts,  # noqa: F811
):
    """The engine's greedy oracle with the draft's uniform forwards on the padded static
    path: batches of up to 6 against graphs of up to 4 (larger ones eager), the next block
    drafted with the append after every greedy verify."""
    requests, expected = baseline
    config = _config(make_spec_config, drafts["two"], k=WIDTH, max_running_requests=6)
    run = engine_run(config, requests, decoder_hook=_with_static_graphs(4, WIDTH))
    for rid, _, _, adapter in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}) diverged"
    graphs = run.engine.decoder.drafter.runner.graphs
    assert graphs._feeds and graphs._blocks  # drafted ahead, and afresh after admissions


def test_mixed_batches_match_eager(make_spec_config, engine_run, drafts):  # noqa: F811
    """Seeded sampling requests beside greedy ones (no drafting ahead: the block's logits
    come from the graph's hidden rows): the same tokens as with an eager draft."""
    requests = [
        (rid, prompt, SamplingParams(max_tokens=params.max_tokens, temperature=0.8, seed=100 + i), name)
        if i % 2
        else (rid, prompt, params, name)
        for i, (rid, prompt, params, name) in enumerate(_requests(count=8, seed=9))
    ]
    config = _config(make_spec_config, drafts["one"], k=WIDTH, max_running_requests=5)
    eager = engine_run(config, requests)
    static = engine_run(config, requests, decoder_hook=_with_static_graphs(4, WIDTH))
    for rid, *_ in requests:
        assert static.outputs[rid].error is None
        assert static.outputs[rid].tokens == eager.outputs[rid].tokens, rid
    graphs = static.engine.decoder.drafter.runner.graphs
    assert graphs._blocks and graphs._appends


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-graphs"])
def test_proposals_after_verify(
    make_spec_config,
    engine_run,
    drafts,  # noqa: F811
    static,
):
    """The draft's context after prefills, verifies (the accepted rows of each) and
    drafting ahead is what a fresh draft builds from one prefill of the committed tokens:
    every proposal the engine makes equals the block drafted from scratch there."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.runner.forward_batch import ForwardBatch
    from loraserve.runtime.runner.model_runner import ModelRunner
    from loraserve.runtime.sampling import Sampler
    from loraserve.runtime.speculative import build_decoder

    config = _config(make_spec_config, drafts["two"], k=WIDTH, max_running_requests=4)
    requests = _requests(count=6, seed=11, max_tokens=14)
    seen: list[tuple[list[int], str | None, list[int]]] = []

    def spy(decoder):
        if static:
            _with_static_graphs(4, WIDTH)(decoder)
        drafter = decoder.drafter
        propose = drafter.propose

        def recording(batch, n):
            proposal = propose(batch, n)
            for req, row in zip(batch, proposal.tokens.tolist(), strict=True):
                seen.append((list(req.all_ids), req.adapter, row))
            return proposal

        drafter.propose = recording

    run = engine_run(config, requests, decoder_hook=spy)
    assert all(run.outputs[rid].error is None for rid, *_ in requests)
    runner = ModelRunner(config)
    fresh = build_decoder(config=config, runner=runner, sampler=Sampler(0)).drafter
    assert len(seen) > 20
    for ids, adapter, row in seen:
        out = runner.forward(
            ForwardBatch(ForwardMode.EXTEND, ["x"], torch.tensor(ids[:-1]), extend_lens=[len(ids) - 1],
                         lora_names=[adapter], hidden_layers=fresh.hidden_layers)
        )  # fmt: skip
        runner.kv.free("x")
        fresh.runner.append_context(["x"], out.aux_hidden_states, [len(ids) - 1])
        tokens, _ = fresh.runner.draft(["x"], torch.tensor([ids[-1]]), WIDTH)
        fresh.runner.release("x")
        assert tokens[0].tolist() == row, (len(ids), adapter)
