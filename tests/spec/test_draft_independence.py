"""The draft never sees an adapter, and a draft equal to the target is (almost) always accepted."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams


def _prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 500, (int(torch.randint(4, 30, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]


def _per_position_accept_rate(histogram: list[int]) -> list[float]:
    """P(draft j accepted | drafts 0..j-1 accepted), from a histogram of accept lengths."""
    rates = []
    for j in range(len(histogram) - 1):
        reached = sum(histogram[j:])
        rates.append(sum(histogram[j + 1 :]) / reached if reached else 0.0)
    return rates


def test_target_as_draft_accepts_all(make_spec_config, engine_run):
    """Draft equal to target is accepted at every position."""
    greedy = [
        (f"g{i}", p, SamplingParams(max_tokens=40, temperature=0.0), None)
        for i, p in enumerate(_prompts(6, 1))
    ]
    sampled = [
        (f"s{i}", p, SamplingParams(max_tokens=40, temperature=0.8, seed=i), None)
        for i, p in enumerate(_prompts(6, 2))
    ]
    for requests in (greedy, sampled):
        run = engine_run(make_spec_config("STANDALONE", "same", k=5), requests)
        hist = run.engine.decoder.metrics.snapshot().per_adapter[""].histogram
        rates = _per_position_accept_rate(hist)
        assert len(rates) == 4
        assert min(rates) > 0.9, (requests[0][0], hist, rates)


def test_standalone_ignores_adapter(
    spec_assets, make_spec_config, engine_run
):
    """An embeddings + lm_head adapter on the target never reaches the draft.

    The draft is a copy of the target, so an adapted draft would propose the adapted
    target's tokens; the proposals recorded while serving the adapter must instead equal
    a fresh base-model draft's greedy continuations of the same contexts, bit for bit.
    """
    config = make_spec_config("STANDALONE", "same")
    recorded: list[tuple[list[int], list[int]]] = []

    def spy(decoder):
        assert decoder.drafter.runner.lora is None and decoder.drafter.runner.is_draft
        propose = decoder.drafter.propose

        def recording(requests, n):
            proposal = propose(requests, n)
            for req, row in zip(requests, proposal.tokens.tolist(), strict=True):
                recorded.append((list(req.all_ids), row))
            return proposal

        decoder.drafter.propose = recording

    requests = [
        (f"a{i}", p, SamplingParams(max_tokens=24, temperature=0.0), "emb-head")
        for i, p in enumerate(_prompts(4, 3))
    ]
    run = engine_run(config, requests, decoder_hook=spy)
    stats = run.engine.decoder.metrics.snapshot().per_adapter["emb-head"]
    assert stats.accept_rate < 0.9  # the adapter really changes the target's choices

    fresh_config = make_spec_config()
    fresh_config.lora.adapters = {}
    draft = ModelRunner(fresh_config, is_draft=True, model_path=spec_assets.same_draft)
    assert draft.lora is None
    for n, (context, proposal) in enumerate(recorded):
        rid = f"replay{n}"
        batch = ForwardBatch(ForwardMode.EXTEND, [rid], torch.tensor(context), extend_lens=[len(context)])
        token = int(draft.forward(batch).logits[0].argmax())
        expected = [token]
        for _ in range(len(proposal) - 1):
            token = int(
                draft.forward(ForwardBatch(ForwardMode.DECODE, [rid], torch.tensor([token])))
                .logits[0]
                .argmax()
            )
            expected.append(token)
        draft.kv.free(rid)
        assert proposal == expected


@pytest.mark.parametrize(
    "case", [("EAGLE3", "eagle3"), ("EAGLE", "eagle-token-map")], ids=["whole-head", "token-map"]
)
def test_eagle_uses_base_embeddings(make_spec_config, case):
    """With an embeddings + lm_head adapter active in the target, the EAGLE draft's logits
    and embeddings are bit-identical to those with no adapter in play: whether it shares the
    target's head whole or takes rows of it for a token map."""
    from loraserve.runtime.sampling import Sampler
    from loraserve.runtime.speculative import build_decoder

    runner = ModelRunner(make_spec_config())
    decoder = build_decoder(config=make_spec_config(*case), runner=runner, sampler=Sampler(0))
    draft = decoder.drafter.runner
    assert draft.lora is None and draft.model.lora is None
    assert draft.model._embed_weight.data_ptr() == runner.embed_tokens.weight.data_ptr()
    if draft.vocab.to_target is None:
        assert draft.vocab.head_weight.data_ptr() == runner.lm_head.weight.data_ptr()
    else:
        rows = runner.lm_head.weight.index_select(0, draft.vocab.to_target)
        assert torch.equal(draft.vocab.head_weight, rows)  # the base head's rows, taken unwrapped

    hidden = torch.randn(5, runner.hidden_size)
    ids = torch.randint(0, runner.vocab_size, (5,))
    plain_logits = draft.compute_logits(hidden)
    plain_embed = draft.model.embed(ids)
    target_plain = runner.model.compute_logits(hidden)
    # Put the target's adapter context in the state of an emb-head forward over these rows.
    slots = runner.lora.prepare_batch(["emb-head"] * 5)
    info = runner.lora.batch_info(ForwardMode.EXTEND, slots, extend_lens=[1] * 5)
    runner.lora.ctx.set(info, info)
    try:
        target_adapted = runner.model.compute_logits(hidden)
        assert (target_adapted - target_plain).abs().max() > 1e-3  # the adapter would change a shared head
        assert torch.equal(draft.compute_logits(hidden), plain_logits)
        assert torch.equal(draft.model.embed(ids), plain_embed)
    finally:
        runner.lora.ctx.clear()
