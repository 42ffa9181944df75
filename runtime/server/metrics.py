"""Prometheus metrics of one runtime process.

Names follow vLLM's (``vllm:`` prefix, ``model_name`` label) wherever vLLM has the same
metric, because LoRA-aware routers and dashboards read those names: in particular
``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``,
whose value is the time of the sample, and ``vllm:num_requests_waiting`` /
``vllm:kv_cache_usage_perc``. Metrics vLLM has no counterpart for use ``loraserve:``.

Request-level metrics are fed by the engine (:class:`EngineObserver` hooks, on the
engine thread); queue and cache gauges are read from the engine's snapshot at scrape
time, so they are never stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..contract.catalog import public_name
from ..engine.request import Request
from ..engine.stats import EngineObserver, EngineSnapshot

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)
ACCEPT_BUCKETS = tuple(range(0, 17))

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics(EngineObserver):
    """The process's registry; also the engine's observer."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot | None] = lambda: None) -> None:
        self.model_name = model_name
        self.snapshot = snapshot
        self.adapters_loaded: Callable[[], int] = lambda: 0
        self.registry = CollectorRegistry(auto_describe=True)
        reg, label = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", label, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", label, registry=reg)
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*label, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            label,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens.",
            label,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            label,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.preemptions = Counter(
            "vllm:num_preemptions", "Requests retracted to free KV cache.", label, registry=reg
        )
        self.spec_drafts = Counter(
            "vllm:spec_decode_num_drafts", "Speculative verify steps.", label, registry=reg
        )
        self.spec_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", label, registry=reg
        )
        self.spec_accepted_tokens = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", label, registry=reg
        )
        self.http_requests = Counter(
            "loraserve:http_requests", "HTTP requests by route and status.", ["route", "status"], registry=reg
        )
        self.requests = Counter(
            "loraserve:requests",
            "Generation requests by model (base or adapter) and outcome.",
            ["model", "finished_reason"],
            registry=reg,
        )
        self.batch_size = Histogram(
            "loraserve:batch_size", "Requests per engine step.", ["kind"], buckets=BATCH_BUCKETS, registry=reg
        )
        self.step_seconds = Histogram(
            "loraserve:step_seconds", "Engine step time.", ["kind"], buckets=ITL_BUCKETS, registry=reg
        )
        self.accept_length = Histogram(
            "loraserve:spec_accept_length",
            "Draft tokens accepted per verify step.",
            ["model"],
            buckets=ACCEPT_BUCKETS,
            registry=reg,
        )
        self.adapter_accepted = Counter(
            "loraserve:spec_accepted_tokens", "Draft tokens accepted, per model.", ["model"], registry=reg
        )
        self.adapter_drafted = Counter(
            "loraserve:spec_draft_tokens", "Draft tokens proposed, per model.", ["model"], registry=reg
        )
        self.adapter_loads = Counter(
            "loraserve:adapter_loads",
            "Adapter loads by trigger (demand: a request; admin: the admin API) and outcome.",
            ["trigger", "outcome"],
            registry=reg,
        )
        self.adapter_load_seconds = Histogram(
            "loraserve:adapter_load_seconds",
            "Time from a request naming an adapter this pod did not hold to the adapter loaded.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
            registry=reg,
        )
        self.adapter_evictions = Counter(
            "loraserve:adapter_evictions",
            "Idle on-demand adapters unloaded to make room in the host cache.",
            registry=reg,
        )
        self.warmup_seconds = Gauge(
            "loraserve:cuda_graph_warmup_seconds",
            "Seconds the start-up CUDA graph warm-up took (absent: no warm-up ran).",
            label,
            registry=reg,
        )
        # Prefix cache, in tokens: vLLM's names (all models), then per model (base or adapter).
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Tokens looked up in the prefix cache (prompts of admitted requests).",
            label,
            registry=reg,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Tokens found in the prefix cache (not prefilled).", label, registry=reg
        )
        self.prefix_hit_tokens = Counter(
            "loraserve:prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache, per model (base or adapter).",
            ["model"],
            registry=reg,
        )
        self.prefix_query_tokens = Counter(
            "loraserve:prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache, per model (base or adapter).",
            ["model"],
            registry=reg,
        )
        self.prefix_hit_requests = Counter(
            "loraserve:prefix_cache_hit_requests",
            "Admitted requests that reused a cached prefix, per model (base or adapter).",
            ["model"],
            registry=reg,
        )
        reg.register(_SnapshotCollector(self))

    # ---------------------------------------------------------------- engine hooks
    def on_first_token(self, request: Request, ttft_s: float) -> None:
        self.ttft.labels(self.model_name).observe(max(ttft_s, 0.0))

    def on_tokens(self, request: Request, num_tokens: int, gap_s: float) -> None:
        if num_tokens <= 0:
            return
        per_token = max(gap_s, 0.0) / num_tokens
        hist = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            hist.observe(per_token)

    def on_request_finished(self, request: Request) -> None:
        name = self.model_name
        reason = request.finish_reason.value if request.finish_reason is not None else "unknown"
        model = public_name(request.adapter) if request.adapter else name
        self.request_success.labels(name, reason).inc()
        self.requests.labels(model, reason).inc()
        if request.num_cached or request.output_ids:
            self.prompt_tokens.labels(name).inc(len(request.prompt_ids))
        self.generation_tokens.labels(name).inc(len(request.output_ids))
        if request.finished_time is not None:
            self.e2e.labels(name).observe(max(request.finished_time - request.arrival_time, 0.0))
        spec = request.spec
        if spec.verify_steps:
            self.spec_drafts.labels(name).inc(spec.verify_steps)
            self.spec_draft_tokens.labels(name).inc(spec.draft_tokens)
            self.spec_accepted_tokens.labels(name).inc(spec.accepted_tokens)
            self.adapter_drafted.labels(model).inc(spec.draft_tokens)
            self.adapter_accepted.labels(model).inc(spec.accepted_tokens)
            hist = self.accept_length.labels(model)
            for n in spec.accept_lens:
                hist.observe(n)

    def on_step(self, kind: str, batch_size: int, num_tokens: int, seconds: float) -> None:
        self.batch_size.labels(kind).observe(batch_size)
        self.step_seconds.labels(kind).observe(seconds)

    def on_retract(self, request: Request) -> None:
        self.preemptions.labels(self.model_name).inc()

    def on_prefix_lookup(self, request: Request, hit_tokens: int, query_tokens: int) -> None:
        model = public_name(request.adapter) if request.adapter else self.model_name
        self.prefix_queries.labels(self.model_name).inc(query_tokens)
        self.prefix_hits.labels(self.model_name).inc(hit_tokens)
        self.prefix_query_tokens.labels(model).inc(query_tokens)
        self.prefix_hit_tokens.labels(model).inc(hit_tokens)
        if hit_tokens:
            self.prefix_hit_requests.labels(model).inc()

    # ---------------------------------------------------------------- exposition
    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges read from the engine's latest snapshot at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        snap = self.m.snapshot() or EngineSnapshot()
        name = self.m.model_name
        for metric, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", snap.num_running),
            ("vllm:num_requests_waiting", "Requests waiting for admission.", snap.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", snap.kv_usage),
            ("loraserve:kv_cache_total_tokens", "KV cache capacity in tokens.", snap.kv_total_tokens),
            ("loraserve:adapters_loaded", "LoRA adapters loaded and serving.", self.m.adapters_loaded()),
        ):
            yield _per_model(GaugeMetricFamily, metric, doc, name, value)
        yield from _step_totals(snap, name)
        yield from _prefix_cache_gauges(snap, name)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [
                str(snap.max_loras_per_batch),
                _public_names(snap.running_adapters),
                _public_names(snap.waiting_adapters),
            ],
            snap.time if snap.time else time.time(),
        )
        yield info


