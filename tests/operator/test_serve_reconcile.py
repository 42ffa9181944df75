"""One LoRAServe reconcile pass against an API stand-in: creates, converges, retries 409s.

There is no Kubernetes API server on these machines: kmock's KubernetesEmulator stands in
for it, with the uid / generation / resourceVersion / 409 bookkeeping of
``tests/e2e/apiserver.py``. It validates no schema and runs no controllers.
"""

from __future__ import annotations

import base64
import json

import pytest

from loraserve.operator import desired as ds
from loraserve.operator import diff
from loraserve.operator.reconcile.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    LORASERVES,
    SECRETS,
    KubeError,
    retry_on_conflict,
)
from loraserve.operator.reconcile.serve import reconcile_serve

from .api_standin import LORASERVE_API, NAME, NS, SETTINGS, api_client, reconcile_pass, serve_body, writes


@pytest.fixture
async def api():
    async with api_client(LORASERVE_API) as api:
        yield api


async def test_second_pass_writes_nothing(api) -> None:
    """First pass creates everything and the second writes nothing."""
    server, client = api
    await client.create(LORASERVES, NS, serve_body())
    outcome = await reconcile_pass(client)
    assert {(a.verb, a.kind) for a in outcome.acts} == {
        ("Created", "Secret"),
        ("Created", "Deployment"),
        ("Created", "Service"),
        ("Created", "PodDisruptionBudget"),
        ("Created", "ConfigMap"),
    }
    assert outcome.status_written and outcome.status["phase"] == "Progressing"
    serve = await client.get(LORASERVES, NS, NAME)
    assert serve["status"]["observedGeneration"] == serve["metadata"]["generation"] == 1
    secret = await client.get(SECRETS, NS, f"{NAME}-admin-token")
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) >= 32

    since = len(list(server))
    again = await reconcile_pass(client)
    assert again.acts == [] and not again.status_written
    assert writes(server, since) == [], "a converged serve gets no write"

    # A spec change updates the Deployment, rolls by the config hash, keeps the token.
    await client.patch(LORASERVES, NS, NAME, {"spec": {"lora": {"maxRank": 32}}})
    changed = await reconcile_pass(client)
    assert [(a.verb, a.kind) for a in changed.acts] == [("Updated", "Deployment")]
    assert changed.rolled_from is not None and changed.rolled_from != changed.config_hash
    assert base64.b64decode((await client.get(SECRETS, NS, f"{NAME}-admin-token"))["data"]["token"]) == token
    assert (await client.get(LORASERVES, NS, NAME))["status"]["observedGeneration"] == 2


def _adapter_spec(source: str, **extra) -> dict:
    return {"serve": NAME, "source": source, **extra}


async def test_catalog_follows_without_rolling(api) -> None:
    """The catalog ConfigMap lists the serve's usable Adapters; changing it never changes
    the pod template (running pods get the catalog pushed instead of restarting)."""
    _, client = api
    await client.create(
        LORASERVES,
        NS,
        serve_body(
            storage={
                "models": {"type": "PersistentVolumeClaim", "claimName": "models"},
                "adapters": {"type": "PersistentVolumeClaim", "claimName": "adapters"},
            }
        ),
    )
    catalog = [
        ("sql", _adapter_spec("pvc://adapters/sql-r16", rank=16, sha256="ab" * 32, pinned=True)),
        ("hub", _adapter_spec("hf://org/adapter@v1")),
        ("unmounted", _adapter_spec("pvc://elsewhere/x")),  # the Adapter's own status says why
        ("broken", {"serve": NAME}),  # no source: not in the catalog
    ]
    body = await client.get(LORASERVES, NS, NAME)
    outcome = await reconcile_serve(client, body, SETTINGS, adapters=4, now="t", catalog=catalog)
    assert [e.name for e in outcome.catalog] == ["hub", "sql"]
    cm = await client.get(CONFIGMAPS, NS, ds.catalog_configmap_name(NAME))
    listed = json.loads(cm["data"]["catalog.json"])["adapters"]
    assert listed == [
        {"name": "hub", "pinned": False, "source": "hf://org/adapter@v1"},
        {"name": "sql", "pinned": True, "rank": 16, "sha256": "ab" * 32, "source": "/adapters/sql-r16"},
    ]
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "LoRAServe"
    template = (await client.get(DEPLOYMENTS, NS, NAME))["spec"]["template"]
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "catalog")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    container = template["spec"]["containers"][0]
    assert (
        container["args"][container["args"].index("--adapter-catalog") + 1]
        == "/etc/loraserve/catalog/catalog.json"
    )

    body = await client.get(LORASERVES, NS, NAME)
    changed = await reconcile_serve(client, body, SETTINGS, adapters=1, now="t", catalog=catalog[:1])
    assert [(a.verb, a.kind) for a in changed.acts] == [("Updated", "ConfigMap")], "no Deployment write"
    cm = await client.get(CONFIGMAPS, NS, ds.catalog_configmap_name(NAME))
    assert [a["name"] for a in json.loads(cm["data"]["catalog.json"])["adapters"]] == ["sql"]
    assert (await client.get(DEPLOYMENTS, NS, NAME))["spec"]["template"] == template
    again = await reconcile_serve(
        client, await client.get(LORASERVES, NS, NAME), SETTINGS, adapters=1, now="t", catalog=catalog[:1]
    )
    assert again.acts == []


