"""The fused MoE kernels (``kernels.moe``): routing metadata against its definition, and the
Triton forward (base and per-row LoRA deltas on the experts) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import moe
from loraserve.kernels.moe import reference, triton_ops
from loraserve.kernels.moe.routing import RoutingBuffers, align_block_size, capacity

SLOTS = 3  # slot 0: LoRA on both parts, 1: on no expert part, 2: on down only (rank 4)
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the kernels run


def _routing_ok(groups: torch.Tensor, num_groups: int, block: int) -> None:
    """Every live pair once, grouped, each group's run starting at a block of its own."""
    layout = align_block_size(groups, num_groups, block)
    pairs, owners = layout.sorted_pairs.long(), layout.block_groups.long()
    assert pairs.numel() == capacity(groups.numel(), num_groups, block) and pairs.numel() % block == 0
    live = pairs < groups.numel()
    assert sorted(pairs[live].tolist()) == [p for p in range(groups.numel()) if groups[p] >= 0]
    block_of = torch.arange(pairs.numel()) // block
    assert torch.equal(groups[pairs[live]].long(), owners[block_of[live]])  # each pair in its group's block
    used = owners >= 0
    assert torch.equal(used, torch.arange(owners.numel()) < int(used.sum()))  # used blocks come first
    assert int(used.sum()) == sum(-(-int((groups == g).sum()) // block) for g in range(num_groups))


@pytest.mark.parametrize("pairs,groups,block", [(1, 4, 16), (37, 5, 16), (100, 3, 32), (8, 40, 64)])
def test_align_block_size(pairs, groups, block, gen):
    ids = torch.randint(-1, groups, (pairs,), generator=gen)
    _routing_ok(ids, groups, block)


def test_align_into_buffers_and_overflow():
    """Persistent buffers give the same layout at a fixed address; too many pairs is an error."""
    ids = torch.tensor([2, 0, 2, 1, -1, 0, 2])
    buffers = RoutingBuffers(max_pairs=8, num_groups=3, block=64, device="cpu")
    into = align_block_size(ids, 3, 16, buffers)
    fresh = align_block_size(ids, 3, 16)
    assert torch.equal(into.sorted_pairs, fresh.sorted_pairs) and torch.equal(into.block_groups, fresh.block_groups)
    assert into.sorted_pairs.data_ptr() == buffers._pairs.data_ptr()
    with pytest.raises(ValueError, match="do not fit routing buffers sized for 8"):
        align_block_size(torch.zeros(9, dtype=torch.long), 3, 16, buffers)


def _weights(num_experts, hidden, inter, dtype, gen):
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return gate_up.to(DEV), down.to(DEV)


def _lora(num_experts, hidden, inter, rank, dtype, gen, token_slots) -> moe.MoELoRA:
    """Three slots in the pool's layout (B rank-major, rows past a slot's rank hold junk that
    must never be read)."""

    def part(n_in, offsets, ranks):
        slices, n_out = len(offsets) - 1, offsets[-1]
        a = torch.randn(SLOTS, num_experts, slices * rank, n_in, generator=gen).to(dtype)
        b = (torch.randn(SLOTS, num_experts, rank, n_out, generator=gen) / rank).to(dtype).transpose(2, 3)
        return moe.ExpertLoRA(a.to(DEV), b.to(DEV), offsets, torch.tensor(ranks, dtype=torch.int32, device=DEV))

    return moe.MoELoRA(
        token_slots=token_slots.to(DEV, torch.int32),
        scalings=torch.tensor([0.5, 2.0, 1.5], device=DEV),
        gate_up=part(hidden, (0, inter, 2 * inter), [rank, 0, 0]),
        down=part(inter, (0, hidden), [rank, 0, 4]),
    )


def _route(tokens, num_experts, top_k, hidden, dtype, gen):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return x.to(DEV), weights.to(DEV), ids.to(DEV)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# tokens not a multiple of any block; top-1 and top-2; more experts than pairs
SHAPES = [(5, 4, 2, 32, 24), (19, 6, 2, 48, 40), (3, 8, 1, 32, 16)]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", SHAPES)
def test_fused_moe_base(tokens, experts, top_k, hidden, inter, gen, tolerance):
    gate_up, down = _weights(experts, hidden, inter, torch.float32, gen)
    x, weights, ids = _route(tokens, experts, top_k, hidden, torch.float32, gen)
    out = triton_ops.fused_moe(x, gate_up, down, weights, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _rel(out, reference.fused_moe(x, gate_up, down, weights, ids)) < tolerance[torch.float32]


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", SHAPES[:2])
def test_fused_moe_lora(tokens, experts, top_k, hidden, inter, gen, tolerance):
    """Rows of four kinds in one batch: base (-1), an adapter on both parts (0), an adapter
    with no LoRA on the experts (1), one on down only at a lower rank (2)."""
    gate_up, down = _weights(experts, hidden, inter, torch.float32, gen)
    x, weights, ids = _route(tokens, experts, top_k, hidden, torch.float32, gen)
    slots = torch.tensor([-1, 0, 1, 2, 0], device=DEV)[torch.arange(tokens, device=DEV) % 5]
    lora = _lora(experts, hidden, inter, 8, torch.float32, gen, slots)
    out = triton_ops.fused_moe(x, gate_up, down, weights, ids, lora)
    ref = reference.fused_moe(x, gate_up, down, weights, ids, lora)
    assert _rel(out, ref) < tolerance[torch.float32]
    base = reference.fused_moe(x, gate_up, down, weights, ids)
    for slot in (-1, 1):  # base rows and the adapter without expert LoRA: the base output
        rows = slots == slot
        torch.testing.assert_close(out[rows].double(), base[rows], rtol=1e-5, atol=1e-5)
    for slot in (0, 2):  # the deltas are there
        rows = slots == slot
        assert (ref[rows] - base[rows]).abs().max() > 1e-2


def test_fused_moe_bf16_lora(gen, tolerance):
    gate_up, down = _weights(4, 32, 24, torch.bfloat16, gen)
    x, weights, ids = _route(7, 4, 2, 32, torch.bfloat16, gen)
    lora = _lora(4, 32, 24, 16, torch.bfloat16, gen, torch.tensor([0, 2, -1, 0, 1, 2, 0]))
    out = triton_ops.fused_moe(x, gate_up, down, weights, ids, lora)
    assert out.dtype == torch.bfloat16
    assert _rel(out, reference.fused_moe(x, gate_up, down, weights, ids, lora)) < tolerance[torch.bfloat16]


def test_fused_moe_into_buffers(gen):
    """With persistent buffers (as a CUDA graph captures) the result is the same, and a
    batch of more token rows than they were sized for is refused by name."""
    gate_up, down = _weights(4, 32, 16, torch.float32, gen)
    x, weights, ids = _route(6, 4, 2, 32, torch.float32, gen)
    lora = _lora(4, 32, 16, 8, torch.float32, gen, torch.tensor([0, 2, -1, 0, 1, 2]))
    buffers = moe.MoEBuffers(max_tokens=6, top_k=2, num_experts=4, num_slots=SLOTS, device=DEV)
    out = triton_ops.fused_moe(x, gate_up, down, weights, ids, lora, buffers)
    torch.testing.assert_close(out, triton_ops.fused_moe(x, gate_up, down, weights, ids, lora), rtol=0, atol=0)
    with pytest.raises(ValueError, match="7 token rows do not fit"):
        triton_ops.fused_moe(torch.cat([x, x[:1]]), gate_up, down, weights.repeat(2, 1)[:7], ids.repeat(2, 1)[:7], None, buffers)


@pytest.mark.parametrize("real_bs", [4, 3])
def test_verify_graph_buffers_sized_in_tokens(real_bs, gen):
    """A verify graph for ``max_bs`` requests of width ``k`` feeds ``max_bs * k`` token rows:
    its MoE buffers hold them, filled through the graph's LoRA metadata (padded requests on
    the base model), and the real rows equal the unpadded reference."""
    from loraserve.kernels import ForwardMode, GraphLoRAMetadata

    max_bs, k, experts, top_k, hidden, inter = 4, 3, 4, 2, 32, 16
    mode = ForwardMode.TARGET_VERIFY
    meta = GraphLoRAMetadata(mode, max_bs, SLOTS, num_draft_tokens=k, device=DEV)
    buffers = moe.MoEBuffers.for_graph(mode, max_bs, k, top_k=top_k, num_experts=experts, num_slots=SLOTS, device=DEV)
    meta.capture_info(max_bs)
    req_slots = [0, 2, -1, 1][:real_bs]
    info = meta.update(req_slots, [8] * SLOTS, [0.5, 2.0, 1.5], num_draft_tokens=k, batch_size=max_bs)
    gate_up, down = _weights(experts, hidden, inter, torch.float32, gen)
    x, weights, ids = _route(max_bs * k, experts, top_k, hidden, torch.float32, gen)
    parts = _lora(experts, hidden, inter, 8, torch.float32, gen, info.token_slots)
    graphed = moe.MoELoRA(info.token_slots, info.scalings, parts.gate_up, parts.down)
    out = triton_ops.fused_moe(x, gate_up, down, weights, ids, graphed, buffers)
    rows = real_bs * k
    unpadded = moe.MoELoRA(torch.tensor(req_slots, device=DEV).repeat_interleave(k), info.scalings.clone(), parts.gate_up, parts.down)
    ref = reference.fused_moe(x[:rows], gate_up, down, weights[:rows], ids[:rows], unpadded)
    assert _rel(out[:rows], ref) < 1e-5


def _spans(layout) -> list[tuple[int, list[int]]]:
    """Each group's run of entries (its pairs, padding included), the order inside a run aside."""
    owners, pairs, block = layout.block_groups.tolist(), layout.sorted_pairs.tolist(), layout.block
    runs: list[tuple[int, list[int]]] = []
    for b, owner in enumerate(owners):
        if runs and runs[-1][0] == owner:
            runs[-1][1].extend(pairs[b * block : (b + 1) * block])
        else:
            runs.append((owner, pairs[b * block : (b + 1) * block]))
    return [(owner, sorted(entries)) for owner, entries in runs]


@pytest.mark.parametrize("tokens,experts,top_k,block", [(1, 4, 2, 16), (37, 6, 2, 16), (50, 3, 4, 32), (3, 40, 1, 64)])
def test_triton_align_matches_torch(tokens, experts, top_k, block, gen):
    """The two-launch Triton layout puts every group's pairs in the entries the torch one does,
    for experts and for (expert, slot) groups (base rows and rank-0 slots left out)."""
    from loraserve.kernels.moe.align import align

    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEV)
    assert _spans(align(ids, experts, block)) == _spans(align_block_size(ids.reshape(-1), experts, block))
    slots = torch.randint(-1, SLOTS, (tokens,), generator=gen, dtype=torch.int32).to(DEV)
    ranks = torch.tensor([8, 0, 4], dtype=torch.int32, device=DEV)
    got = align(ids, experts * SLOTS, 16, token_slots=slots, ranks=ranks, num_slots=SLOTS)
    want = align_block_size(moe.lora_groups(ids, slots, ranks, SLOTS), experts * SLOTS, 16)
    assert _spans(got) == _spans(want)
