"""The shared draft runner: settings taken from the target once, one KV cache and one
weight loader for every algorithm's draft."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.dev.dflash_builder import build_dflash_draft
from loraserve.runtime.model.arch import ModelConfigError
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.speculative.dflash.runner import DFlashDraftRunner
from loraserve.runtime.speculative.draft.runner import DraftRunner
from loraserve.runtime.speculative.draft.settings import DraftSettings
from loraserve.runtime.speculative.eagle.runner import EagleDraftRunner

from .conftest import tiny_target


@pytest.fixture(scope="module")
def dflash_dir(spec_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_runner")
    return build_dflash_draft(root / "d", spec_assets.target, target_layer_ids=[0, 1], block_size=4, seed=41)


@pytest.fixture(scope="module")
def drafts(spec_assets, dflash_dir):
    """``(runner class, checkpoint)`` of each algorithm's draft."""
    return {"eagle": (EagleDraftRunner, spec_assets.eagle), "dflash": (DFlashDraftRunner, dflash_dir)}


def _settings(spec_assets, path, **change) -> DraftSettings:
    arch, target = tiny_target(spec_assets)
    return DraftSettings(
        path, target_arch=arch, embed_weight=target.embed_tokens.weight, lm_head_weight=target.lm_head.weight,
        dtype=torch.float32, device="cpu", max_total_tokens=96, max_requests=3, max_context_len=64,
        target_dir=spec_assets.target, **change,
    )  # fmt: skip


def test_beside_follows_the_target(make_spec_config):
    config = make_spec_config("EAGLE", "eagle")
    runner = ModelRunner(make_spec_config())
    s = DraftSettings.beside(config, runner)
    assert (s.max_total_tokens, s.max_requests, s.max_context_len) == (
        runner.kv.capacity, runner.kv.max_requests, runner.kv.max_context_len
    )
    assert s.embed_weight is runner.embed_tokens.weight and s.lm_head_weight is runner.lm_head.weight
    assert (s.dtype, s.verify_width, s.cuda_graph_max_bs) == (runner.dtype, config.speculative.num_draft_tokens, 0)


@pytest.mark.parametrize("which", ["eagle", "dflash"])
def test_one_cache_sized_like_the_target(spec_assets, drafts, which):
    cls, path = drafts[which]
    runner = cls(_settings(spec_assets, path))
    assert isinstance(runner, DraftRunner)
    assert (runner.kv.capacity, runner.kv.max_requests, runner.kv.max_context_len) == (96, 3, 64)
    assert runner.held("r") == 0


@pytest.mark.parametrize("which", ["eagle", "dflash"])
def test_one_weight_loader(spec_assets, drafts, which):
    """``dummy`` draws from the seed; ``pt`` pickles are refused, naming the field."""
    cls, path = drafts[which]

    def weights(seed: int) -> list[torch.Tensor]:
        runner = cls(_settings(spec_assets, path, load_format="dummy", seed=seed))
        return [p.detach().clone() for p in runner.model.parameters()]

    read = [p.detach() for p in cls(_settings(spec_assets, path)).model.parameters()]
    same, other = weights(1), weights(1)
    assert all(torch.equal(a, b) for a, b in zip(same, other, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(same, weights(2), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(same, read, strict=True))
    with pytest.raises(ModelConfigError, match=r"speculative\.draft_load_format 'pt'"):
        cls(_settings(spec_assets, path, load_format="pt"))
