"""Fixtures: a tiny model with two adapters, and the real runtime app on a real port.

The server is the production app (``build_app``) on aiohttp's ``TestServer`` (a real
listening socket): requests go over real HTTP, through the real engine thread, model
runner and adapter manager. Nothing is mocked.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.contract.config import RuntimeConfig, SpecAlgorithm
from loraserve.runtime.dev.devmodels import DemoAssets, build_adapter, ensure_demo_assets
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.server import STATE, build_app, wait_until_ready

ADMIN_TOKEN = "test-admin-token-0123456789"


@dataclass
class Assets:
    demo: DemoAssets
    extra_adapters: dict[str, Path]  # more adapters for load/unload tests

    @property
    def model_dir(self) -> Path:
        return self.demo.model_dir


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Assets:
    root = tmp_path_factory.mktemp("runtime-server-assets")
    demo = ensure_demo_assets(root)
    extra = {}
    for i, modules in enumerate([("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), ("o_proj",)]):
        extra[f"extra-{i}"] = build_adapter(
            root / f"extra-{i}", demo.model_dir, rank=4 + 2 * i, target_modules=modules, seed=100 + i
        )
    return Assets(demo=demo, extra_adapters=extra)


def make_config(assets: Assets, **overrides) -> RuntimeConfig:
    cfg = RuntimeConfig()
    cfg.model.path = str(assets.model_dir)
    cfg.model.served_name = "tiny-base"
    cfg.device = "cpu"
    cfg.scheduler.max_total_tokens = overrides.pop("max_total_tokens", 8192)
    cfg.scheduler.max_running_requests = overrides.pop("max_running_requests", 16)
    cfg.scheduler.chunked_prefill_size = overrides.pop("chunked_prefill_size", 256)
    cfg.lora.max_loras_per_batch = overrides.pop("max_loras_per_batch", 3)
    cfg.lora.max_loaded_loras = overrides.pop("max_loaded_loras", 8)
    cfg.lora.max_rank = 16
    cfg.lora.adapters = overrides.pop("adapters", {k: str(v) for k, v in assets.demo.adapters.items()})
    cfg.server.admin_token = overrides.pop("admin_token", ADMIN_TOKEN)
    cfg.server.max_body_bytes = overrides.pop("max_body_bytes", 64 * 1024)
    if overrides:
        raise TypeError(f"unknown overrides {sorted(overrides)}")
    return cfg


def draft_pool_config(assets: Assets, algorithm: SpecAlgorithm, draft_path: Path | str) -> RuntimeConfig:
    """A serve without adapters that speculates with ``algorithm`` (3 steps, 4 draft tokens)
    over the draft at ``draft_path``, with a pool of 2 draft adapters of rank up to 16."""
    cfg = make_config(assets, adapters={})
    cfg.speculative.algorithm = algorithm
    cfg.speculative.draft_model_path = str(draft_path)
    cfg.speculative.num_steps = 3
    cfg.speculative.num_draft_tokens = 4
    cfg.speculative.draft_max_loras = 2
    cfg.speculative.draft_max_lora_rank = 16
    return cfg


@dataclass
class Server:
    """A running runtime app and a client session pointed at it."""

    app: web.Application
    server: TestServer
    session: aiohttp.ClientSession
    config: RuntimeConfig

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def engine(self):
        return self.app[STATE].engine

    @property
    def state(self):
        return self.app[STATE]

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def post(self, path: str, body=None, **kwargs) -> tuple[int, dict]:
        async with self.session.post(self.url + path, json=body, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)

    async def get(self, path: str, **kwargs) -> tuple[int, object]:
        async with self.session.get(self.url + path, **kwargs) as resp:
            if resp.content_type == "application/json":
                return resp.status, await resp.json()
            return resp.status, await resp.text()


@contextlib.asynccontextmanager
async def running_server(config: RuntimeConfig, tmp_path: Path, **app_kwargs) -> AsyncIterator[Server]:
    """Start the app (model loaded in the background as in production) and wait for ready."""
    sources = SourceSettings(
        cache_dir=tmp_path / "adapter-cache", pvc_root=tmp_path / "pvc", env=app_kwargs.pop("env", {})
    )
    app = build_app(
        config,
        lambda metrics: build_engine(config, observer=metrics),
        sources=sources,
        drain_timeout_s=5.0,
        **app_kwargs,
    )
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    session = aiohttp.ClientSession()
    try:
        await wait_until_ready(app)
        yield Server(app=app, server=server, session=session, config=config)
    finally:
        await session.close()
        await server.close()


async def greedy_completion(server: Server, model: str, prompt: str, max_tokens: int) -> dict:
    """``model``'s greedy completion of ``prompt``, ``max_tokens`` long (EOS ignored); it must answer 200."""
    status, body = await server.post(
        "/v1/completions",
        {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert status == 200, body
    return body


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(assets, tmp_path_factory) -> AsyncIterator[Server]:
    """One server per test module (loading the model once keeps the suite fast)."""
    async with running_server(make_config(assets), tmp_path_factory.mktemp("server")) as srv:
        yield srv
