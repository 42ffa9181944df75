"""The DFLASH trainer: which block labels count, where blocks go, and the
target's outputs computed once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loraserve.runtime.tools.distill.dflash_train import (
    DFlashTraining,
    block_targets,
    cache_budget,
    cached_outputs,
    dflash_loss,
    first_anchors,
    sample_anchors,
    split_cached,
    target_outputs,
    train_dflash,
)
from loraserve.runtime.tools.distill.eagle_head import LayerDims, RopeFrequencies

from .conftest import tiny_llama


def test_label_counts_after_greedy_tokens():
    """Block position ``j`` of anchor ``a`` is judged by serving only when tokens ``a + 1 ..
    a + j - 1`` were the target's greedy choices: labels after any other token are masked."""
    length, vocab, block = 12, 7, 5
    greedy = torch.tensor([(3 * i) % vocab for i in range(length)])  # the target's choice after token i
    logits = torch.nn.functional.one_hot(greedy, vocab).float()[None] * 5.0
    window = torch.zeros(1, length, dtype=torch.long)
    for i in range(length - 1):
        window[0, i + 1] = greedy[i]  # the target's own continuation ...
    window[0, 5] = (greedy[4] + 1) % vocab  # ... but token 5 is not its choice
    anchors = torch.tensor([[1, 3, 5, 8]])
    labels, teacher, counts = block_targets(window, logits.argmax(-1), logits, anchors, block)
    assert teacher.shape == (1, 4, block - 1, vocab)
    assert labels[0, 1].tolist() == greedy[3:7].tolist()  # anchor 3: the target's choices after tokens 3..6
    greedy_only = block_targets(window, logits.argmax(-1), None, anchors, block)
    assert greedy_only[1] is None
    assert torch.equal(greedy_only[0], labels) and torch.equal(greedy_only[2], counts)
    # anchor 1, position 1: the target's distribution after token 1
    assert torch.allclose(teacher[0, 0, 0].exp(), torch.softmax(logits[0, 1], -1))
    assert counts[0].tolist() == [
        [True, True, True, True],  # tokens 2..4 are the target's
        [True, True, False, False],  # token 5 is not: anchor 3's positions 3, 4 are never verified after it
        [True, True, True, True],  # anchor 5: its drafts follow token 5, whatever it was
        [True, True, True, True],  # the last anchor: its last label is the window's last row
    ]


def test_anchors_distinct_with_room():
    """Anchors are distinct and leave room for the labels."""
    gen = torch.Generator().manual_seed(0)
    anchors = sample_anchors(64, 20, 4, 10, gen, first=3)
    assert anchors.min() >= 3 and anchors.max() <= 20 - 4 + 1  # the last label row is the window's last token
    assert all(len(set(row.tolist())) == 10 for row in anchors)


def test_anchors_start_where_each_window_says():
    """A ``first`` per window: each window's anchors are distinct and start at its own first;
    the shortest span still holds ``n``, else the error names the windows."""
    gen = torch.Generator().manual_seed(0)
    first = torch.tensor([1, 1, 9, 9, 13])
    anchors = sample_anchors(5, 20, 4, 5, gen, first=first)
    assert all(len(set(row.tolist())) == 5 for row in anchors)
    assert (anchors >= first[:, None]).all() and anchors.max() <= 20 - 4 + 1
    assert sorted(anchors[4].tolist()) == [13, 14, 15, 16, 17]  # its span holds exactly five
    assert anchors[:2].min() < 9  # the others may start anywhere
    with pytest.raises(ValueError, match="fewer than 6 blocks of 4 from 13"):
        sample_anchors(5, 20, 4, 6, gen, first=first)


def test_teacher_blocks_after_prompt():
    """``anchor_from="continuation"``: the batch's teacher windows (its last rows) start their
    blocks at the prompt's last token, where the first draft follows the prompt; corpus windows
    and ``"window"`` keep every anchor."""
    opts = DFlashTraining(seconds=0, seq=16, batch=4, lr=0, block=4, layer_ids=[0], teacher_prompt=6)
    assert first_anchors(4, 2, opts) == 1
    cont = replace(opts, anchor_from="continuation")
    assert first_anchors(4, 2, cont).tolist() == [1, 1, 5, 5]
    assert first_anchors(4, 0, cont) == 1
    with pytest.raises(ValueError, match="anchor_from must be window or continuation, got 'middle'"):
        first_anchors(4, 2, replace(opts, anchor_from="middle"))


