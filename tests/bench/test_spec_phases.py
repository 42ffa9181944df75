"""``bench/speculative --phases``: the recorder that times a decoder's calls by wrapping bound
methods, and the per-step summary of what it recorded (host times, CUDA-event spans and
the gaps between them), on stand-ins for the decoder and for CUDA events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.speculative.phases.recorder import PhaseRecorder, Span
from bench.speculative.phases.report import phases_markdown
from bench.speculative.phases.summary import summarize_phases
from loraserve.kernels import ForwardMode


class FakeEvent:
    """A CUDA event stand-in at a given GPU time (ms)."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.ms - self.ms


def _span(name, t0, t1, g0, g1, children=(), tokens=0):
    """Host times in ms (stored in seconds, as perf_counter gives them), GPU times in ms."""
    return Span(name, FakeEvent(g0), FakeEvent(g1), t0 / 1e3, t1 / 1e3, list(children), tokens)


def _step(at: float, verify_ms: float):
    """A step at host time ``at``: propose (one nested draft call), verify, 1 ms of host
    work untimed at the end; on the GPU, everything 0.5 ms behind the host."""
    g = at + 0.5
    propose = _span("drafter.propose", at + 0.1, at + 1.1, g + 0.1, g + 1.2,
                    [_span("draft.draft_chain", at + 0.3, at + 0.9, g + 0.3, g + 1.1)])  # fmt: skip
    verify = _span("target.forward[TARGET_VERIFY]", at + 1.2, at + 1.2 + verify_ms, g + 1.2,
                   g + 1.2 + verify_ms)  # fmt: skip
    end = at + 1.2 + verify_ms + 1.0
    return _span("decoder.step", at, end, g, end + 0.5, [propose, verify], tokens=3)


def test_summary_rows_gaps_and_totals():
    steps = [_step(20.0 * i, verify_ms=8.0 + (i % 2)) for i in range(7)]
    s = summarize_phases(steps, [], skip=3)
    assert (s["steps"], s["skipped"], s["tokens_per_step"]) == (4, 3, 3.0)
    labels = [(r["depth"], r["label"]) for r in s["rows"]]
    assert labels == [
        (1, "(gap) start → drafter.propose"),
        (1, "drafter.propose"),
        (2, "(gap) start → draft.draft_chain"),
        (2, "draft.draft_chain"),
        (2, "(gap) draft.draft_chain → end"),
        (1, "(gap) drafter.propose → target.forward[TARGET_VERIFY]"),
        (1, "target.forward[TARGET_VERIFY]"),
        (1, "(gap) target.forward[TARGET_VERIFY] → end"),
    ]
    rows = {r["phase"]: r for r in s["rows"]}
    verify = rows["target.forward[TARGET_VERIFY]"]
    assert verify["calls"] == 1 and verify["host_ms"] == pytest.approx([8.5, 8.5])
    assert verify["gpu_ms"] == pytest.approx([8.5, 8.5])
    nested = rows["drafter.propose / draft.draft_chain"]
    assert nested["host_ms"] == pytest.approx([0.6, 0.6]) and nested["gpu_ms"] == pytest.approx([0.8, 0.8])
    tail = rows["(gap) target.forward[TARGET_VERIFY] → end"]
    assert tail["host_ms"] == pytest.approx([1.0, 1.0]) and tail["gpu_ms"] == pytest.approx([1.0, 1.0])
    # the top-level rows add up to the step, on the host and on the GPU
    top = [r for r in s["rows"] if r["depth"] == 1]
    assert sum(r["host_ms"][0] for r in top) == pytest.approx(s["step_host_ms"][0])
    assert sum(r["gpu_ms"][0] for r in top) == pytest.approx(s["step_gpu_ms"][0])
    # steps start every 20 ms and last 10.2 / 11.2 ms on the host
    assert s["between_host_ms"] == pytest.approx([(8.8 + 9.8 + 8.8) / 3, 8.8], abs=1e-3)
    assert s["between_gpu_ms"] == pytest.approx([(8.8 + 9.8 + 8.8) / 3, 8.8], abs=1e-3)


