"""DFLASH: a block of drafts in one forward, from the target's captured layer outputs.

- the checkpoint format (z-lab's ``DFlashDraftModel`` config fields, defaults, refusals);
- the mask token's order of fallbacks and the error when none exists;
- the draft's math against an independent re-derivation of the reference model over
  Hugging Face's ``output_hidden_states`` of the target (the capture mapping included);
- greedy speculation is lossless per adapter in mixed concurrent batches;
- proposals never see a target adapter (embed_tokens / lm_head taken unwrapped);
- sampled output keeps the target's law (chi-square; slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraserve.kernels import ForwardMode
from loraserve.runtime.dev.dflash_builder import build_dflash_draft, dflash_draft_config
from loraserve.runtime.model.arch import ModelConfigError, arch_from_dict
from loraserve.runtime.runner.forward_batch import ForwardBatch
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import Sampler, SamplingParams
from loraserve.runtime.speculative.dflash.format import (
    DEFAULT_MASK_TOKEN,
    default_target_layer_ids,
    dflash_config_from_dict,
    load_dflash_config,
    resolve_mask_token_id,
)

ADAPTERS = ("attn-r8", "all-r16", "mlp-r4", "emb-head")


@pytest.fixture(scope="module")
def drafts(spec_assets, tmp_path_factory) -> dict[str, Path]:
    """DFLASH drafts for the tiny 3-layer target: one layer over layers 0 and 1 (block 4),
    two layers over layer 1 (block 6)."""
    root = tmp_path_factory.mktemp("dflash")
    return {
        "one": build_dflash_draft(root / "one", spec_assets.target, target_layer_ids=[0, 1], block_size=4, seed=41,
                                  init_std=0.1),
        "two": build_dflash_draft(root / "two", spec_assets.target, num_layers=2, target_layer_ids=[1], block_size=6,
                                  seed=42, init_std=0.1),
    }  # fmt: skip


def accepting_draft(dest: Path, target_dir: Path, outputs: list[list[int]], *, block_size: int = 6) -> Path:
    """A DFLASH draft whose blocks the target accepts: its layer adds nothing to the stream
    (``o_proj`` and ``down_proj`` zero), so every block position proposes the same token,
    ``argmax lm_head(norm(embed(mask)))``; the mask token is picked so that this is the token
    the target emits most often in ``outputs`` (of those some mask token maps to). Random
    drafts are never accepted under greedy decoding, which leaves a greedy oracle testing
    rejections alone; with this one, drafts are accepted wherever the target emits that
    token. On the test target, which repeats that token in runs, the accepted blocks are
    whole ones (every draft and the bonus token); partial accepts are the other drafts'
    oracles' (``test_greedy_oracle.py``)."""
    from safetensors.torch import load_file, save_file

    weights = {}
    for f in Path(target_dir).glob("*.safetensors"):
        weights.update(load_file(f))
    embed = weights["model.embed_tokens.weight"].double()
    head = weights.get("lm_head.weight", embed).double()
    eps = float(json.loads((Path(target_dir) / "config.json").read_text()).get("rms_norm_eps", 1e-6))
    image = ((embed * torch.rsqrt(embed.pow(2).mean(-1, keepdim=True) + eps)) @ head.T).argmax(-1)
    counts = torch.bincount(torch.tensor([t for out in outputs for t in out]), minlength=image.numel())
    for token in counts.argsort(descending=True).tolist():
        masks = (image == token).nonzero().flatten()
        if masks.numel():
            break
    else:
        raise AssertionError("no mask token maps to any token the target emits")
    build_dflash_draft(dest, target_dir, target_layer_ids=[1], block_size=block_size, mask_token_id=int(masks[0]))
    tensors = load_file(dest / "model.safetensors")
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _config(make_spec_config, draft: Path, *, k: int = 4, **sched):
    config = make_spec_config("DFLASH", None, k=k, **sched)
    config.speculative.draft_model_path = str(draft)
    return config


def _target_raw(spec_assets) -> dict:
    return json.loads((spec_assets.target / "config.json").read_text())


# --------------------------------------------------------------------------- format


