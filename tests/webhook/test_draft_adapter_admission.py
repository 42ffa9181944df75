"""Draft adapters at admission, over real HTTPS with kopf's indexes fed by a watch.

An Adapter's ``spec.draft`` is judged by the compatibility policy against the serve the
index holds (algorithm, draft pool, rank, modules), its source as ``spec.source`` is
(claims, volumes, hosts, pinned revisions); a serve change that would strand Adapters'
draft adapters is refused naming them. See conftest.py for the stack.
"""

from __future__ import annotations

import pytest

from loraserve.operator.specs import API_VERSION

pytestmark = pytest.mark.asyncio(loop_scope="module")

PINNED = "0123456789abcdef0123456789abcdef01234567"


def serve(name: str, namespace: str, algorithm: str = "STANDALONE", *, pool: int = 4, **spec) -> dict:
    speculative = {"algorithm": algorithm, "draftLora": {"maxLoras": pool, "maxRank": 16}}
    if algorithm in ("STANDALONE", "EAGLE", "EAGLE3", "DFLASH"):
        speculative["draftModel"] = {"source": "/models/draft"}
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRAServe",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": "/models/llama"}, "speculative": speculative, **spec},
    }


def adapter(name: str, namespace: str, serve_name: str, **draft) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "Adapter",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "serve": serve_name,
            "source": f"hf://acme/{name}@{PINNED}",
            "draft": {"source": f"hf://acme/{name}-draft@{PINNED}", **draft},
        },
    }


async def test_standalone_pool_draft_admitted(lab):
    """A draft adapter for a standalone pool is admitted."""
    ns = "draft-ok"
    assert (await lab.apply(serve("s", ns))).allowed
    applied = await lab.apply(adapter("sql", ns, "s", rank=16, targetModules=["q_proj", "v_proj"]))
    assert applied.allowed, applied.validation.message
    assert applied.warnings == []
    stored = await lab.get("Adapter", "sql", ns)
    assert stored["spec"]["draft"]["rank"] == 16


async def test_ngram_refuses_draft_adapter(lab):
    """N-gram refuses a draft adapter with the reason."""
    ns = "draft-ngram"
    created = await lab.apply(serve("s", ns, "NGRAM", pool=0))
    assert created.allowed
    refused = await lab.apply(adapter("sql", ns, "s"))
    assert not refused.allowed and refused.validation.code == 422
    assert refused.validation.message.startswith(
        "spec.draft: NGRAM drafts from the prompt: there is no draft model to adapt; fix: remove spec.draft"
    )
    assert await lab.get("Adapter", "sql", ns) is None


async def test_eagle3_head_takes_draft_adapter(lab):
    """An EAGLE3 head takes a draft adapter on its own layers."""
    ns = "draft-eagle"
    assert (await lab.apply(serve("s", ns, "EAGLE3"))).allowed
    applied = await lab.apply(adapter("sql", ns, "s", rank=8, targetModules=["q_proj", "down_proj", "fc"]))
    assert applied.allowed, applied.validation.message
    refused = await lab.apply(adapter("emb", ns, "s", targetModules=["fc", "lm_head"]))
    assert not refused.allowed
    assert refused.validation.message.startswith(
        "spec.draft.targetModules: targets lm_head, which an EAGLE3 head's draft adapter pool does not wrap"
    )


async def test_dflash_takes_no_draft_adapter(lab):
    """A DFlash draft takes no draft adapter in this version."""
    ns = "draft-dflash"
    assert (await lab.apply(serve("s", ns, "DFLASH", pool=0))).allowed
    refused = await lab.apply(adapter("sql", ns, "s"))
    assert not refused.allowed
    assert "spec.draft: not available in this runtime:" in refused.validation.message
    assert "draft adapters serve STANDALONE drafts and EAGLE / EAGLE3 heads" in refused.validation.message


async def test_no_draft_pool_names_fix(lab):
    """A serve without a draft pool names the fix."""
    ns = "draft-nopool"
    assert (await lab.apply(serve("s", ns, pool=0))).allowed
    refused = await lab.apply(adapter("sql", ns, "s"))
    assert not refused.allowed
    assert (
        "fix: set LoRAServe 's' spec.speculative.draftLora.maxLoras to 1 or more"
        in refused.validation.message
    )


async def test_rank_and_modules_judged_by_pool(lab):
    """Rank and modules are judged against the draft pool all at once."""
    ns = "draft-fit"
    assert (await lab.apply(serve("s", ns))).allowed
    refused = await lab.apply(adapter("big", ns, "s", rank=32, targetModules=["q_proj", "lm_head"]))
    assert not refused.allowed
    message = refused.validation.message
    assert message.startswith("2 problems:")
    assert (
        "spec.draft.rank: draft rank 32 exceeds LoRAServe 's' spec.speculative.draftLora.maxRank (16)"
        in message
    )
    assert "spec.draft.targetModules: targets lm_head, which the draft adapter pool does not wrap" in message


async def test_draft_source_follows_rules(lab):
    """The draft source follows the source rules."""
    ns = "draft-source"
    pvc = {"adapters": {"type": "PersistentVolumeClaim", "claimName": "lora"}}
    assert (await lab.apply(serve("s", ns, storage=pvc))).allowed
    unmounted = await lab.apply(adapter("x", ns, "s", source="pvc://other/x-draft"))
    assert not unmounted.allowed
    assert "spec.draft.source: claim 'other' is not mounted by LoRAServe 's'" in unmounted.validation.message
    floating = await lab.apply(adapter("y", ns, "s", source="hf://acme/y-draft"))
    assert floating.allowed
    assert any(
        w.startswith("spec.draft.source: hf://acme/y-draft names no revision") for w in floating.warnings
    )
    mounted = await lab.apply(adapter("z", ns, "s", source="pvc://lora/z/draft"))
    assert mounted.allowed, mounted.validation.message


async def test_removing_used_pool_refused(lab):
    """Removing the pool under draft adapters is refused naming them."""
    ns = "draft-strand"
    assert (await lab.apply(serve("s", ns))).allowed
    assert (await lab.apply(adapter("sql", ns, "s"))).allowed
    lowered = await lab.apply(serve("s", ns, pool=0))
    assert not lowered.allowed
    assert (
        "existing Adapter 'sql' spec.draft: the serve has no draft adapter pool" in lowered.validation.message
    )
    ngram = await lab.apply(serve("s", ns, "NGRAM", pool=0))
    assert not ngram.allowed and "NGRAM drafts from the prompt" in ngram.validation.message
    await lab.delete(adapter("sql", ns, "s"))
    assert (await lab.apply(serve("s", ns, pool=0))).allowed


async def test_pool_judged_with_algorithm(lab):
    """The serves pool is judged with its algorithm."""
    ns = "draft-pool"
    eagle = await lab.apply(serve("e", ns, "EAGLE", pool=2))
    assert eagle.allowed, eagle.validation.message  # a pool over the head's own layers
    dflash = await lab.apply(serve("d", ns, "DFLASH", pool=2))
    assert not dflash.allowed
    assert dflash.validation.message.startswith(
        "spec.speculative.draftLora.maxLoras: not available in this runtime: a draft adapter pool for the DFLASH draft"
    )
    ngram = await lab.apply(serve("n", ns, "NGRAM", pool=2))
    assert ngram.allowed
    assert any(
        w.startswith("spec.speculative.draftLora.maxLoras: NGRAM drafts from the prompt")
        for w in ngram.warnings
    )