def test_loss_places_teacher_blocks(target):
    """``dflash_loss`` with ``teacher_rows``: the draft is asked for blocks of the teacher
    windows only at or after the prompt's last token (seen at the draft's own input)."""
    from loraserve.runtime.tools.distill.dflash_draft import DFlashDraft

    draft = DFlashDraft(LayerDims.of(target.config), target.model.embed_tokens.weight, target.lm_head.weight, layer_ids=[0],
                        num_layers=1, block=4, mask_id=0, eps=1e-5, rope=RopeFrequencies.of(target.config))  # fmt: skip
    seen = []
    real = draft.block_logits
    draft.block_logits = lambda w, f, a: seen.append(a.clone()) or real(w, f, a)
    opts = DFlashTraining(seconds=0, seq=16, batch=4, lr=0, block=4, layer_ids=[0], blocks=5, teacher_prompt=10,
                          anchor_from="continuation")  # fmt: skip
    windows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(2))
    for _ in range(5):
        dflash_loss(draft, target, windows, opts, torch.Generator().manual_seed(len(seen)), teacher_rows=3)
    anchors = torch.stack(seen)  # [5, 4, 5]
    assert (anchors[:, 1:] >= 9).all()  # teacher rows: the prompt's last token or later
    assert (anchors[:, 0] < 9).any()  # the corpus row: anywhere


def test_cached_outputs_match_target():
    """The cache keeps the layer outputs in bfloat16 and the target's greedy tokens; for KL
    labels also the final normed hidden state, from which the logits come back through the LM
    head as the uncached step computes them."""
    target = tiny_llama(128, 4, 8, 4, 16, 256, vocab=64, seed=0)  # 4 layers: two outputs
    windows = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    feats, logits = target_outputs(target, windows, [0, 2])
    rows, greedy = cached_outputs(target, windows, [0, 2])
    assert rows.dtype == torch.bfloat16 and rows.shape == (3, 17, 2 * 128)
    assert torch.equal(greedy, logits.argmax(-1))
    got_feats, no_logits = split_cached(target, rows, with_logits=False)
    assert torch.equal(got_feats, feats.to(torch.bfloat16).float()) and no_logits is None
    full, _ = cached_outputs(target, windows, [0, 2], with_final=True)
    assert full.shape == (3, 17, 3 * 128)
    got_feats, got_logits = split_cached(target, full, with_logits=True)
    assert torch.equal(got_feats, feats.to(torch.bfloat16).float())
    assert torch.allclose(got_logits, logits, atol=0.05)
    assert torch.equal(got_logits.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("labels", ["greedy", "distribution"])
def test_cached_step_equals_uncached(target, labels):
    """The same windows and anchors give the same loss from the cache as from the target (to
    the cache's bfloat16 rounding), with greedy and KL labels alike."""
    from loraserve.runtime.tools.distill.dflash_draft import DFlashDraft
    from loraserve.runtime.tools.distill.dflash_train import dflash_loss

    torch.manual_seed(0)
    draft = DFlashDraft(LayerDims.of(target.config), target.model.embed_tokens.weight, target.lm_head.weight, layer_ids=[0],
                        num_layers=1, block=4, mask_id=0, eps=1e-5, rope=RopeFrequencies.of(target.config))  # fmt: skip
    with torch.no_grad():
        draft.norm.mul_(30.0)  # peaked logits: the loss then depends on which token is the label
    opts = DFlashTraining(seconds=0, seq=16, batch=3, lr=0, block=4, layer_ids=[0], blocks=5, labels=labels)
    windows = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(2))
    plain, _ = dflash_loss(draft, target, windows, opts, torch.Generator().manual_seed(3))
    rows, greedy = cached_outputs(target, windows, [0], with_final=labels != "greedy")
    cached, _ = dflash_loss(draft, target, windows, opts, torch.Generator().manual_seed(3), (rows, greedy))
    assert torch.allclose(plain, cached, rtol=0.02), (plain, cached)


