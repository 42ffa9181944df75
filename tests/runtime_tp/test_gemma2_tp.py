"""Oracle: Gemma 2 on two tensor-parallel ranks gives the single-device runner's logits (which
tests/runtime_model/test_gemma2.py holds to transformers and peft): attention soft-capping
applies per score, so each rank caps its own heads' scores; the final cap after the logits'
all-gather; sliding and global layers over prompts longer than the window; an adapter on every
linear module. The group runs with SDPA and with the paged Triton kernel, against one device on
SDPA each time.
"""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.dev.devmodels import ALL_LINEAR_MODULES, build_adapter, build_tiny_model
from loraserve.runtime.runner.model_runner import ModelRunner

from ..runtime_model.test_gemma2 import CAPS, SMALL
from .conftest import Pair, adapter_delta, every_mode, greedy, tp_config, tp_group


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma2_tp")
    path = build_tiny_model(root / "m", architecture="gemma2", seed=95, moe=CAPS, **SMALL)
    return path, build_adapter(root / "a", path, rank=8, alpha=16, target_modules=ALL_LINEAR_MODULES, seed=96)


@pytest.fixture(scope="module", params=["sdpa", "triton"])
def pair(request, model):
    path, adapter = model
    adapters = {"all": adapter}
    with tp_group(tp_config(path, 2, adapters, attention=request.param)) as (handle, runner):
        assert runner.attention_backend == request.param
        yield Pair(tp=runner, ref=ModelRunner(tp_config(path, 1, adapters)), handle=handle)


def test_every_mode_matches_one_device(pair):
    """Extend (every position), two decodes, a verify, a truncation and a decode after it; the
    adapter and the base model in one batch."""
    out = every_mode(pair, ["all", None, "all"], (9, 3, 13), (2, 0, 3), vocab=500)
    assert out.logits.abs().max() <= CAPS["final_logit_softcapping"]


@pytest.mark.parametrize("adapter", [None, "all"])
def test_greedy_generation_matches_one_device(pair, adapter):
    prompt = torch.tensor([2, 306, 395, 347, 486, 10, 308, 334])
    tokens = {
        key: greedy(runner, f"g-{adapter}", prompt, adapter)
        for key, runner in (("tp", pair.tp), ("ref", pair.ref))
    }
    assert tokens["tp"] == tokens["ref"]
    assert adapter_delta(pair.tp, torch.arange(5, 17), "all") > 1e-2
