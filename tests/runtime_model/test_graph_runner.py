"""The shared CUDA-graph runner's logic on the CPU: bucket choice, padding, the capture /
replay / fallback bookkeeping (with a fake capture), and the verify-width guard.

Real captures need a GPU (``tests/runtime_model/test_cuda_graph.py`` and
``tests/spec/test_eagle_graphs.py``, marked ``gpu``); everything here is what surrounds them.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.kv import Allocation
from loraserve.runtime.runner import graph_runner
from loraserve.runtime.runner.graph_runner import Captured, GraphRunner, StaticRequests, fill_padded


def _runner(max_context_len: int = 1024) -> SimpleNamespace:
    """What the graph runner reads of a model runner: its device and its cache's limit."""
    return SimpleNamespace(device=torch.device("cpu"), kv=SimpleNamespace(max_context_len=max_context_len))


def _alloc(prefix_lens: list[int], new_lens: list[int], rows: list[int]) -> Allocation:
    slots = torch.arange(1, sum(new_lens) + 1, dtype=torch.int64)
    return Allocation(
        request_ids=[f"r{i}" for i in range(len(rows))],
        rows=torch.tensor(rows, dtype=torch.int64),
        prefix_lens=prefix_lens,
        new_lens=new_lens,
        out_cache_loc=slots,
        created=[False] * len(rows),
    )


class _FakeGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_shape_pads_and_buckets():
    """Shape pads the batch and buckets the context."""
    graphs = GraphRunner(_runner(max_context_len=200), max_bs=20, use_graphs=False)
    assert graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
    assert graphs.shape(_alloc([10, 3, 60], [1, 1, 1], [4, 5, 6])) == (3, 4, 64)
    assert graphs.shape(_alloc([64], [1], [2])) == (1, 1, 128)
    assert graphs.shape(_alloc([150] * 9, [4] * 9, list(range(1, 10)))) == (9, 16, 200)  # capped at the cache
    with pytest.raises(AssertionError, match="exceeds the graphs' 20"):
        graphs.padded(21)
    with pytest.raises(ValueError, match="exceeds the cache's limit"):
        graphs.context(_alloc([200], [1], [1]))


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="use_graphs=False"):
        GraphRunner(_runner(), max_bs=4, use_graphs=True)


def test_static_buffers_zero_padded():
    """Padded requests and rows read zeros (table row 0, slot 0, token 0), also where an
    earlier, larger batch left values behind."""
    graphs = GraphRunner(_runner(), max_bs=4, use_graphs=False)
    static = graphs.static_requests(StaticRequests, 4)
    static.rows.fill_(9)
    static.prefix_lens.fill_(9)
    static.fill_requests(_alloc([5, 7], [1, 1], [3, 8]), padded=4)
    assert static.rows.tolist() == [3, 8, 0, 0]
    assert static.prefix_lens.tolist() == [5, 7, 0, 0]
    buf = torch.full((8,), 9, dtype=torch.int64)
    fill_padded(buf, torch.tensor([1, 2, 3]), valid=3, padded=6)
    assert buf.tolist() == [1, 2, 3, 0, 0, 0, 9, 9]  # past the padded size: untouched, never read
    table: dict[int, torch.Tensor] = {}
    made = graphs.cached(table, 2, lambda: graphs.zeros(2))
    assert graphs.cached(table, 2, lambda: graphs.zeros(5)) is made  # made once per key


def test_static_path_runs_the_body_every_time():
    graphs = GraphRunner(_runner(), max_bs=4, use_graphs=False)
    table = graphs.new_table()
    calls = []
    for key in ("a", "a", "b"):
        graphs.replay(
            table, key, lambda key=key: calls.append(key) or key, before_capture=lambda: calls.append("!")
        )
    assert calls == ["a", "a", "b"]  # no capture, so nothing prepares one
    assert graphs.num_shapes == 2 and graphs.num_captured == 0
    assert all(entry.graph is None for entry in table.values())


