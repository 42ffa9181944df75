"""CUDA-graph warm-up: run every captured batch size at every context bucket at start-up.

Graphs are captured lazily, the first time a shape key is seen (:mod:`..runner.cuda_graph`),
and a capture takes tens to hundreds of milliseconds, which a live request would pay. The
server runs :func:`warm_up` after the engine starts and before ``/ready`` turns 200, so the
decode / target-verify graphs of every batch size the scheduler can run, at every context
bucket up to ``cuda_graph.warmup_context`` tokens, exist before the first request (the
draft's graphs too, since the warm-up runs real requests through the whole decoder).

:func:`plan_warmup` (pure) decides the items; :func:`run_item` runs one on a started
engine. How an item reaches its key: a graph's context bucket is that of the batch's
*longest* request, so an item is one request whose prompt puts every decode step inside
the bucket, plus ``batch_size - 1`` one-token requests. All of them are prefilled before
any decodes (``new_tokens`` leaves room for every extend step the prompts need, during
which the decode steps in between may each take a verify's width), and every request
lives for at least two decode steps after that, whatever the draft's acceptance: the
first step after a prefill and the steps after it can differ (a draft fed from an
extend, or from a verify).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..contract.config import CudaGraphConfig
from ..runner.graph_runner import MIN_CONTEXT_BUCKET, graph_batch_sizes
from ..sampling import SamplingParams
from .request import FinishReason, Request, RequestOutput
from .stats import EngineObserver

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("loraserve.warmup")

MIN_NEW_TOKENS = 4
"""The fewest tokens an item's requests generate (one from the prefill, the rest decoded)."""
SHORT_PROMPT = 1
"""Prompt tokens of an item's requests beside its longest one (they fill the batch only)."""
ITEM_TIMEOUT_S = 600.0
"""How long one item may take (its captures included) before the warm-up fails."""


class WarmupError(RuntimeError):
    """The warm-up could not run an item; the message names it and why."""


@dataclass(frozen=True)
class WarmupLimits:
    """What the engine allows, as far as the plan needs it."""

    max_running_requests: int
    """Requests the scheduler decodes together (bounded by the KV cache's rows too)."""
    kv_capacity: int
    """KV cache tokens."""
    context_len: int
    """The longest request (prompt and output) the engine takes."""
    bucket_limit: int
    """Where context buckets are capped (the KV cache's longest context)."""
    tokens_per_step: int
    """KV tokens one decode step may append to a request: 1, or the verify width."""
    chunk_budget: int
    """Prompt tokens one extend step prefills."""


@dataclass(frozen=True)
class WarmupItem:
    """One batch of warm-up requests, run together.

    ``batch_size`` requests (padded to ``graph_batch_size`` in the graphs) decode at context
    bucket ``context``: one with a prompt of ``prompt_len`` tokens, the others with
    :data:`SHORT_PROMPT` tokens, each generating exactly ``new_tokens``; all on ``adapter``
    (None: the base model).
    """

    batch_size: int
    graph_batch_size: int
    context: int
    prompt_len: int
    new_tokens: int
    adapter: str | None = None

    @property
    def kv_tokens(self) -> int:
        """KV tokens the item's prompts and outputs take (a verify's rows come on top)."""
        return self.prompt_len + (self.batch_size - 1) * SHORT_PROMPT + self.batch_size * self.new_tokens


@dataclass(frozen=True)
class WarmupReport:
    """What a warm-up did: items run, seconds, and the graphs held after it."""

    items: int
    seconds: float
    graphs: int
    draft_graphs: int | None = None


def context_buckets(warmup_context: int, limits: WarmupLimits) -> list[int]:
    """The context buckets a context of up to ``warmup_context`` tokens (capped at the
    engine's context length) falls in: 64, 128, ... as :func:`context_bucket` keys them."""
    top = min(warmup_context, limits.context_len)
    if top <= 0:
        return []
    buckets, bucket = [], MIN_CONTEXT_BUCKET
    while True:
        buckets.append(min(bucket, limits.bucket_limit))
        if bucket >= top or bucket >= limits.bucket_limit:
            return buckets
        bucket *= 2


