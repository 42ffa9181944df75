"""Oracle: our runner's logits equal transformers' (+ peft) on the same weights, in every mode."""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import ADAPTERS, MODEL_KINDS

TOL = 2e-4  # fp32; both sides are float32 on the CPU


def _check_modes(runner, reference, ops, names=None, seed=0):
    """Extend two prompts, decode two steps, verify three tokens; compare every logit row."""
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (11, 5)]
    rids = ["r0", "r1"]
    out = ops.extend(runner, rids, prompts, names=names, all_logits=True)
    rows = 0
    for prompt in prompts:
        ref = reference(prompt[None]).logits[0]
        torch.testing.assert_close(out.logits[rows : rows + len(prompt)], ref, atol=TOL, rtol=0)
        rows += len(prompt)
    seqs = [p.clone() for p in prompts]
    for _ in range(2):
        nxt = torch.randint(3, vocab, (2,), generator=gen)
        out = ops.decode(runner, rids, nxt, names=names)
        for i in range(2):
            seqs[i] = torch.cat([seqs[i], nxt[i : i + 1]])
            ref = reference(seqs[i][None]).logits[0, -1]
            torch.testing.assert_close(out.logits[i], ref, atol=TOL, rtol=0)
    blocks = [torch.randint(3, vocab, (3,), generator=gen) for _ in range(2)]
    out = ops.verify(runner, rids, blocks, names=names)
    assert out.logits.shape == (6, vocab)
    for i in range(2):
        full = torch.cat([seqs[i], blocks[i]])
        ref = reference(full[None]).logits[0, -3:]
        torch.testing.assert_close(out.logits[3 * i : 3 * i + 3], ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("kind", sorted(MODEL_KINDS))
def test_base_logits_match_transformers(kind, assets, make_runner, hf_model, ops):
    model_dir = assets.models[kind]
    runner = make_runner(model_dir)
    with torch.no_grad():
        _check_modes(runner, hf_model(model_dir), ops)


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_adapter_logits_match_peft(adapter, assets, make_runner, hf_model, ops):
    model_dir = assets.models["llama-gqa"]
    runner = make_runner(model_dir, adapters={adapter: assets.adapters[adapter]})
    reference = hf_model(model_dir, assets.adapters[adapter])
    with torch.no_grad():
        _check_modes(runner, reference, ops, names=[adapter, adapter], seed=1)
        # and the adapter really matters: the base model's logits differ
        base = hf_model(model_dir)
        prompt = torch.arange(3, 12)[None]
        assert (reference(prompt).logits - base(prompt).logits).abs().max() > 1e-2


@pytest.mark.parametrize("adapter", [None, "all-r16", "emb-head"])
def test_greedy_generation_matches_transformers(adapter, assets, make_runner, hf_model, ops):
    model_dir = assets.models["llama-gqa"]
    adapters = {adapter: assets.adapters[adapter]} if adapter else {}
    runner = make_runner(model_dir, adapters=adapters)
    reference = hf_model(model_dir, assets.adapters[adapter] if adapter else None)
    prompt = torch.tensor([1, 306, 395, 347, 486, 10, 308, 334])
    with torch.no_grad():
        expected = reference.generate(
            input_ids=prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    names = [adapter]
    out = ops.extend(runner, ["g"], [prompt], names=names)
    tokens = [int(out.logits[0].argmax())]
    while len(tokens) < 32:
        out = ops.decode(runner, ["g"], [tokens[-1]], names=names)
        tokens.append(int(out.logits[0].argmax()))
    assert tokens == expected
    assert runner.kv.seq_len("g") == len(prompt) + 31


def test_hidden_states_match_transformers(assets, make_runner, hf_model, ops):
    """return_hidden = HF's final normed state; hidden_layers = HF's per-layer residual stream."""
    model_dir = assets.models["llama-gqa"]
    runner = make_runner(model_dir)
    prompt = torch.arange(5, 18)
    out = ops.extend(runner, ["h"], [prompt], return_hidden=True, hidden_layers=(0, 1, 2))
    with torch.no_grad():
        ref = hf_model(model_dir)(prompt[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(out.hidden_states, ref[-1][0], atol=TOL, rtol=0)
    h = runner.hidden_size
    assert out.aux_hidden_states.shape == (len(prompt), 3 * h)
    for pos, layer in enumerate((0, 1)):
        torch.testing.assert_close(out.aux_hidden_states[:, pos * h : (pos + 1) * h], ref[layer][0], atol=TOL, rtol=0)
    # hidden_layers == num_layers: the un-normed stream, whose norm is the final hidden state
    final = runner.model.model.norm(out.aux_hidden_states[:, 2 * h :])
    torch.testing.assert_close(final, out.hidden_states, atol=TOL, rtol=0)


def test_bf16_runner_tracks_transformers_bf16(assets, make_config, hf_model, ops):
    """bf16 end to end: same dtype as HF in bf16, so errors stay at bf16 rounding level."""
    from transformers import AutoModelForCausalLM

    from loraserve.runtime.runner.model_runner import ModelRunner

    model_dir = assets.models["llama-gqa"]
    config = make_config(model_dir)
    config.model.dtype = "bfloat16"
    runner = ModelRunner(config)
    assert runner.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    fp32 = hf_model(model_dir)
    prompt = torch.arange(3, 20)
    out = ops.extend(runner, ["b"], [prompt], all_logits=True)
    with torch.no_grad():
        ref = reference(prompt[None]).logits[0].float()
        exact = fp32(prompt[None]).logits[0]
    err_ours = (out.logits - exact).abs().max()
    err_hf = (ref - exact).abs().max()
    assert err_ours <= 2 * err_hf + 1e-3, (err_ours, err_hf)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1")
def test_triton_backend_mixed_batch_matches_peft(assets, make_runner, hf_model, ops):
    """The runner on the Triton LoRA kernels (interpreted on the CPU) against peft, per request."""
    model_dir = assets.models["llama-gqa"]
    names = ["emb-head", None, "all-r16"]
    runner = make_runner(model_dir, adapters={n: assets.adapters[n] for n in names if n}, backend="triton")
    assert runner.lora.backend.name == "triton"
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (6, 9, 4)]
    out = ops.extend(runner, ["t0", "t1", "t2"], prompts, names=names)
    step = torch.randint(3, 512, (3,), generator=gen)
    dec = ops.decode(runner, ["t0", "t1", "t2"], step, names=names)
    with torch.no_grad():
        for i, name in enumerate(names):
            ref = hf_model(model_dir, assets.adapters[name] if name else None)
            torch.testing.assert_close(out.logits[i], ref(prompts[i][None]).logits[0, -1], atol=TOL, rtol=0)
            full = torch.cat([prompts[i], step[i : i + 1]])[None]
            torch.testing.assert_close(dec.logits[i], ref(full).logits[0, -1], atol=TOL, rtol=0)