def test_capture_once_then_replay(monkeypatch):
    """A key's first step captures its body (after ``before_capture``); later steps replay
    the graph and return the captured outputs without running the body."""
    captures = []

    def fake_capture(body, device, pool, *, warmups):
        captures.append(warmups)
        return _FakeGraph(), body()

    monkeypatch.setattr(graph_runner, "capture_graph", fake_capture)
    graphs = GraphRunner(_runner(), max_bs=4, use_graphs=False, warmups=2)
    graphs.use_graphs = True  # as on a GPU, up to the capture itself
    table = graphs.new_table()
    bodies, prepared = [], []
    out = torch.zeros(1)

    def step(key: str) -> torch.Tensor:
        return graphs.replay(
            table, key, lambda: bodies.append(key) or out, before_capture=lambda: prepared.append(key)
        )

    assert step("a") is out and step("a") is out and step("a") is out
    step("b")
    assert captures == [2, 2] and bodies == ["a", "b"] and prepared == ["a", "b"]
    assert table["a"].graph.replays == 2 and table["b"].graph.replays == 0
    assert graphs.num_shapes == graphs.num_captured == 2
    assert isinstance(table["a"], Captured)


def test_failed_capture_turns_off(monkeypatch):
    """The failing step runs eagerly; graphs captured before keep replaying; new shapes run
    on the static path with no further capture attempt."""
    attempts = []

    def fake_capture(body, device, pool, *, warmups):
        attempts.append(1)
        if len(attempts) == 2:
            raise RuntimeError("operation failed due to a previous error during capture")
        return _FakeGraph(), body()

    monkeypatch.setattr(graph_runner, "capture_graph", fake_capture)
    graphs = GraphRunner(_runner(), max_bs=4, use_graphs=False)
    graphs.use_graphs = True
    table = graphs.new_table()
    bodies = []

    def step(key: str) -> str:
        return graphs.replay(table, key, lambda: bodies.append(key) or key)

    assert [step("a"), step("b"), step("a"), step("c"), step("b")] == ["a", "b", "a", "c", "b"]
    assert len(attempts) == 2
    assert graphs.capture_failures == 1 and not graphs.use_graphs
    assert bodies == ["a", "b", "c", "b"]  # "a" replayed its graph the second time
    assert table["a"].graph.replays == 1 and table["b"].graph is None and table["c"].graph is None
    assert graphs.num_shapes == 3 and graphs.num_captured == 1


def test_verify_replays_own_width(static_graph_pair, ops):
    """Verify widths 3 and 4 get a graph and a LoRA layout each; a layout refuses a replay
    of another width loudly, as it does under CUDA graphs."""
    eager, graphed = static_graph_pair(("attn-r8",), max_bs=4)
    gen = torch.Generator().manual_seed(4)
    rids, lora = ["a", "b"], ["attn-r8", None]
    prompts = [torch.randint(3, 512, (n,), generator=gen) for n in (5, 7)]
    for r in (eager, graphed):
        ops.extend(r, rids, prompts, names=lora)
    for width in (3, 4):
        blocks = [torch.randint(3, 512, (width,), generator=gen) for _ in rids]
        torch.testing.assert_close(
            ops.verify(graphed, rids, blocks, names=lora).logits,
            ops.verify(eager, rids, blocks, names=lora).logits,
            atol=1e-5,
            rtol=0,
        )
    graphs = graphed.graphs
    assert sorted(key.width for key in graphs._graphs) == [3, 4]
    meta = graphs._lora_meta[(ForwardMode.TARGET_VERIFY, 4)]
    lm = graphed.lora
    with pytest.raises(
        ValueError, match="verifies 3 tokens per request but the CUDA graph was captured for 4"
    ):
        meta.update([0, -1], lm.slot_ranks(), lm.slot_scalings(), num_draft_tokens=3, batch_size=2)
