"""The pure parts: how tensors are cut, what a rank's LoRA partial sums add up to, the
wire format, and the errors a configuration that cannot be split gets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraserve.runtime.distributed.errors import TensorParallelConfigError
from loraserve.runtime.distributed.protocol import ForwardStep, Kind, Message, SlotEvent
from loraserve.runtime.distributed.sharding import ShardPlan, check_tensor_parallel
from loraserve.runtime.executor.launch import TPOptions, start_tensor_parallel
from loraserve.runtime.model.arch import ModelArchConfig
from loraserve.runtime.runner.model_runner import ModelRunner

from .conftest import tp_config


def _arch(**kw) -> ModelArchConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        family="llama",
        vocab_size=1003,
        hidden_size=64,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    base.update(kw)
    return ModelArchConfig(**base)


def _plans(arch: ModelArchConfig, size: int) -> list[ShardPlan]:
    return [ShardPlan.for_arch(arch, rank, size) for rank in range(size)]


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_rank_slices_rebuild_every_tensor(size):
    """Column rows, row-parallel columns and vocab rows of all ranks put back together are
    the whole tensor; replicated KV heads are the ones each rank's query heads read."""
    arch = _arch()
    plans = _plans(arch, size)
    gen = torch.Generator().manual_seed(size)
    q = torch.randn(arch.q_size, 64, generator=gen, dtype=torch.float64)
    kv = torch.randn(arch.kv_size, 64, generator=gen, dtype=torch.float64)
    up = torch.randn(arch.intermediate_size, 64, generator=gen, dtype=torch.float64)
    down = torch.randn(64, arch.intermediate_size, generator=gen, dtype=torch.float64)
    vocab = torch.randn(arch.vocab_size, 64, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(torch.cat([p.shard_module_tensor("q_proj", "weight", q) for p in plans]), q)
    torch.testing.assert_close(torch.cat([p.shard_module_tensor("up_proj", "weight", up) for p in plans]), up)
    torch.testing.assert_close(torch.cat([p.shard_module_tensor("down_proj", "weight", down) for p in plans], 1), down)
    shards = [p.shard_module_tensor("embed_tokens", "weight", vocab) for p in plans]
    assert {s.shape[0] for s in shards} == {-(-arch.vocab_size // size)}  # equal, padded shards
    torch.testing.assert_close(torch.cat(shards)[: arch.vocab_size], vocab)
    assert torch.cat(shards)[arch.vocab_size :].abs().sum() == 0
    assert torch.equal(plans[0].shard_module_tensor("o_proj", "bias", q[:, 0]), q[:, 0])  # whole, added once
    kv_parts = [p.shard_module_tensor("k_proj", "weight", kv) for p in plans]
    group = arch.num_heads // arch.num_kv_heads
    for plan, part in zip(plans, kv_parts, strict=True):
        first_q_head = plan.rank * plan.local_heads
        kv_head = first_q_head // group  # the KV head this rank's query heads share
        assert plan.kv_head_start == kv_head
        want = kv[kv_head * arch.head_dim : (kv_head + plan.local_kv_heads) * arch.head_dim]
        torch.testing.assert_close(part, want)
    if size > arch.num_kv_heads:
        assert [p.kv_head_start for p in plans] == [r * arch.num_kv_heads // size for r in range(size)]
    else:
        torch.testing.assert_close(torch.cat(kv_parts), kv)


def test_row_parallel_scales_once():
    """Σ_ranks s·(x_r A_rᵀ) Bᵀ is the whole delta s·(x Aᵀ) Bᵀ: each rank's partial joins the
    base output's all-reduce; the whole delta on every rank would count it ``size`` times."""
    arch = _arch()
    gen = torch.Generator().manual_seed(1)
    rank, scaling = 4, 2.5
    x = torch.randn(5, arch.q_size, generator=gen, dtype=torch.float64)
    a = torch.randn(rank, arch.q_size, generator=gen, dtype=torch.float64)
    b = torch.randn(arch.hidden_size, rank, generator=gen, dtype=torch.float64)
    whole = scaling * (x @ a.T) @ b.T
    for size in (2, 4):
        total = torch.zeros_like(whole)
        for plan in _plans(arch, size):
            a_r, b_r = plan.shard_lora("o_proj", a, b)
            lo, hi = plan.part_range("q")
            total += scaling * (x[:, lo:hi] @ a_r.T) @ b_r.T
        torch.testing.assert_close(total, whole)
        assert not torch.allclose(size * whole, whole)


def test_column_parallel_cuts_b():
    """Column parallel LoRA keeps a and cuts b by output."""
    arch = _arch()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 64, generator=gen, dtype=torch.float64)
    a = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    b = torch.randn(arch.intermediate_size, 8, generator=gen, dtype=torch.float64)
    outs = []
    for plan in _plans(arch, 4):
        a_r, b_r = plan.shard_lora("gate_proj", a, b)
        assert a_r is a
        outs.append((x @ a_r.T) @ b_r.T)
    torch.testing.assert_close(torch.cat(outs, 1), (x @ a.T) @ b.T)
    # Embedding A and lm_head B are cut by this rank's vocabulary rows, unpadded.
    plan = ShardPlan.for_arch(arch, 1, 2)
    emb_a = torch.randn(arch.vocab_size, 8, generator=gen)
    assert torch.equal(plan.shard_lora("embed_tokens", emb_a, b)[0], emb_a[502:])
    head_b = torch.randn(arch.vocab_size, 8, generator=gen)
    assert torch.equal(plan.shard_lora("lm_head", a, head_b)[1], head_b[502:])


@pytest.mark.parametrize(
    ("change", "size", "words"),
    [
        ({}, 3, "8 attention heads"),
        ({"num_kv_heads": 4, "num_heads": 12}, 6, "4 KV heads"),
        ({"intermediate_size": 100}, 8, "intermediate_size 100"),
    ],
)
def test_unsplittable_sizes_name_field(change, size, words):
    """Sizes the model cannot split name the field."""
    with pytest.raises(TensorParallelConfigError) as exc:
        check_tensor_parallel(_arch(**change), size)
    assert "parallel.tensor_parallel_size" in str(exc.value) and words in str(exc.value)


def test_launcher_refuses_early(tp_assets):
    """Launcher refuses before starting anything."""
    config = tp_config(tp_assets.gqa, 3)  # 4 heads do not split over 3 ranks
    with pytest.raises(TensorParallelConfigError, match="does not divide the model's 4 attention heads"):
        start_tensor_parallel(config)
    config = tp_config(tp_assets.gqa, 2)
    config.device = "cuda"
    if not torch.cuda.is_available():
        with pytest.raises(TensorParallelConfigError, match="CUDA is not available"):
            start_tensor_parallel(config)


def test_runner_without_group_explains(tp_assets):
    """Runner without a group says how to start one."""
    with pytest.raises(TensorParallelConfigError, match="start_tensor_parallel"):
        ModelRunner(tp_config(tp_assets.gqa, 2))
    # A draft never shards, whatever the size.
    draft = ModelRunner(tp_config(tp_assets.draft, 2), is_draft=True, model_path=tp_assets.draft)
    assert draft.tp is None


def test_options_from_the_environment():
    opts = TPOptions.from_env({"LORASERVE_TP_CONTROL_TIMEOUT_S": "12", "LORASERVE_TP_HEARTBEAT_S": "2"})
    assert (opts.control_timeout_s, opts.heartbeat_s) == (12.0, 2.0)
    with pytest.raises(TensorParallelConfigError, match="LORASERVE_TP_COLLECTIVE_TIMEOUT_S"):
        TPOptions.from_env({"LORASERVE_TP_COLLECTIVE_TIMEOUT_S": "soon"})
    with pytest.raises(TensorParallelConfigError, match="at most half"):
        TPOptions.from_env({"LORASERVE_TP_CONTROL_TIMEOUT_S": "4", "LORASERVE_TP_HEARTBEAT_S": "3"})


def test_messages_round_trip_as_json():
    ids = torch.tensor([5, 0, 2**40, 7])
    step = ForwardStep(
        mode="target_verify",
        request_ids=[3, 9],
        num_tokens=4,
        slots=[1, -1],
        num_draft_tokens=2,
        hidden_layers=[0, 2],
        input_ids=ForwardStep.encode_ids(ids),
        expect_free_tokens=17,
        expect_slot_ranks=[8, 0],
    )
    message = Message(
        Kind.FORWARD,
        kv_ops=[(0, 3, 0), (1, 9, 2)],
        slot_events=[SlotEvent("load", "a", path="/x"), SlotEvent("place", "a", slot=1)],
        step=step,
    )
    data = message.encode()
    assert data.startswith(b"{")  # JSON: nothing received is ever executed
    back = Message.decode(data)
    assert back.kind is Kind.FORWARD and back.kv_ops == message.kv_ops and back.slot_events == message.slot_events
    assert dataclasses.asdict(back.step) == dataclasses.asdict(step)
    assert torch.equal(back.step.decode_ids(), ids)
