"""EAGLE / EAGLE3 draft checkpoints: format checks, and the cached draft layer vs a float64 reference."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraserve.runtime.model import ModelConfigError, build_model, load_arch_config
from loraserve.runtime.speculative.eagle.builder import build_eagle_draft
from loraserve.runtime.speculative.eagle.format import load_eagle_config, load_eagle_tensors
from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner

from .conftest import eagle_runner


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from loraserve.runtime.dev.devmodels import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("eagle-target") / "model", num_layers=3, seed=5)
    arch = load_arch_config(path)
    model = build_model(
        arch, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, model_dir=path
    )
    return path, arch, model


def _runner(draft_dir, arch, model, **kw) -> EagleDraftRunner:
    """A CPU float32 draft runner over the module's target (``kw`` overrides the sizes)."""
    sizes = {"max_total_tokens": 128, "max_requests": 4, "max_context_len": 64, **kw}
    return eagle_runner(draft_dir, arch, model, **sizes)


def _rms(x, w, eps):
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _reference(cfg, t, embed, lm_head, ids, feats):
    """The draft equations of eagle_format, for one sequence at positions 0..T-1, in float64."""
    layer = cfg.layer
    eps, hd = layer.rms_norm_eps, layer.head_dim
    w = {k: v.double() for k, v in t.items()}
    emb = embed.double()[ids]
    feats = feats.double()
    if cfg.version == 3:
        feature = feats @ w["fc.weight"].T if feats.shape[-1] != cfg.hidden_size else feats
        x = torch.cat(
            [
                _rms(emb, w["layers.0.input_layernorm.weight"], eps),
                _rms(feature, w["layers.0.hidden_norm.weight"], eps),
            ],
            -1,
        )
        residual = feature
    else:
        residual = torch.cat([emb, feats], -1) @ w["fc.weight"].T
        norm = w.get("layers.0.input_layernorm.weight")
        x = residual if norm is None else _rms(residual, norm, eps)
    T = ids.numel()
    pos = torch.arange(T)
    q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(T, layer.num_heads, hd)
    k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(T, layer.num_kv_heads, hd)
    v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(T, layer.num_kv_heads, hd)
    q, k = _rope(q, pos, layer.rope.theta), _rope(k, pos, layer.rope.theta)
    rep = layer.num_heads // layer.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, -1)
    h = residual + attn @ w["layers.0.self_attn.o_proj.weight"].T
    m = _rms(h, w["layers.0.post_attention_layernorm.weight"], eps)
    gate, up = m @ w["layers.0.mlp.gate_proj.weight"].T, m @ w["layers.0.mlp.up_proj.weight"].T
    out = h + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T
    logits_in = _rms(out, w["norm.weight"], eps) if cfg.version == 3 else out
    return out, logits_in @ lm_head.double().T


@pytest.mark.parametrize(
    "version,input_norm", [(1, True), (1, False), (3, True)], ids=["eagle", "eagle-no-input-norm", "eagle3"]
)
def test_cached_draft_layer_matches_reference(target, tmp_path, version, input_norm):
    path, arch, model = target
    draft_dir = build_eagle_draft(
        tmp_path / "draft", path, version=version, input_norm=input_norm, seed=7, init_std=0.2
    )
    runner = _runner(draft_dir, arch, model, max_total_tokens=512, max_requests=8, max_context_len=128)
    cfg = runner.config
    tensors = load_eagle_tensors(draft_dir, cfg)
    gen = torch.Generator().manual_seed(version)
    lengths = {"a": 9, "b": 4, "c": 12}
    ids = {r: torch.randint(0, arch.vocab_size, (n,), generator=gen) for r, n in lengths.items()}
    feats = {r: torch.randn(n, runner.model.feature_size, generator=gen) for r, n in lengths.items()}
    outs = {r: [] for r in lengths}
    cursor = dict.fromkeys(lengths, 0)
    # Ragged extend, two uniform single-row steps, then a ragged extend of the rest.
    for plan in (
        {"a": 5, "b": 2, "c": 7},
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "b": 1, "c": 1},
        {"a": 2, "c": 3},
    ):
        rids = list(plan)
        step_ids = torch.cat([ids[r][cursor[r] : cursor[r] + plan[r]] for r in rids])
        step_feats = torch.cat([feats[r][cursor[r] : cursor[r] + plan[r]] for r in rids])
        out = runner.forward(rids, step_ids, step_feats, [plan[r] for r in rids])
        for r, chunk in zip(rids, out.split([plan[r] for r in rids]), strict=True):
            outs[r].append(chunk)
            cursor[r] += plan[r]
    for r in lengths:
        got = torch.cat(outs[r])
        want, want_logits = _reference(
            cfg, tensors, model.embed_tokens.weight, model.lm_head.weight, ids[r], feats[r]
        )
        n = got.shape[0]
        assert torch.linalg.norm(got.double() - want[:n]) / torch.linalg.norm(want[:n]) < 1e-5
        logits = runner.compute_logits(got)
        assert (
            torch.linalg.norm(logits.double() - want_logits[:n]) / torch.linalg.norm(want_logits[:n]) < 1e-5
        )
        assert runner.kv.seq_len(r) == n


