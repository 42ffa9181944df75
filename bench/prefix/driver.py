"""Runs sessions through a real engine and measures what a client sees."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from loraserve.runtime.engine import Engine, EngineObserver, Request
from loraserve.runtime.sampling import SamplingParams

from ..harness import percentile
from .workloads import Session


class HitCounter(EngineObserver):
    """Prefix-cache lookups the engine reports, summed."""

    def __init__(self) -> None:
        self.hit = 0
        self.query = 0

    def on_prefix_lookup(self, request, hit_tokens: int, query_tokens: int) -> None:
        self.hit += hit_tokens
        self.query += query_tokens


@dataclass
class RunResult:
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    hit_tokens: int = 0
    query_tokens: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    evicted_tokens: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def ttft_ms(self, q: float) -> float:
        return 1e3 * percentile(self.ttft_s, 100 * q) if self.ttft_s else 0.0


def run_sessions(engine: Engine, sessions: list[Session], output_tokens: int, tag: str, timeout_s: float = 1800) -> RunResult:
    """Every session sends its requests one after another (after its waits), all sessions
    at once. Output tok/s counts the whole run, waits included."""
    result = RunResult()
    lock = threading.Lock()
    done = threading.Event()
    errors: list[str] = []
    remaining = [len(s.parts) for s in sessions]
    live = [len(sessions)]

    def submit(i: int, turn: int, last: list[int]) -> None:
        session = sessions[i]
        rid = f"{tag}-{i}-{turn}"
        answer: list[int] = []
        first: list[float] = []

        def sink(out) -> None:
            with lock:
                if out.token_ids and not first:
                    first.append(time.monotonic())
                    result.ttft_s.append(first[0] - req.arrival_time)
                answer.extend(out.token_ids)
                if out.error is not None:
                    errors.append(f"{rid}: {out.error.message}")
                if not out.finished:
                    return
                result.outputs[rid] = list(answer)
                result.output_tokens += len(answer)
                remaining[i] -= 1
            if remaining[i] > 0 and out.error is None:
                later(i, turn + 1, answer)
                return
            with lock:
                live[0] -= 1
                if live[0] == 0:
                    done.set()

        params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
        req = Request(rid=rid, prompt_ids=session.prompt(turn, last), params=params, adapter=session.adapter, sink=sink)
        engine.submit(req)

    def later(i: int, turn: int, last: list[int]) -> None:
        """Send after the user's wait (at once without one); TTFT counts from the send."""
        wait = sessions[i].wait_before(turn)
        if wait <= 0:
            submit(i, turn, last)
            return
        timer = threading.Timer(wait, submit, args=(i, turn, last))
        timer.daemon = True
        timer.start()

    start = time.perf_counter()
    for i in range(len(sessions)):
        later(i, 0, [])
    if not done.wait(timeout_s):
        raise RuntimeError(f"{tag}: timed out")
    result.seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{tag}: {errors[:3]}")
    return result