def test_cached_training_reports_cache(target):
    """Training on cached outputs reports the cache."""
    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    teacher = torch.randint(0, 64, (12, 17), generator=torch.Generator().manual_seed(5))
    opts = DFlashTraining(seconds=600, seq=16, batch=4, lr=3e-3, block=4, layer_ids=[0], num_layers=2,
                          blocks=6, max_steps=3, cache_gib=0.0005)  # fmt: skip
    _, info = train_dflash(target, data, teacher, torch.device("cpu"), opts)
    assert info["steps"] == 3 and info["cached_teacher_windows"] >= 1 and info["cached_corpus_windows"] >= 1
    assert info["labels"] == "greedy"  # cross-entropy to the target's greedy token by default
    assert cache_budget(DFlashTraining(seconds=0, seq=16, batch=4, lr=0, block=4, layer_ids=[0], num_layers=1),
                        torch.device("cpu")) == 0.0  # fmt: skip


def test_streamed_teacher_windows_trained(target, monkeypatch):
    """``teacher_outputs="stream"``: the cache holds corpus windows only, and each step's
    teacher windows (its last rows) come from every teacher window with the target's outputs
    computed then, equal to what the cache would hold; with ``"cache"``, the teacher windows
    are the few the cache's half holds."""
    from loraserve.runtime.tools.distill import dflash_train as dflash_training

    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    teacher = torch.randint(0, 64, (200, 17), generator=torch.Generator().manual_seed(5))
    steps = []
    real = dflash_training.dflash_loss

    def spy(draft, target_, window, opts, gen, cached=None, teacher_rows=0, forward=None):
        steps.append((window.clone(), cached[0].clone(), teacher_rows))
        return real(draft, target_, window, opts, gen, cached, teacher_rows, forward)

    monkeypatch.setattr(dflash_training, "dflash_loss", spy)
    opts = DFlashTraining(seconds=600, seq=16, batch=8, lr=3e-3, block=4, layer_ids=[0], blocks=3, max_steps=12,
                          cache_gib=0.00005, teacher_fraction=0.5, teacher_outputs="stream")  # fmt: skip
    _, info = train_dflash(target, data, teacher, torch.device("cpu"), opts)
    assert info["teacher_outputs"] == "stream" and info["cached_teacher_windows"] == 0
    rows_of = {tuple(w.tolist()): i for i, w in enumerate(teacher)}
    streamed = set()
    for window, rows, n in steps:
        assert n == 4 and window.shape[0] == 8
        for w, r in zip(window[4:], rows[4:], strict=True):
            streamed.add(rows_of[tuple(w.tolist())])  # a teacher window ...
            assert torch.equal(r, cached_outputs(target, w[None], [0])[0][0])  # ... with its outputs
        assert all(tuple(w.tolist()) not in rows_of for w in window[:4])  # corpus rows first
    cached = replace(opts, teacher_outputs="cache")
    _, kept = train_dflash(target, data, teacher, torch.device("cpu"), cached)
    assert kept["teacher_outputs"] == "cache" and 1 <= kept["cached_teacher_windows"] < len(streamed)
    with pytest.raises(ValueError, match="teacher_outputs must be cache or stream, got 'disk'"):
        train_dflash(target, data, teacher, torch.device("cpu"), replace(opts, teacher_outputs="disk"))


