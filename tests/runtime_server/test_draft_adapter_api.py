"""Draft adapters through the admin API and the catalog, on a real server.

A STANDALONE serve whose draft is a copy of the target, with a draft pool: an Adapter
loaded with ``draft`` (its own LoRA as draft adapter) drafts with it (every greedy draft
accepted), answers exactly as without speculation, and leaves with it; a bad draft adapter
refuses the whole load naming ``draft`` and leaves nothing loaded; a catalogued Adapter
with a ``draft_source`` loads both on its first request.
"""

from __future__ import annotations

from loraserve.runtime.contract.config import SpecAlgorithm
from loraserve.runtime.dev.devmodels import copy_model

from .conftest import draft_pool_config, greedy_completion, make_config, running_server

PROMPT = "def total(items):\n    return sum(item.price for item in"


def _spec_config(assets, tmp_path):
    """A STANDALONE serve whose draft is a copy of the target."""
    draft = copy_model(assets.model_dir, tmp_path / "draft")
    return draft_pool_config(assets, SpecAlgorithm.STANDALONE, draft)


async def test_draft_adapter_lifecycle(assets, tmp_path):
    """An adapter with its draft adapter loads serves and unloads."""
    name, path = next(iter(assets.demo.adapters.items()))
    async with running_server(make_config(assets, adapters={name: str(path)}), tmp_path / "plain") as plain:
        expected = (await greedy_completion(plain, name, PROMPT, 24))["choices"][0]["text"]
    async with running_server(_spec_config(assets, tmp_path), tmp_path / "spec") as server:
        status, body = await server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "draft": {"lora_path": str(path)}},
            headers=server.admin_headers(),
        )
        assert status == 200, body
        assert body["draft"] == {"lora_path": str(path), "sha256": None, "loaded": True}
        answer = await greedy_completion(server, name, PROMPT, 24)
        assert answer["choices"][0]["text"] == expected
        stats = answer["usage"]["speculative"]
        assert stats["accepted_tokens"] == stats["draft_tokens"] > 0  # the draft is the adapted target
        # The same load again is idempotent; without the draft it is a conflict.
        status, _ = await server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "draft": {"lora_path": str(path)}},
            headers=server.admin_headers(),
        )
        assert status == 200
        status, body = await server.post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, headers=server.admin_headers()
        )
        assert status == 409 and "draft adapter" in body["error"]["message"]
        status, _ = await server.post(
            "/v1/unload_lora_adapter", {"lora_name": name}, headers=server.admin_headers()
        )
        assert status == 200
        assert server.engine.list_draft_adapters() == []


async def test_bad_draft_refuses_load(assets, tmp_path):
    """A bad draft adapter refuses the whole load."""
    name, path = next(iter(assets.demo.adapters.items()))
    async with running_server(_spec_config(assets, tmp_path), tmp_path / "spec") as server:
        status, body = await server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "draft": {"lora_path": str(tmp_path / "missing")}},
            headers=server.admin_headers(),
        )
        assert status == 400, body
        assert body["error"]["param"].startswith("draft") and "draft adapter" in body["error"]["message"]
        assert name not in server.engine.adapter_names and server.engine.list_draft_adapters() == []
        status, body = await server.post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": str(path), "draft": "nope"},
            headers=server.admin_headers(),
        )
        assert status == 400 and body["error"]["param"] == "draft"


async def test_catalogued_draft_loads_on_request(assets, tmp_path):
    """A catalogued draft adapter loads on the first request."""
    name, path = next(iter(assets.demo.adapters.items()))
    async with running_server(_spec_config(assets, tmp_path), tmp_path / "spec") as server:
        catalog = {"adapters": [{"name": name, "source": str(path), "draft_source": str(path)}]}
        async with server.session.put(
            server.url + "/v1/lora_catalog", json=catalog, headers=server.admin_headers()
        ) as resp:
            assert resp.status == 200, await resp.text()
        _, listing = await server.get("/v1/lora_catalog", headers=server.admin_headers())
        assert listing["adapters"][0]["draft_state"] == "absent"
        stats = (await greedy_completion(server, name, PROMPT, 24))["usage"]["speculative"]
        assert stats["accepted_tokens"] == stats["draft_tokens"] > 0
        _, listing = await server.get("/v1/lora_catalog", headers=server.admin_headers())
        assert listing["adapters"][0]["state"] == "loaded" and listing["adapters"][0]["draft_state"] == "loaded"
        # A changed draft source reloads the adapter: the new catalog decides.
        catalog["adapters"][0]["draft_source"] = str(tmp_path / "elsewhere")
        async with server.session.put(
            server.url + "/v1/lora_catalog", json=catalog, headers=server.admin_headers()
        ) as resp:
            assert resp.status == 200
        assert name not in server.engine.adapter_names and server.engine.list_draft_adapters() == []
