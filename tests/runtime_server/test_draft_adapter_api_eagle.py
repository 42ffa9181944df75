"""Head draft adapters through the admin API, on a real server with an EAGLE serve.

The serve starts (its start-up runs the compatibility policy, which admits a draft adapter
pool for an EAGLE head); an Adapter loaded with a ``draft`` in the head's PEFT layout loads
into the head's own pool, its requests answer exactly as without speculation, and it leaves
with its Adapter; a draft adapter on the head's shared lm_head refuses the whole load,
naming ``draft`` and the reason.
"""

from __future__ import annotations

import json

from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.speculative.eagle.builder import build_eagle_draft, build_eagle_draft_adapter

from .conftest import draft_pool_config, greedy_completion, make_config, running_server

PROMPT = "def total(items):\n    return sum(item.price for item in"


async def test_eagle_draft_adapter_lifecycle(assets, tmp_path):
    """An EAGLE heads draft adapter loads serves and unloads."""
    name, path = next(iter(assets.demo.adapters.items()))
    head = build_eagle_draft(tmp_path / "head", assets.model_dir, version=1, seed=3, init_std=0.1)
    draft = build_eagle_draft_adapter(tmp_path / "head-adapter", head, rank=8, seed=4)
    async with running_server(make_config(assets, adapters={name: str(path)}), tmp_path / "plain") as plain:
        expected = (await greedy_completion(plain, name, PROMPT, 16))["choices"][0]["text"]
    config = draft_pool_config(assets, SpecAlgorithm.EAGLE, head)
    async with running_server(config, tmp_path / "spec") as server:
        assert server.engine.list_draft_adapters() == []  # the target's adapters never reach the head
        status, body = await server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "draft": {"lora_path": str(draft)}},
            headers=server.admin_headers(),
        )
        assert status == 200, body
        assert body["draft"]["loaded"] is True
        (info,) = server.engine.list_draft_adapters()
        assert info.name.partition("@")[0] == name and "fc" in info.target_modules  # under its version's key
        answer = await greedy_completion(server, name, PROMPT, 16)
        assert answer["choices"][0]["text"] == expected
        assert answer["usage"]["speculative"]["draft_tokens"] > 0
        status, _ = await server.post(
            "/v1/unload_lora_adapter", {"lora_name": name}, headers=server.admin_headers()
        )
        assert status == 200
        assert server.engine.list_draft_adapters() == []


async def test_shared_lm_head_adapter_refused(assets, tmp_path):
    """A head adapter on the shared lm head refuses the whole load."""
    name, path = next(iter(assets.demo.adapters.items()))
    head = build_eagle_draft(tmp_path / "head", assets.model_dir, version=1, seed=3)
    bad = build_eagle_draft_adapter(tmp_path / "bad", head, rank=4, target_modules=("q_proj",))
    raw = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**raw, "target_modules": ["q_proj", "lm_head"]}))
    config = draft_pool_config(assets, SpecAlgorithm.EAGLE, head)
    async with running_server(config, tmp_path / "spec") as server:
        status, body = await server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "draft": {"lora_path": str(bad)}},
            headers=server.admin_headers(),
        )
        assert status == 400, body
        assert body["error"]["param"].startswith("draft")
        assert "shares the target's base lm_head" in body["error"]["message"]
        assert name not in server.engine.adapter_names and server.engine.list_draft_adapters() == []