def test_real_checkpoint_config_read(spec_assets):
    """Config fields of real checkpoints are read."""
    raw = dflash_draft_config(spec_assets.target, num_layers=2, target_layer_ids=[0, 1], block_size=16)
    raw["block_size"] = 8  # the older top-level spelling loses to dflash_config.block_size
    config = dflash_config_from_dict(raw, target_num_layers=3)
    assert config.block_size == 16 and config.target_layer_ids == (0, 1) and config.num_layers == 2
    assert config.capture_layers == (1, 2)  # HF hidden_states[i + 1]: the stream entering layer i + 1
    assert config.fc_in_features == 2 * config.hidden_size
    del raw["dflash_config"]["block_size"]
    assert dflash_config_from_dict(raw, target_num_layers=3).block_size == 8
    raw["target_layer_ids"] = raw["dflash_config"].pop("target_layer_ids")  # top-level spelling
    assert dflash_config_from_dict(raw, target_num_layers=3).target_layer_ids == (0, 1)
    del raw["target_layer_ids"]
    raw["num_target_layers"] = 36
    assert dflash_config_from_dict(raw, target_num_layers=3).target_layer_ids == default_target_layer_ids(
        36, 2
    )


def test_default_target_layers():
    """Default target layers follow the reference."""
    assert default_target_layer_ids(32, 1) == (16,)  # one draft layer: the middle layer
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # evenly from 1 to L - 3 (Qwen3-8B's)
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)
    with pytest.raises(ModelConfigError, match="at least 4 layers"):
        default_target_layer_ids(3, 2)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
        ({"architectures": ["LlamaForCausalLM"]}, "not a DFLASH draft"),
        ({"layer_types": ["sliding_attention"]}, "sliding-window"),
        ({"dflash_config": {"target_layer_ids": []}}, "target_layer_ids"),
        ({"dflash_config": {"target_layer_ids": [1, 1]}}, "distinct"),
        ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": -1}}, "mask_token_id"),
        ({"dflash_config": {"target_layer_ids": [0], "block_size": 0}}, "block_size"),
    ],
)
def test_malformed_configs_are_refused(spec_assets, change, message):
    raw = {**dflash_draft_config(spec_assets.target, target_layer_ids=[0]), **change}
    with pytest.raises(ModelConfigError, match=message):
        dflash_config_from_dict(raw, target_num_layers=3)


def test_target_and_block_checks(spec_assets):
    target = arch_from_dict(_target_raw(spec_assets))
    for ids in ([2], [-1]):  # the last layer's output (normed in HF's hidden_states) and nonsense
        raw = dflash_draft_config(spec_assets.target, target_layer_ids=ids)
        with pytest.raises(ModelConfigError, match="target_layer_ids"):
            dflash_config_from_dict(raw, target_num_layers=3).check_target(target)
    config = dflash_config_from_dict(
        dflash_draft_config(spec_assets.target, block_size=4), target_num_layers=3
    )
    config.check_block(4)
    config.check_block(2)  # a shorter block than trained: fewer masks, still a valid draft
    with pytest.raises(ModelConfigError, match="block_size 4"):
        config.check_block(5)


def test_too_wide_block_refused(make_spec_config, drafts):
    """A block wider than the checkpoint is refused at start up."""
    from loraserve.runtime.speculative import build_decoder
    from loraserve.runtime.speculative.draft_config import SpeculativeConfigError

    runner = ModelRunner(make_spec_config())
    with pytest.raises(SpeculativeConfigError, match="block_size 4") as err:
        build_decoder(config=_config(make_spec_config, drafts["one"], k=5), runner=runner, sampler=Sampler(0))
    assert err.value.field == "speculative.num_draft_tokens"


def test_checkpoint_tensors_are_checked(spec_assets, tmp_path):
    from safetensors.torch import load_file, save_file

    from loraserve.runtime.speculative.dflash.format import load_dflash_tensors

    draft = build_dflash_draft(tmp_path / "d", spec_assets.target, target_layer_ids=[0])
    config = load_dflash_config(draft, target_num_layers=3)
    tensors = load_file(str(draft / "model.safetensors"))
    # A copy of the target's embedding and an HF "model." prefix are tolerated.
    extra = {f"model.{k}": v for k, v in tensors.items()}
    extra["embed_tokens.weight"] = torch.zeros(config.layer.vocab_size, config.hidden_size)
    save_file(extra, str(draft / "model.safetensors"))
    assert set(load_dflash_tensors(draft, config)) == set(config.tensor_shapes())
    del tensors["layers.0.self_attn.k_norm.weight"]
    save_file(tensors, str(draft / "model.safetensors"))
    with pytest.raises(ModelConfigError, match="k_norm"):
        load_dflash_tensors(draft, config)