def _item(batch: int, padded: int, lower: int, bucket: int, limits: WarmupLimits, adapter: str | None):
    """The item of ``batch`` requests at the bucket of contexts in ``(lower, bucket]``, or
    None where its steps cannot all stay in that bucket or its KV does not fit."""
    width = limits.tokens_per_step
    prompt = lower + 1  # the first decode step's context already exceeds ``lower``
    extends = math.ceil((prompt + (batch - 1) * SHORT_PROMPT) / limits.chunk_budget)
    # One token from the prefill, up to ``width`` per decode step run between the extends,
    # then room for two more decode steps.
    new_tokens = max(MIN_NEW_TOKENS, 2 + width * extends)
    item = WarmupItem(batch, padded, bucket, prompt, new_tokens, adapter)
    # The last decode step's context (prompt, outputs, a verify's rows) within the bucket.
    if prompt + new_tokens + width > min(bucket, limits.context_len):
        return None
    if item.kv_tokens + batch * width > limits.kv_capacity:
        return None  # such a batch never runs at once
    return item


def plan_warmup(
    graphs: CudaGraphConfig, limits: WarmupLimits, adapter: str | None = None
) -> list[WarmupItem]:
    """The warm-up's items: every captured batch size the scheduler can fill, at every
    context bucket up to ``graphs.warmup_context`` tokens; each once more on ``adapter``
    when one is given (graphs with LoRA are keys of their own).

    A batch size is warmed with as many requests as it holds, or where the scheduler runs
    fewer, with ``max_running_requests`` when they still pad to it. Items whose steps cannot
    stay inside their bucket (a verify wider than the bucket leaves room for) or whose
    tokens do not fit the KV cache are left out. Empty when ``warmup_context`` is 0.
    """
    if graphs.warmup_context < 0:
        raise ValueError(
            f"cuda_graph.warmup_context must be >= 0 (0 captures graphs on first use), got {graphs.warmup_context}"
        )
    buckets = context_buckets(graphs.warmup_context, limits)
    items: list[WarmupItem] = []
    for variant in (None, adapter) if adapter is not None else (None,):
        previous = 0
        for padded in graph_batch_sizes(graphs.max_bs):
            batch = min(padded, limits.max_running_requests)
            if batch <= previous:
                break  # larger sizes hold batches the scheduler never runs
            previous = padded
            lower = 0
            for bucket in buckets:
                item = _item(batch, padded, lower, bucket, limits, variant)
                if item is not None:
                    items.append(item)
                lower = bucket
    return items


# ---------------------------------------------------------------------- running it
def warmup_limits(engine: Engine) -> WarmupLimits:
    """The plan's view of a built engine."""
    kv = engine.kv
    return WarmupLimits(
        max_running_requests=engine.limits.max_running_requests,
        kv_capacity=int(kv.capacity),
        context_len=int(engine.context_len),
        bucket_limit=int(kv.max_context_len),
        tokens_per_step=engine.limits.decode_tokens_per_step,
        chunk_budget=engine.limits.chunk_budget,
    )


def warmup_adapter(engine: Engine) -> str | None:
    """An adapter to warm the LoRA graphs with (a pinned one first, which always has a
    slot), or None: no adapter loaded, or batches with adapters never replay graphs."""
    graphs = getattr(engine.runner, "graphs", None)
    names = engine.adapter_names
    if not names or not getattr(graphs, "lora_in_graphs", False):
        return None
    pinned = [i.name for i in engine.list_adapters() if i.pinned and i.name in names]
    return min(pinned or names)


