"""The CUDA-graph warm-up: its plan (pure), and its run on a real engine whose graph runner
takes the padded static path (``use_graphs=False``): every shape a GPU would capture is
entered in the runner's table, so the keys the warm-up leaves there are exactly the
graphs a GPU would hold."""

from __future__ import annotations

import pytest
import torch

from loraserve.kernels import ForwardMode
from loraserve.runtime.contract.config import CudaGraphConfig, SpecAlgorithm
from loraserve.runtime.engine import Engine
from loraserve.runtime.engine.warmup import (
    SHORT_PROMPT,
    WarmupError,
    WarmupItem,
    WarmupLimits,
    context_buckets,
    item_prompts,
    plan_warmup,
    run_item,
    warm_up,
    warmup_limits,
)
from loraserve.runtime.runner.cuda_graph import CudaGraphRunner
from loraserve.runtime.runner.model_runner import ModelRunner
from loraserve.runtime.speculative import build_decoder

from .conftest import engine_config, make_request, wait_all

LIMITS = WarmupLimits(
    max_running_requests=64,
    kv_capacity=1 << 20,
    context_len=4096,
    bucket_limit=4096,
    tokens_per_step=1,
    chunk_budget=2048,
)


def graphs(**kw) -> CudaGraphConfig:
    cfg = CudaGraphConfig(enabled=True, max_bs=kw.pop("max_bs", 64), warmup_context=kw.pop("warmup_context", 1024))
    assert not kw
    return cfg


def limits(**kw) -> WarmupLimits:
    return WarmupLimits(**{**LIMITS.__dict__, **kw})


def keys(plan: list[WarmupItem]) -> set[tuple[int, int, bool]]:
    return {(i.graph_batch_size, i.context, i.adapter is not None) for i in plan}


# ---------------------------------------------------------------------- the plan
def test_plan_covers_sizes_and_buckets():
    """Plan covers every batch size at every bucket."""
    plan = plan_warmup(graphs(), LIMITS)
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    buckets = [64, 128, 256, 512, 1024]
    assert keys(plan) == {(s, b, False) for s in sizes for b in buckets}
    assert len(plan) == len(sizes) * len(buckets)
    for item in plan:
        assert item.batch_size == item.graph_batch_size and item.adapter is None
        lower = item.context // 2 if item.context > 64 else 0
        # The first decode step's context is past the smaller bucket, the last within its own.
        assert item.prompt_len > lower
        assert item.prompt_len + item.new_tokens + LIMITS.tokens_per_step <= item.context
        assert item.new_tokens >= 4


def test_buckets_stop_at_context():
    """Buckets stop at the warmup context and the context length."""
    assert context_buckets(1024, LIMITS) == [64, 128, 256, 512, 1024]
    assert context_buckets(1000, LIMITS) == [64, 128, 256, 512, 1024]  # 1000 tokens fall in 1024
    assert context_buckets(100, LIMITS) == [64, 128]
    assert context_buckets(10, LIMITS) == [64]
    # Capped at the model's context; a cache shorter than a power of two caps the last bucket.
    assert context_buckets(1 << 20, limits(context_len=512, bucket_limit=512)) == [64, 128, 256, 512]
    assert context_buckets(4096, limits(context_len=1000, bucket_limit=1000)) == [64, 128, 256, 512, 1000]
    capped = plan_warmup(graphs(max_bs=1, warmup_context=4096), limits(context_len=1000, bucket_limit=1000))
    assert [i.context for i in capped] == [64, 128, 256, 512, 1000]
    assert all(i.prompt_len + i.new_tokens + 1 <= 1000 for i in capped)


def test_warmup_context_zero_or_negative():
    """Warmup context zero plans nothing and negative is refused."""
    assert plan_warmup(graphs(warmup_context=0), LIMITS) == []
    with pytest.raises(ValueError, match=r"cuda_graph\.warmup_context must be >= 0"):
        plan_warmup(graphs(warmup_context=-1), LIMITS)


