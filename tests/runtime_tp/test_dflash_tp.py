"""DFLASH over a 2-rank target: the draft runs whole on rank 0, the target captures its
layer outputs on every rank's shard and gathers them (the residual stream is replicated
after each all-reduce). Greedy output equals plain decoding on one device, per adapter."""

from __future__ import annotations

import pytest
import torch

from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.sampling import SamplingParams

from .conftest import run_engine, tp_config, tp_group

ADAPTERS = ("attn-r8", "emb-head")


def _requests(count: int = 6, seed: int = 7, max_tokens: int = 12):
    gen = torch.Generator().manual_seed(seed)
    names = [None, *ADAPTERS]
    return [
        (
            f"d{i}",
            torch.randint(3, 500, (int(torch.randint(4, 24, (1,), generator=gen)),), generator=gen).tolist(),
            SamplingParams(max_tokens=max_tokens, temperature=0.0),
            names[i % len(names)],
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def draft(tp_assets, tmp_path_factory):
    from loraserve.runtime.dev.dflash_builder import build_dflash_draft

    return build_dflash_draft(
        tmp_path_factory.mktemp("dflash_tp") / "d", tp_assets.gqa, target_layer_ids=[0, 1], block_size=4,
        seed=56, init_std=0.1,
    )  # fmt: skip


def test_greedy_dflash_is_lossless_on_two_ranks(tp_assets, draft):
    adapters = {n: tp_assets.adapters[n] for n in ADAPTERS}
    requests = _requests()
    single = tp_config(tp_assets.gqa, 1, adapters)
    expected, _ = run_engine(single, ModelRunner(single), requests)
    config = tp_config(tp_assets.gqa, 2, adapters)
    config.speculative.algorithm = SpecAlgorithm.DFLASH
    config.speculative.num_draft_tokens = 4
    config.speculative.draft_model_path = str(draft)
    with tp_group(config) as (handle, runner):
        outputs, engine = run_engine(config, runner, requests)
        assert engine.decoder.drafter.lora is None
        assert getattr(engine.decoder.drafter.runner, "tp", None) is None  # whole, on rank 0 only
        assert handle.health.failure is None
    for rid, *_ in requests:
        assert outputs[rid].error is None, (rid, outputs[rid].error)
        assert outputs[rid].tokens == expected[rid].tokens, rid
        assert outputs[rid].spec is not None and outputs[rid].spec.verify_steps >= 1
