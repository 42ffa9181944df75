"""Speculative-decoding counters: accept lengths overall, per adapter and per context length,
verify timing.

Written on the engine thread after every verify step, read by any thread (the server's
``/metrics``): a lock guards the few integers. :meth:`SpecMetrics.collector` returns a
``prometheus_client`` collector the server registers; :meth:`SpecMetrics.snapshot` gives
the same numbers as plain data for tests, logs and benchmarks.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..contract.catalog import public_name
from .switch import batch_bucket

TIME_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
BASE_LABEL = ""
"""The ``adapter`` label of requests on the base model (an empty label is "no adapter")."""
CONTEXT_BUCKETS: tuple[int, ...] = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
"""Lower bounds of the context lengths acceptance is also counted by (label ``context``): a
draft trained on shorter sequences than it serves accepts less as its requests grow, and only
acceptance by context length shows it."""


def context_bucket(tokens: int) -> str:
    """The ``context`` label of a verify step whose request held ``tokens`` tokens before it:
    ``"256-511"``, or ``"32768+"`` past the last bound."""
    i = max(bisect.bisect_right(CONTEXT_BUCKETS, tokens) - 1, 0)
    lower = CONTEXT_BUCKETS[i]
    return f"{lower}+" if i + 1 == len(CONTEXT_BUCKETS) else f"{lower}-{CONTEXT_BUCKETS[i + 1] - 1}"


def context_bucket_start(label: str) -> int:
    """The first context length of a :func:`context_bucket` label (its sort key)."""
    return int(label.split("-")[0].rstrip("+"))


@dataclass
class AcceptStats:
    """Accept-length accounting for one adapter (or overall)."""

    verify_steps: int = 0  # request-steps verified
    draft_tokens: int = 0  # drafts proposed
    accepted_tokens: int = 0  # drafts accepted
    histogram: list[int] = field(default_factory=list)  # histogram[a]: steps that accepted a drafts

    @property
    def mean_accept_len(self) -> float:
        """Mean drafts accepted per verify step."""
        return self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def accept_rate(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per verify step (accepted drafts + the target's own)."""
        return self.mean_accept_len + 1 if self.verify_steps else 0.0

    def add(self, accepted: int, drafted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if accepted >= len(self.histogram):
            self.histogram.extend([0] * (accepted + 1 - len(self.histogram)))
        self.histogram[accepted] += 1


@dataclass
class TimeHistogram:
    """Cumulative-bucket timing histogram (Prometheus layout)."""

    buckets: tuple[float, ...] = TIME_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * len(TIME_BUCKETS_S))
    count: int = 0
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.total += seconds
        for i, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.counts[i] += 1


@dataclass
class SpecSnapshot:
    """A consistent copy of every counter."""

    algorithm: str
    num_draft_tokens: int
    overall: AcceptStats
    per_adapter: dict[str, AcceptStats]
    per_context: dict[str, AcceptStats]  # by context_bucket, shortest first
    verify_seconds: TimeHistogram
    step_seconds: TimeHistogram
    undrafted_steps: int = 0  # decode steps that skipped drafting (speculative.disable_batch_size)
    undrafted_requests: int = 0  # request-steps in them
    shape_steps: dict[tuple[str, int], int] = field(default_factory=dict)  # (shape, batch bucket) -> steps


def _copy_stats(stats: AcceptStats) -> AcceptStats:
    return AcceptStats(stats.verify_steps, stats.draft_tokens, stats.accepted_tokens, list(stats.histogram))


def _copy_hist(hist: TimeHistogram) -> TimeHistogram:
    return TimeHistogram(hist.buckets, list(hist.counts), hist.count, hist.total)


class SpecMetrics:
    """Thread-safe accumulation of speculative-decoding statistics."""

    def __init__(self, algorithm: str, num_draft_tokens: int):
        self.algorithm = algorithm
        self.num_draft_tokens = num_draft_tokens
        self._lock = threading.Lock()
        self._overall = AcceptStats(histogram=[0] * num_draft_tokens)
        self._per_adapter: dict[str, AcceptStats] = {}
        self._per_context: dict[str, AcceptStats] = {}
        self._verify = TimeHistogram()
        self._step = TimeHistogram()
        self._undrafted_steps = 0
        self._undrafted_requests = 0
        self._shape_steps: dict[tuple[str, int], int] = {}

    def _count_shape(self, shape: str, requests: int) -> None:
        key = (str(shape), batch_bucket(max(1, int(requests))))
        self._shape_steps[key] = self._shape_steps.get(key, 0) + 1

    def record_undrafted(self, requests: int) -> None:
        """One decode step of ``requests`` requests that ran without drafting."""
        with self._lock:
            self._undrafted_steps += 1
            self._undrafted_requests += int(requests)
            self._count_shape("plain", requests)

    def record_step(
        self,
        adapters: Sequence[str | None],
        accept_lens: Sequence[int],
        num_drafts: int,
        *,
        contexts: Sequence[int],
        verify_seconds: float,
        step_seconds: float,
        shape: str = "chain",
        bucket_of: int | None = None,
    ) -> None:
        """One verify step of ``shape`` (tree or chain): request ``i`` used ``adapters[i]``,
        held ``contexts[i]`` tokens before the step and accepted ``accept_lens[i]``;
        ``bucket_of``: the step's batch size (default: the requests verified)."""
        if not len(adapters) == len(contexts) == len(accept_lens):
            raise ValueError(
                f"record_step takes one adapter, context and accept length per request; got {len(adapters)},"
                f" {len(contexts)} and {len(accept_lens)}"
            )
        with self._lock:
            for adapter, context, accepted in zip(adapters, contexts, accept_lens, strict=True):
                label = BASE_LABEL if adapter is None else public_name(adapter)  # never a version key
                for table, key in ((self._per_adapter, label), (self._per_context, context_bucket(int(context)))):
                    stats = table.get(key)
                    if stats is None:
                        stats = table[key] = AcceptStats(histogram=[0] * self.num_draft_tokens)
                    stats.add(int(accepted), num_drafts)
                self._overall.add(int(accepted), num_drafts)
            self._verify.observe(verify_seconds)
            self._step.observe(step_seconds)
            self._count_shape(shape, bucket_of if bucket_of is not None else len(adapters))

    def snapshot(self) -> SpecSnapshot:
        with self._lock:
            return SpecSnapshot(
                algorithm=self.algorithm,
                num_draft_tokens=self.num_draft_tokens,
                overall=_copy_stats(self._overall),
                per_adapter={k: _copy_stats(v) for k, v in self._per_adapter.items()},
                per_context={k: _copy_stats(self._per_context[k]) for k in sorted(self._per_context, key=context_bucket_start)},
                verify_seconds=_copy_hist(self._verify),
                step_seconds=_copy_hist(self._step),
                undrafted_steps=self._undrafted_steps,
                undrafted_requests=self._undrafted_requests,
                shape_steps=dict(sorted(self._shape_steps.items())),
            )

    def collector(self, prefix: str = "loraserve:spec"):
        """A ``prometheus_client`` collector of these numbers (register it once).

        The server already counts drafted / accepted tokens per model when requests
        finish; this adds the decoder's live view (updated every step), step timing and
        the configuration, under names that do not clash with the server's.
        """
        return _Collector(self, prefix)


