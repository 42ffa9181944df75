"""The runtime admin client: what counts as the adapter's fault, reading /v1/models and the catalog."""

from __future__ import annotations

import socket

import aiohttp
import pytest

from loraserve.operator.runtime_client import (
    RuntimeCallError,
    RuntimeClient,
    classify_status,
    error_message,
    parse_catalog_listing,
    parse_models,
)


@pytest.mark.parametrize("status", [400, 404, 409, 413, 422])
def test_4xx_is_the_adapters_fault(status: int) -> None:
    assert classify_status(status) is False


@pytest.mark.parametrize("status", [401, 403, 408, 425, 429, 500, 502, 503, 504])
def test_5xx_throttling_and_auth_are_transient(status: int) -> None:
    assert classify_status(status) is True


def test_error_prefers_runtime_words() -> None:
    """Error message prefers the runtimes own words."""
    body = (
        '{"error": {"message": "adapter rank 32 exceeds max_lora_rank 16", "type": "invalid_request_error"}}'
    )
    assert error_message(400, body) == "adapter rank 32 exceeds max_lora_rank 16"
    assert error_message(502, "<html>bad gateway</html>") == "HTTP 502: <html>bad gateway</html>"
    assert error_message(503, "") == "HTTP 503"


def test_models_lists_adapters() -> None:
    """Models lists adapters with what the runtime read."""
    answer = {
        "object": "list",
        "data": [
            {"id": "llama", "object": "model", "root": "/models/llama", "parent": None},
            {
                "id": "sql",
                "object": "model",
                "root": "sql",
                "parent": "llama",
                "lora": {
                    "source": "/adapters/sql",
                    "rank": 8,
                    "target_modules": ["q_proj", "v_proj"],
                    "pinned": False,
                    "sha256": "ab" * 32,
                },
            },
            {"id": "bare", "object": "model", "parent": "llama"},
        ],
    }
    models = parse_models(answer)
    assert models.base == "llama"
    assert set(models.adapters) == {"sql", "bare"}
    sql = models.adapters["sql"]
    assert (sql.source, sql.rank, sql.target_modules, sql.sha256) == (
        "/adapters/sql",
        8,
        ("q_proj", "v_proj"),
        "ab" * 32,
    )
    assert models.adapters["bare"].rank is None
    # root is what any client sees (the name, for a path in the pod): never taken as the source.
    assert parse_models({"data": [{"id": "x", "root": "x", "parent": "llama"}]}).adapters["x"].source is None
    with pytest.raises(RuntimeCallError) as info:
        parse_models({"object": "list"})
    assert info.value.transient


async def test_silent_pod_is_transient() -> None:
    """A pod that does not listen is a transient failure."""
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        async with aiohttp.ClientSession() as http:
            client = RuntimeClient(http, f"http://127.0.0.1:{port}", "token", probe_timeout_s=2)
            with pytest.raises(RuntimeCallError) as info:
                await client.models()
    assert info.value.transient and info.value.status is None
    assert f"127.0.0.1:{port}" in str(info.value)


def test_catalog_listing_reads_versions() -> None:
    """Catalog listing reads versions and progress."""
    listing = parse_catalog_listing(
        {
            "digest": "d1",
            "ready": True,
            "confirmed": False,
            "adapters": [
                {
                    "name": "sql",
                    "source": "/adapters/sql-v2",
                    "sha256": "ab" * 32,
                    "state": "loading",
                    "version": "v2",
                    "serving_versions": ["v1", 7, "v0"],
                    "loading_for_s": 12.5,
                    "waiting_on": "the source's first byte",
                },
                {"name": "old", "state": "loaded", "loading_for_s": True, "version": 3},
            ],
        }
    )
    assert listing.confirmed is False and listing.digest == "d1"
    sql = listing.adapters["sql"]
    assert sql.identity() == ("/adapters/sql-v2", "ab" * 32, None, None)
    assert (sql.version, sql.serving_versions) == ("v2", ("v1", "v0"))
    assert (sql.loading_for_s, sql.waiting_on) == (12.5, "the source's first byte")
    # An older runtime's listing (or a wrong type): the new keys read as absent.
    old = listing.adapters["old"]
    assert (old.version, old.serving_versions, old.loading_for_s, old.waiting_on) == (None, (), None, None)
    assert parse_catalog_listing({"digest": "d", "ready": True}).confirmed is None