# --------------------------------------------------------------------------- mask token


def _tokenizer(directory: Path, tokens: dict[str, int], *, declared: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": tokens}, "added_tokens": []}))
    if declared is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"mask_token": declared}))
    return directory


def _mask_config(spec_assets, **kw):
    raw = dflash_draft_config(spec_assets.target, target_layer_ids=[0], **kw)
    return dflash_config_from_dict(raw, target_num_layers=3)


def test_mask_token_fallbacks_in_order(spec_assets, tmp_path):
    vocab = 512
    target = _tokenizer(tmp_path / "target", {"a": 0, "b": 1, DEFAULT_MASK_TOKEN: 300})
    draft = _tokenizer(tmp_path / "draft", {"a": 0, DEFAULT_MASK_TOKEN: 200, "<m>": 7}, declared="<m>")
    resolve = lambda config, d=draft, t=target: resolve_mask_token_id(  # noqa: E731
        config, draft_dir=d, target_dir=t, vocab_size=vocab
    )
    # 1. the config's id
    assert resolve(_mask_config(spec_assets, mask_token_id=9))[0] == 9
    # 2. the mask token's text: the draft's tokenizer first, then the target's
    assert resolve(_mask_config(spec_assets, mask_token_id=None))[0] == 200
    assert resolve(_mask_config(spec_assets, mask_token_id=None), d=tmp_path / "none")[0] == 300
    assert resolve(_mask_config(spec_assets, mask_token_id=None, mask_token="<m>"))[0] == 7
    # 3. the mask token a tokenizer declares
    no_text = _tokenizer(tmp_path / "target2", {"a": 0, "<m>": 5})
    declares = _tokenizer(tmp_path / "draft2", {"a": 0, "<m>": 7}, declared="<m>")
    assert resolve(_mask_config(spec_assets, mask_token_id=None), d=declares, t=no_text)[0] == 7
    # 4. the first embedding row past the target's tokenizer (the reference's added token)
    config = _mask_config(spec_assets, mask_token_id=None)
    token, source = resolve(config, d=tmp_path / "none", t=no_text)
    assert token == 6 and "past the tokenizer" in source


def test_mask_token_errors(spec_assets, tmp_path):
    config = _mask_config(spec_assets, mask_token_id=None)
    # The tiny target's tokenizer fills its whole embedding and has no mask token.
    with pytest.raises(ModelConfigError, match=r"dflash_config\.mask_token_id"):
        resolve_mask_token_id(config, draft_dir=tmp_path, target_dir=spec_assets.target, vocab_size=512)
    with pytest.raises(ModelConfigError, match="outside the target's vocabulary"):
        resolve_mask_token_id(
            _mask_config(spec_assets, mask_token_id=512), draft_dir=tmp_path, target_dir=spec_assets.target,
            vocab_size=512,
        )  # fmt: skip