def item_prompts(item: WarmupItem, vocab_size: int) -> list[list[int]]:
    """The item's prompts, longest first, each starting differently (requests that would
    compute the same tokens are not prefilled side by side under the prefix cache)."""
    prompts = []
    for j in range(item.batch_size):
        n = item.prompt_len if j == 0 else SHORT_PROMPT
        head = [j % vocab_size, (j // vocab_size + 1) % vocab_size]
        prompts.append([*head, *((7 * k + 3) % vocab_size for k in range(n))][:n])
    return prompts


class _Batch:
    """Collects the final outputs of one item's requests."""

    def __init__(self, count: int) -> None:
        self.finals: dict[str, RequestOutput] = {}
        self._count = count
        self._lock = threading.Lock()
        self.done = threading.Event()

    def sink(self, out: RequestOutput) -> None:
        if not out.finished:
            return
        with self._lock:
            self.finals[out.rid] = out
            if len(self.finals) == self._count:
                self.done.set()


def run_item(engine: Engine, item: WarmupItem, *, index: int = 0, timeout_s: float = ITEM_TIMEOUT_S) -> None:
    """Run one item on a started engine and wait for it; :class:`WarmupError` if any of
    its requests fails or does not finish in ``timeout_s``."""
    vocab = engine.vocab_size or 2
    batch = _Batch(item.batch_size)
    params = SamplingParams(max_tokens=item.new_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        Request(rid=f"warmup-{index}-{j}", prompt_ids=ids, params=params, adapter=item.adapter, sink=batch.sink)
        for j, ids in enumerate(item_prompts(item, vocab))
    ]
    gate = threading.Event()
    engine.call(gate.wait)  # holds the engine between steps: the item arrives at once
    try:
        for req in requests:
            engine.submit(req)
    except Exception as exc:
        raise WarmupError(f"warm-up item {item} could not be submitted: {exc}") from exc
    finally:
        gate.set()
    if not batch.done.wait(timeout_s):
        for req in requests:
            engine.abort(req.rid)
        raise WarmupError(f"warm-up item {item} did not finish in {timeout_s:g} s")
    for req in requests:
        out = batch.finals[req.rid]
        if out.finish_reason is not FinishReason.LENGTH or out.completion_tokens != item.new_tokens:
            why = out.error.message if out.error is not None else f"finished with {out.finish_reason}"
            raise WarmupError(f"warm-up item {item} failed: request {req.rid}: {why}")


def warm_up(engine: Engine, *, timeout_s: float = ITEM_TIMEOUT_S) -> WarmupReport | None:
    """Capture the graphs :func:`plan_warmup` names by running its items on ``engine``
    (started); None where nothing is warmed (CUDA graphs off, no graph runner, or
    ``cuda_graph.warmup_context`` 0). Raises :class:`WarmupError` if an item fails.

    The engine's observer sees none of it (serving metrics count clients' requests); the
    prefix cache is emptied afterwards (warm-up prompts are no one's prefix), and the step
    costs and the speculation switch forget the warm-up's steps (they carried captures).
    """
    graphs_config = engine.config.cuda_graph
    graphs = getattr(engine.runner, "graphs", None)
    if not graphs_config.enabled or graphs is None or graphs_config.warmup_context <= 0:
        return None
    plan = plan_warmup(graphs_config, warmup_limits(engine), warmup_adapter(engine))
    began = time.perf_counter()
    observer, engine.observer = engine.observer, EngineObserver()
    ran = 0
    try:
        for item in plan:
            run_item(engine, item, index=ran, timeout_s=timeout_s)
            ran += 1
            if graphs.capture_failures:
                # The runner stopped capturing (logged): later items would only run eagerly.
                log.warning("a CUDA graph capture failed; the warm-up stops after %d of %d items", ran, len(plan))
                break
    finally:
        engine.observer = observer
    if engine.prefix.enabled:
        engine.reset_prefix_cache().result(timeout_s)
    engine.forget_step_measurements().result(timeout_s)
    report = WarmupReport(
        items=ran,
        seconds=time.perf_counter() - began,
        graphs=int(graphs.num_graphs),
        draft_graphs=_draft_graphs(engine),
    )
    log.info(
        "CUDA graph warm-up: %d items in %.1f s; graphs held: %d target%s",
        report.items,
        report.seconds,
        report.graphs,
        "" if report.draft_graphs is None else f", {report.draft_graphs} draft",
    )
    return report


def _draft_graphs(engine: Engine) -> int | None:
    """Graphs the draft's runner holds, or None (no draft model, or no graphs)."""
    drafter = getattr(engine.decoder, "drafter", None)
    graphs = getattr(getattr(drafter, "runner", None), "graphs", None)
    return None if graphs is None else int(graphs.num_graphs)
