"""Fixtures for the engine: a tiny model with adapters, real runners, a request collector."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.dev.devmodels import DemoAssets, build_adapter, ensure_demo_assets
from loraserve.runtime.engine import Engine, EngineObserver, Request, RequestOutput
from loraserve.runtime.sampling import SamplingParams
from loraserve.runtime.tokenizer import Tokenizer


@dataclass
class EngineAssets:
    demo: DemoAssets
    third_adapter: Path


@pytest.fixture(scope="session")
def engine_assets(tmp_path_factory) -> EngineAssets:
    root = tmp_path_factory.mktemp("runtime-engine-assets")
    demo = ensure_demo_assets(root)
    third = build_adapter(
        root / "third", demo.model_dir, rank=4, target_modules=("v_proj", "down_proj"), seed=33
    )
    return EngineAssets(demo=demo, third_adapter=third)


@pytest.fixture(scope="session")
def tokenizer(engine_assets) -> Tokenizer:
    return Tokenizer.load(engine_assets.demo.model_dir)


def engine_config(assets: EngineAssets, **kw) -> RuntimeConfig:
    cfg = RuntimeConfig()
    cfg.model.path = str(assets.demo.model_dir)
    cfg.device = "cpu"
    cfg.scheduler.max_total_tokens = kw.pop("max_total_tokens", 8192)
    cfg.scheduler.max_running_requests = kw.pop("max_running_requests", 16)
    cfg.scheduler.chunked_prefill_size = kw.pop("chunked_prefill_size", 512)
    cfg.scheduler.max_prefill_tokens = kw.pop("max_prefill_tokens", 8192)
    cfg.lora.max_loras_per_batch = kw.pop("max_loras_per_batch", 4)
    cfg.lora.max_rank = 16
    cfg.lora.adapters = {
        **{k: str(v) for k, v in assets.demo.adapters.items()},
        "third": str(assets.third_adapter),
    }
    if kw:
        raise TypeError(f"unknown settings {sorted(kw)}")
    return cfg


class StepRecorder(EngineObserver):
    """Records what the engine reports (an observer is a real extension point)."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int]] = []
        self.retractions = 0
        self.finished: list[Request] = []

    def on_step(self, kind, batch_size, num_tokens, seconds):
        self.steps.append((kind, batch_size))

    def on_retract(self, request):
        self.retractions += 1

    def on_request_finished(self, request):
        self.finished.append(request)


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: object | None = None
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list[RequestOutput] = field(default_factory=list)

    def sink(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        self.token_ids.extend(out.token_ids)
        self.text += out.text
        if out.finished:
            self.finish_reason = out.finish_reason.value if out.finish_reason else None
            self.error = out.error
            self.done.set()


_ids = iter(range(10**9))


def make_request(prompt_ids: list[int], adapter: str | None = None, **params) -> tuple[Request, Collected]:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    col = Collected()
    r = Request(
        rid=f"t{next(_ids)}",
        prompt_ids=list(prompt_ids),
        params=SamplingParams(**params),
        adapter=adapter,
        sink=col.sink,
    )
    return r, col


def wait_all(collected: list[Collected], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for c in collected:
        assert c.done.wait(max(deadline - time.monotonic(), 0.01)), "a request never finished"


@pytest.fixture
def start_engine():
    """Build and start engines; every one is shut down at the end of the test."""
    from loraserve.runtime.runner.model_runner import ModelRunner

    engines: list[Engine] = []

    def start(cfg: RuntimeConfig, tokenizer: Tokenizer | None = None, **kwargs) -> Engine:
        runner = ModelRunner(cfg)
        engine = Engine(cfg, runner, tokenizer=tokenizer, **kwargs)
        engine.start()
        engines.append(engine)
        return engine

    yield start
    for e in engines:
        e.shutdown(drain_timeout_s=2.0)