def test_summary_without_events_and_with_an_extend_between_steps():
    steps = [_step(20.0 * i, verify_ms=8.0) for i in range(4)]
    for span in steps:  # the CPU: no events anywhere
        stack = [span]
        while stack:
            node = stack.pop()
            node.start = node.end = None
            stack += node.children
    extend = (0.045, 0.050)  # host seconds: between steps 2 and 3
    s = summarize_phases(steps, [extend], skip=0)
    assert s["step_gpu_ms"] is None and all(r["gpu_ms"] is None for r in s["rows"])
    assert s["between_host_ms"] == pytest.approx([9.8, 9.8])  # 2 of the 3 gaps
    assert s["between_gpu_ms"] is None
    # fewer steps than the warm-up: all of them count
    assert summarize_phases(steps[:2], [], skip=3)["steps"] == 2
    text = phases_markdown(
        "eagle", {"spec": {**s, "generated": 12, "seconds": 0.1, "graphs_captured": 0}},
        {"device": "cpu", "prompt_tokens": 32, "adapter": None, "new_tokens": 12, "overhead_us": 1.0},
    )  # fmt: skip
    assert (
        "| · `draft.draft_chain` | 1 |" in text and "| **step** (`decoder.step`, start to end) | 1 |" in text
    )


class _Runner:
    def forward(self, batch):
        return batch.mode


class _DraftRunner:
    def compute_logits(self, hidden):
        return hidden

    def draft_chain(self, rids, first, hidden, steps):
        return [first] * steps


class _Acceptance:
    def host(self):
        return [1], [[5, 6]]

    def host_accept_lens(self):
        return self.host()[0]


class _Drafter:
    def __init__(self):
        self.runner = _DraftRunner()

    def propose(self, requests, n):
        return self.runner.draft_chain(None, self.runner.compute_logits(7), None, n - 1)

    def on_verify(self, requests, acceptance, output):
        acceptance.host_accept_lens()


class _Decoder:
    def __init__(self):
        self.runner = _Runner()
        self.drafter = _Drafter()

    def _accept(self):
        return _Acceptance()

    def step(self, requests):
        self.drafter.propose(requests, 3)
        self.runner.forward(SimpleNamespace(mode=ForwardMode.TARGET_VERIFY))
        acceptance = self._accept()
        acceptance.host()
        self.drafter.on_verify(requests, acceptance, None)
        return [SimpleNamespace(token_ids=[1, 2])]

    def extend(self, chunks):
        self.runner.forward(SimpleNamespace(mode=ForwardMode.EXTEND))
        return [None]


def test_recorder_wraps_instances_and_restores_them():
    decoder = _Decoder()
    recorder = PhaseRecorder(cuda=False)
    recorder.instrument(decoder)
    assert decoder.extend([]) == [None]  # outside a step: noted, not recorded
    outs = [decoder.step(["r"]) for _ in range(2)]
    recorder.restore()
    assert outs[0][0].token_ids == [1, 2]
    assert len(recorder.extends) == 1 and len(recorder.steps) == 2
    step = recorder.steps[0]
    assert step.tokens == 2 and step.start is None
    assert [c.name for c in step.children] == [
        "drafter.propose", "target.forward[TARGET_VERIFY]", "decoder._accept", "acceptance.host",
        "drafter.on_verify",
    ]  # fmt: skip
    assert [c.name for c in step.children[0].children] == ["draft.compute_logits", "draft.draft_chain"]
    assert [c.name for c in step.children[4].children] == ["acceptance.host"]
    assert all(c.t0 <= c.t1 for c in step.children)
    # every wrapper is gone: the instances use their classes' methods again
    for obj, attrs in (
        (decoder, ("step", "extend", "_accept")),
        (decoder.runner, ("forward",)),
        (decoder.drafter, ("propose", "on_verify")),
        (decoder.drafter.runner, ("compute_logits", "draft_chain")),
    ):
        assert not set(attrs) & set(vars(obj)), (obj, vars(obj))
    decoder.step(["r"])
    assert len(recorder.steps) == 2
    assert recorder.overhead_us(calls=20) >= 0.0 and not recorder._saved


def test_recorder_keeps_an_instance_attribute_that_was_there():
    decoder = _Decoder()
    own = decoder.step
    decoder.step = own  # already an instance attribute
    recorder = PhaseRecorder(cuda=False)
    recorder.instrument(decoder)
    assert decoder.step is not own
    recorder.restore()
    assert vars(decoder)["step"] is own
