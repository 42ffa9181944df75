"""The EAGLE head trainer: its loss, and the target's features computed once."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.tools.distill.eagle_head import EagleHead, LayerDims, RopeFrequencies
from loraserve.runtime.tools.distill.eagle_train import (
    EagleTraining,
    FeatureCache,
    eagle_loss,
    target_features,
    train_eagle_head,
)


def test_cached_features_match_target(target):
    """Cached features are the targets features of their windows."""
    windows = torch.randint(0, 64, (7, 17), generator=torch.Generator().manual_seed(1))
    cache = FeatureCache.build(target, windows, torch.device("cpu"), chunk=3)
    assert cache.features.dtype == torch.bfloat16 and cache.features.shape == (7, 17, 64)
    want = target_features(target, windows).to(torch.bfloat16)
    assert torch.equal(cache.features, want)
    picked, feats = cache.sample(5, torch.Generator().manual_seed(2))
    for row, feat in zip(picked, feats, strict=True):
        i = next(i for i in range(7) if torch.equal(windows[i], row))
        assert torch.equal(feat, want[i])  # a sampled window comes with its own features


def test_cached_loss_equals_computed(target):
    """The loss on cached features equals the loss computing them."""
    head = EagleHead(
        LayerDims.of(target.config),
        target.model.embed_tokens.weight,
        target.lm_head.weight,
        eps=1e-5,
        rope=RopeFrequencies.of(target.config),
    )
    windows = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    opts = EagleTraining(seconds=0, seq=16, batch=4, lr=0)
    fresh, top_fresh = eagle_loss(head, target, windows, opts)
    feats = target_features(target, windows)
    cached, top_cached = eagle_loss(head, target, windows, opts, feats)
    assert torch.equal(fresh, cached) and top_fresh == top_cached


def test_cache_fills_teacher_rows():
    """The corpus keeps up to half of the cache; the teacher rows take the rest, so a small
    corpus leaves them more than half, and a large one leaves each half."""
    from loraserve.runtime.tools.distill.eagle_train import cache_windows

    def sizes(corpus_tokens: int, teacher_rows: int, budget_rows: int) -> tuple[int, int]:
        data = torch.zeros(corpus_tokens, dtype=torch.long)
        teacher = torch.zeros(teacher_rows, 5, dtype=torch.long)
        got = cache_windows(data, teacher, 5, 2**20, budget_rows / 2**10, lambda w: w, "test")
        return got[2]["cached_corpus_windows"], got[2]["cached_teacher_windows"]

    assert sizes(corpus_tokens=5 * 10, teacher_rows=500, budget_rows=100) == (10, 90)  # small corpus
    assert sizes(corpus_tokens=5 * 400, teacher_rows=500, budget_rows=100) == (50, 50)  # both over half
    assert sizes(corpus_tokens=5 * 400, teacher_rows=20, budget_rows=100) == (80, 20)  # few teacher rows
    assert (
        cache_windows(torch.zeros(50, dtype=torch.long), None, 5, 2**20, 100 / 2**10, lambda w: w, "t")[2][
            "cached_corpus_windows"
        ]
        == 10
    )


def test_cached_training_reports_and_learns(target):
    """Training with a cache reports it and learns."""
    data = torch.randint(0, 64, (4000,), generator=torch.Generator().manual_seed(4))
    teacher = torch.randint(0, 64, (24, 17), generator=torch.Generator().manual_seed(5))
    opts = EagleTraining(seconds=600, seq=16, batch=8, lr=3e-3, max_steps=30, cache_gib=0.001)
    head, info = train_eagle_head(target, data, teacher, torch.device("cpu"), opts)
    assert info["steps"] == 30
    assert info["cached_teacher_windows"] == 24 and 0 < info["cached_corpus_windows"] <= 4000 // 17
    off = EagleTraining(seconds=600, seq=16, batch=8, lr=3e-3, max_steps=1, cache_gib=0.0)
    _, info_off = train_eagle_head(target, data, teacher, torch.device("cpu"), off)
    assert info_off["feature_cache"] == "off"
    # thirty steps lower the loss from where one step (same init and data) leaves it
    one = EagleTraining(seconds=600, seq=16, batch=8, lr=3e-3, max_steps=1, cache_gib=0.001)
    head_one, _ = train_eagle_head(target, data, teacher, torch.device("cpu"), one)
    windows = teacher[:8]
    with torch.no_grad():
        trained_loss, _ = eagle_loss(head, target, windows, opts)
        start_loss, _ = eagle_loss(head_one, target, windows, opts)
    assert trained_loss < start_loss


@pytest.mark.parametrize("steps", [2, 4])
def test_unrolled_steps_match_serving(target, steps):
    """Step ``s`` at position ``j`` equals one causal forward over the pairs serving's ``s``-th
    chain step sees: target features up to ``j - s + 1``, then the chain's own entries, each
    fed the previous step's output (an entry's K/V depend on its own pair only)."""
    torch.manual_seed(7)
    head = EagleHead(
        LayerDims.of(target.config),
        target.model.embed_tokens.weight,
        target.lm_head.weight,
        eps=1e-5,
        rope=RopeFrequencies.of(target.config),
    )
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(8))
    feats = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        outs = head.unrolled(ids, feats, steps)
        assert len(outs) == steps
        torch.testing.assert_close(outs[0], head(ids, feats))
        for s in range(2, steps + 1):
            for j in range(s - 1, ids.shape[1]):
                committed = j - s + 1  # last position holding a target feature
                chain = [outs[r - 2][:, committed + r - 2] for r in range(2, s + 1)]
                pairs = torch.cat([feats[:, : committed + 1], torch.stack(chain, 1)], 1)
                want = head(ids[:, : j + 1], pairs)[:, -1]
                torch.testing.assert_close(outs[s - 1][:, j], want, rtol=1e-5, atol=1e-5)


def test_loss_is_kl_plus_feature_term(target):
    """One step: KL(target's next-token distribution ‖ the head's), the distribution read by
    the target's LM head from the target's next feature, plus ``feature_weight`` smooth-L1 to
    that feature; computed here from the head's forward alone."""
    head = EagleHead(LayerDims.of(target.config), target.model.embed_tokens.weight, target.lm_head.weight,
                     eps=1e-5, rope=RopeFrequencies.of(target.config))  # fmt: skip
    windows = torch.randint(0, 64, (3, 13), generator=torch.Generator().manual_seed(9))
    opts = EagleTraining(seconds=0, seq=12, batch=3, lr=0, unroll=1, feature_weight=0.3)
    got, _ = eagle_loss(head, target, windows, opts)
    feats = target_features(target, windows)
    out = head(windows[:, 1:], feats[:, :-1])
    p = torch.log_softmax(feats[:, 1:] @ target.lm_head.weight.T, -1)
    q = torch.log_softmax(out @ target.lm_head.weight.T, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    want = kl + 0.3 * torch.nn.functional.smooth_l1_loss(out, feats[:, 1:])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["phi3", "llama3-rope"])