def test_batch_sizes_stop_at_scheduler():
    """Batch sizes stop at what the scheduler runs."""
    plan = plan_warmup(graphs(max_bs=64, warmup_context=64), limits(max_running_requests=20))
    # 20 requests pad to the 24 graph; 32 and above never run.
    assert [(i.batch_size, i.graph_batch_size) for i in plan] == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (20, 24)]
    exact = plan_warmup(graphs(max_bs=64, warmup_context=64), limits(max_running_requests=16))
    assert [i.graph_batch_size for i in exact] == [1, 2, 4, 8, 16]


def test_unfit_items_left_out():
    """Items whose tokens do not fit the KV cache are left out."""
    full = plan_warmup(graphs(max_bs=8), LIMITS)
    capacity = 530  # a 1024-token bucket's long prompt is 513 tokens
    plan = plan_warmup(graphs(max_bs=8), limits(kv_capacity=capacity))
    assert plan == [i for i in full if i.kv_tokens + i.batch_size <= capacity]
    assert {(4, 1024, False), (8, 1024, False)} <= keys(full) - keys(plan)
    assert {(1, 1024, False), (2, 1024, False), (8, 512, False)} <= keys(plan)  # they still fit


def test_adapter_variant_replans():
    """The adapter variant plans every item again on the adapter."""
    base = plan_warmup(graphs(max_bs=8, warmup_context=256), LIMITS)
    plan = plan_warmup(graphs(max_bs=8, warmup_context=256), LIMITS, adapter="sql")
    assert plan[: len(base)] == base
    assert [i.adapter for i in plan[len(base) :]] == ["sql"] * len(base)
    assert keys(plan) == keys(base) | {(s, b, True) for s, b, _ in keys(base)}