# --------------------------------------------------------------------------- the math


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _reference_block(
    draft: Path, target: Path, prompt: list[int], last: int, width: int, mask: int
) -> torch.Tensor:
    """The reference model's block logits, re-derived from its published equations over
    Hugging Face's ``output_hidden_states`` (HF layer ``i``'s output is ``hidden_states[i+1]``)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    raw = json.loads((draft / "config.json").read_text())
    w = load_file(str(draft / "model.safetensors"))
    heads, kvh, d = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    theta = raw["rope_parameters"]["rope_theta"]
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        feats = torch.cat([states[i + 1][0] for i in raw["dflash_config"]["target_layer_ids"]], -1)
        ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
        emb, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        x = emb[torch.tensor([last] + [mask] * (width - 1))]
        n = len(prompt)
        for j in range(raw["num_hidden_layers"]):
            p = lambda name, j=j: w[f"layers.{j}.{name}.weight"]  # noqa: E731
            h = _rms(x, p("input_layernorm"))
            q = _rms((h @ p("self_attn.q_proj").T).view(width, heads, d), p("self_attn.q_norm"))
            k = torch.cat([ctx, h]) @ p("self_attn.k_proj").T
            k = _rms(k.view(n + width, kvh, d), p("self_attn.k_norm"))
            v = (torch.cat([ctx, h]) @ p("self_attn.v_proj").T).view(n + width, kvh, d)
            q, k = _rope(q, torch.arange(n, n + width), theta), _rope(k, torch.arange(n + width), theta)
            k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * d**-0.5, -1)  # no mask: all visible
            out = torch.einsum("hqk,khd->qhd", att, v).reshape(width, heads * d)
            x = x + out @ p("self_attn.o_proj").T
            m = _rms(x, p("post_attention_layernorm"))
            x = x + (F.silu(m @ p("mlp.gate_proj").T) * (m @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
        return (_rms(x, w["norm.weight"]) @ head.T)[1:]


@pytest.mark.parametrize("which", ["one", "two"])
def test_block_logits_match_reference(spec_assets, make_spec_config, drafts, which):
    """Block logits match the reference equations."""
    from loraserve.runtime.speculative import build_decoder

    width = 4
    runner = ModelRunner(make_spec_config())
    drafter = build_decoder(
        config=_config(make_spec_config, drafts[which], k=width), runner=runner, sampler=Sampler(0)
    ).drafter
    prompt = [5, 17, 99, 3, 250, 42, 8, 77, 31]
    out = runner.forward(
        ForwardBatch(ForwardMode.EXTEND, ["p"], torch.tensor(prompt), extend_lens=[len(prompt)],
                     hidden_layers=drafter.hidden_layers)
    )  # fmt: skip
    drafter.runner.append_context(["p"], out.aux_hidden_states, [len(prompt)])
    mask = drafter.runner.mask_token_id
    ours = drafter.runner.draft_block(["p"], torch.tensor([123]), width)[0]
    expected = _reference_block(drafts[which], spec_assets.target, prompt, 123, width, mask)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    assert drafter.runner.held("p") == len(prompt)  # the block's entries are gone again


# --------------------------------------------------------------------------- greedy oracle


def _requests(count: int = 12, seed: int = 0, max_tokens: int = 16):
    gen = torch.Generator().manual_seed(seed)
    names = [None, *ADAPTERS]
    out = []
    for i in range(count):
        n = int(torch.randint(3, 36, (1,), generator=gen))
        if i % 3 == 0:
            unit = torch.randint(3, 500, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)
            prompt = unit.repeat(n // unit.numel() + 1)[:n].tolist()
        else:
            prompt = torch.randint(3, 500, (n,), generator=gen).tolist()
        out.append(
            (f"r{i}", prompt, SamplingParams(max_tokens=max_tokens - (i % 4), temperature=0.0), names[i % 5])
        )
    return out


@pytest.fixture(scope="module")
def baseline(make_spec_config, engine_run):
    requests = _requests()
    run = engine_run(make_spec_config(), requests)
    return requests, {rid: run.outputs[rid].tokens for rid, *_ in requests}


@pytest.mark.parametrize(
    "which,k,max_running", [("one", 4, 1), ("one", 4, 12), ("two", 6, 5), ("two", 3, 12)]
)
def test_greedy_output_is_identical_per_adapter(
    make_spec_config, engine_run, baseline, drafts, which, k, max_running
):
    requests, expected = baseline
    run = engine_run(
        _config(make_spec_config, drafts[which], k=k, max_running_requests=max_running), requests
    )
    for rid, _, _, adapter in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}) diverged"
        assert out.spec is not None and out.spec.verify_steps >= 1
        assert out.spec.draft_tokens == (k - 1) * out.spec.verify_steps
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.algorithm == "DFLASH"
    assert set(snap.per_adapter) == {"", *ADAPTERS}


@pytest.fixture(scope="module")
def accepting(spec_assets, baseline, tmp_path_factory) -> Path:
    """:func:`accepting_draft` for the baseline's outputs."""
    _, expected = baseline
    return accepting_draft(tmp_path_factory.mktemp("dflash") / "accepting", spec_assets.target, list(expected.values()))


