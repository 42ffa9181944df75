"""Rank 0 serves the OpenAI API over a 2-rank target, exactly as the runtime assembles it.

The production app (``build_app``) on a real socket, its engine built on
``build_target_runner`` (the launcher's one call for the entry point): completions for
the base model and adapters, an adapter loaded over the admin API while serving, all
answering what a one-device server answers.
"""

from __future__ import annotations

import aiohttp
from aiohttp.test_utils import TestServer

from loraserve.runtime.engine import Engine
from loraserve.runtime.executor.launch import build_target_runner, shutdown_tensor_parallel
from loraserve.runtime.lora.sources import SourceSettings
from loraserve.runtime.server import build_app, wait_until_ready
from loraserve.runtime.speculative import build_decoder
from loraserve.runtime.tokenizer import Tokenizer

from .conftest import TEST_OPTIONS, tp_config

TOKEN = "tp-admin-token-0123456789"
PROMPTS = ["def read_config(path):", "import os\nimport sys\n", "class Parser:"]


async def _serve_and_ask(config, tmp_path, late_adapter) -> dict:
    def factory(metrics):
        runner = build_target_runner(config, options=TEST_OPTIONS, exit_on_failure=False)
        tokenizer = Tokenizer.load(config.model.path)
        return Engine(config, runner, tokenizer=tokenizer, observer=metrics, decoder_factory=build_decoder), tokenizer

    app = build_app(config, factory, sources=SourceSettings(cache_dir=tmp_path / "cache", pvc_root=tmp_path))
    server = TestServer(app)
    await server.start_server()
    answers = {}
    try:
        async with aiohttp.ClientSession() as session:
            await wait_until_ready(app)
            url = str(server.make_url("")).rstrip("/")
            async with session.post(
                url + "/v1/load_lora_adapter",
                json={"lora_name": "late-r4", "lora_path": str(late_adapter)},
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as resp:
                assert resp.status == 200, await resp.text()
            for model in ("base", "all-r16", "emb-head", "late-r4"):
                for prompt in PROMPTS:
                    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        answers[model, prompt] = (await resp.json())["choices"][0]["text"]
            async with session.get(url + "/ready") as resp:
                assert resp.status == 200
    finally:
        await server.close()
        shutdown_tensor_parallel()
    return answers


async def test_two_rank_server_answers_like_one_device(tp_assets, tmp_path):
    adapters = {n: tp_assets.adapters[n] for n in ("all-r16", "emb-head")}
    answers = {}
    for tp in (2, 1):
        config = tp_config(tp_assets.gqa, tp, adapters)
        config.model.served_name = "base"
        config.server.admin_token = TOKEN
        answers[tp] = await _serve_and_ask(config, tmp_path / str(tp), tp_assets.adapters["late-r4"])
    assert answers[2] == answers[1]
    for adapter in ("all-r16", "emb-head", "late-r4"):  # the adapters really act on two ranks
        assert any(answers[2][adapter, p] != answers[2]["base", p] for p in PROMPTS), adapter