def test_speculation_leaves_verify_room():
    """Speculation leaves room for the verify width and outlives the prefill."""
    wide = limits(tokens_per_step=8, chunk_budget=256)
    plan = plan_warmup(graphs(max_bs=64, warmup_context=1024), wide)
    for item in plan:
        assert item.prompt_len + item.new_tokens + 8 <= item.context
        extends = -(-(item.prompt_len + (item.batch_size - 1) * SHORT_PROMPT) // 256)
        # A verify may take 8 tokens per decode step between extends, and two steps follow.
        assert item.new_tokens >= 2 + 8 * extends
    # A 64-token bucket has no room for a verify of 40 rows after any prompt.
    assert 64 not in {i.context for i in plan_warmup(graphs(max_bs=1), limits(tokens_per_step=40))}


def test_prompts_valid_and_ordered():
    """Prompts are valid distinct and longest first."""
    item = WarmupItem(8, 8, 128, 65, 4)
    prompts = item_prompts(item, vocab_size=512)
    assert [len(p) for p in prompts] == [65] + [SHORT_PROMPT] * 7
    assert len({tuple(p[:2]) for p in prompts}) == 8
    assert all(0 <= t < 512 for p in prompts for t in p)


# ---------------------------------------------------------------------- the run
def _engine(
    engine_assets, *, warmup_context=256, max_bs=8, prefix_cache=True, spec=False, auto_disable=False, **kw
) -> Engine:
    cfg = engine_config(engine_assets, max_running_requests=kw.pop("max_running_requests", 8), **kw)
    cfg.scheduler.prefix_cache = prefix_cache
    cfg.cuda_graph.enabled = True
    cfg.cuda_graph.max_bs = max_bs
    cfg.cuda_graph.warmup_context = warmup_context
    if spec:
        cfg.speculative.algorithm = SpecAlgorithm.NGRAM
        cfg.speculative.num_steps = 3
        cfg.speculative.num_draft_tokens = 4
        cfg.speculative.auto_disable = auto_disable
    runner = ModelRunner(cfg)
    # The static padded path on the CPU: each shape enters the table as a GPU would capture it.
    runner.graphs = CudaGraphRunner(runner, max_bs=max_bs, use_graphs=False)
    engine = Engine(cfg, runner, decoder_factory=build_decoder)
    engine.start()
    return engine


def _step_keys(engine: Engine) -> set[tuple[ForwardMode, int, int, int, bool]]:
    return {(k.mode, k.width, k.batch_size, k.context, k.lora) for k in engine.runner.graphs._graphs}


def _serve(engine: Engine, *, prompt_len: int, stride: int, adapter: str | None = None) -> list:
    """Four requests of ``prompt_len`` tokens, 8 new tokens each, run to their end."""
    collected = []
    for j in range(4):
        r, c = make_request([(stride * j + k) % 500 for k in range(prompt_len)], adapter, max_tokens=8)
        engine.submit(r)
        collected.append(c)
    wait_all(collected)
    assert all(len(c.token_ids) == 8 and c.error is None for c in collected)
    return collected


@pytest.fixture
def engines():
    made: list[Engine] = []
    yield made
    for e in made:
        e.shutdown(drain_timeout_s=2.0)


def test_warmup_holds_decode_keys(engine_assets, engines):
    """Warmup holds every planned decode key and serving adds none."""
    engine = _engine(engine_assets)
    engines.append(engine)
    report = warm_up(engine)
    plan = plan_warmup(engine.config.cuda_graph, warmup_limits(engine), "chat-r16")
    assert report is not None and report.items == len(plan) and report.draft_graphs is None
    assert {i.adapter for i in plan} == {None, "chat-r16"}  # the smallest adapter name
    held = _step_keys(engine)
    assert report.graphs == engine.runner.graphs.num_shapes
    want = {(ForwardMode.DECODE, 1, i.graph_batch_size, i.context, i.adapter is not None) for i in plan}
    assert want <= held
    assert {(s, c) for _, _, s, c, _ in want} == {(s, c) for s in (1, 2, 4, 8) for c in (64, 128, 256)}

    # Serving within the warmed range: no new decode shape (no capture on a GPU).
    before = {k for k in held if k[0] is ForwardMode.DECODE}
    for adapter in (None, "sql-r8"):
        _serve(engine, prompt_len=100, stride=11, adapter=adapter)
    after = {k for k in _step_keys(engine) if k[0] is ForwardMode.DECODE}
    assert after == before


def test_full_batches_reached(engine_assets, engines):
    """Extend and decode steps alternate while prompts are prefilled: every request of an
    item must still be running when the last of them is prefilled."""
    engine = _engine(engine_assets, chunked_prefill_size=48, prefix_cache=False)
    engines.append(engine)
    assert warm_up(engine) is not None
    plan = plan_warmup(engine.config.cuda_graph, warmup_limits(engine), "chat-r16")
    assert max(i.prompt_len for i in plan) > 2 * 48  # the 256 bucket's prompt takes three extends
    want = {(ForwardMode.DECODE, 1, i.graph_batch_size, i.context, i.adapter is not None) for i in plan}
    assert want <= _step_keys(engine)


def test_warmup_leaves_nothing_behind(engine_assets, engines):
    engine = _engine(engine_assets, warmup_context=128)
    engines.append(engine)
    assert warm_up(engine) is not None
    snap = engine.snapshot
    assert snap.num_running == 0 and snap.num_waiting == 0
    assert snap.kv_free_tokens == snap.kv_total_tokens == engine.kv.capacity
    assert engine.kv.num_free_tokens == engine.kv.capacity
    assert engine.prefix.enabled and engine.kv.num_cached_tokens == 0
    assert engine.snapshot.steps > 0 and engine.scheduler.costs.decode_seconds is None  # captures' steps forgotten


def test_warmup_off_without_graphs(engine_assets, engines):
    """Warmup is off without graphs or with a zero context."""
    engine = _engine(engine_assets, warmup_context=0)
    engines.append(engine)
    assert warm_up(engine) is None
    assert engine.runner.graphs.num_shapes == 0
    engine.config.cuda_graph.warmup_context = 128
    engine.config.cuda_graph.enabled = False
    assert warm_up(engine) is None
    engine.config.cuda_graph.enabled = True
    engine.runner.graphs = None
    assert warm_up(engine) is None
    assert engine.snapshot.steps == 0


def test_warmup_holds_verify_keys(engine_assets, engines):
    """Warmup with speculation holds the verify keys."""
    engine = _engine(engine_assets, spec=True, warmup_context=128, max_bs=4, prefix_cache=False)
    engines.append(engine)
    assert engine.limits.decode_tokens_per_step == 4
    report = warm_up(engine)
    plan = plan_warmup(engine.config.cuda_graph, warmup_limits(engine), "chat-r16")
    assert report is not None and report.items == len(plan)
    held = _step_keys(engine)
    want = {(ForwardMode.TARGET_VERIFY, 4, i.graph_batch_size, i.context, i.adapter is not None) for i in plan}
    assert want <= held
    assert {(s, c) for _, _, s, c, _ in want} == {(s, c) for s in (1, 2, 4) for c in (64, 128)}
    before = {k for k in held if k[0] is not ForwardMode.EXTEND}
    _serve(engine, prompt_len=90, stride=13)
    assert {k for k in _step_keys(engine) if k[0] is not ForwardMode.EXTEND} == before


def test_warmup_steps_forgotten(engine_assets, engines):
    """The warm-up's steps carry graph captures and batches no client sent: the speculation
    switch's throughputs and the scheduler's step costs start from serving's first step."""
    engine = _engine(engine_assets, spec=True, auto_disable=True, warmup_context=128, max_bs=4, prefix_cache=False)
    engines.append(engine)
    switch = engine.decoder.switch
    assert switch is not None and warm_up(engine) is not None and engine.snapshot.steps > 0
    assert switch._buckets == {} and switch.rates(1) == {}
    assert engine.scheduler.costs.decode_seconds is None and engine.scheduler.costs.extend_fixed_seconds is None


def test_a_failing_item_raises_naming_it(engine_assets, engines):
    engine = _engine(engine_assets)
    engines.append(engine)
    with pytest.raises(WarmupError, match=r"could not be submitted: .*no-such-adapter"):
        run_item(engine, WarmupItem(2, 2, 64, 1, 4, adapter="no-such-adapter"))
    # Longer than the engine's context: refused at submission, named.
    with pytest.raises(WarmupError, match=r"WarmupItem\(batch_size=1"):
        run_item(engine, WarmupItem(1, 1, 64, engine.context_len, 4))
    assert engine.snapshot.num_running == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_warmed_range_captures_nothing(engine_assets, engines):
    """On a GPU serving within the warmed range captures nothing."""
    cfg = engine_config(engine_assets, max_running_requests=8)
    cfg.device = "cuda"
    cfg.cuda_graph.enabled = True
    cfg.cuda_graph.max_bs = 8
    cfg.cuda_graph.warmup_context = 256
    # Prefills eager: extend graphs are keyed by prefill shapes, which the warm-up leaves lazy.
    cfg.cuda_graph.max_prefill_tokens = 0
    engine = Engine(cfg, ModelRunner(cfg))
    engine.start()
    engines.append(engine)
    assert engine.runner.graphs is not None and engine.runner.graphs.use_graphs
    report = warm_up(engine)
    assert report is not None and report.items > 0
    captured = engine.runner.graphs.num_captured
    assert captured > 0 and engine.runner.graphs.capture_failures == 0
    warmed = {k for k in engine.runner.graphs._graphs if k.mode is ForwardMode.DECODE}
    _serve(engine, prompt_len=100, stride=11)
    assert engine.runner.graphs.num_captured == captured, "a decode step captured a graph after the warm-up"
    assert {k for k in engine.runner.graphs._graphs if k.mode is ForwardMode.DECODE} == warmed