def test_trained_head_rotates_as_served(tmp_path, family):
    """A head built by the trainer, saved, and loaded by the runtime computes the same output
    features: its rotation (partial rotary and LongRoPE's factor set for a Phi-4-mini-like
    target, llama3 scaling for a Llama 3.1-like one) is the served head's."""
    import json

    from transformers import AutoModelForCausalLM

    from loraserve.runtime.dev.devmodels import build_tiny_model
    from loraserve.runtime.model import build_model, load_arch_config
    from loraserve.runtime.tools.distill.eagle_head import eagle_config, save_eagle_head
    from tests.runtime_model.test_phi3 import MODELS
    from tests.spec.conftest import eagle_runner

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}  # fmt: skip
    kwargs = {
        "phi3": {"architecture": "phi3", **MODELS["phi4"]},
        "llama3-rope": {"architecture": "llama", "max_position_embeddings": 256, "rope_scaling": llama3},
    }[family]
    target_dir = build_tiny_model(tmp_path / "target", num_layers=2, **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    dims = LayerDims.of(hf.config)
    torch.manual_seed(3)
    head = EagleHead(dims, hf.model.embed_tokens.weight, hf.lm_head.weight, eps=hf.config.rms_norm_eps,
                     rope=RopeFrequencies.of(hf.config))  # fmt: skip
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(std=0.1)
    raw = json.loads((target_dir / "config.json").read_text())
    path = save_eagle_head(head.checkpoint(), eagle_config(raw, dims.intermediate), tmp_path / "head")
    arch = load_arch_config(target_dir)
    model = build_model(arch, dtype=torch.float32, device=torch.device("cpu"), max_positions=256, model_dir=target_dir)
    runner = eagle_runner(path, arch, model)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(4))
    feats = torch.randn(40, dims.hidden, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = head(ids[None], feats[None])[0]
        got = runner.forward(["r"], ids, feats, [40])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
