"""Oracle: mixture-of-experts models (Qwen3-MoE, Mixtral) on two tensor-parallel ranks give
the single-device runner's logits (which tests/runtime_model/test_moe.py holds to
transformers and peft).

Every expert is cut along its intermediate dimension (rank r holds its gate rows, its up
rows and its down columns of every expert), the router is whole, the layer's output is
all-reduced once. The tiny Qwen3-MoE (``norm_topk_prob``, a dense layer between two sparse
ones) loads a per-expert checkpoint, Mixtral the fused 3-D layout transformers 5 holds; the
adapters adapt attention, every expert and the router: peft's fused ``gate_up_proj`` at
double rank, and the per-expert layout older adapters have. Base and adapter rows share
every batch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from loraserve.kernels import moe as moe_kernels
from loraserve.kernels.moe import ExpertLoRA, MoELoRA
from loraserve.runtime.dev.devmodels import build_adapter, build_tiny_model
from loraserve.runtime.distributed.errors import TensorParallelConfigError
from loraserve.runtime.distributed.sharding import ShardPlan, check_tensor_parallel
from loraserve.runtime.model.arch import load_arch_config
from loraserve.runtime.model.loader import build_model
from loraserve.runtime.model.moe import SparseMoE
from loraserve.runtime.runner.model_runner import ModelRunner

from ..runtime_model.test_moe import SMALL, _fuse_experts, _per_expert_adapter
from .conftest import Pair, adapter_delta, both, decode, every_mode, extend, greedy, tp_config, tp_group

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS, HIDDEN = 4, 64
MODELS = {
    # name: (build_tiny_model kwargs, the adapter's target modules, one expert's intermediate size)
    "qwen3_moe": (
        {"architecture": "qwen3_moe", "seed": 71, "moe": {"norm_topk_prob": True, "mlp_only_layers": [1]}},
        (*ATTN, "gate_proj", "up_proj", "down_proj", "gate"),
        48,
    ),
    "mixtral": (
        {"architecture": "mixtral", "seed": 72, "intermediate_size": 48},
        ("q_proj", "v_proj", "w1", "w2", "w3", "gate"),
        48,
    ),
}


@dataclass
class MoEAssets:
    model: object  # Path: the checkpoint the runners load
    adapters: dict  # name -> Path
    names: list  # a batch's adapters (None: the base model)
    inter: int  # one expert's intermediate size (whole)


@pytest.fixture(scope="module")
def moe_assets(tmp_path_factory) -> dict[str, MoEAssets]:
    root = tmp_path_factory.mktemp("moe_tp")
    out = {}
    for name, (kw, targets, inter) in MODELS.items():
        model = build_tiny_model(root / name, **{**SMALL, **kw})
        fused = build_adapter(root / f"{name}-all", model, rank=4, alpha=8, target_modules=targets, seed=73)
        raw = json.loads((fused / "adapter_config.json").read_text())
        assert "gate_up_proj" in raw["target_parameters"]  # peft with transformers 5: fused, double rank
        if name == "qwen3_moe":  # as published: per expert; an older adapter, per expert too
            _, old = _per_expert_adapter(fused, root / "old", name)
            out[name] = MoEAssets(model, {"all": fused, "old": old}, ["all", None, "old"], inter)
        else:  # the fused 3-D checkpoint layout
            out[name] = MoEAssets(
                _fuse_experts(model, root / "mixtral-fused"), {"all": fused}, ["all", None, "all"], inter
            )
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, moe_assets):
    """Two ranks and one device on the same model and adapters (one group at a time)."""
    assets = moe_assets[request.param]
    with tp_group(tp_config(assets.model, 2, assets.adapters)) as (handle, runner):
        pair = Pair(tp=runner, ref=ModelRunner(tp_config(assets.model, 1, assets.adapters)), handle=handle)
        pair.assets = assets  # type: ignore[attr-defined]
        yield pair


def test_every_mode_matches_one_device(pair):
    """Extend (every position, the hidden states of every layer), two decodes, a verify, a
    rejected-draft truncation and a decode after it; adapters and the base model in one batch."""
    out = every_mode(pair, pair.assets.names, (9, 4, 13), (2, 0, 3), hidden_layers=(1, 2, 3))
    assert out.logits.shape == (26, 512)


@pytest.mark.parametrize("adapter", [None, "all"])
def test_greedy_generation_matches_one_device(pair, adapter):
    prompt = torch.randint(3, 512, (8,), generator=torch.Generator().manual_seed(2))
    tokens = {
        key: greedy(runner, f"g-{adapter}", prompt, adapter, n=16)
        for key, runner in (("tp", pair.tp), ("ref", pair.ref))
    }
    assert tokens["tp"] == tokens["ref"]
    assert len(set(tokens["tp"])) > 1  # not a degenerate repeat any model would match


def test_adapters_change_tp_output(pair):
    """Guards the oracle: each adapter moves the logits on two ranks."""
    prompt = torch.arange(5, 17)
    for name in pair.assets.adapters:
        assert adapter_delta(pair.tp, prompt, name) > 1e-2, name


def test_rank_holds_its_slice_of_every_expert(pair):
    """Rank 0 holds every expert's first half of the gate rows, of the up rows and of the
    down columns, the whole router; its adapter slots hold the same cut of one device's."""
    inter, half = pair.assets.inter, pair.assets.inter // 2
    plan = pair.tp.shard
    assert (plan.rank, plan.local_moe_intermediate) == (0, half)
    tp_hooks, ref_hooks = pair.tp.lora.pool.hooks, pair.ref.lora.pool.hooks
    names = list(pair.assets.adapters)
    both(pair, extend, names, [torch.arange(3, 7)] * len(names), names)  # every adapter in a slot
    pair.free(names)
    slot_of = dict(zip(names, pair.tp.lora.prepare_batch(names), strict=True))
    ref_slot = dict(zip(names, pair.ref.lora.prepare_batch(names), strict=True))
    sparse = [i for i, layer in enumerate(pair.tp.model.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse == ([0, 2] if pair.tp.arch.family == "qwen3_moe" else [0, 1, 2])
    for i in sparse:
        got, want = pair.tp.model.model.layers[i].mlp, pair.ref.model.model.layers[i].mlp
        assert got.experts.gate_up_proj.shape == (EXPERTS, 2 * half, HIDDEN)
        assert got.experts.down_proj.shape == (EXPERTS, HIDDEN, half)
        whole = want.experts.gate_up_proj
        assert torch.equal(
            got.experts.gate_up_proj, torch.cat([whole[:, :half], whole[:, inter : inter + half]], 1)
        )
        assert torch.equal(got.experts.down_proj, want.experts.down_proj[..., :half])
        assert torch.equal(got.gate.weight, want.gate.weight)  # the router: whole
        for name in pair.assets.adapters:
            s, r = slot_of[name], ref_slot[name]
            gu, ref_gu = tp_hooks[("gate_up_proj", i)], ref_hooks[("gate_up_proj", i)]
            assert gu.slice_offsets == (0, half, 2 * half)
            assert torch.equal(gu.A[s], ref_gu.A[r])  # column-parallel: A whole
            assert torch.equal(gu.B[s], plan.shard_expert_weight("gate_up_proj", ref_gu.B[r]))
            down, ref_down = tp_hooks[("down_proj", i)], ref_hooks[("down_proj", i)]
            assert torch.equal(down.A[s], ref_down.A[r][..., :half])  # row-parallel: A's columns
            assert torch.equal(down.B[s], ref_down.B[r])
            assert torch.equal(tp_hooks[("gate", i)].B[s], ref_hooks[("gate", i)].B[r])
            assert (
                gu.A[s].abs().sum() > 0
                and down.A[s].abs().sum() > 0
                and tp_hooks[("gate", i)].A[s].abs().sum() > 0
            )


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1"
)
def test_fused_path_on_rank_zero(pair):
    """Rank 0's MoE layers run the fused Triton kernels on their local slices (rank 1 the
    torch path: each rank's partial sum is its own), with expert LoRA rows and base rows in
    one batch: the sum is one device's torch-path output."""
    names = pair.assets.names
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (6, 3, 5)]
    step = torch.randint(3, 512, (3,), generator=gen)
    rids = ["f0", "f1", "f2"]
    want = torch.cat(
        [extend(pair.ref, rids, prompts, names).logits, decode(pair.ref, rids, step, names).logits]
    )
    moe_kernels.set_path("triton")  # this process only: rank 0 (the reference ran above)
    try:
        got = torch.cat(
            [extend(pair.tp, rids, prompts, names).logits, decode(pair.tp, rids, step, names).logits]
        )
    finally:
        moe_kernels.set_path("auto")
    pair.free(rids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------- without a group


def test_expert_slices_rebuild_experts_and_deltas():
    """Over 2 and 4 ranks: the fused gate_up slices are [gate slice ; up slice] of every
    expert, and per-expert and fused checkpoints cut alike; gate/up LoRA outputs concatenate
    to the whole, and down LoRA partials (each scaled) sum to the whole delta scaled once."""
    gen = torch.Generator().manual_seed(3)
    inter, rank, scaling = 48, 4, 2.5
    gate_up = torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen, dtype=torch.float64)
    x = torch.randn(5, HIDDEN, generator=gen, dtype=torch.float64)
    h = torch.randn(5, inter, generator=gen, dtype=torch.float64)
    a_up = torch.randn(EXPERTS, rank, HIDDEN, generator=gen, dtype=torch.float64)
    b_up = torch.randn(EXPERTS, inter, rank, generator=gen, dtype=torch.float64)
    a_down = torch.randn(EXPERTS, rank, inter, generator=gen, dtype=torch.float64)
    b_down = torch.randn(EXPERTS, HIDDEN, rank, generator=gen, dtype=torch.float64)
    for size in (2, 4):
        plans = [_plan(inter, r, size) for r in range(size)]
        slices = [p.shard_expert_weight("gate_up_proj", gate_up) for p in plans]
        assert {tuple(s.shape) for s in slices} == {(EXPERTS, 2 * inter // size, HIDDEN)}
        n = inter // size
        torch.testing.assert_close(torch.cat([s[:, :n] for s in slices], 1), gate_up[:, :inter])  # gate rows
        torch.testing.assert_close(torch.cat([s[:, n:] for s in slices], 1), gate_up[:, inter:])  # up rows
        for e in (0, 3):  # a per-expert checkpoint's gate_proj / up_proj cut as its fused rows
            for p, s in zip(plans, slices, strict=True):
                torch.testing.assert_close(p.shard_expert_weight("gate_proj", gate_up[e, :inter]), s[e, :n])
                torch.testing.assert_close(p.shard_expert_weight("up_proj", gate_up[e, inter:]), s[e, n:])
        up_outs, down_total = [], torch.zeros(EXPERTS, 5, HIDDEN, dtype=torch.float64)
        for p in plans:
            a, b = p.shard_expert_lora("up_proj", a_up, b_up)
            assert a is a_up
            up_outs.append(torch.einsum("tk,erk,enr->etn", x, a, b))
            a, b = p.shard_expert_lora("down_proj", a_down, b_down)
            lo, hi = p.part_range("expert")
            down_total += scaling * torch.einsum("ti,eri,enr->etn", h[:, lo:hi], a, b)
        torch.testing.assert_close(torch.cat(up_outs, 2), torch.einsum("tk,erk,enr->etn", x, a_up, b_up))
        torch.testing.assert_close(down_total, scaling * torch.einsum("ti,eri,enr->etn", h, a_down, b_down))


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on the CPU needs TRITON_INTERPRET=1"
)
def test_fused_kernels_sum_rank_slices():
    """The fused kernels, given each rank's slices of the experts and of a slot's expert
    LoRA (as the pool holds them), return partials that sum to the whole layer's output."""
    gen = torch.Generator().manual_seed(4)
    inter, rank, slots, tokens = 32, 4, 2, 7
    gate_up = 0.2 * torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen)
    down = 0.2 * torch.randn(EXPERTS, HIDDEN, inter, generator=gen)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    weights, ids = (
        torch.rand(tokens, 2, generator=gen),
        torch.stack([torch.randperm(EXPERTS, generator=gen)[:2] for _ in range(tokens)]),
    )
    ranks = torch.tensor([rank, rank], dtype=torch.int32)
    gu_a = 0.3 * torch.randn(slots, EXPERTS, 2 * rank, HIDDEN, generator=gen)
    gu_b = 0.3 * torch.randn(slots, EXPERTS, 2 * inter, rank, generator=gen)
    dn_a = 0.3 * torch.randn(slots, EXPERTS, rank, inter, generator=gen)
    dn_b = 0.3 * torch.randn(slots, EXPERTS, HIDDEN, rank, generator=gen)
    token_slots = torch.tensor([0, 0, -1, 1, 1, -1, 0], dtype=torch.int32)  # two adapters and the base model
    scalings = torch.tensor([2.0, 0.5])

    def lora(gu_a, gu_b, dn_a, dn_b, n):
        return MoELoRA(
            token_slots,
            scalings,
            ExpertLoRA(gu_a, gu_b, (0, n, 2 * n), ranks),
            ExpertLoRA(dn_a, dn_b, (0, HIDDEN), ranks),
        )

    whole = moe_kernels.fused_moe(x, gate_up, down, weights, ids, lora(gu_a, gu_b, dn_a, dn_b, inter))
    total = torch.zeros_like(whole)
    for r in range(2):
        p = _plan(inter, r, 2)
        part = lora(
            gu_a,
            p.shard_expert_weight("gate_up_proj", gu_b),
            p.shard_expert_weight("down_proj", dn_a),
            dn_b,
            inter // 2,
        )
        total += moe_kernels.fused_moe(
            x,
            p.shard_expert_weight("gate_up_proj", gate_up),
            p.shard_expert_weight("down_proj", down),
            weights,
            ids,
            part,
        )
    torch.testing.assert_close(total, whole, atol=1e-4, rtol=0)
    assert (whole - moe_kernels.fused_moe(x, gate_up, down, weights, ids)).abs().max() > 1e-2  # LoRA acts