@pytest.mark.parametrize("k,max_running", [(6, 1), (4, 12)])
def test_greedy_identical_accepted(
    make_spec_config, engine_run, baseline, accepting, k, max_running
):
    """The oracle with drafts the target accepts (whole blocks, several drafts a step): the
    accepted rows' KV, the draft's context appended from them and the bonus token all feed
    the next step, and the output stays plain decoding's per adapter."""
    requests, expected = baseline
    run = engine_run(_config(make_spec_config, accepting, k=k, max_running_requests=max_running), requests)
    for rid, _, _, adapter in requests:
        out = run.outputs[rid]
        assert out.error is None, (rid, out.error)
        assert out.tokens == expected[rid], f"{rid} (adapter {adapter}) diverged"
    stats = run.engine.decoder.metrics.snapshot().overall
    assert stats.accepted_tokens > 0 and sum(stats.histogram[2:]) > 0, stats  # steps accepting several drafts


def test_greedy_identical_chunked(
    make_spec_config, engine_run, baseline, drafts
):
    """Prefill in chunks (context appended chunk by chunk) and steps too large to draft
    (the context still grows through ``on_decode``)."""
    requests, expected = baseline
    config = _config(make_spec_config, drafts["one"], max_running_requests=12, chunked_prefill_size=16)
    config.speculative.disable_batch_size = 7
    run = engine_run(config, requests)
    for rid, *_ in requests:
        assert run.outputs[rid].tokens == expected[rid], rid
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.overall.verify_steps > 0 and snap.undrafted_steps > 0


# --------------------------------------------------------------------------- independence


class _Wrapped(torch.nn.Module):
    """A PEFT-style wrapper whose own weight carries an adapter's merged delta."""

    def __init__(self, base: torch.nn.Module, delta: torch.Tensor):
        super().__init__()
        self.base_layer = base
        self.weight = torch.nn.Parameter(base.weight.detach() + delta, requires_grad=False)

    def forward(self, x):  # pragma: no cover - never called by a correct draft
        raise AssertionError("the draft called the target's adapted module")


def _replay_proposals(drafter, log) -> list[torch.Tensor]:
    out = []
    for kind, args in log:
        if kind == "append":
            drafter.runner.append_context(*args)
        else:
            out.append(drafter.runner.draft(*args))
    return out


def test_proposals_ignore_head_adapter(
    make_spec_config, engine_run, drafts
):
    """Serving the emb-head adapter (embed_tokens + lm_head + v_proj) among others, with the
    target's embed_tokens and lm_head WRAPPED in adapter-carrying modules: every draft call
    replayed on a draft built beside a plain target (no adapters at all) gives bit-identical
    proposals and hidden rows (the logits of sampled drafts). A draft that took the wrapped weights, or ran the target's adapter hooks, fails."""
    config = _config(make_spec_config, drafts["one"], max_running_requests=6)
    runner = ModelRunner(config)
    gen = torch.Generator().manual_seed(5)
    base_embed, base_head = runner.model.model.embed_tokens, runner.model.lm_head
    runner.model.model.embed_tokens = _Wrapped(
        base_embed, torch.randn(base_embed.weight.shape, generator=gen)
    )
    runner.model.lm_head = _Wrapped(base_head, torch.randn(base_head.weight.shape, generator=gen))
    log: list = []

    def spy(decoder):
        inner = decoder.drafter.runner
        assert inner.lora is None and inner.model.lora is None
        assert inner.model._embed_weight.data_ptr() == base_embed.weight.data_ptr()
        assert inner.model._head_weight.data_ptr() == base_head.weight.data_ptr()
        append, block = inner.append_context, inner.draft

        def appending(rids, feats, lens):
            log.append(("append", (list(rids), feats.clone(), list(lens))))
            return append(rids, feats, lens)

        def drafting(rids, first, width):
            tokens, hidden = block(rids, first, width)
            log.append(("block", (list(rids), first.clone(), width)))
            recorded.append((tokens.clone(), hidden.clone()))
            return tokens, hidden

        inner.append_context, inner.draft = appending, drafting
        # the engine's target must not run the wrapped modules: restore them for serving
        runner.model.model.embed_tokens, runner.model.lm_head = base_embed, base_head

    recorded: list[tuple[torch.Tensor, torch.Tensor]] = []
    # every other request serves the emb-head adapter, the rest a mix of the others and the base
    requests = [
        (f"a{i}", p, params, "emb-head" if i % 2 else name)
        for i, (_, p, params, name) in enumerate(_requests(count=10, seed=3))
    ]
    run = engine_run(config, requests, runner=runner, decoder_hook=spy)
    assert all(run.outputs[rid].error is None for rid, *_ in requests)
    assert recorded and any(kind == "append" for kind, _ in log)

    plain_config = _config(make_spec_config, drafts["one"])
    plain_config.lora.adapters = {}
    plain_config.lora.enabled = False
    from loraserve.runtime.speculative import build_decoder

    plain = build_decoder(config=plain_config, runner=ModelRunner(plain_config), sampler=Sampler(0)).drafter
    replayed = _replay_proposals(plain, log)
    assert len(replayed) == len(recorded)
    for ours, theirs in zip(recorded, replayed, strict=True):
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_adapter_context_not_in_draft(make_spec_config, drafts):
    """With the emb-head adapter's LoRA context set on the target (as during its forward),
    the draft's mask-block embedding and logits are unchanged, bit for bit."""
    from loraserve.runtime.speculative import build_decoder

    runner = ModelRunner(make_spec_config())
    drafter = build_decoder(
        config=_config(make_spec_config, drafts["one"]), runner=runner, sampler=Sampler(0)
    ).drafter
    feats = torch.randn(7, len(drafter.hidden_layers) * runner.hidden_size)
    drafter.runner.append_context(["x"], feats, [7])
    ids = torch.tensor([drafter.runner.mask_token_id, 3, 9])
    plain_logits = drafter.runner.draft_block(["x"], torch.tensor([11]), 4)
    plain_embed = drafter.runner.model.embed(ids)
    hidden = torch.randn(3, runner.hidden_size)
    target_plain = runner.model.compute_logits(hidden)
    slots = runner.lora.prepare_batch(["emb-head"] * 3)
    info = runner.lora.batch_info(ForwardMode.EXTEND, slots, extend_lens=[1] * 3)
    runner.lora.ctx.set(info, info)
    try:
        assert (runner.model.compute_logits(hidden) - target_plain).abs().max() > 1e-3  # the adapter is live
        assert torch.equal(drafter.runner.draft_block(["x"], torch.tensor([11]), 4), plain_logits)
        assert torch.equal(drafter.runner.model.embed(ids), plain_embed)
    finally:
        runner.lora.ctx.clear()