def test_compiled_forward_trains_eager_draft(target, monkeypatch):
    """``compile``: every step runs the draft's forward compiled, after one compiling step
    outside the clock that leaves the draft and the batches as they were, so the trained
    draft is the eager one's up to the compiler's rounding (streamed teacher windows: the
    target runs in each step too)."""
    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    teacher = torch.randint(0, 64, (40, 17), generator=torch.Generator().manual_seed(5))
    calls = []
    real = torch.compile

    def counted(fn, **kw):
        # Dynamo and AOT autograd as in a real compile, without inductor's C++ build (a minute
        # and a half on 2 cores; the GPU builds Triton kernels instead, never these).
        compiled = real(fn, backend="aot_eager", **kw)
        return lambda *a: calls.append(len(calls)) or compiled(*a)

    monkeypatch.setattr(torch, "compile", counted)
    opts = DFlashTraining(seconds=600, seq=16, batch=4, lr=3e-3, block=4, layer_ids=[0], num_layers=2, blocks=3,
                          max_steps=3, cache_gib=0.0005, teacher_outputs="stream")  # fmt: skip
    eager, plain = train_dflash(target, data, teacher, torch.device("cpu"), opts)
    compiled, info = train_dflash(target, data, teacher, torch.device("cpu"), replace(opts, compile=True))
    assert len(calls) == 1 + 3 and info["compile_seconds"] > 0 and "compile_seconds" not in plain
    assert info["steps"] == plain["steps"] == 3
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_compile_failure_trains_eagerly(target, monkeypatch):
    """A compiler failure costs the run its speed-up, not the run: the draft trains eagerly,
    as without ``compile``, and the record names the error."""
    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))

    def broken(fn, **kw):
        def fail(*a):
            raise RuntimeError("inductor: no C++ compiler")

        return fail

    monkeypatch.setattr(torch, "compile", broken)
    opts = DFlashTraining(
        seconds=600, seq=16, batch=4, lr=3e-3, block=4, layer_ids=[0], blocks=3, max_steps=2
    )
    eager, _ = train_dflash(target, data, None, torch.device("cpu"), opts)
    fell_back, info = train_dflash(target, data, None, torch.device("cpu"), replace(opts, compile=True))
    assert info["steps"] == 2 and "no C++ compiler" in info["compile_error"] and "compile_seconds" not in info
    for a, b in zip(eager.parameters(), fell_back.parameters(), strict=True):
        assert torch.equal(a, b)


def test_probes_judge_periodically(target):
    """``probe_every``: the probe sees the draft after every ``probe_every`` steps, in eval
    mode, as it trains; its own time is not training time: a probe slower than the whole
    budget still leaves the budget's steps to come."""
    import time

    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    seen: list[tuple[bool, torch.Tensor]] = []

    def probe(draft) -> dict:
        seen.append((draft.training, draft.layers[0].q_proj.weight.detach().clone()))
        return {"walk": float(len(seen))}

    opts = DFlashTraining(seconds=600, seq=16, batch=4, lr=3e-3, block=4, layer_ids=[0], num_layers=2,
                          blocks=6, max_steps=7, probe_every=2, cache_gib=0.0)  # fmt: skip
    draft, info = train_dflash(target, data, None, torch.device("cpu"), opts, probe=probe)
    assert [(p["steps"], p["walk"]) for p in info["probes"]] == [(2, 1.0), (4, 2.0), (6, 3.0)]
    assert not any(training for training, _ in seen) and not draft.training  # eval mode while probed
    assert not torch.equal(seen[0][1], seen[-1][1])  # it saw the draft as it trained
    _, plain = train_dflash(target, data, None, torch.device("cpu"), replace(opts, probe_every=0),
                            probe=probe)  # fmt: skip
    assert "probes" not in plain and plain["steps"] == 7

    def slow(draft) -> dict:
        time.sleep(3.5 if not slow.calls else 0.0)  # longer than the whole budget, the first time
        slow.calls += 1
        return {}

    slow.calls = 0
    # 3 s of training: the three steps before the probe leave time for more on a loaded machine
    timed = replace(opts, seconds=3.0, max_steps=None, probe_every=3)
    _, info = train_dflash(target, data, None, torch.device("cpu"), timed, probe=slow)
    assert info["steps"] > 4  # were the probe's 3.5 s counted, training would stop one step after it (4)