def _public_names(keys: tuple[str, ...]) -> str:
    """The adapters of engine keys as clients name them (versions of one name count once)."""
    return ",".join(sorted({public_name(k) for k in keys}))


def _per_model(
    family: type[GaugeMetricFamily | CounterMetricFamily], metric: str, doc: str, name: str, value: float
) -> GaugeMetricFamily | CounterMetricFamily:
    """``metric`` with one sample, ``value``, labelled with the served model's ``name``."""
    samples = family(metric, doc, labels=["model_name"])
    samples.add_metric([name], value)
    return samples


def _step_totals(snap: EngineSnapshot, name: str):
    """The engine's cumulative step counters: where serving time goes, per step kind.

    Decoder seconds against host seconds show how much of a step is the model; extends
    during decode and deferred admission steps show what batched admission trades.
    """
    kinds = (("extend", snap.extend), ("decode", snap.decode))
    for metric, doc, attr in (
        ("loraserve:engine_steps", "Engine steps, by kind.", "steps"),
        ("loraserve:engine_step_requests", "Requests summed over steps (batch sizes), by kind.", "requests"),
        ("loraserve:engine_step_tokens", "Tokens prefilled (extend) or generated (decode).", "tokens"),
        (
            "loraserve:engine_decoder_seconds",
            "Seconds inside the decoder (model, drafting, sampling).",
            "seconds",
        ),
    ):
        c = CounterMetricFamily(metric, doc, labels=["model_name", "kind"])
        for kind, totals in kinds:
            c.add_metric([name, kind], getattr(totals, attr))
        yield c
    for metric, doc, value in (
        (
            "loraserve:engine_host_seconds",
            "Seconds of engine-thread work outside the decoder (scheduling, outputs, detokenising).",
            snap.engine_seconds,
        ),
        (
            "loraserve:extends_during_decode",
            "Extend steps that paused running decodes.",
            snap.extends_during_decode,
        ),
        (
            "loraserve:deferred_admission_steps",
            "Decode steps run while admissible requests waited, to batch their prefill.",
            snap.deferred_admission_steps,
        ),
        (
            "loraserve:cuda_graph_capture_failures",
            "CUDA graph captures that failed; after one, uncaptured steps run eagerly.",
            snap.cuda_graph_capture_failures,
        ),
    ):
        yield _per_model(CounterMetricFamily, metric, doc, name, value)
    for metric, doc, value in (
        (
            "loraserve:decode_occupancy",
            "Mean decode batch over max running requests (1 = always full).",
            snap.decode_occupancy,
        ),
        (
            "loraserve:cuda_graphs",
            "CUDA graphs the target's runner holds (captured steps).",
            snap.cuda_graphs,
        ),
    ):
        yield _per_model(GaugeMetricFamily, metric, doc, name, value)


def _prefix_cache_gauges(snap: EngineSnapshot, name: str):
    """The prefix cache's place in the KV pool (absent while the cache is off)."""
    if not snap.prefix_cache_enabled:
        return
    for metric, doc, value in (
        ("loraserve:prefix_cache_tokens", "KV tokens the prefix cache holds.", snap.prefix_cached_tokens),
        (
            "loraserve:prefix_cache_evictable_tokens",
            "Cached KV tokens no request holds (counted free; evicted least recently used first).",
            snap.prefix_evictable_tokens,
        ),
        (
            "loraserve:prefix_cache_usage_perc",
            "The prefix cache's share of the KV pool (1 = all).",
            snap.prefix_cache_share,
        ),
    ):
        yield _per_model(GaugeMetricFamily, metric, doc, name, value)
    yield _per_model(
        CounterMetricFamily,
        "loraserve:prefix_cache_evicted_tokens",
        "Cached KV tokens evicted to make room.",
        name,
        snap.prefix_evicted_tokens,
    )