# --------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_sampled_joint_law(make_spec_config, engine_run, chi_square, drafts):
    """As tests/spec/test_sampling_oracle.py, with DFLASH drafting (each block position drawn
    from the draft's marginal there) and the emb-head adapter."""
    from .joint_law import reference_law, sampled_counts
    from .test_sampling_oracle import ALPHA, NUM_REQUESTS, PROMPT, _params

    adapter = "emb-head"
    config = _config(make_spec_config, drafts["one"], max_running_requests=64)
    requests = [(f"s{i}", PROMPT, _params(1000 + i), adapter) for i in range(NUM_REQUESTS)]
    run = engine_run(config, requests, timeout_s=600)
    counts = sampled_counts(run, requests)
    snap = run.engine.decoder.metrics.snapshot()
    assert snap.overall.verify_steps >= NUM_REQUESTS
    assert snap.overall.accepted_tokens > 0  # the accept path ran, not only resampling
    reference = reference_law(ModelRunner(make_spec_config()), adapter, PROMPT, _params(0))
    support = reference > 0
    assert counts[~support].sum() == 0
    assert chi_square(counts[support], reference[support]) > ALPHA


# --------------------------------------------------------------------------- the contract


def test_policy_dflash_lora_no_trees(make_spec_config, drafts):
    """This image's capabilities: DFLASH with adapters, a block of any width (num_steps
    unused; the checkpoint's block_size bounds it at start-up), CUDA graphs; trees refused."""
    from loraserve.runtime.contract import policy

    config = _config(make_spec_config, drafts["one"])
    config.device = "cuda"  # CUDA graphs are refused on the CPU, whatever the algorithm
    config.cuda_graph.enabled = True
    config.cuda_graph.max_bs = config.scheduler.max_running_requests
    config.speculative.num_steps, config.speculative.num_draft_tokens = 3, 16
    report = policy.check_config(config)
    assert not report.violations, [v.render() for v in report.violations]
    config.speculative.top_k = 2
    rules = {v.rule for v in policy.check_config(config).violations}
    assert "tree-algorithm" in rules
    config.speculative.top_k, config.speculative.algorithm = 1, "DSPARK"
    rules = {v.rule for v in policy.check_config(config).violations}
    assert "algorithm-unavailable" in rules  # DSPARK stays not available in this image
