"""An Adapter's version changes in place while its requests stream: no request fails, and
each one's output is exactly one version's (the one current when it arrived).

Real runtime app on a real port, real engine; the two versions are two different demo
adapters, so their greedy outputs differ and each stream can be attributed.
"""

from __future__ import annotations

import asyncio

import pytest

from loraserve.runtime.contract.catalog import CatalogEntry, encode_catalog

from .catalog_helpers import catalog_listing, engine_keys, put_catalog, stream, wait_for
from .conftest import make_config, running_server

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKENS = 48


async def test_version_change_under_streaming_load(assets, tmp_path):
    a, b = str(assets.demo.adapters["sql-r8"]), str(assets.demo.adapters["chat-r16"])
    old, new = CatalogEntry("x", a), CatalogEntry("x", b)
    config = make_config(assets, adapters={})
    catalog = tmp_path / "catalog.json"
    # "ref-a" / "ref-b": each version's weights served alone, under names of their own.
    catalog.write_text(encode_catalog([old, CatalogEntry("ref-a", a), CatalogEntry("ref-b", b)]))
    config.lora.catalog = str(catalog)
    async with running_server(config, tmp_path / "srv") as srv:
        ref_a, ref_b = (await stream(srv, "ref-a", TOKENS)).text, (await stream(srv, "ref-b", TOKENS)).text
        assert ref_a and ref_b and ref_a != ref_b, "the two versions must be told apart"
        assert (await stream(srv, "x", TOKENS)).text == ref_a

        pushed = asyncio.Event()
        results: list[tuple[bool, object]] = []  # (sent after the push answered, outcome)
        stop = asyncio.Event()

        async def client() -> None:
            after = 0
            while not stop.is_set():
                sent_after = pushed.is_set()
                results.append((sent_after, await stream(srv, "x", TOKENS)))
                after += sent_after
                if after >= 2:
                    return

        clients = [asyncio.create_task(client()) for _ in range(6)]
        await wait_for(
            lambda: srv.engine.snapshot.num_running >= 4 and len(results) >= 6, "streams in flight"
        )
        status, change = await put_catalog(srv, [new.to_dict(), {"name": "ref-a", "source": a}])
        assert status == 200 and change["changed"] == ["x"], change
        pushed.set()
        # The old version still finishes its streams beside the new one.
        listing = await catalog_listing(srv)
        assert listing["by_name"]["x"]["version"] == new.version
        assert old.version in listing["by_name"]["x"]["serving_versions"], listing["by_name"]["x"]
        # Metrics name the adapter as clients do, however many versions run.
        _, metrics = await srv.get("/metrics")
        assert 'running_lora_adapters="x"' in metrics and "x@" not in metrics
        await asyncio.wait_for(asyncio.gather(*clients), 300)

        failed = [r for _, r in results if r.status != 200 or r.error or r.tokens != TOKENS]
        assert failed == [], failed[:3]
        texts = [(after, r.text) for after, r in results]
        assert all(t in (ref_a, ref_b) for _, t in texts), "a stream mixed versions or changed weights"
        assert all(t == ref_b for after, t in texts if after), "sent after the push: the new version"
        assert any(t == ref_a for _, t in texts) and any(t == ref_b for _, t in texts)
        # The old version is freed once its last request ended.
        await wait_for(lambda: engine_keys(srv, "x") == {new.key}, "the old version freed")
        listing = await catalog_listing(srv)
        assert listing["by_name"]["x"]["serving_versions"] == [new.version]
        status, models = await srv.get("/v1/models")
        assert [m["id"] for m in models["data"]].count("x") == 1
        _, metrics = await srv.get("/metrics")
        assert (
            f'loraserve:requests_total{{finished_reason="length",model="x"}} {len(results) + 1}.0' in metrics
        )


async def test_full_cache_change_waits(assets, tmp_path):
    """With room for one adapter, the new version waits for the old one's last request
    (before: 503 ``adapter_capacity``), then serves; the old requests run to their end."""
    a, b = str(assets.demo.adapters["sql-r8"]), str(assets.demo.adapters["chat-r16"])
    config = make_config(assets, adapters={}, max_loaded_loras=1)
    catalog = tmp_path / "catalog.json"
    catalog.write_text(encode_catalog([CatalogEntry("x", a), CatalogEntry("ref-b", b)]))
    config.lora.catalog = str(catalog)
    async with running_server(config, tmp_path / "srv") as srv:
        ref_b = (await stream(srv, "ref-b", TOKENS)).text
        old = [asyncio.create_task(stream(srv, "x", 150)) for _ in range(2)]
        await wait_for(lambda: srv.engine.snapshot.num_running >= 2, "the old streams running")
        status, _ = await put_catalog(srv, [{"name": "x", "source": b}, {"name": "ref-b", "source": b}])
        assert status == 200
        got = await stream(srv, "x", TOKENS)
        assert got.status == 200 and got.text == ref_b, got
        assert all(r.status == 200 and r.tokens == 150 for r in await asyncio.gather(*old))