def test_random_weights_are_cut_from_one_device_model(moe_assets):
    """Random weights (benchmarks) are drawn whole and cut: each rank's experts and router
    are its slices of the model one device draws from the same seed."""
    arch = load_arch_config(moe_assets["qwen3_moe"].model)
    build = dict(
        dtype=torch.float32, device=torch.device("cpu"), max_positions=32, random_init_std=0.02, seed=7
    )
    whole = build_model(arch, **build)
    for r in range(2):
        plan = ShardPlan.for_arch(arch, r, 2)
        local = build_model(arch, shard=plan, group=_BuildOnly(r, 2), **build)
        for i in (0, 2):
            got, want = local.model.layers[i].mlp, whole.model.layers[i].mlp
            assert torch.equal(
                got.experts.gate_up_proj, plan.shard_expert_weight("gate_up_proj", want.experts.gate_up_proj)
            )
            assert torch.equal(
                got.experts.down_proj, plan.shard_expert_weight("down_proj", want.experts.down_proj)
            )
            assert torch.equal(got.gate.weight, want.gate.weight)


def test_indivisible_expert_size_is_refused(moe_assets, tmp_path):
    """An expert intermediate size the group cannot split is refused, naming the field, by
    the check the launcher runs before any rank starts and by the plan every rank makes."""
    arch = load_arch_config(moe_assets["qwen3_moe"].model)  # intermediate 96, expert 48
    raw = json.loads((moe_assets["qwen3_moe"].model / "config.json").read_text())
    raw["moe_intermediate_size"] = 50
    (tmp_path / "config.json").write_text(json.dumps(raw))
    odd = load_arch_config(tmp_path)  # heads, KV heads and intermediate_size split over 4
    check_tensor_parallel(odd, 2)  # 50 splits over 2
    with pytest.raises(TensorParallelConfigError) as exc:
        check_tensor_parallel(odd, 4)
    message = str(exc.value)
    assert "moe_intermediate_size 50" in message and "parallel.tensor_parallel_size=4" in message
    with pytest.raises(TensorParallelConfigError, match="moe_intermediate_size 50"):
        ShardPlan.for_arch(odd, 0, 4)
    assert ShardPlan.for_arch(arch, 1, 4).part_range("expert") == (12, 24)