def test_draft_shares_target_head(target, tmp_path):
    """Draft shares the target embeddings and head."""
    path, arch, model = target
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=3, aux_layer_ids=[0, 2, 3])
    runner = _runner(draft_dir, arch, model, max_total_tokens=64, max_requests=2, max_context_len=32)
    assert runner.model._embed_weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert runner.model.vocab.head_weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert runner.model.vocab.to_target is None
    names = {n for n, _ in runner.model.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert runner.lora is None and runner.model.lora is None
    assert runner.aux_layer_ids == (0, 2, 3)
    assert runner.model.feature_size == 3 * arch.hidden_size


def _corrupt(draft_dir, edit):
    file = draft_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("fc.weight"), "missing \\['fc.weight'\\]"),
        (lambda t: t.__setitem__("layers.0.extra.weight", torch.zeros(2)), "unexpected"),
        (lambda t: t.__setitem__("fc.weight", torch.zeros(3, 3)), "fc.weight has shape"),
        (lambda t: t.__setitem__("d2t", torch.zeros(3, dtype=torch.long)), "d2t"),
    ],
)
def test_checkpoint_mismatches_are_named(target, tmp_path, edit, message):
    path, _, _ = target
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=1)
    _corrupt(draft_dir, edit)
    with pytest.raises(ModelConfigError, match=message):
        load_eagle_tensors(draft_dir, load_eagle_config(draft_dir))


def test_draft_for_another_target_is_refused(target, tmp_path):
    path, arch, _ = target
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=3, aux_layer_ids=[1, 3])
    raw = json.loads((draft_dir / "config.json").read_text())
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 9]
    (draft_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="names stream 9"):
        load_eagle_config(draft_dir).check_target(arch)
    raw["target_hidden_size"] = arch.hidden_size * 2
    raw["eagle_aux_hidden_state_layer_ids"] = [1]
    (draft_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelConfigError, match="target_hidden_size"):
        load_eagle_config(draft_dir).check_target(arch)


def test_non_eagle_config_is_refused(target):
    path, _, _ = target
    with pytest.raises(ModelConfigError, match="not an EAGLE draft"):
        load_eagle_config(path)


def _draft_rows(arch, n, seed):
    return sorted(torch.randperm(arch.vocab_size, generator=torch.Generator().manual_seed(seed))[:n].tolist())


def _check_reduced_logits(runner, reference_logits, hidden, rows):
    """Full-vocabulary logits: the reference at the draft's rows, -inf elsewhere; the greedy
    token is the best of those rows, as a target id."""
    logits = runner.compute_logits(hidden)
    ids = torch.tensor(rows)
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()
    got = logits[:, ids].double()
    assert torch.linalg.norm(got - reference_logits) / torch.linalg.norm(reference_logits) < 1e-5
    expected = ids[reference_logits.argmax(-1)]
    assert torch.equal(runner.model.greedy_tokens(hidden), expected)
    assert torch.equal(logits.argmax(-1), expected)