async def test_hand_edits_of_owned_fields_are_undone(api) -> None:
    _, client = api
    await client.create(LORASERVES, NS, serve_body())
    await reconcile_pass(client)
    deployment = await client.get(DEPLOYMENTS, NS, NAME)
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    hacked = [{"op": "replace", "path": "/spec/template/spec/containers/0/image", "value": "evil:1"}]
    await client.patch(DEPLOYMENTS, NS, NAME, hacked, content_type="application/json-patch+json")
    outcome = await reconcile_pass(client)
    assert [(a.verb, a.kind) for a in outcome.acts] == [("Updated", "Deployment")]
    restored = await client.get(DEPLOYMENTS, NS, NAME)
    assert restored["spec"]["template"]["spec"]["containers"][0]["image"] == image


async def test_stale_writes_retried(api) -> None:
    """Stale writes get 409 and are retried after observing again."""
    _, client = api
    await client.create(LORASERVES, NS, serve_body())
    await reconcile_pass(client)
    stale = await client.get(DEPLOYMENTS, NS, NAME)
    await client.patch(DEPLOYMENTS, NS, NAME, {"metadata": {"labels": {"touched": "yes"}}})  # another writer

    want = stale | {"spec": {**stale["spec"], "replicas": 5}}
    with pytest.raises(KubeError) as info:
        await client.patch(DEPLOYMENTS, NS, NAME, diff.update_patch(stale, want, ("spec.replicas",)))
    assert info.value.conflict

    tries = []

    async def observe_then_write() -> dict:
        have = stale if not tries else await client.get(DEPLOYMENTS, NS, NAME)
        tries.append(have["metadata"]["resourceVersion"])
        return await client.patch(DEPLOYMENTS, NS, NAME, diff.update_patch(have, want, ("spec.replicas",)))

    result = await retry_on_conflict(observe_then_write, delay_s=0.01)
    assert len(tries) == 2 and result["spec"]["replicas"] == 5
    assert result["metadata"]["labels"]["touched"] == "yes", "the other writer's change survives"


async def test_incompatible_spec_creates_nothing(api) -> None:
    """Incompatible spec creates nothing and says why."""
    _, client = api
    await client.create(LORASERVES, NS, serve_body(lora={"maxLorasPerBatch": 16, "maxLoadedLoras": 8}))
    outcome = await reconcile_pass(client)
    assert outcome.acts == [] and await client.get(DEPLOYMENTS, NS, NAME) is None
    status = (await client.get(LORASERVES, NS, NAME))["status"]
    assert status["phase"] == "Failed"
    compatible = next(c for c in status["conditions"] if c["type"] == "Compatible")
    assert compatible["status"] == "False" and "spec.lora.maxLorasPerBatch" in compatible["message"]


async def test_missing_user_secret_blocks_with_a_fix(api) -> None:
    _, client = api
    await client.create(LORASERVES, NS, serve_body(adminTokenSecretName="mine"))
    outcome = await reconcile_pass(client)
    assert await client.get(DEPLOYMENTS, NS, NAME) is None
    assert any("Secret 'mine' not found" in r and "fix:" in r for r in outcome.rejected)
    await client.create(
        SECRETS,
        NS,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mine"}, "stringData": {"token": "t"}},
    )
    outcome = await reconcile_pass(client)
    assert ("Created", "Deployment") in {(a.verb, a.kind) for a in outcome.acts}
    assert await client.get(SECRETS, NS, f"{NAME}-admin-token") is None, (
        "no token is generated for a named Secret"
    )