def _plan(inter: int, rank: int, size: int) -> ShardPlan:
    return ShardPlan(
        rank=rank, size=size, num_heads=8, num_kv_heads=8, head_dim=8, intermediate_size=96, vocab_size=512,
        moe_intermediate_size=inter,
    )  # fmt: skip


@dataclass
class _BuildOnly:
    """A group for building a sharded model whose forward never runs (no collective is called)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("built only: no forward runs")

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("built only: no forward runs")


@pytest.mark.parametrize("algorithm", ["NGRAM", "EAGLE3"])
def test_speculation_on_ranks_is_lossless(pair, algorithm, tmp_path_factory):
    """Greedy speculation over the two-rank MoE target (the draft whole on rank 0) gives the
    tokens of plain decoding on one device, adapters and the base model in one batch."""
    from loraserve.runtime.contract.config import SpecAlgorithm
    from loraserve.runtime.sampling import SamplingParams
    from loraserve.runtime.speculative.eagle.builder import build_eagle_draft

    from .conftest import run_engine

    assets = pair.assets
    gen = torch.Generator().manual_seed(4)
    requests = []
    for i, name in enumerate(assets.names * 2):
        unit = torch.randint(3, 500, (3,), generator=gen)
        prompt = (
            unit.repeat(5)[: 6 + i].tolist()
            if i % 2
            else torch.randint(3, 500, (6 + i,), generator=gen).tolist()
        )
        requests.append((f"s{i}", prompt, SamplingParams(max_tokens=10, temperature=0.0), name))
    expected, _ = run_engine(tp_config(assets.model, 1, assets.adapters), pair.ref, requests)
    config = tp_config(assets.model, 2, assets.adapters).copy()
    config.speculative.algorithm = SpecAlgorithm(algorithm)
    config.speculative.num_steps, config.speculative.num_draft_tokens = 3, 4
    if algorithm == "EAGLE3":
        draft = tmp_path_factory.mktemp("moe_tp_eagle3")
        config.speculative.draft_model_path = str(
            build_eagle_draft(draft, assets.model, version=3, aux_layer_ids=[0, 1, 2], seed=75, init_std=0.1)
        )
    outputs, _ = run_engine(config, pair.tp, requests)
    for rid, *_ in requests:
        assert outputs[rid].error is None, (rid, outputs[rid].error)
        assert outputs[rid].tokens == expected[rid].tokens, rid
        assert outputs[rid].spec is not None and outputs[rid].spec.verify_steps >= 1, rid
    assert pair.handle.health.failure is None