def test_draft_init_from_top_layers(target):
    """``init="target"``: draft layer ``j`` of ``n`` holds target layer ``L - n + j``'s
    weights and the draft's final norm the target's; a draft deeper than the target, or an
    unknown init, is refused by name."""
    from loraserve.runtime.tools.distill.dflash_draft import DFlashDraft
    from loraserve.runtime.tools.distill.dflash_train import init_from_target

    def draft(layers: int) -> DFlashDraft:
        return DFlashDraft(LayerDims.of(target.config), target.model.embed_tokens.weight, target.lm_head.weight, layer_ids=[0],
                           num_layers=layers, block=4, mask_id=0, eps=1e-5, rope=RopeFrequencies.of(target.config))  # fmt: skip

    one = draft(1)
    init_from_target(one, target)
    top = target.model.layers[-1]
    assert torch.equal(one.layers[0].q_proj.weight, top.self_attn.q_proj.weight)
    assert torch.equal(one.layers[0].down_proj.weight, top.mlp.down_proj.weight)
    assert torch.equal(one.layers[0].input_layernorm, top.input_layernorm.weight)
    assert torch.equal(one.norm, target.model.norm.weight)
    assert torch.equal(one.layers[0].q_norm, torch.ones_like(one.layers[0].q_norm))  # the target has none
    two = draft(2)
    init_from_target(two, target)
    assert torch.equal(two.layers[0].gate_proj.weight, target.model.layers[0].mlp.gate_proj.weight)
    with pytest.raises(ValueError, match="a 3-layer draft cannot start from a 2-layer target"):
        init_from_target(draft(3), target)
    data = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(4))
    opts = DFlashTraining(seconds=600, seq=16, batch=4, lr=3e-3, block=4, layer_ids=[0], num_layers=1,
                          blocks=6, max_steps=1, init="copied")  # fmt: skip
    with pytest.raises(ValueError, match="init must be random or target, got 'copied'"):
        train_dflash(target, data, None, torch.device("cpu"), opts)


def test_training_features_match_serving(tmp_path):
    """For every target layer either spread picks on an 8-layer target, ``target_outputs``
    (what training reads) equals what the runtime's target forward captures for the draft
    (what serving feeds it); layer ``L-1``, whose Hugging Face output is normed where the
    served one is not, is refused by name. A draft trained over ``L-1`` (the top spread
    once did) was served other features than it learnt on: it drafted other tokens."""
    from loraserve.kernels import ForwardMode
    from loraserve.runtime.contract.config import RuntimeConfig
    from loraserve.runtime.dev.devmodels import copy_tokenizer, write_tokenizer
    from loraserve.runtime.model.arch import ModelConfigError
    from loraserve.runtime.runner.forward_batch import ForwardBatch
    from loraserve.runtime.runner.model_runner import ModelRunner
    from loraserve.runtime.tools.distill.dflash_train import dflash_layer_ids, target_outputs

    small = tiny_llama(128, 8, 4, 2, 32, 384, vocab=512, seed=2)
    small.to(torch.bfloat16).save_pretrained(str(tmp_path / "target"))
    copy_tokenizer(write_tokenizer(tmp_path / "tok", 512), tmp_path / "target")
    small.float()  # the bfloat16 values the runtime loads, computed in float32 as it does
    config = RuntimeConfig()
    config.model.path = str(tmp_path / "target")
    config.device, config.model.dtype = "cpu", "float32"
    config.scheduler.max_total_tokens = 256
    runner = ModelRunner(config)
    window = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    ids = sorted(
        {i for n in range(1, 8) for spread in ("reference", "top") for i in dflash_layer_ids(8, n, spread)}
    )
    assert ids == list(range(1, 7))  # every capturable layer but the embeddings' 0
    out = runner.forward(ForwardBatch(ForwardMode.EXTEND, ["r"], window[0], extend_lens=[40],
                                      hidden_layers=tuple(i + 1 for i in ids)))  # fmt: skip
    runner.kv.free("r")
    trained, _ = target_outputs(small, window, ids)
    assert torch.allclose(trained[0], out.aux_hidden_states, atol=1e-4, rtol=1e-4)
    with pytest.raises(ModelConfigError, match="names layer 7, but the target has 8 layers"):
        target_outputs(small, window, [1, 7])
    # why: the stream a forward captures after the last layer is not Hugging Face's last state
    last = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, ["r"], window[0], extend_lens=[40], hidden_layers=(8,))
    )
    with torch.no_grad():
        normed = small.model(input_ids=window, output_hidden_states=True).hidden_states[8][0]
    assert not torch.allclose(normed, last.aux_hidden_states, atol=1e-2)
