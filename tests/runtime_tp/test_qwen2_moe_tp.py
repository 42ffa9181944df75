"""Oracle: a Qwen2-MoE model on two tensor-parallel ranks gives the single-device runner's
logits (which tests/runtime_model/test_qwen2_moe.py holds to transformers and peft).

Beside the routed experts (cut along their intermediate dimension) every sparse layer has a
shared expert, cut as a dense MLP of its own size (gate and up rows, down columns), whose
partial output joins the layer's one all-reduce; its gate ``shared_expert_gate`` (H -> 1)
is whole on every rank. The adapter adapts attention, the shared expert and its gate, the
routed experts and the router; base and adapter rows share every batch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from loraserve.kernels import moe as moe_kernels
from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model
from loraserve.runtime.distributed.errors import TensorParallelConfigError
from loraserve.runtime.distributed.sharding import ShardPlan, check_tensor_parallel
from loraserve.runtime.model.arch import load_arch_config
from loraserve.runtime.runner.model_runner import ModelRunner

from ..runtime_model.test_moe import SMALL
from .conftest import Pair, adapter_delta, both, every_mode, extend, tp_config, tp_group

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
SHARED_INTER, HIDDEN = 80, 64
MODEL = {
    "architecture": "qwen2_moe",
    "seed": 81,
    "moe": {"mlp_only_layers": [1], "shared_expert_intermediate_size": 80},
}
ADAPTER = {
    "target_modules": (*ATTN, "gate_proj", "up_proj", "down_proj", "shared_expert_gate"),
    "target_parameters": ("gate_up_proj", "down_proj", "gate.weight"),
}
NAMES = ["all", None, "all"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2_moe_tp")
    model = build_tiny_model(root / "m", **{**SMALL, **MODEL})
    return model, {"all": build_adapter(root / "all", model, rank=4, alpha=8, seed=83, **ADAPTER)}


@pytest.fixture(scope="module")
def pair(assets):
    """Two ranks and one device on the same model and adapter."""
    model, adapters = assets
    with tp_group(tp_config(model, 2, adapters)) as (handle, runner):
        yield Pair(tp=runner, ref=ModelRunner(tp_config(model, 1, adapters)), handle=handle)


def test_every_mode_matches_one_device(pair):
    """Extend (every position, hidden states), two decodes, a verify, a rejected-draft
    truncation and a decode after it; the adapter and the base model in one batch."""
    every_mode(pair, NAMES, (9, 4, 13), (2, 0, 3), hidden_layers=(1, 2, 3))


def test_adapter_changes_tp_output(pair):
    """Guards the oracle: the adapter moves the logits on two ranks."""
    prompt = torch.arange(5, 17)
    assert adapter_delta(pair.tp, prompt, "all") > 1e-2


def test_rank_holds_its_slice_of_the_shared_expert(pair):
    """Rank 0 holds the first half of the shared expert's gate rows, up rows and down columns
    and its whole gate; its adapter slots hold the same cut of one device's."""
    half = SHARED_INTER // 2
    assert pair.tp.shard.part_range("shared") == (0, half)
    both(pair, extend, ["s"], [torch.arange(3, 7)], ["all"])  # the adapter in a slot
    pair.free(["s"])
    s, r = pair.tp.lora.prepare_batch(["all"])[0], pair.ref.lora.prepare_batch(["all"])[0]
    tp_hooks, ref_hooks = pair.tp.lora.pool.hooks, pair.ref.lora.pool.hooks
    for i in (0, 2):
        got, want = pair.tp.model.model.layers[i].mlp, pair.ref.model.model.layers[i].mlp
        whole = want.shared_expert.gate_up_proj.weight
        assert torch.equal(
            got.shared_expert.gate_up_proj.weight,
            torch.cat([whole[:half], whole[SHARED_INTER : SHARED_INTER + half]]),
        )
        assert torch.equal(got.shared_expert.down_proj.weight, want.shared_expert.down_proj.weight[:, :half])
        assert torch.equal(got.shared_expert_gate.weight, want.shared_expert_gate.weight)  # whole
        gu, ref_gu = tp_hooks[("shared_expert.gate_up_proj", i)], ref_hooks[("shared_expert.gate_up_proj", i)]
        assert gu.slice_offsets == (0, half, 2 * half)
        assert torch.equal(gu.A[s], ref_gu.A[r])  # column-parallel: A whole, B's rows
        assert torch.equal(
            gu.B[s], torch.cat([ref_gu.B[r][:half], ref_gu.B[r][SHARED_INTER : SHARED_INTER + half]])
        )
        down, ref_down = tp_hooks[("shared_expert.down_proj", i)], ref_hooks[("shared_expert.down_proj", i)]
        assert torch.equal(down.A[s], ref_down.A[r][:, :half]) and torch.equal(down.B[s], ref_down.B[r])
        gate, ref_gate = tp_hooks[("shared_expert_gate", i)], ref_hooks[("shared_expert_gate", i)]
        assert torch.equal(gate.A[s], ref_gate.A[r]) and torch.equal(gate.B[s], ref_gate.B[r])
        assert gu.A[s].abs().sum() > 0 and down.A[s].abs().sum() > 0 and gate.A[s].abs().sum() > 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1"
)
def test_fused_path_on_rank_zero(pair):
    """Rank 0's routed experts on the fused Triton kernels, its shared expert beside them:
    the ranks' sum is one device's torch-path output."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (6, 3, 5)]
    rids = ["f0", "f1", "f2"]
    want = extend(pair.ref, rids, prompts, NAMES).logits
    moe_kernels.set_path("triton")  # this process only: rank 0 (the reference ran above)
    try:
        got = extend(pair.tp, rids, prompts, NAMES).logits
    finally:
        moe_kernels.set_path("auto")
    pair.free(rids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_indivisible_shared_expert_size_is_refused(assets, tmp_path):
    """A shared expert size the group cannot split is refused, naming the field."""
    raw = json.loads((assets[0] / "config.json").read_text())
    raw["shared_expert_intermediate_size"] = 90
    (tmp_path / "config.json").write_text(json.dumps(raw))
    odd = load_arch_config(tmp_path)
    check_tensor_parallel(odd, 2)  # 90 splits over 2
    with pytest.raises(TensorParallelConfigError, match="shared_expert_intermediate_size 90"):
        ShardPlan.for_arch(odd, 0, 4)


def test_random_weights_are_cut_from_one_device_model(assets):
    """Random weights (benchmarks) are drawn whole and cut: each rank's shared expert is its
    slice of the one a device draws from the same seed, its gate whole."""
    from loraserve.runtime.model.loader import build_model

    from .test_moe_tp import _BuildOnly

    arch = load_arch_config(assets[0])
    build = dict(
        dtype=torch.float32, device=torch.device("cpu"), max_positions=32, random_init_std=0.02, seed=7
    )
    whole = build_model(arch, **build)
    for r in range(2):
        plan = ShardPlan.for_arch(arch, r, 2)
        local = build_model(arch, shard=plan, group=_BuildOnly(r, 2), **build)
        lo, hi = plan.part_range("shared")
        for i in (0, 2):
            got, want = local.model.layers[i].mlp, whole.model.layers[i].mlp
            gate_up = want.shared_expert.gate_up_proj.weight
            assert torch.equal(
                got.shared_expert.gate_up_proj.weight,
                torch.cat([gate_up[lo:hi], gate_up[SHARED_INTER + lo : SHARED_INTER + hi]]),
            )
            assert torch.equal(
                got.shared_expert.down_proj.weight, want.shared_expert.down_proj.weight[:, lo:hi]
            )
            assert torch.equal(got.shared_expert_gate.weight, want.shared_expert_gate.weight)