@pytest.mark.parametrize("version", [1, 3])
def test_reduced_head_predicts_target_ids(target, tmp_path, version):
    """``draft_vocab_size`` + ``d2t`` (EAGLE3 training's layout): the draft's own LM head
    scores its rows, and row ``i`` stands for target token ``i + d2t[i]``."""
    path, arch, model = target
    rows = _draft_rows(arch, arch.vocab_size // 3, seed=version)
    draft_dir = build_eagle_draft(
        tmp_path / "draft", path, version=version, seed=3, init_std=0.2, draft_vocab=rows
    )
    runner = _runner(draft_dir, arch, model)
    assert runner.vocab.size == len(rows) and "d2t" in runner.vocab.source
    head = load_file(str(draft_dir / "model.safetensors"))["lm_head.weight"]
    hidden = torch.randn(5, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    final = runner.model._final(hidden)
    _check_reduced_logits(runner, final.double() @ head.double().T, hidden, rows)


def test_token_map_selects_head_rows(target, tmp_path):
    """FR-Spec: the draft scores the listed tokens through those rows of the target's base
    head (a copy: the target's weights are untouched); a relative path is a file of the
    draft's directory, and every accepted file format reads the same ids."""
    path, arch, model = target
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=1, seed=4, init_std=0.2)
    rows = _draft_rows(arch, 40, seed=9)
    frequency_order = list(reversed(rows))  # maps list the most frequent first: order is free
    (draft_dir / "map.json").write_text(json.dumps(frequency_order))
    torch.save(torch.tensor(frequency_order), str(draft_dir / "map.pt"))
    save_file({"hot": torch.tensor(frequency_order)}, str(tmp_path / "map.safetensors"))
    before = model.lm_head.weight.clone()
    hidden = torch.randn(6, arch.hidden_size, generator=torch.Generator().manual_seed(1))
    for name in ("map.json", str(draft_dir / "map.pt"), str(tmp_path / "map.safetensors")):
        runner = _runner(draft_dir, arch, model, token_map=name)
        assert runner.vocab.size == 40
        assert runner.vocab.head_weight.data_ptr() != model.lm_head.weight.data_ptr()
        reference = hidden.double() @ model.lm_head.weight.double()[rows].T
        _check_reduced_logits(runner, reference, hidden, rows)
    assert torch.equal(model.lm_head.weight, before)


@pytest.mark.parametrize(
    "content,message",
    [
        ([1, 2, 2], "more than once"),
        ([1, 10**6], "vocabulary is 0"),
        ([], "non-empty"),
        ({"ids": [1]}, "JSON list of integer"),
        ([1.5], "JSON list of integer"),
    ],
)
def test_bad_token_maps_are_named(target, tmp_path, content, message):
    from loraserve.runtime.speculative.draft_vocab import TokenMapError

    path, arch, model = target
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=1)
    (draft_dir / "map.json").write_text(json.dumps(content))
    with pytest.raises(TokenMapError, match=f"speculative.token_map .*map.json.*{message}"):
        _runner(draft_dir, arch, model, token_map="map.json")
    with pytest.raises(TokenMapError, match="not found"):
        _runner(draft_dir, arch, model, token_map="missing.json")


def test_own_head_checkpoint_mistakes_are_named(target, tmp_path):
    """A d2t that maps two rows to one token or past the vocabulary, a reduced head without
    d2t, and a token map beside a draft that has its own head."""
    from loraserve.runtime.speculative.draft_vocab import TokenMapError

    path, arch, model = target
    rows = _draft_rows(arch, 20, seed=2)
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=3, draft_vocab=rows)
    (draft_dir / "map.json").write_text(json.dumps(rows))
    with pytest.raises(TokenMapError, match="has its own lm_head"):
        _runner(draft_dir, arch, model, token_map="map.json")
    clean = load_file(str(draft_dir / "model.safetensors"))
    for edit, message in (
        (lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), "more than once"),
        (lambda t: t["d2t"].__setitem__(0, arch.vocab_size), "vocabulary is 0"),
        (lambda t: t.pop("d2t"), "missing \\['d2t'\\]"),
    ):
        tensors = {k: v.clone() for k, v in clean.items()}
        edit(tensors)
        save_file(tensors, str(draft_dir / "model.safetensors"))
        with pytest.raises(ModelConfigError, match=message):
            _runner(draft_dir, arch, model)


def test_token_map_file_not_weights(target, tmp_path):
    """A safetensors token map beside the weights is not read as weights."""
    path, arch, model = target
    draft_dir = build_eagle_draft(tmp_path / "draft", path, version=1)
    rows = _draft_rows(arch, 16, seed=5)
    save_file({"hot": torch.tensor(rows)}, str(draft_dir / "hot.safetensors"))
    runner = _runner(draft_dir, arch, model, token_map="hot.safetensors")
    assert runner.vocab.to_target.tolist() == rows