class _Collector:
    """Renders a :class:`SpecMetrics` snapshot as Prometheus metric families."""

    def __init__(self, metrics: SpecMetrics, prefix: str):
        self.metrics = metrics
        self.prefix = prefix

    def describe(self):
        return []  # unchecked collector: families are produced at scrape time

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self.metrics.snapshot()
        p = self.prefix
        info = GaugeMetricFamily(
            f"{p}_info", "Speculative decoding configuration", labels=["algorithm", "num_draft_tokens"]
        )
        info.add_metric([snap.algorithm, str(snap.num_draft_tokens)], 1.0)
        yield info
        steps = CounterMetricFamily(
            f"{p}_step_verifies", "Request verify steps, counted live", labels=["adapter"]
        )
        drafted = CounterMetricFamily(
            f"{p}_step_draft_tokens", "Drafts proposed, counted live", labels=["adapter"]
        )
        accepted = CounterMetricFamily(
            f"{p}_step_accepted_tokens", "Drafts accepted, counted live", labels=["adapter"]
        )
        lengths = HistogramMetricFamily(
            f"{p}_step_accept_length",
            "Drafts accepted per request verify step, counted live",
            labels=["adapter"],
        )
        for adapter, stats in sorted(snap.per_adapter.items()):
            steps.add_metric([adapter], stats.verify_steps)
            drafted.add_metric([adapter], stats.draft_tokens)
            accepted.add_metric([adapter], stats.accepted_tokens)
            cumulative, buckets = 0, []
            for length, count in enumerate(stats.histogram):
                cumulative += count
                buckets.append((str(float(length)), cumulative))
            buckets.append(("+Inf", stats.verify_steps))
            lengths.add_metric([adapter], buckets, sum_value=float(stats.accepted_tokens))
        yield steps
        yield drafted
        yield accepted
        yield lengths
        yield from _context_families(snap, p)
        undrafted = CounterMetricFamily(
            f"{p}_undrafted_steps", "Decode steps run without drafting (batch at or above disable_batch_size)"
        )
        undrafted.add_metric([], snap.undrafted_steps)
        yield undrafted
        undrafted_requests = CounterMetricFamily(
            f"{p}_undrafted_request_steps", "Request-steps decoded without drafting"
        )
        undrafted_requests.add_metric([], snap.undrafted_requests)
        yield undrafted_requests
        shapes = CounterMetricFamily(
            f"{p}_shape_steps",
            "Decode steps by what they verified (tree, chain, plain) and batch-size bucket",
            labels=["shape", "batch_bucket"],
        )
        for (shape, bucket), count in snap.shape_steps.items():
            shapes.add_metric([shape, str(bucket)], count)
        yield shapes
        for name, hist, text in (
            ("verify_seconds", snap.verify_seconds, "Target verify forward plus acceptance, per step"),
            ("step_seconds", snap.step_seconds, "Whole speculative step (draft, verify, accept), per step"),
        ):
            family = HistogramMetricFamily(f"{p}_{name}", text)
            family.add_metric(
                [],
                [(str(b), c) for b, c in zip(hist.buckets, hist.counts, strict=True)]
                + [("+Inf", hist.count)],
                sum_value=hist.total,
            )
            yield family


def _context_families(snap: SpecSnapshot, p: str):
    """Verify steps and accepted drafts by the request's context length (``context``)."""
    from prometheus_client.core import CounterMetricFamily

    steps = CounterMetricFamily(
        f"{p}_context_verifies", "Request verify steps by the request's context length", labels=["context"]
    )
    accepted = CounterMetricFamily(
        f"{p}_context_accepted_tokens", "Drafts accepted by the request's context length", labels=["context"]
    )
    for bucket, stats in snap.per_context.items():
        steps.add_metric([bucket], stats.verify_steps)
        accepted.add_metric([bucket], stats.accepted_tokens)
    yield steps
    yield accepted
